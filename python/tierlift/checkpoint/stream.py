"""Streaming checkpoints of offloaded optimizer state (offload="cpu"|"nvme"): the Offloader's
committed generation goes to a directory chunk by chunk through its pipeline slot, and comes
back the same way, so the host memory a save or a load holds stays inside `cpu_budget`.

Layout (independent of chunk size, budget and tier, so it loads anywhere):

    state.json          per param group: its state kinds and their dtypes and, per parameter
                        that has taken a step, its index, name, shape, dtype, step and offset
                        (elements) in the kind files (with compact state also its offset in the
                        scale file); the SHA-256 of every kind file
    g0.exp_avg.f32 ...  one file per group and kind: the values of the stepped parameters,
                        concatenated densely in parameter order ("master" holds the fp32 master
                        weights, or the parameter itself where it is fp32 and its own master).
                        Compact state (state_dtype="bf16"): g0.exp_avg.bf16, g0.exp_avg_sq.u8
                        (codes) and g0.exp_avg_sq_scale.f32 (one scale per 256 elements)

Checksums are SHA-256, the mechanism of tierlift.checkpoint.format, computed while the bytes are
written (no second pass) and verified before anything is loaded: a truncated or corrupt file is
an error naming it, and the optimizer is left as it was. Loading is in restore.py.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from tierlift.checkpoint import format as fmt
from tierlift.checkpoint import validate
from tierlift.checkpoint.writer import Held, RawFile
from tierlift.offload.layout import SCALE_KIND, kind_elems, kind_slice
from tierlift.offload.tiers import MemoryTier

STATE_JSON = "state.json"
FORMAT = "tierlift-offload-state"
VERSION = 1
_LOW_PRECISION = ("torch.bfloat16", "torch.float16")


_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.uint8: "u8"}
_DTYPE = {v: k for k, v in _SUFFIX.items()}
_NP = {torch.float32: np.float32, torch.bfloat16: np.int16, torch.uint8: np.uint8}


def kind_file(gi: int, kind: str, dtype: torch.dtype = torch.float32) -> str:
    return f"g{gi}.{kind}.{_SUFFIX[dtype]}"


def dtypes(group: dict) -> dict[str, torch.dtype]:
    """{kind: dtype} of a state.json group (files without "dtypes" hold fp32 kinds)."""
    saved = group.get("dtypes", {})
    return {k: _DTYPE[saved.get(k, "f32")] for k in group["kinds"]}


def kind_offset(kind: str, entry: dict) -> int:
    """Where a parameter's values start in the kind file (in values of the kind)."""
    return entry["scale_offset"] if kind == SCALE_KIND else entry["offset"]


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def read_state_json(directory: str) -> dict:
    file = os.path.join(directory, STATE_JSON)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{directory} holds no offloaded optimizer state (no "
                                f"{STATE_JSON})")
    try:
        with open(file) as f:
            meta = json.load(f)
    except ValueError as e:
        raise ValueError(f"{file} is corrupt: {e}") from e
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{file}: unsupported format {meta.get('format')!r} version "
                         f"{meta.get('version')!r} (expected {FORMAT!r} {VERSION})")
    try:
        for gi, group in enumerate(meta["groups"]):
            for e in group["params"]:
                validate.step(e["step"], f"{file}: groups[{gi}] parameter {e['index']}")
    except (KeyError, TypeError) as e:
        raise ValueError(f"{file} is corrupt: {type(e).__name__}: {e}") from None
    return meta


def verify(directory: str, meta: dict | None = None) -> dict:
    """Checks every kind file's size and SHA-256 against state.json; returns state.json."""
    meta = meta or read_state_json(directory)
    for gi, group in enumerate(meta["groups"]):
        for kind, dtype in dtypes(group).items():
            nbytes = dtype.itemsize * sum(kind_elems(kind, p["numel"]) for p in group["params"])
            name = kind_file(gi, kind, dtype)
            file = os.path.join(directory, name)
            if not os.path.isfile(file):
                raise FileNotFoundError(f"offloaded optimizer state {directory} lacks {name}")
            if os.path.getsize(file) != nbytes:
                raise ValueError(f"{file} is truncated or corrupt: {os.path.getsize(file)} "
                                 f"bytes, {nbytes} expected")
            if fmt.sha256(file) != meta["sha256"][name]:
                raise ValueError(f"{file} is corrupt or truncated: its SHA-256 does not match "
                                 f"the one in {STATE_JSON}")
    return meta


def _wait_quietly(handles) -> None:
    for h in handles:
        try:
            h.wait()
        except Exception:  # noqa: BLE001 - the first error is the one raised
            pass


