"""offload="cpu" with overlap=True under a cpu_budget smaller than two generations: the host tier
keeps one generation plus the spare chunk blocks the budget holds (tiers.MemoryTier). The
overlap steps chunks ahead into spare blocks while they last (out of place, validated as
always), step() steps the others in place; commit adopts the blocks. Checked here: the memory
held (within the budget, below two generations), the split (kept chunks = spare blocks), the
result bit for bit against offload="none" (fp32 and compact state, fp32 and bf16 weights, with
chunks redone after a clip that scales and after a weight edit), and that every block comes back
after a step, a skipped step, a load between backward and step() and a worker failure. The
whole conformance matrix runs the modes cpu_ov_spare and c_cpu_ov_spare (conformance_util)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import tierlift
from tierlift.offload.overlap import Overlap

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

CHUNK = 16 << 10  # 4096 elements per chunk


def build(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 8)).to(dtype)


def optimizer(model, *, state_dtype="fp32", spare=None, **kw):
    """AdamW(offload="cpu", overlap=True) whose budget holds one generation and `spare` chunks
    (None: no budget, two generations)."""
    common = dict(lr=1e-2, chunk_bytes=CHUNK, state_dtype=state_dtype)
    if spare is not None:
        one, per_chunk = generation_bytes(model[0].weight.dtype, state_dtype)
        kw["cpu_budget"] = one + spare * per_chunk + per_chunk // 2
    return tierlift.optim.AdamW(model.parameters(), offload="cpu", overlap=True, **common, **kw)


def generation_bytes(dtype=torch.float32, state_dtype="fp32") -> tuple[int, int]:
    """(one generation of the overlapped host tier's state, one chunk of it), in bytes."""
    probe = tierlift.optim.AdamW(build(dtype).parameters(), offload="cpu", overlap=True,
                                 chunk_bytes=CHUNK, state_dtype=state_dtype)
    tier = probe._offload.tiers[0]
    one = tier.resident_bytes // 2
    probe._offload.close()
    return one, one // len(tier.gen)


def train(model, opt, steps=5, clip_every=0, edit_at=None):
    g = torch.Generator().manual_seed(1)
    stats = []
    for i in range(steps):
        x = torch.randn(16, 64, generator=g).to(model[0].weight.dtype)
        opt.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        if clip_every and i % clip_every == 0:
            # After the worker's steps (a chunk it stepped from the clipped gradients would be
            # kept, by timing): every chunk stepped ahead is then redone.
            if getattr(opt, "_offload", None) is not None and opt._offload.overlap is not None:
                opt._offload.overlap.wait()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-4)  # scales: chunks redone
        if edit_at == i:
            with torch.no_grad():
                model[2].weight.mul_(0.5)  # after backward: its chunks' publish sees it
        opt.step()
        stats.append(dict(opt.last_step_stats))
    return stats


def assert_free(opt):
    for tier in opt._offload.tiers:
        assert not tier.pending and len(tier.free) == tier.spare, (tier.pending, tier.free)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_spare_blocks_hold_the_budget_and_step_exactly(state_dtype, dtype):
    ref = build(dtype)
    ref_opt = tierlift.optim.AdamW(ref.parameters(), lr=1e-2, state_dtype=state_dtype)
    model = build(dtype)
    opt = optimizer(model, state_dtype=state_dtype, spare=3)
    off = opt._offload
    tier = off.tiers[0]
    n = len(off.layouts[0].chunks)
    assert tier.spare == 3 and tier.generations == 1 and n > 3
    # One generation and 3 chunks instead of two generations; within the budget.
    one, per_chunk = generation_bytes(dtype, state_dtype)
    assert tier.resident_bytes == one + 3 * per_chunk
    assert tier.resident_bytes + off.pool_bytes <= off.config.cpu_budget
    stats = train(model, opt)
    train(ref, ref_opt)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    for st in stats[1:]:  # the first step's gradients arrive before any step count exists
        assert st["overlap_kept_chunks"] == 3 and st["overlap_redone_chunks"] == 0, st
        assert st["overlap_no_room_chunks"] == n - 3 and st["ram_chunks"] == n - 3, st
    assert_free(opt)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    for pi, st in ref_sd["state"].items():
        for k, v in st.items():
            assert torch.equal(sd["state"][pi][k], v), (pi, k)


