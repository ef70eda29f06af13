"""The offloaded optimizer's GPU-only branches, reached on a CPU through their stand-ins:
close() unpins the host tier's page-locked memory (tierlift._pinned); fp32 device weights that
are their own master are stepped through a slot wherever d2h.on_device says they are on a
device; the device part (device_fraction) is its own leg, with its kernels' device time read
from events once done, never waited for; a refused pin of the io engine's pool is reported;
HostRegistration's errors name their caller. The tests marked gpu run the same on a device."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import tierlift
from tierlift import _pinned
from tierlift.offload import d2h, h2d, legs
from tierlift.offload.device_part import DevicePart
from tierlift.optim import AdamW

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")


class PageLocks:
    """Stands in for cudaHostRegister (the extension's HostRegistration): which byte ranges are
    page-locked now, and every owner name the registrations were made for."""

    def __init__(self) -> None:
        self.ranges: dict[int, int] = {}  # address -> bytes
        self.owners: list[str] = []
        locks = self

        class HostRegistration:
            def __init__(self, tensor, read_only=False, owner="HostRegistration", remedy=""):
                self.ptr = tensor.data_ptr()
                if self.ptr in locks.ranges:
                    raise ValueError(f"{owner}: this memory is already registered with CUDA")
                locks.ranges[self.ptr] = tensor.nbytes
                locks.owners.append(owner)

            @property
            def active(self) -> bool:
                return self.ptr in locks.ranges

            def close(self) -> None:
                locks.ranges.pop(self.ptr, None)

        self.cls = HostRegistration

    @property
    def locked(self) -> int:
        return sum(self.ranges.values())


@pytest.fixture
def page_locks(monkeypatch):
    """A machine whose CUDA pins host memory: the offload tiers register their state."""
    locks = PageLocks()
    monkeypatch.setattr(tierlift._extension._C, "HostRegistration", locks.cls)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return locks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))


def _train(model, opt, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 32, generator=g).to(next(model.parameters()).device)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


# ---- close() unpins the host tier ------------------------------------------------------------
def test_close_unpins_the_host_tier_and_still_refuses_to_step(page_locks):
    gc.collect()  # no earlier test's registration goes away while this one counts
    baseline, counted = page_locks.locked, _pinned.registered_bytes()
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2, offload="cpu", chunk_bytes=4096)
    _train(model, opt)
    tier = opt._offload.tiers[0]
    pinned = tier.resident_bytes
    assert pinned > 0 and page_locks.locked == baseline + pinned
    assert _pinned.registered_bytes() == counted + pinned
    assert set(page_locks.owners) == {"tierlift._pinned.pinned_zeros"}
    state = opt.state_dict()
    opt.close()
    assert page_locks.locked == baseline  # unpinned now, not when the optimizer is collected
    assert _pinned.registered_bytes() == counted
    assert tier._registrations == []  # the references are dropped too
    after = opt.state_dict()  # the state stays readable, pageable
    assert all(torch.equal(a, b) for s, t in zip(state["state"].values(), after["state"].values())
               for a, b in zip(s.values(), t.values()) if isinstance(a, torch.Tensor))
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    opt.close()  # idempotent
    assert page_locks.locked == baseline and _pinned.registered_bytes() == counted


@pytest.mark.filterwarnings("ignore:tierlift IoEngine:RuntimeWarning")  # its pool's own pin
def test_hybrid_close_unpins_its_ram_part(page_locks, tmp_path):
    model = _model()
    n = sum(p.numel() for p in model.parameters())
    baseline = page_locks.locked
    opt = AdamW(model.parameters(), lr=1e-2, offload="hybrid", nvme_path=str(tmp_path),
                cpu_budget=64 * n, chunk_bytes=4096)
    ram = opt._offload.tiers[0].ram
    assert ram.resident_bytes > 0 and page_locks.locked == baseline + ram.resident_bytes
    opt.close()
    assert page_locks.locked == baseline


def test_a_dropped_registration_stops_counting(page_locks):
    gc.collect()
    counted, regs = _pinned.registered_bytes(), []
    t = _pinned.pinned_zeros(1000, torch.float32, regs)
    assert _pinned.registered_bytes() == counted + t.nbytes
    del regs[:]
    assert _pinned.registered_bytes() == counted and page_locks.locked == 0
    regs = []
    _pinned.register(t, regs)  # the same memory again: it was unpinned before it was let go
    _pinned.release(regs)
    _pinned.release(regs)
    assert regs == [] and page_locks.locked == 0 and t.numel() == 1000


# ---- fp32 device weights that are their own master -------------------------------------------
class Copies:
    """d2h/h2d stand-ins: every tensor is a device tensor, copies are host copies done at once;
    `down` and `up` keep the data pointers of each copy's device side."""

    def __init__(self, monkeypatch) -> None:
        self.down: list[int] = []
        self.up: list[int] = []
        copies = self

        def copy(self, pairs, ready):
            for dst, src in pairs:
                copies.down.append(src.data_ptr())
                dst.copy_(src)
            return []

        def upload_events(pairs):
            copies.up.extend(dst.data_ptr() for dst, _ in pairs)
            return []

        monkeypatch.setattr(d2h, "on_device", lambda t: True)
        monkeypatch.setattr(d2h, "ready_events", lambda tensors: [])
        monkeypatch.setattr(d2h.Copier, "copy", copy)
        monkeypatch.setattr(h2d, "upload_events", upload_events)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)

    @staticmethod
    def within(ptrs: list[int], p: torch.Tensor) -> bool:
        lo = p.data_ptr()
        return any(lo <= q < lo + p.nbytes for q in ptrs)


