"""Ordinary torch calls on a sharded model: made exact, or refused before anything changes.

model.parameters() of a sharded model yields one flat fp32 shard per unit (this rank's slice
of the unit's parameters, back to back). Two everyday torch lines would silently see that
slice instead of the model:

- torch.nn.utils.clip_grad_norm_(model.parameters(), ...) (and get_total_norm) would clip each
  rank by the norm of its own slice. Both go through torch.nn.utils.clip_grad._get_total_norm,
  looked up when called (so a script that imported clip_grad_norm_ before tierlift is covered
  too); wrapped, the norm over shard gradients is the whole model's, summed over the shards'
  ranks (a collective, as every rank clips), the same on every rank. Other tensors count once.
- Optimizer param groups split by name or shape (nanoGPT's `p.dim() >= 2`, Hugging Face's
  "bias" / "norm" names) cannot see the model's parameters in a shard: every shard lands on one
  side and the other side is left empty. An optimizer built with an empty group whose settings
  differ from those of a group holding shards (shards that shard(param_group_fn=...) did not
  split) is refused when it is constructed, naming the way to split them.
- optimizer.zero_grad() and model.zero_grad() after backwards inside no_sync() would clear only
  the shard gradients: the local sums no_sync() keeps in each unit's full gradient would reach
  the next synced backward. Under DDP they live in param.grad, which zero_grad clears; so the
  wrapped zero_grad drops them for every shard it clears (a shard's `p.grad = None` by hand is
  not seen).
- A submodule's .parameters() yields the shards of the units inside it only: its parameters kept
  in an enclosing unit (a Llama's model.model.norm.weight, in the root unit) are missing. Such a
  subset given to clip_grad_norm_ / get_total_norm / clip_grad_value_ / clip_grads_with_norm_
  (all through clip_grad's _get_total_norm or _group_tensors_by_device_and_dtype) or as an
  optimizer param group is refused before any gradient changes, naming what is missing. A
  subset that loses nothing (whole units: model.blocks[0] when the block is a unit) is exact.
- torch.optim.LBFGS, torch.optim.Adafactor (and transformers' Adafactor) and torch.optim.Muon
  do not update each element from its own gradient and state alone (dot products over all
  parameters; per-parameter RMS; row/column factors or orthogonalization of 2-D weights), so over
  flat shards they would compute another update than torch's (LBFGS 104% off, Adafactor 1.2%
  after 3 steps on 2 ranks). Refused when given shards (construction or add_param_group).
- optimizer.state_dict() holds this rank's slice of the state only: it records whose slice,
  and load_state_dict refuses another rank's (a file saved on rank 0 only, loaded everywhere);
  see optim_record.py.
- torch.distributed calls on the shards or their gradients (a broadcast of the initial weights,
  the tutorial's average_gradients, model averaging) would mix the ranks' different slices:
  refused before anything is sent, see collectives.py.
- module.requires_grad_() after shard() on a module inside a unit (a block's LayerNorm, the
  final norm in the root unit) would change nothing (its .parameters() yields no shard) and the
  weights would go on training: refused, as any change of requires_grad after shard() is.
- Hugging Face model.generate() at stage 3 over several ranks: every forward gathers the
  weights (a collective), so a rank whose sequences finish first and leaves the loop would
  leave the others waiting in their next forward's gathers until the process group's timeout.
  transformers keeps every rank forwarding until all are done with synced_gpus=True, which it
  turns on by itself only for DeepSpeed ZeRO-3 and FSDP: GenerationMixin.generate (wrapped
  once transformers is imported, at the next shard()) turns it on for a stage-3 sharded model,
  also over an explicit False (Seq2SeqTrainer's), as tierlift.hf.install's generate does. The
  tokens are the same; a model whose own generate() does not call GenerationMixin's is not
  covered.
"""

from __future__ import annotations

import inspect
import sys
import weakref

import torch

from tierlift._shards import combined_norm, grad_owners, shard_owner, split_by_owner
from tierlift._text import first_names
from tierlift._torch_patch import wrap_method
from tierlift.offload.overlap import group_settings, same_hyper
from tierlift.zero import (
    autograd_calls,
    collectives,
    members,
    optim_record,
    replaced,
    unused,
    user_calls,
)

