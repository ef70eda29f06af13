"""Loading streamed optimizer state (stream.py's files) into an Offloader: all-or-nothing, and
within its cpu_budget whatever the world size the checkpoint was saved on.

A load follows a plan: for each parameter with saved state, its step and the runs of elements
that come from the saved kind files. A run (lo, hi, dir, gi, first) says that elements [lo, hi)
of the parameter are elements first, first + 1, ... of `dir`/g{gi}.<kind>.f32; elements no run
covers are zeros (a ZeRO shard's padding). Compact state's scales (one per 256 elements) come
from `scale_runs`, in scales. The same-world-size load has one run per parameter
(plan_from_state); a resharded load one per saved rank that the new shard overlaps (reshard.py).
The bytes go from the files straight into the pipeline slots or the tier (readinto, no
temporaries), a chunk at a time, so host memory stays what the Offloader already holds.

All-or-nothing, whatever fails after the first byte changed (a read error, a file that became
shorter after its SHA-256 was checked, an interrupt):
- NVMe, and host memory with two generations (overlap=True): each chunk is read into a slot,
  filled, and written to the uncommitted generation; all chunks flip together at the end.
- host memory with one generation (offload="cpu"): the chunks are filled in place, and the bytes
  each fill replaces go first to an undo journal, an unnamed temporary file (so no host memory),
  which is played back in reverse on failure (tierlift.offload.journal).
Every check that can refuse a checkpoint (check_plan) runs before the first change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from tierlift.checkpoint import stream
from tierlift.offload.device_part import kept_kinds
from tierlift.offload.journal import filling
from tierlift.offload.layout import SCALE_KIND, kind_elems, kind_slice, not_reserved


@dataclass(kw_only=True)
class ParamSource:
    step: float
    numel: int  # the parameter's numel in the checkpoint (a ZeRO shard's: padded)
    runs: list[tuple[int, int, str, int, int]]  # (lo, hi, dir, saved group, first element)
    scale_runs: list[tuple[int, int, str, int, int]] | None = None  # the same, in scales
    shape: tuple | None = None  # the parameter's shape when saved (a same-world-size load)


@dataclass(kw_only=True)
class GroupPlan:
    kinds: list[str] | None = None  # the kinds every source of the group holds (None: no source)
    dtypes: dict | None = None  # {kind: torch dtype} saved (None: fp32)
    params: dict[int, ParamSource] = field(default_factory=dict)


def read_into(f, arr: np.ndarray) -> None:
    """Fills `arr` from file `f` at its position (tests inject faults here)."""
    if f.readinto(arr) != arr.nbytes:
        raise ValueError(f"{f.name} is truncated: it became shorter after its SHA-256 was "
                         "checked")


def plan_from_state(directory: str, meta: dict) -> list[GroupPlan]:
    """The plan of a same-world-size load: one run per saved parameter."""
    def source(gi: int, e: dict) -> ParamSource:
        scales = None
        if "scale_offset" in e:
            scales = [(0, kind_elems(SCALE_KIND, e["numel"]), directory, gi, e["scale_offset"])]
        shape = tuple(e["shape"]) if "shape" in e else None
        return ParamSource(step=e["step"], numel=e["numel"], scale_runs=scales, shape=shape,
                           runs=[(0, e["numel"], directory, gi, e["offset"])])

    return [GroupPlan(kinds=list(g["kinds"]), dtypes=stream.dtypes(g),
                      params={e["index"]: source(gi, e) for e in g["params"]})
            for gi, g in enumerate(meta["groups"])]


def check_plan(off, plan: list[GroupPlan], source: str) -> None:
    """Raises a ValueError if `plan` does not fit Offloader `off`; changes nothing."""
    if len(plan) != len(off.opt.param_groups):
        raise ValueError(f"offloaded optimizer state {source} has {len(plan)} param groups, "
                         f"the optimizer {len(off.opt.param_groups)}")
    for gi, (gp, group) in enumerate(zip(plan, off.opt.param_groups, strict=True)):
        params = group["params"]
        if gp.kinds is not None and (SCALE_KIND in gp.kinds) != (SCALE_KIND in off.tiers[gi].kinds):
            # the files are read into the tiers as they are: another format is not converted here
            was, now = ("bf16", "fp32") if SCALE_KIND in gp.kinds else ("fp32", "bf16")
            raise ValueError(
                f"offloaded optimizer state {source} was saved with state_dtype={was!r}, the "
                f"optimizer has state_dtype={now!r}; load it into an optimizer built with "
                f"state_dtype={was!r}, then pass that optimizer's state_dict() to this one's "
                "load_state_dict, which converts")
        missing = [k for k in off.tiers[gi].kinds if k not in (gp.kinds or [])]
        if gp.kinds is not None and missing:
            why = (" (saved with amsgrad=False, the optimizer has amsgrad=True)"
                   if "max_exp_avg_sq" in missing else "")
            raise ValueError(f"offloaded optimizer state {source} has no {missing} for "
                             f"param group {gi}{why}")
        if gp.kinds is not None and "max_exp_avg_sq" in gp.kinds \
                and "max_exp_avg_sq" not in off.tiers[gi].kinds:
            # the tiers are laid out once: the saved maxima would be dropped, then every step
            # refused as "amsgrad changed"
            raise ValueError(f"offloaded optimizer state {source} was saved with amsgrad=True "
                             f"for param group {gi}, the optimizer has amsgrad=False; build it "
                             "with amsgrad=True")
        tier = off.tiers[gi]
        if SCALE_KIND in tier.kinds and any(s.scale_runs is None for s in gp.params.values()):
            raise ValueError(f"offloaded optimizer state {source}: loading compact state "
                             "(state_dtype='bf16') on another world size is not supported")
        saved = {k: (gp.dtypes or {}).get(k, torch.float32) for k in tier.kinds}
        if gp.kinds is not None and saved != tier.dtypes:
            raise ValueError(
                f"offloaded optimizer state {source} holds param group {gi} as "
                f"{ {k: str(d) for k, d in saved.items()} }, the optimizer as "
                f"{ {k: str(d) for k, d in tier.dtypes.items()} } (another state_dtype); load "
                "its state dict (tierlift.checkpoint.optimizer_state_dict) with "
                "load_state_dict, which converts")
        device_kinds = set()
        for pi, src in gp.params.items():
            held = pi < len(params) and off.device_part.holds(gi, pi)
            if held:
                device_kinds.update(_device_kinds(off, gi, pi))
            if pi < len(params) and not off.layouts[gi].reserved[pi] and not held:
                raise ValueError(not_reserved(off._name(gi, pi), off.config.offload,
                                              f"has state in the checkpoint {source}"))
            if pi < len(params) and off.layouts[gi].reserved[pi]:
                off.check_param(gi, pi, params[pi])  # filled by its laid-out numel
            if pi >= len(params) or params[pi].numel() != src.numel:
                got = (f"shape {tuple(params[pi].shape)}" if pi < len(params)
                       else "no such parameter")
                raise ValueError(f"offloaded optimizer state {source} does not match the "
                                 f"optimizer: param_groups[{gi}]['params'][{pi}] holds "
                                 f"{src.numel} elements in the checkpoint, {got} here")
            # as many elements in another shape: another parameter order (a transposed weight)
            if src.shape is not None and src.shape != tuple(params[pi].shape):
                raise ValueError(f"offloaded optimizer state {source} does not match the "
                                 f"optimizer: param_groups[{gi}]['params'][{pi}] has shape "
                                 f"{src.shape} in the checkpoint, {tuple(params[pi].shape)} "
                                 "here (another model or parameter order)")
        if device_kinds and gp.kinds is not None:  # the device part's kinds (master too)
            missing = sorted(device_kinds - set(gp.kinds))
            if missing:
                raise ValueError(f"offloaded optimizer state {source} has no {missing} for "
                                 f"param group {gi} (its device part needs them)")
            want = {k: off._dtypes[gi][k] for k in device_kinds}
            saved = {k: (gp.dtypes or {}).get(k, torch.float32) for k in device_kinds}
            if saved != want:
                raise ValueError(f"offloaded optimizer state {source} holds param group {gi}'s "
                                 f"device part as { {k: str(d) for k, d in saved.items()} }, "
                                 f"the optimizer as { {k: str(d) for k, d in want.items()} }")


def _device_kinds(off, gi: int, pi: int) -> list[str]:
    return kept_kinds(off.opt.param_groups[gi]["params"][pi], off._kinds[gi])


def _read_device_part(off, plan: list[GroupPlan], files: _Files) -> dict:
    """{param: its new state} for the device-part parameters in `plan`, read from the files
    into fresh tensors on each parameter's device; the optimizer is not changed yet."""
    out = {}
    for gi, gp in enumerate(plan):
        params = off.opt.param_groups[gi]["params"]
        for pi, src in gp.params.items():
            if not off.device_part.holds(gi, pi):
                continue
            p = params[pi]
            state = {"step": torch.tensor(src.step, dtype=torch.float32)}
            for k in _device_kinds(off, gi, pi):
                dtype = off._dtypes[gi][k]
                t = torch.empty(kind_elems(k, p.numel()), dtype=dtype)
                _fill(files, k, dtype, src, 0, p.numel(), stream._np(t))
                t = t if k == SCALE_KIND else t.view(p.shape)
                state[k] = t.to(p.device).contiguous()  # one at a time: host memory stays small
            out[p] = state
    return out


