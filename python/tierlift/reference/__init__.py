"""Pure-torch references of every tierlift kernel, used by the tests and as the fallback when
the compiled extension is missing. Each mirrors its kernel's arithmetic order."""

from tierlift.reference.gather import gather_rows
from tierlift.reference.lowp import fp8_dequantize, fp8_quantize, fp8_quantize_dual
from tierlift.reference.optim import adam_step_

__all__ = ["adam_step_", "fp8_dequantize", "fp8_quantize", "fp8_quantize_dual", "gather_rows"]
