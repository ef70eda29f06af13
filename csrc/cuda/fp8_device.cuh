// Device building blocks of the FP8 quantize kernels (fp8_quant.cu, fp8_quant_tiles.cu): fp8.h's
// encoder and scale rule written with explicitly rounded intrinsics (bit-identical to the C++
// reference), packed stores of 4 or 8 codes, and the warp / non-negative float reductions.
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

// Non-negative floats order like their bit patterns.
__device__ __forceinline__ void atomic_max_nonneg(float* addr, float v) {
  atomicMax(reinterpret_cast<unsigned int*>(addr), __float_as_uint(v));
}

}  // namespace fp8dev
}  // namespace cuda
}  // namespace tierlift
