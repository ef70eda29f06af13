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


def _f32(x):
    """A Python float rounded to fp32, as C++ rounds a double."""
    return torch.tensor(x, dtype=torch.float32)


def unscale_factor(op, grad_scale, params):
    """The checks of the kernels' grad_scale argument (csrc/torch/adam_common.h), then the fp32
    factor GradScaler.unscale_ multiplies by: 1 / scale in double, rounded to fp32; None without
    a scale."""
    if grad_scale is None:
        return None
    if grad_scale.dtype != torch.float32:
        raise TypeError(f"{op}: grad_scale must be float32, got {grad_scale.dtype}")
    if grad_scale.numel() != 1 or grad_scale.layout != torch.strided:
        raise ValueError(f"{op}: grad_scale must be a dense 1-element tensor, got "
                         f"{grad_scale.numel()} elements")
    if params and grad_scale.device != params[0].device:
        raise ValueError(f"{op}: grad_scale is on {grad_scale.device} but params[0] is on "
                         f"{params[0].device}; put the scale on the params' device")
    scale = float(grad_scale.item())
    inv = _f32(1.0 / scale) if scale > 0 and math.isfinite(scale) else None
    if inv is None or not math.isfinite(inv.item()):
        raise ValueError(f"{op}: grad_scale must be finite and > 0, got {scale}")
    return inv


def decay_and_moments(p, grad, m, v, s, *, beta1, beta2, weight_decay, decoupled, maximize,
                      inv_grad_scale=None):
    """adam_impl.h's decay_and_moments on one tensor, shared by both state layouts: decays the
    fp32 weight `p` in place (AdamW) and returns the new fp32 moments (m, v), computed from the
    old fp32 `m` and `v` out of place. `s` is adam_scalars' dict."""
    g = grad.float()
    if inv_grad_scale is not None:  # AMP: GradScaler.unscale_'s multiply, rounded to fp32
        g = g * inv_grad_scale.to(g.device)
    if maximize:
        g = -g
    if decoupled:
        p.mul_(_f32(s["decay"]))
    elif weight_decay != 0:
        g = _fma(_f32(weight_decay), p, g)
    m = _fma(_f32(1.0 - beta1), g - m, m)
    v = v * _f32(beta2) + _f32(1.0 - beta2) * g * g
    return m, v


def apply_update(p, m, vhat, s, eps, param_copy) -> None:
    """adam_impl.h's apply_update: steps `p` in place with the new fp32 m and v (or its running
    max), then writes the new weight into `param_copy` unless it is None."""
    denom = _sqrt(vhat) / _f32(s["bc2_sqrt"]) + _f32(eps)
    p.add_(_f32(s["neg_step_size"]) * m / denom)
    if param_copy is not None:
        param_copy.copy_(p)


_INTS = {4: torch.int32, 2: torch.int16}


def _refresh(params, param_copies) -> None:
    """The ops' refresh_from_copies: each element of a param whose copy is not the param rounded
    to the copy's dtype (bit for bit, as apply_update writes it) takes the copy's value (the
    model weight was changed outside the optimizer)."""
    for p, c in zip(params, param_copies):
        ints = _INTS[c.element_size()]
        same = p.to(c.dtype).view(ints) == c.view(ints)
        p.copy_(torch.where(same, p, c.float()))


def read_sources(op, params, param_copies, refresh_from_copies, params_from, state_sources):
    """What both Adam ops do before their arithmetic, refusing before anything changes.

    The out-of-place sources (`*_from`): params_from, then each (name, state list, sources) of
    `state_sources`; a given list has one tensor per param, read in place of the state tensor
    beside it. Stepping a copy of the source in place is the same arithmetic, so each source is
    copied into its state tensor first (the sources are not changed); a source that is the state
    tensor itself needs nothing. Then refresh_from_copies, which rewrites params in place from
    their copies and so cannot be combined with params_from."""
    if refresh_from_copies and params_from is not None:
        raise ValueError(f"{op}: refresh_from_copies updates params in place; it cannot be "
                         "combined with params_from")
    if refresh_from_copies and not param_copies:
        raise ValueError(f"{op}: refresh_from_copies=True needs param_copies (one per param)")
    if param_copies and len(param_copies) != len(params):  # as the compiled ops refuse it
        raise ValueError(f"{op}: param_copies must be empty or one per param, got "
                         f"{len(param_copies)} for {len(params)}")
    pairs = [("params_from", params, params_from), *state_sources]
    for name, state, sources in pairs:
        if sources is not None and len(sources) != len(state):
            raise ValueError(f"{op}: {name} must be None or hold one tensor per param, got "
                             f"{len(sources)} for {len(state)}")
    for _, state, sources in pairs:
        for dst, src in zip(state, sources or ()):
            if src.data_ptr() != dst.data_ptr() or src.numel() != dst.numel():
                dst.copy_(src.reshape(dst.shape))
    if refresh_from_copies:
        _refresh(params, param_copies)


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
    grad_scale=None,
    refresh_from_copies=False,
    params_from=None,
    exp_avgs_from=None,
    exp_avg_sqs_from=None,
    max_exp_avg_sqs_from=None,
) -> None:
    s = adam_scalars(lr, beta1, beta2, weight_decay, step)
    hyper = dict(beta1=beta1, beta2=beta2, weight_decay=weight_decay, decoupled=decoupled,
                 maximize=maximize,
                 inv_grad_scale=unscale_factor("adam_step_", grad_scale, params))
    read_sources("adam_step_", params, param_copies, refresh_from_copies, params_from,
                 [("exp_avgs_from", exp_avgs, exp_avgs_from),
                  ("exp_avg_sqs_from", exp_avg_sqs, exp_avg_sqs_from),
                  ("max_exp_avg_sqs_from", max_exp_avg_sqs,
                   max_exp_avg_sqs_from if amsgrad else None)])
    for i, p in enumerate(params):
        m, v = decay_and_moments(p, grads[i], exp_avgs[i], exp_avg_sqs[i], s, **hyper)
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)
        vhat = v
        if amsgrad:
            torch.maximum(max_exp_avg_sqs[i], v, out=max_exp_avg_sqs[i])
            vhat = max_exp_avg_sqs[i]
        apply_update(p, m, vhat, s, eps, param_copies[i] if param_copies else None)


def advance_steps_(steps) -> list[int]:
    """tierlift::advance_steps_: adds 1 to each step count (a 1-element tensor) in place and
    returns the new counts as ints; a count that is not one finite value is refused before any
    changes."""
    steps = list(steps)
    for i, step in enumerate(steps):
        if step.numel() != 1:
            raise ValueError(f"advance_steps_: steps[{i}] must hold one element (a step count), "
                             f"got {step.numel()}")
        if not math.isfinite(step.item() + 1.0):
            raise ValueError(f"advance_steps_: steps[{i}] is {step.item() + 1.0} after the "
                             "increment, not a finite step count")
    counts = []
    for step in steps:  # in order: a count listed twice reads 1 more the second time
        step.add_(1)
        counts.append(int(step.item()))
    return counts
