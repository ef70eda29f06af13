"""Overlap: the optimizer step of a chunk runs in a background thread during backward.

A post-accumulate-grad hook marks a parameter ready; once every parameter (that requires a
gradient) of a chunk is ready, the chunk goes to one worker thread, which reads its state, runs
the fused SIMD Adam (the GIL is released inside the op and inside I/O waits) and writes the
new master, m and v to the uncommitted generation. The parameters themselves are not touched (a
second backward for gradient accumulation may still read them); step() copies the new master
weights into them ("publish") and commits. With device staging (device_staging.py) the worker
also uploads a chunk's new device weights into a device shadow during backward, and publish()
copies a kept chunk's weights from there, device to device.

Exactness by speculate-and-validate: each speculative chunk records what it used: a 64-bit
content fingerprint (watch.fingerprints) of the bytes of every gradient segment it read (taken
right before the kernel read them) and of every parameter segment its master was prepared from,
the step counts, the hyperparameters and the GradScaler scale it assumed (the previous
step's). step() keeps the chunk only if all of these are the same now, compared by content:
GradScaler's unscale_, `.data` and numpy writes change gradients without bumping their version
counter. Anything that changed (clipping that
scales the gradients, an unscale_, a second backward for accumulation, an lr scheduler, a
weight edited after backward) invalidates the chunk, which is then stepped again from the
committed generation with the final values. A chunk is therefore only ever committed with
exactly the inputs of the plain step. torch.nn.utils.clip_grad_norm_ below its threshold scales
by exactly 1.0, which changes no bits, so the chunks are kept; the optimizer's own
`max_grad_norm` computes the same global norm in step() and scales only when it must.

The check in step() rides on passes that read the same bytes anyway: the host gradients are
fingerprinted by step()'s finite check (scan_grads: one pass gives both), and an fp32 host
parameter is compared by publish() in the pass that copies its new value in (all or nothing
per chunk: a chunk with a parameter changed since its step started is not written and is
stepped again). Under GradScaler.step the scaler's own inf check is that pass
(scaler_scan.py). Only what no such pass reads (gradients after clipping scaled them or where
the scaler's check cannot be used, device and half-precision parameters) is fingerprinted by
validate() on its own.

Under tierlift.zero.shard the parameters are flat shards whose gradient is assigned when the
unit's reduction completes (no post-accumulate-grad hook fires): for those the Overlap listens
with tierlift.zero.on_shard_grad_ready, so a unit's chunks start as soon as its reduce-scatter
is done. With parameter offload on CUDA the gradient's copy to host memory may still be in
flight then: the listener says it waits for it (waits_for_landing), so the unit is handed over
at once and the worker waits for the copy's event itself (landing_event) before it reads the
gradient: the unit's step starts as soon as the copy lands, not when the training thread next
looks (a unit's backward later).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from tierlift._shards import is_shard, on_shard_grad_ready, shard_owner
from tierlift.offload import d2h, masters, worker_threads
from tierlift.offload.checks import check_group
from tierlift.offload.legs import WAIT
from tierlift.offload.tiers import drain
from tierlift.offload.watch import copy_checked, fingerprints, fingerprints_finite


def _value(v):
    """A group value as a comparable snapshot: a tensor (a tensor lr a scheduler fills in
    place) by its contents, containers element by element."""
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, tuple(v.shape), tuple(v.detach().cpu().reshape(-1).tolist()))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_value(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((k, _value(x)) for k, x in v.items()))
    return v


def group_settings(group: dict) -> tuple:
    """Every setting of the group (every key but "params", whether this optimizer reads it or
    not: one a later torch adds is covered too), in key order."""
    return tuple(sorted(((k, _value(v)) for k, v in group.items() if k != "params"),
                        key=lambda kv: str(kv[0])))


def same_hyper(a: tuple, b: tuple) -> bool:
    """Whether two group_settings snapshots are equal; a value that cannot be compared (an array
    whose == is elementwise) counts as changed, and so does a NaN."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - any failure to compare means "step it again"
        return False


