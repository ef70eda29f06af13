"""The offloaded optimizer's GPU-only branches, reached on a CPU through their stand-ins:
close() unpins the host tier's page-locked memory (tierlift._pinned), a refused pin of the io
engine's pool is reported, and fp32 device weights that are their own master are stepped
through a slot wherever d2h.on_device says they are on a device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tierlift
from tierlift import _pinned
from tierlift.offload import d2h, h2d
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
        model(torch.randn(4, 32, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


# ---- close() unpins the host tier ------------------------------------------------------------
def test_close_unpins_the_host_tier_and_still_refuses_to_step(page_locks):
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

