"""tierlift.checkpoint.load into an optimizer built over the same parameters in another order:
each parameter's state (moments, master, step) and each group's hyperparameters are matched by
the parameter's name in the model, as torch DCP keys optimizer state; a load that cannot be
made exact is refused before anything changes. Two Linear(4, 4) layers: swapping them keeps
every shape, so positions alone put one layer's moments into the other."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import tierlift

X = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


def _opt(kind: str, groups, tmp_path, **kw):
    if kind == "torch":
        return torch.optim.AdamW(groups, lr=0.05, **kw)
    extra = {"offload": kind} if kind != "none" else {}
    if kind == "nvme":
        extra["nvme_path"] = str(tmp_path / "swap")
        os.makedirs(extra["nvme_path"], exist_ok=True)
    return tierlift.optim.AdamW(groups, lr=0.05, **extra, **kw)


def _train(model, opt, xs) -> None:
    for x in xs:
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _close(opt) -> None:
    if hasattr(opt, "close"):
        opt.close()


def _resume(kind, tmp_path, order, *, wrap=None, load_into=None):
    """Trains 2 steps, saves (the model as `wrap` gives it), trains 2 more: the reference.
    Then a fresh model whose optimizer lists params as `order(model)` gives them loads the
    checkpoint and trains the same 2 steps; returns (reference params, resumed params)."""
    model = _net()
    opt = _opt(kind, model.parameters(), tmp_path)
    _train(model, opt, X[:2])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, wrap(model) if wrap else model, opt)
    _train(model, opt, X[2:])
    _close(opt)
    fresh = _net()
    opt2 = _opt(kind, order(fresh), tmp_path)
    tierlift.checkpoint.load(ck, load_into(fresh) if load_into else fresh, opt2)
    _train(fresh, opt2, X[2:])
    _close(opt2)
    return dict(model.named_parameters()), dict(fresh.named_parameters())


def _swapped(model):
    a, b = model[0], model[2]
    return [b.weight, b.bias, a.weight, a.bias]


@pytest.mark.parametrize("kind", ["torch", "none", "cpu", "nvme"])
def test_reordered_params_get_their_own_state(tmp_path, kind):
    ref, got = _resume(kind, tmp_path, _swapped)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("kind", ["torch", "none", "cpu"])
def test_reordered_groups_keep_their_hyperparameters(tmp_path, kind):
    """Groups listed the other way round: each saved group's lr and weight decay go with its
    parameters, not to the group at its position."""

    def groups(m, flip):
        g = [
            {"params": [m[0].weight, m[2].weight], "weight_decay": 0.5, "lr": 0.02},
            {"params": [m[2].bias, m[0].bias], "weight_decay": 0.0, "lr": 0.07},
        ]
        return g[::-1] if flip else g

    model = _net()
    opt = _opt(kind, groups(model, False), tmp_path)
    _train(model, opt, X[:2])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    _train(model, opt, X[2:])
    fresh = _net()
    opt2 = _opt(kind, groups(fresh, True), tmp_path, weight_decay=0.3)
    tierlift.checkpoint.load(ck, fresh, opt2)
    assert [(g["lr"], g["weight_decay"]) for g in opt2.param_groups] == [(0.07, 0.0), (0.02, 0.5)]
    _train(fresh, opt2, X[2:])
    for name, p in model.named_parameters():
        torch.testing.assert_close(dict(fresh.named_parameters())[name], p, rtol=0, atol=0)


def _snapshot(model, opt):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()},
    )


def _assert_unchanged(before, model, opt):
    weights, groups, state = before
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    now = opt.state_dict()["state"]
    assert now.keys() == state.keys()
    for i, s in state.items():
        for k, v in s.items():
            assert torch.equal(now[i][k], v), (i, k)


@pytest.mark.parametrize("kind", ["none", "cpu"])
def test_param_moved_to_another_group_is_refused(tmp_path, kind):
    model = _net()
    opt = _opt(
        kind,
        [
            {"params": [model[0].weight, model[0].bias]},
            {"params": [model[2].weight, model[2].bias], "lr": 0.01},
        ],
        tmp_path,
    )
    _train(model, opt, X[:1])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    fresh = _net()
    opt2 = _opt(
        kind,
        [
            {"params": [fresh[0].weight, fresh[2].bias]},
            {"params": [fresh[2].weight, fresh[0].bias], "lr": 0.01},
        ],
        tmp_path,
    )
    _train(fresh, opt2, X[1:2])
    before = _snapshot(fresh, opt2)
    with pytest.raises(
        ValueError,
        match=r"holds other parameters than any saved group "
        r"\('2.bias' was in saved group 1\)",
    ):
        tierlift.checkpoint.load(ck, fresh, opt2)
    _assert_unchanged(before, fresh, opt2)
    _close(opt2)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.c.weight = self.a.weight  # tied: one parameter, two names
        self.b.bias.requires_grad_(False)  # frozen: in no optimizer

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


@pytest.mark.parametrize("kind", ["none", "cpu"])
def test_tied_and_frozen_params_in_another_order(tmp_path, kind):
    model = Tied()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = _opt(kind, trainable, tmp_path)
    _train(model, opt, X[:2])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    _train(model, opt, X[2:])
    fresh = Tied()
    opt2 = _opt(kind, [p for p in fresh.parameters() if p.requires_grad][::-1], tmp_path)
    tierlift.checkpoint.load(ck, fresh, opt2)
    _train(fresh, opt2, X[2:])
    for name, p in model.named_parameters():
        torch.testing.assert_close(dict(fresh.named_parameters())[name], p, rtol=0, atol=0)


class Wrapper(nn.Module):
    """Names its child `module`, as DDP does."""

    def __init__(self, module):
        super().__init__()
        self.module = module


@pytest.mark.parametrize("kind", ["none", "cpu"])
@pytest.mark.parametrize("wrap", ["compiled", "ddp"])
def test_wrapped_model_loads_into_the_plain_one(tmp_path, kind, wrap):
    """Saved through torch.compile's wrapper (`_orig_mod.` names) or DDP's (`module.`), loaded
    into the plain model in another order: mapped by name without the wrapper, not refused."""
    how = torch.compile if wrap == "compiled" else Wrapper
    ref, got = _resume(kind, tmp_path, _swapped, wrap=how)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0, msg=name)


def test_plain_model_loads_into_the_wrapped_one(tmp_path):
    ref, got = _resume("none", tmp_path, _swapped, load_into=Wrapper)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0, msg=name)


def test_param_outside_the_model_is_matched_by_position(tmp_path):
    """An optimizer parameter that is not in the model has no name: the state is matched by
    position, and a reorder the names that do exist show is refused."""
    model = _net()
    temp = nn.Parameter(torch.ones(4))
    opt = _opt("none", [temp, *model.parameters()], tmp_path)
    _train(model, opt, X[:1])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    fresh = _net()
    opt2 = _opt("none", [nn.Parameter(torch.ones(4)), *_swapped(fresh)], tmp_path)
    before = _snapshot(fresh, opt2)
    with pytest.raises(ValueError, match=r"parameter #1 is '2.weight' here but was '0.weight'"):
        tierlift.checkpoint.load(ck, fresh, opt2)
    _assert_unchanged(before, fresh, opt2)
    fresh = _net()
    opt2 = _opt("none", [nn.Parameter(torch.ones(4)), *fresh.parameters()], tmp_path)
    tierlift.checkpoint.load(ck, fresh, opt2)
    for i, s in opt.state_dict()["state"].items():
        assert torch.equal(opt2.state_dict()["state"][i]["exp_avg"], s["exp_avg"])


def test_torch_param_names_stay_this_optimizers(tmp_path):
    """An optimizer built from named_parameters() keeps its own "param_names" (torch's), not
    the saved order's."""
    model = _net()
    opt = torch.optim.AdamW(model.named_parameters(), lr=0.05)
    _train(model, opt, X[:1])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    fresh = _net()
    named = dict(fresh.named_parameters())
    opt2 = torch.optim.AdamW(
        [(n, named[n]) for n in ["2.weight", "2.bias", "0.weight", "0.bias"]], lr=0.05
    )
    tierlift.checkpoint.load(ck, fresh, opt2)
    assert opt2.param_groups[0]["param_names"] == ["2.weight", "2.bias", "0.weight", "0.bias"]
    for n, p in model.named_parameters():
        assert torch.equal(opt2.state[named[n]]["exp_avg"], opt.state[p]["exp_avg"])


def test_unnamed_sharded_checkpoint_loads_by_position(tmp_path):
    """A sharded checkpoint from before names: its groups are matched by position, as then."""

    def fresh():
        m = tierlift.zero.shard(_net(), stage=3, min_unit_numel=1)
        return m, tierlift.optim.AdamW(m.parameters(), lr=0.05)

    model, opt = fresh()
    _train(model, opt, X[:1])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    meta_file = os.path.join(ck, "metadata.json")
    with open(meta_file) as f:
        meta = json.load(f)
    del meta["param_names"]
    with open(meta_file, "w") as f:
        json.dump(meta, f)
    os.unlink(os.path.join(ck, "manifest.json"))
    m2, o2 = fresh()
    with pytest.warns(UserWarning, match="no manifest.json"):
        tierlift.checkpoint.load(ck, m2, o2, verify=False)
    for a, b in zip(opt.param_groups[0]["params"], o2.param_groups[0]["params"], strict=True):
        assert torch.equal(opt.state[a]["exp_avg"], o2.state[b]["exp_avg"])


@pytest.mark.parametrize("kind", ["none", "cpu", "nvme"])
def test_sharded_groups_in_another_order(tmp_path, kind):
    """tierlift.zero.param_groups with the keys the other way round: each group keeps its
    weight decay, and each shard its state (the streamed one too)."""
    opts = {"decay": {"weight_decay": 0.5}, "no_decay": {"weight_decay": 0.0}}

    def fresh(flip):
        m = tierlift.zero.shard(
            _net(),
            stage=3,
            min_unit_numel=1,
            param_group_fn=lambda n, p: "decay" if p.dim() > 1 else "no_decay",
        )
        keys = ["no_decay", "decay"] if flip else ["decay", "no_decay"]
        groups = tierlift.zero.param_groups(m, {k: opts[k] for k in keys})
        return m, _opt(kind, groups, tmp_path)

    model, opt = fresh(False)
    _train(model, opt, X[:2])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    _train(model, opt, X[2:])
    m2, o2 = fresh(True)
    tierlift.checkpoint.load(ck, m2, o2)
    assert [g["weight_decay"] for g in o2.param_groups] == [0.0, 0.5]
    _train(m2, o2, X[2:])
    ref, got = tierlift.zero.full_state_dict(model), tierlift.zero.full_state_dict(m2)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0, msg=k)
    _close(opt)
    _close(o2)


