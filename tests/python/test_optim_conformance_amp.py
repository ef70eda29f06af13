"""Conformance of tierlift.optim.AdamW with torch.optim.AdamW under mixed precision, in every
mode: torch.amp.GradScaler (plain, unscale_ + clipping, steps whose scaled loss overflows and
must be skipped with weights, state and step counts unchanged) and bf16 parameters with fp32
master weights. Shared pieces: conformance_util.py, conformance_actions.py."""

from __future__ import annotations

import copy

import pytest
import torch
from conformance_actions import ACTIONS, CLIPS
from conformance_util import (
    COMPACT_MODES,
    MODES,
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
    rel_err,
    snapshot,
    timings,
    tl_opt,
    torch_opt,
    train,
    twin,
)

import tierlift

pytestmark = [
    pytest.mark.skipif(not tierlift._extension.available(), reason="compiled extension not loaded"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # skipped steps and reopens say so
]

OVERFLOW_STEP = 2


@pytest.fixture(autouse=True)
def _one_thread():
    with num_threads(1):
        yield


def _scaler():
    # growth every 2 clean steps: the scale changes within the run (up, and down at overflow)
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)


def _unscale_clip(scaler):
    def hook(i, model, opt):
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIPS)
    return hook


def _inject_inf(i, model, opt):
    if i == OVERFLOW_STEP:
        with torch.no_grad():
            model[2].weight.grad[3, 5] = float("inf")


def _overflow_loss(i, loss):
    return loss * 3e38 if i == OVERFLOW_STEP else loss  # finite; inf once scaled


def _scaler_action(name: str, skipped: list):
    """train() keyword arguments; appends to `skipped` the snapshots taken around the step that
    must be skipped (before its forward, after its step)."""
    scaler = _scaler()
    kw = {"scaler": scaler}
    if name == "scaler_unscale_clip":
        kw["before_step"] = _unscale_clip(scaler)
    if name == "scaler_overflow":
        kw["loss_hook"] = _overflow_loss
    if name == "scaler_inject_inf":
        kw["before_step"] = _inject_inf
    if name in ("scaler_overflow", "scaler_inject_inf"):
        def watch(i, model, opt):
            if i in (OVERFLOW_STEP - 1, OVERFLOW_STEP):
                skipped.append(snapshot(model, opt))
            if i == OVERFLOW_STEP:
                skipped.append(scaler.get_scale())
        kw["after_step"] = watch
    return kw


SCALER_ACTIONS = ["scaler", "scaler_unscale_clip", "scaler_overflow", "scaler_inject_inf"]
SCALER_CASES = [pytest.param(c.values[0], a, id=f"{c.id}-{a}") for a in SCALER_ACTIONS
                for c in timings(MODES, variants=a == "scaler_overflow")]


@pytest.mark.parametrize(("case", "action"), SCALER_CASES)
def test_grad_scaler_matches_torch(case, action, tmp_path):
    mode, seed, threads = case
    with num_threads(threads):
        ref = build_model(seed)
        model = twin(ref)
        ref_opt = torch_opt(ref.parameters())
        ref_skipped: list = []
        train(ref, ref_opt, seed=seed, **_scaler_action(action, ref_skipped))
        opt = tl_opt(mode, model.parameters(), tmp_path)
        skipped: list = []
        try:
            train(model, opt, seed=seed, **_scaler_action(action, skipped))
            if skipped:
                before, after, scale = skipped
                assert scale == ref_skipped[2], f"scale after the overflow {scale}"
                assert_same_snapshot(after, before, "the step with inf gradients")
            assert_matches_torch(model, ref)
            assert_state_matches_torch(opt, ref_opt)
        finally:
            close(opt)


@pytest.mark.parametrize("action", ["scaler_unscale_clip", "scaler_overflow"])
@pytest.mark.parametrize("mode", [m for m in COMPACT_MODES if m != "c_none"])
def test_grad_scaler_compact_bitwise(mode, action, tmp_path):
    """Compact state: every mode bit-identical to the in-memory compact optimizer."""
    ref = build_model()
    model = twin(ref)
    ref_opt = tl_opt("c_none", ref.parameters(), tmp_path)
    train(ref, ref_opt, **_scaler_action(action, []))
    opt = tl_opt(mode, model.parameters(), tmp_path)
    try:
        skipped: list = []
        train(model, opt, **_scaler_action(action, skipped))
        if skipped:
            assert_same_snapshot(skipped[1], skipped[0], "the step with inf gradients")
        assert_bitwise(model, ref)
        assert_same_snapshot((flat(model), opt.state_dict()), (flat(ref), ref_opt.state_dict()),
                             "compact state")
    finally:
        close(opt)


