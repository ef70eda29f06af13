"""The overlap's worker steps chunks on a share of tierlift's CPU threads while training runs
(OffloadConfig.overlap_threads; tierlift.offload.worker_threads) and on all of them once step()
waits for it; the threads change no result.

The worker is held at its first chunk until step() waits for it, and step() waits for that
chunk to start first (a tiny backward ends before the worker's first chunk: it then read that
training had ended), so what each chunk ran on does not depend on timing: the first started
while training ran, every later one after step() began waiting."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import tierlift
from tierlift.offload import worker_threads
from tierlift.offload.config import OffloadConfig
from tierlift.offload.overlap import Overlap
from tierlift.offload.runner import Offloader
from tierlift.optim import AdamW

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

HOLD_S = 5.0  # the longest the held worker waits for step() (only reached when it fails)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])


def _train(opt, model, steps: int, device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(8, 64, generator=g).to(device)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-2, ValueError), (True, TypeError),
                                        (2.0, TypeError), ("4", TypeError)])
def test_bad_overlap_threads_are_refused(bad, error):
    with pytest.raises(error, match="overlap_threads"):
        OffloadConfig(offload="cpu", overlap=True, overlap_threads=bad)


def test_overlap_threads_needs_the_overlap():
    with pytest.raises(ValueError, match="needs overlap=True"):
        AdamW(_model().parameters(), offload="cpu", overlap_threads=2)


@pytest.mark.parametrize("pool, on_cuda, requested, want", [
    (16, True, None, 14), (8, True, None, 7), (2, True, None, 1), (1, True, None, 1),
    (16, False, None, 16), (2, False, None, 2), (16, True, 4, 4), (4, False, 9, 4)])
def test_the_default_leaves_an_eighth_of_the_pool_to_training_on_cuda(
        monkeypatch, pool, on_cuda, requested, want):
    monkeypatch.setattr(worker_threads, "pool_size", lambda: pool)
    monkeypatch.setattr(worker_threads, "trains_on_cuda", lambda groups: on_cuda)
    assert worker_threads.cap(requested, []) == want


def test_cpu_parameters_do_not_train_on_cuda():
    assert not worker_threads.trains_on_cuda([{"params": list(_model().parameters())}])


def test_worker_is_capped_while_training_runs_and_not_once_step_waits(monkeypatch):
    seen = []  # the thread limit each of the worker's chunks ran under
    started, waiting = threading.Event(), threading.Event()
    step_chunk, wait_pending = Offloader._step_chunk, Overlap._wait_pending

    def held_step_chunk(self, *args, **kwargs):
        if threading.current_thread().name.startswith("tierlift-offload"):
            seen.append(tierlift._extension._C.thread_limit())
            if len(seen) == 1:
                started.set()
                assert waiting.wait(HOLD_S), "step() never waited for the worker"
        return step_chunk(self, *args, **kwargs)

    def signalled_wait(self):
        assert started.wait(HOLD_S), "the worker stepped no chunk during backward"
        # what _wait_pending() does first, before the worker goes on: its next chunk reads it
        self._training = False
        waiting.set()
        return wait_pending(self)

    monkeypatch.setattr(Offloader, "_step_chunk", held_step_chunk)
    monkeypatch.setattr(Overlap, "_wait_pending", signalled_wait)
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2, offload="cpu", overlap=True, overlap_threads=1,
                chunk_bytes=16 << 10)
    _train(opt, model, 1)
    assert len(seen) > 1, "the worker stepped fewer than two chunks"
    assert seen[0] == 1 and set(seen[1:]) == {0}, seen
    assert opt.last_step_stats["overlap_threads"] == 1.0
    # the worker thread keeps no cap for its other work, nor does the training thread
    assert opt._offload.overlap._pool.submit(tierlift._extension._C.thread_limit).result() == 0
    assert tierlift._extension._C.thread_limit() == 0
    opt.close()


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_a_capped_worker_steps_bit_for_bit_as_the_in_memory_optimizer(state_dtype):
    ref_model, model = _model(), _model()
    ref = AdamW(ref_model.parameters(), lr=1e-2, state_dtype=state_dtype)
    opt = AdamW(model.parameters(), lr=1e-2, offload="cpu", overlap=True, overlap_threads=1,
                chunk_bytes=16 << 10, state_dtype=state_dtype)
    _train(ref, ref_model, 3)
    _train(opt, model, 3)
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert opt.last_step_stats["overlap_kept_chunks"] > 0  # stepped by the capped worker
    opt.close()


@pytest.mark.gpu
def test_on_a_gpu_the_default_leaves_an_eighth_and_steps_exactly():
    """CUDA parameters: the worker's default cap is all but an eighth of the pool, and the
    weights are those of the same offload without the overlap."""
    ref_model, model = _model().cuda(), _model().cuda()
    ref = AdamW(ref_model.parameters(), lr=1e-2, offload="cpu", chunk_bytes=16 << 10)
    opt = AdamW(model.parameters(), lr=1e-2, offload="cpu", overlap=True, chunk_bytes=16 << 10)
    pool = worker_threads.pool_size()
    want = max(1, pool - max(1, pool // 8))
    assert opt._offload.overlap.threads == want
    _train(ref, ref_model, 3, "cuda")
    _train(opt, model, 3, "cuda")
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert opt.last_step_stats["overlap_threads"] == float(want)
    opt.close()
    ref.close()
