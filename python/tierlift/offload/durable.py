"""Optimizer state on NVMe that outlives its process: offload="nvme", durable=True.

A process killed mid-step (kill -9, the OOM killer) leaves its state folder behind; the next
optimizer built with the same parameters on the same nvme_path reopens it at exactly the last
committed step, or at the step after it when that step can be finished from its journal, never
a mix of the two. The folder is nvme_path/tierlift-durable-rank{R}/; beside the state files:

manifest.json    the committed step: a counter, the layout it was written for, each chunk's
                 generation and CRC-32C per kind, every parameter's step count. Replaced whole
                 (written, fsynced, renamed), so it always describes one step or the other.
intent.json      one generation only: the step being rewritten in place (hyperparameters, step
                 counts, its chunks, the CRC-32C of each chunk's logged gradient).
g{gi}.grads      one generation only: that step's gradients, chunk ci at ci x the chunk's bytes
                 (each parameter's gradient in its own dtype, at most as wide as the parameter).
journal.{kind}   one generation only: the new bytes of the chunks in flight, one position per
                 pipeline slot (the "write-ahead journal of the chunks in flight").
journal.records  64 bytes per chunk: which journal position holds its new bytes, their CRCs.
creating.json    a new state before its first manifest. Without it, a folder with state files
                 but no manifest is refused, never zeroed: durable="fresh" starts over.

One generation, per step: the gradients are logged and synced, then intent.json is renamed into
place. Each chunk is stepped, its new bytes go to its slot's journal position, its record is
written once those writes are done, and only then is it rewritten in place; a slot (and its
journal position) is reused only after that in-place write finished. Finally every file is
synced and a new manifest commits the step. Reopening with an intent newer than the manifest
finishes that step chunk by chunk: a chunk already rewritten (its bytes match its record) stays,
one still at the manifest's bytes is stepped again from the logged gradient (the same kernel,
so the same bits), one torn mid-write is copied from its journal position. Anything else (a
gradient, record, journal position or manifest whose CRC does not match) is refused with a
ChecksumError: the state is never guessed. Two generations need no journal: the manifest names
the committed generation of every chunk.

The cost over one plain generation: the gradient log (the gradients' bytes per parameter: 2 for
bf16, 4 for fp32), the journal (one chunk of every kind per pipeline slot), and every in-place
chunk written twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import struct
import sys
import time
import warnings
import zlib
from collections import defaultdict

import torch

from tierlift._text import first_names
from tierlift.io import ChecksumError
from tierlift.io.fsync import fsync_path
from tierlift.offload.layout import IO_ALIGN, kind_bytes
from tierlift.offload.tiers import (
    _owner_alive,
    _pid_namespace,
    _reserve,
    _start_time,
    crc32c,
    drain,
)

DIR_PREFIX = "tierlift-durable-"
CREATING = "creating.json"  # a new state before its first manifest (claim_dir)
FORMAT = 1
_MAGIC = 0x7D1F1A57
_REC = struct.Struct("<IQIIII5I")  # magic, seq, gi, ci, slot, n_kinds, CRC per kind (<= 5)
_REC_BYTES = 64
_CLAIM_WAIT_S = 30.0  # a claim takes milliseconds; one held longer is a stuck process's


def durable_dir(nvme_path: str) -> str:
    """The state folder of this process's rank under nvme_path."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return os.path.join(nvme_path, f"{DIR_PREFIX}rank{rank}")


def _owner() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "pidns": _pid_namespace(),
            "start_time": _start_time(os.getpid())}


def claim_dir(path: str, start_fresh: bool = False) -> bool:
    """Makes `path` this process's durable state folder; True if it is new, False if it holds a
    state to reopen. A folder whose owner is alive (or on another host, where that cannot be
    told) is refused, and so is one with state files but no manifest (only the manifest says
    which step they hold: they are never taken for a new state and zeroed). `start_fresh`
    (durable="fresh"): whatever state the folder holds is discarded and a new one started.
    Claims of one folder run one at a time (_claim_lock): of two optimizers started together on
    it, the second finds the first's owner.json and is refused."""
    os.makedirs(path, exist_ok=True)
    with _claim_lock(path):
        return _claim(path, start_fresh)


