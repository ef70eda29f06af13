"""One Python wrapper per tierlift op, plus the fake (meta) kernel of every op so the ops trace
under torch.compile and pass torch.library.opcheck.

Wrappers call torch.ops.tierlift.* when the compiled extension is loaded, else the pure-torch
reference (with the one-time warning _extension already gave). check_adam_hyper validates the
hyperparameters of adam_step_ for both of its callers (tierlift.optim and tierlift.offload).
"""

from __future__ import annotations

import math

import torch

from tierlift import _extension, reference


def _has_kernel(tensor: torch.Tensor) -> bool:
    if not _extension.available():
        return False
    return tensor.device.type == "cpu" or (tensor.is_cuda and _extension.has_cuda_kernels())


def runs_kernel(tensor: torch.Tensor) -> bool:
    """Whether an op on `tensor` runs one of tierlift's compiled kernels (CPU or CUDA), not the
    pure-torch reference."""
    return _has_kernel(tensor)


def _adam_op(name, tensor_lists, lr, beta1, beta2, eps, weight_decay, step, *flags,
             grad_scale=None, refresh_from_copies=False, sources=None) -> None:
    """Calls the Adam op `name` (its compiled kernel, else its reference) with the schema's
    argument types: the six tensor lists as lists, the hyperparameters as floats, step as an int,
    the trailing flags as bools, grad_scale as a tensor or None, refresh_from_copies as a bool
    and `sources` ({"params_from": [...], ...}, the lists given) as lists."""
    args = (
        *(list(tensors) for tensors in tensor_lists),
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        int(step),
        *(bool(flag) for flag in flags),
    )
    params = args[0]
    amp = {} if grad_scale is None else {"grad_scale": grad_scale}
    if refresh_from_copies:
        amp["refresh_from_copies"] = True
    amp.update({k: list(v) for k, v in (sources or {}).items() if v is not None})
    if params and _has_kernel(params[0]):
        getattr(torch.ops.tierlift, name)(*args, **amp)
    else:
        getattr(reference, name)(*args, **amp)


def adam_step_(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    param_copies,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    decoupled,
    amsgrad,
    maximize,
    grad_scale=None,
    refresh_from_copies=False,
    params_from=None,
    exp_avgs_from=None,
    exp_avg_sqs_from=None,
    max_exp_avg_sqs_from=None,
) -> None:
    """Fused Adam/AdamW update of fp32 `params` (weights or master weights) in place.

    `param_copies` is empty or holds, per param, a tensor that receives the updated weight in its
    own dtype (bf16/fp16/fp32): the low-precision model weight whose master `params` is.
    `grad_scale` (AMP) is None or GradScaler's scale, a 1-element float32 tensor on the params'
    device: the gradients are still scaled, and each is multiplied by float(1 / scale) before
    use, exactly as GradScaler.unscale_ would (the CUDA kernel reads it without a host sync).
    `refresh_from_copies` (needs `param_copies`): an element whose copy is not its param rounded
    to the copy's dtype, bit for bit (the model weight was changed outside the optimizer), is
    stepped from the copy's value instead; the others keep their master's low bits. The CUDA
    kernel does it in the step's own pass. Without it the copies are only written.
    `params_from`, `exp_avgs_from`, `exp_avg_sqs_from`, `max_exp_avg_sqs_from` (CPU; None: in
    place): per param, where the old weight or moment is read, while the new one is written to
    `params`, `exp_avgs`, ...: the same step out of place, bit for bit (each source is the tensor
    it stands in for or memory apart from it; not with `refresh_from_copies`).
    """
    _adam_op(
        "adam_step_",
        (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies),
        lr, beta1, beta2, eps, weight_decay, step, decoupled, amsgrad, maximize,
        grad_scale=grad_scale, refresh_from_copies=refresh_from_copies,
        sources={"params_from": params_from, "exp_avgs_from": exp_avgs_from,
                 "exp_avg_sqs_from": exp_avg_sqs_from,
                 "max_exp_avg_sqs_from": max_exp_avg_sqs_from},
    )


