"""Parameters that got no gradient while others of their unit did: stepped as torch steps them.

Under torch a parameter no backward reached since zero_grad (a branch not taken, a head unused
this step) keeps .grad None and Adam/AdamW skip it: no weight decay, no moment update, no step
count. A unit's flat gradient has zeros there instead, which the optimizer would step. So:

- each forward hooks the views a unit's parameters are read through (a hook fires when a
  gradient reaches the view); an entry whose hook did not fire but whose local gradient is
  nonzero (reached some other way) counts as used too;
- a synced backward (the gradient's owner is the union over the ranks, as DDP's
  find_unused_parameters) ORs the entries' flags over every rank: one small all-reduce, issued
  asynchronously at the end of backward and waited for at the next optimizer step, only for
  models with a unit of several parameters and more than one rank;
- none of this reads the device in a step where every parameter got a gradient (no host sync:
  the flags are Python lists, a rank whose flags are all set sends ones made on the device and
  needs no answer, since a MAX with all ones is all ones); a step with a parameter without
  gradient reads the flags once, every unit's together (the check of an unseen entry's local
  gradient stays on the device until then), and the shards' step counts once;
- around an Adam/AdamW step (torch's or tierlift's) of a shard that holds entries without
  gradient, their ranges of the shard and of the moments are put back as they were (zeros when
  the step created the state), and entries whose own step count lags the shard's (skipped by an
  earlier step) get their update recomputed with their own count's bias correction, so each
  parameter follows torch's per-parameter AdamW exactly (an offloaded optimizer's own master
  of an entry put back is set from it, so state_dict() and checkpoints saved between steps hold
  what the next step starts from). Other optimizers, tierlift's compact or offloaded state
  (whose layout cannot be restored per range) are refused before the step;
- those per-parameter step counts go with the optimizer's state across a resume:
  step_counts.py.
"""

from __future__ import annotations

import functools
import weakref

import torch

from tierlift.zero.comm import flags_on

# The step counts across a resume live in step_counts.py; checkpoint/io.py and the tests still
# reach them as unused.X.
from tierlift.zero.step_counts import (  # noqa: F401
    KEY,
    adopt,
    check_record,
    counts_of,
    hook_state_dict,
    install,
    names,
    record,
    restore_counts,
    unknown_counts,
)


def tracked(unit) -> bool:
    """Units whose flat gradient may mix used and unused parameters."""
    return not unit.frozen and len(unit.entries) > 1


def _mark(seen: list, i: int, grad):
    seen[i] = True


def is_watch_hook(hook) -> bool:
    """Whether a tensor hook is one watch() registered (rewrites.refuse_hooked: not the
    user's)."""
    return isinstance(hook, functools.partial) and hook.func is _mark


def watch(unit) -> None:
    """Hooks the views just installed on the unit's modules (while grad is enabled)."""
    if unit.seen is None or not torch.is_grad_enabled():
        return
    seen = unit.seen
    for i, e in enumerate(unit.entries):
        mod, attr = e.owners[0]
        view = getattr(mod(), attr, None)
        if isinstance(view, torch.Tensor) and view.requires_grad and view.grad_fn is not None:
            view.register_hook(functools.partial(_mark, seen, i))


def local_grad(unit, grad: torch.Tensor) -> None:
    """Before the unit's (local) gradient is reduced or summed on: an entry that got a gradient
    some way the hooks did not see counts as used, so nothing with a gradient is ever masked.
    Which did stays on the device (unit.grad_hit, ORed over the backwards of a no_sync()
    accumulation) and goes into the flags the step reads once for every unit: a read here, in
    the middle of backward, would stall a GPU's queue once per unit."""
    seen = unit.seen
    if seen is None or all(seen):
        return
    no = grad.new_zeros((), dtype=torch.bool)
    hit = torch.stack([no if s else grad[e.offset : e.offset + e.numel].any()
                       for s, e in zip(seen, unit.entries, strict=True)])
    was = getattr(unit, "grad_hit", None)
    unit.grad_hit = hit if was is None else was.logical_or_(hit)


