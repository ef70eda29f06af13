"""The overlap's worker waits for its own gradient copies, not for the device work queued after
the gradients (offload/d2h.py). On a GPU, torch.cuda.synchronize() before each chunk's CPU step
waited for every kernel queued so far, i.e. for the backward of the units after it: the worker
ran behind backward instead of beside it.

On a CPU the device is a stand-in (d2h's seams replaced, as test_offload_schedule.py fakes the
copies' events): every tensor counts as a device tensor, so the optimizer stages gradients
through its slots; an event is a host time with query()/synchronize(); the copy stream's copy
is done COPY_S after the gradients' event; an autograd stand-in between the two layers queues a
LONG_S kernel in backward, right after the last layer's gradients (asynchronous: the host does
not wait). The check: the last layer's CPU Adam starts well before that kernel would end. The
control, the earlier synchronize(), fails it. The GPU test at the end runs the same on a real
device with torch.cuda._sleep."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

import tierlift
from tierlift.offload import d2h
from tierlift.offload.runner import Offloader

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

LONG_S = 2.0  # the unrelated kernel queued after the gradients
COPY_S = 0.005  # a chunk's D2H copy


class Event:
    """A device event: done at host time `at`."""

    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        return time.perf_counter() >= self.at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.perf_counter()))


class Device:
    """The stand-in device's one compute stream: the time its queued work ends."""

    def __init__(self) -> None:
        self.busy_until = 0.0
        self.queued = threading.Event()  # the unrelated kernel was queued this backward
        self.kernel_at = None

    def queue(self, seconds: float) -> None:
        now = time.perf_counter()
        self.busy_until = max(now, self.busy_until) + seconds
        self.kernel_at = now
        self.queued.set()

    def synchronize(self) -> None:  # torch.cuda.synchronize(): everything queued so far
        time.sleep(max(0.0, self.busy_until - time.perf_counter()))


class Unrelated(torch.autograd.Function):
    """In backward, queues a LONG_S kernel (the backward of the next unit, say) and returns at
    once, as a launch does."""

    @staticmethod
    def forward(ctx, x, device: Device):
        ctx.device = device
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.device.queue(LONG_S)
        return grad, None


class Net(nn.Module):
    def __init__(self, device: Device) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.last = nn.Linear(32, 64), nn.Linear(64, 8)
        self.device = device

    def forward(self, x):
        # In backward: the last layer's gradients, then the unrelated kernel, then the first's.
        return self.last(Unrelated.apply(torch.relu(self.first(x)), self.device))


@pytest.fixture
def device(monkeypatch):
    """Every tensor a device tensor for d2h; events and copies on the stand-in device. Returns
    it, with .adam: [(thread name, start time, parameter ids)] of each chunk's CPU Adam."""
    dev = Device()
    dev.adam = []

    def ready_events(tensors):
        return [Event(time.perf_counter())]  # the hook sees the gradients produced by now

    def copy(self, pairs, ready):
        # The copy is issued while the device is still busy with what backward queued after
        # the gradients (the host runs ahead of the device).
        dev.queued.wait(5.0)
        for dst, src in pairs:
            dst.copy_(src)
        if ready is None:  # on the current stream: after everything queued there
            return [Event(max(time.perf_counter(), dev.busy_until) + COPY_S)]
        return [Event(max(e.at for e in ready) + COPY_S)]

    monkeypatch.setattr(d2h, "on_device", lambda t: True)
    monkeypatch.setattr(d2h, "ready_events", ready_events)
    monkeypatch.setattr(d2h.Copier, "copy", copy)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: dev.synchronize())
    adam = Offloader._adam

    def logged(self, group, buckets, *args, **kwargs):
        ids = {id(t) for b in buckets.values() for t in b["grads"]}
        dev.adam.append((threading.current_thread().name, time.perf_counter(), ids))
        return adam(self, group, buckets, *args, **kwargs)

    monkeypatch.setattr(Offloader, "_adam", logged)
    return dev


def train(model, opt, dev: Device, steps: int = 2):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        dev.queued.clear()
        dev.adam.clear()
        opt.zero_grad(set_to_none=True)
        model(torch.randn(16, 32, generator=g)).square().mean().backward()
        opt.step()


def worker_lag(dev: Device) -> float:
    """Seconds from the unrelated kernel's launch to the first CPU Adam on the worker."""
    starts = [t for name, t, _ in dev.adam if name.startswith("tierlift-offload")]
    assert starts, dev.adam
    return min(starts) - dev.kernel_at


