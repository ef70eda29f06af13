"""Host buffers of the RAM tier for CPU tensors, reused by size from one step to the next.

A training step saves the same tensor sizes every time; a fresh buffer each time costs the
page faults of new memory (measured on the CPU bench: about as much as the copy itself), a
reused one does not. A buffer comes back when autograd drops its saved tensor, and only if no
view of it is alive (its storage has no other user), so a tensor autograd still holds is never
overwritten. At most `limit` bytes wait unused (cpu_budget: the tier may hold that much anyway).
GPU tensors use pinned memory from torch's caching host allocator instead, which orders reuse
after the copies that read a buffer.

The pool also keeps cpu_budget's account, for GPU and CPU tensors alike: the bytes in the RAM
tier over every forward of one offload alive at once (micro-batches in one context, forwards of
separate contexts or of offload_blocks before their backwards), so together they hold at most
cpu_budget, not cpu_budget each.
"""

from __future__ import annotations

import threading
import weakref

import torch


def _users(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class HostPool:
    def __init__(self, limit: int):
        self.limit = limit
        self.cached = 0
        self.held = 0  # bytes of saved tensors in the RAM tier, over every forward
        self._free: dict[int, list[torch.Tensor]] = {}
        self._alone: int | None = None  # the use count of a buffer nothing else refers to
        # Forwards in two threads; buffers come back from any thread, also from a collection
        # inside get() (hence re-entrant).
        self._lock = threading.RLock()

    def reserve(self, nbytes: int) -> bool:
        """Whether cpu_budget has room for `nbytes` more (then counted as held)."""
        with self._lock:
            if self.held + nbytes > self.limit:
                return False
            self.held += nbytes
            return True

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes

    def get(self, nbytes: int, owner) -> tuple[torch.Tensor, weakref.finalize]:
        """A buffer of `nbytes`, handed back to the pool when `owner` is collected or when the
        returned finalizer is called (whichever comes first)."""
        with self._lock:
            free = self._free.get(nbytes)
            buf = free.pop() if free else None
            if buf is not None:
                self.cached -= nbytes
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            if self._alone is None:
                self._alone = _users(buf)
        return buf, weakref.finalize(owner, self._put, buf)

    def _put(self, buf: torch.Tensor) -> None:
        n = buf.numel()
        with self._lock:
            if _users(buf) != self._alone or self.cached + n > self.limit:
                return  # a view is alive (or the pool is full): let it go
            self._free.setdefault(n, []).append(buf)
            self.cached += n

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.cached = 0
