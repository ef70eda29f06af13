"""A user switching from torch.optim.AdamW: checkpoints moved between torch's optimizer and
tierlift's in every mode, each resumed run compared with an uninterrupted torch run, or refused
with a clear error before anything changes.

- step counts saved as numbers (torch before 1.12, converted checkpoints): torch's Adam makes
  them float32 tensors on load; the offloaded step once failed on them with AttributeError,
  after the load had replaced the state; one set by hand in optimizer.state failed the same way;
- a state dict saved with another amsgrad than the offloaded optimizer's state kinds were laid
  out for (or amsgrad=True into compact state): the load replaced the step counts, dropped
  max_exp_avg_sq (or left it zero) and set the group's amsgrad, and every step() then refused
  the group; now the load refuses, before anything changes.
Regression checks of paths that were right: a run moved either way between torch's AdamW and
tierlift's through torch.distributed.checkpoint.state_dict's get_state_dict/set_state_dict
(set_state_dict first steps a fresh optimizer at lr 0 to create its state), with named
parameters (param_names) and a scheduler that cycles betas (CyclicLR) or cuts the lr
(ReduceLROnPlateau), its state saved and loaded beside the optimizer's.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from conformance_util import (
    COMPACT_MODES,
    LR,
    MODES,
    OFFLOADED,
    assert_matches_torch,
    assert_same_snapshot,
    assert_state_matches_torch,
    build_model,
    close,
    snapshot,
    tl_opt,
    torch_opt,
    train,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import lr_scheduler

import tierlift

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")


def _torch_checkpoint(steps: int = 3, **kw) -> tuple:
    """A model trained `steps` steps by torch's AdamW, its state dict and the optimizer's."""
    model = build_model()
    opt = torch_opt(model.parameters(), **kw)
    train(model, opt, steps=steps)
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize("number", [int, float])
@pytest.mark.parametrize("mode", list(MODES))
def test_step_counts_saved_as_numbers_resume_as_torch(mode, number, tmp_path, one_thread):
    ref = build_model()
    ref_opt = torch_opt(ref.parameters())
    train(ref, ref_opt, steps=5)
    sd_model, sd_opt = _torch_checkpoint()
    for st in sd_opt["state"].values():
        st["step"] = number(st["step"])
    model = build_model(seed=5)
    model.load_state_dict(sd_model)
    opt = tl_opt(mode, model.parameters(), tmp_path)
    try:
        opt.load_state_dict(sd_opt)
        train(model, opt, steps=2, start=3)
        assert_matches_torch(model, ref)
        assert_state_matches_torch(opt, ref_opt)
        steps = [st["step"] for st in opt.state_dict()["state"].values()]
        assert all(isinstance(s, torch.Tensor) and s.dtype == torch.float32 for s in steps)
    finally:
        close(opt)


@pytest.mark.parametrize("mode", list(MODES))
def test_step_count_set_to_a_number_restarts_bias_correction(mode, tmp_path, one_thread):
    """`optimizer.state[p]["step"] = 0` after some steps, compared with torch's AdamW given the
    float32 tensor it keeps there."""
    ref = build_model()
    ref_opt = torch_opt(ref.parameters())
    model = build_model()
    opt = tl_opt(mode, model.parameters(), tmp_path)
    try:
        for o, m, count in ((ref_opt, ref, torch.tensor(0.0)), (opt, model, 0)):
            train(m, o, steps=2)
            o.state[m[2].weight]["step"] = count
            train(m, o, steps=2, start=2)
        assert_matches_torch(model, ref)
        assert_state_matches_torch(opt, ref_opt)
    finally:
        close(opt)


# (mode, amsgrad of the saved dict): compact state has no amsgrad of its own to differ from
AMSGRAD_CASES = [(m, saved) for m in OFFLOADED for saved in (True, False)] + [
    ("c_none", True), ("c_cpu_ov", True)]


@pytest.mark.parametrize(("mode", "saved_amsgrad"), AMSGRAD_CASES)
def test_load_with_other_amsgrad_refused_before_anything_changes(mode, saved_amsgrad, tmp_path,
                                                                 one_thread):
    amsgrad = not saved_amsgrad and mode not in COMPACT_MODES
    _, sd_opt = _torch_checkpoint(amsgrad=saved_amsgrad)
    model = build_model()
    opt = tl_opt(mode, model.parameters(), tmp_path, amsgrad=amsgrad)
    try:
        train(model, opt, steps=2)
        before = snapshot(model, opt)
        with pytest.raises(ValueError, match=r"amsgrad=True in param_groups\[0\]"
                           if saved_amsgrad else r"amsgrad=False in param_groups\[0\]"):
            opt.load_state_dict(sd_opt)
        assert_same_snapshot(snapshot(model, opt), before, "refused load")
        train(model, opt, steps=1, start=2)  # still steps
    finally:
        close(opt)


@pytest.mark.parametrize("mode", ["cpu", "nvme2_ov"])
def test_load_with_the_same_amsgrad_resumes_as_torch(mode, tmp_path, one_thread):
    ref = build_model()
    ref_opt = torch_opt(ref.parameters(), amsgrad=True)
    train(ref, ref_opt, steps=5)
    sd_model, sd_opt = _torch_checkpoint(amsgrad=True)
    model = build_model(seed=5)
    model.load_state_dict(sd_model)
    opt = tl_opt(mode, model.parameters(), tmp_path, amsgrad=True)
    try:
        opt.load_state_dict(sd_opt)
        train(model, opt, steps=2, start=3)
        assert_matches_torch(model, ref)
        assert_state_matches_torch(opt, ref_opt)
    finally:
        close(opt)


SCHEDULERS = {
    "cyclic_betas": functools.partial(lr_scheduler.CyclicLR, base_lr=LR / 10, max_lr=LR,
                                      step_size_up=2, cycle_momentum=True, base_momentum=0.8,
                                      max_momentum=0.95),
    "plateau": functools.partial(lr_scheduler.ReduceLROnPlateau, patience=0, factor=0.5),
}


def _train_scheduled(model, opt, sched, steps: int, start: int = 0) -> None:
    for i in range(start, start + steps):
        train(model, opt, steps=1, start=i)
        if isinstance(sched, lr_scheduler.ReduceLROnPlateau):
            sched.step(1.0)  # no improvement: halves the lr from the second step on
        else:
            sched.step()


@pytest.mark.parametrize("sched_name", list(SCHEDULERS))
@pytest.mark.parametrize("to_torch", [True, False], ids=["to_torch", "from_torch"])
@pytest.mark.parametrize("mode", list(MODES))
def test_run_moved_through_dcp_state_dict_helpers(mode, to_torch, sched_name, tmp_path,
                                                  one_thread):
    make = SCHEDULERS[sched_name]
    ref = build_model()
    ref_opt = torch_opt(ref.named_parameters())
    _train_scheduled(ref, ref_opt, make(ref_opt), steps=5)

    def build(model, ours: bool):
        params = model.named_parameters()
        return tl_opt(mode, params, tmp_path) if ours else torch_opt(params)

    opened = []
    try:
        model = build_model()
        opt = build(model, ours=to_torch)
        opened.append(opt)
        sched = make(opt)
        _train_scheduled(model, opt, sched, steps=3)
        sd_model, sd_opt = copy.deepcopy(get_state_dict(model, opt))
        sd_sched = copy.deepcopy(sched.state_dict())
        close(opt)
        model = build_model(seed=5)
        opt = build(model, ours=not to_torch)
        opened.append(opt)
        sched = make(opt)
        set_state_dict(model, opt, model_state_dict=sd_model, optim_state_dict=sd_opt)
        sched.load_state_dict(sd_sched)
        _train_scheduled(model, opt, sched, steps=2, start=3)
        assert_matches_torch(model, ref)
        assert_state_matches_torch(opt, ref_opt)
        assert opt.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"]
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    finally:
        for o in opened:
            close(o)
