#include <cuda_fp16.h>

#include "cuda/adam.cuh"
#include "cuda/launch.cuh"

namespace tierlift {
namespace cuda {
namespace {

constexpr int kMaxTensors = 24;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 1 << 16;  // elements per block
constexpr int kThreads = 512;

struct Pack {
  AdamTensorPtrs t[kMaxTensors];
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
// __float2half_rn, except that NaN keeps its sign as sign | 0x7e00 (the device's is 0x7fff), as
// core's f32_to_f16 and c10::Half write it.
__device__ __forceinline__ uint16_t f32_to_f16(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u);
  return __half_as_ushort(__float2half_rn(f));
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

template <DType kGrad, DType kCopy>
__global__ void __launch_bounds__(kThreads) adam_kernel(Pack pack, AdamScalars s) {
  const AdamTensorPtrs& t = pack.t[pack.block_tensor[blockIdx.x]];
  const int64_t begin = static_cast<int64_t>(pack.block_chunk[blockIdx.x]) * kChunk;
  const int64_t end = min(t.numel, begin + kChunk);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float g = load<kGrad>(t.grad, i);
    if (s.maximize) g = -g;
    float p = t.param[i];
    if (s.decoupled) {
      p = __fmul_rn(p, s.decay);
    } else if (s.weight_decay != 0.f) {
      g = __fmaf_rn(s.weight_decay, p, g);
    }
    float m = __fmaf_rn(s.one_minus_beta1, __fsub_rn(g, t.exp_avg[i]), t.exp_avg[i]);
    float v = __fmul_rn(t.exp_avg_sq[i], s.beta2);
    v = __fadd_rn(v, __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
    t.exp_avg[i] = m;
    t.exp_avg_sq[i] = v;
    if (s.amsgrad) {
      const float vmax = t.max_exp_avg_sq[i];
      v = vmax < v ? v : vmax;
      t.max_exp_avg_sq[i] = v;
    }
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bc2_sqrt), s.eps);
    p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
    t.param[i] = p;
    if constexpr (kCopy != DType::kNone) store<kCopy>(t.param_copy, i, p);
  }
}

template <DType kGrad, DType kCopy>
cudaError_t run(const AdamTensorPtrs* tensors, int count, const AdamScalars& s,
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
        TIERLIFT_LAUNCH(nb, kThreads, 0, stream, adam_kernel<kGrad, kCopy>)(pack, s);
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
    TIERLIFT_LAUNCH(nb, kThreads, 0, stream, adam_kernel<kGrad, kCopy>)(pack, s);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

template <DType kGrad>
cudaError_t run_copy(const AdamTensorPtrs* t, int n, DType copy, const AdamScalars& s,
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

cudaError_t adam_step(const AdamTensorPtrs* tensors, int count, DType grad_type, DType copy_type,
                      const AdamScalars& s, cudaStream_t stream) {
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
