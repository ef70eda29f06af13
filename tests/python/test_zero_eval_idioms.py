"""Evaluation and inference idioms between training steps on a sharded model (stages 1, 2, 3),
each against the same model unsharded on the whole batch (the ranks' equal slices average to
its loss, as DDP's do).

- torch.inference_mode() and torch.no_grad() evals between steps (stage 3 gathers inside
  them, resharding after forward or not): the same logits, no inference tensor left in a
  shard or its gradient, and training goes on with torch's losses and weights.
- Hugging Face generate() (greedy, a tiny LlamaForCausalLM, use_cache on and off): the
  unsharded model's tokens, then training goes on exactly.
- model.eval() with Dropout and BatchNorm: running statistics used, not updated; model.train()
  turns dropout back on.
- A last partial batch on one rank (same number of forwards, other shapes): exact per rank.
- Uneven eval forwards (rank 0 one more, as DDP's join() covers): at stage 3 each forward
  gathers, so the next training step raises RankFailureError on every rank within seconds,
  nothing stepped; an extra forward balanced by a later one pairs identical gathers and is
  exact. Stages 1/2 eval without collectives. With two stage-3 models over the same ranks (a
  policy and its reference), the extra forward of one would gather with the other's forward:
  refused at its start, before any gather.
- torch.autocast bf16 eval, bf16 eval through MixedPrecision (a bf16 copy of the weights,
  buffers kept fp32), and torch.compile(model) eval at stage 3 that sees the weights of the
  step taken after it was compiled.

One spawn of 2 gloo ranks; each rank writes what it saw and the tests check it."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from zero_model import batches, make_model, raised, spawn_ranks, train

import tierlift
from tierlift.zero import MixedPrecision

LR = 1e-2
VARIANTS = [(1, True), (2, True), (3, True), (3, False)]  # (stage, reshard_after_forward)


def _state(model, zero: bool) -> dict:
    sd = tierlift.zero.full_state_dict(model) if zero else model.state_dict()
    return {k: v.detach().float().clone() for k, v in sd.items()}


def _evals_between_steps(model, rank: int, world: int, zero: bool) -> dict:
    """Train, eval (inference_mode and no_grad in turn), train on; then autocast bf16 and a
    compiled eval (stage 3 and plain) before and after one more step."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    data, evals = batches(4, 4), batches(2, 4, seed=7)
    out = {"losses": [], "evals": []}
    for i, seq in enumerate(data):
        out["losses"] += train(model, opt, [seq], accum=1, clip=None, world=world, rank=rank,
                               zero=zero)
        with torch.inference_mode() if i % 2 == 0 else torch.no_grad():
            out["evals"].append(model(evals[i % 2][:, :-1]).clone())
    out["inference_left"] = any(p.is_inference() or (p.grad is not None and p.grad.is_inference())
                                for p in model.parameters())
    x = evals[0][:, :-1]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out["autocast"] = model(x).float()
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        out["compiled"] = compiled(x).clone()
    out["losses"] += train(model, opt, batches(1, 4, seed=3), accum=1, clip=None, world=world,
                           rank=rank, zero=zero)
    with torch.no_grad():
        out["compiled_after_step"] = compiled(x).clone()
    out["state"] = _state(model, zero)
    return out


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _generate_between_steps(model, rank: int, world: int, zero: bool) -> dict:
    g = torch.Generator().manual_seed(5)
    prompts, data = torch.randint(3, 64, (2, 5), generator=g), torch.randint(3, 64, (4, 9),
                                                                             generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step() -> float:
        opt.zero_grad()
        ids = data.chunk(world)[rank]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        loss = loss.detach()
        if zero:
            torch.distributed.all_reduce(loss)
        return loss.item() / world

    out = {"losses": [step()]}
    model.eval()
    for use_cache in (True, False):
        out[use_cache] = model.generate(prompts, max_new_tokens=6, do_sample=False,
                                        use_cache=use_cache, pad_token_id=0)
    model.train()
    out["losses"] += [step(), step()]
    return out


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 4))


def _eval_mode(model, rank: int, world: int, zero: bool) -> dict:
    """Steps in eval mode (no dropout: the ranks' slices average to the whole batch's
    gradient), a training-mode forward on this rank's slice (its own statistics, as DDP), then
    eval forwards that must use and keep them."""
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(4, 8, generator=g) for _ in range(3)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.eval()
    for x in xs[:2]:
        opt.zero_grad()
        model(x.chunk(world)[rank] if zero else x).square().mean().backward()
        opt.step()
    model.train()
    with torch.no_grad():
        model(xs[2].chunk(world)[rank])
    model.eval()
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    with torch.no_grad():
        out = {"eval": model(xs[2]).clone(), "again": model(xs[2]).clone()}
    out["buffers_kept"] = all(torch.equal(buffers[k], v) for k, v in model.named_buffers())
    model.train()
    with torch.no_grad():
        out["dropout_on"] = not torch.equal(model(xs[2]), model(xs[2]))
    return out


