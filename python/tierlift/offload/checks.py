"""The offloaded step's checks of its inputs: the parameters (at construction) and the params
lists (since), the param group's hyperparameters and state kinds, finite gradients, and
GradScaler's scale."""

from __future__ import annotations

import operator

import numpy as np
import torch

from tierlift.offload.layout import SCALE_KIND, state_kinds
from tierlift.offload.tier_values import TierValue
from tierlift.offload.tiers import crc_pool


def check_group(opt, gi: int, group: dict, kinds: list[str]) -> None:
    """The optimizer's own checks of group gi (types and values of its hyperparameters,
    Adam._check_hyper), then that its state kinds are still those laid out."""
    opt._check_hyper(gi, group)
    if list(state_kinds(group["amsgrad"], opt._state_dtype)) != kinds:
        raise ValueError(f"param_groups[{gi}]['amsgrad'] changed after the optimizer was "
                         "created; offloaded state cannot change kinds")


# The keys torch's Adam keeps in optimizer.state[p] that the tiers hold instead.
TIER_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", SCALE_KIND, "master")


def check_state_keys(opt, layouts: list, owner) -> None:
    """Refuses a moment or master written into optimizer.state[p] of a parameter whose state
    the tiers hold (optimizer.state keeps only its "step" there): the step would use the
    tiers' value and state_dict() would replace the written one with it, both silently, where
    torch's AdamW steps from what was written. A TierValue of this very moment put back (a
    framework moving the state, tier_values.py) is taken out instead: the tiers hold it."""
    for gi, group in enumerate(opt.param_groups):
        reserved = layouts[gi].reserved
        for pi, p in enumerate(group["params"]):
            state = opt.state.get(p)
            if not state:
                continue
            for k, v in list(dict.items(state)):
                if not isinstance(v, TierValue):
                    continue
                if not v.bound(owner, p, k):
                    raise RuntimeError(
                        f"optimizer.state[p][{k!r}] of param_groups[{gi}]['params'][{pi}] holds "
                        "what an offloaded optimizer's state yielded for another parameter, "
                        "moment or optimizer: moments live in the offload tiers and cannot be "
                        "moved between parameters through optimizer.state. Edit "
                        "optimizer.state_dict() and load it with load_state_dict() instead. "
                        "Nothing was changed")
                dict.__delitem__(state, k)
            if not reserved[pi]:
                continue
            keys = [k for k in TIER_KEYS if dict.__contains__(state, k)]  # written, not yielded
            if keys:
                raise RuntimeError(
                    f"optimizer.state[p] of param_groups[{gi}]['params'][{pi}] has "
                    f"{', '.join(map(repr, keys))}, written there after the optimizer was built: "
                    "an offloaded optimizer keeps moments and master weights in its tiers and "
                    "only 'step' in optimizer.state, so the value written would be ignored. "
                    "To change the state, edit optimizer.state_dict() and load it with "
                    "load_state_dict(); to go on without the change, delete those keys. "
                    "Nothing was changed")


def check_params(groups: list[dict]) -> None:
    """At construction, before anything is laid out: parameters that have a value (not on the
    meta device), each listed once."""
    first: dict = {}
    for gi, group in enumerate(groups):
        for pi, p in enumerate(group["params"]):
            name = f"param_groups[{gi}]['params'][{pi}]"
            if p.is_meta:
                raise ValueError(
                    f"{name} (shape {tuple(p.shape)}) is on the meta device: it has no values "
                    "for the offloaded master weights to start from. Materialize the model "
                    "first (model.to_empty(device=...), then initialise or load its weights), "
                    "then build the optimizer")
            seen = first.setdefault(id(p), name)
            if seen != name:
                # torch warns and steps such a parameter twice per step() through one state;
                # the tiers would give each listing its own state and one of the two results.
                raise ValueError(
                    f"{name} is the same parameter as {seen}: torch's AdamW would update it "
                    "twice per step() (it only warns), which the offloaded state, laid out per "
                    "listing, cannot reproduce; list it once")


def formats(groups: list[dict]) -> list[list]:
    """Each parameter's (dtype, device, shape) when the state was laid out, beside its numel in
    the layout: what check_unchanged compares."""
    return [[(p.dtype, p.device, p.shape) for p in g["params"]] for g in groups]


def check_unchanged(name: str, p: torch.Tensor, numel: int, dtype, device, shape=None, *,
                    strided: bool = False) -> None:
    """Refuses a parameter whose data was replaced since the state was laid out (`p.data =
    x`: model.to(dtype or memory_format=...), an embedding grown in place): the tiers hold
    `numel` elements for it, stream it as flat memory and keep or skip its master by its
    dtype, so a step would leave the rest of a grown parameter untrained, or fail half way.
    The tiers hold its state in its logical element order, so a new `shape` of the same numel
    (a weight stored transposed: `p.data = p.data.t().contiguous()`) would pair each element
    with another's moments; torch's step raises on it.
    `strided`: it was laid out non-contiguous, so any layout is stepped (offload/strided.py);
    one laid out contiguous may be its own master, read as flat memory, and must stay so."""
    if (p.numel() == numel and p.dtype == dtype and p.device == device
            and (shape is None or p.shape == shape) and (strided or p.is_contiguous())):
        return
    what = []
    if p.numel() != numel:
        what.append(f"{numel} elements, now {p.numel()}")
    elif shape is not None and p.shape != shape:
        what.append(f"shape {tuple(shape)}, now {tuple(p.shape)}")
    if p.dtype != dtype:
        what.append(f"dtype {dtype}, now {p.dtype}")
    if p.device != device:
        what.append(f"on {device}, now on {p.device}")
    if not (strided or p.is_contiguous()):
        what.append(f"now non-contiguous (stride {p.stride()})")
    # A state dict's moments have the old shape: the new optimizer refuses them unchanged.
    reshaped = (" with its moments in that state dict changed the same way"
                if p.numel() == numel and shape is not None and p.shape != shape else "")
    raise RuntimeError(
        f"{name} is not the tensor the offloaded state was laid out for ({'; '.join(what)}): "
        "its data was replaced after the optimizer was built, and offloaded state is laid out "
        "once, for each parameter as it was then. Make the change before building the "
        f"optimizer (save its state_dict() first and load it into the new one{reshaped}), or "
        "undo it. Nothing was changed")


