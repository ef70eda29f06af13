"""Ranks that run different units before a synced backward at stages 1/2 (an MoE expert no token
was routed to on one rank, a branch taken on one rank): each unit's gradient is reduced with a
collective paired with the other ranks' in call order, so a skipped unit paired one unit's
gradient with another's: gloo aborted the process ("collective mismatch", no tierlift error),
units of the same size mixed silently. Every rank now raises RankFailureError naming the unit
and the ranks, before any rank communicates (training can go on); the same skip on every rank
trains as torch does; and an eval on rank 0 only (no_grad, weights current: no collective) is
not taken for a rank that went on without a later collective call (full_state_dict). 2 gloo
ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zero_model import raised, spawn_ranks

import tierlift

STEPS, LR = 4, 1e-2


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.e0, self.e1, self.e2 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, skip: bool):
        h = self.e0(x)
        if not skip:  # e1: an expert no token was routed to is skipped
            h = h + self.e1(h)
        return self.e2(h).square().mean()


class Routed(nn.Module):
    """One expert per rank (bias-free, all the same size): the same number of reductions on
    every rank, so nothing aborted; e1's and e2's gradients were summed into each other (after
    one SGD step their updates 76% and 250% off DDP's, no error)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.e0, self.e1, self.e2, self.e3 = (nn.Linear(8, 8, bias=False) for _ in range(4))

    def forward(self, x, expert: str):
        h = self.e0(x)
        return self.e3(h + getattr(self, expert)(h)).square().mean()


def _data(world: int, rank: int):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, 8, generator=g).chunk(world)[rank] for _ in range(STEPS)]


def _train(model, opt, xs, skip, kept=None) -> None:
    for it, x in enumerate(xs):
        opt.zero_grad()
        model(x, skip(it)).backward()
        opt.step()
        if kept is not None:  # the shards after each step
            kept[:] = [p.detach().clone() for p in model.parameters()]


def _sharded(stage: int, group=None):
    model = tierlift.zero.shard(Experts(), stage=stage, units=["e0", "e1", "e2"],
                                process_group=group)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _stage(stage: int, rank: int, world: int) -> dict:
    out = {}
    xs = _data(world, rank)
    # Every rank skips e1 from step 2 on: fine, and as torch.
    model, opt = _sharded(stage)
    _train(model, opt, xs, lambda it: it >= 2)
    out["same_skip"] = {k: v.clone() for k, v in tierlift.zero.full_state_dict(model).items()}
    # Rank 0 evaluates alone (nanoGPT's estimate_loss), weights current: no collective.
    if rank == 0:
        with torch.no_grad():
            model(xs[0], False)
            model(xs[1], True)
    out["eval"] = raised(lambda: tierlift.zero.full_state_dict(model))
    # Rank 1 skips e1 from step 2 on: both raise before communicating, and can go on.
    moe, moe_opt = _sharded(stage)
    kept: list = []
    out["skip"] = raised(lambda: _train(moe, moe_opt, xs, lambda it: rank == 1 and it >= 2,
                                        kept))
    # Nothing stepped: the shards are those of step 1, and no gradient landed.
    out["kept"] = all(torch.equal(p, k) for p, k in zip(moe.parameters(), kept, strict=True))
    out["no_grads"] = all(p.grad is None for p in moe.parameters())
    _train(moe, moe_opt, xs, lambda it: False)  # the same units again: trains on
    out["goes_on"] = {k: v.clone() for k, v in tierlift.zero.full_state_dict(moe).items()}
    return out


def _routed(rank: int, world: int) -> str:
    model = tierlift.zero.shard(Routed(), stage=2, units=["e0", "e1", "e2", "e3"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        model(_data(world, rank)[0], "e1" if rank == 0 else "e2").backward()
        opt.step()

    return raised(step)


def _cases(rank, world, tmp):
    out = {stage: _stage(stage, rank, world) for stage in (1, 2)}
    out["routed"] = _routed(rank, world)
    return out

def _reference():
    model = Experts()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _train(model, opt, [torch.cat(xs) for xs in zip(*(_data(2, r) for r in range(2)))],
           lambda it: it >= 2)
    return model.state_dict()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("zero_moe")))


@pytest.mark.parametrize("stage", [1, 2])
def test_same_skip_on_every_rank_trains_as_torch(ranks, stage):
    ref = _reference()
    for out in ranks:
        for k, v in ref.items():
            torch.testing.assert_close(out[stage]["same_skip"][k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 2])
def test_eval_on_rank0_only_is_no_skipped_call(ranks, stage):
    for out in ranks:
        assert out[stage]["eval"] == "<no error>", out[stage]["eval"]


@pytest.mark.parametrize("stage", [1, 2])
def test_unit_skipped_on_one_rank_named_on_every_rank(ranks, stage):
    for rank, out in enumerate(ranks):
        msg = out[stage]["skip"]
        assert msg.startswith("RankFailureError"), msg
        assert "'e1' ran on rank 0 only" in msg and "before synced backward 3" in msg, msg
        assert out[stage]["kept"] and out[stage]["no_grads"], (rank, out[stage])
    for k, v in ranks[0][stage]["goes_on"].items():
        assert torch.equal(ranks[1][stage]["goes_on"][k], v), k


def test_each_rank_its_own_expert_refused(ranks):
    for out in ranks:
        msg = out["routed"]
        assert msg.startswith("RankFailureError"), msg
        assert "'e1' ran on rank 0 only" in msg and "'e2' ran on rank 1 only" in msg, msg
