"""Torch mechanisms that re-point a module's parameters, on a sharded model: refused before
anything runs or changes, with what to do instead.

After shard() a module's `_parameters` holds its unit's flat shard (`_zero_flat_shard`), and its
weight attributes are plain views of the unit's gathered weights, put back at every forward.

- torch.func.functional_call (also torch.nn.utils.stateless.functional_call and
  _reparametrize_module) swaps the tensors it is given in for the names of
  model.named_parameters(): the shards. The forward computes with the gathered weights, so the
  tensors given would be ignored: the model's own output, zero gradients for them. The first
  forward hook (the root's, before any gather or collective) checks that every module still
  holds its unit's shard object; given the original names (`0.weight`), functional_call sets
  the module attributes instead, which the attribute check refuses (hooks.check_copies).
  A tensor given as an nn.Parameter is registered in `_parameters`; the refusal moves it back
  out, so the call's own restore leaves the module as it was (else torch would put the view
  back into `_parameters`, where no later forward can set it).
- model.to(dtype) / .half() / .double() / .cuda(), to_empty(), share_memory(): torch converts
  child modules one by one, so a refusal at the first shard would come after earlier
  children's buffers were converted. The conversion is tried first on a one-element tensor of
  each sharded weight's dtype and device: refused where it changes either or gives new storage.
  model.to(torch.device("cpu", i)) (Accelerate's device on a multi-process CPU run) is
  model.to("cpu"): torch copies a CPU tensor sent to an indexed CPU device, though every index
  is the same memory, and that copy would be refused as new storage.
- torch.nn.utils.prune, torch.nn.utils.weight_norm and torch.nn.utils.parametrize on a sharded
  weight register a parameter of their own from the module attribute (torch raises TypeError
  or KeyError, or removes a pruning hook before failing): refused by name. Re-pruning a weight
  pruned before shard() changes only the mask buffer and works where the weight can be read.
"""

from __future__ import annotations

import functools
import threading

import torch
from torch import nn
from torch.nn.utils import parametrize, prune
from torch.nn.utils.weight_norm import WeightNorm

from tierlift._torch_patch import wrap_method
from tierlift.zero import members
from tierlift.zero.freed import FreedWeight

_UNSHARDED_COPY = ("load tierlift.zero.full_state_dict(model) into a fresh unsharded copy of the "
                   "model and call that")
_BEFORE_SHARD = "before tierlift.zero.shard(model), or on an unsharded model"


# ---- functional_call and assignment ----
def shard_slots(units) -> list[tuple[dict, str]]:
    """Per unit: (its module's `_parameters`, the key its shard is registered under)."""
    out = []
    for unit in units:
        params = unit.module._parameters
        out.append((params, next(k for k, p in params.items() if p is unit.shard)))
    return out


def check_shards_in_place(units, slots) -> None:
    """Raises when a module no longer holds its unit's shard (functional_call swapped it)."""
    for unit, (params, key) in zip(units, slots, strict=True):
        if params.get(key) is not unit.shard:
            _refuse_swapped_shard(unit, key)


def _refuse_swapped_shard(unit, key: str) -> None:
    raise RuntimeError(
        f"the flat shard parameter {key!r} of unit {unit.name!r} was swapped for another tensor "
        "on its module: torch.func.functional_call (also torch.nn.utils.stateless."
        "functional_call and _reparametrize_module) puts the tensors given for the names "
        "model.named_parameters() yields there, or a parameter was assigned. A model sharded "
        "by tierlift.zero.shard computes with its units' gathered weights, not with that "
        "tensor, so the output and its gradients would ignore the tensors given. "
        f"functional_call (per-sample gradients with vmap/grad, MAML) needs full weights: "
        f"{_UNSHARDED_COPY}. Nothing was run")


def is_installed(unit, value) -> bool:
    """Whether a module attribute is one the unit put there (a view of its gathered weights,
    or a stand-in while freed), maybe given other data (`.data =`), not another tensor."""
    return isinstance(value, FreedWeight) or getattr(value, "_base", None) is unit.full


