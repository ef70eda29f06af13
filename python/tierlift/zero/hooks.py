"""The module and autograd hooks that run ZeRO: when each unit is gathered, when its gradient is
reduced, when it is freed. One ZeroState per sharded model (model._tierlift_zero).

forward   pre-hook of unit i: wait for / issue its all-gather, prefetch the next units in the
          recorded forward order (with param_group_fn, a module's other groups first), point
          the module's attributes at fresh views of `full`;
          post-hook (stage 3): free `full`, hook the outputs so that backward regathers.
          The pre-hooks run before the module's other pre-hooks (weight_norm and pruning
          compute the weight from sharded ones), also those put first after shard() and global
          ones (pre_hook_order.py); the post-hooks after its other forward hooks.
backward  output-gradient hook (stage 3): all-gather unit i again, prefetch the unit before it;
          post-accumulate-grad hook on `full`: launch the (async) reduce-scatter (stage 2/3) or
          all-reduce (stage 1) of the unit's gradient, free `full` (stage 3), then finish, in
          launch order, the earlier reductions whose collective is already done (with
          hierarchical sharding, then summed over the replicas: replicas.py): add the
          rank's slice to shard.grad and notify the listeners of that shard
          (on_shard_grad_ready: the offloaded optimizer starts that unit's step at once).
          With parameter offload the slice is first copied to host memory; a copy still in
          flight is handed over at once where only listeners that wait for it themselves
          (landing_event) read the gradient before backward ends: the overlap's worker then
          steps the unit as soon as its copy lands, without this thread coming back to poll;
          end-of-backward callback: wait for and finish the remaining reductions and copies,
          free anything still gathered.
optimizer a global step pre-hook checks what a step over shards needs (edited module weights,
          parameters without a gradient), a post-hook puts back what those should not have
          had changed and marks the stepped units stale (stages 1/2 gather them again at
          once); inside a compiled step both run eagerly at a graph break, and a fullgraph
          compiled step over shards is refused while it is traced, before anything ran.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from tierlift._shards import register_shard
from tierlift.offload.legs import ModelLegs
from tierlift.zero import (
    averaged,
    frozen,
    grad_scaler,
    pre_hook_order,
    rewrites,
    torch_calls,
    unused,
)
from tierlift.zero.buffers import BufferSync
from tierlift.zero.comm import flags_on, work_done
from tierlift.zero.config import ShardConfig
from tierlift.zero.replicas import ReplicaLegs
from tierlift.zero.topology import Topology
from tierlift.zero.unit import FlatUnit

_ATTR = "_tierlift_zero"  # the model attribute that holds its ZeroState
# The global optimizer-step hooks of models that are gone, removed at the next shard() or
# forward: a model freed by the garbage collector while an optimizer's step() runs its hooks
# must not change torch's hook dict under that iteration ("OrderedDict mutated during
# iteration"). Until then they do nothing (their weak reference is dead).
_DEAD_STEP_HOOKS: list = []


def _remove_dead_step_hooks() -> None:
    while _DEAD_STEP_HOOKS:
        _DEAD_STEP_HOOKS.pop().remove()


class ZeroState:
    def __init__(self, *, config: ShardConfig, topology: Topology, root, units: list[FlatUnit],
                 heartbeat=None, key_order: dict[str, int] | None = None, offload=None,
                 stats: dict | None = None, replicated: list | None = None):
        self.config = config
        self._root = weakref.ref(root)  # the model owns its state, never the reverse
        self.key_order = key_order or {}
        self.topology = topology
        self.comm = topology.shard       # the ranks each unit is split over
        self.world_comm = topology.world  # every rank of the model
        self.replicas = (ReplicaLegs(topology.legs, config.grad_comm) if topology.legs
                         else None)
        self.world = self.comm.world * (self.replicas.world if self.replicas else 1)
        self.crossing: list = []         # [unit, reduced, ReplicaSum or None] in launch order
        self.units = units
        self.replicated = replicated or []  # (name, parameter): frozen and not sharded
        self.heartbeat = heartbeat
        self.order: list[FlatUnit] = []  # forward order, recorded on the first forward
        self.order_done = False
        self.syncing = True              # False inside no_sync()
        self.buffers = BufferSync(topology.world, config.broadcast_buffers)
        self.local_sums = False          # no_sync() entered since the last synced backward
        self.callback_queued = False
        self.backward_task = -1  # the autograd graph task _finish_backward is queued on
        self.reductions: list = []       # (unit, work, buffer) in flight this backward
        self.landing: list = []          # (unit, host grad, event): D2H in flight (offload)
        self.in_flight: dict = {}        # id(shard) -> event: handed over before it landed
        # OrderedDict: RemovableHandle keeps a weak reference to it.
        self.listeners: dict[int, OrderedDict] = {id(u.shard): OrderedDict() for u in units}
        self.offload = offload           # ParamOffload with offload_params="cpu"/"nvme"
        # Shared with the ParamOffload and NvmeParamStore, which add their byte counts.
        self.stats = stats if stats is not None else {}
        resident = sum(u.full_bytes for u in units)
        self.stats.update(resident_bytes=resident, peak_resident_bytes=resident,
                          prefetch_skipped=0, grads_ready_early=0, grads_ready_at_end=0,
                          grads_handed_in_flight=0,
                          h2d_bytes=0, d2h_bytes=0,
                          last_step_sent={"intra_node": 0, "inter_node": 0})
        self._sent_at_step = topology.sent()
        # Forward, backward and the copies, for the offloaded optimizer's last_step_stats.
        self.legs = ModelLegs(cuda=any(u.device.type == "cuda" for u in units))
        if offload is not None:
            offload.legs = self.legs
        self.hooked: set[int] = set()    # ids of units that got gradients this backward
        self.handles: list = []
        self.gathered_blocks = 0         # tierlift.zero.gathered() blocks open on this model
        self.forwarding = 0              # root forwards running (their units were checked)
        self.shard_slots = rewrites.shard_slots(units)  # where each module holds its shard
        self.post_hooks: dict[int, list] = {}  # id(module) -> [hook count seen, our hook ids]
        self.pre_hooks: dict[int, list] = {}  # id(module) -> our pre-hooks (pre_hook_order.py)
        self.ran_early: set = set()  # (id(module), key): run by the global pre-hook this call
        self._shard_ids = {id(u.shard) for u in units}
        self.unit_of = {id(u.shard): u for u in units}
        for u in units:  # which parameters got gradients (unused.py)
            u.seen = [False] * len(u.entries) if unused.tracked(u) else None
            u.has_grad, u.used_for, u.before, u.stepped_by = None, None, None, None
            u.lag, u.stepped = [0] * len(u.entries), [False] * len(u.entries)
        self.agreement = (unused.Agreement(self) if any(u.seen is not None for u in units)
                          else None)
        self.step_todo: dict = {}  # id(optimizer) -> what unused.after_step puts back
        for i, u in enumerate(units):
            register_shard(u.shard, self, i)
        self._install()

    @property
    def root(self):
        return self._root()

    # ---- setup ----
    def _install(self) -> None:
        _remove_dead_step_hooks()
        ref = weakref.ref(self)
        # Pre-hooks first, before the user's (weight_norm's and pruning's recompute the weight
        # from the sharded ones, which must be gathered), the root's before the root unit's:
        # each is prepended, so the last registered runs first.
        # Kept first also past pre-hooks registered after shard() with prepend=True, and run
        # before global module pre-hooks (pre_hook_order.py).
        pre_hook_order.install()
        for i, unit in reversed(list(enumerate(self.units))):
            self.handles.append(pre_hook_order.register_first(
                self, unit.module, i, _bind(ref, "_pre_forward", i)))
        self.handles.append(pre_hook_order.register_first(
            self, self.root, None, _bind(ref, "_root_pre_forward")))
        pre_hook_order.ensure_global_first(needed=True)
        # Post-hooks last, after the user's (which may read the weights a stage-3 unit frees
        # here): kept last also past hooks registered after shard() (_keep_post_hooks_last).
        self._post_hook(self.root, self.root.register_forward_hook(
            _bind(ref, "_root_post_forward")))
        self._post_hook(self.root, self.root.register_forward_hook(
            _bind(ref, "_root_forward_ended"), always_call=True))  # also when it raised
        for i, unit in enumerate(self.units):
            self._post_hook(unit.module, unit.module.register_forward_hook(
                _bind(ref, "_post_forward", i)))
            if not unit.frozen:
                self.handles.append(unit.full.register_post_accumulate_grad_hook(
                    _bind(ref, "_on_grad", i)))
        frozen_of: dict[int, list] = {}  # id(module) -> [module, indices of its frozen units]
        for i, unit in enumerate(self.units):
            if unit.frozen:
                frozen_of.setdefault(id(unit.module), [unit.module, []])[1].append(i)
        for module, indices in frozen_of.values():
            self.handles.append(frozen.install(self, module, indices))
        grad_scaler.install()  # GradScaler's inf check agreed over the ranks
        torch_calls.install()  # torch's clip_grad_norm_ global, param groups checked
        rewrites.install()  # model.to(dtype), pruning, weight norm refused before any change
        averaged.install()  # an AveragedModel built before shard() averages the full weights
        before = _bind(ref, "_before_optimizer_step", traced=True)
        before.leaves_grads = True  # only checks: GradScaler's check stays valid (scaler_scan)
        after = _bind(ref, "_after_optimizer_step", traced=True)
        opt_hooks = [register_optimizer_step_post_hook(after),
                     register_optimizer_step_pre_hook(before)]
        if self.config.grad_dtype != torch.float32:
            for unit in self.units:
                if not unit.frozen:
                    unit.shard.grad_dtype = self.config.grad_dtype
        for h in opt_hooks:
            self.handles.append(h)
            weakref.finalize(self, _DEAD_STEP_HOOKS.append, h)  # the global hooks go too

    def _post_hook(self, module, handle) -> None:
        self.handles.append(handle)
        mine = self.post_hooks.setdefault(id(module), [len(module._forward_hooks), []])
        mine[0] = len(module._forward_hooks)
        mine[1].append(handle.id)

    def _keep_post_hooks_last(self, module) -> None:
        """Moves this model's forward hooks on `module` after any registered since (in the
        order they were registered), so that those read the weights before a stage-3 unit
        frees them. A length check per forward; the order changes only when the hooks did."""
        mine = self.post_hooks.get(id(module))
        hooks = module._forward_hooks
        if mine is None or mine[0] == len(hooks):
            return
        for hook_id in mine[1]:
            if hook_id in hooks:
                hooks.move_to_end(hook_id)
        mine[0] = len(hooks)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.pre_hooks.clear()  # the global pre-hook runs none of them any more

    def named_call(self, name: str) -> None:
        """Entering collective `name` outside forward/backward: every rank must (heartbeat.py)."""
        if self.heartbeat is not None:
            self.heartbeat.collective(name)

    # ---- listeners ----
    def on_grad_ready(self, shard: torch.Tensor, fn) -> RemovableHandle:
        if id(shard) not in self.listeners:
            raise ValueError("param is not a shard of this model")
        hooks = self.listeners[id(shard)]
        handle = RemovableHandle(hooks)
        hooks[handle.id] = fn
        return handle

    # ---- gathered bytes ----
    def _gather(self, unit: FlatUnit, async_op: bool = False) -> None:
        if unit.pending is not None and (unit.stale or
                                         unit.shard._version != unit.shard_version):
            # A prefetch issued before the shard changed (a step, a load, a `.data` write after
            # a forward that stopped early or a module called on its own): it holds the old
            # weights, which unit.gather would take as current. Waited for and gathered again,
            # on the flags needs_gather reads for a unit already gathered.
            unit.wait_gather()
        before = unit.full_bytes
        unit.gather(async_op=async_op)
        self._account(unit.full_bytes - before)
        if not async_op:
            unit.wait_gather()

    def _free(self, unit: FlatUnit) -> None:
        before = unit.full_bytes
        unit.free()
        self._account(unit.full_bytes - before)

    def _account(self, delta: int) -> None:
        if delta:
            self.stats["resident_bytes"] += delta
            self.stats["peak_resident_bytes"] = max(self.stats["peak_resident_bytes"],
                                                    self.stats["resident_bytes"])

    def _fits(self, unit: FlatUnit) -> bool:
        """Whether prefetching `unit` stays within gpu_budget, keeping room for the root unit
        (gathered on demand around every other unit) when it is not gathered."""
        budget = self.config.gpu_budget
        if budget is None or not unit.needs_gather() or unit.pending is not None:
            return True
        reserve = sum(u.gather_bytes for u in self.units
                      if u.module is self.root and u.full_bytes == 0)
        return self.stats["resident_bytes"] + unit.gather_bytes + reserve <= budget

    def check_copies(self) -> None:
        """Refuses weights edited in place through a module attribute where that attribute is
        a compute-dtype copy (stages 1/2 with MixedPrecision.param_dtype): the masters would
        not see it, and the next gather would undo it. Also refuses a module attribute given
        other data (`.data = ...`, any stage: the next forward puts the views back), and has the
        next forward gather again where the shards were written through `.data`."""
        for unit in self.units:
            moved = unit.moved_attrs()
            if moved:
                rewrites.refuse_moved(unit, moved)
            rewrites.refuse_hooked(unit)
            if unit.take_data_edits():
                unit.stale = True
        for unit in self.units:
            if unit.edited_copy():
                names = ", ".join(e.names[0] for e in unit.entries[:3])
                more = ", ..." if len(unit.entries) > 3 else ""
                raise RuntimeError(
                    f"a weight of unit {unit.name!r} ({names}{more}) "
                    "was changed in place through its module attribute (or its .data) since the "
                    "last forward. "
                    f"At stage {self.config.stage} with MixedPrecision(param_dtype="
                    f"{unit.compute_dtype}) that attribute is a gathered {unit.compute_dtype} "
                    "copy, not the fp32 master weights: the optimizer would step the unchanged "
                    "masters and the next gather would undo the change. Edit the weights inside "
                    "tierlift.zero.gathered(module, modifier_rank=0), or the shards "
                    "(model.parameters()), or load them with load_full_state_dict")

    # ---- forward ----
    def _root_pre_forward(self, module, args):
        if self.ran_early and pre_hook_order.ran_early(self, module, None):
            return
        pre_hook_order.ensure_global_first()
        self.forwarding += 1  # _root_forward_ended takes it back, also when this raises
        if _DEAD_STEP_HOOKS:
            _remove_dead_step_hooks()
        # First, before any gather or collective: a module whose shard was swapped out
        # (functional_call) would compute with weights the call did not give.
        rewrites.check_shards_in_place(self.units, self.shard_slots)
        if self.gathered_blocks:
            raise RuntimeError("forward inside tierlift.zero.gathered(): it would run on the "
                               "sharded weights, not the block's, and take the block's weights "
                               "off the modules; run it after the block")
        frozen.check_requires_grad(self)
        self.check_copies()
        if self.callback_queued and not _in_backward():
            # A backward raised before its end-of-backward callback ran: start clean.
            self.reductions.clear()
            self.crossing.clear()
            self.landing.clear()
            self._landed()
            self.hooked.clear()
            self.callback_queued = False
        if self.heartbeat is not None and not _in_backward():  # recomputations are no forward
            self.heartbeat.beat(no_grad=self.config.stage == 3 and not torch.is_grad_enabled())
        if not _in_backward():
            self.legs.begin("forward")
            self.buffers.before_forward(module)
        self._keep_post_hooks_last(module)

    def _root_forward_ended(self, module, args, output):
        # Not below 0: a global pre-hook that raised before the root's pre-hook ran.
        self.forwarding = max(self.forwarding - 1, 0)
        self.ran_early.clear()  # left by a global pre-hook that raised after tierlift's

    def _root_post_forward(self, module, args, output):
        self.order_done = True
        if not _in_backward():
            self.buffers.after_forward(self.syncing)
        self.legs.end("forward")
        return output

    def _pre_forward(self, unit: FlatUnit, module, args):
        if self.ran_early and pre_hook_order.ran_early(self, module, self.units.index(unit)):
            return
        if not self.forwarding:
            # The module called on its own (or recomputed in backward): the root's checks did
            # not run for this call.
            index = self.units.index(unit)
            rewrites.check_shards_in_place([unit], [self.shard_slots[index]])
            moved = unit.moved_attrs()
            if moved:
                rewrites.refuse_moved(unit, moved)
            # Shards written through `.data` since the gather this unit still holds (kept at
            # stages 1/2, left by a stage-3 forward that raised): gathered again, as the
            # root's check_copies has a model call do.
            if not _in_backward() and unit.take_data_edits():
                unit.stale = True
        self._keep_post_hooks_last(module)
        if not self.order_done and unit not in self.order:
            self.order.append(unit)
        unit.full_grad = None
        self._gather(unit)
        if not _in_backward():
            # Inside backward this is a recomputation (activation checkpointing): the units
            # after it are done, and the backward hooks prefetch the ones before it.
            self._prefetch(unit, +1)
        unit.install_views()
        unused.watch(unit)

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
            unit.expects_backward = unit.expects_backward or bool(tensors)
        if self.config.reshard_after_forward or not torch.is_grad_enabled():
            self._free(unit)
        return output

    def _prefetch(self, unit: FlatUnit, direction: int) -> None:
        """Issues the gathers of the other groups of unit's module (param_group_fn splits a
        module over several units, all needed now), then of the units of the next `prefetch`
        modules in the recorded order, walking in `direction`."""
        if self.config.prefetch == 0 or unit not in self.order:
            return
        siblings = [u for u in self.order if u.module is unit.module and u is not unit]
        if siblings and unit.module is not self.root:
            for u in siblings:
                if not self._fits(u):
                    self.stats["prefetch_skipped"] += 1
                    return
                self._gather(u, async_op=True)
        i = self.order.index(unit)
        modules, prev = 0, unit.module
        j = i + direction
        while 0 <= j < len(self.order):
            nxt = self.order[j]
            j += direction
            if nxt.module is not prev:
                modules, prev = modules + 1, nxt.module
                if modules > self.config.prefetch:
                    break
            if nxt.module is self.root or nxt.module is unit.module:
                continue
            if direction < 0 and nxt.frozen and not nxt.expects_backward:
                continue  # no backward runs through it: nothing would free it before the end
            if not self._fits(nxt):
                self.stats["prefetch_skipped"] += 1  # gathered on demand, once room is made
                break
            self._gather(nxt, async_op=True)

    # ---- backward ----
    def _queue_callback(self) -> None:
        if not self.callback_queued:
            if self.config.stage == 3 and self.heartbeat is not None:
                self.heartbeat.check_same_forward(self.comm)
            self.callback_queued = True
            self.backward_task = torch._C._current_graph_task_id()
            self.legs.begin("backward")
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _pre_backward(self, unit: FlatUnit, grad):
        self._queue_callback()
        if id(unit) not in self.hooked:
            self._gather(unit)
            self._prefetch(unit, -1)
            # Views again in place of the freed stand-ins, for a recomputed (checkpointed)
            # submodule; with grad enabled, so its gradient reaches `full`.
            with torch.enable_grad():
                unit.install_views()
                unused.watch(unit)
        return None

    def _on_grad(self, unit: FlatUnit, full: torch.Tensor) -> None:
        self._queue_callback()
        self.hooked.add(id(unit))
        # A backward nested in this one (a reentrant torch.utils.checkpoint's, run through the
        # views of the unit) gives the unit part of its gradient: the outer backward may still
        # read its weights, saved for a use before the checkpoint; its end frees them.
        if self.config.stage == 3 and torch._C._current_graph_task_id() == self.backward_task:
            self._free(unit)
        unused.local_grad(unit, full.grad)
        if not self.syncing:
            return  # accumulate locally: full.grad keeps summing until a synced backward
        grad = full.grad
        full.grad = None
        self._reduce(unit, grad)

    def _reduce(self, unit: FlatUnit, grad: torch.Tensor) -> None:
        """Launches the reduction of a unit's full gradient (async) and lands what is done."""
        if self.agreement is not None:
            self.agreement.on_reduce(unit)
        rdt = self.config.reduce_dtype or grad.dtype
        buf = grad.to(rdt)
        if rdt == torch.float16:
            buf.div_(self.world)  # fp16 would overflow summing before dividing
        if self.config.stage == 1:
            work = self.comm.all_reduce(buf, async_op=True)
        else:
            out = torch.empty(unit.shard_numel, dtype=rdt, device=buf.device)
            work = self.comm.reduce_scatter(out, buf, async_op=True)
            buf = (out, buf)  # keep the input alive until the collective is done
        self.reductions.append((unit, work, buf))
        self._drain(wait=False)

    def _drain(self, wait: bool) -> None:
        """Finishes, in launch order, the reductions whose collective (and, with replicas,
        their sum over the replicate legs; with parameter offload, the D2H copy) is done; all
        of them when `wait`."""
        while self.reductions:
            unit, work, buf = self.reductions[0]
            if not wait and not work_done(work):
                break
            self.reductions.pop(0)
            self.comm.wait(work)
            reduced = buf if self.config.stage == 1 else buf[0]
            if self.replicas is None:
                self._landing(unit, reduced)
            else:
                self.crossing.append([unit, reduced, None])
        while self.crossing:
            # One replica sum at a time, in launch order: every rank then issues the legs'
            # collectives in the same order, whatever its own timing.
            entry = self.crossing[0]
            if entry[2] is None:
                entry[2] = self.replicas.start(entry[1])
            if not wait and not entry[2].done():
                break
            self.crossing.pop(0)
            self._landing(entry[0], entry[2].wait())
        while self.landing:
            unit, piece, event = self.landing[0]
            if event is not None:
                if not wait and not event.query():
                    if not self._takes_in_flight(unit):
                        break
                    # Its readers wait for the copy themselves: handed over now, not when this
                    # thread next comes back to poll (a unit's backward later).
                    self.landing.pop(0)
                    self.in_flight[id(unit.shard)] = event
                    self.stats["grads_handed_in_flight"] += 1
                    self._hand_over(unit, piece, early=True)
                    continue
                with self.legs.copy("d2h", waiting=True):
                    event.synchronize()
            self.landing.pop(0)
            self._hand_over(unit, piece, early=not wait)
        if wait:
            self._landed()

    def _takes_in_flight(self, unit: FlatUnit) -> bool:
        """Whether unit's gradient may be handed over while its copy to host memory is still in
        flight: nothing reads it before backward ends but listeners that wait for the copy
        themselves (landing_event; the offloaded optimizer's overlap): no hook on the shard,
        no gradient to add it to, no file to write it to."""
        shard = unit.shard
        return (shard.grad is None and unit.offload is not None and unit.offload.store is None
                and not shard._backward_hooks
                and not getattr(shard, "_post_accumulate_grad_hooks", None)
                and all(getattr(fn, "waits_for_landing", False)
                        for fn in self.listeners[id(shard)].values()))

    def landing_event(self, shard: torch.Tensor):
        """The event (synchronize() waits for it) of the copy that writes shard.grad when the
        gradient was handed over before it landed; None once it has (and after backward)."""
        return self.in_flight.get(id(shard))

    def _landed(self) -> None:
        """Waits for the copies handed over in flight: after backward every shard.grad is in
        host memory, whoever reads it."""
        for event in self.in_flight.values():
            with self.legs.copy("d2h", waiting=True):
                event.synchronize()
        self.in_flight.clear()

    def take_legs(self) -> dict:
        """Forward, backward, H2D and D2H since the last call (ModelLegs.take)."""
        return self.legs.take()

    def _landing(self, unit: FlatUnit, reduced: torch.Tensor) -> None:
        piece = self._land(unit, reduced)
        if unit.offload is not None:
            self.landing.append((unit, *unit.offload.stage_out(piece)))
        else:
            self.landing.append((unit, piece, None))

    def _land(self, unit: FlatUnit, reduced: torch.Tensor) -> torch.Tensor:
        """The averaged gradient of this rank's slice in the shards' grad dtype (stage 1 keeps
        the full one, and a slice of that dtype is a view of it: no second copy)."""
        if reduced.dtype != torch.float16:
            reduced.div_(self.world)  # fp16 was divided before the sum
        dtype = self.config.grad_dtype
        if self.config.stage == 1:
            unit.full_grad = reduced  # stage 1 keeps the averaged full gradient
            lo = self.comm.rank * unit.shard_numel
            return reduced[lo:lo + unit.shard_numel].to(dtype)
        return reduced.to(dtype)

    def _hand_over(self, unit: FlatUnit, piece: torch.Tensor, early: bool) -> None:
        store = unit.offload.store if unit.offload is not None else None
        for fn in list((unit.shard._backward_hooks or {}).values()):
            # A hook the user put on the shard: called with the gradient that is about to be
            # accumulated into shard.grad, as autograd calls a leaf's hooks.
            out = fn(piece)
            piece = piece if out is None else out
        if unit.shard.grad is None:
            # With offload_params="nvme" the gradient lives in the file, not in RAM.
            home = store.grad_home(unit.shard, piece) if store is not None else None
            unit.shard.grad = piece if home is None else home
        elif piece._base is not None:
            # A view of this backward's full gradient (stage 1): sum into it and let the
            # previous backward's buffer go, which the old view would keep alive (a + b == b + a
            # in IEEE arithmetic, so the sum is the same bits).
            unit.shard.grad = piece.add_(unit.shard.grad)
        else:
            unit.shard.grad.add_(piece)
        if store is not None:
            store.landed(unit.shard.grad)  # in the file: dropped from RAM a hand-over later
        self.stats["grads_ready_early" if early else "grads_ready_at_end"] += 1
        for fn in list((getattr(unit.shard, "_post_accumulate_grad_hooks", None) or {}).values()):
            fn(unit.shard)
        for fn in list(self.listeners[id(unit.shard)].values()):
            fn(unit.shard)

    def _finish_backward(self) -> None:
        self._drain(wait=True)
        if self.syncing and self.local_sums:
            self._reduce_local_sums()
        if self.syncing and self.agreement is not None:
            self.agreement.launch()
        self.hooked.clear()
        self.callback_queued = False
        if self.config.stage == 3:
            for unit in self.units:
                self._free(unit)
        frozen.reset(self)
        self.legs.end("backward")

    def _reduce_local_sums(self) -> None:
        """Units that summed gradients inside no_sync() but got none in this synced backward
        (a branch only earlier micro-batches took) are reduced now, as DDP reduces what
        no_sync() left in param.grad. Which ones is agreed over every rank first: a rank may
        have summed where another did not (it sends zeros).

        Only units this backward did not reduce can be left: where it reduced every one there
        is nothing to agree on, so no collective and no read back (a host sync on a GPU). Every
        rank reduced the same units (their reductions are collectives, matched in order), so
        every rank takes that early return together."""
        self.local_sums = False
        units = [u for u in self.units if not u.frozen and id(u) not in self.hooked]
        if not units:
            return
        left_here = [float(u.full.grad is not None) for u in units]
        comm = self.world_comm
        if comm.world == 1:  # nothing to agree on: no device round trip (a host sync on a GPU)
            agreed = left_here
        elif all(left_here):
            # MAX with all ones is all ones whatever the others send: sent, not read back.
            mask = torch.ones(len(units), device=units[0].device)
            comm.wait(comm.all_reduce(mask, op=torch.distributed.ReduceOp.MAX))
            agreed = left_here
        else:
            mask = flags_on(left_here, units[0].device)
            comm.wait(comm.all_reduce(mask, op=torch.distributed.ReduceOp.MAX))
            agreed = mask.tolist()  # read only where some unit left has no sum here
        for unit, left in zip(units, agreed, strict=True):
            if left:
                grad = unit.full.grad
                unit.full.grad = None
                self._reduce(unit, grad if grad is not None else torch.zeros(
                    unit.padded, dtype=unit.compute_dtype, device=unit.device))
        self._drain(wait=True)

    # ---- optimizer ----
    # The global step hooks are traced inside a compiled step (torch.compile(opt.step)): an
    # optimizer without shards only has its parameters looked at, so its fullgraph step stays
    # one graph. Over shards the hooks' work runs eagerly behind one graph break
    # (_step_checks_eagerly), which fullgraph=True refuses at trace time, before anything ran.
    def _steps_shards(self, optimizer) -> bool:
        return any(id(p) in self._shard_ids for g in optimizer.param_groups for p in g["params"])

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._steps_shards(optimizer):
            _step_checks_eagerly[self.config.stage == 3](self, optimizer)

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._steps_shards(optimizer):
            _step_ended_eagerly(self, optimizer)

    def check_before_step(self, optimizer) -> None:
        """Refuses a step when requires_grad changed since shard() (frozen.py). Gradient shards
        in a dtype other than their parameter's (MixedPrecision.grad_dtype) reach only an
        optimizer that takes them; torch's would fail deep in its kernels."""
        frozen.check_requires_grad(self)
        self.check_copies()
        self.check_gathered_edits(optimizer)
        self.step_todo[id(optimizer)] = unused.before_step(self, optimizer)
        if getattr(optimizer, "takes_low_precision_grads", False):
            return
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) in self._shard_ids and p.grad is not None and p.grad.dtype != p.dtype:
                    raise TypeError(
                        f"{type(optimizer).__name__} got {p.grad.dtype} gradients of "
                        f"{p.dtype} shards (MixedPrecision(grad_dtype={p.grad.dtype})); "
                        "use tierlift.optim.Adam/AdamW, which take them, or "
                        "grad_dtype=torch.float32")

    def check_gathered_edits(self, optimizer) -> None:
        """Stage 3: refuses a step of units whose gathered weights were changed in place and
        freed since the last step (FlatUnit.free): the masters it would step miss the change."""
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        edited = [u for u in self.units if u.edited_gathered and id(u.shard) in ids]
        if not edited:
            return
        names = ", ".join(e.names[0] for u in edited for e in u.entries)
        raise RuntimeError(
            f"the gathered weights of unit {edited[0].name!r} ({names}) were changed in place "
            "during forward or backward (nn.Embedding(max_norm=...) renormalizes the rows it "
            "reads; so does any in-place edit under no_grad). At stage 3 they are a gathered "
            "copy, freed after use: the fp32 master shards this step would update never got the "
            "change, which torch's parameter keeps. Shard at stage 1 or 2 with fp32 weights "
            "(the module attribute is then the masters), or make the change outside the model "
            "(inside tierlift.zero.gathered(module, modifier_rank=0))")

    def step_ended(self, optimizer) -> None:
        """Puts back what the step changed of parameters without a gradient (unused.py), marks
        the stepped units stale and, at stages 1/2, gathers them again (_refresh)."""
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        unused.after_step(optimizer, self.step_todo.pop(id(optimizer), []))
        now = self.topology.sent()
        self.stats["last_step_sent"] = {k: now[k] - self._sent_at_step[k] for k in now}
        self._sent_at_step = now
        stepped = [u for u in self.units if id(u.shard) in ids and not u.frozen]
        for unit in stepped:
            unit.stale = True
            unit.edited_gathered = False
        if self.config.stage != 3 and not self.gathered_blocks:
            self._refresh(stepped)

    @torch.compiler.disable  # collectives: never traced into a compiled step
    def _refresh(self, units: list[FlatUnit]) -> None:
        """Stages 1/2: gathers the units a step changed now, so that module attributes hold
        the stepped weights right after step() (an edit, a read for logging or an eval between
        step and forward), as DeepSpeed's ZeRO-1/2 step ends with its all-gather. The bytes the
        next forward would have gathered, moved earlier. Every rank steps the same units
        (unused.after_step's put-backs, on some ranks only, run before and are taken in), so
        the collectives pair. Two in flight at a time, as the forward's prefetch: each holds a
        copy of its shard as the source until it is waited for."""
        for unit in units:
            unit.wait_gather()  # a prefetch still in flight gathered the weights before the step
        flying: list[FlatUnit] = []
        for unit in units:
            self._gather(unit, async_op=True)
            flying.append(unit)
            if len(flying) > 1:
                flying.pop(0).wait_gather()
        for unit in flying:
            unit.wait_gather()


