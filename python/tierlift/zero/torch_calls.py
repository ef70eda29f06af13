"""Ordinary torch calls on a sharded model: made exact, or refused before anything changes.

model.parameters() of a sharded model yields one flat fp32 shard per unit (this rank's slice
of the unit's parameters, back to back). Two everyday torch lines would silently see that
slice instead of the model:

- torch.nn.utils.clip_grad_norm_(model.parameters(), ...) (and get_total_norm) would clip each
  rank by the norm of its own slice. Both go through torch.nn.utils.clip_grad._get_total_norm,
  looked up when called (so a script that imported clip_grad_norm_ before tierlift is covered
  too); wrapped, the norm over shard gradients is the whole model's, summed over the shards'
  ranks (a collective, as every rank clips), the same on every rank. Other tensors count once.
- Optimizer param groups split by name or shape (nanoGPT's `p.dim() >= 2`, Hugging Face's
  "bias" / "norm" names) cannot see the model's parameters in a shard: every shard lands on one
  side and the other side is left empty. An optimizer built with an empty group whose settings
  differ from those of a group holding shards (shards that shard(param_group_fn=...) did not
  split) is refused when it is constructed, naming the way to split them.
- optimizer.zero_grad() and model.zero_grad() after backwards inside no_sync() would clear only
  the shard gradients: the local sums no_sync() keeps in each unit's full gradient would reach
  the next synced backward. Under DDP they live in param.grad, which zero_grad clears; so the
  wrapped zero_grad drops them for every shard it clears (a shard's `p.grad = None` by hand is
  not seen).
"""

from __future__ import annotations

import torch

from tierlift._shards import combined_norm, grad_owners, shard_owner, split_by_owner
from tierlift._torch_patch import wrap_method
from tierlift.offload.overlap import group_settings, same_hyper
from tierlift.zero import unused

_NORM_PARAMS = ["tensors", "norm_type", "error_if_nonfinite", "foreach"]


def _global_norm(original):
    def get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        owners = grad_owners() if tensors else {}
        if not any(id(t) in owners for t in tensors):
            return original(tensors, norm_type, error_if_nonfinite, foreach)
        shards, local = split_by_owner((t, owners.get(id(t))) for t in tensors)
        total = combined_norm(shards, local, float(norm_type),
                              lambda ts, nt: original(ts, nt, False, foreach))
        total = total.to(tensors[0].device)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        return total

    return get_total_norm


def check_groups(param_groups: list[dict]) -> None:
    """Refuses param groups that split ungrouped shards by name or shape (see above)."""
    holding = []
    for i, group in enumerate(param_groups):
        for p in group["params"]:
            owner = shard_owner(p)
            if owner is not None and owner[0].units[owner[1]].group is None:
                holding.append(i)
                break
    if not holding:
        return
    for i, group in enumerate(param_groups):
        if group["params"]:
            continue
        for j in holding:
            if not same_hyper(group_settings(group), group_settings(param_groups[j])):
                raise ValueError(
                    f"optimizer param group {i} is empty while group {j}, with other settings, "
                    "holds ZeRO shards: after tierlift.zero.shard() each parameter of "
                    "model.parameters() is one unit's flat 1-D shard, so a split by parameter "
                    "name or shape (p.dim() >= 2, 'bias' or 'norm' in the name) puts every "
                    "shard on one side. Split them with shard(model, ..., param_group_fn=fn) "
                    "(fn(name, param) sees the model's own names and shapes) and build the "
                    "groups with tierlift.zero.param_groups(model, {key: settings})")


def _checking(original):
    def __init__(self, params, defaults):
        original(self, params, defaults)
        check_groups(self.param_groups)

    return __init__


def _drop_local_sums(params) -> None:
    """Drops what no_sync() summed locally for the units of the shards in `params`."""
    for p in params:
        owner = shard_owner(p)
        if owner is not None:
            unit = owner[0].units[owner[1]]
            if not unit.frozen:
                unit.full.grad = None
                unused.reset(unit)


def _optimizer_zero_grad(original):
    def zero_grad(self, set_to_none=True):
        original(self, set_to_none)
        _drop_local_sums(p for g in self.param_groups for p in g["params"])

    return zero_grad


def _module_zero_grad(original):
    def zero_grad(self, set_to_none=True):
        original(self, set_to_none)
        _drop_local_sums(self.parameters())

    return zero_grad


def install() -> None:
    """Idempotent (tierlift/_torch_patch.py)."""
    wrap_method(torch.nn.utils.clip_grad, "_get_total_norm", _NORM_PARAMS, _global_norm)
    wrap_method(torch.nn.utils, "get_total_norm", _NORM_PARAMS, _global_norm)
    wrap_method(torch.optim.Optimizer, "__init__", ["self", "params", "defaults"], _checking)
    wrap_method(torch.optim.Optimizer, "zero_grad", ["self", "set_to_none"], _optimizer_zero_grad)
    wrap_method(torch.nn.Module, "zero_grad", ["self", "set_to_none"], _module_zero_grad)
