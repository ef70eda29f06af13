"""What schedulers and users do to an offloaded AdamW's param groups and gradients between
steps, in every offload mode, against torch's AdamW on the same model and data:

- hyperparameters edited by hand (lr, betas as a tuple or a list, eps, weight_decay, maximize,
  a tensor lr filled in place) after a step, or between backward and step() (after the overlap
  stepped chunks with the old values);
- gradients set to None for some parameters on some steps (torch skips them: no state change),
  zeroed (torch still steps them: decay and moments change), a parameter frozen mid-training
  with zero_grad(set_to_none=False) (its zero gradient is still stepped), then unfrozen;
- one Parameter shared by two modules (weight tying);
- OneCycleLR / CyclicLR (cycle_momentum: they rewrite betas) stepped per micro-batch under
  gradient accumulation, so the values change after the overlap stepped chunks;
- a group torch's step() refuses (a tensor lr with foreach=True; a key deleted, as by a
  group dict rebuilt by hand): refused by step() before anything changes, as torch's is. The
  overlap's gradient hook raised them inside backward, which stopped half way (a step() after
  the repair then ran on partial gradients); without "decoupled_weight_decay" AdamW stepped
  as Adam, and without "maximize" the step failed half way (offload with one generation then
  refused every later step);
- a parameter frozen when the optimizer was built and unfrozen later, amsgrad switched off, a
  parameter moved to another group: refused before anything changes (the state is laid out
  at construction)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from conformance_util import (
    OFFLOADED,
    assert_matches_torch,
    assert_same_snapshot,
    assert_state_matches_torch,
    batch,
    build_model,
    close,
    snapshot,
    tl_opt,
    torch_opt,
    twin,
)
from torch import nn
from torch.optim import lr_scheduler

import tierlift

pytestmark = [
    pytest.mark.skipif(not tierlift._extension.available(), reason="compiled extension not loaded"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # durable reopens say so
    pytest.mark.filterwarnings("ignore::UserWarning"),  # a scheduler stepped per micro-batch
]

OVERLAP = [m for m in OFFLOADED if "_ov" in m]
STEPS = 8


class TiedNet(nn.Module):
    """The middle weight is one Parameter used by two layers (model.parameters() lists it
    once); the weights span several offload chunks (conformance_util.CHUNK)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(32, 96)
        self.a = nn.Linear(96, 96)
        self.b = nn.Linear(96, 96)
        self.b.weight = self.a.weight
        self.head = nn.Linear(96, 8)

    def forward(self, x):
        x = torch.relu(self.inp(x))
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


def _edit_group(i: int, opt, when: str) -> None:
    """Hand edits of the one group, some after a step, some between backward and step()."""
    g = opt.param_groups[0]
    edits = {
        ("after", 0): lambda: g.update(betas=(0.5, 0.9)),
        ("before", 1): lambda: g["lr"].fill_(2e-2),  # the tensor lr, in place
        ("after", 2): lambda: g.update(eps=1e-3, weight_decay=0.3),
        ("before", 3): lambda: g.update(betas=[0.7, 0.99]),
        ("before", 4): lambda: g.update(maximize=True),
        ("after", 5): lambda: g.update(maximize=False, lr=5e-3),
        ("before", 6): lambda: g.update(weight_decay=0.0, eps=1e-8),
    }
    edit = edits.get((when, i))
    if edit is not None:
        edit()


def _edit_grads(i: int, model: TiedNet) -> None:
    """Between backward and step: no gradient for some parameters on some steps, an all-zero
    one for others."""
    if i in (1, 4):
        model.head.weight.grad = None
    if i == 2:
        model.inp.bias.grad = None
        model.a.bias.grad.zero_()
    if i >= 5:
        model.b.bias.grad.zero_()


def _train_with_edits(model: TiedNet, opt) -> float:
    """STEPS steps with the edits above; the inp layer frozen from step 3 to 5, its last
    gradients kept (zero_grad(set_to_none=False)), so torch still steps it. Returns the most
    chunks an overlapped step kept (0 without overlap)."""
    kept = 0.0
    for i in range(STEPS):
        if i == 3:
            model.inp.requires_grad_(False)
        if i == 6:
            model.inp.requires_grad_(True)
        x, y = batch(0, i)
        F.mse_loss(model(x), y).backward()
        _edit_grads(i, model)
        _edit_group(i, opt, "before")
        opt.step()
        kept = max(kept, getattr(opt, "last_step_stats", {}).get("overlap_kept_chunks", 0.0))
        opt.zero_grad(set_to_none=False)
        _edit_group(i, opt, "after")
    return kept


@pytest.mark.parametrize("mode", OFFLOADED)
def test_group_and_gradient_edits_match_torch(mode, tmp_path, one_thread):
    ref = TiedNet()
    model = twin(ref)
    assert model.b.weight is model.a.weight
    ref_opt = torch_opt(ref.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1)
    opt = tl_opt(mode, model.parameters(), tmp_path, lr=torch.tensor(1e-2), weight_decay=0.1)
    try:
        _train_with_edits(ref, ref_opt)
        kept = _train_with_edits(model, opt)
        assert_matches_torch(model, ref)
        assert_state_matches_torch(opt, ref_opt)
        if mode in OVERLAP:  # the overlap stepped chunks during backward and some were kept
            assert kept > 0
    finally:
        close(opt)


SCHEDULERS = {
    "onecycle": functools.partial(lr_scheduler.OneCycleLR, max_lr=2e-2,
                                  total_steps=3 * STEPS + 1),
    "cyclic": functools.partial(lr_scheduler.CyclicLR, base_lr=1e-3, max_lr=2e-2,
                                step_size_up=2, cycle_momentum=True, base_momentum=0.8,
                                max_momentum=0.95),
}