_NORM_PARAMS = ["tensors", "norm_type", "error_if_nonfinite", "foreach"]
_GROUP_PARAMS = ["tensorlistlist", "with_indices"]
# owner -> {(units given, units that count): [(module name, [lost parameter names])]}. Keyed by
# unit indices, not tensor ids: gradients are new tensors (often at reused ids) every step.
_SUBSETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# ids of the optimizers inside Optimizer.__init__: their add_param_group calls are checked all
# together once every group is in.
_BUILDING: set[int] = set()


def _lossy_modules(owner, given: frozenset, pool: frozenset) -> list[tuple]:
    """The submodules whose .parameters() yields exactly the shards `given` (among the units
    `pool` that count) while some of their own parameters, in a unit of `pool` outside them
    (an enclosing unit's shard), would be left out: [(module name, [those parameters], name of
    a submodule yielding the same shards that lacks nothing, or None)]."""
    root = owner.root
    if root is None:
        return []
    out, lossless = [], []
    for name, module in root.named_modules():
        if not name:
            continue
        inside = set()
        for p in module.parameters():
            found = shard_owner(p)
            if found is not None and found[0] is owner:
                inside.add(found[1])
        if not inside or frozenset(inside & pool) != given:
            continue
        prefix = name + "."
        lost = [e.names[0] for i, u in enumerate(owner.units)
                if i in pool and i not in inside and not u.frozen
                for e in u.entries if any(n.startswith(prefix) for n in e.names)]
        (out if lost else lossless).append((name, lost))
    # The same shards as a submodule that lacks nothing: refused too (which one the caller
    # meant cannot be told apart), saying so.
    twin = lossless[0][0] if lossless else None
    return [(name, lost, twin) for name, lost in out]


def check_subset(found, call: str, *, grads: bool, settle=None) -> None:
    """Refuses (before any change) shards `found` ((owner, unit index) pairs) that are what a
    submodule's .parameters() yields after shard() but lack some of its parameters (see the
    module doc). grads=True: only units holding a gradient count. settle(owner, name, lost),
    when given, returns the lost names it accepts (an optimizer group with the same settings
    holds them)."""
    by_owner: dict = {}
    for owner, index in found:
        by_owner.setdefault(owner, set()).add(index)
    for owner, indices in by_owner.items():
        pool = frozenset(i for i, u in enumerate(owner.units)
                         if (u.shard.grad is not None if grads else not u.frozen))
        given = frozenset(indices) & pool
        if not given or given == pool:
            continue  # the whole model (the every-step case): nothing is left out
        cache = _SUBSETS.setdefault(owner, {})
        key = (given, pool)
        if key not in cache:
            cache[key] = _lossy_modules(owner, given, pool)
        for name, lost, twin in cache[key]:
            if settle is not None:
                ok = settle(owner, name, lost)
                lost = [n for n in lost if n not in ok]
            if lost:
                shown = first_names(lost)
                raise ValueError(
                    f"{call} was given the parameters of {name!r} ({name}.parameters()) of a "
                    "model sharded by tierlift.zero.shard: after shard() they are the flat "
                    "shards of the units inside it only, and these of its parameters live in "
                    f"an enclosing unit's shard, so they would be left out: {shown}. "
                    "Pass model.parameters() (the whole model), or shard with units=[...] so "
                    f"that every parameter of {name!r} is in a unit inside it (a unit of its "
                    f"own: units=[..., {name!r}] or its submodules)"
                    + (f". (These are also the shards of {twin}.parameters(), which lacks "
                       "nothing; the two cannot be told apart.)" if twin else ""))


def _global_norm(original):
    def get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        owners = grad_owners() if tensors else {}
        if not any(id(t) in owners for t in tensors):
            return original(tensors, norm_type, error_if_nonfinite, foreach)
        check_subset((owners[id(t)] for t in tensors if id(t) in owners),
                     "clip_grad_norm_ / get_total_norm", grads=True)
        shards, local = split_by_owner((t, owners.get(id(t))) for t in tensors)
        total = combined_norm(shards, local, float(norm_type),
                              lambda ts, nt: original(ts, nt, False, foreach))
        total = total.to(tensors[0].device)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        return total

    return get_total_norm


def _checked_grouping(original):
    # clip_grad_value_ and clip_grads_with_norm_ group the gradients here before changing them.
    def _group_tensors_by_device_and_dtype(tensorlistlist, with_indices=False):
        if tensorlistlist and tensorlistlist[0]:
            owners = grad_owners()
            check_subset((owners[id(t)] for t in tensorlistlist[0] if id(t) in owners),
                         "clip_grad_value_ / clip_grads_with_norm_", grads=True)
        return original(tensorlistlist, with_indices)

    return _group_tensors_by_device_and_dtype


