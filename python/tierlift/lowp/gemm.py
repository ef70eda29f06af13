"""The scaled FP8 GEMM out = (a_q / a_s) @ (b_q / b_s)^T.

a_q [M, K] and b_q [N, K] are row-major FP8 (so b_q.t() is the column-major right operand
cuBLAS wants); a_s [M, 1] or [1, 1] and b_s [N, 1] or [1, 1] are the quantization scales
(q = x * s). On GPUs with FP8 tensor cores (sm_89+) this is torch._scaled_mm with the inverse
scales; elsewhere (CPU included) it is emulated exactly the same way: dequantize by multiplying
with the inverse scale, then an fp32 matmul.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import Counter

import torch


@functools.cache
def _fp8_tensor_cores(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def _use_scaled_mm(a_q: torch.Tensor, b_q: torch.Tensor) -> bool:
    if not (a_q.is_cuda and hasattr(torch, "_scaled_mm")):
        return False
    if not _fp8_tensor_cores(a_q.device.index or 0):
        return False
    return all(d % 16 == 0 for d in (*a_q.shape, *b_q.shape))


_warned: set[str] = set()
# GEMMs torch._scaled_mm refused and the emulation ran instead, counted per kind: same numbers,
# not the same time, so a benchmark reads these to say which of its rows were emulated.
_fallbacks: Counter[str] = Counter()


def scaled_mm_fallbacks() -> dict[str, int]:
    """{kind: calls} of the GEMMs torch._scaled_mm refused since import (each then emulated);
    kind: "<a dtype>-<b dtype>-<out dtype>-<tensorwise|rowwise>: <torch's first error line>"."""
    return dict(_fallbacks)

# The profiler range every scaled_mm call runs in while a profiler records, so that its inverse
# scales and (off the FP8 tensor cores) its dequantize + fp32 matmul are grouped as the GEMM
# by name (benchmarks/lowp_split.py), not by guessing kernel names.
PROFILER_RANGE = "tierlift.lowp.scaled_mm"


def scaled_mm(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    # A range costs microseconds even with no profiler running (on a CPU core, about 0.8x a
    # 16x32 emulated GEMM): opened only under a profiler.
    # Under torch.compile the plain call is traced: a graph must not depend on profiler state.
    if torch.compiler.is_compiling() or not torch.autograd._profiler_enabled():
        return _scaled_mm(a_q, a_s, b_q, b_s, out_dtype)
    with torch.profiler.record_function(PROFILER_RANGE):
        return _scaled_mm(a_q, a_s, b_q, b_s, out_dtype)


def _scaled_mm(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    inv_a, inv_b = a_s.reciprocal(), b_s.reciprocal()
    if _use_scaled_mm(a_q, b_q):
        rowwise = inv_a.numel() > 1 or inv_b.numel() > 1
        sa = inv_a if rowwise else inv_a.reshape(())
        sb = inv_b.t() if rowwise else inv_b.reshape(())
        try:
            return torch._scaled_mm(a_q, b_q.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
        # A refusal (e.g. a cuBLAS without rowwise E5M2): TORCH_CHECK raises RuntimeError
        # (NotImplementedError is one), TORCH_CHECK_VALUE ValueError (the rowwise output dtype
        # and E5M2 x E5M2 checks). A TypeError (a changed signature) is a bug: it propagates.
        except (RuntimeError, ValueError) as exc:
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            key = f"{a_q.dtype}-{b_q.dtype}-{out_dtype}-{'rowwise' if rowwise else 'tensorwise'}"
            _fallbacks[f"{key}: {first_line}"] += 1
            if key not in _warned:
                _warned.add(key)
                warnings.warn(f"tierlift.lowp: torch._scaled_mm rejected this GEMM ({exc}); "
                              "using the dequantize + matmul emulation for it", RuntimeWarning,
                              stacklevel=3)
    with autocast_off(a_q.device.type):  # fp32 means fp32
        a = a_q.float() * inv_a
        b = b_q.float() * inv_b
        return as_dtype(torch.mm(a, b.t()), out_dtype)


def has_autocast(device_type: str) -> bool:
    """Whether torch.autocast takes this device: meta has none (a model moved to meta for shape
    or FLOP counting runs its layers there). A string test, not torch.amp.is_autocast_available,
    which torch 2.11's torch.compile cannot trace."""
    return device_type != "meta"


def autocast_off(device_type: str):
    """A region where autocast is off (none on a device without autocast)."""
    if not has_autocast(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype, cast only where it differs. An autograd.Function's forward returns this, not
    a no-op .to(): torch 2.11's torch.compile gives such an output's backward zeros for its
    gradient (fixed in later torch), which trains silently wrong."""
    return t if t.dtype == dtype else t.to(dtype)
