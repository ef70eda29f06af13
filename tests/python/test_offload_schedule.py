"""The offloaded pipeline's schedule, checked on a CPU: ZeRO-3 with offload_params="cpu" and the
overlapped, offloaded AdamW, with every device leg replaced by a timed stand-in and every leg
logged. The test asserts the order the overlap promises, not a timing:

- optimizer work runs during backward: unit k's CPU Adam starts after unit k's own backward
  and gradient D2H, and before the backward of unit k-1 (the next one in backward order) ends;
- prefetch: the stage-in (H2D) of unit k+1 is issued before unit k's forward ends, and in
  backward that of unit k-1 before unit k's backward ends;
- at most prefetch + 1 units are gathered at once.

Stand-ins: each block's forward sleeps FWD_S and its backward BWD_S on the training thread (the
GPU compute of the unit, with a host that waits for it). A backward stand-in is stretched, up
to GRACE, while the step of the unit `lag` after it has not started: a loaded machine may start
the worker thread later than BWD_S, but a serialized pipeline never starts it before backward
ends, so only a serialization fails the check. Controls show that each check can fail:
overlap=False, an overlap whose worker waits for the end of backward (every chunk still kept:
the step's stats alone would not notice), and prefetch=0.

With the D2H copy asynchronous too (an event that completes D2H_S after the copy is issued, as
on a GPU) and a host that waits for each unit's compute (these stand-ins), the same order holds:
zero/hooks.py hands the gradient over with its copy in flight and the overlap's worker waits for
the copy's event before its Adam reads it. The control is the earlier way, where the training
thread hands a gradient over only once it finds its copy done, when the next unit launches its
reduction: one unit late, which the check catches.

last_step_stats["legs"] is checked on the same stand-ins: each leg has its fields, exposed <=
total, and with Adam given a stand-in time too, overlap=False leaves all of it exposed while the
overlap hides all but the unit stepped after backward.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

import tierlift
from tierlift.offload.legs import LEGS, TRAINING
from tierlift.offload.overlap import Overlap
from tierlift.offload.runner import Offloader
from tierlift.zero.hooks import ZeroState
from tierlift.zero.param_offload import ParamOffload

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

UNITS, DIM = 5, 32
FWD_S, BWD_S = 0.005, 0.03  # stand-ins for a unit's forward and backward on the device
GRACE = 0.5  # the most a backward stand-in waits for an earlier unit's step to start
D2H_S = 0.005  # an asynchronous gradient copy, shorter than a unit's backward
ADAM_S = 0.01  # a stand-in for a large unit's CPU Adam, per chunk (legs test)


class Log:
    """The event log: (time, kind, unit, thread) in the order they happened."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, int, str]] = []
        self.cond = threading.Condition()
        self.armed = False  # stretch backward stand-ins (the measured step only)
        self.lag = 1  # ... until the step of the unit `lag` after it has started
        self.units_of: dict[int, int] = {}  # id(shard) -> unit
        self.t0 = time.perf_counter()

    def __call__(self, kind: str, unit: int = -1) -> None:
        with self.cond:
            self.events.append((time.perf_counter(), kind, unit,
                                threading.current_thread().name))
            self.cond.notify_all()

    def seen(self, kind: str, unit: int) -> bool:
        return any(k == kind and u == unit for _, k, u, _ in self.events)

    def wait_for(self, kind: str, unit: int, timeout: float) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.seen(kind, unit), timeout=timeout)

    def clear(self) -> None:
        with self.cond:
            self.events.clear()
            self.t0 = time.perf_counter()

    def first(self, kind: str, unit: int, phase: str | None = None) -> float:
        """Time of the first `kind` event of `unit` (inside `phase` when given)."""
        for t, k, u, _ in self.timeline(phase):
            if k == kind and u == unit:
                return t
        raise AssertionError(f"no {kind} of unit {unit}{' in ' + phase if phase else ''}:\n"
                             f"{self.format()}")

    def timeline(self, phase: str | None = None) -> list:
        if phase is None:
            return list(self.events)
        out, inside = [], False
        for e in self.events:
            if e[1].startswith("phase:"):
                inside = e[1] == f"phase:{phase}"
                continue
            if inside:
                out.append(e)
        return out

    def format(self) -> str:
        lines = []
        for t, kind, unit, thread in self.events:
            who = "" if unit < 0 else f" {unit}"
            where = "" if thread == "MainThread" else f"  [{thread}]"
            lines.append(f"{(t - self.t0) * 1e3:8.1f} ms  {kind}{who}{where}")
        return "\n".join(lines)


