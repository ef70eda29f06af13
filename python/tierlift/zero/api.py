"""tierlift.zero: shard(), no_sync(), clip_grad_norm_(), full_state_dict(), load_full_state_dict(),
on_shard_grad_ready(), global_grad_norm().

    dist.init_process_group("nccl")                        # under torchrun
    model = tierlift.zero.shard(model, stage=3)            # in place; returns the model
    opt = tierlift.optim.AdamW(model.parameters(), lr=3e-4)  # steps this rank's shards only
"""

from __future__ import annotations

import contextlib
import math
import weakref

import torch
from torch import nn

from tierlift._shards import (  # noqa: F401  (re-exported: tierlift.zero's API)
    all_ranks_agree,
    global_grad_norm,
    is_shard,
    on_shard_grad_ready,
    sharded_norm,
)
from tierlift.lowp import delayed
from tierlift.lowp.linear import Float8Linear
from tierlift.zero import guards, materialize, replaced
from tierlift.zero.config import MixedPrecision, ShardConfig
from tierlift.zero.fp8_gather import enable_fp8_all_gather
from tierlift.zero.frozen import Frozen
from tierlift.zero.groups import check_param_group_fn, register_shards, split_frozen
from tierlift.zero.heartbeat import Heartbeat
from tierlift.zero.hooks import _ATTR, ZeroState, _state
from tierlift.zero.param_nvme import NvmeParamStore
from tierlift.zero.param_offload import ParamOffload
from tierlift.zero.same_init import check_same_init
from tierlift.zero.topology import build as build_topology
from tierlift.zero.unit import FlatUnit, source_key

_SHARD_NAME = "_zero_flat_shard"


def _shards_frozen(p: torch.Tensor) -> bool:
    """Whether a frozen parameter is sharded at stage 3 (dense real floating point, as every
    trainable one must be); others stay replicated."""
    return p.is_floating_point() and not p.is_sparse


def _sharded_numel(module: nn.Module, include_frozen: bool) -> int:
    return sum(p.numel() for p in module.parameters()
               if p.requires_grad or (include_frozen and _shards_frozen(p)))


