"""Reference of tierlift.zero.quant_comm: what every rank holds after the blockwise-quantized
all-reduce, computed from all ranks' inputs in one process, one block at a time in numpy.

Blocks are independent, so quantizing whole vectors and summing them gives the same bits as the
collective's chunked exchange: rank r's chunk is a whole number of blocks, and the fp32 sum is
taken value by value in rank order 0..W-1 either way. e4m3 rounding uses torch's float8_e4m3fn
cast of a CPU tensor (round to nearest even) as its primitive."""

from __future__ import annotations

import numpy as np
import torch

QMAX = {"int8": np.float32(127.0), "fp8": np.float32(448.0)}


def quantize_dequantize(x: torch.Tensor, mode: str, block: int = 256) -> torch.Tensor:
    """code * scale for every value of a 1-D fp32 x (length a multiple of block)."""
    values = _as_float32(x)
    if mode not in QMAX or block <= 0 or values.size % block:
        raise ValueError(f"bad mode {mode!r} or block {block} for {values.size} values")
    return torch.from_numpy(_fake_quantize(values, mode, block))


def quantized_all_reduce(inputs: list[torch.Tensor], mode: str, block: int = 256) -> torch.Tensor:
    """The fp32 vector every rank ends with, given each rank's input (in rank order)."""
    vectors = [_as_float32(x) for x in inputs]
    n = vectors[0].size
    if any(v.size != n for v in vectors):
        raise ValueError("every rank must contribute a vector of the same length")
    world = len(vectors)
    if world == 1:
        return torch.from_numpy(vectors[0].copy())  # a world of one sends nothing
    span = world * block
    padded = -(-n // span) * span
    total = None
    for v in vectors:
        received = _fake_quantize(np.pad(v, (0, padded - n)), mode, block)
        total = received if total is None else total + received
    return torch.from_numpy(_fake_quantize(total, mode, block)[:n].copy())


def _as_float32(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().reshape(-1).to(torch.float32).numpy().copy()


def _fake_quantize(values: np.ndarray, mode: str, block: int) -> np.ndarray:
    out = np.empty_like(values)
    for start in range(0, values.size, block):
        out[start:start + block] = _fake_quantize_block(values[start:start + block], mode)
    return out


def _fake_quantize_block(values: np.ndarray, mode: str) -> np.ndarray:
    if not np.isfinite(values).all():
        return np.full_like(values, np.nan)  # scale NaN, codes 0: the block reads as NaN
    scale = np.float32(np.abs(values).max() / QMAX[mode])
    if scale == 0:
        return np.zeros_like(values)  # all zeros, or too tiny for a nonzero fp32 scale
    scaled = np.clip(values / scale, -QMAX[mode], QMAX[mode])
    codes = _round_int8(scaled) if mode == "int8" else _round_e4m3(scaled)
    return (codes * scale).astype(np.float32)


def _round_int8(scaled: np.ndarray) -> np.ndarray:
    # np.rint rounds half to even; going through int8 turns a rounded -0.0 into +0.0 as the
    # int8 codes do.
    return np.rint(scaled).astype(np.int8).astype(np.float32)


def _round_e4m3(scaled: np.ndarray) -> np.ndarray:
    codes = torch.from_numpy(np.ascontiguousarray(scaled)).to(torch.float8_e4m3fn)
    return codes.to(torch.float32).numpy()
