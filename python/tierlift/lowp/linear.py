"""Float8Linear: nn.Linear whose three GEMMs run in FP8.

forward   y  = x @ W^T          x, W quantized to E4M3
backward  gx = gy @ W           gy in E5M2, W's column-major copy (E4M3)
          gW = gy^T @ x         gy^T in E5M2, x's column-major copy (E4M3); or in high precision
Each operand is scaled along its GEMM's reduction dimension (rowwise recipes) or per tensor.
The forward quantizes x and W once each; the dual quantizer, which also emits the transposed
copy from the same reads, runs only where a backward GEMM reads that copy (x^T: the FP8 weight
gradient; W^T: the input gradient). The FP8 copies (not x itself) are what is saved for
backward, so activation memory is half of bf16's. The backward quantizes grad_out once, dual
only when both gradients are FP8 GEMMs, and skips the GEMM of a gradient nobody asked for.
Float8Recipe.transposed_copy="separate" makes the transposed copies after q instead (same bits).
docs/lowp.md ("Passes over memory") lists what each recipe moves; tests/python/
test_lowp_passes.py pins it.

A delayed recipe (Float8Recipe.amax_history_len > 0) takes x's and grad_out's scales from amax
histories kept by the layer (lowp/delayed.py); the functional float8_linear keeps no state, so
there every scale is just in time, as fp8-tensorwise's.

Under ZeRO-3 with fp8_all_gather=True (tierlift.zero.shard) the weight arrives already
quantized: the layer's `gathered_weight_fn` returns a GatheredFloat8Weight (codes + scales,
bit-identical to what the forward would compute from the gathered weight) while it is current,
and the forward uses it instead of quantizing `weight`. The weight stays the autograd input, so
its gradient lands where it always does. The dgrad operand (W scaled along its columns) is
derived from the gathered codes: tensorwise, the transpose of the same bytes with the same scale
(bit-identical); rowwise, the codes dequantized (exactly, power-of-two scales) and requantized
per column (a second rounding: close, not bit-identical; see docs/lowp.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from tierlift import ops
from tierlift.lowp import delayed
from tierlift.lowp.gemm import has_autocast, scaled_mm
from tierlift.lowp.recipe import Float8Recipe, get_recipe


@dataclass(kw_only=True, eq=False)
class GatheredFloat8Weight:
    """A weight quantized before the forward (ZeRO-3 FP8 all-gather): data [out, in] row-major
    FP8 codes, scale [1, 1] (tensorwise) or [out, 1] (rowwise), q = cast(W * scale)."""

    data: torch.Tensor
    scale: torch.Tensor
    recipe: Float8Recipe
    _transposed: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def transposed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W^T codes [in, out], scales [1, 1] or [in, 1]) for the dgrad GEMM, made once."""
        if self._transposed is None:
            r = self.recipe
            if r.scaling == "tensor":  # same scale, same bytes: exactly the dual quantizer's
                self._transposed = (self.data.t().contiguous(), self.scale)
            else:  # per column of W: dequantize, requantize (a second rounding)
                w = self.data.float() / self.scale
                # W^T's rows are W's columns: the quantizer reads the transposed view and writes
                # the [in, out] codes directly (no transposing copy of them afterwards)
                self._transposed = ops.fp8_quantize(w.t(), "row", r.forward_dtype, r.pow2_scale)
        return self._transposed


def _quantize(t: torch.Tensor, with_transposed: bool, scaling: str, fp8_dtype: torch.dtype,
              pow2: bool, transposed_copy: str = "dual") -> tuple[torch.Tensor | None, ...]:
    """(q, s, qt, st); qt, st None unless asked for. The dual quantizer emits both from the
    same reads; alone, q costs one read fewer on the GPU (row scaling) and no second write.
    transposed_copy="separate" (Float8Recipe) makes qt after q instead, with the same bits."""
    if with_transposed and transposed_copy == "dual":
        return ops.fp8_quantize_dual(t, scaling, fp8_dtype, pow2)
    q, s = ops.fp8_quantize(t, scaling, fp8_dtype, pow2)
    if not with_transposed:
        return q, s, None, None
    if scaling == "tensor":  # one scale: q^T is q's codes transposed
        return q, s, q.t().contiguous(), s
    return (q, s, *ops.fp8_quantize(t.t(), scaling, fp8_dtype, pow2))


