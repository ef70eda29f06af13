"""Which saved optimizer parameter is which: a checkpoint records, per param group, the name each
optimizer parameter has in the model (its first alias in model.named_parameters(); a ZeRO shard
is named by the first parameter it holds). A load maps the saved state to this optimizer's
parameters by those names, as torch.distributed.checkpoint keys optimizer state by name, so an
optimizer built over the same parameters in another order (q_proj and k_proj swapped, groups
listed the other way round, `list(set(params))`) gets each parameter's own moments, master and
group hyperparameters. Positions alone cannot tell two parameters of one shape apart.

Names match exactly, through any alias of a tied parameter, or else with the wrappers'
path segments removed (torch.compile's `_orig_mod.` anywhere, DDP's leading `module.`) where
that maps one to one. A saved group's hyperparameters go to the group holding the same
parameters; groups that hold other parameters than when saved are refused. A checkpoint
without names (an older tierlift), or an optimizer holding a parameter that is not in the
model, maps by position, as before, once the names both sides have agree there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierlift.checkpoint.restore import GroupPlan

_COMPILED = "_orig_mod"
_DDP = "module"


def strip_wrappers(name: str) -> str:
    """`name` without torch.compile's `_orig_mod` segments and DDP's leading `module.`."""
    parts = [p for p in name.split(".") if p != _COMPILED]
    while len(parts) > 1 and parts[0] == _DDP:
        parts = parts[1:]
    return ".".join(parts)


def by_wrappers(saved: list[str], own: list[str]) -> dict[str, str] | None:
    """{saved name: own name} where the two lists differ only by wrapper segments and map one
    to one after removing them; None otherwise."""
    mine = {}
    for n in own:
        mine.setdefault(strip_wrappers(n), []).append(n)
    out = {}
    for n in saved:
        hit = mine.get(strip_wrappers(n), [])
        if len(hit) != 1:
            return None
        out[n] = hit[0]
    return out if len(set(out.values())) == len(out) else None


def aliases(model: torch.nn.Module) -> dict[int, list[str]]:
    """{id(param): its names in `model`, first alias first}."""
    out: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(n)
    return out


def param_names(model: torch.nn.Module, optimizer, names: dict | None = None) -> list[list]:
    """Per param group, the name of each optimizer parameter in `model` (None: not in it).
    `names`: {id(param): name} to use instead (a ZeRO model's shards)."""
    if names is None:
        names = {i: a[0] for i, a in aliases(model).items()}
    return [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]


@dataclass
class Mapping:
    """groups[gi]: the saved group of this optimizer's group gi; params[gi][pi]: the position in
    that saved group of this optimizer's parameter pi."""

    groups: list[int]
    params: list[list[int]]

    @property
    def identity(self) -> bool:
        return self.groups == list(range(len(self.groups))) and all(
            ps == list(range(len(ps))) for ps in self.params
        )

    def flat(self, saved_sizes: list[int]) -> list[int]:
        """Per parameter of this optimizer in order, its index in the saved state dict."""
        base = [sum(saved_sizes[:i]) for i in range(len(saved_sizes))]
        return [base[sg] + sp for sg, ps in zip(self.groups, self.params, strict=True) for sp in ps]


def _short(groups: list[list]) -> str:
    out = []
    for g in groups:
        shown = ", ".join(repr(n) for n in g[:6]) + (
            f", ... ({len(g)} in all)" if len(g) > 6 else ""
        )
        out.append(f"[{shown}]")
    return "[" + ", ".join(out) + "]"


def _positional(saved: list[list], sizes: list[int], where: str) -> Mapping:
    return Mapping(groups=list(range(len(saved))), params=[list(range(n)) for n in sizes])


def match(
    saved: list[list] | None, own: list[list], where: str, *, alias: dict[str, str] | None = None
) -> Mapping:
    """How this optimizer's parameters (`own`: per group, their names, None where unnamed) map
    to the saved ones (`saved`, as param_names() recorded them; None or [] for a checkpoint
    without names). `alias`: {any name of a parameter: the name `own` gives it} (tied
    weights). Raises a ValueError naming both orders, before anything changes, where the
    mapping is not exact."""
    sizes = [len(g) for g in own]
    if not saved:  # an older checkpoint: by position, as it was loaded before names
        return _positional(own, sizes, where)
    if len(saved) != len(own):
        raise ValueError(
            f"{where} has {len(saved)} optimizer param groups, the optimizer {len(own)}"
        )
    flat_saved = [n for g in saved for n in g]
    flat_own = [n for g in own for n in g]
    if len(flat_saved) != len(flat_own):
        gi = next(i for i, (a, b) in enumerate(zip(saved, own)) if len(a) != len(b))
        raise ValueError(
            f"{where}: the checkpoint's optimizer param group {gi} has "
            f"{len(saved[gi])} parameters, this optimizer's {len(own[gi])} (saved "
            f"{_short(saved)}, here {_short(own)})"
        )
    alias = alias or {}
    resolved = [alias.get(n, n) if n is not None else None for n in flat_saved]
    complete = (
        None not in flat_own
        and None not in resolved
        and len(set(flat_own)) == len(flat_own)
        and len(set(resolved)) == len(resolved)
    )
    if complete and set(resolved) != set(flat_own):
        wrapped = by_wrappers(resolved, flat_own)
        if wrapped is not None:
            resolved = [wrapped[n] for n in resolved]
    if not complete:  # some parameter is not in the model: only positions can pair them
        for gi, (sg, og) in enumerate(zip(saved, own, strict=True)):
            if len(sg) != len(og):
                raise ValueError(
                    f"{where}: the checkpoint's optimizer param group {gi} has "
                    f"{len(sg)} parameters, this optimizer's {len(og)}"
                )
        pos = 0
        for a, b in zip(resolved, flat_own, strict=True):
            if (
                a is not None
                and b is not None
                and a != b
                and strip_wrappers(a) != strip_wrappers(b)
            ):
                raise ValueError(_order_error(where, saved, own, a, b, pos))
            pos += 1
        return _positional(own, sizes, where)
    at = {}
    for sg, g in enumerate(saved):
        for sp, _ in enumerate(g):
            at[resolved[sum(len(x) for x in saved[:sg]) + sp]] = (sg, sp)
    missing = [n for n in flat_own if n not in at]
    if missing:
        extra = [n for n in resolved if n not in set(flat_own)]
        raise ValueError(
            f"{where} does not match the optimizer: {missing[0]!r} is in this "
            f"optimizer but not in the checkpoint's (which has {extra[0]!r} "
            f"instead); saved {_short(saved)}, here {_short(own)}"
        )
    groups, params = [], []
    for gi, g in enumerate(own):
        from_groups = {at[n][0] for n in g}
        if len(from_groups) > 1 or from_groups and len(saved[next(iter(from_groups))]) != len(g):
            n = next(n for n in g if at[n][0] != at[g[0]][0]) if len(from_groups) > 1 else g[0]
            raise ValueError(
                f"{where}: this optimizer's param group {gi} holds other parameters than any "
                f"saved group ({n!r} was in saved group {at[n][0]}), so the saved groups' "
                f"hyperparameters have no one place to go; build the param groups with the "
                f"parameters they held when saved (saved {_short(saved)}, here {_short(own)})"
            )
        groups.append(next(iter(from_groups)) if from_groups else None)
        params.append([at[n][1] for n in g])
    empty_saved = [sg for sg, g in enumerate(saved) if not g]
    groups = [g if g is not None else empty_saved.pop(0) for g in groups]
    return Mapping(groups=groups, params=params)


def _order_error(where: str, saved: list[list], own: list[list], a: str, b: str, pos: int) -> str:
    return (
        f"{where}: the optimizer's parameter #{pos} is {b!r} here but was {a!r} when saved "
        "(another parameter order); as some optimizer parameters are not in the model, "
        "the state can only be matched by position: build the optimizer with the order "
        f"it was saved with (saved {_short(saved)}, here {_short(own)})"
    )


def alias_map(model: torch.nn.Module) -> dict[str, str]:
    """{each name of a parameter in `model`: its first name}."""
    return {n: a[0] for a in aliases(model).values() for n in a}


def remap_plan(plan: list, mapping: Mapping) -> list:
    """A streamed load's plan (restore.py; in the saved groups and positions) in this
    optimizer's order: each source still reads its saved group's files."""
    out = []
    for sg, ps in zip(mapping.groups, mapping.params, strict=True):
        gp = plan[sg]
        out.append(
            GroupPlan(
                kinds=gp.kinds,
                dtypes=gp.dtypes,
                params={pi: gp.params[sp] for pi, sp in enumerate(ps) if sp in gp.params},
            )
        )
    return out


def saved_groups(meta: dict, mapping: Mapping, where: str = "checkpoint") -> list[dict]:
    """The saved groups' hyperparameters in this optimizer's group order, without the names
    torch keeps in a group (this optimizer's own stay: the saved order's would be wrong).
    Raises a ValueError where the groups were reordered under an LR scheduler (below)."""
    if not meta.get("param_groups"):
        return []
    _refuse_scheduled_reorder(meta["param_groups"], mapping, where)
    return [
        {k: v for k, v in meta["param_groups"][sg].items() if k != "param_names"}
        for sg in mapping.groups
    ]


def _refuse_scheduled_reorder(saved: list[dict], mapping: Mapping, where: str) -> None:
    """Groups listed in another order than when saved get their own hyperparameters here, but
    an LR scheduler's state_dict keeps its per-group lists (base_lrs) by position: after
    scheduler.load_state_dict each group would follow another group's schedule. A scheduler
    marks every group it drives with `initial_lr`; refused where those differ between a group
    and the position it moved to."""
    for gi, sg in enumerate(mapping.groups):
        if sg == gi or "initial_lr" not in saved[sg] or "initial_lr" not in saved[gi]:
            continue
        if saved[sg]["initial_lr"] != saved[gi]["initial_lr"]:
            raise ValueError(
                f"{where}: this optimizer lists its param groups in another order than when "
                f"saved (its group {gi} was saved group {sg}), and the saved groups were driven "
                f"by an LR scheduler (initial_lr {saved[sg]['initial_lr']} and "
                f"{saved[gi]['initial_lr']}), whose state_dict keeps per-group values (base_lrs) "
                "by position: after scheduler.load_state_dict each group would follow another "
                "group's schedule. Nothing was loaded; build the param groups in the order they "
                "were saved with")


def refuse_stale_state(optimizer, path: str) -> None:
    """A checkpoint saved without an optimizer, loaded with one that has stepped: its moments
    and step counts would stay, beside weights from another step. Raises before any change."""
    stepped = sum(1 for s in optimizer.state.values() if s)
    if stepped:
        raise ValueError(
            f"checkpoint {path} holds no optimizer state (saved without an optimizer), but the "
            f"optimizer passed to load() holds state for {stepped} parameters, which would be "
            "kept beside the loaded weights; nothing was loaded. Load into a new optimizer, or "
            "pass optimizer=None to load the weights alone"
        )
