"""The overlapped step's new device weights, staged during backward (offload/device_staging.py):
the worker uploads each chunk's rounded weights into a device shadow on a side stream, and step()
publishes a kept chunk by a D2D copy shadow -> parameter on the current stream.

On a CPU the device is the stand-in of test_offload_h2d.py (every tensor a device tensor; an
upload's event in flight until waited for, holding the bytes it read), plus stand-in streams:
each records what it waited for, and the log says on which stream each upload and D2D copy went.
The checks: weights bit-identical to offload="none" in every mode; an upload into the shadow
only after the side stream waited for the last step's D2D copies out of it, and for the current
stream since the shadows were allocated there; a D2D copy only after the current stream waited
for the side stream; uploads into the shadow on the side stream, the parameters' own uploads
and the D2D copies on the current one. Controls show each order
check fails without the wait it guards. The GPU test at the end runs on a real device."""

from __future__ import annotations

import contextlib
import itertools
import os

import pytest
import torch
from test_offload import _nvme
from test_offload_h2d import _model, device, gpu_bf16_model, gpu_steps  # noqa: F401 (fixture)

import tierlift
from tierlift.offload import device_staging, h2d

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

STEPS = 3
CHUNK_BYTES = 4096  # 1024 elements: the model has 13 chunks


class Stream:
    def __init__(self, streams: Streams, name: str) -> None:
        self.streams, self.name = streams, name
        self.waited: set = set()  # ids of the events it waited for
        self.side_seen = -1  # current: side uploads it waited for (wait_stream), by count
        self.allocations_seen = -1  # side: shadow allocations it waited for, by count

    def wait_event(self, event) -> None:
        self.waited.add(event.id)

    def wait_stream(self, other) -> None:
        if other.name == "current":  # the side stream, after the shadows' allocation
            self.allocations_seen = self.streams.allocations
            return
        assert other.name == "side"
        self.side_seen = self.streams.side_uploads

    def synchronize(self) -> None:
        self.streams.log.append(("synchronize", self.name))


class Event:
    def __init__(self, eid: int) -> None:
        self.id = eid

    def synchronize(self) -> None:
        pass


class Streams:
    """The stand-in streams and the order checks; `log`: (what, stream name)."""

    def __init__(self) -> None:
        self.ids = itertools.count()
        self.current = Stream(self, "current")
        self.active = self.current  # torch.cuda.current_stream() of the training thread
        self.log: list = []
        self.copied: dict = {}  # shadow -> events recorded after D2D copies out of it
        self.copying = None  # the shadow of the D2D copies just issued
        self.side_uploads = 0
        self.allocations = 0  # of the shadows (on the current stream)
        self.violations: list = []
        self.shadows: list = []  # buffers of the optimizer's shadows
        self.free = 1 << 40

    def shadow_of(self, tensors) -> int | None:
        """The shadow (its storage's address) that all of `tensors` lie in, or None."""
        ptrs = {b.untyped_storage().data_ptr() for b in self.shadows}
        into = {t.untyped_storage().data_ptr() for t in tensors}
        assert len(into) == 1 or not into & ptrs  # one upload: one shadow, or parameters
        return into.pop() if into <= ptrs else None

    def uploaded(self, pairs) -> None:
        shadow = self.shadow_of([dst for dst, _ in pairs])
        if shadow is not None:
            self.log.append(("shadow upload", self.active.name))
            side = self.active
            if any(e.id not in side.waited for e in self.copied.get(shadow, [])):
                self.violations.append("shadow rewritten before the D2D copies out of it")
            if side.allocations_seen != self.allocations:
                self.violations.append("shadow written before the side stream waited for the "
                                       "current one, whose block it was given")
            self.side_uploads += 1
        else:
            self.log.append(("param upload", self.active.name))

    def d2d(self, stream, pairs) -> None:
        self.log.append(("d2d", stream.name))
        self.copying = self.shadow_of([src for _, src in pairs])
        if stream.side_seen != self.side_uploads:
            self.violations.append("D2D copy before the current stream waited for the side")
        for dst, src in pairs:
            dst.copy_(src)