class _Float8MatmulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: Float8Recipe,
                gathered: GatheredFloat8Weight | None, grad_enabled: bool,
                layer: nn.Module | None):
        sc, p2, f8, tc = (recipe.scaling, recipe.pow2_scale, recipe.forward_dtype,
                          recipe.transposed_copy)
        # needs_input_grad follows requires_grad even under no_grad, where no backward follows
        need_gx = grad_enabled and ctx.needs_input_grad[0]
        need_gw = grad_enabled and ctx.needs_input_grad[1]
        fp8_wgrad = need_gw and not recipe.grad_weight_high_precision
        ctx.layer = layer  # a delayed recipe's layer: its histories; else None
        if layer is None:
            xq, xs, xtq, xts = _quantize(x, fp8_wgrad, sc, f8, p2, tc)  # x^T: the FP8 wgrad's
        else:
            xq, xs, xtq, xts, ctx.amax_x = delayed.quantize_from_history(
                x, delayed.forward_history(layer, "x"), f8, p2, fp8_wgrad, tc)
            if (need_gx or need_gw) and not delayed.recomputing():
                ctx.awaiting = delayed.AwaitingBackward(delayed.pending(layer))
            # g's history as this forward saw it: the backward may run where the layer holds
            # other tensors (a functional_call given the histories has put its own back by then)
            ctx.g_history = delayed.forward_history(layer, "g")
        if gathered is None:
            wq, ws, wtq, wts = _quantize(weight, need_gx, sc, f8, p2, tc)  # W^T: the dgrad's
        else:
            wq, ws = gathered.data, gathered.scale
            wtq, wts = gathered.transposed() if need_gx else (None, None)
        ctx.recipe = recipe
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        if recipe.grad_weight_high_precision:
            ctx.save_for_backward(x if need_gw else None, wtq, wts)
        else:
            ctx.save_for_backward(xtq, xts, wtq, wts)
        return scaled_mm(xq, xs, wq, ws, out_dtype=x.dtype)

    @staticmethod
    @once_differentiable  # its GEMMs are not differentiable: a second derivative is refused
    def backward(ctx, grad_out: torch.Tensor):
        r, layer = ctx.recipe, ctx.layer
        need_gx, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g = grad_out.contiguous()
        grad_x = grad_w = None
        amax_g = []  # a delayed layer's: g's amax, once g is quantized

        def quantize_g(t, with_transposed, transposed_copy="dual"):
            if layer is None:
                return _quantize(t, with_transposed, r.scaling, r.grad_dtype, r.pow2_scale,
                                 transposed_copy)
            *out, amax = delayed.quantize_from_history(t, ctx.g_history,
                                                       r.grad_dtype, r.pow2_scale,
                                                       with_transposed, transposed_copy)
            amax_g.append(amax)
            return out

        if r.grad_weight_high_precision:
            x, wtq, wts = ctx.saved_tensors
            if need_gw:
                grad_w = (g.t().to(x.dtype) @ x).to(ctx.w_dtype)
            gq = gs = None
            if need_gx:
                gq, gs, _, _ = quantize_g(g, False)
        else:
            xtq, xts, wtq, wts = ctx.saved_tensors
            if need_gx:  # g for the dgrad, and g^T from the same reads when the wgrad wants it
                gq, gs, gtq, gts = quantize_g(g, need_gw, r.transposed_copy)
            elif need_gw:  # g^T alone: quantizing the transposed view writes only its codes
                gtq, gts, _, _ = quantize_g(g.t(), False)
            if need_gw:
                grad_w = scaled_mm(gtq, gts, xtq, xts, out_dtype=ctx.w_dtype)
        if need_gx:
            grad_x = scaled_mm(gq, gs, wtq, wts, out_dtype=ctx.x_dtype)
        if layer is not None:  # the same order on every rank: g's amax, then x's
            queue, length = delayed.pending(layer), r.amax_history_len
            for amax in amax_g:
                queue.push("g", amax, r.reduce_amax, length)
            # x was quantized once: a second backward of the graph (retain_graph) adds only g's
            amax_x, ctx.amax_x = ctx.amax_x, None
            if amax_x is not None:
                queue.push("x", amax_x, r.reduce_amax, length)
            awaiting = getattr(ctx, "awaiting", None)
            if awaiting is not None:
                awaiting.done()
        return grad_x, grad_w, None, None, None, None