def reset(unit) -> None:
    """The local sums were dropped (zero_grad after no_sync())."""
    if unit.seen is not None:
        unit.seen[:] = [False] * len(unit.seen)
        unit.grad_hit = None


class Agreement:
    """The per-entry "got a gradient" flags of the units reduced in a synced backward, ORed over
    every rank; then, per unit, which entries the current shard.grad covers."""

    def __init__(self, state) -> None:
        self._state = weakref.ref(state)  # the state owns this, never the reverse (no cycle)
        install()  # units that may lag: their optimizers' state dicts carry the counts
        self.reduced: list = []  # units reduced in this backward, each with its fresh flag
        # (work or None, flags tensor or None, its values if known without reading it,
        #  [(unit, seen, fresh, grad_hit)])
        self.pending = None

    @property
    def state(self):
        return self._state()

    def on_reduce(self, unit) -> None:
        """The unit's gradient is sent now: its local flags go with this backward."""
        if unit.seen is None:
            return
        self.settle()  # the previous backward's flags first
        # Reduced twice in one backward (a reentrant torch.utils.checkpoint runs its own
        # backward through the unit's views, apart from the outer one): the second gradient is
        # summed onto the first, so its flags add to the first's, not replace them.
        again = any(u is unit for u, *_ in self.reduced)
        fresh = not again and (
            unit.shard.grad is None
            or unit.used_for is None
            or unit.used_for() is not unit.shard.grad
        )
        if fresh:
            unit.before = None
        if unit.before is None and not all(unit.seen) and self.state.listeners[id(unit.shard)]:
            # The offloaded optimizer's overlap steps the shard as soon as its gradient lands,
            # before the step's hooks: the weights as they were, to put skipped entries back.
            unit.before = unit.shard.detach().clone()
        self.reduced.append((unit, list(unit.seen), fresh, getattr(unit, "grad_hit", None)))
        reset(unit)

    def launch(self) -> None:
        """End of a synced backward: one all-reduce (MAX) of every reduced unit's flags; the
        gradient checks of local_grad ORed in on the device, so the flags are the one read."""
        self.settle()
        if not self.reduced:
            return
        entries = self.reduced
        self.reduced = []
        local = [f for _, seen, _, _ in entries for f in seen]
        comm = self.state.world_comm
        dev = entries[0][0].device
        if all(local):
            if comm.world == 1:  # the local flags are the answer: no device work
                self.pending = (None, None, local, entries)
                return
            # Every rank sends the same size in the same order; only how the tensor is made
            # differs. MAX with all ones is all ones whatever the others send: nothing to read.
            flags = torch.ones(len(local), device=dev)
            work = comm.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, async_op=True)
            self.pending = (work, flags, local, entries)
            return
        flags, k = flags_on(local, dev), 0
        for _, seen, _, hit in entries:
            if hit is not None:
                flags[k : k + len(seen)].masked_fill_(hit.to(dev), 1.0)
            k += len(seen)
        work = None
        if comm.world > 1:
            work = comm.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, async_op=True)
        self.pending = (work, flags, None, entries)

    def settle(self) -> None:
        """Waits for the flags in flight and records, per unit, the entries its gradient has."""
        if self.pending is None:
            return
        work, flags, values, entries = self.pending
        self.pending = None
        if work is not None:
            self.state.world_comm.wait(work)  # completes the collective even if not read
        if values is None:
            values = flags.tolist()  # a sync only when this rank has an entry without gradient
        k = 0
        for unit, seen, fresh, _ in entries:
            got = [v > 0 for v in values[k : k + len(seen)]]
            k += len(seen)
            if not fresh:  # summed onto the last settled gradient (no zero_grad since)
                had = unit.has_grad or [True] * len(seen)  # None: every entry had one
                got = [a or b for a, b in zip(got, had, strict=True)]
            grad = unit.shard.grad
            unit.has_grad = None if all(got) else got
            unit.used_for = None if grad is None else weakref.ref(grad)


def _slice(unit) -> tuple[int, int]:
    lo = unit.comm.rank * unit.shard_numel
    return lo, lo + unit.shard_numel


