"""torch.autograd calls that name a sharded model's parameters, or differentiate through its
gradient: made exact, or refused before the engine runs.

A shard (what model.parameters() yields) is not in the autograd graph: forward computes with
views of the unit's gathered buffer (`unit.full`, a leaf), whose accumulated gradient tierlift
reduces into shard.grad. So:

- loss.backward(inputs=list(model.parameters())) (torch.autograd.backward(..., inputs=...); a
  GAN's generator step that keeps the discriminator's gradients out) would accumulate nothing:
  no gradient reached the shards, and the step left the model as it was. Each shard given is
  replaced by its unit's gathered buffer, so exactly the units given are reduced into their
  shards, as torch accumulates into exactly the parameters given. Module weights given
  (inputs=[model.head.weight, model.head.bias]: views of the unit's gathered buffer, at stage 3
  stand-ins after forward) trained nothing at stages 1/2 either; they count as their unit when
  they are all of its weights, and are refused otherwise (the unit's gradient is reduced and
  stepped as a whole), naming the weights left out.
- torch.autograd.grad(loss, model.parameters()) returns gradients without accumulating them,
  so nothing is reduced: torch raised "appears to not have been used in the graph", and with
  allow_unused=True returned None for every parameter (a MAML or per-parameter update built on
  it silently did nothing). Refused, naming what to do instead.
- create_graph=True (a gradient penalty such as WGAN-GP's or R1's, a Hessian-vector product)
  through a stage-3 model: stage 3 frees each unit's gathered weights when its backward ends,
  but the graph of the gradient keeps using them, and the second backward failed on freed
  storage (after the first had run). Refused before the engine runs; stages 1 and 2 keep the
  weights gathered and are exact.

Both checks wrap torch.autograd._engine_run_backward, which backward() and grad() look up when
called (so a `grad` imported before tierlift is covered too); a backward with neither `inputs=`
nor create_graph=True costs two tuple reads.
"""

from __future__ import annotations

import torch

from tierlift._shards import shard_owner
from tierlift._torch_patch import wrap_method
from tierlift.zero import members

_PARAMS = ["t_outputs", "args", "kwargs"]


def _unit_lookup() -> tuple[dict, dict]:
    """({id(unit.full): unit}, {id(stand-in): (unit, entry index)}) over the trainable units
    of the live sharded models: what a module weight attribute is a view of, or stands for."""
    fulls, stand_ins = {}, {}
    for state in members.live_states():
        for unit in getattr(state, "units", ()):
            if unit.frozen:
                continue
            fulls[id(unit.full)] = unit
            for i, t in enumerate(unit._freed or ()):
                stand_ins[id(t)] = (unit, i)
    return fulls, stand_ins


def _given_units(inputs, views: bool) -> tuple[list[tuple], dict]:
    """Shards among `inputs` as [(position, unit)], and (views=True) module weight attributes
    among them (views of a unit's gathered buffer, or stage-3 stand-ins) as {id(unit): [unit,
    {entry index: position}]}."""
    shards, attrs = [], {}
    lookup = None
    for pos, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            continue
        found = shard_owner(t)
        if found is not None:
            shards.append((pos, found[0].units[found[1]]))
            continue
        if not views:
            continue
        if lookup is None:
            lookup = _unit_lookup()
        fulls, stand_ins = lookup
        hit = stand_ins.get(id(t))
        if hit is None and t._base is not None:
            unit = fulls.get(id(t._base))
            if unit is not None and t._base is unit.full and t.data_ptr() in unit.attr_ptrs:
                hit = (unit, unit.attr_ptrs.index(t.data_ptr()))
        if hit is not None:
            attrs.setdefault(id(hit[0]), [hit[0], {}])[1][hit[1]] = pos
    return shards, attrs


def _stage3_fulls() -> dict[int, object]:
    """id(unit.full) -> unit over the trainable units of live stage-3 models."""
    out = {}
    for state in members.live_states():
        if state.config.stage == 3:
            for unit in getattr(state, "units", ()):
                if not unit.frozen:
                    out[id(unit.full)] = unit
    return out