def _frozen(group: dict) -> dict:
    """The group's hyperparameters as values: the worker steps with these, not with the group,
    which the user may change (or change and change back) before step()."""
    out = {k: v for k, v in group.items() if k != "params"}
    out.update(lr=float(group["lr"]), betas=tuple(float(b) for b in group["betas"]),
               eps=float(group["eps"]), weight_decay=float(group["weight_decay"]))
    return out


@dataclass(kw_only=True)
class Record:
    """What a speculative chunk step used."""

    tensors: dict  # pi -> the gradient tensor, as the hook found it
    steps: dict
    group: dict  # the hyperparameters it stepped with (_frozen)
    hyper: tuple  # every setting of the group when it started (group_settings)
    scale: float | None  # the GradScaler scale the kernel assumed
    grads: dict = field(default_factory=dict)  # (ci, pi) -> fingerprint of the gradient read
    params: dict = field(default_factory=dict)  # (ci, pi) -> fingerprint of the parameter
    landing: list = field(default_factory=list)  # events of gradient copies still in flight
    ready: list = field(default_factory=list)  # events of device gradients' production (d2h)
    staged: dict = field(default_factory=dict)  # (ci, pi) -> fingerprint of weights in the shadow


def landing_event(p: torch.Tensor):
    """The event of the copy that still writes p.grad (a ZeRO shard handed over before its
    copy to host memory landed), else None."""
    owner = shard_owner(p)
    return None if owner is None else owner[0].landing_event(p)


def deferred(p: torch.Tensor) -> bool:
    """Whether publish() checks parameter `p` (an fp32 host parameter, copied from its master
    as it is) in the pass that overwrites it, instead of validate()."""
    return p.device.type == "cpu" and p.dtype == torch.float32


def _host_grad_segments(gi: int, chunk, grads: dict, keys: list, pieces: list) -> None:
    """Appends (gi, ci, pi) and the gradient slice of each of `chunk`'s segments whose gradient
    is on the host."""
    for s in chunk.segments:
        g = grads.get(s.pi)
        if g is not None and g.device.type == "cpu":
            keys.append((gi, chunk.ci, s.pi))
            pieces.append(g[s.plo:s.phi])


def _by_group(n: int, keys: list, values: list) -> list[dict]:
    """Per group {(ci, pi): value} from (gi, ci, pi) keys."""
    known = [dict() for _ in range(n)]
    for (gi, ci, pi), v in zip(keys, values):
        known[gi][(ci, pi)] = v
    return known


def scan_grads(off, live: list[dict], spec: dict) -> tuple[bool, list[dict], set]:
    """The finite check of the host gradients of the groups with chunks stepped ahead, exact
    (no element with an all-ones exponent), fingerprinting every chunk segment in the same
    pass: (all finite, per group {(ci, pi): fingerprint}, the (gi, pi) it covered)."""
    return _scan(off, live, [gi for gi, records in spec.items() if records])


def scan_all_grads(off, live: list[dict]) -> tuple[bool, list[dict]]:
    """scan_grads over every group's host gradients (GradScaler's check, scaler_scan.py)."""
    finite, known, _ = _scan(off, live, [gi for gi, got in enumerate(live) if got])
    return finite, known


def _scan(off, live: list[dict], groups: list) -> tuple[bool, list[dict], set]:
    keys, pieces = [], []
    for gi in groups:
        for chunk in off.layouts[gi].chunks:
            _host_grad_segments(gi, chunk, live[gi], keys, pieces)
    covered = {(gi, pi) for gi, _, pi in keys}
    if not pieces:
        return True, [dict() for _ in live], covered
    values, flags = fingerprints_finite(pieces)
    return all(flags), _by_group(len(live), keys, values), covered


