#include "core/lowp/quantize.h"

#include <algorithm>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "core/util/thread_pool.h"

namespace tierlift {
namespace {

constexpr int64_t kGrainElems = 1 << 16;

int64_t ceil_div(int64_t a, int64_t b) { return b == 0 ? 0 : (a + b - 1) / b; }

template <DType kT>
inline float load_at(const void* p, int64_t k) {
  if constexpr (kT == DType::kBFloat16) {
    return bf16_to_f32(static_cast<const uint16_t*>(p)[k]);
  } else if constexpr (kT == DType::kFloat16) {
    return f16_to_f32(static_cast<const uint16_t*>(p)[k]);
  } else {
    return static_cast<const float*>(p)[k];
  }
}

// Row i of x merged into the amaxes of its blocks (bc wide): amax[g] covers columns
// [g * bc, (g + 1) * bc). Segment loops keep divisions and dtype switches out of the inner loop.
template <DType kT>
void row_amax_t(const Fp8Input& x, int64_t i, int64_t bc, float* amax) {
  const int64_t base = i * x.row_stride, cs = x.col_stride;
  for (int64_t jb = 0, g = 0; jb < x.cols; jb += bc, ++g) {
    const int64_t je = std::min(x.cols, jb + bc);
    float m = amax[g];
    for (int64_t j = jb; j < je; ++j)
      m = std::max(m, finite_abs(load_at<kT>(x.data, base + j * cs)));
    amax[g] = m;
  }
}

template <DType kT>
void row_cast_t(const Fp8Input& x, int64_t i, int64_t bc, const float* scales, Fp8Format fmt,
                uint8_t* q) {
  const int64_t base = i * x.row_stride, cs = x.col_stride;
  for (int64_t jb = 0, g = 0; jb < x.cols; jb += bc, ++g) {
    const int64_t je = std::min(x.cols, jb + bc);
    const float s = scales[g];
    for (int64_t j = jb; j < je; ++j)
      q[j] = fp8_encode(load_at<kT>(x.data, base + j * cs) * s, fmt);
  }
}

// Row i of x cast with one scale, returning the row's finite amax merged into m: delayed
// scaling's single pass.
template <DType kT>
float row_cast_amax_t(const Fp8Input& x, int64_t i, float s, Fp8Format fmt, uint8_t* q, float m) {
  const int64_t base = i * x.row_stride, cs = x.col_stride;
  for (int64_t j = 0; j < x.cols; ++j) {
    const float v = load_at<kT>(x.data, base + j * cs);
    m = std::max(m, finite_abs(v));
    q[j] = fp8_encode(v * s, fmt);
  }
  return m;
}

float row_cast_amax(const Fp8Input& x, int64_t i, float s, Fp8Format fmt, uint8_t* q, float m) {
  switch (x.dtype) {
    case DType::kBFloat16:
      return row_cast_amax_t<DType::kBFloat16>(x, i, s, fmt, q, m);
    case DType::kFloat16:
      return row_cast_amax_t<DType::kFloat16>(x, i, s, fmt, q, m);
    default:
      return row_cast_amax_t<DType::kFloat32>(x, i, s, fmt, q, m);
  }
}

void row_amax(const Fp8Input& x, int64_t i, int64_t bc, float* amax) {
  switch (x.dtype) {
    case DType::kBFloat16:
      return row_amax_t<DType::kBFloat16>(x, i, bc, amax);
    case DType::kFloat16:
      return row_amax_t<DType::kFloat16>(x, i, bc, amax);
    default:
      return row_amax_t<DType::kFloat32>(x, i, bc, amax);
  }
}

void row_cast(const Fp8Input& x, int64_t i, int64_t bc, const float* scales, Fp8Format fmt,
              uint8_t* q) {
  switch (x.dtype) {
    case DType::kBFloat16:
      return row_cast_t<DType::kBFloat16>(x, i, bc, scales, fmt, q);
    case DType::kFloat16:
      return row_cast_t<DType::kFloat16>(x, i, bc, scales, fmt, q);
    default:
      return row_cast_t<DType::kFloat32>(x, i, bc, scales, fmt, q);
  }
}

void check(const Fp8Input& x, const void* q, const float* scales) {
  if (x.rows < 0 || x.cols < 0) throw std::invalid_argument("fp8_quantize: negative size");
  if (x.rows * x.cols == 0) return;
  if (x.data == nullptr || q == nullptr || scales == nullptr) {
    throw std::invalid_argument("fp8_quantize: null pointer");
  }
  if (x.dtype != DType::kFloat32 && x.dtype != DType::kBFloat16 && x.dtype != DType::kFloat16) {
    throw std::invalid_argument("fp8_quantize: input must be fp32, bf16 or fp16");
  }
}

// Pass 1 + 2: per-block amax over finite elements, then the scale.
void compute_scales(const Fp8Input& x, const Fp8Blocks& b, Fp8Format fmt, bool pow2,
                    float* scales) {
  const int64_t nscales = b.grid_rows * b.grid_cols;
  std::fill(scales, scales + nscales, 0.f);
  if (b.grid_rows > 1) {
    // Each task owns whole bands of block rows: no two tasks touch the same block.
    const int64_t band_elems = std::max<int64_t>(b.rows * x.cols, 1);
    const int64_t grain = std::max<int64_t>(1, kGrainElems / band_elems);
    ThreadPool::global().parallel_for(b.grid_rows, grain, [&](int64_t g0, int64_t g1) {
      for (int64_t i = g0 * b.rows; i < std::min(x.rows, g1 * b.rows); ++i) {
        row_amax(x, i, b.cols, scales + (i / b.rows) * b.grid_cols);
      }
    });
  } else {
    // Blocks span every row (kTensor, kCol): tasks keep local maxima and merge them under a
    // lock. max is exact and order-free, so the result does not depend on the split.
    std::mutex mu;
    const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(x.cols, 1));
    ThreadPool::global().parallel_for(x.rows, grain, [&](int64_t r0, int64_t r1) {
      std::vector<float> amax(static_cast<size_t>(b.grid_cols), 0.f);
      for (int64_t i = r0; i < r1; ++i) row_amax(x, i, b.cols, amax.data());
      std::lock_guard<std::mutex> lock(mu);
      for (int64_t c = 0; c < b.grid_cols; ++c) scales[c] = std::max(scales[c], amax[c]);
    });
  }
  for (int64_t s = 0; s < nscales; ++s) scales[s] = fp8_scale(scales[s], fmt, pow2);
}

// Pass 3: q = encode(x * scale).
void cast(const Fp8Input& x, const Fp8Blocks& b, Fp8Format fmt, const float* scales, uint8_t* q) {
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(x.cols, 1));
  ThreadPool::global().parallel_for(x.rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      row_cast(x, i, b.cols, scales + (i / b.rows) * b.grid_cols, fmt, q + i * x.cols);
    }
  });
}

