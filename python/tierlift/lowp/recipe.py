"""FP8 training recipes: which scaling each GEMM operand gets.

  fp8-tensorwise     one scale per tensor for x, W (E4M3) and grad_output (E5M2)
  fp8-rowwise        one scale per row along each GEMM's reduction dimension, power-of-two
                     scales (exact dequantization, as torchao's rowwise recipe)
  fp8-rowwise-gw-hp  rowwise, but grad_weight = grad_output^T @ x in high precision (the GEMM
                     whose error hurts most, torchao's rowwise_with_gw_hp)
  fp8-tensorwise-delayed  tensorwise, x's and grad_output's scales from the max of their last 16
                     amaxes (TransformerEngine's DelayedScaling, torchao's former delayed
                     scaling): one pass over x and g instead of two (lowp/delayed.py)

amax_history_len > 0 makes a recipe delayed (tensor scaling only); reduce_amax (TransformerEngine's
name) all-reduces each amax (MAX) over the default process group before it enters a history:
every rank must then run the same delayed layers' backwards in the same order, and a reduction
that paired different layers' amaxes is refused (lowp/delayed.py); experts routed per rank take
reduce_amax=False.

transposed_copy chooses how a transposed FP8 copy (the x^T, W^T, g^T a backward GEMM reads) is
made, with the same bits either way: "dual" (default) emits it from the quantizer's own reads
(fewest bytes: 2 reads, 2 one-byte writes per element); "separate" quantizes q alone, then
transposes q's codes (tensorwise) or quantizes the input's transposed view (rowwise): more bytes,
other kernels. Which is faster is a GPU measurement (benchmarks/bench_lowp.py times both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True, kw_only=True)
class Float8Recipe:
    name: str
    scaling: str  # "tensor" or "row"
    pow2_scale: bool
    grad_weight_high_precision: bool
    forward_dtype: torch.dtype = torch.float8_e4m3fn
    grad_dtype: torch.dtype = torch.float8_e5m2
    transposed_copy: str = "dual"  # "dual" or "separate" (module docstring)
    amax_history_len: int = 0  # 0: every scale just in time; > 0: delayed scaling
    reduce_amax: bool = True  # delayed: the same history on every data-parallel rank

    def __post_init__(self):
        if self.scaling not in ("tensor", "row"):
            raise ValueError(f"scaling must be 'tensor' or 'row', got {self.scaling!r}")
        for what in ("forward_dtype", "grad_dtype"):
            # checked here, not at the first forward: convert() would already have swapped the
            # layers of the model in place by then
            if getattr(self, what) not in FP8_DTYPES:
                raise ValueError(f"{what} must be one of {FP8_DTYPES} (what the quantizers and "
                                 f"torch._scaled_mm take), got {getattr(self, what)}")
        if self.transposed_copy not in ("dual", "separate"):
            raise ValueError(f"transposed_copy must be 'dual' or 'separate', got "
                             f"{self.transposed_copy!r}")
        if type(self.amax_history_len) is not int or self.amax_history_len < 0:
            raise ValueError(f"amax_history_len must be an int >= 0, got "
                             f"{self.amax_history_len!r}")
        if self.amax_history_len and self.scaling != "tensor":
            # a history per row would be one per row of every activation: not what TE or
            # torchao keep, and the quantizer with a scale chosen ahead is tensorwise only
            raise ValueError(f"amax_history_len={self.amax_history_len} (delayed scaling) needs "
                             f"scaling='tensor', got {self.scaling!r}")
        if not isinstance(self.reduce_amax, bool):
            raise TypeError(f"reduce_amax must be a bool, got {type(self.reduce_amax).__name__}")

    @property
    def delayed(self) -> bool:
        return getattr(self, "amax_history_len", 0) > 0  # absent in recipes pickled before it


RECIPES: dict[str, Float8Recipe] = {
    r.name: r
    for r in (
        Float8Recipe(name="fp8-tensorwise", scaling="tensor", pow2_scale=False,
                     grad_weight_high_precision=False),
        Float8Recipe(name="fp8-rowwise", scaling="row", pow2_scale=True,
                     grad_weight_high_precision=False),
        Float8Recipe(name="fp8-rowwise-gw-hp", scaling="row", pow2_scale=True,
                     grad_weight_high_precision=True),
        # 16: torchao's default history length; the window's max is TE's "max" algorithm
        Float8Recipe(name="fp8-tensorwise-delayed", scaling="tensor", pow2_scale=False,
                     grad_weight_high_precision=False, amax_history_len=16),
    )
}


def get_recipe(recipe: str | Float8Recipe) -> Float8Recipe:
    if isinstance(recipe, Float8Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {sorted(RECIPES)} or a Float8Recipe, "
                         f"got {recipe!r}")
    return RECIPES[recipe]