# Containers that are never called: their forward hooks, which gather a unit, would never run.
_NEVER_CALLED = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def default_units(model: nn.Module, min_unit_numel: int | None = None, *,
                  include_frozen: bool = False) -> list[str]:
    """Child modules that become units: each child holding at least `min_unit_numel` trainable
    elements (default: 1/32 of the model), descending into children that hold more than half
    the model (the container of the transformer blocks) so each block is its own unit, and
    into ModuleList / ModuleDict containers, which are never called. include_frozen=True
    (stage 3, which shards frozen parameters too) counts frozen elements as well."""

    def _trainable_numel(module: nn.Module) -> int:
        return _sharded_numel(module, include_frozen)

    total = _trainable_numel(model)
    threshold = min_unit_numel if min_unit_numel is not None else max(total // 32, 1)
    names: list[str] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            n = _trainable_numel(child)
            fqn = prefix + name
            if n == 0:
                continue
            if isinstance(child, _NEVER_CALLED) or (
                    n > total // 2 and any(True for _ in child.children())):
                visit(child, fqn + ".")
            elif n >= threshold:
                names.append(fqn)

    visit(model, "")
    return names


def _resolve_units(model: nn.Module, units) -> list[str]:
    by_obj = {id(m): n for n, m in model.named_modules()}
    names = []
    for i, u in enumerate(units):
        if isinstance(u, nn.Module):
            if id(u) not in by_obj or by_obj[id(u)] == "":
                raise ValueError(f"units[{i}] is not a submodule of the model")
            names.append(by_obj[id(u)])
        elif isinstance(u, str):
            try:
                model.get_submodule(u)
            except AttributeError as exc:
                raise ValueError(f"units[{i}]={u!r} names no submodule of the model") from exc
            if u == "":
                raise ValueError(f"units[{i}] is the model itself (the root is always a unit)")
            names.append(u)
        else:
            raise TypeError(f"units[{i}] must be a module or a module name, got "
                            f"{type(u).__name__}")
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise ValueError(f"units {a!r} and {b!r} are nested; units must be disjoint")
    for i, name in enumerate(names):
        mod = model.get_submodule(name)
        if isinstance(mod, _NEVER_CALLED):
            raise ValueError(f"units[{i}] is a {type(mod).__name__}, which is never called, so "
                             "the hooks that gather a unit would never run: name the modules it "
                             "holds")
    return names


def _owning_unit(module_name: str, unit_names: list[str]) -> str:
    best = ""
    for u in unit_names:
        if (module_name == u or module_name.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


def shard(model: nn.Module, stage: int = 3, *, process_group=None,
          mixed_precision: MixedPrecision | None = None, units=None, prefetch: int = 1,
          reshard_after_forward: bool = True, min_unit_numel: int | None = None,
          offload_params: str = "none", gpu_budget: int | None = None,
          fp8_all_gather: bool = False, nvme_path: str | None = None,
          param_group_fn=None, hierarchy: str | None = None, mesh=None,
          grad_comm: str | None = None, device_params: int = 0, device=None,
          weights=None, broadcast_buffers: bool = True) -> nn.Module:
    """Shard `model` in place over `process_group` (default: the world) with ZeRO `stage`.

    Afterwards model.parameters() yields one fp32 shard parameter per unit, so any optimizer
    built on them steps this rank's slice. Frozen parameters (requires_grad=False: a base
    model under LoRA adapters) stay replicated at stages 1/2; stage 3 shards them too, into
    units of their own whose shards (requires_grad=False, in the parameters' own dtype) are
    gathered for forward and backward and never reduced or stepped (see zero/frozen.py).
    requires_grad is fixed from here on: a change is refused at the next forward or step.
    Every rank must call shard() on an identically initialised model: a fingerprint of every
    parameter is compared across the ranks and weights that differ are refused, naming the
    first (zero/same_init.py).

    Stage 3 only: offload_params="cpu" keeps the fp32 shards in host memory (pinned with CUDA)
    and streams each unit to the device when it is gathered; offload_params="nvme" keeps them
    in a mapped file under `nvme_path` instead (see zero/param_nvme.py). device_params=N keeps
    the shards of the first units (model order, whole units, N parameters at most) on the
    device with their gradients, so a GPU with room to spare holds part of what would go to
    host memory; `python -m tierlift plan` picks N. gpu_budget (bytes) caps the
    gathered unit weights on the device at once (prefetch waits for room; a budget too small
    for the largest unit next to the root unit is refused with the smallest that works).
    model._tierlift_zero.stats has the peak resident bytes and the bytes copied each way.

    fp8_all_gather=True (stage 3): the weights of Float8Linear layers (tierlift.lowp.convert,
    called before shard) are all-gathered as FP8 bytes with their scales instead of in the
    compute dtype; see zero/fp8_gather.py and docs/lowp.md.

    param_group_fn(name, param) -> hashable key splits each unit into one flat shard per key
    (the name is the one model.named_parameters() gives), so optimizer param groups can treat
    them differently: tierlift.zero.param_groups(model, {key: {"weight_decay": ...}}) builds
    them. It must return the same keys on every rank. See zero/groups.py.

    hierarchy="node" shards within each node and keeps one sharded copy per node (as HSDP /
    ZeRO++ hpZ): gathers stay inside the node, and gradients are reduce-scattered inside the
    node, then summed across nodes shard by shard. mesh= (a torch DeviceMesh of 2 or more
    dimensions) says the same explicitly: its last dimension shards, the others replicate.
    grad_comm="int8" / "fp8" sends that cross-node sum blockwise-quantized (as ZeRO++ qgZ).
    See zero/topology.py; tierlift.zero.last_step_stats(model) has the bytes sent.

    A model whose parameters are on the meta device (built inside tierlift.zero.deferred_init(),
    under torch.device("meta") or accelerate's init_empty_weights()) is built here, each rank
    making only what it keeps: device= says where the shards go; weights=DIR reads them from
    safetensors files (this rank's byte ranges only at stage 3), else the deferred_init()
    recording is replayed (bit-identical to eager construction after the same seed). Nothing
    is left on meta: a model shard() cannot fill is refused. See zero/materialize.py.

    Module buffers (BatchNorm's running statistics) are not sharded. As DDP's default,
    broadcast_buffers=True broadcasts rank 0's buffers over the model's ranks before a forward
    that follows one with grad enabled outside no_sync() (and before the first), and
    full_state_dict() too, so every rank holds the same model; False keeps them per rank. See
    zero/buffers.py.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if hasattr(model, _ATTR):
        raise ValueError("model is already sharded by tierlift.zero.shard")
    check_param_group_fn(param_group_fn)
    _refuse_sparse_grads(model)
    config = ShardConfig(stage=stage, mixed_precision=mixed_precision, prefetch=prefetch,
                         reshard_after_forward=reshard_after_forward,
                         min_unit_numel=min_unit_numel, offload_params=offload_params,
                         gpu_budget=gpu_budget, fp8_all_gather=fp8_all_gather,
                         nvme_path=nvme_path, hierarchy=hierarchy, grad_comm=grad_comm,
                         device_params=device_params, broadcast_buffers=broadcast_buffers)
    if fp8_all_gather and not any(isinstance(m, Float8Linear) for m in model.modules()):
        raise ValueError("fp8_all_gather=True but the model has no Float8Linear layer to gather "
                         "in FP8: call tierlift.lowp.convert(model, recipe=...) before shard()")
    topology = build_topology(process_group, hierarchy, mesh)
    if grad_comm is not None and not topology.legs:
        raise ValueError(f"grad_comm={grad_comm!r} quantizes the gradient sum across nodes of "
                         "hierarchical sharding: pass hierarchy='node' or mesh= too")
    comm = topology.shard
    stage3 = config.stage == 3

    def sharded(p: torch.Tensor) -> bool:
        return p.requires_grad or (stage3 and _shards_frozen(p))

    # checks, changes nothing
    built = materialize.prepare(model, device=device, weights=weights, sharded=sharded)
    key_order = {k: i for i, k in enumerate(model.state_dict().keys())}
    unit_names = (default_units(model, min_unit_numel, include_frozen=stage3) if units is None
                  else _resolve_units(model, units))
    # Every sharded parameter, its alias names and owners; a parameter reachable from two
    # units (tied weights) belongs to the root, which stays gathered around all of them.
    info: dict[int, list] = {}
    order: list[int] = []
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is None or not sharded(p):
                continue
            if p.is_sparse or not p.is_floating_point() or p.is_complex():
                raise TypeError(f"parameter {mod_name + '.' if mod_name else ''}{attr} is "
                                f"{p.dtype}{' sparse' if p.is_sparse else ''}; ZeRO shards "
                                "dense real floating-point parameters")
            fqn = f"{mod_name}.{attr}" if mod_name else attr
            _refuse_hooks(p, fqn)
            if id(p) not in info:
                info[id(p)] = [p, [], [], set()]
                order.append(id(p))
            rec = info[id(p)]
            if fqn not in rec[1]:
                rec[1].append(fqn)
            if not any(m is mod and a == attr for m, a in rec[2]):
                rec[2].append((mod, attr))
            rec[3].add(_owning_unit(mod_name, unit_names))
    if not any(info[i][0].requires_grad for i in order):
        raise ValueError("model has no trainable parameters to shard")
    devices = {info[i][0].device for i in order} if built is None else {built.device}
    if len(devices) != 1:
        raise ValueError(f"all {'' if stage3 else 'trainable '}parameters must be on one "
                         f"device, got {devices}")
    if built is None:  # a meta model is filled by shard() itself, alike on every rank
        check_same_init(topology.world, list(model.named_parameters()), next(iter(devices)))
    grouped: dict[str, list] = {n: [] for n in [*unit_names, ""]}
    for pid in order:
        p, names, owners, owning = info[pid]
        grouped[next(iter(owning)) if len(owning) == 1 else ""].append((p, names, owners))
    split = split_frozen(grouped, param_group_fn)
    compute_dtype = config.param_dtype or torch.float32
    # Per unit: compute dtype, shard dtype. Frozen units keep their parameters' dtype (also
    # for compute without param_dtype, as when they were replicated); in an NVMe file, fp32.
    offloaded = _offloaded_units(split, config)
    dtypes = []
    for (_, key, _), off in zip(split, offloaded, strict=True):
        if isinstance(key, Frozen):
            dtypes.append((config.param_dtype or key.dtype,
                           torch.float32 if off and config.offload_params == "nvme"
                           else key.dtype))
        else:
            dtypes.append((compute_dtype, torch.float32))
    if config.gpu_budget is not None:
        _check_gpu_budget(config.gpu_budget, split, comm.world, [c for c, _ in dtypes])
    # Meta models: non-trainable tensors made real now, units built from what this rank keeps.
    unit_kwargs = [{}] * len(split) if built is None else built.run(split, comm, config.stage)
    if config.param_dtype is not None:
        # Frozen parameters that stay replicated are never stepped: compute in param_dtype too.
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point() and id(p) not in info:
                p.data = p.data.to(compute_dtype)
    offload = None
    stats: dict = {}  # model._tierlift_zero.stats
    if config.offload_params != "none":
        sizes = [-(-sum(p.numel() for p, _, _ in ps) // comm.world)
                 for (_, _, ps), off in zip(split, offloaded) if off]
        store = None if config.offload_params == "cpu" else \
            NvmeParamStore(nvme_path=config.nvme_path, shard_numels=sizes,
                           rank=topology.world.rank, stats=stats)
        offload = ParamOffload(device=next(iter(devices)), compute_dtype=compute_dtype,
                               shard_numels=sizes, stats=stats, store=store,
                               dtypes=[s for (_, s), off in zip(dtypes, offloaded) if off])
    units_out = []
    for (name, key, params), off, kw, (cdt, sdt) in zip(split, offloaded, unit_kwargs, dtypes):
        module = model.get_submodule(name) if name else model
        is_frozen = isinstance(key, Frozen)
        units_out.append(FlatUnit(name=name, module=module, comm=comm,
                                  compute_dtype=cdt, keep_full=config.stage < 3,
                                  offload=offload if off else None,
                                  group=None if is_frozen else key, frozen=is_frozen,
                                  shard_dtype=sdt, out_dtype=key.dtype if is_frozen else None,
                                  **{"params": params, **kw}))
        if config.stage == 3:
            units_out[-1].free()  # gathered again by the first forward
    if config.fp8_all_gather:
        enable_fp8_all_gather([u for u in units_out if not u.frozen])
    register_shards(units_out, _SHARD_NAME)
    if built is not None:
        materialize.check_no_meta(model)
    heartbeat = (Heartbeat(topology.world, topology.comms(), gathers=config.stage == 3)
                 if topology.world.world > 1 else None)
    shard_ids = {id(u.shard) for u in units_out}
    replicated = [(n, p) for n, p in model.named_parameters()
                  if not p.requires_grad and id(p) not in shard_ids]
    state = ZeroState(config=config, topology=topology, root=model, units=units_out,
                      heartbeat=heartbeat, key_order=key_order, offload=offload, stats=stats,
                      replicated=replicated)
    object.__setattr__(model, _ATTR, state)
    guards.install(model, state)  # DDP, module swaps, foreign shards in load_state_dict
    # An optimizer built before shard() would step these, which no longer get gradients.
    replaced.record((info[i][0], info[i][1][0]) for i in order)
    model_ref = weakref.ref(model)  # no reference cycle: the model is freed as soon as unused
    model.no_sync = lambda: no_sync(model_ref())
    return model


def _refuse_sparse_grads(model: nn.Module) -> None:
    """An embedding with sparse=True gives its weight a sparse gradient, which the unit's dense
    flat gradient cannot take (torch fails in backward, reshaping it): refused up front."""
    for name, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and \
                isinstance(m.weight, torch.Tensor) and m.weight.requires_grad:
            raise ValueError(
                f"{type(m).__name__} {name or '<root>'!r} was built with sparse=True (sparse "
                "gradients): tierlift.zero.shard packs each unit's gradients into one dense "
                "flat buffer, reduced and stepped as dense shards, which a sparse gradient "
                "cannot go into. Build it with sparse=False (set module.sparse = False), and "
                "use a dense optimizer (torch.optim.SparseAdam takes only sparse gradients); "
                "nothing was changed")


def _refuse_hooks(p: torch.Tensor, name: str) -> None:
    """A hook on a parameter that shard() replaces would never run again: refused (before
    anything changes), naming it. Hooks on modules are kept and run as before."""
    kinds = [kind for kind, hooks in (("register_hook", p._backward_hooks),
                                      ("register_post_accumulate_grad_hook",
                                       getattr(p, "_post_accumulate_grad_hooks", None)))
             if hooks]
    if kinds:
        raise ValueError(f"parameter {name!r} has a hook ({kinds[0]}): shard() replaces each "
                         "parameter by its unit's flat shard, so the hook would never run "
                         "again. Remove it (handle.remove()) before shard(), and register it "
                         "on the model's shards afterwards (they run once this rank's slice "
                         "of the gradient has landed) or on a module")


def _offloaded_units(split: list, config: ShardConfig) -> list[bool]:
    """Per unit: whether its shard is offloaded. With device_params=N, units keep their shards
    on the device, in model order (the root unit last), while their parameters add up to at
    most N; the rest are offloaded."""
    if config.offload_params == "none":
        return [False] * len(split)
    left, out = config.device_params, []
    for _, _, params in split:
        n = sum(p.numel() for p, _, _ in params)
        stays = n <= left
        left = left - n if stays else -1  # a prefix of the units stays
        out.append(not stays)
    return out


def _check_gpu_budget(budget: int, split: list, world: int, dtypes: list[torch.dtype]) -> None:
    """Refuses a budget that cannot hold the largest unit (all its groups) next to the root
    unit (which stays gathered around the others), naming the smallest budget that works."""
    gathered: dict[str, int] = {}
    for (name, _, params), dtype in zip(split, dtypes, strict=True):
        elem = torch.empty((), dtype=dtype).element_size()
        padded = -(-sum(p.numel() for p, _, _ in params) // world) * world * elem
        gathered[name] = gathered.get(name, 0) + padded
    root = gathered.pop("", 0)
    sizes = gathered
    need = root + max(sizes.values(), default=0)
    if budget < need:
        worst = max(sizes, key=sizes.get) if sizes else "<root>"
        raise ValueError(f"gpu_budget={budget} bytes cannot hold unit {worst!r} "
                         f"({sizes.get(worst, root)} bytes gathered) next to the root unit "
                         f"({root} bytes); the smallest budget that works is {need} bytes")


def last_step_stats(model: nn.Module) -> dict:
    """What this rank sent during the last optimizer step (from the step before it to that
    one: forward, backward, the gradient reductions and anything else on the model's groups):
    {"intra_node_bytes": ..., "inter_node_bytes": ...}. Byte counts are each collective's
    logical volume (comm.py), the same for any backend algorithm."""
    sent = _state(model).stats["last_step_sent"]
    return {"intra_node_bytes": sent["intra_node"], "inter_node_bytes": sent["inter_node"]}


def close(model: nn.Module) -> None:
    """Removes the model's NVMe parameter folder now (offload_params="nvme") rather than at
    garbage collection or interpreter exit, e.g. before os._exit, once training is over. The
    shards stay readable and writable (the mapping outlives the file's name), but are no longer
    released from RAM unit by unit. A no-op for other models."""
    offload = _state(model).offload
    if offload is not None and offload.store is not None:
        offload.store.close()


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Gradient accumulation without communication: backward passes inside keep summing the
    full unit gradients locally; the first backward after the block reduces everything."""
    state = _state(model)
    prev = state.syncing
    state.syncing = False
    state.local_sums = True  # the next synced backward also reduces units only summed here
    try:
        yield
    finally:
        state.syncing = prev


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of a sharded model by their global norm across ranks (as
    torch.nn.utils.clip_grad_norm_ computes it on the unsharded model); returns that norm.

    This scales the gradients in place (by exactly 1.0 under the threshold, which changes no
    bits: the steps tierlift.optim.AdamW(offload=..., overlap=True) ran during backward are kept;
    a clip that scales invalidates them, and they are stepped again). Passing max_grad_norm to
    that optimizer instead computes the same global norm inside its step.
    max_norm=inf only computes the norm (as torch; Hugging Face's max_grad_norm=0 logs it so).
    """
    state = _state(model)
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    if math.isnan(max_norm) or max_norm < 0:
        raise ValueError(f"max_norm must be >= 0 (inf: only compute the norm), got {max_norm}")
    if not norm_type > 0:
        raise ValueError(f"norm_type must be > 0 (or inf), got {norm_type}")
    grads = [u.shard.grad for u in state.units if u.shard.grad is not None]
    total = sharded_norm(state, grads, norm_type)
    if math.isinf(max_norm):
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return total


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model's state_dict (fp32 master weights, original names and order), on
    every rank. A collective: every rank must call it. With broadcast_buffers (the default)
    rank 0's buffers are broadcast into every rank's model first, as its next forward would."""
    state = _state(model)
    state.named_call("tierlift.zero.full_state_dict")
    state.check_copies()
    state.buffers.sync(model)
    flat = {}
    for unit in state.units:
        flat.update((public_name(k), v) for k, v in unit.split(unit.gather_fp32()).items())
    out = {}
    for key, value in model.state_dict().items():
        if key.endswith(_SHARD_NAME):
            continue
        out[key] = value
    out.update(flat)
    return dict(sorted(out.items(), key=lambda kv: state_key_order(state, kv[0])))


def state_key_order(state: ZeroState, key: str):
    return state.key_order.get(key, len(state.key_order))


# torch.distributed's checkpoint_wrapper (apply_activation_checkpointing) drops this from the
# names its state_dict gives, as FSDP's clean_tensor_name does; the parameters' own names,
# recorded at shard(), keep it.
_WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def public_name(name: str) -> str:
    """A parameter name as the model's state_dict() gives it."""
    return name.replace(_WRAPPER_PREFIX, "")


def _by_own_names(state: ZeroState, state_dict: dict) -> dict:
    """`state_dict` with each sharded parameter given under its public name (full_state_dict's
    of a checkpoint-wrapped model, a plain model's) added under its own names too."""
    out = dict(state_dict)
    for unit in state.units:
        for e in unit.entries:
            for name in e.names:
                if name not in out and public_name(name) in state_dict:
                    out[name] = state_dict[public_name(name)]
    return out


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict (as full_state_dict returns) into a sharded model. Tied
    names given together load as torch loads them: the last in model order wins (the same rule
    as model.load_state_dict on the sharded model)."""
    state = _state(model)
    state.named_call("tierlift.zero.load_full_state_dict")
    # Check everything before changing anything: a bad state dict leaves the model as it was.
    given = state_dict
    state_dict = _by_own_names(state, state_dict)
    sharded = set()
    for unit in state.units:
        for e in unit.entries:
            key = source_key(e.names, state_dict)
            if key is None:
                raise KeyError("state_dict has no entry for parameter "
                               f"{public_name(e.names[0])!r}")
            t = state_dict[key]
            if tuple(t.shape) != tuple(e.shape):
                raise ValueError(f"state_dict[{key!r}] has shape {tuple(t.shape)}, the "
                                 f"model expects {tuple(e.shape)}")
            sharded.update(e.names)
            sharded.update(public_name(n) for n in e.names)
    rest = {k: v for k, v in given.items() if k not in sharded}
    own = {k: v for k, v in model.state_dict().items() if not k.endswith(_SHARD_NAME)}
    for key, value in rest.items():
        if key not in own:
            raise KeyError(f"state_dict has an unexpected entry {key!r}")
        if own[key].shape != value.shape:
            raise ValueError(f"state_dict[{key!r}] has shape {tuple(value.shape)}, the model "
                             f"expects {tuple(own[key].shape)}")
    for unit in state.units:
        unit.load_fp32(state_dict)
    with torch.no_grad():
        # In model order, as torch copies: of tied unsharded weights the last name wins.
        for key, value in own.items():
            if key in rest:
                value.copy_(rest[key])
            elif delayed.is_history_name(key):
                # a state dict without it (a plain nn.Linear's): never filled, as
                # load_state_dict leaves it, not the history of the weights replaced
                value.fill_(delayed.NEVER_WRITTEN)
