"""Pure-torch references of the ZeRO flat-buffer ops (tierlift::flatten_pack_ / unflatten_)."""

from __future__ import annotations

import torch


def _check(flat: torch.Tensor, tensors, op: str) -> int:
    if flat.dim() != 1:
        raise ValueError(f"{op}: flat must be 1-D, got shape {tuple(flat.shape)}")
    total = 0
    for i, t in enumerate(tensors):
        if t.dtype != flat.dtype:
            raise TypeError(f"{op}: tensors[{i}] has dtype {t.dtype} but flat has {flat.dtype}")
        if t.device != flat.device:
            raise ValueError(f"{op}: tensors[{i}] is on {t.device} but flat is on {flat.device}")
        total += t.numel()
    if total > flat.numel():
        raise ValueError(f"{op}: tensors hold {total} elements in total but flat has only "
                         f"{flat.numel()}")
    return total


def flatten_pack_(flat: torch.Tensor, tensors) -> None:
    total = _check(flat, tensors, "flatten_pack_")
    offset = 0
    for t in tensors:
        flat[offset:offset + t.numel()].copy_(t.reshape(-1))
        offset += t.numel()
    flat[total:].zero_()


def unflatten_(flat: torch.Tensor, tensors) -> None:
    _check(flat, tensors, "unflatten_")
    offset = 0
    for t in tensors:
        t.view(-1).copy_(flat[offset:offset + t.numel()])
        offset += t.numel()
