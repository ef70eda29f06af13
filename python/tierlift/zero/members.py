"""Which sharded models each module belongs to: the registry that shard() fills (guards.install)
and that every part reads (which ZeroStates a module, a parameter list or a gathered() call
touches). Its own module, importing nothing of tierlift.zero, so that torch_calls can read it
without an import cycle through hooks."""

from __future__ import annotations

import weakref

from torch import nn

MEMBERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> weak ZeroState
STATES: weakref.WeakSet = weakref.WeakSet()  # every live ZeroState
GENERATION = [0]  # bumped by every add(): what is cached over the live states is out of date


def add(model: nn.Module, state) -> None:
    ref = weakref.ref(state)
    for m in model.modules():
        MEMBERS[m] = ref
    STATES.add(state)
    GENERATION[0] += 1


def states_in(module: nn.Module) -> list:
    """The ZeroStates of the sharded models `module` is part of or holds, in a fixed order."""
    out = []
    for m in module.modules():
        ref = MEMBERS.get(m)
        state = ref() if ref is not None else None
        if state is not None and all(state is not s for s in out):
            out.append(state)
    return out


def live_states() -> list:
    """Every live ZeroState. Copying a WeakSet raises "Set changed size during iteration" when
    another thread adds to it (its shard()) or drops a collected state from it meanwhile: copied
    again then, which only such a change in that short window repeats."""
    while True:
        try:
            return list(STATES)
        except RuntimeError as e:
            if "changed size during iteration" not in str(e):
                raise
