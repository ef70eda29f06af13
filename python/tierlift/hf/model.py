"""What the Hugging Face side needs from a model sharded by tierlift.zero.shard: its full
weights gathered unit by unit (for save_pretrained), full weights put back from safetensors,
clipping by the global norm, a parameter count of the whole model, and generate() that keeps
every rank forwarding until all are done.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import weakref

import torch
import torch.distributed as dist

from tierlift._shards import global_grad_norm, shard_owner
from tierlift.zero import num_parameters
from tierlift.zero.api import _SHARD_NAME, load_full_state_dict, state_key_order
from tierlift.zero.hooks import _ATTR, _state
from tierlift.zero.torch_calls import check_subset

_SAFE_WEIGHTS = "model.safetensors"
_SAFE_INDEX = "model.safetensors.index.json"


def is_sharded(model) -> bool:
    """Whether `model` (or the module a torch.compile / DDP wrapper holds) is sharded by
    tierlift.zero.shard."""
    return getattr(_inner(model), _ATTR, None) is not None


def _inner(model):
    for attr in ("_orig_mod", "module"):  # torch.compile, DDP
        if getattr(model, _ATTR, None) is None and isinstance(
                getattr(model, attr, None), torch.nn.Module):
            model = getattr(model, attr)
    return model


def owns(model, param: torch.Tensor) -> bool:
    """Whether `param` is a shard of the sharded `model`."""
    owner = shard_owner(param)
    return owner is not None and owner[0] is _state(_inner(model))


@torch.no_grad()
def gathered_state_dict(model, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded state_dict of a sharded model (fp32 master weights, the model's own names
    and order) on the CPU. A collective: every rank calls it. Units are gathered one at a time,
    so the device holds one unit more than in training; with rank0_only only rank 0 keeps the
    tensors (in host memory) and the other ranks get {}."""
    model = _inner(model)
    state = _state(model)
    state.named_call("Accelerator.get_state_dict")
    keep = not rank0_only or state.world_comm.rank == 0
    out: dict[str, torch.Tensor] = {}
    for unit in state.units:
        flat = unit.gather_fp32()
        if keep:
            for name, t in unit.split(flat.cpu()).items():
                out[name] = t
        del flat
    if not keep:
        return {}
    for key, value in model.state_dict().items():
        if not key.endswith(_SHARD_NAME):
            out[key] = value.detach().cpu()
    return dict(sorted(out.items(), key=lambda kv: state_key_order(state, kv[0])))


