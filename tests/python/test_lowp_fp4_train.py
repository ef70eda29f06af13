"""End to end: the tiny GPT of test_lowp_train.py trained 100 steps on CPU with each FP4 recipe
ends within 10% of the bf16 (autocast) run's loss. Every recipe's final loss is recorded
(pytest --junitxml, or -s to see the printed table), including the plain round-to-nearest MXFP4
baseline without Hadamard (on this model the recipes are within seed noise of each other:
docs/lowp.md, benchmarks/study_fp4_recipes.py).

100 steps, not test_lowp_train.py's 300: FP4's emulated GEMMs make a step ~6x a bf16 one, and by
step 100 the loss is past its fast fall (bf16 1.805, 300 steps: 1.718). The recipes' gap to bf16
there is what it is at 300 (+0.1% to +0.5%, seed 0), and a broken backward is further from it,
not closer: with gw left in the Hadamard basis (Quartet) or flipped (nvfp4, rtn), +46% to +58% at
100 steps against +32% to +50% at 300, both far outside the 10%."""

import math

import pytest
import torch
from test_lowp_train import LAYERS, VOCAB, train

from tierlift.lowp import FP4_RECIPES, FP4Linear

STEPS = 100


@pytest.mark.slow
def test_tiny_gpt_fp4_recipes_track_bf16(record_property):
    torch.set_num_threads(2)
    base, _ = train(None, steps=STEPS)
    record_property("bf16", round(base, 4))
    assert base < math.log(VOCAB) * 0.7
    losses = {}
    for name in ("mxfp4-quartet", "nvfp4", "mxfp4-rtn"):
        loss, model = train(name, steps=STEPS)
        losses[name] = loss
        record_property(name, round(loss, 4))
        assert isinstance(model.blocks[LAYERS - 1].fc, FP4Linear)
    print(f"\nfinal loss (mean of last 20 steps): bf16 {base:.4f}, " +
          ", ".join(f"{k} {v:.4f} ({(v - base) / base:+.1%})" for k, v in losses.items()))
    for name in FP4_RECIPES:
        assert abs(losses[name] - base) / base <= 0.10, (name, losses[name], base)
