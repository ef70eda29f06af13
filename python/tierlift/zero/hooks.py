"""The module and autograd hooks that run ZeRO: when each unit is gathered, when its gradient is
reduced, when it is freed. One ZeroState per sharded model (model._tierlift_zero).

forward   pre-hook of unit i: wait for / issue its all-gather, prefetch the next units in the
          recorded forward order, point the module's attributes at fresh views of `full`;
          post-hook (stage 3): free `full`, hook the outputs so that backward regathers.
backward  output-gradient hook (stage 3): all-gather unit i again, prefetch the unit before it;
          post-accumulate-grad hook on `full`: launch the (async) reduce-scatter (stage 2/3) or
          all-reduce (stage 1) of the unit's gradient, free `full` (stage 3);
          end-of-backward callback: wait for the reductions, add each rank's slice to
          shard.grad, free anything still gathered.
optimizer a global step post-hook marks the units whose shards it stepped as stale, so stage
          1/2 re-gather the updated weights before the next forward.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_flatten

from tierlift.zero.config import ShardConfig
from tierlift.zero.unit import FlatUnit


class ZeroState:
    def __init__(self, *, config: ShardConfig, comm, root, units: list[FlatUnit],
                 heartbeat=None, key_order: dict[str, int] | None = None):
        self.config = config
        self._root = weakref.ref(root)  # the model owns its state, never the reverse
        self.key_order = key_order or {}
        self.comm = comm
        self.units = units
        self.heartbeat = heartbeat
        self.order: list[FlatUnit] = []  # forward order, recorded on the first forward
        self.order_done = False
        self.syncing = True              # False inside no_sync()
        self.callback_queued = False
        self.reductions: list = []       # (unit, work, buffer) in flight this backward
        self.hooked: set[int] = set()    # ids of units that got gradients this backward
        self.handles: list = []
        self._shard_ids = {id(u.shard) for u in units}
        self._install()

    @property
    def root(self):
        return self._root()

    # ---- setup ----
    def _install(self) -> None:
        ref = weakref.ref(self)
        # Registered first, so it runs before the root unit's own pre-hook.
        self.handles.append(self.root.register_forward_pre_hook(_bind(ref, "_root_pre_forward")))
        self.handles.append(self.root.register_forward_hook(_bind(ref, "_root_post_forward")))
        for i, unit in enumerate(self.units):
            self.handles.append(unit.module.register_forward_pre_hook(
                _bind(ref, "_pre_forward", i)))
            self.handles.append(unit.module.register_forward_hook(
                _bind(ref, "_post_forward", i)))
            self.handles.append(unit.full.register_post_accumulate_grad_hook(
                _bind(ref, "_on_grad", i)))
        opt_hook = register_optimizer_step_post_hook(_bind(ref, "_after_optimizer_step"))
        self.handles.append(opt_hook)
        weakref.finalize(self, opt_hook.remove)  # the global hook goes with the model

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # ---- forward ----
    def _root_pre_forward(self, module, args):
        if self.callback_queued and not _in_backward():
            # A backward raised before its end-of-backward callback ran: start clean.
            self.reductions.clear()
            self.hooked.clear()
            self.callback_queued = False
        if self.heartbeat is not None:
            self.heartbeat.beat()

    def _root_post_forward(self, module, args, output):
        self.order_done = True
        return output

    def _pre_forward(self, unit: FlatUnit, module, args):
        if not self.order_done and unit not in self.order:
            self.order.append(unit)
        unit.full_grad = None
        unit.gather()
        unit.wait_gather()
        self._prefetch(unit, +1)
        unit.install_views()

    def _post_forward(self, unit: FlatUnit, module, args, output):
        if self.config.stage != 3 or _in_backward():
            # Stage 1/2 keep their weights; and a forward run inside backward (activation
            # checkpointing recomputing the unit) must not free what its backward is about to use.
            return output
        if torch.is_grad_enabled():
            ref = weakref.ref(self)
            tensors = [t for t in tree_flatten(output)[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            for t in tensors:
                t.register_hook(_bind(ref, "_pre_backward", self.units.index(unit)))
        if self.config.reshard_after_forward or not torch.is_grad_enabled():
            unit.free()
        return output

    def _prefetch(self, unit: FlatUnit, direction: int) -> None:
        if self.config.prefetch == 0 or unit not in self.order:
            return
        i = self.order.index(unit)
        for k in range(1, self.config.prefetch + 1):
            j = i + direction * k
            if 0 <= j < len(self.order) and self.order[j].module is not self.root:
                self.order[j].gather(async_op=True)

    # ---- backward ----
    def _queue_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _pre_backward(self, unit: FlatUnit, grad):
        self._queue_callback()
        if id(unit) not in self.hooked:
            unit.gather()
            unit.wait_gather()
            self._prefetch(unit, -1)
        return None

    def _on_grad(self, unit: FlatUnit, full: torch.Tensor) -> None:
        self._queue_callback()
        self.hooked.add(id(unit))
        if self.config.stage == 3:
            unit.free()
        if not self.syncing:
            return  # accumulate locally: full.grad keeps summing until a synced backward
        grad = full.grad
        full.grad = None
        rdt = self.config.reduce_dtype or grad.dtype
        world = self.comm.world
        buf = grad.to(rdt)
        if rdt == torch.float16:
            buf.div_(world)  # fp16 would overflow summing before dividing
        if self.config.stage == 1:
            work = self.comm.all_reduce(buf, async_op=True)
        else:
            out = torch.empty(unit.shard_numel, dtype=rdt, device=buf.device)
            work = self.comm.reduce_scatter(out, buf, async_op=True)
            buf = (out, buf)  # keep the input alive until the collective is done
        self.reductions.append((unit, work, buf))

    def _finish_backward(self) -> None:
        world = self.comm.world
        for unit, work, buf in self.reductions:
            self.comm.wait(work)
            reduced = buf if self.config.stage == 1 else buf[0]
            if reduced.dtype != torch.float16:
                reduced.div_(world)  # fp16 was divided before the sum
            if self.config.stage == 1:
                unit.full_grad = reduced  # stage 1 keeps the averaged full gradient
                lo = self.comm.rank * unit.shard_numel
                piece = reduced[lo:lo + unit.shard_numel].to(torch.float32, copy=True)
            else:
                piece = reduced.to(torch.float32)
            if unit.shard.grad is None:
                unit.shard.grad = piece
            else:
                unit.shard.grad.add_(piece)
        self.reductions.clear()
        self.hooked.clear()
        self.callback_queued = False
        if self.config.stage == 3:
            for unit in self.units:
                unit.free()

    # ---- optimizer ----
    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if ids & self._shard_ids:
            for unit in self.units:
                if id(unit.shard) in ids:
                    unit.stale = True


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _bind(ref, method: str, unit_index: int | None = None):
    """A hook that calls ref().method([unit,] *args) and does nothing once the state is gone.

    Hooks hold only a weak reference and an index: a hook on `full` that held its unit would
    form a cycle (unit -> full -> hook -> unit) that only the garbage collector frees, at some
    arbitrary later time (after destroy_process_group(), gloo aborts the process)."""

    def hook(*args):
        state = ref()
        if state is None:
            return None
        if unit_index is None:
            return getattr(state, method)(*args)
        return getattr(state, method)(state.units[unit_index], *args)

    return hook
