#include <cuda_fp16.h>

#include "core/optim/adam_compact.h"
#include "cuda/adam_compact.cuh"
#include "cuda/launch.cuh"

namespace tierlift {
namespace cuda {
namespace {

constexpr int kMaxTensors = 24;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 1 << 16;      // elements per CUDA block: whole code blocks
constexpr int kThreads = kCompactBlock;  // one element of the code block per thread
constexpr int kWarps = kThreads / 32;
static_assert(kChunk % kCompactBlock == 0, "a code block must not straddle two CUDA blocks");

struct Pack {
  CompactAdamTensorPtrs t[kMaxTensors];
  uint8_t block_tensor[kMaxBlocks];
  int32_t block_chunk[kMaxBlocks];
};

__device__ __forceinline__ float bf16_to_f32(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}
__device__ __forceinline__ uint16_t f32_to_bf16(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + ((u >> 16) & 1u) + 0x7fffu) >> 16);
}
// As cuda/adam.cu: NaN keeps its sign as sign | 0x7e00, like core's f32_to_f16.
__device__ __forceinline__ uint16_t f32_to_f16(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u);
  return __half_as_ushort(__float2half_rn(f));
}

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

template <DType kT>
__device__ __forceinline__ float load(const void* p, int64_t i) {
  if constexpr (kT == DType::kFloat32) return static_cast<const float*>(p)[i];
  if constexpr (kT == DType::kBFloat16) return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  if constexpr (kT == DType::kFloat16) return __half2float(static_cast<const __half*>(p)[i]);
  return 0.f;
}

template <DType kT>
__device__ __forceinline__ void store(void* p, int64_t i, float x) {
  if constexpr (kT == DType::kFloat32) static_cast<float*>(p)[i] = x;
  if constexpr (kT == DType::kBFloat16) static_cast<uint16_t*>(p)[i] = f32_to_bf16(x);
  if constexpr (kT == DType::kFloat16) static_cast<uint16_t*>(p)[i] = f32_to_f16(x);
}

// adam_impl.h's decay_and_moments and apply_update on one element; returns the new v.
template <DType kGrad, DType kCopy>
__device__ __forceinline__ float step_element(const CompactAdamTensorPtrs& t, const AdamScalars& s,
                                              int64_t i, float old_max) {
  float g = load<kGrad>(t.grad, i);
  if (s.maximize) g = -g;
  float p = t.param[i];
  if (s.decoupled) {
    p = __fmul_rn(p, s.decay);
  } else if (s.weight_decay != 0.f) {
    g = __fmaf_rn(s.weight_decay, p, g);
  }
  const float m0 = bf16_to_f32(t.exp_avg[i]);
  const float m = __fmaf_rn(s.one_minus_beta1, __fsub_rn(g, m0), m0);
  float v = __fmul_rn(decode_code(t.exp_avg_sq[i], old_max), s.beta2);
  v = __fadd_rn(v, __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
  t.exp_avg[i] = f32_to_bf16(m);
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bc2_sqrt), s.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
  t.param[i] = p;
  if constexpr (kCopy != DType::kNone) store<kCopy>(t.param_copy, i, p);
  return v;
}

template <DType kGrad, DType kCopy>
__global__ void __launch_bounds__(kThreads) adam_compact_kernel(Pack pack, AdamScalars s) {
  __shared__ float warp_max[kWarps];
  __shared__ int warp_bad[kWarps];
  const CompactAdamTensorPtrs& t = pack.t[pack.block_tensor[blockIdx.x]];
  const int64_t begin = static_cast<int64_t>(pack.block_chunk[blockIdx.x]) * kChunk;
  const int64_t end = min(t.numel, begin + kChunk);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t b0 = begin; b0 < end; b0 += kCompactBlock) {
    float* scale = t.exp_avg_sq_scale + b0 / kCompactBlock;
    const int64_t i = b0 + threadIdx.x;
    const bool live = i < end;
    const float v = live ? step_element<kGrad, kCopy>(t, s, i, *scale) : 0.f;
    // Block max (exact in any order) and whether any v is NaN or infinite.
    float vmax = v;
    int bad = !(__fsub_rn(v, v) == 0.f);
    for (int o = 16; o > 0; o >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, vmax, o);
      vmax = vmax < other ? other : vmax;
      bad |= __shfl_xor_sync(0xffffffffu, bad, o);
    }
    if (lane == 0) {
      warp_max[warp] = vmax;
      warp_bad[warp] = bad;
    }
    __syncthreads();  // every thread has also read the old scale by now
    vmax = 0.f;
    bad = 0;
    for (int w = 0; w < kWarps; ++w) {
      vmax = vmax < warp_max[w] ? warp_max[w] : vmax;
      bad |= warp_bad[w];
    }
    __syncthreads();  // warp_max is rewritten by the next code block
    if (threadIdx.x == 0) *scale = bad ? __int_as_float(0x7fc00000) : vmax;
    if (live) t.exp_avg_sq[i] = bad ? 255 : encode_code(v, vmax);
  }
}

template <DType kGrad, DType kCopy>
cudaError_t run(const CompactAdamTensorPtrs* tensors, int count, const AdamScalars& s,
                cudaStream_t stream) {
  Pack pack;
  int nt = 0, nb = 0;
  for (int i = 0; i < count; ++i) {
    const int64_t chunks = (tensors[i].numel + kChunk - 1) / kChunk;
    if (chunks == 0) continue;
    pack.t[nt] = tensors[i];
    for (int64_t c = 0; c < chunks; ++c) {
      pack.block_tensor[nb] = static_cast<uint8_t>(nt);
      pack.block_chunk[nb] = static_cast<int32_t>(c);
      ++nb;
      const bool last_chunk = c == chunks - 1;
      if (nb == kMaxBlocks || (last_chunk && nt + 1 == kMaxTensors)) {
        TIERLIFT_LAUNCH(nb, kThreads, 0, stream, adam_compact_kernel<kGrad, kCopy>)(pack, s);
        if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
        nb = 0;
        // A tensor split across launches starts the next pack at slot 0.
        if (!last_chunk) {
          pack.t[0] = tensors[i];
          nt = 0;
        } else {
          nt = -1;
        }
      }
    }
    ++nt;
  }
  if (nb > 0) {
    TIERLIFT_LAUNCH(nb, kThreads, 0, stream, adam_compact_kernel<kGrad, kCopy>)(pack, s);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

template <DType kGrad>
cudaError_t run_copy(const CompactAdamTensorPtrs* t, int n, DType copy, const AdamScalars& s,
                     cudaStream_t st) {
  switch (copy) {
    case DType::kFloat32:
      return run<kGrad, DType::kFloat32>(t, n, s, st);
    case DType::kBFloat16:
      return run<kGrad, DType::kBFloat16>(t, n, s, st);
    case DType::kFloat16:
      return run<kGrad, DType::kFloat16>(t, n, s, st);
    default:
      return run<kGrad, DType::kNone>(t, n, s, st);
  }
}

}  // namespace

cudaError_t adam_compact_step(const CompactAdamTensorPtrs* tensors, int count, DType grad_type,
                              DType copy_type, const AdamScalars& s, cudaStream_t stream) {
  switch (grad_type) {
    case DType::kBFloat16:
      return run_copy<DType::kBFloat16>(tensors, count, copy_type, s, stream);
    case DType::kFloat16:
      return run_copy<DType::kFloat16>(tensors, count, copy_type, s, stream);
    default:
      return run_copy<DType::kFloat32>(tensors, count, copy_type, s, stream);
  }
}

}  // namespace cuda
}  // namespace tierlift
