"""torch.amp.GradScaler over tierlift.zero shards: the inf/NaN check agreed by every rank.

GradScaler looks for inf/NaN in the gradients its own rank holds. Under tierlift.zero each rank
holds a different shard of every gradient, so an overflow lands on one rank: that rank would
skip its step and halve its scale while the others step and keep theirs, and from then on the
reduction sums gradients scaled differently (or a collective waits forever). torch's
ShardedGradScaler does the same agreement for FSDP; here it comes without changing the user's
scaler: GradScaler's `_unscale_grads_` (which both `unscale_` and `step`'s own check call) is
wrapped, and for an optimizer over tierlift shards its found-inf flags are or-ed over every rank
(one small all-reduce per check, on the device: nothing is read back, so torch's own read
of the flags in step() stays the only host sync). Other optimizers are not touched.
"""

from __future__ import annotations

import torch

from tierlift._shards import any_rank_found, owners_of
from tierlift._torch_patch import wrap_method


def _agreeing(original):
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = original(self, optimizer, inv_scale, found_inf, allow_fp16)
        owners = owners_of(p for g in getattr(optimizer, "param_groups", []) for p in g["params"])
        if not owners:
            return per_device
        # Or-ed on the device: torch's step then reads the flags once, as without sharding.
        agreed = any_rank_found(owners, list(per_device.values()))
        if agreed is None:  # one rank: nothing to agree on
            return per_device
        if not per_device:  # no gradient here at all: this rank follows the others' verdict
            per_device[found_inf.device] = found_inf
        for t in per_device.values():
            t.copy_(agreed)
        return per_device

    return _unscale_grads_


def install() -> None:
    """Idempotent (tierlift/_torch_patch.py)."""
    wrap_method(torch.amp.GradScaler, "_unscale_grads_",
                ["self", "optimizer", "inv_scale", "found_inf", "allow_fp16"], _agreeing)