@pytest.mark.parametrize("tier", ["nvme", "cpu"])
def test_own_master_device_weights_go_through_a_slot(monkeypatch, tmp_path, tier):
    """nvme with one generation: an fp32 device parameter is its own master, copied down into a
    slot, stepped there and uploaded (chunk_step). cpu without overlap: its master is in the
    tier (_uses_master), as on a GPU. Whether a parameter is on a device is d2h.on_device's
    to say, so the stand-in reaches both branches."""
    ref = _model()
    want = AdamW(ref.parameters(), lr=1e-2)
    _train(ref, want)
    copies = Copies(monkeypatch)
    model = _model()
    kw = (dict(offload="nvme", nvme_path=str(tmp_path), nvme_generations=1) if tier == "nvme"
          else dict(offload="cpu"))
    opt = AdamW(model.parameters(), lr=1e-2, chunk_bytes=4096, **kw)
    try:
        off = opt._offload
        assert off._cuda and ("master" in off.tiers[0].kinds) == (tier == "cpu")
        _train(model, opt)
    finally:
        opt.close()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert Copies.within(copies.up, p)  # the new weights went up from the host staging
        if tier == "nvme":  # stepped from a copy of the weights, not in place
            assert Copies.within(copies.down, p)
        torch.testing.assert_close(p, r, rtol=0, atol=1e-6)


# ---- the device part's own leg -----------------------------------------------------------------
class Events:
    """Stand-in CUDA timing events: recorded at a stand-in device clock (ms), done only once
    the test says the device got there; nothing may wait for one."""

    def __init__(self, monkeypatch) -> None:
        self.clock_ms = 0.0
        self.done_until = -1.0
        self.recorded: list = []
        events = self

        class Event:
            def __init__(self) -> None:
                self.at = events.clock_ms

            def query(self) -> bool:
                return self.at <= events.done_until

            def elapsed_time(self, end) -> float:
                assert self.query() and end.query(), "read before it was done"
                return end.at - self.at

            def synchronize(self) -> None:
                raise AssertionError("the step must not wait for the device part")

        def record_events(devices):
            got = [Event() for _ in devices]
            events.recorded.extend(got)
            return got

        monkeypatch.setattr(legs, "record_events", record_events)
        monkeypatch.setattr(torch.cuda, "synchronize", self.no_wait)

    @staticmethod
    def no_wait(*args, **kwargs):
        raise AssertionError("the step must not synchronize")

    def run(self, ms: float) -> None:
        """The device part's kernels take `ms` on the device: the clock moves past them."""
        self.clock_ms += ms


