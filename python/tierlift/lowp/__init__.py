"""tierlift.lowp: FP8 and FP4 training.

    import tierlift
    report = tierlift.lowp.convert(model, recipe="fp8-rowwise")   # in place
    print(report)                                                 # what stayed high precision

FP4: convert(model, recipe="mxfp4-quartet" | "nvfp4" | "mxfp4-rtn") swaps in
FP4Linear (MXFP4/NVFP4 operands, Hadamard rotations, stochastic rounding; GEMMs emulated).

Float8Linear runs its forward in E4M3 and its grad_output in E5M2; the quantizers are the
tierlift.ops.fp8_quantize* ops (C++ on CPU, fused CUDA kernels on GPU). "fp8-tensorwise-delayed"
takes x's and grad_output's scales from amax histories the layer keeps (lowp/delayed.py), so
each is read once. See docs/lowp.md.
"""

from tierlift.lowp.convert import ConversionReport, convert
from tierlift.lowp.fp4 import FP4Linear, fp4_linear
from tierlift.lowp.fp4_recipe import FP4_RECIPES, FP4Recipe, get_fp4_recipe
from tierlift.lowp.gemm import scaled_mm
from tierlift.lowp.linear import Float8Linear, float8_linear
from tierlift.lowp.recipe import RECIPES, Float8Recipe, get_recipe

__all__ = ["FP4_RECIPES", "RECIPES", "ConversionReport", "FP4Linear", "FP4Recipe", "Float8Linear",
           "Float8Recipe", "convert", "float8_linear", "fp4_linear", "get_fp4_recipe", "get_recipe",
           "scaled_mm"]
