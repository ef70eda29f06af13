"""tierlift.hf.Trainer reading checkpoint-N/tierlift while this process's background save of it
is still in flight (a train() that raised leaves one running; resuming or loading in the same
process then reads that checkpoint) waits for the save, as tierlift.checkpoint.load does: it
reads the checkpoint being saved, not the one before it (a lone tierlift.old left by a save
killed between its renames), and does not call a checkpoint it is writing itself unfinished.

One process, a config-only Llama (hf_worker.py's builders); the save's commit is slowed so
that it is still in flight when the Trainer reads."""

from __future__ import annotations

import os
import time

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (scripts/setup.sh installs it)")
pytest.importorskip("accelerate", reason="needs accelerate (scripts/setup.sh installs it)")

import hf_worker as W  # noqa: E402

import tierlift.checkpoint  # noqa: E402
import tierlift.hf  # noqa: E402
from tierlift.checkpoint import format as fmt  # noqa: E402

COMMIT_DELAY_S = 1.0  # far longer than the tiny model's load


@pytest.fixture
def slow_commit(monkeypatch):
    replace = fmt.replace_dir

    def late(tmp, path):
        time.sleep(COMMIT_DELAY_S)
        replace(tmp, path)

    monkeypatch.setattr(fmt, "replace_dir", late)


def _trained(out: str):
    W.quiet()
    torch.set_num_threads(1)
    trainer = tierlift.hf.Trainer(
        model=W.build("llama"), train_dataset=W.Data(),
        zero=tierlift.hf.ZeroConfig(stage=3, background_saves=True),
        args=W.training_args(out, batch=2, max_steps=1, save_steps=1,
                             gradient_accumulation_steps=1))
    trainer.train()  # checkpoint-1, complete: train() waits for its save
    return trainer


def _full(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tierlift.zero.full_state_dict(model).items()}


def _save_in_background(trainer, ckpt: str) -> dict[str, torch.Tensor]:
    """New weights saved to ckpt/tierlift in the background; the model is then changed
    again, so that what a read loads shows. Returns the weights being saved."""
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.5)
    saving = _full(trainer.model)
    trainer._save_optimizer_and_scheduler(ckpt)
    assert trainer._pending_save is not None and not trainer._pending_save.done()
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.zero_()
    return saving


def _assert_weights(model, want: dict[str, torch.Tensor]) -> None:
    got = _full(model)
    assert list(got) == list(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_resume_waits_for_the_save_not_the_old_copy(tmp_path, slow_commit):
    out = str(tmp_path / "run")
    trainer = _trained(out)
    ckpt = os.path.join(out, "checkpoint-1")
    # a save killed between its renames: the previous checkpoint is there as tierlift.old
    fmt.move_aside(os.path.join(ckpt, "tierlift"), os.path.join(ckpt, "tierlift.old"))
    saving = _save_in_background(trainer, ckpt)
    trainer._load_from_checkpoint(ckpt)
    trainer._load_optimizer_and_scheduler(ckpt)
    _assert_weights(trainer.model, saving)
    assert sorted(os.listdir(ckpt)).count("tierlift") == 1
    assert "tierlift.old" not in os.listdir(ckpt)


def test_resume_of_a_checkpoint_this_process_is_writing(tmp_path, slow_commit):
    out = str(tmp_path / "run")
    trainer = _trained(out)
    ckpt = os.path.join(out, "checkpoint-2")  # a fresh folder: no tierlift/ until the commit
    saving = _save_in_background(trainer, ckpt)
    trainer._load_from_checkpoint(ckpt)
    trainer._load_optimizer_and_scheduler(ckpt)
    _assert_weights(trainer.model, saving)
