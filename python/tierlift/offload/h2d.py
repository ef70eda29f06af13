"""The copies of a step's new weights to the device: each chunk's weights, rounded to the
parameters' dtype into a pipeline slot's host "copy" buffer, go to the device parameters
without the host waiting for them.

They are issued with non_blocking=True on the current stream, the stream of the step and of
the user's next forward: stream order alone puts them after whatever reads or writes the
parameters before them and before the next forward reads them, so no other stream has to wait
for them. What stays to guard is the host buffer they read: one event per upload batch, kept
under that buffer, and `reserve(buffer)` waits for that upload only, right before the host
rewrites the buffer (the next chunk stepped in that slot, or a fingerprint's scratch).
`drain()` waits for every upload: before the buffers' memory goes away (close), or before the
parameters are read on another thread's stream. torch.cuda.synchronize() after each chunk
waited for every kernel queued so far and kept the next chunk's Adam from overlapping the copy.

On a host without CUDA tensors nothing here waits. `upload_events` is the seam the CPU tests
replace with stand-in events (tests/python/test_offload_h2d.py); whether a tensor is on a
device is d2h.on_device."""

from __future__ import annotations

import threading

import torch


def upload_events(pairs: list) -> list:
    """One event per CUDA device among the destinations of the (dst, src) copies `pairs` just
    issued, recorded on that device's current stream: done once the copies are."""
    events = []
    for device in {dst.device for dst, _ in pairs if dst.device.type == "cuda"}:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return events


class Uploader:
    """Host-to-device copies of staging buffers, each buffer's last upload waited for only when
    the host is about to rewrite it."""

    def __init__(self):
        self._pending: dict = {}  # buffer address -> events of the last upload that read it
        self._lock = threading.Lock()  # the overlap's worker reserves scratch too

    @staticmethod
    def _key(buffer: torch.Tensor) -> int:
        return buffer.data_ptr()

    def upload(self, pairs: list, buffer: torch.Tensor) -> None:
        """Issues dst.copy_(src, non_blocking=True) for each (device dst, host src), every src
        inside `buffer`; the host must not write `buffer` again before reserve(buffer)."""
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        events = upload_events(pairs)
        with self._lock:
            self._pending.setdefault(self._key(buffer), []).extend(events)

    def reserve(self, buffer: torch.Tensor) -> None:
        """Waits until the last upload that read `buffer` is done: the host may rewrite it."""
        with self._lock:
            events = self._pending.pop(self._key(buffer), [])
        for event in events:
            event.synchronize()

    def drain(self) -> None:
        """Waits until every upload issued so far is done."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for events in pending.values():
            for event in events:
                event.synchronize()


__all__ = ["Uploader", "upload_events"]
