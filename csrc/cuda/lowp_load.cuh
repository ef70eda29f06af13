// Element loads of the fp32 / bf16 / fp16 inputs of the low-precision quantize kernels
// (fp8_quant*.cu, fp4_quant.cu): one element, or 4 / 8 consecutive ones as 8- or 16-byte vector
// loads, widened to fp32 exactly. Internal header.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/util/dtype.h"

namespace tierlift {
namespace cuda {
namespace lowp {

template <DType kT>
__device__ __forceinline__ float load(const void* p, int64_t k) {
  if constexpr (kT == DType::kFloat32) {
    return static_cast<const float*>(p)[k];
  } else if constexpr (kT == DType::kBFloat16) {
    return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[k]) << 16);
  } else {
    return __half2float(static_cast<const __half*>(p)[k]);
  }
}

template <DType kT>
__device__ __forceinline__ float widen16(uint32_t h) {  // the low 16 bits of h
  if constexpr (kT == DType::kBFloat16) {
    return __uint_as_float(h << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h & 0xffffu)));
  }
}

// kW consecutive elements x[k..k+kW-1] (kW = 1, 4 or 8; k % kW == 0 and the base aligned to kW
// elements for kW > 1): 16-byte loads where they fit (8 bf16/fp16, 4 fp32), 8-byte for 4
// bf16/fp16.
template <DType kT, int kW>
__device__ __forceinline__ void load_vec(const void* p, int64_t k, float (&v)[kW]) {
  if constexpr (kW == 1) {
    v[0] = load<kT>(p, k);
  } else if constexpr (kT == DType::kFloat32) {
    for (int n = 0; n < kW / 4; ++n) {
      const float4 f = reinterpret_cast<const float4*>(p)[k / 4 + n];
      v[4 * n] = f.x, v[4 * n + 1] = f.y, v[4 * n + 2] = f.z, v[4 * n + 3] = f.w;
    }
  } else if constexpr (kW == 4) {
    const uint2 raw = reinterpret_cast<const uint2*>(p)[k / 4];
    v[0] = widen16<kT>(raw.x), v[1] = widen16<kT>(raw.x >> 16);
    v[2] = widen16<kT>(raw.y), v[3] = widen16<kT>(raw.y >> 16);
  } else {
    static_assert(kW == 8, "vector width 1, 4 or 8");
    const uint4 raw = reinterpret_cast<const uint4*>(p)[k / 8];
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    for (int n = 0; n < 4; ++n)
      v[2 * n] = widen16<kT>(w[n]), v[2 * n + 1] = widen16<kT>(w[n] >> 16);
  }
}

}  // namespace lowp
}  // namespace cuda
}  // namespace tierlift
