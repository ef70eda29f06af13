"""tierlift.activations.offload: a context manager around forward, like
torch.autograd.graph.save_on_cpu, that moves saved activations to pinned RAM and NVMe.

    with tierlift.activations.offload(cpu_budget=8 << 30, nvme_path="/nvme"):
        loss = model(x, y)
    loss.backward()
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch
from torch import nn

from tierlift.activations.config import OffloadConfig
from tierlift.activations.host_pool import HostPool
from tierlift.activations.kept import KeptBudget
from tierlift.activations.session import Session


class Engines:
    """The io engine, created on first NVMe use and shared by every forward of one offload."""

    def __init__(self, config: OffloadConfig):
        self._config = config
        self._engine = None
        self._lock = threading.Lock()  # forwards in two threads: one engine, not two

    def get(self):
        with self._lock:
            return self._get()

    def _get(self):
        if self._engine is None:
            from tierlift.io import EngineConfig, IoEngine

            block = 1 << 20
            # Read-ahead buffers come from the engine's pool (aligned: read in place); the
            # rest of the pool stages writes from unaligned tensors.
            pool = -(-self._config.io_bytes // block) * block + 4 * block
            self._engine = IoEngine(EngineConfig(queue_depth=32, block_size=block,
                                                 pool_bytes=pool))
        return self._engine

    def close(self) -> None:
        with self._lock:
            if self._engine is not None:
                self._engine.close()
                self._engine = None


def parameter_pointers(params: nn.Module | Iterable[torch.Tensor] | None) -> frozenset[int]:
    if params is None:
        return frozenset()
    if isinstance(params, nn.Module):
        params = params.parameters()
    return frozenset(p.untyped_storage().data_ptr() for p in params)


class offload:  # noqa: N801 - used like torch.autograd.graph.save_on_cpu
    """Saved tensors of the forward run inside this context that are at least `min_bytes` go to
    pinned RAM (up to `cpu_budget` bytes) and then, with `nvme_path`, to NVMe; backward brings
    them back, reading ahead in reverse order, bit for bit. Parameters and their views are never
    copied (pass `params=model` to also recognize them when they are not leaves that require
    grad, e.g. frozen weights). See OffloadConfig for every argument.

    A budget that cannot hold what the forward saves raises BudgetError when the forward ends,
    naming the smallest budget that works; an I/O error raises OSError. Either way the forward
    is abandoned: its activation file is gone and backward on it raises."""

    def __init__(self, cpu_budget: int, nvme_path=None, *, io_bytes: int = 64 << 20,
                 gpu_budget: int = 0, min_bytes: int = 1 << 20, params=None):
        self.config = OffloadConfig(cpu_budget=cpu_budget, nvme_path=nvme_path,
                                    io_bytes=io_bytes, gpu_budget=gpu_budget,
                                    min_bytes=min_bytes)
        self._engines = Engines(self.config)
        self._param_ptrs = parameter_pointers(params)
        self._host_pool = HostPool(self.config.cpu_budget)
        # One gpu_budget for all of this offload's forwards alive at once, not one each.
        self._kept = KeptBudget(self.config.gpu_budget)
        # Per thread, as torch's saved-tensor hooks are: a forward in a background thread
        # gets a session of its own instead of ending the main thread's.
        self._local = threading.local()
        self.last_stats: dict = {}

    def session(self) -> Session:
        """A new forward's state (offload_blocks drives sessions itself)."""
        s = Session(self.config, self._engines, self._param_ptrs, self._host_pool, self._kept)
        self.last_stats = s.stats  # the same dict: backward's read waits land in it too
        return s

    def __enter__(self) -> offload:
        if getattr(self._local, "active", None) is not None:
            raise RuntimeError("this tierlift.activations.offload is already in use in this "
                               "thread (not re-entrant); make one per nesting level")
        session = self.session()
        hooks = torch.autograd.graph.saved_tensors_hooks(session.pack, session.unpack)
        hooks.__enter__()
        self._local.active = (session, hooks)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        session, hooks = self._local.active
        self._local.active = None
        hooks.__exit__(exc_type, exc, tb)
        if exc is not None:
            session.abandon(exc)
            return
        session.finish()

    def trim(self) -> None:
        """Frees the RAM tier's idle buffers (kept for reuse by the next forward)."""
        self._host_pool.clear()

    def close(self) -> None:
        """Closes the io engine (activations of forwards not yet backpropagated are lost) and
        frees the RAM tier's idle buffers."""
        self._engines.close()
        self._host_pool.clear()
