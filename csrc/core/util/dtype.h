// Element types the torch-free kernels understand, and exact scalar conversions between
// fp32 and the 16-bit float formats (round-to-nearest-even, NaN kept NaN), matching
// c10::BFloat16 / c10::Half bit for bit.
//
// The helpers are `static` on purpose: files compiled for AVX2/AVX-512 include this header too,
// and internal linkage keeps the linker from picking their copies for code run on older CPUs.
#pragma once

#include <cstdint>
#include <cstring>

namespace tierlift {

enum class DType : uint8_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kNone = 255 };

static inline int dtype_size(DType t) {
  return t == DType::kFloat32 ? 4 : (t == DType::kNone ? 0 : 2);
}

static inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
static inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

static inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  const uint32_t bias = ((u >> 16) & 1u) + 0x7fffu;
  return static_cast<uint16_t>((u + bias) >> 16);
}

// IEEE binary16 decode (handles subnormals, inf, NaN).
static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return bits_f32(sign);
    // Subnormal: value = mant * 2^-24, exact in fp32.
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

// IEEE binary16 encode, round to nearest even, overflow to inf.
static inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
  if (abs < 0x38800000u) {                        // below 2^-14: subnormal or zero
    if (abs < 0x33000000u) return sign;           // below 2^-25 rounds to zero
    const uint32_t e = abs >> 23;
    const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  const uint32_t rem = r & 0x1fffu;
  r >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return sign | static_cast<uint16_t>(r);
}

}  // namespace tierlift
