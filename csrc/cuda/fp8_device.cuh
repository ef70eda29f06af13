// Device building blocks of the FP8 quantize kernels (fp8_quant.cu, fp8_quant_tiles.cu): fp8.h's
// encoder and scale rule written with explicitly rounded intrinsics (bit-identical to the C++
// reference), a branch-free encoder of finite values for the hot loops (Fp8Encoder), packed
// stores of 4 or 8 codes, and the warp / non-negative float reductions.
// Internal header.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/lowp/fp8.h"
#include "core/util/dtype.h"
#include "cuda/lowp_load.cuh"

namespace tierlift {
namespace cuda {
namespace fp8dev {

using lowp::load;
using lowp::load_vec;

__device__ __forceinline__ float pow2f_dev(int e) {
  return __uint_as_float(static_cast<uint32_t>(e + 127) << 23);
}

__device__ __forceinline__ float finite_abs(float x) {
  const uint32_t a = __float_as_uint(x) & 0x7fffffffu;
  return a >= 0x7f800000u ? 0.f : __uint_as_float(a);
}

// fp8.h fp8_encode, operation for operation.
__device__ __forceinline__ uint32_t encode(float x, Fp8Format fmt) {
  const int mbits = fmt == Fp8Format::kE4M3 ? 3 : 2;
  const int bias = fmt == Fp8Format::kE4M3 ? 7 : 15;
  const uint32_t max_bits = __float_as_uint(fmt == Fp8Format::kE4M3 ? kE4M3Max : kE5M2Max);
  const uint32_t u = __float_as_uint(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7fu;
  if (abs == 0x7f800000u) return fmt == Fp8Format::kE5M2 ? (sign | 0x7cu) : 0x7fu;
  if (abs > max_bits) abs = max_bits;
  const float a = __uint_as_float(abs);
  if (a < pow2f_dev(1 - bias)) {
    const float units = __fmul_rn(a, pow2f_dev(bias - 1 + mbits));
    const float r = __fsub_rn(__fadd_rn(units, 8388608.f), 8388608.f);
    return sign | static_cast<uint32_t>(r);
  }
  const int shift = 23 - mbits;
  const uint32_t lsb = (abs >> shift) & 1u;
  uint32_t r = (abs + ((1u << (shift - 1)) - 1u) + lsb) >> shift;
  r -= static_cast<uint32_t>(127 - bias) << mbits;
  return sign | (r & 0xffu);
}

// 8 consecutive elements as raw 16-byte words (two for fp32), zeros where `in` is false (the
// address 16-byte aligned), then widened to fp32 by widen8: the zeros cost 4 moves, not 8 per
// widened vector, and the widening needs no predicate.
template <DType kT>
struct Raw8 {
  uint4 w[kT == DType::kFloat32 ? 2 : 1];
};

template <DType kT>
__device__ __forceinline__ Raw8<kT> load_raw8(const void* p, bool in) {
  Raw8<kT> r;
  for (uint4& w : r.w) w = make_uint4(0u, 0u, 0u, 0u);
  if (in) {
    for (int i = 0; i < static_cast<int>(sizeof(r.w) / sizeof(uint4)); ++i) {
      r.w[i] = static_cast<const uint4*>(p)[i];
    }
  }
  return r;
}

template <DType kT>
__device__ __forceinline__ void widen8(const Raw8<kT>& r, float (&v)[8]) {
  if constexpr (kT == DType::kFloat32) {
    for (int i = 0; i < 2; ++i) {
      v[4 * i] = __uint_as_float(r.w[i].x), v[4 * i + 1] = __uint_as_float(r.w[i].y);
      v[4 * i + 2] = __uint_as_float(r.w[i].z), v[4 * i + 3] = __uint_as_float(r.w[i].w);
    }
  } else {
    const uint32_t w[4] = {r.w[0].x, r.w[0].y, r.w[0].z, r.w[0].w};
    for (int n = 0; n < 4; ++n) {
      v[2 * n] = lowp::widen16<kT>(w[n]), v[2 * n + 1] = lowp::widen16<kT>(w[n] >> 16);
    }
  }
}

// fp8.h fp8_encode for finite inputs, four codes packed at a time: the hot loops' encoder.
// Bit-identical to encode() on finite x; a non-finite x sets `special`, and the caller then
// encodes that group with encode(), so the fast path carries no per-element NaN / Inf branches.
// Built on the host and passed by value, its constants stay in the kernel's parameter bank
// rather than in registers.
struct Fp8Encoder {
  uint32_t max_bits;         // the format's largest finite value
  uint32_t min_normal_bits;  // 2^(1 - bias)
  uint32_t sub_magic_bits;   // 2^(23 - k), k = bias - 1 + mbits: subnormal units in the mantissa
  uint32_t round_add;        // 2^(shift - 1) - 1 - ((127 - bias) << 23), modulo 2^32
  int shift;                 // 23 - mbits
  Fp8Format fmt;

  static __host__ __device__ Fp8Encoder of(Fp8Format fmt) {
    const int mbits = fmt == Fp8Format::kE4M3 ? 3 : 2;
    const int bias = fmt == Fp8Format::kE4M3 ? 7 : 15;
    auto pow2_bits = [](int e) { return static_cast<uint32_t>(e + 127) << 23; };
    Fp8Encoder e;
    e.max_bits = fmt == Fp8Format::kE4M3 ? 0x43e00000u : 0x47600000u;  // 448, 57344
    e.min_normal_bits = pow2_bits(1 - bias);
    e.sub_magic_bits = pow2_bits(23 - (bias - 1 + mbits));
    e.shift = 23 - mbits;
    e.round_add = ((1u << (e.shift - 1)) - 1u) - (static_cast<uint32_t>(127 - bias) << 23);
    e.fmt = fmt;
    return e;
  }

  // The code of finite x without its sign, in the low byte (bit 7 clear; higher bytes are not
  // defined).
  __device__ __forceinline__ uint32_t magnitude(float x, bool& special) const {
    const float a = fabsf(x);
    special |= !(a <= kF32Max);                           // NaN or Inf
    const float c = fminf(a, __uint_as_float(max_bits));  // saturate
    const uint32_t bits = __float_as_uint(c);
    // Normal: round half to even at bit `shift`; the rebias is a multiple of 2^shift below
    // `bits` (c >= min_normal), so subtracting it before the shift is exact. The result is at
    // most the code of max, < 0x80.
    const uint32_t normal = (bits + round_add + ((bits >> shift) & 1u)) >> shift;
    // Subnormal or zero: encode()'s (c * 2^k + 2^23) - 2^23 scaled by 2^-k, which is exact, so
    // the same rounding: c + 2^(23 - k) holds the units (<= 2^mbits) in its low mantissa bits.
    const uint32_t sub = __float_as_uint(__fadd_rn(c, __uint_as_float(sub_magic_bits)));
    return c < __uint_as_float(min_normal_bits) ? sub : normal;
  }

  // Codes of x[0..3], x[0] in the low byte: the low bytes of the magnitudes and the sign bits of
  // the top bytes of x, gathered byte by byte.
  __device__ __forceinline__ uint32_t pack4(const float (&x)[4], bool& special) const {
    uint32_t m[4], u[4];
    for (int b = 0; b < 4; ++b) m[b] = magnitude(x[b], special), u[b] = __float_as_uint(x[b]);
    const uint32_t codes =
        (m[0] & 0xffu) | ((m[1] & 0xffu) << 8) | ((m[2] & 0xffu) << 16) | (m[3] << 24);
    const uint32_t tops =
        __byte_perm(__byte_perm(u[0], u[1], 0x73u), __byte_perm(u[2], u[3], 0x73u),
                    0x5410u);  // byte 3 of each u
    return codes | (tops & 0x80808080u);
  }
};

// fp8.h fp8_scale.
__device__ __forceinline__ float scale_of(float amax, Fp8Format fmt, bool pow2) {
  if (!(amax > 0.f)) return 1.f;
  float s = __fdiv_rn(fmt == Fp8Format::kE4M3 ? kE4M3Max : kE5M2Max, amax);
  if (s > kF32Max) s = kF32Max;
  if (pow2) s = __uint_as_float(__float_as_uint(s) & 0xff800000u);
  return s;
}

// q[k..k+kW-1] = encode(v * s) as one kW-byte store (element k at the lowest address).
template <int kW>
__device__ __forceinline__ void encode_store(uint8_t* q, int64_t k, const float (&v)[kW], float s,
                                             Fp8Format fmt) {
  if constexpr (kW == 1) {
    q[k] = static_cast<uint8_t>(encode(__fmul_rn(v[0], s), fmt));
  } else {
    uint32_t w[kW / 4];
    for (int n = 0; n < kW / 4; ++n) {
      w[n] = 0;
      for (int b = 0; b < 4; ++b) w[n] |= encode(__fmul_rn(v[4 * n + b], s), fmt) << (8 * b);
    }
    if constexpr (kW == 4) {
      reinterpret_cast<uint32_t*>(q)[k / 4] = w[0];
    } else {
      static_assert(kW == 8, "vector width 1, 4 or 8");
      reinterpret_cast<uint2*>(q)[k / 8] = make_uint2(w[0], w[1]);
    }
  }
}

// Max over aligned groups of kLanes lanes (a power of two up to 32); every lane of the warp
// must call it.
template <int kLanes = 32>
__device__ __forceinline__ float group_max(float v) {
  for (int o = kLanes / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// n / d for n < 2^31 and 1 <= d < 2^31 as a multiply-high and a shift (Granlund and
// Montgomery's round-up method); the constants are built on the host.
struct FastDiv {
  uint32_t magic, shift;

  static __host__ FastDiv of(uint32_t d) {
    FastDiv f{0, 0};
    while ((uint64_t{1} << f.shift) < d) ++f.shift;
    f.magic = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << f.shift) - d)) / d + 1);
    return f;
  }
  __host__ __device__ __forceinline__ uint32_t div(uint32_t n) const {
    const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(n) * magic) >> 32);
    return (hi + n) >> shift;
  }
};

// Non-negative floats order like their bit patterns.
__device__ __forceinline__ void atomic_max_nonneg(float* addr, float v) {
  atomicMax(reinterpret_cast<unsigned int*>(addr), __float_as_uint(v));
}

}  // namespace fp8dev
}  // namespace cuda
}  // namespace tierlift
