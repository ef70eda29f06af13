"""tierlift's forward pre-hooks run before every other pre-hook of a sharded model's modules.

A unit is gathered (stage 3), checked and, after a write through a shard's `.data` (an EMA
swapped in), gathered again (stages 1/2) in forward pre-hooks on its module and on the root,
registered with prepend=True so that pre-hooks registered before shard() (weight_norm, pruning,
a user's) read the current full weights. Two kinds of pre-hook still ran before them:

- a pre-hook registered after shard() with prepend=True, put in front of tierlift's: at stage 3
  it raised NotGatheredError; at stages 1/2 it read the weights from before a `.data` swap.
  nn.Module.register_forward_pre_hook is wrapped: right after such a registration tierlift's
  hooks of that module are moved back to the front (the user's stays before all the others).
- global module pre-hooks (register_module_forward_pre_hook) run before any module's own.
  While a sharded model lives and other global pre-hooks exist, one global pre-hook of
  tierlift's is kept first among them: on a unit's module or the root it runs tierlift's
  pre-hooks of that module, which then skip their own call. It is there only while needed:
  any global pre-hook takes every module call of the process off torch's fast path.

Either way the user's hook runs after the gather, as it would on a module without tierlift.
tierlift's pre-hooks neither read nor replace the inputs, so running them first changes nothing
else a user's hook sees.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

from tierlift._torch_patch import wrap_method
from tierlift.zero import members

_MARK = "_tierlift_zero_pre_hooks"  # in the __dict__ of a module holding tierlift's pre-hooks
_GLOBAL: list = [None]  # the RemovableHandle of tierlift's global pre-hook, while installed


def register_first(state, module: nn.Module, key, hook) -> RemovableHandle:
    """Registers `hook` (state's pre-hook `key` of `module`) in front of the module's
    pre-hooks; `state.pre_hooks[id(module)]` keeps tierlift's (id, key, hook) in front order."""
    handle = module.register_forward_pre_hook(hook, prepend=True)
    state.pre_hooks.setdefault(id(module), []).insert(0, (handle.id, key, hook))
    module.__dict__[_MARK] = True
    _move_first(module, state)
    return handle


def _move_first(module: nn.Module, state) -> None:
    hooks = module._forward_pre_hooks
    for hook_id, _, _ in reversed(state.pre_hooks.get(id(module), ())):
        if hook_id in hooks:
            hooks.move_to_end(hook_id, last=False)


def ran_early(state, module: nn.Module, key) -> bool:
    """Whether tierlift's global pre-hook already ran this pre-hook in this module call (the
    module's own call of it then does nothing)."""
    token = (id(module), key)
    if token in state.ran_early:
        state.ran_early.discard(token)
        return True
    return False


def _state_of(module: nn.Module):
    ref = members.MEMBERS.get(module)
    return ref() if ref is not None else None


def _global_pre_hook(module, args):
    if _MARK not in module.__dict__:  # a module without tierlift's pre-hooks: nothing to do
        return None
    return _run_early(module, args)


def _run_early(module, args):
    state = _state_of(module)
    if state is None:
        return None
    for _, key, hook in state.pre_hooks.get(id(module), ()):
        hook(module, args)
        state.ran_early.add((id(module), key))
    return None


_run_early = torch.compiler.disable(_run_early, reason="tierlift.zero hooks: collectives")


def ensure_global_first(needed: bool = False) -> None:
    """Keeps tierlift's global pre-hook first among the global forward pre-hooks while others
    exist and a sharded model lives (`needed`: one is being built), and removes it when it is
    the only one. Cheap when there are none: one dict truthiness test."""
    hooks = torch_module._global_forward_pre_hooks
    if not hooks:
        return
    handle = _GLOBAL[0]
    if handle is not None and handle.id in hooks:
        if len(hooks) == 1 or not (needed or members.live_states()):
            handle.remove()
            _GLOBAL[0] = None
            # A call a later global pre-hook aborted left its marks: with ours gone, no call
            # renews them, and the module's own pre-hook would skip its gather.
            for state in members.live_states():
                state.ran_early.clear()
        elif next(iter(hooks)) != handle.id:
            hooks.move_to_end(handle.id, last=False)
        return
    if not (needed or members.live_states()):
        return
    handle = RemovableHandle(hooks)
    hooks[handle.id] = _global_pre_hook
    hooks.move_to_end(handle.id, last=False)
    _GLOBAL[0] = handle


def _checked_register(original):
    def register_forward_pre_hook(self, hook, *, prepend=False, with_kwargs=False):
        handle = original(self, hook, prepend=prepend, with_kwargs=with_kwargs)
        if prepend and _MARK in self.__dict__:
            state = _state_of(self)
            if state is not None:
                _move_first(self, state)
        return handle

    return register_forward_pre_hook


def _checked_global_register(original):
    def register_module_forward_pre_hook(hook):
        handle = original(hook)
        ensure_global_first()
        return handle

    return register_module_forward_pre_hook


def install() -> None:
    """Idempotent (tierlift/_torch_patch.py)."""
    wrap_method(nn.Module, "register_forward_pre_hook",
                ["self", "hook", "prepend", "with_kwargs"], _checked_register)
    wrap_method(torch_module, "register_module_forward_pre_hook", ["hook"],
                _checked_global_register)
