"""torch.amp.GradScaler over tierlift.zero shards reads nothing back itself: the found-inf flags
are or-ed over the ranks on the device, and torch's own read of them in step() (the one host
sync it makes without sharding) stays the only one. Reads are counted on CPU at tierlift's own
call sites (test_zero_sync.HostReads; each would be a sync on a GPU), at one rank and on 2 gloo
ranks, over steps with an inf written into rank 0's gradient shard on step 1: every rank skips
that step and the weights and scales match GradScaler + AdamW on the unsharded model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_zero_sync import HostReads
from zero_model import batches, make_model, raised, spawn_ranks

import tierlift

STEPS, BATCH, LR = 3, 4, 3e-3


def _all_used(model):
    for block in model.blocks:
        del block.unused  # every parameter gets a gradient: no other read in the step
    return model


def _fit(model, opt, *, world, rank, reads=None, unscale=False):
    """Scales after every step and tierlift's reads per step (inside the counted region)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scales, counts = [], []
    for i, seq in enumerate(batches(STEPS, BATCH)):
        opt.zero_grad(set_to_none=True)
        local = seq.chunk(world)[rank]
        loss = F.cross_entropy(model(local[:, :-1]).flatten(0, 1), local[:, 1:].flatten())
        scaler.scale(loss).backward()
        if i == 1 and rank == 0:
            g = next(p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None)
            g.view(-1)[0] = float("inf")
        if reads is not None:
            reads.__enter__()
        if unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        if reads is not None:
            reads.__exit__()
            counts.append(dict(reads.counts))
        scales.append(scaler.get_scale())
    return scales, counts


def _reference(unscale=False):
    model = _all_used(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    scales, _ = _fit(model, opt, world=1, rank=0, unscale=unscale)
    return scales, model.state_dict()


def _sharded(world, rank, reads, stage, unscale=False):
    model = tierlift.zero.shard(_all_used(make_model()), stage=stage)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    scales, counts = _fit(model, opt, world=world, rank=rank, reads=reads, unscale=unscale)
    return scales, counts, {k: v.clone() for k, v in tierlift.zero.full_state_dict(model).items()}


def _check(scales, counts, sd, ref_scales, ref):
    assert scales == ref_scales and scales[1] == scales[0] / 2, (scales, ref_scales)
    assert counts == [{}] * STEPS, counts  # tierlift read nothing back
    for k, v in ref.items():
        torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_rank_no_reads(monkeypatch, stage):
    ref_scales, ref = _reference()
    _check(*_sharded(1, 0, HostReads(monkeypatch), stage), ref_scales, ref)


CASES = {"s1": (1, False), "s2": (2, False), "s3-unscale": (3, True)}


def _cases(rank, world, tmp):
    mp = pytest.MonkeyPatch()
    reads = HostReads(mp)
    try:
        out = {name: _sharded(world, rank, reads, stage, unscale)
               for name, (stage, unscale) in CASES.items()}
    finally:
        mp.undo()
    out["no_grads_here"] = raised(lambda: _no_grads_on_rank1(rank))
    return out


def _no_grads_on_rank1(rank):
    """Rank 1 holds no gradient at the step (cleared): it takes the other ranks' verdict, where
    GradScaler alone asserts "No inf checks were recorded" on that rank only."""
    model = tierlift.zero.shard(_all_used(make_model()), stage=2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu")
    seq = batches(1, BATCH)[0]
    loss = F.cross_entropy(model(seq[:, :-1]).flatten(0, 1), seq[:, 1:].flatten())
    scaler.scale(loss).backward()
    if rank == 1:
        opt.zero_grad(set_to_none=True)
    scaler.step(opt)
    scaler.update()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("zero_scaler_sync")))


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_no_reads_and_skip_agreed(ranks, name):
    torch.set_num_threads(1)
    ref_scales, ref = _reference(unscale=CASES[name][1])
    for r in range(2):
        _check(*ranks[r][name], ref_scales, ref)


def test_rank_without_gradients_follows_the_others(ranks):
    for out in ranks:
        assert out["no_grads_here"] == "<no error>", out["no_grads_here"]
