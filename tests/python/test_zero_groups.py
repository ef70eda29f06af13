"""shard(param_group_fn=...): per-group flat shards under ZeRO, so weight decay can skip norms,
biases and the (tied) embedding, against plain torch AdamW with the same groups on the unsharded
model: stages 1/2/3 in one process and on 2 gloo ranks under torchrun, checkpoints across world
sizes, full state dicts, bad key functions, and the default left bit for bit as it was."""

from __future__ import annotations

import textwrap

import pytest
import torch
from zero_model import batches, make_model, run_torchrun, train

import tierlift

STEPS, BATCH = 8, 8
LR, DECAY = 3e-3, 0.1
OPTIONS = {"decay": {"weight_decay": DECAY}, "no_decay": {"weight_decay": 0.0}}
DATA = batches(5, BATCH, seed=3)


def decay_key(name: str, param: torch.Tensor) -> str:
    """The GPT recipe: no decay on norms, biases and the embedding (tied with the LM head)."""
    return "no_decay" if param.dim() < 2 or name.startswith("tok.") else "decay"


def _torch_adamw(groups):
    return torch.optim.AdamW(groups, lr=LR, foreach=False)


def _reference(data, *, accum=1, clip=None, decay_key=decay_key):
    """Plain torch AdamW with the decay/no-decay groups on the unsharded model."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model()
        groups = {k: [] for k in OPTIONS}
        for name, p in model.named_parameters():
            if p.requires_grad:
                groups[decay_key(name, p)].append(p)
        opt = _torch_adamw([{"params": groups[k], **o} for k, o in OPTIONS.items()])
        losses = train(model, opt, data, accum=accum, clip=clip)
    finally:
        torch.set_num_threads(threads)
    return losses, model.state_dict()


def _assert_matches(losses, sd, ref_losses, ref_sd):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert list(sd) == list(ref_sd), "full_state_dict keys/order differ"
    for key, ref in ref_sd.items():
        torch.testing.assert_close(sd[key], ref, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=key: f"{k}: {m}")


# ---- world 1 ----


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optim", ["torch", "tierlift"])
def test_world1_matches_torch_adamw_groups(stage, optim):
    torch.set_num_threads(1)
    model = tierlift.zero.shard(make_model(), stage=stage, param_group_fn=decay_key)
    groups = tierlift.zero.param_groups(model, OPTIONS)
    opt = (_torch_adamw(groups) if optim == "torch"
           else tierlift.optim.AdamW(groups, lr=LR))
    data = batches(STEPS, BATCH)
    losses = train(model, opt, data, accum=2, clip=0.5, zero=True)
    sd = tierlift.zero.full_state_dict(model)
    ref_losses, ref_sd = _reference(data, accum=2, clip=0.5)
    _assert_matches(losses, sd, ref_losses, ref_sd)
    # The groups matter: one decay for everything ends elsewhere (so this test can fail).
    _, uniform = _reference(data, accum=2, clip=0.5, decay_key=lambda n, p: "decay")
    assert not torch.allclose(sd["ln_f.weight"], uniform["ln_f.weight"], rtol=1e-5, atol=0)
    assert not torch.allclose(sd["tok.weight"], uniform["tok.weight"], rtol=1e-5, atol=0)


def test_units_and_groups_layout():
    calls = []

    def key(name, p):
        calls.append(name)
        return decay_key(name, p)

    model = tierlift.zero.shard(make_model(), stage=3, param_group_fn=key)
    units = model._tierlift_zero.units
    # The frozen `pos` is a unit of its own, in no group, and param_group_fn never sees it.
    assert [(u.name, u.group, u.frozen) for u in units] == [
        ("blocks.0", "no_decay", False), ("blocks.0", "decay", False),
        ("blocks.1", "no_decay", False), ("blocks.1", "decay", False),
        ("blocks.2", "no_decay", False), ("blocks.2", "decay", False),
        ("<root>", "no_decay", False), ("<root>", None, True)]
    # The tied embedding/LM head is asked about once, under the name named_parameters() uses.
    assert "tok.weight" in calls and "head.weight" not in calls
    assert sorted(calls) == sorted(n for n, p in make_model().named_parameters()
                                   if p.requires_grad)
    groups = tierlift.zero.shard_groups(model)
    assert list(groups) == ["no_decay", "decay"]
    assert [len(v) for v in groups.values()] == [4, 3]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for v in groups.values() for p in v} == {id(p) for p in trainable}
    pg = tierlift.zero.param_groups(model, OPTIONS)
    assert [g["weight_decay"] for g in pg] == [DECAY, 0.0]
    assert pg[0]["params"] == groups["decay"]


@pytest.mark.parametrize("stage", [1, 3])
def test_default_is_unchanged_bit_for_bit(stage):
    """One key for everything gives the very units (and results) of the default."""
    torch.set_num_threads(1)
    out = []
    for fn in (None, lambda n, p: "all"):
        model = tierlift.zero.shard(make_model(), stage=stage, param_group_fn=fn)
        opt = tierlift.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
        losses = train(model, opt, batches(4, 4), accum=2, clip=0.5, zero=True)
        units = [(u.name, u.numel, [e.names for e in u.entries])
                 for u in model._tierlift_zero.units]
        out.append((losses, tierlift.zero.full_state_dict(model), units))
    assert out[0][0] == out[1][0] and out[0][2] == out[1][2]
    assert all(torch.equal(out[0][1][k], out[1][1][k]) for k in out[0][1])
    model = tierlift.zero.shard(make_model(), stage=stage)
    assert list(tierlift.zero.shard_groups(model)) == [None]


def test_full_state_dict_round_trip_with_groups():
    torch.set_num_threads(1)
    donor = make_model(seed=9)
    model = tierlift.zero.shard(make_model(), stage=3, param_group_fn=decay_key)
    idx = batches(1, 2)[0][:, :-1]
    tierlift.zero.load_full_state_dict(model, donor.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(idx), donor(idx), rtol=1e-6, atol=1e-6)
    sd = tierlift.zero.full_state_dict(model)
    assert list(sd) == list(donor.state_dict())
    assert all(torch.equal(sd[k], v) for k, v in donor.state_dict().items())
    assert sd["head.weight"] is sd["tok.weight"]


# ---- bad input ----


def test_bad_param_group_fn_is_named_and_leaves_the_model():
    model = make_model()

    def raises(name, p):
        if name == "blocks.1.fc.bias":
            raise KeyError("no rule")
        return "x"

    with pytest.raises(ValueError, match=r"param_group_fn raised KeyError for parameter "
                                         r"'blocks\.1\.fc\.bias'"):
        tierlift.zero.shard(model, stage=3, param_group_fn=raises)
    with pytest.raises(TypeError, match=r"unhashable list for parameter 'blocks\.0\.ln1\.weight'"):
        tierlift.zero.shard(model, stage=3, param_group_fn=lambda n, p: [n])
    with pytest.raises(TypeError, match="param_group_fn must be a callable"):
        tierlift.zero.shard(model, stage=3, param_group_fn="decay")
    # Nothing was changed: the same model shards fine afterwards.
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())
    tierlift.zero.shard(model, stage=3, param_group_fn=decay_key)


def test_param_groups_bad_options():
    model = tierlift.zero.shard(make_model(), stage=2, param_group_fn=decay_key)
    with pytest.raises(ValueError, match="no entry for group key 'no_decay'"):
        tierlift.zero.param_groups(model, {"decay": {}})
    with pytest.raises(ValueError, match="'nodecay', which no parameter"):
        tierlift.zero.param_groups(model, {**OPTIONS, "nodecay": {}})
    with pytest.raises(ValueError, match="must not contain 'params'"):
        tierlift.zero.param_groups(model, {"decay": {"params": []}, "no_decay": {}})
    with pytest.raises(TypeError, match=r"options\['decay'\] must be a mapping"):
        tierlift.zero.param_groups(model, {"decay": 0.1, "no_decay": {}})
    with pytest.raises(TypeError, match="options must be a mapping"):
        tierlift.zero.param_groups(model, [("decay", {})])
    with pytest.raises(ValueError, match="not sharded"):
        tierlift.zero.param_groups(make_model(), OPTIONS)


def test_checkpoint_with_other_grouping_is_refused(tmp_path):
    torch.set_num_threads(1)
    model = tierlift.zero.shard(make_model(), stage=3, param_group_fn=decay_key)
    tierlift.checkpoint.save(tmp_path / "ck", model)
    plain = tierlift.zero.shard(make_model(), stage=3)
    with pytest.raises(ValueError, match="split into units differently"):
        tierlift.checkpoint.load(tmp_path / "ck", plain)


# ---- 2 gloo ranks under torchrun, checkpoints across world sizes ----

SCRIPT = textwrap.dedent("""
    import tierlift
    from zero_model import batches, make_model, train
    from test_zero_groups import DATA, OPTIONS, STEPS, BATCH, _fresh, _torch_adamw, decay_key
    out = {{}}
    for stage in (1, 2, 3):
        model = tierlift.zero.shard(make_model(), stage=stage, param_group_fn=decay_key)
        opt = _torch_adamw(tierlift.zero.param_groups(model, OPTIONS))
        out[f"losses{{stage}}"] = torch.tensor(train(
            model, opt, batches(STEPS, BATCH), accum=2, clip=0.5, world=world, rank=rank,
            zero=True))
        out[f"state{{stage}}"] = tierlift.zero.full_state_dict(model)
    # 1 -> 2: resume the world-1 checkpoint on 2 ranks.
    model, opt = _fresh(stage=2)
    tierlift.checkpoint.load({ckpt1!r}, model, opt)
    out["resumed_1to2"] = torch.tensor(train(model, opt, DATA[3:], accum=1, clip=1.0,
                                             world=world, rank=rank, zero=True))
    # 2 -> 1: save here, the test resumes on one process.
    model, opt = _fresh(stage=3)
    train(model, opt, DATA[:3], accum=1, clip=1.0, world=world, rank=rank, zero=True)
    tierlift.checkpoint.save({ckpt2!r}, model, opt)
    out["after_2"] = torch.tensor(train(model, opt, DATA[3:], accum=1, clip=1.0, world=world,
                                        rank=rank, zero=True))
    donor = make_model(seed=9).state_dict()
    tierlift.zero.load_full_state_dict(model, donor)
    sd = tierlift.zero.full_state_dict(model)
    out["loaded_ok"] = torch.tensor(all(torch.equal(sd[k], v) for k, v in donor.items()))
