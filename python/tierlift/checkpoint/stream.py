"""Streaming checkpoints of offloaded optimizer state (offload="cpu"|"nvme"): the Offloader's
committed generation goes to a directory chunk by chunk through its pipeline slot, and comes
back the same way, so the host memory a save or a load holds stays inside `cpu_budget`.

Layout (independent of chunk size, budget and tier, so it loads anywhere):

    state.json          per param group: its state kinds and, per parameter that has taken a
                        step, its index, name, shape, dtype, step and offset (elements) in the
                        kind files; the SHA-256 of every kind file
    g0.exp_avg.f32 ...  one file per group and kind: the fp32 values of the stepped parameters,
                        concatenated densely in parameter order ("master" holds the fp32 master
                        weights, or the parameter itself where it is fp32 and its own master)

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
from tierlift.checkpoint.writer import Held, RawFile
from tierlift.offload.tiers import MemoryTier

STATE_JSON = "state.json"
FORMAT = "tierlift-offload-state"
VERSION = 1
_LOW_PRECISION = ("torch.bfloat16", "torch.float16")


def kind_file(gi: int, kind: str) -> str:
    return f"g{gi}.{kind}.f32"


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


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
    return meta


def verify(directory: str, meta: dict | None = None) -> dict:
    """Checks every kind file's size and SHA-256 against state.json; returns state.json."""
    meta = meta or read_state_json(directory)
    for gi, group in enumerate(meta["groups"]):
        nbytes = 4 * sum(p["numel"] for p in group["params"])
        for kind in group["kinds"]:
            name = kind_file(gi, kind)
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


def stage_offloaded(off, directory: str, names: dict, packer, helds: list, files: list):
    """Stages the committed state of Offloader `off` for a save into `directory` (created):
    in-place host tiers are copied by `packer` now; two-generation tiers are held, and a
    writer.Held for each group is appended to `helds` (the writer reads them after the pieces).
    The kind files are appended to `files`. Returns finish(digests), which writes state.json
    once the writer knows every file's SHA-256. `names` ({param: name}) are recorded."""
    os.makedirs(directory, exist_ok=True)
    groups, outs_all = [], {}
    for gi, group in enumerate(off.opt.param_groups):
        params, layout, tier = group["params"], off.layouts[gi], off.tiers[gi]
        kinds = ["master", *[k for k in tier.kinds if k != "master"]]
        stepped = [pi for pi, p in enumerate(params) if "step" in off.opt.state[p]]
        entries, dense, pos = [], {}, 0
        for pi in stepped:
            p = params[pi]
            dense[pi] = pos
            entries.append({"index": pi, "name": names.get(p), "shape": list(p.shape),
                            "dtype": str(p.dtype), "numel": p.numel(), "offset": pos,
                            "step": float(off.opt.state[p]["step"])})
            pos += p.numel()
        outs = {k: RawFile(os.path.join(directory, kind_file(gi, k)), 4 * pos) for k in kinds}
        files.extend(outs.values())
        outs_all.update({kind_file(gi, k): f for k, f in outs.items()})
        live = set(stepped)
        chunks = [(c.ci, [s for s in c.segments if s.pi in live]) for c in layout.chunks]
        chunks = [(ci, segs) for ci, segs in chunks if segs]
        if _held(tier):
            helds.append(Held(tier.hold([ci for ci, _ in chunks]), kinds, outs, chunks, dense,
                              off.chunk_elems, getattr(tier, "used", None),
                              lambda ci, gi=gi, lay=layout: off._what(gi, lay.chunks[ci])()))
        else:
            for k in kinds:
                for ci, segs in chunks:
                    view = tier.view(k, ci, off.chunk_elems) if k in tier.kinds else None
                    for s in segs:
                        p = params[s.pi]
                        if k == "master" and (view is None or not off._uses_master(p)):
                            src = p.detach().view(-1)[s.plo:s.phi]  # its own master
                        else:
                            src = view[s.clo:s.chi]
                        packer.add(outs[k], src, (dense[s.pi] + s.plo) * 4)
        groups.append({"kinds": kinds, "params": entries})

    def finish(digests: dict) -> None:
        fmt.write_json(os.path.join(directory, STATE_JSON), {
            "format": FORMAT, "version": VERSION, "groups": groups,
            "sha256": {name: digests[f.path] for name, f in outs_all.items()}})

    return finish


def read_tensors(directory: str, mmap: bool = False) -> list[dict]:
    """[{param index: {"step": tensor, kind: fp32 tensor}} per group], "master" only for
    low-precision parameters (as optimizer.state_dict() has it). mmap=True maps the files
    (pages are read on use, not held) instead of reading them."""
    meta = read_state_json(directory)
    out = []
    for gi, group in enumerate(meta["groups"]):
        arrays = {}
        for k in group["kinds"]:
            file = os.path.join(directory, kind_file(gi, k))
            empty = os.path.getsize(file) == 0
            arrays[k] = (np.zeros(0, np.float32) if empty else
                         np.memmap(file, dtype=np.float32, mode="c") if mmap else
                         np.fromfile(file, dtype=np.float32))
        states = {}
        for e in group["params"]:
            st = {"step": torch.tensor(e["step"], dtype=torch.float32)}
            for k, a in arrays.items():
                if k == "master" and e["dtype"] not in _LOW_PRECISION:
                    continue
                st[k] = torch.from_numpy(a[e["offset"]:e["offset"] + e["numel"]]).view(
                    e["shape"])
            states[e["index"]] = st
        out.append(states)
    return out


def names(directory: str) -> list[dict]:
    """[{param index: name recorded at save}] per group."""
    return [{e["index"]: e["name"] for e in g["params"]}
            for g in read_state_json(directory)["groups"]]
