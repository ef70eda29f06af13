"""save() and load() of a model that is not sharded: one process, or replicated ranks (DDP)
where rank 0 writes and every rank reads. Same directory, atomic publish and SHA-256 checks as
the sharded format (format.py), with:

    metadata.json       "layout": "replicated", the model's key order, the optimizer's param
                        groups (hyperparameters and parameter names) and the caller's `extra`
    rank00000.pt        "model.<key>" for the model state dict and, for an optimizer whose
                        state is in RAM, "optim.<index>.<kind>" as its state_dict() has it
    optim/              an offloading optimizer's state, streamed (stream.py): never in RAM

An offloaded checkpoint loads into an optimizer with any other budget, chunk size or tier,
into offload="none", and into torch.optim.AdamW (optimizer_state_dict() converts it).
"""

from __future__ import annotations

import json
import os

import torch

from tierlift.checkpoint import agree, background, in_flight, order, restore, stream, validate
from tierlift.checkpoint import format as fmt
from tierlift.offload.journal import Journal
from tierlift.offload.layout import kind_elems
from tierlift.zero.comm import Comm

OPTIM_DIR = "optim"


def _dist():
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        return d.get_rank(), d.get_world_size()
    return 0, 1


def _comm(model) -> Comm | None:
    """The ranks that must agree on a load: a DDP model's process group; a model that is not
    wrapped in DDP loads on each rank on its own (no collective: it may be loaded on one)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return Comm(model.process_group)
    return None


def save(path: str, model: torch.nn.Module, optimizer, extra: dict | None, *,
         blocking: bool = True, staging_budget: int | None = None):
    """Rank 0 snapshots and writes; every rank of the default group votes on the commit."""
    rank, _ = _dist()
    comm = Comm(None)
    try:  # a rank refusing here still votes, with the others' claim: none waits for it
        in_flight.before_save()
        off = fmt.offloader(optimizer)
        job = background.Job(path, blocking=blocking, staging_budget=staging_budget,
                             off=off if rank == 0 else None,
                             estimate=lambda: background.estimate_bytes(model, optimizer, off))
    except BaseException as e:
        background.refuse(background.training_vote(comm), e, path)
    job.claim(rank, background.training_vote(comm), writes=rank == 0)  # rank 0 alone
    fields = None
    try:
        if rank == 0:
            fields = _stage(job, model, optimizer, off, extra)
    except BaseException as e:
        job.snapshot_failed(e)
    vote = background.training_vote(comm) if blocking else background.side_vote(comm)
    return job.start(vote, lambda: _publish(job, fields) if rank == 0 else None)


def _stage(job, model, optimizer, off, extra) -> dict:
    """Rank 0's snapshot: model (and optimizer) tensors into the job; returns the metadata."""
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    kind, scalars = None, {}
    if off is not None:
        kind = "offloaded"
        first = {i: a[0] for i, a in order.aliases(model).items()}
        job.offloaded(off, OPTIM_DIR, {p: first.get(id(p)) for g in optimizer.param_groups
                                       for p in g["params"]})
    elif optimizer is not None:
        kind = "tensors"
        for i, st in optimizer.state_dict()["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    tensors[f"optim.{i}.{k}"] = v
                else:
                    scalars[f"{i}.{k}"] = v
    job.tensor_file(0, tensors)
    return {
        "key_order": list(model.state_dict().keys()),
        "optimizer_state": kind, "optimizer_scalars": scalars,
        "param_groups": [] if optimizer is None else fmt.param_groups_json(optimizer),
        "param_names": [] if optimizer is None else order.param_names(model, optimizer),
        "extra": json.loads(json.dumps(extra or {})),  # as it is now; checked JSON-able
    }


def _publish(job, fields: dict) -> None:
    job.publish({"format": fmt.FORMAT, "version": fmt.VERSION, "layout": "replicated",
                 "world_size": 1, **fields})


def save_state_dict(path: str, state_dict: dict[str, torch.Tensor],
                    extra: dict | None = None) -> None:
    """A checkpoint of a plain model state dict without an optimizer (one brought in from
    another format), in save()'s format: load() puts it into a model that is not sharded.
    `path` must be new or an empty directory: an existing checkpoint is not replaced."""
    in_flight.before_save()
    path = fmt.dir_path(path)
    job = background.Job(path, blocking=True, staging_budget=None, replace=False,
                         estimate=lambda: sum(t.numel() * t.element_size()
                                              for t in state_dict.values()))
    job.claim(0, background.Vote(0, 1, None))
    try:
        job.tensor_file(0, {f"model.{k}": v for k, v in state_dict.items()})
    except BaseException as e:
        job.snapshot_failed(e)
    fields = {"key_order": list(state_dict), "optimizer_state": None, "optimizer_scalars": {},
              "param_groups": [], "param_names": [], "extra": extra or {}}
    job.start(background.Vote(0, 1, None), lambda: _publish(job, fields))


def optimizer_state_dict(path: str, *, verify: bool = True) -> dict:
    """The optimizer state of a replicated checkpoint as torch's Optimizer.state_dict() has it
    ({"state": {index: {...}}, "param_groups": [...]}): loads into torch.optim.AdamW, or into
    tierlift's optimizers with any offload. A checkpoint without manifest.json is refused
    unless `verify` is False (format.read_metadata)."""
    in_flight.before_load(path)
    path = fmt.resolve_dir(os.fspath(path))
    meta = fmt.read_metadata(path, verify)
    if meta.get("layout") != "replicated":
        raise ValueError(f"{path} is a sharded checkpoint: its optimizer state is per unit "
                         "shard; load it with tierlift.checkpoint.load into a sharded model")
    state: dict = {}
    if meta["optimizer_state"] == "offloaded":
        d = os.path.join(path, OPTIM_DIR)
        stream.verify(d)
        base = 0
        for group, sizes in zip(stream.read_tensors(d), meta["param_names"]):
            for index, st in group.items():
                state[base + index] = st
            base += len(sizes)
    elif meta["optimizer_state"] == "tensors":
        for key, value in fmt.load_tensors(path, 0).items():
            if key.startswith("optim."):
                _, i, k = key.split(".", 2)
                state.setdefault(int(i), {})[k] = value
        for key, value in meta["optimizer_scalars"].items():
            i, k = key.split(".", 1)
            state.setdefault(int(i), {})[k] = value
    groups, base = [], 0
    for hyper, names in zip(meta["param_groups"], meta["param_names"]):
        g = dict(hyper)
        g["params"] = list(range(base, base + len(names)))
        base += len(names)
        groups.append(g)
    from tierlift.optim.hyper import loaded_codes

    # compact codes under their own key, as state_dict() gives them (the offloaded tiers' files
    # and older checkpoints name them exp_avg_sq): torch.optim then refuses to step on them
    return loaded_codes({"state": state, "param_groups": groups})


def _mapping(model, optimizer, meta: dict, path: str) -> order.Mapping:
    """How this optimizer's parameters map to the saved ones, by name (order.py)."""
    return order.match(meta["param_names"], order.param_names(model, optimizer),
                       f"checkpoint {path}", alias=order.alias_map(model))


def _remap_state_dict(opt_sd: dict, mapping: order.Mapping, saved_groups: list[dict]) -> dict:
    """`opt_sd` (the saved order) in this optimizer's order."""
    sizes = [len(g["params"]) for g in opt_sd["param_groups"]]
    state, groups, base = {}, [], 0
    for i, si in enumerate(mapping.flat(sizes)):
        if si in opt_sd["state"]:
            state[i] = opt_sd["state"][si]
    for hyper, ps in zip(saved_groups, mapping.params, strict=True):
        groups.append({**hyper, "params": list(range(base, base + len(ps)))})
        base += len(ps)
    return {"state": state, "param_groups": groups}


def _model_keys(own: dict, saved: dict) -> dict:
    """`saved` with its keys renamed to the model's where they differ only by torch.compile's
    or DDP's wrapper prefixes, one to one; else as it is (check_fits names the difference)."""
    if set(own) == set(saved):
        return saved
    renamed = order.by_wrappers(list(saved), list(own))
    if renamed is None or set(renamed.values()) != set(own):
        return saved
    return {renamed[k]: v for k, v in saved.items()}


def _check_state(optimizer, opt_sd: dict, path: str) -> None:
    """Every saved state tensor fits its parameter: checked before anything changes (an
    optimizer would find a mismatch half-way through its load_state_dict)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, st in opt_sd["state"].items():
        for k, v in st.items():
            want = kind_elems(k, params[i].numel())  # compact state: a scale per 256 elements
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() != want:
                raise ValueError(f"checkpoint {path} does not match the optimizer: the state "
                                 f"{k!r} of parameter {i} has shape {tuple(v.shape)}, the "
                                 f"parameter {tuple(params[i].shape)}")


@torch.no_grad()
def load(path: str, model: torch.nn.Module, optimizer, *, verify: bool = True) -> dict:
    # Each DDP rank checks the checkpoint on its own; one that refuses still reaches the
    # agreement, so no rank waits there for it (agree.py).
    agreement = agree.Agreement(_comm(model), path)
    try:
        in_flight.before_load(path)  # this process's background save of `path` lands first
        path = fmt.resolve_dir(path)
        agreement.path = path
        meta = fmt.read_metadata(path, verify)
        agreement.fingerprint = agree.fingerprint(path)
        if meta.get("layout") != "replicated":
            raise ValueError(f"{path} holds a sharded (tierlift.zero) checkpoint: load it into a "
                             "model after tierlift.zero.shard()")
        # Everything is checked before anything changes.
        tensors = fmt.load_tensors(path, 0)
        saved = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
        saved = _model_keys(model.state_dict(), saved)
        fmt.check_fits(model.state_dict(), saved, complete=True)
        off = fmt.offloader(optimizer)
        opt_sd, plan = None, None
        optim = os.path.join(path, OPTIM_DIR)
        saved_groups = []
        if optimizer is not None and meta["optimizer_state"] is not None:
            mapping = _mapping(model, optimizer, meta, path)
            saved_groups = order.saved_groups(meta, mapping, f"checkpoint {path}")
            validate.fits(saved_groups, optimizer.param_groups, os.path.join(path, fmt.METADATA))
            if meta["optimizer_state"] == "offloaded":
                smeta = stream.verify(optim)
                mine = {"groups": [smeta["groups"][sg] for sg in mapping.groups]}
                if off is None or not restore.same_state_format(off, mine):
                    # through a state dict, which the optimizer converts (fp32 <-> compact state)
                    opt_sd = optimizer_state_dict(path, verify=verify)
                else:
                    plan = order.remap_plan(restore.plan_from_state(optim, smeta), mapping)
                    restore.check_plan(off, plan, optim)
            else:
                opt_sd = optimizer_state_dict(path, verify=verify)
            if opt_sd is not None:
                opt_sd = _remap_state_dict(opt_sd, mapping, saved_groups)
                _check_state(optimizer, opt_sd, path)
        elif optimizer is not None:
            order.refuse_stale_state(optimizer, path)
    except BaseException as e:
        agreement.fail(e)
        raise
    # Prepared, agreed on by every DDP rank, committed (agree.py): the model in place behind
    # an undo journal, first (an offloading optimizer takes a parameter as its master where a
    # state dict has none); the optimizer's state uncommitted until the agreement.
    journal = Journal()
    try:
        for value in model.state_dict().values():
            journal.keep(value)
        model.load_state_dict(saved)
        if plan is not None:
            restore.load_plan(off, plan, optim, before_commit=agreement.check)
        elif opt_sd is not None:
            # this optimizer's own group keys, overridden by the saved hyperparameters (not
            # through optimizer.state_dict(): an offloading one would read its state back)
            opt_sd["param_groups"] = [
                {**{k: v for k, v in g.items() if k != "params"}, **saved_g}
                for g, saved_g in zip(optimizer.param_groups, opt_sd["param_groups"],
                                      strict=True)]
            agree.load_optimizer_state(optimizer, opt_sd, before_commit=agreement.check)
        agreement.check()  # a no-op if the optimizer already agreed
    except BaseException as e:
        agreement.fail(e)
        journal.undo()
        raise
    finally:
        journal.close()
    if optimizer is not None and meta["optimizer_state"] is not None:
        for group, hyper in zip(optimizer.param_groups, saved_groups, strict=True):
            for k, v in hyper.items():
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    return meta.get("extra", {})