def refuse_hooked(unit) -> None:
    """Raises for a gradient hook registered on a module attribute of `unit` since its views
    were installed (`model.emb.weight.register_hook(mask)`): the attribute is a view that the
    next forward replaces by a fresh one, so the hook would never run again."""
    from tierlift.zero.unused import is_watch_hook

    for e in unit.entries:
        for mod, attr in e.owners:
            now = getattr(mod(), attr, None)
            hooks = getattr(now, "_backward_hooks", None) if isinstance(now, torch.Tensor) \
                else None
            if hooks and not all(is_watch_hook(h) for h in hooks.values()):
                raise RuntimeError(
                    f"a gradient hook was registered on {e.names[0]!r} (its module attribute) "
                    "after tierlift.zero.shard: that attribute is a view of the unit's gathered "
                    "weights, replaced by a fresh one at every forward, so the hook would never "
                    "run. Register it on the model's shards (model.parameters(): it runs once "
                    "this rank's slice of the gradient has landed), or on the module "
                    "(register_full_backward_hook). Nothing was changed")


def refuse_moved(unit, moved: list[str]) -> None:
    """Raises for weights of `unit` whose module attribute was given other data or another
    tensor (unit.moved_attrs()), naming the likely cause."""
    replaced = _take_back_registered(unit)
    for e in unit.entries:
        for mod, attr in e.owners:
            if not is_installed(unit, getattr(mod(), attr, None)):
                replaced = True
    shown = ", ".join(moved[:3]) + (", ..." if len(moved) > 3 else "")
    if replaced:
        raise RuntimeError(
            f"{shown} of unit {unit.name!r} was set to another tensor on its module since the "
            "last forward: torch.func.functional_call (also torch.nn.utils.stateless."
            "functional_call and _reparametrize_module) given the model's original parameter "
            "names sets the module attributes to the tensors given, or an attribute was "
            "assigned. A model sharded by tierlift.zero.shard puts views of its units' gathered "
            "weights back on the modules at every forward, so that tensor would be ignored, "
            "and get no gradient. functional_call (per-sample gradients with vmap/grad, MAML) "
            f"needs full weights: {_UNSHARDED_COPY}. To set weights, write the shards "
            "(model.parameters(): p.data.copy_(...)), load them with model.load_state_dict / "
            "tierlift.zero.load_full_state_dict, or edit them inside "
            "tierlift.zero.gathered(model, modifier_rank=0). Nothing was changed")
    raise RuntimeError(
        f"{shown} of unit {unit.name!r} was given other data through "
        "its module attribute (`.data = ...`) since the last "
        "forward. That attribute is a view of the unit's gathered weights, put back "
        "at every forward, so the change would be undone and the fp32 master "
        "weights never see it. Set the weights through the shards instead "
        "(model.parameters(): p.data = ..., p.data.copy_(...), as an EMA over "
        "model.parameters() does), or load them with model.load_state_dict / "
        "tierlift.zero.load_full_state_dict, or edit them inside "
        "tierlift.zero.gathered(model, modifier_rank=0); to go on, set the "
        "attribute's .data back to what it was")


def _take_back_registered(unit) -> bool:
    """A weight attribute given an nn.Parameter (functional_call, `module.weight = Parameter`)
    is registered in `_parameters`: moved back to a plain attribute, where functional_call's
    restore then puts the view back (in `_parameters` the view could never be set again).
    Whether there was one."""
    found = False
    for e in unit.entries:
        for mod, attr in e.owners:
            module = mod()
            if module is not None and attr in module._parameters:
                value = module._parameters.pop(attr)
                object.__setattr__(module, attr, value)
                found = True
    return found


# ---- where a module's sharded weights are ----
def _sharded_names(module: nn.Module) -> set[str]:
    """The attribute names of `module` that are sharded weights (none outside a sharded model)."""
    ref = members.MEMBERS.get(module)
    state = ref() if ref is not None else None
    if state is None:
        return set()
    return {attr for u in state.units for e in u.entries for mod, attr in e.owners
            if mod() is module}


# ---- dtype and device conversion ----
_CONVERTING = threading.local()  # nesting of Module._apply: only the outermost call checks


