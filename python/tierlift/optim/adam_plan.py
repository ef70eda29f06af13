"""The steady-state step of tierlift.optim.Adam without offload: a param group's step plan.

A step's host work used to be per parameter and per step: create or convert its state, pick the
tensor the kernel updates, collect it into lists. None of it changes from one step to the next
unless someone changes the group or the state, so it is done once (Adam._step_group) and kept
here; each later step only re-reads what may have changed since (the gradients, the group's
parameters, the state dicts and their tensors), compares it by identity with what the plan
holds, and takes the general path again where anything differs. So a scheduler's lr, a new
group, a loaded state dict, a tensor put into the state or a gradient set to None are seen at
the next step, as torch's optimizers see them.
"""

from __future__ import annotations

import operator
from itertools import repeat

import torch

from tierlift import ops
from tierlift.optim.hyper import CODES_KEY

_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))
_dtype = operator.attrgetter("dtype")
_layout = operator.attrgetter("layout")
_device = operator.attrgetter("device")
_shape = operator.attrgetter("shape")
_grad = operator.attrgetter("grad")
_contiguous = torch.Tensor.is_contiguous


class GroupPlan:
    """What one group's step passes to the kernel besides the gradients, for the parameters
    that had gradients when it was made (in the group's order)."""

    __slots__ = ("group", "state", "active", "dtypes", "shapes", "sds", "flat", "amsgrad",
                 "device", "steps", "lists")

    def take(self, grads, index=None) -> dict:
        """The kernel's lists for this step (all the plan's parameters, or those at `index`)."""
        lists = dict(self.lists, grads=grads)
        if index is None:
            return lists
        return {k: [v[i] for i in index] if v else v for k, v in lists.items()}


def build_plan(state, group: dict, state_dtype: str) -> GroupPlan | None:
    """The plan of `group` right after the general path stepped it (every parameter with a
    gradient has its state, in this optimizer's format), or None where the plan does not apply:
    no gradients, no compiled kernel (its reference refreshes masters in separate passes), a
    non-contiguous parameter (stepped through a copy), a step count that is not a tensor."""
    active = [p for p in group["params"] if p.grad is not None]
    if not active or not ops.runs_kernel(active[0]) or not all(map(_contiguous, active)):
        return None
    sds = [state[p] for p in active]
    if not all(isinstance(sd.get("step"), torch.Tensor) for sd in sds):
        return None
    targets = [sd.get("master", p) for sd, p in zip(sds, active)]
    with_copies = any("master" in sd for sd in sds)
    plan = GroupPlan()
    plan.group, plan.state, plan.active, plan.sds = group, state, active, sds
    plan.dtypes = list(map(_dtype, active))
    plan.shapes = list(map(_shape, active))
    plan.flat = [v for sd in sds for v in sd.values()]
    plan.amsgrad = group["amsgrad"]
    plan.device = active[0].device
    plan.steps = [sd["step"] for sd in sds]
    plan.lists = {
        "params": targets,
        # A parameter without a master writes into itself (one launch for all, as the general
        # path does).
        "copies": list(active) if with_copies else [],
        "exp_avgs": [sd["exp_avg"] for sd in sds],
        "exp_avg_sqs": [sd[CODES_KEY if state_dtype == "bf16" else "exp_avg_sq"] for sd in sds],
        "scales": [sd["exp_avg_sq_scale"] for sd in sds] if state_dtype == "bf16" else [],
        "max_exp_avg_sqs": [sd["max_exp_avg_sq"] for sd in sds] if plan.amsgrad else [],
    }
    return plan


def plan_grads(plan: GroupPlan | None, state, group: dict) -> list | None:
    """The gradients to step `group` with by its plan, or None where the plan is stale or a
    gradient needs the general path's checks (its error, or a conversion). Reads, never
    changes anything."""
    if plan is None or plan.group is not group or plan.state is not state:
        return None
    params = group["params"]
    grads = list(map(_grad, params))
    if all(map(operator.is_not, grads, repeat(None))):
        active = params
    else:
        active = [p for p, g in zip(params, grads) if g is not None]
        grads = [g for g in grads if g is not None]
    if len(active) != len(plan.active) or not all(map(operator.is_, active, plan.active)):
        return None
    if group["amsgrad"] != plan.amsgrad:
        return None
    # `p.data = x` keeps the Parameter but may change its dtype, device, shape or layout: the
    # general path's checks must see that before any group changes.
    if (list(map(_dtype, active)) != plan.dtypes or list(map(_shape, active)) != plan.shapes
            or set(map(_device, active)) != {plan.device} or not all(map(_contiguous, active))):
        return None
    # The state dicts, and every tensor in them, as when the plan was made.
    sds = list(map(state.__getitem__, active))
    if not all(map(operator.is_, sds, plan.sds)):
        return None
    flat = [v for sd in sds for v in sd.values()]
    if len(flat) != len(plan.flat) or not all(map(operator.is_, flat, plan.flat)):
        return None
    if (not set(map(_dtype, grads)) <= _DTYPES or set(map(_layout, grads)) != {torch.strided}
            or set(map(_device, grads)) != {plan.device}):
        return None
    if not all(map(_contiguous, grads)):
        grads = [g.contiguous() for g in grads]
    return grads
