"""Where an offloaded step's time goes, leg by leg, and how much of each leg the training thread
waited for: last_step_stats["legs"] of tierlift.optim.Adam/AdamW with offload.

Legs: "forward" and "backward" (the device's compute as the host sees it), "h2d" (parameter
copies to the device), "d2h" (gradient copies to host memory), "adam" (the CPU Adam kernel),
"device_adam" (the device part's own step, OffloadConfig.device_fraction: its launch on the
host, and on CUDA its kernels' device time, which runs after step() returns, before the next
forward), "nvme_read" and "nvme_write" (the optimizer state's I/O), "other" (the optimizer's
other work: checks, fingerprints, masters, publish). Each is

  total_s    how long the leg took on whatever did it: the host threads' time in it; for a copy
             whose tensors are on CUDA, the host's part plus the device's time (CUDA events)
             in place of the host's waits for it; for NVMe, the engine's busy time (each
             request from its issue until it is first seen done, overlapping requests once);
  exposed_s  the part the training thread spent doing it or blocked on it: all of its own time
             in the leg; of the overlap worker's, only what falls inside step()'s waits for it;
  threads    {thread: {"total_s", "exposed_s"}}: the host time per thread ("training": the
             thread of forward, backward and step(); the overlap's worker by its name);
  bytes      what the leg moved (copies, NVMe);
  device_s   the CUDA-event time of the leg (None where nothing of it ran on CUDA).

The exposed parts split the training thread's time, from forward to the end of step(), less what
the loop does between them (the loss, zero_grad): forward and backward are the host's time in
them less the copies it made or waited for there, and a wait for a copy beyond the copy's own
device time (the wait also waits for the compute queued before it) counts to backward. On a CPU
the device legs are the host's own copies (no CUDA events).

"device_adam"'s device time is not known when step() returns (its kernels are only queued):
DeviceTime fills it in (device_s, and into total_s) once its events are done, when the stats
are read or at the next step, whichever finds them done first; until then device_s is None.

Nothing here synchronizes: spans are perf_counter pairs, CUDA events are read once query() says
they are done (at step() they are: backward waits for the gradient copies).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

LEGS = ("forward", "backward", "h2d", "d2h", "adam", "device_adam", "nvme_read", "nvme_write",
        "other")
TRAINING = "training"
WAIT = "wait"  # a Clock span: step()'s thread blocked on the overlap's worker
_MAX_EVENTS = 512  # CUDA event pairs kept unread before the done ones are folded in

_local = threading.local()


def _stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


class Span:
    """An open span; `until`, set inside it, ends the leg's part there (the rest of the span is
    the time of the span around it: a wait's CRC check after the data arrived)."""

    __slots__ = ("clock", "leg", "start", "until")

    def __init__(self, clock, leg: str, start: float):
        self.clock, self.leg, self.start, self.until = clock, leg, start, None


class Clock:
    """The host-side intervals of one optimizer step, per leg and thread. A thread's time in
    nested spans is split exclusively: an inner span pauses the one around it."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.segments: list = []  # (leg, thread name, t0, t1)
        self.io: list = []  # (leg, issued, first seen done, bytes) of the engine's requests

    def _add(self, leg: str, t0: float, t1: float) -> None:
        if t1 > t0:
            self.segments.append((leg, threading.current_thread().name, t0, t1))

    @contextmanager
    def span(self, leg: str):
        stack = _stack()
        now = time.perf_counter()
        if stack:
            outer = stack[-1]
            outer.clock._add(outer.leg, outer.start, now)
        s = Span(self, leg, now)
        stack.append(s)
        try:
            yield s
        finally:
            end = time.perf_counter()
            stack.pop()
            until = end if s.until is None else min(max(s.until, s.start), end)
            self._add(leg, s.start, until)
            if stack:
                stack[-1].start = until


class IoTrack:
    """The engine's requests of one pipeline run, each from its issue until first seen done
    (offload.tiers._Checked: `issued_at`, `done_at` once waited for, `handles` to poll)."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.open: list = []  # (leg, handle)

    def add(self, leg: str, handles) -> None:
        for h in handles:
            if getattr(h, "handles", None) and getattr(h, "issued_at", None) is not None:
                self.open.append((leg, h))

    def poll(self) -> None:
        """Closes the requests that are done (cheap: no wait)."""
        if not self.open:
            return
        now, keep = time.perf_counter(), []
        for leg, h in self.open:
            done_at = getattr(h, "done_at", None)
            if done_at is None and all(p.done() for p in h.handles):
                done_at = now
            if done_at is None:
                keep.append((leg, h))
            else:
                self.clock.io.append((leg, h.issued_at, done_at, _nbytes(h)))
        self.open = keep

    def close(self) -> None:
        """Every request left was waited for (or drained) by now."""
        now = time.perf_counter()
        for leg, h in self.open:
            self.clock.io.append((leg, h.issued_at, getattr(h, "done_at", None) or now,
                                  _nbytes(h)))
        self.open = []


