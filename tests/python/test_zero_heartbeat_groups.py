"""The heartbeat's c10d-store keys of models over different process groups (4 gloo ranks).

Two data-parallel groups ([0, 1] and [2, 3]) each shard their own copy. Every model's keys were
`tierlift_zero/m<n>/` (the n-th model of the process), whatever its ranks, so:

- a named collective in group A (full_state_dict) left a flag that made every forward of group
  B's model read the store twice more, looking for callers among its own ranks;
- a divergence in group A (a forward without grad on one rank) was named as the cause of any
  failed collective in group B;
- a model over every rank, made after a group's model on some ranks and before it on others,
  had a different n on each: it read the other group's model's forwards as its peers' and
  raised "a forward ran on some ranks only" on every rank.

Each model's keys are now under its ranks, numbered among the models over those ranks. Models
over every rank (plain and mesh=, whose shard groups are the two pairs) train as one process.

One spawn; each rank records the store keys its heartbeats touch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from zero_model import spawn_ranks

import tierlift
from tierlift.zero import heartbeat

LR, STEPS = 0.1, 2
UNITS = ["0", "2"]
DIVERGED = "ran on some ranks only"


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(step))


def _steps(model, pieces: int, piece: int, first: int = 0) -> list[float]:
    """SGD steps on this rank's piece of each batch; this rank's losses."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(first, first + STEPS):
        opt.zero_grad()
        loss = model(_batch(step).chunk(pieces)[piece]).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class _Recorder:
    """The c10d store, recording each call and the keys it touches."""

    def __init__(self, store, log: list) -> None:
        self._store, self._log = store, log

    def __getattr__(self, name: str):
        fn = getattr(self._store, name)

        def call(*args, **kwargs):
            keys = args[0] if args else ()
            self._log.append((name, tuple(keys) if isinstance(keys, list) else (keys,)))
            return fn(*args, **kwargs)

        return call


def _record(log: list):
    """Routes every heartbeat's store calls through a _Recorder (this process only)."""
    original = heartbeat.Heartbeat.store

    def store(self):
        inner = original.fget(self)
        return None if inner is None else _Recorder(inner, log)

    heartbeat.Heartbeat.store = property(store)
    return original


def _keys(log: list) -> set[str]:
    return {k for _, keys in log for k in keys}


def _group_phase(rank: int, groups, log: list) -> dict:
    """Each group's own model: a named call in group A, then a divergence in group A, then a
    failure explained in group B."""
    g, mine = rank // 2, groups[rank // 2]
    out = {}
    model = tierlift.zero.shard(_net(g), stage=3, process_group=mine, units=UNITS)
    _steps(model, 2, rank % 2)
    dist.barrier()
    if g == 0:  # a named collective on group A only
        tierlift.zero.full_state_dict(model)
    dist.barrier()
    start = len(log)
    _steps(model, 2, rank % 2, first=STEPS)
    out["store_calls_per_step"] = (len(log) - start) / STEPS
    dist.barrier()
    if g == 0:
        # A real divergence, on both ranks at once: forward N without grad on rank 0 only,
        # with gathers matching rank 1's; each rank's next backward checks forward N.
        x = _batch(0)[:4]
        earlier = model(x).sum()
        with torch.no_grad() if rank == 0 else torch.enable_grad():
            later = model(x).sum()
        try:
            (earlier if rank == 0 else later).backward()
            out["diverged"] = "<no error>"
        except tierlift.zero.RankFailureError as e:
            out["diverged"] = str(e)
    dist.barrier()  # group A's divergence is in the store
    if g == 1:
        # A collective of group B fails (what its Comm hands to on_error).
        hb = model._tierlift_zero.heartbeat
        hb.settle_s = 0.5
        out["explained"] = str(hb.explain(RuntimeError("Connection closed by peer")))
    dist.barrier()
    out["keys"] = _keys(log)
    return out


def _order_phase(rank: int, groups) -> dict:
    """A model over every rank, made after a group's model on ranks 0 and 1 and before it on
    ranks 2 and 3; then a mesh= model (shard groups: the pairs, replicated across them). Each
    group evaluates its model on every rank of it first (allowed)."""
    g, mine = rank // 2, groups[rank // 2]
    out = {}
    if g == 0:
        second = tierlift.zero.shard(_net(g), stage=3, process_group=mine, units=UNITS)
    everyone = tierlift.zero.shard(_net(), stage=3, units=UNITS)
    if g == 1:
        second = tierlift.zero.shard(_net(g), stage=3, process_group=mine, units=UNITS)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    meshed = tierlift.zero.shard(_net(), stage=3, mesh=mesh, units=UNITS)
    with torch.no_grad():
        second(_batch(0))
    for name, model in (("everyone", everyone), ("mesh", meshed)):
        try:
            out[name] = _steps(model, 4, rank)
        except tierlift.zero.RankFailureError as e:
            out[name] = str(e)
    return out


def _cases(rank: int, world: int, tmp: str) -> dict:
    log: list = []
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    original = _record(log)
    try:
        out = _group_phase(rank, groups, log)
        out["order"] = _order_phase(rank, groups)
    finally:
        heartbeat.Heartbeat.store = original
    dist.barrier()  # no rank leaves (taking the store down) before the others are done
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("zero_heartbeat_groups")), world=4)


def test_groups_never_touch_each_others_keys(ranks):
    a = ranks[0]["keys"] | ranks[1]["keys"]
    b = ranks[2]["keys"] | ranks[3]["keys"]
    assert a and b
    assert not a & b, sorted(a & b)


def test_a_named_call_in_one_group_adds_no_store_calls_to_the_other(ranks):
    """Before: 5 store calls per step in group B after group A's full_state_dict, 3 in A."""
    calls = [out["store_calls_per_step"] for out in ranks]
    assert calls[0] > 0
    assert calls == [calls[0]] * 4, calls


def test_a_divergence_in_one_group_is_not_named_in_the_other(ranks):
    for rank in (0, 1):
        msg = ranks[rank]["diverged"]
        assert DIVERGED in msg, (rank, msg)
    for rank in (2, 3):
        msg = ranks[rank]["explained"]
        assert f"a collective failed on rank {rank}" in msg and DIVERGED not in msg, (rank, msg)


def test_models_over_every_rank_made_in_any_order_train_as_one_process(ranks):
    want = []
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        pieces = [model(x).square().mean() for x in _batch(step).chunk(4)]
        torch.stack(pieces).mean().backward()  # the mean over ranks of each rank's loss
        opt.step()
        want.append([p.item() for p in pieces])
    for rank, out in enumerate(ranks):
        for name in ("everyone", "mesh"):
            got = out["order"][name]
            assert not isinstance(got, str), (rank, name, got)
            assert got == pytest.approx([w[rank] for w in want], rel=1e-6, abs=1e-7), (rank, name)