def test_redone_chunks_go_to_their_spare_blocks():
    """A clip that scales every gradient (every chunk stepped ahead is redone, into the block it
    holds) and a weight edited between backward and step() (its chunk's publish refuses it)."""
    ref = build()
    ref_opt = tierlift.optim.AdamW(ref.parameters(), lr=1e-2)
    model = build()
    opt = optimizer(model, spare=2)
    stats = train(model, opt, steps=6, clip_every=2, edit_at=3)
    train(ref, ref_opt, steps=6, clip_every=2, edit_at=3)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert stats[2]["overlap_redone_chunks"] == 2 and stats[2]["overlap_kept_chunks"] == 0
    assert stats[3]["overlap_redone_chunks"] >= 1
    assert_free(opt)


def test_blocks_come_back_after_skips_loads_and_failures(monkeypatch):
    model = build()
    opt = optimizer(model, spare=2, skip_nonfinite=True)
    train(model, opt, steps=2)
    x = torch.randn(16, 64)
    # A skipped step (non-finite gradient): nothing changes, the blocks come back.
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    model[0].weight.grad[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert_free(opt)
    # A load between backward and step(): the chunks stepped ahead are dropped with their blocks.
    sd = opt.state_dict()
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt._offload.overlap.wait()
    assert any(t.pending for t in opt._offload.tiers)
    opt.load_state_dict(sd)
    assert_free(opt)
    opt.step()
    assert_free(opt)
    # A worker that fails: step() raises, the blocks come back, the next step is exact again.
    ref = build()
    ref.load_state_dict(model.state_dict())
    ref_opt = tierlift.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_opt.load_state_dict(opt.state_dict())
    run = type(opt._offload).run

    def failing(self, *args, **kwargs):
        if kwargs.get("publish") is False:
            raise RuntimeError("injected worker failure")
        return run(self, *args, **kwargs)

    monkeypatch.setattr(type(opt._offload), "run", failing)
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()
    assert_free(opt)
    monkeypatch.setattr(type(opt._offload), "run", run)
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()
    ref_opt.zero_grad(set_to_none=True)
    ref(x).square().mean().backward()
    ref_opt.step()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_no_spare_room_warns_and_steps_everything_in_step():
    ref = build()
    ref_opt = tierlift.optim.AdamW(ref.parameters(), lr=1e-2)
    model = build()
    with pytest.warns(RuntimeWarning, match="no spare chunk"):
        opt = optimizer(model, spare=0)
    assert opt._offload.tiers[0].spare == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = train(model, opt, steps=3)
    train(ref, ref_opt, steps=3)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert not stats[-1].get("overlap_kept_chunks")
    assert isinstance(opt._offload.overlap, Overlap)
    assert stats[-1]["ram_chunks"] == len(opt._offload.layouts[0].chunks)


def test_a_budget_below_one_generation_is_refused():
    model = build()
    one, _ = generation_bytes()
    with pytest.raises(ValueError, match="smaller than the optimizer state"):
        tierlift.optim.AdamW(model.parameters(), offload="cpu", overlap=True, chunk_bytes=CHUNK,
                             cpu_budget=one - 1)


@pytest.mark.parametrize("blocking", [True, False], ids=["save", "background-save"])
def test_checkpoint_round_trip(tmp_path, blocking):
    """tierlift.checkpoint with the spare tier (one generation: a save copies it, a load fills it
    in place behind its undo journal): resuming from step 2 gives the uninterrupted run's bits."""
    ref = build()
    ref_opt = optimizer(ref, spare=2)
    train(ref, ref_opt, steps=4)
    model = build()
    opt = optimizer(model, spare=2)
    train(model, opt, steps=2)
    handle = tierlift.checkpoint.save(str(tmp_path / "ck"), model, opt, blocking=blocking)
    if not blocking:
        handle.wait()
    train(model, opt, steps=1)  # diverges, then loads
    model2 = build()
    opt2 = optimizer(model2, spare=2)
    tierlift.checkpoint.load(str(tmp_path / "ck"), model2, opt2)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # the batches of steps 0 and 1 again, then steps 2 and 3
        torch.randn(16, 64, generator=g)
    for _ in range(2):
        x = torch.randn(16, 64, generator=g)
        opt2.zero_grad(set_to_none=True)
        model2(x).square().mean().backward()
        opt2.step()
    for a, b in zip(ref.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert_free(opt2)
