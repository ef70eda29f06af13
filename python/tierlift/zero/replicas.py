"""Summing a rank's reduced gradient shard over the replicas of its shard (hierarchical
sharding, topology.py): one all-reduce per replicate leg, innermost first, each started when the
one before it is done, so the hooks can poll without blocking.

A leg that crosses nodes can carry the gradient quantized (grad_comm="int8" / "fp8",
quant_comm.py); legs inside a node always carry it in the reduce dtype.
"""

from __future__ import annotations

import torch

from tierlift.zero.comm import Comm, work_done
from tierlift.zero.quant_comm import QuantizedAllReduce


class _Plain:
    """An all-reduce in flight, with the done()/wait() of a quantized one."""

    def __init__(self, comm: Comm, t: torch.Tensor):
        self.comm, self.t = comm, t
        self.work = comm.all_reduce(t, async_op=True)

    def done(self) -> bool:
        return work_done(self.work)

    def wait(self) -> torch.Tensor:
        self.comm.wait(self.work)
        return self.t


class ReplicaLegs:
    """The replicate legs of one model and how each carries gradients."""

    def __init__(self, legs: list[Comm], grad_comm: str | None, block: int = 256):
        """`grad_comm`: None, "int8" or "fp8" (checked by ShardConfig)."""
        if grad_comm is not None and not any(leg.crosses_nodes for leg in legs):
            raise ValueError(f"grad_comm={grad_comm!r} quantizes the gradient sum across nodes, "
                             "but no replicate leg crosses nodes (use hierarchy='node' or a "
                             "mesh over several nodes)")
        self.legs = legs
        self.quant = [QuantizedAllReduce(leg, grad_comm, block)
                      if grad_comm is not None and leg.crosses_nodes else None for leg in legs]
        self.world = 1
        for leg in legs:
            self.world *= leg.world

    def start(self, t: torch.Tensor) -> ReplicaSum:
        return ReplicaSum(self, t)


class ReplicaSum:
    """`t` summed over every leg, in place (a quantized leg works on an fp32 copy, cast back)."""

    def __init__(self, legs: ReplicaLegs, t: torch.Tensor):
        self.legs, self.t, self.i = legs, t, 0
        self.handle = self._start()

    def _start(self):
        quant = self.legs.quant[self.i]
        if quant is None:
            return _Plain(self.legs.legs[self.i], self.t)
        return quant.start(self.t if self.t.dtype == torch.float32 else self.t.float())

    def _advance(self) -> None:
        out = self.handle.wait()
        if out is not self.t:
            self.t.copy_(out)
        self.i += 1
        self.handle = self._start() if self.i < len(self.legs.legs) else None

    def done(self) -> bool:
        """Starts the next leg when the current one is done; True once all are."""
        while self.handle is not None:
            if not self.handle.done():
                return False
            self._advance()
        return True

    def wait(self) -> torch.Tensor:
        while self.handle is not None:
            self._advance()
        return self.t
