// The compact-state Adam step (cuda/adam_compact.cuh), one warp per 256-element code block. Each
// lane steps 8 consecutive elements (32 x 8 = one code block): on the vector path it loads them
// with one 16-byte access per 16 bytes of each array (fp32 param and fp32 grad or copy 2 x 16 B,
// bf16 m and bf16/fp16 grad or copy 16 B) and the 8 v codes with one 8-byte access, computes
// the 8 new v in registers, and the warp reduces the block's new max and its NaN/Inf flag with
// shuffles and a vote alone, then lane 0 writes the scale and every lane its 8 codes in one
// 8-byte store. No shared memory and no barrier: a CUDA block's 8 warps run 8 code blocks
// independently, and each lane has 72-120 bytes of loads in flight instead of the 9-15 of one
// element per thread, so an SM keeps enough bytes in flight to reach bandwidth.
//
// A tensor whose arrays are not aligned for those accesses (a view at an odd offset), and the
// last, partial code block of any tensor, take the scalar layout: lane l steps elements
// l, l + 32, ..., l + 224 of the code block, one access per element, coalesced across the warp.
// Both layouts run the same arithmetic on each element (adam_element.cuh's, operation for
// operation), so every path is bit-identical to core's scalar kernel.
#include <cstdint>

#include "core/optim/adam_compact.h"
#include "cuda/adam_compact.cuh"
#include "cuda/adam_element.cuh"
#include "cuda/launch.cuh"
#include "cuda/multi_tensor.cuh"