def _groups_lossy(param_groups: list[dict]) -> None:
    """A param group that is a submodule's .parameters() lacking some of its parameters (see
    the module doc) is refused, unless a group with the same settings holds what it lacks."""
    where = {}  # id(shard) -> group index
    for i, group in enumerate(param_groups):
        for p in group["params"]:
            where[id(p)] = i
    for i, group in enumerate(param_groups):
        found = [o for o in map(shard_owner, group["params"]) if o is not None]

        def settle(owner, name, lost, i=i):
            ok = set()
            for u in owner.units:
                j = where.get(id(u.shard))
                if j is not None and same_hyper(group_settings(param_groups[j]),
                                                group_settings(param_groups[i])):
                    ok.update(e.names[0] for e in u.entries)
            return ok

        check_subset(found, f"optimizer param group {i}", grads=False, settle=settle)


def check_groups(param_groups: list[dict]) -> None:
    """Refuses param groups that split ungrouped shards by name or shape (see above)."""
    holding = []
    for i, group in enumerate(param_groups):
        for p in group["params"]:
            owner = shard_owner(p)
            if owner is not None and owner[0].units[owner[1]].group is None:
                holding.append(i)
                break
    _groups_lossy(param_groups)
    if not holding:
        return
    for i, group in enumerate(param_groups):
        if group["params"]:
            continue
        for j in holding:
            if not same_hyper(group_settings(group), group_settings(param_groups[j])):
                raise ValueError(
                    f"optimizer param group {i} is empty while group {j}, with other settings, "
                    "holds ZeRO shards: after tierlift.zero.shard() each parameter of "
                    "model.parameters() is one unit's flat 1-D shard, so a split by parameter "
                    "name or shape (p.dim() >= 2, 'bias' or 'norm' in the name) puts every "
                    "shard on one side. Split them with shard(model, ..., param_group_fn=fn) "
                    "(fn(name, param) sees the model's own names and shapes) and build the "
                    "groups with tierlift.zero.param_groups(model, {key: settings})")
    _check_kinds(param_groups)


def _weight_decay(group: dict):
    value = group.get("weight_decay")
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)  # None (an optimizer without weight decay) or something odd


def _kinds(unit) -> tuple[list[str], list[str]]:
    """(names of the unit's matrices, names of its biases, norm weights and scalars)."""
    return ([e.names[0] for e in unit.entries if len(e.shape) >= 2],
            [e.names[0] for e in unit.entries if len(e.shape) <= 1])


def _check_kinds(param_groups: list[dict]) -> None:
    """Refuses groups that give one model's ungrouped shards different weight_decay when one of
    those shards packs matrices with biases / norm weights: the rule that split them (module
    type, name, shape) saw the unit's module and a 1-D `_zero_flat_shard`, not its parameters,
    so the mixed unit's parameters all got one setting where torch gives them two. A split by
    unit with different weight decay (a head without decay) is refused too: the groups alone
    cannot tell it from those. Equal weight_decay (learning rates per unit) is exact. Shards
    split by shard(param_group_fn=...) are trusted: the user split each unit consciously."""
    by_model: dict = {}  # owner -> {unit index: group index}
    for i, group in enumerate(param_groups):
        for p in group["params"]:
            found = shard_owner(p)
            if found is None:
                continue
            owner, index = found
            unit = owner.units[index]
            if unit.group is None and not unit.frozen:  # a frozen shard is never stepped
                by_model.setdefault(owner, {})[index] = i
    for owner, where in by_model.items():
        decays = {}  # weight_decay -> first group index giving it
        for i in sorted(set(where.values())):
            decays.setdefault(_weight_decay(param_groups[i]), i)
        if len(decays) < 2:
            continue
        for index in sorted(where):
            unit = owner.units[index]
            matrices, flat = _kinds(unit)
            if not (matrices and flat):
                continue
            i = where[index]
            mine = _weight_decay(param_groups[i])
            other = next(w for w in decays if w != mine)
            raise ValueError(
                f"optimizer param group {i} (weight_decay={mine}) holds the ZeRO shard of unit "
                f"{unit.name!r} while group {decays[other]} gives other shards of the same "
                f"model weight_decay={other}: after tierlift.zero.shard() a unit's parameters "
                f"are one flat 1-D shard, and this one packs matrices ({first_names(matrices)}) "
                f"with biases / norm weights ({first_names(flat)}), so a split by module type, "
                "parameter name or shape (detectron2's get_default_optimizer_params, mmengine's "
                "norm_decay_mult / bias_decay_mult, 'bias' or 'norm' in the name, p.dim() < 2) "
                "gave them all one weight decay. Split them with shard(model, ..., "
                "param_group_fn=fn) (fn(name, param) sees the model's own names and shapes; to "
                "keep the groups a framework builds, build them on the model before shard() and "
                "let fn return the index of the group holding each parameter) and build the "
                "groups with tierlift.zero.param_groups(model, {key: settings}) "
                "(docs/zero-optimizer-groups.md). Nothing was changed")