class Ahead:
    """Fingerprints of the host gradient segments of the chunks stepped ahead, taken on the
    overlap's (idle) worker thread while step() computes the gradient norm on its own: under a
    GradScaler no pass of step() reads the gradients, and torch's norm keeps one core busy."""

    def __init__(self, pool, groups: list, live: list[dict], spec: dict, scale: float | None,
                 clock):
        keys, pieces = [], []
        for gi, records in spec.items():
            for chunk, rec in records:
                if rec.scale != scale or not same_hyper(rec.hyper, group_settings(groups[gi])):
                    continue  # validate() redoes it without a look at its gradients
                _host_grad_segments(gi, chunk, live[gi], keys, pieces)
        self._n = len(live)
        self._keys = keys
        self._clock = clock
        self._future = pool.submit(self._run, pieces)

    def _run(self, pieces: list) -> tuple[list[int], float]:
        t = time.perf_counter()
        with self._clock.span("other"):
            return fingerprints(pieces), time.perf_counter() - t

    def result_(self, stats) -> list[dict]:
        """Per group {(ci, pi): fingerprint}; the wait counts as the check's time in step()."""
        t = time.perf_counter()
        with self._clock.span(WAIT):
            values, took = self._future.result()
        stats["overlap_check_s"] += time.perf_counter() - t
        stats["grad_fingerprint_ahead_s"] += took
        return _by_group(self._n, self._keys, values)

    def cancel_(self, stats) -> None:
        """The gradients changed meanwhile (a clip scaled them): waits, drops the values."""
        t = time.perf_counter()
        try:
            with self._clock.span(WAIT):
                self._future.result()
        except Exception:  # noqa: BLE001 - the values are not used
            pass
        stats["overlap_check_s"] += time.perf_counter() - t


def validate(off, gi: int, records: list, live: dict, scale: float | None,
             known: dict | None = None) -> tuple[list, list]:
    """Splits the speculative chunks [(chunk, Record)] of group gi into those stepped with
    exactly the inputs step() has now (kept, as (chunk, Record)) and the others (chunks,
    stepped again). `known`: {(ci, pi): fingerprint} of gradient segments as they are now
    (scan_grads); the rest are fingerprinted here. Parameters that deferred() are left to
    publish()."""
    group = off.opt.param_groups[gi]
    params = group["params"]
    known = known or {}
    candidates = []
    for chunk, rec in records:
        in_chunk = {s.pi for s in chunk.segments}
        if (not same_hyper(group_settings(group), rec.hyper) or scale != rec.scale
                or in_chunk & live.keys() != in_chunk & rec.tensors.keys()
                or off.next_steps(gi, rec.tensors) != rec.steps):
            candidates.append((chunk, rec, None))
            continue
        segs = [s for s in chunk.segments if s.pi in live]
        candidates.append((chunk, rec, segs))
    # Every fingerprint still to take, of every candidate, in one batch (one call, threads).
    keys, tensors = [], []
    for chunk, rec, segs in candidates:
        for s in segs or []:
            if (chunk.ci, s.pi) not in known:
                keys.append((id(rec), "g", chunk.ci, s.pi))
                tensors.append(live[s.pi][s.plo:s.phi])
            if (chunk.ci, s.pi) in rec.params and not deferred(params[s.pi]):
                keys.append((id(rec), "p", chunk.ci, s.pi))
                tensors.append(params[s.pi].detach().view(-1)[s.plo:s.phi])
    scratch = off._slots[0].get("copy")  # device tensors' bytes pass through it
    if scratch is not None and tensors:
        off._uploads.reserve(scratch)
    now = dict(zip(keys, fingerprints(tensors, scratch)))

    def same(rec, ci: int, s) -> bool:
        grad = known.get((ci, s.pi), now.get((id(rec), "g", ci, s.pi)))
        return grad == rec.grads.get((ci, s.pi)) and (
            deferred(params[s.pi])
            or now.get((id(rec), "p", ci, s.pi)) == rec.params.get((ci, s.pi)))

    good, bad = [], []
    for chunk, rec, segs in candidates:
        if segs is not None and all(same(rec, chunk.ci, s) for s in segs):
            good.append((chunk, rec))
        else:
            bad.append(chunk)
    return good, bad


