"""The checkpoint writer: a thread that takes staged pieces (staging.py) and chunks of held
optimizer generations (tiers.GenerationHold) in order, writes them through an io engine with
O_DIRECT, and computes every file's SHA-256 on the way (in file order, no second pass).

Files:
    TensorFile   a rank's tensor file in torch.save's format: its skeleton (torch.save with
                 skip_data, storages 4 KiB-aligned) is written first on the training thread,
                 the tensors' bytes go to their records' offsets; torch.load reads it as ever.
    RawFile      bytes written front to back (an offloaded optimizer's dense kind files).
"""

from __future__ import annotations

import collections
import hashlib
import os
import queue
import threading

import torch

from tierlift.checkpoint.staging import MIN_PIECE, Piece, Run, Staging
from tierlift.io import ChecksumError, EngineConfig, IoEngine
from tierlift.offload.layout import kind_slice
from tierlift.offload.tiers import crc32c

_ENGINE: IoEngine | None = None
_ENGINE_LOCK = threading.Lock()
_IN_FLIGHT = 8  # pieces written at once


def engine() -> IoEngine:
    """The engine checkpoint files are written with (one save writes at a time)."""
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is None or _ENGINE.closed:
            # Staging buffers are aligned as their files are (staging.Packer): the pool only
            # takes what a drive with a stricter O_DIRECT alignment needs staged again.
            _ENGINE = IoEngine(EngineConfig(queue_depth=32, pool_bytes=2 << 20))
        return _ENGINE


def close_engine() -> None:
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is not None:
            _ENGINE.close()
            _ENGINE = None


class RawFile:
    def __init__(self, path: str, size: int, create: bool = True):
        self.path, self.size = path, size
        self.sha = hashlib.sha256()
        self.pos = 0  # hashed up to here
        self.gaps: list[tuple[int, bytes]] = []  # (offset, bytes) not written by pieces
        if create:
            with open(path, "wb"):
                pass

    def hash_to(self, offset: int) -> None:
        """Hashes the skeleton bytes before `offset` (the next piece's data starts there)."""
        while self.gaps and self.gaps[0][0] < offset:
            at, data = self.gaps.pop(0)
            if at != self.pos:
                raise RuntimeError(f"{self.path}: bytes {self.pos}..{at} are never written")
            self.sha.update(data)
            self.pos += len(data)
        if self.pos != offset:
            raise RuntimeError(f"{self.path}: written out of order (at {offset}, hashed to "
                               f"{self.pos})")

    def file_offset(self, record: int | None, offset: int) -> int:
        return offset

    def hash_data(self, data: torch.Tensor) -> None:
        self.sha.update(data.numpy())
        self.pos += data.numel()

    def digest(self) -> str:
        self.hash_to(self.size)
        return self.sha.hexdigest()


class TensorFile(RawFile):
    """torch.save(tensors) in two passes: the skeleton, then the data through pieces. Pieces
    address tensor i's bytes as record i; the skeleton (and so where each record lies) is
    written by the writer thread before its first piece, not by the training thread."""

    def __init__(self, path: str, tensors: dict[str, torch.Tensor]):
        super().__init__(path, 0, create=False)
        # Fresh storages: torch.save writes a view's whole storage, and data/i must be tensor i.
        self._skeleton = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
        self.records: list[int] | None = None

    def prepare(self) -> None:
        if self.records is not None:
            return
        from torch.utils.serialization import config

        skeleton = {k: torch.empty(shape, dtype=dtype)
                    for k, (shape, dtype) in self._skeleton.items()}
        # Into a Python file: a failed write's OSError (a full drive, a file size limit) stays
        # beneath torch's own error (write_errors.py), which a path would lose.
        with open(self.path, "wb") as f, torch.serialization.skip_data(), config.patch(
                {"save.storage_alignment": 4096, "save.compute_crc32": False}):
            torch.save(skeleton, f)
        self.size = os.path.getsize(self.path)
        reader = torch._C.PyTorchFileReader(self.path)
        self.records = [reader.get_record_offset(f"data/{i}") for i in range(len(skeleton))]
        del reader
        spans = sorted((off, t.nbytes) for off, t in zip(self.records, skeleton.values()))
        with open(self.path, "rb") as f:
            at = 0
            for offset, nbytes in spans:
                self.gaps.append((at, os.pread(f.fileno(), offset - at, at)))
                at = offset + nbytes
            self.gaps.append((at, os.pread(f.fileno(), self.size - at, at)))
        self.gaps = [(a, d) for a, d in self.gaps if d]

    def file_offset(self, record: int | None, offset: int) -> int:
        self.prepare()
        return self.records[record] + offset

    def digest(self) -> str:
        self.prepare()
        return super().digest()