def _slotted(off, gi: int, chunks: list, writes: dict):
    """Yields (i, chunk, bufs, in_place) for a fill of `chunks`. Host chunks kept in one
    generation come first, as views of the tier (in_place=True: the caller journals them).
    The others come in the pipeline slots holding their committed generation, chunk i+1 read
    (CRC-32C checked in the background) while the caller works on chunk i; the caller puts the
    handles of its writes from a slot into `writes[i]`, and the slot is reused only after they
    finished."""
    tier = off.tiers[gi]
    off.quiet()
    in_place = {c.ci for c in chunks if tier.viewable(c.ci) and not tier.two_gen(c.ci)}
    for chunk in (c for c in chunks if c.ci in in_place):
        yield None, chunk, off._chunk_bufs(gi, chunk), True
    chunks = [c for c in chunks if c.ci not in in_place]
    slots = off._slots
    reads: dict = {}

    def start(i):
        reads[i] = tier.read_all(chunks[i].ci, slots[i % len(slots)], off._what(gi, chunks[i]))

    try:
        if chunks:
            start(0)
        for i, chunk in enumerate(chunks):
            if i + 1 < len(chunks):
                for h in writes.pop(i + 1 - len(slots), []):
                    h.wait()
                start(i + 1)
            for h in reads.pop(i):
                h.wait()
            yield i, chunk, slots[i % len(slots)], False
        for i in sorted(writes):
            for h in writes.pop(i):
                h.wait()
    finally:  # an error, or the caller stopped: no I/O may stay in flight into the slots
        for hs in [*reads.values(), *writes.values()]:
            _wait_quietly(hs)


def state_bytes(off) -> int:
    """The bytes stage_offloaded() writes for Offloader `off`'s current state (its kind
    files; "master" for every stepped parameter)."""
    total = 0
    for gi, group in enumerate(off.opt.param_groups):
        tier = off.tiers[gi]
        kinds = ["master", *[k for k in tier.kinds if k != "master"]]
        for p in group["params"]:
            if "step" in off.opt.state.get(p, {}):
                total += sum(tier.dtypes.get(k, torch.float32).itemsize
                             * kind_elems(k, p.numel()) for k in kinds)
    return total


def held_chunk_bytes(off) -> int:
    """The staging a save needs to read one chunk of a held generation (0: none is held)."""
    held = any(_held(t) for t in off.tiers)
    return off.chunk_elems * 4 if held else 0


def _held(tier) -> bool:
    """The writer reads a tier's committed chunks itself, holding them (a step's write into a
    held chunk waits until the writer has read it), unless the tier is the one-generation host
    tier of offload="cpu" without overlap: its step writes in place without asking, so the save
    copies it first."""
    return not (isinstance(tier, MemoryTier) and tier.generations == 1)


def device_state(off, gi: int, pi: int, kinds: list[str], types: dict) -> dict:
    """{kind: tensor} of device-part parameter `pi` of group `gi` as the kind files hold it:
    "master" is the parameter itself where it is fp32 (its own master)."""
    p = off.opt.param_groups[gi]["params"][pi]
    state = off.opt.state[p]
    out = {}
    for k in kinds:
        t = p.detach() if k == "master" and p.dtype == torch.float32 else state.get(k)
        if not isinstance(t, torch.Tensor) or t.dtype != types[k] or \
                t.numel() != kind_elems(k, p.numel()):
            got = "missing" if not isinstance(t, torch.Tensor) else \
                f"{t.dtype} with {t.numel()} elements"
            raise RuntimeError(f"the device part's {k!r} of {off._name(gi, pi)} is {got}, "
                               f"{types[k]} with {kind_elems(k, p.numel())} elements expected")
        out[k] = t
    return out


