"""A ZeRO checkpoint resumed in another configuration than it was saved in: the training after
the load matches an uninterrupted run exactly, or the load is refused before anything
changes. Two Linear(4, 4) layers and a buffer, one unit each (min_unit_numel=1)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import tierlift

X = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("shift", torch.arange(4.0))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + self.shift


def _train(model, opt, xs) -> None:
    for x in xs:
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _plain(net):
    return tierlift.zero.shard(net, stage=3, min_unit_numel=1)


def _compiled_inside(net):  # sharded through the wrapper: `_orig_mod.` in every name
    return tierlift.zero.shard(torch.compile(net), stage=3, min_unit_numel=1)


def _compiled_outside(net):  # the sharded model compiled: state_dict() keys get `_orig_mod.`
    return torch.compile(tierlift.zero.shard(net, stage=3, min_unit_numel=1))


def _full(model) -> dict:
    return {k.replace("_orig_mod.", ""): v for k, v in tierlift.zero.full_state_dict(model).items()}


WRAPS = {"plain": _plain, "compiled-inside": _compiled_inside,
         "compiled-outside": _compiled_outside}


@pytest.mark.parametrize(("saved", "loaded"), [
    ("compiled-inside", "plain"), ("compiled-outside", "plain"),
    ("plain", "compiled-inside"), ("plain", "compiled-outside"),
    ("compiled-inside", "compiled-outside"),
])
def test_compiled_zero_model_resumes_in_the_plain_one(tmp_path, one_thread, saved, loaded):
    """Saved through torch.compile (`_orig_mod.` names), loaded without it (or the reverse):
    every unit, the buffer and the optimizer state go to their parameters. The layers train
    through the module inside the wrapper (the hooks are there), so nothing is compiled."""
    net = Net()
    model = WRAPS[saved](net)
    opt = tierlift.optim.AdamW(model.parameters(), lr=0.05)
    _train(net, opt, X[:2])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    _train(net, opt, X[2:])
    net2 = Net()
    with torch.no_grad():
        net2.shift.add_(5.0)  # the buffer must come from the checkpoint
    model2 = WRAPS[loaded](net2)
    opt2 = tierlift.optim.AdamW(model2.parameters(), lr=0.05)
    tierlift.checkpoint.load(ck, model2, opt2)
    _train(net2, opt2, X[2:])
    ref, got = _full(model), _full(model2)
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0, msg=k)


GROUP_OPTS = {"decay": {"weight_decay": 0.5, "lr": 0.02},
              "no_decay": {"weight_decay": 0.0, "lr": 0.07}}


def _grouped(keys, kind, tmp_path):
    model = tierlift.zero.shard(Net(), stage=3, min_unit_numel=1,
                                param_group_fn=lambda n, p: "decay" if p.dim() > 1
                                else "no_decay")
    extra = {} if kind == "none" else {"offload": kind}
    groups = tierlift.zero.param_groups(model, {k: GROUP_OPTS[k] for k in keys})
    return model, tierlift.optim.AdamW(groups, **extra)


def _without_names(ck: str) -> None:
    """As a tierlift from before parameter names wrote it (and so without a manifest)."""
    file = os.path.join(ck, "metadata.json")
    with open(file) as f:
        meta = json.load(f)
    del meta["param_names"]
    with open(file, "w") as f:
        json.dump(meta, f)
    os.unlink(os.path.join(ck, "manifest.json"))


def _snapshot(model, opt) -> tuple:
    return ({k: v.clone() for k, v in tierlift.zero.full_state_dict(model).items()},
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            {i: {k: torch.as_tensor(v).clone() for k, v in s.items()}
             for i, s in opt.state_dict()["state"].items()})


def _assert_same(a: tuple, b: tuple) -> None:
    assert a[0].keys() == b[0].keys() and a[1] == b[1] and a[2].keys() == b[2].keys()
    for k in a[0]:
        assert torch.equal(a[0][k], b[0][k]), k
    for i in a[2]:
        for k in a[2][i]:
            assert torch.equal(a[2][i][k], b[2][i][k]), (i, k)


@pytest.mark.parametrize("kind", ["none", "cpu"])
def test_unnamed_checkpoint_into_groups_in_another_order(tmp_path, one_thread, kind):
    """A checkpoint without names, loaded into param groups listed the other way round: by
    position each group took the other's lr and weight decay (34% off after 2 steps). The
    streamed state names each unit's saved group, so that load is exact; state in the rank
    files does not, and the order this optimizer's own values show is refused."""
    model, opt = _grouped(["decay", "no_decay"], kind, tmp_path)
    _train(model, opt, X[:2])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    _train(model, opt, X[2:])
    _without_names(ck)
    model2, opt2 = _grouped(["no_decay", "decay"], kind, tmp_path)
    if kind == "none":
        _train(model2, opt2, X[:1])
        before = _snapshot(model2, opt2)
        with pytest.raises(ValueError, match=r"param group 0 \(\{lr: 0.07, weight_decay: 0.0\}"
                           r"\) looks like saved group 1 .* another order than when saved"):
            with pytest.warns(UserWarning, match="no manifest.json"):
                tierlift.checkpoint.load(ck, model2, opt2, verify=False)
        _assert_same(before, _snapshot(model2, opt2))
        model2, opt2 = _grouped(["decay", "no_decay"], kind, tmp_path)  # the saved order
    with pytest.warns(UserWarning, match="no manifest.json"):
        tierlift.checkpoint.load(ck, model2, opt2, verify=False)
    _train(model2, opt2, X[2:])
    ref, got = _full(model), _full(model2)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0, msg=k)


