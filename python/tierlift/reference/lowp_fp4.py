"""Pure-torch FP4 quantizers, bit-exact with csrc/core/lowp/fp4_quant (the C++ reference) and the
CUDA kernel (the rules are written out in csrc/core/lowp/fp4.h):

- optional Hadamard rotation over blocks of 16/32 columns: negate the inputs whose bit is set in
  `signs`, butterflies (a, b) -> (a + b, a - b) for h = 1, 2, 4, .., then * fp32(1/sqrt(n));
- MXFP4 (blocks 1x32, E8M0 scale 2^e, code e + 127): rule "floor" e = floor(log2 amax) - 2 (OCP),
  "rceil" e = ceil(log2(amax / 6)), "quest" e = ceil(log2(2.06650448 * rms / 6)) (the exponent
  nearest in log2 to QuEST's 2.92247856 * rms / 6; see csrc/core/lowp/fp4.h); the ceil is exact
  (from the mantissa, no division); the rms is taken on the block scaled by 2^-floor(log2 amax)
  so tiny and huge blocks do not underflow or overflow; e in [-127, 127]; v = x * 2^-e;
- NVFP4 (blocks 1x16 or 16x16, E4M3 block scale, fp32 tensor scale
  s_t = min(2688 / tensor_amax, FLT_MAX * 2^-9), 1 for an all-zero tensor):
  sb = e4m3(amax_b / 6 * s_t), at least the smallest subnormal 2^-9 for a non-zero block,
  v = x * (s_t / sb);
- amaxes are over finite elements; a block holding a NaN/Inf (after the rotation) gets the NaN
  scale (E8M0 0xFF, E4M3 0x7F), codes 0 and mask 0, and dequantizes to all NaN;
- E2M1 encode of v: saturating round-to-nearest-even, or stochastic rounding with Philox4x32-10
  uniforms (seed, offset + row * cols + col); codes packed two per byte, first in the low nibble;
- clip mask: |v| <= 6.
Every float operation is one IEEE fp32 operation in the same order as the C++.
"""

from __future__ import annotations

import torch

RULES = ("floor", "rceil", "quest", "nv")
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
QUEST_ALPHA = 2.06650447845459  # fp32(2.92247856 / sqrt(2)): see csrc/core/lowp/fp4.h
QUEST_CLIP = 2.92247856  # QuEST's MSE-optimal clip / rms for Gaussian data and an exact scale
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_M32 = 0xFFFFFFFF
NV_MAX_TENSOR_SCALE = torch.finfo(torch.float32).max / 512  # keeps s_t / 2^-9 finite


