"""A user switching from torch.optim.AdamW: checkpoints moved between torch's optimizer and
tierlift's in every mode, each resumed run compared with an uninterrupted torch run, or refused
with a clear error before anything changes.

- step counts saved as numbers (torch before 1.12, converted checkpoints): torch's Adam makes
  them float32 tensors on load; the offloaded step once failed on them with AttributeError,
  after the load had replaced the state; one set by hand in optimizer.state failed the same way;
"""

from __future__ import annotations

import copy

import pytest
import torch
from conformance_util import (
    MODES,
    assert_matches_torch,
    assert_state_matches_torch,
    build_model,
    close,
    tl_opt,
    torch_opt,
    train,
)

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
