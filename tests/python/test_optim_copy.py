"""copy.deepcopy and pickling (torch.save(optimizer)) of tierlift's Adam/AdamW. torch's
Optimizer pickles its defaults, state and param groups only. A copy must step as the original
would: compact state (state_dtype="bf16") was once read back as fp32 state (its uint8 codes
converted to floats), and a copy's state_dict() failed. An offloaded optimizer's moments live
in its tiers, not in `state`: its copy restarted Adam from zero moments, silently, so copying
it is refused."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from conformance_util import (
    OFFLOADED,
    assert_bitwise,
    assert_same_snapshot,
    build_model,
    close,
    num_threads,
    snapshot,
    tl_opt,
    train,
)

import tierlift

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")


def _deepcopy(model, opt):
    return copy.deepcopy((model, opt))


def _torch_save(model, opt):
    buf = io.BytesIO()
    torch.save({"model": model, "opt": opt}, buf)
    buf.seek(0)
    got = torch.load(buf, weights_only=False)
    return got["model"], got["opt"]


COPIES = {"deepcopy": _deepcopy, "torch_save": _torch_save}


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize(("state_dtype", "dtype"), [("fp32", torch.float32),
                                                    ("bf16", torch.float32),
                                                    ("bf16", torch.bfloat16),
                                                    ("fp32", torch.bfloat16)])
def test_copy_steps_as_the_original(how, state_dtype, dtype):
    with num_threads(1):
        model = build_model(dtype=dtype)
        opt = tierlift.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=state_dtype)
        train(model, opt, steps=3)
        twin, twin_opt = COPIES[how](model, opt)
        assert twin_opt._state_dtype == state_dtype
        train(model, opt, steps=2, start=3)
        train(twin, twin_opt, steps=2, start=3)
        assert_bitwise(twin, model)
        assert_same_snapshot(snapshot(twin, twin_opt), snapshot(model, opt), "copy")


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("mode", OFFLOADED)
def test_offloaded_copy_is_refused(tmp_path, mode, how):
    with num_threads(1):
        model = build_model()
        opt = tl_opt(mode, model.parameters(), tmp_path)
        try:
            train(model, opt, steps=2)
            before = snapshot(model, opt)
            with pytest.raises(TypeError, match="cannot be pickled or copied.*state_dict"):
                COPIES[how](model, opt)
            with pytest.raises(TypeError, match="cannot be pickled or copied"):
                pickle.dumps(opt)
            assert_same_snapshot(before, snapshot(model, opt), "refused copy")
            train(model, opt, steps=1, start=2)  # and it trains on
        finally:
            close(opt)
