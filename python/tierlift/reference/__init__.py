"""Pure-torch references of every tierlift kernel, used by the tests and as the fallback when
the compiled extension is missing. Each mirrors its kernel's arithmetic order."""

from tierlift.reference.gather import gather_rows
from tierlift.reference.io import block_crc32c
from tierlift.reference.lowp import (
    fp8_dequantize,
    fp8_quantize,
    fp8_quantize_delayed,
    fp8_quantize_dual,
    fp8_quantize_from_history,
)
from tierlift.reference.lowp_fp4 import fp4_dequantize, fp4_quantize
from tierlift.reference.optim import adam_step_, advance_steps_
from tierlift.reference.optim_compact import (
    adam_compact_step_,
    dequantize_exp_avg_sq,
    quantize_exp_avg_sq,
)
from tierlift.reference.zero import flatten_pack_, unflatten_

__all__ = [
    "adam_compact_step_", "adam_step_", "advance_steps_", "block_crc32c", "dequantize_exp_avg_sq",
    "flatten_pack_", "fp4_dequantize", "fp4_quantize", "fp8_dequantize", "fp8_quantize",
    "fp8_quantize_delayed", "fp8_quantize_dual", "fp8_quantize_from_history", "gather_rows",
    "quantize_exp_avg_sq", "unflatten_",
]
