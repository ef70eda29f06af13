"""Frozen parameters under ZeRO stage 3 (a frozen base with LoRA adapters): sharded like the
trainable ones, never reduced or stepped.

One spawn of 2 gloo ranks runs every configuration (fp32 base, with and without
offload_params="cpu"; a bf16 base offloaded; through peft when it is installed); the tests then
compare with one process training the same model with torch.optim.AdamW on its trainable
parameters. Each rank averages the gradients of its half of the batch, so the only difference
is the order of fp32 sums."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from lora_model import SEQ, VOCAB, base_numel, batches, fit, make_lora
from zero_model import free_port, init_gloo, shutdown

import tierlift

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

STEPS, MORE, BATCH, WORLD = 6, 2, 8, 2
OPT = dict(lr=1e-2, weight_decay=0.1)
CONFIGS = {  # name: (base dtype, offload_params)
    "fp32": (torch.float32, "none"),
    "fp32-cpu": (torch.float32, "cpu"),
    "bf16-cpu": (torch.bfloat16, "cpu"),
}


def _gathered_frozen(state) -> list[str]:
    return [u.name for u in state.units if u.frozen and u.full_bytes > 0]


def _run_config(rank, world, name, tmp):
    dtype, offload = CONFIGS[name]
    model = tierlift.zero.shard(make_lora(dtype), stage=3, offload_params=offload)
    state = model._tierlift_zero
    # Every parameter goes to the optimizer: the frozen shards must get no state.
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    seen = []
    hook = model.blocks[0].register_full_backward_pre_hook(
        lambda *_: seen.append(_gathered_frozen(state)))
    data = batches(STEPS + MORE, BATCH)
    losses = fit(model, opt, data[:STEPS], world=world, rank=rank)
    hook.remove()
    frozen = [u for u in state.units if u.frozen]
    out = {
        "losses": losses,
        "during_backward": seen[0],
        "frozen_bytes": {str(dt): sum(u.shard.numel() * u.shard.element_size()
                                      for u in frozen if u.shard.dtype == dt)
                         for dt in {u.shard.dtype for u in frozen}},
        "frozen_units": len(frozen),
        "frozen_offloaded": all(u.offload is not None for u in frozen),
        "frozen_in_arena": all(
            u.offload is None or u.shard.untyped_storage().data_ptr()
            == u.offload.arenas[u.shard.dtype].untyped_storage().data_ptr() for u in frozen),
        "frozen_grads": [u.shard.grad is not None or u.full.grad is not None for u in frozen],
        "frozen_opt_state": sum(1 for u in frozen if u.shard in opt.state),
        "trainable_opt_state": sum(1 for u in state.units if not u.frozen and u.shard in opt.state),
        "gathered_after_step": [u.name for u in state.units if u.full_bytes > 0],
        "num_parameters": (tierlift.zero.num_parameters(model),
                           tierlift.zero.num_parameters(model, only_trainable=True)),
    }
    with tierlift.zero.gathered(model.blocks[1].up.base):
        out["gathered_weight"] = model.blocks[1].up.base.weight.detach().clone()
    out["state"] = tierlift.zero.full_state_dict(model)
    # Checkpoint round trip: save, train on; a fresh sharded model resumes to the same bits.
    ckpt = os.path.join(tmp, f"ckpt-{name}")
    tierlift.checkpoint.save(ckpt, model, opt)
    own = copy.deepcopy(model.state_dict())  # this rank's shards, with their record
    out["after"] = fit(model, opt, data[STEPS:], world=world, rank=rank)
    out["after_state"] = tierlift.zero.full_state_dict(model)
    again = tierlift.zero.shard(make_lora(dtype, seed=9), stage=3, offload_params=offload)
    opt2 = torch.optim.AdamW(again.parameters(), **OPT)
    tierlift.checkpoint.load(ckpt, again, opt2)
    out["resumed"] = fit(again, opt2, data[STEPS:], world=world, rank=rank)
    out["resumed_state"] = tierlift.zero.full_state_dict(again)
    # model.state_dict() of one rank loads into the same rank of another sharded model.
    third = tierlift.zero.shard(make_lora(dtype, seed=9), stage=3, offload_params=offload)
    third.load_state_dict(own)
    out["state_dict_round_trip"] = tierlift.zero.full_state_dict(third)
    return out


def _peft_model():
    """A tiny Llama with LoRA adapters (B non-zero, so they change the output), seed 0."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=40,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=SEQ + 1, tie_word_embeddings=False)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    return model


