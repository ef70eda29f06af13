"""device_fraction under the optimizer conformance suite's user actions: an offloaded AdamW whose
first parameters keep their state beside them must give torch.optim.AdamW's weights and state
whatever the user does around it (accumulation, clipping, schedulers, gradient and weight edits,
GradScaler, state dicts loaded before or after the first step, into another fraction), exactly
as the all-offloaded modes do (test_optim_conformance*.py, whose modes leave the device part out).

The MLP (conformance_util.build_model) has 13256 elements: FIRST keeps the first layer (3168)
on the device, MOST all but the last layer (12480), so gradient actions on model[2] hit the
device part with MOST and the offloaded part with FIRST."""

from __future__ import annotations

import copy

import pytest
import torch
from conformance_actions import ACTIONS
from conformance_util import (
    STEPS,
    MasterAdamW,
    assert_bitwise,
    assert_matches_torch,
    assert_same_snapshot,
    assert_state_matches_torch,
    build_model,
    close,
    flat,
    num_threads,
    snapshot,
    tl_opt,
    torch_opt,
    train,
    twin,
)

import tierlift

pytestmark = [
    pytest.mark.skipif(not tierlift._extension.available(), reason="compiled extension not loaded"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

FIRST, MOST = 0.3, 0.95
DEVICE_PARAMS = {FIRST: 2, MOST: 4}
MODES = ["cpu", "cpu_ov", "nvme2_ov"]


@pytest.fixture(autouse=True)
def _one_thread():
    with num_threads(1):
        yield


def _keep_zero_grads(i, model, opt):
    """zero_grad(set_to_none=False): the next backward accumulates into zeroed gradients."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


def _edit_group(i, model, opt):
    if i == 2:
        for g in opt.param_groups:
            g["weight_decay"] = 0.3
            g["betas"] = (0.8, 0.99)


def _lr_before_step(i, model, opt):
    """A schedule written by hand after backward (the overlap already stepped chunks)."""
    for g in opt.param_groups:
        g["lr"] = 1e-2 / (1 + i)


def _drop_grad(index):
    def hook(i, model, opt):
        if i == 2:
            list(model.parameters())[index].grad = None  # torch leaves it unstepped
    return hook


EXTRA = {
    "zero_grad_keep": lambda opt: {"after_step": _keep_zero_grads},
    "edit_group": lambda opt: {"after_step": _edit_group},
    "lr_before_step": lambda opt: {"before_step": _lr_before_step},
    "warm_restarts": lambda opt: {"sched": torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
        opt, T_0=2)},
    "drop_first_grad": lambda opt: {"before_step": _drop_grad(0)},
    "drop_last_grad": lambda opt: {"before_step": _drop_grad(-1)},
}
ALL_ACTIONS = {**ACTIONS, **EXTRA}


@pytest.mark.parametrize("fraction", [FIRST, MOST])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("action", list(ALL_ACTIONS))
def test_action_matches_torch(action, mode, fraction, tmp_path):
    ref = build_model()
    model = twin(ref)
    ref_opt = torch_opt(ref.parameters())
    train(ref, ref_opt, **ALL_ACTIONS[action](ref_opt))
    opt = tl_opt(mode, model.parameters(), tmp_path, device_fraction=fraction)
    try:
        train(model, opt, **ALL_ACTIONS[action](opt))
        assert opt.last_step_stats["device_part_params"] == DEVICE_PARAMS[fraction]
        assert_matches_torch(model, ref)
        assert_state_matches_torch(opt, ref_opt)
    finally:
        close(opt)


def _scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)


def _inject_inf(index):
    def hook(i, model, opt):
        if i == 2:
            with torch.no_grad():
                list(model.parameters())[index].grad.view(-1)[5] = float("inf")
    return hook


@pytest.mark.parametrize("index", [0, 2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_grad_scaler_skipped_step_matches_torch(mode, index, tmp_path):
    """An inf gradient in the device part (index 0), or outside it: the step is skipped
    everywhere, the scale backs off as torch's, and training goes on as torch's."""
    ref = build_model()
    model = twin(ref)
    ref_opt = torch_opt(ref.parameters())
    train(ref, ref_opt, scaler=_scaler(), before_step=_inject_inf(index))
    opt = tl_opt(mode, model.parameters(), tmp_path, device_fraction=FIRST)
    seen = []

    def watch(i, model, opt):
        if i in (1, 2):
            seen.append(snapshot(model, opt))
    try:
        train(model, opt, scaler=_scaler(), before_step=_inject_inf(index), after_step=watch)
        assert_same_snapshot(seen[1], seen[0], "the step with an inf gradient")
        assert_matches_torch(model, ref)
        assert_state_matches_torch(opt, ref_opt)
    finally:
        close(opt)


@pytest.mark.parametrize("order", ["opt_first", "model_first"])
@pytest.mark.parametrize(("saved", "loaded"), [(FIRST, 0.0), (0.0, MOST), (MOST, FIRST),
                                                (FIRST, FIRST)])
@pytest.mark.parametrize("mode", ["cpu", "cpu_ov"])
def test_resume_into_another_fraction_matches_torch(mode, saved, loaded, order, tmp_path):
    ref = build_model()
    ref_opt = torch_opt(ref.parameters())
    train(ref, ref_opt, steps=5)
    model = build_model()
    opt = tl_opt(mode, model.parameters(), tmp_path, device_fraction=saved)
    train(model, opt, steps=3)
    sd_model, sd_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train(model, opt, steps=1, start=3)  # lost
    close(opt)
    fresh = build_model(50)
    opt = tl_opt(mode, fresh.parameters(), tmp_path, device_fraction=loaded)
    try:
        if order == "opt_first":
            opt.load_state_dict(sd_opt)
            fresh.load_state_dict(sd_model)
        else:
            fresh.load_state_dict(sd_model)
            opt.load_state_dict(sd_opt)
        train(fresh, opt, steps=2, start=3)
        assert_matches_torch(fresh, ref)
        assert_state_matches_torch(opt, ref_opt)
    finally:
        close(opt)


@pytest.mark.parametrize("mode", ["cpu", "cpu_ov"])
def test_torch_state_dict_loads_before_the_first_step(mode, tmp_path):
    """torch's AdamW checkpoint into a fresh device-fraction optimizer, and the reverse."""
    ref = build_model()
    ref_opt = torch_opt(ref.parameters())
    train(ref, ref_opt, steps=3)
    model = twin(ref)
    opt = tl_opt(mode, model.parameters(), tmp_path, device_fraction=MOST)
    try:
        opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
        train(model, opt, steps=2, start=3)
        back = twin(model)
        back_opt = torch_opt(back.parameters())
        back_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    finally:
        close(opt)
    train(ref, ref_opt, steps=2, start=3)
    assert_matches_torch(model, ref)
    train(back, back_opt, steps=1, start=5)
    train(ref, ref_opt, steps=1, start=5)
    assert_matches_torch(back, ref)
    assert_state_matches_torch(back_opt, ref_opt)


@pytest.mark.parametrize("action", ["plain", "w_mul", "w_mul_before_step", "grad_data_mul"])
@pytest.mark.parametrize("mode", ["cpu", "cpu_ov"])
def test_bf16_params_match_master_reference(mode, action, tmp_path):
    ref = build_model(dtype=torch.bfloat16)
    model = twin(ref)
    ref_opt = MasterAdamW(ref.parameters())
    train(ref, ref_opt, **ACTIONS[action](ref_opt))
    opt = tl_opt(mode, model.parameters(), tmp_path, device_fraction=MOST)
    try:
        train(model, opt, **ACTIONS[action](opt))
        a, b = flat(model), flat(ref)
        ulp = torch.ldexp(torch.ones_like(b), torch.frexp(
            b.abs().clamp_min(2.0**-126)).exponent - 8)
        assert float(((a - b).abs() / ulp).max()) <= STEPS
        sd = opt.state_dict()["state"]
        masters = torch.cat([sd[i]["master"].flatten() for i in range(len(ref_opt.masters))])
        rm = torch.cat([m.flatten() for m in ref_opt.masters])
        assert float((masters - rm).abs().max() / rm.abs().max()) <= 1e-6
    finally:
        close(opt)


@pytest.mark.parametrize("action", ["plain", "accumulate", "w_mul_before_step", "zero_grad_keep",
                                    "drop_first_grad"])
@pytest.mark.parametrize("mode", ["c_cpu_ov", "c_nvme2_ov"])
def test_compact_state_bitwise(mode, action, tmp_path):
    ref = build_model()
    model = twin(ref)
    ref_opt = tl_opt("c_none", ref.parameters(), tmp_path)
    train(ref, ref_opt, **ALL_ACTIONS[action](ref_opt))
    opt = tl_opt(mode, model.parameters(), tmp_path, device_fraction=MOST)
    try:
        train(model, opt, **ALL_ACTIONS[action](opt))
        assert_bitwise(model, ref)
        assert_same_snapshot((flat(model), opt.state_dict()), (flat(ref), ref_opt.state_dict()),
                             "compact state")
    finally:
        close(opt)
