// The host side of the multi-tensor optimizer kernels (cuda/adam.cu, cuda/adam_compact.cu): the
// packing of many tensors into few launches and the run-time (grad dtype, copy dtype) ->
// template dispatch.
//
// A launch takes one TensorPack by value: up to kTensors tensor descriptors and, per tensor, the
// first block that works on it, so a model with hundreds of parameters costs a handful of
// launches, as apex/torch's fused optimizers do. There is no per-block (tensor, chunk) table,
// which would cap a launch at a few hundred blocks to fit the 4 KiB kernel parameters: a block
// finds its tensor by a binary search over block_start. So a launch has as many blocks as its
// tensors have chunks, and the GPU stays full to the end of a pack instead of draining every
// few hundred blocks. A tensor with more chunks than pack_block_limit() is split across
// launches.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/util/dtype.h"

namespace tierlift {
namespace cuda {

constexpr int kPackTensors = 24;

template <typename Ptrs, int kTensors = kPackTensors>
struct TensorPack {
  Ptrs t[kTensors];
  int32_t block_start[kTensors];  // first block of t[k] in this launch, ascending
  int32_t tensors;                // slots in use
  int64_t first_chunk;            // t[0]'s chunk of block 0 (> 0 when split across launches)
};

// The most blocks one launch gets (a tensor with more chunks is split across launches). Grids
// may have 2^31 - 1 blocks; tests lower it to reach the split on small shapes.
inline int64_t& pack_block_limit() {
  static int64_t limit = int64_t{1} << 30;
  return limit;
}

// The slot (pack.t index) and chunk of the tensor that `block` works on.
template <typename Pack>
__device__ __forceinline__ int pack_slot(const Pack& pack, int block, int64_t& chunk) {
  int lo = 0, hi = pack.tensors - 1;  // block_start[lo] <= block throughout
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (pack.block_start[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  chunk = (lo == 0 ? pack.first_chunk : 0) + (block - pack.block_start[lo]);
  return lo;
}

// Cuts every tensor (Ptrs has a numel) into chunks of kChunk elements, one CUDA block each, and
// calls launch(pack, blocks) for every full pack (kTensors tensors or pack_block_limit()
// blocks) and for the last one; stops at the first launch error. Block b of a launch works on
// the chunk pack_slot(pack, b, chunk) returns. Empty tensors take no slot.
template <int64_t kChunk, int kTensors = kPackTensors, typename Ptrs, typename Launch>
cudaError_t launch_packed(const Ptrs* tensors, int count, Launch&& launch) {
  const int64_t limit = std::min<int64_t>(std::max<int64_t>(pack_block_limit(), 1), INT32_MAX);
  TensorPack<Ptrs, kTensors> pack;
  pack.tensors = 0;
  pack.first_chunk = 0;
  int64_t blocks = 0;
  for (int i = 0; i < count; ++i) {
    const int64_t chunks = (tensors[i].numel + kChunk - 1) / kChunk;
    for (int64_t done = 0; done < chunks;) {
      if (pack.tensors == kTensors || blocks == limit) {
        launch(pack, static_cast<int>(blocks));
        if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
        pack.tensors = 0;
        blocks = 0;
      }
      // A tensor continued from the last launch starts this one, at slot 0.
      if (pack.tensors == 0) pack.first_chunk = done;
      const int64_t take = std::min(chunks - done, limit - blocks);
      pack.t[pack.tensors] = tensors[i];
      pack.block_start[pack.tensors] = static_cast<int32_t>(blocks);
      ++pack.tensors;
      blocks += take;
      done += take;
    }
  }
  if (blocks > 0) {
    launch(pack, static_cast<int>(blocks));
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
