"""torch.optim.swa_utils.AveragedModel built before shard(), updated from the sharded model.

`swa = AveragedModel(model)` before `shard(model)` holds an unsharded copy; after it,
`swa.update_parameters(model)` zipped that copy's parameters with the model's flat shards:
torch's shape error, or, where a shard's length happened to broadcast, a silently wrong
average (and zip stops at the shorter list, leaving the rest of the copy unaveraged). Wrapped,
update_parameters given a sharded model (or a module holding one) averages the copy with the
model's full fp32 weights, paired by name: each unit gathers its master shards (a collective,
as full_state_dict: every rank calls it, as every rank does under DDP), and parameters that
are not sharded (frozen ones at stages 1/2) and buffers are the model's own, this rank's as
under DDP. Where the copy and the model do not have the same names, nothing is averaged and
ValueError names the first that differs. The average itself is torch's, unchanged.

An AveragedModel built after shard() is refused by copy.deepcopy (guards.py).
"""

from __future__ import annotations

from torch import nn
from torch.optim.swa_utils import AveragedModel

from tierlift._torch_patch import wrap_method
from tierlift.zero import members


class _Unsharded:
    """What AveragedModel.update_parameters reads of a model: parameters() and buffers()."""

    def __init__(self, params: list, buffers: list) -> None:
        self._params, self._buffers = params, buffers

    def parameters(self):
        return iter(self._params)

    def buffers(self):
        return iter(self._buffers)


def _full_weights(model: nn.Module) -> dict:
    """{name in `model`: full fp32 weight} of every sharded unit inside `model`."""
    roots = {id(s.root): s for s in members.states_in(model) if s.root is not None}
    out = {}
    for prefix, module in model.named_modules():
        state = roots.get(id(module))
        if state is None:
            continue
        state.named_call("AveragedModel.update_parameters")
        state.check_copies()
        for unit in state.units:
            for name, value in unit.split(unit.gather_fp32()).items():
                out[f"{prefix}.{name}" if prefix else name] = value
    return out


def _paired(averaged: AveragedModel, model: nn.Module) -> _Unsharded:
    states = members.states_in(model)
    if len(states) == 1 and states[0].root is not None:
        # Names as in the sharded model itself, also when `model` wraps it (torch.compile).
        model = states[0].root
    full = _full_weights(model)
    own = dict(model.named_parameters())
    params = []
    for name, p in averaged.module.named_parameters():
        value = full.get(name, own.get(name))
        if value is None or value.shape != p.shape:
            raise ValueError(
                f"AveragedModel.update_parameters: the averaged copy's parameter {name!r} "
                f"{tuple(p.shape)} is not a weight of the model sharded by tierlift.zero.shard "
                f"({'missing' if value is None else tuple(value.shape)}); build the "
                "AveragedModel from this model before shard(), or from a fresh unsharded model "
                "loaded with tierlift.zero.full_state_dict(model); nothing was averaged")
        params.append(value)
    # Averaged with use_buffers=True, copied as they are without (torch zips them either way).
    buffers = []
    mine = dict(model.named_buffers())
    for name, b in averaged.module.named_buffers():
        if name not in mine or mine[name].shape != b.shape:
            raise ValueError(
                f"AveragedModel.update_parameters: the averaged copy's buffer {name!r} is "
                "not a buffer of the same shape in the sharded model; nothing was averaged")
        buffers.append(mine[name])
    return _Unsharded(params, buffers)


def _checked_update(original):
    def update_parameters(self, model):
        if not members.states_in(model) or members.states_in(self.module):
            return original(self, model)
        return original(self, _paired(self, model))

    return update_parameters


def install() -> None:
    """Idempotent (tierlift/_torch_patch.py)."""
    wrap_method(AveragedModel, "update_parameters", ["self", "model"], _checked_update)