def check_fp4_args(x, scale_rule: str, hadamard: int, signs: int, block_2d: bool) -> None:
    """The errors the compiled op raises, for the pure-torch path."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor (reshape to [rows, cols]), got "
                         f"{getattr(x, 'shape', type(x))}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if scale_rule not in RULES:
        raise ValueError(f"scale_rule must be one of {RULES}, got {scale_rule!r}")
    block = block_size(scale_rule)
    if x.shape[1] % block:
        raise ValueError(f"x has {x.shape[1]} columns: cols must be a multiple of the block size "
                         f"{block}")
    if hadamard not in (0, 16, 32):
        raise ValueError(f"hadamard must be 0, 16 or 32, got {hadamard}")
    if hadamard and x.shape[1] % hadamard:
        raise ValueError(f"x has {x.shape[1]} columns: cols must be a multiple of the Hadamard "
                         f"size {hadamard}")
    if not 0 <= signs < (1 << max(hadamard, 1)) or (signs and not hadamard):
        raise ValueError(f"signs must be a bit mask below 2**hadamard, got {signs}")
    if block_2d and scale_rule != "nv":
        raise ValueError("block_2d (16x16 blocks) is NVFP4-only: use scale_rule='nv'")


def block_size(scale_rule: str) -> int:
    return 16 if scale_rule == "nv" else 32


def scales_shape(scale_rule: str, rows: int, cols: int, block_2d: bool) -> tuple[int, int]:
    return (-(-rows // 16) if block_2d else rows), cols // block_size(scale_rule)


def _f32(v: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full((), v, dtype=torch.float32, device=like.device)


def hadamard(x: torch.Tensor, n: int, signs: int = 0) -> torch.Tensor:
    """fp32 rotation of each block of n (16/32) columns of a 2-D tensor (see the module doc)."""
    rows, cols = x.shape
    y = x.float().reshape(rows, cols // n, n)
    if signs:
        neg = torch.tensor([(signs >> i) & 1 for i in range(n)], dtype=torch.bool, device=x.device)
        y = torch.where(neg, -y, y)
    h = 1
    while h < n:
        y = y.reshape(rows, cols // n, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    scale = 0.25 if n == 16 else 0.176776695296636881
    return (y.reshape(rows, cols) * _f32(scale, y)).contiguous()


def _finite_abs(y: torch.Tensor) -> torch.Tensor:
    a = y.abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a))


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """int64 floor(log2 a) for finite a > 0 (subnormals included)."""
    return torch.frexp(a)[1].to(torch.int64) - 1


def _block_stat(y: torch.Tensor, block: int, quest: bool) -> torch.Tensor:
    rows, cols = y.shape
    a = _finite_abs(y).reshape(rows, cols // block, block)
    amax = a.amax(dim=-1) if a.numel() else a.sum(dim=-1)
    if not quest:
        return amax
    # Scaled by 2^-k (exact) so the squares of tiny or huge blocks stay normal fp32 numbers.
    k = torch.where(amax > 0, _floor_log2(amax).clamp(-126, 127), 0)
    a = a * pow2(-k).unsqueeze(-1)
    s = a * a
    h = block // 2
    while h >= 1:
        s = s[..., :h] + s[..., h:2 * h]
        h //= 2
    return torch.sqrt(s[..., 0] * _f32(1.0 / block, s)) * pow2(k)


def _block_bad(y: torch.Tensor, block: int) -> torch.Tensor:
    """True for the 1 x block blocks holding a NaN/Inf."""
    rows, cols = y.shape
    return (~torch.isfinite(y)).reshape(rows, cols // block, block).any(dim=-1)


def mx_exponent(stat: torch.Tensor, scale_rule: str) -> torch.Tensor:
    """int64 E8M0 exponent e per block from its amax (floor, rceil) or rms (quest)."""
    low = torch.full_like(stat, -127, dtype=torch.int64)
    if scale_rule == "floor":
        _, e = torch.frexp(stat)
        e = e.to(torch.int64) - 1 - 2
        return torch.where(stat > 0, e.clamp(-127, 127), low)
    clip = stat * _f32(QUEST_ALPHA, stat) if scale_rule == "quest" else stat
    # ceil(log2(clip / 6)) exactly: clip = m * 2^f, m in [0.5, 1) -> f - 3, plus 1 if m > 0.75.
    m, f = torch.frexp(clip)
    e = f.to(torch.int64) - 3 + (m > 0.75).to(torch.int64)
    e = torch.where(torch.isinf(clip), torch.full_like(low, 127), e)
    return torch.where(clip > 0, e.clamp(-127, 127), low)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2^e for int64 e in [-127, 127]."""
    normal = ((e + 127).clamp(min=1) << 23).to(torch.int32).view(torch.float32)
    sub = torch.full_like(normal, 2.0 ** -127)
    return torch.where(e >= -126, normal, sub)


def e2m1_encode_rne(v: torch.Tensor) -> torch.Tensor:
    a = v.abs()
    m = sum(((a > 0.25), (a >= 0.75), (a > 1.25), (a >= 1.75), (a > 2.5), (a >= 3.5), (a > 5.0)),
            torch.zeros_like(a, dtype=torch.int32))
    sign = torch.signbit(v) & ~torch.isnan(v)
    return (m + sign.to(torch.int32) * 8).to(torch.uint8)