@pytest.fixture
def streams(device, monkeypatch):  # noqa: F811 - the fixture imported above
    st = Streams()
    upload_events = h2d.upload_events  # the `device` fixture's stand-in

    def logged(pairs):
        st.uploaded(pairs)
        return upload_events(pairs)

    @contextlib.contextmanager
    def on_stream(stream):
        before, st.active = st.active, stream
        try:
            yield
        finally:
            st.active = before

    def record_event(stream):
        event = Event(next(st.ids))
        if stream is st.current:  # after the D2D copies out of a shadow
            st.copied.setdefault(st.copying, []).append(event)
        return event

    real = device_staging.DeviceStaging._allocate

    def allocate(self):
        st.allocations += 1
        real(self)
        st.shadows = [s.buffer for s in self.shadows if s is not None]

    monkeypatch.setattr(h2d, "upload_events", logged)
    monkeypatch.setattr(device_staging, "stageable", lambda p: True)
    monkeypatch.setattr(device_staging, "free_bytes", lambda dev: st.free)
    monkeypatch.setattr(device_staging, "side_stream", lambda dev: Stream(st, "side"))
    monkeypatch.setattr(device_staging, "current_stream", lambda dev: st.current)
    monkeypatch.setattr(device_staging, "on_stream", on_stream)
    monkeypatch.setattr(device_staging, "copy_on", st.d2d)
    monkeypatch.setattr(device_staging, "record_event", record_event)
    monkeypatch.setattr(device_staging.DeviceStaging, "_allocate", allocate)
    st.device = device
    return st


def _stepped_ahead(opt) -> None:
    """Lets every chunk the worker steps during backward finish, so the edit after it is one
    the speculation cannot have seen (otherwise whether any chunk is redone is timing)."""
    if opt._offload is not None and opt._offload.overlap is not None:
        opt._offload.overlap.wait()


def _clip(model, opt) -> None:
    """Clipping that scales every gradient: every chunk stepped ahead is stepped again."""
    _stepped_ahead(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)


def _edit(model, opt) -> None:
    """A weight edited between backward and step(): its chunk is stepped again."""
    _stepped_ahead(opt)
    with torch.no_grad():
        model[0].weight[0, 0] += 1


def _reload(model, opt) -> None:
    """A load between backward and step(): every chunk is stepped again."""
    opt.load_state_dict(opt.state_dict())


def _fit(opt_kw, between=None, edit_after=None, steps=STEPS, two_groups=False):
    """The model after `steps` steps and each step's last_step_stats. `between(model, opt)` runs
    between backward and step(); `edit_after` between a step and the next forward;
    `two_groups`: weights and biases in param groups of their own (a shadow each)."""
    model = _model(torch.bfloat16)
    params = model.parameters()
    if two_groups:
        named = list(model.named_parameters())
        params = [{"params": [p for n, p in named if n.endswith("weight")]},
                  {"params": [p for n, p in named if n.endswith("bias")], "lr": 3e-2}]
    opt = tierlift.optim.AdamW(params, lr=1e-2, **opt_kw)
    g = torch.Generator().manual_seed(9)
    stats = []
    try:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(16, 48, generator=g).to(torch.bfloat16)).square().mean().backward()
            if between is not None:
                between(model, opt)
            opt.step()
            stats.append(opt.last_step_stats)
            if edit_after is not None:
                edit_after(model, opt)
    finally:
        opt.close()
    return [p.detach().clone() for p in model.parameters()], stats


def _kw(tier: str, tmp_path, **extra) -> dict:
    kw = dict(overlap=True, chunk_bytes=CHUNK_BYTES, **extra)
    if tier == "nvme":
        kw.update(_nvme(tmp_path, 1 << 20))
    elif tier == "spare":  # one generation and a few spare chunks (tiers.MemoryTier)
        kw.update(offload="cpu", cpu_budget=400_000)
    elif tier == "compact":
        kw.update(offload="cpu", state_dtype="bf16")
    else:
        kw.update(offload="cpu")
    return kw


