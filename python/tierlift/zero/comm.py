"""The collectives ZeRO needs, over torch.distributed, with a world of one handled locally
(so shard() also works in a plain single-process run) and failures turned into errors that
name the rank that stopped answering (see heartbeat.py).

Every collective counts the bytes this rank sends, split by whether the peer is on its own node
or another (`nodes`: the node of each rank of the group). The count is the collective's logical
volume as a direct exchange (each peer gets what it needs from this rank: its piece of a
reduce-scatter, this rank's shard of an all-gather, both halves of an all-reduce), which does
not depend on the algorithm the backend picks and is what a cross-node link has to carry at
least."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist


class _Own(threading.local):
    """Set while this thread issues tierlift's own collectives: they move shards and their
    slices on purpose, and the process groups' pre-hook (collectives.py) lets them through."""

    issuing = False  # a class default: reading it raises nothing in a thread that never set it


OWN = _Own()


def unchecked(fn):
    """torch's own collective where tierlift wraps it to refuse user calls on shards
    (collectives.py): tierlift's collectives move shards and their slices on purpose."""
    return fn.__wrapped__ if getattr(fn, "_tierlift_wrapped", False) else fn


class _Done:
    """Stands in for a dist Work object when nothing was sent."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def flags_on(values, device: torch.device) -> torch.Tensor:
    """0/1 float flags on `device` for a collective, copied from pinned host memory without
    blocking the host (a blocking copy is a host sync on a GPU)."""
    host = torch.tensor([float(v) for v in values], pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def work_done(work) -> bool:
    """Whether a collective's work has completed, without waiting (works without
    is_completed() are treated as done)."""
    is_completed = getattr(work, "is_completed", None)
    return True if is_completed is None else bool(is_completed())


class RankFailureError(RuntimeError):
    """A collective failed because another rank died or stopped answering."""


class Comm:
    def __init__(self, process_group=None, nodes: list | None = None):
        self.initialized = dist.is_available() and dist.is_initialized()
        if process_group is not None and not self.initialized:
            raise ValueError("process_group was given but torch.distributed is not initialized")
        self.group = process_group
        self.rank = dist.get_rank(process_group) if self.initialized else 0
        self.world = dist.get_world_size(process_group) if self.initialized else 1
        self.on_error = None  # callable(exc) -> exception to raise instead; set by heartbeat
        # callable(comm) run before each collective is issued (heartbeat.py's agreement with the
        # ranks' own c10d calls), and how many have been issued: compared over the ranks
        self.before_issue = None
        self.issued = 0
        self.all_gather_bytes = 0  # bytes received by all-gathers (own piece included)
        # The node of each rank of the group (None: all on one node).
        self.nodes = list(nodes) if nodes is not None else [0] * self.world
        if len(self.nodes) != self.world:
            raise ValueError(f"nodes names {len(self.nodes)} ranks, the group has {self.world}")
        mine = self.nodes[self.rank]
        self.peers_intra = sum(1 for n in self.nodes if n == mine) - 1
        self.peers_inter = self.world - 1 - self.peers_intra
        self.sent = {"intra_node": 0, "inter_node": 0}  # bytes this rank sent

    @property
    def crosses_nodes(self) -> bool:
        return self.peers_inter > 0

    def _count(self, per_peer: int) -> None:
        """Records `per_peer` bytes sent to every other rank of the group."""
        self.sent["intra_node"] += per_peer * self.peers_intra
        self.sent["inter_node"] += per_peer * self.peers_inter

    def _run(self, fn, *args, **kwargs):
        if self.before_issue is not None:
            self.before_issue(self)  # may refuse: then nothing was sent
        self.issued += 1
        OWN.issuing = True
        try:
            return unchecked(fn)(*args, group=self.group, **kwargs)
        except RuntimeError as exc:
            if self.on_error is None:
                raise
            raise self.on_error(exc) from exc
        finally:
            OWN.issuing = False

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        self.all_gather_bytes += out.numel() * out.element_size()
        self._count(shard.numel() * shard.element_size())
        if self.world == 1:
            out.copy_(shard)
            return _Done()
        return self._run(dist.all_gather_into_tensor, out, shard, async_op=async_op) or _Done()

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False):
        self._count(out.numel() * out.element_size())
        if self.world == 1:
            out.copy_(full)
            return _Done()
        return self._run(dist.reduce_scatter_tensor, out, full, async_op=async_op) or _Done()

    def all_reduce(self, t: torch.Tensor, op=None, async_op: bool = False):
        self._count(2 * -(-t.numel() // self.world) * t.element_size())
        if self.world == 1:
            return _Done()
        op = dist.ReduceOp.SUM if op is None else op
        return self._run(dist.all_reduce, t, op=op, async_op=async_op) or _Done()

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """Equal pieces: rank r's i-th 1/world of `inp` lands as the r-th 1/world of rank i's
        `out`."""
        self._count(inp.numel() // self.world * inp.element_size())
        if self.world == 1:
            out.copy_(inp)
            return _Done()
        return self._run(dist.all_to_all_single, out, inp, async_op=async_op) or _Done()

    def broadcast(self, t: torch.Tensor, src: int = 0, async_op: bool = False):
        """Group rank `src`'s `t` into every rank's."""
        if self.rank == src:
            self._count(t.numel() * t.element_size())
        if self.world == 1:
            return _Done()
        return self._run(dist.broadcast, t, group_src=src, async_op=async_op) or _Done()

    def wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            if self.on_error is None:
                raise
            raise self.on_error(exc) from exc
