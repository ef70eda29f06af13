"""tierlift.optim.Adam / AdamW: drop-in torch.optim.Optimizer subclasses backed by the fused
SIMD CPU kernel (csrc/core/optim) and the fused multi-tensor CUDA kernel (csrc/cuda/adam.cu).

Same constructor as torch's, same param-group keys and the same state_dict layout
(state: step, exp_avg, exp_avg_sq[, max_exp_avg_sq]), so checkpoints move between torch's
optimizer and ours in both directions. Differences, all deliberate:
  * optimizer state is fp32 by default; a bf16/fp16 parameter also gets an fp32 master copy
    (state key "master") and receives the rounded update, written by the same fused pass;
  * state_dtype="bf16" keeps compact moments instead (as 8-bit Adam does): exp_avg in bf16,
    exp_avg_sq as uint8 codes with one fp32 scale per 256 elements ("exp_avg_sq_scale");
    about 3 bytes per parameter instead of 8 (docs/optim.md). Loading an fp32-state checkpoint
    quantizes it and an fp32-state optimizer dequantizes a compact one. Its state (and
    state_dict) has the codes under "exp_avg_sq_codes", not "exp_avg_sq": torch's optimizers
    raise instead of stepping on them;
  * offload="cpu"|"nvme"|"hybrid" (with nvme_path, cpu_budget, overlap, nvme_generations,
    chunk_bytes, durable, skip_nonfinite, device_staging, device_fraction, overlap_threads)
    moves the state out of the parameter's memory (device_fraction keeps a share of it there);
    tierlift.offload does that work (docs/offload.md). Its state is laid out by position in
    the params lists at construction: a parameter listed twice (torch warns and updates it
    twice) and a list changed afterwards are refused;
  * hyperparameter types are checked (optim/hyper.py): torch raises on lr="0.001" only by
    accident of a comparison, float() would take it;
  * foreach/fused/capturable are accepted for compatibility and ignored (ours is always fused),
    except in the combinations torch refuses, which raise as torch's do; differentiable=True
    is refused;
  * GradScaler's protocol of torch's fused Adam (_step_supports_amp_scaling): the kernel
    unscales the gradients, or the step is skipped (docs/optim.md, "AMP GradScaler");
  * a non-contiguous parameter (a transposed or strided view) is stepped through a contiguous
    copy that is written back (slower; warned about once); offload does the same, its state
    held in the parameter's logical order (offload/strided.py).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import defaultdict
from itertools import repeat

import torch
from torch.optim import Optimizer

from tierlift import ops
from tierlift.offload import OffloadConfig, Offloader
from tierlift.offload.masters import refresh_master
from tierlift.optim import amp, state_hooks
from tierlift.optim.adam_plan import build_plan, plan_grads
from tierlift.optim.hyper import (
    CODES_KEY,
    SCALE_KEY,
    check_amsgrad_state,
    check_flags,
    check_group_lr,
    check_group_types,
    check_loaded_amsgrad,
    check_loaded_moments,
    check_state_dtype,
    check_torch_config,
    check_types,
    loaded_codes,
    saved_codes,
)
from tierlift.optim.state_shapes import check_loaded_shapes, check_state_follows
from tierlift.reference.optim_compact import (
    dequantize_exp_avg_sq,
    quantize_exp_avg_sq,
    scale_count,
)

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_DTYPES = frozenset((torch.float32, *_LOW_PRECISION))  # of params and of gradients
# State tensors taken from a loaded state dict as they are (torch would cast them to the
# parameter's dtype), then brought to this optimizer's state format.
_STATE_KEYS = ("exp_avg", "exp_avg_sq", CODES_KEY, SCALE_KEY, "max_exp_avg_sq", "master")


def _check_grad_scale(grad_scale) -> None:
    """GradScaler's scale as the kernels take it: a 1-element float32 tensor."""
    if not isinstance(grad_scale, torch.Tensor) or grad_scale.dtype != torch.float32:
        raise TypeError("grad_scale must be a float32 tensor (GradScaler's scale), got "
                        f"{getattr(grad_scale, 'dtype', type(grad_scale).__name__)}")
    if grad_scale.numel() != 1:
        raise ValueError(f"grad_scale must be a 1-element tensor, got {grad_scale.numel()} "
                         "elements")