class StandIn(torch.autograd.Function):
    """The device compute of a unit's backward: BWD_S, stretched (up to GRACE) while the unit
    `log.lag` after it has not started its optimizer step."""

    @staticmethod
    def forward(ctx, x, unit: int, log: Log):
        ctx.unit, ctx.log = unit, log
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        log, unit = ctx.log, ctx.unit
        log("bwd_start", unit)
        time.sleep(BWD_S)
        if log.armed and unit + log.lag < UNITS:
            log.wait_for("adam_start", unit + log.lag, GRACE)
        log("bwd_end", unit)
        return grad, None, None


class Block(nn.Module):
    def __init__(self, unit: int, log: Log) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.unit = unit
        self.log = log

    def forward(self, x):
        self.log("fwd_start", self.unit)
        time.sleep(FWD_S)
        # At the output: in backward the stand-in runs first, then the unit's gradient lands.
        y = StandIn.apply(torch.tanh(self.lin(x)), self.unit, self.log)
        self.log("fwd_end", self.unit)
        return y


class Net(nn.Module):
    """UNITS equal blocks, one unit each, nothing at the root (no root unit)."""

    def __init__(self, log: Log) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(i, log) for i in range(UNITS))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.fixture
def log(monkeypatch):
    """A Log fed by the legs of the pipeline: stage-in (H2D) of a unit, gather/free with the
    number of units gathered after it, the D2H of a unit's gradient shard, the CPU Adam of a
    unit's chunks (on whichever thread), the hand-over of its gradient to the optimizer."""
    log = Log()
    units_of = log.units_of

    stage_in = ParamOffload.stage_in

    def logged_stage_in(self, shard, dtype=None):
        log("stage_in", units_of.get(id(shard), -1))
        return stage_in(self, shard, dtype)

    def counted(name: str, orig):
        def wrapper(self, unit, *args, **kwargs):
            out = orig(self, unit, *args, **kwargs)
            live = sum(u.full_bytes > 0 for u in self.units)
            log(f"{name}:{live}", self.units.index(unit))
            return out
        return wrapper

    step_chunk = Offloader._step_chunk

    def logged_step_chunk(self, gi, group, params, grads, steps, chunk, *args, **kwargs):
        units = sorted({units_of.get(id(params[s.pi]), -1) for s in chunk.segments})
        for u in units:
            log("adam_start", u)
        try:
            return step_chunk(self, gi, group, params, grads, steps, chunk, *args, **kwargs)
        finally:
            for u in units:
                log("adam_end", u)

    landing = ZeroState._landing

    def logged_landing(self, unit, reduced):
        log("d2h", self.units.index(unit))  # the gradient shard's copy to host memory
        return landing(self, unit, reduced)

    hand_over = ZeroState._hand_over

    def logged_hand_over(self, unit, piece, early):
        log("grad_ready", self.units.index(unit))  # on_shard_grad_ready listeners run next
        return hand_over(self, unit, piece, early)

    monkeypatch.setattr(ParamOffload, "stage_in", logged_stage_in)
    monkeypatch.setattr(ZeroState, "_hand_over", logged_hand_over)
    monkeypatch.setattr(ZeroState, "_landing", logged_landing)
    monkeypatch.setattr(ZeroState, "_gather", counted("gather", ZeroState._gather))
    monkeypatch.setattr(ZeroState, "_free", counted("free", ZeroState._free))
    monkeypatch.setattr(Offloader, "_step_chunk", logged_step_chunk)
    # One intra-op thread: on a loaded machine an OpenMP barrier after each sleep waits for a
    # second thread to be scheduled, which slows the run (not the order).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield log
    torch.set_num_threads(threads)


def build(log: Log, tmp_path, tier: str = "cpu", overlap: bool = True, prefetch: int = 1):
    torch.manual_seed(0)
    model = tierlift.zero.shard(Net(log), stage=3, offload_params="cpu", prefetch=prefetch)
    state = model._tierlift_zero
    assert [u.name for u in state.units] == [f"blocks.{i}" for i in range(UNITS)]
    log.units_of.update({id(u.shard): i for i, u in enumerate(state.units)})
    kw = dict(nvme_path=str(tmp_path)) if tier == "nvme" else {}
    # 4 KiB chunks: every chunk holds one unit's shard only (shards start 4 KiB aligned), so a
    # unit is stepped as soon as its own gradient lands.
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-3, offload=tier, overlap=overlap,
                               chunk_bytes=4096, **kw)
    return model, opt


