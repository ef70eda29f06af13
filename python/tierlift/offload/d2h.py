"""The copies a chunk's CPU step makes from the device: its gradients, and fp32 device weights
that are their own master, into the chunk's host staging slot.

Each goes on a copy stream of its own (one per device), which first waits for an event recorded
on the stream that produced the gradients: where the overlap's hook saw them ready
(post-accumulate-grad hooks run on that stream), or, in step(), on the current stream, after
whatever the user queued since. The step then waits for its own copies' event only, never for
the compute queued after the gradients (the next units' backward): torch.cuda.synchronize()
did, so the overlap's worker waited for backward to drain before each chunk.

On a host without CUDA tensors nothing here runs. `on_device`, `ready_events` and `Copier` are
the seams the CPU tests replace with stand-ins (tests/python/test_offload_d2h.py)."""

from __future__ import annotations

import torch


def on_device(t: torch.Tensor) -> bool:
    """Whether `t` is on a device (its bytes reach the host by a D2H copy)."""
    return t.device.type != "cpu"


def ready_events(tensors) -> list:
    """One event per device among `tensors`, recorded on that device's current stream: done once
    the work queued there so far (the tensors' production) is."""
    events = []
    for device in {t.device for t in tensors if on_device(t)}:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return events


class Copier:
    """D2H copies on a copy stream per device, each batch after the events it is given."""

    def __init__(self):
        self._streams: dict = {}

    def _stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def copy(self, pairs: list, ready: list | None) -> list:
        """Issues dst.copy_(src) for each (host dst, device src) after `ready` (events of the
        sources' production; None: recorded now, on the current streams). Returns one event per
        device, done when its copies are. The sources stay referenced by the caller until it has
        waited for them, so their memory cannot be reused by their stream meanwhile."""
        if ready is None:
            ready = ready_events([src for _, src in pairs])
        done = []
        by_device: dict = {}
        for dst, src in pairs:
            by_device.setdefault(src.device, []).append((dst, src))
        for device, group in by_device.items():
            stream = self._stream(device)
            for event in ready:
                stream.wait_event(event)
            with torch.cuda.stream(stream):
                for dst, src in group:
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            done.append(event)
        return done


__all__ = ["Copier", "on_device", "ready_events"]