def _masters(off, gi: int, part: list) -> list:
    """The new master weights of the kept chunks `part`: host memory's own chunks, or read
    into the pipeline slots (free here) and checked."""
    tier = off.tiers[gi]
    peek = getattr(tier, "peek", None)
    if peek is not None:
        return [peek("master", c.ci, tier.next_gen(c.ci)) for c, _ in part]
    bufs = [off._slots[j]["master"] for j in range(len(part))]
    reads = {}
    try:
        t = time.perf_counter()
        for j, (chunk, _) in enumerate(part):
            reads[j] = [tier.read("master", chunk.ci, bufs[j], tier.next_gen(chunk.ci))]
        # the engine's requests (a hybrid tier's RAM chunks are copied by read() itself)
        nbytes = sum(h.tensor.nbytes for hs in reads.values() for h in hs if hasattr(h, "done"))
        with off.clock.span("nvme_read"):
            for j in sorted(reads):
                for h in reads.pop(j):
                    h.wait()
        if nbytes:
            off.clock.io.append(("nvme_read", t, time.perf_counter(), nbytes))
    except BaseException:
        drain(reads)
        raise
    for (chunk, _), buf in zip(part, bufs):
        tier.verify("master", chunk.ci, buf, off._what(gi, chunk), tier.next_gen(chunk.ci))
    return bufs


def _publish_chunk(off, chunk, params, grads: dict, masters_: torch.Tensor, k: int,
                   stats) -> dict:
    """Writes the new weights of the parameters of `chunk` that deferred() leaves here, from
    its masters; returns {(ci, pi): the bytes written, in host memory}. Device weights are
    rounded into the copy buffer of slot k % S, once the upload that last read it is done, and
    uploaded without a wait (h2d.Uploader): the next chunk is rounded while this one is copied."""
    written, uploads, staging = {}, [], None
    for s in chunk.segments:
        p = params[s.pi]
        if s.pi not in grads or deferred(p):
            continue
        dst = p.detach().view(-1)[s.plo:s.phi]
        src = masters_[s.clo:s.chi]
        if not d2h.on_device(p):
            written[(chunk.ci, s.pi)] = dst.copy_(src)
            continue
        if staging is None:
            staging = off._slots[k % off.n_slots]
            off._h2d(stats, off._uploads.reserve, staging["copy"])
        # rounded on the host, so the bytes the parameter gets are known here
        written[(chunk.ci, s.pi)] = off._staging(p, s, staging).copy_(src)
        uploads.append((dst, written[(chunk.ci, s.pi)]))
    if uploads:
        off._h2d(stats, off._uploads.upload, uploads, staging["copy"])
    return written


def _shadowed(off, gi: int, chunk, rec: Record, params: list, grads: dict) -> bool:
    """Whether kept `chunk`'s new weights are all in the device shadow (device_staging.py):
    every segment with a gradient a device one, uploaded by the step that is kept."""
    staging = off._device_staging
    return (staging is not None and staging.covers(gi, chunk, grads, params)
            and all((chunk.ci, s.pi) in rec.staged for s in chunk.segments if s.pi in grads))


def _publish_shadowed(off, gi: int, part: list, params: list, grads: dict, stats,
                      published: list) -> None:
    """Publishes the kept chunks `part` from the device shadow: D2D copies on the current
    stream (no master is read, nothing is rounded); the parameter watch gets the fingerprints
    the worker took of the bytes it uploaded."""
    published.extend(c for c, _ in part)
    pairs, seen = [], {}
    for chunk, rec in part:
        for s in chunk.segments:
            if s.pi in grads:
                p = params[s.pi]
                pairs.append((p.detach().view(-1)[s.plo:s.phi],
                              off._device_staging.segment(gi, chunk.ci, s, p)))
                seen[(chunk.ci, s.pi)] = rec.staged[(chunk.ci, s.pi)]
    off._h2d(stats, off._device_staging.copy_out, gi, pairs)
    off._watch.record(gi, seen)
    stats["device_staged_chunks"] += len(part)