def _check_conversion(module: nn.Module, fn) -> bool:
    """Raises when `fn` would change the dtype or device of a sharded weight under `module`, or
    give it new storage; else whether `module` is part of a sharded model or holds one."""
    states = members.states_in(module)
    if not states:
        return False
    inside = {id(m) for m in module.modules()}
    for unit in (u for state in states for u in state.units):
        if id(unit.module) not in inside and not any(
                id(mod()) in inside for e in unit.entries for mod, _ in e.owners):
            continue
        # The device as a tensor there reports it (cuda:0 for a unit placed on "cuda").
        given = torch.empty(1, dtype=unit.shard.dtype, device=unit.device)
        dtype, device, where = given.dtype, given.device, given.data_ptr()
        try:
            with torch.no_grad():
                probe = fn(given)
        except Exception:  # noqa: BLE001 (not a conversion of tensors: torch's own call decides)
            return True
        if not isinstance(probe, torch.Tensor):
            continue
        if (probe.dtype, probe.device) == (dtype, device) and (
                probe is not given or probe.data_ptr() != where):
            what = ("moves tensors to new storage in place: model.share_memory()"
                    if probe is given else "returns new tensors of the same dtype and device: "
                    "model.to_empty() (uninitialised memory), or a copy")
            raise RuntimeError(
                f"a module conversion that {what}, on a model sharded by tierlift.zero.shard, "
                f"would move the weights of unit {unit.name!r} ({dtype} on {device}) away from "
                "the buffer its module attributes view. Build a model on the meta device "
                "and let shard() fill it (shard(model, device=..., weights=...)), load "
                "weights with tierlift.zero.load_full_state_dict; a sharded model is not "
                "shared between processes. Nothing was changed")
        if (probe.dtype, probe.device) != (dtype, device):
            raise RuntimeError(
                f"converting a model sharded by tierlift.zero.shard (model.to(...), .half(), "
                f".bfloat16(), .double(), .float(), .cuda(), .cpu()) would turn the weights of "
                f"unit {unit.name!r} ({dtype} on {device}) into {probe.dtype} on "
                f"{probe.device}: their dtype and device are fixed at shard(), where the fp32 "
                "master shards are made. For low-precision compute pass "
                "tierlift.zero.shard(model, mixed_precision=tierlift.zero.MixedPrecision("
                "param_dtype=...)); otherwise cast or move the model before shard() (shard(..., "
                "device=...) for a model built on meta). Nothing was changed")
    return True


def _checked_to(original):
    def to(self, *args, **kwargs):
        # Only on a sharded model (or one holding it): elsewhere torch's copy is kept.
        if members.states_in(self):
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
            if device is not None and device.type == "cpu" and device.index is not None:
                args, kwargs = (), {"device": torch.device("cpu"), "dtype": dtype,
                                    "non_blocking": non_blocking}
                if memory_format is not None:
                    kwargs["memory_format"] = memory_format
        return original(self, *args, **kwargs)

    return to


def _checked_apply(original):
    def _apply(self, fn, recurse=True):
        depth = getattr(_CONVERTING, "depth", 0)
        swap = torch.__future__.get_swap_module_params_on_conversion()
        # The shards are left as they are (a no-op for them) through `.data =`: swapping them
        # would fail (torch cannot swap a tensor that has weak references) after torch swapped
        # the modules before.
        keep = not depth and _check_conversion(self, fn) and swap
        _CONVERTING.depth = depth + 1
        try:
            if keep:
                torch.__future__.set_swap_module_params_on_conversion(False)
            return original(self, fn, recurse)
        finally:
            _CONVERTING.depth = depth
            if keep:
                torch.__future__.set_swap_module_params_on_conversion(True)

    return _apply


# ---- pruning, weight norm, parametrizations ----
def _refuse_reparametrization(what: str, module: nn.Module, name: str, fix: str) -> None:
    raise RuntimeError(
        f"{what} on {type(module).__name__}.{name}, a weight sharded by tierlift.zero.shard: "
        "it would register a parameter of its own made from the module attribute, which is a "
        f"view of the unit's gathered weights, not a parameter. {fix}. Nothing was changed")


