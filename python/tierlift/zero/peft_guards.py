"""peft adapters on a model sharded by tierlift.zero.shard: the calls that would go wrong are
refused before they change anything (installed by guards.install when peft is imported).

- Merging and unloading (merge_and_unload, unload, merge_adapter, unmerge_adapter of a merged
  adapter, delete_adapter, and a LoRA layer's own merge() / unmerge()): they write merged
  weights into one layer at a time (at stage 3 into a gathered copy that the shards do not
  follow), or drop adapters.
- New adapters (add_adapter, add_weighted_adapter, load_adapter, the tuner's inject_adapter):
  their weights would not be sharded (the module-registration guard would refuse them half-way,
  after peft recorded the adapter). load_adapter into an adapter the model already has would
  load nothing: peft matches the saved keys against model.state_dict(), whose adapter weights
  are inside flat shards.
- Switching adapters (set_adapter, set_requires_grad, enable / disable adapter layers, the
  disable_adapter() context, for the whole model or one layer): requires_grad is fixed at
  shard(). A switch that would make trainable an adapter weight frozen then (stage 3: it would
  never train; stages 1/2: it would train with no gradient averaging), or freeze one that
  trains while it stays in use (the sharded model would go on training it), is refused; the
  others (evaluating another adapter with inference_mode=True, disable_adapter() around a
  reference forward) change no weight's trainability and are exact.
- save_pretrained without state_dict, get_peft_model_state_dict(model): peft takes the adapter
  from model.state_dict(), which holds flat shards, and would write (or return) no adapter
  weights; set_peft_model_state_dict would load none (the tuner's hooks that map the keys,
  private to peft, are wrapped where this peft has them).
"""

from __future__ import annotations

import functools
import sys
import weakref

import torch
from torch import nn

from tierlift._shards import is_shard
from tierlift._torch_patch import wrap_method
from tierlift.zero import members

# {ZeroState: {id(module): {attribute: trainable when shard() ran}}} for every weight of its model
_TRAINABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_FULL_COPY = ("load tierlift.zero.full_state_dict(model) (or tierlift.hf.gathered_state_dict"
              "(model); a collective: every rank calls it) into an unsharded peft model")


def install(model: nn.Module, state) -> None:
    """Records which weights of `model` train (fixed at shard()) and wraps peft's calls."""
    index: dict[int, dict[str, bool]] = {}
    for u in state.units:
        for e in u.entries:
            for mod, attr in e.owners:
                m = mod()
                if m is not None:
                    index.setdefault(id(m), {})[attr] = not u.frozen
    for m in model.modules():
        for attr, p in m._parameters.items():
            if p is not None and not is_shard(p):
                index.setdefault(id(m), {})[attr] = p.requires_grad
    _TRAINABLE[state] = index
    _wrap_peft()


def _subclasses(cls) -> list:
    out, todo = [], [cls]
    while todo:  # subclasses that define their own version of a call are wrapped too
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


def _wrap(classes, calls: dict) -> None:
    for cls in classes:
        for name, wrap in calls.items():
            if name in cls.__dict__:
                wrap_method(cls, name, None, wrap)


def _wrap_peft() -> None:
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is None or not hasattr(tuners, "BaseTuner"):
        return  # peft's models exist only once it is imported
    peft_model = sys.modules.get("peft.peft_model")
    models = _subclasses(tuners.BaseTuner)
    if peft_model is not None and hasattr(peft_model, "PeftModel"):
        models += _subclasses(peft_model.PeftModel)  # its own delete_adapter, set_adapter, ...
    refused = {n: _refusing(n, _changes_why) for n in (
        "merge_and_unload", "unload", "_unload_and_optionally_merge", "merge_adapter",
        "unmerge_adapter", "delete_adapter")}
    refused.update({n: _refusing(n, _adds_why) for n in (
        "add_adapter", "add_weighted_adapter", "inject_adapter", "load_adapter")})
    refused.update(set_adapter=_switching("set_adapter", _set_adapter_args),
                   set_requires_grad=_switching("set_requires_grad", _requires_grad_args),
                   _enable_adapter_layers=_switching("_enable_adapter_layers", _enable_args),
                   disable_adapter=_checking_context, save_pretrained=_saving)
    _wrap(models, refused)
    for cls in models:
        for name, wrap in (("_get_adapter_state_dict", _collecting),
                           ("_remap_adapter_state_dict_for_load", _mapping_for_load)):
            found = cls.__dict__.get(name)
            if isinstance(found, classmethod) and not getattr(found.__func__, "_tierlift_wrapped",
                                                              False):
                func = functools.wraps(found.__func__)(wrap(found.__func__))
                func._tierlift_wrapped = True
                setattr(cls, name, classmethod(func))
    if hasattr(tuners, "BaseTunerLayer"):
        _wrap(_subclasses(tuners.BaseTunerLayer), {
            "merge": _refusing("merge", _changes_why),
            "unmerge": _refusing("unmerge", _changes_why),
            "set_adapter": _switching("set_adapter", _set_adapter_args, layer=True),
            "set_requires_grad": _switching("set_requires_grad", _requires_grad_args,
                                            layer=True),
            "enable_adapters": _switching("enable_adapters", _enable_args, layer=True)})


