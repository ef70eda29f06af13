"""tierlift.lowp: FP8 training.

    import tierlift
    report = tierlift.lowp.convert(model, recipe="fp8-rowwise")   # in place
    print(report)                                                 # what stayed high precision

Float8Linear runs its forward in E4M3 and its grad_output in E5M2; the quantizers are the
tierlift.ops.fp8_quantize* ops (C++ on CPU, fused CUDA kernels on GPU). See docs/lowp.md.
"""

from tierlift.lowp.convert import ConversionReport, convert
from tierlift.lowp.gemm import scaled_mm
from tierlift.lowp.linear import Float8Linear, float8_linear
from tierlift.lowp.recipe import RECIPES, Float8Recipe, get_recipe

__all__ = ["RECIPES", "ConversionReport", "Float8Linear", "Float8Recipe", "convert",
           "float8_linear", "get_recipe", "scaled_mm"]