def test_the_device_part_is_its_own_leg_with_its_gpu_time(monkeypatch):
    Copies(monkeypatch)  # every tensor a device tensor: the device part launches "on CUDA"
    events = Events(monkeypatch)
    launch = DevicePart.launch

    def timed_launch(self, scale):  # its kernels take 7 ms on the stand-in device
        launch(self, scale)
        events.run(7.0)

    monkeypatch.setattr(DevicePart, "launch", timed_launch)
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2, offload="cpu", overlap=True, chunk_bytes=4096,
                device_fraction=0.8)
    try:
        assert opt._offload.device_part.params > 0
        _train(model, opt, steps=1)
        first = opt.last_step_stats
        assert len(events.recorded) == 2  # one start and one end event, one device
        leg = first["legs"]["device_adam"]
        # Queued, not done: unknown, not 0 (and not waited for).
        assert first["device_part_gpu_s"] is None and leg["device_s"] is None
        assert list(leg["threads"]) == ["training"] and 0 < leg["total_s"] <= first[
            "device_part_s"]
        host = leg["total_s"]
        events.done_until = events.clock_ms  # the device got through the kernels
        again = opt.last_step_stats  # read without a wait, now that the events are done
        assert again is first and first["device_part_gpu_s"] == pytest.approx(7e-3)
        assert leg["device_s"] == pytest.approx(7e-3)
        assert leg["total_s"] == pytest.approx(host + 7e-3)

        # At the next step, the one before is filled in even if nobody read its stats.
        _train(model, opt, steps=1)
        second = opt._offload._last_stats
        events.done_until = events.clock_ms
        _train(model, opt, steps=1)
        assert second["device_part_gpu_s"] == pytest.approx(7e-3)
        assert second["legs"]["device_adam"]["device_s"] == pytest.approx(7e-3)
        assert opt._offload._last_stats["device_part_gpu_s"] is None
    finally:
        opt.close()


def test_a_host_device_part_has_no_gpu_time(monkeypatch):
    """CPU parameters: the device part's leg is its host time alone, no events."""
    def no_events(devices):
        raise AssertionError("no CUDA events for host parameters")

    monkeypatch.setattr(legs, "record_events", no_events)
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2, offload="cpu", chunk_bytes=4096,
                device_fraction=0.8)
    try:
        _train(model, opt, steps=1)
        stats = opt.last_step_stats
    finally:
        opt.close()
    leg = stats["legs"]["device_adam"]
    assert "device_part_gpu_s" not in stats and leg["device_s"] is None
    assert 0 < leg["total_s"] <= stats["device_part_s"]


# ---- a refused pin of the io engine's pool -------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the refusal injected is CUDA's on a machine without a GPU")
def test_a_refused_pool_pin_is_warned_once_and_queryable(monkeypatch, tmp_path):
    """CUDA without a usable GPU refuses cudaHostRegister: the engine's pool stays pageable,
    which is correct, and says so (the cause, and what it costs) instead of running slower
    silently."""
    from tierlift.io import EngineConfig, IoEngine

    config = EngineConfig(backend="threads", queue_depth=4, block_size=4096, pool_bytes=1 << 20)
    with IoEngine(config) as plain:  # no GPU, nothing asked: nothing to say
        assert plain.pool_pinned is False and plain.pool_pin_error == ""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.warns(RuntimeWarning) as seen:
        engine = IoEngine(config)
    with engine:
        assert len(seen) == 1
        message = str(seen[0].message)
        assert "1048576-byte staging pool" in message and "pageable" in message
        assert engine.pool_pin_error in message and "cudaHostRegister" in engine.pool_pin_error
        assert "block the host" in message  # what it costs
        assert engine.pool_pinned is False
        buf = engine.pool_tensor(4096)
        buf.fill_(7)  # still a working pool
        engine.write(buf, tmp_path / "f").wait()
        back = torch.zeros(4096, dtype=torch.uint8)
        engine.read(back, tmp_path / "f").wait()
        assert torch.equal(back, buf)