# ---- merging, unloading, new adapters: refused outright ----
def _changes_why(name: str) -> str:
    return ("it would change adapters or base weights in place one layer at a time, which the "
            "shards do not follow (the model would be left partly changed). Merge or unload "
            f"before tierlift.zero.shard(model), or on a full copy: {_FULL_COPY} and merge there")


def _adds_why(name: str) -> str:
    load = (" (into an adapter the model already has it would load nothing: peft matches the "
            "saved keys against model.state_dict(), whose adapter weights are inside flat "
            "shards)") if name == "load_adapter" else ""
    return (f"the new adapter's weights would not be sharded, nor their gradients averaged "
            f"across ranks{load}. Add, load or combine adapters before tierlift.zero.shard("
            "model) (e.g. PeftModel.from_pretrained(base, path, is_trainable=True), then "
            f"shard), or on a full copy: {_FULL_COPY}; resume a sharded run with "
            "tierlift.checkpoint")


def _merged(module: nn.Module) -> bool:
    return any(getattr(m, "merged", False) is True for m in module.modules())


def _states(module) -> list:
    return members.states_in(module) if isinstance(module, nn.Module) else []


def _refusing(name: str, why):
    def wrap(original):
        def call(self, *args, **kwargs):
            # unmerging with nothing merged changes nothing: let it through
            if _states(self) and (
                    name not in ("unmerge_adapter", "unmerge") or _merged(self)):
                raise RuntimeError(f"peft's {name} on a model sharded by tierlift.zero.shard: "
                                   f"{why(name)}; nothing was changed")
            return original(self, *args, **kwargs)
        return call
    return wrap


# ---- switching adapters: refused when a weight's trainability would change ----
def _arg(args, kwargs, i: int, name: str, default):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _names(value) -> list[str]:
    if value is None:
        return []  # peft raises its own error
    return [value] if isinstance(value, str) else list(value)


def _set_adapter_args(layer, args, kwargs):
    """(requires_grad it sets per (adapter layer name, adapter), active after, enabled after)."""
    names = _names(_arg(args, kwargs, 0, "adapter_names", kwargs.get("adapter_name")))
    inference = bool(_arg(args, kwargs, 1, "inference_mode", False))
    frozen = getattr(layer, "frozen_peft_weight_names", None) or {}
    grads = {(ln, k): k in names and not inference and ln not in frozen.get(k, ())
             for ln, k in _adapter_keys(layer)}
    return grads, names, not layer.disable_adapters


def _enable_args(layer, args, kwargs):
    if bool(_arg(args, kwargs, 0, "enabled", True)):
        grads, names, _ = _set_adapter_args(layer, (layer.active_adapters,), {})
        return grads, names, True
    return {key: False for key in _adapter_keys(layer)}, layer.active_adapters, False


def _requires_grad_args(layer, args, kwargs):
    names = set(_names(_arg(args, kwargs, 0, "adapter_names", ())))
    grad = bool(_arg(args, kwargs, 1, "requires_grad", True))
    return ({(ln, k): grad for ln, k in _adapter_keys(layer) if k in names},
            layer.active_adapters, not layer.disable_adapters)


def _adapter_keys(layer) -> list[tuple[str, str]]:
    out = []
    for ln in layer.adapter_layer_names:
        holder = getattr(layer, ln, None)
        if isinstance(holder, (nn.ModuleDict, nn.ParameterDict)):
            out += [(ln, k) for k in holder.keys()]
    return out


def _trainable(states, holder, key: str) -> list[bool]:
    """Whether each weight of adapter `key` in `holder` (a ModuleDict or ParameterDict)
    trained when shard() ran."""
    indexes = [_TRAINABLE.get(s) or {} for s in states]
    if isinstance(holder, nn.ParameterDict):
        found = [ix[id(holder)][key] for ix in indexes if key in ix.get(id(holder), {})]
        return found or [bool(getattr(holder[key], "requires_grad", False))]
    return [t for m in holder[key].modules() for ix in indexes
            for t in ix.get(id(m), {}).values()]


def _problem(layer, states, plan) -> str | None:
    grads, active, enabled = plan
    for (ln, key), grad in grads.items():
        trains = _trainable(states, getattr(layer, ln), key)
        if grad and not all(trains):
            return (f"would make adapter {key!r}'s weights trainable, which were frozen when "
                    "tierlift.zero.shard() ran: requires_grad is fixed at shard() (at stage 3 "
                    "they would never train, at stages 1/2 they would train with no gradient "
                    "averaging). Make it trainable before tierlift.zero.shard(model); to "
                    "evaluate another adapter use set_adapter(name, inference_mode=True)")
        if not grad and any(trains) and enabled and key in active:
            return (f"would freeze adapter {key!r}'s weights, which were trainable when "
                    "tierlift.zero.shard() ran and stay in use: requires_grad is fixed at "
                    "shard(), so the sharded model would go on training them. Evaluate under "
                    "torch.no_grad() instead, or freeze before tierlift.zero.shard(model)")
    return None


