"""Module weights right after optimizer.step() at stages 1/2 (2 gloo ranks), against one process
with torch.optim.AdamW over the whole batch.

Stages 1/2 keep the full weights modules read (`m.weight`). They used to be refreshed only at
the next forward, so between step() and that forward they held the weights from before the
step: an edit that reads other elements (a max-norm row renorm through `m.weight`) or a read for
logging or evaluation saw stale values. The step now gathers the units it stepped, so:

- a row renorm through the module attributes after each step, and the weights read through them
  after each step, match torch's;
- with MixedPrecision the attributes are the compute-dtype copy of the stepped masters;
- with one optimizer per part of the model, each step refreshes the units it stepped;
- an eval forward on rank 0 alone between steps sends nothing (no collective to pair with)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zero_model import batches, make_model, spawn_ranks

import tierlift

BATCH, STEPS = 8, 3


def _loss(model, x):
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _renorm(model):  # rows of every Linear weight to norm <= 0.5 (reads whole rows)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight.div_(m.weight.norm(dim=1, keepdim=True).clamp(min=0.5) * 2)


def _weights(model) -> dict:
    """Every weight as its module attribute holds it (what logging or an edit reads)."""
    return {f"{n}.{a}": getattr(m, a).detach().float().clone()
            for n, m in model.named_modules() for a in ("weight", "bias")
            if isinstance(getattr(m, a, None), torch.Tensor)}


def _rel(got: dict, ref: dict) -> float:
    return max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp(min=1e-6))
               for k in ref)


def _train(model, opts, data, world, rank, after=None) -> list:
    """Steps every optimizer in turn; `after(model)` under no_grad after each step. Returns the
    weights the module attributes hold after each step()."""
    seen = []
    for x in data:
        for o in opts:
            o.zero_grad()
        _loss(model, x.chunk(world)[rank]).backward()
        for o in opts:
            o.step()
            seen.append(_weights(model))
        if after is not None:
            with torch.no_grad():
                after(model)
    return seen


def _halves(model) -> list:
    ps = list(model.parameters())
    return [ps[: len(ps) // 2], ps[len(ps) // 2:]]


def _cases(rank, world, tmp) -> dict:
    out: dict = {}
    data = batches(STEPS, BATCH)
    ref = make_model()
    ref_losses = []
    ref_seen = _train(ref, [_adamw(p for p in ref.parameters() if p.requires_grad)], data, 1, 0,
                      after=lambda m: ref_losses.append(_loss(m, data[0]).item()))
    renorm_ref = make_model()
    _train(renorm_ref, [_adamw(p for p in renorm_ref.parameters() if p.requires_grad)], data,
           1, 0, after=_renorm)
    renorm_ref = _weights(renorm_ref)
    for stage in (1, 2):
        model = tierlift.zero.shard(make_model(), stage=stage)
        seen = _train(model, [_adamw(model.parameters())], data, world, rank)
        out[f"read{stage}_rel"] = max(_rel(s, r) for s, r in zip(seen, ref_seen, strict=True))

        model = tierlift.zero.shard(make_model(), stage=stage)
        _train(model, [_adamw(model.parameters())], data, world, rank, after=_renorm)
        full = tierlift.zero.full_state_dict(model)
        out[f"renorm{stage}_rel"] = _rel({k: full[k] for k in renorm_ref}, renorm_ref)

    # One optimizer per half of the units: each step() refreshes the units it stepped.
    model = tierlift.zero.shard(make_model(), stage=2)
    seen = _train(model, [_adamw(h) for h in _halves(model)], data, world, rank)
    out["halves_rel"] = _rel(seen[-1], ref_seen[-1])

    # bf16 compute: the attributes are the bf16 copy of the stepped fp32 masters.
    model = tierlift.zero.shard(make_model(), stage=2, mixed_precision=tierlift.zero.MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    seen = _train(model, [_adamw(model.parameters())], data[:1], world, rank)
    full = tierlift.zero.full_state_dict(model)
    out["bf16_copy"] = all(torch.equal(seen[-1][k], full[k].to(torch.bfloat16).float())
                           for k in seen[-1])

    # An eval forward on rank 0 alone between steps: nothing to gather, nothing sent.
    model = tierlift.zero.shard(make_model(), stage=2, broadcast_buffers=False)
    state = model._tierlift_zero
    sent, losses = [], []

    def rank0_eval(m):
        if rank == 0:
            before = dict(state.topology.sent())
            losses.append(_loss(m, data[0]).item())
            sent.append(state.topology.sent() != before)

    seen = _train(model, [_adamw(model.parameters())], data, world, rank, after=rank0_eval)
    out["eval_sent"] = any(sent)
    out["eval_loss_rel"] = max(abs(a - b) / b for a, b in zip(losses or ref_losses, ref_losses,
                                                              strict=True))
    out["eval_rel"] = _rel(seen[-1], ref_seen[-1])
    return out


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("after_step")))


@pytest.mark.parametrize("stage", [1, 2])
def test_weights_read_after_step_are_current(outs, stage):
    for out in outs:
        assert out[f"read{stage}_rel"] < 1e-5


@pytest.mark.parametrize("stage", [1, 2])
def test_renorm_through_module_attributes_after_step(outs, stage):
    for out in outs:
        assert out[f"renorm{stage}_rel"] < 1e-5


def test_one_optimizer_per_part_refreshes_its_units(outs):
    for out in outs:
        assert out["halves_rel"] < 1e-5


def test_mixed_precision_copy_is_current_after_step(outs):
    for out in outs:
        assert out["bf16_copy"]


def test_rank0_only_eval_between_steps_sends_nothing(outs):
    assert not outs[0]["eval_sent"]
    assert outs[0]["eval_loss_rel"] < 1e-5
    for out in outs:
        assert out["eval_rel"] < 1e-5