def adam_compact_step_(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    exp_avg_sq_scales,
    param_copies,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    decoupled,
    maximize,
    grad_scale=None,
    refresh_from_copies=False,
    params_from=None,
    exp_avgs_from=None,
    exp_avg_sqs_from=None,
    exp_avg_sq_scales_from=None,
) -> None:
    """adam_step_ with compact state: per param, `exp_avgs` bf16, `exp_avg_sqs` uint8 codes and
    `exp_avg_sq_scales` fp32 block maxima, one per 256 elements (format and error bound:
    tierlift.reference.optim_compact). No amsgrad. `grad_scale`, `refresh_from_copies` and the
    `*_from` sources as in adam_step_."""
    _adam_op(
        "adam_compact_step_",
        (params, grads, exp_avgs, exp_avg_sqs, exp_avg_sq_scales, param_copies),
        lr, beta1, beta2, eps, weight_decay, step, decoupled, maximize,
        grad_scale=grad_scale, refresh_from_copies=refresh_from_copies,
        sources={"params_from": params_from, "exp_avgs_from": exp_avgs_from,
                 "exp_avg_sqs_from": exp_avg_sqs_from,
                 "exp_avg_sq_scales_from": exp_avg_sq_scales_from},
    )


# An editable install's library built before the op existed steps through the reference.
_HAS_ADVANCE_STEPS = _extension.available() and hasattr(torch.ops.tierlift, "advance_steps_")


def advance_steps_(steps) -> list[int]:
    """Adds 1 to each optimizer step count in `steps` (1-element tensors, fp32 on the CPU as
    torch keeps them) in place, in one call, and returns the new counts as ints. Under
    torch.compile it runs outside the graph (the counts are data the caller branches on; a
    traced op could not return them): a compiled optimizer steps through adam_group_step_."""
    steps = list(steps)
    return (_advance_outside_graph if torch.compiler.is_compiling() else _advance)(steps)


def _advance(steps: list) -> list[int]:
    if _HAS_ADVANCE_STEPS:
        return torch.ops.tierlift.advance_steps_(steps)
    return reference.advance_steps_(steps)


_advance_outside_graph = torch.compiler.disable(_advance)


def by_count(counts: list[int]) -> dict[int, list[int]]:
    """The positions of each step count, in order of first appearance: one fused call per
    count (parameters that skipped steps keep counts of their own)."""
    positions: dict[int, list[int]] = {}
    for i, count in enumerate(counts):
        positions.setdefault(count, []).append(i)
    return positions


def check_grad_scale_value(scale: float) -> None:
    """The kernels multiply by float32(1 / scale): it must be a finite, nonzero factor."""
    inv = torch.tensor(1.0 / scale if scale != 0 else math.inf, dtype=torch.float32).item()
    if not (0.0 < scale < math.inf and math.isfinite(inv)):
        raise ValueError(f"grad_scale (GradScaler's scale) must be finite and > 0, got {scale}")


def amp_skips(grad_scale, found_inf) -> bool:
    """GradScaler's verdict on this step, read with one host sync: True if it found inf/NaN
    gradients (the step is skipped: weights, state and step counts stay as they are). Otherwise
    checks its scale before anything changes (a CUDA kernel could not refuse it)."""
    if isinstance(found_inf, torch.Tensor) and found_inf.numel() != 1:
        raise ValueError(f"found_inf must be a 1-element tensor, got {found_inf.numel()} "
                         "elements")
    values = [found_inf] if grad_scale is None else [found_inf, grad_scale]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    read = torch.cat([torch.as_tensor(v).detach().reshape(1).to(device, torch.float64)
                      for v in values]).tolist()
    if read[0] != 0.0:
        return True
    if grad_scale is not None:
        check_grad_scale_value(read[1])
    return False


def adam_group_step_(steps, params, grads, exp_avgs, exp_avg_sqs, extra_states, param_copies, *,
                     lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize,
                     compact, grad_scale=None, refresh_from_copies=False, found_inf=None) -> None:
    """A param group's whole step in one op that torch.compile can trace: advances the step
    counts `steps` (as advance_steps_) and runs adam_step_ (adam_compact_step_ if `compact`)
    once per count over the params at that count. `extra_states` is max_exp_avg_sqs (amsgrad),
    exp_avg_sq_scales (compact) or empty; the rest as in adam_step_. The counts never leave
    the op, so a compiled step needs no graph break and no recompilation as they grow.

    `lr` is a float or a 1-element tensor read (and checked) when the op runs: a scheduler that
    updates a tensor lr in place changes a compiled step's lr without a recompile. `found_inf`
    (GradScaler's, with `grad_scale`): nonzero skips the whole step, counts included; otherwise
    the scale's value is checked before anything changes."""
    lr_tensor = lr if isinstance(lr, torch.Tensor) else None
    torch.ops.tierlift.adam_group_step_(
        list(steps), list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
        list(extra_states), list(param_copies), 0.0 if lr_tensor is not None else float(lr),
        float(beta1), float(beta2), float(eps), float(weight_decay), bool(decoupled),
        bool(amsgrad), bool(maximize), bool(compact), grad_scale, bool(refresh_from_copies),
        lr_tensor, found_inf)


