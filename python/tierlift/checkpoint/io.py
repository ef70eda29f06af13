"""save() and load() of sharded models: every rank writes and reads its own shard; load()
reshards when the world size changed. See format.py for the layout. An offloading optimizer's
shard state is streamed to `rankNNNNN.optim/` (tierlift.checkpoint.stream), never built in RAM,
and streamed back (restore.py), on another world size from the byte ranges each new shard
overlaps (reshard.py).
Models that are not sharded go to tierlift.checkpoint.replicated."""

from __future__ import annotations

import json
import os

import torch

from tierlift.checkpoint import (
    agree,
    background,
    in_flight,
    order,
    replicated,
    reshard,
    restore,
    stream,
    unnamed,
    validate,
)
from tierlift.checkpoint import format as fmt
from tierlift.offload.journal import Journal
from tierlift.zero import unused
from tierlift.zero.api import _ATTR, _SHARD_NAME, _state
from tierlift.zero.guards import _slice


def _per_param_state(optimizer) -> dict:
    """{param: its state} as optimizer.state_dict() reports it: an offloading optimizer keeps
    exp_avg/exp_avg_sq (and master) in its tiers, not in optimizer.state."""
    if optimizer is None:
        return {}
    sd = optimizer.state_dict()
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {p: sd["state"].get(i, {}) for p, i in zip(params, ids, strict=True)}


def _load_per_param_state(optimizer, loaded: dict, before_commit=None) -> None:
    """Replace the optimizer's state with `loaded` ({param: state}; a parameter without an
    entry starts fresh, as torch's load_state_dict leaves it) through load_state_dict, so an
    offloading optimizer puts it back into its tiers. `before_commit`
    is called before the new state becomes final; if it raises, the old state is put back."""
    sd = _groups_only(optimizer) if getattr(optimizer, "_offload", None) is not None else \
        optimizer.state_dict()
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p, i in zip(params, ids, strict=True):
        if p in loaded:
            sd["state"][i] = loaded[p]
        else:  # no state in the checkpoint: starts fresh, as in torch (stale moments stayed)
            sd["state"].pop(i, None)
    agree.load_optimizer_state(optimizer, sd, before_commit)


def _groups_only(optimizer) -> dict:
    """An offloading optimizer's state_dict() without its state, numbered as torch numbers it:
    every entry is replaced or dropped by the load anyway, and reading the tiers would refuse
    a state that a failed in-place rewrite left mixed, which this load is there to replace."""
    groups, n = [], 0
    for g in optimizer.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": list(range(n, n + len(g["params"])))})
        n += len(g["params"])
    return {"state": {}, "param_groups": groups}


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer=None, *,
         extra: dict | None = None, blocking: bool = True,
         staging_budget: int | None = None) -> background.SaveHandle:
    """Write a checkpoint of a model (and its optimizer) to directory `path`; `extra` is any
    JSON-able dict (progress: step, losses), stored in metadata.json and returned by load().

    Atomic: files go to `path`.tmp, then replace `path` by renames, so a run killed in the
    middle leaves the previous checkpoint loadable. A sharded model (tierlift.zero.shard): a
    collective, every rank writes its shard. Otherwise one process, or replicated ranks (DDP)
    of which rank 0 writes.

    blocking=False returns once the state is snapshotted (copied into at most
    `staging_budget` bytes of host memory, pinned with a GPU; an offloading optimizer's
    two-generation state is held, not copied); the files are written in the background and
    training may step on meanwhile. The returned handle's wait() re-raises a failure, as do
    the next save() and tierlift.checkpoint.close(). A budget smaller than the snapshot
    streams it in pieces: save() returns when all but the last budget's worth is written."""
    path = fmt.dir_path(path)
    if getattr(model, _ATTR, None) is None:
        return replicated.save(path, model, optimizer, extra, blocking=blocking,
                               staging_budget=staging_budget)
    state = _state(model)
    state.named_call("tierlift.checkpoint.save")  # every rank must call it (zero/heartbeat.py)
    # Files are named by the rank within the shard group; with hierarchical sharding only the
    # first replica of each shard writes it, and every rank of the model votes.
    comm, everyone = state.comm, state.world_comm
    try:  # a rank refusing here still votes, with the others' claim: none waits for it
        in_flight.before_save()
        _refuse_foreign_params(state, optimizer)
        off = fmt.offloader(optimizer)
        job = background.Job(path, blocking=blocking, staging_budget=staging_budget, off=off,
                             estimate=lambda: background.estimate_bytes(model, optimizer, off))
    except BaseException as e:
        background.refuse(background.training_vote(everyone), e, path)
    job.claim(everyone.rank, background.training_vote(everyone),
              writes=state.topology.primary)
    try:
        if state.topology.primary:
            _stage_shard(job, state, model, optimizer, off)
        meta = _metadata(state, comm, off, optimizer, extra)
    except BaseException as e:
        job.snapshot_failed(e)
    vote = background.training_vote(everyone) if blocking else background.side_vote(everyone)
    return job.start(vote, lambda: job.publish(meta) if everyone.rank == 0 else None)


