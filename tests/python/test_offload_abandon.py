"""A step that will be clipped or skipped does not wait for the overlap's worker to finish chunks
it would only step again.

With the optimizer's own max_grad_norm, a norm above it scales every gradient, so every chunk
stepped during backward is redone. A worker that is behind backward (the CPU Adam slower than
the device's backward, as on a large model) used to make step() wait for all its queued chunks
first. step() now takes the clip's norm before waiting; where it clips (or a GradScaler found
inf/NaN, so the step is skipped), the worker leaves the chunks it has not started.

The user's own torch.nn.utils.clip_grad_norm_ between backward and step() is another case:
the chunks the worker starts after it read the clipped gradients, so step() waits for them and
keeps them; only those stepped before it are stepped again.

The worker is held at its first chunk (or its second submission) until step() has decided (or
the clip is done), so the tests do not depend on timing: without the abandon it would step
every chunk (and hold until its wait times out).
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import tierlift
from tierlift.offload.overlap import Overlap
from tierlift.offload.runner import Offloader
from tierlift.optim import AdamW

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

LAYERS, DIM = 6, 64
HOLD_S = 5.0  # the longest the held worker waits for step() (only reached when it fails)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(LAYERS)])


@pytest.fixture
def held_worker(monkeypatch):
    """Holds the worker's first speculative chunk of each backward until step() abandons the
    rest (or HOLD_S passes); counts the chunks the worker stepped."""
    state = {"abandoned": threading.Event(), "worker_chunks": 0, "held": False}
    step_chunk, abandon = Offloader._step_chunk, Overlap.abandon

    def held_step_chunk(self, *args, **kwargs):
        if threading.current_thread().name.startswith("tierlift-offload"):
            state["worker_chunks"] += 1
            if not state["held"]:
                state["held"] = True
                state["abandoned"].wait(HOLD_S)
        return step_chunk(self, *args, **kwargs)

    def abandon_and_release(self):
        abandon(self)
        state["abandoned"].set()

    monkeypatch.setattr(Offloader, "_step_chunk", held_step_chunk)
    monkeypatch.setattr(Overlap, "abandon", abandon_and_release)
    return state


def _train(opt, model, steps: int, state=None, clip_torch: float | None = None,
           scaler=None, device: str = "cpu") -> list[dict]:
    g = torch.Generator().manual_seed(1)
    stats = []
    for _ in range(steps):
        if state is not None:
            state.update(held=False, worker_chunks=0)
            state["abandoned"].clear()
        loss = model(torch.randn(16, DIM, generator=g).to(device)).square().mean()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if clip_torch is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_torch)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        stats.append(dict(getattr(opt, "last_step_stats", {}),
                          worker_chunks=None if state is None else state["worker_chunks"]))
        opt.zero_grad(set_to_none=True)
    return stats


def _chunks(opt) -> int:
    return sum(len(lay.chunks) for lay in opt._offload.layouts)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_clipped_step_leaves_unstarted_chunks_and_steps_exactly(held_worker, state_dtype):
    ref_model, model = _model(), _model()
    ref = AdamW(ref_model.parameters(), lr=1e-2, state_dtype=state_dtype)
    _train(ref, ref_model, 3, clip_torch=1e-3)
    opt = AdamW(model.parameters(), lr=1e-2, offload="cpu", overlap=True, max_grad_norm=1e-3,
                chunk_bytes=DIM * DIM * 4, state_dtype=state_dtype)
    stats = _train(opt, model, 3, state=held_worker)
    n = _chunks(opt)
    assert n >= LAYERS  # one chunk per weight at least: something to leave
    for s in stats:
        assert s["grad_norm"] > 1e-3  # every step clips
        # at most the held chunk ran (none if the worker had not started when step()
        # decided); the rest, queued or in its own submission, were left
        assert s["worker_chunks"] <= 1
        assert s["overlap_abandoned_chunks"] == n - s["worker_chunks"]
        assert s["overlap_kept_chunks"] == 0
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    opt.close()


def test_unclipped_step_waits_and_keeps_its_chunks(held_worker):
    ref_model, model = _model(), _model()
    ref = AdamW(ref_model.parameters(), lr=1e-2)
    _train(ref, ref_model, 2)
    opt = AdamW(model.parameters(), lr=1e-2, offload="cpu", overlap=True, max_grad_norm=1e9,
                chunk_bytes=DIM * DIM * 4)
    # Nothing abandons, so release the hold at once: this case is about what is kept.
    held_worker["abandoned"].set()
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        model(torch.randn(16, DIM, generator=g)).square().mean().backward()
        opt.step()
        s = opt.last_step_stats
        assert s.get("overlap_abandoned_chunks", 0) == 0
        assert s["overlap_kept_chunks"] > 0
        opt.zero_grad(set_to_none=True)
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    opt.close()


def test_step_the_scaler_skips_leaves_unstarted_chunks(held_worker):
    """GradScaler found inf: the step is skipped, nothing changes, the worker's queue is
    dropped."""
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2, offload="cpu", overlap=True,
                chunk_bytes=DIM * DIM * 4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    held_worker["abandoned"].set()  # the first step holds nothing
    _train(opt, model, 1, scaler=scaler)  # the first step: the overlap assumes a scale
    before = [p.detach().clone() for p in model.parameters()]
    held_worker.update(held=False, worker_chunks=0)
    held_worker["abandoned"].clear()
    loss = model(torch.randn(16, DIM)).square().mean()
    scaler.scale(loss).backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    scaler.step(opt)
    s = opt.last_step_stats
    assert s["skipped"] is True
    assert held_worker["worker_chunks"] <= 1
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)
    opt.close()


def test_a_refused_gradient_changes_nothing_and_the_next_step_is_exact(held_worker):
    """A sparse gradient: step() refuses it, now before the clip's norm is taken, changes
    nothing, and once the gradient is dense again training goes on exactly."""
    held_worker["abandoned"].set()
    ref_model, model = _model(), _model()
    ref = AdamW(ref_model.parameters(), lr=1e-2)
    opt = AdamW(model.parameters(), lr=1e-2, offload="cpu", overlap=True, max_grad_norm=1e9,
                chunk_bytes=DIM * DIM * 4)
    x = torch.randn(16, DIM)
    for m, o in ((ref_model, ref), (model, opt)):
        m(x).square().mean().backward()
        o.step()
        o.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    dense = model[0].weight.grad
    model[0].weight.grad = dense.to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradient"):
        opt.step()
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)
    model[0].weight.grad = dense
    opt.step()
    ref_model(x).square().mean().backward()
    ref.step()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    opt.close()


@pytest.fixture
def held_second_submission(monkeypatch):
    """Holds the worker's second submission of each backward until the test releases it
    (`release`), after the first has finished."""
    state = {"release": threading.Event(), "first_done": threading.Event(), "calls": 0}
    work = Overlap._work

    def held_work(self, *args, **kwargs):
        state["calls"] += 1
        if state["calls"] == 2:
            state["release"].wait(HOLD_S)
        try:
            return work(self, *args, **kwargs)
        finally:
            if state["calls"] == 1:
                state["first_done"].set()

    monkeypatch.setattr(Overlap, "_work", held_work)
    return state


@pytest.mark.parametrize("device, state_dtype", [
    ("cpu", "fp32"), ("cpu", "bf16"),
    pytest.param("cuda", "fp32", marks=pytest.mark.gpu),
    pytest.param("cuda", "bf16", marks=pytest.mark.gpu)])
def test_torch_clip_after_backward_keeps_the_chunks_started_after_it(held_second_submission,
                                                                     device, state_dtype):
    """torch.nn.utils.clip_grad_norm_ (the Hugging Face Trainer's, with a tierlift optimizer
    passed in) scales every gradient between backward and step(): the chunks the worker stepped
    before it are stepped again, and those it starts after it read the clipped gradients, so
    step() waits for them and keeps them (leaving them would only move that work into step()).
    On a GPU the gradients are fingerprinted there; the reference is the same offload without
    the overlap."""
    ref_model, model = _model().to(device), _model().to(device)
    ref = AdamW(ref_model.parameters(), lr=1e-2, state_dtype=state_dtype, offload="cpu",
                chunk_bytes=DIM * DIM * 4)
    _train(ref, ref_model, 2, clip_torch=1e-3, device=device)
    opt = AdamW(model.parameters(), lr=1e-2, offload="cpu", overlap=True,
                chunk_bytes=DIM * DIM * 4, state_dtype=state_dtype)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        held = held_second_submission
        held.update(calls=0)
        held["release"].clear()
        held["first_done"].clear()
        model(torch.randn(16, DIM, generator=g).to(device)).square().mean().backward()
        assert held["first_done"].wait(HOLD_S)
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3) > 1e-3  # it scales
        held["release"].set()
        opt.step()
        s = opt.last_step_stats
        assert s["overlap_redone_chunks"] >= 1  # the first submission read the gradients before
        assert s["overlap_kept_chunks"] >= 1  # the held one read them clipped
        assert s["overlap_kept_chunks"] + s["overlap_redone_chunks"] == _chunks(opt)
        assert s.get("overlap_abandoned_chunks", 0) == 0
        opt.zero_grad(set_to_none=True)
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    opt.close()
    ref.close()


def test_torch_clip_below_its_threshold_keeps_the_chunks():
    """Under the threshold clip_grad_norm_ scales by exactly 1.0: no bit changes, the probe
    finds nothing, the worker's chunks are kept."""
    ref_model, model = _model(), _model()
    ref = AdamW(ref_model.parameters(), lr=1e-2)
    _train(ref, ref_model, 2, clip_torch=1e9)
    opt = AdamW(model.parameters(), lr=1e-2, offload="cpu", overlap=True,
                chunk_bytes=DIM * DIM * 4)
    stats = _train(opt, model, 2, clip_torch=1e9)
    for s in stats:
        assert s.get("overlap_rewritten_gradients", 0.0) == 0.0
        assert s.get("overlap_abandoned_chunks", 0) == 0
        assert s["overlap_kept_chunks"] > 0
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    opt.close()