# Python-defined (it calls the ops above): every list it updates is declared mutated, and it
# returns nothing, so functionalization (auto_functionalize) takes it.
@torch.library.custom_op(
    "tierlift::adam_group_step_",
    mutates_args=("steps", "params", "exp_avgs", "exp_avg_sqs", "extra_states", "param_copies"),
    schema="(Tensor(a!)[] steps, Tensor(b!)[] params, Tensor[] grads, Tensor(c!)[] exp_avgs, "
           "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] extra_states, Tensor(f!)[] param_copies, "
           "float lr, float beta1, float beta2, float eps, float weight_decay, bool decoupled, "
           "bool amsgrad, bool maximize, bool compact, Tensor? grad_scale, "
           "bool refresh_from_copies, Tensor? lr_tensor=None, Tensor? found_inf=None) -> ()")
def _adam_group_step(steps, params, grads, exp_avgs, exp_avg_sqs, extra_states, param_copies,
                     lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize, compact,
                     grad_scale, refresh_from_copies, lr_tensor=None, found_inf=None) -> None:
    # GradScaler's verdict and scale as the eager step reads them, before any change.
    if found_inf is not None:
        if amp_skips(grad_scale, found_inf):
            return
    elif grad_scale is not None and grad_scale.device.type == "cpu":
        check_grad_scale_value(float(grad_scale))
    if lr_tensor is not None:
        lr = _lr_value(lr_tensor)
    buckets = by_count(advance_steps_(steps))
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                 decoupled=decoupled, maximize=maximize, grad_scale=grad_scale,
                 refresh_from_copies=refresh_from_copies)
    lists = (params, grads, exp_avgs, exp_avg_sqs, extra_states, param_copies)
    for step, index in buckets.items():
        taken = lists if len(buckets) == 1 else [[t[i] for i in index] if t else t
                                                 for t in lists]
        if compact:
            adam_compact_step_(*taken, step=step, **hyper)
        else:
            adam_step_(*taken, step=step, amsgrad=amsgrad, **hyper)


@_adam_group_step.register_fake
def _adam_group_step_fake(*args) -> None:
    return None


@torch.library.custom_op("tierlift::adam_lr_values", mutates_args=())
def adam_lr_values(lrs: list[torch.Tensor]) -> torch.Tensor:
    """The values of the tensor lrs of a compiled step's groups, checked (check_adam_hyper's
    rule) and returned as float64 on the CPU: every group's op reads its lr from this output, so
    the check runs before any group changes, and a bad lr in one group leaves all as they were."""
    return torch.tensor([_lr_value(lr) for lr in lrs], dtype=torch.float64)


def _lr_value(lr: torch.Tensor) -> float:
    """A tensor lr's value, checked as check_adam_hyper checks it."""
    v = _finite("lr", lr)
    if v < 0:
        raise ValueError(f"lr must be >= 0, got {v}")
    return v


@adam_lr_values.register_fake
def _adam_lr_values_fake(lrs):
    return torch.empty(len(lrs), dtype=torch.float64)


def _finite(name: str, value) -> float:
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"Tensor {name} must be 1-element, got {value.numel()} elements")
    v = float(value.item() if isinstance(value, torch.Tensor) else value)
    # a comparison, not math.isfinite: under torch.compile a float lr that changed between
    # steps is symbolic, which dynamo can guard on but not pass to math.isfinite (NaN and
    # infinities fail it alike)
    if not abs(v) < math.inf:
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def check_adam_hyper(lr, betas, eps, weight_decay) -> None:
    """Raises a ValueError naming the first bad Adam hyperparameter (as a param group holds
    them); the steppers call it before they change anything."""
    lr_v = _finite("lr", lr)
    if lr_v < 0:
        raise ValueError(f"lr must be >= 0, got {lr_v}")
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair, got {betas!r}")
    for i, b in enumerate(betas):
        if not 0.0 <= _finite(f"betas[{i}]", b) < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {b}")
    if _finite("eps", eps) < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if _finite("weight_decay", weight_decay) < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


