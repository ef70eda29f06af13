"""Gather reads of the NVMe parameter tier (param_nvme.py) with O_DIRECT through io_uring
(tierlift.io.IoEngine) into two aligned buffers: the shard a gather copies now and the shard it
will copy next (double buffering). The next read is issued as soon as the current shard was
copied, so it runs while the unit computes, and a gather copies from RAM instead of faulting
the mapping 4 KiB at a time on the training thread (measured on the 2-core VM: 48 MB read cold
through the mapping 26-45 ms, with O_DIRECT 8-14 ms, off the training thread).

Coherence  An O_DIRECT read writes the range's dirty page-cache pages back before it reads, so
           it sees what an optimizer wrote through the mapping. A read ahead is only used if
           nothing wrote the range after it was issued: the optimizer's step of that range
           marks it stale (stale()), and every other write (a Parameter view, load_state_dict)
           goes through this process's mapping, which the store had unmapped (MADV_DONTNEED)
           before the read was issued, so it maps pages in again: /proc/self/pagemap shows
           them. A stale or mispredicted read ahead is discarded and the shard is read again,
           synchronously. The same check lets a gather of the unit gathered last (the last
           unit of forward is the first of backward) reuse the buffer without reading.
Failures   a read error is an OSError naming the file, the unit's offset and the errno.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import time

import torch

from tierlift.io import IoEngine
from tierlift.io.engine import EngineConfig

_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_libc.mincore.restype = ctypes.c_int


def direct_io_error(path: str) -> OSError | None:
    """None if `path` can be opened with O_DIRECT, or the error if the file system does not
    support it (EINVAL: the caller falls back). Any other failure (too many open files, ...)
    is raised, naming the file: it says nothing about O_DIRECT."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC))
    except OSError as e:
        if e.errno == errno.EINVAL:
            return e
        hint = ""
        if e.errno in (errno.EMFILE, errno.ENFILE):
            import resource

            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            hint = (f"; this process has reached its limit on open files (RLIMIT_NOFILE = "
                    f"{soft}): raise it with `ulimit -n`")
        raise OSError(e.errno, f"cannot open {path!r} for direct reads: "
                               f"{os.strerror(e.errno or 0)}{hint}") from e
    return None


class _PageMap:
    """Which pages of this process's address space are mapped (/proc/self/pagemap: 8 bytes
    per page, bit 63 present, bit 62 swapped)."""

    def __init__(self):
        self._fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)

    def mapped_pages(self, address: int, nbytes: int) -> int:
        first, n = address // _PAGE, -(-nbytes // _PAGE)
        raw = os.pread(self._fd, 8 * n, 8 * first)
        entries = memoryview(raw).cast("Q")
        return sum(1 for e in entries if e >> 62)

    def close(self) -> None:
        os.close(self._fd)