def _traced_lrs(groups: list) -> dict:
    """A compiled step's tensor lrs by group index. Each group's op checks its lr before it
    changes anything; with several groups, all are checked first by one op
    (ops.adam_lr_values) whose output every group's op reads, so that it runs first."""
    index = [gi for gi, group in enumerate(groups) if isinstance(group["lr"], torch.Tensor)]
    if len(groups) == 1 or not index:
        return {gi: groups[gi]["lr"].detach() for gi in index}
    values = ops.adam_lr_values([groups[gi]["lr"].detach() for gi in index])
    return {gi: values[i] for i, gi in enumerate(index)}


def _caller_stacklevel() -> int:
    """The warnings.warn stacklevel, counted from the function that calls this one, of the
    first frame outside tierlift and torch: optimizer.step() reaches ours through torch's
    hook and no_grad wrappers, so a fixed level would point into torch."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tierlift/
    skip = (os.path.dirname(torch.__file__) + os.sep, package + os.sep)
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def _refuse_param(name: str, p: torch.Tensor, device) -> None:
    """Raises the error for the first check Adam._check_group finds `p` (named `name`) failing;
    `device` is the device of the group's earlier parameters (None for the first)."""
    grad = p.grad
    if grad.is_sparse:
        raise RuntimeError(
            f"{name} has a sparse gradient; tierlift's Adam needs dense "
            "gradients (use torch.optim.SparseAdam)"
        )
    if device is not None and p.device != device:
        raise RuntimeError(
            f"{name} is on {p.device} but earlier parameters of the same "
            f"group are on {device}; put each device in its own group"
        )
    if grad.dtype not in _DTYPES:
        raise TypeError(
            f"{name}.grad has dtype {grad.dtype}; expected float32, bfloat16 or float16"
        )
    raise TypeError(
        f"{name} has dtype {p.dtype}; tierlift's Adam steps float32, bfloat16 "
        "and float16 parameters"
    )


def _advance_steps(states: list) -> list:
    """Adds 1 to every state's step count (a tensor, as torch keeps it) in one call, and returns
    the new counts as ints."""
    steps = [state["step"] for state in states]
    if all(isinstance(step, torch.Tensor) for step in steps):
        return ops.advance_steps_(steps)
    for state in states:
        state["step"] += 1
    return [int(state["step"]) for state in states]


