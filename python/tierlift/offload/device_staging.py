"""Device staging: the overlapped step's new device weights, uploaded during backward.

A chunk stepped ahead (overlap.py) must not touch the parameters, so without this its new
weights reach them in step(): the fp32 masters are rounded on the host and uploaded, all after
backward, with the next forward's kernels queued behind the uploads. With device staging the
worker's speculative step writes the rounded weights into the slot's host "copy" buffer in the
kernel's own pass and uploads them, on a side stream, into a device shadow buffer (one per param
group: every chunk's device-parameter segments, each viewed in its parameter's dtype). PCIe's
host-to-device direction is idle during backward. step() then publishes a kept chunk by a
device-to-device copy shadow -> parameter on the current stream; a chunk stepped again (its
inputs changed) or stepped in step() is published from the host as before.

The shadow costs one copy of the device weights (2 B/param for a bf16 model).
OffloadConfig.device_staging: None turns it on, after the first step(), for a group with CUDA
parameters on one device where torch.cuda.mem_get_info() still shows twice the shadows' bytes
free (what that step's forward and backward left over); True turns it on from the start where
the shadows fit and refuses at construction otherwise; False keeps it off.

`stageable`, `free_bytes`, `side_stream`, `current_stream`, `on_stream`, `copy_on` and
`record_event` are the seams the CPU tests replace with stand-ins
(tests/python/test_offload_device_staging.py).
"""

from __future__ import annotations

import torch

from tierlift.offload import d2h

# bytes between segments' starts: every dtype's view and a copy's best alignment
SEGMENT_ALIGN = 256


def segment_bytes(nbytes: int) -> int:
    """The shadow bytes a segment of `nbytes` takes, up to the next segment's start."""
    return -(-nbytes // SEGMENT_ALIGN) * SEGMENT_ALIGN


def stageable(p: torch.Tensor) -> bool:
    """Whether `p` is on a device with streams to upload into (CUDA)."""
    return p.device.type == "cuda"


def free_bytes(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0]


def side_stream(device: torch.device):
    return torch.cuda.Stream(device)


def current_stream(device: torch.device):
    return torch.cuda.current_stream(device)


def on_stream(stream):
    """A context in which copies issued (and upload events recorded) go to `stream`."""
    return torch.cuda.stream(stream)


def copy_on(stream, pairs: list) -> None:
    """dst.copy_(src, non_blocking=True) for each (dst, src) device pair, on `stream`."""
    with on_stream(stream):
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)


def record_event(stream):
    event = torch.cuda.Event()
    event.record(stream)
    return event


class Shadow:
    """One param group's device shadow: {(ci, pi): byte offset} of each device segment."""

    def __init__(self, device: torch.device, offsets: dict, dtypes: dict, nbytes: int):
        self.device = device
        self.offsets = offsets
        self.dtypes = dtypes  # pi -> the parameter's dtype when the shadow was laid out
        self.nbytes = nbytes
        self.buffer = None  # allocated once every group's shadow is known to fit
        self.copied = None  # event after the last D2D copies out of it (current stream)

    def segment(self, ci: int, s, p: torch.Tensor) -> torch.Tensor:
        """Segment `s` of chunk `ci` of parameter `p`, in p's dtype."""
        at = self.offsets[(ci, s.pi)]
        return self.buffer[at:at + (s.phi - s.plo) * p.element_size()].view(p.dtype)


def _plan(off, gi: int) -> Shadow | str | None:
    """The shadow of group gi; None where it has no device parameter; a reason where it has
    some that cannot be staged."""
    params = off.opt.param_groups[gi]["params"]
    device_params = [p for pi, p in enumerate(params)  # the tiers' (not the device part's)
                     if off.layouts[gi].reserved[pi] and d2h.on_device(p)]
    if not device_params:
        return None
    if not all(stageable(p) for p in device_params):
        return "device parameters not on CUDA"
    devices = {p.device for p in device_params}
    if len(devices) > 1:
        return f"device parameters on {len(devices)} devices (one shadow per group)"
    if not all(off._uses_master(p) for p in device_params):
        return "device parameters that are their own master"
    offsets, dtypes, at = {}, {}, 0
    for chunk in off.layouts[gi].chunks:
        for s in chunk.segments:
            p = params[s.pi]
            if d2h.on_device(p):
                offsets[(chunk.ci, s.pi)] = at
                dtypes[s.pi] = p.dtype
                at += segment_bytes((s.phi - s.plo) * p.element_size())
    return Shadow(next(iter(devices)), offsets, dtypes, at)


