"""Content fingerprints (a 64-bit hash of a tensor's bytes, csrc/core/util/fingerprint.h) for
the two exactness rules of the offloaded step. Version counters do not see every route that
changes a tensor (GradScaler's unscale, `.data`, numpy views), so both rules compare bytes:

* the overlap keeps a chunk it stepped during backward only if the gradients step() sees are
  the ones it used (overlap.Record);
* the offloader steps a parameter from its current value: a parameter whose bytes differ from
  what the optimizer last wrote into it has its master refreshed (ParamWatch).

The fingerprints live in memory only and are compared only with each other, so they need not
be CRC-32C (which the files on disk keep): the hash runs near memory bandwidth.
"""

from __future__ import annotations

import os

import torch

from tierlift import _extension

# Threads of the kernel pool one fingerprints() call may use, as many as the CRC pool had.
THREADS = min(4, os.cpu_count() or 1)


def host_bytes(t: torch.Tensor, scratch: torch.Tensor | None) -> torch.Tensor:
    """The bytes of a contiguous tensor as a CPU uint8 tensor: the tensor itself on the host,
    else copied into `scratch` (a host buffer at least as large)."""
    flat = t.reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        return flat
    out = scratch.view(torch.uint8)[:flat.numel()]
    out.copy_(flat)
    return out


_U64 = (1 << 64) - 1


def fingerprints(tensors: list[torch.Tensor], scratch: torch.Tensor | None = None) -> list[int]:
    """The 64-bit content fingerprint of each tensor's bytes: host tensors in one call without
    the GIL, CUDA tensors by one kernel per device (csrc/cuda/fingerprint.cu: the value the host
    gives for the same bytes), without copying them down. Device tensors of an extension built
    without CUDA go one by one through `scratch`."""
    fp = _extension._C.io.fingerprints
    if all(t.device.type == "cpu" for t in tensors):
        return fp([host_bytes(t, None) for t in tensors], THREADS)
    out: list = [None] * len(tensors)
    host = [i for i, t in enumerate(tensors) if t.device.type == "cpu"]
    for i, v in zip(host, fp([host_bytes(tensors[i], None) for i in host], THREADS)):
        out[i] = v
    by_device: dict = {}
    for i, t in enumerate(tensors):
        if t.device.type != "cpu":
            by_device.setdefault(t.device, []).append(i)
    for device, idx in by_device.items():
        if device.type == "cuda" and hasattr(_extension._C.io, "fingerprints_device"):
            for i, v in zip(idx, _on_cuda([tensors[i] for i in idx], device)):
                out[i] = v
        else:
            for i in idx:
                out[i] = fp([host_bytes(tensors[i], scratch)])[0]
    return out


def _on_cuda(tensors: list[torch.Tensor], device: torch.device) -> list[int]:
    """fingerprints of CUDA tensors on `device`, in the order of the current stream there: one
    kernel over all of them, and 8 bytes each read back."""
    flat = [t.reshape(-1).view(torch.uint8) for t in tensors]  # kept alive until read back
    table = torch.tensor([[f.data_ptr(), f.numel()] for f in flat], dtype=torch.int64)
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        table = table.to(device)
        values = torch.empty(len(flat), dtype=torch.int64, device=device)
        _extension._C.io.fingerprints_device(table, values, stream.cuda_stream)
        return [v & _U64 for v in values.tolist()]


def fingerprints_finite(tensors: list[torch.Tensor]) -> tuple[list[int], list[bool]]:
    """(fingerprints, finite) of contiguous float CPU tensors in one pass over their bytes:
    the fingerprint of each (as fingerprints() gives) and whether all its values are finite."""
    return _extension._C.io.fingerprints_finite([t.reshape(-1) for t in tensors], THREADS)


def copy_checked(groups: list[list[tuple]]) -> list[list[int] | None]:
    """groups: [[(dst, src, want)]] of contiguous CPU tensors of equal bytes. Per group, all or
    nothing in one pass: if every dst whose `want` is not None still has that fingerprint,
    copies each src into its dst and gives the fingerprints of the copied bytes, else copies
    nothing of the group (None)."""
    return _extension._C.io.copy_checked(
        [[(host_bytes(d, None), host_bytes(s, None), w) for d, s, w in g] for g in groups],
        THREADS)


class ParamWatch:
    """Per param group, {(chunk, param index): fingerprint} of each parameter segment as the
    optimizer last wrote it. A segment without an entry is unknown and must be compared with
    its master: every fill (load_state_dict, a checkpoint load, a reopen) forgets them all."""

    def __init__(self, n_groups: int):
        self._seen = [dict() for _ in range(n_groups)]

    def forget(self, gi: int | None = None, keys=None) -> None:
        groups = range(len(self._seen)) if gi is None else [gi]
        for g in groups:
            if keys is None:
                self._seen[g].clear()
            else:
                for k in keys:
                    self._seen[g].pop(k, None)

    def record(self, gi: int, entries: dict) -> None:
        """entries: {(ci, pi): fingerprint} of segments the optimizer has just written."""
        self._seen[gi].update(entries)

    def known(self, gi: int, key) -> int | None:
        return self._seen[gi].get(key)


__all__ = ["ParamWatch", "copy_checked", "fingerprints", "fingerprints_finite", "host_bytes"]
