"""Lines of popular training scripts (nanoGPT's train.py, timm's EMA) on a sharded model, 2 gloo
ranks, each against one process with torch.optim.AdamW over the whole batch, computed in the
rank itself:

- nanoGPT's checkpoint: `if master_process: torch.save({"optimizer": optimizer.state_dict()})`,
  loaded on every rank at resume, would give rank 1 rank 0's moments (same shapes: torch loads
  them silently; 29% relative off two steps later). Refused on the rank it is not, before
  anything is loaded; each rank's own file resumes exactly.
- an EMA of the shards (timm ModelEmaV3's `torch._foreach_lerp_` over model.parameters()),
  swapped in for evaluation; an eval forward under torch.no_grad() between steps at stage 3;
  model.apply(init_fn) after shard() at stages 1/2: the same numbers.
- an optimizer built before shard() (where nanoGPT builds it, before its DDP wrap) holds the
  replaced parameters and stepped nothing: refused at step() and when built.
- a weight constraint (row renorm) applied after each step inside gathered(modifier_rank=0):
  hung at stages 1/2 (the block's exit re-gathered on some ranks only); now as torch.
- freezing a layer after shard() (`model.ln_f.requires_grad_(False)`, or its weight's flag at
  stage 3) changed nothing and the layer went on training: refused at the call."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from zero_model import batches, make_model, raised, spawn_ranks

import tierlift

BATCH, STEPS, DECAY = 8, 4, 0.8


def _loss(model, x):
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


def _max_rel(sd: dict, ref: dict) -> float:
    return max(float((sd[k] - ref[k]).abs().max() / ref[k].abs().max().clamp(min=1e-6))
               for k in ref if ref[k].is_floating_point())


def _train(model, opt, data, world, rank, after=None):
    for x in data:
        opt.zero_grad()
        _loss(model, x.chunk(world)[rank]).backward()
        opt.step()
        if after is not None:
            with torch.no_grad():
                after(model)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _reference(data, model=None, after=None):
    model = make_model() if model is None else model
    _train(model, _adamw([p for p in model.parameters() if p.requires_grad]), data, 1, 0, after)
    return model


def _init(module):  # nanoGPT's _init_weights
    if isinstance(module, nn.Linear):
        torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            torch.nn.init.zeros_(module.bias)


def _renorm(model):  # rows of every Linear weight to norm <= 0.5 (reads whole rows)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight.div_(m.weight.norm(dim=1, keepdim=True).clamp(min=0.5) * 2)


def _state_of(opt) -> dict:
    return {(i, k): torch.as_tensor(v).clone() for i, st in opt.state_dict()["state"].items()
            for k, v in st.items()}


def _resume_cases(rank, world, tmp, out, data):
    ref = _reference(data).state_dict() if rank == 0 else None
    for stage, make_opt in ((2, _adamw), (3, lambda ps: tierlift.optim.AdamW(
            ps, lr=1e-2, weight_decay=0.1))):
        model = tierlift.zero.shard(make_model(), stage=stage)
        opt = make_opt(model.parameters())
        _train(model, opt, data[:2], world, rank)
        full = tierlift.zero.full_state_dict(model)
        torch.save(opt.state_dict(), os.path.join(tmp, f"optim{stage}_rank{rank}.pt"))
        dist.barrier()
        for source in ("rank0", "own"):
            base = make_model()
            base.load_state_dict(full)
            resumed = tierlift.zero.shard(base, stage=stage)
            opt2 = make_opt(resumed.parameters())
            _train(resumed, opt2, data[:1], world, rank)  # state to keep when refused
            before = _state_of(opt2)
            tierlift.zero.load_full_state_dict(resumed, full)
            path = os.path.join(tmp, f"optim{stage}_rank{0 if source == 'rank0' else rank}.pt")
            sd = torch.load(path, weights_only=True)
            out[f"{source}{stage}_error"] = raised(lambda: opt2.load_state_dict(sd))  # noqa: B023
            after = _state_of(opt2)
            out[f"{source}{stage}_kept"] = before.keys() == after.keys() and all(
                torch.equal(after[k], v) for k, v in before.items())
            if source == "own":
                _train(resumed, opt2, data[2:], world, rank)
                got = tierlift.zero.full_state_dict(resumed)
                out[f"own{stage}_rel"] = _max_rel(got, ref) if rank == 0 else 0.0


def _cases(rank, world, tmp) -> dict:
    out: dict = {}
    data = batches(STEPS, BATCH)
    _resume_cases(rank, world, tmp, out, data)

    # timm ModelEmaV3 over the shards, swapped in for evaluation; against an EMA model.
    ref = make_model()
    ema_ref = make_model()
    ema_ref.requires_grad_(False)

    def ref_ema(model):
        torch._foreach_lerp_(list(ema_ref.parameters()), list(model.parameters()), 1 - DECAY)

    _reference(data, ref, ref_ema)
    for stage in (1, 2, 3):
        model = tierlift.zero.shard(make_model(), stage=stage)
        ema = [p.detach().clone() for p in model.parameters()]

        def shard_ema(m, ema=ema):
            torch._foreach_lerp_(ema, [p.detach() for p in m.parameters()], 1 - DECAY)

        _train(model, _adamw(model.parameters()), data, world, rank, shard_ema)
        with torch.no_grad():
            eval_ref = _loss(ema_ref, data[0]).item()
            saved = [p.data.clone() for p in model.parameters()]
            for p, e in zip(model.parameters(), ema, strict=True):
                p.data.copy_(e)
            out[f"ema{stage}_loss"] = abs(_loss(model, data[0]).item() - eval_ref) / eval_ref
            out[f"ema{stage}_rel"] = _max_rel(tierlift.zero.full_state_dict(model),
                                              ema_ref.state_dict())
            for p, s in zip(model.parameters(), saved, strict=True):
                p.data.copy_(s)
        out[f"ema{stage}_model_rel"] = _max_rel(tierlift.zero.full_state_dict(model),
                                                ref.state_dict())

    ref_sd = ref.state_dict()
    # nanoGPT builds the optimizer (configure_optimizers) before wrapping the model in DDP;
    # shard() in DDP's place left it holding the replaced parameters: it stepped nothing.
    for stage in (2, 3):
        base = make_model()
        params = [p for p in base.parameters() if p.requires_grad]
        opt = _adamw(params)
        model = tierlift.zero.shard(base, stage=stage)
        before = tierlift.zero.full_state_dict(model)
        _loss(model, data[0].chunk(world)[rank]).backward()
        out[f"early{stage}_step"] = raised(opt.step)
        out[f"early{stage}_kept"] = _max_rel(tierlift.zero.full_state_dict(model), before)
        out[f"early{stage}_init"] = raised(lambda ps=params: _adamw(ps))

    # A max-norm constraint after each step, inside gathered(modifier_rank=0) (the module
    # attributes of stages 1/2 lag after a step): the block's exit re-gathered only the ranks
    # whose slice held a parameter without a gradient, so the next forward's gathers hung.
    renorm_ref = _reference(data, after=_renorm).state_dict()
    for stage in (1, 2, 3):
        model = tierlift.zero.shard(make_model(), stage=stage)

        def renorm_gathered(m):
            with tierlift.zero.gathered(m, modifier_rank=0):
                _renorm(m)

        _train(model, _adamw(model.parameters()), data, world, rank, renorm_gathered)
        out[f"renorm{stage}_rel"] = _max_rel(tierlift.zero.full_state_dict(model), renorm_ref)

    # Freezing a layer mid-training (a norm inside a block, the final norm in the root unit):
    # refused at the call, nothing changed; training goes on as the reference's.
    for stage in (1, 3):
        model = tierlift.zero.shard(make_model(), stage=stage)
        opt = _adamw(model.parameters())
        _train(model, opt, data[:2], world, rank)
        before = tierlift.zero.full_state_dict(model)
        grads = [p.requires_grad for p in model.parameters()]
        for name in ("ln_f", "blocks.0.ln1"):
            out[f"freeze{stage}_{name}"] = raised(
                lambda m=model, n=name: m.get_submodule(n).requires_grad_(False))
        # The weight's own flag (stage 3: a stand-in outside forward; 1/2: a view, not a leaf).
        out[f"freeze{stage}_attr"] = raised(
            lambda m=model: setattr(m.ln_f.weight, "requires_grad", False))
        out[f"freeze{stage}_grads"] = grads == [p.requires_grad for p in model.parameters()]
        out[f"freeze{stage}_kept"] = _max_rel(tierlift.zero.full_state_dict(model), before)
        _train(model, opt, data[2:], world, rank)
        out[f"freeze{stage}_rel"] = _max_rel(tierlift.zero.full_state_dict(model), ref_sd)

    # An eval forward under no_grad between steps (stage 3 gathers and frees for it).
    model = tierlift.zero.shard(make_model(), stage=3)

    def evaluate(m):
        m.eval()
        _loss(m, data[0])
        m.train()

    _train(model, _adamw(model.parameters()), data, world, rank, evaluate)
    out["eval_rel"] = _max_rel(tierlift.zero.full_state_dict(model), ref_sd)

    # model.apply(init_fn) after shard() at stages 1/2 (the attributes hold the fp32 masters).
    torch.manual_seed(3)
    init_ref = make_model()
    torch.manual_seed(3)
    init_ref.apply(_init)
    init_sd = _reference(data, init_ref).state_dict()
    for stage in (1, 2):
        model = tierlift.zero.shard(make_model(), stage=stage)
        torch.manual_seed(3)
        model.apply(_init)
        _train(model, _adamw(model.parameters()), data, world, rank)
        out[f"apply{stage}_rel"] = _max_rel(tierlift.zero.full_state_dict(model), init_sd)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("zero_scripts")))


@pytest.mark.parametrize("stage", [2, 3])
def test_optimizer_state_of_rank0_refused_on_other_ranks(ranks, stage):
    """Rank 0's optimizer.state_dict() loaded on every rank: rank 0 takes it, rank 1 refuses it
    and keeps its own state; each rank's own file resumes as the uninterrupted run."""
    assert ranks[0][f"rank0{stage}_error"] == "<no error>"
    err = ranks[1][f"rank0{stage}_error"]
    assert err.startswith("RuntimeError: optimizer.load_state_dict was given the state of rank "
                          "0 of 2's ZeRO shard"), err
    assert "this is rank 1 of 2" in err and "tierlift.checkpoint" in err
    assert ranks[1][f"rank0{stage}_kept"]
    for out in ranks:
        assert out[f"own{stage}_error"] == "<no error>"
    assert ranks[0][f"own{stage}_rel"] < 1e-5


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ema_of_shards_as_an_ema_model(ranks, stage):
    for out in ranks:
        assert out[f"ema{stage}_loss"] < 1e-5
        assert out[f"ema{stage}_rel"] < 1e-5
        assert out[f"ema{stage}_model_rel"] < 1e-5  # the swap put the trained weights back


