"""Guard rails: uses of a sharded model that would silently go wrong are refused, or made exact.

- DistributedDataParallel around a model holding ZeRO shards: its constructor would broadcast
  rank 0's shards over every other rank's (each rank holds a different slice) and reduce the
  gradients a second time. A global module-registration hook refuses it when DDP registers the
  module, before DDP's first collective.
- FSDP around it (FullyShardedDataParallel, fully_shard, composable replicate): it would flatten
  or re-shard the shard parameters as if they were full weights. Each module of a sharded model
  carries a composable-API registry (torch's record of which distributed APIs a module has)
  whose membership test refuses the names FSDP asks about before it changes anything (the mark
  torch's @contract has already put on an outer module is taken back).
- Replacing a submodule that holds sharded weights (LoRA layers injected after shard()) would
  leave the unit pointing at the old module (resize_token_embeddings, which resizes the embedding
  in place before it swaps the head, is refused when called); adding a submodule
  with trainable parameters would train it with no gradient reduction. Both are refused.
  peft's calls that would do either, or change adapters in place, are refused when called,
  before they change anything (peft_guards.py).
- model.state_dict() records, in its `_metadata` (which torch.save keeps), the rank, world size
  and layout its `*_zero_flat_shard` entries belong to; model.load_state_dict loads shard entries
  only when that record says they are this rank's, and turns full (unsharded) entries into this
  rank's slice, as load_full_state_dict does. Refusals come before anything is copied.
- Each shard Parameter carries `full_numel` (its unit's elements in the unsharded model), and
  num_parameters() counts the unsharded model.
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import weakref

import torch
from torch import nn

from tierlift._shards import is_shard
from tierlift.zero import members, peft_guards
from tierlift.zero.hooks import _ATTR
from tierlift.zero.unit import source_key

_META_KEY = "tierlift_zero"  # in a module's state_dict _metadata: its shards' record
_MODEL_KEY = "tierlift_zero_model"  # the whole sharded model's
_HOOK = []  # the global module-registration hook's handle, installed once

_DDP_FIX = ("do not wrap it: tierlift.zero already averages the gradients across ranks. With "
            "Hugging Face use tierlift.hf.Trainer / tierlift.hf.Accelerator, which leave the "
            "model unwrapped")

# A wrapper holding the old module (torch's checkpoint_wrapper) swaps the module as any swap does.
_WRAP_FIX = ("; to checkpoint activations, wrap the blocks before shard() "
             "(apply_activation_checkpointing) or switch checkpointing on with a flag "
             "(model.gradient_checkpointing_enable()), which is exact after shard()")


def install(model: nn.Module, state) -> None:
    """Called by shard() once the model is sharded: the guards for `model`."""
    ref = weakref.ref(state)
    members.add(model, state)
    state.owner_modules = weakref.WeakSet(
        mod() for u in state.units for e in u.entries for mod, _ in e.owners)
    for u in state.units:
        u.shard.full_numel = u.numel
    # Whole-model checks on the model (refusing before any module copies anything), and each
    # module holding shards checks and converts its own (also when loaded on its own).
    names = {id(p): n for n, p in model.named_parameters()}
    mod_names = {id(m): n for n, m in model.named_modules()}
    whole = [(names[id(u.shard)], u, list(e.names for e in u.entries)) for u in state.units]
    _hook_state_dict(model, state, ref, whole, _MODEL_KEY, convert=False, base="")
    by_module: dict[int, list] = {}
    for u in state.units:
        base = mod_names[id(u.module)]
        cut = len(base) + 1 if base else 0
        item = (names[id(u.shard)][cut:], u, [[n[cut:] for n in e.names] for e in u.entries])
        by_module.setdefault(id(u.module), [u.module, []])[1].append(item)
    for module, items in by_module.values():
        base = mod_names[id(module)]
        _hook_state_dict(module, state, ref, items, _META_KEY, convert=True,
                         base=base + "." if base else "")
    for m in model.modules():
        _mark_for_fsdp(m)
        if callable(getattr(m, "resize_token_embeddings", None)):
            # transformers resizes the embedding in place, then swaps the LM head, which the
            # module-swap guard refuses half-way: refuse the call itself, before any change.
            object.__setattr__(m, "resize_token_embeddings", _refuse_resize)
    _refuse_deepcopy_of(model, state)
    peft_guards.install(model, state)
    if state.heartbeat is not None and state.config.stage in (1, 2):
        _check_same_units(state)
    if not _HOOK:
        _HOOK.append(nn.modules.module.register_module_module_registration_hook(_on_register))


def _check_same_units(state) -> None:
    """Stages 1/2 on several ranks: the units each rank ran since its last backward began are
    compared over the ranks when the next synced backward reaches its first unit, before that
    unit's gradient is accumulated and reduced (a hook on the unit's gathered leaf runs before
    the reduction's post-accumulate hook), see Heartbeat.check_same_units. And a forward
    without grad that needs no collective (weights current, no buffers to broadcast: a
    rank-0-only eval) is not counted as a forward, so a later named collective (full_state_dict,
    a checkpoint) does not take it for a rank that went on without the call."""
    ref = weakref.ref(state)
    heartbeat = state.heartbeat
    heartbeat.unit_names = [u.name for u in state.units]
    used: list[int] = []  # units run with grad since the last backward began, first-call order
    graph = [None]  # the autograd graph task last seen, so that one backward checks once

    def ran(index, module, args):
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1 \
                and index not in used:
            used.append(index)

    def first_grad(grad):
        task = torch._C._current_graph_task_id()
        st = ref()
        if st is None or task == graph[0]:
            return
        graph[0] = task
        mine = list(used)
        used.clear()
        if st.syncing:
            st.heartbeat.check_same_units(mine)

    def quiet() -> bool:
        st = ref()
        if st is None or torch.is_grad_enabled() or any(u.needs_gather() for u in st.units):
            return False
        sync = st.buffers  # a buffer broadcast ahead (buffers.py sends nothing without any)
        return not (sync.enabled and sync.pending and sync.comm.world > 1 and st.root is not None
                    and any(b.numel() and not b.is_meta for b in st.root.buffers()))

    heartbeat.quiet = quiet
    for i, u in enumerate(state.units):
        if not u.frozen:
            state.handles.append(u.module.register_forward_pre_hook(functools.partial(ran, i)))
            state.handles.append(u.full.register_hook(first_grad))


def _refuse_resize(*args, **kwargs):
    raise RuntimeError("resize_token_embeddings on a model sharded by tierlift.zero.shard: the "
                       "embedding and LM head are sharded with their current shapes. Resize "
                       "before tierlift.zero.shard(model) (with tierlift.hf.Trainer: before "
                       "handing it the model); nothing was changed")


def _refuse_deepcopy_of(model: nn.Module, state) -> None:
    """copy.deepcopy of the model, or of a submodule holding sharded weights, raises one clear
    error (torch's own would be about non-leaf tensors, or NotGatheredError at stage 3)."""
    owners = {id(m) for m in state.owner_modules}
    holders = {""}
    for name, m in model.named_modules(remove_duplicate=False):
        if id(m) in owners:
            parts = name.split(".")
            holders.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    for name, m in model.named_modules(remove_duplicate=False):
        if name in holders:
            object.__setattr__(m, "__deepcopy__", _refuse_deepcopy)


def _refuse_deepcopy(memo):
    raise RuntimeError(
        "copy.deepcopy of a model sharded by tierlift.zero.shard (as torch.optim.swa_utils."
        "AveragedModel or an EMA copy makes): its parameters are this rank's flat shards and "
        "its module attributes gathered views, so the copy would not be the model. For an "
        "EMA or a twin for evaluation, build a fresh unsharded model and load "
        "tierlift.zero.full_state_dict(model) into it (a collective: call it on every rank), "
        "build the AveragedModel before shard() (its update_parameters(model) then averages "
        "the full weights, on every rank), or keep an EMA of the shards themselves (e = "
        "p.detach().clone() for each p in model.parameters(), e.lerp_(p.detach(), 1 - decay) "
        "after each optimizer step)")


# ---- module registration: DDP, replaced and added submodules ----
def _holds_shards(module: nn.Module) -> bool:
    return (any(is_shard(p) for p in module.parameters())
            or any(m in members.MEMBERS for m in module.modules()))


def _on_register(parent, name, child):
    if isinstance(parent, nn.parallel.DistributedDataParallel):
        if child is not None and _holds_shards(child):
            raise RuntimeError(
                "DistributedDataParallel was given a model sharded by tierlift.zero.shard: it "
                "would broadcast rank 0's shards over every other rank's shards (each rank "
                f"holds a different slice) and reduce the gradients twice; {_DDP_FIX}")
        return None
    ref = members.MEMBERS.get(parent)
    state = ref() if ref is not None else None
    if state is None:
        return None
    old = parent._modules.get(name)
    if old is child:
        return None
    if old is not None and any(m in state.owner_modules for m in old.modules()):
        raise RuntimeError(
            f"cannot replace submodule {name!r} of a model sharded by tierlift.zero.shard: "
            "its weights are sharded, and the shards would keep pointing at the old module "
            "(resize_token_embeddings, adapters such as LoRA, or any module swap must happen "
            "before tierlift.zero.shard(model))"
            + (_WRAP_FIX if child is not None and old in child.modules() else ""))
    if child is not None and any(p.requires_grad for p in child.parameters()):
        raise RuntimeError(
            f"cannot add submodule {name!r} with trainable parameters to a model sharded by "
            "tierlift.zero.shard: its parameters would not be sharded and their gradients "
            "not averaged across ranks; add it before tierlift.zero.shard(model) (or freeze it)")
    return None


# ---- FSDP1 / FSDP2 / composable replicate ----
try:  # torch's registry (and states) of composable distributed APIs applied to a module
    from torch.distributed._composable.contract import REGISTRY_KEY as _REGISTRY_KEY
    from torch.distributed._composable.contract import STATE_KEY as _STATE_KEY
except ImportError:  # pragma: no cover - torch without torch.distributed
    _REGISTRY_KEY = _STATE_KEY = None
_CONTRACT_FILE = os.path.join("_composable", "contract.py")

# The names FSDP asks the registry about before it touches a module: FullyShardedDataParallel's
# constructor ("replicate", in _get_ignored_modules: its first step), fully_shard ("fully_shard"
# in its @contract, then "replicate" for every managed module), composable replicate (both).
_FSDP_ASKS = frozenset({"fully_shard", "replicate"})


class _ShardedRegistry(collections.OrderedDict):
    """The registry of a module of a sharded model: refuses FSDP's questions, answers others."""

    def __contains__(self, key) -> bool:
        if key in _FSDP_ASKS:
            _take_back_contract_marks()
            raise RuntimeError(
                "torch FSDP (FullyShardedDataParallel / fully_shard, or replicate) was given a "
                "model sharded by tierlift.zero.shard: it would flatten or re-shard tierlift's "
                "shard parameters (each rank holds a different slice) as if they were the full "
                f"weights; {_DDP_FIX}. (torch.distributed.checkpoint.state_dict asks the same "
                "question; save a sharded model with tierlift.checkpoint.save)")
        return super().__contains__(key)


def _take_back_contract_marks() -> None:
    """torch's @contract (fully_shard, composable replicate) records its API on the modules it
    was given (their __dict__'s composable state and registry) before the API asks about their
    submodules; when a sharded submodule refuses, the marks are taken back, so the outer module
    is as it was and a second call is refused the same way, not told the API was applied. The
    marks are found in the locals of @contract's wrapper frame (modules, func, state,
    registry_item); with a torch that names them otherwise, nothing is taken back."""
    frame = sys._getframe(2)
    try:
        while frame is not None and not (
                frame.f_code.co_name == "wrapper"
                and frame.f_code.co_filename.endswith(_CONTRACT_FILE)):
            frame = frame.f_back
        if frame is None:
            return
        found = frame.f_locals
        func, api_state, item = (found.get(k) for k in ("func", "state", "registry_item"))
        for module in found.get("modules") or []:
            if not isinstance(module, nn.Module):
                continue
            for key, entry, value in ((_STATE_KEY, func, api_state),
                                      (_REGISTRY_KEY, getattr(func, "__name__", None), item)):
                marks = module.__dict__.get(key)
                if not isinstance(marks, dict) or value is None:
                    continue
                if dict.get(marks, entry) is value:
                    dict.pop(marks, entry)
                if not marks and type(marks) is not _ShardedRegistry:
                    del module.__dict__[key]  # an empty record is no record
    finally:
        del frame


def _mark_for_fsdp(module: nn.Module) -> None:
    if _REGISTRY_KEY is None:
        return
    old = module.__dict__.get(_REGISTRY_KEY)
    if isinstance(old, _ShardedRegistry) or (old is not None and not isinstance(old, dict)):
        return
    module.__dict__[_REGISTRY_KEY] = _ShardedRegistry(old or ())


# ---- state dicts ----
def _hook_state_dict(module, state, ref, items, meta_key: str, convert: bool,
                     base: str) -> None:
    """items: [(shard key, unit, [names of each entry])], relative to `module`, whose name in
    the sharded model is `base` (with its dot). convert: this module holds the shards of
    `items` and turns full weights into them; else (the whole model) it only checks."""
    layout = [[k, u.numel] for k, u, _ in items]
    last: list = []  # (prefix, len(missing keys) at the pre-hook, what to report as missing)

    def save(mod, state_dict, prefix, local_metadata):
        st = ref()
        if st is not None:
            local_metadata[meta_key] = {"rank": st.comm.rank, "world": st.comm.world,
                                        "layout": [list(x) for x in layout]}

    def load(mod, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        last.clear()
        st = ref()
        if st is None:
            return
        plan = _check_load(st, state_dict, prefix, local_metadata.get(meta_key), items, layout,
                           assign=bool(local_metadata.get("assign_to_params_buffers")),
                           build=convert)
        report = _full_missing(state_dict, prefix, items) if convert else ({}, [])
        for key, piece, drop in plan:
            for n in drop:
                state_dict.pop(n, None)
            state_dict[key] = piece
        last.append((prefix, len(missing), report))

    def loaded(mod, incompatible):
        # Missing keys as torch reports them for the unsharded model: full weight names, not
        # shard keys, in the order of its state_dict.
        st = ref()
        if st is None or not last:
            return
        prefix, start, (instead, extra) = last.pop()
        keys = incompatible.missing_keys
        tail = [n for k in keys[start:] for n in instead.get(k, [k])] + extra
        keys[start:] = _in_model_order(tail, prefix, base, st.key_order)

    state.handles.append(module.register_state_dict_post_hook(save))
    state.handles.append(module.register_load_state_dict_pre_hook(load))
    state.handles.append(module.register_load_state_dict_post_hook(loaded))


def _full_missing(sd, prefix, items) -> tuple[dict[str, list[str]], list[str]]:
    """For a state_dict of full weights (none of these shard keys in it): ({shard key: the
    full names it stands for}, [names absent from units that load]); else ({}, [])."""
    if any(prefix + k in sd for k, _, _ in items):
        return {}, []
    instead, extra = {}, []
    for key, _, entry_names in items:
        absent = [prefix + n for names in entry_names for n in names if prefix + n not in sd]
        if len(absent) == sum(len(names) for names in entry_names):
            instead[prefix + key] = absent
        else:
            extra += absent
    return instead, extra


def _in_model_order(keys: list[str], prefix: str, base: str, order: dict) -> list[str]:
    """`keys` sorted as the unsharded model's state_dict orders them; a key it does not know
    stays right after the known key before it."""
    ranked, at = [], -1
    for i, k in enumerate(keys):
        pos = order.get(base + k[len(prefix):]) if k.startswith(prefix) else None
        if pos is not None:
            at = pos
        ranked.append((at, pos is None, i, k))
    return [k for *_, k in sorted(ranked)]


def _check_load(state, sd, prefix, rec, items, layout, assign: bool, build: bool) -> list:
    """Raises when `sd` must not load into the shards of `items`; else the conversions of full
    weights into this rank's slices: [(shard key, slice, full keys to drop)]."""
    shard_in = [(prefix + k, u) for k, u, _ in items if prefix + k in sd]
    full_in: dict[int, dict[int, str]] = {}
    for i, (_, _, entry_names) in enumerate(items):
        for j, names in enumerate(entry_names):
            found = source_key(names, sd, prefix)  # tied names: the last one given
            if found is not None:
                full_in.setdefault(i, {})[j] = found
    if not shard_in and not full_in:
        return []
    if assign:
        raise RuntimeError("load_state_dict(assign=True) would replace the shard parameters of "
                           "a model sharded by tierlift.zero.shard; load without assign")
    if shard_in and full_in:
        first = next(iter(next(iter(full_in.values())).values()))
        raise RuntimeError(f"state_dict holds both shards ({shard_in[0][0]!r}) and full "
                           f"weights ({first!r}) of a sharded model; give one or the other")
    if shard_in:
        _check_shards(state, sd, rec, shard_in, layout)
        return []
    plan = []
    for i, (key, u, entry_names) in enumerate(items):
        given = full_in.get(i)
        if not given:
            continue  # left as it is; the missing keys name its weights (_full_missing)
        for j, e in enumerate(u.entries):
            if j in given and tuple(sd[given[j]].shape) != tuple(e.shape):
                raise RuntimeError(f"size mismatch for {given[j]!r}: the state_dict has shape "
                                   f"{tuple(sd[given[j]].shape)}, the model {tuple(e.shape)}")
        plan.append((key, u, given, entry_names))
    if not build:
        return []
    # A unit given in part keeps its other weights as they are (taken from its shard), as
    # torch keeps the parameters a state_dict does not name.
    return [(prefix + key, _slice(u, [sd[given[j]] if j in given else None
                                      for j in range(len(u.entries))]),
             [prefix + n for names in entry_names for n in names])
            for key, u, given, entry_names in plan]


def _check_shards(state, sd, rec, shard_in, layout) -> None:
    first = shard_in[0][0]
    fix = ("load shards with tierlift.checkpoint.load(path, model), or full weights with "
           "model.load_state_dict(full) / tierlift.zero.load_full_state_dict(model, full)")
    if not isinstance(rec, dict):
        raise RuntimeError(
            f"state_dict holds ZeRO shards ({first!r}) with no record of the rank and world size "
            "they were saved on (model.state_dict() keeps one in its _metadata; safetensors "
            "files and rebuilt dicts lose it), so they may be another rank's; " + fix)
    rank, world = state.comm.rank, state.comm.world
    if rec.get("world") != world or rec.get("rank") != rank:
        raise RuntimeError(
            f"state_dict holds the ZeRO shards of rank {rec.get('rank')} of "
            f"{rec.get('world')}; this is rank {rank} of {world}, whose shards are other "
            "slices of the weights; " + fix)
    if rec.get("layout") != [list(x) for x in layout]:
        raise RuntimeError(f"state_dict holds ZeRO shards ({first!r}) of a model split into "
                           "units differently; " + fix)
    by_key = {k: u for k, u in shard_in}
    for key, u in by_key.items():
        t = sd[key]
        if tuple(t.shape) != (u.shard_numel,):
            raise RuntimeError(f"size mismatch for {key!r}: the state_dict has shape "
                               f"{tuple(t.shape)}, the shard ({u.shard_numel},)")


@torch.no_grad()
def _slice(unit, tensors: list[torch.Tensor | None]) -> torch.Tensor:
    """This rank's slice of the unit's padded flat buffer (in the shard dtype), from full
    per-entry tensors; an entry given as None keeps the shard's current values."""
    n = unit.shard_numel
    lo = unit.comm.rank * n
    if all(t is not None for t in tensors):
        out = torch.zeros(n, dtype=unit.shard.dtype, device=unit.shard.device)
    else:
        out = unit.shard.detach().clone()
    for e, t in zip(unit.entries, tensors, strict=True):
        a, b = max(lo, e.offset), min(lo + n, e.offset + e.numel)
        if a < b and t is not None:
            flat = t.detach().reshape(-1)[a - e.offset:b - e.offset]
            out[a - lo:b - lo].copy_(flat)
    return out


# ---- parameter counts ----
def num_parameters(model: nn.Module, only_trainable: bool = False,
                   exclude_embeddings: bool = False) -> int:
    """The parameter count of the unsharded model, as Hugging Face's
    PreTrainedModel.num_parameters() counts it: each parameter once (tied ones once), the
    sharded ones at their full size, frozen ones unless only_trainable; exclude_embeddings
    leaves out the weights of nn.Embedding modules. `model` may hold the sharded model (a
    wrapper) or be a plain model."""
    skip = set()
    if exclude_embeddings:
        skip = {f"{n}.weight" if n else "weight" for n, m in model.named_modules()
                if isinstance(m, nn.Embedding)}
    total, shards = 0, set()
    for prefix, root in model.named_modules():
        state = getattr(root, _ATTR, None)
        if state is None:
            continue
        dot = prefix + "." if prefix else ""
        for u in state.units:
            shards.add(id(u.shard))
            if only_trainable and u.frozen:
                continue
            for e in u.entries:
                if not skip.intersection(dot + n for n in e.names):
                    total += e.numel
    for name, p in model.named_parameters():
        if id(p) in shards or name in skip or (only_trainable and not p.requires_grad):
            continue
        total += p.numel()
    return total