def train(model, opt, log: Log, steps: int = 2, gate: threading.Event | None = None) -> dict:
    """`steps` steps, the last one logged (the first records the forward order, which prefetch
    needs). Returns the last step's optimizer stats, with "wall_s": that step's time from
    forward to the end of step()."""
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1))
    for s in range(steps):
        last = s == steps - 1
        if last:
            log.clear()
            log.armed = True
            model._tierlift_zero.stats["peak_resident_bytes"] = 0
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        log("phase:forward")
        loss = model(x).square().mean()
        log("phase:backward")
        loss.backward()
        if gate is not None:
            gate.set()
        log("phase:step")
        opt.step()
        log("phase:end")
        log.armed = False
    return dict(opt.last_step_stats, wall_s=time.perf_counter() - t0)


# ---- the order checks --------------------------------------------------------------------------
def check_overlap(log: Log, lag: int = 1) -> None:
    """Unit k's CPU Adam starts after its own backward and its gradient's D2H, and before the
    backward of unit k-lag ends (lag 1: the unit right after it in backward order)."""
    for k in range(UNITS):
        start = log.first("adam_start", k)
        assert (log.first("bwd_end", k, "backward") < log.first("d2h", k)
                < log.first("grad_ready", k) < start), \
            f"unit {k}'s Adam started before its gradient was on the host:\n{log.format()}"
    for k in reversed(range(lag, UNITS)):  # backward order
        assert log.first("adam_start", k) < log.first("bwd_end", k - lag, "backward"), \
            f"unit {k}'s CPU Adam did not start during the backward of unit {k - lag}: the " \
            f"optimizer step is serialized after backward\n{log.format()}"


def stepped_after_backward(log: Log) -> list[int]:
    """The units whose CPU Adam started only after the last backward stand-in ended."""
    end = log.first("bwd_end", 0, "backward")
    return [k for k in range(UNITS) if log.first("adam_start", k) > end]


def check_prefetch(log: Log) -> None:
    """Forward: unit k+1's stage-in is issued before unit k's forward ends. Backward: unit
    k-1's before unit k's backward ends."""
    for k in range(UNITS - 1):
        assert log.first("stage_in", k + 1, "forward") < log.first("fwd_end", k, "forward"), \
            f"unit {k + 1}'s H2D was not issued before unit {k}'s forward ended (no " \
            f"prefetch)\n{log.format()}"
    for k in range(1, UNITS):
        assert log.first("stage_in", k - 1, "backward") < log.first("bwd_end", k, "backward"), \
            f"unit {k - 1}'s H2D was not issued before unit {k}'s backward ended (no " \
            f"prefetch)\n{log.format()}"


def live_units(log: Log) -> int:
    """The most units gathered at once (counted after every gather and free)."""
    return max(int(k.split(":")[1]) for _, k, _, _ in log.events
               if k.startswith(("gather:", "free:")))


def check_live(log: Log, model, prefetch: int) -> None:
    bound = prefetch + 1  # the unit computing and the `prefetch` units gathered ahead of it
    assert live_units(log) <= bound, f"more than {bound} units gathered\n{log.format()}"
    unit_bytes = model._tierlift_zero.units[0].gather_bytes
    assert model._tierlift_zero.stats["peak_resident_bytes"] <= bound * unit_bytes


# ---- the pipeline keeps its promises -----------------------------------------------------------
@pytest.mark.parametrize("tier,prefetch", [("cpu", 1), ("cpu", 2), ("nvme", 1)])
def test_offloaded_step_keeps_the_promised_order(log, tmp_path, tier, prefetch):
    model, opt = build(log, tmp_path, tier, prefetch=prefetch)
    try:
        stats = train(model, opt, log)
    finally:
        opt._offload.close()
    check_overlap(log)
    check_prefetch(log)
    check_live(log, model, prefetch)
    assert live_units(log) == prefetch + 1  # the prefetch did run ahead
    assert stats["overlap_kept_chunks"] == 2 * UNITS and stats["overlap_redone_chunks"] == 0
    # Only the unit first in forward order is stepped after backward.
    assert stepped_after_backward(log) == [0]


class CopyEvent:
    """The device event of an asynchronous gradient copy, on the copy stream beside the compute
    of the unit after it in backward: done once that unit's backward has started and D2H_S has
    passed (not by time alone: a poll on a loaded machine must not find it done early)."""

    def __init__(self, log: Log, unit: int) -> None:
        self.log, self.unit, self.issued = log, unit, len(log.events)
        self.at = time.perf_counter() + D2H_S
        self.landed = False

    def query(self) -> bool:
        return time.perf_counter() >= self.at and any(
            kind == "bwd_start" for _, kind, _, _ in self.log.events[self.issued:])

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.perf_counter()))
        if not self.landed:
            self.landed = True
            self.log("landed", self.unit)  # on the thread that waited for it