def _accumulate(model, opt, sched, micro: int = 3) -> None:
    """Gradient accumulation with the scheduler stepped per micro-batch: betas and lr change
    after each backward, so every chunk stepped during backward must use step()'s values."""
    for i in range(4):
        for k in range(micro):
            x, y = batch(0, i, k)
            (F.mse_loss(model(x), y) / micro).backward()
            sched.step()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("sched", list(SCHEDULERS))
@pytest.mark.parametrize("mode", OVERLAP + ["nvme1"])
def test_momentum_scheduler_per_micro_batch_matches_torch(mode, sched, tmp_path, one_thread):
    ref = build_model()
    model = twin(ref)
    ref_opt = torch_opt(ref.parameters())
    opt = tl_opt(mode, model.parameters(), tmp_path)
    try:
        _accumulate(ref, ref_opt, SCHEDULERS[sched](ref_opt))
        _accumulate(model, opt, SCHEDULERS[sched](opt))
        assert_matches_torch(model, ref)
        assert_state_matches_torch(opt, ref_opt)
        assert opt.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"]
    finally:
        close(opt)


def _tensor_lr_with_foreach(group: dict) -> None:
    group["foreach"] = True  # torch's step refuses a tensor lr then


def _deleting(key: str):
    def breaks(group: dict) -> None:
        del group[key]
    return breaks


BROKEN_GROUPS = {
    "tensor_lr_with_foreach": (_tensor_lr_with_foreach, RuntimeError, "lr as a Tensor"),
    "no_eps": (_deleting("eps"), KeyError, "eps"),
    "no_maximize": (_deleting("maximize"), KeyError, "maximize"),
    "no_decoupled_weight_decay": (_deleting("decoupled_weight_decay"), KeyError,
                                  "decoupled_weight_decay"),
}


@pytest.mark.parametrize("broken", list(BROKEN_GROUPS))
@pytest.mark.parametrize("mode", ["none", "cpu", "nvme1", "cpu_ov", "nvme2_ov"])
def test_group_torch_refuses_is_refused_before_any_change(mode, broken, tmp_path, one_thread):
    """torch raises at step(), after a complete backward, with nothing changed; the user
    repairs the group and steps again. The overlap's first gradient hook checks the group too:
    it must leave the error to step()."""
    breaks, error, match = BROKEN_GROUPS[broken]
    ref = build_model()
    model = twin(ref)
    ref_opt = torch_opt(ref.parameters(), lr=torch.tensor(1e-2))
    opt = tl_opt(mode, model.parameters(), tmp_path, lr=torch.tensor(1e-2))
    try:
        for m, o in ((ref, ref_opt), (model, opt)):
            x, y = batch(0, 0)
            F.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
            saved = dict(o.param_groups[0])
            breaks(o.param_groups[0])
            x, y = batch(0, 1)
            F.mse_loss(m(x), y).backward()  # complete, for ours too
            before = snapshot(m, o) if o is opt else None
            with pytest.raises(error, match=match):
                o.step()
            if o is opt:
                assert_same_snapshot(snapshot(m, o), before, "refused step")
            o.param_groups[0].clear()
            o.param_groups[0].update(saved)
            o.step()
            o.zero_grad()
        assert_matches_torch(model, ref)
        assert_state_matches_torch(opt, ref_opt)
    finally:
        close(opt)


def _unfreeze(model, opt, undo: bool = False) -> None:
    model[2].requires_grad_(undo is False)


def _amsgrad_off(model, opt, undo: bool = False) -> None:
    opt.param_groups[0]["amsgrad"] = undo


def _move_to_second_group(model, opt, undo: bool = False) -> None:
    first, second = (g["params"] for g in opt.param_groups)
    if undo:
        first.append(second.pop(0))
    else:
        second.insert(0, first.pop())


LAYOUT_CHANGES = {
    # frozen when built: no state was laid out for it (torch would start it from zeros)
    "unfrozen": (_unfreeze, dict(frozen=True), RuntimeError, "was frozen"),
    # torch steps on without max_exp_avg_sq; the tiers' state kinds are fixed
    "amsgrad_off": (_amsgrad_off, dict(amsgrad=True), ValueError, "amsgrad"),
    # torch keeps a parameter's state wherever it is listed; the tiers lay it out by position
    "moved_between_groups": (_move_to_second_group, dict(groups=True), RuntimeError,
                             "is not the list the optimizer was built with"),
}


@pytest.mark.parametrize("change", list(LAYOUT_CHANGES))
@pytest.mark.parametrize("mode", OFFLOADED)
def test_layout_change_after_steps_is_refused_before_anything_changes(mode, change, tmp_path,
                                                                      one_thread):
    edit, kw, error, match = LAYOUT_CHANGES[change]
    kw = dict(kw)
    model = build_model()
    if kw.pop("frozen", False):
        model[2].requires_grad_(False)
    params = list(model.parameters())
    if kw.pop("groups", False):
        params = [{"params": params[:3]}, {"params": params[3:], "lr": 5e-3}]
    opt = tl_opt(mode, params, tmp_path, **kw)
    try:
        for i in range(2):
            x, y = batch(0, i)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        before = snapshot(model, opt)
        edit(model, opt)
        x, y = batch(0, 2)
        with pytest.raises(error, match=match):  # with overlap, a moved one in backward
            F.mse_loss(model(x), y).backward()
            opt.step()
        edit(model, opt, undo=True)
        assert_same_snapshot(snapshot(model, opt), before, "refused step")
    finally:
        close(opt)

