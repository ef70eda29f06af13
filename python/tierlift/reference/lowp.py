"""Pure-torch FP8 quantizers, bit-exact with csrc/core/lowp (the C++ reference) and the CUDA
kernels. The rules (see csrc/core/lowp/fp8.h):

- amax of a scaling block = max |x| over its FINITE elements (a NaN/Inf neither poisons its
  neighbours' scale nor hides itself: it is cast on its own, see below);
- scale = min(fp8_max / amax, FLT_MAX) in fp32, 1 for amax == 0 (TransformerEngine's rule),
  optionally rounded down to a power of two: never inf, NaN or zero, and with no minimum amax,
  so tiny blocks keep their precision;
- q = saturating round-to-nearest-even cast of fp32(x) * scale for finite values (|y| > max
  becomes +-max); NaN becomes the canonical NaN code 0x7f, +-inf stays +-inf in E5M2 and becomes
  NaN (0x7f) in E4M3, which has no inf: a non-finite input is never quantized to a number;
- dequantize: q / scale.

Scalings of a 2-D [rows, cols] tensor: "tensor", "row" (1 x cols), "col" (rows x 1), "1x128",
"128x128"; scales have shape [ceil(rows / block_h), ceil(cols / block_w)].
"""

from __future__ import annotations

import torch

SCALINGS = ("tensor", "row", "col", "1x128", "128x128")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
F32_MAX = torch.finfo(torch.float32).max
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_EXPONENT_MASK = -8388608  # 0xff800000 as int32: keeps sign and exponent


def check_quantize_args(x: torch.Tensor, scaling: str, fp8_dtype: torch.dtype) -> None:
    """The errors the compiled ops raise, for the pure-torch path."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor (reshape to [rows, cols]), got "
                         f"{getattr(x, 'shape', type(x))}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got "
                        f"{fp8_dtype}")


def block_shape(scaling: str, rows: int, cols: int) -> tuple[int, int]:
    """(block height, block width) of `scaling` for a rows x cols matrix."""
    shapes = {"tensor": (rows, cols), "row": (1, cols), "col": (rows, 1), "1x128": (1, 128),
              "128x128": (128, 128)}
    br, bc = shapes[scaling]
    return max(br, 1), max(bc, 1)


def scales_shape(scaling: str, rows: int, cols: int) -> tuple[int, int]:
    br, bc = block_shape(scaling, rows, cols)
    gr = 1 if scaling in ("tensor", "col") else -(-rows // br)
    gc = 1 if scaling in ("tensor", "row") else -(-cols // bc)
    return gr, gc


def expand_scales(scales: torch.Tensor, scaling: str, rows: int, cols: int) -> torch.Tensor:
    """Per-element [rows, cols] view of block scales."""
    br, bc = block_shape(scaling, rows, cols)
    return scales.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


def scale_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype, pow2_scale: bool) -> torch.Tensor:
    a = amax.float()
    # tensor / tensor: correctly rounded (python_scalar / tensor would multiply by a reciprocal).
    # a == 0 gives inf, replaced by 1; a quotient that overflowed is capped at FLT_MAX.
    scale = torch.full_like(a, FP8_MAX[fp8_dtype]) / a
    scale = torch.where(a > 0, scale.clamp(max=F32_MAX), torch.ones_like(scale))
    if pow2_scale:
        scale = (scale.view(torch.int32) & _EXPONENT_MASK).view(torch.float32)
    return scale


def block_amax(x: torch.Tensor, scaling: str) -> torch.Tensor:
    rows, cols = x.shape
    br, bc = block_shape(scaling, rows, cols)
    gr, gc = scales_shape(scaling, rows, cols)
    a = x.float().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device))
    a = torch.nn.functional.pad(a, (0, gc * bc - cols, 0, gr * br - rows))
    return a.reshape(gr, br, gc, bc).amax(dim=(1, 3))


def cast_to_fp8(y: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Saturating RNE fp32 -> fp8 for finite values; NaN -> 0x7f, +-inf -> +-inf (E5M2) or 0x7f
    (E4M3). The non-finite codes are written explicitly: torch's own cast of inf to e4m3fn
    saturates on some versions and devices."""
    fmax = FP8_MAX[fp8_dtype]
    finite = torch.isfinite(y)
    q = torch.where(finite, y, 0.0).clamp(-fmax, fmax).to(fp8_dtype).view(torch.uint8)
    special = torch.full_like(q, 0x7F)
    if fp8_dtype == torch.float8_e5m2:
        inf = torch.where(y > 0, 0x7C, 0xFC).to(torch.uint8)
        special = torch.where(torch.isinf(y), inf, special)
    return torch.where(finite, q, special).view(fp8_dtype)