_FULLGRAPH = ("compile the step without fullgraph=True (torch.compile(optimizer.step)): the "
              "optimizer's own math is still compiled, and these hooks run eagerly at one graph "
              "break around it. Nothing was changed")
_CHECKS = ("tierlift's checks before it (module weights edited or re-pointed since the last "
           "forward: data pointers and version counters; parameters that got no gradient: "
           "agreed over the ranks and put back after the step) cannot be traced")


def _eagerly(fn, reason: str):
    """`fn` run eagerly inside a compiled step: a graph break, and under fullgraph=True the
    error that names `reason`, raised while tracing, before anything ran."""
    return torch.compiler.disable(fn, reason=reason)


# Indexed by `stage == 3`: fullgraph=True names what stops that stage's step being one graph.
_step_checks_eagerly = (
    _eagerly(
        ZeroState.check_before_step,
        "optimizer.step() over the shards of a model sharded by tierlift.zero at stage 1 or 2 "
        "cannot be one graph (fullgraph=True): the step ends with all-gathers (collectives) "
        "of the stepped shards into the module weights, and " + _CHECKS + "; " + _FULLGRAPH),
    _eagerly(
        ZeroState.check_before_step,
        "optimizer.step() over the shards of a model sharded by tierlift.zero (stage 3) "
        "cannot be one graph (fullgraph=True): " + _CHECKS + "; " + _FULLGRAPH),
)
_step_ended_eagerly = _eagerly(ZeroState.step_ended, "tierlift.zero's bookkeeping after a step "
                               "over shards: put-backs of parameters without a gradient, "
                               "all-gathers at stages 1/2")