QUANTIZED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the quantizers' inputs
_DTYPE_NAMES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
                torch.bfloat16: "BFloat16"}  # c10's names, as F.linear's errors spell them


def refuse_nested(x: torch.Tensor) -> None:
    """The quantizers and GEMMs take one dense [tokens, features] matrix; a nested tensor
    failed deep inside with torch's internal "NestedTensorImpl doesn't support sizes"."""
    if x.is_nested:
        raise TypeError("low precision layers take dense inputs, not nested tensors (an "
                        "nn.TransformerEncoder makes them in eval from a padding mask unless built "
                        "with enable_nested_tensor=False, or converted by tierlift.lowp.convert "
                        "together with its layers)")


def _runs_its_own_forward(module: nn.Module, args) -> None:
    """A forward pre-hook that changes nothing: its presence is what turns torch's fused paths
    off (nn.TransformerEncoderLayer's eval fast path hands linear1/linear2's weights to one fused
    kernel and never calls their forward while no module of the layer has a hook)."""


def keep_off_fused_paths(module: nn.Module) -> None:
    """Gives a low precision layer its no-op pre-hook, once: built directly, by from_linear or
    by convert, and wherever it is put, its forward runs (a fused path would silently run the
    layer in high precision)."""
    if _runs_its_own_forward not in module._forward_pre_hooks.values():
        module.register_forward_pre_hook(_runs_its_own_forward)


def linear_input(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """x in the dtype nn.Linear would multiply it in: autocast's where autocast is on (which
    casts fp32/bf16/fp16 operands, never fp64), else its own. Operands whose dtypes would then
    differ are refused with F.linear's error: low precision layers would otherwise run the
    GEMM anyway (weight and input are quantized separately) and return the input's dtype."""
    def effective(t: torch.Tensor) -> torch.dtype:
        if autocast and t.is_floating_point() and t.dtype != torch.float64:
            return torch.get_autocast_dtype(x.device.type)
        return t.dtype

    # meta has no autocast (torch.is_autocast_enabled refuses it): nn.Linear runs there
    autocast = has_autocast(x.device.type) and torch.is_autocast_enabled(x.device.type)
    xd, wd = effective(x), effective(weight)
    pairs = [("mat1 and mat2", xd, wd)]
    if bias is not None:
        pairs.append(("self and mat2", effective(bias), wd))
    for what, a, b in pairs:
        if a != b:
            raise RuntimeError(
                f"{what} must have the same dtype, but got {_DTYPE_NAMES.get(a, a)} and "
                f"{_DTYPE_NAMES.get(b, b)} (as nn.Linear refuses them: cast the input to the "
                f"layer's dtype, or run under torch.autocast)")
    if xd not in QUANTIZED_DTYPES:  # before a delayed layer's history would be read
        raise TypeError(f"low precision layers take float32, bfloat16 or float16 inputs and "
                        f"weights (what their quantizers read), got {_DTYPE_NAMES.get(xd, xd)}: "
                        f"cast the model back (model.float()) or keep this layer in high "
                        f"precision (tierlift.lowp.convert's module_filter_fn) before casting it")
    return x.to(xd) if xd != x.dtype else x


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  recipe: str | Float8Recipe = "fp8-rowwise",
                  gathered: GatheredFloat8Weight | None = None) -> torch.Tensor:
    """Functional form: F.linear(x, weight, bias) with FP8 GEMMs (x: [..., in_features]).

    `gathered`: weight's FP8 copy made with this recipe (ZeRO-3 FP8 all-gather), used instead
    of quantizing `weight`, which still receives the gradient. It keeps no state: a delayed
    recipe's scales are just in time here (Float8Linear keeps the amax histories)."""
    return _float8_linear(x, weight, bias, get_recipe(recipe), gathered, None)


