"""Master weights that follow the parameters: torch steps a parameter from its current value,
so a parameter changed outside the optimizer (load_state_dict, an in-place edit, `.data`, an
EMA swap, a resume that loads the optimizer first: any route) must be stepped from that value,
not from the master the optimizer kept."""

from __future__ import annotations

import time

import torch

from tierlift.offload import d2h
from tierlift.offload.strided import logical_flats
from tierlift.offload.watch import fingerprints

_INTS = {4: torch.int32, 2: torch.int16}


def _same_bits(master: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Per element, on p's device: whether `p` is `master` rounded to p's dtype, bit for bit
    (NaN payloads and signed zeros included)."""
    ints = _INTS[p.element_size()]
    return master.to(device=p.device, dtype=p.dtype).view(ints) == p.detach().view(ints)


def refresh_master(master: torch.Tensor, p: torch.Tensor) -> None:
    """Sets each element of the fp32 `master` whose rounding is no longer the parameter's
    value from the parameter; the others keep their low bits (a bf16/fp16 parameter that only
    took optimizer steps, or a resume that loaded both). Branch-free: no host sync where the
    master and the parameter share a device. A host master of a GPU parameter (offload) takes
    the mask down to the host: torch.where refuses tensors of two devices."""
    same = _same_bits(master, p).to(master.device)
    master.copy_(torch.where(same, master, p.detach().to(device=master.device,
                                                         dtype=master.dtype)))


def prepare(off, gi: int, grads: dict, chunks, stats, rewritten: set | None = None,
            speculative: bool = False) -> dict:
    """Makes the committed master weights of `chunks` of Offloader `off` follow the parameters
    before they are stepped. On a parameter's first step its master is written from it. Later,
    only a parameter whose bytes differ from what the optimizer last wrote into it (ParamWatch)
    is compared with its master, element by element (refresh_master). The refreshed masters go
    to the committed generation, so a failure later in the step puts the parameter back to the
    value it had. Returns {(ci, pi): fingerprint} of the parameters as they were found (the overlap
    keeps them); `rewritten` receives the chunks whose committed master changed. Uses the last
    slot, which the step's early reads leave free.

    `speculative` (the overlap's worker): a parameter whose last written fingerprint is known is
    not read at all; its entry is that fingerprint, i.e. the step assumes the parameter is what
    the optimizer wrote, which its master is. step() compares the parameter with it before it
    publishes (publish() for fp32 host parameters, in the pass that overwrites them, validate()
    for the others) and steps the chunk again, refreshing the master, if it changed meanwhile.
    That saves the worker a read of every parameter per step."""
    params, tier = off.opt.param_groups[gi]["params"], off.tiers[gi]
    if "master" not in tier.kinds:  # every parameter of the group is its own master
        return {}
    t = time.perf_counter()
    segs = [(c, s) for c in chunks for s in c.segments
            if s.pi in grads and off._uses_master(params[s.pi])]
    seen = {}
    if speculative:
        for c, s in segs:
            known = off._watch.known(gi, (c.ci, s.pi))
            if known is not None and "step" in off.opt.state.get(params[s.pi], ()):
                seen[(c.ci, s.pi)] = known
        segs = [(c, s) for c, s in segs if (c.ci, s.pi) not in seen]
    flat = logical_flats(params)
    found = [flat(s.pi)[s.plo:s.phi] for _, s in segs]
    if any(d2h.on_device(t) for t in found):
        # Read through slot 0's copy buffer, on this thread's stream: the overlap's worker is
        # not on the stream the last uploads of the parameters (and from that buffer) went.
        off._uploads.drain()
    found = fingerprints(found, off._slots[0].get("copy"))
    seen.update({(c.ci, s.pi): v for (c, s), v in zip(segs, found)})
    todo: dict = {}  # ci -> (chunk, [(segment, first step)])
    for c, s in segs:
        fresh = "step" not in off.opt.state.get(params[s.pi], ())
        if fresh or off._watch.known(gi, (c.ci, s.pi)) != seen[(c.ci, s.pi)]:
            todo.setdefault(c.ci, (c, []))[1].append((s, fresh))
    stats["param_check_s"] += time.perf_counter() - t
    marked = False  # durable: the chunks' masters are about to change
    for chunk, entries in todo.values():
        t = time.perf_counter()
        gen = tier.gen[chunk.ci]
        if tier.viewable(chunk.ci):
            tier._wait_unheld(chunk.ci, gen)
            buf = tier.view("master", chunk.ci, off.chunk_elems)
        else:
            buf = off._slots[-1]["master"]
            tier.read("master", chunk.ci, buf).wait()
            tier.verify("master", chunk.ci, buf, off._what(gi, chunk))
        stale = [(s, fresh) for s, fresh in entries
                 if fresh or not bool(_same_bits(buf[s.clo:s.chi],
                                                 flat(s.pi)[s.plo:s.phi]).all())]
        if stale:
            if off._durable is not None and not marked:
                # A reopen must not check these masters against CRCs about to change.
                off._durable.write_manifest(unverified={(gi, ci) for ci in todo})
                marked = True
            for s, fresh in stale:
                p = flat(s.pi)[s.plo:s.phi]
                if fresh:
                    buf[s.clo:s.chi].copy_(p)
                else:
                    refresh_master(buf[s.clo:s.chi], p)
            if not tier.viewable(chunk.ci):
                tier.write("master", chunk.ci, buf, gen).wait()
                if off._engine is not None:
                    off._engine.sync()
            off._in_file[gi].update(s.pi for s, _ in stale)
            if rewritten is not None:
                rewritten.add(chunk.ci)
            stats["masters_refreshed"] += sum(not fresh for _, fresh in stale)
        off._watch.record(gi, {(chunk.ci, s.pi): seen[(chunk.ci, s.pi)] for s, _ in entries})
        stats["master_init_s"] += time.perf_counter() - t
    if marked:
        off._durable.write_manifest()
    return seen


def from_param(off, p: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
    """Sets the master of the element ranges [(a, b)] of p.view(-1) from `p`, bit for bit
    (widened), on the committed generation, and records p's bytes as what the optimizer last
    wrote (a parameter on the device is forgotten instead: the next step compares it, with no
    host sync now). For ranges a caller put back after a step (zero/unused.py: entries of a
    flat shard that got no gradient and were never stepped, whose master is their value): the
    step's weight decay moved their master, and refresh_master's rounding rule would keep low
    bits of it for a low-precision parameter; state_dict(), checkpoints (in memory, streamed,
    in the background) and the next step then all start from the value torch would keep."""
    where = [(gi, pi) for gi, g in enumerate(off.opt.param_groups)
             for pi, q in enumerate(g["params"]) if q is p]
    if not where or not ranges:
        return
    gi, pi = where[0]
    flat = p.detach().view(-1)
    if off.device_part.holds(gi, pi):  # its master, if any, is in optimizer.state
        master = off.opt.state.get(p, {}).get("master")
        if master is not None:
            for a, b in ranges:
                master.view(-1)[a:b].copy_(flat[a:b])
        return
    tier, layout = off.tiers[gi], off.layouts[gi]
    if not layout.reserved[pi] or "master" not in tier.kinds or not off._uses_master(p):
        return
    todo: dict = {}  # ci -> (chunk, segment, [(chunk lo, chunk hi, param lo, param hi)])
    for chunk in layout.chunks:
        for s in chunk.segments:
            if s.pi != pi:
                continue
            for a, b in ranges:
                lo, hi = max(a, s.plo), min(b, s.phi)
                if lo < hi:
                    todo.setdefault(chunk.ci, (chunk, s, []))[2].append(
                        (s.clo + lo - s.plo, s.clo + hi - s.plo, lo, hi))
    if not todo:
        return
    off.quiet()  # the overlap's worker uses the slots
    on_device = d2h.on_device(p)
    if off._durable is not None:  # a reopen must not check these masters against old CRCs
        off._durable.write_manifest(unverified={(gi, ci) for ci in todo})
    for ci, (chunk, _, parts) in todo.items():
        gen = tier.gen[ci]
        if tier.viewable(ci):
            tier._wait_unheld(ci, gen)  # a background save may be reading it
            buf = tier.view("master", ci, off.chunk_elems)
        else:
            buf = off._slots[-1]["master"]
            tier.read("master", ci, buf).wait()
            tier.verify("master", ci, buf, off._what(gi, chunk))
        for clo, chi, lo, hi in parts:
            buf[clo:chi].copy_(flat[lo:hi])  # from the device: a small synchronous copy
        if not tier.viewable(ci):
            tier.write("master", ci, buf, gen).wait()
            if off._engine is not None:
                off._engine.sync()
    keys = [(ci, pi) for ci in todo]
    if on_device:
        off._watch.forget(gi, keys)
    else:
        segs = [flat[s.plo:s.phi] for _, s, _ in todo.values()]
        off._watch.record(gi, dict(zip(keys, fingerprints(segs), strict=True)))
    if off._durable is not None:
        off._durable.write_manifest()