@pytest.mark.parametrize("stage", [2, 3])
def test_optimizer_built_before_shard_is_refused(ranks, stage):
    """An optimizer given the model's parameters before shard() stepped nothing (the model did
    not train: loss 14.8 after four steps against 8.7): refused at step() and when built."""
    for out in ranks:
        err = out[f"early{stage}_step"]
        assert err.startswith("RuntimeError: AdamW.step() on parameters that "
                              "tierlift.zero.shard() replaced (tok.weight, "), err
        assert "Build the optimizer after shard()" in err
        assert out[f"early{stage}_kept"] == 0.0
        assert out[f"early{stage}_init"].startswith("RuntimeError: AdamW.__init__() on "
                                                    "parameters that tierlift.zero.shard()")


@pytest.mark.parametrize("stage", [1, 3])
def test_freezing_a_layer_inside_a_unit_is_refused(ranks, stage):
    """`model.ln_f.requires_grad_(False)` after shard(): ln_f.parameters() yields no shard, so
    torch's call changed nothing and ln_f went on training (91% relative off a model that froze
    it). Refused at the call, before anything changes; so is setting the flag of a stage-3
    weight outside forward (a stand-in: the same silent no-op)."""
    for out in ranks:
        for name in ("ln_f", "blocks.0.ln1"):
            err = out[f"freeze{stage}_{name}"]
            assert err.startswith(f"RuntimeError: {name}.requires_grad_(False) on a model "
                                  f"sharded by tierlift.zero.shard would freeze {name}.weight, "
                                  f"{name}.bias"), err
            assert "Nothing was changed" in err
        err = out[f"freeze{stage}_attr"]
        assert err.startswith("RuntimeError: " + (
            "setting requires_grad=False on 'ln_f.weight', a weight of a model sharded by "
            "tierlift.zero (stage 3)" if stage == 3 else "you can only change requires_grad")), err
        assert out[f"freeze{stage}_grads"]
        assert out[f"freeze{stage}_kept"] == 0.0
        assert out[f"freeze{stage}_rel"] < 1e-5


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_weight_constraint_inside_gathered_after_each_step(ranks, stage):
    for out in ranks:
        assert out[f"renorm{stage}_rel"] < 1e-5


def test_eval_and_apply_as_torch(ranks):
    for out in ranks:
        assert out["eval_rel"] < 1e-5
        assert out["apply1_rel"] < 1e-5
        assert out["apply2_rel"] < 1e-5
