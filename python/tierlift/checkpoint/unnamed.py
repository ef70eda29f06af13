"""Which saved param group is which, for a ZeRO checkpoint saved without parameter names (a
tierlift from before they were recorded). Each shard's state goes to its unit whatever the
order (io.py); only the groups' hyperparameters (lr, weight_decay, ...) need a saved group per
group of this optimizer, and by position alone an optimizer listing its groups in another
order gives each group the other's.

- Streamed (offloaded) optimizer state names each unit's saved group (state.json): a group
  here takes the saved group its stepped shards were in. Shards from two saved groups in one
  group here are refused.
- Otherwise (and for groups here without a stepped shard) by position, refused where this
  optimizer's own hyperparameters show another order: on the keys the saved groups differ
  in, each group's values equal exactly one saved group's, one to one, and not always the
  one at its position.
"""

from __future__ import annotations

import os

from tierlift.checkpoint import stream
from tierlift.checkpoint.format import jsonable
from tierlift.checkpoint.order import Mapping

_NOT_HYPER = ("params", "param_names")


def _saved_group_of_units(path: str, world: int, optim_dir) -> dict[int, int]:
    """{saved unit index: its saved param group} from every saved rank's state.json."""
    out: dict[int, int] = {}
    for r in range(world):
        groups = stream.read_state_json(os.path.join(path, optim_dir(r)))["groups"]
        for sg, group in enumerate(groups):
            for e in group["params"]:
                out.setdefault(int(e["name"][len("unit"):]), sg)
    return out


def _shown(group: dict, keys: list[str]) -> str:
    return "{" + ", ".join(f"{k}: {group.get(k)!r}" for k in keys) + "}"


def mapping(meta: dict, aligned, optimizer, path: str, optim_dir) -> Mapping:
    """The saved group of each of `optimizer`'s groups (Mapping.groups; Mapping.params is by
    position: per-shard state goes by unit). `aligned`: per saved unit, the model's unit or
    None. Raises a ValueError, before anything changes, where the order cannot be made exact."""
    saved = meta["param_groups"]
    n = len(optimizer.param_groups)
    where = f"checkpoint {path} was saved without parameter names (by an older tierlift)"
    groups: list[int | None] = [None] * n
    if meta.get("optimizer_state") == "offloaded":
        of_unit = _saved_group_of_units(path, meta["world_size"], optim_dir)
        group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        found: list[set] = [set() for _ in range(n)]
        for i, sg in of_unit.items():
            unit = aligned[i] if i < len(aligned) else None
            if unit is not None and id(unit.shard) in group_of:
                found[group_of[id(unit.shard)]].add(sg)
        for gi, sgs in enumerate(found):
            if len(sgs) > 1:
                raise ValueError(
                    f"{where}: this optimizer's param group {gi} holds shards of the saved "
                    f"groups {sorted(sgs)}, so the saved hyperparameters have no one place to "
                    "go; build the param groups with the shards they held when saved")
            groups[gi] = next(iter(sgs)) if sgs else None
        if len(set(g for g in groups if g is not None)) != sum(g is not None for g in groups):
            gi = next(i for i, g in enumerate(groups) if groups.count(g) > 1 and g is not None)
            raise ValueError(f"{where}: two of this optimizer's param groups hold shards of "
                             f"saved group {groups[gi]}; build the param groups as when saved")
    certain = [g is not None for g in groups]
    left = [sg for sg in range(n) if sg not in groups]
    groups = [g if g is not None else left.pop(0) for g in groups]
    differ = sorted({k for g in saved for k in g if k not in _NOT_HYPER
                     and len({repr(s.get(k)) for s in saved}) > 1})
    # Evidence of another order: each group here looks like exactly one saved group, no two
    # alike, and not always the one at its position (values changed on purpose show no such
    # one-to-one likeness, and stay by position).
    like = {}
    for gi, group in enumerate(optimizer.param_groups):
        if certain[gi] or not differ:
            continue
        mine = {k: jsonable(group.get(k)) for k in differ}
        like[gi] = [sg for sg, s in enumerate(saved) if all(s.get(k) == mine[k] for k in differ)]
    seen = [v[0] for v in like.values() if len(v) == 1]
    if like and len(seen) == len(like) and len(set(seen)) == len(seen):
        moved = [gi for gi, v in like.items() if v[0] != groups[gi]]
        if moved:
            gi, sg = moved[0], like[moved[0]][0]
            mine = {k: jsonable(optimizer.param_groups[gi].get(k)) for k in differ}
            raise ValueError(
                f"{where}, so its param groups can only be matched by position, and this "
                f"optimizer's param group {gi} ({_shown(mine, differ)}) looks like saved group "
                f"{sg} ({_shown(saved[sg], differ)}), not saved group {groups[gi]} "
                f"({_shown(saved[groups[gi]], differ)}): its groups are listed in another "
                "order than when saved. Nothing was loaded; build the param groups in the "
                "order they were saved with")
    return Mapping(groups=groups, params=[list(range(len(g["params"])))
                                          for g in optimizer.param_groups])
