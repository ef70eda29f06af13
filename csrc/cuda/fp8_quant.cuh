// Fused FP8 quantization on the GPU, torch-free: amax -> scale -> saturating cast for the
// scalings of core/lowp/quantize.h (tensor, row, column, 1x128, 128x128), optionally also
// emitting the quantization of x^T (the column-major copy the backward GEMMs read).
//
// Shapes of work:
//  - Row and 1x128 scaling of a row-contiguous input, single output: ONE fused kernel. A 1x128
//    block is one warp (4 values per lane held in registers: read once); a row is one thread
//    block that reduces the row's amax and then casts it (the second read hits L2).
//  - Everything else (tensor scaling's global reduction, column and 128x128 blocks, the dual
//    row+column-major output): two passes over 32x32 tiles. Pass 1 reduces each tile's slice of
//    every scaling block in shared memory and merges it with one atomicMax per (tile, block)
//    (non-negative floats order like their bit patterns); a tiny kernel turns amaxes into
//    scales; pass 2 casts, writing q directly and q^T through the shared-memory tile so both
//    stores are coalesced.
// Every element follows fp8.h's formulas with explicitly rounded intrinsics (__fmul_rn,
// __fdiv_rn), so results are bit-identical to the C++ reference.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/lowp/fp8.h"
#include "core/lowp/quantize.h"
#include "core/util/dtype.h"

namespace tierlift {
namespace cuda {

struct Fp8QuantArgs {
  const void* x = nullptr;  // device pointer
  DType dtype = DType::kFloat32;
  int64_t rows = 0, cols = 0;
  int64_t row_stride = 0, col_stride = 1;  // elements
  Fp8Scaling scaling = Fp8Scaling::kTensor;
  Fp8Format fmt = Fp8Format::kE4M3;
  bool pow2_scale = false;
  uint8_t* q = nullptr;       // [rows, cols] row-major
  float* scales = nullptr;    // fp8_blocks(scaling, rows, cols) grid, row-major
  uint8_t* qt = nullptr;      // optional: [cols, rows] = quantization of x^T
  float* scales_t = nullptr;  // fp8_blocks(scaling, cols, rows) grid (with qt)
};

// Enqueues the quantization on `stream`; returns the first launch error.
cudaError_t fp8_quantize(const Fp8QuantArgs& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace tierlift
