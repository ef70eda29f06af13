"""The types of Adam's hyperparameters, checked before anything uses them.

torch's Adam compares them with numbers, so a string lr raises there; ours reads them through
float(), which would take "0.001" and train with it. Checked at construction (argument names)
and again at each step (the param group's keys, which a user or a scheduler may set), before
anything changes. Value checks are ops.check_adam_hyper's. Also the checks of a loaded state
dict's groups and compact state keys (saved_codes, loaded_codes)."""

from __future__ import annotations

import numbers

import torch

_STATE_DTYPES = ("fp32", "bf16")
# Compact state's key for the uint8 exp_avg_sq codes, in optimizer.state and its state dict (the
# offload tiers name them "exp_avg_sq"). Not torch's key: torch.optim.AdamW would cast the codes
# (1..255) to float and step on them as second moments; without "exp_avg_sq" it raises instead.
CODES_KEY = "exp_avg_sq_codes"
SCALE_KEY = "exp_avg_sq_scale"
# Flags the step reads (a truthy string would silently switch them on); foreach, capturable,
# fused and differentiable are read once, at construction.
STEP_FLAGS = ("amsgrad", "maximize", "decoupled_weight_decay")


def _kind(value) -> str:
    return f"{type(value).__name__} {value!r}" if not isinstance(value, torch.Tensor) else (
        f"a Tensor of {value.numel()} elements")


def _check_number(name: str, value, tensor_ok: bool) -> None:
    if isinstance(value, torch.Tensor) and tensor_ok:
        return  # ops.check_adam_hyper checks its size and value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        what = "a float or a 1-element Tensor" if tensor_ok else "a float"
        raise TypeError(f"{name} must be {what}, got {_kind(value)}")


def _check_bool(name: str, value, none_ok: bool = False) -> None:
    if not isinstance(value, bool) and not (none_ok and value is None):
        raise TypeError(f"{name} must be a bool{' or None' if none_ok else ''}, got "
                        f"{_kind(value)}")


def check_types(lr, betas, eps, weight_decay, name=lambda k: k) -> None:
    """lr: a real number or a Tensor; betas: a tuple or list of 2 (numbers or Tensors); eps,
    weight_decay: real numbers (ints too, as torch takes them; bools refused). `name` turns a
    key into the name the message gives."""
    _check_number(name("lr"), lr, tensor_ok=True)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"{name('betas')} must be a tuple of 2 floats or 2 Tensors, got "
                        f"{_kind(betas)}")
    for i, b in enumerate(betas):
        _check_number(f"{name('betas')}[{i}]", b, tensor_ok=True)
    _check_number(name("eps"), eps, tensor_ok=False)
    _check_number(name("weight_decay"), weight_decay, tensor_ok=False)


def check_flags(**flags) -> None:
    """The constructor's flags: foreach and fused may be None (torch picks), the rest bools."""
    for k, v in flags.items():
        _check_bool(k, v, none_ok=k in ("foreach", "fused"))


def check_group_types(gi: int, group: dict) -> None:
    """check_types on a param group, naming its keys (`param_groups[0]['lr']`)."""
    def name(k):
        return f"param_groups[{gi}][{k!r}]"

    check_types(group["lr"], group["betas"], group["eps"], group["weight_decay"], name)
    for k in STEP_FLAGS:
        if k not in group:
            # torch's step raises KeyError on it; read with a default, a group rebuilt without
            # "decoupled_weight_decay" would step AdamW as Adam, and a step that read
            # "maximize" only in its kernel call failed half way
            raise KeyError(f"{name(k)} is missing: torch's Adam reads it at every step (load "
                           "a state dict, or add_param_group, to get the defaults)")
        _check_bool(name(k), group[k])


def check_state_dtype(state_dtype, amsgrad) -> None:
    if state_dtype not in _STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {_STATE_DTYPES}, got {state_dtype!r}")
    if state_dtype == "fp32":
        return
    if amsgrad:
        raise ValueError(
            "amsgrad=True is not supported with state_dtype='bf16' (its running max of v would "
            "need a third compact buffer); use state_dtype='fp32' for amsgrad")


