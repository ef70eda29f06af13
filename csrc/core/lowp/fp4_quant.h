// FP4 quantizers on the CPU: the bit-exact reference the CUDA kernel (cuda/fp4_quant.cuh) and
// tierlift.reference.lowp_fp4 are checked against. Scalar rules are in fp4.h.
//
// A 2-D input [rows, cols] (any strides, fp32/bf16/fp16) is optionally rotated by a Hadamard
// transform over blocks of `hadamard` (16/32) columns, then quantized along rows:
//   MXFP4 (rule floor/rceil/quest): blocks 1x32, scales uint8 E8M0 [rows, cols / 32]
//   NVFP4 (rule nv): blocks 1x16, or 16x16 with block_2d (weights: the quantization of W^T is
//     then the transpose of W's), scales E4M3 codes [rows or ceil(rows/16), cols / 16], plus the
//     fp32 tensor scale.
// Outputs: codes [rows, cols / 2] (two per byte, first in the low nibble), the clip mask
// [rows, cols] (1 = not saturated) when requested, scales and tensor scale as above. A block
// holding a NaN/Inf gets the NaN scale (E8M0 0xFF, E4M3 0x7F) and dequantizes to all NaN.
#pragma once

#include <cstdint>

#include "core/lowp/fp4.h"
#include "core/lowp/quantize.h"

namespace tierlift {

struct Fp4Config {
  fp4::ScaleRule rule = fp4::ScaleRule::kFloor;
  int hadamard = 0;         // 0, 16 or 32
  uint32_t signs = 0;       // bit i set: negate element i of each Hadamard block first
  bool stochastic = false;  // SR with Philox(seed, offset) instead of RNE
  uint64_t seed = 0, offset = 0;
  bool block_2d = false;  // NVFP4 only: 16x16 blocks
};

struct Fp4Output {
  uint8_t* codes = nullptr;       // [rows, cols / 2]
  uint8_t* scales = nullptr;      // fp4_scale_shape()
  float* tensor_scale = nullptr;  // [1]: s_t (NVFP4), 1 (MXFP4)
  uint8_t* mask = nullptr;        // optional [rows, cols]
};

inline int fp4_block(fp4::ScaleRule r) { return r == fp4::ScaleRule::kNv ? 16 : 32; }

// Scale grid [grid_rows, grid_cols] of a rows x cols input.
void fp4_scale_shape(const Fp4Config& c, int64_t rows, int64_t cols, int64_t* grid_rows,
                     int64_t* grid_cols);

// Throws std::invalid_argument on a bad configuration (cols not a multiple of the block or of
// the Hadamard size, a Hadamard size other than 0/16/32, block_2d with an MX rule, null outputs).
void fp4_validate(const Fp8Input& x, const Fp4Config& c);

void fp4_quantize(const Fp8Input& x, const Fp4Config& c, const Fp4Output& out);

// out[i, j] = dequantized value (fp32 row-major) of codes/scales made by fp4_quantize.
void fp4_dequantize(const uint8_t* codes, const uint8_t* scales, float tensor_scale, int64_t rows,
                    int64_t cols, fp4::ScaleRule rule, bool block_2d, float* out);

}  // namespace tierlift
