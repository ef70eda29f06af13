"""Host buffers pinned at their size (tierlift._pinned): the optimizer state tiers' memory."""

import pytest
import torch

import tierlift
from tierlift._pinned import pinned_zeros, registered_bytes
from tierlift.offload.tiers import MemoryTier

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="needs the compiled extension")


def test_without_pinning_the_state_is_plain_zeroed_memory():
    tier = MemoryTier(["master", "exp_avg"], n_chunks=3, chunk_elems=1024, pin=False, spare=1)
    assert tier._registrations == []
    assert all(not t.is_pinned() and t.numel() == 4 * 1024 and not t.any()
               for t in tier.flat.values())


@pytest.mark.gpu
def test_pinned_at_its_size_and_copied_asynchronously():
    regs = []
    n = (5 << 20) + 3  # 20 MiB + 12 B: torch's pinned allocator would take 32 MiB
    counted = registered_bytes()
    t = pinned_zeros(n, torch.float32, regs)
    assert t.is_pinned() and t.numel() == n and not t.any() and len(regs) == 1
    assert registered_bytes() == counted + 4 * n  # what the benchmarks add to torch's stats
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    t.fill_(2.0)
    d = t.to("cuda", non_blocking=True)
    back = torch.empty_like(t)
    back.copy_(d, non_blocking=False)
    assert torch.equal(back, t)
    # The memory is not torch's pinned allocator's.
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    regs[0].close()
    assert not t.is_pinned() and t[0].item() == 2.0  # unpinned, still the tensor's


@pytest.mark.gpu
def test_the_offload_tiers_state_is_pinned_at_its_size():
    tier = MemoryTier(["master", "exp_avg", "exp_avg_sq"], n_chunks=5, chunk_elems=3 << 18,
                      pin=True, generations=2)
    assert len(tier._registrations) == 6
    assert all(t.is_pinned() and t.numel() == 5 * (3 << 18) for t in tier.flat.values())
    assert tier.resident_bytes == 6 * 5 * (3 << 18) * 4


@pytest.mark.gpu
def test_a_refused_registration_falls_back_to_torchs_pinned_memory(monkeypatch):
    def refuse(tensor, read_only=False, owner="HostRegistration", remedy=""):
        raise ValueError(f"{owner}: cudaHostRegister of 64 bytes failed (out of memory)")

    monkeypatch.setattr(tierlift._extension._C, "HostRegistration", refuse)
    regs = []
    with pytest.warns(RuntimeWarning, match="rounds the block up"):
        t = pinned_zeros(16, torch.float32, regs)
    assert t.is_pinned() and t.numel() == 16 and not t.any() and regs == []