def _refuse_foreign_params(state, optimizer) -> None:
    """A sharded checkpoint holds the optimizer state of the model's shards only: the state of
    any other optimizer parameter would be dropped, and a load would resume it from scratch."""
    if optimizer is None:
        return
    shards = {id(u.shard) for u in state.units}
    for gi, g in enumerate(optimizer.param_groups):
        for pi, p in enumerate(g["params"]):
            # a frozen parameter stages 1/2 keep replicated never has state (its value is saved)
            if id(p) not in shards and optimizer.state.get(p):
                raise ValueError(
                    f"optimizer param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) is "
                    "not a shard of the sharded model but has optimizer state, and a sharded "
                    "checkpoint holds the optimizer state of the model's shards only; nothing "
                    "was saved. Register it in the model before tierlift.zero.shard(), or give "
                    "it its own optimizer and save that one with torch.save")


def _stage_shard(job, state, model, optimizer, off) -> None:
    """This rank's files: its shards (and their optimizer state), the extras on shard rank 0."""
    comm = state.comm
    if off is not None:
        job.offloaded(off, optim_dir(comm.rank),
                      {u.shard: f"unit{i}" for i, u in enumerate(state.units)})
    tensors: dict[str, torch.Tensor] = {}
    opt_state = {} if off is not None else _per_param_state(optimizer)
    for i, unit in enumerate(state.units):
        unit.check_files()  # a shard file cut short: an error, not a SIGBUS as it is read
        tensors[f"unit{i}.param"] = unit.shard
        for key, value in opt_state.get(unit.shard, {}).items():
            if isinstance(value, torch.Tensor) and key != unused.KEY:  # in the metadata
                tensors[f"unit{i}.{key}"] = value
    if comm.rank == 0:
        for key, value in model.state_dict().items():
            if not key.endswith(_SHARD_NAME):
                tensors[f"extra.{key}"] = value
    job.tensor_file(comm.rank, tensors)


def _metadata(state, comm, off, optimizer, extra) -> dict:
    return {
        "format": fmt.FORMAT,
        "version": fmt.VERSION,
        "world_size": comm.world,
        "stage": state.config.stage,
        "optimizer_state": "offloaded" if off is not None else "tensors",
        "extra": json.loads(json.dumps(extra or {})),  # as it is now; checked JSON-able
        "key_order": list(state.key_order),
        "units": [{"name": u.name, "group": None if u.group is None else repr(u.group),
                   "frozen": u.frozen, "numel": u.numel, "padded": u.padded,
                   "shard_numel": u.shard_numel,
                   "entries": [{"names": e.names, "shape": list(e.shape),
                                "offset": e.offset, "numel": e.numel}
                               for e in u.entries], **_counts(u, optimizer)}
                  for u in state.units],
        "param_groups": [] if optimizer is None else fmt.param_groups_json(optimizer),
        "param_names": [] if optimizer is None else _shard_names(state, optimizer),
        "param_step_counts": True,  # a unit without "lag": every parameter took every step
    }