@pytest.fixture
def async_d2h(log, monkeypatch) -> list:
    """Every gradient copy asynchronous (CopyEvent); returns the events in issue order."""
    stage_out = ParamOffload.stage_out
    events = []

    def async_stage_out(self, grad):
        unit = next(u for _, k, u, _ in reversed(log.events) if k == "d2h")
        events.append(CopyEvent(log, unit))
        return stage_out(self, grad)[0], events[-1]

    monkeypatch.setattr(ParamOffload, "stage_out", async_stage_out)
    return events


def check_landed_first(log: Log) -> None:
    """Each unit's copy landed (its event waited for) before its Adam read the gradient."""
    for k in range(UNITS):
        assert log.first("landed", k) < log.first("adam_start", k), \
            f"unit {k}'s Adam started before its gradient's copy landed:\n{log.format()}"


def test_async_d2h_keeps_the_promised_order(log, tmp_path, async_d2h):
    """The gradient is handed over with its copy in flight and the worker waits for the copy
    itself: each unit's Adam starts during the backward of the unit after it, after its copy
    landed, and every chunk stepped ahead is kept (the worker read the bytes step() sees)."""
    model, opt = build(log, tmp_path)
    try:
        stats = train(model, opt, log)
    finally:
        opt._offload.close()
    check_overlap(log)
    check_landed_first(log)
    check_prefetch(log)
    assert stepped_after_backward(log) == [0]
    assert all(e.landed for e in async_d2h)  # backward ends with every copy landed
    zs = model._tierlift_zero.stats
    assert zs["grads_handed_in_flight"] == 2 * UNITS  # both steps, every unit
    assert stats["overlap_kept_chunks"] == 2 * UNITS and stats["overlap_redone_chunks"] == 0
    # The worker's waits for the copies are D2H time on its thread, not the training thread's.
    d2h = stats["legs"]["d2h"]["threads"]
    assert any(t != TRAINING and v["total_s"] > 0 for t, v in d2h.items()), d2h


def test_async_d2h_polled_by_the_training_thread_fails_the_check(log, tmp_path, async_d2h,
                                                                 monkeypatch):
    """The earlier way: a gradient is handed over only once the training thread finds its copy
    done, which it looks for when the next unit launches its reduction: unit k's Adam waits
    for the end of unit k-1's backward."""
    monkeypatch.setattr(ZeroState, "_takes_in_flight", lambda self, unit: False)
    model, opt = build(log, tmp_path)
    try:
        train(model, opt, log)
    finally:
        opt._offload.close()
    check_landed_first(log)
    with pytest.raises(AssertionError, match="serialized"):
        check_overlap(log)
    assert model._tierlift_zero.stats["grads_handed_in_flight"] == 0


def test_async_d2h_listener_that_reads_sees_landed_gradients(log, tmp_path, async_d2h):
    """A listener (on_shard_grad_ready) that does not wait for the copy itself keeps the units
    it listens to on the landed hand-over: it never sees a gradient still being written."""
    model, opt = build(log, tmp_path)
    state = model._tierlift_zero
    seen = []

    def reads(shard):
        seen.append(state.landing_event(shard) is None and all(
            e.landed for e in async_d2h if e.unit == log.units_of[id(shard)]))

    handles = [tierlift.zero.on_shard_grad_ready(u.shard, reads) for u in state.units[:2]]
    try:
        train(model, opt, log)
    finally:
        for h in handles:
            h.remove()
        opt._offload.close()
    assert seen == [True] * 4  # two units, two steps
    # the units after them in launch order (units 1 and 0 are last) lose nothing
    assert state.stats["grads_handed_in_flight"] == 2 * (UNITS - 2)
    check_landed_first(log)


# ---- each check can fail -----------------------------------------------------------------------
def test_no_overlap_fails_the_check(log, tmp_path):
    model, opt = build(log, tmp_path, overlap=False)
    try:
        train(model, opt, log)
    finally:
        opt._offload.close()
    with pytest.raises(AssertionError, match="serialized"):
        check_overlap(log)
    check_prefetch(log)  # the parameter side does not depend on the optimizer
    assert stepped_after_backward(log) == list(range(UNITS))


