"""Ordinary torch lines on a sharded model (2 gloo ranks against one process over the whole
batch): torch.nn.utils.clip_grad_norm_ over model.parameters() clips by the global norm, with
and without an offloaded optimizer, also through a clip_grad_norm_ imported before tierlift;
get_total_norm and error_if_nonfinite agree on every rank; param groups split by name or shape
(nanoGPT, Hugging Face) are refused when the optimizer is built, while a split by unit name is
kept; hooks on a parameter are refused by shard() before anything changes, and hooks on a shard
run once its gradient has landed; a block frozen mid-training is refused at the next forward;
ranks that built different weights are refused by shard().

One spawn runs every case; each rank writes what it saw and the tests check it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_  # bound before tierlift wraps anything
from zero_model import batches, make_model, raised, spawn_ranks

import tierlift

BATCH, STEPS, CLIP = 8, 3, 0.05  # every step's norm is above CLIP: each step is clipped
OPT = dict(lr=3e-3, weight_decay=0.1)
MODES = {"s2": (2, None), "s3": (3, None), "s3-cpu-offload": (3, "cpu")}


def _train(model, opt, data, world: int, rank: int) -> list[float]:
    norms = []
    for seq in data:
        opt.zero_grad(set_to_none=True)
        local = seq.chunk(world)[rank]
        loss = F.cross_entropy(model(local[:, :-1]).flatten(0, 1), local[:, 1:].flatten())
        loss.backward()
        norms.append(float(clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return norms


def _optimizer(params, offload):
    if offload is None:
        return torch.optim.AdamW(params, **OPT)
    return tierlift.optim.AdamW(params, offload=offload, **OPT)


def _clip_cases(rank: int, world: int) -> dict:
    out = {}
    data = batches(STEPS, BATCH)
    for name, (stage, offload) in MODES.items():
        model = tierlift.zero.shard(make_model(), stage=stage)
        opt = _optimizer([p for p in model.parameters() if p.requires_grad], offload)
        norms = _train(model, opt, data, world, rank)
        out[f"clip/{name}"] = (norms, tierlift.zero.full_state_dict(model))
    # get_total_norm over the shard gradients, and a non-finite norm raising on every rank
    model = tierlift.zero.shard(make_model(), stage=3)
    local = data[0].chunk(world)[rank]
    F.cross_entropy(model(local[:, :-1]).flatten(0, 1), local[:, 1:].flatten()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    out["total_norm"] = float(torch.nn.utils.get_total_norm(grads))
    out["inf_norm"] = float(torch.nn.utils.get_total_norm(grads, float("inf")))
    if rank == 0:
        grads[0][0] = float("nan")  # on one rank only
    out["nonfinite"] = raised(lambda: clip_grad_norm_(model.parameters(), 1.0,
                                                       error_if_nonfinite=True))
    return out


def _group_cases() -> dict:
    out = {}
    model = tierlift.zero.shard(make_model(), stage=3)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    nanogpt = [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
               {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]
    hf = [{"params": [p for n, p in named if "bias" not in n and "ln" not in n],
           "weight_decay": 0.1},
          {"params": [p for n, p in named if "bias" in n or "ln" in n], "weight_decay": 0.0}]
    makers = {"torch": torch.optim.AdamW, "tierlift": tierlift.optim.AdamW,
              "tierlift-cpu-offload": lambda g, **kw: tierlift.optim.AdamW(g, offload="cpu", **kw)}
    for kind, make in makers.items():
        out[f"groups/nanogpt/{kind}"] = raised(lambda make=make: make(nanogpt, lr=1e-3))
        out[f"groups/hf/{kind}"] = raised(lambda make=make: make(hf, lr=1e-3))
    # Kept: a split by unit (layer-wise learning rates) and an empty group with equal settings.
    by_unit = [{"params": [p for n, p in named if n.startswith("blocks.0.")], "lr": 1e-4},
               {"params": [p for n, p in named if not n.startswith("blocks.0.")]}]
    out["groups/by_unit"] = raised(lambda: torch.optim.AdamW(by_unit, lr=1e-3))
    same = [{"params": [], "weight_decay": 0.1}, {"params": [p for _, p in named]}]
    out["groups/same"] = raised(lambda: torch.optim.AdamW(same, lr=1e-3, weight_decay=0.1))
    # param_group_fn: the same nanoGPT split, made on the model's own shapes, is accepted.
    grouped = tierlift.zero.shard(make_model(), stage=3,
                                  param_group_fn=lambda n, p: "d" if p.dim() >= 2 else "n")
    out["groups/param_group_fn"] = raised(lambda: torch.optim.AdamW(tierlift.zero.param_groups(
        grouped, {"d": {"weight_decay": 0.1}, "n": {"weight_decay": 0.0}}), lr=1e-3))
    return out


def _hook_cases(rank: int, world: int) -> dict:
    out = {}
    for kind in ("register_hook", "register_post_accumulate_grad_hook"):
        model = make_model()
        before = {n: p for n, p in model.named_parameters()}
        getattr(model.blocks[1].fc.weight, kind)(lambda x: None)
        out[f"hooks/{kind}"] = raised(lambda model=model: tierlift.zero.shard(model, stage=2))
        out[f"hooks/{kind}/unchanged"] = (
            not hasattr(model, "_tierlift_zero")
            and all(p is before[n] for n, p in model.named_parameters())
            and len(before) == len(list(model.named_parameters())))
    # Hooks on a shard: run once this rank's slice of the gradient has landed.
    model = tierlift.zero.shard(make_model(), stage=2)
    shard = model.blocks[0]._zero_flat_shard
    seen = []
    shard.register_hook(lambda g: g * 0)
    shard.register_post_accumulate_grad_hook(lambda p: seen.append(float(p.grad.abs().sum())))
    local = batches(1, BATCH)[0].chunk(world)[rank]
    F.cross_entropy(model(local[:, :-1]).flatten(0, 1), local[:, 1:].flatten()).backward()
    out["hooks/on_shard"] = seen
    return out


def _freeze_cases(rank: int, world: int) -> dict:
    """A block frozen mid-training (the shard holding it, as model.blocks[0].parameters()
    yields it): refused at the next forward, before anything changes."""
    out = {}
    for stage in (2, 3):
        model = tierlift.zero.shard(make_model(), stage=stage)
        opt = tierlift.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                   offload="cpu", **OPT)
        _train(model, opt, batches(1, BATCH), world, rank)
        for p in model.blocks[0].parameters():
            p.requires_grad_(False)
        before = tierlift.zero.full_state_dict(model)
        out[f"freeze/s{stage}"] = raised(lambda m=model, o=opt: _train(
            m, o, batches(1, BATCH, seed=2), world, rank))
        for p in model.blocks[0].parameters():
            p.requires_grad_(True)
        after = tierlift.zero.full_state_dict(model)
        out[f"freeze/s{stage}/unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    return out


def _same_init_cases(rank: int) -> dict:
    model = make_model(seed=rank)  # a script that seeds each rank before building the model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    msg = raised(lambda: tierlift.zero.shard(model, stage=3))
    unchanged = not hasattr(model, "_tierlift_zero") and all(
        torch.equal(p, before[n]) for n, p in model.named_parameters())
    return {"same_init": msg, "same_init/unchanged": unchanged}


def _cases(rank: int, world: int, tmp: str) -> dict:
    return {**_clip_cases(rank, world), **_group_cases(), **_hook_cases(rank, world),
            **_same_init_cases(rank), **_freeze_cases(rank, world)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("zero_torch_calls")))


@pytest.fixture(scope="module")
def reference():
    model = make_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPT)
    norms = _train(model, opt, batches(STEPS, BATCH), 1, 0)
    return norms, model.state_dict()


@pytest.mark.parametrize("mode", MODES)
def test_torch_clip_grad_norm_is_the_global_norm(ranks, reference, mode):
    ref_norms, ref_sd = reference
    for out in ranks:
        norms, sd = out[f"clip/{mode}"]
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert all(n > CLIP for n in norms)  # every step was clipped
        for key, want in ref_sd.items():
            if key in sd:
                torch.testing.assert_close(sd[key], want, rtol=1e-5, atol=1e-6, msg=key)


def test_get_total_norm_and_nonfinite_agree_on_every_rank(ranks):
    assert ranks[0]["total_norm"] == pytest.approx(ranks[1]["total_norm"], rel=1e-6)
    assert ranks[0]["inf_norm"] == ranks[1]["inf_norm"]
    for out in ranks:
        assert out["nonfinite"].startswith("RuntimeError: The total norm of order 2.0")


@pytest.mark.parametrize("split", ["nanogpt", "hf"])
@pytest.mark.parametrize("kind", ["torch", "tierlift", "tierlift-cpu-offload"])
def test_group_split_by_name_or_shape_is_refused(ranks, split, kind):
    msg = ranks[0][f"groups/{split}/{kind}"]
    assert msg.startswith("ValueError: optimizer param group")
    assert "param_group_fn" in msg


@pytest.mark.parametrize("case", ["by_unit", "same", "param_group_fn"])
def test_group_splits_that_see_the_shards_are_kept(ranks, case):
    assert ranks[0][f"groups/{case}"] == "<no error>"


@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
def test_parameter_hook_refused_before_anything_changes(ranks, kind):
    for out in ranks:
        msg = out[f"hooks/{kind}"]
        assert msg.startswith("ValueError: parameter 'blocks.1.fc.weight' has a hook")
        assert kind in msg
        assert out[f"hooks/{kind}/unchanged"]


def test_hooks_on_a_shard_run_when_its_gradient_lands(ranks):
    for out in ranks:
        assert out["hooks/on_shard"] == [0.0]  # called once, after the zeroing pre-hook


def test_ranks_that_built_different_weights_are_refused(ranks):
    for out in ranks:
        msg = out["same_init"]
        assert msg.startswith("ValueError: parameter 'pos' differs between rank 0 and "
                              "rank 1"), msg
        assert out["same_init/unchanged"]


@pytest.mark.parametrize("stage", [2, 3])
def test_freeze_mid_training_refused_before_anything_changes(ranks, stage):
    for out in ranks:
        assert out[f"freeze/s{stage}"].startswith("RuntimeError: the shard of"), \
            out[f"freeze/s{stage}"]
        assert "is fixed at shard()" in out[f"freeze/s{stage}"]
        assert out[f"freeze/s{stage}/unchanged"]
