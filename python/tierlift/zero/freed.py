"""What a stage-3 module weight is while its unit is not gathered.

Outside forward and backward a stage-3 unit's gathered buffer is freed (its storage shrunk to 0
bytes). A view of it left on the module would keep the full shape and read freed memory: any
read (`w.sum()`, resize_token_embeddings copying rows) crashes the process. Instead, freeing a
unit puts a FreedWeight on each module attribute: a tensor with no storage that keeps the
weight's full shape, dtype and device (so code that only looks at `.shape` works) and raises
NotGatheredError, naming the weight and the fix, on any operation. The next forward (or
tierlift.zero.gathered()) puts views of the gathered weights back.
"""

from __future__ import annotations

import torch


class NotGatheredError(RuntimeError):
    """An operation on a stage-3 weight that is not gathered (outside forward and backward)."""


class FreedWeight(torch.Tensor):
    """A storage-less stand-in for a freed stage-3 weight; every operation raises."""

    @staticmethod
    def __new__(cls, name: str, shape, dtype: torch.dtype, device: torch.device):
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device,
                                                requires_grad=False)
        t._tierlift_name = name
        return t

    def __init__(self, *args, **kwargs):
        super().__init__()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        name = next((a._tierlift_name for a in args if isinstance(a, FreedWeight)), None)
        if name is None:  # the stand-in is in kwargs (out=, ...)
            name = next((v._tierlift_name for v in (kwargs or {}).values()
                         if isinstance(v, FreedWeight)), "a weight")
        raise NotGatheredError(
            f"{name!r} is sharded by tierlift.zero (stage 3) and not gathered outside forward "
            f"({func} needs its values); read or edit it inside `with "
            "tierlift.zero.gathered(model, modifier_rank=...):` on every rank, or take a copy "
            "with tierlift.zero.full_state_dict(model)")

    # Setting requires_grad on a stand-in (`model.ln_f.weight.requires_grad = False` to freeze
    # a layer) would change nothing the unit reads: the weight would go on training.
    @property
    def requires_grad(self) -> bool:
        return torch._C.TensorBase.requires_grad.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        _refuse_requires_grad(self, value)

    def requires_grad_(self, requires_grad: bool = True):
        _refuse_requires_grad(self, requires_grad)

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"FreedWeight({self._tierlift_name!r}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, not gathered)")

    def __reduce_ex__(self, proto):
        raise NotGatheredError(f"{self._tierlift_name!r} is a stage-3 weight that is not "
                               "gathered; save the model with tierlift.checkpoint.save or "
                               "tierlift.zero.full_state_dict, not by pickling the module")


def _refuse_requires_grad(stand_in: FreedWeight, value) -> None:
    raise RuntimeError(
        f"setting requires_grad={bool(value)} on {stand_in._tierlift_name!r}, a weight of a "
        "model sharded by tierlift.zero (stage 3): outside forward its module attribute is a "
        "stand-in, and requires_grad is fixed when shard() packs the weights into flat "
        "shards, so the weight would go on as before. Freeze or unfreeze before "
        "tierlift.zero.shard(model), then build the optimizer; nothing was changed")


def freed_weights(entries, dtype: torch.dtype, device: torch.device) -> list[FreedWeight]:
    """One stand-in per parameter entry of a unit (made once, reused at every free)."""
    return [FreedWeight(e.names[0], e.shape, dtype, device) for e in entries]