if _extension.available():

    def _adam_fake(*args, **kwargs):
        """Both Adam ops update their tensors in place and return nothing."""
        return None

    torch.library.register_fake("tierlift::adam_step_")(_adam_fake)
    torch.library.register_fake("tierlift::adam_compact_step_")(_adam_fake)

if _HAS_ADVANCE_STEPS:

    @torch.library.register_fake("tierlift::advance_steps_")
    def _advance_steps_fake(steps):
        """Refuses: functionalization takes no integers from an op that mutates its inputs,
        and these integers are data (an unbacked integer for an int[] is no fake either)."""
        raise RuntimeError(
            "tierlift::advance_steps_ cannot be traced: it updates its tensors in place and "
            "returns their values as integers, which torch.compile cannot functionalize; "
            "tierlift.ops.advance_steps_ runs it outside the graph, and "
            "tierlift::adam_group_step_ keeps the counts inside one op")


# ---- gather ----


def gather_rows(table, index, out, *, cache_table=None, cache_slots=None,
                bad_index=None, locality="index", kernel="auto") -> None:
    """out[i] = table[index[i]] (rows of any size and dtype), bounds-checked.

    On CUDA (`out` on the GPU), `table` is a CPU tensor in pinned, mapped host memory that the
    kernel reads directly, and rows with `cache_slots[row] >= 0` come from `cache_table` (GPU).
    An out-of-range or negative index raises IndexError naming its position; it is never read.
    With `bad_index` (int64 [2] holding -1s, on out's device) the check is deferred: nothing
    raises and the CUDA op does not synchronise; the (position, value) of a bad index is stored
    there unless slot 0 already holds one, and that row of `out` is not written.
    `locality="sorted"` has the CUDA kernel read rows in ascending row order (the index sorted
    on the device; each row still lands at its own position); `kernel` ("auto", "warp",
    "grouped") picks the CUDA kernel's shape. The CPU gather ignores both (same result).
    """
    _check_gather_choices(locality, kernel)
    if isinstance(out, torch.Tensor):
        # The op writes out's memory without autograd or the lazy conj/neg bit: torch refuses
        # the first for its own out= ops, and a conj/neg view would abort inside the dispatcher.
        if out.requires_grad:
            raise ValueError("gather_rows: out requires grad, and gather_rows is not "
                             "differentiable; gather into a tensor that does not require grad")
        if out.is_conj() or out.is_neg():
            raise ValueError("gather_rows: out is a conjugate or negative view; gather into a "
                             "plain tensor (call .resolve_conj()/.resolve_neg() on a copy)")
    for name, src in (("table", table), ("index", index)):
        if isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) \
                and _overlap(out, src):
            raise ValueError(f"gather_rows: out shares memory with {name}, so rows would be "
                             f"read after being overwritten; gather into a separate tensor")
    if _extension.available() and (out.device.type == "cpu" or _extension.has_cuda_kernels()):
        torch.ops.tierlift.gather_rows(table, index, cache_table, cache_slots, out, bad_index,
                                       locality, kernel)
    else:
        reference.gather_rows(table, index, cache_table, cache_slots, out, bad_index)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two strided tensors' byte spans in one storage intersect (conservative). By
    storage, not data_ptr, which fake tensors (torch.compile) do not have."""
    if a.numel() == 0 or b.numel() == 0 \
            or a.untyped_storage()._cdata != b.untyped_storage()._cdata:
        return False

    def span(t):
        start = t.storage_offset() * t.element_size()
        return start, start + t.element_size() * (1 + sum((n - 1) * st for n, st in
                                                          zip(t.shape, t.stride())))

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


GATHER_LOCALITIES = ("index", "sorted")
GATHER_KERNELS = ("auto", "warp", "grouped")


def _check_gather_choices(locality, kernel) -> None:
    if locality not in GATHER_LOCALITIES:
        raise ValueError(f"gather_rows: locality must be one of {GATHER_LOCALITIES}, "
                         f"got {locality!r}")
    if kernel not in GATHER_KERNELS:
        raise ValueError(f"gather_rows: kernel must be one of {GATHER_KERNELS}, got {kernel!r}")


if _extension.available():

    @torch.library.register_fake("tierlift::gather_rows")
    def _gather_rows_fake(table, index, cache_table, cache_slots, out, bad_index=None,
                          locality="index", kernel="auto"):
        return None


# ---- lowp ----


def fp8_quantize(x: torch.Tensor, scaling: str, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                 pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D fp32/bf16/fp16 tensor to FP8: returns (q, scales) with q = cast(x * scale).

    scaling: "tensor" | "row" | "col" | "1x128" | "128x128"; scales are fp32
    [ceil(rows / block_h), ceil(cols / block_w)]. Rules: tierlift.reference.lowp.
    """
    if _has_kernel(x):
        return torch.ops.tierlift.fp8_quantize(x, scaling, fp8_dtype, bool(pow2_scale))
    return reference.fp8_quantize(x, scaling, fp8_dtype, bool(pow2_scale))