def _counts(unit, optimizer) -> dict:
    """{"lag": ...}: the unit's per-parameter step counts where they differ from its shard's
    (zero/unused.py), world-size independent; {} where every parameter took every step."""
    if optimizer is None or not unused.tracked(unit):
        return {}
    if unit.stepped_by is None or unit.stepped_by() is not optimizer:  # none stepped by it
        return {"lag": {"lag": [0] * len(unit.entries), "stepped": [False] * len(unit.entries)}}
    rec = unused.record(unit)
    return {} if rec is None else {"lag": rec}


def _loaded_counts(meta: dict, aligned, path: str) -> dict:
    """{unit: its step counts} for every unit whose counts may differ; a unit saved without
    them took every step with its shard, and one of a checkpoint from before they were saved
    is given the shard's count, as a load did before. Checked before anything changes."""
    out = {}
    every = bool(meta.get("param_step_counts"))
    for unit, saved in zip(aligned, meta["units"], strict=True):
        if unit is None or not unused.tracked(unit):
            continue
        n = len(unit.entries)
        rec = saved.get("lag", {"lag": [0] * n, "stepped": [every] * n})
        unused.check_record(unit, rec, os.path.join(path, fmt.METADATA))
        out[unit] = rec
    return out


def _shard_names(state, optimizer) -> list[list]:
    """Per param group, each shard's name: the first parameter its unit holds (order.py); a
    frozen parameter that stages 1/2 keep replicated has its own."""
    names = {id(p): n for n, p in getattr(state, "replicated", [])}
    names.update({id(u.shard): u.entries[0].names[0] for u in state.units if u.entries})
    return order.param_names(None, optimizer, names)


def _plan_by_unit(plan: list, smeta: dict, aligned, optimizer) -> list:
    """A same-world-size streamed load's plan (saved groups and positions) for this optimizer:
    each saved unit's state ("unit3" in state.json) to the group and position its shard has
    here, whatever order the optimizer lists the shards in."""
    where = {p: (gi, pi) for gi, g in enumerate(optimizer.param_groups)
             for pi, p in enumerate(g["params"])}
    out = [restore.GroupPlan() for _ in optimizer.param_groups]
    for sg, group in enumerate(smeta["groups"]):
        for e in group["params"]:
            i = int(e["name"][len("unit"):])
            unit = aligned[i] if i < len(aligned) else None
            if unit is None or unit.shard not in where:
                raise ValueError(f"the checkpoint holds optimizer state for unit {i}, which "
                                 "has no shard in this optimizer")
            gi, pi = where[unit.shard]
            gp = out[gi]
            if gp.kinds is not None and (gp.kinds, gp.dtypes) != (plan[sg].kinds,
                                                                  plan[sg].dtypes):
                raise ValueError(f"param group {gi} holds shards whose state was saved in "
                                 "param groups with other state kinds or dtypes")
            gp.kinds, gp.dtypes = plan[sg].kinds, plan[sg].dtypes
            gp.params[pi] = plan[sg].params[e["index"]]
    return out


def _check_layout(meta: dict, units) -> None:
    saved = [(n, tuple(e["shape"])) for u in meta["units"] for e in u["entries"]
             for n in e["names"][:1]]
    ours = [(e.names[0], tuple(e.shape)) for u in units for e in u.entries]
    if ours != saved and sorted(ours) == sorted(saved):
        raise ValueError("checkpoint does not match the model: the same parameters are split "
                         "into units differently (saved with other units= or param_group_fn=)")
    for i, (mine, theirs) in enumerate(zip(ours, saved, strict=False)):
        if mine != theirs:
            raise ValueError(f"checkpoint does not match the model: tensor #{i} is {theirs[0]!r} "
                             f"with shape {theirs[1]} in the checkpoint but {mine[0]!r} with "
                             f"shape {mine[1]} in the model")
    if len(ours) != len(saved):
        longer, which = (ours, "model") if len(ours) > len(saved) else (saved, "checkpoint")
        first = longer[min(len(ours), len(saved))][0]
        raise ValueError(f"checkpoint does not match the model: {first!r} exists only in the "
                         f"{which}")
    for i, (u, m) in enumerate(zip(units, meta["units"], strict=False)):
        if u.numel != m["numel"]:
            raise ValueError(f"checkpoint does not match the model: unit {i} ({u.name}) holds "
                             f"{m['numel']} elements in the checkpoint, {u.numel} in the model")


