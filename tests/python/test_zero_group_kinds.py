"""Optimizer groups that split a sharded model's parameters by kind (decay on matrices, none on
norms and biases) without leaving a group empty, in one process (world 1).

After tierlift.zero.shard() a unit's parameters are one flat 1-D shard on the unit's module, so
detectron2's get_default_optimizer_params, mmengine's DefaultOptimWrapperConstructor
(norm_decay_mult / bias_decay_mult) and a "bias" / "norm" name split that matches some unit
names give a unit packing a matrix with its bias (or a block with its LayerNorm) one weight
decay where torch gives two. Such groups are refused at construction and at add_param_group,
before anything changes; splits that stay exact are kept; and the same framework code, run on
the model before shard() and handed over through param_group_fn, trains exactly like torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zero_model import raised

import tierlift

VOCAB, DIM, STEPS = 13, 16, 3
UNITS = ["embed", "block", "norm", "head"]
NORMS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d)
WD, LR = 0.1, 1e-2  # lr * wd is far above the tolerance: a decay given to the wrong side shows


class Net(nn.Module):
    """embed: matrices only; block (Linear + LayerNorm) and head (Linear with bias): mixed
    units; norm: 1-D parameters only."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = nn.Sequential(nn.Linear(DIM, DIM, bias=bias), nn.LayerNorm(DIM))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        return self.head(self.norm(x + torch.tanh(self.block(x))))


def make(bias: bool = True) -> Net:
    torch.manual_seed(0)
    net = Net(bias)
    with torch.no_grad():  # LayerNorm starts at ones / zeros: make decay visible there too
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return net


def sharded(stage: int = 3, bias: bool = True, **kw) -> Net:
    return tierlift.zero.shard(make(bias), stage=stage, units=UNITS, **kw)


# ---- the framework idioms, as they read a model ----

def detectron2_like(model, weight_decay_norm=0.0, weight_decay_bias=0.0) -> list[dict]:
    """detectron2's get_default_optimizer_params: one group per parameter by module type and
    attribute name, then groups with equal settings merged (reduce_param_groups)."""
    overrides = {"bias": {"weight_decay": weight_decay_bias}}
    groups, memo = [], set()
    for module in model.modules():
        for name, value in module.named_parameters(recurse=False):
            if not value.requires_grad or value in memo:
                continue
            memo.add(value)
            hyper = {"lr": LR, "weight_decay": WD}
            if isinstance(module, NORMS):
                hyper["weight_decay"] = weight_decay_norm
            hyper.update(overrides.get(name, {}))
            groups.append({"params": [value], **hyper})
    merged: dict = {}
    for g in groups:
        key = tuple(sorted((k, v) for k, v in g.items() if k != "params"))
        merged.setdefault(key, []).extend(g["params"])
    return [{"params": ps, **dict(key)} for key, ps in merged.items()]


def mmengine_like(model, norm_decay_mult=0.0, bias_decay_mult=0.0) -> list[dict]:
    """mmengine's DefaultOptimWrapperConstructor.add_params with paramwise_cfg: one group per
    parameter, module by module; the optimizer's weight_decay for the rest."""
    groups = []

    def add(module):
        is_norm = isinstance(module, NORMS)
        for name, param in module.named_parameters(recurse=False):
            group = {"params": [param]}
            if param.requires_grad:
                if name == "bias" and not is_norm:
                    group["weight_decay"] = WD * bias_decay_mult
                elif is_norm:
                    group["weight_decay"] = WD * norm_decay_mult
            groups.append(group)
        for child in module.children():
            add(child)

    add(model)
    return groups


def name_split(model) -> list[dict]:
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if "bias" not in n and "norm" not in n],
             "weight_decay": WD},
            {"params": [p for n, p in named if "bias" in n or "norm" in n], "weight_decay": 0.0}]


IDIOMS = {"detectron2": detectron2_like, "mmengine": mmengine_like, "name_split": name_split}
OPTIMIZERS = {
    "torch": lambda groups: torch.optim.AdamW(groups, lr=LR, weight_decay=WD),
    "tierlift": lambda groups: tierlift.optim.AdamW(groups, lr=LR, weight_decay=WD),
    "tierlift-cpu-offload": lambda groups: tierlift.optim.AdamW(groups, offload="cpu", lr=LR,
                                                                 weight_decay=WD),
}


def _train(model, opt) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        idx = torch.randint(0, VOCAB, (4, 6), generator=g)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(idx).flatten(0, 1), idx.roll(1, 1).flatten()).backward()
        opt.step()


def _snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unchanged(model, before: dict) -> bool:
    now = dict(model.named_parameters())
    return now.keys() == before.keys() and all(torch.equal(now[n], before[n]) for n in before)


# ---- refused ----

@pytest.mark.parametrize("idiom", IDIOMS)
@pytest.mark.parametrize("stage", [2, 3])
def test_kind_split_is_refused_before_anything_changes(idiom, stage):
    model = sharded(stage)
    before = _snapshot(model)
    msg = raised(lambda: OPTIMIZERS["torch"](IDIOMS[idiom](model)))
    assert msg.startswith("ValueError: optimizer param group"), msg
    # names a mixed unit and its parameters, and the way out
    assert "unit 'block'" in msg or "unit 'head'" in msg, msg
    assert "block.0.weight" in msg or "head.weight" in msg, msg
    assert "param_group_fn" in msg and "tierlift.zero.param_groups" in msg, msg
    assert _unchanged(model, before)