def publish(off, gi: int, kept: list, grads: dict, stats, published: list) -> list:
    """Copies the new master weights of the kept chunks [(chunk, Record)] into the parameters
    (a speculative step never touches them: a second backward may still read them) and records
    what it wrote for the parameter watch. A parameter that deferred() is compared with the
    fingerprint its step started from in the pass that copies over it; a chunk with one that
    changed since is not written at all and is returned, to be stepped again. `published`
    receives each chunk before any of its parameters is written (a failure puts those back)."""
    if not kept:
        return []
    t = time.perf_counter()
    params, tier = off.opt.param_groups[gi]["params"], off.tiers[gi]
    from_shadow = {c.ci for c, rec in kept if _shadowed(off, gi, c, rec, params, grads)}
    if from_shadow:
        _publish_shadowed(off, gi, [(c, r) for c, r in kept if c.ci in from_shadow], params,
                          grads, stats, published)
        kept = [(c, r) for c, r in kept if c.ci not in from_shadow]
    late = []
    batch = max(1, len(kept)) if hasattr(tier, "peek") else off.n_slots
    for at in range(0, len(kept), batch):
        part = kept[at:at + batch]
        masters_ = _masters(off, gi, part)
        groups = [[(params[s.pi].detach().view(-1)[s.plo:s.phi], buf[s.clo:s.chi],
                    rec.params.get((chunk.ci, s.pi)))
                   for s in chunk.segments if s.pi in grads and deferred(params[s.pi])]
                  for (chunk, rec), buf in zip(part, masters_)]
        results = copy_checked(groups)
        published.extend(c for (c, _), got in zip(part, results) if got is not None)
        for j, ((chunk, _), buf, got) in enumerate(zip(part, masters_, results)):
            if got is None:
                late.append(chunk)
                continue
            keys = [(chunk.ci, s.pi) for s in chunk.segments
                    if s.pi in grads and deferred(params[s.pi])]
            seen = dict(zip(keys, got))
            written = _publish_chunk(off, chunk, params, grads, buf, at + j, stats)
            seen.update(zip(written, fingerprints(list(written.values()))))
            off._watch.record(gi, seen)
    stats["publish_s"] += time.perf_counter() - t
    return late


def _after_production(rec: Record) -> None:
    """The worker's own device work (a copy of a strided gradient, fingerprints of device
    weights) goes on its thread's current stream; that stream waits for the streams that
    produced the gradients (`rec.ready`), which training may have run on streams of its own."""
    if not rec.ready or not torch.cuda.is_available():
        return
    for device in {g.device for g in rec.tensors.values() if g.is_cuda}:
        stream = torch.cuda.current_stream(device)
        for event in rec.ready:
            stream.wait_event(event)