class WithScale(Net):
    """Net with a buffer added since the save (a layer without parameters)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x):
        return super().forward(x) * self.scale


@pytest.mark.parametrize("stage", [1, 3])
def test_a_buffer_only_in_the_model_is_refused(tmp_path, one_thread, stage):
    """A model that gained a buffer since the save kept its initial value beside the loaded
    weights (the unsharded load refuses it, as torch's strict load_state_dict does)."""
    model = tierlift.zero.shard(Net(), stage=stage, min_unit_numel=1)
    opt = tierlift.optim.AdamW(model.parameters(), lr=0.05)
    _train(model, opt, X[:2])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    model2 = tierlift.zero.shard(WithScale(), stage=stage, min_unit_numel=1)
    opt2 = tierlift.optim.AdamW(model2.parameters(), lr=0.05)
    before = _snapshot(model2, opt2)
    with pytest.raises(ValueError, match="'scale' exists only in the model"):
        tierlift.checkpoint.load(ck, model2, opt2)
    _assert_same(before, _snapshot(model2, opt2))


class FrozenB(Net):
    def __init__(self):
        super().__init__()
        self.b.weight.requires_grad_(False)


@pytest.mark.parametrize(("saved", "loaded"), [(Net, FrozenB), (FrozenB, Net)])
def test_a_parameter_frozen_since_the_save_is_refused_with_its_name(tmp_path, one_thread,
                                                                   saved, loaded):
    """requires_grad changed since the save moves the parameter between units: refused
    naming it (before: 'tensor #2 is b.weight ... but b.bias'), nothing changed, and the
    weights alone load the way the message says."""
    model = tierlift.zero.shard(saved(), stage=3, min_unit_numel=1)
    opt = tierlift.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    _train(model, opt, X[:2])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    model2 = tierlift.zero.shard(loaded(), stage=1, min_unit_numel=1)
    opt2 = tierlift.optim.AdamW([p for p in model2.parameters() if p.requires_grad], lr=0.05)
    before = _snapshot(model2, opt2)
    how = "frozen .* in the model but was trained" if saved is Net else \
        "trained in the model but was frozen"
    with pytest.raises(ValueError, match=f"'b.weight' is {how} when saved; .*load_full_state_dict"):
        tierlift.checkpoint.load(ck, model2, opt2)
    _assert_same(before, _snapshot(model2, opt2))
    tierlift.zero.load_full_state_dict(model2, tierlift.checkpoint.full_state_dict(ck))
    ref, got = _full(model), _full(model2)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_compact_state_resumes_exactly(tmp_path, one_thread):
    """state_dtype='bf16' without offload: its exp_avg_sq_scale (one per 256 elements) was
    sliced as if it held one value per element and its uint8 codes cast to float, so the load
    failed with a bare RuntimeError."""
    def fresh():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 40))
        model = tierlift.zero.shard(net, stage=3, min_unit_numel=1)
        return model, tierlift.optim.AdamW(model.parameters(), lr=0.01, state_dtype="bf16")

    xs = [torch.randn(3, 40, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    model, opt = fresh()
    _train(model, opt, xs[:2])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    _train(model, opt, xs[2:])
    model2, opt2 = fresh()
    tierlift.checkpoint.load(ck, model2, opt2)
    _train(model2, opt2, xs[2:])
    ref, got = _full(model), _full(model2)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


class LateB(Net):
    """Layer b joins the forward later (as an expert first routed to, or a head unfrozen)."""

    use_b = False

    def forward(self, x):
        y = torch.tanh(self.a(x))
        return self.b(y) if self.use_b else y


@pytest.mark.parametrize("saved_after", [0, 2])
@pytest.mark.parametrize("kind", ["none", "torch"])
def test_rolling_back_clears_state_the_checkpoint_lacks(tmp_path, one_thread, kind,
                                                        saved_after):
    """Loading an earlier checkpoint into the optimizer that trained on (a rollback after a
    loss spike): a unit with no state in the checkpoint kept its later moments and step count
    (b 2% off after 2 steps), and a checkpoint saved before any step kept all of them."""
    def fresh():
        net = LateB()
        model = tierlift.zero.shard(net, stage=3, min_unit_numel=1)
        opt = (torch.optim.AdamW if kind == "torch" else tierlift.optim.AdamW)(
            model.parameters(), lr=0.05)
        return net, model, opt

    net, model, opt = fresh()
    _train(model, opt, X[:saved_after])  # b is not used: it has no state
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    net.use_b = True
    _train(model, opt, X[2:])
    tierlift.checkpoint.load(ck, model, opt)
    _train(model, opt, X[:2])
    net2, model2, opt2 = fresh()
    net2.use_b = True
    tierlift.checkpoint.load(ck, model2, opt2)
    _train(model2, opt2, X[:2])
    ref, got = _full(model2), _full(model)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_a_deleted_checksum_file_is_named(tmp_path, one_thread):
    """A checkpoint without manifest.json (an older tierlift's) whose rank00000.sha256 was
    deleted: the error was a bare '[Errno 2] No such file or directory'."""
    model = tierlift.zero.shard(Net(), stage=3, min_unit_numel=1)
    opt = tierlift.optim.AdamW(model.parameters(), lr=0.05)
    _train(model, opt, X[:1])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    os.unlink(os.path.join(ck, "manifest.json"))
    os.unlink(os.path.join(ck, "rank00000.sha256"))
    before = _snapshot(model, opt)
    with pytest.raises(FileNotFoundError, match=r"lacks rank00000.sha256 \(the SHA-256 of "
                       r"rank00000.pt\), so that file cannot be checked"):
        with pytest.warns(UserWarning, match="no manifest.json"):
            tierlift.checkpoint.load(ck, model, opt, verify=False)
    _assert_same(before, _snapshot(model, opt))


def _scheduled(flip: bool, sharded: bool):
    keys = ["no_decay", "decay"] if flip else ["decay", "no_decay"]
    if sharded:
        model, opt = _grouped(keys, "none", None)
    else:
        model = Net()
        groups = {"decay": [model.a.weight, model.b.weight],
                  "no_decay": [model.a.bias, model.b.bias]}
        opt = tierlift.optim.AdamW([{"params": groups[k], **GROUP_OPTS[k]} for k in keys])
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _train_scheduled(model, opt, sched, xs) -> None:
    for x in xs:
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "zero3"])
def test_groups_reordered_under_a_scheduler_are_refused(tmp_path, one_thread, sharded):
    """The groups' hyperparameters follow them by name, but the scheduler's base_lrs (saved
    in `extra`) are by position: each group followed the other's schedule, 10% off in the
    weights after 2 steps. Refused, nothing changed; in the saved order it resumes exactly."""
    model, opt, sched = _scheduled(False, sharded)
    _train_scheduled(model, opt, sched, X[:2])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt, extra={"sched": sched.state_dict()})
    _train_scheduled(model, opt, sched, X[2:])
    model2, opt2, sched2 = _scheduled(True, sharded)
    _train_scheduled(model2, opt2, sched2, X[:1])
    snap = _snapshot if sharded else (lambda m, o: (
        {k: v.clone() for k, v in m.state_dict().items()},
        [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups],
        {i: {k: v.clone() for k, v in s.items()} for i, s in o.state_dict()["state"].items()}))
    before = snap(model2, opt2)
    with pytest.raises(ValueError, match=r"its group 0 was saved group 1\), and the saved "
                       r"groups were driven by an LR scheduler \(initial_lr 0.07 and 0.02\)"):
        tierlift.checkpoint.load(ck, model2, opt2)
    _assert_same(before, snap(model2, opt2))
    model2, opt2, sched2 = _scheduled(False, sharded)
    extra = tierlift.checkpoint.load(ck, model2, opt2)
    sched2.load_state_dict(extra["sched"])
    _train_scheduled(model2, opt2, sched2, X[2:])
    ref, got = (_full(model), _full(model2)) if sharded else (model.state_dict(),
                                                               model2.state_dict())
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_unnamed_checkpoint_with_values_changed_on_purpose_loads(tmp_path, one_thread):
    """Groups in the saved order, built with weight decay 0 everywhere: both look like saved
    group 1, which is no evidence of another order, so it loads by position (the saved
    values win, as they always do) and resumes exactly."""
    def fresh(decay):
        model = tierlift.zero.shard(Net(), stage=3, min_unit_numel=1,
                                    param_group_fn=lambda n, p: "w" if p.dim() > 1 else "b")
        opts = {"w": {"weight_decay": decay, "lr": 0.02}, "b": {"weight_decay": 0.0, "lr": 0.02}}
        return model, tierlift.optim.AdamW(tierlift.zero.param_groups(model, opts))

    model, opt = fresh(0.5)
    _train(model, opt, X[:2])
    ck = str(tmp_path / "ck")
    tierlift.checkpoint.save(ck, model, opt)
    _train(model, opt, X[2:])
    _without_names(ck)
    model2, opt2 = fresh(0.0)
    with pytest.warns(UserWarning, match="no manifest.json"):
        tierlift.checkpoint.load(ck, model2, opt2, verify=False)
    assert [g["weight_decay"] for g in opt2.param_groups] == [0.5, 0.0]
    _train(model2, opt2, X[2:])
    ref, got = _full(model), _full(model2)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
