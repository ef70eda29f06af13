"""An optimizer built before shard() holds the parameters shard() replaced: refused, not a no-op.

nanoGPT's train.py builds the optimizer (model.configure_optimizers) before it wraps the model in
DDP; putting tierlift.zero.shard(model) where DDP was leaves that optimizer holding the model's
original parameters. shard() packs them into flat shards and takes them off the modules: they
get no gradient any more, so torch's step() skips them without a word and the model never
trains (the loss stays where it started: 14.8 after four steps against 8.7). shard() records
the parameters it replaced; an optimizer holding one is refused when it is built and at every
step() (a global step pre-hook, checked once per optimizer, shard() call and group count),
before anything changes.

The same check refuses a trainable parameter of a sharded model that shard() did not pack: one
added after shard() (register_parameter, a module attribute set to an nn.Parameter, a frozen
submodule added and unfrozen) or a frozen one added since and then unfrozen. It is an ordinary
parameter, outside every unit, so each rank would step it with its own gradient, never averaged
across the ranks: on 2 ranks a learnable scale added after shard() ended 0.03 and 0.05 away
from the single-process run after three steps, and the ranks apart from each other. A frozen
one the optimizer holds is watched at every step, so unfreezing it later is refused too."""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tierlift._text import first_names
from tierlift.zero import members

_REPLACED: dict[int, tuple[weakref.ref, str]] = {}  # id(parameter) -> (it, its name)
_GENERATION = [0]  # bumped by every shard(): optimizers checked before are checked again
# optimizer -> ((gen, n), [(weak frozen parameter, name)]): the unpacked frozen ones it holds
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HOOK: list = []


def record(params) -> None:
    """`params`: [(parameter, its name)] that shard() took off the model."""
    for p, name in params:
        key = id(p)
        _REPLACED[key] = (weakref.ref(p, lambda _, key=key: _REPLACED.pop(key, None)), name)
    _GENERATION[0] += 1
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_before_step))


def check(optimizer, when: str) -> list:
    """Raises when `optimizer` holds a parameter that shard() replaced, or a trainable one of a
    sharded model that shard() did not pack; returns the frozen unpacked ones it holds
    [(weak parameter, name)], whose requires_grad every step checks again."""
    watch = _check_unpacked(optimizer, when)
    if not _REPLACED:
        return watch
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _REPLACED.get(id(p))
            if entry is not None and entry[0]() is p:
                names.append(entry[1])
    if names:
        shown = first_names(names)
        raise RuntimeError(
            f"{type(optimizer).__name__}.{when} on parameters that tierlift.zero.shard() "
            f"replaced ({shown}): the optimizer was given the model's parameters "
            "before shard(model) packed them into flat shards, so they get no gradient any "
            "more and it would step nothing (the model would not train). Build the optimizer "
            "after shard(), from model.parameters() (tierlift.zero.param_groups(model, ...) "
            "for weight-decay groups). Or a module outside the sharded model still holds "
            "them (a weight tied to a module that was not sharded) and the tie cannot hold: "
            "shard the module that shares it as part of the model, or untie it before "
            "shard(); nothing was changed")
    return watch


def _check_unpacked(optimizer, when: str) -> list:
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    states = members.live_states() if held else []
    # Shards of every live model; frozen parameters shard() left replicated (stages 1/2) are
    # checked by the model itself at the next forward and step (frozen.check_requires_grad).
    known = {id(u.shard) for st in states for u in st.units}
    known.update(id(p) for st in states for _, p in st.replicated)
    names, watch, swapped = [], [], []
    for st in states:
        root = st.root
        sharded = {n for u in st.units for e in u.entries for n in e.names}
        for name, p in root.named_parameters() if root is not None else ():
            if id(p) in held and id(p) not in known:
                if name in sharded:
                    swapped.append(name)
                elif p.requires_grad:
                    names.append(name)
                else:
                    watch.append((weakref.ref(p), name))
    if swapped:
        raise RuntimeError(
            f"{type(optimizer).__name__}.{when} on {first_names(swapped)}, set to a new "
            "nn.Parameter (module.weight = nn.Parameter(...)) on a model sharded by "
            "tierlift.zero.shard: the model computes with its units' gathered weights, so the "
            "new parameter would be ignored and the sharded weight trained on. Put the new "
            "values into the sharded weight instead: copy them inside `with "
            "tierlift.zero.gathered(model, modifier_rank=0):` (stage 3 too), or load them "
            "with tierlift.zero.load_full_state_dict; nothing was changed")
    if names:
        _refuse_unpacked(optimizer, when, names)
    return watch


def _refuse_unpacked(optimizer, when: str, names: list[str]) -> None:
    raise RuntimeError(
        f"{type(optimizer).__name__}.{when} on trainable parameters of a model sharded by "
        f"tierlift.zero.shard that shard() did not pack ({first_names(names)}): added "
        "after shard() (register_parameter, a module attribute set to an nn.Parameter, a "
        "frozen submodule added and unfrozen) or unfrozen since. They are outside every "
        "unit, so each rank would step them with its own gradient, never averaged across "
        "the ranks, and the ranks' copies would drift apart. Add parameters and heads, and "
        "set requires_grad, before tierlift.zero.shard(model); nothing was changed")


def _before_step(optimizer, args, kwargs) -> None:
    # Every optimizer's step runs this once shard() was called in the process. Inside a
    # compiled step it returns at once (constant under dynamo): a compiler.disable'd hook would
    # be a graph break, which fullgraph=True refuses. Eager steps and __init__ still check.
    if torch.compiler.is_compiling():
        return
    key = (_GENERATION[0], sum(len(g["params"]) for g in optimizer.param_groups))
    seen = _CHECKED.get(optimizer)
    if seen is not None and seen[0] == key:
        unfrozen = [name for p, name in seen[1] if p() is not None and p().requires_grad]
        if unfrozen:
            _refuse_unpacked(optimizer, "step()", unfrozen)
        return
    _CHECKED[optimizer] = (key, check(optimizer, "step()"))


_before_step.leaves_grads = True  # only checks: GradScaler's early check stays valid (scaler_scan)
