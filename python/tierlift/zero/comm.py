"""The three collectives ZeRO needs, over torch.distributed, with a world of one handled locally
(so shard() also works in a plain single-process run) and failures turned into errors that
name the rank that stopped answering (see heartbeat.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _Done:
    """Stands in for a dist Work object when nothing was sent."""

    def wait(self) -> bool:
        return True


class Comm:
    def __init__(self, process_group=None):
        self.initialized = dist.is_available() and dist.is_initialized()
        if process_group is not None and not self.initialized:
            raise ValueError("process_group was given but torch.distributed is not initialized")
        self.group = process_group
        self.rank = dist.get_rank(process_group) if self.initialized else 0
        self.world = dist.get_world_size(process_group) if self.initialized else 1
        self.on_error = None  # callable(exc) -> exception to raise instead; set by heartbeat
        self.all_gather_bytes = 0  # bytes received by all-gathers (own piece included)

    def _run(self, fn, *args, **kwargs):
        try:
            return fn(*args, group=self.group, **kwargs)
        except RuntimeError as exc:
            if self.on_error is None:
                raise
            raise self.on_error(exc) from exc

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        self.all_gather_bytes += out.numel() * out.element_size()
        if self.world == 1:
            out.copy_(shard)
            return _Done()
        return self._run(dist.all_gather_into_tensor, out, shard, async_op=async_op) or _Done()

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False):
        if self.world == 1:
            out.copy_(full)
            return _Done()
        return self._run(dist.reduce_scatter_tensor, out, full, async_op=async_op) or _Done()

    def all_reduce(self, t: torch.Tensor, op=None, async_op: bool = False):
        if self.world == 1:
            return _Done()
        op = dist.ReduceOp.SUM if op is None else op
        return self._run(dist.all_reduce, t, op=op, async_op=async_op) or _Done()

    def wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            if self.on_error is None:
                raise
            raise self.on_error(exc) from exc