def _tuner_layers(model: nn.Module) -> list:
    tuners = sys.modules["peft.tuners.tuners_utils"]
    return [m for m in model.modules() if isinstance(m, tuners.BaseTunerLayer)]


def _check_switch(name: str, layers, states, plan_of) -> None:
    for layer in layers:
        if name != "set_requires_grad" and layer.merged:
            # peft unmerges a merged layer to switch it, or in its next forward once disabled
            raise RuntimeError(f"peft's {name} on a model sharded by tierlift.zero.shard, "
                               f"with merged adapters: {_changes_why(name)}; nothing was changed")
        why = _problem(layer, states, plan_of(layer))
        if why is not None:
            raise RuntimeError(f"peft's {name} on a model sharded by tierlift.zero.shard "
                               f"{why}; nothing was changed")


def _switching(name: str, plan, layer: bool = False):
    """A whole model's call is checked on every tuner layer before it changes any; a layer's
    own call (a loop over model.modules()) on that layer."""
    def wrap(original):
        def call(self, *args, **kwargs):
            states = _states(self)
            if states:
                layers = [self] if layer else _tuner_layers(self)
                shown = name  # the public call that runs the private one
                if name == "_enable_adapter_layers":
                    on = bool(_arg(args, kwargs, 0, "enabled", True))
                    shown = "enable_adapter_layers" if on else "disable_adapter_layers"
                _check_switch(shown, layers, states, lambda m: plan(m, args, kwargs))
            return original(self, *args, **kwargs)
        return call
    return wrap


def _checking_context(original):
    """disable_adapter(): entering disables every layer, leaving enables the active adapters
    again (setting them trainable): both are checked on entry, before the body runs."""
    def call(self, *args, **kwargs):
        states = _states(self)
        if states:
            layers = _tuner_layers(self)
            for enabled in (False, True):
                _check_switch("disable_adapter", layers, states,
                              lambda m, e=enabled: _enable_args(m, (e,), {}))
        return original(self, *args, **kwargs)
    return call


# ---- saving and loading adapter weights by name ----
def _holds_shards(state_dict) -> bool:
    return any(k.endswith("_zero_flat_shard") or (isinstance(v, torch.Tensor) and is_shard(v))
               for k, v in state_dict.items())


def _saving(original):
    def call(self, *args, **kwargs):
        if _states(self):
            given = kwargs.get("state_dict")
            if given is None or _holds_shards(given):
                raise RuntimeError(
                    "peft's save_pretrained on a model sharded by tierlift.zero.shard: peft "
                    "takes the adapter weights from model.state_dict(), which holds flat "
                    "shards, and would write an empty adapter file. Pass the full weights: "
                    "full = tierlift.zero.full_state_dict(model) (a collective: every rank "
                    "calls it), then model.save_pretrained(path, state_dict=full) (on rank 0); "
                    "or call tierlift.hf.install(model) once, whose save_pretrained does both; "
                    "nothing was written")
        return original(self, *args, **kwargs)
    return call


def _collecting(original):
    """get_peft_model_state_dict's selection of the adapter's entries."""
    def call(cls, *args, **kwargs):
        model = kwargs["model"] if "model" in kwargs else args[0]
        given = kwargs["state_dict"] if "state_dict" in kwargs else args[3]
        if _states(model) and _holds_shards(given):
            raise RuntimeError(
                "peft's get_peft_model_state_dict on a model sharded by tierlift.zero.shard: "
                "model.state_dict() holds flat shards, so no adapter weight would be found. "
                "Pass the full weights: get_peft_model_state_dict(model, state_dict="
                "tierlift.zero.full_state_dict(model)) (a collective: every rank calls it); "
                "nothing was changed")
        return original(cls, *args, **kwargs)
    return call


def _mapping_for_load(original):
    """set_peft_model_state_dict's mapping of saved keys to the model's."""
    def call(cls, *args, **kwargs):
        model = kwargs["model"] if "model" in kwargs else args[0]
        if _states(model):
            raise RuntimeError(
                "peft's set_peft_model_state_dict on a model sharded by tierlift.zero.shard: "
                "peft matches the saved keys against model.state_dict(), whose adapter "
                "weights are inside flat shards, so it would load nothing. Load adapter "
                "weights before tierlift.zero.shard(model) (PeftModel.from_pretrained(base, "
                "path, is_trainable=True), or set_peft_model_state_dict on the unsharded "
                "model); nothing was changed")
        return original(cls, *args, **kwargs)
    return call
