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
    """a * b + c rounded once to fp32 (like the kernels' fused multiply-add): the fp32 product
    is exact in double, so only the final sum rounds (double rounding through fp64 can differ
    from a true FMA in rare ties; the tests allow an ulp)."""
    return (a.double() * b.double() + c.double()).float()


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
        denom = vhat.sqrt() / f32(s["bc2_sqrt"]) + f32(eps)
        p.add_(f32(s["neg_step_size"]) * m / denom)
        if param_copies:
            param_copies[i].copy_(p)
