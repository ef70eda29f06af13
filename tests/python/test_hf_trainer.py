"""tierlift.hf.Trainer under torchrun (2 gloo ranks, CPU, config-only Llama / GPT-2 / LoRA).

Every ZeRO stage, stage 3 with parameter offload and an NVMe optimizer with overlap, a tied GPT-2
with max_grad_norm=0 and LoRA on ZeRO-3 with parameter offload train as one process does with
the same global batch: the logged losses and gradient norms (the global norm, clipped at 0.5)
within 1e-5; save_model writes a model from_pretrained loads with the sharded model's logits;
resuming from checkpoint-3 in a new process repeats the uninterrupted run's steps 4-6 bit for
bit; generate() with a different length on each rank finishes; num_parameters() and Trainer's
log of trainable parameters count the whole model; misuses are refused. All runs share two
torchrun launches (hf_worker.py).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (scripts/setup.sh installs it)")
pytest.importorskip("accelerate", reason="needs accelerate (scripts/setup.sh installs it)")
pytest.importorskip("peft", reason="needs peft (scripts/setup.sh installs it)")

import hf_worker as W  # noqa: E402

DIST = [n for n in W.TRAINER_RUNS]


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    return W.launch(str(tmp_path_factory.mktemp("hf")))


def one_process(kind: str, tmp_path, **extra):
    """The same run in this process, unsharded, plain transformers.Trainer, one rank taking
    the global batch (2 x PER_RANK)."""
    from transformers import Trainer

    W.quiet()
    torch.set_num_threads(1)
    model = W.build(kind)
    trainer = Trainer(model=model, args=W.training_args(str(tmp_path), batch=2 * W.PER_RANK,
                                                        save_strategy="no", **extra),
                      train_dataset=W.Data())
    trainer.train()
    with torch.no_grad():
        logits = model(input_ids=W.PROBE).logits
    return W.history(trainer), model, logits


@pytest.fixture(scope="module")
def ref_llama(tmp_path_factory):
    return one_process("llama", tmp_path_factory.mktemp("ref_llama"))


def close(a: dict, b: dict, rtol=1e-5):
    assert sorted(a) == sorted(b)
    torch.testing.assert_close(torch.tensor([a[k] for k in sorted(a)]),
                               torch.tensor([b[k] for k in sorted(b)]), rtol=rtol, atol=0)


@pytest.mark.parametrize("name", ["z1", "z2", "z3", "z3_offload"])
def test_stage_equals_one_process(name, runs, ref_llama):
    train, _, _ = runs
    ref, _, ref_logits = ref_llama
    close(train[name]["loss"], ref["loss"])
    close(train[name]["grad_norm"], ref["grad_norm"])  # the global norm, not rank 0's
    assert min(ref["grad_norm"].values()) > W.CLIP  # every step was clipped
    torch.testing.assert_close(train[name]["logits"], ref_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", DIST)
def test_save_model_loads_with_from_pretrained(name, runs):
    from transformers import AutoModelForCausalLM

    train, _, root = runs
    final = os.path.join(root, name, "final")
    if name == "lora_z3":
        from peft import PeftModel

        model = PeftModel.from_pretrained(W.build("llama"), final)
        assert sorted(os.listdir(final)).count("adapter_model.safetensors") == 1
    else:
        model = AutoModelForCausalLM.from_pretrained(final)
    with torch.no_grad():
        logits = model(input_ids=W.PROBE).logits
    # The sharded model's own forward after training, and the saved one: the same weights.
    torch.testing.assert_close(logits, train[name]["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", DIST)
def test_resume_in_a_new_process_repeats_the_run(name, runs):
    train, resume, _ = runs
    assert sorted(resume[name]["loss"]) == list(range(1, W.STEPS + 1))
    for step in range(W.SAVE_AT + 1, W.STEPS + 1):  # bit for bit
        assert resume[name]["loss"][step] == train[name]["loss"][step], step
        assert resume[name]["grad_norm"][step] == train[name]["grad_norm"][step], step


def test_background_checkpoint_is_complete(runs):
    _, _, root = runs
    ckpt = os.path.join(root, "z3_offload", f"checkpoint-{W.SAVE_AT}")
    files = set(os.listdir(ckpt))
    assert {"tierlift", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth",
            "trainer_state.json", "model.safetensors"} <= files, files
    assert not any(f.endswith(".tmp") for f in files)


def test_max_grad_norm_zero_logs_the_norm_unclipped(runs, tmp_path):
    train, _, _ = runs
    ref, _, ref_logits = one_process("gpt2", tmp_path, max_grad_norm=0.0)
    assert max(ref["grad_norm"].values()) > 1.0  # clipping at 1.0 would have changed things
    close(train["gpt2_norm0"]["grad_norm"], ref["grad_norm"])
    close(train["gpt2_norm0"]["loss"], ref["loss"])
    torch.testing.assert_close(train["gpt2_norm0"]["logits"], ref_logits, rtol=1e-4, atol=1e-4)


def test_lora_on_zero3_offload_equals_one_process(runs, tmp_path):
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    train, _, root = runs
    r = train["lora_z3"]
    ref, ref_model, ref_logits = one_process("lora", tmp_path)
    close(r["loss"], ref["loss"])
    close(r["grad_norm"], ref["grad_norm"])
    torch.testing.assert_close(r["logits"], ref_logits, rtol=1e-4, atol=1e-4)
    saved = load_file(os.path.join(root, "lora_z3", "final", "adapter_model.safetensors"))
    expected = get_peft_model_state_dict(ref_model)
    assert sorted(saved) == sorted(expected) and saved
    for k, v in expected.items():
        torch.testing.assert_close(saved[k], v, rtol=1e-4, atol=1e-6)
    # The frozen base: sharded too (half of it per rank, each frozen unit padded to an even
    # size), no gradients, no optimizer state; the optimizer holds only the adapters' shards.
    base = W.build("llama").num_parameters()
    assert base // 2 <= r["frozen_numel"] <= base // 2 + 32
    assert r["frozen_grads"] == 0 and r["state_on_frozen"] == 0
    assert r["optimizer_params_all_shards"]
    assert r["num_parameters"] == ref_model.get_nb_trainable_parameters()


@pytest.mark.parametrize("name", ["z1", "z3", "gpt2_norm0"])
def test_num_parameters_counts_the_full_model(name, runs):
    train, _, _ = runs
    model = W.build(W.TRAINER_RUNS[name][0])
    assert train[name]["num_parameters"] == model.num_parameters()
    assert train[name]["trainable"] == model.num_parameters(only_trainable=True)
    assert train[name]["no_embeddings"] == model.num_parameters(exclude_embeddings=True)


@pytest.mark.parametrize("name", DIST)
def test_trainer_logs_the_full_trainable_count(name, runs):
    """Trainer's "Number of trainable parameters" line counts the whole model, not the shards
    of rank 0 (LoRA: the adapters, with the frozen base sharded beside them)."""
    train, _, _ = runs
    model = W.build(W.TRAINER_RUNS[name][0])
    assert train[name]["logged_trainable"] == sum(
        p.numel() for p in model.parameters() if p.requires_grad)


def test_generate_with_uneven_lengths_per_rank(runs):
    from transformers import AutoModelForCausalLM

    train, _, root = runs
    model = AutoModelForCausalLM.from_pretrained(os.path.join(root, "z3", "final")).eval()
    plain, forced = train["z3"]["generate"]
    # an explicit synced_gpus=False is overridden (no hang), with the same tokens
    assert all(torch.equal(a, b) for a, b in zip(forced, plain, strict=True))
    for rank, ids in enumerate(plain):
        n = 2 + 5 * rank
        assert ids.shape[1] == 4 + n
        ref = model.generate(W.PROBE[:1, :4], max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        assert torch.equal(ids, ref), rank


@pytest.mark.parametrize("case,error", [
    ("unsharded_optimizer", "ValueError: optimizers=(optimizer, ...) holds the unsharded"),
    ("sharded_twice", "ValueError: the model is sharded already"),
    ("two_norms", "ValueError: TrainingArguments.max_grad_norm=0.5 and the optimizer's own"),
    ("unsharded_checkpoint", "ValueError:"),
    ("interrupted_save", "RuntimeError:"),
    ("bad_optimizer_key", "ValueError: ZeroConfig.optimizer_kwargs has an unknown key 'ofload'"),
])
def test_misuse_is_refused(case, error, runs):
    train, _, _ = runs
    assert train["refusals"][case].startswith(error), train["refusals"][case]


def test_zero_config_checks_itself():
    import tierlift.hf

    with pytest.raises(ValueError, match="needs stage=3"):
        tierlift.hf.ZeroConfig(stage=2, offload_params="cpu")
    with pytest.raises(ValueError, match="unknown key 'prefech'"):
        tierlift.hf.ZeroConfig(shard_kwargs={"prefech": 2})
    with pytest.raises(ValueError, match="set by ZeroConfig"):
        tierlift.hf.ZeroConfig(shard_kwargs={"stage": 2})
    with pytest.raises(ValueError, match="background_saves"):
        tierlift.hf.ZeroConfig(staging_budget=1 << 20)


def test_example_with_zero3_equals_one_process(runs, tmp_path):
    """examples/finetune_hf.py --zero 3 under torchrun (2 ranks x 2 rows) and the same example
    unsharded in one process with 4 rows per step: the same losses."""
    train, _, root = runs
    example = W.load_example()
    ref = example.main([*W.EXAMPLE_FLAGS, "--batch-size", "4", "--output-dir", str(tmp_path)])
    assert sorted(train["example"]) == sorted(ref) == [1, 2, 3, 4]
    close(train["example"], ref)
    assert os.path.isfile(os.path.join(root, "example", "final", "model.safetensors"))