def check_torch_config(lr, betas, foreach, capturable, fused, differentiable) -> None:
    """The constructor arguments torch.optim.Adam refuses although ours could run them, refused
    with torch's exception type and message, so that code written against torch behaves the
    same; in torch's order. (Value checks: ops.check_adam_hyper.)"""
    if isinstance(lr, torch.Tensor) and foreach and not capturable:
        raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
    if len(betas) == 2 and not (all(isinstance(b, float) for b in betas)
                                or all(isinstance(b, torch.Tensor) for b in betas)):
        raise ValueError("betas must be either both floats or both Tensors")
    for i, b in enumerate(betas):
        if isinstance(b, torch.Tensor) and foreach and not capturable:
            raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and "
                             "foreach=True")
    if fused and differentiable:
        raise RuntimeError("`fused` does not support `differentiable`")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")


def check_group_lr(group: dict) -> None:
    """torch's step-time rule for a tensor lr put into a group after construction (its
    constructor refuses the same in check_torch_config): not with foreach=True unless
    capturable=True."""
    if isinstance(group["lr"], torch.Tensor) and group.get("foreach") \
            and not group.get("capturable"):
        raise RuntimeError("lr as a Tensor is not supported for capturable=False and foreach=True")


def check_loaded_amsgrad(saved_groups: list, state_dtype: str, laid_out: list | None) -> None:
    """Before a load changes anything: a saved group's amsgrad that this optimizer's state cannot
    follow. Loaded, the group would be refused by every step() after the load had replaced the
    step counts and moments, its max_exp_avg_sq dropped (or zeroed). `laid_out`: each group's
    amsgrad when an offloaded optimizer laid its state kinds out; None without offload."""
    for gi, saved in enumerate(saved_groups):
        amsgrad = bool(saved.get("amsgrad", False))
        if amsgrad and state_dtype == "bf16":
            raise ValueError(
                f"the state dict being loaded has amsgrad=True in param_groups[{gi}], which "
                "state_dtype='bf16' does not support; load it into an optimizer built with "
                "state_dtype='fp32'. Nothing was changed")
        if laid_out is not None and gi < len(laid_out) and amsgrad != laid_out[gi]:
            raise ValueError(
                f"the state dict being loaded has amsgrad={amsgrad} in param_groups[{gi}], but "
                f"this offloaded optimizer was built with amsgrad={laid_out[gi]} there: its "
                "state kinds (max_exp_avg_sq or not) are laid out at construction. Build the "
                f"optimizer with amsgrad={amsgrad} to load this state dict. Nothing was changed")


def check_amsgrad_state(gi: int, group: dict, state) -> None:
    """Before a step changes anything: a group switched to amsgrad after its parameters stepped.
    Their state has no max_exp_avg_sq, where torch's AdamW raises KeyError; starting one from
    zeros (or from the current exp_avg_sq) would be a choice torch does not make."""
    if not group["amsgrad"]:
        return
    for pi, p in enumerate(group["params"]):
        st = state.get(p) if p.grad is not None else None
        if st and "exp_avg" in st and "max_exp_avg_sq" not in st:
            raise ValueError(
                f"param_groups[{gi}] has amsgrad=True, but param_groups[{gi}]['params'][{pi}] "
                "has stepped without it: its state has no 'max_exp_avg_sq' (torch's AdamW "
                "raises KeyError). To switch to AMSGrad from here, set each such parameter's "
                "optimizer.state[p]['max_exp_avg_sq'] to the maximum to start from (e.g. "
                "torch.zeros_like(p, dtype=torch.float32)), or build the optimizer with "
                "amsgrad=True. Nothing was changed")