def _refuse_frozen_changes(meta: dict, shards: list[dict], state, path: str) -> None:
    """A parameter trained when saved and frozen here (requires_grad=False), or the reverse:
    the units hold trainable and frozen parameters apart, so the layouts differ. Said plainly,
    with the way to take the weights alone, before _check_layout reports a mismatch."""
    def names(units, frozen: bool) -> set:
        return {n for u in units if bool(u["frozen"] if isinstance(u, dict) else u.frozen)
                == frozen for e in (u["entries"] if isinstance(u, dict) else u.entries)
                for n in (e["names"] if isinstance(e, dict) else e.names)}

    saved_frozen = names(meta["units"], True) | {k[len("extra."):] for k in shards[0]
                                                 if k.startswith("extra.")}
    own_frozen = names(state.units, True) | {n for n, _ in state.replicated}
    now_frozen = sorted(names(meta["units"], False) & own_frozen)
    now_trained = sorted(names(state.units, False) & saved_frozen)
    if not now_frozen and not now_trained:
        return
    what = (f"{now_frozen[0]!r} is frozen (requires_grad=False) in the model but was trained "
            "when saved" if now_frozen else
            f"{now_trained[0]!r} is trained in the model but was frozen when saved")
    more = len(now_frozen) + len(now_trained) - 1
    raise ValueError(
        f"checkpoint does not match the model: {what}{f' ({more} more)' if more else ''}; a "
        "sharded checkpoint holds trainable and frozen parameters in separate units, so it "
        "loads into a model that freezes the same ones. To start from its weights with other "
        "parameters frozen, load them alone: tierlift.zero.load_full_state_dict(model, "
        f"tierlift.checkpoint.full_state_dict({path!r})) (the optimizer starts fresh)")


def _refuse_missing(own: dict, extras: dict) -> None:
    """A buffer (or replicated parameter) of the model that the checkpoint lacks would keep
    its initial value beside loaded weights: refused, as a model that is not sharded refuses
    it (a unit's parameters are checked by _check_layout)."""
    missing = [k for k in own if not k.endswith(_SHARD_NAME) and k not in extras]
    if missing:
        raise ValueError(f"checkpoint does not match the model: {missing[0]!r} exists only in "
                         "the model")


def _align(meta: dict, units, shards: list[dict]):
    """Pairs the model's units with the saved ones. Stage 3 shards frozen parameters, stages
    1/2 keep them replicated (saved as extras), so a checkpoint may hold them either way:
    returns (per saved unit: the model's unit or None, {model frozen unit: its full tensors
    from the saved extras}, {name: full tensor} of saved frozen units the model replicates).
    Trainable units must match one to one, in order (_check_layout)."""
    saved = meta["units"]
    frozen = [bool(m.get("frozen")) for m in saved]
    trainable = [u for u in units if not u.frozen]
    _check_layout({"units": [m for m, f in zip(saved, frozen, strict=True) if not f]},
                  trainable)
    aligned = [None] * len(saved)
    left = iter(trainable)
    for i, f in enumerate(frozen):
        if not f:
            aligned[i] = next(left)
    free = [i for i, f in enumerate(frozen) if f]
    extras = {k[len("extra."):]: v for k, v in shards[0].items() if k.startswith("extra.")}
    from_extras = {}
    for u in units:
        if not u.frozen:
            continue
        mine = [(e.names[0], list(e.shape)) for e in u.entries]
        match = next((i for i in free if mine == [(e["names"][0], list(e["shape"]))
                                                  for e in saved[i]["entries"]]), None)
        if match is not None:
            aligned[match] = u
            free.remove(match)
            continue
        tensors = []
        for e in u.entries:
            name = next((n for n in e.names if n in extras), None)
            if name is None:
                raise ValueError(f"checkpoint does not match the model: frozen parameter "
                                 f"{e.names[0]!r} exists only in the model")
            if tuple(extras[name].shape) != tuple(e.shape):
                raise ValueError(f"checkpoint does not match the model: {name!r} has shape "
                                 f"{tuple(extras[name].shape)} in the checkpoint but "
                                 f"{tuple(e.shape)} in the model")
            tensors.append(extras[name])
        from_extras[u] = tensors
    replicated = {}
    for i in free:
        m = saved[i]
        for e in m["entries"]:
            t = fmt.unit_slice(shards, f"unit{i}.param", m["shard_numel"], e["offset"],
                               e["offset"] + e["numel"]).reshape(e["shape"])
            for n in e["names"]:
                replicated[n] = t
    return aligned, from_extras, replicated


