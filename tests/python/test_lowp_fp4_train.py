"""End to end: the tiny GPT of test_lowp_train.py trained 300 steps on CPU with each FP4 recipe
ends within 10% of the bf16 (autocast) run's loss. Every recipe's final loss is recorded
(pytest --junitxml, or -s to see the printed table), including the plain round-to-nearest MXFP4
baseline without Hadamard (on this model the recipes are within seed noise of each other:
docs/lowp.md, benchmarks/study_fp4_recipes.py)."""

import math

import pytest
import torch
from test_lowp_train import LAYERS, VOCAB, bf16_loss, train

from tierlift.lowp import FP4_RECIPES, FP4Linear


@pytest.mark.slow
def test_tiny_gpt_fp4_recipes_track_bf16(record_property):
    torch.set_num_threads(2)
    base = bf16_loss()
    record_property("bf16", round(base, 4))
    assert base < math.log(VOCAB) * 0.7
    losses = {}
    for name in ("mxfp4-quartet", "nvfp4", "mxfp4-rtn"):
        loss, model = train(name)
        losses[name] = loss
        record_property(name, round(loss, 4))
        assert isinstance(model.blocks[LAYERS - 1].fc, FP4Linear)
    print(f"\nfinal loss (mean of last 20 steps): bf16 {base:.4f}, " +
          ", ".join(f"{k} {v:.4f} ({(v - base) / base:+.1%})" for k, v in losses.items()))
    for name in FP4_RECIPES:
        assert abs(losses[name] - base) / base <= 0.10, (name, losses[name], base)
