"""Pure-torch reference of tierlift::adam_step_: the same arithmetic, in the same order, as
csrc/core/optim/adam_impl.h, written with ordinary fp32 tensor ops (runs on any device)."""

from __future__ import annotations

import math

import torch


def adam_scalars(lr, beta1, beta2, weight_decay, step):
    """Per-step scalars in double precision, as torch's single-tensor Adam computes them."""
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    return {
        "decay": 1.0 - lr * weight_decay,
        "neg_step_size": -(lr / bc1),
        "bc2_sqrt": math.sqrt(bc2),
    }


def _fma(a, b, c):
    """a * b + c rounded once to fp32, like the kernels' fused multiply-add. The fp32 product is
    exact in double and the double sum's rounding error is recovered exactly (TwoSum); that error
    matters only when the double sum sits exactly halfway between two floats, where it says
    which way the exact sum lies (rounding the double sum alone would tie to even)."""
    x, y = a.double() * b.double(), c.double()
    s = x + y
    t = s - x
    err = (x - (s - t)) + (y - t)
    f = s.float()
    toward = torch.where(s > f.double(), torch.inf, -torch.inf).float()
    other = torch.nextafter(f, toward)
    tie = (s != f.double()) & ((s - f.double()).abs() == (other.double() - s).abs())
    up = torch.maximum(f, other)
    down = torch.minimum(f, other)
    exact = torch.where(err > 0, up, down)
    return torch.where(tie & (err != 0), exact, f)


def _sqrt(x):
    """fp32 sqrt rounded correctly, as the kernels' (torch's vectorized CPU sqrt can be an ulp
    off); through double, where rounding twice cannot change a square root's fp32 result."""
    return x.double().sqrt().float()


@torch.no_grad()
def adam_step_(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    param_copies,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    decoupled,
    amsgrad,
    maximize,
) -> None:
    s = adam_scalars(lr, beta1, beta2, weight_decay, step)
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # round a Python float like C++ does
    for i, p in enumerate(params):
        g = grads[i].float()
        if maximize:
            g = -g
        if decoupled:
            p.mul_(f32(s["decay"]))
        elif weight_decay != 0:
            g = _fma(f32(weight_decay), p, g)
        m, v = exp_avgs[i], exp_avg_sqs[i]
        m.copy_(_fma(f32(1.0 - beta1), g - m, m))
        v.mul_(f32(beta2)).add_(f32(1.0 - beta2) * g * g)
        vhat = v
        if amsgrad:
            torch.maximum(max_exp_avg_sqs[i], v, out=max_exp_avg_sqs[i])
            vhat = max_exp_avg_sqs[i]
        denom = _sqrt(vhat) / f32(s["bc2_sqrt"]) + f32(eps)
        p.add_(f32(s["neg_step_size"]) * m / denom)
        if param_copies:
            param_copies[i].copy_(p)
