"""tierlift.hf.Accelerator under torchrun (2 gloo ranks, CPU, a config-only Llama).

A loop written the Accelerate way (prepare, accumulate, backward, clip_grad_norm_, save_state)
on a tierlift.zero-sharded model, ZeRO stages 1-3 and stage 3 with parameter offload and an NVMe
optimizer with overlap: the model is not wrapped in DDP; losses and global gradient norms equal
one process with the same global batch (1e-5); get_state_dict / save_model give the full model;
load_state in a new process repeats steps 4-6 bit for bit. Shares the torchrun launches of
test_hf_trainer.py (hf_worker.py).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (scripts/setup.sh installs it)")
pytest.importorskip("accelerate", reason="needs accelerate (scripts/setup.sh installs it)")
pytest.importorskip("peft", reason="needs peft (scripts/setup.sh installs it)")

import hf_worker as W  # noqa: E402

RUNS = list(W.ACCEL_RUNS)


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    return W.launch(str(tmp_path_factory.mktemp("hf")))


@pytest.fixture(scope="module")
def reference():
    """The loop in one process, unsharded, torch.optim.AdamW: each micro-batch is the global
    one; accelerate steps the scheduler once per process and optimizer step (2 here)."""
    torch.set_num_threads(1)
    model = W.build("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=W.LR, weight_decay=0.0)
    sched = W.schedule(opt)
    losses, norms = {}, {}
    for step in range(W.STEPS):
        total = 0.0
        for micro in range(W.ACCUM):
            x = W.global_micro_batch(step, micro)
            loss = model(input_ids=x, labels=x).loss / W.ACCUM
            loss.backward()
            total += loss.item()
        norms[step + 1] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), W.CLIP))
        opt.step()
        for _ in range(2):
            sched.step()
        opt.zero_grad()
        losses[step + 1] = total
    with torch.no_grad():
        logits = model(input_ids=W.PROBE).logits
    return losses, norms, model.state_dict(), logits


def close(a: dict, b: dict, rtol=1e-5):
    assert sorted(a) == sorted(b)
    torch.testing.assert_close(torch.tensor([a[k] for k in sorted(a)]),
                               torch.tensor([b[k] for k in sorted(b)]), rtol=rtol, atol=0)


@pytest.mark.parametrize("name", RUNS)
def test_accelerate_loop_equals_one_process(name, runs, reference):
    train, _, _ = runs
    losses, norms, _, logits = reference
    assert min(norms.values()) > W.CLIP  # every step was clipped
    assert train[name]["wrapped"] == "LlamaForCausalLM"  # not DistributedDataParallel
    close(train[name]["loss"], losses)
    close(train[name]["grad_norm"], norms)
    torch.testing.assert_close(train[name]["logits"], logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", RUNS)
def test_save_model_writes_the_full_model(name, runs, reference):
    from safetensors.torch import load_file

    train, _, root = runs
    _, _, ref_sd, _ = reference
    saved = load_file(os.path.join(root, name, "final", "model.safetensors"))
    assert sorted(saved) == sorted(ref_sd) == train[name]["state_dict_keys"]
    model = W.build("llama")
    model.load_state_dict(saved)  # strict: every weight there, no shard names
    with torch.no_grad():
        logits = model(input_ids=W.PROBE).logits
    torch.testing.assert_close(logits, train[name]["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", RUNS)
def test_load_state_in_a_new_process_repeats_the_run(name, runs):
    train, resume, root = runs
    assert sorted(resume[name]["loss"]) == list(range(W.SAVE_AT + 1, W.STEPS + 1))
    for step in resume[name]["loss"]:  # bit for bit
        assert resume[name]["loss"][step] == train[name]["loss"][step], step
        assert resume[name]["grad_norm"][step] == train[name]["grad_norm"][step], step
    state = set(os.listdir(os.path.join(root, name, "state")))
    assert {"tierlift_model", "random_states_0.pkl", "random_states_1.pkl"} <= state, state
    assert not any(f.startswith(("model", "optimizer")) for f in state), state


def test_optimizer_built_before_shard_is_refused(runs):
    train, _, _ = runs
    assert train["refusals"]["stale_optimizer"].startswith(
        "ValueError: the optimizer holds parameters that are not the sharded model's")
