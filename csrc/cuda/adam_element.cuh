// One element of the Adam step on the GPU, shared by the fp32-state (cuda/adam.cu) and the
// compact-state (cuda/adam_compact.cu) kernels, which differ only in how they load and store m
// and v: the fp32/bf16/fp16 element conversions, then core/optim/adam_impl.h's decay_and_moments
// (here grad_and_decay and moments) and apply_update, operation for operation, with explicitly
// rounded intrinsics so nvcc cannot contract them into FMAs. With refresh (load_weight), the
// weight comes from the model's copy where that was changed outside the optimizer.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/optim/adam.h"
#include "core/util/dtype.h"

namespace tierlift {
namespace cuda {

__device__ __forceinline__ float bf16_to_f32(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}
__device__ __forceinline__ uint16_t f32_to_bf16(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + ((u >> 16) & 1u) + 0x7fffu) >> 16);
}
// __float2half_rn, except that NaN keeps its sign as sign | 0x7e00 (the device's is 0x7fff), as
// core's f32_to_f16 and c10::Half write it.
__device__ __forceinline__ uint16_t f32_to_f16(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u);
  return __half_as_ushort(__float2half_rn(f));
}

// __half2float, except that a NaN keeps its sign and payload, as core's f16_to_f32 and c10::Half
// widen it (the host's __half2float, which the simulator runs, makes every NaN 0x7fffffff): a
// master refreshed from an fp16 copy takes the copy's value bit for bit.
__device__ __forceinline__ float f16_to_f32_exact(uint16_t h) {
  const float nan = __uint_as_float((static_cast<uint32_t>(h & 0x8000u) << 16) | 0x7f800000u |
                                    (static_cast<uint32_t>(h & 0x3ffu) << 13));
  return (h & 0x7fffu) > 0x7c00u ? nan : __half2float(__ushort_as_half(h));
}

// The storage of one kT element (fp32, or bf16/fp16 bits), and its value as fp32 and back.
template <DType kT>
using Storage = std::conditional_t<kT == DType::kFloat32, float, uint16_t>;

template <DType kT>
__device__ __forceinline__ float to_f32(Storage<kT> x) {
  if constexpr (kT == DType::kFloat32) return x;
  if constexpr (kT == DType::kBFloat16) return bf16_to_f32(x);
  if constexpr (kT == DType::kFloat16) return __half2float(__ushort_as_half(x));
  return 0.f;
}

template <DType kT>
__device__ __forceinline__ Storage<kT> from_f32(float x) {
  if constexpr (kT == DType::kFloat32) return x;
  if constexpr (kT == DType::kBFloat16) return f32_to_bf16(x);
  if constexpr (kT == DType::kFloat16) return f32_to_f16(x);
  return 0;
}

// Element i of a kT array (fp32, bf16 or fp16) as fp32, and back.
template <DType kT>
__device__ __forceinline__ float load(const void* p, int64_t i) {
  return to_f32<kT>(static_cast<const Storage<kT>*>(p)[i]);
}

template <DType kT>
__device__ __forceinline__ void store(void* p, int64_t i, float x) {
  static_cast<Storage<kT>*>(p)[i] = from_f32<kT>(x);
}

// kN consecutive elements of an array in one aligned access (ld/st.global.v4, .v2, or one 8- or
// 16-byte access): the vector paths' loads and stores.
template <typename T, int kN>
struct alignas(sizeof(T) * kN) Elements {
  T x[kN];
};

// Group j of kN elements from p, which is aligned to sizeof(Elements<T, kN>).
template <int kN, typename T>
__device__ __forceinline__ Elements<T, kN> load_elements(const T* p, int j) {
  return reinterpret_cast<const Elements<T, kN>*>(p)[j];
}
template <int kN, typename T>
__device__ __forceinline__ void store_elements(T* p, int j, const Elements<T, kN>& e) {
  reinterpret_cast<Elements<T, kN>*>(p)[j] = e;
}