# Optimizers whose update of an element reads more than that element's gradient and state:
# over flat shards (each rank one 1-D slice of each unit) they cannot compute torch's update.
_WHOLE_TENSOR = {
    "LBFGS": "its line search and curvature pairs are dot products over every parameter, and "
             "each rank would take them over its own slice only",
    "Adafactor": "it factors each 2-D parameter's second moment by rows and columns and scales "
                 "each parameter's step by that parameter's RMS, and a shard is a 1-D slice of "
                 "a whole unit",
    "Muon": "it orthogonalizes each 2-D parameter's update, and a shard is a 1-D slice of a "
            "whole unit",
}
_WHOLE_TENSOR_CLASSES = {"transformers.optimization.Adafactor": "Adafactor"}


def _whole_tensor_kind(cls) -> str | None:
    for name in _WHOLE_TENSOR:
        base = getattr(torch.optim, name, None)
        if base is not None and issubclass(cls, base):
            return name
    for base in cls.__mro__:
        kind = _WHOLE_TENSOR_CLASSES.get(f"{base.__module__}.{base.__qualname__}")
        if kind is not None:
            return kind
    return None


def check_elementwise(cls, param_groups: list[dict]) -> None:
    """Refuses shards given to an optimizer class whose update is not elementwise
    (_WHOLE_TENSOR), at construction or add_param_group, before the optimizer holds them."""
    kind = _whole_tensor_kind(cls)
    if kind is None:
        return
    for group in param_groups:
        for p in group["params"]:
            found = shard_owner(p)
            if found is not None:
                raise ValueError(
                    f"{cls.__name__} was given the ZeRO shard of unit "
                    f"{found[0].units[found[1]].name!r} (model.parameters() of a model sharded "
                    f"by tierlift.zero): {_WHOLE_TENSOR[kind]}. Over shards only optimizers "
                    "that update each element from its own gradient and state are exact (SGD, "
                    "Adam, AdamW, RMSprop, Adagrad, tierlift.optim.AdamW). Use one of "
                    f"those, or train this model without tierlift.zero (DDP) to use "
                    f"{cls.__name__}. Nothing was changed")


def _checking(original):
    def __init__(self, params, defaults):
        _BUILDING.add(id(self))
        try:
            original(self, params, defaults)
        finally:
            _BUILDING.discard(id(self))
        check_elementwise(type(self), self.param_groups)
        check_groups(self.param_groups)
        replaced.check(self, "__init__()")
        optim_record.hook(self)

    return __init__


def _checked_add(original):
    # A group added after construction (a head or a second model added later): the groups it
    # would make are checked for mixed units before torch changes anything.
    def add_param_group(self, param_group):
        if id(self) not in _BUILDING and isinstance(param_group, dict) \
                and "params" in param_group:
            params = param_group["params"]
            if not isinstance(params, (torch.Tensor, set)):
                params = param_group["params"] = list(params)  # torch lists it the same way
                tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]
                _check_kinds([*self.param_groups,
                              {**self.defaults, **param_group, "params": tensors}])
                check_elementwise(type(self), [{"params": tensors}])
        return original(self, param_group)

    return add_param_group


def _drop_local_sums(params) -> None:
    """Drops what no_sync() summed locally for the units of the shards in `params`."""
    collectives.forget()  # the next gradients are other tensors
    for p in params:
        owner = shard_owner(p)
        if owner is not None:
            unit = owner[0].units[owner[1]]
            if not unit.frozen:
                unit.full.grad = None
                unused.reset(unit)


def _optimizer_zero_grad(original):
    def zero_grad(self, set_to_none=True):
        original(self, set_to_none)
        _drop_local_sums(p for g in self.param_groups for p in g["params"])

    return zero_grad


def _module_zero_grad(original):
    def zero_grad(self, set_to_none=True):
        original(self, set_to_none)
        _drop_local_sums(self.parameters())

    return zero_grad


