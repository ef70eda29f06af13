"""GradScaler's inf/NaN check as the overlap's gradient check: one read of the gradients.

Under `scaler.step(opt)` (no `unscale_` first) torch checks every gradient for inf/NaN with
`_amp_foreach_non_finite_check_and_unscale_` and an inverse scale of 1.0: a pass that reads
and rewrites every gradient. The overlapped optimizer must then read every host gradient once
more, to prove it is the one its chunks were stepped with during backward (overlap.validate).
Both passes are memory bound, and with no clipping nothing else in step() hides the second.

For an offloaded, overlapped optimizer whose gradients are all on the host, the scaler's check
is done here instead, in the one pass that also fingerprints the gradient segments
(_C.io.fingerprints_finite): the same found_inf, the gradients left as torch's pass leaves them
(multiplying by 1.0 changes no finite value), and step() takes the fingerprints from it. This
is a narrow patch of GradScaler's `_check_inf_per_device`: every other optimizer, device or
case (a step pre-hook that could change the gradients in between, denormals flushed by
torch.set_flush_denormal, which torch's multiply would apply) goes to torch's own check.
step() uses the fingerprints only if every gradient is still the same tensor at the same
version; otherwise it takes its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.optim.optimizer import _global_optimizer_pre_hooks

from tierlift._shards import all_ranks_agree
from tierlift._torch_patch import wrap_method
from tierlift.offload import gradients
from tierlift.offload.overlap import scan_all_grads


@dataclass
class Scan:
    """What the scaler's check saw: every gradient tensor and its version, and per group the
    fingerprint of each host gradient segment {(ci, pi): value}."""

    grads: list[tuple]  # (param, grad, grad._version)
    known: list[dict]


def _grads(opt) -> list[tuple]:
    return [(p, p.grad, p.grad._version) for g in opt.param_groups for p in g["params"]
            if p.grad is not None]


def _pre_hooks_may_write(opt) -> bool:
    """Whether a step pre-hook (they run between the scaler's check and step()) could change a
    gradient: any but tierlift.zero's own, which only checks (marked `leaves_grads`)."""
    hooks = [*_global_optimizer_pre_hooks.values(),
             *getattr(opt, "_optimizer_step_pre_hooks", {}).values()]
    return any(not getattr(h, "leaves_grads", False) for h in hooks)


def _flushes_denormals() -> bool:
    return bool((torch.full((1,), 1e-40) * 1.0).item() == 0.0)


def _usable(opt, grads: list[tuple]) -> bool:
    if os.environ.get("TIERLIFT_SCALER_SCAN", "1") == "0":  # torch's check, for comparisons
        return False
    off = getattr(opt, "_offload", None)
    if off is None or off.overlap is None or not off.streamed:
        return False
    if _pre_hooks_may_write(opt):
        return False
    return (bool(grads) and all(g.device.type == "cpu" and not g.is_sparse
                                and g.dtype in (torch.float32, torch.bfloat16, torch.float16)
                                for _, g, _ in grads)
            and not _flushes_denormals())


def scan(opt) -> bool | None:
    """The scaler's check for `opt`: whether every gradient is finite, keeping the segment
    fingerprints for its next step(); None where torch's own check must run."""
    off = opt._offload
    off.scaler_scan = None
    off.check_lists()  # before collect() indexes the layouts by position
    grads = _grads(opt)
    if not _usable(opt, grads):
        return None
    finite, known = scan_all_grads(off, gradients.collect(off))
    finite = off.device_part.finite(finite, False, [])  # collect() leaves its gradients out
    off.scaler_scan = Scan(grads, known)
    return finite


def take(opt) -> list[dict] | None:
    """The fingerprints the scaler's check took, if nothing can have changed a gradient since:
    the same tensors at the same versions and no step pre-hook. Consumed by one step()."""
    off = opt._offload
    seen, off.scaler_scan = getattr(off, "scaler_scan", None), None
    if seen is None or _pre_hooks_may_write(opt):
        return None
    now = _grads(opt)
    if len(now) != len(seen.grads) or any(
            p is not q or g is not h or v != w
            for (p, g, v), (q, h, w) in zip(now, seen.grads)):
        return None
    return seen.known


def _fused(original):
    def _check_inf_per_device(self, optimizer):
        if getattr(optimizer, "_offload", None) is None:
            return original(self, optimizer)
        self._check_scale_growth_tracker("_check_inf_per_device")
        finite = scan(optimizer)
        if finite is None:
            return original(self, optimizer)
        # over every rank of the tierlift.zero shards it steps (zero/grad_scaler.py says why)
        finite = all_ranks_agree([p for g in optimizer.param_groups for p in g["params"]], finite)
        # keyed by the gradients' device, as torch's check does (a CUDA scaler's step sums the
        # values onto its own device)
        found = torch.full((), 0.0 if finite else 1.0, dtype=torch.float32)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = {found.device: found}
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    return _check_inf_per_device


def install() -> None:
    """Routes GradScaler's inf check for tierlift's offloaded optimizers through scan()
    (idempotent; tierlift/_torch_patch.py)."""
    wrap_method(torch.amp.GradScaler, "_check_inf_per_device", ["self", "optimizer"], _fused)
