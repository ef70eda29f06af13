"""optimizer.state_dict() of ZeRO shards records whose shards they are; another rank's is refused.

Each rank's optimizer holds the state (Adam's moments) of its own slice of every unit. A script
that saves on one rank only (nanoGPT: `if master_process: torch.save({"optimizer":
optimizer.state_dict(), ...})`) and loads that file on every rank at resume would give every
other rank rank 0's moments: the tensors have the same shapes, so torch loads them without a
word and training goes on from the wrong state (29% relative off the uninterrupted weights two
steps after the resume in tests/python/test_zero_scripts.py). As model.state_dict() does for its
shards (guards.py), optimizer.state_dict() records under RECORD, per shard it holds state for,
the unit, the rank and world size of its slice and its length; load_state_dict refuses a record
that names another slice, before anything is loaded, and takes the record off the dict. A dict
without one (saved before this was recorded, or rebuilt by hand) loads as before."""

from __future__ import annotations

import weakref

from tierlift._shards import shard_owner

RECORD = "tierlift_zero_shards"  # top-level key of optimizer.state_dict()
_HOOKED: weakref.WeakSet = weakref.WeakSet()


def _shards_in(optimizer, sd: dict) -> list[tuple[int, list]]:
    """[(the shard's index in sd, [unit, rank, world, shard numel])] of the shards of live
    sharded models among `optimizer`'s parameters, matched with `sd`'s ids in order."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in sd.get("param_groups", []) for i in g["params"]]
    out = []
    for p, i in zip(params, ids, strict=False):
        owner = shard_owner(p)
        if owner is not None:
            state, index = owner
            unit = state.units[index]
            out.append((i, [unit.name, state.comm.rank, state.comm.world, unit.shard_numel]))
    return out


def _save(optimizer, sd: dict) -> dict:
    held = sd.get("state", {})
    rec = {i: r for i, r in _shards_in(optimizer, sd) if held.get(i)}
    if rec:
        sd[RECORD] = rec
    return sd


def _load(optimizer, sd: dict):
    rec = sd.get(RECORD)
    if rec is None:
        return None
    held = sd.get("state", {})
    for i, mine in _shards_in(optimizer, sd):
        saved = rec.get(i)
        if saved is None or not held.get(i) or list(saved) == mine:
            continue
        unit, rank, world, numel = saved
        raise RuntimeError(
            f"optimizer.load_state_dict was given the state of rank {rank} of {world}'s ZeRO "
            f"shard of unit {unit!r} ({numel} elements); this is rank {mine[1]} of {mine[2]}, "
            f"whose shard of unit {mine[0]!r} ({mine[3]} elements) is another slice of the "
            "weights, so it would train on another slice's moments. Save optimizer.state_dict() "
            "on every rank to a file of its own (f'optim_rank{rank}.pt') and load each rank's "
            "own, or save and load with tierlift.checkpoint.save/load (any world size); "
            "nothing was loaded")
    return {k: v for k, v in sd.items() if k != RECORD}


def hook(optimizer) -> None:
    """Once per optimizer holding shards: its state_dict() records them, its load_state_dict()
    checks the record first (before any other pre-hook)."""
    if optimizer in _HOOKED:
        return
    if not any(shard_owner(p) is not None for g in optimizer.param_groups for p in g["params"]):
        return
    _HOOKED.add(optimizer)
    optimizer.register_state_dict_post_hook(_save)
    optimizer.register_load_state_dict_pre_hook(_load, prepend=True)