def _model_names(meta: dict, shards: list[dict], state, model) -> tuple[dict, list[dict]]:
    """`meta` and `shards` with the saved names renamed to the model's where they differ only
    by wrapper segments (torch.compile's `_orig_mod.`, DDP's `module.`: a model sharded or
    saved through either, loaded into one without it, or the reverse), one to one; else as
    they are (_check_layout and check_fits name the difference)."""
    extra = "extra."
    saved = [n for u in meta["units"] for e in u["entries"] for n in e["names"]]
    saved += [k[len(extra):] for k in shards[0] if k.startswith(extra)]
    own = [n for u in state.units for e in u.entries for n in e.names]
    own += [k for k in model.state_dict() if not k.endswith(_SHARD_NAME)]
    if set(saved) <= set(own):
        return meta, shards
    to = order.by_wrappers(list(dict.fromkeys(saved)), list(dict.fromkeys(own)))
    if to is None:
        return meta, shards
    units = [{**u, "entries": [{**e, "names": [to[n] for n in e["names"]]}
                               for e in u["entries"]]} for u in meta["units"]]
    names = [[to.get(n, n) if n is not None else None for n in g]
             for g in meta.get("param_names") or []]
    first = [{(extra + to[k[len(extra):]] if k.startswith(extra) else k): v
              for k, v in shards[0].items()}]
    return {**meta, "units": units, "param_names": names}, first + shards[1:]


def optim_dir(rank: int) -> str:
    return f"rank{rank:05d}.optim"


def _add_streamed(path: str, meta: dict, shards: list[dict]) -> None:
    """Puts the streamed optimizer state of every saved rank into `shards` as mapped tensors
    ("unit3.exp_avg", "unit3.step"), for the resharding path."""
    for r, tensors in enumerate(shards):
        d = os.path.join(path, optim_dir(r))
        for group, names in zip(stream.read_tensors(d, mmap=True), stream.names(d)):
            for index, st in group.items():
                for k, v in st.items():
                    tensors[f"{names[index]}.{k}"] = v.reshape(-1) if v.dim() else v


def _take(shards: list[dict], unit, saved: dict, key: str, rank: int) -> torch.Tensor:
    """This rank's new shard of the unit's flat tensor `key` (zeros past the unit's end)."""
    lo = rank * unit.shard_numel
    hi = min(lo + unit.shard_numel, unit.numel)
    # state keeps its saved dtype: compact state's uint8 codes cast to float were refused
    out = torch.zeros(unit.shard_numel, dtype=unit.shard.dtype if key.endswith(".param")
                      else shards[0][key].dtype)
    if hi > lo:
        out[:hi - lo] = fmt.unit_slice(shards, key, saved["shard_numel"], lo, hi)
    return out.to(unit.device)