def test_sharded_save_refuses_a_param_outside_the_model(tmp_path):
    """A sharded checkpoint holds the state of the model's shards only: an optimizer parameter
    outside the model had its moments dropped, and the load resumed it from scratch."""
    model = tierlift.zero.shard(_net(), stage=3, min_unit_numel=1)
    temp = nn.Parameter(torch.ones(4))
    opt = tierlift.optim.AdamW([*model.parameters(), temp], lr=0.05)
    for x in X[:2]:
        (model(x) * temp).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    ck = tmp_path / "ck"
    with pytest.raises(
        ValueError,
        match=r"param_groups\[0\]\['params'\]\[2\] \(shape \(4,\)\) "
        "is not a shard of the sharded model but has optimizer state",
    ):
        tierlift.checkpoint.save(str(ck), model, opt)
    assert not os.path.exists(ck) and not os.path.exists(str(ck) + ".tmp")


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "zero3"])
def test_weights_only_checkpoint_refuses_a_stepped_optimizer(tmp_path, sharded):
    """save(path, model) without the optimizer, then load(path, model, opt) after steps: the
    weights went back while the moments and step counts stayed, silently mixed."""
    model = _net()
    if sharded:
        model = tierlift.zero.shard(model, stage=3, min_unit_numel=1)
    opt = tierlift.optim.AdamW(model.parameters(), lr=0.05)
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model)
    _train(model, opt, X[:2])
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match="holds no optimizer state .* holds state for"):
        tierlift.checkpoint.load(ck, model, opt)
    _assert_unchanged(before, model, opt)
    fresh = tierlift.optim.AdamW(model.parameters(), lr=0.05)
    tierlift.checkpoint.load(ck, model, fresh)  # a new optimizer: nothing to mix
    tierlift.checkpoint.load(ck, model)