def listed(groups: list[dict]) -> list[list]:
    """The params lists as the offloaded state was laid out for them."""
    return [list(g["params"]) for g in groups]


def check_lists(groups: list[dict], built: list[list]) -> None:
    """Refuses param groups whose params lists are no longer those the state was laid out
    for (`built`, compared by identity): the state is found by position in the list, so after
    a filter another parameter of the same shape would take it."""
    if len(groups) != len(built):
        raise RuntimeError(
            f"the optimizer has {len(groups)} param groups; it was built with {len(built)} and "
            "offloaded state is laid out once, when the optimizer is built. Build a new "
            "optimizer with every group (offload refuses add_param_group)")
    for gi, (group, old) in enumerate(zip(groups, built)):
        new = group["params"]
        if len(new) == len(old) and all(map(operator.is_, new, old)):
            continue
        now = {id(p) for p in new}
        before = {id(p) for p in old}
        removed = [i for i, p in enumerate(old) if id(p) not in now]
        added = [i for i, p in enumerate(new) if id(p) not in before]
        what = []
        if removed:
            what.append(f"built-with entries {removed[:8]} removed")
        if added:
            what.append(f"entries {added[:8]} added")
        raise RuntimeError(
            f"param_groups[{gi}]['params'] is not the list the optimizer was built with "
            f"({', '.join(what) or 'reordered'}): offloaded state is laid out once, by position "
            "in that list, so it cannot follow a filtered, extended or reordered list. Put the "
            "list back, or build a new optimizer over the parameters to train (offload refuses "
            "add_param_group); a frozen parameter may stay listed: without a gradient it is "
            "not stepped. Nothing was changed")


def _sum_finite_np(g: torch.Tensor) -> bool:
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is confirmed by the caller
        return bool(np.isfinite(g.detach().numpy().sum()))


def sums_finite(grads: list[torch.Tensor]) -> bool:
    """Whether the sum of every gradient is finite. fp32 CPU gradients are summed by numpy,
    one single-threaded sum per gradient on the CRC pool's threads (numpy releases the GIL):
    torch's intra-op parallel sum waits for all its OpenMP threads at a barrier, and on a
    loaded host that wait measured 8 ms per 4M-element sum against 0.6 ms single-threaded.
    Other gradients (GPU, half precision) keep torch's sum."""
    host = [g for g in grads if g.device.type == "cpu" and g.dtype == torch.float32]
    other = [g for g in grads if not (g.device.type == "cpu" and g.dtype == torch.float32)]
    if host and not all(crc_pool().map(_sum_finite_np, host) if len(host) > 1
                        else map(_sum_finite_np, host)):
        return False
    return all_true([g.sum().isfinite() for g in other])


def all_true(flags: list[torch.Tensor]) -> bool:
    """Whether every one-element bool tensor holds True, read with one copy to the host per
    device (a GPU's flags are stacked there): a copy per flag waits for the GPU each time."""
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for f in flags:
        per_device.setdefault(f.device, []).append(f.reshape(()))
    return all(bool(torch.stack(fs).all()) for fs in per_device.values())


def every_finite(grads: list[torch.Tensor]) -> bool:
    """Whether every element of every gradient is finite: sums_finite, and where a sum is not
    finite (finite values can overflow it, e.g. fp16), each gradient's aminmax confirms it
    (propagates NaN, shows +-Inf, no gradient-sized mask; several times slower than a sum)."""
    return sums_finite(grads) or all_true(
        [torch.stack(torch.aminmax(g)).isfinite().all() for g in grads])


def scale_value(grad_scale: torch.Tensor) -> float:
    """The GradScaler scale as a float, checked (the kernels divide by it)."""
    if not isinstance(grad_scale, torch.Tensor) or grad_scale.numel() != 1:
        raise ValueError(f"grad_scale must be a 1-element tensor, got {grad_scale!r}")
    v = float(grad_scale.detach().float().reshape(()).item())
    if not (v > 0.0 and np.isfinite(v)):
        raise ValueError(f"grad_scale must be finite and > 0, got {v}")
    return v


def inverse(scale: float) -> float:
    """1/scale as GradScaler computes it (fp64 reciprocal, rounded to fp32)."""
    return float(np.float32(1.0 / scale))


def power_of_two(scale: float) -> bool:
    return np.frexp(scale)[0] == 0.5