def _float8_linear(x, weight, bias, recipe: Float8Recipe, gathered, layer) -> torch.Tensor:
    if gathered is not None:
        if gathered.recipe != recipe:
            raise ValueError(f"gathered was quantized with recipe {gathered.recipe.name!r}, the "
                             f"layer uses {recipe.name!r}")
        if tuple(gathered.data.shape) != tuple(weight.shape):
            raise ValueError(f"gathered has shape {tuple(gathered.data.shape)}, weight has "
                             f"{tuple(weight.shape)}")
    refuse_nested(x)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x must have {weight.shape[1]} features in its last dimension, got "
                         f"shape {tuple(x.shape)}")
    x = linear_input(x, weight, bias)
    lead = x.shape[:-1]
    y = _Float8MatmulFn.apply(x.reshape(-1, x.shape[-1]), weight, recipe, gathered,
                              torch.is_grad_enabled(), layer)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, weight.shape[0])


class Float8Linear(nn.Linear):
    """Drop-in nn.Linear with FP8 forward/backward GEMMs; parameters stay in their dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: str | Float8Recipe = "fp8-rowwise", device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = get_recipe(recipe)
        # Set by tierlift.zero.shard(..., fp8_all_gather=True): the current FP8 copy or None.
        self.gathered_weight_fn: Callable[[], GatheredFloat8Weight | None] | None = None
        keep_off_fused_paths(self)
        delayed.attach(self, self.recipe, self.weight.device)

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe: str | Float8Recipe = "fp8-rowwise"
                    ) -> Float8Linear:
        """A Float8Linear sharing `mod`'s parameters (no copy)."""
        new = cls(mod.in_features, mod.out_features, bias=False, recipe=recipe, device="meta")
        new.weight = mod.weight
        new.bias = mod.bias
        new.train(mod.training)
        delayed.attach(new, new.recipe, mod.weight.device)  # not on meta
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = getattr(self, "gathered_weight_fn", None)  # absent in modules pickled before it
        gathered = fn() if fn is not None else None
        if self.recipe.delayed:
            return self._delayed_forward(x, gathered)
        return _float8_linear(x, self.weight, self.bias, self.recipe, gathered, None)

    # The histories' host-side queue is Python state torch.compile cannot trace: the layer runs
    # eagerly there (a graph break; fullgraph=True refuses it), with the same numbers.
    @torch.compiler.disable
    def _delayed_forward(self, x: torch.Tensor, gathered) -> torch.Tensor:
        if delayed.pending(self) is None:  # a delayed recipe set on the layer by hand
            raise RuntimeError(f"this Float8Linear has no amax histories for recipe "
                               f"{self.recipe.name!r}: build it with the recipe (Float8Linear("
                               f"..., recipe=...), from_linear or tierlift.lowp.convert) instead "
                               f"of setting .recipe")
        delayed.flush_unless_recomputing(self)
        return _float8_linear(x, self.weight, self.bias, self.recipe, gathered, self)

    # State of a delayed recipe's layer: the queued amaxes enter the histories before anything
    # reads or copies them, and a load without them (nn.Linear's state_dict) resets them.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        queue = delayed.pending(self)
        if queue is not None:
            queue.flush(self)
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        queue = delayed.pending(self)
        # a dict without any of this layer's entries (strict=False: an adapter's, a partial
        # one) leaves its histories and queue as it leaves its weights
        if queue is not None and delayed.describes(state_dict, prefix, self):
            queue.drop()
        else:
            queue = None
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if queue is not None:
            delayed.load_or_reset(self, state_dict, prefix, missing_keys)

    def _apply(self, fn, recurse=True):
        before = dict(self._buffers)
        out = super()._apply(fn, recurse)
        if delayed.pending(self) is not None:
            delayed.keep_fp32(self, before)
        return out

    def __getstate__(self):  # deepcopy and pickle: the queue (with its collectives) is written
        queue = delayed.pending(self)
        if queue is not None:
            queue.flush(self)
        return super().__getstate__()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"
