// FP4 (E2M1) formats and the scalar rules every tierlift FP4 quantizer follows. The functions are
// host+device so the CUDA kernel (cuda/fp4_quant.cu), the C++ reference (fp4.cc) and
// tierlift.reference.lowp_fp4 compute the same bits; every float operation is a single IEEE
// operation (no FMA contraction: mul_rn/add_rn use explicitly rounded intrinsics on the device).
//
// E2M1 codes: bit 3 sign, 3 magnitude bits -> {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Two codes per byte,
// the FIRST element in the LOW nibble (torch.float4_e2m1fn_x2's layout).
// Encode (RNE): saturating (|v| > 6 -> 6), ties to the even code; NaN encodes as +0 (E2M1 has
// no NaN: a NaN is carried by its block's scale, see below). Encode (SR): |v| between grid points
// lo < hi rounds up iff (|v| - lo) / (hi - lo) > u, u = (philox word >> 8) * 2^-24 in [0, 1):
// unbiased up to 2^-24. Both subtraction and division by the power-of-two step are exact.
// Philox4x32-10: key = seed (lo, hi), counter = (lo(n), hi(n), 0, 0) with n = (offset + idx) / 4,
// word (offset + idx) % 4, idx = row * cols + col of the element.
//
// Scales. MXFP4 (block 32 along rows, E8M0 scale 2^e, code e + 127 in [0, 254]):
//   floor:  e = floor(log2(amax)) - 2            (OCP MX spec; values above 6 saturate)
//   rceil:  e = ceil(log2(amax / 6))             (NVIDIA's RCEIL: nothing saturates)
//   quest:  e = ceil(log2(clip / 6)), clip = fp32(2.06650448 * rms): the E8M0 exponent nearest to
//           QuEST's Gaussian-optimal clip 2.92247856 * rms / 6 (2.0665 = 2.9225 / sqrt(2)): the
//           clip then lies in [2.07, 4.13] rms. Rounding 2.92 * rms / 6 up instead (clip in
//           [2.92, 5.84] rms) costs 21% more squared error on Gaussian blocks than the OCP floor
//           rule (benchmarks/study_fp4_recipes.py, part quest). Elements above the clip saturate
//           and are marked in the clip mask.
//   ceil(log2(c / 6)) is exact, read off c = m * 2^f (m in [1, 2)): f - 2, plus 1 if m > 1.5 (a
//   division by 6 would round c / 6 onto a power of two when it is an fp32 subnormal, and the
//   block would saturate). e is clamped to [-127, 127]; amax is over finite elements; rms is
//   computed on the block scaled by 2^-k, k = floor(log2(amax)) clamped to [-126, 127], so that
//   squares of tiny (|x| < 1e-19) or huge (> 1e19) values neither underflow nor overflow:
//   rms = sqrt(sum((x * 2^-k)^2) * (1 / n)) * 2^k, the sum reduced as a halving tree
//   (s[i] += s[i + h], h = n/2 .. 1). Quantize: v = x * 2^-e.
// NVFP4 (block 16, E4M3 block scale, fp32 tensor scale): s_t = min(2688 / tensor_amax,
//   FLT_MAX * 2^-9), 1 for tensor_amax == 0 (2688 = 448 * 6, tensor_amax over finite elements;
//   the cap keeps s_t / sb finite for the smallest sb and binds only below amax 4e-33);
//   block scale code = max(e4m3(fp32(amax_b / 6) * s_t), 1) for amax_b > 0: a block far below
//   the tensor amax gets the smallest E4M3 subnormal 2^-9 where 0 would zero it (code 0 only
//   for an all-zero block); sb = decode(code); v = x * fp32(s_t / sb) (v = 0 when sb = 0).
//   Dequantize: (e2m1(q) * sb) / s_t.
// NaN and Inf (E2M1 has neither): a block holding one (after the rotation, which spreads it over
//   its Hadamard block) gets the NaN scale, E8M0 0xFF (a NaN scale makes the whole block NaN in
//   OCP MX; an Inf, whose amax has no E8M0 exponent, is treated alike) or E4M3 0x7F, so the
//   block dequantizes to NaN; its codes are 0 and its clip mask 0 (v = x * NaN). Other blocks,
//   and the tensor amax (over finite elements), are unaffected.
// Clip mask: 1 where |v| <= 6 (the element was representable without saturating), else 0.
// Hadamard (before quantization, along rows, blocks of 16/32): x_i *= -1 where bit i of the
// sign mask is set, then butterflies h = 1, 2, 4, ..: (a, b) -> (a + b, a - b) for a = x[j],
// b = x[j + h], then * fp32(1 / sqrt(n)): orthogonal, symmetric, its own inverse (with no signs).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define TL_HD __host__ __device__ __forceinline__
#else
#define TL_HD inline
#endif

