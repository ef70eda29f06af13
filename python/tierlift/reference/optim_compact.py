"""Pure-torch reference of tierlift::adam_compact_step_ and of its state format
(csrc/core/optim/adam_compact.h): m in bf16, v as 8-bit codes against the max of each block of
256 elements. The same arithmetic, in the same order, as the C++ and CUDA kernels, so results
agree bit for bit; runs on any device.

The v code: with r = v / block_max in [0, 1], code c in 1..255 stands for the float whose bits
are (c + 761) << 20 (3 mantissa bits over the 32 binades below 1.0); code 0 is exactly zero.
Encoding rounds r's bits to the nearest code, ties to even, and never rounds a nonzero v to 0.
Relative error <= 2^-4 (+ fp32 rounding) for v >= 2^-31 * block_max. A block holding a NaN or
infinite v gets scale NaN and code 255 everywhere.
"""

from __future__ import annotations

import torch

from tierlift.reference.optim import (
    adam_scalars,
    apply_update,
    decay_and_moments,
    read_sources,
    unscale_factor,
)

BLOCK = 256
_SHIFT = 20
_BASE = 127 * 8 - 255


def scale_count(numel: int) -> int:
    return (numel + BLOCK - 1) // BLOCK


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """x flattened and zero-padded to whole blocks, as [blocks, BLOCK]."""
    flat = x.reshape(-1)
    pad = scale_count(flat.numel()) * BLOCK - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK)


def _encode(v: torch.Tensor, block_max: torch.Tensor) -> torch.Tensor:
    """Codes of fp32 v ([blocks, BLOCK]) against finite per-block maxima ([blocks, 1])."""
    u = (v / block_max).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    q = (u + 0x7FFFF + ((u >> _SHIFT) & 1)) >> _SHIFT
    codes = (q - _BASE).clamp(1, 255)
    return torch.where(v == 0, 0, codes)


def quantize_exp_avg_sq(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 v (any shape) -> (uint8 codes of v's shape, fp32 scales [ceil(numel / 256)])."""
    blocks = _blocks(v.detach().float())
    bad = (~torch.isfinite(blocks)).any(dim=1)
    vmax = blocks.amax(dim=1) if blocks.numel() else blocks.new_zeros(0)
    scales = torch.where(bad, torch.nan, vmax)
    codes = _encode(blocks, vmax[:, None])
    codes = torch.where(bad[:, None], 255, codes)
    codes = codes.reshape(-1)[: v.numel()].to(torch.uint8).view(v.shape)
    return codes, scales


def dequantize_exp_avg_sq(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 codes (any shape) and their block scales -> fp32 v of the codes' shape."""
    c = codes.reshape(-1).to(torch.int32)
    r = ((c + _BASE) << _SHIFT).view(torch.float32)
    per_element = scales.repeat_interleave(BLOCK)[: c.numel()]
    v = torch.where(c == 0, 0.0, r * per_element)
    return v.view(codes.shape)


@torch.no_grad()
def adam_compact_step_(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    exp_avg_sq_scales,
    param_copies,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    decoupled,
    maximize,
    grad_scale=None,
    refresh_from_copies=False,
    params_from=None,
    exp_avgs_from=None,
    exp_avg_sqs_from=None,
    exp_avg_sq_scales_from=None,
) -> None:
    s = adam_scalars(lr, beta1, beta2, weight_decay, step)
    hyper = dict(beta1=beta1, beta2=beta2, weight_decay=weight_decay, decoupled=decoupled,
                 maximize=maximize,
                 inv_grad_scale=unscale_factor("adam_compact_step_", grad_scale, params))
    read_sources("adam_compact_step_", params, param_copies, refresh_from_copies, params_from,
                 [("exp_avgs_from", exp_avgs, exp_avgs_from),
                  ("exp_avg_sqs_from", exp_avg_sqs, exp_avg_sqs_from),
                  ("exp_avg_sq_scales_from", exp_avg_sq_scales, exp_avg_sq_scales_from)])
    for i, p in enumerate(params):
        m = exp_avgs[i].float()
        v = dequantize_exp_avg_sq(exp_avg_sqs[i], exp_avg_sq_scales[i])
        m, v = decay_and_moments(p, grads[i], m, v, s, **hyper)
        exp_avgs[i].copy_(m.to(torch.bfloat16))
        codes, scales = quantize_exp_avg_sq(v)
        exp_avg_sqs[i].copy_(codes)
        exp_avg_sq_scales[i].copy_(scales)
        apply_update(p, m, v, s, eps, param_copies[i] if param_copies else None)
