// Multi-tensor fused Adam/AdamW on the GPU, torch-free. The host side packs many tensor
// descriptors into each launch (cuda/multi_tensor.cuh), so a model with hundreds of parameters
// costs a handful of launches, as apex/torch's fused optimizers do. Arithmetic matches the CPU
// kernel (core/optim/adam_impl.h) operation for operation, with explicitly rounded intrinsics so
// nvcc cannot contract them into FMAs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/optim/adam.h"

namespace tierlift {
namespace cuda {

// Tensors per kernel launch (the rest of a call takes further launches).
constexpr int kAdamPackTensors = 64;

struct AdamTensorPtrs {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // null unless amsgrad
  void* param_copy;       // null when no copy is written
  int64_t numel;
};

// All tensors in one call share grad_type and copy_type (the caller groups them). grad_scale:
// null, or GradScaler's fp32 scale in device memory (finite, > 0): every gradient is multiplied
// by (float)(1.0 / (double)*grad_scale) before use, as GradScaler.unscale_ would.
// refresh_from_copies: each param_copy holds the model weight whose master param is; an element
// whose copy is not its param rounded to copy_type (bit for bit, as the kernel writes copies) is
// stepped from the copy's value instead (the weight was changed outside the optimizer). Off, the
// copies are only written (they may hold anything before the call). No effect without copies.
cudaError_t adam_step(const AdamTensorPtrs* tensors, int count, DType grad_type, DType copy_type,
                      const AdamScalars& s, cudaStream_t stream, const float* grad_scale = nullptr,
                      bool refresh_from_copies = false);

}  // namespace cuda
}  // namespace tierlift
