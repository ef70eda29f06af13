"""The host memory a save copies its snapshot into, within an explicit byte budget.

Staging hands out 4 KiB-aligned uint8 buffers (pinned when a GPU is present, so device-to-host
copies are asynchronous and the drive reads them with O_DIRECT in place) and blocks a caller
whose buffer would pass the budget until the writer gives one back. Freed buffers are kept for
the next save: first-touching gigabytes of fresh memory would cost about as much as the copy.

Packer, on the training thread, copies tensors into such buffers ("pieces") and queues each
full piece for the writer with the file ranges it holds. With a budget smaller than the
snapshot it waits for the writer between pieces: the training thread is blocked until all but
the last budget's worth of bytes are on the drive.

A GPU tensor's device-to-host copy is queued on its device's current stream; each piece
carries an event per device it copied from, and settle() waits for them all before save()
returns: a stream ordering alone would not stop a kernel on another stream, another thread or
another device from changing a tensor before its copy ran (a torn checkpoint).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

ALIGN = 4096
MIN_PIECE = 64 << 10
MAX_PIECE = 16 << 20

_FREE: dict[tuple[int, bool], list[torch.Tensor]] = {}  # kept across saves
_FREE_LOCK = threading.Lock()


def piece_bytes(budget: int) -> int:
    """Pieces of a quarter of the budget (several in flight), 64 KiB to 16 MiB."""
    return max(MIN_PIECE, min(MAX_PIECE, budget // 4 // ALIGN * ALIGN))


def _aligned(nbytes: int, pin: bool) -> torch.Tensor:
    if pin:  # page-aligned as a rule; nbytes + ALIGN would be rounded up to 2x when pinned
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % ALIGN == 0:
            return raw
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + nbytes]


def _cuda_device(t: torch.Tensor) -> torch.device | None:
    """The device on whose current stream a copy from `t` is queued (None: a host tensor)."""
    return t.device if t.device.type == "cuda" else None


def free_cached() -> None:
    """Gives the kept buffers back to the allocator."""
    with _FREE_LOCK:
        _FREE.clear()


class Staging:
    def __init__(self, budget: int, pin: bool):
        self.budget = budget
        self.pin = pin
        self.used = 0
        self.peak = 0
        self._cv = threading.Condition()
        self.failed: BaseException | None = None  # the writer died: wake and raise

    def acquire(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.budget:
            raise ValueError(f"staging_budget={self.budget} bytes is smaller than one piece of "
                             f"this save ({nbytes} bytes); the smallest budget that works is "
                             f"{nbytes} bytes")
        with self._cv:
            while self.used + nbytes > self.budget and self.failed is None:
                self._cv.wait()
            if self.failed is not None:
                raise RuntimeError("the checkpoint writer failed") from self.failed
            self.used += nbytes
            self.peak = max(self.peak, self.used)
        with _FREE_LOCK:
            cached = _FREE.get((nbytes, self.pin))
            if cached:
                return cached.pop()
        return _aligned(nbytes, self.pin)

    def release(self, buf: torch.Tensor) -> None:
        with _FREE_LOCK:
            _FREE.setdefault((buf.numel(), self.pin), []).append(buf)
        with self._cv:
            self.used -= buf.numel()
            self._cv.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cv:
            self.failed = error
            self._cv.notify_all()


@dataclass
class Run:
    """Bytes [lo, hi) of a piece go to `offset` of file `out` (of its record `record`, for a
    file whose records are placed by the writer)."""

    out: object
    lo: int
    hi: int
    offset: int
    record: int | None = None


@dataclass
class Piece:
    buf: torch.Tensor
    runs: list[Run] = field(default_factory=list)
    events: list = field(default_factory=list)  # CUDA events, one per device copied from
    fill: int = 0


class Packer:
    """Copies tensors' bytes into staging pieces on the training thread and queues them."""

    def __init__(self, staging: Staging, put, size: int):
        self.staging, self.put, self.size = staging, put, size
        self.piece: Piece | None = None
        self.devices: set[torch.device] = set()  # copied from into the open piece
        self.last: dict[torch.device, object] = {}  # device -> its latest event (settle())

    def add(self, out, tensor: torch.Tensor, offset: int, record: int | None = None) -> None:
        """Queues `tensor`'s bytes (any device, any layout) for `offset` of file `out` (of its
        record `record`). Memory is aligned as the offset within the record is."""
        src = tensor.detach().reshape(-1).view(torch.uint8) if tensor.numel() else None
        n, pos = (src.numel() if src is not None else 0), 0
        while pos < n:
            if self.piece is None or self.piece.fill == self.size:
                self.flush()
                self.piece = Piece(self.staging.acquire(self.size))
            p = self.piece
            last = p.runs[-1] if p.runs else None
            merge = last is not None and last.out is out and last.record == record and \
                last.hi == p.fill and last.offset + last.hi - last.lo == offset + pos
            if not merge:  # memory aligned as the file is: the drive takes it in place
                pad = (offset + pos - p.fill) % ALIGN
                if p.fill + pad >= self.size:
                    p.fill = self.size
                    continue
                p.fill += pad
            take = min(n - pos, self.size - p.fill)
            device = _cuda_device(src)
            p.buf[p.fill:p.fill + take].copy_(src[pos:pos + take],
                                                  non_blocking=device is not None)
            if device is not None:  # queued on the current stream of src's device
                self.devices.add(device)
            if merge:
                last.hi += take
            else:
                p.runs.append(Run(out, p.fill, p.fill + take, offset + pos, record))
            p.fill += take
            pos += take

    def flush(self) -> None:
        if self.piece is not None and self.piece.runs:
            for device in self.devices:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                self.piece.events.append(event)
                self.last[device] = event
            self.devices = set()
            self.put(self.piece)
        elif self.piece is not None:
            self.staging.release(self.piece.buf)
        self.piece = None

    def settle(self) -> None:
        """Waits until every device-to-host copy queued so far is done: from then on the
        tensors may change on any stream without changing the snapshot. Call after flush()."""
        for event in self.last.values():
            event.synchronize()
        for device in self.devices:  # copies into a piece never flushed (a failed snapshot)
            torch.cuda.current_stream(device).synchronize()
        self.last, self.devices = {}, set()
