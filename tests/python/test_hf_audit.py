"""tierlift.hf against the same script without tierlift (one process, config-only Llama): what a
user does after Trainer.train() on a sharded model gives what it gives on the stock one.

save_pretrained on the trained model (also through accelerator.unwrap_model, and peft's on a
LoRA model) writes the trained weights, full, for from_pretrained: not the flat shards, which
from_pretrained would have dropped for freshly initialized weights (and peft for an empty
adapter file); the same for a model tierlift.hf.from_pretrained loaded into shards.
accelerator.clip_grad_norm_ given a submodule's parameters, which sharding moved into its
unit's flat shard, is refused rather than clipping nothing.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import tierlift  # noqa: E402
import tierlift.hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, SEQ = 64, 16


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
            max_position_embeddings=2 * SEQ,
            tie_word_embeddings=False,
        )
    )


def _lora():
    from peft import LoraConfig, get_peft_model

    model = _llama()
    torch.manual_seed(1)
    return get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    )


class _Data(torch.utils.data.Dataset):
    def __init__(self, rows: int = 16):
        self.x = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _train(model, out, zero=None, **extra):
    """Trainer (tierlift.hf.Trainer with `zero`, else transformers') for a few steps."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    kw = dict(
        output_dir=str(out),
        max_steps=3,
        per_device_train_batch_size=2,
        logging_steps=1,
        learning_rate=3e-3,
        weight_decay=0.1,
        seed=0,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        dataloader_num_workers=0,
    )
    kw.update(extra)
    args = transformers.TrainingArguments(**kw)
    if zero is None:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data())
    else:
        trainer = tierlift.hf.Trainer(model=model, args=args, train_dataset=_Data(), zero=zero)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    model = _train(_llama(), tmp_path_factory.mktemp("stock")).model
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("unwrap", [False, True])
@pytest.mark.parametrize("stage", [1, 3])
def test_save_pretrained_writes_the_trained_weights(stage, unwrap, stock, tmp_path):
    trainer = _train(_llama(), tmp_path / "run", tierlift.hf.ZeroConfig(stage=stage))
    model = trainer.accelerator.unwrap_model(trainer.model) if unwrap else trainer.model
    model.save_pretrained(tmp_path / "saved")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved").state_dict()
    assert sorted(loaded) == sorted(stock)
    for k, v in stock.items():
        torch.testing.assert_close(loaded[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_peft_save_pretrained_writes_the_adapters(tmp_path):
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    ref = get_peft_model_state_dict(_train(_lora(), tmp_path / "stock").model)
    trainer = _train(_lora(), tmp_path / "run", tierlift.hf.ZeroConfig(stage=3))
    trainer.model.save_pretrained(tmp_path / "saved")
    saved = load_file(os.path.join(tmp_path, "saved", "adapter_model.safetensors"))
    assert sorted(saved) == sorted(ref) and saved
    for k, v in ref.items():
        torch.testing.assert_close(saved[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_save_pretrained_of_the_shards_state_dict_is_refused(tmp_path):
    model = tierlift.zero.shard(_llama(), stage=3)
    tierlift.hf.install(model)
    with pytest.raises(ValueError, match="sharded model's own state_dict"):
        model.save_pretrained(tmp_path / "saved", state_dict=model.state_dict())
    assert not os.path.exists(tmp_path / "saved")


def _save_on_two_ranks(rank: int, world: int, tmp: str) -> dict:
    """Every rank calls save_pretrained, as accelerate scripts do: with its default arguments,
    and with is_main_process=accelerator.is_main_process."""
    torch.set_num_threads(1)
    model = tierlift.zero.shard(_llama(), stage=3)
    tierlift.hf.install(model)
    full = tierlift.hf.gathered_state_dict(model)
    model.save_pretrained(os.path.join(tmp, "default"))
    model.save_pretrained(os.path.join(tmp, "main_only"), is_main_process=rank == 0)
    return {"full": full}


@pytest.mark.slow  # two spawned ranks importing transformers
def test_save_pretrained_on_every_rank_writes_rank0s_gathered_weights(tmp_path):
    from safetensors.torch import load_file
    from zero_model import spawn_ranks

    full = spawn_ranks(_save_on_two_ranks, str(tmp_path))[0]["full"]
    assert sorted(full) == sorted(_llama().state_dict())
    for name in ("default", "main_only"):
        saved = load_file(os.path.join(tmp_path, name, "model.safetensors"))
        assert sorted(saved) == sorted(full), name
        for k, v in full.items():
            torch.testing.assert_close(saved[k], v, rtol=0, atol=0, msg=k)


def test_from_pretrained_model_saves_its_full_weights(tmp_path):
    """A model tierlift.hf.from_pretrained loaded into shards, trained in a plain loop (no
    Trainer, no Accelerator) and saved with save_pretrained: from_pretrained reads it back as
    the same loop leaves the unsharded model."""
    _llama().save_pretrained(tmp_path / "src")
    ids = torch.arange(2 * SEQ).remainder(VOCAB).view(2, SEQ)
    models = [
        transformers.LlamaForCausalLM.from_pretrained(tmp_path / "src"),
        tierlift.hf.from_pretrained(tmp_path / "src", zero=tierlift.hf.ZeroConfig(stage=3)),
    ]
    for model in models:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    models[1].save_pretrained(tmp_path / "saved")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved").state_dict()
    want = models[0].state_dict()
    assert sorted(loaded) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(loaded[k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.fixture
def _fresh_accelerate():
    import accelerate

    accelerate.state.AcceleratorState._reset_state(True)
    yield
    accelerate.state.AcceleratorState._reset_state(True)


def test_clip_of_a_submodule_inside_a_unit_is_refused(_fresh_accelerate):
    """accelerator.clip_grad_norm_(model.<submodule>.parameters(), ...) clips that submodule's
    gradients on the stock model; after shard() the submodule (inside a layer's unit) has no
    parameters of its own, and the call would clip nothing and return 0."""
    model = tierlift.zero.shard(_llama(), stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    accelerator = tierlift.hf.Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, opt)
    ids = torch.arange(SEQ).view(1, SEQ)
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="clip_grad_norm_ was given no parameters"):
        accelerator.clip_grad_norm_(model.model.layers[0].self_attn.parameters(), 0.1)
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)
    assert float(accelerator.clip_grad_norm_(model.parameters(), 0.1)) > 0.1
