"""Everyday training-loop lines on a sharded model (2 gloo ranks, each against one process over
the whole batch, computed in the rank itself):

- zero_grad() after backwards inside no_sync() (an accumulation window cut short at the end of
  an epoch, a skipped micro-batch) discards what they summed, as DDP does: the local sums live
  in each unit's full gradient, which torch's zero_grad does not see;
- a unit that only the micro-batches inside no_sync() used (a branch the last one skips) has
  its local sum reduced by the synced backward, as DDP reduces what no_sync() left in .grad;
- a weight edited in place through its module attribute (`model.fc.weight.mul_(0.5)`) is exact
  at stages 1/2 in fp32 (the attribute holds the masters), and refused at stages 1/2 with
  MixedPrecision(param_dtype=bf16), where it is a compute copy the next gather would undo: at
  the next forward, optimizer step or full_state_dict, before anything changes."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zero_model import batches, make_model, raised, spawn_ranks

import tierlift

BATCH, STEPS = 8, 3
OPT = dict(lr=1e-2, weight_decay=0.1)
BF16 = tierlift.zero.MixedPrecision(param_dtype=torch.bfloat16)


def _loss(model, x):
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


def _max_rel(sd: dict, ref: dict) -> float:
    return max(float((sd[k] - ref[k]).abs().max() / ref[k].abs().max().clamp(min=1e-6))
               for k in ref if ref[k].is_floating_point())


def _train(model, opt, data, world, rank, zero: bool, edit=None, leftover=None,
           clear="optimizer"):
    """`leftover`: a micro-batch backward (inside no_sync() when sharded) that the first
    zero_grad (the optimizer's, or the model's with clear="model") discards; `edit(model)`:
    run under no_grad before each step's forward."""
    if leftover is not None:
        local = leftover.chunk(world)[rank] if zero else leftover
        if zero:
            with model.no_sync():
                _loss(model, local).backward()
        else:
            _loss(model, local).backward()
    for x in data:
        if clear == "model":
            model.zero_grad(set_to_none=False)
        else:
            opt.zero_grad()
        if edit is not None:
            with torch.no_grad():
                edit(model)
        _loss(model, x.chunk(world)[rank] if zero else x).backward()
        opt.step()  # unused parameters (Block.unused) keep .grad None: not stepped, as torch


def _halve(model):
    for block in model.blocks:
        block.fc.weight.mul_(0.5)


def _reference(data, **kw) -> dict:
    model = make_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPT)
    _train(model, opt, data, 1, 0, False, **kw)
    return model.state_dict()


def _zero_grad_cases(rank: int, world: int) -> dict:
    out = {}
    data = batches(STEPS + 1, BATCH)
    ref = _reference(data[1:], leftover=data[0])
    for stage in (1, 2, 3):
        for how in ("optimizer", "model"):
            model = tierlift.zero.shard(make_model(), stage=stage)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPT)
            _train(model, opt, data[1:], world, rank, True, leftover=data[0], clear=how)
            out[f"zero_grad/s{stage}/{how}"] = _max_rel(tierlift.zero.full_state_dict(model),
                                                        ref)
    return out


