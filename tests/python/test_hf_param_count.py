"""tierlift.hf.Trainer's fix of Trainer's "Number of trainable parameters" is scoped: it replaces
transformers.trainer.get_model_param_count only while its train() runs, counts only sharded
models its own way (every other model gets the original function's result), and leaves the
original in place afterwards, also after nested uses and when something else replaced it
meanwhile. One process, a one-rank sharding (no process group)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (scripts/setup.sh installs it)")
pytest.importorskip("accelerate", reason="needs accelerate (scripts/setup.sh installs it)")

import hf_worker as W  # noqa: E402
import transformers.trainer as hf_trainer  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import tierlift  # noqa: E402
import tierlift.hf  # noqa: E402
from tierlift.hf.param_count import full_param_count  # noqa: E402


def _plain_models():
    frozen = W.build("llama")
    frozen.model.embed_tokens.requires_grad_(False)
    return {"plain": W.build("llama"), "frozen": frozen,
            "wrapped": torch.nn.ModuleDict({"m": W.build("llama")})}


class _Seen(TrainerCallback):
    """What get_model_param_count is, and answers, while the Trainer trains."""

    def __init__(self, original):
        self.original, self.seen = original, {}

    def on_train_begin(self, args, state, control, model=None, **kw):
        fn = hf_trainer.get_model_param_count
        self.seen["replaced"] = fn is not self.original
        self.seen["sharded"] = (fn(model), fn(model, trainable_only=True))
        self.seen["plain"] = {name: [(fn(m, trainable_only=t), self.original(m, trainable_only=t))
                                     for t in (False, True)]
                              for name, m in _plain_models().items()}


def test_replaced_only_during_train_and_only_for_sharded_models(tmp_path):
    W.quiet()
    torch.set_num_threads(1)
    original = hf_trainer.get_model_param_count
    model = W.build("llama")
    want = (model.num_parameters(), model.num_parameters(only_trainable=True))
    seen = _Seen(original)
    trainer = tierlift.hf.Trainer(
        model=model, args=W.training_args(str(tmp_path), batch=2, max_steps=1,
                                          gradient_accumulation_steps=1, save_strategy="no"),
        train_dataset=W.Data(), zero=tierlift.hf.ZeroConfig(stage=3), callbacks=[seen])
    assert hf_trainer.get_model_param_count is original  # building a Trainer patches nothing
    trainer.train()
    assert hf_trainer.get_model_param_count is original  # and train() put it back
    assert seen.seen["replaced"]
    assert seen.seen["sharded"] == want
    for name, answers in seen.seen["plain"].items():
        for got, ref in answers:
            assert got == ref, name
    # A plain transformers.Trainer afterwards sees the original function.
    assert hf_trainer.get_model_param_count(W.build("llama")) == want[0]


def test_nested_and_overridden_uses_restore():
    original = hf_trainer.get_model_param_count
    with full_param_count():
        outer = hf_trainer.get_model_param_count
        assert outer is not original and outer._tierlift_counts_full
        with full_param_count():
            assert hf_trainer.get_model_param_count is outer  # wrapped once, not twice
        assert hf_trainer.get_model_param_count is outer
    assert hf_trainer.get_model_param_count is original

    def theirs(model, trainable_only=False):
        return -1

    try:  # replaced by someone else inside the block: theirs stays
        with full_param_count():
            hf_trainer.get_model_param_count = theirs
        assert hf_trainer.get_model_param_count is theirs
    finally:
        hf_trainer.get_model_param_count = original
    sharded = tierlift.zero.shard(W.build("llama"), stage=3)
    with full_param_count():
        assert hf_trainer.get_model_param_count(sharded) == W.build("llama").num_parameters()