@contextlib.contextmanager
def _claim_lock(path: str):
    """An exclusive flock of folder `path` for one claim (released when it ends, or when the
    process dies): without it, two optimizers started at once both read "no owner" and both
    took the folder, writing each other's state files."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        deadline = time.monotonic() + _CLAIM_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the durable optimizer state {path!r} is being claimed by another "
                        f"optimizer (for more than {_CLAIM_WAIT_S:.0f} s); one optimizer at a "
                        "time may own it (give this one another nvme_path)") from None
                time.sleep(0.01)
            except OSError:  # a file system without flock: claims as before, unserialized
                break
        yield
    finally:
        os.close(fd)


def _claim(path: str, start_fresh: bool) -> bool:
    owner_file = os.path.join(path, "owner.json")
    if os.path.exists(owner_file):
        try:
            owner = _read_json(owner_file)
        except (OSError, ValueError):  # ChecksumError included: torn by a kill, no owner
            owner = None
        if owner is not None:
            same_host = (owner.get("host") == socket.gethostname()
                         and owner.get("pidns") == _pid_namespace())
            if not same_host or _owner_alive(int(owner["pid"]), owner.get("start_time")):
                raise RuntimeError(
                    f"the durable optimizer state {path!r} is in use by pid {owner['pid']} on "
                    f"{owner.get('host')!r}; one optimizer at a time may own it (close() the "
                    "other, or give this one another nvme_path)")
    manifest = os.path.join(path, "manifest.json")
    creating = os.path.join(path, CREATING)
    fresh = start_fresh or not os.path.exists(manifest)
    if fresh and not start_fresh and not os.path.exists(creating):
        left = _state_files(path)
        if left:  # refused before anything in the folder changes
            shown = first_names(left)
            raise ValueError(
                f"the durable optimizer state folder {path!r} holds state files ({shown}) but "
                "no manifest.json, which says which step they hold: it cannot be reopened, and "
                "it is not overwritten. Put its manifest.json back to reopen it, or pass "
                "durable='fresh' to discard these files and start a new state")
    _write_json(owner_file, _owner())
    if not fresh:
        return False
    if start_fresh:  # the manifest and intent first: without them nothing is reopened
        for name in ("manifest.json", "intent.json"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, name))
        fsync_path(path)
    # Until the first manifest commits it, the folder is a new state a kill may leave half
    # made: this marker lets the next optimizer start it again instead of refusing it.
    _write_json(creating, {"format": FORMAT})
    for name in _state_files(path):
        target = os.path.join(path, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        else:
            os.unlink(target)
    return True


def _state_files(path: str) -> list[str]:
    """The entries of a state folder other than its owner and new-state marker."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return []
    skip = {"owner.json", CREATING}
    return sorted(n for n in names if n not in skip and n.removesuffix(".tmp") not in skip)


def _write_json(path: str, body) -> None:
    """Replaces `path` whole: written beside it with a CRC-32 line, fsynced, renamed, and the
    directory fsynced, so a reader sees the old file or the new one."""
    data = json.dumps(body, sort_keys=True).encode()
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(b"%08x\n" % zlib.crc32(data) + data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:  # a full drive: say which file and how many bytes it needed
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OSError(err.errno, f"could not write {path!r} ({len(data) + 9} bytes needed): "
                      f"{err.strerror}") from err
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path))


def _read_json(path: str):
    """The body of a file _write_json wrote, None if there is none; a CRC mismatch raises."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    head, _, data = raw.partition(b"\n")
    try:
        ok = int(head, 16) == zlib.crc32(data)
    except ValueError:
        ok = False
    if not ok:
        raise ChecksumError(f"durable optimizer state file {path!r} is corrupt (its CRC-32 does "
                            "not match); the state cannot be reopened (durable='fresh' "
                            "discards it and starts a new one)")
    return json.loads(data)


def _user_stacklevel() -> int:
    """The warnings stacklevel (counted from the caller) of the first frame outside tierlift:
    the user's line that built the optimizer, however deep Adam or AdamW nest."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def layout_of(off) -> list[dict]:
    """What a durable state was written for: a reopen must find the same."""
    return [{"params": [[list(p.shape), str(p.dtype)] for p in g["params"]],
             "kinds": {k: str(off._dtypes[gi][k]) for k in off._kinds[gi]},
             "chunk_elems": off.chunk_elems, "chunks": len(off.layouts[gi].chunks),
             "generations": off.config.nvme_generations}
            for gi, g in enumerate(off.opt.param_groups)]