// qt = q^T for row-major codes, in 64x64 blocks so both sides stay in cache.
void transpose_codes(const uint8_t* q, int64_t rows, int64_t cols, uint8_t* qt) {
  constexpr int64_t kB = 64;
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(kB * rows, 1));
  ThreadPool::global().parallel_for(ceil_div(cols, kB), grain, [&](int64_t b0, int64_t b1) {
    for (int64_t jb = b0 * kB; jb < std::min(cols, b1 * kB); jb += kB) {
      const int64_t je = std::min(cols, jb + kB);
      for (int64_t ib = 0; ib < rows; ib += kB) {
        const int64_t ie = std::min(rows, ib + kB);
        for (int64_t j = jb; j < je; ++j) {
          for (int64_t i = ib; i < ie; ++i) qt[j * rows + i] = q[i * cols + j];
        }
      }
    }
  });
}

}  // namespace

Fp8Blocks fp8_blocks(Fp8Scaling scaling, int64_t rows, int64_t cols) {
  int64_t br = 1, bc = 1;
  switch (scaling) {
    case Fp8Scaling::kTensor:
      br = rows, bc = cols;
      break;
    case Fp8Scaling::kRow:
      br = 1, bc = cols;
      break;
    case Fp8Scaling::kCol:
      br = rows, bc = 1;
      break;
    case Fp8Scaling::kBlock1x128:
      br = 1, bc = 128;
      break;
    case Fp8Scaling::kBlock128x128:
      br = 128, bc = 128;
      break;
  }
  // A whole-dimension block of an empty dimension still has one (empty) block, so a zero-size
  // matrix has zero scales only along its empty dimension, never a division by zero.
  br = std::max<int64_t>(br, 1);
  bc = std::max<int64_t>(bc, 1);
  const bool whole_r = scaling == Fp8Scaling::kTensor || scaling == Fp8Scaling::kCol;
  const bool whole_c = scaling == Fp8Scaling::kTensor || scaling == Fp8Scaling::kRow;
  return {br, bc, whole_r ? 1 : ceil_div(rows, br), whole_c ? 1 : ceil_div(cols, bc)};
}

void fp8_quantize(const Fp8Input& x, Fp8Scaling scaling, Fp8Format fmt, bool pow2_scale, uint8_t* q,
                  float* scales) {
  check(x, q, scales);
  const Fp8Blocks b = fp8_blocks(scaling, x.rows, x.cols);
  if (x.rows * x.cols == 0) {
    for (int64_t s = 0; s < b.grid_rows * b.grid_cols; ++s) {
      scales[s] = fp8_scale(0.f, fmt, pow2_scale);
    }
    return;
  }
  compute_scales(x, b, fmt, pow2_scale, scales);
  cast(x, b, fmt, scales, q);
}

