"""Dynamic loss scaling for fp16 ZeRO training: scale the loss so small fp16 gradients do not
flush to zero, unscale the fp32 gradient shards before the step, and skip the step (saying so)
when any rank saw an inf/nan, halving the scale; grow it again after a run of good steps.

    scaler = tierlift.zero.LossScaler(model)
    scaler.scale(loss).backward()
    scaler.unscale_()                        # optional: before clip_grad_norm_
    tierlift.zero.clip_grad_norm_(model, 1.0)
    scaler.step(optimizer)                   # False when the step was skipped
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from tierlift.zero.hooks import _state

log = logging.getLogger("tierlift.zero")


@dataclass(kw_only=True, frozen=True)
class LossScalerConfig:
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ValueError(f"init_scale must be a finite number > 0, got {self.init_scale}")
        if not self.growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval}")


class LossScaler:
    def __init__(self, model: torch.nn.Module, config: LossScalerConfig | None = None) -> None:
        self._zero = _state(model)
        self.config = config or LossScalerConfig()
        self.scale_value = float(self.config.init_scale)
        self.good_steps = 0
        self.skipped_steps = 0
        self._unscaled = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def _grads(self):
        return [u.shard.grad for u in self._zero.units if u.shard.grad is not None]

    @torch.no_grad()
    def unscale_(self) -> None:
        """Divide the gradient shards by the scale (once per step)."""
        if self._unscaled:
            return
        inv = 1.0 / self.scale_value
        for g in self._grads():
            g.mul_(inv)
        self._unscaled = True

    @torch.no_grad()
    def _found_inf(self) -> bool:
        device = self._zero.units[0].device
        flag = torch.zeros((), dtype=torch.float32, device=device)
        for g in self._grads():
            flag = torch.maximum(flag, (~torch.isfinite(g)).any().to(torch.float32))
        comm = self._zero.comm
        comm.wait(comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX))
        return bool(flag.item())

    def step(self, optimizer) -> bool:
        """Unscale, then step `optimizer` unless some rank has inf/nan gradients. Returns
        whether the step ran; a skipped step clears the gradients and lowers the scale."""
        self.unscale_()
        self._unscaled = False
        if self._found_inf():
            self.skipped_steps += 1
            old = self.scale_value
            self.scale_value = max(old * self.config.backoff_factor, self.config.min_scale)
            self.good_steps = 0
            for u in self._zero.units:
                u.shard.grad = None
            log.warning("tierlift.zero: skipped an optimizer step: inf/nan gradients at loss "
                        "scale %g; scale is now %g (%d steps skipped so far)", old,
                        self.scale_value, self.skipped_steps)
            return False
        optimizer.step()
        self.good_steps += 1
        if self.good_steps % self.config.growth_interval == 0:
            self.scale_value *= self.config.growth_factor
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale_value = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
