"""A ZeRO checkpoint resumed on another world size, in another configuration: the losses and
weights after the load match an uninterrupted run. One spawn of 2 gloo ranks trains the
reference (and resumes a checkpoint saved on 1 rank); the 2 -> 1 resumes run here. The tiny
GPT has a tied head, a frozen parameter, a buffer and a unit the forward never uses; its
param groups (decay, no_decay) carry different lr and weight decay."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from zero_model import batches, make_model, raised, spawn_ranks, train

import tierlift

DATA = batches(5, 8, seed=3)
OPTS = {"decay": {"weight_decay": 0.1, "lr": 3e-3}, "no_decay": {"weight_decay": 0.0, "lr": 1e-2}}
TOL = dict(rtol=1e-5, atol=1e-6)  # 2 ranks sum their halves' gradients: another float order


def _fresh(stage: int, keys, offload: str = "none", nvme: str | None = None):
    model = tierlift.zero.shard(make_model(seed=5), stage=stage,
                                param_group_fn=lambda n, p: "decay" if p.dim() > 1
                                else "no_decay")
    groups = tierlift.zero.param_groups(model, {k: OPTS[k] for k in keys})
    extra = {} if offload == "none" else {"offload": offload}
    if nvme is not None:
        extra["nvme_path"] = nvme
    return model, tierlift.optim.AdamW(groups, **extra)


def _cases(rank: int, world: int, tmp: str) -> dict:
    out = {}
    model, opt = _fresh(3, ["decay", "no_decay"], "cpu")
    train(model, opt, DATA[:2], accum=1, clip=None, world=world, rank=rank, zero=True)
    tierlift.checkpoint.save(os.path.join(tmp, "ck2"), model, opt)
    out["losses"] = train(model, opt, DATA[2:], accum=1, clip=None, world=world, rank=rank,
                          zero=True)
    out["full"] = tierlift.zero.full_state_dict(model)
    opt.close()
    # 1 -> 2: saved by the parent on one rank (stage 2, no offload); resumed at stage 3
    model, opt = _fresh(3, ["no_decay", "decay"], "cpu")
    tierlift.checkpoint.load(os.path.join(tmp, "ck1"), model, opt)
    out["losses_from_1"] = train(model, opt, DATA[2:], accum=1, clip=None, world=world,
                                 rank=rank, zero=True)
    out["full_from_1"] = tierlift.zero.full_state_dict(model)
    opt.close()
    # compact state saved on 1 rank: its scales cannot be split at 2 ranks' shard bounds
    model = tierlift.zero.shard(make_model(seed=5), stage=3)
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-2, state_dtype="bf16")
    train(model, opt, DATA[:1], accum=1, clip=None, world=world, rank=rank, zero=True)
    before = _state(model, opt)
    out["compact"] = raised(lambda: tierlift.checkpoint.load(os.path.join(tmp, "ck1c"), model,
                                                             opt), ValueError)
    out["compact_unchanged"] = _same(before, _state(model, opt))
    return out


def _state(model, opt) -> tuple:
    return ({k: v.clone() for k, v in tierlift.zero.full_state_dict(model).items()},
            {i: {k: torch.as_tensor(v).clone() for k, v in s.items()}
             for i, s in opt.state_dict()["state"].items()})


def _same(a: tuple, b: tuple) -> bool:
    return a[0].keys() == b[0].keys() and a[1].keys() == b[1].keys() and all(
        torch.equal(a[0][k], b[0][k]) for k in a[0]) and all(
        a[1][i].keys() == b[1][i].keys() and all(torch.equal(a[1][i][k], b[1][i][k])
                                                 for k in a[1][i]) for i in a[1])


@pytest.fixture(scope="module")
def on_two(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("resume_configs"))
    torch.set_num_threads(1)
    model, opt = _fresh(2, ["decay", "no_decay"])
    train(model, opt, DATA[:2], accum=1, clip=None, zero=True)
    tierlift.checkpoint.save(os.path.join(tmp, "ck1"), model, opt)
    ref1 = train(model, opt, DATA[2:], accum=1, clip=None, zero=True)
    compact = tierlift.zero.shard(make_model(seed=5), stage=3)
    opt = tierlift.optim.AdamW(compact.parameters(), lr=1e-2, state_dtype="bf16")
    train(compact, opt, DATA[:1], accum=1, clip=None, zero=True)
    tierlift.checkpoint.save(os.path.join(tmp, "ck1c"), compact, opt)
    ranks = spawn_ranks(_cases, tmp)
    return tmp, ranks[0], (ref1, tierlift.zero.full_state_dict(model))


def _assert_close(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], **TOL, msg=k)


def test_one_rank_to_two_resumes_as_the_uninterrupted_run(on_two):
    """Saved on 1 rank at stage 2 without offload; resumed on 2 at stage 3 with offload="cpu"
    and the groups listed the other way round."""
    _, r0, (losses, full) = on_two
    torch.testing.assert_close(r0["losses_from_1"], losses, **TOL)
    _assert_close(r0["full_from_1"], full)


def test_compact_state_on_another_world_size_is_refused(on_two):
    """state_dtype='bf16' keeps one exp_avg_sq scale per 256 elements of each rank's shard:
    on another world size the blocks would straddle the new bounds."""
    _, r0, _ = on_two
    assert "compact optimizer state (state_dtype='bf16'" in r0["compact"], r0["compact"]
    assert "saved on 1 ranks, which cannot be resharded exactly for 2" in r0["compact"]
    assert r0["compact_unchanged"]


@pytest.mark.parametrize(("stage", "keys", "offload", "named"), [
    (1, ["no_decay", "decay"], "none", True),  # another stage and tier, groups reordered
    (3, ["no_decay", "decay"], "nvme", False),  # saved without names (an older tierlift)
    (2, ["decay", "no_decay"], "none", False),
])
def test_two_ranks_to_one_resumes_as_the_uninterrupted_run(on_two, tmp_path, stage, keys,
                                                           offload, named):
    tmp, r0, _ = on_two
    torch.set_num_threads(1)
    ck = os.path.join(tmp, "ck2")
    if not named:
        ck = str(tmp_path / "unnamed")
        shutil.copytree(os.path.join(tmp, "ck2"), ck)
        file = os.path.join(ck, "metadata.json")
        with open(file) as f:
            meta = json.load(f)
        del meta["param_names"]
        with open(file, "w") as f:
            json.dump(meta, f)
        os.unlink(os.path.join(ck, "manifest.json"))
    model, opt = _fresh(stage, keys, offload, str(tmp_path) if offload == "nvme" else None)
    if named:
        tierlift.checkpoint.load(ck, model, opt)
    else:
        with pytest.warns(UserWarning, match="no manifest.json"):
            tierlift.checkpoint.load(ck, model, opt, verify=False)
    assert {(g["lr"], g["weight_decay"]) for g in opt.param_groups} == \
        {(OPTS[k]["lr"], OPTS[k]["weight_decay"]) for k in keys}
    assert [g["lr"] for g in opt.param_groups] == [OPTS[k]["lr"] for k in keys]
    losses = train(model, opt, DATA[2:], accum=1, clip=None, zero=True)
    torch.testing.assert_close(losses, r0["losses"], **TOL)
    _assert_close(tierlift.zero.full_state_dict(model), r0["full"])
    if hasattr(opt, "close"):
        opt.close()