# bf16 parameters. The reference is MasterAdamW (conformance_util): torch's AdamW on fp32 masters
# rounded into the bf16 weights, masters restarted element by element from weights changed
# outside the optimizer (what offload="none" does). Tolerance "one bf16 rounding step per
# update": a master 1e-7 away from torch's may round to the neighbouring bf16 value, once per
# step, so each weight may be STEPS bf16 ulps off; the masters themselves within 1e-6 relative
# as fp32 weights are (they follow torch's fp32 arithmetic). Stale gradients or lost weight
# edits are tens of ulps (lr 1e-2) or 10% of a weight.
BF16_ACTIONS = ["plain", "grad_data_mul", "w_mul", "w_load_state_dict", "w_mul_before_step"]
BF16_MODES = ["none", "cpu", "cpu_ov", "nvme1", "nvme2_ov", "durable1"]


def _bf16_ulp(w: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |w| (8 significant bits)."""
    exp = torch.frexp(w.float().abs().clamp_min(2.0**-126)).exponent
    return torch.ldexp(torch.ones_like(w.float()), exp - 8)


def _assert_bf16_matches(model, opt, ref, ref_opt, steps: int) -> None:
    a, b = flat(model), flat(ref)
    off = (a - b).abs() / _bf16_ulp(b)
    n = int((a != b).sum())
    assert float(off.max()) <= steps, (
        f"bf16 weights: {n} of {a.numel()} differ, up to {float(off.max()):.0f} bf16 ulps "
        f"(rel_err={rel_err(model, ref):.2e}, tol {steps} ulps)")
    sd = opt.state_dict()["state"]
    masters = torch.cat([sd[i]["master"].flatten() for i in range(len(ref_opt.masters))])
    rm = torch.cat([m.flatten() for m in ref_opt.masters])
    err = float((masters - rm).abs().max() / rm.abs().max())
    assert err <= 1e-6, f"fp32 masters: rel_err={err:.2e} ({n} bf16 weights differ)"


@pytest.mark.parametrize("action", BF16_ACTIONS)
@pytest.mark.parametrize("mode", BF16_MODES)
def test_bf16_params_match_master_reference(mode, action, tmp_path):
    ref = build_model(dtype=torch.bfloat16)
    model = twin(ref)
    ref_opt = MasterAdamW(ref.parameters())
    train(ref, ref_opt, **ACTIONS[action](ref_opt))
    opt = tl_opt(mode, model.parameters(), tmp_path)
    try:
        train(model, opt, **ACTIONS[action](opt))
        _assert_bf16_matches(model, opt, ref, ref_opt, STEPS)
    finally:
        close(opt)


@pytest.mark.parametrize("order", ["opt_first", "model_first"])
@pytest.mark.parametrize("mode", ["none", "cpu_ov", "nvme1", "durable2"])
def test_bf16_resume_matches_uninterrupted(mode, order, tmp_path):
    """As test_resume_matches_uninterrupted_torch with bf16 parameters: the checkpoint carries
    the fp32 masters, so the resumed run goes on from them, not from the rounded weights."""
    ref = build_model(dtype=torch.bfloat16)
    ref_opt = MasterAdamW(ref.parameters())
    train(ref, ref_opt, steps=5)
    model = build_model(dtype=torch.bfloat16)
    opt = tl_opt(mode, model.parameters(), tmp_path)
    train(model, opt, steps=3)
    sd_model, sd_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train(model, opt, steps=1, start=3)
    close(opt)
    fresh = build_model(seed=50, dtype=torch.bfloat16)
    opt = tl_opt(mode, fresh.parameters(), tmp_path)
    try:
        if order == "opt_first":
            opt.load_state_dict(sd_opt)
            fresh.load_state_dict(sd_model)
        else:
            fresh.load_state_dict(sd_model)
            opt.load_state_dict(sd_opt)
        train(fresh, opt, steps=2, start=3)
        _assert_bf16_matches(fresh, opt, ref, ref_opt, 5)
    finally:
        close(opt)
