// The FP8 quantizer's tiled path (fp8_quant_tiles.cu), called by fp8_quantize for everything the
// fused row / 1x128 kernels do not take. Internal header.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/fp8_quant.cuh"

namespace tierlift {
namespace cuda {

// Turns n amaxes into scales in place (zeroing them first when `zero`: the empty-input case).
cudaError_t fp8_amax_to_scales(float* s, int64_t n, Fp8Format fmt, bool pow2, bool zero,
                               cudaStream_t stream);

// Tensor, column and 128x128 scaling, any strided input, and the dual (x and x^T) output of any
// scaling, for a non-empty input.
cudaError_t fp8_quantize_tiled(const Fp8QuantArgs& a, cudaStream_t stream);

}  // namespace cuda
}  // namespace tierlift