MODES = {  # name: (tier, between backward and step(), between step() and forward, staged)
    "plain": ("cpu", None, None, True),
    "edited-weights": ("cpu", None, _edit, True),
    "edited-before-step": ("cpu", _edit, None, True),
    "redone-by-clip": ("cpu", _clip, None, False),
    "load-before-step": ("cpu", _reload, None, False),
    "spare-blocks": ("spare", None, None, True),
    "nvme": ("nvme", None, None, True),
    "compact-state": ("compact", None, None, True),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_staged_weights_are_bit_identical(streams, tmp_path, mode):
    tier, between, after, staged = MODES[mode]
    ref, _ = _fit({"state_dtype": "bf16"} if tier == "compact" else {}, between, after)
    got, stats = _fit(_kw(tier, tmp_path), between, after)
    for a, b in zip(ref, got):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert streams.violations == [] and streams.device.violations == []
    published = sum(s.get("device_staged_chunks", 0) for s in stats)
    redone = sum(s.get("overlap_redone_chunks", 0) for s in stats)
    shadow_uploads = [on for what, on in streams.log if what == "shadow upload"]
    assert shadow_uploads and set(shadow_uploads) == {"side"}
    assert {on for what, on in streams.log if what in ("param upload", "d2d")} <= {"current"}
    # device_staging=None decides after the first step; from the second, every chunk kept
    # was published from the shadow (all parameters are device ones)
    assert stats[0].get("device_staged_chunks", 0) == 0
    assert published == sum(s.get("overlap_kept_chunks", 0) for s in stats[1:])
    if staged:
        assert published > 0
        assert stats[-1]["legs"]["h2d"]["total_s"] > 0
    elif mode == "load-before-step":  # the load dropped every chunk stepped ahead
        assert published == 0
    else:  # every chunk was stepped ahead, before the clip
        assert redone > 0 and published == 0
    if mode.startswith("edited"):
        assert redone > 0  # the edited weight's chunk, published from the host
    if tier == "spare":
        assert sum(s.get("overlap_no_room_chunks", 0) for s in stats) > 0
    # close(): nothing left in flight that reads the slots or the shadow
    assert streams.device.pending() == 0
    assert ("synchronize", "side") in streams.log


def _fit_scaled(opt_kw, skip_at=1):
    """STEPS + 1 steps through torch.amp.GradScaler, with an inf gradient written after
    backward on step `skip_at`: the scaler skips that step."""
    model = _model(torch.bfloat16)
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-2, **opt_kw)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    g = torch.Generator().manual_seed(9)
    stats = []
    try:
        for i in range(STEPS + 1):
            opt.zero_grad(set_to_none=True)
            loss = model(torch.randn(16, 48, generator=g).to(torch.bfloat16)).float()
            scaler.scale(loss.square().mean()).backward()
            if i == skip_at:
                with torch.no_grad():
                    model[2].weight.grad.view(-1)[3] = float("inf")
            scaler.step(opt)
            scaler.update()
            stats.append(getattr(opt, "last_step_stats", None) or {})
    finally:
        opt.close()
    return [p.detach().clone() for p in model.parameters()], stats


def test_grad_scaler_skip_is_bit_identical(streams, tmp_path):
    ref, _ = _fit_scaled({})
    got, stats = _fit_scaled(_kw("cpu", tmp_path))
    for a, b in zip(ref, got):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert streams.violations == [] and streams.device.violations == []
    assert stats[1].get("skipped") is True
    assert stats[1].get("device_staged_chunks", 0) == 0
    # (the step after the skip assumed the old scale: its chunks are stepped again)
    assert sum(s.get("device_staged_chunks", 0) for s in stats) > 0


