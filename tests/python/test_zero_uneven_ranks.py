"""Ranks that run different forwards of a stage-3 sharded model fail with a clear error within
seconds, not after the process group's timeout (2 gloo ranks, one spawn, a 10 s timeout so the
old hang fails fast too):

- an eval loop where rank 0 has one batch more, then the user's `dist.all_reduce(loss)`: rank
  0's extra forward would gather weights against rank 1's all_reduce. With rank 1 inside its
  all_reduce first, both ranks raise RankFailureError naming the call and the forwards
  before anything is sent, and the same model goes on: an even eval and all_reduce
  afterwards gives the plain model's sum, and a training step its loss.
- the same where rank 1 reaches its all_reduce only after rank 0's extra forward is waiting in
  its gather: rank 1 refuses at once; rank 0's gather fails once rank 1 leaves, naming it.
- Hugging Face generate() without tierlift.hf.install, each rank generating another number of
  tokens (synced_gpus left out, and an explicit False as Seq2SeqTrainer passes): each rank gets
  the unsharded model's tokens.
"""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from zero_model import batches, free_port, init_gloo, make_model, train

import tierlift

pytest.importorskip("transformers")

TIMEOUT_S = 10.0


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()


def _generate(rank: int) -> dict:
    plain, model = _llama(), tierlift.zero.shard(_llama(), stage=3)
    prompt, n = torch.tensor([[5, 6, 7, 8]]), 2 + 5 * rank
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    out = {"ref": plain.generate(prompt, **kw)}
    for name, extra in (("default", {}), ("explicit_false", {"synced_gpus": False})):
        out[name] = model.generate(prompt, **kw, **extra)
    return out


def _eval_sum(model, rank: int, extra: bool, pause: float = 0.0) -> torch.Tensor:
    """Sum of the eval losses; extra: rank 0 has a third batch, taken after `pause` s."""
    loss = torch.zeros(())
    with torch.no_grad():
        for i, x in enumerate(batches(3 if extra and rank == 0 else 2, 2, seed=11)):
            if i == 2:
                time.sleep(pause)
            loss += model(x[:, :-1]).float().mean()
    return loss


def _attempt(fn) -> tuple[str, float]:
    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads which error it was
        return f"{type(e).__name__}: {e}", time.monotonic() - start
    return "<no error>", time.monotonic() - start


def _cases(rank: int, port: int, tmp: str) -> None:
    init_gloo(rank, 2, port, timeout_s=TIMEOUT_S)
    out = {"generate": _generate(rank)}

    # Rank 0 evaluates one batch more, then both all-reduce: both refuse (rank 1 is inside
    # its all_reduce before rank 0's extra forward starts).
    model = tierlift.zero.shard(make_model(), stage=3)
    out["uneven"] = _attempt(lambda: dist.all_reduce(_eval_sum(model, rank, True, 1.0)))
    # Nothing was sent and the refused forward never ran: the same model evaluated evenly
    # sums as the plain model does (an async all_reduce agrees too), and trains on.
    total = _eval_sum(model, rank, extra=False)
    if rank == 1:
        time.sleep(0.5)  # rank 0 reads rank 1's refused call first: not taken for entered
    dist.all_reduce(total)
    ones = torch.ones(1)
    dist.all_reduce(ones, async_op=True).wait()
    plain = make_model()
    out["even"] = (float(total), float(_eval_sum(plain, rank, extra=False)) * 2, float(ones))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out["step"] = train(model, opt, batches(1, 4), accum=1, clip=None, world=2, rank=rank,
                        zero=True)
    out["plain_step"] = train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2),
                              batches(1, 4), accum=1, clip=None)

    # A model the script dropped lives on rank 0 until a full collection, while rank 1
    # collected its own: a user call waits for the models left, not _AGREE_S for that one.
    gc.disable()
    old = tierlift.zero.shard(make_model(), stage=3)
    old.__dict__["_cycle"] = [old]  # freed by a full collection only
    _eval_sum(old, rank, extra=False)
    del old
    if rank == 1:
        gc.collect()
    out["dropped"] = _attempt(lambda: dist.all_reduce(torch.ones(1)))
    gc.enable()

    # Rank 1 reaches its all_reduce after rank 0's extra forward waits in its gather. Last:
    # rank 1 leaves after refusing, and that ends rank 0's gather.
    model = tierlift.zero.shard(make_model(), stage=3)
    if rank == 1:
        loss = _eval_sum(model, rank, extra=True)
        time.sleep(1.0)
        out["late"] = _attempt(lambda: dist.all_reduce(loss))
    else:
        out["late"] = _attempt(lambda: _eval_sum(model, rank, extra=True))
    torch.save(out, os.path.join(tmp, f"out{rank}.pt"))
    os._exit(0)  # no teardown: rank 0 may still be inside its gather until rank 1 leaves


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("uneven_ranks"))
    mp.spawn(_cases, args=(free_port(), tmp), nprocs=2)
    return [torch.load(os.path.join(tmp, f"out{r}.pt"), weights_only=False) for r in range(2)]


def test_generate_without_install_keeps_ranks_in_step(ranks):
    for rank, out in enumerate(ranks):
        got = out["generate"]
        assert got["ref"].shape[1] == 4 + 2 + 5 * rank
        assert torch.equal(got["default"], got["ref"]), (rank, got)
        assert torch.equal(got["explicit_false"], got["ref"]), (rank, got)


def test_uneven_eval_then_all_reduce_refused_on_both_ranks(ranks):
    for out in ranks:
        error, seconds = out["uneven"]
        assert error.startswith("RankFailureError: tierlift.zero: rank 1 called allreduce (a "
                                "collective of its own) after forward 2 of sharded model"), error
        assert "but rank 0 went on to the model's collectives" in error, error
        assert "ran on some ranks only" in error and "Nothing was sent" in error, error
        assert seconds < TIMEOUT_S / 2, seconds


def test_same_model_goes_on_exactly_after_a_refusal(ranks):
    for out in ranks:
        total, expected, ones = out["even"]
        assert total == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert ones == 2.0
        assert out["step"] == pytest.approx(out["plain_step"], rel=1e-5)


def test_call_made_after_the_extra_gather_started_names_it(ranks):
    caller, gatherer = ranks[1]["late"], ranks[0]["late"]
    assert caller[0].startswith("RankFailureError: tierlift.zero: rank 1 called allreduce"), \
        caller
    assert caller[1] < 2.0, caller
    assert gatherer[0].startswith("RankFailureError: "), gatherer
    assert "rank 1 called allreduce (a collective of its own)" in gatherer[0], gatherer
    assert gatherer[1] < TIMEOUT_S, gatherer


def test_a_dropped_model_not_yet_collected_holds_up_no_call(ranks):
    for out in ranks:
        error, took = out["dropped"]
        assert error == "<no error>" and took < 2.0, out["dropped"]
