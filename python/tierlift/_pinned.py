"""Long-lived host buffers page-locked at exactly their size.

torch's pinned allocator (`pin_memory=True`) rounds every block up to a power of two for its
cache: 27 GB of one optimizer state kind would pin 32 GiB, and the two generations of a 1.1B
model's state (26.5 GB) 48 GiB. The optimizer state tiers are therefore ordinary tensors
registered with CUDA (cudaHostRegister, the extension's HostRegistration), as the ZeRO parameter
arena is. Registered memory is pinned memory to torch (`is_pinned()`), so its copies run
asynchronously like those of torch's own pinned blocks."""

from __future__ import annotations

import warnings

import torch

from tierlift import _extension

_registered = 0  # bytes this process has registered so far (what torch's host stats miss)


def register(t: torch.Tensor, registrations: list) -> None:
    """Page-locks `t`'s memory (CUDA's cudaHostRegister) until the registration appended to
    `registrations` is closed or dropped; raises where CUDA refuses."""
    global _registered
    registrations.append(_extension._C.HostRegistration(t, read_only=False))
    _registered += t.nbytes


def registered_bytes() -> int:
    """The bytes register() has page-locked in this process, in all (torch's
    host_memory_stats() counts only its own allocator's blocks)."""
    return _registered


def pinned_zeros(numel: int, dtype: torch.dtype, registrations: list) -> torch.Tensor:
    """A zeroed host tensor of `numel` elements, page-locked at its size. The registration goes
    into `registrations`, which must live as long as the tensor's memory is used for copies;
    dropping it (or close()) unpins the memory, which stays the tensor's. Where CUDA refuses
    the registration, the tensor comes from torch's pinned allocator instead (warned: it pins
    more than it holds)."""
    t = torch.zeros(numel, dtype=dtype)
    if not t.numel():
        return t
    try:
        register(t, registrations)
    except (RuntimeError, ValueError) as e:
        warnings.warn(f"tierlift: pinning {t.nbytes} bytes at their size failed ({e}); using "
                      "torch's pinned allocator, which rounds the block up to a power of two",
                      RuntimeWarning, stacklevel=3)
        del t
        return torch.zeros(numel, dtype=dtype, pin_memory=True)
    return t


__all__ = ["pinned_zeros", "register", "registered_bytes"]