class DeviceStaging:
    """The shadows of an Offloader's param groups and a side stream per device."""

    def __init__(self, shadows: list, allocate: bool = True):
        self.shadows = shadows  # per group: Shadow or None
        self._sides: dict = {}
        # device_staging=None decides after the first step() (settle): only then does the
        # device's free memory say what the model's forward and backward leave over.
        self.pending = not allocate
        if allocate:
            self._allocate()

    def _allocate(self) -> None:
        for shadow in self.shadows:
            if shadow is not None:
                shadow.buffer = torch.empty(shadow.nbytes, dtype=torch.uint8,
                                            device=shadow.device)
                if shadow.device not in self._sides:
                    self._sides[shadow.device] = side_stream(shadow.device)
        # torch's allocator gave each shadow a block of the current stream, whose kernels
        # queued before may still use that memory; the side stream writes it first.
        for device, side in self._sides.items():
            side.wait_stream(current_stream(device))

    def _need(self) -> dict:
        need: dict = {}
        for shadow in self.shadows:
            if shadow is not None:
                need[shadow.device] = need.get(shadow.device, 0) + shadow.nbytes
        return need

    def settle(self) -> None:
        """device_staging=None, once, after the first step(): the shadows are made where every
        device still has twice their bytes free beside what torch's allocator kept from that
        step's peak (its forward's activations included); else none is, and the weights are
        published from the host. A model that fit without them is never pushed out of memory."""
        if not self.pending:
            return
        self.pending = False
        if all(free_bytes(device) >= 2 * n for device, n in self._need().items()):
            self._allocate()
        else:
            self.shadows = [None] * len(self.shadows)

    @classmethod
    def build(cls, off) -> DeviceStaging | None:
        """Per OffloadConfig.device_staging (module docstring); refuses before allocating."""
        mode = off.config.device_staging
        if mode is False or not off.config.overlap:
            return None
        plans = [_plan(off, gi) for gi in range(len(off.opt.param_groups))]
        why = [f"param_groups[{gi}]: {p}" for gi, p in enumerate(plans) if isinstance(p, str)]
        shadows = [p if isinstance(p, Shadow) else None for p in plans]
        if mode is True and why:
            raise ValueError(f"device_staging=True cannot stage {'; '.join(why)}; use "
                             "device_staging=None (staged where it can be) or False")
        if not any(shadows):
            if mode is True:
                raise ValueError("device_staging=True needs CUDA parameters (it stages their "
                                 "new weights in device memory); none of the optimizer's are")
            return None
        staging = cls(shadows, allocate=False)
        if mode is None:
            return staging  # decided by settle(), after the first step
        for device, nbytes in staging._need().items():
            free = free_bytes(device)
            if free < nbytes:
                raise ValueError(
                    f"device_staging=True needs {nbytes} bytes of device memory on {device} for "
                    f"the shadow of the new weights, {free} are free; free memory or use "
                    "device_staging=False (the weights are then uploaded in step())")
        staging.pending = False
        staging._allocate()
        return staging

    def covers(self, gi: int, chunk, grads: dict, params: list) -> bool:
        """Whether every segment of `chunk` with a gradient is a device segment of the shadow,
        still of the device and dtype it was laid out for."""
        shadow = self.shadows[gi]
        if shadow is None or shadow.buffer is None:
            return False
        segs = [s for s in chunk.segments if s.pi in grads]
        return bool(segs) and all(
            (chunk.ci, s.pi) in shadow.offsets and d2h.on_device(params[s.pi])
            and params[s.pi].device == shadow.device
            and params[s.pi].dtype == shadow.dtypes[s.pi] for s in segs)

    def segment(self, gi: int, ci: int, s, p: torch.Tensor) -> torch.Tensor:
        return self.shadows[gi].segment(ci, s, p)

    def upload(self, gi: int, pairs: list, buffer: torch.Tensor, uploads) -> None:
        """The worker's uploads (shadow segment, host staging in `buffer`) on the side stream.
        The worker never waits on the current stream (backward's kernels are queued there)."""
        shadow = self.shadows[gi]
        side = self._sides[shadow.device]
        if shadow.copied is not None:
            # Not before the last step's D2D copies out of the shadow are done: they read the
            # bytes this upload overwrites.
            side.wait_event(shadow.copied)
        with on_stream(side):
            # The uploader records its event on the side stream: a host rewrite of `buffer`
            # (uploads.reserve) waits for this upload, not for the current stream.
            uploads.upload(pairs, buffer)

    def copy_out(self, gi: int, pairs: list) -> None:
        """step(): (parameter segment, shadow segment) D2D copies on the current stream."""
        shadow = self.shadows[gi]
        current = current_stream(shadow.device)
        # After every upload into the shadow (finish() has joined the worker: all are issued).
        current.wait_stream(self._sides[shadow.device])
        copy_on(current, pairs)
        # The next step's uploads into the shadow wait for this (upload()).
        shadow.copied = record_event(current)

    def close(self) -> None:
        """Waits for whatever still reads or writes the shadows (the uploads: Uploader.drain
        first), then lets them go."""
        for shadow in self.shadows:
            if shadow is not None and shadow.copied is not None:
                shadow.copied.synchronize()
        for side in self._sides.values():
            side.synchronize()
        for shadow in self.shadows:
            if shadow is not None:
                shadow.buffer = None
                shadow.copied = None


__all__ = ["DeviceStaging", "Shadow"]