@pytest.mark.parametrize("kind", ["tierlift", "tierlift-cpu-offload"])
def test_kind_split_is_refused_for_tierlift_optimizers(kind):
    model = sharded()
    msg = raised(lambda: OPTIMIZERS[kind](detectron2_like(model)))
    assert msg.startswith("ValueError: optimizer param group"), msg
    assert "weight_decay" in msg and "param_group_fn" in msg, msg


def test_kind_group_added_later_is_refused_before_anything_changes():
    model = sharded()
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW([p for n, p in named.items() if "norm" not in n], lr=LR,
                            weight_decay=WD)
    groups_before = [list(g["params"]) for g in opt.param_groups]
    msg = raised(lambda: opt.add_param_group({"params": [named["norm._zero_flat_shard"]],
                                              "weight_decay": 0.0}))
    assert msg.startswith("ValueError: optimizer param group 0 (weight_decay=0.1)"), msg
    assert "unit 'block'" in msg, msg
    assert [list(g["params"]) for g in opt.param_groups] == groups_before
    assert not opt.state


# ---- kept ----

def test_one_group_and_learning_rates_per_unit_are_kept():
    model = sharded()
    assert raised(lambda: torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)) \
        == "<no error>"
    head = list(model.head.parameters())
    rest = [p for p in model.parameters() if all(p is not h for h in head)]
    by_unit = [{"params": head, "lr": 10 * LR}, {"params": rest}]
    assert raised(lambda: torch.optim.AdamW(by_unit, lr=LR, weight_decay=WD)) == "<no error>"
    # a group with another weight decay added later for parameters that are no shard
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    extra = nn.Linear(3, 3)
    assert raised(lambda: opt.add_param_group({"params": extra.parameters(),
                                               "weight_decay": 0.0})) == "<no error>"
    assert len(opt.param_groups) == 2


def test_frozen_mixed_units_and_other_models_are_kept():
    # LoRA-like: the mixed units frozen (stage 3 shards them into frozen units, never stepped)
    net = make()
    for p in [*net.block.parameters(), *net.head.parameters()]:
        p.requires_grad_(False)
    model = tierlift.zero.shard(net, stage=3, units=UNITS)
    assert raised(lambda: torch.optim.AdamW(name_split(model), lr=LR)) == "<no error>"
    # a sharded model in one group next to an unsharded model split by kind
    model, other = sharded(), nn.Linear(4, 4)
    groups = [{"params": list(model.parameters())},
              {"params": [other.weight], "weight_decay": WD},
              {"params": [other.bias], "weight_decay": 0.0}]
    assert raised(lambda: torch.optim.AdamW(groups, lr=LR)) == "<no error>"


@pytest.mark.parametrize("idiom", ["detectron2", "mmengine"])
def test_homogeneous_units_split_by_kind_are_kept_and_exact(idiom):
    """Without biases every unit is matrices only or norm weights only: the framework's split
    of the shards is the split torch makes, so it is kept, and trains as torch."""
    reference = make(bias=False)
    opt = OPTIMIZERS["torch"](IDIOMS[idiom](reference))
    _train(reference, opt)
    # A block (Linear + LayerNorm) is mixed: a unit per layer keeps every unit pure.
    model = tierlift.zero.shard(make(bias=False), stage=3,
                                units=["embed", "block.0", "block.1", "norm", "head"])
    opt = OPTIMIZERS["torch"](IDIOMS[idiom](model))
    _train(model, opt)
    full = tierlift.zero.full_state_dict(model)
    for name, want in reference.state_dict().items():
        torch.testing.assert_close(full[name], want, rtol=1e-6, atol=1e-7, msg=name)


# ---- the recipe: the framework's groups, built before shard(), through param_group_fn ----

def _by_settings(model, groups) -> tuple:
    """(param_group_fn, {key: settings}) from groups built on the unsharded model: each
    parameter keyed by its group's settings (groups with equal settings share a shard)."""
    key_of = {}
    for g in groups:
        key = tuple(sorted((k, v) for k, v in g.items() if k != "params"))
        key_of.update((id(p), key) for p in g["params"])
    names = {n: key_of[id(p)] for n, p in model.named_parameters() if p.requires_grad}
    return (lambda name, _: names[name]), {k: dict(k) for k in dict.fromkeys(names.values())}


@pytest.mark.parametrize("idiom", ["detectron2", "mmengine"])
@pytest.mark.parametrize("stage", [2, 3])
def test_groups_built_before_shard_train_exactly_as_torch(idiom, stage):
    reference = make()
    _train(reference, OPTIMIZERS["torch"](IDIOMS[idiom](reference)))
    model = make()
    fn, settings = _by_settings(model, IDIOMS[idiom](model))
    tierlift.zero.shard(model, stage=stage, units=UNITS, param_group_fn=fn)
    opt = OPTIMIZERS["torch"](tierlift.zero.param_groups(model, settings))
    _train(model, opt)
    full = tierlift.zero.full_state_dict(model)
    for name, want in reference.state_dict().items():
        torch.testing.assert_close(full[name], want, rtol=1e-6, atol=1e-7, msg=name)
    # the groups differ in weight decay: the check saw them and trusted the split
    assert len({g["weight_decay"] for g in opt.param_groups}) == 2