def test_two_param_groups_have_a_shadow_each(streams, tmp_path):
    ref, _ = _fit({}, two_groups=True)
    got, stats = _fit(_kw("cpu", tmp_path), two_groups=True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert streams.violations == [] and streams.device.violations == []
    assert len(streams.shadows) == 2
    assert sum(s.get("device_staged_chunks", 0) for s in stats) == sum(
        s.get("overlap_kept_chunks", 0) for s in stats[1:]) > 0  # None: from the second step


def test_without_the_side_streams_wait_a_rewritten_shadow_is_caught(streams, monkeypatch,
                                                                     tmp_path):
    """Control: the side stream not waiting for the last D2D copies out of the shadow."""
    monkeypatch.setattr(Stream, "wait_event", lambda self, event: None)
    _fit(_kw("cpu", tmp_path))
    assert "shadow rewritten before the D2D copies out of it" in streams.violations


def test_without_the_current_streams_wait_an_early_copy_is_caught(streams, monkeypatch,
                                                                   tmp_path):
    """Control: the D2D copies not waiting for the uploads into the shadow."""
    monkeypatch.setattr(Stream, "wait_stream", lambda self, other: None)
    _fit(_kw("cpu", tmp_path))
    assert "D2D copy before the current stream waited for the side" in streams.violations


def test_without_the_wait_after_allocation_a_shadow_write_is_caught(streams, monkeypatch,
                                                                    tmp_path):
    """Control: the side stream writing the shadows without first waiting for the current
    stream (the allocator handed the shadows blocks its earlier kernels may still use)."""
    wait_stream = Stream.wait_stream

    def side_only(self, other):
        if other.name == "side":
            wait_stream(self, other)

    monkeypatch.setattr(Stream, "wait_stream", side_only)
    _fit(_kw("cpu", tmp_path))
    assert streams.violations == ["shadow written before the side stream waited for the "
                                  "current one, whose block it was given"] * len(
        [1 for what, _ in streams.log if what == "shadow upload"])


def test_a_staging_buffer_rewritten_under_a_shadow_upload_is_caught(streams, monkeypatch,
                                                                    tmp_path):
    """Control: without Uploader.reserve the worker rounds the next chunk into a slot whose
    upload into the shadow is still in flight."""
    monkeypatch.setattr(h2d.Uploader, "reserve", lambda self, buffer: None)
    _fit(_kw("cpu", tmp_path))
    assert streams.device.violations


def test_false_and_no_room_publish_from_the_host(streams, tmp_path):
    ref, _ = _fit({})
    got, stats = _fit(_kw("cpu", tmp_path, device_staging=False))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert sum(s.get("device_staged_chunks", 0) for s in stats) == 0
    assert sum(s.get("overlap_kept_chunks", 0) for s in stats) > 0
    assert not any(what == "shadow upload" for what, _ in streams.log)
    # None: on only where twice the shadow is free; True: where it fits
    streams.free = 32 << 10  # the shadow of the 13112 bf16 weights (~27 KB) fits, not twice
    got, stats = _fit(_kw("cpu", tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert sum(s.get("device_staged_chunks", 0) for s in stats) == 0
    got, stats = _fit(_kw("cpu", tmp_path, device_staging=True))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert sum(s.get("device_staged_chunks", 0) for s in stats) > 0


def test_none_decides_with_the_memory_left_after_the_first_step(streams, tmp_path):
    """The free memory that counts is the one after the first step's forward and backward
    (when torch's allocator holds their peak), not the one at construction."""
    ref, _ = _fit({})

    def free_now(amount):
        def set_free(model, opt):
            streams.free = amount
        return set_free

    streams.free = 1024  # at construction: no room
    got, stats = _fit(_kw("cpu", tmp_path), between=free_now(1 << 30))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert sum(s.get("device_staged_chunks", 0) for s in stats) > 0
    streams.free = 1 << 30  # at construction: room; after the first backward: none
    got, stats = _fit(_kw("cpu", tmp_path), between=free_now(1024))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert sum(s.get("device_staged_chunks", 0) for s in stats) == 0


def test_true_without_room_is_refused_before_anything_changes(streams, tmp_path):
    model = _model(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    streams.free = 1024
    with pytest.raises(ValueError, match="device_staging=True needs .* bytes of device memory"):
        tierlift.optim.AdamW(model.parameters(), **_kw("nvme", tmp_path, device_staging=True))
    assert os.listdir(tmp_path) == []  # no state folder was made
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="device_staging=True needs overlap=True"):
        tierlift.optim.AdamW(model.parameters(), offload="cpu", device_staging=True)
    with pytest.raises(TypeError, match="device_staging must be None, True or False"):
        tierlift.optim.AdamW(model.parameters(), offload="cpu", device_staging="on")


def test_true_without_cuda_parameters_is_refused():
    model = _model(torch.bfloat16)  # host parameters, no stand-in device
    with pytest.raises(ValueError, match="device_staging=True needs CUDA parameters"):
        tierlift.optim.AdamW(model.parameters(), offload="cpu", overlap=True,
                             device_staging=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_gpu_staged_weights_match_host_publish_and_no_offload(tmp_path, tier, state_dtype):
    """On a GPU, bf16 weights: 3 overlapped steps with device staging equal, bit for bit, the
    same steps with device_staging=False and with offload="none"; the chunks kept were
    published from the shadow. Compact state too (the 7B compact fine-tune's path)."""

    def run(**kw):
        model = gpu_bf16_model()
        opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, chunk_bytes=1 << 16,
                                   state_dtype=state_dtype, **kw)
        stats = gpu_steps(model, opt)
        return [p.detach().cpu() for p in model.parameters()], stats

    def tier_kw(name):
        if tier == "cpu":
            return dict(offload="cpu", overlap=True)
        (tmp_path / name).mkdir()
        return dict(_nvme(tmp_path / name, 64 << 20), overlap=True)

    ref, _ = run()
    host, host_stats = run(device_staging=False, **tier_kw("host"))
    got, stats = run(device_staging=True, **tier_kw("staged"))
    # The staging's own claim first (both runs step with the host kernel); then both against
    # offload="none", i.e. the fused CUDA kernel against the host one.
    for b, c in zip(host, got):
        assert torch.equal(b.view(torch.int16), c.view(torch.int16)), "staged != host publish"
    for a, b in zip(ref, host):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "offloaded != CUDA AdamW"
    assert sum(s.get("device_staged_chunks", 0) for s in stats) > 0
    assert sum(s.get("device_staged_chunks", 0) for s in host_stats) == 0