// Whether p is a multiple of `bytes` (a power of two).
__device__ __forceinline__ bool aligned_to(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// core's grad_unscale_factor on the device: GradScaler's scale (read from device memory, so no
// host sync) as the fp32 factor unscale_ multiplies by, 1 / scale in double rounded to fp32.
// Double division is correctly rounded in CUDA whatever the float precision flags.
__device__ __forceinline__ float unscale_factor(const float* grad_scale) {
  return static_cast<float>(1.0 / static_cast<double>(*grad_scale));
}

// The fp32 weight element i steps from: param[i], or, with refresh, the copy's value where the
// copy's bits are not param[i] rounded to kCopy as apply_update writes it (the model weight was
// changed outside the optimizer, so it is stepped from its current value, as torch does). For a
// bf16/fp16 copy this is offload/masters.py's refresh_master fused into the step's own pass:
// one more 2-byte load and a select, no branch per element (refresh is uniform per launch). The
// rounding is the kernel's own, so a copy it wrote is never taken back; it is torch's `.to()`
// bit for bit except for which NaN a NaN becomes (torch's differs by device), and a NaN master
// stays NaN either way.
template <DType kCopy>
__device__ __forceinline__ float refreshed_weight(float p, Storage<kCopy> have) {
  if constexpr (kCopy == DType::kBFloat16 || kCopy == DType::kFloat16) {
    const uint16_t mine = kCopy == DType::kBFloat16 ? f32_to_bf16(p) : f32_to_f16(p);
    const float theirs = kCopy == DType::kBFloat16 ? bf16_to_f32(have) : f16_to_f32_exact(have);
    return have == mine ? p : theirs;
  } else {
    // Rounding to fp32 is the identity: the copy is the weight, bit for bit.
    return have;
  }
}

template <DType kCopy>
__device__ __forceinline__ float load_weight(const float* param, const void* copy, int64_t i,
                                             bool refresh) {
  const float p = param[i];
  if constexpr (kCopy != DType::kNone) {
    if (refresh) return refreshed_weight<kCopy>(p, static_cast<const Storage<kCopy>*>(copy)[i]);
  }
  return p;
}

// The gradient g as loaded (fp32) -> the gradient the moments take (unscaled by inv_grad_scale
// when kUnscale, negated when maximizing, plus the L2 term for Adam); the weight p -> decayed
// for AdamW.
template <bool kUnscale>
__device__ __forceinline__ float grad_with_decay(const AdamScalars& s, float inv_grad_scale,
                                                 float g, float& p) {
  if constexpr (kUnscale) g = __fmul_rn(g, inv_grad_scale);
  if (s.maximize) g = -g;
  if (s.decoupled) {
    p = __fmul_rn(p, s.decay);
  } else if (s.weight_decay != 0.f) {
    g = __fmaf_rn(s.weight_decay, p, g);
  }
  return g;
}

// Loads grad[i] and the weight (load_weight); returns the gradient (unscaled by inv_grad_scale
// when kUnscale, negated when maximizing, plus the L2 term for Adam) and sets p to the weight,
// decayed for AdamW.
template <DType kGrad, DType kCopy, bool kUnscale>
__device__ __forceinline__ float grad_and_decay(const AdamScalars& s, float inv_grad_scale,
                                                const void* grad, const float* param,
                                                const void* copy, bool refresh, int64_t i,
                                                float& p) {
  const float g = load<kGrad>(grad, i);
  p = load_weight<kCopy>(param, copy, i, refresh);
  return grad_with_decay<kUnscale>(s, inv_grad_scale, g, p);
}

struct Moments {
  float m, v;
};

// The new fp32 moments from the gradient g and the old moments m, v.
__device__ __forceinline__ Moments moments(const AdamScalars& s, float g, float m, float v) {
  const float m1 = __fmaf_rn(s.one_minus_beta1, __fsub_rn(g, m), m);
  float v1 = __fmul_rn(v, s.beta2);
  v1 = __fadd_rn(v1, __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
  return {m1, v1};
}

// The decayed weight p stepped with the new m and v (or v's running max).
__device__ __forceinline__ float updated_weight(const AdamScalars& s, float p, float m, float v) {
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bc2_sqrt), s.eps);
  return __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
}

// Steps the decayed weight p with the new m and v (or v's running max) and stores it in param[i]
// and, unless kCopy is kNone, in param_copy[i].
template <DType kCopy>
__device__ __forceinline__ void apply_update(const AdamScalars& s, float* param, void* param_copy,
                                             int64_t i, float p, float m, float v) {
  p = updated_weight(s, p, m, v);
  param[i] = p;
  if constexpr (kCopy != DType::kNone) store<kCopy>(param_copy, i, p);
}

}  // namespace cuda
}  // namespace tierlift