def _state(model) -> ZeroState:
    """The ZeroState of a model sharded by tierlift.zero.shard."""
    state = getattr(model, _ATTR, None)
    if state is None:
        raise ValueError("model is not sharded: call tierlift.zero.shard(model, ...) first")
    return state


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _bind(ref, method: str, unit_index: int | None = None, traced: bool = False):
    """A hook that calls ref().method([unit,] *args) and does nothing once the state is gone.

    Hooks hold only a weak reference and an index: a hook on `full` that held its unit would
    form a cycle (unit -> full -> hook -> unit) that only the garbage collector frees, at some
    arbitrary later time (after destroy_process_group(), gloo aborts the process).

    Not traced by dynamo unless `traced`: under torch.compile(model) the module and gradient
    hooks run eagerly at a graph break. Traced, each unit's hook (its own unit_index) was a
    recompilation of the same code, past dynamo's recompile limit on any model of more than 8
    units, for nothing: they gather, reduce and set module attributes, which a graph cannot
    hold. The global optimizer-step hooks stay `traced`: they run in every optimizer's step,
    and for one without shards they only look at its parameters, which a fullgraph-compiled
    step must be able to trace; over shards they call the eager work at once (one graph break,
    or fullgraph=True's error naming why)."""

    def hook(*args):
        state = ref()
        if state is None:
            return None
        if unit_index is None:
            return getattr(state, method)(*args)
        return getattr(state, method)(state.units[unit_index], *args)

    if traced:
        return hook
    return torch.compiler.disable(hook, reason="tierlift.zero hooks: collectives, bookkeeping")