def _whole(shards: list[dict], unit, saved: dict, key: str, comm, path: str) -> torch.Tensor:
    """A state tensor that is not one value per element of the shard (compact state's
    exp_avg_sq_scale: one per 256 elements of each rank's shard) as this rank saved it; its
    blocks cannot be split at other shard bounds, so another world size is refused."""
    if len(shards) != comm.world or saved["shard_numel"] != unit.shard_numel:
        raise ValueError(
            f"checkpoint {path} holds compact optimizer state (state_dtype='bf16': "
            f"{key.split('.', 1)[1]!r} has one value per 256 elements of each rank's shard) "
            f"saved on {len(shards)} ranks, which cannot be resharded exactly for "
            f"{comm.world}; nothing was loaded. Load it on {len(shards)} ranks, or save it "
            "from an optimizer with state_dtype='fp32'")
    return shards[comm.rank][key].clone().to(unit.device)


@torch.no_grad()
def load(path: str | os.PathLike, model: torch.nn.Module, optimizer=None, *,
         verify: bool = True) -> dict:
    """Load a checkpoint written by save() into a model (and optimizer); returns the `extra`
    dict given to save(). A sharded model loads on any world size: each rank reads the slices
    of the saved shards that overlap its new shard; offloaded optimizer state streams into the
    tiers within cpu_budget (restore.py, reshard.py). Every file's SHA-256 is checked before
    anything is changed, and the load is all-or-nothing across ranks (agree.py): if it fails
    on any rank, every rank keeps its model and optimizer as they were and raises.

    A checkpoint without manifest.json (which records the SHA-256 of its JSON files) is
    refused: verify=False loads one written by a tierlift from before manifests, with a
    warning. Either way the hyperparameters and step counts it holds are checked as the
    optimizer's constructor checks them (validate.py) before anything changes."""
    if getattr(model, _ATTR, None) is None:
        return replicated.load(os.fspath(path), model, optimizer, verify=verify)
    state = _state(model)
    state.named_call("tierlift.checkpoint.load")
    comm = state.comm
    # Each rank checks the checkpoint on its own (its folder, its files, its model may differ);
    # one that refuses still reaches the agreement, so no rank waits there for it (agree.py).
    agreement = agree.Agreement(state.world_comm, os.fspath(path))
    try:
        in_flight.before_load(path)  # this process's background save of `path` lands first
        path = fmt.resolve_dir(os.fspath(path))
        agreement.path = path
        meta = fmt.read_metadata(path, verify)
        agreement.fingerprint = agree.fingerprint(path)
        if meta.get("layout", "sharded") != "sharded":
            raise ValueError(f"{path} holds an unsharded model's checkpoint; load it before "
                             "tierlift.zero.shard(), or into a model that is not sharded")
        shards = [fmt.load_tensors(path, r) for r in range(meta["world_size"])]  # mapped
        meta, shards = _model_names(meta, shards, state, model)
        _refuse_frozen_changes(meta, shards, state, path)
        aligned, from_extras, unsharded = _align(meta, state.units, shards)
        # Every check before the first change: a checkpoint that does not fit leaves all as it was.
        if optimizer is not None and meta["param_groups"] and \
                len(meta["param_groups"]) != len(optimizer.param_groups):
            raise ValueError(f"checkpoint has {len(meta['param_groups'])} optimizer param "
                             f"groups, the optimizer {len(optimizer.param_groups)}")
        saved_groups = []
        if optimizer is not None:
            # Per-shard state goes to each unit's shard whatever the order; the groups'
            # hyperparameters go to the group holding the same shards (order.py).
            if meta["param_groups"] and not meta.get("param_names"):  # saved before names
                mapping = unnamed.mapping(meta, aligned, optimizer, path, optim_dir)
            else:
                mapping = order.match(meta.get("param_names"), _shard_names(state, optimizer),
                                      f"checkpoint {path}")
            saved_groups = order.saved_groups(meta, mapping, f"checkpoint {path}")
            if not meta["param_groups"]:
                order.refuse_stale_state(optimizer, path)
            validate.fits(saved_groups, optimizer.param_groups, os.path.join(path, fmt.METADATA))
        own = model.state_dict()
        taken = {n for u in from_extras for e in u.entries for n in e.names}
        extras = {k[len("extra."):]: v for k, v in shards[0].items()
                  if k.startswith("extra.") and k[len("extra."):] not in taken}
        extras.update(unsharded)
        fmt.check_fits(own, extras, complete=False)
        _refuse_missing(own, extras)
        off = fmt.offloader(optimizer)
        streamed = optimizer is not None and meta.get("optimizer_state") == "offloaded"
        plan, source = None, path
        if streamed and off is not None:  # streamed into the tiers, chunk by chunk
            if meta["world_size"] == comm.world:  # the same shards: this rank's files
                source = os.path.join(path, optim_dir(comm.rank))
                smeta = stream.verify(source)
                plan = _plan_by_unit(restore.plan_from_state(source, smeta), smeta, aligned,
                                     optimizer)
            else:  # each new shard from the byte ranges of the saved shards it overlaps
                for r in range(meta["world_size"]):
                    stream.verify(os.path.join(path, optim_dir(r)))
                plan = reshard.plan(path, meta, aligned, comm.rank, off, optim_dir)
            restore.check_plan(off, plan, source)
        elif streamed:  # into an optimizer that holds its state in RAM anyway
            for r in range(meta["world_size"]):
                stream.verify(os.path.join(path, optim_dir(r)))
            _add_streamed(path, meta, shards)
        counts = _loaded_counts(meta, aligned, path) if optimizer is not None else {}
        if optimizer is not None:  # its load_state_dict takes the counts off the state it loads
            unused.hook_state_dict(state, optimizer)
        prior = unused.counts_of(counts)
        loaded_state: dict = {}
        if optimizer is not None and plan is None:
            for i, (unit, saved) in enumerate(zip(aligned, meta["units"], strict=True)):
                keys = {k.split(".", 1)[1] for k in shards[0] if k.startswith(f"unit{i}.")}
                keys.discard("param")
                if keys and unit is not None:
                    st = loaded_state[unit.shard] = {}
                    for key in sorted(keys):
                        value = shards[0][f"unit{i}.{key}"]
                        if value.dim() == 0:
                            st[key] = value.clone().to(unit.device if key != "step" else "cpu")
                        elif value.numel() != saved["shard_numel"]:  # not one value per element
                            st[key] = _whole(shards, unit, saved, f"unit{i}.{key}", comm, path)
                        else:
                            st[key] = _take(shards, unit, saved, f"unit{i}.{key}", comm.rank)
                    if unit in counts:  # checked and taken off by load_state_dict (unused.py)
                        st[unused.KEY] = counts[unit]
    except BaseException as e:
        agreement.fail(e)
        raise
    # Everything below is prepared, then agreed on by every rank, then committed: params and
    # extras are copied in place behind an undo journal; the optimizer fills its uncommitted
    # generation (or journals in-place fills) and calls the agreement right before it commits.
    journal = Journal()
    try:
        for i, (unit, saved) in enumerate(zip(aligned, meta["units"], strict=True)):
            if unit is None:
                continue  # frozen parameters this model replicates: in `extras`
            new = _take(shards, unit, saved, f"unit{i}.param", comm.rank)  # one unit at a time
            journal.keep(unit.shard)
            unit.shard.copy_(new)
            unit.stale = True
        for unit, tensors in from_extras.items():  # frozen, saved replicated
            journal.keep(unit.shard)
            unit.shard.copy_(_slice(unit, tensors))
            unit.stale = True
        for name, value in extras.items():
            journal.keep(own[name])
            own[name].copy_(value)
        if plan is not None:
            restore.load_plan(off, plan, source, before_commit=agreement.check)
        elif optimizer is not None and meta["param_groups"]:  # saved with an optimizer
            # after the params: an offloader takes a param as its master
            _load_per_param_state(optimizer, loaded_state, before_commit=agreement.check)
        agreement.check()  # a no-op if the optimizer already agreed
    except BaseException as e:
        agreement.fail(e)  # the collective every rank reaches, whatever failed where
        journal.undo()
        unused.restore_counts(prior)  # load_state_dict may have taken them already
        raise
    finally:
        journal.close()
    for unit, rec in counts.items():  # committed: each parameter steps on from its own count
        unused.adopt(unit, optimizer, rec)
    if saved_groups:
        for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
            for k, v in saved.items():
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    return meta.get("extra", {})
