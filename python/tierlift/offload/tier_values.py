"""The moments of an offloaded optimizer as optimizer.state[p] yields them (by name, keys, items()
and values()): read from the tiers when used, never changed through optimizer.state.

torch's AdamW keeps exp_avg and exp_avg_sq in optimizer.state[p]; ours keeps them in host
memory or NVMe tiers and only "step" there. A loop over the keys or items that logs moment norms
would read nothing, and one that resets "every state tensor" (`for k, v in state.items(): if
torch.is_tensor(v): v.zero_()`) would zero the step count alone while the moments stay: Adam
would go on from the old moments with restarted bias corrections, silently. So the state holds a
TierValue for each moment, before "step": a tensor (shape, dtype and device as the moment's)
that reads the tiers' value on each use, as the live state tensor of torch's AdamW would read,
and refuses every in-place change before anything is changed (the reset loop meets a moment
before the step count). Frameworks that move the state to a device (Lightning's
_optimizer_to_device, a resume that calls .to(device) on each value and puts it back) get the
TierValue itself back from .to(), and putting it back into the state is a no-op: the moments
stay in their tiers. A bfloat16/float16 parameter's fp32 master is yielded as well, as the
in-memory optimizer's state holds it (torch.distributed.checkpoint's flattened load rebuilds
the state from these keys); an fp32 parameter's is not (torch's AdamW has none), and neither is
the state of a parameter that has not stepped."""

from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_map

# What a moment is called in optimizer.state_dict() where the tiers name it otherwise: compact
# exp_avg_sq codes (optim/hyper.py CODES_KEY).
CODES_KEY = "exp_avg_sq_codes"
_DEVICE_ONLY = frozenset(("to", "cpu", "cuda"))
_NOT_INPLACE = frozenset(("__index__", "__int__", "__invert__", "__iter__", "__init__",
                          "__init_subclass__"))


class TierValue(torch.Tensor):
    """One moment of one parameter of an offloaded optimizer, read when used (see the module);
    its data here is a meta tensor of the moment's shape and dtype."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = _written(func, args, kwargs)
        if written is not None:
            raise RuntimeError(written.refusal())
        this = next((a for a in args if isinstance(a, TierValue)), None)
        if this is not None:
            if func == torch.Tensor.device.__get__:
                return torch.device("cpu")
            if func == torch.Tensor.is_meta.__get__:
                return False
            if func == torch.Tensor.is_cpu.__get__:
                return True
            name = getattr(func, "__name__", "")
            if func in _ALIASES and args[0] is this:
                return this  # torch's would alias the state: in-place writes stay refused
            if name in _DEVICE_ONLY and args[0] is this and _moves_only(this, func, args,
                                                                        kwargs):
                return this  # the moments stay in their tiers
            if func in _META_GETTERS or (name in _META_METHODS and args[0] is this):
                # what the meta tensor knows as well: no read
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
        args, kwargs = tree_map(_read, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def bound(self, owner, p, name: str) -> bool:
        """Whether this is moment `name` of parameter `p` of Offloader `owner`."""
        return self._owner() is owner and self._param() is p and self._name == name

    def refusal(self) -> str:
        return (f"optimizer.state[p][{self._name!r}] of an offloaded optimizer cannot be "
                "changed in place or replaced: its moments live in the offload tiers (host "
                "memory or NVMe), and what optimizer.state[p] yields for them is read from "
                "there. To "
                "start a parameter's state afresh, as torch's AdamW does for an empty state "
                "(zero moments, step 0), clear it: optimizer.state[p].clear(); to change it "
                "otherwise, edit optimizer.state_dict() and load it with load_state_dict(). "
                "Nothing was changed")

    def value(self) -> torch.Tensor:
        """The moment as the tiers hold it now (a CPU tensor, which in-place ops refuse:
        changing it would change nothing)."""
        owner, p = self._owner(), self._param()
        if owner is None or p is None or getattr(owner.opt, "_closed", False):
            raise RuntimeError(f"optimizer.state[p][{self._name!r}] cannot be read: its "
                               "offloaded optimizer was closed or collected")
        with torch.inference_mode():
            return owner.read_kind(p, self._kind)


# The whole tensor again in torch (writes through them would change torch's state); other views
# read the value, an inference tensor, whose views refuse in-place writes themselves.
_ALIASES = [torch.Tensor.data.__get__, torch.Tensor.detach]
# Answered by the meta tensor (the same as the value's); .data, .T and the like read the value.
_META_GETTERS = [getattr(torch.Tensor, n).__get__ for n in (
    "shape", "dtype", "ndim", "layout", "requires_grad", "is_sparse", "is_quantized", "is_cuda",
    "is_leaf", "grad", "grad_fn", "is_nested")]
_META_METHODS = frozenset(("size", "dim", "numel", "nelement", "ndimension", "stride",
                           "is_contiguous", "element_size", "is_floating_point", "is_complex",
                           "__len__", "__hash__", "get_device"))


def make(owner, p: torch.Tensor, kind: str, name: str, shape, dtype) -> TierValue:
    """The TierValue of moment `kind` (called `name` in optimizer.state) of `p`."""
    t = torch.Tensor._make_subclass(TierValue, torch.empty(shape, dtype=dtype, device="meta"))
    t._owner, t._param = weakref.ref(owner), weakref.ref(p)
    t._kind, t._name = kind, name
    return t


def _read(x):
    return x.value() if isinstance(x, TierValue) else x


def _written(func, args, kwargs) -> TierValue | None:
    """The TierValue `func` would change in place (its self, or an out= argument), if any."""
    name = getattr(func, "__name__", "")
    first = args[0] if args and isinstance(args[0], TierValue) else None
    if first is not None and (
            name == "__setitem__" or (name.startswith("__i") and name.endswith("__")
                                      and name not in _NOT_INPLACE)
            or (name.endswith("_") and not name.endswith("__"))):
        return first
    out = kwargs.get("out")
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return next((o for o in outs if isinstance(o, TierValue)), None)


def _moves_only(this: TierValue, func, args, kwargs) -> bool:
    """Whether .to()/.cpu()/.cuda() asks for a device (and memory format, copy flags) only, not
    another dtype: what frameworks do to move optimizer state."""
    if getattr(func, "__name__", "") != "to":
        return not kwargs.get("memory_format")
    try:
        _, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    except (TypeError, RuntimeError):
        return False
    return dtype is None or dtype == this.dtype
