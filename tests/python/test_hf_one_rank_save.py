"""`if trainer.is_world_process_zero(): trainer.save_model(d)` under torchrun (2 gloo ranks,
ZeRO-3): save_model is a collective, so both ranks raise RankFailureError naming it within
seconds (rank 0 in save_model, rank 1 at its next forward or in it), instead of hanging for the
process group's timeout or blaming the rank that went on. In the same run, on both ranks:
TrainingArguments(fsdp=...) is refused, and resize_token_embeddings after sharding is refused
with the embedding unchanged."""

from __future__ import annotations

import pytest
import torch
from zero_model import run_torchrun

pytest.importorskip("transformers")

BODY = """
import time
import transformers
import tierlift, tierlift.hf
import hf_worker as W

model = W.build("llama")
try:  # FSDP asked for next to tierlift: refused on every rank (CPU would ignore it)
    tierlift.hf.Trainer(model=model, args=transformers.TrainingArguments(
        output_dir={dir!r} + "/fsdp", use_cpu=True, report_to=[], fsdp="full_shard"),
        train_dataset=W.Data(), zero=tierlift.hf.ZeroConfig(stage=3))
    fsdp = "<no error>"
except ValueError as e:
    fsdp = str(e)
args = transformers.TrainingArguments(output_dir={dir!r} + "/run", use_cpu=True, report_to=[],
                                      max_steps=1, per_device_train_batch_size=2,
                                      save_strategy="no", logging_strategy="no")
trainer = tierlift.hf.Trainer(model=model, args=args, train_dataset=W.Data(),
                              zero=tierlift.hf.ZeroConfig(stage=3))
trainer.train()
vocab = model.get_input_embeddings().num_embeddings
try:
    model.resize_token_embeddings(vocab + 8)
    resize = "<no error>"
except RuntimeError as e:
    resize = str(e)
resize = (resize, model.get_input_embeddings().num_embeddings == vocab)
t0 = time.monotonic()
try:
    if trainer.is_world_process_zero():
        trainer.save_model({dir!r} + "/saved")
    else:
        model(W.PROBE)  # the script goes on to a forward
    msg = "<no error>"
except tierlift.zero.RankFailureError as e:
    msg = str(e)
torch.save((msg, time.monotonic() - t0, fsdp, resize), {dir!r} + f"/rank{{rank}}.pt")
out = None
"""


def test_save_model_on_one_rank_is_named_on_both(tmp_path):
    run_torchrun(BODY, tmp_path, timeout=240, dir=str(tmp_path))
    for rank in range(2):
        msg, took, fsdp, (resize, unchanged) = torch.load(tmp_path / f"rank{rank}.pt")
        assert fsdp.startswith("TrainingArguments.fsdp="), (rank, fsdp)
        assert resize.startswith("resize_token_embeddings on a model sharded"), (rank, resize)
        assert unchanged, rank
        assert "rank 0 called Trainer.save_model, a collective that every rank must call" in msg, \
            (rank, msg)
        assert "call Trainer.save_model on every rank" in msg, (rank, msg)
        assert took < 30, (rank, took)
