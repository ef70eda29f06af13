// Fused FP4 quantization on the GPU, torch-free: optional (random-signed) Hadamard rotation over
// blocks of 16/32 columns, block statistics, scales and E2M1 encoding (RNE or Philox stochastic
// rounding) in one kernel, following core/lowp/fp4.h operation for operation so the codes, scales
// and clip mask are bit-identical to the C++ reference for the same seed.
//
// Shape of the work: a thread owns 16 consecutive elements of a row (two 16-byte loads of a
// row-contiguous bf16/fp16 input, four for fp32; strided loads otherwise), so an NVFP4 block is
// one lane and an MXFP4 block 2 (16 rather than 8 halves the per-thread index math, block scale
// and votes per element; 50% occupancy at ~58-64 registers keeps the bytes in flight of 8 at
// 100%). A thread's row comes from a multiply and shift (Div31), not a 64-bit division. The
// Hadamard butterflies run in registers for h = 1 .. 8 and as a __shfl_xor_sync exchange for
// h = 16 (a lane with bit h set takes a - b, the other a + b: the same pairs and order as
// fp4::hadamard_block); block amax is a max over registers then lanes, QuEST's sum of squares
// the same halving tree as fp4::tree_sum_squares (its 16 step across lanes, the rest in
// registers). A thread packs its 16 nibbles into one 8-byte store and its clip mask into one
// 16-byte store; stochastic rounding evaluates Philox once per counter (4 elements) rather than
// once per element. A block's NaN/Inf test is one compare of its largest |x| bits (they order as
// |x| does, and a NaN or Inf has bits >= Inf's), not a test per element.
//  - The common call (contiguous 16-byte aligned rows, no Hadamard, round-to-nearest, no clip
//    mask, aligned codes) runs kernels compiled for it alone: flat-index loads (no row, column or
//    stride math), codes packed from the E2M1 magnitudes and v's sign bits in ~2 operations per
//    element, and for MXFP4 the power-of-two multiplier folded into the encode's step
//    (fp4::e2m1_magnitude_rne_scaled): ~132 instructions per 8 elements for MXFP4, ~51 + ~143
//    for NVFP4's two passes.
//  - MXFP4 (floor/rceil/quest): a scale block lies within a warp, so ONE kernel does everything.
//  - NVFP4: the fp32 tensor scale needs the global amax first, so pass 1 writes per-1x16-block
//    amaxes (after the rotation) and maxes the tensor amax (one atomic per thread block); its
//    last thread block to finish (a counter after a fence) derives s_t and the multiplier
//    s_t / sb of all 128 E4M3 codes once. Pass 2 walks the thread blocks in reverse (it starts on
//    what pass 1 read last, still in L2), recomputes the rotation (cheaper than storing it),
//    derives the E4M3 block scale (over 16 rows of pass 1's amaxes for 16x16 blocks; amax / 6 by
//    two fmas, fp4::div6_rn), looks its multiplier up and encodes: no division per block. A
//    block holding a NaN/Inf gets the NaN scale; pass 1 marks it with amax +inf, which
//    max-reduces over 16x16 blocks as is. Launches: a memset of the tail's two counters, pass 1,
//    pass 2 (the workspace comes uninitialized from the caller, and a grid-wide max needs a known
//    start: without the memset, pass 2 would have to reduce per-block maxima in every block).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/lowp/fp4.h"
#include "core/util/dtype.h"

namespace tierlift {
namespace cuda {

struct Fp4QuantArgs {
  const void* x = nullptr;  // device pointer
  DType dtype = DType::kFloat32;
  int64_t rows = 0, cols = 0;
  int64_t row_stride = 0, col_stride = 1;  // elements
  fp4::ScaleRule rule = fp4::ScaleRule::kFloor;
  int hadamard = 0;  // 0, 16, 32
  uint32_t signs = 0;
  bool stochastic = false;
  uint64_t seed = 0, offset = 0;
  bool block_2d = false;
  uint8_t* codes = nullptr;       // [rows, cols / 2]
  uint8_t* scales = nullptr;      // E8M0 or E4M3 codes, fp4_scale_shape grid
  float* tensor_scale = nullptr;  // [1]: NVFP4 writes s_t; MXFP4 leaves it (the caller sets 1)
  uint8_t* mask = nullptr;        // optional [rows, cols]
  float* workspace = nullptr;     // NVFP4: nv_workspace_floats(rows, cols) floats
};

// The NVFP4 workspace: pass 1's per-1x16-block amaxes (rows * cols / 16 floats), then a tail
// written by pass 1 and read by pass 2: the tensor amax and the count of finished thread blocks
// (zeroed by one memset before pass 1), the tensor scale s_t and s_t / sb for every E4M3 code
// (written once by pass 1's last thread block, so pass 2 divides nowhere).
constexpr int64_t kNvTailAmax = 0, kNvTailDone = 1, kNvTailScale = 2, kNvTailMultipliers = 4;
constexpr int64_t kNvTailFloats = kNvTailMultipliers + 128;
static_assert(kNvTailDone == kNvTailAmax + 1, "one memset zeroes both");
inline int64_t nv_workspace_floats(int64_t rows, int64_t cols) {
  return rows * cols / 16 + kNvTailFloats;
}

// t / d for t < 2^31 and d in [1, 2^31) by one multiply and a shift: with 2^l >= d and
// m = floor(2^(31 + l) / d) + 1 (< 2^32), t * m / 2^(31 + l) = t / d + t * e / (d * 2^(31 + l)),
// e = m * d - 2^(31 + l) in (0, d]: the excess is below 1 / d, too small to reach the next
// integer (Granlund & Montgomery). The kernels find a thread's row so, not by a 64-bit division.
struct Div31 {
  uint32_t magic = 0;  // 0: not usable (the kernels then divide)
  int shift = 0;

  static Div31 make(int64_t d) {
    Div31 r;
    if (d < 1 || d >= (int64_t{1} << 31)) return r;
    int l = 0;
    while ((int64_t{1} << l) < d) ++l;
    r.magic = static_cast<uint32_t>(((uint64_t{1} << (31 + l)) / static_cast<uint64_t>(d)) + 1);
    r.shift = 31 + l;
    return r;
  }
  __host__ __device__ __forceinline__ uint32_t div(uint32_t t) const {
    return static_cast<uint32_t>((static_cast<uint64_t>(t) * magic) >> shift);
  }
};

// Enqueues the quantization on `stream` (arguments already validated by core's fp4_validate);
// returns the first launch error.
cudaError_t fp4_quantize(const Fp4QuantArgs& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace tierlift
