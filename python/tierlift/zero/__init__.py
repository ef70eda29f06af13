"""tierlift.zero: ZeRO stages 1/2/3 over torch.distributed (NCCL on GPU, gloo on CPU).

    model = tierlift.zero.shard(model, stage=3, mixed_precision=MixedPrecision())
    opt = tierlift.optim.AdamW(model.parameters(), lr=3e-4)
    with model.no_sync():               # inner micro-steps: no communication
        loss(model(x0)).backward()
    loss(model(x1)).backward()          # reduces the accumulated gradient
    tierlift.zero.clip_grad_norm_(model, 1.0)
    opt.step()
    sd = tierlift.zero.full_state_dict(model)   # unsharded, on every rank
"""

from tierlift.zero.api import (
    clip_grad_norm_,
    close,
    default_units,
    full_state_dict,
    global_grad_norm,
    is_shard,
    last_step_stats,
    load_full_state_dict,
    no_sync,
    on_shard_grad_ready,
    shard,
)
from tierlift.zero.config import MixedPrecision, ShardConfig
from tierlift.zero.deferred import deferred_init
from tierlift.zero.freed import NotGatheredError
from tierlift.zero.gathered import gathered
from tierlift.zero.groups import param_groups, shard_groups
from tierlift.zero.guards import num_parameters
from tierlift.zero.heartbeat import RankFailureError
from tierlift.zero.scaler import LossScaler, LossScalerConfig

__all__ = ["LossScaler", "LossScalerConfig", "MixedPrecision", "NotGatheredError",
           "RankFailureError", "ShardConfig", "clip_grad_norm_", "close", "deferred_init",
           "default_units", "full_state_dict", "gathered", "global_grad_norm", "is_shard",
           "last_step_stats", "load_full_state_dict", "no_sync", "num_parameters",
           "on_shard_grad_ready", "param_groups", "shard", "shard_groups"]