void fp8_quantize_dual(const Fp8Input& x, Fp8Scaling scaling, Fp8Format fmt, bool pow2_scale,
                       uint8_t* q, float* scales, uint8_t* qt, float* scales_t) {
  fp8_quantize(x, scaling, fmt, pow2_scale, q, scales);
  Fp8Input t = x;
  t.rows = x.cols;
  t.cols = x.rows;
  t.row_stride = x.col_stride;
  t.col_stride = x.row_stride;
  fp8_quantize(t, scaling, fmt, pow2_scale, qt, scales_t);
}

Fp8DelayedResult fp8_quantize_delayed(const Fp8Input& x, float scale, Fp8Format fmt,
                                      bool pow2_scale, uint8_t* q, uint8_t* qt) {
  if (!(scale > 0.f && scale <= kF32Max)) {
    throw std::invalid_argument("fp8_quantize_delayed: scale must be finite and > 0");
  }
  check(x, q, &scale);
  if (x.rows * x.cols == 0) return {scale, 0.f};
  // Pass 1: cast with the given scale and take the amax; tasks merge their maxima under a lock
  // (max is exact and order-free, so the split does not change it).
  float amax = 0.f;
  std::mutex mu;
  const int64_t grain = std::max<int64_t>(1, kGrainElems / x.cols);
  ThreadPool::global().parallel_for(x.rows, grain, [&](int64_t r0, int64_t r1) {
    float m = 0.f;
    for (int64_t i = r0; i < r1; ++i) m = row_cast_amax(x, i, scale, fmt, q + i * x.cols, m);
    std::lock_guard<std::mutex> lock(mu);
    amax = std::max(amax, m);
  });
  float used = scale;
  if (fp8_delayed_redo(amax, scale, fmt)) {
    used = fp8_scale(amax, fmt, pow2_scale);
    // Equal scales cast to equal codes: the second read is needed only when the scale changed.
    if (used != scale) cast(x, fp8_blocks(Fp8Scaling::kTensor, x.rows, x.cols), fmt, &used, q);
  }
  if (qt != nullptr) transpose_codes(q, x.rows, x.cols, qt);
  return {used, amax};
}

float fp8_history_scale(const float* history, int64_t n, int64_t stride, Fp8Format fmt,
                        bool pow2_scale) {
  if (n < 1 || history == nullptr) {
    throw std::invalid_argument("fp8_history_scale: the history needs at least one entry");
  }
  // max(history) clamped below, as torch's max and clamp: a NaN anywhere is the result.
  float m = kSmallestAmax;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float v = history[i * stride];
    nan |= v != v;
    m = std::max(m, v);
  }
  return fp8_scale(nan ? std::numeric_limits<float>::quiet_NaN() : m, fmt, pow2_scale);
}

Fp8DelayedResult fp8_quantize_from_history(const Fp8Input& x, const float* history, int64_t n,
                                           int64_t stride, Fp8Format fmt, bool pow2_scale,
                                           uint8_t* q, uint8_t* qt) {
  const float given = fp8_history_scale(history, n, stride, fmt, pow2_scale);
  if (!(given > 0.f)) {
    throw std::invalid_argument(
        "fp8_quantize_from_history: history holds +Inf (its scale would be 0): an amax history "
        "holds finite amaxes");
  }
  Fp8DelayedResult r = fp8_quantize_delayed(x, given, fmt, pow2_scale, q, qt);
  if (r.amax == 0.f) r.scale_used = 1.f;  // no finite non-zero value: any scale gives its codes
  return r;
}

void fp8_dequantize(const uint8_t* q, int64_t rows, int64_t cols, Fp8Scaling scaling, Fp8Format fmt,
                    const float* scales, float* out) {
  if (rows < 0 || cols < 0) throw std::invalid_argument("fp8_dequantize: negative size");
  if (rows * cols == 0) return;
  if (q == nullptr || scales == nullptr || out == nullptr) {
    throw std::invalid_argument("fp8_dequantize: null pointer");
  }
  const Fp8Blocks b = fp8_blocks(scaling, rows, cols);
  const int64_t grain = std::max<int64_t>(1, kGrainElems / cols);
  ThreadPool::global().parallel_for(rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const float* srow = scales + (i / b.rows) * b.grid_cols;
      for (int64_t j = 0; j < cols; ++j) {
        out[i * cols + j] = fp8_decode(q[i * cols + j], fmt) / srow[j / b.cols];
      }
    }
  });
}

}  // namespace tierlift