def stage_offloaded(off, directory: str, names: dict, packer, helds: list, files: list):
    """Stages the committed state of Offloader `off` for a save into `directory` (created):
    in-place host tiers are copied by `packer` now; two-generation tiers are held, and a
    writer.Held for each group is appended to `helds` (the writer reads them after the pieces).
    The kind files are appended to `files`. Returns finish(digests), which writes state.json
    once the writer knows every file's SHA-256. `names` ({param: name}) are recorded. A state
    that step() refuses (a failed in-place rewrite) is refused here too (check_readable)."""
    off.check_readable()
    for gi, group in enumerate(off.opt.param_groups):  # read by their laid-out numels
        for pi, p in enumerate(group["params"]):
            if off.layouts[gi].reserved[pi] and "step" in off.opt.state.get(p, {}):
                off.check_param(gi, pi, p)
    os.makedirs(directory, exist_ok=True)
    groups, outs_all = [], {}
    for gi, group in enumerate(off.opt.param_groups):
        params, layout, tier = group["params"], off.layouts[gi], off.tiers[gi]
        kinds = ["master", *[k for k in tier.kinds if k != "master"]]
        types = {k: tier.dtypes.get(k, torch.float32) for k in kinds}
        stepped = [pi for pi, p in enumerate(params) if "step" in off.opt.state.get(p, {})]
        entries, dense, pos = [], {k: {} for k in kinds}, dict.fromkeys(kinds, 0)
        for pi in stepped:
            p = params[pi]
            for k in kinds:
                dense[k][pi] = pos[k]
            entry = {"index": pi, "name": names.get(p), "shape": list(p.shape),
                     "dtype": str(p.dtype), "numel": p.numel(), "offset": pos["master"],
                     "step": float(off.opt.state[p]["step"])}
            if SCALE_KIND in kinds:
                entry["scale_offset"] = pos[SCALE_KIND]
            entries.append(entry)
            for k in kinds:
                pos[k] += kind_elems(k, p.numel())
        outs = {k: RawFile(os.path.join(directory, kind_file(gi, k, types[k])),
                           types[k].itemsize * pos[k]) for k in kinds}
        files.extend(outs.values())
        outs_all.update({kind_file(gi, k, types[k]): f for k, f in outs.items()})
        # The device part's state (device_part.py) is copied now, as in-place tiers are: later
        # steps change it in place. Its parameters come first in the group (choose()), so in
        # each kind file its bytes precede the tiers', as the writer's in-order hashing needs.
        device = [pi for pi in stepped if off.device_part.holds(gi, pi)]
        if device and device[-1] > min((pi for pi in stepped if pi not in device),
                                        default=device[-1]):
            raise RuntimeError(f"param group {gi}: the device part is not a prefix of the "
                               "stepped parameters; its state cannot be written in order")
        for pi in device:
            for k, src in device_state(off, gi, pi, kinds, types).items():
                packer.add(outs[k], src, dense[k][pi] * types[k].itemsize)
        live = set(stepped) - set(device)
        chunks = [(c.ci, [s for s in c.segments if s.pi in live]) for c in layout.chunks]
        chunks = [(ci, segs) for ci, segs in chunks if segs]
        # Parameters that are their own master (no "master" in the tier) are copied now.
        held = [k for k in kinds if k in tier.kinds] if _held(tier) else []
        if held:
            helds.append(Held(tier.hold([ci for ci, _ in chunks]), held, outs, chunks, dense,
                              off.chunk_elems, types,
                              lambda ci, gi=gi, lay=layout: off._what(gi, lay.chunks[ci])()))
        for k in kinds:
            if k in held:
                continue
            for ci, segs in chunks:
                view = tier.view(k, ci, off.chunk_elems) if k in tier.kinds else None
                for s in segs:
                    p = params[s.pi]
                    if k == "master" and (view is None or not off._uses_master(p)):
                        src = p.detach().view(-1)[s.plo:s.phi]  # its own master
                    else:
                        src = view[kind_slice(k, s.clo, s.chi)]
                    at = dense[k][s.pi] + kind_slice(k, s.plo, s.phi).start
                    packer.add(outs[k], src, at * types[k].itemsize)
        groups.append({"kinds": kinds, "dtypes": {k: _SUFFIX[d] for k, d in types.items()},
                       "params": entries})

    def finish(digests: dict) -> None:
        fmt.write_json(os.path.join(directory, STATE_JSON), {
            "format": FORMAT, "version": VERSION, "groups": groups,
            "sha256": {name: digests[f.path] for name, f in outs_all.items()}})

    return finish


def read_tensors(directory: str, mmap: bool = False) -> list[dict]:
    """[{param index: {"step": tensor, kind: tensor}} per group], "master" only for
    low-precision parameters (as optimizer.state_dict() has it); compact state as the
    in-memory compact optimizer holds it (bf16 exp_avg, uint8 exp_avg_sq, fp32 scales).
    mmap=True maps the files (pages are read on use, not held) instead of reading them."""
    meta = read_state_json(directory)
    out = []
    for gi, group in enumerate(meta["groups"]):
        arrays = {}
        types = dtypes(group)
        for k, dtype in types.items():
            file = os.path.join(directory, kind_file(gi, k, dtype))
            empty = os.path.getsize(file) == 0
            arrays[k] = (np.zeros(0, _NP[dtype]) if empty else
                         np.memmap(file, dtype=_NP[dtype], mode="c") if mmap else
                         np.fromfile(file, dtype=_NP[dtype]))
        states = {}
        for e in group["params"]:
            st = {"step": torch.tensor(e["step"], dtype=torch.float32)}
            for k, a in arrays.items():
                if k == "master" and e["dtype"] not in _LOW_PRECISION:
                    continue
                at, n = kind_offset(k, e), kind_elems(k, e["numel"])
                t = torch.from_numpy(a[at:at + n])
                if types[k] == torch.bfloat16:
                    t = t.view(torch.bfloat16)
                st[k] = t if k == SCALE_KIND else t.view(e["shape"])
            states[e["index"]] = st
        out.append(states)
    return out


def names(directory: str) -> list[dict]:
    """[{param index: name recorded at save}] per group."""
    return [{e["index"]: e["name"] for e in g["params"]}
            for g in read_state_json(directory)["groups"]]