def read_manifest(off, directory: str) -> dict:
    """The manifest of the state in `directory`, checked against Offloader `off`'s layout."""
    m = _read_json(os.path.join(directory, "manifest.json"))
    if m is None or m.get("format") != FORMAT:
        raise ValueError(f"{directory!r} has no durable optimizer state tierlift can read; "
                         "durable='fresh' discards its files and starts a new state")
    if m["layout"] != layout_of(off):
        raise ValueError(
            f"the durable optimizer state in {directory!r} was written for other parameters "
            "or settings (shapes, dtypes, state kinds, chunk size or nvme_generations "
            "differ); build the optimizer as before, use another nvme_path, or pass "
            "durable='fresh' to discard that state")
    return m


class _Window:
    """A chunk's logged gradient of one parameter, indexed by the parameter's own element
    positions (the runner slices gradients as grads[pi][plo:phi])."""

    def __init__(self, values: torch.Tensor, shift: int):
        self.values, self.shift = values, shift

    def __getitem__(self, sl: slice) -> torch.Tensor:
        return self.values[sl.start - self.shift:sl.stop - self.shift]


class _Staged:
    """The write of one in-place chunk: its journal position first; promote() (once those
    writes are done) records it and starts the in-place writes; wait() waits for both."""

    def __init__(self, durable, tier, gi, ci, slot, bufs, crcs, handles, crc_s):
        self.durable, self.tier, self.gi, self.ci = durable, tier, gi, ci
        self.slot, self.bufs, self.crcs = slot, bufs, crcs
        self.journal, self.in_place = handles, None
        self.crc_s = crc_s

    def promote(self) -> None:
        if self.in_place is not None:
            return
        for h in self.journal:
            h.wait()
        self.durable.record(self.gi, self.ci, self.slot, self.crcs)
        self.in_place = self.tier.write_all(self.ci, self.bufs, self.tier.gen[self.ci],
                                            crcs=self.crcs)

    def wait(self) -> None:
        self.promote()
        for h in self.in_place:
            h.wait()

    def abandon(self) -> None:
        """After a failure: waits for what was started, starts nothing new."""
        for h in self.journal + (self.in_place or []):
            try:
                h.wait()
            except Exception:  # noqa: BLE001 - the caller raises the first error
                pass


