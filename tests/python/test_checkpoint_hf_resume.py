"""tierlift.hf.Trainer resumes from checkpoint-N/tierlift as tierlift.checkpoint.load finds it:
a save killed between the two renames of its replace leaves only checkpoint-N/tierlift.old,
the previous complete checkpoint, and resuming from checkpoint-N reads it from there (model
and optimizer state: the resumed run ends with the uninterrupted one's weights bit for bit).
One process, a config-only Llama (hf_worker.py's builders)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (scripts/setup.sh installs it)")
pytest.importorskip("accelerate", reason="needs accelerate (scripts/setup.sh installs it)")

import hf_worker as W  # noqa: E402

import tierlift.hf  # noqa: E402
from tierlift.checkpoint import format as fmt  # noqa: E402


def _trainer(out: str):
    W.quiet()
    torch.set_num_threads(1)
    return tierlift.hf.Trainer(
        model=W.build("llama"), train_dataset=W.Data(), zero=tierlift.hf.ZeroConfig(stage=3),
        args=W.training_args(out, batch=2, max_steps=2, save_steps=1,
                             gradient_accumulation_steps=1))


def test_resume_from_a_lone_tierlift_old(tmp_path):
    out = str(tmp_path / "run")
    first = _trainer(out)
    first.train()
    ckpt = os.path.join(out, "checkpoint-1")
    fmt.move_aside(os.path.join(ckpt, "tierlift"), os.path.join(ckpt, "tierlift.old"))

    again = _trainer(out)
    again.train(resume_from_checkpoint=ckpt)
    want, got = W.history(first), W.history(again)
    assert sorted(got["loss"]) == [1, 2]  # 1 from the trainer state
    assert got["loss"][2] == want["loss"][2]  # the checkpoint's weights
    # the weights after step 2 need the checkpoint's optimizer state (step 1's Adam moments)
    for (name, a), b in zip(first.model.named_parameters(), again.model.parameters()):
        assert torch.equal(a, b), name
    assert sorted(os.listdir(ckpt)).count("tierlift.old") == 1  # read, not moved
