// CPU FP4 quantizer (see fp4_quant.h): pass 1 rotates rows block by block into an fp32 buffer
// and reduces the statistics (block amax / rms, NVFP4's tensor amax), pass 2 turns them into
// scales, pass 3 encodes. Rows are split across ThreadPool::global().
#include "core/lowp/fp4_quant.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/lowp/fp8.h"
#include "core/util/dtype.h"
#include "core/util/thread_pool.h"

namespace tierlift {
namespace {

using fp4::ScaleRule;

float load(const Fp8Input& x, int64_t i, int64_t j) {
  const int64_t k = i * x.row_stride + j * x.col_stride;
  switch (x.dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(x.data)[k];
    case DType::kBFloat16:
      return bf16_to_f32(static_cast<const uint16_t*>(x.data)[k]);
    default:
      return f16_to_f32(static_cast<const uint16_t*>(x.data)[k]);
  }
}

void for_rows(int64_t rows, int64_t cols, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1));
  ThreadPool::global().parallel_for(rows, grain, fn);
}

}  // namespace

void fp4_scale_shape(const Fp4Config& c, int64_t rows, int64_t cols, int64_t* grid_rows,
                     int64_t* grid_cols) {
  *grid_rows = c.block_2d ? (rows + 15) / 16 : rows;
  *grid_cols = cols / fp4_block(c.rule);
}

void fp4_validate(const Fp8Input& x, const Fp4Config& c) {
  if (x.rows < 0 || x.cols < 0) throw std::invalid_argument("fp4: negative size");
  if (x.rows * x.cols > 0 && x.data == nullptr) throw std::invalid_argument("fp4: null input");
  if (x.dtype != DType::kFloat32 && x.dtype != DType::kBFloat16 && x.dtype != DType::kFloat16) {
    throw std::invalid_argument("fp4: x must be fp32, bf16 or fp16");
  }
  const int b = fp4_block(c.rule);
  if (x.cols % b) {
    throw std::invalid_argument("fp4: cols (" + std::to_string(x.cols) +
                                ") must be a multiple of the block size " + std::to_string(b));
  }
  if (c.hadamard != 0 && c.hadamard != 16 && c.hadamard != 32) {
    throw std::invalid_argument("fp4: hadamard must be 0, 16 or 32, got " +
                                std::to_string(c.hadamard));
  }
  if (c.hadamard && x.cols % c.hadamard) {
    throw std::invalid_argument("fp4: cols must be a multiple of the Hadamard size");
  }
  if (!c.hadamard && c.signs) {
    throw std::invalid_argument("fp4: signs needs a Hadamard size (16 or 32)");
  }
  if (c.hadamard && (c.signs >> (c.hadamard - 1)) > 1u) {
    throw std::invalid_argument("fp4: signs has bits beyond the Hadamard size");
  }
  if (c.block_2d && c.rule != ScaleRule::kNv) {
    throw std::invalid_argument("fp4: block_2d (16x16 blocks) is NVFP4-only");
  }
}