""")


def _fresh(stage):
    model = tierlift.zero.shard(make_model(seed=5), stage=stage, param_group_fn=decay_key)
    return model, tierlift.optim.AdamW(tierlift.zero.param_groups(model, OPTIONS), lr=LR)


@pytest.fixture(scope="module")
def torchrun2(tmp_path_factory):
    root = tmp_path_factory.mktemp("groups")
    ckpt1, ckpt2 = str(root / "ck1"), str(root / "ck2")
    torch.set_num_threads(1)
    model, opt = _fresh(stage=3)
    train(model, opt, DATA[:3], accum=1, clip=1.0, zero=True)
    tierlift.checkpoint.save(ckpt1, model, opt)
    after_1 = train(model, opt, DATA[3:], accum=1, clip=1.0, zero=True)
    result = run_torchrun(SCRIPT, root, timeout=180, weights_only=True, ckpt1=ckpt1, ckpt2=ckpt2)
    return dict(result, after_1=after_1, ckpt2=ckpt2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_torchrun2_matches_torch_adamw_groups(torchrun2, stage):
    ref_losses, ref_sd = _reference(batches(STEPS, BATCH), accum=2, clip=0.5)
    _assert_matches(torchrun2[f"losses{stage}"].tolist(), torchrun2[f"state{stage}"],
                    ref_losses, ref_sd)


def test_torchrun2_checkpoint_across_world_sizes(torchrun2):
    torch.testing.assert_close(torchrun2["resumed_1to2"], torch.tensor(torchrun2["after_1"]),
                               rtol=1e-5, atol=0)
    torch.set_num_threads(1)
    model, opt = _fresh(stage=1)
    tierlift.checkpoint.load(torchrun2["ckpt2"], model, opt)
    assert [g["weight_decay"] for g in opt.param_groups] == [DECAY, 0.0]
    resumed = train(model, opt, DATA[3:], accum=1, clip=1.0, zero=True)
    torch.testing.assert_close(torch.tensor(resumed), torchrun2["after_2"], rtol=1e-5, atol=0)
    assert bool(torchrun2["loaded_ok"])


def test_param_offload_with_groups_at_the_smallest_budget():
    """offload_params="cpu" with gpu_budget: the budget counts every group of a unit."""
    import re

    torch.set_num_threads(1)
    with pytest.raises(ValueError, match="smallest budget that works") as info:
        tierlift.zero.shard(make_model(), stage=3, offload_params="cpu", gpu_budget=1,
                            param_group_fn=decay_key)
    need = int(re.search(r"works is (\d+) bytes", str(info.value)).group(1))
    model = tierlift.zero.shard(make_model(), stage=3, offload_params="cpu", gpu_budget=need,
                                param_group_fn=decay_key)
    opt = _torch_adamw(tierlift.zero.param_groups(model, OPTIONS))
    data = batches(4, 4)
    losses = train(model, opt, data, accum=1, clip=None, zero=True)
    _assert_matches(losses, tierlift.zero.full_state_dict(model), *_reference(data))
    assert model._tierlift_zero.stats["peak_resident_bytes"] <= need