namespace tierlift {
namespace fp4 {

constexpr float kMax = 6.f;
constexpr float kQuestAlpha = 2.06650447845459f;  // fp32(2.92247856 / sqrt(2))
constexpr float kNvTensorNum = 2688.f;            // 448 * 6
constexpr float kNvMaxTensorScale = 3.40282346638528859812e+38f / 512.f;  // FLT_MAX * 2^-9
constexpr float kHadamardScale16 = 0.25f;
constexpr float kHadamardScale32 = 0.176776695296636881f;  // fp32(1 / sqrt(32))
constexpr uint8_t kE8M0Nan = 0xff;
constexpr uint8_t kE4M3Nan = 0x7f;

TL_HD uint32_t bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
TL_HD float from_bits(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
TL_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
TL_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TL_HD float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
TL_HD float sqrt_rn(float a) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
TL_HD float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

TL_HD float fma_rn(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// Exact 2^e for e in [-149, 127] (subnormals included).
TL_HD float pow2(int e) {
  if (e >= -126) return from_bits(static_cast<uint32_t>(e + 127) << 23);
  return from_bits(1u << (e + 149));
}

TL_HD float nan_f32() { return from_bits(0x7fc00000u); }
TL_HD float inf_f32() { return from_bits(0x7f800000u); }
TL_HD bool nonfinite(float x) { return (bits(x) & 0x7fffffffu) >= 0x7f800000u; }

TL_HD float finite_abs(float x) {
  const uint32_t a = bits(x) & 0x7fffffffu;
  return a >= 0x7f800000u ? 0.f : from_bits(a);
}

// ---- E2M1 ----
TL_HD float e2m1_decode(uint8_t code) {
  const uint32_t m = code & 7u;
  const float mag = m < 4u ? 0.5f * static_cast<float>(m)
                           : pow2(static_cast<int>(m >> 1) - 1) * (1.f + 0.5f * (m & 1u));
  return (code & 8u) ? -mag : mag;
}

// Saturating round-to-nearest-even of a v that is not NaN, the sign kept (-0.1 -> 0x8). Per
// binade of steps (0.5 below 2, 1 below 4, 2 above) it scales a = |v| by s = 1 / step, exactly,
// and rounds with the magic add y = a * s + (2^23 + off): y's ulp is 1, so its low mantissa bits
// hold off + rint(a * s), ties to even as off is even. s comes from v's exponent bits alone:
// 2^(128 - E) for a biased exponent E (whose 8-bit complement is 255 - E), at most 2, and
// off = 2 * (1 - log2 s): integer operations, no compares or selects. Above 4 no clamp is needed:
// a >= 8 takes s <= 1/4, so a * s in [2, 4) and off >= 6 give q >= 8, which the min saturates
// (Inf: s = 0, y NaN, q huge, 7 again). a * s is exact, so an FMA (the device's one
// instruction) and a separate multiply and add round alike; a subnormal a (flushed or not)
// rounds to 0 either way. The kernels call it directly: a NaN there comes only with its whole
// block's NaN scale, whose codes they zero at once; their lean path calls the magnitude part (the
// device takes |v| as an operand modifier of the FMA) and places the sign bits itself.
TL_HD uint32_t e2m1_magnitude_rne(float v) {
  const uint32_t exp_complement = ~bits(v) & 0x7f800000u;
  const uint32_t s_bits = exp_complement < 0x40000000u ? exp_complement : 0x40000000u;
  const uint32_t off = (0x40000000u - s_bits) >> 22;
  constexpr uint32_t kMagicBits = 0x4b000000u;  // 2^23
#ifdef __CUDA_ARCH__
  const float y = __fmaf_rn(fabsf(v), __uint_as_float(s_bits), __uint_as_float(kMagicBits + off));
#else
  const float y = std::fabs(v) * from_bits(s_bits) + from_bits(kMagicBits + off);
#endif
  const uint32_t q = bits(y) - kMagicBits;
  return q < 7u ? q : 7u;
}

// e2m1_magnitude_rne(x * 2^-ex) without the multiply (the MXFP4 kernel's lean encode), for
// -126 <= ex <= 126 and step_bound = mx_step_bound(ex), the bits of 2^(1 - ex) (a normal float
// there). The above scales |v| = |x| 2^-ex by s = min(2^(128 - E_v), 2) and adds 2^23 + off,
// off = 2 (1 - log2 s); here s 2^-ex = min(2^(128 - E_x), 2^(1 - ex)) multiplies |x|
// (E_v = E_x - ex: a power-of-two scaling moves only the exponent; where v or x is subnormal both
// take s = 2, and a subnormal v rounds to 0 either way, the FMA's product being exact), with the
// same off and magic. 2^(128 - E_x) is normal for every finite x; a NaN or Inf x gives s = 0 and
// an undefined magnitude (its block is zeroed). tests/cudasim/test_kernel_fp4_paths.cc checks it
// on every bf16 value at every exponent.
TL_HD uint32_t mx_step_bound(int ex) { return static_cast<uint32_t>(128 - ex) << 23; }
TL_HD uint32_t e2m1_magnitude_rne_scaled(float x, uint32_t step_bound) {
  const uint32_t exp_complement = ~bits(x) & 0x7f800000u;
  const uint32_t s_bits = exp_complement < step_bound ? exp_complement : step_bound;
  const uint32_t off = (step_bound - s_bits) >> 22;
  constexpr uint32_t kMagicBits = 0x4b000000u;  // 2^23
#ifdef __CUDA_ARCH__
  const float y = __fmaf_rn(fabsf(x), __uint_as_float(s_bits), __uint_as_float(kMagicBits + off));
#else
  const float y = std::fma(std::fabs(x), from_bits(s_bits), from_bits(kMagicBits + off));
#endif
  const uint32_t q = bits(y) - kMagicBits;
  return q < 7u ? q : 7u;
}

TL_HD uint8_t e2m1_encode_rne_not_nan(float v) {
  return static_cast<uint8_t>(((bits(v) >> 28) & 8u) | e2m1_magnitude_rne(v));
}

// Saturating round-to-nearest-even; NaN -> +0.
TL_HD uint8_t e2m1_encode_rne(float v) {
  const bool nan = (bits(v) & 0x7fffffffu) > 0x7f800000u;
  return nan ? 0 : e2m1_encode_rne_not_nan(v);
}

// Stochastic rounding with a uniform u in [0, 1) (see the header comment); NaN -> +0.
TL_HD uint8_t e2m1_encode_sr(float v, float u01) {
  const uint32_t ub = bits(v);
  if ((ub & 0x7fffffffu) > 0x7f800000u) return 0;
  const uint8_t sign = (ub >> 28) & 8u;
  const float a = from_bits(ub & 0x7fffffffu);
  if (a >= kMax) return sign | 7u;
  uint8_t lo;
  float lo_v, inv_step;
  if (a < 2.f) {
    lo = static_cast<uint8_t>(a * 2.f);  // exact: a * 2 < 4, truncation = floor
    lo_v = 0.5f * lo;
    inv_step = 2.f;
  } else if (a < 4.f) {
    lo = a < 3.f ? 4 : 5;
    lo_v = a < 3.f ? 2.f : 3.f;
    inv_step = 1.f;
  } else {
    lo = 6;
    lo_v = 4.f;
    inv_step = 0.5f;
  }
  const float frac = mul_rn(sub_rn(a, lo_v), inv_step);
  return sign | static_cast<uint8_t>(lo + (frac > u01 ? 1 : 0));
}

// ---- Philox4x32-10 ----
TL_HD void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

// The four words of counter n (the CUDA kernel uses all four; the reference one per element).
TL_HD void philox4(uint64_t seed, uint64_t n, uint32_t (&out)[4]) {
  uint32_t c0 = static_cast<uint32_t>(n), c1 = static_cast<uint32_t>(n >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    if (r) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(0xD2511F53u, c0, hi0, lo0);
    mulhilo(0xCD9E8D57u, c2, hi1, lo1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

TL_HD uint32_t philox_word(uint64_t seed, uint64_t n, int word) {
  uint32_t w[4];
  philox4(seed, n, w);
  return w[word & 3];
}

// The uniform in [0, 1) for element index idx of a stream (seed, offset).
TL_HD float philox_uniform(uint64_t seed, uint64_t offset, uint64_t idx) {
  const uint64_t n = offset + idx;
  return static_cast<float>(philox_word(seed, n >> 2, static_cast<int>(n & 3u)) >> 8) *
         5.9604644775390625e-8f;  // 2^-24
}

// ---- scales ----
// floor(log2(a)) for finite a > 0 (subnormals: their true exponent).
TL_HD int floor_log2(float a) {
  const uint32_t u = bits(a) & 0x7fffffffu;
  const int e = static_cast<int>(u >> 23);
  if (e) return e - 127;
  int lz = 0;  // subnormal: position of the top set bit
  for (uint32_t m = u; m < 0x400000u; m <<= 1) ++lz;
  return -127 - lz;
}
TL_HD int clamp_exp(int e) { return e < -127 ? -127 : (e > 127 ? 127 : e); }

enum class ScaleRule : uint8_t { kFloor = 0, kRceil = 1, kQuest = 2, kNv = 3 };

// MXFP4 E8M0 exponent from the block statistic (amax for floor/rceil, rms for quest).
TL_HD int mx_exponent(float stat, ScaleRule rule) {
  if (!(stat > 0.f)) return -127;
  if (rule == ScaleRule::kFloor) return clamp_exp(floor_log2(stat) - 2);
  const float clip = rule == ScaleRule::kQuest ? mul_rn(stat, kQuestAlpha) : stat;
  const uint32_t u = bits(clip);
  if (u >= 0x7f800000u) return 127;  // rms * alpha overflowed
  // ceil(log2(clip / 6)) exactly; for a subnormal clip it is below -127 either way.
  return clamp_exp(floor_log2(clip) - 2 + ((u & 0x7fffffu) > 0x400000u ? 1 : 0));
}

// The k of the rms rule's 2^-k pre-scaling (see the header comment); 0 for amax == 0.
TL_HD int rms_shift(float amax) {
  if (!(amax > 0.f)) return 0;
  const int k = floor_log2(amax);
  return k < -126 ? -126 : (k > 127 ? 127 : k);
}

// E8M0 code -> 2^(code - 127); 0xFF is NaN.
TL_HD float e8m0_decode(uint8_t code) {
  return code == kE8M0Nan ? nan_f32() : pow2(static_cast<int>(code) - 127);
}

TL_HD float nv_tensor_scale(float tensor_amax) {
  if (!(tensor_amax > 0.f)) return 1.f;
  const float st = div_rn(kNvTensorNum, tensor_amax);
  return st > kNvMaxTensorScale ? kNvMaxTensorScale : st;
}

}  // namespace fp4
}  // namespace tierlift

namespace tierlift {
namespace fp4 {

// Saturating RNE fp32 -> E4M3 code for a finite v >= 0 (NVFP4 block scales). Equal to
// fp8_encode(v, kE4M3) on that domain (tests/cpp/test_lowp_fp4.cc checks every E4M3 value and
// every midpoint); kept here so the CUDA kernel shares it.
TL_HD uint8_t e4m3_encode_nonneg(float v) {
  uint32_t a = bits(v) & 0x7fffffffu;
  if (a > 0x43e00000u) a = 0x43e00000u;  // 448
  const float f = from_bits(a);
  if (f < 0.015625f) {  // below 2^-6: subnormal units of 2^-9, RNE via the magic add
    const float units = mul_rn(f, 512.f);
    const float r = sub_rn(add_rn(units, 8388608.f), 8388608.f);
    return static_cast<uint8_t>(r);
  }
  const uint32_t lsb = (a >> 20) & 1u;
  uint32_t r = (a + 0x7ffffu + lsb) >> 20;
  r -= 120u << 3;  // rebias 127 -> 7
  return static_cast<uint8_t>(r);
}

TL_HD float e4m3_decode_nonneg(uint8_t q) {
  const uint32_t e = (q >> 3) & 15u, m = q & 7u;
  if (q == kE4M3Nan) return nan_f32();
  if (e == 0) return static_cast<float>(m) * 0.001953125f;  // m * 2^-9
  return from_bits(((e + 120u) << 23) | (m << 20));
}

// NVFP4 block scale code from the block's finite amax; amax = +inf (which a finite amax never is)
// marks a block holding a NaN/Inf: it gets the E4M3 NaN. A non-zero block whose scale rounds to 0
// gets code 1 (2^-9) instead: flushing it would zero the whole block.
TL_HD uint8_t nv_scale_code(float amax, float st) {
  if (bits(amax) == 0x7f800000u) return kE4M3Nan;
  const uint8_t code = e4m3_encode_nonneg(mul_rn(div_rn(amax, kMax), st));
  return code == 0 && amax > 0.f ? 1 : code;
}

// div_rn(x, 6) for finite x >= 0 without a division: q = x * fp32(1/6) is within an ulp, its
// remainder x - 6q is exact in one fma, and one more fma rounds q + r / 6 correctly. That holds
// for every x >= 2^-125 (where x / 6 is normal); below, the quotient's subnormal rounding breaks
// it, so those divide (tests/cudasim/test_kernel_nvfp4_passes.cc checks every float).
constexpr float kSixth = 1.f / 6.f;
TL_HD float div6_rn(float x) {
  if (x < 0x1p-125f) return div_rn(x, kMax);
  const float q = mul_rn(x, kSixth);
  return fma_rn(fma_rn(-q, kMax, x), kSixth, q);
}

// nv_scale_code with amax / 6 by div6_rn (the same code for every input): what the kernel runs.
TL_HD uint8_t nv_scale_code_nodiv(float amax, float st) {
  if (bits(amax) == 0x7f800000u) return kE4M3Nan;
  const uint8_t code = e4m3_encode_nonneg(mul_rn(div6_rn(amax), st));
  return code == 0 && amax > 0.f ? 1 : code;
}

// The factor taking a block's values to the E2M1 grid: s_t / sb, 0 for a zero scale (an all-zero
// block) and NaN for the NaN scale (so the block's codes are 0 and its mask 0).
TL_HD float nv_multiplier(uint8_t code, float st) {
  const float sb = e4m3_decode_nonneg(code);
  return sb == 0.f ? 0.f : div_rn(st, sb);
}

// In-place sign flips + normalized fast Walsh-Hadamard transform of n = 16 or 32 values.
TL_HD void hadamard_block(float* v, int n, uint32_t signs) {
  for (int i = 0; i < n; ++i) {
    if ((signs >> i) & 1u) v[i] = -v[i];
  }
  for (int h = 1; h < n; h <<= 1) {
    for (int j = 0; j < n; j += 2 * h) {
      for (int k = j; k < j + h; ++k) {
        const float a = v[k], b = v[k + h];
        v[k] = add_rn(a, b);
        v[k + h] = sub_rn(a, b);
      }
    }
  }
  const float s = n == 16 ? kHadamardScale16 : kHadamardScale32;
  for (int i = 0; i < n; ++i) v[i] = mul_rn(v[i], s);
}

// Sum of squares of the finite ones of n (power of two) values, each first multiplied by `down`,
// as a halving tree: s[i] += s[i + h].
TL_HD float tree_sum_squares(const float* v, int n, float down) {
  float s[32];
  for (int i = 0; i < n; ++i) {
    const float a = mul_rn(finite_abs(v[i]), down);  // NaN/Inf do not poison the block
    s[i] = mul_rn(a, a);
  }
  for (int h = n / 2; h >= 1; h >>= 1) {
    for (int i = 0; i < h; ++i) s[i] = add_rn(s[i], s[i + h]);
  }
  return s[0];
}

// The quest rule's rms of n values whose finite amax is `amax` (see the header comment).
TL_HD float block_rms(const float* v, int n, float amax) {
  const int k = rms_shift(amax);
  const float ms = mul_rn(tree_sum_squares(v, n, pow2(-k)), 1.f / static_cast<float>(n));
  return mul_rn(sqrt_rn(ms), pow2(k));
}

}  // namespace fp4
}  // namespace tierlift