void fp4_quantize(const Fp8Input& x, const Fp4Config& c, const Fp4Output& out) {
  fp4_validate(x, c);
  // Empty tensors have null data pointers; only the tensor scale is always written.
  const bool empty = x.rows * x.cols == 0;
  if (!out.tensor_scale || (!empty && (!out.codes || !out.scales))) {
    throw std::invalid_argument("fp4: null output");
  }
  const int64_t rows = x.rows, cols = x.cols;
  const int b = fp4_block(c.rule);
  const int64_t nb = cols / b;
  int64_t grows, gcols;
  fp4_scale_shape(c, rows, cols, &grows, &gcols);
  std::vector<float> y(static_cast<size_t>(rows * cols));
  std::vector<float> stat(static_cast<size_t>(rows * nb));   // per 1 x b block: amax or rms
  std::vector<uint8_t> bad(static_cast<size_t>(rows * nb));  // 1: the block holds a NaN/Inf
  const bool quest = c.rule == ScaleRule::kQuest;
  for_rows(rows, cols, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      float* row = y.data() + i * cols;
      for (int64_t j = 0; j < cols; ++j) row[j] = load(x, i, j);
      if (c.hadamard) {
        for (int64_t j = 0; j < cols; j += c.hadamard)
          fp4::hadamard_block(row + j, c.hadamard, c.signs);
      }
      for (int64_t k = 0; k < nb; ++k) {
        const float* v = row + k * b;
        float amax = 0.f;
        for (int e = 0; e < b; ++e) amax = std::max(amax, fp4::finite_abs(v[e]));
        stat[i * nb + k] = quest ? fp4::block_rms(v, b, amax) : amax;
        bad[i * nb + k] = std::any_of(v, v + b, [](float f) { return fp4::nonfinite(f); });
      }
    }
  });
  // Scales. mult[g] multiplies the elements of scale block g.
  std::vector<float> mult(static_cast<size_t>(grows * gcols));
  if (c.rule == ScaleRule::kNv) {
    float tamax = 0.f;
    for (float s : stat) tamax = std::max(tamax, s);
    const float st = fp4::nv_tensor_scale(tamax);
    *out.tensor_scale = st;
    for (int64_t g = 0; g < grows; ++g) {
      for (int64_t k = 0; k < gcols; ++k) {
        float amax = 0.f;
        bool any_bad = false;
        const int64_t i0 = c.block_2d ? g * 16 : g,
                      i1 = c.block_2d ? std::min(rows, i0 + 16) : g + 1;
        for (int64_t i = i0; i < i1; ++i) {
          amax = std::max(amax, stat[i * nb + k]);
          any_bad = any_bad || bad[i * nb + k];
        }
        const uint8_t code = fp4::nv_scale_code(any_bad ? fp4::inf_f32() : amax, st);
        out.scales[g * gcols + k] = code;
        mult[g * gcols + k] = fp4::nv_multiplier(code, st);
      }
    }
  } else {
    *out.tensor_scale = 1.f;
    for (int64_t g = 0; g < grows * gcols; ++g) {
      const int e = fp4::mx_exponent(stat[g], c.rule);
      out.scales[g] = bad[g] ? fp4::kE8M0Nan : static_cast<uint8_t>(e + 127);
      mult[g] = bad[g] ? fp4::nan_f32() : fp4::pow2(-e);
    }
  }
  for_rows(rows, cols, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const float* row = y.data() + i * cols;
      const float* m = mult.data() + (c.block_2d ? i / 16 : i) * gcols;
      for (int64_t j = 0; j < cols; j += 2) {
        uint8_t q[2];
        for (int t = 0; t < 2; ++t) {
          const float v = fp4::mul_rn(row[j + t], m[(j + t) / b]);
          q[t] = c.stochastic ? fp4::e2m1_encode_sr(
                                    v, fp4::philox_uniform(c.seed, c.offset,
                                                           static_cast<uint64_t>(i * cols + j + t)))
                              : fp4::e2m1_encode_rne(v);
          if (out.mask) out.mask[i * cols + j + t] = std::fabs(v) <= fp4::kMax;  // NaN, Inf: 0
        }
        out.codes[(i * cols + j) / 2] = static_cast<uint8_t>(q[0] | (q[1] << 4));
      }
    }
  });
}

void fp4_dequantize(const uint8_t* codes, const uint8_t* scales, float tensor_scale, int64_t rows,
                    int64_t cols, ScaleRule rule, bool block_2d, float* out) {
  const int b = fp4_block(rule);
  const int64_t gcols = cols / b;
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* s = scales + (block_2d ? i / 16 : i) * gcols;
    for (int64_t j = 0; j < cols; ++j) {
      const uint8_t byte = codes[(i * cols + j) / 2];
      const float v = fp4::e2m1_decode((j & 1) ? byte >> 4 : byte & 15u);
      float r;
      if (rule == ScaleRule::kNv) {
        r = fp4::div_rn(fp4::mul_rn(v, fp4::e4m3_decode_nonneg(s[j / b])), tensor_scale);
      } else {
        r = fp4::mul_rn(v, fp4::e8m0_decode(s[j / b]));
      }
      out[i * cols + j] = r;
    }
  }
}

}  // namespace tierlift
