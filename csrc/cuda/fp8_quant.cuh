// Fused FP8 quantization on the GPU, torch-free: amax -> scale -> saturating cast for the
// scalings of core/lowp/quantize.h (tensor, row, column, 1x128, 128x128), optionally also
// emitting the quantization of x^T (the column-major copy the backward GEMMs read).
//
// Shapes of work (the kernels move 8 elements per 16-byte load and 4-16 codes per store where the
// view's alignment allows, element by element where it does not):
//  - Row and 1x128 scaling of a row-contiguous input, single output: ONE fused kernel
//    (fp8_quant.cu). A 1x128 block is 4 lanes holding its values in registers (read once); a
//    row is one thread block that keeps rows of up to 16384 elements in registers, reduces the
//    row's amax and casts it. Both encode with the branch-free encoder (fp8_device.cuh).
//  - Everything else (tensor scaling's global reduction, column and 128x128 blocks, strided
//    views, the dual row+column-major output): two passes over 64x64 tiles (fp8_quant_tiles.cu).
//    Pass 1 reduces each tile's slice of every scaling block in shared memory and merges it with
//    one atomicMax per (tile, block) (non-negative floats order like their bit patterns); tensor
//    scaling of a contiguous input is one grid-stride reduction with one atomicMax per thread
//    block. A tiny kernel turns amaxes into scales; pass 2 stages the tile in shared memory and
//    writes q and q^T from it as 16-byte rows of codes, so both stores are coalesced.
//  - Delayed tensor scaling (a scale chosen ahead, fp8_quantize_delayed, or taken from an amax
//    history on the device, fp8_quantize_from_history): one pass that casts and reduces the amax
//    together (fp8_quant_tiles.cu), a second only where the scale would clip.
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

// Delayed scaling (core's fp8_quantize_delayed, fp8_quant_tiles.cu): tensor scaling with a scale
// chosen ahead, read from device memory. One pass casts q (and q^T) with *scale and reduces x's
// finite amax (one atomicMax per thread block); a one-thread kernel writes scale_used = *scale,
// or x's own scale where fl(amax * *scale) > max or *scale is not finite and > 0 (it cannot be
// refused without a host sync); a second cast, whose blocks return at once unless scale_used
// differs from *scale, recasts only then. Never synchronizes with the host.
struct Fp8DelayedArgs {
  const void* x = nullptr;  // device pointer
  DType dtype = DType::kFloat32;
  int64_t rows = 0, cols = 0;
  int64_t row_stride = 0, col_stride = 1;  // elements
  Fp8Format fmt = Fp8Format::kE4M3;
  bool pow2_scale = false;       // for x's own scale only
  const float* scale = nullptr;  // [1], the scale chosen ahead
  uint8_t* q = nullptr;          // [rows, cols] row-major
  uint8_t* qt = nullptr;         // optional: [cols, rows] = q^T
  float* scale_used = nullptr;   // [1]
  float* amax = nullptr;         // [1]: x's finite amax
};

cudaError_t fp8_quantize_delayed(const Fp8DelayedArgs& args, cudaStream_t stream);

// Delayed scaling with the scale taken from an amax history (core's fp8_quantize_from_history):
// a one-warp kernel writes the history's scale to `given` on the device (and zeroes amax), then
// the launches of fp8_quantize_delayed run with it, the decision also writing `scale`
// (scale_used, or 1 where amax is 0): four launches and no memset, two for an empty x, no host
// sync. A history holding +Inf gives
// scale 0, which the decision treats as any bad scale (x's own).
struct Fp8HistoryArgs {
  Fp8DelayedArgs delayed;          // its scale is `given`; its scale_used a [1] device scratch
  const float* history = nullptr;  // device, history_len >= 1 entries, history_stride apart
  int64_t history_len = 0, history_stride = 1;
  float* given = nullptr;  // [1] device scratch: the history's scale
  float* scale = nullptr;  // [1]: scale_used, or 1 where amax == 0
};

cudaError_t fp8_quantize_from_history(const Fp8HistoryArgs& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace tierlift
