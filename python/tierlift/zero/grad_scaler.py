"""torch.amp.GradScaler over tierlift.zero shards: the inf/NaN check agreed by every rank.

GradScaler looks for inf/NaN in the gradients its own rank holds. Under tierlift.zero each rank
holds a different shard of every gradient, so an overflow lands on one rank: that rank would
skip its step and halve its scale while the others step and keep theirs, and from then on the
reduction sums gradients scaled differently (or a collective waits forever). torch's
ShardedGradScaler does the same agreement for FSDP; here it comes without changing the user's
scaler: GradScaler's `_unscale_grads_` (which both `unscale_` and `step`'s own check call) is
wrapped, and for an optimizer over tierlift shards its found-inf flags are or-ed over every rank
(one small all-reduce per check). Other optimizers are not touched.
"""

from __future__ import annotations

import torch

from tierlift._shards import all_ranks_agree, is_shard
from tierlift._torch_patch import wrap_method


def _shard_params(optimizer) -> list:
    params = [p for g in getattr(optimizer, "param_groups", []) for p in g["params"]]
    return params if any(is_shard(p) for p in params) else []


def _agreeing(original):
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = original(self, optimizer, inv_scale, found_inf, allow_fp16)
        params = _shard_params(optimizer)
        if not params:
            return per_device
        local = all(float(t) == 0.0 for t in per_device.values())
        if all_ranks_agree(params, local) or not local:
            return per_device
        # another rank found one: this rank skips and backs off too
        for t in per_device.values():
            t.fill_(1.0)
        if not per_device:  # no gradient here at all
            per_device[found_inf.device] = found_inf.fill_(1.0)
        return per_device

    return _unscale_grads_


def install() -> None:
    """Idempotent (tierlift/_torch_patch.py)."""
    wrap_method(torch.amp.GradScaler, "_unscale_grads_",
                ["self", "optimizer", "inv_scale", "found_inf", "allow_fp16"], _agreeing)