def fp8_quantize_dual(x: torch.Tensor, scaling: str, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                      pow2_scale: bool = False):
    """(q, scales, qt, scales_t): fp8_quantize(x) and fp8_quantize(x.t()) in one pass over x."""
    if _has_kernel(x):
        return torch.ops.tierlift.fp8_quantize_dual(x, scaling, fp8_dtype, bool(pow2_scale))
    return reference.fp8_quantize_dual(x, scaling, fp8_dtype, bool(pow2_scale))


def fp8_quantize_delayed(x: torch.Tensor, scale: torch.Tensor,
                         fp8_dtype: torch.dtype = torch.float8_e4m3fn, dual: bool = False,
                         pow2_scale: bool = False):
    """(q, scale_used, qt or None, amax): tensorwise FP8 with a scale chosen ahead, in one pass
    over x unless the scale would clip (then x's own scale). Rules:
    tierlift.reference.lowp.fp8_quantize_delayed. The compiled op takes `scale` as a one-element
    fp32 tensor on x's device; on CPU it must be finite and > 0."""
    if _has_kernel(x):
        return torch.ops.tierlift.fp8_quantize_delayed(x, scale, fp8_dtype, bool(dual),
                                                       bool(pow2_scale))
    return reference.fp8_quantize_delayed(x, scale, fp8_dtype, bool(dual), bool(pow2_scale))


def fp8_quantize_from_history(x: torch.Tensor, history: torch.Tensor,
                              fp8_dtype: torch.dtype = torch.float8_e4m3fn, dual: bool = False,
                              pow2_scale: bool = False):
    """(q, scale, qt or None, amax): fp8_quantize_delayed with the scale an amax history (1-D
    fp32 on x's device) gives, computed where x is (on a GPU without a host sync); scale is 1
    where x has no finite non-zero value. Rules:
    tierlift.reference.lowp.fp8_quantize_from_history."""
    if _has_kernel(x):
        return torch.ops.tierlift.fp8_quantize_from_history(x, history, fp8_dtype, bool(dual),
                                                            bool(pow2_scale))
    return reference.fp8_quantize_from_history(x, history, fp8_dtype, bool(dual),
                                               bool(pow2_scale))


