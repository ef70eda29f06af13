"""The gradients step() works from: collected and checked (dtype, shape, reserved state),
checked for inf/NaN, and clipped by the optimizer's own `max_grad_norm`."""

from __future__ import annotations

import torch

from tierlift._shards import all_ranks_agree, global_grad_norm
from tierlift.offload.checks import every_finite, inverse, power_of_two
from tierlift.offload.layout import not_reserved
from tierlift.offload.overlap import scan_grads
from tierlift.offload.state_io import _LOW_PRECISION


def collect(off) -> list[dict]:
    """Per group {param index: the gradient, contiguous and flat}; refuses what step() cannot
    use before anything changes."""
    live = []
    for gi, group in enumerate(off.opt.param_groups):
        got = {}
        for pi, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            name = off._name(gi, pi)
            if not off.layouts[gi].reserved[pi]:
                if off.device_part.holds(gi, pi):  # stepped beside its parameter
                    continue
                raise RuntimeError(not_reserved(name, off.config.offload,
                                                "has a gradient now"))
            off.check_param(gi, pi, p)
            if g.is_sparse:
                raise RuntimeError(f"{name} has a sparse gradient; tierlift's Adam needs "
                                   "dense gradients")
            if g.dtype not in (torch.float32, *_LOW_PRECISION):
                raise TypeError(f"{name}.grad has dtype {g.dtype}; expected float32, "
                                "bfloat16 or float16")
            if g.shape != p.shape:
                raise ValueError(f"{name}.grad has shape {tuple(g.shape)}, expected "
                                 f"{tuple(p.shape)}")
            got[pi] = g.contiguous().view(-1)
        live.append(got)
    return live


def all_finite(off, live: list[dict], spec: dict) -> tuple[bool, list[dict]]:
    """Host gradients of groups with chunks stepped ahead: checked element by element in
    the pass that takes the overlap's fingerprints (overlap.scan_grads), returned per group.
    Others: checks.every_finite (a sum per gradient, aminmax only to confirm a sum that is
    not finite)."""
    finite, known, covered = scan_grads(off, live, spec)
    grads = [g for gi, got in enumerate(live) for pi, g in got.items()
             if g.numel() and (gi, pi) not in covered]
    if finite and grads:
        finite = every_finite(grads)
    if off._zero:
        # ZeRO shards: a non-finite value on any rank skips the step on every rank.
        finite = all_ranks_agree(off._params(), finite)
    return finite, known


def norm_ahead(off, scale: float | None):
    """The norm clip() computes, taken before step() waits for the overlap's worker, so that
    a step known to be clipped does not wait for chunks it would step again. Only read: the
    checks between here and clip() change no gradient, so clip(total=...) reuses it. None
    where there is nothing to clip or clip() must first unscale (a scale not a power of two).
    Every rank takes it under the same conditions (ZeRO: the same collective, earlier)."""
    if off.config.max_grad_norm is None or (scale is not None and not power_of_two(scale)):
        return None
    return _total_norm(off, _with_grads(off), scale)


def clips(off, total) -> bool:
    """Whether clip() scales the gradients for this norm."""
    return float(off.config.max_grad_norm) / (float(total) + 1e-6) < 1.0


def _with_grads(off) -> list:
    return [p for g in off.opt.param_groups for p in g["params"] if p.grad is not None]


def _total_norm(off, params: list, scale: float | None):
    if off._zero:
        # ZeRO shards: the norm over all ranks, exactly as tierlift.zero.clip_grad_norm_.
        total = global_grad_norm(params)
    else:
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
    return total if scale is None else total * inverse(scale)


def clip(off, stats, scale: float | None, total=None) -> tuple[float | None, bool]:
    """torch.nn.utils.clip_grad_norm_ over the optimizer's parameters, in their order; the
    gradients are only touched when they are scaled (so speculative steps stay valid).
    Under a GradScaler (`scale`) the result is that of unscale_ then clip_grad_norm_: with
    a power-of-two scale (GradScaler's default) the norm of the scaled gradients times
    1/scale is exact and so is (g * coef) * (1/scale), so the gradients stay scaled and the
    kernel unscales them; any other scale is unscaled here first. `total`: norm_ahead()'s,
    of these same gradients. Returns the scale the kernel still applies and whether the
    gradients were changed."""
    params = _with_grads(off)
    changed = False
    if total is None:
        if scale is not None and not power_of_two(scale):
            torch._foreach_mul_([p.grad for p in params], inverse(scale))
            scale, changed = None, True
        total = _total_norm(off, params, scale)
    stats["grad_norm"] = float(total)
    if clips(off, total):
        torch.nn.utils.clip_grads_with_norm_(params, off.config.max_grad_norm, total)
        changed = True
    return scale, changed
