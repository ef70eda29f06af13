"""Hugging Face save/resume of a model converted with the FP8 delayed-scaling recipe, whose amax
histories are buffers in its state_dict: Trainer's resume_from_checkpoint continues bit for bit;
save_model then from_pretrained into a plain model drops the histories (transformers lists them
as unexpected keys), so convert alone restarts them never filled, while loading the saved
weights after convert gives the trained model back exactly."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from test_hf_lowp_activations import W, converted, losses, plain_trainer

import tierlift

DELAYED = "fp8-tensorwise-delayed"

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")


def _histories(model) -> dict:
    return {k: v for k, v in model.state_dict().items() if "amax_history" in k}


def test_trainer_resume_and_save_model_of_a_delayed_model(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = converted(DELAYED)
    out = str(tmp_path / "run")
    first = plain_trainer(copy.deepcopy(base), out)
    first.train()
    again = plain_trainer(copy.deepcopy(base), out)
    again.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{W.SAVE_AT}"))
    assert losses(again) == losses(first)  # steps after the save recomputed bit for bit
    final = str(tmp_path / "final")
    first.save_model(final)
    trained = first.model
    with torch.no_grad():
        want = trained(input_ids=W.PROBE).logits
    assert all((h >= 0).any() for h in _histories(trained).values())

    # from_pretrained, then convert: the saved histories are not read; they start never filled
    dropped = AutoModelForCausalLM.from_pretrained(final)
    tierlift.lowp.convert(dropped, DELAYED, min_features=0)
    assert all((h == -1).all() for h in _histories(dropped).values())

    # ... and loading the saved weights after convert restores them: the same logits
    restored = AutoModelForCausalLM.from_pretrained(final)
    tierlift.lowp.convert(restored, DELAYED, min_features=0)
    restored.load_state_dict(load_file(os.path.join(final, "model.safetensors")), strict=True)
    saved = _histories(trained)
    assert all(torch.equal(v, saved[k]) for k, v in _histories(restored).items())
    with torch.no_grad():
        assert torch.equal(restored(input_ids=W.PROBE).logits, want)
        off = (dropped(input_ids=W.PROBE).logits - want).abs().max().item()
    print(f"from_pretrained + convert without the histories: logits off by {off:.3e} "
          f"(largest logit {want.abs().max().item():.3e})")
