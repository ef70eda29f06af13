// Inputs and comparisons for the simulated low-precision kernel tests (test_kernel_fp8.cc,
// test_kernel_fp4.cc).
//
// A StridedInput is a [rows, cols] fp32/bf16/fp16 matrix viewed through arbitrary strides in a
// heap buffer of EXACTLY the bytes the view reaches (plus a leading offset), so AddressSanitizer
// flags a kernel that reads past the view. Elements inside the buffer that the view skips hold a
// huge finite poison value: a kernel that read one would get a different amax, hence different
// scales. The buffer is 64-byte aligned, so whether a view is aligned (the FP8 kernels'
// vectorized paths) is decided by its offset and strides alone.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "core/lowp/quantize.h"
#include "core/util/dtype.h"
#include "tests/cudasim/dtypes.h"

namespace tierlift {
namespace cudasim_test {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// n standard-normal values, reproducible from `seed`.
inline std::vector<float> normal_values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = normal(rng);
  return x;
}

// Largest finite value of the input type: the "huge" element of the test data.
// Points a kernel's argument struct (cuda::Fp8QuantArgs, Fp8DelayedArgs, Fp4QuantArgs) at x.
template <typename Args>
void set_input(Args& a, const Fp8Input& x) {
  a.x = x.data;
  a.dtype = x.dtype;
  a.rows = x.rows;
  a.cols = x.cols;
  a.row_stride = x.row_stride;
  a.col_stride = x.col_stride;
}

inline float huge_of(DType t) { return t == DType::kFloat16 ? 65504.f : 3.0e38f; }

// How the logical [rows, cols] matrix sits in memory.
enum class Layout {
  kContiguous,  // row_stride = cols
  kTransposed,  // stored [cols, rows] row-major: x = storage^T (row_stride 1, col_stride rows)
  kPadded2,     // row_stride = cols + 2 (a multiple of 4 only if cols % 4 == 2)
  kPadded4,     // row_stride = cols + 4
  kPadded8,     // row_stride = cols + 8
  kOffset1,     // contiguous, base one element past a 64-byte boundary (misaligned)
  kOffset4,     // contiguous, base four elements past it (8-byte aligned bf16/fp16: not 16)
  kEveryOther,  // every other column of a [rows, 2 * cols] matrix (col_stride 2)
};

inline const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kContiguous:
      return "contiguous";
    case Layout::kTransposed:
      return "transposed";
    case Layout::kPadded2:
      return "row_stride=cols+2";
    case Layout::kPadded4:
      return "row_stride=cols+4";
    case Layout::kPadded8:
      return "row_stride=cols+8";
    case Layout::kOffset1:
      return "offset=1";
    case Layout::kOffset4:
      return "offset=4";
    case Layout::kEveryOther:
      return "col_stride=2";
  }
  return "?";
}

class StridedInput {
 public:
  // `values` are the logical elements, row-major; they are rounded to `dtype` on the way in.
  StridedInput(const std::vector<float>& values, int64_t rows, int64_t cols, DType dtype,
               Layout layout)
      : esize_(dtype_size(dtype)) {
    in_.dtype = dtype;
    in_.rows = rows;
    in_.cols = cols;
    int64_t offset = 0;
    switch (layout) {
      case Layout::kContiguous:
        in_.row_stride = cols, in_.col_stride = 1;
        break;
      case Layout::kTransposed:
        in_.row_stride = 1, in_.col_stride = rows;
        break;
      case Layout::kPadded2:
        in_.row_stride = cols + 2, in_.col_stride = 1;
        break;
      case Layout::kPadded4:
        in_.row_stride = cols + 4, in_.col_stride = 1;
        break;
      case Layout::kPadded8:
        in_.row_stride = cols + 8, in_.col_stride = 1;
        break;
      case Layout::kOffset1:
        in_.row_stride = cols, in_.col_stride = 1, offset = 1;
        break;
      case Layout::kOffset4:
        in_.row_stride = cols, in_.col_stride = 1, offset = 4;
        break;
      case Layout::kEveryOther:
        in_.row_stride = 2 * cols, in_.col_stride = 2;
        break;
    }
    const int64_t reach =
        rows * cols == 0 ? 0 : (rows - 1) * in_.row_stride + (cols - 1) * in_.col_stride + 1;
    bytes_ = static_cast<size_t>((offset + reach) * esize_);
    buf_.reset(static_cast<uint8_t*>(::operator new (bytes_, std::align_val_t{64})));
    for (int64_t k = 0; k < offset + reach; ++k) store(k, -huge_of(dtype));  // poison
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        store(offset + i * in_.row_stride + j * in_.col_stride, values[i * cols + j]);
      }
    }
    in_.data = buf_.get() + offset * esize_;
  }

  const Fp8Input& view() const { return in_; }
  size_t bytes() const { return bytes_; }

 private:
  struct AlignedDelete {
    void operator()(uint8_t* p) const { ::operator delete (p, std::align_val_t{64}); }
  };

  void store(int64_t k, float v) {
    uint8_t* p = buf_.get() + k * esize_;
    if (in_.dtype == DType::kFloat32) {
      std::memcpy(p, &v, 4);
    } else {
      const uint16_t h = in_.dtype == DType::kBFloat16 ? f32_to_bf16(v) : f32_to_f16(v);
      std::memcpy(p, &h, 2);
    }
  }

  int esize_;
  size_t bytes_ = 0;
  std::unique_ptr<uint8_t, AlignedDelete> buf_;
  Fp8Input in_;
};

// Bit-for-bit comparison of n elements. On a mismatch says how many differ and lists the first
// few as flat index and [row, col] of a row-major array `cols` wide, with both bit patterns.
template <typename T>
::testing::AssertionResult same_bits(const char* what, const std::vector<T>& got,
                                     const std::vector<T>& want, int64_t cols) {
  static_assert(sizeof(T) <= 8, "element too wide");
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure()
           << what << ": size " << got.size() << " != " << want.size();
  }
  int64_t bad = 0;
  std::string first;
  for (size_t k = 0; k < got.size(); ++k) {
    uint64_t g = 0, w = 0;
    std::memcpy(&g, &got[k], sizeof(T));
    std::memcpy(&w, &want[k], sizeof(T));
    if (g == w) continue;
    if (bad++ < 5) {
      const int64_t c = cols > 0 ? cols : 1;
      char line[160];
      std::snprintf(line, sizeof(line), "\n  [%zu] = (%lld, %lld): kernel 0x%llx, core 0x%llx", k,
                    static_cast<long long>(static_cast<int64_t>(k) / c),
                    static_cast<long long>(static_cast<int64_t>(k) % c),
                    static_cast<unsigned long long>(g), static_cast<unsigned long long>(w));
      first += line;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << got.size() << " elements differ" << first;
}

}  // namespace cudasim_test
}  // namespace tierlift
