"""The new weights' copies to the device do not block the host (offload/h2d.py): each chunk's
upload is issued and left in flight while the next chunk is stepped (or rounded, in publish()),
and the host waits for an upload only before it rewrites the staging buffer that upload reads.

On a CPU the device is a stand-in (as in test_offload_d2h.py): every tensor counts as a device
tensor, so new weights go through the slots' copy buffers and the uploader; an upload's event
is in flight until something waits for it, and keeps a copy of the bytes it read: a buffer
rewritten while an upload from it is in flight (the DMA would read the new bytes) is a
violation. The fingerprints' scratch writes (a device tensor's bytes copied into slot 0's copy
buffer) are stood in for by flipping the bytes of the scratch. Controls show that each check
fails without the wait it guards. The GPU test at the end runs on a real device, with a long
kernel queued ahead of the uploads so they are still in flight when the host moves on."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from test_offload import _nvme
from test_offload_d2h import sleep_cycles

import tierlift
from tierlift.offload import d2h, h2d, masters, overlap
from tierlift.offload.runner import Offloader

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

STEPS = 3
CHUNK_BYTES = 4096  # 1024 elements: the model has 13 chunks, the pipeline 6 slots


class Upload:
    """A stand-in upload event: in flight until waited for; holds the bytes it read."""

    def __init__(self, dev: Device, pairs: list) -> None:
        self.dev = dev
        self.id = next(dev.ids)
        self.reads = [(src, src.view(torch.uint8).clone()) for _, src in pairs]
        self.done = False

    def intact(self) -> bool:
        return all(torch.equal(src.view(torch.uint8), seen) for src, seen in self.reads)

    def synchronize(self) -> None:
        if not self.done:
            if not self.intact():  # the DMA reads at the end: rewritten bytes went out
                self.dev.violations.append(("rewritten before its wait", self.id))
            self.done = True
            self.dev.log.append(("wait", self.id))


class Device:
    """The log of the training thread: ("adam" | "upload" | "wait" | "sync", id)."""

    def __init__(self) -> None:
        self.ids = itertools.count()
        self.log: list = []
        self.uploads: dict = {}
        self.violations: list = []

    def check(self, where: str) -> None:
        """Every upload in flight still reads the bytes it was issued with."""
        for u in self.uploads.values():
            if not u.done and not u.intact():
                self.violations.append((where, u.id))
                u.done = True  # reported once

    def pending(self) -> int:
        return sum(not u.done for u in self.uploads.values())


@pytest.fixture
def device(monkeypatch):
    dev = Device()
    training = threading.current_thread()

    def upload_events(pairs):
        dev.check("a later upload")
        u = Upload(dev, pairs)
        dev.uploads[u.id] = u
        dev.log.append(("upload", u.id))
        return [u]

    def copy(self, pairs, ready):  # the D2H copies: done at once
        for dst, src in pairs:
            dst.copy_(src)
        return []

    def scribbling(real):
        def fingerprints(tensors, scratch=None):
            if scratch is not None and tensors:  # a D2H copy of each into the scratch
                scratch.view(torch.uint8)[:max(t.nbytes for t in tensors)].bitwise_not_()
                dev.check("fingerprint scratch")
            return real(tensors, scratch)
        return fingerprints

    adam = Offloader._adam

    def logged(self, *args, **kwargs):
        out = adam(self, *args, **kwargs)
        if threading.current_thread() is training:
            dev.log.append(("adam", None))
        dev.check("adam")
        return out

    def synchronize(*args, **kwargs):
        dev.log.append(("sync", None))

    monkeypatch.setattr(d2h, "on_device", lambda t: True)
    monkeypatch.setattr(d2h, "ready_events", lambda tensors: [])
    monkeypatch.setattr(d2h.Copier, "copy", copy)
    monkeypatch.setattr(h2d, "upload_events", upload_events)
    monkeypatch.setattr(overlap, "fingerprints", scribbling(overlap.fingerprints))
    monkeypatch.setattr(masters, "fingerprints", scribbling(masters.fingerprints))
    monkeypatch.setattr(Offloader, "_adam", logged)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    return dev


def _model(dtype):
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.Tanh(), torch.nn.Linear(96, 80),
                               torch.nn.Tanh(), torch.nn.Linear(80, 8)).to(dtype)


def _fit(dtype, opt_kw, dev: Device | None = None):
    """The model after STEPS steps; with `dev`, also each step's log and the uploads still in
    flight when it returned."""
    model = _model(dtype)
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-2, **opt_kw)
    g = torch.Generator().manual_seed(9)
    steps = []
    try:
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(16, 48, generator=g).to(dtype)).square().mean().backward()
            at = len(dev.log) if dev else 0
            opt.step()
            if dev:
                steps.append((dev.log[at:], dev.pending(), opt.last_step_stats))
    finally:
        opt.close()
    return [p.detach().clone() for p in model.parameters()], steps


def not_overlapped(log: list) -> list:
    """Uploads of a step waited for before the step issued its next upload (the host blocked
    on the copy instead of stepping or rounding the next chunk meanwhile)."""
    uploads = [(i, u) for i, (kind, u) in enumerate(log) if kind == "upload"]
    waited = {u: i for i, (kind, u) in enumerate(log) if kind == "wait"}
    return [u for (_, u), (at, _) in zip(uploads, uploads[1:]) if waited.get(u, at) < at]


CASES = {  # name: (parameter dtype, optimizer kwargs; "nvme" filled in with tmp_path)
    "cpu-overlap-bf16": (torch.bfloat16, dict(offload="cpu", overlap=True)),
    "cpu-bf16": (torch.bfloat16, dict(offload="cpu")),
    "nvme-overlap-bf16": (torch.bfloat16, dict(offload="nvme", overlap=True)),
    "nvme-fp32": (torch.float32, dict(offload="nvme")),
}


def _kwargs(case: str, tmp_path) -> dict:
    dtype, kw = CASES[case]
    kw = dict(kw, chunk_bytes=CHUNK_BYTES)
    if kw["offload"] == "nvme":
        kw.update(_nvme(tmp_path, 1 << 20), chunk_bytes=CHUNK_BYTES)
    return kw


@pytest.mark.parametrize("case", list(CASES))
def test_uploads_overlap_the_next_chunk_and_guard_their_buffer(device, tmp_path, case):
    dtype = CASES[case][0]
    ref, _ = _fit(dtype, {})
    got, steps = _fit(dtype, _kwargs(case, tmp_path), device)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert device.violations == []
    kept = 0
    for log, in_flight, stats in steps:
        kinds = [kind for kind, _ in log]
        assert "sync" not in kinds  # no host-wide synchronize
        assert kinds.count("upload") > 6  # more chunks than slots: every slot was reused
        assert not_overlapped(log) == []
        assert in_flight > 0  # step() returned with its uploads still in flight
        kept += stats.get("overlap_kept_chunks", 0)
    if CASES[case][1].get("overlap"):
        assert kept > 0  # publish() uploaded the chunks stepped during backward
    # close() waited for every upload: the slots may go
    assert device.pending() == 0


def test_without_the_wait_a_rewritten_buffer_is_caught(device, monkeypatch, tmp_path):
    """Control: with reserve() a no-op, the host rewrites a slot's staging (the next chunk in
    that slot, a fingerprint's scratch) while an upload from it is in flight."""
    monkeypatch.setattr(h2d.Uploader, "reserve", lambda self, buffer: None)
    _fit(torch.bfloat16, _kwargs("nvme-overlap-bf16", tmp_path), device)
    assert device.violations