def _run_peft(rank, world):
    model = _peft_model()
    model = tierlift.zero.shard(model, stage=3, offload_params="cpu")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPT)
    losses = []
    for seq in batches(3, BATCH):
        opt.zero_grad(set_to_none=True)
        local = seq.chunk(world)[rank]
        model(input_ids=local, labels=local).loss.backward()
        opt.step()
        with torch.no_grad():
            losses.append(model(input_ids=seq, labels=seq).loss.item())
    return {"losses": losses, "frozen_units": sum(u.frozen for u in model._tierlift_zero.units)}


def _worker(rank, world, port, tmp, out):
    init_gloo(rank, world, port)
    torch.manual_seed(0)
    results = {n: _run_config(rank, world, n, tmp) for n in CONFIGS}
    try:
        import peft  # noqa: F401
    except ImportError:
        pass
    else:
        results["peft"] = _run_peft(rank, world)
    if rank == 0:
        torch.save(results, out)
    shutdown()


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("frozen")
    out = tmp / "results.pt"
    mp.spawn(_worker, args=(WORLD, free_port(), str(tmp), str(out)), nprocs=WORLD)
    return torch.load(out, weights_only=False)


def _reference(dtype):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_lora(dtype)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPT)
        losses = fit(model, opt, batches(STEPS, BATCH))
    finally:
        torch.set_num_threads(threads)
    return model, losses


@pytest.mark.parametrize("name", list(CONFIGS))
def test_trains_as_one_process(world2, name):
    r = world2[name]
    dtype = CONFIGS[name][0]
    ref, ref_losses = _reference(dtype)
    # A bf16 base rounds its inputs: an fp32 sum-order difference may flip one rounding.
    rtol = 1e-6 if dtype == torch.float32 else 1e-5
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses),
                               rtol=rtol, atol=0)
    ref_sd = ref.state_dict()
    assert list(r["state"]) == list(ref_sd)
    for key, value in ref_sd.items():
        assert r["state"][key].dtype == value.dtype, key
        torch.testing.assert_close(r["state"][key], value, rtol=rtol, atol=rtol / 10,
                                   msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_frozen_base_is_sharded_and_never_stepped(world2, name):
    r = world2[name]
    dtype, offload = CONFIGS[name]
    base = base_numel(make_lora(dtype))
    assert set(r["frozen_bytes"]) == {str(dt) for dt in base}
    for dt, n in base.items():
        per_rank = n * dt.itemsize / WORLD
        # Each frozen unit pads to a multiple of the world size: at most one element more.
        assert per_rank <= r["frozen_bytes"][str(dt)] <= per_rank + r["frozen_units"] * dt.itemsize
    assert r["frozen_offloaded"] == (offload == "cpu") and r["frozen_in_arena"]
    assert not any(r["frozen_grads"])
    assert r["frozen_opt_state"] == 0 and r["trainable_opt_state"] > 0
    assert r["gathered_after_step"] == []
    total = sum(base.values())
    trainable = sum(p.numel() for p in make_lora(dtype).parameters() if p.requires_grad)
    assert r["num_parameters"] == (total + trainable, trainable)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_frozen_units_freed_after_their_backward(world2, name):
    """In the first block's backward the later blocks' and the head's frozen weights are
    already freed; the frozen embedding (no gradient flows into it) was never gathered again.
    Only the root's frozen LayerNorm (its input, token ids, needs no gradient) stays."""
    assert sorted(set(world2[name]["during_backward"])) == ["<root>", "blocks.0"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_full_state_dict_keeps_frozen_weights_and_loads_unsharded(world2, name):
    r = world2[name]
    dtype = CONFIGS[name][0]
    original = make_lora(dtype).state_dict()
    for key, value in original.items():
        if "lora_" not in key and key != "head.bias":
            assert torch.equal(r["state"][key], value), key
    assert torch.equal(r["gathered_weight"], original["blocks.1.up.base.weight"])
    fresh = make_lora(dtype, seed=5)
    fresh.load_state_dict(r["state"])
    ref, _ = _reference(dtype)
    idx = batches(1, 2, seed=3)[0][:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(fresh(idx), ref(idx), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_checkpoint_and_state_dict_round_trips(world2, name):
    r = world2[name]
    assert r["resumed"] == r["after"]
    for key, value in r["after_state"].items():
        assert torch.equal(r["resumed_state"][key], value), key
    for key, value in r["state"].items():
        assert torch.equal(r["state_dict_round_trip"][key], value), key


def test_peft_lora_trains_as_one_process(world2):
    pytest.importorskip("peft")
    r = world2["peft"]
    assert r["frozen_units"] > 0
    model = _peft_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPT)
    losses = []
    for seq in batches(3, BATCH):
        opt.zero_grad(set_to_none=True)
        halves = seq.chunk(WORLD)
        # The ranks average the mean losses of their halves.
        (sum(model(input_ids=h, labels=h).loss for h in halves) / WORLD).backward()
        opt.step()
        with torch.no_grad():
            losses.append(model(input_ids=seq, labels=seq).loss.item())
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), rtol=1e-5,
                               atol=0)


# ---- single process: what is refused ----
def test_requires_grad_changed_after_shard_is_refused():
    model = tierlift.zero.shard(make_lora(), stage=3)
    idx = batches(1, 2)[0][:, :-1]
    frozen = next(u for u in model._tierlift_zero.units if u.frozen)
    trainable = next(u for u in model._tierlift_zero.units if not u.frozen)
    frozen.shard.requires_grad_(True)
    with pytest.raises(RuntimeError, match="was frozen when tierlift.zero.shard"):
        model(idx)
    frozen.shard.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    before = trainable.shard.detach().clone()
    trainable.shard.requires_grad_(False)
    with pytest.raises(RuntimeError, match="was trainable when tierlift.zero.shard"):
        opt.step()
    assert torch.equal(trainable.shard.detach(), before)
    with pytest.raises(RuntimeError, match="fixed at shard"):
        model(idx)


def test_stage2_frozen_stays_replicated_and_unfreezing_is_refused():
    model = tierlift.zero.shard(make_lora(), stage=2)
    assert not any(u.frozen for u in model._tierlift_zero.units)
    assert model.blocks[0].up.base.weight.dtype == torch.float32  # a plain Parameter still
    model.blocks[0].up.base.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="'blocks.0.up.base.weight' was frozen"):
        model(batches(1, 2)[0][:, :-1])