def fp8_quantize(x: torch.Tensor, scaling: str, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                 pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): q = cast(x * scale) row-major, scales fp32 per block."""
    check_quantize_args(x, scaling, fp8_dtype)
    rows, cols = x.shape
    scales = scale_from_amax(block_amax(x, scaling), fp8_dtype, pow2_scale)
    if x.numel() == 0:
        return torch.empty(rows, cols, dtype=fp8_dtype, device=x.device), scales
    y = x.float() * expand_scales(scales, scaling, rows, cols)
    return cast_to_fp8(y, fp8_dtype).contiguous(), scales


def fp8_quantize_dual(x: torch.Tensor, scaling: str, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                      pow2_scale: bool = False):
    """(q, scales, qt, scales_t): x quantized and x^T quantized, with the same scaling kind."""
    q, s = fp8_quantize(x, scaling, fp8_dtype, pow2_scale)
    qt, st = fp8_quantize(x.t(), scaling, fp8_dtype, pow2_scale)
    return q, s, qt, st


def fp8_quantize_delayed(x: torch.Tensor, scale: torch.Tensor,
                         fp8_dtype: torch.dtype = torch.float8_e4m3fn, dual: bool = False,
                         pow2_scale: bool = False):
    """Tensorwise quantize with a scale chosen ahead (delayed scaling): one pass over x.

    Returns (q, scale_used [1, 1], qt or None, amax [1]): amax is x's finite amax, for the next
    scale. scale_used is `scale` (one finite, positive fp32 element) unless some finite |x| * scale
    exceeds the format's max, in which case the just-in-time scale of x is used instead, so no
    value is ever clipped by a stale scale (a second pass, only then). q = cast(x * scale_used),
    qt = q's transpose (the same scale)."""
    check_quantize_args(x, "tensor", fp8_dtype)
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or \
            scale.dtype != torch.float32 or scale.device != x.device:
        raise ValueError(f"scale must be a one-element float32 tensor on x's device {x.device}, "
                         f"got {getattr(scale, 'dtype', type(scale))} "
                         f"{tuple(getattr(scale, 'shape', ()))} on {getattr(scale, 'device', '-')}")
    # as the CPU op (the CUDA kernel, which cannot check without a sync, takes x's own scale)
    if not (torch.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError(f"scale must be finite and > 0, got {scale.item()}")
    rows, cols = x.shape
    amax = block_amax(x, "tensor").reshape(1)
    given = scale.detach().reshape(1, 1)
    clipped = (amax.reshape(1, 1) * given) > FP8_MAX[fp8_dtype]
    used = torch.where(clipped, scale_from_amax(amax.reshape(1, 1), fp8_dtype, pow2_scale), given)
    q = cast_to_fp8(x.float() * used, fp8_dtype).contiguous() if x.numel() else \
        torch.empty(rows, cols, dtype=fp8_dtype, device=x.device)
    return q, used, (q.t().contiguous() if dual else None), amax


# The smallest fp32 subnormal: the amax a never-filled history (max <= 0) counts as.
SMALLEST_AMAX = torch.finfo(torch.float32).smallest_normal * torch.finfo(torch.float32).eps


def check_history(x: torch.Tensor, history: torch.Tensor) -> None:
    """The history errors the compiled op and its fake kernel raise."""
    if not isinstance(history, torch.Tensor) or history.dim() != 1 or history.numel() < 1 or \
            history.dtype != torch.float32 or history.device != x.device:
        raise ValueError(f"history must be a 1-D float32 tensor of at least one entry on x's "
                         f"device {x.device}, got {getattr(history, 'dtype', type(history))} "
                         f"{tuple(getattr(history, 'shape', ()))} on "
                         f"{getattr(history, 'device', '-')}")


def history_scale(history: torch.Tensor, fp8_dtype: torch.dtype, pow2_scale: bool) -> torch.Tensor:
    """The scale [1, 1] an amax history gives: that of its max, at least SMALLEST_AMAX (so a
    never-filled history gives the format's largest scale). A NaN entry gives 1, an Inf one 0."""
    hmax = history.detach().max().reshape(1, 1).clamp(min=SMALLEST_AMAX)
    return scale_from_amax(hmax, fp8_dtype, pow2_scale)


def fp8_quantize_from_history(x: torch.Tensor, history: torch.Tensor,
                              fp8_dtype: torch.dtype = torch.float8_e4m3fn, dual: bool = False,
                              pow2_scale: bool = False):
    """fp8_quantize_delayed with the scale an amax history gives (history_scale), the scale
    returned set to 1 where x has no finite non-zero value (its codes are the same under any
    scale, and a GEMM then never multiplies Inf codes by a tiny inverse scale). Returns (q, scale
    [1, 1], qt or None, amax [1])."""
    check_quantize_args(x, "tensor", fp8_dtype)
    check_history(x, history)
    given = history_scale(history, fp8_dtype, pow2_scale)
    if not (given > 0).all():  # the composition's own refusal, said in the history's terms
        raise ValueError("history holds +Inf (its scale would be 0): an amax history holds "
                         "finite amaxes")
    q, used, qt, amax = fp8_quantize_delayed(x, given, fp8_dtype, dual, pow2_scale)
    return q, used.masked_fill(amax == 0, 1.0), qt, amax


def fp8_dequantize(q: torch.Tensor, scales: torch.Tensor, scaling: str) -> torch.Tensor:
    """fp32 q / scale, element by element."""
    rows, cols = q.shape
    return q.float() / expand_scales(scales, scaling, rows, cols)
