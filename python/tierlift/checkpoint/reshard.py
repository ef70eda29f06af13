"""The plan (restore.py) that loads a ZeRO checkpoint's streamed optimizer state on another world
size: for each unit, this rank's new shard [lo, hi) of the unit's flat elements overlaps the
saved shards of a few ranks (each `shard_numel` long), and each overlap is one run reading that
byte range of the saved rank's kind files. Only state.json files are read here; the state
itself streams later, chunk by chunk, into the Offloader's tiers, so a resharding load holds
no more host memory than a same-world-size one.
"""

from __future__ import annotations

import os

from tierlift.checkpoint import stream
from tierlift.checkpoint.restore import GroupPlan, ParamSource


def _saved_units(path: str, world: int, optim_dir) -> list[dict]:
    """Per saved rank: {unit name ("unit3"): (its directory, group, state.json entry, kinds)}."""
    out = []
    for r in range(world):
        d = os.path.join(path, optim_dir(r))
        found = {}
        for gi, group in enumerate(stream.read_state_json(d)["groups"]):
            for e in group["params"]:
                found[e["name"]] = (d, gi, e, group["kinds"])
        out.append(found)
    return out


def plan(path: str, meta: dict, units, rank: int, off, optim_dir) -> list[GroupPlan]:
    """The plan that gives Offloader `off` (of this rank, `rank`, with sharded `units`: the
    model's unit for each saved one, or None) its new shards of the state saved in checkpoint
    `path` (metadata `meta`). Raises a ValueError if the saved ranks disagree (a unit stepped
    on some ranks only, or with other step counts)."""
    saved = _saved_units(path, meta["world_size"], optim_dir)
    where = {p: (gi, pi) for gi, g in enumerate(off.opt.param_groups)
             for pi, p in enumerate(g["params"])}
    plans = [GroupPlan() for _ in off.opt.param_groups]
    for i, (unit, m) in enumerate(zip(units, meta["units"], strict=True)):
        if unit is None or unit.shard not in where:
            continue  # None: frozen parameters the model keeps replicated
        gi, pi = where[unit.shard]
        size = m["shard_numel"]
        lo = rank * unit.shard_numel
        hi = min(lo + unit.shard_numel, unit.numel)
        owners = list(range(lo // size, -(-hi // size))) if hi > lo else [0]
        found = [saved[r].get(f"unit{i}") for r in owners]
        if all(f is None for f in found):
            continue  # never stepped: starts fresh
        if any(f is None for f in found) or len({f[2]["step"] for f in found}) > 1:
            raise ValueError(f"checkpoint {path}: the saved ranks {owners} disagree on the "
                             f"optimizer state of unit {i} ({unit.name}): stepped on some only, "
                             "or a different number of times")
        runs = []
        for r, (d, sgi, e, _) in zip(owners, found, strict=True):
            if e["numel"] != size:
                raise ValueError(f"checkpoint {path}: rank {r}'s optimizer state of unit {i} "
                                 f"holds {e['numel']} elements, its shard {size}")
            a, b = max(lo, r * size), min(hi, (r + 1) * size)
            if a < b:
                runs.append((a - lo, b - lo, d, sgi, e["offset"] + a - r * size))
        kinds = set.intersection(*(set(f[3]) for f in found))
        gp = plans[gi]
        gp.kinds = sorted(kinds if gp.kinds is None else kinds & set(gp.kinds))
        gp.params[pi] = ParamSource(step=found[0][2]["step"], numel=unit.shard_numel, runs=runs)
    return plans