def _checked_prune(original):
    @functools.wraps(original)
    def apply(cls, module, name, *args, **kwargs):
        names = _sharded_names(module)
        if name in names:
            _refuse_reparametrization(f"torch.nn.utils.prune ({cls.__name__})", module, name,
                                      f"Prune {_BEFORE_SHARD}")
        if name + "_orig" in names and isinstance(getattr(module, name + "_orig"), FreedWeight):
            raise RuntimeError(
                f"torch.nn.utils.prune ({cls.__name__}) on {type(module).__name__}.{name}, "
                "pruned before tierlift.zero.shard: the new mask is computed from the weights, "
                f"which stage 3 keeps sharded outside forward. Prune inside `with "
                "tierlift.zero.gathered(model):` on every rank. Nothing was changed")
        return original(cls, module, name, *args, **kwargs)

    return classmethod(apply)


def _checked_prune_remove(original):
    def remove(self, module):
        names = _sharded_names(module)
        if self._tensor_name + "_orig" in names:
            _refuse_reparametrization(
                "torch.nn.utils.prune.remove", module, self._tensor_name,
                "The pruning stays in effect (the mask is applied at every forward); make it "
                f"permanent {_BEFORE_SHARD} (load tierlift.zero.full_state_dict(model) into one)")
        return original(self, module)

    return remove


def _checked_weight_norm(original):
    @functools.wraps(original)
    def apply(module, name, dim):
        names = _sharded_names(module)
        if name in names:
            _refuse_reparametrization("torch.nn.utils.weight_norm", module, name,
                                      f"Apply it {_BEFORE_SHARD}")
        return original(module, name, dim)

    return staticmethod(apply)


def _checked_weight_norm_remove(original):
    def remove(self, module):
        names = _sharded_names(module)
        if self.name + "_g" in names:
            _refuse_reparametrization("torch.nn.utils.remove_weight_norm", module, self.name,
                                      f"Remove it {_BEFORE_SHARD}")
        return original(self, module)

    return remove


def _checked_parametrization(original):
    def register_parametrization(module, tensor_name, parametrization, *, unsafe=False):
        names = _sharded_names(module)
        if tensor_name in names:
            _refuse_reparametrization("torch.nn.utils.parametrize.register_parametrization",
                                      module, tensor_name, f"Register it {_BEFORE_SHARD}")
        return original(module, tensor_name, parametrization, unsafe=unsafe)

    return register_parametrization


def _checked_parametrization_removal(original):
    def remove_parametrizations(module, tensor_name, leave_parametrized=True):
        holder = getattr(module, "parametrizations", None)
        if isinstance(holder, nn.ModuleDict) and tensor_name in holder:
            if _sharded_names(holder[tensor_name]):
                _refuse_reparametrization(
                    "torch.nn.utils.parametrize.remove_parametrizations", module, tensor_name,
                    f"Remove it {_BEFORE_SHARD}")
        return original(module, tensor_name, leave_parametrized)

    return remove_parametrizations


def _wrap_class_attr(cls, name: str, kind, wrap) -> None:
    """wrap_method for a classmethod / staticmethod (looked up in the class's own dict)."""
    original = cls.__dict__.get(name)
    if not isinstance(original, kind) or getattr(original.__func__, "_tierlift_wrapped", False):
        return
    wrapped = wrap(original.__func__)
    wrapped.__func__._tierlift_wrapped = True
    setattr(cls, name, wrapped)


def install() -> None:
    """Idempotent (tierlift/_torch_patch.py)."""
    wrap_method(nn.Module, "_apply", ["self", "fn", "recurse"], _checked_apply)
    wrap_method(nn.Module, "to", ["self", "args", "kwargs"], _checked_to)
    _wrap_class_attr(prune.BasePruningMethod, "apply", classmethod, _checked_prune)
    wrap_method(prune.BasePruningMethod, "remove", ["self", "module"], _checked_prune_remove)
    _wrap_class_attr(WeightNorm, "apply", staticmethod, _checked_weight_norm)
    wrap_method(WeightNorm, "remove", ["self", "module"],
                _checked_weight_norm_remove)
    wrap_method(parametrize, "register_parametrization",
                ["module", "tensor_name", "parametrization", "unsafe"], _checked_parametrization)
    wrap_method(parametrize, "remove_parametrizations",
                ["module", "tensor_name", "leave_parametrized"],
                _checked_parametrization_removal)