def _changed_by(state, module, requires_grad: bool) -> list[str]:
    """Names of the sharded model's weights under `module` (its own attributes or its
    submodules') whose requires_grad `module.requires_grad_(requires_grad)` would change."""
    inside = {id(m) for m in module.modules()}
    out = []
    for unit in state.units:
        if unit.frozen == (not requires_grad):
            continue
        for e in unit.entries:
            if any(id(mod()) in inside for mod, _ in e.owners if mod() is not None):
                out.append(e.names[0])
    if requires_grad:
        own = {id(p) for p in module.parameters()}
        out += [name for name, p in state.replicated if id(p) in own]
    return out


def _module_requires_grad(original):
    # After shard() a module's weights are views of its unit's buffer, and .parameters() of a
    # module inside a unit (a LayerNorm of a block, the final norm in the root unit) yields no
    # shard: torch's requires_grad_ would change nothing there and training would go on
    # updating the weights it was meant to freeze. requires_grad is fixed at shard() (the
    # next forward or step refuses a changed shard): refused here, before anything changes.
    def requires_grad_(self, requires_grad=True):
        for state in members.states_in(self):
            names = _changed_by(state, self, bool(requires_grad))
            if names:
                root = state.root
                where = next((n for n, m in root.named_modules() if m is self), None) \
                    if root is not None else None
                what = (f"{where or 'model'}.requires_grad_({bool(requires_grad)})"
                        if where is not None else
                        f"requires_grad_({bool(requires_grad)}) on a module holding the model")
                shown = first_names(names)
                raise RuntimeError(
                    f"{what} on a model sharded by tierlift.zero.shard would "
                    f"{'freeze' if not requires_grad else 'unfreeze'} {shown}: requires_grad "
                    "is fixed when shard() packs the weights into flat shards (a module "
                    "inside a unit holds no parameter of its own any more, so torch's "
                    "requires_grad_ would leave them training). Freeze or unfreeze before "
                    "tierlift.zero.shard(model), then build the optimizer; to change it during "
                    "training, save tierlift.zero.full_state_dict(model), build and shard a new "
                    "model from it with the new requires_grad. Nothing was changed")
        return original(self, requires_grad)

    return requires_grad_


def _gathers_over_ranks(model) -> bool:
    """Whether `model` holds a stage-3 sharded model over several ranks (its forwards gather)."""
    return isinstance(model, torch.nn.Module) and any(
        st.config.stage == 3 and st.world_comm.world > 1 for st in members.states_in(model))


def _synced_generate(original):
    sig = inspect.signature(original)

    def generate(self, *args, **kwargs):
        if members.STATES.data and _gathers_over_ranks(self):
            if "synced_gpus" in sig.parameters:
                bound = sig.bind_partial(self, *args, **kwargs)
                bound.arguments["synced_gpus"] = True
                args, kwargs = bound.args[1:], bound.kwargs
            else:
                kwargs["synced_gpus"] = True
        return original(self, *args, **kwargs)

    return generate


def install() -> None:
    """Idempotent (tierlift/_torch_patch.py)."""
    generation = sys.modules.get("transformers.generation.utils")  # never imported here
    if generation is not None and hasattr(generation, "GenerationMixin"):
        wrap_method(generation.GenerationMixin, "generate", None, _synced_generate)
    wrap_method(torch.nn.utils.clip_grad, "_get_total_norm", _NORM_PARAMS, _global_norm)
    wrap_method(torch.nn.utils, "get_total_norm", _NORM_PARAMS, _global_norm)
    wrap_method(torch.nn.utils.clip_grad, "_group_tensors_by_device_and_dtype", _GROUP_PARAMS,
                _checked_grouping)
    wrap_method(torch.optim.Optimizer, "__init__", ["self", "params", "defaults"], _checking)
    wrap_method(torch.optim.Optimizer, "add_param_group", ["self", "param_group"], _checked_add)
    wrap_method(torch.optim.Optimizer, "zero_grad", ["self", "set_to_none"], _optimizer_zero_grad)
    wrap_method(torch.nn.Module, "zero_grad", ["self", "set_to_none"], _module_zero_grad)
    wrap_method(torch.nn.Module, "requires_grad_", ["self", "requires_grad"],
                _module_requires_grad)
    collectives.install()  # c10d calls on shards or their gradients refused
    autograd_calls.install()  # backward(inputs=shards) exact; grad() of shards refused
    user_calls.install_user_calls()  # the ranks' own calls agreed on at stage 3