class _Files:
    """The saved kind files, opened on first use."""

    def __init__(self):
        self.open: dict = {}

    def get(self, directory: str, gi: int, kind: str, dtype: torch.dtype):
        key = (directory, gi, kind)
        if key not in self.open:
            self.open[key] = open(os.path.join(directory, stream.kind_file(gi, kind, dtype)),
                                  "rb")
        return self.open[key]

    def close(self) -> None:
        for f in self.open.values():
            f.close()


def _fill(files: _Files, kind: str, dtype: torch.dtype, src: ParamSource, plo: int, phi: int,
          dst: np.ndarray) -> None:
    """The values of the parameter's `kind` for its elements [plo, phi) into `dst`."""
    runs = src.scale_runs if kind == SCALE_KIND else src.runs
    sl = kind_slice(kind, plo, phi)
    plo, phi = sl.start, sl.stop
    pos = plo
    for lo, hi, directory, gi, first in runs:
        a, b = max(lo, plo), min(hi, phi)
        if a >= b:
            continue
        if a > pos:
            dst[pos - plo:a - plo] = 0
        f = files.get(directory, gi, kind, dtype)
        f.seek(dtype.itemsize * (first + a - lo))
        read_into(f, dst[a - plo:b - plo])
        pos = b
    if pos < phi:
        dst[pos - plo:] = 0