def _stage3_unit_in(outputs, fulls: dict[int, object]):
    """The first stage-3 unit whose gathered buffer the graph of `outputs` reaches, else None
    (depth first: the last units used are met first)."""
    seen: set[int] = set()
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            unit = fulls.get(id(variable))
            if unit is not None and variable is unit.full:
                return unit
            continue
        stack.extend(fn for fn, _ in node.next_functions)
    return None


def _refuse_grad(unit) -> None:
    raise RuntimeError(
        f"torch.autograd.grad was given the shard of unit {unit.name!r} (a parameter from "
        "model.parameters() of a model sharded by tierlift.zero). The shards are not in the "
        "autograd graph: forward computes with each unit's gathered weights, whose gradient "
        "tierlift reduces into shard.grad only when a backward accumulates it, so grad() "
        "would return no gradient for them (None with allow_unused=True). Use "
        "loss.backward() (or backward(inputs=[...shards])) and read p.grad of the shards, "
        "or, for gradients that build a graph (MAML, per-sample gradients), an unsharded "
        "model loaded from tierlift.zero.full_state_dict(model)")


def _check_whole_unit(unit, where: dict) -> None:
    """backward(inputs=...) given some of a unit's weights: the unit's gradient is reduced and
    stepped as a whole, so only all of them can be given."""
    missing = [e.names[0] for i, e in enumerate(unit.entries) if i not in where]
    if not missing:
        return
    given = [unit.entries[i].names[0] for i in sorted(where)]
    raise RuntimeError(
        f"backward(inputs=...) was given {', '.join(given)} but not {', '.join(missing[:4])}"
        f"{', ...' if len(missing) > 4 else ''} of the same ZeRO unit {unit.name!r}: tierlift "
        "reduces a unit's gradient into its flat shard as a whole, so the weights left out "
        "would get a gradient that torch would not give them. Give all of them (or the "
        "unit's shard from model.parameters()), or shard with units=[...] so that the weights "
        "you give form units of their own. Nothing was computed")


def _refuse_create_graph(unit) -> None:
    raise RuntimeError(
        f"create_graph=True through unit {unit.name!r} of a model sharded by tierlift.zero at "
        "stage 3 (a gradient penalty, a double backward, a Hessian-vector product): stage 3 "
        "frees each unit's gathered weights when its backward ends, but the graph of the "
        "gradient keeps using them, so the next backward through it would read freed weights. "
        "Nothing was computed. Shard this model with stage=1 or stage=2 (they keep the weights "
        "gathered, and double backward through them is exact)")


def _checked_backward(original):
    def run(t_outputs, *args, **kwargs):
        # (grad_tensors, retain_graph, create_graph, inputs, ...) as backward() and grad() pass
        if len(args) < 4 or "accumulate_grad" not in kwargs or not (args[2] or args[3]):
            return original(t_outputs, *args, **kwargs)
        create_graph, inputs = args[2], args[3]
        if create_graph:
            fulls = _stage3_fulls()
            if fulls:
                unit = _stage3_unit_in(t_outputs, fulls)
                if unit is not None:
                    _refuse_create_graph(unit)
        if inputs:
            # grad() of a module weight at stages 1/2 is torch's local gradient, as under DDP
            accumulate = kwargs["accumulate_grad"]
            shards, attrs = _given_units(inputs, views=accumulate)
            if shards and not accumulate:
                _refuse_grad(shards[0][1])
            if shards or attrs:
                given = list(inputs)
                for pos, unit in shards:
                    if not unit.frozen:  # a frozen shard: torch's own "does not require grad"
                        given[pos] = unit.full
                for unit, where in attrs.values():
                    _check_whole_unit(unit, where)
                    for pos in where.values():
                        given[pos] = unit.full
                args = (*args[:3], tuple(given), *args[4:])
        return original(t_outputs, *args, **kwargs)

    return run


def install() -> None:
    """Idempotent (tierlift/_torch_patch.py)."""
    wrap_method(torch.autograd, "_engine_run_backward", _PARAMS, _checked_backward)