def saved_codes(state_dict: dict) -> dict:
    """`state_dict` with each compact state's codes under CODES_KEY (an offloaded optimizer's
    read back from the tiers has them under "exp_avg_sq"); the given dict and its per-parameter
    dicts (torch's share optimizer.state's) are left alone."""
    if not any(SCALE_KEY in s and "exp_avg_sq" in s for s in state_dict["state"].values()):
        return state_dict
    state = {i: {(CODES_KEY if k == "exp_avg_sq" else k): v for k, v in s.items()}
             if SCALE_KEY in s else s for i, s in state_dict["state"].items()}
    return {**state_dict, "state": state}


def loaded_codes(state_dict: dict) -> dict:
    """`state_dict` with compact codes under CODES_KEY: saved there, or under "exp_avg_sq" (as
    tierlift saved them before CODES_KEY). Checked before a load changes anything: codes that
    are not uint8 beside their scales would be read as moments (torch.optim's load casts them
    to the parameter's dtype)."""
    states = state_dict.get("state")
    if not isinstance(states, dict):
        return state_dict  # torch's load raises on it
    out = {}
    for i, s in states.items():
        if not isinstance(s, dict):
            out[i] = s
            continue
        codes = s.get(CODES_KEY, s.get("exp_avg_sq"))
        is_codes = isinstance(codes, torch.Tensor) and codes.dtype == torch.uint8
        if CODES_KEY in s and "exp_avg_sq" in s:
            raise ValueError(
                f"the state of parameter {i} in the state dict being loaded has both "
                f"'exp_avg_sq' and {CODES_KEY!r}: remove one. Nothing was changed")
        if CODES_KEY in s and not (is_codes and SCALE_KEY in s):
            what = (f"{codes.dtype} codes" if isinstance(codes, torch.Tensor)
                    else type(codes).__name__)
            raise ValueError(
                f"the compact state of parameter {i} in the state dict being loaded has "
                f"{what} under {CODES_KEY!r}" + ("" if SCALE_KEY in s else f" and no {SCALE_KEY!r}")
                + "; expected uint8 codes beside their float32 scales, as "
                "tierlift.optim.AdamW(state_dtype='bf16').state_dict() saves them. A compact "
                "state dict loaded into torch.optim (which casts the codes to float) cannot be "
                "restored from its state_dict(); load the original. Nothing was changed")
        if SCALE_KEY in s and not isinstance(codes, torch.Tensor):
            raise ValueError(
                f"the compact state of parameter {i} in the state dict being loaded has "
                f"{SCALE_KEY!r} but no codes ({CODES_KEY!r}): its second moments cannot be "
                "read. Nothing was changed")
        if is_codes and SCALE_KEY not in s:
            raise ValueError(
                f"the state of parameter {i} in the state dict being loaded has uint8 "
                f"'exp_avg_sq' without {SCALE_KEY!r}: compact codes cannot be read without "
                "their scales. Nothing was changed")
        if is_codes and CODES_KEY not in s:
            s = {(CODES_KEY if k == "exp_avg_sq" else k): v for k, v in s.items()}
        out[i] = s
    return {**state_dict, "state": out}


def check_loaded_moments(states: dict) -> None:
    """Before a load changes anything: a parameter's state with a step count but no moments
    would restart Adam from zero moments (offloaded) or from step 0 (in memory) without a word;
    torch's Adam raises at its step instead."""
    for i, s in states.items():
        if isinstance(s, dict) and "step" in s and not isinstance(s.get("exp_avg"), torch.Tensor):
            raise ValueError(
                f"the state of parameter {i} in the state dict being loaded has a step count but "
                f"no 'exp_avg' tensor (keys: {sorted(map(str, s))}), so its moments would restart "
                "from zero. torch.distributed.checkpoint's set_state_dict with "
                "flatten_optimizer_state_dict=True rebuilds the state from optimizer.state's "
                "keys, which need not be the saved state's: load the unflattened state dict "
                "(flatten_optimizer_state_dict=False). Nothing was changed")
