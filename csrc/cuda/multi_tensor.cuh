// The host side of the multi-tensor optimizer kernels (cuda/adam.cu, cuda/adam_compact.cu): the
// packing of many tensors into few launches and the run-time (grad dtype, copy dtype) ->
// template dispatch.
//
// A launch takes one TensorPack by value: up to kPackTensors tensor descriptors and a
// block -> (tensor, chunk) map for up to kPackBlocks CUDA blocks, so a model with hundreds of
// parameters costs a handful of launches, as apex/torch's fused optimizers do. A tensor too
// large for the blocks left in a pack is split across launches.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/util/dtype.h"

namespace tierlift {
namespace cuda {

constexpr int kPackTensors = 24;
constexpr int kPackBlocks = 320;

template <typename Ptrs>
struct TensorPack {
  Ptrs t[kPackTensors];
  uint8_t block_tensor[kPackBlocks];
  int32_t block_chunk[kPackBlocks];
};

// Cuts every tensor (Ptrs has a numel) into chunks of kChunk elements, one CUDA block each, and
// calls launch(pack, blocks) for every full pack and for the last one; stops at the first launch
// error. Block b of a launch works on chunk pack.block_chunk[b] of pack.t[pack.block_tensor[b]].
template <int64_t kChunk, typename Ptrs, typename Launch>
cudaError_t launch_packed(const Ptrs* tensors, int count, Launch&& launch) {
  TensorPack<Ptrs> pack;
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
      if (nb == kPackBlocks || (last_chunk && nt + 1 == kPackTensors)) {
        launch(pack, nb);
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
    launch(pack, nb);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

template <DType kT>
using DTypeTag = std::integral_constant<DType, kT>;

template <DType kGrad, typename Run>
cudaError_t dispatch_copy(DType copy_type, Run& run) {
  switch (copy_type) {
    case DType::kFloat32:
      return run(DTypeTag<kGrad>{}, DTypeTag<DType::kFloat32>{});
    case DType::kBFloat16:
      return run(DTypeTag<kGrad>{}, DTypeTag<DType::kBFloat16>{});
    case DType::kFloat16:
      return run(DTypeTag<kGrad>{}, DTypeTag<DType::kFloat16>{});
    default:
      return run(DTypeTag<kGrad>{}, DTypeTag<DType::kNone>{});
  }
}

// run(DTypeTag<grad>{}, DTypeTag<copy>{}) with the run-time dtypes as compile-time ones: grad
// fp32 unless bf16 or fp16, copy none unless fp32, bf16 or fp16.
template <typename Run>
cudaError_t dispatch_grad_copy(DType grad_type, DType copy_type, Run&& run) {
  switch (grad_type) {
    case DType::kBFloat16:
      return dispatch_copy<DType::kBFloat16>(copy_type, run);
    case DType::kFloat16:
      return dispatch_copy<DType::kFloat16>(copy_type, run);
    default:
      return dispatch_copy<DType::kFloat32>(copy_type, run);
  }
}

}  // namespace cuda
}  // namespace tierlift