def _partial_batch(model, rank: int, zero: bool) -> list:
    """Two eval forwards; the second splits 5 rows 3 / 2 (plain: the whole batch)."""
    out = []
    with torch.no_grad():
        for i, x in enumerate(batches(2, 5, seed=11)):
            x = x[:, :-1]
            if zero and i == 1:
                x = x[:3] if rank == 0 else x[3:]
            out.append(model(x).clone())
    return out


def _mixed_precision_eval(stage: int) -> dict:
    model = tierlift.zero.shard(make_model(), stage=stage, mixed_precision=MixedPrecision())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    train(model, opt, batches(1, 4), accum=1, clip=None, world=2,
          rank=torch.distributed.get_rank(), zero=True)
    full = tierlift.zero.full_state_dict(model)
    ref = make_model()
    ref.load_state_dict(full)
    ref = ref.to(torch.bfloat16)
    ref.logit_scale = full["logit_scale"].clone()  # buffers stay fp32 under MixedPrecision
    x = batches(1, 4, seed=7)[0][:, :-1]
    with torch.no_grad():
        expected = ref(x)
        got = model(x)
    with torch.inference_mode():
        got_inference = model(x)
    return {"dtype": got.dtype, "diff": (got.float() - expected.float()).abs().max().item(),
            "diff_inference": (got_inference.float() - expected.float()).abs().max().item()}


def _uneven(stage: int, rank: int, world: int, balanced: bool) -> dict:
    """Rank 0 evaluates one batch more; balanced: rank 1 one more in a later eval. Then two
    training steps."""
    model = tierlift.zero.shard(make_model(), stage=stage)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ev = batches(3, 2, seed=11)
    # DDP's `with model.join():` for uneven inputs: a sharded model has none; it fails at once.
    out = {"evals": [], "join": raised(lambda: model.join())}
    with torch.no_grad():
        for x in ev[:3 if rank == 0 else 2]:
            out["evals"].append(model(x[:, :-1]).clone())
        if balanced:
            for x in ev[:1 if rank == 0 else 2]:
                out["evals"].append(model(x[:, :-1]).clone())
    before = [p.detach().clone() for p in model.parameters()]
    start = time.monotonic()
    out["error"] = raised(lambda: out.setdefault("losses", train(
        model, opt, batches(2, 4), accum=1, clip=None, world=world, rank=rank, zero=True)))
    out["seconds"] = time.monotonic() - start
    out["kept"] = all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    if out["error"] == "<no error>":
        out["state"] = _state(model, True)
    return out


def _two_models(rank: int, extra: bool) -> dict:
    """Two stage-3 models over the same ranks (a policy and its reference model, a teacher,
    an EMA copy) evaluated in turn; extra: rank 0 evaluates the first one batch more first.
    Their gathers share the ranks' collectives: the extra forward would pair the first model's
    weight gathers with the second's (same sizes), wrong logits on both ranks, no error."""
    first = tierlift.zero.shard(make_model(0), stage=3)
    second = tierlift.zero.shard(make_model(1), stage=3)
    plain = make_model(0), make_model(1)
    before = [p.detach().clone() for m in (first, second) for p in m.parameters()]
    xs = [x[:, :-1] for x in batches(3, 2, seed=11)]
    out = {"diffs": []}

    def evaluate():
        with torch.no_grad():
            if extra and rank == 0:
                first(xs[0])
            for x in xs[1:]:
                for model, ref in zip((second, first), plain[::-1], strict=True):
                    out["diffs"].append((model(x) - ref(x)).abs().max().item())

    start = time.monotonic()
    out["error"] = raised(evaluate)
    out["seconds"] = time.monotonic() - start
    after = [p for m in (first, second) for p in m.parameters()]
    out["kept"] = all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    return out


def _cases(rank, world, tmp):
    # The references on this rank (eval mode's statistics are this rank's).
    out = {"plain_evals": _evals_between_steps(make_model(), 0, 1, False),
           "plain_generate": _generate_between_steps(_llama(), 0, 1, False),
           "plain_eval_mode": _eval_mode(_bn_model(), rank, world, False),
           "plain_partial": _partial_batch(make_model(), rank, False)}
    for stage, reshard in VARIANTS:
        model = tierlift.zero.shard(make_model(), stage=stage, reshard_after_forward=reshard)
        torch._dynamo.reset()
        out["evals", stage, reshard] = _evals_between_steps(model, rank, world, True)
    for stage in (1, 2, 3):
        out["generate", stage] = _generate_between_steps(
            tierlift.zero.shard(_llama(), stage=stage), rank, world, True)
        out["eval_mode", stage] = _eval_mode(tierlift.zero.shard(_bn_model(), stage=stage),
                                             rank, world, True)
        out["partial", stage] = _partial_batch(tierlift.zero.shard(make_model(), stage=stage),
                                               rank, True)
        out["mixed", stage] = _mixed_precision_eval(stage)
        out["uneven_balanced", stage] = _uneven(stage, rank, world, balanced=True)
    for stage in (1, 2):
        out["uneven", stage] = _uneven(stage, rank, world, balanced=False)
    out["two_models"] = _two_models(rank, extra=False)
    # Last: the ranks' forwards stay out of step after it.
    out["uneven", 3] = _uneven(3, rank, world, balanced=False)
    return out


