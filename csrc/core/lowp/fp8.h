// FP8 formats and the scalar rules every tierlift FP8 quantizer follows (C++ reference, CUDA
// kernel and tierlift.reference.lowp agree on them bit for bit).
//
//   E4M3 (torch.float8_e4m3fn): bias 7, 3 mantissa bits, max 448, no inf, NaN 0x7f/0xff.
//   E5M2 (torch.float8_e5m2):   bias 15, 2 mantissa bits, max 57344, inf 0x7c, NaN 0x7d-0x7f.
//
// Cast (fp32 -> fp8): saturating round-to-nearest-even for finite x (|x| > max becomes +-max).
// Non-finite values stay non-finite, so a NaN or Inf never turns into a plausible number: NaN
// becomes the canonical NaN code 0x7f whatever its sign (GPUs do not keep a NaN's sign through
// arithmetic, so it cannot be bit-exact); +-inf becomes +-inf in E5M2 (0x7c/0xfc) and NaN (0x7f)
// in E4M3, which has no inf. For |x| <= max the result equals torch's `x.to(float8_*)` exactly.
//
// Scale: amax is the largest |x| over the FINITE elements of a scaling block, so one NaN/Inf
// neither zeroes the scale of its finite neighbours (448 / inf = 0) nor hides itself: it is cast
// on its own as above. scale = min(max_fp8 / amax, FLT_MAX) in fp32 (correctly rounded division),
// 1 for amax == 0 (TransformerEngine's rule), optionally rounded DOWN to a power of two by
// clearing its mantissa (so amax * scale <= max_fp8 still holds and dequantization is exact). The
// scale is never inf, NaN or zero, and a tiny block keeps its precision: only below
// amax = max_fp8 / FLT_MAX (1.3e-36 for E4M3, 1.7e-34 for E5M2) does the cap leave codes unused.
// Quantize: q = cast(fp32(x) * scale), the product rounded to fp32 (no FMA). Dequantize: q / scale.
#pragma once

#include <cstdint>

#include "core/util/dtype.h"

namespace tierlift {

enum class Fp8Format : uint8_t { kE4M3 = 0, kE5M2 = 1 };

constexpr float kF32Max = 3.40282346638528859812e+38f;  // FLT_MAX
constexpr float kE4M3Max = 448.f;
constexpr float kE5M2Max = 57344.f;

struct Fp8Spec {
  int mbits;  // mantissa bits
  int bias;   // exponent bias
  float max;  // largest finite value
};

static inline Fp8Spec fp8_spec(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? Fp8Spec{3, 7, kE4M3Max} : Fp8Spec{2, 15, kE5M2Max};
}

// Exact power of two 2^e for e in the normal fp32 range.
static inline float pow2f(int e) { return bits_f32(static_cast<uint32_t>(e + 127) << 23); }

// Saturating round-to-nearest-even fp32 -> fp8 (see the rules above).
static inline uint8_t fp8_encode(float x, Fp8Format fmt) {
  const Fp8Spec s = fp8_spec(fmt);
  const uint32_t u = f32_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7fu;  // NaN (canonical)
  if (abs == 0x7f800000u) return fmt == Fp8Format::kE5M2 ? (sign | 0x7cu) : 0x7fu;  // inf
  if (abs > f32_bits(s.max)) abs = f32_bits(s.max);                                 // saturate
  const float a = bits_f32(abs);
  const float min_normal = pow2f(1 - s.bias);
  if (a < min_normal) {
    // Subnormal (or zero): the code is the value in units of the smallest subnormal, rounded
    // half to even. The power-of-two multiply is exact; the magic-number add rounds (RNE) and
    // the result (< 2^mbits + 1) is exact, so no rounding-mode dependence beyond the default.
    const float units = a * pow2f(s.bias - 1 + s.mbits);
    const float r = (units + 8388608.f) - 8388608.f;
    return sign | static_cast<uint8_t>(static_cast<uint32_t>(r));  // 2^mbits = min normal code
  }
  // Normal: round the fp32 mantissa to mbits (RNE) on the bit pattern, then rebias the exponent.
  const int shift = 23 - s.mbits;
  const uint32_t lsb = (abs >> shift) & 1u;
  uint32_t r = (abs + ((1u << (shift - 1)) - 1u) + lsb) >> shift;
  r -= static_cast<uint32_t>(127 - s.bias) << s.mbits;
  return sign | static_cast<uint8_t>(r);
}

// Exact fp8 -> fp32.
static inline float fp8_decode(uint8_t q, Fp8Format fmt) {
  const Fp8Spec s = fp8_spec(fmt);
  const uint32_t sign = static_cast<uint32_t>(q & 0x80u) << 24;
  const int ebits = 7 - s.mbits;
  const uint32_t e = (q >> s.mbits) & ((1u << ebits) - 1u);
  const uint32_t m = q & ((1u << s.mbits) - 1u);
  const uint32_t emax = (1u << ebits) - 1u;
  if (fmt == Fp8Format::kE4M3 && e == emax && m == 7u) return bits_f32(sign | 0x7fc00000u);
  if (fmt == Fp8Format::kE5M2 && e == emax) {
    return bits_f32(sign | (m == 0 ? 0x7f800000u : 0x7fc00000u));
  }
  if (e == 0) {
    const float v = static_cast<float>(m) * pow2f(1 - s.bias - s.mbits);
    return bits_f32(sign | f32_bits(v));
  }
  return bits_f32(sign | ((e - s.bias + 127u) << 23) | (m << (23 - s.mbits)));
}

// |x| if finite, else 0: the amax contribution of one element.
static inline float finite_abs(float x) {
  const uint32_t abs = f32_bits(x) & 0x7fffffffu;
  return abs >= 0x7f800000u ? 0.f : bits_f32(abs);
}

// Scale from a block's amax (finite, >= 0); see the rules above.
static inline float fp8_scale(float amax, Fp8Format fmt, bool pow2) {
  if (!(amax > 0.f)) return 1.f;  // all-zero block: any scale is exact
  float scale = fp8_spec(fmt).max / amax;
  if (scale > kF32Max) scale = kF32Max;  // the quotient overflowed to inf
  if (pow2) scale = bits_f32(f32_bits(scale) & 0xff800000u);
  return scale;
}

}  // namespace tierlift
