"""What a user of torch.optim.AdamW does to optimizer.state, done to tierlift's offloaded AdamW:
torch's result, or a clear refusal before anything changes.

- a moment written into optimizer.state[p] (the tiers hold it: refused at step() and at
  state_dict(), which would have used or returned the tiers' value; deleting the key goes on);
- optimizer.state[p] cleared or its "step" reset (honored: the moments restart from zero, or
  the bias correction restarts, as in torch)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from conformance_util import (
    assert_matches_torch,
    assert_same_snapshot,
    assert_state_matches_torch,
    batch,
    build_model,
    close,
    num_threads,
    snapshot,
    tl_opt,
    torch_opt,
    train,
    twin,
)

import tierlift

pytestmark = pytest.mark.skipif(
    not tierlift._extension.available(), reason="compiled extension not loaded"
)

MODES = ["cpu", "cpu_ov", "nvme1", "nvme2_ov", "hybrid_ov"]


def _backward(model, step: int) -> None:
    x, y = batch(0, step)
    F.mse_loss(model(x), y).backward()


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("mode", MODES)
def test_a_moment_written_into_state_is_refused_and_nothing_changes(tmp_path, mode, key):
    model = build_model()
    ref = twin(model)
    opt = tl_opt(mode, model.parameters(), tmp_path)
    ref_opt = torch_opt(ref.parameters())
    p = list(model.parameters())[2]
    with num_threads(1):
        train(model, opt, steps=2)
        train(ref, ref_opt, steps=2)
        _backward(model, 2)
        _backward(ref, 2)
        before = snapshot(model, opt)
        with pytest.raises(RuntimeError, match="or replaced.*clear.*Nothing was changed"):
            opt.state[p][key] = torch.zeros_like(p)  # torch's AdamW would step from these zeros
        dict.update(opt.state[p], {key: torch.zeros_like(p)})  # past it: the step's refusal
        with pytest.raises(
            RuntimeError,
            match=rf"param_groups\[0\]\['params'\]\[2\] has "
            rf"'{key}'.*load_state_dict.*Nothing was changed",
        ):
            opt.step()
        with pytest.raises(RuntimeError, match=f"has '{key}'"):
            opt.state_dict()
        assert key in opt.state[p], "the refusal leaves what the user wrote"
        del opt.state[p][key]
        assert_same_snapshot(snapshot(model, opt), before, "after the refused step")
        opt.step()  # the same gradients: training goes on as if nothing was written
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        train(model, opt, steps=1, start=3)
        train(ref, ref_opt, steps=1, start=3)
    assert_matches_torch(model, ref)
    assert_state_matches_torch(opt, ref_opt)
    close(opt)


def _reset(i, model, opt) -> None:
    ps = list(model.parameters())
    if i == 1:
        opt.state[ps[2]].clear()  # its moments restart from zero
        del opt.state[ps[4]]
    if i == 2:
        opt.state[ps[0]]["step"] = torch.tensor(0.0)  # its bias correction restarts


@pytest.mark.parametrize("mode", MODES)
def test_cleared_state_and_reset_step_count_are_honored(tmp_path, mode):
    model = build_model()
    ref = twin(model)
    opt = tl_opt(mode, model.parameters(), tmp_path)
    ref_opt = torch_opt(ref.parameters())
    with num_threads(1):
        train(model, opt, steps=4, after_step=_reset)
        train(ref, ref_opt, steps=4, after_step=_reset)
    assert_matches_torch(model, ref)
    assert_state_matches_torch(opt, ref_opt)
    close(opt)


def _inf_at(steps):
    return lambda i, loss: loss * float("inf") if i in steps else loss


def _no_empty_entries(opt) -> None:
    """Every entry of optimizer.state and of its state_dict() holds a step count (torch's
    fused AdamW makes step-0 entries on a skipped step, its others none at all)."""
    assert all("step" in s for s in opt.state.values()), "an empty optimizer.state entry"
    assert all("step" in s for s in opt.state_dict()["state"].values())


@pytest.mark.parametrize("mode", MODES)
def test_skipped_first_steps_leave_no_empty_state_entries(tmp_path, mode):
    """GradScaler skips the first steps of fp16 training (its scale starts too high). The
    overlap's worker, stepping ahead, read optimizer.state (a defaultdict) by indexing and so
    left an empty entry for every parameter: in state_dict() too, and added from another
    thread (a concurrent `for p in optimizer.state` could see the dict change size)."""
    model = build_model()
    ref = twin(model)
    opt = tl_opt(mode, model.parameters(), tmp_path)
    ref_opt = torch_opt(ref.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with num_threads(1):
        train(model, opt, steps=2, scaler=scaler, loss_hook=_inf_at({0, 1}))
        train(ref, ref_opt, steps=2, scaler=ref_scaler, loss_hook=_inf_at({0, 1}))
        _no_empty_entries(opt)
        _backward(model, 2)
        if opt._offload.overlap is not None:
            opt._offload.overlap.wait()  # every chunk stepped ahead
        _no_empty_entries(opt)
        opt.step()
        opt.zero_grad()
        _backward(ref, 2)
        ref_opt.step()
        ref_opt.zero_grad()
    assert_matches_torch(model, ref)
    assert_state_matches_torch(opt, ref_opt)
    close(opt)


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
def test_a_moment_written_into_state_is_refused_by_checkpoint_save_and_load(tmp_path, blocking):
    """A checkpoint streams the tiers: it would leave the written moment out (and a load would
    leave it behind over the loaded state). Refused before any file is written or read."""
    model = build_model()
    opt = tl_opt("cpu", model.parameters(), tmp_path)
    p = list(model.parameters())[2]
    with num_threads(1):
        train(model, opt, steps=2)
        tierlift.checkpoint.save(tmp_path / "good", model, opt)
        before = snapshot(model, opt)
        dict.update(opt.state[p], exp_avg=torch.zeros_like(p))  # past state[p]'s refusal
        with pytest.raises(RuntimeError, match=r"has 'exp_avg'.*Nothing was changed"):
            tierlift.checkpoint.save(tmp_path / "ck", model, opt, blocking=blocking).wait()
        assert not any(n.startswith("ck") for n in os.listdir(tmp_path))
        with pytest.raises(RuntimeError, match="has 'exp_avg'"):
            tierlift.checkpoint.load(tmp_path / "good", model, opt)
        del opt.state[p]["exp_avg"]
        assert_same_snapshot(snapshot(model, opt), before, "after the refused save and load")
    close(opt)