def load_plan(off, plan: list[GroupPlan], source: str, before_commit=None) -> None:
    """Replaces the state of Offloader `off` with the one `plan` reads, all-or-nothing (see the
    module docstring). Parameters the plan lacks start fresh, as in torch. `before_commit`, if
    given, is called once everything is filled and before the first change becomes visible;
    if it raises, the fills are undone (a multi-rank load agrees there, io.py)."""
    check_plan(off, plan, source)
    off.quiet(replacing=True)
    files = _Files()
    try:
        device = _read_device_part(off, plan, files)  # before the first change
        with filling(off._engine, before_commit) as (journal, flips):
            for gi, gp in enumerate(plan):
                layout, tier = off.layouts[gi], off.tiers[gi]
                chunks = [c for c in layout.chunks if any(s.pi in gp.params for s in c.segments)]
                writes: dict = {}
                for i, chunk, bufs, in_place in stream._slotted(off, gi, chunks, writes):
                    for s in (s for s in chunk.segments if s.pi in gp.params):
                        for k in tier.kinds:
                            dst = stream._np(bufs[k][kind_slice(k, s.clo, s.chi)])
                            if in_place:
                                journal.keep(dst)
                            _fill(files, k, tier.dtypes[k], gp.params[s.pi], s.plo, s.phi,
                                  dst)
                    if not in_place:  # a two-generation tier's other copy, flipped at the end
                        off.rewriting(tier, chunk.ci)
                        writes[i] = tier.write_all(chunk.ci, bufs, tier.next_gen(chunk.ci))
                        if tier.two_gen(chunk.ci):
                            flips.append((tier, chunk.ci))
    finally:
        files.close()
    off.device_part.replace(device)
    for gi, (gp, group) in enumerate(zip(plan, off.opt.param_groups, strict=True)):
        for pi, p in enumerate(group["params"]):
            if off.device_part.holds(gi, pi):
                continue  # replace() above
            if pi in gp.params:
                off.opt.state[p]["step"] = torch.tensor(gp.params[pi].step, dtype=torch.float32)
                off._in_file[gi].add(pi)
            else:  # no state in the checkpoint: starts fresh, as in torch (no entry at all)
                if p in off.opt.state:
                    off.opt.state[p].pop("step", None)
                    if not off.opt.state[p]:
                        del off.opt.state[p]
                off._in_file[gi].discard(pi)
    off.fill_done()


def same_state_format(off, meta: dict) -> bool:
    """Whether the state saved with state.json `meta` has the dtypes of Offloader `off`'s
    tiers (fp32 or compact): only then does it stream in as it is."""
    return len(meta["groups"]) == len(off.tiers) and all(
        all(stream.dtypes(g).get(k, torch.float32) == d for k, d in t.dtypes.items())
        for g, t in zip(meta["groups"], off.tiers))


def check_fits(off, meta: dict, directory: str) -> None:
    """Raises a ValueError if the state saved in `directory` (its state.json `meta`) does not
    fit Offloader `off`."""
    check_plan(off, plan_from_state(directory, meta), directory)


def load_offloaded(off, directory: str, check: bool = True) -> None:
    """Replaces the state of Offloader `off` with the one saved in `directory` by
    stream.save_offloaded. Checks every file's SHA-256 first (unless `check` is False because
    the caller already did); all-or-nothing."""
    meta = stream.verify(directory) if check else stream.read_state_json(directory)
    load_plan(off, plan_from_state(directory, meta), directory)