if _extension.available():

    def _fp8_fake(x, scaling, fp8_dtype, transpose):
        from tierlift.reference.lowp import check_quantize_args, scales_shape

        check_quantize_args(x, scaling, fp8_dtype)
        rows, cols = (x.shape[1], x.shape[0]) if transpose else (x.shape[0], x.shape[1])
        q = x.new_empty((rows, cols), dtype=fp8_dtype)
        return q, x.new_empty(scales_shape(scaling, rows, cols), dtype=torch.float32)

    @torch.library.register_fake("tierlift::fp8_quantize")
    def _fp8_quantize_fake(x, scaling, fp8_dtype, pow2_scale):
        return _fp8_fake(x, scaling, fp8_dtype, False)

    @torch.library.register_fake("tierlift::fp8_quantize_dual")
    def _fp8_quantize_dual_fake(x, scaling, fp8_dtype, pow2_scale):
        return (*_fp8_fake(x, scaling, fp8_dtype, False), *_fp8_fake(x, scaling, fp8_dtype, True))

    @torch.library.register_fake("tierlift::fp8_quantize_delayed")
    def _fp8_quantize_delayed_fake(x, scale, fp8_dtype, dual, pow2_scale):
        if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != x.device:
            raise ValueError(f"scale must be a one-element float32 tensor on x's device "
                             f"{x.device}, got {scale.dtype} {tuple(scale.shape)} on "
                             f"{scale.device}")
        q, scale_used = _fp8_fake(x, "tensor", fp8_dtype, False)
        qt = _fp8_fake(x, "tensor", fp8_dtype, True)[0] if dual else None
        return q, scale_used, qt, x.new_empty((1,), dtype=torch.float32)

    @torch.library.register_fake("tierlift::fp8_quantize_from_history")
    def _fp8_quantize_from_history_fake(x, history, fp8_dtype, dual, pow2_scale):
        from tierlift.reference.lowp import check_history

        q, scale = _fp8_fake(x, "tensor", fp8_dtype, False)
        check_history(x, history)
        qt = _fp8_fake(x, "tensor", fp8_dtype, True)[0] if dual else None
        return q, scale, qt, x.new_empty((1,), dtype=torch.float32)


# ---- zero ----


def flatten_pack_(flat: torch.Tensor, tensors) -> None:
    """Copy `tensors` back to back into the 1-D `flat` and zero the padding after them."""
    tensors = list(tensors)
    if _has_kernel(flat):
        torch.ops.tierlift.flatten_pack_(flat, tensors)
    else:
        reference.flatten_pack_(flat, tensors)


def unflatten_(flat: torch.Tensor, tensors) -> None:
    """Copy consecutive slices of the 1-D `flat` into `tensors` (each contiguous), in place."""
    tensors = list(tensors)
    if _has_kernel(flat):
        torch.ops.tierlift.unflatten_(flat, tensors)
    else:
        reference.unflatten_(flat, tensors)


if _extension.available():

    @torch.library.register_fake("tierlift::flatten_pack_")
    def _flatten_pack_fake(flat, tensors):
        return None

    @torch.library.register_fake("tierlift::unflatten_")
    def _unflatten_fake(flat, tensors):
        return None


# ---- lowp_fp4 ----


def fp4_quantize(x: torch.Tensor, scale_rule: str, hadamard: int = 0, signs: int = 0,
                 stochastic: bool = False, seed: int = 0, offset: int = 0, block_2d: bool = False,
                 want_mask: bool = False):
    """Quantize a 2-D fp32/bf16/fp16 tensor to FP4 along its rows, optionally Hadamard-rotated.

    scale_rule: "floor" | "rceil" | "quest" (MXFP4, E8M0 scale per 1x32) or "nv" (NVFP4, E4M3
    scale per 1x16, or 16x16 with block_2d, plus an fp32 tensor scale). Returns (codes uint8
    [rows, cols/2] two E2M1 codes per byte, scale codes uint8, tensor_scale fp32 [1], clip mask
    bool [rows, cols] or empty). Rules: tierlift.reference.lowp_fp4.
    """
    args = (scale_rule, int(hadamard), int(signs), bool(stochastic), int(seed), int(offset),
            bool(block_2d), bool(want_mask))
    if _has_kernel(x):
        return torch.ops.tierlift.fp4_quantize(x, *args)
    return reference.fp4_quantize(x, *args)


if _extension.available():

    @torch.library.register_fake("tierlift::fp4_quantize")
    def _fp4_quantize_fake(x, scale_rule, hadamard, signs, stochastic, seed, offset, block_2d,
                           want_mask):
        from tierlift.reference.lowp_fp4 import check_fp4_args, scales_shape

        check_fp4_args(x, scale_rule, hadamard, signs, block_2d)
        rows, cols = x.shape
        codes = x.new_empty((rows, cols // 2), dtype=torch.uint8)
        scales = x.new_empty(scales_shape(scale_rule, rows, cols, block_2d), dtype=torch.uint8)
        mask = x.new_empty((rows, cols) if want_mask else (0,), dtype=torch.bool)
        return codes, scales, x.new_empty((1,), dtype=torch.float32), mask
