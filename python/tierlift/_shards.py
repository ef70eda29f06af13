"""How the optimizer side finds out that a parameter is a ZeRO shard, and reduces over the ranks
that hold the other shards of its model.

tierlift.zero registers each unit's shard here when it shards a model; tierlift.offload (the
offloaded optimizer step) asks which of its parameters are shards, hooks their gradient-ready
events and takes the global gradient norm and the skip-the-step vote over their process groups.
It lives below both packages so that neither imports the other's way up: the optimizer does
not import tierlift.zero (which itself uses tierlift.offload for its NVMe parameter store).

An owner is the ZeroState of a sharded model (tierlift.zero.hooks): what is used here is its
`units` (each with `shard` and `device`), `comm` (tierlift.zero.comm.Comm, the ranks the shards
split over), `world_comm` (every rank of the model, replicas of the shards included) and
`on_grad_ready(shard, fn)`.
"""

from __future__ import annotations

import math
import weakref

import torch

# id(shard) -> (weak shard, weak owner, unit index). Nothing is attached to the Parameter
# itself, so pickling or deep-copying it carries no reference to the model's state.
_OWNERS: dict[int, tuple] = {}


def register_shard(shard: torch.Tensor, owner, index: int) -> None:
    """Records that `shard` is unit `index` of the sharded model whose state is `owner`."""
    key = id(shard)
    _OWNERS[key] = (weakref.ref(shard, lambda _: _OWNERS.pop(key, None)), weakref.ref(owner),
                    index)


def shard_owner(param: torch.Tensor):
    """(owner, unit index) when `param` is the shard of a live sharded model, else None."""
    entry = _OWNERS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    owner = entry[1]()
    return None if owner is None else (owner, entry[2])


def is_shard(param: torch.Tensor) -> bool:
    """Whether `param` is the flat shard of a unit of a (live) sharded model."""
    return shard_owner(param) is not None


def on_shard_grad_ready(param: torch.Tensor, fn):
    """Calls fn(param) each time a synced backward has set (or accumulated into) the gradient
    of `param`, a shard of a sharded model, i.e. as soon as that unit's reduction is done
    (not inside no_sync()). Returns a handle with .remove()."""
    owner = shard_owner(param)
    if owner is None:
        raise ValueError("param is not a shard of a model sharded by tierlift.zero.shard")
    return owner[0].on_grad_ready(param, fn)


def sharded_norm(owner, grads: list, norm_type: float) -> torch.Tensor:
    """The `norm_type` norm of `grads` (shards of the model of `owner`) over all its ranks."""
    device = owner.units[0].device
    if math.isinf(norm_type):
        local = torch.stack([g.abs().max() for g in grads]).max() if grads else \
            torch.zeros((), device=device)
        total = local.to(device=device, dtype=torch.float32).clone()
        owner.comm.wait(owner.comm.all_reduce(total, op=torch.distributed.ReduceOp.MAX))
    else:
        local = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            local += torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) ** norm_type
        owner.comm.wait(owner.comm.all_reduce(local))
        total = local ** (1.0 / norm_type)
    return total


@torch.no_grad()
def global_grad_norm(params, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the gradients of `params` over all ranks: shards of sharded models add up
    across their process group; other parameters (replicated) count once. With the shards of
    one model only, this is exactly the norm clip_grad_norm_(model) computes."""
    owners, local = split_by_owner((p.grad, shard_owner(p)) for p in params
                                   if p.grad is not None)
    return combined_norm(owners, local, float(norm_type))


def split_by_owner(grads) -> tuple[list[tuple], list]:
    """([(owner, {unit indices})], [replicated gradients]) from (grad, (owner, index) or None)
    pairs: what combined_norm takes."""
    by_owner: dict[int, tuple] = {}
    local = []
    for grad, owner in grads:
        if owner is None:
            local.append(grad)
        else:
            by_owner.setdefault(id(owner[0]), (owner[0], set()))[1].add(owner[1])
    return list(by_owner.values()), local


def grad_owners() -> dict[int, tuple]:
    """{id(shard.grad): (owner, unit index)} over the live shards that hold a gradient."""
    out = {}
    for ref, owner_ref, index in list(_OWNERS.values()):
        shard, owner = ref(), owner_ref()
        if shard is not None and owner is not None and shard.grad is not None:
            out[id(shard.grad)] = (owner, index)
    return out


def combined_norm(owners: list[tuple], local: list, norm_type: float,
                  local_norm=None) -> torch.Tensor:
    """The norm over the gradients of units `index` of each (owner, index) in `owners` (summed
    over the owner's ranks: a collective) and the replicated gradients `local` (counted once;
    their norm by `local_norm`, default torch.nn.utils.get_total_norm)."""
    totals = []
    for owner, index in owners:
        grads = [u.shard.grad for i, u in enumerate(owner.units)
                 if i in index and u.shard.grad is not None]
        totals.append(sharded_norm(owner, grads, norm_type))
    if local:
        totals.append((local_norm or torch.nn.utils.get_total_norm)(local, norm_type))
    if len(totals) == 1:
        return totals[0]
    if not totals:
        return torch.zeros(())
    totals = [t.to(torch.float32).cpu() for t in totals]
    if math.isinf(norm_type):
        return torch.stack(totals).max()
    return torch.stack([t ** norm_type for t in totals]).sum() ** (1.0 / norm_type)


def owners_of(params) -> list:
    """The live sharded models (their states) whose shards are among `params`, each once."""
    seen = {}
    for p in params:
        owner = shard_owner(p)
        if owner is not None:
            seen.setdefault(id(owner[0]), owner[0])
    return list(seen.values())


def any_rank_found(owners: list, flags: list[torch.Tensor]) -> torch.Tensor | None:
    """The MAX of the 0/1 tensors `flags` over this rank and every rank of the models of
    `owners` (replicas included), as a float32 tensor left on the device of the last model that
    has more than one rank: nothing is read back, so on a GPU no host sync (the caller's own
    read of the result makes the only one). Each model's collective runs on that model's device,
    where its process group's backend takes tensors (one optimizer may hold models on two GPUs,
    or on the CPU and a GPU: the flag moves between them, a host sync only when it moves between
    the host and a GPU). None where every owner has a single rank: nothing to agree on."""
    reductions = [(o.world_comm, o.units[0].device) for o in owners if o.world_comm.world > 1]
    if not reductions:
        return None
    device = reductions[0][1]
    if flags:
        found = torch.stack([f.to(device=device, dtype=torch.float32).reshape(()) for f in flags])
        found = found.amax()
    else:  # no gradient on this rank: it still takes part in every rank's collective
        found = torch.zeros((), dtype=torch.float32, device=device)
    for comm, device in reductions:
        found = found.to(device)  # the same tensor where the device does not change
        comm.wait(comm.all_reduce(found, op=torch.distributed.ReduceOp.MAX))
    return found


def all_ranks_agree(params, flag: bool) -> bool:
    """`flag` and-ed over every rank of the process groups of the shards among `params` (a
    collective over those groups; `flag` itself when there are none)."""
    for owner in owners_of(params):
        # torch.full, not torch.tensor: no copy from pageable host memory
        t = torch.full((), 0.0 if flag else 1.0, device=owner.units[0].device)
        # Over every rank, replicas included: they must step (or skip) together.
        owner.world_comm.wait(owner.world_comm.all_reduce(t, op=torch.distributed.ReduceOp.MAX))
        flag = flag and not bool(t.item())
    return flag