def _local(unit, e) -> tuple[int, int] | None:
    """Entry e's range within this rank's shard, or None."""
    lo, hi = _slice(unit)
    a, b = max(e.offset, lo), min(e.offset + e.numel, hi)
    return (a - lo, b - lo) if a < b else None


def _mode(optimizer) -> str:
    """ "adam": Adam/AdamW (torch's, tierlift's) with fp32 state in optimizer.state: moments put
    back and lagging counts corrected; "opaque": tierlift's compact or offloaded state, out of
    reach: only the parameter and its masters are put back; "generic": any other optimizer:
    the parameter and every state tensor of its shape are put back."""
    if not isinstance(optimizer, torch.optim.Adam) and not _is_tierlift_adam(optimizer):
        return "generic"
    if (
        getattr(optimizer, "_state_dtype", "fp32") != "fp32"
        or getattr(optimizer, "_offload", None) is not None
    ):
        return "opaque"
    return "adam"


def _is_tierlift_adam(optimizer) -> bool:
    """tierlift.optim.Adam or a subclass, without importing tierlift.optim (a sibling layer)."""
    return any(
        c.__name__ == "Adam" and c.__module__.startswith("tierlift.optim")
        for c in type(optimizer).__mro__
    )


def _refuse(unit, optimizer, names: str, why: str):
    return RuntimeError(
        f"parameters {names} of unit {unit.name!r} {why}; torch steps each parameter on its "
        f"own, but they share the unit's flat shard, which {type(optimizer).__name__} steps as "
        "a whole, and this optimizer's state cannot be kept exact for part of it. Make those "
        "modules units of their own (shard(units=[...]) or param_group_fn), or use "
        "torch.optim.AdamW / tierlift.optim.AdamW with fp32 state and no offload, which step "
        "them exactly"
    )


@torch.compiler.disable  # collectives and bookkeeping: never traced into a compiled step
def before_step(state, optimizer) -> list:
    """Checks and snapshots for the shards of `optimizer` whose gradient leaves entries out or
    whose entries' own step counts lag; refuses (nothing changed yet) what cannot be stepped
    exactly. Returns what after_step takes."""
    if state.agreement is None:
        return []
    state.agreement.settle()
    todo = []
    mode = _mode(optimizer)
    offloaded = getattr(optimizer, "_offload", None) is not None  # its state is elsewhere
    for group in optimizer.param_groups:
        for p in group["params"]:
            unit = state.unit_of.get(id(p))
            if unit is None or p.grad is None:
                continue
            st = optimizer.state.get(p, {})
            n = len(unit.entries)
            hook_state_dict(state, optimizer)
            loaded = st.pop(KEY, None) if st else None  # the counts loaded with this state
            if loaded is not None:
                adopt(unit, optimizer, loaded)
            elif (
                unit.stepped_by is None
                or unit.stepped_by() is not optimizer
                or (not st and not offloaded)
            ):
                if st and record(unit) is not None:
                    raise unknown_counts(unit)
                # Another optimizer, or fresh state: every parameter's count starts at zero.
                unit.lag, unit.stepped = [0] * n, [False] * n
                unit.stepped_by = weakref.ref(optimizer)
            got = unit.has_grad
            if got is not None and (unit.used_for is None or unit.used_for() is not p.grad):
                got = None  # a gradient set by hand: every entry has it
            if got is None and not any(unit.lag):
                unit.stepped = [True] * n
                continue
            got = got if got is not None else [True] * n
            lagging = [g and lag > 0 for g, lag in zip(got, unit.lag, strict=True)]
            counts = "step" in st or mode != "generic"
            if mode != "adam" and counts and any(lagging):
                raise _refuse(
                    unit,
                    optimizer,
                    names(unit, [not x for x in lagging]),
                    "got no gradient in an earlier step and one now, so their own "
                    "step counts lag the shard's",
                )
            if mode == "opaque":
                decays = not group.get("decoupled_weight_decay") and group["weight_decay"]
                moved = [not g and (s or decays) for g, s in zip(got, unit.stepped, strict=True)]
                if any(moved):
                    raise _refuse(
                        unit,
                        optimizer,
                        names(unit, [not x for x in moved]),
                        "got no gradient now, and their moments would change",
                    )
            before, unit.before = unit.before, None
            snap = {
                "param": p.detach().clone() if before is None else before,
                "step": _step_now(st) if "step" in st else None,
            }
            for k, v in st.items():
                # opaque: only a master kept beside the parameter (compact state, an offloaded
                # optimizer's device part); the tiers' masters are set from p after the step
                if isinstance(v, torch.Tensor) and v.shape == p.shape and (
                        mode != "opaque" or k == "master"):
                    snap[k] = v.detach().clone()
            todo.append((unit, p, group, got, snap, mode, bool(st)))
    return todo