def test_a_blocking_upload_is_caught(device, monkeypatch, tmp_path):
    """Control: an upload waited for at once (the earlier copy-then-synchronize) fails the
    overlap check."""
    upload = h2d.Uploader.upload

    def blocking(self, pairs, buffer):
        upload(self, pairs, buffer)
        self.drain()

    monkeypatch.setattr(h2d.Uploader, "upload", blocking)
    _, steps = _fit(torch.bfloat16, _kwargs("cpu-overlap-bf16", tmp_path), device)
    assert all(not_overlapped(log) for log, _, _ in steps)


def test_uploader_waits_only_for_the_buffer_rewritten(monkeypatch):
    """Unit: reserve(buffer) waits for the last upload from that buffer only; drain() for all;
    without CUDA tensors nothing is recorded."""
    waits = []

    class Event:
        def __init__(self, name):
            self.name = name

        def synchronize(self):
            waits.append(self.name)

    names = iter(["a", "b", "a2"])
    up = h2d.Uploader()
    a, b = torch.zeros(8), torch.zeros(8)
    dst = torch.empty(4)
    with monkeypatch.context() as m:
        m.setattr(h2d, "upload_events", lambda pairs: [Event(next(names))])
        up.upload([(dst, a[:4])], a)
        up.upload([(dst, b[4:])], b)
        up.reserve(a)
        assert waits == ["a"]
        up.reserve(a)  # nothing in flight from it any more
        assert waits == ["a"]
        up.upload([(dst, a[4:])], a)
        up.drain()
        assert sorted(waits) == ["a", "a2", "b"]
        up.drain()
        assert len(waits) == 3
    plain = h2d.Uploader()
    plain.upload([(dst, a[:4])], a)  # host tensors: copied, no event
    assert torch.equal(dst, a[:4]) and plain._pending[a.data_ptr()] == []


