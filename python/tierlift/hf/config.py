"""ZeroConfig: what tierlift.hf.Trainer shards the model with and how it builds the optimizer.

Typed, and checked at construction: `shard_kwargs` and `optimizer_kwargs` are passed through to
tierlift.zero.shard and tierlift.optim.AdamW, and a key those functions do not take is an error
here (not a silent default at the first step).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from tierlift.optim import AdamW
from tierlift.zero import MixedPrecision, shard

# Set by ZeroConfig itself (or by the Trainer from TrainingArguments), so not accepted twice.
_SHARD_OWN = {"model", "stage", "offload_params", "mixed_precision", "param_group_fn"}
_OPTIM_OWN = {"params", "lr", "betas", "eps", "weight_decay"}


def _check_kwargs(kwargs: dict, fn, own: set, what: str) -> None:
    if not isinstance(kwargs, dict):
        raise TypeError(f"{what} must be a dict of keyword arguments, got {type(kwargs).__name__}")
    accepted = set(inspect.signature(fn).parameters) - own
    for key in kwargs:
        if key in own:
            raise ValueError(f"{what}[{key!r}] is set by ZeroConfig or TrainingArguments "
                             f"already; set it there")
        if key not in accepted:
            raise ValueError(f"{what} has an unknown key {key!r}; {fn.__qualname__} takes "
                             f"{sorted(accepted)}")


@dataclass(kw_only=True, frozen=True)
class ZeroConfig:
    """How tierlift.hf.Trainer shards a model that is not sharded yet.

    stage: ZeRO stage 1, 2 or 3. offload_params: "none", "cpu" or "nvme" (stage 3; "nvme" needs
    shard_kwargs={"nvme_path": ...}). mixed_precision: tierlift.zero.MixedPrecision or None
    (fp32). shard_kwargs: any other tierlift.zero.shard option (units, prefetch, gpu_budget,
    hierarchy, ...). optimizer_kwargs: options of the tierlift.optim.AdamW the Trainer builds
    when it is given no optimizer (offload, nvme_path, cpu_budget, overlap, max_grad_norm,
    state_dtype, ...); lr, betas, eps and weight_decay come from TrainingArguments.
    background_saves: Trainer checkpoints are written by tierlift.checkpoint.save(...,
    blocking=False) (training steps on while the files are written; staging_budget bounds the
    host memory it copies into). checkpoint_full_model: each checkpoint-N also holds the full
    model for from_pretrained (gathered, written by rank 0), next to the sharded state.
    """

    stage: int = 3
    offload_params: str = "none"
    mixed_precision: MixedPrecision | None = None
    shard_kwargs: dict[str, Any] = field(default_factory=dict)
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    background_saves: bool = False
    staging_budget: int | None = None
    checkpoint_full_model: bool = True

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ZeroConfig.stage must be 1, 2 or 3, got {self.stage!r}")
        if self.offload_params not in ("none", "cpu", "nvme"):
            raise ValueError("ZeroConfig.offload_params must be 'none', 'cpu' or 'nvme', got "
                             f"{self.offload_params!r}")
        if self.offload_params != "none" and self.stage != 3:
            raise ValueError(f"ZeroConfig.offload_params={self.offload_params!r} needs stage=3")
        if self.mixed_precision is not None and not isinstance(self.mixed_precision,
                                                               MixedPrecision):
            raise TypeError("ZeroConfig.mixed_precision must be tierlift.zero.MixedPrecision or "
                            f"None, got {type(self.mixed_precision).__name__}")
        _check_kwargs(self.shard_kwargs, shard, _SHARD_OWN, "ZeroConfig.shard_kwargs")
        _check_kwargs(self.optimizer_kwargs, AdamW.__init__, _OPTIM_OWN | {"self"},
                      "ZeroConfig.optimizer_kwargs")
        if self.staging_budget is not None and not self.background_saves:
            raise ValueError("ZeroConfig.staging_budget applies to background saves: set "
                             "background_saves=True too")

    def shard(self, model, param_group_fn=None, **source):
        """tierlift.zero.shard(model, ...) with this configuration; `source` (device=,
        weights=) fills a model built on the meta device."""
        return shard(model, stage=self.stage, offload_params=self.offload_params,
                     mixed_precision=self.mixed_precision, param_group_fn=param_group_fn,
                     **self.shard_kwargs, **source)