def test_default_units_count_frozen_at_stage3():
    model = make_lora()
    assert tierlift.zero.default_units(model, include_frozen=True) == [
        "tok", "blocks.0", "blocks.1", "blocks.2", "head"]
    sharded = tierlift.zero.shard(make_lora(torch.bfloat16), stage=3)
    units = [(u.name, u.frozen, u.shard.dtype) for u in sharded._tierlift_zero.units]
    assert ("blocks.0", True, torch.bfloat16) in units  # the bf16 base, its own dtype
    assert ("blocks.0", True, torch.float32) in units   # its fp32 LayerNorm
    assert ("blocks.0", False, torch.float32) in units  # the adapters


@pytest.mark.parametrize("stages", [(2, 3), (3, 2)])
def test_checkpoint_across_stages(tmp_path, stages):
    """Stages 1/2 save frozen parameters replicated, stage 3 in units: either loads into the
    other."""
    saved_at, loaded_at = stages
    model = tierlift.zero.shard(make_lora(torch.bfloat16), stage=saved_at)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPT)
    fit(model, opt, batches(2, 4))
    tierlift.checkpoint.save(tmp_path / "ckpt", model, opt)
    again = tierlift.zero.shard(make_lora(torch.bfloat16, seed=9), stage=loaded_at)
    opt2 = torch.optim.AdamW([p for p in again.parameters() if p.requires_grad], **OPT)
    tierlift.checkpoint.load(tmp_path / "ckpt", again, opt2)
    want, got = tierlift.zero.full_state_dict(model), tierlift.zero.full_state_dict(again)
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    data = batches(2, 4, seed=4)
    assert fit(model, opt, data) == fit(again, opt2, data)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant):
    """Blocks recomputed in backward (checkpointed through their __call__, as Hugging Face
    does): the frozen base is gathered for the recomputation and freed after its backward;
    training equals the plain model's."""

    def checkpointed(model):
        model.reentrant = reentrant
        return model

    data = batches(3, 4)
    ref = checkpointed(make_lora())
    ref_losses = fit(ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad],
                                            **OPT), data)
    model = tierlift.zero.shard(checkpointed(make_lora()), stage=3)
    state = model._tierlift_zero
    seen = []
    model.blocks[0].register_full_backward_pre_hook(
        lambda *_: seen.append(sorted({u.name for u in state.units
                                       if u.frozen and u.full_bytes > 0})))
    losses = fit(model, torch.optim.AdamW(model.parameters(), **OPT), data)
    assert losses == ref_losses
    assert all(u.full_bytes == 0 for u in state.units)
    # The later blocks' frozen weights were freed before the first block's backward.
    assert all("blocks.1" not in s and "blocks.2" not in s for s in seen) and seen
    sd = tierlift.zero.full_state_dict(model)
    for key, value in ref.state_dict().items():
        assert torch.equal(sd[key], value), key