def e2m1_encode_sr(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    nan = torch.isnan(v)
    a = torch.where(nan, torch.zeros_like(v), v.abs())
    lo_small = (a * 2).clamp(max=3).to(torch.int32)
    lo = torch.where(a < 2, lo_small, torch.where(a < 3, 4, torch.where(a < 4, 5, 6)))
    lo_v = torch.where(a < 2, lo_small.float() * 0.5,
                       torch.where(a < 3, 2.0, torch.where(a < 4, 3.0, 4.0)))
    inv_step = torch.where(a < 2, 2.0, torch.where(a < 4, 1.0, 0.5))
    frac = (a - lo_v) * inv_step
    m = torch.where(a >= 6, 7, lo + (frac > u).to(torch.int32))
    sign = torch.signbit(v) & ~nan
    return (m + sign.to(torch.int32) * 8).to(torch.uint8)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = a * (b & 0xFFFF)
    u = a * (b >> 16) + (t >> 16)
    return u >> 16, ((u & 0xFFFF) << 16) | (t & 0xFFFF)


def philox_uniform(seed: int, offset: int, idx: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in [0, 1): Philox4x32-10 word (offset + idx) % 4 of counter (offset+idx)/4."""
    n = idx.to(torch.int64) + offset
    ctr = n >> 2
    c0, c1 = ctr & _M32, (ctr >> 32) & _M32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
        hi0, lo0 = _mulhilo(0xD2511F53, c0)
        hi1, lo1 = _mulhilo(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    words = torch.stack((c0, c1, c2, c3), dim=-1)
    w = torch.gather(words, -1, (n & 3).unsqueeze(-1)).squeeze(-1)
    return (w >> 8).to(torch.float32) * (2.0 ** -24)


def e4m3_encode_nonneg(t: torch.Tensor) -> torch.Tensor:
    return t.clamp(max=448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def fp4_quantize(x: torch.Tensor, scale_rule: str, hadamard_size: int = 0, signs: int = 0,
                 stochastic: bool = False, seed: int = 0, offset: int = 0, block_2d: bool = False,
                 want_mask: bool = False):
    """(codes uint8 [rows, cols/2], scale codes uint8, tensor_scale fp32 [1], mask bool)."""
    check_fp4_args(x, scale_rule, hadamard_size, signs, block_2d)
    rows, cols = x.shape
    block = block_size(scale_rule)
    y = hadamard(x, hadamard_size, signs) if hadamard_size else x.float().contiguous()
    stat = _block_stat(y, block, scale_rule == "quest")
    bad = _block_bad(y, block)
    if scale_rule == "nv":
        tamax = stat.amax() if stat.numel() else torch.zeros((), device=x.device)
        st = torch.full_like(tamax, 2688.0) / tamax  # inf for 0: replaced by 1 below
        st = torch.where(tamax > 0, st.clamp(max=NV_MAX_TENSOR_SCALE), torch.ones_like(st))
        if block_2d:
            g = -(-rows // 16)
            stat = torch.nn.functional.pad(stat, (0, 0, 0, g * 16 - rows))
            bad = torch.nn.functional.pad(bad, (0, 0, 0, g * 16 - rows))
            stat = stat.reshape(g, 16, -1).amax(dim=1) if stat.numel() else stat[:g]
            bad = bad.reshape(g, 16, -1).any(dim=1) if bad.numel() else bad[:g]
        t = (stat / torch.full_like(stat, 6.0)) * st
        code = e4m3_encode_nonneg(t)
        code = torch.where((code == 0) & (stat > 0), torch.ones_like(code), code)
        scales = torch.where(bad, 0x7F, code).to(torch.uint8)
        sb = scales.view(torch.float8_e4m3fn).float()  # NaN for 0x7F: mult NaN, codes 0
        mult = torch.where(sb == 0, torch.zeros_like(sb), st / sb)
        tensor_scale = st.reshape(1)
    else:
        e = mx_exponent(stat, scale_rule)
        scales = torch.where(bad, 0xFF, e + 127).to(torch.uint8)
        mult = torch.where(bad, float("nan"), pow2(-e))
        tensor_scale = torch.ones(1, dtype=torch.float32, device=x.device)
    mult = mult.repeat_interleave(block, dim=1)
    if block_2d:
        mult = mult.repeat_interleave(16, dim=0)[:rows]
    v = y * mult
    if stochastic:
        idx = torch.arange(rows * cols, device=x.device).reshape(rows, cols)
        q = e2m1_encode_sr(v, philox_uniform(seed, offset, idx))
    else:
        q = e2m1_encode_rne(v)
    codes = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    mask = v.abs() <= 6.0 if want_mask else torch.empty(0, dtype=torch.bool, device=x.device)
    return codes, scales.contiguous(), tensor_scale, mask


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values [rows, 2 * cols] of packed codes [rows, cols] (low nibble first)."""
    vals = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32,
                        device=codes.device)
    byte = torch.arange(256, device=codes.device)
    lut = torch.stack((vals[byte & 15], vals[byte >> 4]), dim=-1)  # [256, 2]
    return lut[codes.long()].reshape(codes.shape[0], 2 * codes.shape[1])  # -1: ambiguous at 0 rows


def fp4_dequantize(codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor,
                   scale_rule: str, block_2d: bool = False) -> torch.Tensor:
    """fp32 [rows, 2 * codes.shape[1]]: e2m1 * 2^e (MXFP4) or (e2m1 * sb) / s_t (NVFP4)."""
    v = e2m1_decode(codes)
    rows, cols = v.shape
    block = block_size(scale_rule)
    if scale_rule == "nv":
        s = scales.view(torch.float8_e4m3fn).float()  # 0x7F is NaN
    else:
        s = torch.where(scales == 0xFF, float("nan"), pow2(scales.to(torch.int64) - 127))
    if block_2d:
        s = s.repeat_interleave(16, dim=0)[:rows]
    out = (v.reshape(rows, cols // block, block) * s.unsqueeze(-1)).reshape(rows, cols)
    if scale_rule == "nv":
        return out / tensor_scale.expand_as(out).contiguous()
    return out
