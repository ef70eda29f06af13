"""Pure-Python reference of the io kernels: CRC-32C (Castagnoli) per block of a tensor's bytes,
as tierlift._C.io.block_crc32c computes it (byte-at-a-time, reflected polynomial 0x82F63B78)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


def crc32c(data: bytes, crc: int = 0) -> int:
    table = _table()
    c = crc ^ 0xFFFFFFFF
    for b in data:
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def block_crc32c(tensor: torch.Tensor, block_bytes: int) -> list[int]:
    """CRC-32C of each block_bytes-long block of a contiguous CPU tensor's bytes."""
    raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return [crc32c(raw[i:i + block_bytes]) for i in range(0, len(raw), block_bytes)]
