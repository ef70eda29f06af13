"""Content fingerprints (CRC-32C of a tensor's bytes) for the two exactness rules of the
offloaded step. Version counters do not see every route that changes a tensor (GradScaler's
unscale, `.data`, numpy views), so both rules compare bytes:

* the overlap keeps a chunk it stepped during backward only if the gradients step() sees are
  the ones it used (overlap.Record);
* the offloader steps a parameter from its current value: a parameter whose bytes differ from
  what the optimizer last wrote into it has its master refreshed (ParamWatch).
"""

from __future__ import annotations

import torch

from tierlift.offload.tiers import crc32c, crc_pool


def host_bytes(t: torch.Tensor, scratch: torch.Tensor | None) -> torch.Tensor:
    """The bytes of a contiguous tensor as a CPU uint8 tensor: the tensor itself on the host,
    else copied into `scratch` (a host buffer at least as large)."""
    flat = t.reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        return flat
    out = scratch.view(torch.uint8)[:flat.numel()]
    out.copy_(flat)
    return out


def crcs(tensors: list[torch.Tensor], scratch: torch.Tensor | None = None) -> list[int]:
    """CRC-32C of each tensor's bytes; host tensors on the CRC pool's threads (the CRC releases
    the GIL), device ones one by one through `scratch`."""
    if len(tensors) > 1 and all(t.device.type == "cpu" for t in tensors):
        return list(crc_pool().map(lambda t: crc32c(host_bytes(t, None)), tensors))
    return [crc32c(host_bytes(t, scratch)) for t in tensors]


class ParamWatch:
    """Per param group, {(chunk, param index): CRC-32C} of each parameter segment as the
    optimizer last wrote it. A segment without an entry is unknown and must be compared with
    its master: every fill (load_state_dict, a checkpoint load, a reopen) forgets them all."""

    def __init__(self, n_groups: int):
        self._crc = [dict() for _ in range(n_groups)]

    def forget(self, gi: int | None = None, keys=None) -> None:
        groups = range(len(self._crc)) if gi is None else [gi]
        for g in groups:
            if keys is None:
                self._crc[g].clear()
            else:
                for k in keys:
                    self._crc[g].pop(k, None)

    def record(self, gi: int, entries: dict) -> None:
        """entries: {(ci, pi): crc} of segments the optimizer has just written."""
        self._crc[gi].update(entries)

    def known(self, gi: int, key) -> int | None:
        return self._crc[gi].get(key)


__all__ = ["ParamWatch", "crcs", "host_bytes"]
