"""Each parameter's own step count where the parameters of a unit skipped different steps
(unused.py steps a parameter without gradient as torch does: not at all), carried across a
resume: optimizer.state_dict() holds them under KEY beside the shard's state (tierlift.checkpoint
writes them into its metadata), and load_state_dict() takes them off the dict and onto the
units, never into optimizer.state, refusing a state without them where the model's units lag.
"""

from __future__ import annotations

import functools
import weakref

import torch

from tierlift._shards import shard_owner
from tierlift._torch_patch import wrap_method


def names(unit, got) -> str:
    """The first names of the unit's entries whose flag in `got` is false."""
    out = [e.names[0] for e, g in zip(unit.entries, got, strict=True) if not g]
    return ", ".join(out[:3]) + (", ..." if len(out) > 3 else "")


# optimizer.state_dict()["state"][i][KEY]: the per-parameter step counts of a unit's entries
# where they differ from its shard's (as_tensor()), so a resume steps them as torch's own
# per-parameter "step" does. load_state_dict() takes it onto the units, never into
# optimizer.state.
KEY = "tierlift_zero_lag"


def record(unit) -> dict | None:
    """The unit's per-entry counts where some differ from the shard's (None: none does)."""
    if unit.stepped_by is None or (not any(unit.lag) and all(unit.stepped)):
        return None
    return {"lag": list(unit.lag), "stepped": list(unit.stepped)}


def as_tensor(rec: dict) -> torch.Tensor:
    """record() as it goes into a state dict: int64 [2, entries], lags then stepped flags (a
    tensor, as the other values of a parameter's state)."""
    return torch.tensor([rec["lag"], [int(s) for s in rec["stepped"]]], dtype=torch.int64)


def _from_tensor(rec):
    if not isinstance(rec, torch.Tensor) or rec.dim() != 2 or rec.shape[0] != 2 or \
            rec.is_complex() or not bool((rec == rec.round()).all()):
        return rec  # a dict, or what check_record refuses
    lag, stepped = rec.to("cpu", torch.int64).tolist()
    return {"lag": lag, "stepped": [s == 1 if s in (0, 1) else s for s in stepped]}


def check_record(unit, rec, where: str) -> tuple[list, list]:
    """`rec` (record()'s format, or as_tensor()'s) as (lags, stepped) for `unit`, or a
    ValueError naming `where`."""
    rec = _from_tensor(rec)
    n = len(unit.entries)
    lag, stepped = (rec.get("lag"), rec.get("stepped")) if isinstance(rec, dict) else (None,
                                                                                      None)
    if (
        not isinstance(lag, (list, tuple))
        or not isinstance(stepped, (list, tuple))
        or len(lag) != n
        or len(stepped) != n
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in lag)
        or not all(isinstance(v, bool) for v in stepped)
    ):
        raise ValueError(
            f"{where}: the per-parameter step counts of unit {unit.name!r} are {rec!r}; "
            f"expected {{'lag': [{n} whole numbers >= 0], 'stepped': [{n} flags]}}, one per "
            "parameter of the unit"
        )
    return list(lag), list(stepped)


def adopt(unit, optimizer, rec, where: str = "optimizer state") -> None:
    """The unit's entries step on from the counts `rec` of a loaded state."""
    unit.lag, unit.stepped = check_record(unit, rec, where)
    unit.stepped_by = weakref.ref(optimizer)


def counts_of(units) -> list:
    """What restore_counts() puts back (a load that failed after the counts were taken)."""
    return [(u, u.lag, u.stepped, u.stepped_by) for u in units]


def restore_counts(saved: list) -> None:
    for u, lag, stepped, by in saved:
        u.lag, u.stepped, u.stepped_by = lag, stepped, by


def unknown_counts(unit) -> RuntimeError:
    even = [not lag and s for lag, s in zip(unit.lag, unit.stepped, strict=True)]
    return RuntimeError(
        f"the optimizer state of unit {unit.name!r} was loaded without its parameters' own "
        f"step counts ({KEY!r}), but parameters of that unit ({names(unit, even)}) "
        "skipped steps that the others took, so their Adam bias correction would be wrong. "
        "Load a state dict saved by optimizer.state_dict() of this tierlift version (it "
        "carries them), or use tierlift.checkpoint.save/load. Nothing was changed"
    )


def install() -> None:
    """Idempotent: an optimizer given a shard gets hook_state_dict()'s hooks at once, so a
    load_state_dict() before its first step takes the counts too."""
    wrap_method(torch.optim.Optimizer, "add_param_group", ["self", "param_group"], _hooking)


def _hooking(original):
    def add_param_group(self, param_group):
        original(self, param_group)
        for p in self.param_groups[-1]["params"]:
            owner = shard_owner(p)
            if owner is not None:
                hook_state_dict(owner[0], self)

    return add_param_group


def hook_state_dict(state, optimizer) -> None:
    """Once per model and optimizer: state_dict() carries the units' counts (KEY);
    load_state_dict() takes them off the dict before it is loaded (refusing a state without
    them where the model's units lag) and onto the units once it is in place."""
    hooked = state.__dict__.setdefault("lag_hooked", weakref.WeakSet())
    if optimizer in hooked:
        return
    hooked.add(optimizer)
    ref = weakref.ref(state)
    optimizer.register_state_dict_post_hook(functools.partial(_save_counts, ref))
    optimizer.register_load_state_dict_pre_hook(functools.partial(_take_counts, ref))
    optimizer.register_load_state_dict_post_hook(functools.partial(_adopt_taken, ref))


def _ours(state, optimizer, sd) -> list:
    """[(unit, position in sd["state"])] of this model's units in `optimizer`."""
    if state is None:
        return []
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    out = []
    for p, i in zip(params, ids, strict=False):
        unit = state.unit_of.get(id(p))
        if unit is not None:
            out.append((unit, i))
    return out


def _by(unit, optimizer) -> bool:
    return unit.stepped_by is not None and unit.stepped_by() is optimizer


def _save_counts(ref, optimizer, sd):
    for unit, i in _ours(ref(), optimizer, sd):
        rec = record(unit) if _by(unit, optimizer) else None
        st = sd["state"].get(i)
        if rec is not None and st and KEY not in st:
            sd["state"][i] = {**st, KEY: as_tensor(rec)}
    return sd


def _take_counts(ref, optimizer, sd):
    """Before anything is loaded: the counts off the dict, kept for _adopt_taken; a state
    without them refused where the model's units lag."""
    state = ref()
    taken, strip = [], set()
    for unit, i in _ours(state, optimizer, sd):
        st = sd["state"].get(i)
        if st and KEY in st:
            taken.append((unit, st[KEY]))
            check_record(unit, st[KEY], "load_state_dict")
            strip.add(i)
        elif st and _by(unit, optimizer) and record(unit) is not None:
            raise unknown_counts(unit)
    if state is not None:
        state.__dict__.setdefault("lag_taken", weakref.WeakKeyDictionary())[optimizer] = taken
    if not strip:
        return None
    return {**sd, "state": {i: {k: v for k, v in st.items() if k != KEY} if i in strip else st
                            for i, st in sd["state"].items()}}


def _adopt_taken(ref, optimizer) -> None:
    state = ref()
    if state is not None:
        for unit, rec in state.__dict__.get("lag_taken", {}).pop(optimizer, []):
            adopt(unit, optimizer, rec, "load_state_dict")
