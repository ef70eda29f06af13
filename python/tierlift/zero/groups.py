"""Per-parameter optimizer groups under ZeRO (weight decay on matrices, none on norms and biases).

shard(model, ..., param_group_fn=fn) calls fn(name, param) -> hashable key once per trainable
parameter (with the name model.named_parameters() gives it: the first alias of a tied weight)
and splits each unit into one FlatUnit per key: the unit's parameters with that key, packed back
to back into their own flat buffer and shard. Each such group is gathered and reduced by its own
collectives (the hooks issue a module's groups back to back), and its shard is an ordinary
Parameter that an optimizer param group can hold. Without param_group_fn every unit is one group
with key None: exactly the layout shard() always had.

    model = tierlift.zero.shard(model, stage=3, param_group_fn=decay_key)
    opt = torch.optim.AdamW(tierlift.zero.param_groups(
        model, {"decay": {"weight_decay": 0.1}, "no_decay": {"weight_decay": 0.0}}), lr=3e-4)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

from torch import nn

from tierlift.zero.frozen import Frozen
from tierlift.zero.hooks import _state

ParamGroupFn = Callable[[str, nn.Parameter], Hashable]


def check_param_group_fn(fn) -> None:
    if fn is not None and not callable(fn):
        raise TypeError(f"param_group_fn must be a callable (name, param) -> hashable key or "
                        f"None, got {type(fn).__name__}")


def _key_of(fn: ParamGroupFn, name: str, param: nn.Parameter) -> Hashable:
    try:
        key = fn(name, param)
    except Exception as exc:
        raise ValueError(f"param_group_fn raised {type(exc).__name__} for parameter {name!r}: "
                         f"{exc}") from exc
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"param_group_fn returned an unhashable {type(key).__name__} for "
                        f"parameter {name!r}; return a hashable key such as a string") from None
    return key


def split_units(grouped: dict[str, list], fn: ParamGroupFn | None) -> list[tuple[str, Any, list]]:
    """[(unit name, key, params)] from {unit name: [(param, names, owners)]}: each unit's
    parameters split by key, keys in the order they first appear in the unit, parameters in
    their original order. With fn None: one group per non-empty unit, key None."""
    out = []
    for name, params in grouped.items():
        if not params:
            continue
        if fn is None:
            out.append((name, None, params))
            continue
        by_key: dict = {}
        for item in params:
            p, names, _ = item
            by_key.setdefault(_key_of(fn, names[0], p), []).append(item)
        out.extend((name, key, items) for key, items in by_key.items())
    return out


def split_frozen(grouped: dict[str, list], fn: ParamGroupFn | None) -> list[tuple[str, Any, list]]:
    """split_units for stage 3, where `grouped` holds frozen parameters too: per unit, its
    trainable groups (split by fn), then its frozen parameters, one group per dtype with key
    Frozen(dtype) (fn is not called on them: they go to no optimizer group)."""
    out = []
    for name, params in grouped.items():
        out += split_units({name: [x for x in params if x[0].requires_grad]}, fn)
        out += split_units({name: [x for x in params if not x[0].requires_grad]},
                           lambda _, p: Frozen(p.dtype))
    return out


def register_shards(units, shard_name: str) -> None:
    """Registers each unit's shard on its module: the first group of a module as `shard_name`
    (the name shard() always used), the next ones as `_group<i>` + shard_name, so that every
    shard is in model.parameters() and model.state_dict() and every name ends in shard_name."""
    seen: dict[int, int] = {}
    for unit in units:
        i = seen.get(id(unit.module), 0)
        seen[id(unit.module)] = i + 1
        unit.module.register_parameter(f"_group{i}{shard_name}" if i else shard_name, unit.shard)


def shard_groups(model: nn.Module) -> dict[Any, list[nn.Parameter]]:
    """{key: [shard parameters]} of a model sharded by tierlift.zero.shard, keys in the order
    they first appear (key None for every shard when shard() had no param_group_fn)."""
    out: dict[Any, list[nn.Parameter]] = {}
    for unit in _state(model).units:
        if not unit.frozen:  # in no optimizer group
            out.setdefault(unit.group, []).append(unit.shard)
    return out


def param_groups(model: nn.Module, options: Mapping[Any, Mapping[str, Any]]) -> list[dict]:
    """Optimizer param groups of a sharded model: one per key of `options`, in its order, each
    {"params": that key's shards, **options[key]}. `options` must name every key the model's
    param_group_fn returned and no other (a misspelt key is an error, not a silent default)."""
    if not isinstance(options, Mapping):
        raise TypeError(f"options must be a mapping {{key: {{optimizer option: value}}}}, got "
                        f"{type(options).__name__}")
    groups = shard_groups(model)
    missing = [k for k in groups if k not in options]
    if missing:
        raise ValueError(f"options has no entry for group key {missing[0]!r}; the model's keys "
                         f"are {list(groups)}")
    out = []
    for key, opts in options.items():
        if key not in groups:
            raise ValueError(f"options names group key {key!r}, which no parameter of the model "
                             f"has; the model's keys are {list(groups)}")
        if not isinstance(opts, Mapping):
            raise TypeError(f"options[{key!r}] must be a mapping of optimizer options, got "
                            f"{type(opts).__name__}")
        if "params" in opts:
            raise ValueError(f"options[{key!r}] must not contain 'params': param_groups fills "
                             "them in")
        out.append({"params": groups[key], **opts})
    return out