def read_full_weights(directory: str) -> dict[str, torch.Tensor] | None:
    """The tensors of a save_pretrained directory (model.safetensors, or its shards through
    the index), or None when it has neither."""
    from safetensors.torch import load_file

    single = os.path.join(directory, _SAFE_WEIGHTS)
    if os.path.isfile(single):
        return load_file(single, device="cpu")
    index = os.path.join(directory, _SAFE_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        out = {}
        for name in files:
            out.update(load_file(os.path.join(directory, name), device="cpu"))
        return out
    return None


def load_full_weights(model, directory: str) -> None:
    """Put the full weights that save_pretrained wrote to `directory` into the sharded model
    (each rank keeps its slices). Every weight of the model must be there: a missing one is an
    error, never a weight left as it was."""
    sd = read_full_weights(directory)
    if sd is None:
        raise FileNotFoundError(f"{directory} has no {_SAFE_WEIGHTS} or {_SAFE_INDEX}")
    model = _inner(model)
    own = {k for k in model.state_dict() if not k.endswith(_SHARD_NAME)}
    missing = sorted(own - set(sd))
    # save_pretrained drops tied aliases and non-persistent buffers; those come back by
    # themselves. Anything else missing would keep a stale value.
    tied = _tied_aliases(model)
    missing = [k for k in missing if k not in tied]
    if missing:
        raise KeyError(f"{directory} has no weight for {missing[0]!r} (and {len(missing) - 1} "
                       "more); it is not a full save of this model")
    load_full_state_dict(model, {k: v for k, v in sd.items() if k in own or _is_param(model, k)})


def _is_param(model, key: str) -> bool:
    return any(key in e.names for u in _state(model).units for e in u.entries)


def _tied_aliases(model) -> set[str]:
    """Names under which a state_dict entry is the same tensor as an earlier name's."""
    seen: dict[int, str] = {}
    out = set()
    for name, t in model.state_dict(keep_vars=True).items():
        key = id(t)
        if key in seen:
            out.add(name)
        seen[key] = name
    return out


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, norm_type: float = 2.0, *,
                    scale: bool = True) -> torch.Tensor:
    """The global norm of the gradients of `params` (shards of sharded models summed over
    their ranks, other parameters counted once), as torch.nn.utils.clip_grad_norm_ computes it
    on the unsharded model; scales them by max_norm / (norm + 1e-6) when that is below 1.
    max_norm=inf (Trainer's max_grad_norm=0, to log the norm) only computes it. Gradients are
    scaled only when they must be: multiplying by 1.0, as torch does under the threshold,
    gives the same bits, and would invalidate an overlapped optimizer's early steps."""
    params = [p for p in params if p.grad is not None]
    max_norm, norm_type = float(max_norm), float(norm_type)
    if math.isnan(max_norm) or max_norm < 0:
        raise ValueError(f"max_norm must be >= 0 (or inf), got {max_norm}")
    # A submodule's shards lacking parameters kept in an enclosing unit: refused, not a norm
    # of fewer parameters than torch's (also where nothing would be scaled).
    check_subset((o for o in map(shard_owner, params) if o is not None), "clip_grad_norm_",
                 grads=True)
    total = global_grad_norm(params, norm_type)
    if scale and math.isfinite(max_norm) and params:
        coef = max_norm / (float(total) + 1e-6)
        if coef < 1.0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def count_parameters(model, only_trainable: bool = False,
                     exclude_embeddings: bool = False) -> int:
    """PreTrainedModel.num_parameters() of the unsharded model: each parameter once (tied ones
    too), the sharded ones at their full size (tierlift.zero.num_parameters)."""
    return num_parameters(model, only_trainable=only_trainable,
                          exclude_embeddings=exclude_embeddings)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _save_pretrained(cls, model, args: tuple, kwargs: dict):
    """cls.save_pretrained on a sharded model: its own state_dict() holds flat shards, which
    save_pretrained would write as they are (from_pretrained then initializes every weight
    afresh; a peft model writes an empty adapter file). Without state_dict=, the full one is
    gathered (a collective) and rank 0 writes it; a state_dict of shards is refused."""
    sig = inspect.signature(cls.save_pretrained)
    bound = sig.bind(model, *args, **kwargs)
    if "state_dict" in sig.parameters:
        slot = bound.arguments
    else:  # peft.PeftModel takes it through **kwargs
        var = next(n for n, p in sig.parameters.items() if p.kind is p.VAR_KEYWORD)
        slot = bound.arguments.setdefault(var, {})
    state_dict = slot.get("state_dict")
    if state_dict is None:
        _state(model).named_call(f"{cls.__name__}.save_pretrained")
        slot["state_dict"] = gathered_state_dict(model)
        if _state(model).world_comm.rank != 0 and "is_main_process" in sig.parameters:
            bound.arguments["is_main_process"] = False  # it holds nothing to write
    elif any(k.endswith(_SHARD_NAME) for k in state_dict):
        raise ValueError("save_pretrained(state_dict=...) was given the sharded model's own "
                         "state_dict (flat shards, not weights): leave state_dict out (the full "
                         "weights are gathered) or pass tierlift.hf.gathered_state_dict(model)")
    return cls.save_pretrained(*bound.args, **bound.kwargs)


def install(model) -> None:
    """Gives a sharded model's instance a num_parameters() that counts the full model, a
    save_pretrained() that writes the full weights (gathered; rank 0 writes) rather than the
    flat shards, and a generate() that runs with synced_gpus=True across ranks (each rank keeps
    forwarding, with its finished sequences, until every rank is done: a sharded forward is a
    collective, so a rank that stopped early would leave the others waiting). Idempotent."""
    model = _inner(model)
    if getattr(model, "_tierlift_hf_installed", False):
        return
    ref = weakref.ref(model)  # no cycle through the instance's own __dict__
    cls = type(model)
    if hasattr(cls, "generate"):
        def generate(*args, **kwargs):
            if _world() > 1:
                kwargs["synced_gpus"] = True  # also over an explicit False (Seq2SeqTrainer's)
            return cls.generate(ref(), *args, **kwargs)

        generate.__doc__ = cls.generate.__doc__
        model.generate = generate
    if hasattr(cls, "num_parameters"):
        def num_parameters(only_trainable: bool = False, exclude_embeddings: bool = False):
            return count_parameters(ref(), only_trainable, exclude_embeddings)

        model.num_parameters = num_parameters
    if hasattr(cls, "save_pretrained"):
        def save_pretrained(*args, **kwargs):
            return _save_pretrained(cls, ref(), args, kwargs)

        save_pretrained.__doc__ = cls.save_pretrained.__doc__
        model.save_pretrained = save_pretrained
    if hasattr(cls, "get_nb_trainable_parameters"):  # peft.PeftModel
        def get_nb_trainable_parameters():
            return (count_parameters(ref(), only_trainable=True), count_parameters(ref()))

        model.get_nb_trainable_parameters = get_nb_trainable_parameters
    model._tierlift_hf_installed = True
