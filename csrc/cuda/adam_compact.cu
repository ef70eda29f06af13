#include "core/optim/adam_compact.h"
#include "cuda/adam_compact.cuh"
#include "cuda/adam_element.cuh"
#include "cuda/launch.cuh"
#include "cuda/multi_tensor.cuh"

namespace tierlift {
namespace cuda {
namespace {

constexpr int64_t kChunk = 1 << 16;      // elements per CUDA block: whole code blocks
constexpr int kThreads = kCompactBlock;  // one element of the code block per thread
constexpr int kWarps = kThreads / 32;
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

// adam_impl.h's decay_and_moments and apply_update on one element; returns the new v.
template <DType kGrad, DType kCopy, bool kUnscale>
__device__ __forceinline__ float step_element(const CompactAdamTensorPtrs& t, const AdamScalars& s,
                                              float inv_grad_scale, bool refresh, int64_t i,
                                              float old_max) {
  float p;
  const float g = grad_and_decay<kGrad, kCopy, kUnscale>(s, inv_grad_scale, t.grad, t.param,
                                                         t.param_copy, refresh, i, p);
  const Moments mv =
      moments(s, g, bf16_to_f32(t.exp_avg[i]), decode_code(t.exp_avg_sq[i], old_max));
  t.exp_avg[i] = f32_to_bf16(mv.m);
  apply_update<kCopy>(s, t.param, t.param_copy, i, p, mv.m, mv.v);
  return mv.v;
}

template <DType kGrad, DType kCopy, bool kUnscale>
__global__ void __launch_bounds__(kThreads)
    adam_compact_kernel(Pack pack, AdamScalars s, const float* grad_scale, bool refresh) {
  __shared__ float warp_max[kWarps];
  __shared__ int warp_bad[kWarps];
  int64_t chunk;
  const CompactAdamTensorPtrs& t = pack.t[pack_slot(pack, blockIdx.x, chunk)];
  const int64_t begin = chunk * kChunk;
  const int64_t end = min(t.numel, begin + kChunk);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float inv_grad_scale = 1.f;
  if constexpr (kUnscale) inv_grad_scale = unscale_factor(grad_scale);
  for (int64_t b0 = begin; b0 < end; b0 += kCompactBlock) {
    float* scale = t.exp_avg_sq_scale + b0 / kCompactBlock;
    const int64_t i = b0 + threadIdx.x;
    const bool live = i < end;
    const float v =
        live ? step_element<kGrad, kCopy, kUnscale>(t, s, inv_grad_scale, refresh, i, *scale) : 0.f;
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
