"""Moving one saved tensor's bytes between its device and host memory, and back in its own
layout. On a GPU the copies run on side streams and return an event, so the compute stream
only waits where it uses the data; on the CPU they are plain copies and the events are None.

A saved tensor comes back with its dtype, shape and strides, not a contiguous copy: kernels pick
different code paths by layout (a transposed matmul operand rounds differently), and the
gradients must be bit-identical to a run without offload.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    device: torch.device
    contiguous: bool
    nbytes: int

    @classmethod
    def of(cls, t: torch.Tensor) -> Layout:
        return cls(t.dtype, tuple(t.shape), tuple(t.stride()), t.device, t.is_contiguous(),
                   t.numel() * t.element_size())


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements in row-major order as one uint8 vector (a view when contiguous)."""
    return (t if t.is_contiguous() else t.contiguous()).view(-1).view(torch.uint8)


def restore(buf: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The tensor of `layout` from its row-major bytes `buf` (same device as `buf`)."""
    values = buf[:layout.nbytes].view(layout.dtype)
    if layout.contiguous:
        return values.as_strided(layout.shape, layout.stride)
    out = torch.empty_strided(layout.shape, layout.stride, dtype=layout.dtype, device=buf.device)
    return out.copy_(values.view(layout.shape))


class CpuCopier:
    """Host tensors: the copies are synchronous memcpys."""

    pin = False

    def to_host(self, t: torch.Tensor, host: torch.Tensor) -> None:
        host[:t.numel() * t.element_size()].copy_(flat_bytes(t))
        return None

    def to_device(self, host: torch.Tensor, layout: Layout):
        return host, None

    def consume(self, dev: torch.Tensor, event) -> None:
        pass

    def done(self, event) -> bool:
        return True

    def wait(self, event) -> None:
        pass


class CudaCopier:
    """D2H on one side stream, H2D on another; each copy's event says when its bytes are there.
    The allocator is told which streams use which memory (record_stream), so a tensor freed by
    the compute stream is not reused while a side stream still reads or writes it."""

    pin = True

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def to_host(self, t: torch.Tensor, host: torch.Tensor):
        compute = torch.cuda.current_stream(self.device)
        flat = flat_bytes(t)  # on the compute stream, which produced t
        self.d2h.wait_stream(compute)
        with torch.cuda.stream(self.d2h):
            host[:flat.numel()].copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.d2h)
        flat.record_stream(self.d2h)
        return event

    def to_device(self, host: torch.Tensor, layout: Layout):
        with torch.cuda.stream(self.h2d):
            dev = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
            dev.copy_(host[:layout.nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.h2d)
        return dev, event

    def consume(self, dev: torch.Tensor, event) -> None:
        """Makes the compute stream wait for `dev`'s copy, and keeps `dev`'s memory from the
        side stream until the compute stream is done with it."""
        compute = torch.cuda.current_stream(self.device)
        if event is not None:
            compute.wait_event(event)
        dev.record_stream(compute)

    def done(self, event) -> bool:
        return event is None or event.query()

    def wait(self, event) -> None:
        if event is not None:
            event.synchronize()


def copier_for(device: torch.device):
    return CudaCopier(device) if device.type == "cuda" else CpuCopier()
