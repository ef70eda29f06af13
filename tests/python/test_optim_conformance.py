"""Conformance of tierlift.optim.AdamW with torch.optim.AdamW in every mode (plain, offload to
cpu / nvme / hybrid, overlap, one or two NVMe generations, durable), under what users do around
an optimizer: accumulation, clipping, schedulers, gradients and weights edited outside the
optimizer, resuming from checkpoints, bf16 parameters. Each case trains a tiny MLP with both
optimizers on identical copies and data (conformance_util.py); compact state is compared bit for
bit with tierlift's own in-memory compact optimizer. GradScaler and torch's own optimizer
configurations: test_optim_conformance_amp.py."""

from __future__ import annotations

import copy

import pytest
import torch
from conformance_actions import ACTIONS, CLIPS, NO_CLIP, clip_norm
from conformance_util import (
    COMPACT_MODES,
    MODES,
    OFFLOADED,
    assert_bitwise,
    assert_matches_torch,
    assert_same_snapshot,
    assert_state_matches_torch,
    build_model,
    close,
    flat,
    num_threads,
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
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # durable reopens say so
]


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread unless a case asks for two (see conformance_util.timings)."""
    with num_threads(1):
        yield


def _compare_with_torch(case, tmp_path, action, **tl_kw):
    mode, seed, threads = case
    with num_threads(threads):
        ref = build_model(seed)
        model = twin(ref)
        ref_opt = torch_opt(ref.parameters())
        train(ref, ref_opt, seed=seed, **ACTIONS[action](ref_opt))
        opt = tl_opt(mode, model.parameters(), tmp_path, **tl_kw)
        try:
            train(model, opt, seed=seed, **ACTIONS[action](opt))
            assert_matches_torch(model, ref)
            assert_state_matches_torch(opt, ref_opt)
        finally:
            close(opt)


# Which modes each kind of action can tell apart. Gradient-side actions: the overlap modes
# (chunks stepped during backward, before the action), and one mode per other
# way of reading gradients (resident, streamed; durable's gradient log reads them in step() as
# these do, and runs with the weight edits, resume, GradScaler). Weight edits: every mode keeps
# its own master copy somewhere.
GRAD_ACTIONS = ["accumulate", "clip_norm_clips", "clip_norm_noop", "clip_value", "lambda_lr",
                "onecycle", "grad_data_mul", "grad_numpy_mul", "grad_mul", "grad_replace",
                "state_dict_before_step", "opt_load_before_step", "skip_step"]
WEIGHT_ACTIONS = ["w_load_state_dict", "w_mul", "w_data_copy_ema", "w_numpy"]
GRAD_MODES = ["none", "cpu", "nvme2", "cpu_ov", "cpu_ov_spare", "nvme2_ov", "hybrid_ov"]
# The second timing (seed 1, two threads) for the actions whose outcome raced with backward.
RACY = ["accumulate", "grad_numpy_mul", "state_dict_before_step", "opt_load_before_step"]


def _cases(actions, modes) -> list:
    return [pytest.param(c.values[0], a, id=f"{c.id}-{a}")
            for a in actions for c in timings(modes, variants=a in RACY)]


ACTION_CASES = (_cases(["plain"], MODES) + _cases(GRAD_ACTIONS, GRAD_MODES)
                + _cases(WEIGHT_ACTIONS + ["w_mul_before_step"], MODES))


@pytest.mark.parametrize(("case", "action"), ACTION_CASES)
def test_action_matches_torch(case, action, tmp_path):
    _compare_with_torch(case, tmp_path, action)


@pytest.mark.parametrize(("case", "clips"), [
    pytest.param(c.values[0], clips, id=f"{c.id}-{'clips' if clips else 'noop'}")
    for clips in (True, False) for c in timings(OFFLOADED, variants=False)])
def test_max_grad_norm_is_clip_grad_norm(case, clips, tmp_path):
    """The optimizer's own max_grad_norm against clip_grad_norm_ + torch's step."""
    mode, seed, threads = case
    max_norm = CLIPS if clips else NO_CLIP
    with num_threads(threads):
        ref = build_model(seed)
        model = twin(ref)
        ref_opt = torch_opt(ref.parameters())
        train(ref, ref_opt, seed=seed, **clip_norm(max_norm, clips))
        opt = tl_opt(mode, model.parameters(), tmp_path, max_grad_norm=max_norm)
        try:
            train(model, opt, seed=seed)
            assert_matches_torch(model, ref)
            assert_state_matches_torch(opt, ref_opt)
        finally:
            close(opt)


def test_max_grad_norm_without_offload_refused_or_exact():
    """offload="none": max_grad_norm either clips as clip_grad_norm_ does or is refused when
    the optimizer is built (never silently ignored)."""
    ref = build_model()
    model = twin(ref)
    ref_opt = torch_opt(ref.parameters())
    train(ref, ref_opt, **clip_norm(CLIPS, True))
    try:
        opt = tierlift.optim.AdamW(model.parameters(), lr=1e-2, max_grad_norm=CLIPS)
    except ValueError as e:
        assert "max_grad_norm" in str(e)
        return
    train(model, opt)
    assert_matches_torch(model, ref)


@pytest.mark.parametrize("case", timings(MODES, variants=False))
def test_add_param_group_exact_or_refused_first(case, tmp_path):
    """A head added as a second group after step 1 (its gradients accumulated meanwhile, as in
    torch, whose zero_grad() clears only the optimizer's own parameters). Offload may refuse it,
    with nothing changed; the user then trains on without it, compared with torch doing so."""
    mode, seed, threads = case

    def run(opt_fn, add: bool) -> tuple:
        torch.manual_seed(seed)
        body, head = build_model(seed), torch.nn.Linear(8, 8)
        opt = opt_fn(body.parameters())
        refused = []

        def hook(i, model, opt):
            if i != 1 or not add:
                return
            before = snapshot(body, opt)
            try:
                opt.add_param_group({"params": list(head.parameters()), "lr": 5e-3})
            except (RuntimeError, ValueError) as e:
                refused.append(str(e))
                assert_same_snapshot(snapshot(body, opt), before, "refused add_param_group")
                assert len(opt.param_groups) == 1

        try:
            train(torch.nn.Sequential(*body, head), opt, seed=seed, after_step=hook)
        finally:
            close(opt)
        return torch.nn.Sequential(body, head), refused

    with num_threads(threads):
        model, refused = run(lambda ps: tl_opt(mode, ps, tmp_path), add=True)
        if refused:
            assert "add_param_group" in refused[0], refused[0]
        ref, _ = run(torch_opt, add=not refused)
        assert_matches_torch(model, ref)


@pytest.mark.parametrize("order", ["opt_first", "model_first"])
@pytest.mark.parametrize("case", timings(MODES, variants=False))
def test_resume_matches_uninterrupted_torch(case, order, tmp_path):
    """Checkpoint at step 3, train one more step (lost), then load the checkpoint into a fresh
    model and optimizer (built with other weights, in the same nvme_path: a durable optimizer
    reopens the newer state first) in either order and train on."""
    mode, seed, threads = case
    with num_threads(threads):
        ref = build_model(seed)
        ref_opt = torch_opt(ref.parameters())
        train(ref, ref_opt, seed=seed, steps=5)
        model = build_model(seed)
        opt = tl_opt(mode, model.parameters(), tmp_path)
        train(model, opt, seed=seed, steps=3)
        # torch.save(...) in memory: a state dict holds the live tensors
        sd_model, sd_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        train(model, opt, seed=seed, steps=1, start=3)
        close(opt)
        fresh = build_model(seed + 50)
        opt = tl_opt(mode, fresh.parameters(), tmp_path)
        try:
            if order == "opt_first":
                opt.load_state_dict(sd_opt)
                fresh.load_state_dict(sd_model)
            else:
                fresh.load_state_dict(sd_model)
                opt.load_state_dict(sd_opt)
            train(fresh, opt, seed=seed, steps=2, start=3)
            assert_matches_torch(fresh, ref)
            assert_state_matches_torch(opt, ref_opt)
        finally:
            close(opt)


# Compact state: every mode bit-identical to the in-memory compact optimizer under the same
# actions (compact moments are not torch's, so torch is no reference here).
COMPACT_ACTIONS = ["plain", "accumulate", "grad_numpy_mul", "w_mul", "w_mul_before_step"]
COMPACT_OFFLOADED = [m for m in COMPACT_MODES if m != "c_none"]
COMPACT_CASES = [pytest.param(c.values[0], a, id=f"{c.id}-{a}")
                 for a in COMPACT_ACTIONS for c in timings(COMPACT_OFFLOADED, variants=False)]


def _assert_same_as(model, opt, ref, ref_opt) -> None:
    assert_bitwise(model, ref)
    assert_same_snapshot((flat(model), opt.state_dict()), (flat(ref), ref_opt.state_dict()),
                         "compact state")


@pytest.mark.parametrize(("case", "action"), COMPACT_CASES)
def test_compact_state_bitwise_across_modes(case, action, tmp_path):
    mode, seed, threads = case
    with num_threads(threads):
        ref = build_model(seed)
        model = twin(ref)
        ref_opt = tl_opt("c_none", ref.parameters(), tmp_path)
        train(ref, ref_opt, seed=seed, **ACTIONS[action](ref_opt))
        opt = tl_opt(mode, model.parameters(), tmp_path)
        try:
            train(model, opt, seed=seed, **ACTIONS[action](opt))
            _assert_same_as(model, opt, ref, ref_opt)
        finally:
            close(opt)


@pytest.mark.parametrize("mode", COMPACT_OFFLOADED)
def test_compact_resume_bitwise(mode, tmp_path):
    """A compact checkpoint loaded into a fresh offloaded optimizer (optimizer first, then the
    model) continues exactly as the uninterrupted in-memory compact run."""
    ref = build_model()
    ref_opt = tl_opt("c_none", ref.parameters(), tmp_path)
    train(ref, ref_opt, steps=5)
    model = build_model()
    opt = tl_opt(mode, model.parameters(), tmp_path)
    train(model, opt, steps=3)
    sd_model, sd_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    close(opt)
    fresh = build_model(seed=50)
    opt = tl_opt(mode, fresh.parameters(), tmp_path)
    try:
        opt.load_state_dict(sd_opt)
        fresh.load_state_dict(sd_model)
        train(fresh, opt, steps=2, start=3)
        _assert_same_as(fresh, opt, ref, ref_opt)
    finally:
        close(opt)
