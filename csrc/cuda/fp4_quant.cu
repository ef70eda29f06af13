#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/fp4_quant.cuh"
#include "cuda/launch.cuh"

namespace tierlift {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFull = 0xffffffffu;

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

// The element this lane owns, rotated; `valid` is false past the end (the lane still takes
// part in the shuffles with a zero).
template <DType kT>
__device__ __forceinline__ float rotated(const Fp4QuantArgs& a, int64_t e, bool valid, int lane) {
  float v = 0.f;
  if (valid) {
    const int64_t i = e / a.cols, j = e - i * a.cols;
    v = load<kT>(a.x, i * a.row_stride + j * a.col_stride);
  }
  if (a.hadamard) {
    const int n = a.hadamard;
    if ((a.signs >> (lane & (n - 1))) & 1u) v = -v;
    for (int h = 1; h < n; h <<= 1) {
      const float p = __shfl_xor_sync(kFull, v, h);
      v = (lane & h) ? __fsub_rn(p, v) : __fadd_rn(v, p);
    }
    v = __fmul_rn(v, n == 16 ? fp4::kHadamardScale16 : fp4::kHadamardScale32);
  }
  return v;
}

// Max over groups of `width` (16 or 32) lanes.
__device__ __forceinline__ float group_max(float v, int width) {
  for (int h = width / 2; h >= 1; h >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, h));
  return v;
}

__device__ __forceinline__ float group_tree_sum(float s, int width) {
  for (int h = width / 2; h >= 1; h >>= 1) s = __fadd_rn(s, __shfl_xor_sync(kFull, s, h));
  return s;
}

// Encode, pack two nibbles per byte, write the mask.
__device__ __forceinline__ void encode_store(const Fp4QuantArgs& a, int64_t e, bool valid, int lane,
                                             float v) {
  uint8_t q = 0;
  if (a.stochastic) {
    q = fp4::e2m1_encode_sr(v, fp4::philox_uniform(a.seed, a.offset, static_cast<uint64_t>(e)));
  } else {
    q = fp4::e2m1_encode_rne(v);
  }
  const uint32_t hi = __shfl_down_sync(kFull, static_cast<uint32_t>(q), 1);
  if (!valid) return;
  if ((lane & 1) == 0) a.codes[e >> 1] = static_cast<uint8_t>(q | (hi << 4));
  if (a.mask) a.mask[e] = fabsf(v) <= fp4::kMax ? 1 : 0;
}

template <DType kT>
__global__ void mx_kernel(Fp4QuantArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t e = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x);
  const int64_t total = a.rows * a.cols;
  const bool valid = e < total;
  const float v = rotated<kT>(a, e, valid, lane);
  const float f = fp4::finite_abs(v);
  float stat = group_max(f, 32);
  if (a.rule == fp4::ScaleRule::kQuest) {  // fp4::block_rms, lane by lane
    const int k = fp4::rms_shift(stat);
    const float fs = __fmul_rn(f, fp4::pow2(-k));
    const float sum = group_tree_sum(__fmul_rn(fs, fs), 32);
    stat = __fmul_rn(__fsqrt_rn(__fmul_rn(sum, 1.f / 32)), fp4::pow2(k));
  }
  const bool bad = __any_sync(kFull, fp4::nonfinite(v));  // the block holds a NaN/Inf
  const int ex = fp4::mx_exponent(stat, a.rule);
  if (valid && lane == 0) a.scales[e >> 5] = bad ? fp4::kE8M0Nan : static_cast<uint8_t>(ex + 127);
  encode_store(a, e, valid, lane, __fmul_rn(v, bad ? fp4::nan_f32() : fp4::pow2(-ex)));
}

__device__ __forceinline__ void atomic_max_nonneg(float* addr, float v) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));  // v >= 0 orders like its bits
}

template <DType kT>
__global__ void nv_amax_kernel(Fp4QuantArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t e = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x);
  const bool valid = e < a.rows * a.cols;
  const float v = rotated<kT>(a, e, valid, lane);
  const float m = group_max(fp4::finite_abs(v), 16);
  // A 16-lane group holding a NaN/Inf stores amax +inf (never a finite amax): the NaN scale.
  const bool bad = ((__ballot_sync(kFull, fp4::nonfinite(v)) >> (lane & 16)) & 0xffffu) != 0;
  if (valid && (lane & 15) == 0) a.workspace[e >> 4] = bad ? fp4::inf_f32() : m;
  const float w = __shfl_xor_sync(kFull, m, 16);
  if (lane == 0) atomic_max_nonneg(a.workspace + (a.rows * a.cols >> 4), fmaxf(m, w));
}

template <DType kT>
__global__ void nv_encode_kernel(Fp4QuantArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t e = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x);
  const int64_t total = a.rows * a.cols;
  const bool valid = e < total;
  const float v = rotated<kT>(a, e, valid, lane);
  const float st = fp4::nv_tensor_scale(a.workspace[total >> 4]);
  if (e == 0) *a.tensor_scale = st;
  float amax = 0.f;
  int64_t slot = 0;
  bool writer = false;
  if (valid) {
    const int64_t nb = a.cols >> 4;
    const int64_t i = e / a.cols, k = (e - i * a.cols) >> 4;
    if (a.block_2d) {
      const int64_t i0 = i & ~int64_t{15};
      const int64_t i1 = i0 + 16 < a.rows ? i0 + 16 : a.rows;
      for (int64_t r = i0; r < i1; ++r) amax = fmaxf(amax, a.workspace[r * nb + k]);
      slot = (i >> 4) * nb + k;
      writer = (i & 15) == 0;
    } else {
      amax = a.workspace[i * nb + k];
      slot = i * nb + k;
      writer = true;
    }
    writer = writer && (lane & 15) == 0;
  }
  const uint8_t code = fp4::nv_scale_code(amax, st);
  if (writer) a.scales[slot] = code;
  encode_store(a, e, valid, lane, __fmul_rn(v, fp4::nv_multiplier(code, st)));
}

template <DType kT>
cudaError_t launch(const Fp4QuantArgs& a, cudaStream_t stream) {
  const int64_t total = a.rows * a.cols;
  if (total == 0) return cudaSuccess;  // the caller filled tensor_scale
  const unsigned blocks = static_cast<unsigned>((total + kThreads - 1) / kThreads);
  if (a.rule != fp4::ScaleRule::kNv) {
    TIERLIFT_LAUNCH(blocks, kThreads, 0, stream, mx_kernel<kT>)(a);
    return cudaGetLastError();
  }
  cudaError_t err = cudaMemsetAsync(a.workspace + (total >> 4), 0, sizeof(float), stream);
  if (err != cudaSuccess) return err;
  TIERLIFT_LAUNCH(blocks, kThreads, 0, stream, nv_amax_kernel<kT>)(a);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  TIERLIFT_LAUNCH(blocks, kThreads, 0, stream, nv_encode_kernel<kT>)(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t fp4_quantize(const Fp4QuantArgs& args, cudaStream_t stream) {
  switch (args.dtype) {
    case DType::kFloat32:
      return launch<DType::kFloat32>(args, stream);
    case DType::kBFloat16:
      return launch<DType::kBFloat16>(args, stream);
    default:
      return launch<DType::kFloat16>(args, stream);
  }
}

}  // namespace cuda
}  // namespace tierlift
