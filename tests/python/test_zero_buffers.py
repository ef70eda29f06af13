"""Module buffers under tierlift.zero follow DDP's default (broadcast_buffers=True), on 2 gloo
ranks: a Linear -> BatchNorm1d -> Linear model trained at stages 1, 2 and 3 with a no_sync()
micro-batch and a training-mode forward under torch.no_grad() between steps (the two cases
where DDP skips the next broadcast) has, on each rank, DDP's weights and that rank's DDP
buffers; evaluation afterwards, full_state_dict and a checkpoint saved and loaded give rank 0's
buffers on every rank; broadcast_buffers=False keeps them per rank, as DDP's
forward_sync_buffers=False. copy.deepcopy of a sharded model (an EMA, AveragedModel) raises one
error naming what to do instead."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from zero_model import spawn_ranks

import tierlift

STEPS, BATCH = 3, 8
TOL = 1e-6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))


def _data():
    g = torch.Generator().manual_seed(1)
    # Per step: a micro-batch inside no_sync(), the synced one, and a no_grad forward; the
    # ranks' slices differ in scale, so their batch statistics differ.
    scale = torch.linspace(0.5, 3.0, BATCH).unsqueeze(1)
    return [[torch.randn(BATCH, 8, generator=g) * scale for _ in range(3)]
            for _ in range(STEPS)], torch.randn(BATCH, 8, generator=g)


def _train(model, opt, data, rank, world):
    mine = [[x.chunk(world)[rank] for x in step] for step in data]
    for i, (inner, synced, extra) in enumerate(mine):
        opt.zero_grad()
        with model.no_sync():
            model(inner).pow(2).mean().backward()
        model(synced).pow(2).mean().backward()
        opt.step()
        if i < len(mine) - 1:
            with torch.no_grad():  # training mode: updates the statistics; no broadcast next
                model(extra)


def _buffers(model) -> dict:
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return {k: v.clone() for k, v in inner.named_buffers()}


def _eval(model, x):
    model.eval()
    with torch.no_grad():
        out = model(x)
    model.train()
    return out


def _run(model, rank, world, zero: bool):
    data, x_eval = _data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, data, rank, world)
    res = {"trained": _buffers(model), "eval": _eval(model, x_eval),
           "after_eval": _buffers(model)}
    sd = tierlift.zero.full_state_dict(model) if zero else model.module.state_dict()
    res["state"] = {k: v.clone() for k, v in sd.items()}
    res["after_state"] = _buffers(model)
    return res, opt


def _cases(rank: int, world: int, tmp: str) -> dict:
    out = {}
    for name, kw in (("ddp", {}), ("ddp_nosync", {"forward_sync_buffers": False})):
        ddp = nn.parallel.DistributedDataParallel(_model(), **kw)
        out[name], _ = _run(ddp, rank, world, zero=False)
    for stage in (1, 2, 3):
        for flag in (True, False):
            model = tierlift.zero.shard(_model(), stage=stage, broadcast_buffers=flag)
            res, opt = _run(model, rank, world, zero=True)
            out[f"s{stage}/{flag}"] = res
            if flag:
                # A checkpoint, loaded into a fresh model on every rank.
                with torch.no_grad():  # per-rank statistics again, as after a training step
                    model[1].running_mean.add_(rank)
                res["before_save"] = _buffers(model)
                path = os.path.join(tmp, f"ck{stage}")
                tierlift.checkpoint.save(path, model, opt)
                fresh = tierlift.zero.shard(_model(), stage=stage)
                tierlift.checkpoint.load(path, fresh)
                res["loaded"] = _buffers(fresh)
    # The broadcast's cost in bytes is counted like every other collective of the model.
    for flag in (True, False):
        model = tierlift.zero.shard(_model(), stage=3, broadcast_buffers=flag)
        with torch.no_grad():  # training mode: rank 0's buffers, then this rank's update
            model(torch.randn(4, 8) * (rank + 1))
        before = model._tierlift_zero.world_comm.sent["intra_node"]
        model.eval()
        with torch.inference_mode():  # not broadcast: the last forward had no grad
            model(torch.randn(4, 8))
        model.train()
        model(torch.randn(4, 8))  # not broadcast either (the same rule)
        with torch.inference_mode():  # broadcast: the last forward had grad
            model(torch.randn(4, 8))
        out[f"inference/{flag}"] = _buffers(model)
        out[f"sent/{flag}"] = model._tierlift_zero.world_comm.sent["intra_node"] - before
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("zero_buffers")))


def _close(a: dict, b: dict, tol: float = TOL) -> bool:
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    return all(torch.allclose(a[k].double(), b[k].double(), rtol=tol, atol=tol) for k in a)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_buffers_follow_ddp(ranks, stage):
    for out in ranks:
        ddp, zero = out["ddp"], out[f"s{stage}/True"]
        # Each rank's buffers after training are DDP's on that rank (rank 0's broadcast, then
        # that rank's own last updates, which DDP does not broadcast either).
        assert _close(zero["trained"], ddp["trained"])
        # Weights, and the buffers evaluation synced, as DDP's within fp32 rounding.
        assert _close(zero["state"], ddp["state"], 1e-5)
        assert torch.allclose(zero["eval"], ddp["eval"], rtol=1e-5, atol=1e-6)
    # The ranks differed after training (per-rank statistics), and agree from evaluation on.
    r0, r1 = ranks[0][f"s{stage}/True"], ranks[1][f"s{stage}/True"]
    assert not _same(r0["trained"], r1["trained"])
    assert _same(r1["after_eval"], r0["trained"])
    assert torch.equal(r0["eval"], r1["eval"])
    assert _same(r0["state"], r1["state"])
    assert _same(r1["after_state"], r0["after_state"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpoint_holds_rank0_buffers_on_every_rank(ranks, stage):
    r0, r1 = ranks[0][f"s{stage}/True"], ranks[1][f"s{stage}/True"]
    assert not _same(r0["before_save"], r1["before_save"])
    assert _same(r0["loaded"], r0["before_save"])
    assert _same(r1["loaded"], r0["before_save"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_broadcast_buffers_false_keeps_them_per_rank(ranks, stage):
    for out in ranks:
        ddp, zero = out["ddp_nosync"], out[f"s{stage}/False"]
        assert _close(zero["trained"], ddp["trained"])
        assert _close(zero["after_state"], ddp["after_state"])
        assert torch.allclose(zero["eval"], ddp["eval"], rtol=1e-5, atol=1e-6)
    r0, r1 = ranks[0][f"s{stage}/False"], ranks[1][f"s{stage}/False"]
    assert not _same(r0["after_state"], r1["after_state"])
    assert not torch.allclose(r0["eval"], r1["eval"])


def test_one_broadcast_counted_also_under_inference_mode(ranks):
    nbytes = 2 * 16 * 4 + 8  # running_mean, running_var (fp32), num_batches_tracked (int64)
    assert ranks[0]["sent/True"] - ranks[0]["sent/False"] == nbytes
    assert ranks[1]["sent/True"] == ranks[1]["sent/False"]
    assert _same(ranks[0]["inference/True"], ranks[1]["inference/True"])
    assert not _same(ranks[0]["inference/False"], ranks[1]["inference/False"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepcopy_refused_with_the_fix(stage):
    model = tierlift.zero.shard(_model(), stage=stage)
    model(torch.randn(4, 8)).sum().backward()
    for target in (model, model[1]):
        with pytest.raises(RuntimeError, match="full_state_dict") as info:
            copy.deepcopy(target)
        assert "copy.deepcopy of a model sharded by tierlift.zero.shard" in str(info.value)
    with pytest.raises(RuntimeError, match="AveragedModel"):
        torch.optim.swa_utils.AveragedModel(model)
    copy.deepcopy(nn.Sequential(nn.Linear(2, 2)))  # other models are untouched


def test_broadcast_buffers_checked():
    with pytest.raises(TypeError, match="broadcast_buffers must be a bool"):
        tierlift.zero.shard(_model(), stage=2, broadcast_buffers=1)


def test_one_rank_sends_nothing(monkeypatch):
    """A model sharded over this process alone has no other rank to sync: no packing, no
    broadcast at its forwards (tierlift's single-GPU ZeRO-3 with parameters in RAM)."""
    from tierlift.zero import buffers

    def refuse(*args, **kwargs):
        raise AssertionError("broadcast with one rank")

    monkeypatch.setattr(buffers, "broadcast_", refuse)
    model = tierlift.zero.shard(_model(), stage=3)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
    tierlift.zero.full_state_dict(model)