class Held:
    """One param group's chunks of a held generation, to be read, checked, packed densely
    (only the stepped parameters' elements) and written to the group's kind files."""

    def __init__(self, hold, kinds: list[str], outs: dict, chunks: list, dense: dict,
                 chunk_elems: int, dtypes: dict, what):
        self.hold, self.kinds, self.outs = hold, kinds, outs
        self.chunks = chunks  # [(ci, [segments of stepped parameters])]
        self.dense = dense  # kind -> pi -> offset of the parameter in the kind file (values)
        self.chunk_elems, self.dtypes, self.what = chunk_elems, dtypes, what


class Writer(threading.Thread):
    """Writes queued Pieces and Helds in order; `error` holds what failed."""

    def __init__(self, staging: Staging, files: list[RawFile]):
        super().__init__(name="tierlift-checkpoint", daemon=True)
        self.staging, self.files = staging, files
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.digests: dict[str, str] = {}
        self.written = 0
        self._inflight: collections.deque = collections.deque()
        self._holds: list = []
        self._lock = threading.Lock()
        self._closed = False  # the thread stopped: nothing queued from now on is taken
        # Set when the writer may start: at once when it must free staging for the snapshot,
        # else after it (on 2 cores, hashing and I/O beside the copy doubled the stall).
        self.go = threading.Event()

    def put(self, item) -> None:
        with self._lock:
            if not self._closed:
                self.queue.put(item)
                return
        _dispose(item, self.staging)
        raise RuntimeError("the checkpoint writer stopped") from self.error

    def finish(self) -> None:
        with self._lock:
            if not self._closed:
                self.queue.put(None)

    def run(self) -> None:
        try:
            self.go.wait()
            while True:
                item = self._next()
                if item is None:
                    break
                if isinstance(item, Piece):
                    self._write(item)
                else:
                    self._write_held(item)
            self._drain()
            eng = engine()
            eng.sync()
            for f in self.files:
                eng.forget(f.path)
                self.digests[f.path] = f.digest()
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self.error = e
            self.staging.fail(e)
            self._drain(quiet=True)
        finally:
            with self._lock:
                self._closed = True
            while True:  # what was queued after a failure (or after the end, never)
                try:
                    _dispose(self.queue.get_nowait(), self.staging)
                except queue.Empty:
                    break
            for h in self._holds:
                h.release()

    def _next(self):
        while self._inflight:  # give buffers back while the training thread fills others
            try:
                return self.queue.get_nowait()
            except queue.Empty:
                self._retire()
        return self.queue.get()

    def _retire(self, quiet: bool = False) -> None:
        handles, buf = self._inflight.popleft()
        error = None
        for h in handles:
            try:
                h.wait()
            except BaseException as e:  # noqa: BLE001 - every handle is waited for
                error = error or e
        self.staging.release(buf)
        if error is not None and not quiet:
            raise error

    def _drain(self, quiet: bool = False) -> None:
        while self._inflight:
            self._retire(quiet)

    def _acquire(self, nbytes: int) -> torch.Tensor:
        """A staging buffer, retiring this thread's own writes first where the budget is
        short (nobody else gives buffers back once the training thread is done packing)."""
        while self._inflight and self.staging.used + nbytes > self.staging.budget:
            self._retire()
        return self.staging.acquire(nbytes)

    def _submit(self, buf: torch.Tensor, runs: list[Run]) -> None:
        eng = engine()
        handles = []
        try:
            for r in runs:
                data = buf[r.lo:r.hi]
                offset = r.out.file_offset(r.record, r.offset)
                r.out.hash_to(offset)
                r.out.hash_data(data)
                handles.append(eng.write(data, r.out.path, offset))
                self.written += r.hi - r.lo
        finally:
            self._inflight.append((handles, buf))
        while len(self._inflight) > _IN_FLIGHT:
            self._retire()

    def _write(self, piece: Piece) -> None:
        for event in piece.events:
            event.synchronize()
        self._submit(piece.buf, piece.runs)

    def _write_held(self, held: Held) -> None:
        """Reads chunk k+1 (every kind) while chunk k is checked, packed and written, when the
        budget holds both; else one chunk and kind at a time."""
        self._holds.append(held.hold)
        nbytes = held.chunk_elems * 4
        ahead = self.staging.budget >= 2 * len(held.kinds) * nbytes + MIN_PIECE
        reads: collections.deque = collections.deque()
        try:
            for i, (ci, segs) in enumerate(held.chunks):
                if not ahead:  # one kind at a time: the budget holds one chunk of one kind
                    for kind in held.kinds:
                        reads.append(self._read_chunk(held, ci, nbytes, [kind]))
                        self._write_chunk(held, ci, segs, reads.popleft())
                else:
                    if not reads:
                        reads.append(self._read_chunk(held, ci, nbytes, held.kinds))
                    if i + 1 < len(held.chunks):
                        reads.append(self._read_chunk(held, held.chunks[i + 1][0], nbytes,
                                                      held.kinds))
                    self._write_chunk(held, ci, segs, reads.popleft())
                held.hold.release(ci)
        finally:
            for chunk in reads:  # an error: nothing stays in flight into staging
                _settle(chunk, self.staging)

    def _write_chunk(self, held: Held, ci: int, segs: list, reads: list) -> None:
        """Waits for the reads of chunk `ci`, checks, packs and starts writing them."""
        for i, (kind, buf, part, handle) in enumerate(reads):
            try:
                handle.wait()
                self._check(held, kind, ci, part)
                n = _pack(buf.view(held.dtypes[kind]), segs, kind)
            except BaseException:
                _settle(reads[i:], self.staging)
                raise
            first, size = segs[0], held.dtypes[kind].itemsize
            offset = (held.dense[kind][first.pi] + kind_slice(kind, first.plo, first.phi).start)
            self._submit(buf, [Run(held.outs[kind], 0, n * size, offset * size)])

    def _read_chunk(self, held: Held, ci: int, nbytes: int, kinds: list[str]) -> list:
        """Starts reading `kinds` of held chunk `ci`: [(kind, buf, part, handle)]."""
        out = []
        tier, gen = held.hold.tier, held.hold.gen[ci]
        for kind in kinds:
            buf = self._acquire(nbytes)
            try:
                part = tier.part(kind, ci, buf.view(held.dtypes[kind]))
                out.append((kind, buf, part, tier.read(kind, ci, part, gen)))
            except BaseException:
                self.staging.release(buf)
                _settle(out, self.staging)
                raise
        return out

    def _check(self, held: Held, kind: str, ci: int, part: torch.Tensor) -> None:
        gen = held.hold.gen[ci]
        want = held.hold.crc.get((kind, ci, gen))
        if want is not None and crc32c(part) != want:
            raise ChecksumError(
                f"optimizer state file {held.hold.tier.paths[(kind, gen)]!r} is corrupt: the "
                f"{kind} of {held.what(ci)} (chunk {ci}) does not match its CRC-32C")


def _pack(buf: torch.Tensor, segs: list, kind: str) -> int:
    """Moves the segments' values of `kind` in a chunk buffer to its front, in order; returns
    how many. A segment never moves right, so each copy reads bytes no earlier copy wrote."""
    at = 0
    for s in segs:
        sl = kind_slice(kind, s.clo, s.chi)
        n = sl.stop - sl.start
        if at != sl.start:
            src = buf[sl]
            buf[at:at + n].copy_(src if at + n <= sl.start else src.clone())
        at += n
    return at


def _dispose(item, staging: Staging) -> None:
    if isinstance(item, Piece):
        staging.release(item.buf)
    elif isinstance(item, Held):
        item.hold.release()


def _settle(reads: list, staging: Staging) -> None:
    """Waits for reads that will not be used (an error), then gives their buffers back."""
    for _, buf, _, handle in reads:
        try:
            handle.wait()
        except BaseException:  # noqa: BLE001 - the first error is the one raised
            pass
        staging.release(buf)