def gpu_bf16_model() -> torch.nn.Module:
    """The GPU tests' small bf16 model, the same weights every call."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(),
                               torch.nn.Linear(1024, 256)).cuda().to(torch.bfloat16)


def gpu_steps(model, opt, before_step=lambda: None) -> list[dict]:
    """STEPS steps of `opt` on the same random batches every call, then close(); each step's
    last_step_stats."""
    g = torch.Generator().manual_seed(1)
    stats = []
    try:
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(64, 256, generator=g).cuda().to(torch.bfloat16)
                  ).square().mean().backward()
            before_step()
            opt.step()
            stats.append(opt.last_step_stats)
        torch.cuda.synchronize()
    finally:
        opt.close()
    return stats


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_gpu_overlapped_steps_match_blocking_uploads(tmp_path, tier, monkeypatch):
    """On a GPU, bf16 weights: 3 overlapped steps with the uploads in flight equal, bit for
    bit, the same steps with each upload waited for at once (the earlier semantics). A ~50 ms
    kernel queued on the stream at the start of each step() keeps the uploads queued behind
    it while the host rounds the next chunks into the slots: a missing wait before a slot is
    rewritten would send the new bytes."""
    cycles = sleep_cycles(0.05)

    def run(blocking: bool):
        upload = h2d.Uploader.upload

        def waited(self, pairs, buffer):
            upload(self, pairs, buffer)
            torch.cuda.synchronize()

        monkeypatch.setattr(h2d.Uploader, "upload", waited if blocking else upload)
        model = gpu_bf16_model()
        first[:] = [p.detach().cpu() for p in model.parameters()]  # the same in both runs
        kw = (_nvme(tmp_path / str(blocking), 64 << 20) if tier == "nvme"
              else dict(offload="cpu"))
        opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, overlap=True,
                                   chunk_bytes=1 << 16, **kw)
        stats = gpu_steps(model, opt, before_step=lambda: torch.cuda._sleep(cycles))
        monkeypatch.setattr(h2d.Uploader, "upload", upload)
        return [p.detach().cpu() for p in model.parameters()], [s["legs"]["h2d"] for s in stats]

    first = []
    (tmp_path / "True").mkdir()
    (tmp_path / "False").mkdir()
    ref, _ = run(blocking=True)
    got, legs = run(blocking=False)
    for a, b, w in zip(ref, got, first):
        assert torch.equal(a, b) and not torch.equal(a, w)
    assert legs[-1]["total_s"] > 0  # issuing the uploads, and the waits before a slot's reuse
