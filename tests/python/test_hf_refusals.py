"""Hugging Face calls that cannot be made exact on a sharded model are refused before anything
changes (one process; the 2-rank Trainer runs are in test_hf_trainer.py):
resize_token_embeddings after shard() (stages 2 and 3, also inside gathered(modifier_rank=0)),
and TrainingArguments asking for FSDP or DeepSpeed next to tierlift.hf.Trainer."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tierlift  # noqa: E402
import tierlift.hf  # noqa: E402


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("stage,inside", [(2, False), (3, False), (3, True)])
def test_resize_token_embeddings_refused_and_nothing_changes(stage, inside):
    model = tierlift.zero.shard(_llama(), stage=stage)
    ids = torch.arange(8).view(1, 8)
    before = model(ids).logits.detach().clone()
    with pytest.raises(RuntimeError, match="resize_token_embeddings on a model sharded"):
        if inside:
            with tierlift.zero.gathered(model, modifier_rank=0):
                model.resize_token_embeddings(72)
        else:
            model.resize_token_embeddings(72)
    emb = model.get_input_embeddings()
    assert emb.num_embeddings == 64 and model.config.vocab_size == 64
    torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)


@pytest.mark.parametrize("field,value", [("fsdp", "full_shard"), ("fsdp", True)])
def test_fsdp_arguments_refused_by_the_trainer(tmp_path, field, value):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                          report_to=[], **{field: value})
    model = _llama()
    names = [n for n, _ in model.named_parameters()]
    with pytest.raises(ValueError, match=f"TrainingArguments.{field}="):
        tierlift.hf.Trainer(model=model, args=args, zero=tierlift.hf.ZeroConfig(stage=3))
    assert [n for n, _ in model.named_parameters()] == names  # not sharded