def _edit_cases(rank: int, world: int) -> dict:
    out = {}
    data = batches(STEPS, BATCH)
    ref = _reference(data, edit=_halve)
    for stage in (1, 2):
        model = tierlift.zero.shard(make_model(), stage=stage)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPT)
        _train(model, opt, data, world, rank, True, edit=_halve)
        out[f"edit/fp32/s{stage}"] = _max_rel(tierlift.zero.full_state_dict(model), ref)
        for then in ("forward", "step", "full_state_dict"):
            model = tierlift.zero.shard(make_model(), stage=stage, mixed_precision=BF16)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPT)
            _train(model, opt, data[:1], world, rank, True)
            before = {k: v.clone() for k, v in model.state_dict().items()}
            opt.zero_grad()
            if then == "step":  # gradients of the weights as they were, then the edit
                _loss(model, data[1].chunk(world)[rank]).backward()
            with torch.no_grad():
                _halve(model)
            calls = {"forward": lambda m=model: _loss(m, data[1].chunk(world)[rank]),
                     "step": opt.step,
                     "full_state_dict": lambda m=model: tierlift.zero.full_state_dict(m)}
            out[f"edit/bf16/s{stage}/{then}"] = raised(calls[then])
            # Nothing changed: the shards (masters) and buffers are those of before the edit.
            after = model.state_dict()
            out[f"edit/bf16/s{stage}/{then}/unchanged"] = (
                after.keys() == before.keys()
                and all(torch.equal(before[k], after[k]) for k in before))
    return out


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x, use_b: bool):
        h = torch.tanh(self.a(x))
        if use_b:
            h = h + torch.tanh(self.b(h))
        return self.c(h)


def _branch_train(model, opt, xs, world, rank, zero: bool):
    for step in range(STEPS):
        opt.zero_grad()
        for k, use_b in enumerate((True, False)):  # the last (synced) micro-batch skips b
            x = xs[2 * step + k]
            x = x.chunk(world)[rank] if zero else x
            with model.no_sync() if zero and k == 0 else contextlib.nullcontext():
                (model(x, use_b).pow(2).mean() / 2).backward()
        opt.step()


def _branch_cases(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 8, generator=g) for _ in range(2 * STEPS)]
    torch.manual_seed(0)
    ref = Branchy()
    _branch_train(ref, torch.optim.AdamW(ref.parameters(), **OPT), xs, 1, 0, False)
    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = tierlift.zero.shard(Branchy(), stage=stage, units=["a", "b", "c"])
        _branch_train(model, torch.optim.AdamW(model.parameters(), **OPT), xs, world, rank, True)
        out[f"branch/s{stage}"] = _max_rel(tierlift.zero.full_state_dict(model),
                                           ref.state_dict())
    return out


def _cases(rank: int, world: int, tmp: str) -> dict:
    return {**_zero_grad_cases(rank, world), **_edit_cases(rank, world),
            **_branch_cases(rank, world)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("zero_idioms")))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("how", ["optimizer", "model"])
def test_zero_grad_discards_no_sync_sums(ranks, stage, how):
    for out in ranks:
        assert out[f"zero_grad/s{stage}/{how}"] < 1e-5


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unit_used_only_inside_no_sync_is_reduced(ranks, stage):
    for out in ranks:
        assert out[f"branch/s{stage}"] < 1e-5


@pytest.mark.parametrize("stage", [1, 2])
def test_fp32_attribute_edit_is_exact(ranks, stage):
    for out in ranks:
        assert out[f"edit/fp32/s{stage}"] < 1e-5


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("then", ["forward", "step", "full_state_dict"])
def test_bf16_attribute_edit_refused_before_anything_changes(ranks, stage, then):
    for out in ranks:
        msg = out[f"edit/bf16/s{stage}/{then}"]
        assert msg.startswith("RuntimeError:") and "module attribute" in msg, msg
        assert "blocks.0.fc.weight" in msg or "'blocks.0'" in msg, msg
        assert "gathered(" in msg, msg
        assert out[f"edit/bf16/s{stage}/{then}/unchanged"]


def test_unit_used_only_inside_no_sync_is_reduced_in_one_process(monkeypatch):
    """One rank: the leftover sums are reduced from what this rank holds, with no read back of
    a device value (a host sync per accumulated step on a GPU)."""
    from tierlift.zero import hooks

    reads, real = [], torch.Tensor.tolist

    def counted(t):
        if sys._getframe(1).f_code.co_filename == hooks.__file__:
            reads.append(t.shape)
        return real(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    out = _branch_cases(0, 1)
    assert all(v < 1e-5 for v in out.values()), out
    assert reads == []
