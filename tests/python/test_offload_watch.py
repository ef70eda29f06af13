"""The content fingerprint behind the overlap's and the parameter watch's checks
(tierlift.offload.watch.fingerprints, tierlift._C.io.fingerprints) against its pure-Python
reference, and what it must tell apart."""

import pytest
import torch

import tierlift
from tierlift.offload.watch import fingerprints
from tierlift.reference.fingerprint import fingerprint64
from tierlift.reference.fingerprint import fingerprints as ref_fingerprints

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="needs the compiled extension")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000, 1024, 4099])
def test_matches_the_reference(dtype, n):
    t = torch.randint(0, 100, (n,)).to(dtype)
    assert fingerprints([t]) == ref_fingerprints([t])


def test_known_value():
    data = bytes((i * 31 + 7) & 255 for i in range(1025))
    assert fingerprint64(data) == 0x92B5AA6330ED6C37  # as tests/cpp/test_fingerprint.cc
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert fingerprints([t]) == [0x92B5AA6330ED6C37]


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_threads_and_views_give_the_same_values(threads):
    g = torch.Generator().manual_seed(3)
    flat = torch.randn(3 << 20, generator=g)
    # Segments as the offloader takes them: slices of flat parameters, of uneven sizes.
    cuts = [0, 5, 1 << 20, (1 << 20) + 3, 2 << 20, 3 << 20]
    segs = [flat[a:b] for a, b in zip(cuts, cuts[1:])]
    got = tierlift._extension._C.io.fingerprints(segs, threads)
    assert got == [fingerprints([s])[0] for s in segs]
    assert got[0] == ref_fingerprints([segs[0]])[0]
    # The same bytes seen as another dtype or shape give the same value.
    assert fingerprints([segs[4].view(torch.int32).view(2, -1)]) == [got[4]]


def test_changes_are_seen():
    g = torch.Generator().manual_seed(5)
    grad = torch.randn(1 << 16, generator=g)
    base = fingerprints([grad])[0]
    for edit in (lambda t: t.mul_(0.5), lambda t: t.neg_(), lambda t: t.add_(0.0).mul_(1.0001),
                 lambda t: t[-1:].zero_(), lambda t: t.view(torch.int32)[7].add_(1)):
        t = grad.clone()
        edit(t)
        assert fingerprints([t])[0] != base
    assert fingerprints([grad.clone().mul_(1.0)])[0] == base  # a clip by exactly 1.0
    assert fingerprints([grad[:-1]])[0] != fingerprints([torch.cat([grad[:-1], grad[:1] * 0])])[0]


def test_refuses_what_it_cannot_read():
    t = torch.randn(8, 8)
    with pytest.raises((ValueError, RuntimeError), match="contiguous"):
        tierlift._extension._C.io.fingerprints([t.t()], 1)


@pytest.mark.gpu
def test_device_tensors_are_fingerprinted_on_the_device_as_the_host_does():
    g = torch.Generator().manual_seed(11)
    raw = torch.randint(0, 256, (40_000,), dtype=torch.uint8, generator=g)
    dev = raw.cuda()
    # Lengths around a word, a stripe and a 1 KiB block, at every start modulo 8 (the kernel's
    # unaligned path), the 4-block loop and the blocks after it, bf16/fp32 views, an empty one.
    cuts = [(a, a + n) for a in range(8) for n in (0, 1, 9, 64, 65, 1023, 1024, 5000, 9 * 1024 + 7)]

    def pieces(t):
        return [t[a:b] for a, b in cuts] + [t[:8192].view(torch.bfloat16),
                                            t[:4096].view(torch.float32)]

    host, device = pieces(raw), pieces(dev)
    want = fingerprints(host)
    assert fingerprints(device) == want
    # Host and device tensors in one list, and a non-contiguous device tensor (its bytes in order).
    mixed = [device[0], host[1], device[2]]
    assert fingerprints(mixed) == [want[0], want[1], want[2]]
    m = torch.randn(64, 48, device="cuda")
    assert fingerprints([m.t()]) == fingerprints([m.t().contiguous().cpu()])
    # In stream order: a write queued just before is seen.
    t = torch.randn(1 << 20, device="cuda")
    before = fingerprints([t])[0]
    t[-1:].add_(1.0)
    assert fingerprints([t]) == fingerprints([t.cpu()]) != [before]


@pytest.mark.gpu
def test_device_tensors_go_through_the_scratch_buffer_without_the_kernel(monkeypatch):
    monkeypatch.delattr(tierlift._extension._C.io, "fingerprints_device")
    t = torch.randn(1000, device="cuda")
    scratch = torch.empty(4000, dtype=torch.uint8)
    assert fingerprints([t, t[:10]], scratch) == fingerprints([t.cpu(), t[:10].cpu()])