def test_registration_errors_name_their_caller(monkeypatch):
    """HostRegistration's errors speak for whoever registered (FeatureStore's advice is its
    own), here with the refusal of a machine without a GPU, or the extension's own refusal
    where it was built without CUDA kernels."""
    t = torch.zeros(256)
    with pytest.raises((RuntimeError, ValueError)) as plain:
        tierlift._extension._C.HostRegistration(t)
    if torch.cuda.is_available():
        pytest.skip("CUDA registers the memory here")
    assert str(plain.value).startswith("HostRegistration: ")
    assert "features" not in str(plain.value) and "pin='copy'" not in str(plain.value)
    with pytest.raises((RuntimeError, ValueError), match=r"^features: .*use pin='copy'$"):
        tierlift._extension._C.HostRegistration(t, owner="features", remedy="use pin='copy'")
    regs = []
    monkeypatch.setattr(torch, "zeros", _pinned_fallback(torch.zeros))
    with pytest.warns(RuntimeWarning, match=r"tierlift\._pinned\.pinned_zeros: ") as seen:
        got = _pinned.pinned_zeros(256, torch.float32, regs)
    assert "features" not in str(seen[0].message) and regs == [] and got.numel() == 256


def _pinned_fallback(zeros):
    """torch.zeros whose pin_memory=True (pinned_zeros' fallback) needs no GPU."""
    def wrapped(*args, pin_memory=False, **kwargs):
        return zeros(*args, **kwargs)
    return wrapped


# ---- the same on a GPU -------------------------------------------------------------------------
@pytest.mark.gpu
def test_on_a_gpu_close_unpins_the_host_tier():
    gc.collect()  # no earlier test's registration goes away while this one counts
    counted = _pinned.registered_bytes()
    model = _model().cuda()
    opt = AdamW(model.parameters(), lr=1e-2, offload="cpu", chunk_bytes=4096)
    _train(model, opt)
    flat = list(opt._offload.tiers[0].flat.values())
    assert all(t.is_pinned() for t in flat)
    assert _pinned.registered_bytes() == counted + sum(t.nbytes for t in flat)
    opt.close()
    assert not any(t.is_pinned() for t in flat) and _pinned.registered_bytes() == counted


@pytest.mark.gpu
def test_on_a_gpu_the_pool_is_pinned_without_a_warning():
    import warnings

    from tierlift.io import EngineConfig, IoEngine

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = IoEngine(EngineConfig(backend="threads", queue_depth=4, block_size=4096,
                                       pool_bytes=1 << 20))
    with engine:
        assert engine.pool_pinned and engine.pool_pin_error == ""
        assert engine.pool_tensor(4096).is_pinned()


@pytest.mark.gpu
def test_on_a_gpu_the_device_part_reports_its_kernels_time():
    model = _model().cuda()
    opt = AdamW(model.parameters(), lr=1e-2, offload="cpu", overlap=True, chunk_bytes=4096,
                device_fraction=0.8)
    try:
        _train(model, opt)
        torch.cuda.synchronize()  # the test's wait, not the step's
        stats = opt.last_step_stats
    finally:
        opt.close()
    leg = stats["legs"]["device_adam"]
    assert stats["device_part_gpu_s"] > 0 and leg["device_s"] == stats["device_part_gpu_s"]
    assert leg["total_s"] >= leg["device_s"] + leg["exposed_s"] - 1e-9


# skip_nonfinite's check (offload/checks.py): one host copy per device, not per gradient, and a
# sum that overflows while every element is finite is not taken for inf.
def test_every_finite_confirms_an_overflowing_sum_element_by_element():
    from tierlift.offload.checks import all_true, every_finite, sums_finite

    big = torch.full((100_000,), 1.0, dtype=torch.float16)  # finite; its fp16 sum is inf
    assert not sums_finite([big])
    assert every_finite([big, torch.ones(3)])
    for bad in (float("inf"), float("nan")):
        g = big.clone()
        g[77] = bad
        assert not every_finite([torch.ones(3), g])
    assert all_true([]) and all_true([torch.tensor(True), torch.tensor([True])])
    assert not all_true([torch.tensor(True), torch.tensor(False)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_finite_reads_gpu_gradients_back_once():
    from tierlift.offload import checks

    grads = [torch.ones(1000, device="cuda", dtype=torch.bfloat16) for _ in range(50)]
    copies = []
    real = torch.Tensor.cpu
    try:
        torch.Tensor.cpu = lambda t, *a, **k: copies.append(t.device) or real(t, *a, **k)
        assert checks.every_finite(grads)
    finally:
        torch.Tensor.cpu = real
    assert copies == []  # bool() of the stacked flags: one read, no per-gradient .cpu()
    grads[17][3] = float("nan")
    assert not checks.every_finite(grads)
