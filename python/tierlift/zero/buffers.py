"""Module buffers (BatchNorm's running statistics and num_batches_tracked, anything
register_buffer holds) kept the same on every rank, as DDP keeps them with its default
broadcast_buffers=True.

shard() shards parameters only: each rank's buffers are its own, and a training-mode forward
updates BatchNorm's statistics from that rank's slice of the batch, so without this every rank
would drift to a different model (different eval outputs, a checkpoint holding rank 0's only).
DDP's rule, mirrored exactly (torch/nn/parallel/distributed.py: _check_sync_bufs_pre_fwd,
_sync_buffers): before a forward of the wrapped model, rank 0's buffers are broadcast over the
model's process group if the model has buffers and the previous forward ran with grad enabled
outside no_sync() (or there was none yet). So a forward under torch.no_grad() right after
training syncs (evaluation sees rank 0's statistics), the ones after it do not, and neither does
the first forward after a no_sync() block. `module.training` plays no part, as in DDP.

The buffers are packed into one byte buffer per device and sent in one broadcast (over the
model's `world` Comm: every rank of the model, hierarchical sharding's replicas included).
"""

from __future__ import annotations

import torch
from torch import nn


class BufferSync:
    """One per sharded model: when to broadcast its buffers, and the broadcast itself."""

    def __init__(self, comm, enabled: bool):
        self.comm = comm
        self.enabled = enabled
        self.pending = True  # DDP's require_forward_param_sync

    def before_forward(self, root: nn.Module) -> None:
        if self.enabled and self.pending:
            self.sync(root)

    def after_forward(self, synced: bool) -> None:
        """`synced`: the forward ran outside no_sync()."""
        self.pending = torch.is_grad_enabled() and synced

    def sync(self, root: nn.Module) -> None:
        """Rank 0's buffers onto every rank (a collective; nothing sent without buffers, nor
        where the model's ranks are this one alone)."""
        if self.enabled and self.comm.world > 1:
            broadcast_(self.comm, [b for b in root.buffers() if b.numel() and not b.is_meta])


@torch.no_grad()
def broadcast_(comm, tensors: list[torch.Tensor], src: int = 0) -> None:
    """Group rank `src`'s `tensors` into every rank's, in place, one broadcast per device.
    Every rank must pass tensors of the same dtypes and shapes in the same order."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for device, ts in by_device.items():
        # Widest elements first: every offset in the byte buffer is then a multiple of its
        # tensor's element size, as a view to that dtype needs.
        ts.sort(key=lambda t: -t.element_size())
        sizes = [t.numel() * t.element_size() for t in ts]
        if comm.rank == src:
            flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in ts])
        else:
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        comm.wait(comm.broadcast(flat, src))
        if comm.rank != src:
            pieces = [p.view(t.dtype).view(t.shape)
                      for p, t in zip(flat.split(sizes), ts, strict=True)]
            # As DDP: the copy does not bump the version counters (a buffer saved for a
            # backward still to run is not reported as modified).
            with torch.autograd._unsafe_preserve_version_counter(tuple(ts)):
                torch._foreach_copy_(ts, pieces)