def _nbytes(h) -> int:
    return sum(p.tensor.nbytes for p in h.handles if hasattr(p, "tensor"))


class ModelLegs:
    """The legs of a sharded model's forward and backward, on the thread that runs its hooks,
    since the last take(): the phases less the copies inside them, the copies' host time and
    the host's waits for them, and the device's time of each from CUDA events (read once done).
    One phase at a time: the hooks of a model run one after another."""

    def __init__(self, cuda: bool = False):
        self.cuda = cuda
        self._phase = None  # (leg, start, copy time so far, CUDA start event)
        self._inner = 0.0  # host time in copies, ever (phases subtract what fell inside them)
        self._reset()

    def _reset(self) -> None:
        self._host = defaultdict(float)  # leg -> host time doing it
        self._wait = defaultdict(float)  # leg -> host time waiting for the device's copy
        self._device = defaultdict(float)  # leg -> device time of the events read
        self._bytes = defaultdict(int)
        self._timed: set = set()  # legs with CUDA events this period
        self._events: list = []  # (leg, start, end) not read yet

    def _event(self, stream=None):
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def begin(self, leg: str) -> None:
        """Forward or backward starts (a phase left open by an error is dropped)."""
        start = self._event() if self.cuda else None
        self._phase = (leg, time.perf_counter(), self._inner, start)

    def end(self, leg: str) -> None:
        if self._phase is None or self._phase[0] != leg:
            return
        _, t0, inner, start = self._phase
        self._phase = None
        self._host[leg] += max(0.0, time.perf_counter() - t0 - (self._inner - inner))
        if start is not None:
            self.device(leg, start, self._event())

    @contextmanager
    def copy(self, leg: str, waiting: bool = False):
        """Host time of a copy ("h2d"/"d2h"): doing it, or (`waiting`) waiting for it."""
        t = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t
            (self._wait if waiting else self._host)[leg] += dt
            self._inner += dt

    def moved(self, leg: str, nbytes: int) -> None:
        self._bytes[leg] += nbytes

    def device(self, leg: str, start, end) -> None:
        """CUDA events around the device's part of `leg` (recorded, not waited for)."""
        self._timed.add(leg)
        self._events.append((leg, start, end))
        if len(self._events) > _MAX_EVENTS:
            self._read_events()

    def _read_events(self) -> None:
        keep = []
        for leg, start, end in self._events:
            if start.query() and end.query():
                self._device[leg] += start.elapsed_time(end) / 1e3
            else:
                keep.append((leg, start, end))
        self._events = keep

    def take(self) -> dict:
        """{leg: {"host_s", "wait_s", "device_s" (None: no CUDA events), "bytes"}} since the
        last take(); events not done yet stay for the next one."""
        self._read_events()
        out = {leg: {"host_s": self._host[leg], "wait_s": self._wait[leg],
                     "device_s": self._device[leg] if leg in self._timed else None,
                     "bytes": self._bytes[leg]}
               for leg in ("forward", "backward", "h2d", "d2h")}
        events = self._events
        self._reset()
        self._events = events
        self._timed = {leg for leg, _, _ in events}
        return out


def record_events(devices) -> list:
    """One timing event per CUDA device in `devices`, recorded on its current stream (the seam
    the CPU tests replace with stand-in events)."""
    events = []
    for device in devices:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return events