class DurableState:
    def __init__(self, off, directory: str, fresh: bool):
        self.off = off
        self.dir = directory
        self.one_gen = off.config.nvme_generations == 1
        self.seq = 0
        self.first, n = [], 0
        for lay in off.layouts:
            self.first.append(n)
            n += len(lay.chunks)
        self.layout = layout_of(off)
        # Gradients are logged at the width of the group's widest parameter (a gradient has
        # its parameter's dtype); each chunk's log starts 4 KiB aligned.
        self.log_width = [max([p.element_size() for p in g["params"]] + [2])
                          for g in off.opt.param_groups]
        self.log_stride = [-(-off.chunk_elems * w // IO_ALIGN) * IO_ALIGN
                           for w in self.log_width]
        kinds = {k: b for t in off.tiers for k, b in t.kind_chunk_bytes.items()}
        self.files = {}
        if self.one_gen:
            self.files = {**{("grads", gi): (os.path.join(directory, f"g{gi}.grads"),
                                             len(lay.chunks) * self.log_stride[gi])
                             for gi, lay in enumerate(off.layouts)},
                          **{("journal", k): (os.path.join(directory, f"journal.{k}"),
                                              off.n_slots * b) for k, b in kinds.items()},
                          ("records", 0): (os.path.join(directory, "journal.records"),
                                           n * _REC_BYTES)}
        self.extra_bytes = sum(size for _, size in self.files.values())
        for path, size in self.files.values():
            if fresh:
                with open(path, "wb") as f:
                    _reserve(f.fileno(), size, path, self.extra_bytes + sum(
                        t.disk_bytes for t in off.tiers), 1)
            elif not os.path.exists(path) or os.path.getsize(path) < size:
                raise ValueError(f"durable optimizer state {directory!r} is missing {path!r} "
                                 "(or it is short); it cannot be reopened (durable='fresh' "
                                 "discards it and starts a new state)")
        self._records = None
        if self.one_gen:
            self._records = os.open(self.files[("records", 0)][0], os.O_RDWR)
        self.intent = None
        self.reopened: dict = {}  # what a reopen found: finished steps, chunks by how
        if fresh:
            self._zero_crcs()
            self.write_manifest()
            os.unlink(os.path.join(directory, CREATING))  # committed: a state from here on
        else:
            self._reopen()

    # ---- paths ---------------------------------------------------------------------------
    @property
    def _manifest_path(self) -> str:
        return os.path.join(self.dir, "manifest.json")

    @property
    def _intent_path(self) -> str:
        return os.path.join(self.dir, "intent.json")

    def close(self) -> None:
        """Gives the folder up (the state stays, for the next optimizer to reopen)."""
        if self._records is not None:
            os.close(self._records)
            self._records = None
        try:
            os.unlink(os.path.join(self.dir, "owner.json"))
        except FileNotFoundError:
            pass

    # ---- manifest ------------------------------------------------------------------------
    def _zero_crcs(self) -> None:
        """A new state's files are zeros: their CRCs, so a reopen can check every chunk."""
        zeros: dict[int, int] = {}
        for tier in self.off.tiers:
            for ci in range(len(tier.gen)):
                for k in tier.kinds:
                    n = kind_bytes(k, tier.dtypes[k], tier.used[ci])
                    if n not in zeros:
                        zeros[n] = crc32c(torch.zeros(n, dtype=torch.uint8))
                    tier.crc[(k, ci, tier.gen[ci])] = zeros[n]

    def write_manifest(self, *, unverified=(), filling: bool = False) -> None:
        """Commits what the tiers and the optimizer hold now. `unverified`: (gi, ci) whose
        master is about to be rewritten in place (a parameter's first step): their master CRC
        is left out until the next manifest."""
        off, groups = self.off, []
        for gi, group in enumerate(off.opt.param_groups):
            tier = off.tiers[gi]
            crc = sorted([k, ci, c] for (k, ci, gen), c in tier.crc.items()
                         if gen == tier.gen[ci] and not (k == "master" and (gi, ci) in unverified))
            steps = {str(pi): float(off.opt.state[p]["step"])
                     for pi, p in enumerate(group["params"])
                     if "step" in off.opt.state.get(p, {})}
            groups.append({"gen": list(tier.gen), "crc": crc, "steps": steps,
                           "in_file": sorted(off._in_file[gi])})
        _write_json(self._manifest_path, {"format": FORMAT, "seq": self.seq,
                                          "layout": self.layout, "filling": filling,
                                          "groups": groups})

    def commit(self) -> None:
        """The step's writes are durable and its counts committed: the next manifest."""
        self.seq += 1
        self.write_manifest()
        if self.intent is not None:
            self.intent = None
            os.unlink(self._intent_path)

    # ---- one generation: the step ----------------------------------------------------------
    def log_grads(self, live: list[dict], in_place: dict, stats) -> None:
        """Writes the gradients of the chunks about to be rewritten in place, syncs them, then
        the intent; from here on a reopen finishes this step."""
        off, engine = self.off, self.off._engine
        t = time.perf_counter()
        body = {"seq": self.seq + 1, "groups": {}}
        pending: dict[int, list] = {}
        i = 0
        try:
            for gi, chunks in in_place.items():
                grads, group = live[gi], off.opt.param_groups[gi]
                width = self.log_width[gi]
                for pi, g in grads.items():
                    if g.element_size() > width:
                        raise TypeError(
                            f"{off._name(gi, pi)}.grad is {g.dtype}, wider than the "
                            f"parameters of its group: durable state logs each gradient at "
                            "its parameter's width; give the gradient the parameter's dtype")
                beta1, beta2 = group["betas"]
                body["groups"][str(gi)] = {
                    "hyper": {"lr": float(group["lr"]), "betas": [float(beta1), float(beta2)],
                              "eps": float(group["eps"]),
                              "weight_decay": float(group["weight_decay"]),
                              "amsgrad": group["amsgrad"], "maximize": group["maximize"],
                              "decoupled": bool(off.opt._decoupled(group))},
                    "steps": {str(pi): s for pi, s in off.next_steps(gi, grads).items()},
                    "grad_dtypes": {str(pi): str(g.dtype).removeprefix("torch.")
                                    for pi, g in grads.items()},
                    "chunks": [c.ci for c in chunks], "grad_crcs": {}}
                for chunk in chunks:
                    for h in pending.pop(i - off.n_slots, []):
                        h.wait()
                    part = self._log_part(gi, chunk.ci, off._slots[i % off.n_slots])
                    for s in chunk.segments:
                        if s.pi in grads:
                            g = grads[s.pi][s.plo:s.phi]
                            lo = s.clo * width
                            part[lo:lo + g.nbytes].view(g.dtype).copy_(g)
                    body["groups"][str(gi)]["grad_crcs"][str(chunk.ci)] = crc32c(part)
                    pending[i] = [engine.write(part, self.files[("grads", gi)][0],
                                               chunk.ci * self.log_stride[gi])]
                    stats["grad_log_bytes"] += part.nbytes
                    i += 1
            for hs in pending.values():
                for h in hs:
                    h.wait()
            pending.clear()
            engine.sync()
            _write_json(self._intent_path, body)
        finally:
            drain(pending)  # nothing may stay in flight from the slots
        self.intent = body
        stats["grad_log_s"] += time.perf_counter() - t

    def _log_part(self, gi: int, ci: int, bufs: dict) -> torch.Tensor:
        used = self.off.tiers[gi].used[ci]
        nbytes = -(-used * self.log_width[gi] // IO_ALIGN) * IO_ALIGN
        return bufs["grad"].view(torch.uint8)[:nbytes]

    def stage(self, tier, gi: int, ci: int, slot: int, bufs: dict) -> _Staged:
        """Starts writing chunk ci's new bytes to journal position `slot`."""
        t = time.perf_counter()
        parts = [tier.part(k, ci, bufs[k]) for k in tier.kinds]
        crcs = [crc32c(p) for p in parts]
        crc_s = time.perf_counter() - t
        handles = [self.off._engine.write(p, self.files[("journal", k)][0],
                                          slot * tier.kind_chunk_bytes[k])
                   for k, p in zip(tier.kinds, parts)]
        return _Staged(self, tier, gi, ci, slot, bufs, crcs, handles, crc_s)

    def record(self, gi: int, ci: int, slot: int, crcs: list[int]) -> None:
        body = _REC.pack(_MAGIC, self.seq + 1, gi, ci, slot, len(crcs),
                         *(list(crcs) + [0] * (5 - len(crcs))))
        raw = body + struct.pack("<I", zlib.crc32(body))
        os.pwrite(self._records, raw.ljust(_REC_BYTES, b"\0"),
                  (self.first[gi] + ci) * _REC_BYTES)

    def _read_record(self, gi: int, ci: int, seq: int, n_kinds: int):
        raw = os.pread(self._records, _REC_BYTES, (self.first[gi] + ci) * _REC_BYTES)
        body, tail = raw[:_REC.size], raw[_REC.size:_REC.size + 4]
        if len(tail) < 4 or struct.unpack("<I", tail)[0] != zlib.crc32(body):
            return None  # never written, or torn: the in-place write had not started
        magic, rseq, rgi, rci, slot, n, *crcs = _REC.unpack(body)
        if magic != _MAGIC or rseq != seq or (rgi, rci, n) != (gi, ci, n_kinds):
            return None  # an earlier step's
        return slot, crcs[:n]

    # ---- reopen ----------------------------------------------------------------------------
    def _reopen(self) -> None:
        off = self.off
        m = read_manifest(off, self.dir)
        # A marker beside a manifest is stale: a kill came between the first manifest of a new
        # state and the marker's removal. Removed only now that the manifest is known good.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.dir, CREATING))
        self.seq = m["seq"]
        for gi, g in enumerate(m["groups"]):
            tier, params = off.tiers[gi], off.opt.param_groups[gi]["params"]
            tier.gen[:] = g["gen"]
            tier.crc.clear()
            for k, ci, c in g["crc"]:
                tier.crc[(k, ci, tier.gen[ci])] = c
            for pi, s in g["steps"].items():
                off.opt.state[params[int(pi)]]["step"] = torch.tensor(s, dtype=torch.float32)
            off._in_file[gi] = set(g["in_file"])
        intent = _read_json(self._intent_path) if self.one_gen else None
        if m["filling"]:
            # The interrupted load rewrote one-generation chunks in place, whole or in part:
            # their committed CRCs no longer describe them (the load that mends the state read
            # and checked them, and refused every chunk it had rewritten as corrupt). A load
            # that fails in the process drops them too; the mending load rewrites what it loads.
            for tier in off.tiers:
                for key in [key for key in tier.crc if not tier.two_gen(key[1])]:
                    del tier.crc[key]
            off._broken = (f"a checkpoint load into the durable optimizer state {self.dir!r} "
                           "was interrupted; load a checkpoint before stepping")
            return
        self.reopened = {"kept": 0, "redone": 0, "from_journal": 0}
        finish = intent is not None and intent["seq"] == self.seq + 1
        if finish:
            self._finish(intent)
        elif intent is not None:
            os.unlink(self._intent_path)  # a committed step's
        self._load_masters()
        r = self.reopened
        how = (f"; it finished the step that was interrupted ({r['kept']} chunks were rewritten "
               f"already, {r['redone']} stepped from the logged gradients, {r['from_journal']} "
               "copied from the journal)") if finish else ""
        warnings.warn(f"tierlift offload: reopened the durable optimizer state {self.dir!r} "
                      f"after {self.seq} committed steps{how}", RuntimeWarning,
                      stacklevel=_user_stacklevel())

    def _finish(self, intent: dict) -> None:
        """Brings every chunk of the interrupted step to its new bytes, then commits it. Torn
        chunks are copied from their journal positions first; only then are the chunks still
        at the committed bytes stepped from the logged gradients, each through the journal as
        in a step (which reuses journal positions), so a reopen killed half way leaves a state
        the next reopen finishes."""
        off = self.off
        redo = []
        for gis, gin in intent["groups"].items():
            for ci in gin["chunks"]:
                how = self._settle(int(gis), ci, intent["seq"])
                self.reopened[how] += 1
                if how == "redone":
                    redo.append((int(gis), gin, ci))
        off._engine.sync()
        stats, bufs = defaultdict(float), off._slots[0]
        for gi, gin, ci in redo:
            tier, chunk = off.tiers[gi], off.layouts[gi].chunks[ci]
            for k in tier.kinds:
                tier.read(k, ci, bufs[k]).wait()
                tier.verify(k, ci, bufs[k], off._what(gi, chunk))
            self._redo(gi, gin, chunk, bufs, stats)
            self.stage(tier, gi, ci, 0, bufs).wait()
        for gis, gin in intent["groups"].items():
            params = off.opt.param_groups[int(gis)]["params"]
            for pi, s in gin["steps"].items():
                off.opt.state[params[int(pi)]]["step"] = torch.tensor(float(s),
                                                                      dtype=torch.float32)
                off._in_file[int(gis)].add(int(pi))
        off._engine.sync()
        self.intent = intent
        self.commit()

    def _settle(self, gi: int, ci: int, seq: int) -> str:
        """What chunk ci of the interrupted step needs: "kept" (already rewritten), "redone"
        (still at the committed bytes: to be stepped again) or "from_journal" (torn mid-write:
        copied from its journal position here)."""
        off = self.off
        tier, bufs, gen = off.tiers[gi], off._slots[0], off.tiers[gi].gen[ci]
        what = off._what(gi, off.layouts[gi].chunks[ci])
        for k in tier.kinds:
            tier.read(k, ci, bufs[k], gen).wait()
        got = [crc32c(tier.part(k, ci, bufs[k])) for k in tier.kinds]
        rec = self._read_record(gi, ci, seq, len(tier.kinds))
        if rec is not None and got == rec[1]:
            for k, c in zip(tier.kinds, got):
                tier.crc[(k, ci, gen)] = c
            return "kept"
        if got == [tier.crc.get((k, ci, gen)) for k in tier.kinds]:
            return "redone"
        if rec is None:
            raise ChecksumError(
                f"durable optimizer state {self.dir!r} is corrupt: chunk {ci} of param group "
                f"{gi} ({what()}) matches neither the committed step nor the interrupted one, "
                "and has no journal copy")
        slot, new = rec
        for k in tier.kinds:
            off._engine.read(tier.part(k, ci, bufs[k]), self.files[("journal", k)][0],
                             slot * tier.kind_chunk_bytes[k]).wait()
        if [crc32c(tier.part(k, ci, bufs[k])) for k in tier.kinds] != new:
            raise ChecksumError(
                f"the journal of the interrupted step in {self.dir!r} is corrupt: chunk {ci} of "
                f"param group {gi} ({what()}) was torn mid-write and its journal copy does not "
                "match its CRC-32C; the state cannot be reopened")
        for h in tier.write_all(ci, bufs, gen, crcs=new):
            h.wait()
        return "from_journal"

    def _redo(self, gi: int, gin: dict, chunk, bufs: dict, stats) -> None:
        """Steps a chunk (in `bufs`, at the committed bytes) with its logged gradient and the
        interrupted step's hyperparameters and step counts."""
        off = self.off
        part = self._log_part(gi, chunk.ci, bufs)
        off._engine.read(part, self.files[("grads", gi)][0],
                         chunk.ci * self.log_stride[gi]).wait()
        if crc32c(part) != gin["grad_crcs"][str(chunk.ci)]:
            raise ChecksumError(
                f"the gradient journal {self.files[('grads', gi)][0]!r} of the interrupted step "
                f"is corrupt (chunk {chunk.ci} does not match its CRC-32C); the step cannot be "
                "finished and the state cannot be reopened")
        hyper = gin["hyper"]
        group = dict(off.opt.param_groups[gi])
        group.update(lr=hyper["lr"], betas=tuple(hyper["betas"]), eps=hyper["eps"],
                     weight_decay=hyper["weight_decay"], amsgrad=hyper["amsgrad"],
                     maximize=hyper["maximize"], decoupled_weight_decay=hyper["decoupled"])
        dtypes = {int(pi): getattr(torch, d) for pi, d in gin["grad_dtypes"].items()}
        width, grads = self.log_width[gi], {}
        for s in chunk.segments:
            if s.pi in dtypes:
                d = dtypes[s.pi]
                lo = s.clo * width
                values = part[lo:lo + (s.chi - s.clo) * d.itemsize].view(d)
                grads[s.pi] = _Window(values, s.plo)
        steps = {int(pi): int(n) for pi, n in gin["steps"].items()}
        off._step_chunk(gi, group, group["params"], grads, steps, chunk, bufs, stats,
                        publish=False)

    def _load_masters(self) -> None:
        """The parameters take the committed master weights."""
        off = self.off
        bufs = off._slots[0]
        for gi, group in enumerate(off.opt.param_groups):
            params, tier = group["params"], off.tiers[gi]
            for chunk in off.layouts[gi].chunks:
                segs = [s for s in chunk.segments if s.pi in off._in_file[gi]]
                if not segs:
                    continue
                tier.read("master", chunk.ci, bufs["master"]).wait()
                tier.verify("master", chunk.ci, bufs["master"], off._what(gi, chunk))
                for s in segs:
                    params[s.pi].detach().view(-1)[s.plo:s.phi].copy_(
                        bufs["master"][s.clo:s.chi])