def test_overlap_that_waits_for_backward_fails_the_check(log, tmp_path, monkeypatch):
    """A change that keeps overlap=True but starts the worker only once backward is over: every
    chunk is still stepped ahead and kept, so only the order tells."""
    gate = threading.Event()
    work = Overlap._work

    def late_work(self, *args, **kwargs):
        gate.wait(timeout=30)
        return work(self, *args, **kwargs)

    monkeypatch.setattr(Overlap, "_work", late_work)
    model, opt = build(log, tmp_path)
    try:
        stats = train(model, opt, log, steps=1, gate=gate)
    finally:
        gate.set()
        opt._offload.close()
    assert stats["overlap_kept_chunks"] == 2 * UNITS  # looks overlapped by the stats
    with pytest.raises(AssertionError, match="serialized"):
        check_overlap(log)


def test_no_prefetch_fails_the_check(log, tmp_path):
    model, opt = build(log, tmp_path, prefetch=0)
    try:
        train(model, opt, log)
    finally:
        opt._offload.close()
    check_overlap(log)
    with pytest.raises(AssertionError, match="no prefetch"):
        check_prefetch(log)
    check_live(log, model, 0)


# ---- the step's legs (last_step_stats["legs"]) ----------------------------------------------
def check_legs(legs: dict) -> None:
    """Every leg has its fields, none negative, no more exposed than it took."""
    assert set(legs) == set(LEGS)
    for leg, v in legs.items():
        assert set(v) == {"total_s", "exposed_s", "threads", "bytes", "device_s"}, (leg, v)
        assert v["total_s"] >= 0 and v["exposed_s"] >= 0 and v["bytes"] >= 0, (leg, v)
        assert v["exposed_s"] <= v["total_s"], (leg, v)
        assert v["device_s"] is None, (leg, v)  # nothing runs on CUDA here
        for t in v["threads"].values():
            assert 0 <= t["exposed_s"] <= t["total_s"] + 1e-12, (leg, v)


@pytest.fixture
def slow_adam(monkeypatch) -> None:
    """Each chunk's Adam takes ADAM_S more (a larger unit's kernel, on whichever thread)."""
    adam = Offloader._adam

    def slow(self, *args, **kwargs):
        adam(self, *args, **kwargs)
        time.sleep(ADAM_S)

    monkeypatch.setattr(Offloader, "_adam", slow)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_step_legs_show_what_the_overlap_hides(log, tmp_path, slow_adam, tier):
    runs = {}
    for overlap in (False, True):
        log.lag = 1 if overlap else UNITS  # no Adam during backward to wait for without it
        (tmp_path / str(overlap)).mkdir()
        model, opt = build(log, tmp_path / str(overlap), tier, overlap=overlap)
        try:
            runs[overlap] = train(model, opt, log)
        finally:
            opt._offload.close()
    for overlap, stats in runs.items():
        legs = stats["legs"]
        check_legs(legs)
        # 2 chunks per unit; backward holds every unit's stand-in
        assert legs["adam"]["total_s"] >= 2 * UNITS * ADAM_S, (overlap, legs["adam"])
        assert legs["backward"]["total_s"] >= UNITS * BWD_S, (overlap, legs["backward"])
        for leg in ("forward", "h2d", "d2h", "other"):
            assert legs[leg]["total_s"] > 0, (overlap, leg, legs[leg])
        assert legs["h2d"]["bytes"] > 0 and legs["d2h"]["bytes"] > 0
        for leg in ("nvme_read", "nvme_write"):
            # the engine's requests: the state's chunks (and, read, the new masters that
            # step() publishes from the chunks stepped ahead)
            moved = stats.get(f"{leg}_bytes", 0) if tier == "nvme" else 0
            assert moved <= legs[leg]["bytes"] <= 2 * moved, (overlap, leg, legs[leg], moved)
            if leg == "nvme_write" or not overlap:
                assert legs[leg]["bytes"] == moved, (overlap, leg, legs[leg], moved)
            assert (legs[leg]["total_s"] > 0) == (tier == "nvme"), (overlap, leg, legs[leg])
        # The exposed parts split the training thread's time (less the loss and the logging).
        exposed = sum(v["exposed_s"] for v in legs.values())
        assert 0.8 * stats["wall_s"] <= exposed <= stats["wall_s"], (overlap, exposed, stats)
    serial, hidden = runs[False]["legs"]["adam"], runs[True]["legs"]["adam"]
    assert serial["exposed_s"] == serial["total_s"] and list(serial["threads"]) == [TRAINING]
    # Overlapped: only the unit stepped after backward (a fifth of the chunks) is waited for.
    assert hidden["exposed_s"] < 0.5 * hidden["total_s"], hidden
    assert TRAINING not in hidden["threads"], hidden  # every chunk was kept: none redone
    assert runs[True]["overlap_kept_chunks"] == 2 * UNITS
