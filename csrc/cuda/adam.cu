#include "cuda/adam.cuh"
#include "cuda/adam_element.cuh"
#include "cuda/launch.cuh"
#include "cuda/multi_tensor.cuh"

namespace tierlift {
namespace cuda {
namespace {

constexpr int64_t kChunk = 1 << 16;  // elements per block
constexpr int kThreads = 512;

using Pack = TensorPack<AdamTensorPtrs>;

template <DType kGrad, DType kCopy, bool kUnscale>
__global__ void __launch_bounds__(kThreads)
    adam_kernel(Pack pack, AdamScalars s, const float* grad_scale, bool refresh) {
  const AdamTensorPtrs& t = pack.t[pack.block_tensor[blockIdx.x]];
  const int64_t begin = static_cast<int64_t>(pack.block_chunk[blockIdx.x]) * kChunk;
  const int64_t end = min(t.numel, begin + kChunk);
  float inv_grad_scale = 1.f;
  if constexpr (kUnscale) inv_grad_scale = unscale_factor(grad_scale);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float p;
    const float g = grad_and_decay<kGrad, kCopy, kUnscale>(s, inv_grad_scale, t.grad, t.param,
                                                           t.param_copy, refresh, i, p);
    const Moments mv = moments(s, g, t.exp_avg[i], t.exp_avg_sq[i]);
    t.exp_avg[i] = mv.m;
    t.exp_avg_sq[i] = mv.v;
    float v = mv.v;
    if (s.amsgrad) {
      const float vmax = t.max_exp_avg_sq[i];
      v = vmax < v ? v : vmax;
      t.max_exp_avg_sq[i] = v;
    }
    apply_update<kCopy>(s, t.param, t.param_copy, i, p, mv.m, v);
  }
}

template <DType kGrad, DType kCopy>
cudaError_t run(const AdamTensorPtrs* tensors, int count, const AdamScalars& s, cudaStream_t stream,
                const float* grad_scale, bool refresh) {
  return launch_packed<kChunk>(tensors, count, [&](const Pack& pack, int blocks) {
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
