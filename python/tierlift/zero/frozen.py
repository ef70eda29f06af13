"""Frozen parameters (requires_grad=False) under ZeRO: when a stage-3 frozen unit is freed in
backward, and the check that no parameter changed requires_grad after shard().

Stage 3 shards frozen parameters into FlatUnits of their own (unit.py): gathered with their
module for forward and again for backward (the input gradient of a frozen weight's op needs
the full weight), never reduced. A trainable unit is freed when its gradient is accumulated,
which autograd does only after every op that used its weights; a frozen weight has no
gradient, so nothing says when its last op ran. Instead the module's forward pre-hook puts
a gradient hook on its inputs that require grad (autograd's register_multi_grad_hook): it
runs once their gradients are complete, i.e. after the module's backward has reached its
inputs (and after any use of them outside the module, which only makes it later). Much as
FSDP2 does, this counts on the module's ops that lead elsewhere (to its own trainable weights)
having run by then too: they were recorded after the inputs, and autograd runs
later-recorded ops first. The unit is freed there once every call of its module in this
forward got that far (`pending_backward`). A call whose inputs need no gradient (the first
block after a frozen embedding) has no such point: its unit stays gathered (`pinned`) until
the end of backward.

requires_grad is fixed at shard(): a parameter frozen afterwards would still be reduced and
stepped, one unfrozen afterwards would never get a gradient (stage 3) or would train without
its gradient averaged over the ranks (stages 1/2). The next forward, and the next step of an
optimizer holding the model's shards, refuse both.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class Frozen:
    """The group key of a unit of frozen parameters of one dtype (groups.split_frozen)."""

    dtype: torch.dtype


def install(state, module, indices: list[int]):
    """The forward pre-hook (with kwargs) of `module`, which holds the frozen units `indices`
    of `state` (stage 3)."""
    ref = weakref.ref(state)

    def pre_forward(mod, args, kwargs):
        st = ref()
        if st is None or not torch.is_grad_enabled():
            return None
        units = [st.units[i] for i in indices]
        inputs = [t for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        if not inputs:
            for u in units:
                u.pinned = True
            return None
        # A forward run inside backward is a recomputation (activation checkpointing): the
        # reentrant kind backpropagates through it, the other kind only keeps its tensors.
        counted = torch._C._current_graph_task_id() == -1
        if counted:
            for u in units:
                u.pending_backward += 1
        torch.autograd.graph.register_multi_grad_hook(inputs, _done(ref, indices, counted))
        return None

    return module.register_forward_pre_hook(pre_forward, with_kwargs=True)


def _done(ref, indices: list[int], counted: bool):
    def done(grads):
        st = ref()
        if st is None:
            return
        for i in indices:
            u = st.units[i]
            if counted:
                if u.pending_backward == 0:
                    continue  # counted before an earlier backward ended: freed at the end
                u.pending_backward -= 1
            if u.pending_backward == 0 and not u.pinned:
                st._free(u)
    return done


def reset(state) -> None:
    """At the end of backward (every unit is freed then)."""
    for u in state.units:
        u.pending_backward = 0
        u.pinned = False
        u.expects_backward = False


def check_requires_grad(state) -> None:
    """Raises if a parameter of the model changed requires_grad since shard()."""
    for u in state.units:
        if u.shard.requires_grad == u.frozen:
            was, now = ("frozen", "trainable") if u.frozen else ("trainable", "frozen")
            names = [e.names[0] for e in u.entries]
            raise RuntimeError(
                f"the shard of {names[:3]}{' ...' if len(names) > 3 else ''} (unit {u.name!r}) "
                f"was {was} when tierlift.zero.shard() packed it and is {now} now: requires_grad "
                "is fixed at shard() (a parameter frozen since would still be updated, one "
                "unfrozen since would get no gradient). Set requires_grad (freeze the base, add "
                "adapters) before tierlift.zero.shard(model), then build the optimizer")
    for name, p in state.replicated:
        if p.requires_grad:
            raise RuntimeError(
                f"parameter {name!r} was frozen when tierlift.zero.shard() ran, so it was not "
                "sharded, and requires grad now: its gradient would not be averaged across "
                "ranks. Set requires_grad before tierlift.zero.shard(model)")
