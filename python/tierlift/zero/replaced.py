"""An optimizer built before shard() holds the parameters shard() replaced: refused, not a no-op.

nanoGPT's train.py builds the optimizer (model.configure_optimizers) before it wraps the model in
DDP; putting tierlift.zero.shard(model) where DDP was leaves that optimizer holding the model's
original parameters. shard() packs them into flat shards and takes them off the modules: they
get no gradient any more, so torch's step() skips them without a word and the model never
trains (the loss stays where it started: 14.8 after four steps against 8.7). shard() records
the parameters it replaced; an optimizer holding one is refused when it is built and at every
step() (a global step pre-hook, checked once per optimizer, shard() call and group count),
before anything changes."""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tierlift._text import first_names

_REPLACED: dict[int, tuple[weakref.ref, str]] = {}  # id(parameter) -> (it, its name)
_GENERATION = [0]  # bumped by every shard(): optimizers checked before are checked again
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (gen, n)
_HOOK: list = []


def record(params) -> None:
    """`params`: [(parameter, its name)] that shard() took off the model."""
    for p, name in params:
        key = id(p)
        _REPLACED[key] = (weakref.ref(p, lambda _, key=key: _REPLACED.pop(key, None)), name)
    _GENERATION[0] += 1
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_before_step))


def check(optimizer, when: str) -> None:
    """Raises when `optimizer` holds a parameter that shard() replaced."""
    if not _REPLACED:
        return
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
            "for weight-decay groups); nothing was changed")


def _before_step(optimizer, args, kwargs) -> None:
    # Every optimizer's step runs this once shard() was called in the process. Inside a
    # compiled step it returns at once (constant under dynamo): a compiler.disable'd hook would
    # be a graph break, which fullgraph=True refuses. Eager steps and __init__ still check.
    if torch.compiler.is_compiling():
        return
    key = (_GENERATION[0], sum(len(g["params"]) for g in optimizer.param_groups))
    if _CHECKED.get(optimizer) == key:
        return
    check(optimizer, "step()")
    _CHECKED[optimizer] = key


_before_step.leaves_grads = True  # only checks: GradScaler's early check stays valid (scaler_scan)
