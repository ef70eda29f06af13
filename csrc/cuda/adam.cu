// Fused Adam/AdamW over many tensors (cuda/adam.cuh). Each block steps one chunk of kChunk
// elements of one tensor (the packing: cuda/multi_tensor.cuh). The step is memory-bound (28 bytes
// per fp32 parameter), so the loop is shaped as torch's multi_tensor_apply kernels are: when all
// of a tensor's arrays are aligned to kVec elements, each thread moves kVec consecutive elements
// per iteration with one 16-byte load and store per fp32 array (8 bytes per bf16/fp16 array,
// the copy's refresh check included), and only the last < kVec elements of the tensor take the
// scalar loop; a tensor with an unaligned array (a view at an odd offset) takes the scalar loop
// throughout. Indices within a chunk are 32-bit. Both loops run step_element on each element,
// adam_element.cuh's arithmetic, so the two are bit-identical to each other and to core.
#include <cstdint>

#include "cuda/adam.cuh"
#include "cuda/adam_element.cuh"
#include "cuda/launch.cuh"
#include "cuda/multi_tensor.cuh"

namespace tierlift {
namespace cuda {
namespace {

constexpr int64_t kChunk = 1 << 16;  // elements per block
constexpr int kThreads = 512;
constexpr int kVec = 4;  // elements per thread and iteration on the vector path
static_assert(kChunk % kVec == 0, "a chunk must start on a vector boundary");

using Pack = TensorPack<AdamTensorPtrs, kAdamPackTensors>;
// CUDA's limit for kernel parameters before 12.1 and Volta.
static_assert(sizeof(Pack) + sizeof(AdamScalars) + sizeof(const float*) + sizeof(bool) <= 4096,
              "the kernel's parameters must fit 4 KiB");

// kVec elements of an array in one aligned access (ld/st.global.v4 or .v2).
template <typename T>
using Vec = Elements<T, kVec>;

template <typename T>
__device__ __forceinline__ Vec<T> load_vec(const T* p, int j) {
  return load_elements<kVec>(p, j);
}
template <typename T>
__device__ __forceinline__ void store_vec(T* p, int j, const Vec<T>& v) {
  store_elements<kVec>(p, j, v);
}

// Whether every array the kernel touches for t can be read and written as Vecs (a chunk starts a
// multiple of kVec elements into its tensor, so its arrays are aligned as the tensor's are).
template <DType kGrad, DType kCopy>
__device__ __forceinline__ bool vec_aligned(const AdamTensorPtrs& t, bool amsgrad) {
  constexpr uintptr_t k32 = sizeof(Vec<float>);
  bool ok = aligned_to(t.param, k32) && aligned_to(t.exp_avg, k32) &&
            aligned_to(t.exp_avg_sq, k32) && aligned_to(t.grad, sizeof(Vec<Storage<kGrad>>));
  if (amsgrad) ok = ok && aligned_to(t.max_exp_avg_sq, k32);
  if constexpr (kCopy != DType::kNone) {
    ok = ok && aligned_to(t.param_copy, sizeof(Vec<Storage<kCopy>>));
  }
  return ok;
}

// p + offset, and null for null (an array the call does not have).
template <typename T>
__device__ __forceinline__ T* offset(T* p, int64_t n) {
  return p == nullptr ? p : p + n;
}

// One element: g the gradient as loaded, w the weight it steps from (refreshed from the copy
// where that applies), m, v and vmax (amsgrad) its state, updated in place; returns the new
// weight. core's decay_and_moments and apply_update, operation for operation.
template <bool kUnscale>
__device__ __forceinline__ float step_element(const AdamScalars& s, float inv_grad_scale, float g,
                                              float w, float& m, float& v, float& vmax) {
  g = grad_with_decay<kUnscale>(s, inv_grad_scale, g, w);
  const Moments mv = moments(s, g, m, v);
  m = mv.m;
  v = mv.v;
  float v_used = mv.v;
  if (s.amsgrad) {
    // NaN where either is, as torch.maximum and core's max_nan: a NaN v is kept, not dropped.
    v_used = v_used != v_used ? v_used : (vmax < v_used ? v_used : vmax);
    vmax = v_used;
  }
  return updated_weight(s, w, mv.m, v_used);
}

// At least 2 blocks (1024 threads) per SM: at most 64 registers a thread. Left to itself, ptxas
// gives the fp16-copy variants up to 73 (one block per SM) and spills in the bf16-copy ones;
// capped, none spills more than 16 bytes, and 1024 threads with 64-72 bytes of loads each in
// flight cover the latency-bandwidth product of an H100/H200 SM (about 30 KB) twice over.
template <DType kGrad, DType kCopy, bool kUnscale>
__global__ void __launch_bounds__(kThreads, 2)
    adam_kernel(Pack pack, AdamScalars s, const float* grad_scale, bool refresh) {
  using G = Storage<kGrad>;
  using C = Storage<kCopy>;
  constexpr bool kHasCopy = kCopy != DType::kNone;
  int64_t chunk;
  const AdamTensorPtrs& t = pack.t[pack_slot(pack, blockIdx.x, chunk)];
  const int64_t begin = chunk * kChunk;
  const int n = static_cast<int>(t.numel - begin < kChunk ? t.numel - begin : kChunk);
  // This chunk's part of each array.
  float* const param = t.param + begin;
  const G* const grad = static_cast<const G*>(t.grad) + begin;
  float* const exp_avg = t.exp_avg + begin;
  float* const exp_avg_sq = t.exp_avg_sq + begin;
  float* const max_exp_avg_sq = offset(t.max_exp_avg_sq, begin);
  C* const copy = offset(static_cast<C*>(t.param_copy), begin);
  const bool refresh_copy = kHasCopy && refresh;
  float inv_grad_scale = 1.f;
  if constexpr (kUnscale) inv_grad_scale = unscale_factor(grad_scale);

  int scalar_from = 0;
  if (vec_aligned<kGrad, kCopy>(t, s.amsgrad)) {
    const int vecs = n / kVec;
    for (int j = threadIdx.x; j < vecs; j += kThreads) {
      Vec<float> p = load_vec(param, j);
      const Vec<G> g = load_vec(grad, j);
      Vec<float> m = load_vec(exp_avg, j);
      Vec<float> v = load_vec(exp_avg_sq, j);
      Vec<float> vmax{};
      if (s.amsgrad) vmax = load_vec(max_exp_avg_sq, j);
      Vec<C> c{};
      if (refresh_copy) c = load_vec(copy, j);
      TIERLIFT_UNROLL
      for (int k = 0; k < kVec; ++k) {
        float w = p.x[k];
        if constexpr (kHasCopy) {
          if (refresh) w = refreshed_weight<kCopy>(w, c.x[k]);
        }
        p.x[k] = step_element<kUnscale>(s, inv_grad_scale, to_f32<kGrad>(g.x[k]), w, m.x[k], v.x[k],
                                        vmax.x[k]);
        if constexpr (kHasCopy) c.x[k] = from_f32<kCopy>(p.x[k]);
      }
      store_vec(exp_avg, j, m);
      store_vec(exp_avg_sq, j, v);
      if (s.amsgrad) store_vec(max_exp_avg_sq, j, vmax);
      store_vec(param, j, p);
      if constexpr (kHasCopy) store_vec(copy, j, c);
    }
    scalar_from = vecs * kVec;
  }
  for (int i = scalar_from + threadIdx.x; i < n; i += kThreads) {
    float w = param[i];
    if constexpr (kHasCopy) {
      if (refresh) w = refreshed_weight<kCopy>(w, copy[i]);
    }
    float m = exp_avg[i], v = exp_avg_sq[i], vmax = 0.f;
    if (s.amsgrad) vmax = max_exp_avg_sq[i];
    const float p =
        step_element<kUnscale>(s, inv_grad_scale, to_f32<kGrad>(grad[i]), w, m, v, vmax);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (s.amsgrad) max_exp_avg_sq[i] = vmax;
    param[i] = p;
    if constexpr (kHasCopy) copy[i] = from_f32<kCopy>(p);
  }
}

template <DType kGrad, DType kCopy>
cudaError_t run(const AdamTensorPtrs* tensors, int count, const AdamScalars& s, cudaStream_t stream,
                const float* grad_scale, bool refresh) {
  return launch_packed<kChunk, kAdamPackTensors>(tensors, count, [&](const Pack& pack, int blocks) {
    if (grad_scale != nullptr) {
      TIERLIFT_LAUNCH(blocks, kThreads, 0, stream, adam_kernel<kGrad, kCopy, true>)
      (pack, s, grad_scale, refresh);
    } else {
      TIERLIFT_LAUNCH(blocks, kThreads, 0, stream, adam_kernel<kGrad, kCopy, false>)
      (pack, s, grad_scale, refresh);
    }
  });
}

}  // namespace

cudaError_t adam_step(const AdamTensorPtrs* tensors, int count, DType grad_type, DType copy_type,
                      const AdamScalars& s, cudaStream_t stream, const float* grad_scale,
                      bool refresh_from_copies) {
  return dispatch_grad_copy(grad_type, copy_type, [&](auto grad, auto copy) {
    return run<decltype(grad)::value, decltype(copy)::value>(tensors, count, s, stream, grad_scale,
                                                             refresh_from_copies);
  });
}

}  // namespace cuda
}  // namespace tierlift