class DeviceTime:
    """The device time of work queued on some devices' current streams between start() and
    stop(), handed to a callback once its events are done: poll() reads the ones that are
    (query()), never waiting. Several devices' times add up."""

    MAX_PENDING = 16  # never done: the oldest are given up (their time stays unknown)

    def __init__(self, devices) -> None:
        self.devices = list(devices)
        self._pending: list = []  # (start events, end events, callback)

    def start(self) -> list:
        return record_events(self.devices) if self.devices else []

    def stop(self, starts: list, then) -> None:
        """Ends the span started by start(); `then(seconds)` runs in a later poll()."""
        if not starts:
            return
        self._pending.append((starts, record_events(self.devices), then))
        del self._pending[:-self.MAX_PENDING]

    def poll(self) -> None:
        keep = []
        for starts, ends, then in self._pending:
            if all(e.query() for e in (*starts, *ends)):
                then(sum(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3)
            else:
                keep.append((starts, ends, then))
        self._pending = keep


def device_part_done(stats: dict):
    """The DeviceTime callback of one step's device part: its GPU time into that step's
    `stats` ("device_part_gpu_s") and its "device_adam" leg (device_s, and into total_s)."""

    def then(seconds: float) -> None:
        stats["device_part_gpu_s"] = seconds
        leg = stats.get("legs", {}).get("device_adam")
        if leg is not None:
            leg["device_s"] = seconds
            leg["total_s"] += seconds

    return then


def _overlap(t0: float, t1: float, windows: list) -> float:
    return sum(max(0.0, min(t1, w1) - max(t0, w0)) for w0, w1 in windows)


def _union(intervals) -> float:
    total, end = 0.0, float("-inf")
    for t0, t1 in sorted(intervals):
        if t1 <= end:
            continue
        total += t1 - max(t0, end)
        end = t1
    return total


def empty() -> dict:
    return {leg: {"total_s": 0.0, "exposed_s": 0.0, "threads": {}, "bytes": 0,
                  "device_s": None} for leg in LEGS}


def summarize(clock: Clock, training: str, model: list[dict]) -> dict:
    """last_step_stats["legs"] from an optimizer's Clock (`training`: the name of step()'s
    thread) and the ModelLegs.take() of the sharded models its parameters belong to."""
    legs = empty()
    windows = [(t0, t1) for leg, thread, t0, t1 in clock.segments
               if leg == WAIT and thread == training]
    waits = defaultdict(lambda: [0.0, 0.0])  # copy leg -> [host waits, exposed part]

    def add(leg: str, thread: str, total: float, exposed: float) -> None:
        entry = legs[leg]
        entry["total_s"] += total
        entry["exposed_s"] += exposed
        t = entry["threads"].setdefault(thread, {"total_s": 0.0, "exposed_s": 0.0})
        t["total_s"] += total
        t["exposed_s"] += exposed

    covered = 0.0
    for leg, thread, t0, t1 in clock.segments:
        if leg == WAIT and thread == training:
            continue
        own = thread == training
        name = TRAINING if own else thread
        exposed = (t1 - t0) if own else _overlap(t0, t1, windows)
        covered += 0.0 if own else exposed
        if leg == WAIT:  # a wait on another thread (none today): its own time
            leg = "other"
        if leg in ("h2d", "d2h") and not own:  # the worker waiting for a copy to land
            waits[leg][0] += t1 - t0
            waits[leg][1] += exposed
        add(leg, name, t1 - t0, exposed)
    # What step() waited for while the worker was in no span (between jobs, or the GIL).
    idle = max(0.0, sum(t1 - t0 for t0, t1 in windows) - covered)
    add("other", TRAINING, idle, idle)
    for leg in ("nvme_read", "nvme_write"):
        legs[leg]["total_s"] = _union((t0, t1) for k, t0, t1, _ in clock.io if k == leg)
        legs[leg]["bytes"] = sum(n for k, _, _, n in clock.io if k == leg)
    for got in model:
        for leg in ("forward", "backward"):
            add(leg, TRAINING, got[leg]["host_s"], got[leg]["host_s"])
            _add_device(legs[leg], got[leg]["device_s"])
        for leg in ("h2d", "d2h"):
            add(leg, TRAINING, got[leg]["host_s"] + got[leg]["wait_s"],
                got[leg]["host_s"] + got[leg]["wait_s"])
            waits[leg][0] += got[leg]["wait_s"]
            waits[leg][1] += got[leg]["wait_s"]
            legs[leg]["bytes"] += got[leg]["bytes"]
            _add_device(legs[leg], got[leg]["device_s"])
    for leg in ("h2d", "d2h"):
        device = legs[leg]["device_s"]
        if device is None:
            continue
        # The device's time replaces the host's waits for it; a wait beyond it was for the
        # compute queued before the copy.
        host, exposed_wait = waits[leg]
        entry = legs[leg]
        entry["total_s"] += device - host
        beyond = max(0.0, exposed_wait - device)
        entry["exposed_s"] -= beyond
        for key in ("total_s", "exposed_s"):
            legs["backward"][key] += beyond
    for entry in legs.values():
        entry["total_s"] = max(0.0, entry["total_s"])
        entry["exposed_s"] = min(max(0.0, entry["exposed_s"]), entry["total_s"])
    return legs


def _add_device(entry: dict, device_s) -> None:
    if device_s is not None:
        entry["device_s"] = (entry["device_s"] or 0.0) + device_s
