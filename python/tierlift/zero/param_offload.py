"""Parameter offload for ZeRO stage 3 (shard(..., offload_params="cpu")): the fp32 master shard
of every unit lives in host memory (pinned when CUDA is available), so the device only holds
the units gathered at the moment.

storage   "cpu": every unit's shard is a view of one host arena (registered with CUDA, i.e.
          page-locked, when CUDA is available): one allocation, not one pinned block per unit,
          which torch's caching host allocator would round up to a power of two each. Shards
          of frozen parameters in another dtype (a bf16 base) get one arena per dtype.
gather    shard (host fp32) -> compute dtype into a pinned staging buffer -> async H2D on a
          dedicated copy stream -> the all-gather is issued on that same stream, and the
          compute stream waits on an event recorded after it. Staging buffers come from torch's
          caching host allocator, which does not hand a block out again before the copy that
          read it has finished, so the host never waits here and prefetches can run ahead.
backward  the reduce-scatter output (device) -> async D2H into a pinned host buffer on the copy
          stream, with an event; nothing reads the gradient before the event: hooks.py hands
          it over once the event is done, or at once, with the event, to listeners that wait
          for it themselves (the offloaded optimizer's worker).
legs      `legs` (offload.legs.ModelLegs, the ZeroState's): the host time of each copy and, on
          CUDA, timed events around it on the copy stream, read once done (no wait here).
On a CPU-only machine the same code runs and every copy is a plain, synchronous copy, so the
results are bit-identical to offload_params="none".
With offload_params="nvme" a `store` (NvmeParamStore, param_nvme.py) holds the shards in a
mapped file instead of RAM, and a gather copies from what store.fetch() returns (the shard read
ahead with O_DIRECT); everything else here is the same.
"""

from __future__ import annotations

import contextlib

import torch

from tierlift._pinned import register
from tierlift.offload.legs import ModelLegs


class ParamOffload:
    def __init__(self, *, device: torch.device, compute_dtype: torch.dtype,
                 shard_numels: list[int], stats: dict, store=None,
                 dtypes: list[torch.dtype] | None = None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin = torch.cuda.is_available()
        self.compute_dtype = compute_dtype
        self.store = store  # NvmeParamStore with offload_params="nvme"
        self.stats = stats
        self.arena = None  # the fp32 one
        self.arenas: dict[torch.dtype, torch.Tensor] = {}
        self._registrations = []
        self._next: dict[torch.dtype, int] = {}  # arena offset of the next unit's shard
        if store is None:
            dtypes = dtypes or [torch.float32] * len(shard_numels)
            totals = {torch.float32: 0}
            for n, dt in zip(shard_numels, dtypes, strict=True):
                totals[dt] = totals.get(dt, 0) + n
            for dt, total in totals.items():
                arena = torch.empty(total, dtype=dt)
                self.arenas[dt], self._next[dt] = arena, 0
                if self.pin and arena.numel():
                    register(arena, self._registrations,
                             owner="tierlift.zero.shard(offload_params=\"cpu\")")
            self.arena = self.arenas[torch.float32]
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        # Host time and (on CUDA) device time of the copies; the ZeroState puts its own here.
        self.legs = ModelLegs(cuda=self.cuda)

    def host_shard(self, shard: torch.Tensor) -> torch.Tensor:
        """A host copy of a freshly built shard (pinned when CUDA is available; a view of the
        mapped file with a store)."""
        if self.store is not None:
            return self.store.alloc(shard)
        n, at = shard.numel(), self._next[shard.dtype]
        out = self.arenas[shard.dtype][at:at + n].view(shard.shape)
        self._next[shard.dtype] = at + n
        out.copy_(shard)
        return out

    # ---- gather: host shard -> device --------------------------------------------------------
    def stage_in(self, shard: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The shard in `dtype` (default: the compute dtype) on the device. With CUDA the copy
        is in flight on the copy stream: issue the collective inside `stream_context()`, then
        call `after()`."""
        with self.legs.copy("h2d"):
            n = shard.numel()
            staging = torch.empty(n, dtype=dtype or self.compute_dtype, pin_memory=self.pin)
            src = shard.detach() if self.store is None else self.store.fetch(shard.detach())
            staging.copy_(src)  # fp32 -> compute dtype on the host
            if self.store is not None:
                self.store.staged(shard)  # read: drop it from this process, read ahead the next
            dst = torch.empty(n, dtype=staging.dtype, device=self.device)
            self.stats["h2d_bytes"] += staging.nbytes
            self.legs.moved("h2d", staging.nbytes)
            if not self.cuda:
                dst.copy_(staging)
                return dst
            cur = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(cur)  # dst (allocated on cur) is ready to be written
            with torch.cuda.stream(self.stream):
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(staging, non_blocking=True)  # records the event that guards `staging`
                end = torch.cuda.Event(enable_timing=True)
                end.record()
            self.legs.device("h2d", start, end)  # read once done: no wait here
            dst.record_stream(self.stream)
            return dst

    def stream_context(self):
        """Where the all-gather of a staged shard is issued (the copy stream with CUDA)."""
        if not self.cuda:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def after(self):
        """An event on the copy stream after the collective was issued (None without CUDA)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event) -> None:
        """Makes the current (compute) stream wait for a gather issued on the copy stream."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    # ---- backward: device gradient shard -> host ---------------------------------------------
    def stage_out(self, grad: torch.Tensor):
        """(host tensor, event): the gradient shard copied to host memory; the host tensor may
        be read once the event is done (event None: already done)."""
        with self.legs.copy("d2h"):
            host = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=self.pin)
            self.stats["d2h_bytes"] += host.nbytes
            self.legs.moved("d2h", host.nbytes)
            if grad.device.type != "cuda":
                host.copy_(grad)
                return host, None
            cur = torch.cuda.current_stream(grad.device)
            self.stream.wait_stream(cur)  # the reduce-scatter result is complete
            with torch.cuda.stream(self.stream):
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
                host.copy_(grad, non_blocking=True)
                event = torch.cuda.Event(enable_timing=True)  # timed: the D2H leg's device time
                event.record(self.stream)
            self.legs.device("d2h", start, event)
            grad.record_stream(self.stream)
            return host, event
