"""IoEngine: non-blocking tensor reads and writes to files through tierlift._C.io.Engine.

Requests are split into `block_size` blocks and kept `queue_depth` deep in flight; with a list
of paths the blocks are striped across them (one path per drive, RAID-0 style).

The engine reads and writes with O_DIRECT. Memory aligned to what the file's O_DIRECT needs
(the kernel says, through statx: often 4 bytes on NVMe, 512 on virtio disks) goes to the drive in
place; other memory, such as an ordinary tensor from torch's 64-byte-aligned allocator on a
512-byte device, is staged block by block through the engine's aligned buffer pool, whose size is
the explicit `pool_bytes` budget; each block holds a pool buffer only while it is in flight, so a
request of any size streams through it. With io_uring the staging copies run on a few copier
threads (`copy_threads`), never on the thread that drives the ring. `pool_tensor()` hands out
aligned (and, with a GPU, pinned) tensors from that pool that always go to the disk without a
copy.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierlift import _extension

PathArg = str | os.PathLike | Sequence[str | os.PathLike]


@dataclass(kw_only=True)
class EngineConfig:
    """Engine settings. backend: auto (io_uring if usable, else threads with a warning; the
    TIERLIFT_IO_BACKEND env var can force one), uring or threads."""

    backend: str = "auto"
    queue_depth: int = 32
    block_size: int = 1 << 20
    pool_bytes: int = 64 << 20
    direct: bool = True
    sqpoll: bool = False
    # Threads that copy staged blocks into and out of the pool (io_uring backend; the thread
    # backend's workers copy their own). 0: TIERLIFT_IO_COPY_THREADS, else 2 to 4 by core count.
    copy_threads: int = 0
    pin_pool: bool = True  # page-lock the pool with cudaHostRegister when a GPU is present

    def __post_init__(self):
        if self.backend not in ("auto", "uring", "threads"):
            raise ValueError(f"backend must be 'auto', 'uring' or 'threads', got {self.backend!r}")
        if not 1 <= self.queue_depth <= 4096:
            raise ValueError(f"queue_depth must be in [1, 4096], got {self.queue_depth}")
        if self.block_size <= 0 or self.block_size % 4096:
            raise ValueError(
                f"block_size must be a positive multiple of 4096, got {self.block_size}")
        if self.pool_bytes <= 0:
            raise ValueError(f"pool_bytes must be > 0, got {self.pool_bytes}")
        if not 0 <= self.copy_threads <= 256:
            raise ValueError(f"copy_threads must be in [0, 256], got {self.copy_threads}")


def _paths(path: PathArg, what: str = "path") -> list[str]:
    if isinstance(path, str | os.PathLike):
        return [os.fspath(path)]
    paths = [os.fspath(p) for p in path]
    if not paths:
        raise ValueError(f"{what} must name at least one file")
    return paths


def _file_ends(paths: list[str], offset: int, nbytes: int, block: int) -> dict[str, int]:
    """How long each file must be for a request of `nbytes` at `offset`: with several paths,
    block k of the request's logical range lies in path k % N at (k // N) * block."""
    if len(paths) == 1:
        return {paths[0]: offset + nbytes}
    n, end = len(paths), offset + nbytes
    last = (end - 1) // block
    ends: dict[str, int] = {}
    for k in range(max(offset // block, last - n + 1), last + 1):  # each path's last block
        stop = (k // n) * block + min(end, (k + 1) * block) - k * block
        ends[paths[k % n]] = max(ends.get(paths[k % n], 0), stop)
    return ends


def _check_tensor(tensor, what: str = "tensor") -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{what} must be a CPU tensor, got device {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous (call .contiguous())")


class IoHandle:
    """One request in flight. Holds its tensor so the memory outlives the I/O."""

    def __init__(self, request, tensor: torch.Tensor):
        self._request = request
        self.tensor = tensor

    def done(self) -> bool:
        return self._request.done()

    def wait(self) -> torch.Tensor:
        """Blocks until the request is finished (the GIL is released); raises OSError (errno,
        path and offset in the message) or EOFError on failure. Returns the tensor."""
        self._request.wait()
        return self.tensor


class IoEngine:
    """Asynchronous tensor <-> file engine. Use as a context manager or call close().

    `pool_pinned`: whether the pool is page-locked (pin_pool with a GPU, granted by CUDA);
    `pool_pin_error`: CUDA's reason where it refused (else "")."""

    def __init__(self, config: EngineConfig | None = None):
        _extension.require("extension")
        self.config = config if config is not None else EngineConfig()
        c = self.config
        # page-lock the pool so H2D/D2H copies from pool tensors are asynchronous
        pin = c.pin_pool and torch.cuda.is_available()
        self._engine = _extension._C.io.Engine(
            backend=c.backend, queue_depth=c.queue_depth, block_size=c.block_size,
            pool_bytes=c.pool_bytes, direct=c.direct, sqpoll=c.sqpoll,
            copy_threads=c.copy_threads, pin=pin)
        self.pool_pinned = self._engine.pool_pinned
        self.pool_pin_error = self._engine.pin_error
        if pin and not self.pool_pinned:  # still correct, but slower: say so, once
            warnings.warn(
                f"tierlift IoEngine: page-locking its {c.pool_bytes}-byte staging pool failed "
                f"({self.pool_pin_error}); the pool stays pageable, so copies between its "
                "tensors and the GPU block the host (CUDA stages them through a pinned buffer "
                "of its own) instead of running asynchronously", RuntimeWarning, stacklevel=2)

    @property
    def backend(self) -> str:
        """'io_uring' or 'threads'."""
        return self._engine.backend

    @property
    def closed(self) -> bool:
        return self._engine.closed

    def _check_open(self, op: str) -> None:
        if self._engine.closed:
            raise RuntimeError(f"IoEngine.{op}() called after close()")

    def read(self, tensor: torch.Tensor, path: PathArg, offset: int = 0) -> IoHandle:
        """Starts reading tensor.nbytes bytes at `offset` of `path` into `tensor`. A file
        shorter than the read needs raises EOFError (its size and the size needed) before
        anything is read into `tensor`."""
        self._check_open("read")
        _check_tensor(tensor)
        paths = _paths(path)
        self._check_size(paths, int(offset), tensor.numel() * tensor.element_size())
        return IoHandle(self._engine.read(tensor, paths, int(offset)), tensor)

    def _check_size(self, paths: list[str], offset: int, nbytes: int) -> None:
        # Refused up front: the engine would only find the end mid-read, the tensor half filled.
        if nbytes <= 0 or offset < 0:
            return  # the engine names what is wrong with a negative offset
        for p, need in _file_ends(paths, offset, nbytes, self.config.block_size).items():
            try:
                size = os.stat(p).st_size
            except OSError:
                continue  # the engine's open raises it, errno and path kept
            if size < need:
                raise EOFError(f"read of {p!r} past its end: the file has {size} bytes, the read "
                               f"of {nbytes} bytes at offset {offset} needs {need} (was the file "
                               "cut short, or written with another shape?); nothing was read")

    def write(self, tensor: torch.Tensor, path: PathArg, offset: int = 0) -> IoHandle:
        """Starts writing tensor's bytes at `offset` of `path` (created 0600 if missing)."""
        self._check_open("write")
        _check_tensor(tensor)
        return IoHandle(self._engine.write(tensor, _paths(path), int(offset)), tensor)

    def sync(self) -> None:
        """Waits for every request in flight and flushes written files to the device."""
        self._check_open("sync")
        self._engine.sync()

    def forget(self, path: str | os.PathLike) -> None:
        """Closes the engine's cached descriptors of `path` (after a rename or unlink)."""
        self._check_open("forget")
        self._engine.forget(os.fspath(path))

    def pool_tensor(self, nbytes: int, *, block: bool = True) -> torch.Tensor | None:
        """A 4 KiB-aligned uint8 tensor from the budgeted pool (pinned when a GPU is present);
        None if block=False and the budget is used up. Freed tensors return to the pool."""
        self._check_open("pool_tensor")
        return self._engine.pool_acquire(int(nbytes), block)

    @property
    def pool_in_use(self) -> int:
        return self._engine.pool_in_use

    @property
    def path_bytes(self) -> dict[str, int]:
        """Bytes requested so far by path: 'direct' (O_DIRECT in place), 'staged' (O_DIRECT
        through the pool) and 'buffered' (page cache: tails below the drive's direct-I/O size,
        file systems without O_DIRECT, staging that found the pool full)."""
        return dict(self._engine.path_bytes)

    def close(self) -> None:
        """Waits for requests in flight, then releases the ring, threads and files."""
        if not self._engine.closed:
            self._engine.close()

    def __enter__(self) -> IoEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