def _two_models_uneven(rank, world, tmp):
    # A spawn of its own: the rank that did not see the divergence itself waits in its
    # gather until the other one leaves.
    return _two_models(rank, extra=True)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("zero_eval_idioms")))


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stage,reshard", VARIANTS)
def test_inference_mode_and_no_grad_evals_between_steps(ranks, stage, reshard):
    for out in ranks:
        got, ref = out["evals", stage, reshard], out["plain_evals"]
        assert not got["inference_left"]
        _close(got["losses"], ref["losses"])
        for name in ("evals", "autocast", "compiled", "compiled_after_step"):
            _close(got[name], ref[name])
        # The compiled model saw the step taken after it was compiled.
        assert not torch.allclose(got["compiled"], got["compiled_after_step"])
        for k, v in ref["state"].items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_generate_gives_the_unsharded_tokens_and_training_goes_on(ranks, stage):
    for out in ranks:
        got, ref = out["generate", stage], out["plain_generate"]
        for use_cache in (True, False):
            assert torch.equal(got[use_cache], ref[use_cache]), use_cache
        _close(got["losses"], ref["losses"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_eval_mode_uses_and_keeps_running_stats(ranks, stage):
    for out in ranks:
        got, ref = out["eval_mode", stage], out["plain_eval_mode"]
        _close(got["eval"], ref["eval"])
        assert torch.equal(got["eval"], got["again"])
        assert got["buffers_kept"] and got["dropout_on"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_partial_last_batch_on_one_rank(ranks, stage):
    for rank, out in enumerate(ranks):
        got, ref = out["partial", stage], out["plain_partial"]
        _close(got[0], ref[0])
        _close(got[1], ref[1][:3] if rank == 0 else ref[1][3:])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mixed_precision_eval_is_a_bf16_copy(ranks, stage):
    for out in ranks:
        got = out["mixed", stage]
        assert got["dtype"] == torch.bfloat16
        assert got["diff"] == 0.0 and got["diff_inference"] == 0.0, got


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_uneven_evals_balanced_later_are_exact(ranks, stage):
    plain = make_model()
    with torch.no_grad():
        ref = [plain(x[:, :-1]) for x in batches(3, 2, seed=11)]
    losses = ranks[0]["uneven_balanced", stage]["losses"]
    for rank, out in enumerate(ranks):
        got = out["uneven_balanced", stage]
        assert got["error"] == "<no error>", got["error"]
        expected = ref[:3] + ref[:1] if rank == 0 else ref[:2] + ref[:2]
        for a, b in zip(got["evals"], expected, strict=True):
            _close(a, b)
        assert got["losses"] == losses


def test_uneven_evals_stage3_fail_on_every_rank_quickly(ranks):
    for out in ranks:
        got = out["uneven", 3]
        assert got["error"].startswith("RankFailureError"), got["error"]
        assert "without grad" in got["error"], got["error"]
        assert got["seconds"] < 15, got["seconds"]
        assert got["kept"]  # nothing stepped
        assert got["join"].startswith("AttributeError"), got["join"]


@pytest.mark.parametrize("stage", [1, 2])
def test_uneven_evals_stages_1_2_need_no_collective(ranks, stage):
    plain = make_model()
    opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    ref_losses = train(plain, opt, batches(2, 4), accum=1, clip=None)
    for out in ranks:
        got = out["uneven", stage]
        assert got["error"] == "<no error>", got["error"]
        _close(got["losses"], ref_losses)



def test_two_models_evaluated_in_turn(ranks):
    for out in ranks:
        got = out["two_models"]
        assert got["error"] == "<no error>", got["error"]
        assert max(got["diffs"]) < 1e-5, got["diffs"]


def test_uneven_evals_over_two_models_refused_before_any_gather(tmp_path):
    """Rank 0's extra forward of the first model would gather with rank 1's forward of the
    second: refused before any gather, no logits returned on either rank, nothing changed."""
    seen = 0
    for got in spawn_ranks(_two_models_uneven, str(tmp_path)):
        # The rank that saw it raises at once; one whose check ran first waits in its gather
        # until the other leaves.
        assert got["error"].startswith("RankFailureError"), got["error"]
        seen += "ran on some ranks only" in got["error"]
        assert got["diffs"] == [], got["diffs"]
        assert got["seconds"] < 15, got["seconds"]
        assert got["kept"]
    assert seen >= 1
