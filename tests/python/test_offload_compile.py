"""torch.compile(optimizer.step), as torch's "compiling the optimizer" recipe does, with an
offloaded AdamW: the offloaded step runs eagerly (torch.compiler.disable) and matches torch.
Traced by dynamo and compiled by inductor, its host code once stepped wrongly without an error
(weights 25% to 150% off torch's after 6 steps, by mode)."""

from __future__ import annotations

import pytest
import torch
from conformance_util import (
    assert_matches_torch,
    assert_state_matches_torch,
    build_model,
    close,
    num_threads,
    tl_opt,
    torch_opt,
    train,
    twin,
)

import tierlift

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")


class _Compiled:
    """The optimizer with step() compiled (train() calls step() and zero_grad())."""

    def __init__(self, opt):
        self.opt = opt
        self.step = torch.compile(opt.step)

    def zero_grad(self):
        self.opt.zero_grad()


@pytest.mark.parametrize("mode", ["cpu", "nvme1", "nvme2_ov"])
def test_compiled_step_matches_torch(tmp_path, mode):
    torch._dynamo.reset()
    with num_threads(1):
        ref = build_model()
        model = twin(ref)
        ref_opt = torch_opt(ref.parameters())
        train(ref, ref_opt, steps=4)
        opt = tl_opt(mode, model.parameters(), tmp_path)
        try:
            train(model, _Compiled(opt), steps=4)
            assert_matches_torch(model, ref)
            assert_state_matches_torch(opt, ref_opt)
        finally:
            close(opt)