def resident_pages(address: int, nbytes: int) -> int:
    """How many pages of [address, address + nbytes) of a file mapping are in the page cache."""
    n = -(-nbytes // _PAGE)
    vec = ctypes.create_string_buffer(n)
    if _libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore failed: {os.strerror(err)}")
    return sum(b & 1 for b in vec.raw)


class _Pending:
    __slots__ = ("offset", "nbytes", "handle", "index", "stale")

    def __init__(self, offset: int, nbytes: int, handle, index: int):
        self.offset, self.nbytes, self.handle, self.index = offset, nbytes, handle, index
        self.stale = False


class ShardReader:
    """Reads unit ranges of `path` (a mapped file at `base`, the mapping's address) with
    O_DIRECT. fetch() returns the bytes of one range (read ahead or read now); prefetch()
    starts the read of the range expected next. Stats: nvme_read_wait_s (time the training
    thread waited for shard reads), nvme_prefetch_hits / nvme_prefetch_misses."""

    def __init__(self, *, path: str, fd: int, base: int, slot_bytes: int, stats: dict):
        self.path = path
        self._fd = fd  # the store's (buffered) descriptor of `path`
        self.base = base
        self.slot_bytes = -(-slot_bytes // _PAGE) * _PAGE
        self.stats = stats
        for key in ("nvme_read_wait_s", "nvme_prefetch_hits", "nvme_prefetch_misses",
                    "nvme_cached_reads"):
            self.stats.setdefault(key, 0)
        self._engine: IoEngine | None = None
        self._bufs: list[torch.Tensor] = []
        self._pending: _Pending | None = None
        self._last = 0  # the buffer fetch() returned last
        self._last_range: tuple[int, int] | None = None  # and the range it holds
        self._pagemap = _PageMap()

    def _start(self) -> None:
        # A pool of exactly two slots; not page-locked: the buffers are only copied from on the
        # host (stage_in converts them into its own pinned staging buffer).
        self._engine = IoEngine(EngineConfig(pool_bytes=2 * self.slot_bytes, direct=True,
                                             block_size=1 << 20, queue_depth=32,
                                             pin_pool=False))
        self._bufs = [self._engine.pool_tensor(self.slot_bytes) for _ in range(2)]

    def _read(self, offset: int, nbytes: int, index: int):
        if self._engine is None:
            self._start()
        length = -(-nbytes // _PAGE) * _PAGE  # O_DIRECT: whole pages (the slot is padded)
        try:
            return self._engine.read(self._bufs[index][:length], self.path, offset)
        except OSError as e:
            raise self._error(e, offset) from e
        except EOFError as e:  # the engine checks the file's size before it starts
            raise self._short(offset) from e

    def _error(self, e: OSError, offset: int) -> OSError:
        return OSError(e.errno, f"reading parameter shards from {self.path!r} at offset "
                       f"{offset} failed: {os.strerror(e.errno) if e.errno else e}")

    def _short(self, offset: int) -> OSError:
        return OSError(errno.EIO, f"reading parameter shards from {self.path!r} at offset "
                       f"{offset} failed: the file ends before the shard (was it cut short?)")

    def _wait(self, pending: _Pending) -> None:
        try:
            pending.handle.wait()
        except OSError as e:
            raise self._error(e, pending.offset) from e
        except EOFError as e:
            raise self._short(pending.offset) from e

    def fetch(self, offset: int, nbytes: int) -> torch.Tensor:
        """The `nbytes` bytes at `offset` (uint8, valid until the next fetch)."""
        t0 = time.perf_counter()
        p, self._pending = self._pending, None
        hit = (p is not None and p.offset == offset and p.nbytes == nbytes and not p.stale
               and self._pagemap.mapped_pages(self.base + offset, nbytes) == 0)
        if p is not None and p.handle is not None:
            try:
                self._wait(p)  # (a discarded read must land before its buffer is reused)
            except OSError:
                if hit:
                    raise
        if hit:
            index = p.index
            self.stats["nvme_prefetch_hits"] += 1
        else:
            index = 1 - self._last
            self._wait(_Pending(offset, nbytes, self._read(offset, nbytes, index), index))
            self.stats["nvme_prefetch_misses"] += 1
        self._last = index
        self._last_range = (offset, nbytes)
        self.stats["nvme_read_wait_s"] += time.perf_counter() - t0
        return self._bufs[index][:nbytes]

    def last(self, nbytes: int) -> torch.Tensor:
        """The whole pages of what fetch() returned last (`nbytes` rounded up to a page)."""
        return self._bufs[self._last][:-(-nbytes // _PAGE) * _PAGE]

    def prefetch(self, offset: int, nbytes: int) -> None:
        """Starts reading the range due next into the buffer fetch() did not return last. The
        caller dropped the range from the page cache just before (see the coherence note)."""
        if self._pending is not None:
            if not self._pending.stale:
                return
            p, self._pending = self._pending, None
            if p.handle is not None:
                try:
                    p.handle.wait()  # (its buffer is about to be read into again)
                except (OSError, EOFError):
                    pass
        if self._last_range == (offset, nbytes):  # still in the buffer: no read
            self._pending = _Pending(offset, nbytes, None, self._last)
            return
        index = 1 - self._last
        if resident_pages(self.base + offset, nbytes) == -(-nbytes // _PAGE):
            # Wholly in the page cache (just stepped, under write-back): a copy from there is
            # cheaper than the O_DIRECT read, which would wait for the write-back first.
            t0 = time.perf_counter()
            length = -(-nbytes // _PAGE) * _PAGE
            if os.preadv(self._fd, [self._bufs[index][:length].numpy()], offset) != length:
                raise OSError(errno.EIO, f"reading parameter shards from {self.path!r} at "
                              f"offset {offset} failed: the file ends before the shard (was "
                              f"it cut short?)")
            self.stats["nvme_cached_reads"] += 1
            self.stats["nvme_read_wait_s"] += time.perf_counter() - t0
            self._pending = _Pending(offset, nbytes, None, index)
            return
        self._pending = _Pending(offset, nbytes, self._read(offset, nbytes, index), index)

    def stale(self, offset: int) -> None:
        """The range at `offset` was written (an optimizer stepped it): a read ahead of it is
        no longer valid."""
        if self._pending is not None and self._pending.offset == offset:
            self._pending.stale = True
        if self._last_range is not None and self._last_range[0] == offset:
            self._last_range = None

    def close(self) -> None:
        p, self._pending = self._pending, None
        self._last_range = None
        if p is not None and p.handle is not None:
            try:
                p.handle.wait()
            except (OSError, EOFError):
                pass
        self._bufs = []
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._pagemap is not None:
            self._pagemap.close()
            self._pagemap = None
