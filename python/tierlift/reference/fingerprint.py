"""Pure-Python reference of the 64-bit content fingerprint (csrc/core/util/fingerprint.h) that
tierlift._C.io.fingerprints computes: eight 64-bit lanes over 64-byte stripes, scrambled every
1 KiB, folded into one value with the length. Slow; for tests on small inputs."""

from __future__ import annotations

import functools
import struct

import torch

_M = (1 << 64) - 1
_LANES, _STRIPE, _BLOCK = 8, 64, 16  # lanes, bytes per stripe, stripes per block
_SHIFT, _MUL = 29, 0x9E3779B1


def _mix(z: int) -> int:
    z ^= z >> 32
    z = (z * 0xD6E8FEB86659FD93) & _M
    z ^= z >> 29
    z = (z * 0xA0761D6478BD642F) & _M
    return z ^ (z >> 32)


@functools.cache
def _keys() -> dict:
    seq = [_mix((0x243F6A8885A308D3 + (i + 1) * 0x9E3779B97F4A7C15) & _M)
           for i in range(_BLOCK * _LANES + 3 * _LANES)]
    n = _BLOCK * _LANES
    return {"stripe": [seq[s * _LANES:(s + 1) * _LANES] for s in range(_BLOCK)],
            "scramble": seq[n:n + _LANES], "init": seq[n + _LANES:n + 2 * _LANES],
            "out": seq[n + 2 * _LANES:n + 3 * _LANES]}


def _fold_mul(a: int, b: int) -> int:
    r = a * b
    return (r & _M) ^ (r >> 64)


def fingerprint64(data: bytes) -> int:
    k = _keys()
    acc = list(k["init"])
    n = len(data)
    full = n // _STRIPE
    stripes = [data[i * _STRIPE:(i + 1) * _STRIPE] for i in range(full)]
    if n % _STRIPE:
        stripes.append(data[full * _STRIPE:].ljust(_STRIPE, b"\0"))
    for i, stripe in enumerate(stripes):
        d = struct.unpack("<8Q", stripe)
        key = k["stripe"][i % _BLOCK]
        for lane in range(_LANES):
            x = d[lane] ^ key[lane]
            acc[lane] = (acc[lane] + (x & 0xFFFFFFFF) * (x >> 32) + d[lane ^ 1]) & _M
        if i < full and i % _BLOCK == _BLOCK - 1:
            acc = [(((a ^ (a >> _SHIFT)) ^ s) * _MUL) & _M for a, s in zip(acc, k["scramble"])]
    out = k["out"]
    h = ((n * 0x9E3779B97F4A7C15) & _M) ^ out[0]
    for j in range(0, _LANES, 2):
        h = _fold_mul(h ^ acc[j] ^ out[j], acc[j + 1] ^ out[j + 1])
    return _mix(h ^ n)


def fingerprints(tensors: list[torch.Tensor]) -> list[int]:
    """fingerprint64 of each contiguous CPU tensor's bytes."""
    return [fingerprint64(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            for t in tensors]