def reference():
    torch.manual_seed(0)
    model = Net(Device())
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(16, 32, generator=g)).square().mean().backward()
        opt.step()
    return model


@pytest.mark.parametrize("budget", [None, "spare"])
def test_worker_waits_for_its_copy_only(device, budget):
    model = Net(device)
    kw = {}
    if budget:  # one generation, spare blocks for half of it and the staging slots
        probe = tierlift.optim.AdamW(Net(device).parameters(), offload="cpu", overlap=True,
                                     chunk_bytes=4096)
        one = sum(t.resident_bytes for t in probe._offload.tiers) // 2
        staging = probe._offload.n_slots * 2 * 4096  # grad and copy, per slot
        probe._offload.close()
        kw["cpu_budget"] = one + one // 2 + staging
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-2, offload="cpu", overlap=True,
                               chunk_bytes=4096, **kw)
    try:
        assert opt._offload._cuda  # staged through the slots, as device gradients are
        assert (opt._offload.tiers[0].spare > 0) == bool(budget)
        train(model, opt, device)
        stats = opt.last_step_stats
    finally:
        opt._offload.close()
    assert stats["overlap_kept_chunks"] > 0
    lag = worker_lag(device)
    assert lag < LONG_S / 2, device.adam
    ref = reference()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    # The worker's waits for its copies are D2H time on its own thread.
    assert any(t != "training" and v["total_s"] > 0
               for t, v in stats["legs"]["d2h"]["threads"].items()), stats["legs"]["d2h"]


def test_synchronize_before_each_chunk_fails_the_check(device, monkeypatch):
    """The control: the earlier wait (torch.cuda.synchronize() after the copies) makes the
    worker wait for the unrelated kernel."""

    def earlier(self, pairs, ready):
        device.queued.wait(5.0)
        for dst, src in pairs:
            dst.copy_(src)
        torch.cuda.synchronize()

    monkeypatch.setattr(Offloader, "_wait_copies", earlier)
    model = Net(device)
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-2, offload="cpu", overlap=True,
                               chunk_bytes=4096)
    try:
        train(model, opt, device)
    finally:
        opt._offload.close()
    assert worker_lag(device) >= LONG_S * 0.9, device.adam


def sleep_cycles(seconds: float) -> int:
    """The torch.cuda._sleep argument that keeps this GPU's stream busy for about `seconds`."""
    # Launched once first: the kernel's lazy module load would otherwise fall between the two
    # events, the cycles would seem slower and the sleep come out shorter than asked.
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 * seconds / (start.elapsed_time(end) / 1e3))


@pytest.mark.gpu
def test_gpu_worker_does_not_wait_for_a_kernel_queued_after_the_gradient(monkeypatch):
    """On a GPU: the last layer's gradients are followed by a ~1 s torch.cuda._sleep on the
    backward stream; the worker's first CPU Adam (that layer's chunk) must start well before
    the sleep ends, and the weights must equal the same optimizer's without the overlap."""
    cycles = sleep_cycles(1.0)

    class Sleep(torch.autograd.Function):
        queued_at = None

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            torch.cuda._sleep(cycles)
            Sleep.queued_at = time.perf_counter()
            return grad

    class GpuNet(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.first, self.last = nn.Linear(256, 1024), nn.Linear(1024, 256)

        def forward(self, x):
            return self.last(Sleep.apply(torch.relu(self.first(x))))

    starts = []
    adam = Offloader._adam

    def logged(self, *args, **kwargs):
        if threading.current_thread().name.startswith("tierlift-offload"):
            starts.append(time.perf_counter())
        return adam(self, *args, **kwargs)

    monkeypatch.setattr(Offloader, "_adam", logged)
    results = []
    for overlap in (False, True):
        model = GpuNet().cuda()
        opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, offload="cpu", overlap=overlap,
                                   chunk_bytes=1 << 20)
        g = torch.Generator().manual_seed(1)
        try:
            for _ in range(2):
                starts.clear()
                opt.zero_grad(set_to_none=True)
                model(torch.randn(64, 256, generator=g).cuda()).square().mean().backward()
                opt.step()
            torch.cuda.synchronize()
        finally:
            opt._offload.close()
        if overlap:
            assert starts, "the worker stepped nothing ahead"
            lag = min(starts) - Sleep.queued_at
            assert lag < 0.5, f"the worker's first Adam started {lag:.3f} s after the sleep"
        results.append([p.detach().cpu() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