class Overlap:
    def __init__(self, offloader):
        self.off = offloader
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierlift-offload")
        self._pending = []
        # the worker's threads while training runs (worker_threads.py); all once step() waits
        self.threads = worker_threads.cap(offloader.config.overlap_threads,
                                          offloader.opt.param_groups)
        self._training = False
        self._reset()
        self._where = {}
        self._handles = []
        me = weakref.ref(self)  # the hooks must not keep the optimizer (and its files) alive

        def hook(p: torch.Tensor) -> None:
            overlap = me()
            if overlap is not None:
                overlap._on_grad(p)

        hook.waits_for_landing = True  # _work waits for a shard's gradient copy itself

        for gi, group in enumerate(offloader.opt.param_groups):
            for pi, p in enumerate(group["params"]):
                self._where[p] = (gi, pi)
                if not p.requires_grad or offloader.device_part.holds(gi, pi):
                    continue  # no state to step ahead (frozen, or kept on the device)
                if is_shard(p):
                    self._handles.append(on_shard_grad_ready(p, hook))
                else:
                    self._handles.append(p.register_post_accumulate_grad_hook(hook))

    def fingerprint_ahead(self, live: list[dict], spec: dict, scale: float | None) -> Ahead:
        """Starts fingerprinting the gradients of the chunks in `spec` (finish() has returned,
        so the worker thread is idle)."""
        return Ahead(self._pool, self.off.opt.param_groups, live, spec, scale, self.off.clock)

    def _reset(self) -> None:
        self._ready = defaultdict(set)  # gi -> pis with a gradient this step
        self._submitted = defaultdict(set)  # gi -> cis
        self._spec = defaultdict(list)  # gi -> [(chunk, Record)]
        self._stats = defaultdict(float)
        self._error = None
        self._abandoned = False  # abandon(): the chunks not yet stepped are not stepped ahead
        self._lists_ok = None  # set by the first gradient hook of the next backward
        self._group_ok = {}  # gi -> whether step() would take the group (its first hook's check)

    def _on_grad(self, p: torch.Tensor) -> None:
        self._training = True  # until step() (or a state_dict()) waits for the worker
        if self._lists_ok is None:
            # The earliest point that sees a changed params list, before anything is stepped
            # by position in it. The refusal is step()'s: raised in a gradient hook it would
            # stop backward half way, and a step() after the list is put back would run on
            # the gradients accumulated so far.
            try:
                self.off.check_lists()
                self._lists_ok = True
            except RuntimeError:
                self._lists_ok = False
        if not self._lists_ok:
            return  # nothing is stepped ahead: step() refuses, or steps it all once repaired
        gi, pi = self._where[p]
        group = self.off.opt.param_groups[gi]
        params = group["params"]
        if gi not in self._group_ok:
            self._group_ok[gi] = self._group_takes(gi, group)
        if not self._group_ok[gi]:
            return  # a group step() refuses (amsgrad switched, a bad lr) is not stepped ahead
        with self._lock:
            self._ready[gi].add(pi)
            ready = []
            tier = self.off.tiers[gi]
            for chunk in self.off.layouts[gi].chunks_of(pi):
                # One-generation chunks are rewritten in place, so only step() may touch them
                # (a host tier's spare blocks, while they last, give them a second copy).
                if chunk.ci in self._submitted[gi] or not tier.speculates(chunk.ci):
                    continue
                if all(s.pi in self._ready[gi] or not params[s.pi].requires_grad
                       for s in chunk.segments):
                    self._submitted[gi].add(chunk.ci)
                    ready.append(chunk)
        if ready:
            pis = {s.pi for c in ready for s in c.segments if params[s.pi].grad is not None}
            rec = Record(tensors={q: params[q].grad for q in pis},
                         steps=self.off.next_steps(gi, pis), group=_frozen(group),
                         hyper=group_settings(group),
                         scale=self.off._scale_seen,
                         landing=[e for e in (landing_event(params[q]) for q in pis)
                                  if e is not None],
                         # the hook runs on the stream that produced the gradients
                         ready=d2h.ready_events([params[q].grad for q in pis]))
            self._pending.append((self._pool.submit(self._work, gi, ready, rec), len(ready)))

    def _group_takes(self, gi: int, group: dict) -> bool:
        """The optimizer's checks of the group, once per step at its first gradient (not at
        every hook: they are Python on the thread that launches backward's kernels). A group
        changed after that is still checked by step(), and its chunks' settings compared.
        Whatever the checks raise is step()'s to raise: raised here, in a gradient hook, it
        would stop backward half way, and a step() after the group is repaired would run on
        the gradients accumulated so far."""
        try:
            check_group(self.off.opt, gi, group, self.off._kinds[gi])
        except Exception:  # noqa: BLE001 - step() raises it (torch's RuntimeError, a KeyError)
            return False
        return True

    def _work(self, gi: int, chunks, rec: Record) -> None:
        if self._error is not None:
            return
        if self._abandoned:
            self._count_abandoned(len(chunks))
            return
        t = time.perf_counter()
        clock = self.off.clock
        done = []
        try:
            self._cap_threads()
            with clock.span("other"), torch.no_grad():
                if rec.landing:  # gradient copies handed over in flight: wait here, not there
                    with clock.span("d2h"):
                        for event in rec.landing:
                            event.synchronize()
                _after_production(rec)
                grads = {pi: g.contiguous().view(-1) for pi, g in rec.tensors.items()}
                scale = (None if rec.scale is None
                         else torch.tensor([rec.scale], dtype=torch.float32))
                # Somewhere to write each chunk's new state; without it step() steps it.
                tier = self.off.tiers[gi]
                room = [c for c in chunks if tier.reserve(c.ci)]
                self._stats["overlap_no_room_chunks"] += len(chunks) - len(room)
                chunks = room
                rec.params = masters.prepare(self.off, gi, grads, chunks, self._stats,
                                             speculative=True)
                self.off.run(gi, grads, rec.steps, chunks, self._stats, done, publish=False,
                             scale=scale, used_grads=rec.grads, group=rec.group,
                             ready=rec.ready, staged=rec.staged, stop=self._stop)
        except BaseException as err:  # noqa: BLE001 - re-raised by finish()
            self._error = err
        finally:
            worker_threads.apply(0)  # the worker thread's other work (fingerprint_ahead): all
            self._spec[gi].extend((c, rec) for c in done)
            if self._abandoned and len(done) < len(chunks):
                self._count_abandoned(len(chunks) - len(done))
            self._stats["overlapped_s"] += time.perf_counter() - t

    def _stop(self) -> bool:
        """Whether the worker leaves its remaining chunks to step() (read between chunks);
        the next chunk's threads follow whether training still runs."""
        self._cap_threads()
        return self._abandoned

    def _cap_threads(self) -> None:
        """On the worker thread: `threads` of the pool while training runs, all of it once
        step() waits (worker_threads.py)."""
        worker_threads.apply(self.threads if self._training else 0)

    def _count_abandoned(self, n: int) -> None:
        with self._lock:  # the worker and abandon() both count
            self._stats["overlap_abandoned_chunks"] += n

    def abandon(self) -> None:
        """step() knows every chunk stepped ahead would be stepped again (the gradients are
        about to be clipped, or the step skipped): chunks the worker has not started are left
        to step(), so finish() waits at most for the one in progress."""
        self._training = False
        with self._lock:
            self._abandoned = True
            for f, n in self._pending:
                if f.cancel():
                    self._stats["overlap_abandoned_chunks"] += n

    def _wait_pending(self) -> None:
        self._training = False  # the training thread waits: the worker may take every thread
        with self.off.clock.span(WAIT):
            for f, _ in self._pending:
                if not f.cancelled():
                    f.result()

    def finish(self, stats) -> dict:
        """Waits for the speculative chunks; returns {gi: [(chunk, Record)]} and starts the
        next step's bookkeeping. A worker failure is raised after its chunks are undone."""
        t = time.perf_counter()
        self._wait_pending()
        self._pending = []
        stats["overlap_wait_s"] += time.perf_counter() - t
        stats["overlap_threads"] = float(self.threads)  # while training ran
        for k, v in self._stats.items():
            stats[k] += v
        spec, err = dict(self._spec), self._error
        self._reset()
        if err is not None:
            for tier in self.off.tiers:  # its spare blocks go back with its chunks
                tier.release_spare()
            self.off._raise(err)  # nothing to undo: speculation touches no committed state
        return spec

    def wait(self) -> None:
        """Waits until the worker is idle: it steps chunks in the pipeline slots, which a
        state_dict() or a load between backward and step() also uses."""
        self._wait_pending()

    def discard(self) -> None:
        """The committed state is about to be replaced (a load between backward and step()):
        the chunks stepped ahead started from the old one, so step() steps them again."""
        self.wait()
        # Uploads into the device shadow may still be in flight: they free nothing and read
        # the slots under the uploader's guard, and the chunks they stage are not published.
        self._spec.clear()
        for tier in self.off.tiers:
            tier.release_spare()

    def close(self, join: bool = True) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._pool.shutdown(wait=join)