class Adam(Optimizer):
    """Adam (weight decay as an L2 penalty; `decoupled_weight_decay=True` makes it AdamW)."""

    # bf16/fp16 gradients of fp32 parameters are stepped exactly as their fp32 values
    # (tierlift.zero.MixedPrecision(grad_dtype=...) checks for this before a step).
    takes_low_precision_grads = True
    # torch's AMP protocol, as its fused Adam: GradScaler.step() sets `grad_scale` and
    # `found_inf` on the optimizer instead of unscaling, and step() unscales in the kernel or
    # skips the step (docs/optim.md, "AMP GradScaler").
    _step_supports_amp_scaling = True
    # Set and deleted by GradScaler around each step(); a stale pair is refused (optim/amp.py).
    grad_scale = amp.grad_scale
    found_inf = amp.found_inf

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        amsgrad=False,
        *,
        foreach=None,
        maximize=False,
        capturable=False,
        differentiable=False,
        fused=None,
        decoupled_weight_decay=False,
        offload="none",
        nvme_path=None,
        cpu_budget=None,
        overlap=False,
        max_grad_norm=None,
        nvme_generations=2,
        chunk_bytes=32 << 20,
        state_dtype="fp32",
        durable=False,
        skip_nonfinite=False,
        device_staging=None,
        device_fraction=0.0,
        overlap_threads=None,
    ):
        check_types(lr, betas, eps, weight_decay)
        check_flags(amsgrad=amsgrad, foreach=foreach, maximize=maximize, capturable=capturable,
                    differentiable=differentiable, fused=fused,
                    decoupled_weight_decay=decoupled_weight_decay)
        ops.check_adam_hyper(lr, betas, eps, weight_decay)
        check_torch_config(lr, betas, foreach, capturable, fused, differentiable)
        check_state_dtype(state_dtype, amsgrad)
        self._state_dtype = state_dtype
        if differentiable:
            raise ValueError(
                "tierlift optimizers do not support differentiable=True; "
                "use torch.optim for differentiating through the step"
            )
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            foreach=foreach,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults)
        self._offload = None
        extras = (nvme_path, cpu_budget, max_grad_norm)
        if offload != "none" or overlap or nvme_generations != 2 or chunk_bytes != 32 << 20 \
                or durable or skip_nonfinite is not False or device_staging is not None \
                or device_fraction != 0.0 or overlap_threads is not None \
                or any(x is not None for x in extras):
            config = OffloadConfig(
                offload=offload,
                nvme_path=nvme_path,
                cpu_budget=cpu_budget,
                overlap=overlap,
                max_grad_norm=max_grad_norm,
                nvme_generations=nvme_generations,
                chunk_bytes=chunk_bytes,
                durable=durable,
                skip_nonfinite=skip_nonfinite,
                device_staging=device_staging,
                device_fraction=device_fraction,
                overlap_threads=overlap_threads,
            )
            if config.offload != "none":
                self._offload = Offloader(self, config)
                self.state = state_hooks.tier_states(self.state, self._offload)

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group, refusing at once the parameters step() could not update."""
        if getattr(self, "_offload", None) is not None:
            raise RuntimeError(
                "add_param_group() after construction is not supported with offload (the "
                "offloaded state is laid out when the optimizer is built); pass every group to "
                "the constructor")
        self.__dict__.pop("_plans", None)
        gi = len(self.param_groups)
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif not isinstance(params, set):  # torch refuses a set
            # As torch does: a generator (model.parameters()) is read once, here, and its
            # list is what the group keeps; passed on as it was, the group would be empty.
            params = param_group["params"] = list(params)
        else:
            params = list(params)
        for pi, p in enumerate(params):
            name = f"param_groups[{gi}]['params'][{pi}]"
            if isinstance(p, torch.Tensor) and p.is_complex():
                raise TypeError(f"{name} is complex ({p.dtype}); tierlift's Adam supports real "
                                "tensors only")
            if isinstance(p, torch.Tensor) and p.dtype not in (torch.float32, *_LOW_PRECISION):
                raise TypeError(
                    f"{name} has dtype {p.dtype}; tierlift's Adam steps float32, bfloat16 and "
                    "float16 parameters (keep others on torch.optim.AdamW in a second "
                    "optimizer)")
        super().add_param_group(param_group)

    @property
    def last_step_stats(self) -> dict:
        """Per-step time and byte breakdown of the last offloaded step (empty without offload)."""
        return self._offload.last_step_stats if self._offload is not None else {}

    def state_dict(self):
        # torch's hooks around the whole read: its post-hooks see the moments from the tiers,
        # compact codes under CODES_KEY (the tiers name them "exp_avg_sq"), as returned.
        state_hooks.state_dict_pre_hooks(self)
        with state_hooks.torch_hooks_off(self):
            sd = super().state_dict() if self._offload is None else self._offloaded_state_dict()
        return state_hooks.state_dict_post_hooks(self, saved_codes(sd))

    def _offloaded_state_dict(self) -> dict:
        tiers = self._offload.materialize()
        for p, kinds in tiers.items():
            dict.update(self.state[p], kinds)  # beside the moments it yields, for the copy
        try:
            sd = super().state_dict()
            # detach from self.state; what the dicts hold (not the moments they also yield)
            sd["state"] = {i: dict(dict.items(s)) for i, s in sd["state"].items()}
            self._offload.device_part.snapshot(sd)
            return sd
        finally:
            for p, kinds in tiers.items():
                for k in kinds:
                    self.state[p].pop(k, None)

    def load_state_dict(self, state_dict):
        """As torch's, all-or-nothing: a failure (a state that does not fit, a full drive) leaves
        steps, hyperparameters and offloaded state as they were."""
        self._load_state_dict(state_dict)

    def _load_state_dict(self, state_dict, before_commit=None) -> None:
        """load_state_dict; `before_commit`, if given, is called once everything is in place
        and before it becomes visible: if it raises, all is put back (tierlift.checkpoint's
        multi-rank agreement). torch's load pre-hooks run first and what they return is loaded
        (the moments too); its post-hooks once the whole state is in place."""
        state_dict = loaded_codes(state_hooks.load_pre_hooks(self, state_dict))
        old = {"state": self.state, "param_groups": self.param_groups}  # torch replaces both
        self.__dict__.pop("_plans", None)  # stale anyway; frees the old state sooner
        try:
            with state_hooks.torch_hooks_off(self):
                self._replace_state(state_dict, before_commit)
        except BaseException:
            self.__dict__.update(old)
            raise
        state_hooks.load_post_hooks(self)

    def _replace_state(self, state_dict, before_commit) -> None:
        laid_out = None if self._offload is None else [
            "max_exp_avg_sq" in kinds for kinds in self._offload._kinds]
        check_loaded_amsgrad(state_dict["param_groups"], self._state_dtype, laid_out)
        check_loaded_moments(state_dict["state"])
        if self._offload is None:
            super().load_state_dict(state_dict)
            self._adopt_loaded_state(state_dict)
            if before_commit is not None:
                before_commit()
            return
        self._offload.check_lists()  # the state below is matched to parameters by position
        # Take the state from the dict as is (torch would cast it to the param's dtype), in
        # this optimizer's state format (fp32 or compact), converted as without offload.
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        loaded = {p: {k: v for k, v in state_dict["state"][i].items() if k != "step"}
                  for i, p in zip(ids, params) if i in state_dict["state"]}
        for i, p in zip(ids, params):
            check_loaded_shapes(p, state_dict["state"].get(i, {}), i)
        for p, state in loaded.items():
            if CODES_KEY in state:  # as the tiers (and the device part) name the codes
                state["exp_avg_sq"] = state.pop(CODES_KEY)
            if isinstance(state.get("exp_avg"), torch.Tensor):
                self._to_state_format(p, state)
        steps_only = dict(state_dict)
        steps_only["state"] = {i: {"step": s["step"]} for i, s in state_dict["state"].items()
                               if "step" in s}
        super().load_state_dict(steps_only)
        self.state = state_hooks.tier_states(self.state, self._offload)
        # the device part's state goes beside its parameters (offload/device_part.py)
        self._offload.device_part.load(self._offload.device_part.take(loaded),
                                       self._offload._kinds)
        self._offload.ingest(loaded, before_commit)

    def _adopt_loaded_state(self, state_dict) -> None:
        """torch casts loaded state to the parameter's dtype; ours is fp32 or compact whatever the
        parameter's (a bf16 parameter's master and moments would lose their low bits, a compact
        state's scales too). Takes the saved tensors as they are, then converts them to this
        optimizer's state format."""
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            saved = state_dict["state"].get(i, {})
            check_loaded_shapes(p, saved, i)
            if i not in state_dict["state"]:
                continue  # no entry, as torch's state after the load (self.state is a defaultdict)
            state = self.state[p]
            for k in _STATE_KEYS:
                if k in saved and isinstance(saved[k], torch.Tensor):
                    state[k] = saved[k].detach().to(p.device, copy=True).contiguous()
            if "exp_avg" in state:
                self._to_state_format(p, state)

    @property
    def _codes_key(self) -> str:
        """Compact state's key for its codes: CODES_KEY, the state dict's; under offload, the
        device part (offload/device_part.py) holds them as the tiers name them."""
        return CODES_KEY if getattr(self, "_offload", None) is None else "exp_avg_sq"

    def _to_state_format(self, p: torch.Tensor, state: dict) -> None:
        """Brings moments in either format (fp32, or compact: bf16 m, uint8 v codes + scales) to
        this optimizer's: quantizes fp32 moments into compact state, dequantizes the reverse."""
        compact, ck = self._state_dtype == "bf16", self._codes_key
        if compact:
            if state["exp_avg"].dtype != torch.bfloat16:
                state["exp_avg"] = state["exp_avg"].float().to(torch.bfloat16)
            if SCALE_KEY not in state:
                codes, scales = quantize_exp_avg_sq(state.pop("exp_avg_sq").float())
                state[ck], state[SCALE_KEY] = codes, scales
            state.pop("max_exp_avg_sq", None)
        elif SCALE_KEY in state:
            state["exp_avg_sq"] = dequantize_exp_avg_sq(state.pop(ck), state.pop(SCALE_KEY))
        fp32_keys = ("master",) if compact else ("exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                                 "master")
        for key in fp32_keys:
            if key in state and (
                state[key].dtype != torch.float32 or not state[key].is_contiguous()
            ):
                state[key] = state[key].to(torch.float32).contiguous()
        if compact:
            m, codes, scales = state["exp_avg"], state[ck], state[SCALE_KEY]
            if (codes.dtype != torch.uint8 or codes.shape != p.shape or m.shape != p.shape
                    or scales.dtype != torch.float32 or scales.numel() != scale_count(p.numel())):
                raise ValueError(
                    f"compact state of a parameter of shape {tuple(p.shape)} has exp_avg "
                    f"{tuple(m.shape)}, {ck} {codes.dtype} {tuple(codes.shape)} and "
                    f"exp_avg_sq_scale {scales.dtype} [{scales.numel()}]; expected uint8 codes "
                    f"of the parameter's shape and float32 [{scale_count(p.numel())}] scales")
            for key in ("exp_avg", ck, SCALE_KEY):
                state[key] = state[key].contiguous()

    def __getstate__(self) -> dict:
        """What pickle and copy.deepcopy take (torch's keys, and the state format, which a copy
        must not read as fp32). An offloaded optimizer is refused: its moments and masters live
        in its tiers, so a copy would silently restart Adam from zero moments."""
        if getattr(self, "_offload", None) is not None:
            raise TypeError(
                f"an offloaded {type(self).__name__} cannot be pickled or copied (copy.deepcopy, "
                "torch.save(optimizer)): its state lives in host memory tiers or files that a "
                "copy would not hold, and the copy would restart from zero moments. Save "
                "optimizer.state_dict() (or use tierlift.checkpoint.save) and load it into a "
                "new optimizer")
        return {**super().__getstate__(), "_state_dtype": self._state_dtype}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_state_dtype", "fp32")
        self.__dict__.setdefault("_offload", None)  # an unpickled copy holds its state itself
        for group in self.param_groups:
            group.setdefault("decoupled_weight_decay", False)
            group.setdefault("maximize", False)
            group.setdefault("amsgrad", False)
        # As torch's Adam: a step count saved as a number (torch before 1.12, converters) is
        # kept as a float32 tensor, which every step path and torch's optimizers expect.
        for st in self.state.values():
            if isinstance(st, dict) and SCALE_KEY in st and "exp_avg_sq" in st:
                st[CODES_KEY] = st.pop("exp_avg_sq")  # compact codes pickled before CODES_KEY
            step = st.get("step") if isinstance(st, dict) else None
            if step is not None and not isinstance(step, torch.Tensor):
                st["step"] = torch.tensor(float(step), dtype=torch.float32)

    def _init_state(self, p: torch.Tensor, amsgrad: bool, refresh: bool = True) -> dict:
        """p's state, created on its first step. A bf16/fp16 p gets an fp32 master from its
        value; later its master is refreshed from p where p was changed outside the optimizer
        (refresh_master), unless `refresh` is False because the step's kernel does it
        (refresh_from_copies)."""
        state = self.state[p]
        compact = self._state_dtype == "bf16"
        if len(state) == 0 or "exp_avg" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(
                p, dtype=torch.bfloat16 if compact else torch.float32,
                memory_format=torch.contiguous_format)
            if compact:
                state[self._codes_key] = torch.zeros_like(state["exp_avg"], dtype=torch.uint8)
                state[SCALE_KEY] = torch.zeros(
                    scale_count(p.numel()), dtype=torch.float32, device=p.device)
            else:
                state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
        # State loaded from a torch checkpoint may be in the parameter's dtype, or in the other
        # state format: bring it to this optimizer's.
        self._to_state_format(p, state)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
        if p.dtype in _LOW_PRECISION and "master" not in state:
            state["master"] = p.detach().to(torch.float32).contiguous()
        elif "master" in state and refresh:
            refresh_master(state["master"], p)
        return state

    def close(self) -> None:
        """Releases offloaded state now (NVMe files, the io engine's pool, the page-locking of
        the host tier, the worker thread) instead of at garbage collection; the optimizer
        cannot step afterwards. A no-op without offload."""
        if getattr(self, "_offload", None) is not None:
            self._offload.close()
            self._closed = True

    @torch.no_grad()
    def step(self, closure=None):
        if getattr(self, "_closed", False):
            raise RuntimeError("this optimizer was closed (close() released its offloaded "
                               "state); build a new one to keep training")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Set by GradScaler.step() for this call only (see _step_supports_amp_scaling).
        grad_scale = self.__dict__.get("grad_scale")
        found_inf = self.__dict__.get("found_inf")
        self._last_found_inf = found_inf
        try:
            if getattr(self, "_offload", None) is not None:
                self._offload.step(grad_scale=grad_scale, found_inf=found_inf)
                return loss
            if grad_scale is not None:
                _check_grad_scale(grad_scale)
            # Traced by torch.compile, what is read from tensors (GradScaler's verdict and
            # scale, a tensor lr) is read by the ops when they run, before they change anything:
            # read here it would split the graph (and bake a scheduler's lr into it).
            tracing = torch.compiler.is_compiling()
            if tracing:
                if found_inf is not None and found_inf.numel() != 1:
                    raise ValueError(f"found_inf must be a 1-element tensor, got "
                                     f"{found_inf.numel()} elements")
            elif found_inf is not None:
                if ops.amp_skips(grad_scale, found_inf):
                    return loss
            elif grad_scale is not None and grad_scale.device.type == "cpu":
                ops.check_grad_scale_value(float(grad_scale))
            # Every check before any change: a bad group leaves every parameter and count as
            # it was. A group whose plan still holds (adam_plan) skips the per-parameter work.
            # Traced, the general path runs at trace time only and dynamo's guards do the
            # plan's checks: no plan is read or made (one more recompile, and graph breaks).
            plans = {} if tracing else self.__dict__.setdefault("_plans", {})
            ready = []
            for gi, group in enumerate(self.param_groups):
                grads = None if tracing else plan_grads(plans.get(gi), self.state, group)
                if grads is None:
                    self._check_group(gi, group)
                else:
                    self._check_hyper(gi, group)
                ready.append(grads)
            lrs = _traced_lrs(self.param_groups) if tracing else {}
            for gi, (group, grads) in enumerate(zip(self.param_groups, ready)):
                if grads is not None:
                    self._step_planned(group, plans[gi], grads, grad_scale)
                    continue
                self._step_group(group, grad_scale, found_inf, lrs.get(gi))
                if not tracing:
                    plans[gi] = build_plan(self.state, group, self._state_dtype)
        except BaseException:
            # GradScaler deletes its attributes only after a step that returned; left behind,
            # its next step() would multiply its scale into this stale one.
            if found_inf is not None:
                self.__dict__.pop("grad_scale", None)
                self.__dict__.pop("found_inf", None)
            raise
        return loss

    @property
    def amp_skipped_last_step(self) -> bool:
        """Whether GradScaler found inf/NaN gradients at the last step(), which then changed
        nothing. GradScaler calls step() even then (this optimizer unscales inside it), while it
        does not call torch's own optimizers at all: a wrapper that tells a skipped step by
        whether step() ran (accelerate's AcceleratedOptimizer) must ask this instead."""
        found_inf = self.__dict__.get("_last_found_inf")
        return found_inf is not None and float(found_inf) != 0.0

    def _warn_noncontiguous(self) -> None:
        """Warns once per optimizer which parameters take the slower non-contiguous path."""
        if getattr(self, "_warned_noncontiguous", False):
            return
        names = [
            f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}, stride {p.stride()})"
            for gi, group in enumerate(self.param_groups)
            for pi, p in enumerate(group["params"])
            if p.grad is not None and not p.is_contiguous()
        ]
        if names:
            self._warned_noncontiguous = True
            warnings.warn(
                f"{type(self).__name__}: non-contiguous parameters take a slower path (each "
                "step updates a contiguous copy and copies it back into the parameter): "
                f"{', '.join(names)}. Make them contiguous before building the optimizer to "
                "avoid it.",
                RuntimeWarning,
                stacklevel=_caller_stacklevel(),
            )

    def _check_hyper(self, gi: int, group: dict) -> None:
        check_group_types(gi, group)
        check_group_lr(group)
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and torch.compiler.is_compiling():
            # Its value is checked when the step runs (ops.adam_lr_values), before any change.
            if lr.numel() != 1:
                raise ValueError(f"Tensor lr must be 1-element, got {lr.numel()} elements")
            lr = 0.0
        if torch.compiler.is_compiling() and any(isinstance(b, torch.Tensor)
                                                 for b in group["betas"]):
            # Traced, their values would be data the graph branches on (the checks, the op's
            # float arguments); read at trace time, they would be baked into the graph.
            raise ValueError(
                f"param_groups[{gi}]['betas'] are Tensors, which a compiled step "
                "(torch.compile(optimizer.step)) does not take; pass floats, e.g. "
                "betas=(0.9, 0.999), or step without torch.compile")
        ops.check_adam_hyper(lr, group["betas"], group["eps"], group["weight_decay"])
        if self._state_dtype == "bf16" and group["amsgrad"]:
            raise ValueError(
                f"param_groups[{gi}] has amsgrad=True, which is not supported with "
                "state_dtype='bf16'; use state_dtype='fp32' for amsgrad")

    def _check_group(self, gi: int, group: dict) -> None:
        self._check_hyper(gi, group)
        check_amsgrad_state(gi, group, self.state)
        device = None
        for pi, p in enumerate(group["params"]):
            grad = p.grad
            if grad is None:
                continue
            # The usual case in one test; the messages only for a parameter that fails it.
            p_device = p.device
            if (grad.is_sparse or grad.dtype not in _DTYPES or p.dtype not in _DTYPES
                    or (device is not None and p_device != device)):
                _refuse_param(f"param_groups[{gi}]['params'][{pi}]", p, device)
            device = p_device
            state = self.state.get(p)
            if state:
                check_state_follows(f"param_groups[{gi}]['params'][{pi}]", p, state)

    def _step_group(self, group: dict, grad_scale: torch.Tensor | None = None, found_inf=None,
                    lr=None) -> None:
        """One fused call per step count; `grad_scale` is GradScaler's scale when the gradients
        are still scaled (the kernel unscales them as it reads them). Traced (a compiled step),
        `found_inf` is GradScaler's verdict and `lr` the group's checked tensor lr, both read
        by the op when it runs (adam_group_step_). What is the same for the
        whole group (the device, whether a compiled kernel runs, the step counts' increment) is
        done once for it, not per parameter."""
        amsgrad = group["amsgrad"]
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        v_key = self._codes_key if self._state_dtype == "bf16" else "exp_avg_sq"
        # _check_group put the group's parameters on one device: one answer for all of them.
        # The compiled ops refresh masters from their parameters themselves (the CUDA kernel
        # with one 2-byte read per element, the CPU op in one C++ pass) instead of
        # refresh_master's separate torch passes (about 20x the step's time on a CPU).
        fused = ops.runs_kernel(params[0])
        states = [self._init_state(p, amsgrad, refresh=not fused) for p in params]
        # Traced by torch.compile, the counts stay in one op (adam_group_step_): read here they
        # would be data the graph branches on.
        counted = fused and torch.compiler.is_compiling() and all(
            isinstance(state["step"], torch.Tensor) for state in states)
        steps = repeat(None) if counted else _advance_steps(states)
        # step count -> lists for one fused call; params that skipped steps keep their count.
        buckets: dict = {}
        write_back = []  # (non-contiguous param, the contiguous tensor the kernel updated)
        for p, state, step in zip(params, states, steps):
            master = state.get("master")
            # The fused kernel updates flat contiguous memory: a non-contiguous parameter is
            # stepped through a contiguous copy of it (its fp32 weight, or the value its master
            # is refreshed from and rounded into), written back once the kernel ran. Its state
            # is contiguous anyway.
            weight = p
            if not p.is_contiguous():
                weight = p.contiguous()
                write_back.append((p, weight))
            b = buckets.get(step)
            if b is None:
                b = buckets[step] = defaultdict(list)
            b["params"].append(master if master is not None else weight)
            b["copies"].append(weight if master is not None else None)
            b["grads"].append(p.grad.contiguous())
            if counted:
                b["steps"].append(state["step"])
            b["exp_avgs"].append(state["exp_avg"])
            b["exp_avg_sqs"].append(state[v_key])
            if SCALE_KEY in state:
                b["scales"].append(state[SCALE_KEY])
            if amsgrad:
                b["max_exp_avg_sqs"].append(state["max_exp_avg_sq"])
        if write_back:
            self._warn_noncontiguous()
        scale = None if grad_scale is None else grad_scale.detach().to(params[0].device)
        for step, b in buckets.items():
            if any(c is not None for c in b["copies"]):
                # Params without their own copy write into themselves (a no-op copy is cheaper
                # than a second call, and keeps one launch per bucket).
                b["copies"] = [c if c is not None else p for c, p in zip(b["copies"], b["params"])]
            else:
                b["copies"] = []
            if counted:
                self._launch_counted(group, b, scale, found_inf, lr)
            else:
                self._launch(group, step, b, scale, fused)
        for p, weight in write_back:
            p.copy_(weight)

    def _step_planned(self, group: dict, plan, grads: list, grad_scale) -> None:
        """_step_group by the group's plan (adam_plan): the same calls with the same lists."""
        scale = None if grad_scale is None else grad_scale.detach().to(plan.device)
        counts = ops.advance_steps_(plan.steps)
        if counts.count(counts[0]) == len(counts):
            self._launch(group, counts[0], plan.take(grads), scale, True)
            return
        for step, index in ops.by_count(counts).items():
            self._launch(group, step, plan.take(grads, index), scale, True)

    def _hyper(self, group: dict, b: dict, grad_scale, fused: bool, lr=None) -> dict:
        """The Adam ops' keyword arguments for `group` but the step count; `lr` (a tensor for
        adam_group_step_) instead of the group's if given."""
        amp = {} if grad_scale is None else {"grad_scale": grad_scale}
        if b["copies"] and fused:
            # A copy that is its own master (an fp32 param) reads back its own value.
            amp["refresh_from_copies"] = True
        beta1, beta2 = group["betas"]
        lr = float(group["lr"]) if lr is None else lr
        return dict(lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], decoupled=self._decoupled(group),
                    maximize=group["maximize"], **amp)

    def _launch_counted(self, group: dict, b: dict, grad_scale, found_inf, lr) -> None:
        """_launch for a step traced by torch.compile: the lists in `b` with their step count
        tensors (b["steps"]), advanced and read inside the one op (compiled kernels only)."""
        compact = self._state_dtype == "bf16"
        extra = b["scales"] if compact else b["max_exp_avg_sqs"]
        ops.adam_group_step_(b["steps"], b["params"], b["grads"], b["exp_avgs"],
                             b["exp_avg_sqs"], extra, b["copies"], amsgrad=group["amsgrad"],
                             compact=compact, found_inf=found_inf,
                             **self._hyper(group, b, grad_scale, True, lr))

    def _launch(self, group: dict, step: int, b: dict, grad_scale, fused: bool) -> None:
        """One fused call over the lists in `b` (copies: [] or one per param), all at `step`;
        `grad_scale` on the params' device or None."""
        hyper = dict(self._hyper(group, b, grad_scale, fused), step=step)
        if self._state_dtype == "bf16":
            ops.adam_compact_step_(b["params"], b["grads"], b["exp_avgs"], b["exp_avg_sqs"],
                                   b["scales"], b["copies"], **hyper)
        else:
            ops.adam_step_(b["params"], b["grads"], b["exp_avgs"], b["exp_avg_sqs"],
                           b["max_exp_avg_sqs"], b["copies"], amsgrad=group["amsgrad"], **hyper)

    def _decoupled(self, group: dict) -> bool:
        return bool(group.get("decoupled_weight_decay", False))


class AdamW(Adam):
    """AdamW: Adam with decoupled weight decay (Loshchilov & Hutter), like torch.optim.AdamW."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
        offload="none",
        nvme_path=None,
        cpu_budget=None,
        overlap=False,
        max_grad_norm=None,
        nvme_generations=2,
        chunk_bytes=32 << 20,
        state_dtype="fp32",
        durable=False,
        skip_nonfinite=False,
        device_staging=None,
        device_fraction=0.0,
        overlap_threads=None,
    ):
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            foreach=foreach,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=True,
            state_dtype=state_dtype,
            offload=offload,
            nvme_path=nvme_path,
            cpu_budget=cpu_budget,
            overlap=overlap,
            max_grad_norm=max_grad_norm,
            nvme_generations=nvme_generations,
            chunk_bytes=chunk_bytes,
            durable=durable,
            skip_nonfinite=skip_nonfinite,
            device_staging=device_staging,
            device_fraction=device_fraction,
            overlap_threads=overlap_threads,
        )

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:  # as torch's AdamW: also a state dict saved by Adam
            group["decoupled_weight_decay"] = True