namespace tierlift {
namespace cuda {
namespace {

constexpr int64_t kChunk = 1 << 16;  // elements per CUDA block: whole code blocks
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;  // code blocks a CUDA block steps at a time
constexpr int kPerLane = 8;            // elements per lane and code block
static_assert(32 * kPerLane == kCompactBlock, "one warp steps one code block");
static_assert(kChunk % kCompactBlock == 0, "a code block must not straddle two CUDA blocks");

using Pack = TensorPack<CompactAdamTensorPtrs>;

// core's encode_v / decode_v (adam_compact.h).
__device__ __forceinline__ uint8_t encode_code(float v, float block_max) {
  if (v == 0.f) return 0;
  const uint32_t u = __float_as_uint(__fdiv_rn(v, block_max));
  const int32_t c =
      static_cast<int32_t>((u + 0x7ffffu + ((u >> kVCodeShift) & 1u)) >> kVCodeShift) - kVCodeBase;
  return static_cast<uint8_t>(c < 1 ? 1 : (c > 255 ? 255 : c));
}
__device__ __forceinline__ float decode_code(uint8_t code, float block_max) {
  if (code == 0) return 0.f;
  return __fmul_rn(__uint_as_float(static_cast<uint32_t>(code + kVCodeBase) << kVCodeShift),
                   block_max);
}

// Bytes per access on the vector path: 16, or all 8 elements of a 1-byte array.
template <typename T>
constexpr int kLaneAccess = sizeof(T) * kPerLane < 16 ? sizeof(T) * kPerLane : 16;

// A lane's 8 consecutive elements of p from element e0 (a multiple of 8), in kLaneAccess-byte
// accesses.
template <typename T>
__device__ __forceinline__ void load_lane(const T* p, int e0, T (&x)[kPerLane]) {
  constexpr int kN = kLaneAccess<T> / sizeof(T);
  TIERLIFT_UNROLL
  for (int h = 0; h < kPerLane / kN; ++h) {
    const Elements<T, kN> e = load_elements<kN>(p, e0 / kN + h);
    TIERLIFT_UNROLL
    for (int k = 0; k < kN; ++k) x[h * kN + k] = e.x[k];
  }
}
template <typename T>
__device__ __forceinline__ void store_lane(T* p, int e0, const T (&x)[kPerLane]) {
  constexpr int kN = kLaneAccess<T> / sizeof(T);
  TIERLIFT_UNROLL
  for (int h = 0; h < kPerLane / kN; ++h) {
    Elements<T, kN> e;
    TIERLIFT_UNROLL
    for (int k = 0; k < kN; ++k) e.x[k] = x[h * kN + k];
    store_elements<kN>(p, e0 / kN + h, e);
  }
}

// Whether every array of t can take the vector path: a chunk and a lane's first element are
// multiples of 8 elements into the tensor, so its accesses are aligned as the tensor's arrays.
template <DType kGrad, DType kCopy>
__device__ __forceinline__ bool lanes_aligned(const CompactAdamTensorPtrs& t) {
  bool ok = aligned_to(t.param, kLaneAccess<float>) &&
            aligned_to(t.grad, kLaneAccess<Storage<kGrad>>) &&
            aligned_to(t.exp_avg, kLaneAccess<uint16_t>) &&
            aligned_to(t.exp_avg_sq, kLaneAccess<uint8_t>);
  if constexpr (kCopy != DType::kNone)
    ok = ok && aligned_to(t.param_copy, kLaneAccess<Storage<kCopy>>);
  return ok;
}

// One lane's 8 elements of one code block, as loaded and then as stepped.
template <DType kGrad, DType kCopy>
struct LaneElements {
  float p[kPerLane];
  Storage<kGrad> g[kPerLane];
  uint16_t m[kPerLane];  // bf16 bits
  uint8_t code[kPerLane];
  Storage<kCopy> c[kPerLane];  // loaded with refresh only
  float v[kPerLane];           // the new v
};

// adam_impl.h's decay_and_moments and apply_update on each of the lane's elements, as
// grad_and_decay and apply_update order them: p, m and c become the new weight, m and copy.
template <DType kGrad, DType kCopy, bool kUnscale>
__device__ __forceinline__ void step_lane(LaneElements<kGrad, kCopy>& e, const AdamScalars& s,
                                          float inv_grad_scale, bool refresh, float old_max) {
  TIERLIFT_UNROLL
  for (int k = 0; k < kPerLane; ++k) {
    float w = e.p[k];
    if constexpr (kCopy != DType::kNone) {
      if (refresh) w = refreshed_weight<kCopy>(w, e.c[k]);
    }
    const float g = grad_with_decay<kUnscale>(s, inv_grad_scale, to_f32<kGrad>(e.g[k]), w);
    const Moments mv = moments(s, g, bf16_to_f32(e.m[k]), decode_code(e.code[k], old_max));
    e.m[k] = f32_to_bf16(mv.m);
    e.p[k] = updated_weight(s, w, mv.m, mv.v);
    if constexpr (kCopy != DType::kNone) e.c[k] = from_f32<kCopy>(e.p[k]);
    e.v[k] = mv.v;
  }
}

template <DType kGrad, DType kCopy, bool kUnscale>
__global__ void __launch_bounds__(kThreads)
    adam_compact_kernel(Pack pack, AdamScalars s, const float* grad_scale, bool refresh) {
  using G = Storage<kGrad>;
  using C = Storage<kCopy>;
  constexpr bool kHasCopy = kCopy != DType::kNone;
  int64_t chunk;
  const CompactAdamTensorPtrs& t = pack.t[pack_slot(pack, blockIdx.x, chunk)];
  const int64_t begin = chunk * kChunk;
  const int n = static_cast<int>(t.numel - begin < kChunk ? t.numel - begin : kChunk);
  // This chunk's part of each array.
  float* const param = t.param + begin;
  const G* const grad = static_cast<const G*>(t.grad) + begin;
  uint16_t* const exp_avg = t.exp_avg + begin;
  uint8_t* const codes = t.exp_avg_sq + begin;
  float* const scales = t.exp_avg_sq_scale + begin / kCompactBlock;
  C* const copy = kHasCopy ? static_cast<C*>(t.param_copy) + begin : nullptr;
  const bool refresh_copy = kHasCopy && refresh;
  const int lane = threadIdx.x % 32;
  float inv_grad_scale = 1.f;
  if constexpr (kUnscale) inv_grad_scale = unscale_factor(grad_scale);
  const bool vec = lanes_aligned<kGrad, kCopy>(t);

  for (int b0 = threadIdx.x / 32 * kCompactBlock; b0 < n; b0 += kWarps * kCompactBlock) {
    // Read by every lane before lane 0 overwrites it: its v feed the shuffles below.
    const float old_max = scales[b0 / kCompactBlock];
    // Uniform across the warp: a whole code block of aligned arrays, or the scalar layout.
    const bool whole = vec && n - b0 >= kCompactBlock;
    LaneElements<kGrad, kCopy> e;
    const int e0 = b0 + lane * kPerLane;
    if (whole) {
      load_lane(param, e0, e.p);
      load_lane(grad, e0, e.g);
      load_lane(exp_avg, e0, e.m);
      load_lane(codes, e0, e.code);
      if (refresh_copy) load_lane(copy, e0, e.c);
    } else {
      TIERLIFT_UNROLL
      for (int k = 0; k < kPerLane; ++k) {
        const int i = b0 + lane + 32 * k;
        // An element past the end steps from zeros, and its v is zeroed below.
        const bool live = i < n;
        e.p[k] = live ? param[i] : 0.f;
        e.g[k] = live ? grad[i] : G{};
        e.m[k] = live ? exp_avg[i] : uint16_t{0};
        e.code[k] = live ? codes[i] : uint8_t{0};
        if (refresh_copy) e.c[k] = live ? copy[i] : C{};
      }
    }
    step_lane<kGrad, kCopy, kUnscale>(e, s, inv_grad_scale, refresh, old_max);
    if (whole) {
      store_lane(exp_avg, e0, e.m);
      store_lane(param, e0, e.p);
      if constexpr (kHasCopy) store_lane(copy, e0, e.c);
    } else {
      TIERLIFT_UNROLL
      for (int k = 0; k < kPerLane; ++k) {
        const int i = b0 + lane + 32 * k;
        if (i < n) {
          exp_avg[i] = e.m[k];
          param[i] = e.p[k];
          if constexpr (kHasCopy) copy[i] = e.c[k];
        } else {
          e.v[k] = 0.f;
        }
      }
    }
    // The code block's new max (exact in any order) and whether any v is NaN or infinite.
    float vmax = 0.f;
    bool bad = false;
    TIERLIFT_UNROLL
    for (int k = 0; k < kPerLane; ++k) {
      vmax = vmax < e.v[k] ? e.v[k] : vmax;
      bad |= !(__fsub_rn(e.v[k], e.v[k]) == 0.f);
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, vmax, o);
      vmax = vmax < other ? other : vmax;
    }
    bad = __any_sync(0xffffffffu, bad);
    if (lane == 0) scales[b0 / kCompactBlock] = bad ? __int_as_float(0x7fc00000) : vmax;
    TIERLIFT_UNROLL
    for (int k = 0; k < kPerLane; ++k) e.code[k] = bad ? 255 : encode_code(e.v[k], vmax);
    if (whole) {
      store_lane(codes, e0, e.code);
    } else {
      TIERLIFT_UNROLL
      for (int k = 0; k < kPerLane; ++k) {
        const int i = b0 + lane + 32 * k;
        if (i < n) codes[i] = e.code[k];
      }
    }
  }
}

template <DType kGrad, DType kCopy>
cudaError_t run(const CompactAdamTensorPtrs* tensors, int count, const AdamScalars& s,
                cudaStream_t stream, const float* grad_scale, bool refresh) {
  return launch_packed<kChunk>(tensors, count, [&](const Pack& pack, int blocks) {
    if (grad_scale != nullptr) {
      TIERLIFT_LAUNCH(blocks, kThreads, 0, stream, adam_compact_kernel<kGrad, kCopy, true>)
      (pack, s, grad_scale, refresh);
    } else {
      TIERLIFT_LAUNCH(blocks, kThreads, 0, stream, adam_compact_kernel<kGrad, kCopy, false>)
      (pack, s, grad_scale, refresh);
    }
  });
}

}  // namespace

cudaError_t adam_compact_step(const CompactAdamTensorPtrs* tensors, int count, DType grad_type,
                              DType copy_type, const AdamScalars& s, cudaStream_t stream,
                              const float* grad_scale, bool refresh_from_copies) {
  return dispatch_grad_copy(grad_type, copy_type, [&](auto grad, auto copy) {
    return run<decltype(grad)::value, decltype(copy)::value>(tensors, count, s, stream, grad_scale,
                                                             refresh_from_copies);
  });
}

}  // namespace cuda
}  // namespace tierlift
