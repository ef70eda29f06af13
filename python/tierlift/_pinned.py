"""Long-lived host buffers page-locked at exactly their size.

torch's pinned allocator (`pin_memory=True`) rounds every block up to a power of two for its
cache: 27 GB of one optimizer state kind would pin 32 GiB, and the two generations of a 1.1B
model's state (26.5 GB) 48 GiB. The optimizer state tiers are therefore ordinary tensors
registered with CUDA (cudaHostRegister, the extension's HostRegistration), as the ZeRO parameter
arena is. Registered memory is pinned memory to torch (`is_pinned()`), so its copies run
asynchronously like those of torch's own pinned blocks."""

from __future__ import annotations

import warnings
import weakref

import torch

from tierlift import _extension

_open: weakref.WeakSet = weakref.WeakSet()  # Registrations not closed yet (registered_bytes())


class Registration:
    """One cudaHostRegister of a tensor's memory (the extension's HostRegistration), open until
    close() or until it is dropped. It holds the tensor, so the memory cannot be freed (and
    reused, still registered) before it is unpinned; close() unpins it and lets the tensor go,
    which stays valid, pageable memory for whoever else holds it."""

    _host = None  # until CUDA accepted it
    _tensor = None

    def __init__(self, t: torch.Tensor, owner: str):
        self._host = _extension._C.HostRegistration(t, read_only=False, owner=owner)
        self._tensor = t
        self.nbytes = t.nbytes
        _open.add(self)

    @property
    def active(self) -> bool:
        return self._host is not None and self._host.active

    def close(self) -> None:
        """Unpins the memory (idempotent): the registration first, then the tensor."""
        host, self._host = self._host, None
        if host is not None:
            host.close()
        self._tensor = None
        _open.discard(self)

    def __del__(self):
        self.close()


def register(t: torch.Tensor, registrations: list,
             owner: str = "tierlift._pinned.register") -> None:
    """Page-locks `t`'s memory (CUDA's cudaHostRegister) until the Registration appended to
    `registrations` is closed (release()) or dropped; raises where CUDA refuses, naming
    `owner` (who asked)."""
    registrations.append(Registration(t, owner))


def release(registrations: list) -> None:
    """Unpins every registration in `registrations` and empties it (idempotent)."""
    while registrations:
        registrations.pop().close()


def registered_bytes() -> int:
    """The bytes register() holds page-locked in this process now, in all (torch's
    host_memory_stats() counts only its own allocator's blocks); closed or dropped
    registrations no longer count."""
    return sum(r.nbytes for r in list(_open) if r.active)


def pinned_zeros(numel: int, dtype: torch.dtype, registrations: list) -> torch.Tensor:
    """A zeroed host tensor of `numel` elements, page-locked at its size. The registration goes
    into `registrations`; dropping it (or release()) unpins the memory, which stays the
    tensor's. Where CUDA refuses the registration, the tensor comes from torch's pinned
    allocator instead (warned: it pins more than it holds)."""
    t = torch.zeros(numel, dtype=dtype)
    if not t.numel():
        return t
    try:
        register(t, registrations, owner="tierlift._pinned.pinned_zeros")
    except (RuntimeError, ValueError) as e:
        warnings.warn(f"tierlift: pinning {t.nbytes} bytes at their size failed ({e}); using "
                      "torch's pinned allocator, which rounds the block up to a power of two",
                      RuntimeWarning, stacklevel=3)
        del t
        return torch.zeros(numel, dtype=dtype, pin_memory=True)
    return t


__all__ = ["Registration", "pinned_zeros", "register", "registered_bytes", "release"]
