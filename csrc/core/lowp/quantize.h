// FP8 quantizers on the CPU: the bit-exact reference the CUDA kernels (cuda/fp8_quant.cuh) and
// tierlift.reference.lowp are checked against. Element rules are in fp8.h.
//
// A 2-D input [rows, cols] (any strides, fp32/bf16/fp16) is split into scaling blocks:
//   kTensor      one block                        scales [1, 1]
//   kRow         1 x cols (per row)               scales [rows, 1]
//   kCol         rows x 1 (per column)            scales [1, cols]
//   kBlock1x128  1 x 128 (DeepSeek-V3 activations) scales [rows, ceil(cols/128)]
//   kBlock128x128 128 x 128 (weights)             scales [ceil(rows/128), ceil(cols/128)]
// Edge blocks are partial. Outputs are row-major: q [rows, cols] uint8 codes, scales fp32.
// The dual quantizer also emits the quantization of x^T ([cols, rows], row-major, i.e. x's
// column-major copy) with the same kind of scaling: the operand layout the backward GEMMs need.
// Work runs in three passes (amax, scale, cast) split across ThreadPool::global().
// fp8_quantize_delayed (tensor scaling with a scale chosen ahead) casts and takes the amax in one
// pass; it reads x a second time only when the given scale would clip. fp8_quantize_from_history
// chooses that scale from an amax history.
#pragma once

#include <cstdint>

#include "core/lowp/fp8.h"
#include "core/util/dtype.h"

namespace tierlift {

enum class Fp8Scaling : uint8_t { kTensor = 0, kRow, kCol, kBlock1x128, kBlock128x128 };

struct Fp8Blocks {
  int64_t rows;       // block height
  int64_t cols;       // block width
  int64_t grid_rows;  // scale rows = ceil(matrix rows / block height)
  int64_t grid_cols;  // scale cols
};

// Block shape of `scaling` for a rows x cols matrix (rows, cols >= 0).
Fp8Blocks fp8_blocks(Fp8Scaling scaling, int64_t rows, int64_t cols);

struct Fp8Input {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;  // fp32, bf16 or fp16
  int64_t rows = 0, cols = 0;
  int64_t row_stride = 0, col_stride = 1;  // in elements
};

// Throws std::invalid_argument on null pointers, negative sizes or an unsupported dtype.
void fp8_quantize(const Fp8Input& x, Fp8Scaling scaling, Fp8Format fmt, bool pow2_scale, uint8_t* q,
                  float* scales);

// fp8_quantize(x) into (q, scales) and fp8_quantize(x^T) into (qt [cols, rows], scales_t).
void fp8_quantize_dual(const Fp8Input& x, Fp8Scaling scaling, Fp8Format fmt, bool pow2_scale,
                       uint8_t* q, float* scales, uint8_t* qt, float* scales_t);

// Delayed scaling, bit-exact with tierlift.reference.lowp.fp8_quantize_delayed: q =
// encode(x * scale) and x's finite amax in one pass; if fl(amax * scale) > the format's max (the
// stale scale would clip some finite value), scale_used = fp8_scale(amax, fmt, pow2_scale), x's
// own scale, and q is cast again with it. qt (optional, [cols, rows]) = q^T. Throws
// std::invalid_argument unless scale is finite and > 0.
struct Fp8DelayedResult {
  float scale_used;
  float amax;
};
Fp8DelayedResult fp8_quantize_delayed(const Fp8Input& x, float scale, Fp8Format fmt,
                                      bool pow2_scale, uint8_t* q, uint8_t* qt);

// The amax a never-filled history (max <= 0, e.g. all -1) counts as: the smallest fp32
// subnormal, whose scale is the format's largest (FLT_MAX, or 2^127 with power-of-two scales).
constexpr float kSmallestAmax = 1.40129846432481707092e-45f;

// The scale an amax history of n >= 1 entries (`stride` apart) gives: fp8_scale of its max, at
// least kSmallestAmax; a NaN entry gives NaN's scale, 1, an Inf one 0 (which
// fp8_quantize_delayed refuses). Bit-exact with tierlift.reference.lowp.history_scale.
float fp8_history_scale(const float* history, int64_t n, int64_t stride, Fp8Format fmt,
                        bool pow2_scale);

// fp8_quantize_delayed with fp8_history_scale's scale, its scale_used set to 1 where x has no
// finite non-zero value (amax 0). Bit-exact with
// tierlift.reference.lowp.fp8_quantize_from_history. Throws std::invalid_argument for n < 1 or
// a history holding +Inf.
Fp8DelayedResult fp8_quantize_from_history(const Fp8Input& x, const float* history, int64_t n,
                                           int64_t stride, Fp8Format fmt, bool pow2_scale,
                                           uint8_t* q, uint8_t* qt);

// Whether delayed scaling with `scale` must fall back to x's own scale: the scale is not finite
// and positive, or fl(amax * scale) exceeds the format's max. The CUDA kernel mirrors it.
static inline bool fp8_delayed_redo(float amax, float scale, Fp8Format fmt) {
  if (!(scale > 0.f && scale <= kF32Max)) return true;
  const float product = amax * scale;  // rounded to fp32, as the reference's tensor product
  return product > fp8_spec(fmt).max;
}

// out[i, j] = decode(q[i, j]) / scale of (i, j)'s block, fp32 row-major.
void fp8_dequantize(const uint8_t* q, int64_t rows, int64_t cols, Fp8Scaling scaling, Fp8Format fmt,
                    const float* scales, float* out);

}  // namespace tierlift
