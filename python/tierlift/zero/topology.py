"""Where each rank runs, and the process groups of hierarchical sharding.

Plain ZeRO shards every unit over all ranks, so each gather and reduce-scatter crosses the slow
link between nodes. Hierarchical sharding (as HSDP, or ZeRO++'s hpZ) splits the ranks in two
kinds of group: a *shard* group inside a node, over which the parameters (and the optimizer
state) are sharded and all gathers run, and one or more *replicate* legs, over which the shard
gradients are summed once per step. Every node then holds a full sharded copy of the model.

    hierarchy="node"   the shard group is the node (torchrun's GROUP_RANK, else the host
                       name) and one replicate leg joins the ranks with the same local index;
    mesh=DeviceMesh    the mesh's last dimension shards, every other dimension is a replicate
                       leg, summed innermost first (e.g. a (nodes, pairs, 2) mesh: gather within
                       a pair, sum over the pairs of a node, then across nodes).

Each group's Comm knows the node of each of its ranks, so its byte counts split into traffic
inside a node and across nodes (comm.py), and gradient quantization applies to the legs that
cross nodes.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch.distributed as dist

from tierlift.zero.comm import Comm


@dataclass(kw_only=True)
class Topology:
    """The Comms one sharded model uses."""

    world: Comm        # every rank of the model: votes, agreement, failure reports
    shard: Comm        # the ranks a unit is split over
    legs: list[Comm]   # replicate legs, innermost first (empty: plain ZeRO)

    @property
    def primary(self) -> bool:
        """Whether this rank holds the copy of its shard that checkpoints write (the first
        replica on every leg)."""
        return all(leg.rank == 0 for leg in self.legs)

    def comms(self) -> list[Comm]:
        """Each distinct Comm once."""
        out: list[Comm] = []
        for c in (self.world, self.shard, *self.legs):
            if all(c is not o for o in out):
                out.append(c)
        return out

    def sent(self) -> dict[str, int]:
        """Bytes this rank has sent so far, inside its node and to other nodes."""
        total = {"intra_node": 0, "inter_node": 0}
        for c in self.comms():
            for k in total:
                total[k] += c.sent[k]
        return total


def node_key() -> str:
    """This rank's node: torchrun's node rank when it launched us, else the host name."""
    return os.environ.get("GROUP_RANK") or socket.gethostname()


def node_map(group=None) -> list[int]:
    """The node index (0, 1, ... in order of first appearance) of every rank of `group`,
    learnt from every rank (a collective)."""
    keys: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(keys, node_key(), group=group)
    index: dict = {}
    return [index.setdefault(k, len(index)) for k in keys]


def _ranks(group) -> list[int]:
    return (list(range(dist.get_world_size())) if group is None
            else dist.get_process_group_ranks(group))


def _comm(group, world_nodes: dict[int, int]) -> Comm:
    return Comm(group, nodes=[world_nodes[r] for r in _ranks(group)])


def build(process_group=None, hierarchy: str | None = None, mesh=None) -> Topology:
    """The Comms of a model sharded over `process_group` (default: the world) flat, by node
    (hierarchy="node") or as `mesh` says (values checked by ShardConfig). Every rank of the
    group must call it."""
    if mesh is not None:
        if process_group is not None:
            raise ValueError("give mesh= or process_group=, not both (the mesh has its groups)")
        if hierarchy is not None:
            raise ValueError("give mesh= or hierarchy=, not both (the mesh says the hierarchy)")
        return _from_mesh(mesh)
    if not (dist.is_available() and dist.is_initialized()):
        if hierarchy is not None:
            raise ValueError(f"hierarchy={hierarchy!r} needs torch.distributed initialized "
                             "(launch with torchrun)")
        comm = Comm(process_group)
        return Topology(world=comm, shard=comm, legs=[])
    ranks = _ranks(process_group)
    nodes = node_map(process_group)
    world = Comm(process_group, nodes=nodes)
    if hierarchy is None:
        return Topology(world=world, shard=world, legs=[])
    if len(ranks) != dist.get_world_size():
        # Its groups are created by every rank of the world (torch.distributed's rule).
        raise ValueError(f"hierarchy={hierarchy!r} shards over every rank of the world; got a "
                         f"process_group of {len(ranks)} of {dist.get_world_size()} ranks")
    by_node: dict[int, list[int]] = {}
    for r, n in zip(ranks, nodes, strict=True):
        by_node.setdefault(n, []).append(r)
    sizes = sorted({len(v) for v in by_node.values()})
    if len(sizes) != 1:
        raise ValueError(f"hierarchy='node' needs the same number of ranks on every node, got "
                         f"{ {n: len(v) for n, v in by_node.items()} } (node: ranks)")
    world_nodes = dict(zip(ranks, nodes, strict=True))
    me = dist.get_rank()
    shard = legs = None
    # Every rank creates every group, in the same order (torch.distributed requires it).
    for members in by_node.values():
        g = dist.new_group(members)
        if me in members:
            shard = _comm(g, world_nodes)
    for j in range(sizes[0]):
        members = [v[j] for v in by_node.values()]
        g = dist.new_group(members)
        if me in members:
            legs = [_comm(g, world_nodes)]
    return Topology(world=world, shard=shard, legs=legs)


def _from_mesh(mesh) -> Topology:
    if mesh.ndim < 2:
        raise ValueError(f"mesh= needs at least 2 dimensions (replicate..., shard), got a "
                         f"{mesh.ndim}-D mesh; for plain ZeRO pass process_group= instead")
    everyone = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    if everyone != list(range(dist.get_world_size())):
        raise ValueError(f"mesh= must span every rank of the world ({dist.get_world_size()}), "
                         f"got ranks {everyone}")
    world_nodes = dict(enumerate(node_map(None)))
    world = _comm(None, world_nodes)
    shard = _comm(mesh.get_group(mesh.ndim - 1), world_nodes)
    legs = [_comm(mesh.get_group(d), world_nodes) for d in range(mesh.ndim - 2, -1, -1)]
    return Topology(world=world, shard=shard, legs=legs)