@torch.compiler.disable
@torch.no_grad()
def after_step(optimizer, todo: list) -> None:
    """Puts the skipped entries' ranges back and recomputes lagging entries' updates."""
    # Every shard's step count before and after the step, read in one go (a device count,
    # as fused or capturable AdamW keeps, would cost a sync per read).
    sts = [optimizer.state.get(item[1], {}) for item in todo]
    steps = _floats(
        [v for (*_, snap, _, _), st in zip(todo, sts, strict=True)
         for v in (snap["step"], st.get("step"))]
    )
    for j, (unit, p, group, got, snap, mode, had_state) in enumerate(todo):
        st = sts[j]
        was, now = steps[2 * j], steps[2 * j + 1]
        if had_state and now is not None and now == was:
            continue  # not stepped (GradScaler found inf): nothing changed
        tensors = {
            k: v
            for k, v in st.items()
            if isinstance(v, torch.Tensor)
            and v.shape == p.shape
            and (mode != "opaque" or k in snap)
        }
        put_back = []
        t = int(now) if now is not None else 0
        for i, e in enumerate(unit.entries):
            unit.lag[i] += not got[i]
            unit.stepped[i] = unit.stepped[i] or got[i]
            r = _local(unit, e)
            if r is None:
                continue
            a, b = r
            if not got[i]:
                p.data[a:b] = snap["param"][a:b]
                put_back.append((a, b))
                for k, v in tensors.items():
                    v[a:b] = snap[k][a:b] if k in snap else 0
            elif mode == "adam" and unit.lag[i]:
                p.data[a:b] = _adam_update(snap["param"][a:b], st, group, a, b, t - unit.lag[i])
        offload = getattr(optimizer, "_offload", None)
        if put_back and offload is not None:
            # The tiers' own master of those entries took the step's weight decay. They were
            # never stepped (else refused before the step), so their master is their value.
            offload.masters_from_param(p, put_back)


def _step_now(st: dict):
    """The step count as it is now: a float, or a copy of a tensor count (read after the step,
    with the new one and every other shard's, in one go)."""
    step = st["step"]
    if isinstance(step, torch.Tensor):
        return step.detach().clone()
    return float(step)


def _floats(values: list) -> list:
    """Numbers and 0-dim tensors (None kept) as floats, one read per device and dtype."""
    out = [None if v is None or isinstance(v, torch.Tensor) else float(v) for v in values]
    groups: dict = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            groups.setdefault((v.device, v.dtype), []).append(i)
    for idx in groups.values():
        read = torch.stack([values[i].detach().reshape(()) for i in idx]).tolist()
        for i, x in zip(idx, read, strict=True):
            out[i] = float(x)
    return out


def _adam_update(x: torch.Tensor, st: dict, group: dict, a: int, b: int, own: int):
    """The Adam/AdamW update of parameter range x (before the step) from the stepped moments,
    with bias correction for this parameter's own step count (torch's single-tensor formula)."""
    lr = float(group["lr"])
    beta1, beta2 = (float(v) for v in group["betas"])
    v = st["max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq"][a:b]
    bc1, bc2 = 1 - beta1**own, 1 - beta2**own
    denom = (v.sqrt() / bc2**0.5).add_(float(group["eps"]))
    x = x.clone()
    if group.get("decoupled_weight_decay"):
        x.mul_(1 - lr * float(group["weight_decay"]))
    return x.addcdiv_(st["exp_avg"][a:b], denom, value=-lr / bc1)
