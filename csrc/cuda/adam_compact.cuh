// Multi-tensor fused Adam/AdamW with compact state on the GPU, torch-free: m in bf16, v as 8-bit
// codes with one fp32 scale (the block max) per 256 elements (core/optim/adam_compact.h has the
// format and its error bound). Packs tensors into launches as cuda/adam.cuh does
// (cuda/multi_tensor.cuh). One warp steps one 256-element code block, 8 consecutive elements per
// lane with 16-byte loads and stores (8-byte for the codes) where the tensor's arrays are aligned
// for them, and reduces the block's new max with warp shuffles and a vote before encoding: no
// shared memory and no barrier, so 8 code blocks per CUDA block proceed independently and each lane
// keeps ~100 bytes of loads in flight (cuda/adam_compact.cu). Arithmetic matches the CPU kernel
// operation for operation, with explicitly rounded intrinsics.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/optim/adam.h"

namespace tierlift {
namespace cuda {

struct CompactAdamTensorPtrs {
  float* param;
  const void* grad;
  uint16_t* exp_avg;        // bf16 bits
  uint8_t* exp_avg_sq;      // v codes
  float* exp_avg_sq_scale;  // one per 256 elements
  void* param_copy;         // null when no copy is written
  int64_t numel;
};

// All tensors in one call share grad_type and copy_type (the caller groups them). grad_scale and
// refresh_from_copies: as in cuda::adam_step (cuda/adam.cuh).
cudaError_t adam_compact_step(const CompactAdamTensorPtrs* tensors, int count, DType grad_type,
                              DType copy_type, const AdamScalars& s, cudaStream_t stream,
                              const float* grad_scale = nullptr, bool refresh_from_copies = false);

}  // namespace cuda
}  // namespace tierlift
