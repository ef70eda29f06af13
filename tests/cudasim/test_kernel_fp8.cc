// tierlift::cuda::fp8_quantize (csrc/cuda/fp8_quant.cu) run in the CPU simulator, compared bit
// for bit with core's fp8_quantize / fp8_quantize_dual (csrc/core/lowp/quantize.h): codes,
// scales, and for the dual output the codes and scales of x^T.
//
// Covered: every scaling x both formats x pow2 on/off x fp32/bf16/fp16 inputs, on each of the
// kernel's paths: the fused single-output row and 1x128 kernels (8 elements per load: cols % 8 ==
// 0 and aligned rows; 4: cols % 4 == 0 or a base only 8-byte aligned; 1: odd cols, a misaligned
// base, a row stride not a multiple of 4; rows near 8192 elements; rows past the
// 16384 kept in registers are in test_kernel_fp8_rows.cc), the
// two-pass tiled path (tensor, column and 128x128 scaling, any strided input, e.g. a transposed
// view; vector and scalar loads, 16/8/4/1-byte stores of q and q^T, amax spans of several tiles,
// the flat tensor reduction) and the dual output. Shapes with tails (1x1 .. 300x24), empty inputs
// (which must still get the safe scales), and values over ~30 binades with zeros, +-Inf, NaN, the
// input type's largest value, blocks of 1e-13 and fp32 subnormals, whole tensors of 1e-20 and
// 1e-30; one test feeds every FP8 code and every rounding midpoint through the device encoder.
// Delayed scaling: cuda::fp8_quantize_delayed and cuda::fp8_quantize_from_history against core,
// their launch counts pinned (no host sync).
// Mirrors the gpu tests of tests/python/test_lowp_quant.py, scaled down for the simulator. Inputs
// live in buffers of exactly the bytes they span (lowp_input.h), outputs in vectors of exactly
// their size, so AddressSanitizer catches any access outside them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/lowp/fp8.h"
#include "core/lowp/quantize.h"
#include "core/util/dtype.h"
#include "cuda/fp8_quant.cuh"
#include "cuda/launch.cuh"
#include "cudasim/launch.h"
#include "tests/cudasim/lowp_input.h"

namespace tierlift {
namespace {

using cudasim_test::kInf;
using cudasim_test::kInputDtypes;
using cudasim_test::kNaN;
using cudasim_test::Layout;
using cudasim_test::normal_values;
using cudasim_test::same_bits;
using cudasim_test::StridedInput;

const Fp8Scaling kScalings[] = {Fp8Scaling::kTensor, Fp8Scaling::kRow, Fp8Scaling::kCol,
                                Fp8Scaling::kBlock1x128, Fp8Scaling::kBlock128x128};
const Fp8Format kFormats[] = {Fp8Format::kE4M3, Fp8Format::kE5M2};

const char* scaling_name(Fp8Scaling s) {
  switch (s) {
    case Fp8Scaling::kTensor:
      return "tensor";
    case Fp8Scaling::kRow:
      return "row";
    case Fp8Scaling::kCol:
      return "col";
    case Fp8Scaling::kBlock1x128:
      return "1x128";
    case Fp8Scaling::kBlock128x128:
      return "128x128";
  }
  return "?";
}

bool fused(Fp8Scaling s) { return s == Fp8Scaling::kRow || s == Fp8Scaling::kBlock1x128; }

// Random values over ~30 binades (test_lowp_quant.py's nasty()), and where the shape allows:
// NaN, +-Inf, a zero and (with `huge`) the input type's largest value scattered in the first
// elements; an all-non-finite row, a row of 1e-13, a row of fp32 subnormals, an all-zero
// column and an all-zero last row (blocks whose amax is 0 or tiny still get a finite scale).
std::vector<float> nasty(int64_t rows, int64_t cols, DType dtype, uint32_t seed, bool huge) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> binade(-15, 14);
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (float& v : x) v = std::ldexp(normal(rng), binade(rng));
  if (x.size() > 16) {
    x[3] = kNaN, x[7] = kInf, x[11] = -kInf, x[12] = 0.f;
    if (huge) x[5] = -cudasim_test::huge_of(dtype);
  }
  if (rows >= 5) {
    for (int64_t j = 0; j < cols; ++j) {
      const float special[4] = {kNaN, kInf, -kInf, -kNaN};
      x[1 * cols + j] = special[j % 4];
      x[2 * cols + j] = 1e-13f * normal(rng);
      x[3 * cols + j] = 1e-39f * normal(rng);
    }
  }
  if (rows >= 2 && cols >= 5) {
    for (int64_t i = 0; i < rows; ++i) x[i * cols + 2] = 0.f;
  }
  if (rows * cols > 16) {
    for (int64_t j = 0; j < cols; ++j) x[(rows - 1) * cols + j] = 0.f;
  }
  return x;
}

struct Fp8Case {
  int64_t rows, cols;
  Fp8Scaling scaling;
  Fp8Format fmt;
  bool pow2;
  DType dtype;
  Layout layout;
  bool dual;
  bool huge;
  uint32_t seed;

  std::string describe() const {
    return std::to_string(rows) + "x" + std::to_string(cols) + " " + scaling_name(scaling) +
           (fmt == Fp8Format::kE4M3 ? " e4m3" : " e5m2") + (pow2 ? " pow2" : "") + " " +
           cudasim_test::dtype_name(dtype) + " " + cudasim_test::layout_name(layout) +
           (dual ? " dual" : "") + (huge ? " huge" : "") + " seed=" + std::to_string(seed);
  }
};

// Launches the kernel on `values` laid out as c.layout and compares everything it writes with
// core. Kernel outputs start as garbage (0xaa codes, NaN scales) so a missed store shows. The
// kernel's codes are stored in `*kernel_q` when given.
void check(const Fp8Case& c, const std::vector<float>& values,
           std::vector<uint8_t>* kernel_q = nullptr) {
  SCOPED_TRACE(c.describe());
  const StridedInput in(values, c.rows, c.cols, c.dtype, c.layout);
  const Fp8Input& x = in.view();
  const Fp8Blocks b = fp8_blocks(c.scaling, c.rows, c.cols);
  const Fp8Blocks bt = fp8_blocks(c.scaling, c.cols, c.rows);
  const size_t n = static_cast<size_t>(c.rows * c.cols);
  const size_t ns = static_cast<size_t>(b.grid_rows * b.grid_cols);
  const size_t nst = c.dual ? static_cast<size_t>(bt.grid_rows * bt.grid_cols) : 0;

  std::vector<uint8_t> want_q(n), want_qt(c.dual ? n : 0);
  std::vector<float> want_s(ns), want_st(nst);
  if (c.dual) {
    fp8_quantize_dual(x, c.scaling, c.fmt, c.pow2, want_q.data(), want_s.data(), want_qt.data(),
                      want_st.data());
  } else {
    fp8_quantize(x, c.scaling, c.fmt, c.pow2, want_q.data(), want_s.data());
  }

  std::vector<uint8_t> q(n, 0xaa), qt(c.dual ? n : 0, 0xaa);
  std::vector<float> s(ns, kNaN), st(nst, kNaN);
  cuda::Fp8QuantArgs a;
  cudasim_test::set_input(a, x);
  a.scaling = c.scaling;
  a.fmt = c.fmt;
  a.pow2_scale = c.pow2;
  a.q = q.data();
  a.scales = s.data();
  if (c.dual) {
    // As the torch binding passes them: data_ptr() of an empty tensor is null, so for an empty
    // input qt may be null while scales_t still has its (safe) scales to receive.
    a.qt = qt.data();
    a.scales_t = st.data();
  }
  const uint64_t launches = cudasim::launch_count();
  ASSERT_EQ(cuda::fp8_quantize(a, nullptr), cudaSuccess) << cudasim::last_error_message();
  if (n > 0 && !c.dual && x.col_stride == 1 && fused(c.scaling)) {
    EXPECT_EQ(cudasim::launch_count() - launches, 1u) << "expected the fused one-kernel path";
  }
  EXPECT_TRUE(same_bits("scales", s, want_s, b.grid_cols));
  EXPECT_TRUE(same_bits("q", q, want_q, c.cols));
  if (c.dual) {
    EXPECT_TRUE(same_bits("scales_t", st, want_st, bt.grid_cols));
    EXPECT_TRUE(same_bits("qt", qt, want_qt, c.rows));
  }
  if (kernel_q) *kernel_q = q;
}

void check(const Fp8Case& c) { check(c, nasty(c.rows, c.cols, c.dtype, c.seed, c.huge)); }

// The elements per load of the fused kernels for this view: 8 (16-byte loads of bf16/fp16),
// 4, or 1 (element by element). Outputs are vectors, hence 16-byte aligned.
int fused_width(const StridedInput& in) {
  const Fp8Input& x = in.view();
  const uintptr_t esize = x.dtype == DType::kFloat32 ? 4 : 2;
  if (x.col_stride != 1) return 0;
  for (int w : {8, 4}) {
    const uintptr_t align = w * esize < 16 ? w * esize : 16;
    if (x.cols % w == 0 && x.row_stride % w == 0 &&
        reinterpret_cast<uintptr_t>(x.data) % align == 0) {
      return w;
    }
  }
  return 1;
}

// Whether the tiled path loads 8-element vectors for this view.
bool tiled_vector(const StridedInput& in) {
  const Fp8Input& x = in.view();
  return x.col_stride == 1 && x.cols % 8 == 0 && x.row_stride % 8 == 0 &&
         reinterpret_cast<uintptr_t>(x.data) % 16 == 0;
}

// The layouts the tests below use reach the paths they are meant to reach.
TEST(Fp8Kernel, LayoutsSelectTheIntendedPaths) {
  for (DType t : kInputDtypes) {
    SCOPED_TRACE(cudasim_test::dtype_name(t));
    const bool wide = t == DType::kFloat32;  // 4 fp32 elements past 64 bytes are 16-aligned
    for (int64_t cols : {136, 1000, 5000, 8200}) {
      const std::vector<float> v(static_cast<size_t>(2 * cols), 1.f);
      EXPECT_EQ(fused_width(StridedInput(v, 2, cols, t, Layout::kContiguous)), 8) << cols;
      EXPECT_EQ(fused_width(StridedInput(v, 2, cols, t, Layout::kOffset4)), wide ? 8 : 4) << cols;
      EXPECT_EQ(tiled_vector(StridedInput(v, 2, cols, t, Layout::kOffset4)), wide) << cols;
      EXPECT_EQ(fused_width(StridedInput(v, 2, cols, t, Layout::kPadded4)), 4) << cols;
      EXPECT_EQ(fused_width(StridedInput(v, 2, cols, t, Layout::kOffset1)), 1) << cols;
      EXPECT_TRUE(tiled_vector(StridedInput(v, 2, cols, t, Layout::kContiguous))) << cols;
      EXPECT_FALSE(tiled_vector(StridedInput(v, 2, cols, t, Layout::kPadded4))) << cols;
    }
    for (int64_t cols : {132, 1020, 8196}) {
      const std::vector<float> v(static_cast<size_t>(2 * cols), 1.f);
      EXPECT_EQ(fused_width(StridedInput(v, 2, cols, t, Layout::kContiguous)), 4) << cols;
      EXPECT_EQ(fused_width(StridedInput(v, 2, cols, t, Layout::kPadded4)), 4) << cols;
      EXPECT_EQ(fused_width(StridedInput(v, 2, cols, t, Layout::kPadded2)), 1) << cols;
      EXPECT_FALSE(tiled_vector(StridedInput(v, 2, cols, t, Layout::kContiguous))) << cols;
    }
    const std::vector<float> v8(2 * 136, 1.f);
    EXPECT_EQ(fused_width(StridedInput(v8, 2, 136, t, Layout::kPadded8)), 8);
    EXPECT_TRUE(tiled_vector(StridedInput(v8, 2, 136, t, Layout::kPadded8)));
    const std::vector<float> odd(6 * 37, 1.f);
    EXPECT_EQ(fused_width(StridedInput(odd, 6, 37, t, Layout::kContiguous)), 1);
  }
}

// Every scaling x format x pow2 x input dtype on every path (small shapes, so all combinations
// run): 6x37 (odd cols: the scalar fused kernels for row/1x128, the tiled path for the others)
// single, dual and transposed; 6x132 (cols % 4 == 0) contiguous, with padded rows and a base
// 8-byte aligned (4 elements per load in the fused kernels), with a row stride that is not a
// multiple of 4 and misaligned (element by element); 6x136 (8 elements per load in the fused
// kernels, vector loads in the tiled ones), single and dual.
TEST(Fp8Kernel, EveryScalingFormatDtypeAndPath) {
  int cases = 0;
  uint32_t seed = 1;
  for (Fp8Scaling sc : kScalings) {
    for (Fp8Format fmt : kFormats) {
      for (DType t : kInputDtypes) {
        for (bool pow2 : {false, true}) {
          const bool huge = pow2 != (fmt == Fp8Format::kE5M2);
          check({6, 37, sc, fmt, pow2, t, Layout::kContiguous, false, huge, seed++});
          check({6, 37, sc, fmt, pow2, t, Layout::kContiguous, true, huge, seed++});
          check({6, 37, sc, fmt, pow2, t, Layout::kTransposed, false, huge, seed++});
          cases += 3;
          if (fused(sc)) {
            for (Layout l : {Layout::kContiguous, Layout::kPadded4, Layout::kPadded2,
                             Layout::kOffset1, Layout::kOffset4}) {
              check({6, 132, sc, fmt, pow2, t, l, false, huge, seed++});
              ++cases;
            }
            check({6, 136, sc, fmt, pow2, t, Layout::kContiguous, false, huge, seed++});
            ++cases;
          } else {
            check({6, 132, sc, fmt, pow2, t, Layout::kOffset1, true, huge, seed++});
            check({6, 136, sc, fmt, pow2, t, Layout::kContiguous, false, huge, seed++});
            cases += 2;
          }
          check({6, 136, sc, fmt, pow2, t, Layout::kContiguous, true, huge, seed++});
          ++cases;
        }
      }
    }
  }
  RecordProperty("configurations", cases);
}

struct Shape {
  int64_t rows, cols;
};
struct Path {
  Layout layout;
  bool dual;
};
const Path kPaths[] = {{Layout::kContiguous, false},
                       {Layout::kContiguous, true},
                       {Layout::kTransposed, false},
                       {Layout::kOffset1, false}};

// Shapes with tails in both dimensions (partial 32x32 tiles, 1x128 and 128x128 blocks), every
// scaling; format, dtype and pow2 rotate with the case number.
TEST(Fp8Kernel, ShapesWithTails) {
  int cases = 0;
  uint32_t k = 0;
  auto run = [&](const Shape& sh, Fp8Scaling sc, const Path& r) {
    check({sh.rows, sh.cols, sc, kFormats[k % 2], k % 4 >= 2, kInputDtypes[k % 3], r.layout, r.dual,
           k % 5 != 0, 100 + k});
    ++k;
    ++cases;
  };
  // Small: every scaling on every path.
  for (Shape sh :
       {Shape{1, 1}, Shape{1, 200}, Shape{5, 3}, Shape{2, 4}, Shape{33, 65}, Shape{40, 33}}) {
    for (Fp8Scaling sc : kScalings) {
      for (const Path& r : kPaths) run(sh, sc, r);
    }
  }
  // Long rows: the fused kernels' loops (a row is one 256-thread block, 4 or 8 elements per
  // thread and step on the vector paths).
  for (Shape sh : {Shape{1, 5000}, Shape{3, 1000}, Shape{2, 1020}}) {
    for (Fp8Scaling sc : {Fp8Scaling::kRow, Fp8Scaling::kBlock1x128}) {
      for (Layout l : {Layout::kContiguous, Layout::kOffset1, Layout::kPadded4}) {
        run(sh, sc, {l, false});
      }
    }
  }
  // Several 128x128 blocks both ways: each scaling once, the path rotating, and the dual output
  // of 128x128 blocks (x^T's block grid transposed).
  int rot = 0;
  for (Shape sh : {Shape{130, 257}, Shape{257, 130}}) {
    for (Fp8Scaling sc : kScalings) run(sh, sc, kPaths[rot++ % 4]);
    ++rot;
    run(sh, Fp8Scaling::kBlock128x128, {Layout::kContiguous, true});
  }
  RecordProperty("configurations", cases);
}

// Tensors of 1e-20 and 1e-30 keep their precision (no minimum amax: the scale is
// min(max / amax, FLT_MAX)) on every path, and a block of fp32 subnormals gets the capped scale.
TEST(Fp8Kernel, TinyTensorsKeepTheirCodes) {
  int cases = 0;
  uint32_t k = 0;
  for (float mag : {1e-20f, 1e-30f}) {
    std::vector<float> x = normal_values(33 * 132, 21);
    for (float& v : x) v *= mag;
    for (int64_t j = 0; j < 132; ++j) x[132 + j] = 1e-41f * (j % 3);  // subnormal or zero
    for (Fp8Scaling sc : kScalings) {
      for (Fp8Format fmt : kFormats) {
        const Path& r = kPaths[k % 4];
        std::vector<uint8_t> q;
        check({33, 132, sc, fmt, k % 2 == 0, k % 3 ? DType::kFloat32 : DType::kBFloat16, r.layout,
               r.dual, false, 0},
              x, &q);
        int64_t zeros = 0;
        for (uint8_t c : q) zeros += (c & 0x7f) == 0;
        EXPECT_LT(zeros, static_cast<int64_t>(q.size()) / 20) << "tiny values quantized to 0";
        ++k;
        ++cases;
      }
    }
  }
  RecordProperty("configurations", cases);
}

// An empty input writes no codes but every scale it has, each the safe scale of amax 0.
TEST(Fp8Kernel, EmptyInputsGetSafeScales) {
  int cases = 0;
  for (const Shape& sh : {Shape{0, 16}, Shape{16, 0}, Shape{0, 0}, Shape{0, 300}, Shape{130, 0}}) {
    for (Fp8Scaling sc : kScalings) {
      for (Fp8Format fmt : kFormats) {
        for (bool pow2 : {false, true}) {
          for (bool dual : {false, true}) {
            check({sh.rows, sh.cols, sc, fmt, pow2, DType::kFloat32, Layout::kContiguous, dual,
                   false, 0});
            ++cases;
          }
        }
      }
    }
  }
  RecordProperty("configurations", cases);
}

// Every finite FP8 value, every midpoint between neighbours (ties to even) and one ulp either side
// of it, signed zeros, values below the smallest subnormal, +-Inf (E5M2: +-inf, E4M3: NaN) and NaN,
// through the
// device encoder. Each row holds the format's maximum, so row scaling (fused kernel) and tensor
// scaling (tiled kernel) use scale 1 exactly; the dual runs cast x^T with column scales.
TEST(Fp8Kernel, EveryCodeAndMidpointThroughTheEncoder) {
  int cases = 0;
  for (Fp8Format fmt : kFormats) {
    const float mx = fp8_spec(fmt).max;
    std::vector<float> finite;
    for (int code = 0; code < 256; ++code) {
      const float v = fp8_decode(static_cast<uint8_t>(code), fmt);
      if (std::isfinite(v)) finite.push_back(v);
    }
    std::vector<float> row = {mx, -mx, kInf, -kInf, kNaN, -kNaN, 0.f, -0.f, 1e-30f, -1e-45f};
    for (size_t k = 0; k < finite.size(); ++k) {
      row.push_back(finite[k]);
      if (k + 1 < finite.size() && std::fabs(finite[k + 1]) > std::fabs(finite[k]) &&
          std::signbit(finite[k + 1]) == std::signbit(finite[k])) {
        const float mid = 0.5f * (finite[k] + finite[k + 1]);
        row.push_back(mid);
        row.push_back(std::nextafter(mid, 0.f));
        row.push_back(std::nextafter(mid, 2.f * mid));
      }
    }
    const int64_t cols = static_cast<int64_t>(row.size());
    std::vector<float> x(row);
    x.insert(x.end(), row.rbegin(), row.rend());  // a second row, reversed
    for (Fp8Scaling sc : {Fp8Scaling::kRow, Fp8Scaling::kTensor}) {
      check({2, cols, sc, fmt, false, DType::kFloat32, Layout::kContiguous, false, false, 0}, x);
      check({2, cols, sc, fmt, false, DType::kFloat32, Layout::kTransposed, true, false, 0}, x);
      cases += 2;
    }
  }
  RecordProperty("configurations", cases);
}

// NaN and +-Inf come out non-finite on every path (E5M2 keeps inf, E4M3 has only NaN), and do
// not enter the scale: the finite elements' codes are those of the same input without them.
TEST(Fp8Kernel, NonFiniteInputsStayNonFinite) {
  const int64_t rows = 40, cols = 132;
  std::vector<float> x = normal_values(rows * cols, 5);
  std::vector<float> clean(x);
  const int64_t pos[] = {0 * cols + 3, 7 * cols + 129, 39 * cols + 131, 20 * cols + 64};
  const float special[] = {kNaN, kInf, -kInf, -kNaN};
  for (int k = 0; k < 4; ++k) x[pos[k]] = special[k], clean[pos[k]] = 0.f;
  int cases = 0;
  for (Fp8Scaling sc : kScalings) {
    for (Fp8Format fmt : kFormats) {
      for (const Path& r : kPaths) {
        const Fp8Case c{rows, cols, sc, fmt, true, DType::kBFloat16, r.layout, r.dual, false, 0};
        std::vector<uint8_t> q, q0;
        check(c, x, &q);
        check(c, clean, &q0);
        ASSERT_EQ(q.size(), x.size());
        ASSERT_EQ(q0.size(), x.size());
        for (int64_t k = 0; k < rows * cols; ++k) {
          if (std::isfinite(x[k])) {
            ASSERT_EQ(q[k], q0[k]) << c.describe() << " at " << k;
          } else if (std::isinf(x[k]) && fmt == Fp8Format::kE5M2) {
            ASSERT_EQ(q[k], x[k] > 0 ? 0x7c : 0xfc) << c.describe() << " at " << k;
          } else {
            ASSERT_EQ(q[k], 0x7f) << c.describe() << " at " << k;
          }
        }
        ++cases;
      }
    }
  }
  RecordProperty("configurations", cases);
}

// The 1x128 kernel's 64-bit index fallback (taken on a GPU only past INT32_MAX blocks), forced on
// small shapes through narrow_index_limit: several rows and column blocks, so a wrong block-to-
// row/column mapping shows; both the vectorized and the scalar kernel.
TEST(Fp8Kernel, WideIndexFallbackOfThe1x128Kernel) {
  const int64_t saved = cuda::narrow_index_limit();
  cuda::narrow_index_limit() = 0;
  for (DType t : kInputDtypes) {
    for (Layout l : {Layout::kContiguous, Layout::kOffset1}) {
      for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{5, 300}, {3, 1020}}) {
        check({rows, cols, Fp8Scaling::kBlock1x128, Fp8Format::kE4M3, false, t, l, false, false,
               static_cast<uint32_t>(rows + cols)});
      }
    }
  }
  cuda::narrow_index_limit() = saved;
}

// The tiled path on shapes that reach each of its branches: 8-wide vector loads (cols % 8 == 0,
// contiguous or rows padded by 8) and scalar ones (odd widths, a row stride of cols + 4, a
// transposed view, every other column); 16-, 8-, 4- and 1-byte stores of q and of qt (cols and
// rows % 16, 8, 4, odd); tiles ragged in both dimensions; amax blocks spanning 2 (128x128) and 4
// (tensor, column) row tiles, with a tail; tensor scaling through the flat grid-stride reduction
// (contiguous) and through the tiles (padded). Every non-fused scaling and the dual output of all.
TEST(Fp8Kernel, TiledPathWidthsAndSpans) {
  int cases = 0;
  uint32_t k = 0;
  const Shape shapes[] = {{70, 136}, {96, 48}, {130, 200}, {20, 12}, {64, 4},
                          {300, 24}, {7, 13},  {257, 72},  {33, 65}};
  for (const Shape& sh : shapes) {
    for (Fp8Scaling sc : kScalings) {
      for (bool dual : {false, true}) {
        if (!dual && fused(sc)) continue;
        for (Layout l : {Layout::kContiguous, Layout::kPadded8, Layout::kPadded4,
                         Layout::kTransposed, Layout::kEveryOther}) {
          ++k;
          // Scalar loads are covered elsewhere: a third of their cases here.
          if ((l == Layout::kPadded4 || l == Layout::kEveryOther) && k % 3 != 0) continue;
          check({sh.rows, sh.cols, sc, kFormats[k % 2], k % 4 >= 2, kInputDtypes[k % 3], l, dual,
                 k % 5 != 0, 300 + k});
          ++cases;
        }
      }
    }
  }
  RecordProperty("configurations", cases);
}

// Tensor scaling of a contiguous input large enough that the flat reduction's grid (8 blocks per
// simulated SM) loops: several strides, the 4-deep unrolled loads ragged at the end, and a
// tail of n % 8 elements; the largest value sits in the last element and then in the tail.
TEST(Fp8Kernel, FlatTensorAmaxLoops) {
  for (DType t : kInputDtypes) {
    for (const Shape& sh : {Shape{257, 520}, Shape{251, 523}}) {
      std::vector<float> x = normal_values(sh.rows * sh.cols, 7);
      x.back() = 300.f;
      for (bool dual : {false, true}) {
        check({sh.rows, sh.cols, Fp8Scaling::kTensor, Fp8Format::kE4M3, false, t,
               Layout::kContiguous, dual, false, 0},
              x);
      }
    }
  }
}

// The fused kernels at their edges: rows around 8192 elements (all kept in registers since the
// row kernel holds up to 16384; longer rows, read twice, are in test_kernel_fp8_rows.cc), at 8,
// 4 and 1 elements per load; 1x128 block counts that leave half of
// a warp without a block (16 lanes per block at 8 elements per load).
TEST(Fp8Kernel, FusedKernelEdges) {
  uint32_t k = 0;
  for (int64_t cols : {8200, 8196, 8193, 8192}) {
    for (Layout l : {Layout::kContiguous, Layout::kOffset4}) {
      check({2, cols, Fp8Scaling::kRow, kFormats[k % 2], k % 2 == 1, kInputDtypes[k % 3], l, false,
             true, 500 + k});
      ++k;
    }
  }
  for (const Shape& sh : {Shape{3, 128}, Shape{5, 264}, Shape{1, 136}, Shape{7, 8}}) {
    for (DType t : kInputDtypes) {
      for (Layout l : {Layout::kContiguous, Layout::kOffset4, Layout::kPadded8}) {
        check({sh.rows, sh.cols, Fp8Scaling::kBlock1x128, kFormats[k % 2], k % 2 == 0, t, l, false,
               true, 600 + k});
        ++k;
      }
    }
  }
}

// ---- Delayed scaling: cuda::fp8_quantize_delayed against core's fp8_quantize_delayed ----

// The scale to pass, relative to x's own tensorwise scale: half of it fits, 4x would clip (the
// recast), 1x is x's own (a recast only where fl(amax * scale) rounds above max, to equal codes).
const float kScaleFactors[] = {0.5f, 1.f, 4.f};

struct DelayedCase {
  int64_t rows, cols;
  Fp8Format fmt;
  bool pow2;
  DType dtype;
  Layout layout;
  bool dual;

  std::string describe() const {
    return std::to_string(rows) + "x" + std::to_string(cols) +
           (fmt == Fp8Format::kE4M3 ? " e4m3" : " e5m2") + (pow2 ? " pow2" : "") + " " +
           cudasim_test::dtype_name(dtype) + " " + cudasim_test::layout_name(layout) +
           (dual ? " dual" : "");
  }
};

// x's own tensorwise scale (core).
float own_scale(const Fp8Input& x, Fp8Format fmt) {
  std::vector<uint8_t> q(static_cast<size_t>(x.rows * x.cols));
  float s = 0.f;
  fp8_quantize(x, Fp8Scaling::kTensor, fmt, false, q.data(), &s);
  return s;
}

// The kernel's arguments for x (case c) with its outputs.
cuda::Fp8DelayedArgs delayed_args(const DelayedCase& c, const Fp8Input& x, std::vector<uint8_t>& q,
                                  std::vector<uint8_t>& qt, float* scale_used, float* amax) {
  cuda::Fp8DelayedArgs a;
  cudasim_test::set_input(a, x);
  a.fmt = c.fmt;
  a.pow2_scale = c.pow2;
  a.q = q.data();
  if (c.dual) a.qt = qt.data();
  a.scale_used = scale_used;
  a.amax = amax;
  return a;
}

void expect_same(const DelayedCase& c, const std::vector<uint8_t>& q,
                 const std::vector<uint8_t>& qt, float scale, float amax,
                 const std::vector<uint8_t>& want_q, const std::vector<uint8_t>& want_qt,
                 const Fp8DelayedResult& want) {
  EXPECT_TRUE(
      same_bits("scale", std::vector<float>{scale}, std::vector<float>{want.scale_used}, 1));
  EXPECT_TRUE(same_bits("amax", std::vector<float>{amax}, std::vector<float>{want.amax}, 1));
  EXPECT_TRUE(same_bits("q", q, want_q, c.cols));
  if (c.dual) {
    EXPECT_TRUE(same_bits("qt", qt, want_qt, c.rows));
  }
}

// fp8_quantize_from_history's kernels with `history` (entries `stride` apart) against core's: q
// (and q^T), the scale and amax bit for bit, in four launches (two for an empty x). A history
// core refuses (one holding +Inf, whose scale is 0) must give what a clipping scale gives: x's own
// tensorwise quantization. Outputs and scratch start as garbage.
void check_history(const DelayedCase& c, const std::vector<float>& values,
                   const std::vector<float>& history, int64_t stride = 1) {
  SCOPED_TRACE(c.describe() + " history[0]=" + std::to_string(history[0]));
  const StridedInput in(values, c.rows, c.cols, c.dtype, c.layout);
  const Fp8Input& x = in.view();
  const size_t n = static_cast<size_t>(c.rows * c.cols);
  const int64_t len = (static_cast<int64_t>(history.size()) - 1) / stride + 1;
  std::vector<uint8_t> want_q(n), want_qt(c.dual ? n : 0);
  uint8_t* want_qt_or_null = c.dual ? want_qt.data() : nullptr;
  Fp8DelayedResult want;
  if (fp8_history_scale(history.data(), len, stride, c.fmt, c.pow2) > 0.f) {
    want = fp8_quantize_from_history(x, history.data(), len, stride, c.fmt, c.pow2, want_q.data(),
                                     want_qt_or_null);
  } else {
    EXPECT_THROW(fp8_quantize_from_history(x, history.data(), len, stride, c.fmt, c.pow2,
                                           want_q.data(), nullptr),
                 std::invalid_argument);
    want = fp8_quantize_delayed(x, kF32Max, c.fmt, c.pow2, want_q.data(), want_qt_or_null);
    if (want.amax == 0.f) want.scale_used = 1.f;
  }
  std::vector<uint8_t> q(n, 0xaa), qt(c.dual ? n : 0, 0xaa);
  std::vector<float> given = {kNaN}, used = {kNaN}, scale = {kNaN}, amax = {1e30f};
  cuda::Fp8HistoryArgs h;
  h.delayed = delayed_args(c, x, q, qt, used.data(), amax.data());
  h.history = history.data();
  h.history_len = len;
  h.history_stride = stride;
  h.given = given.data();
  h.scale = scale.data();
  const uint64_t launches = cudasim::launch_count();
  EXPECT_EQ(cuda::fp8_quantize_from_history(h, nullptr), cudaSuccess)
      << cudasim::last_error_message();
  // The history's scale, the cast, the decision and the guarded recast: no host sync.
  EXPECT_EQ(cudasim::launch_count() - launches, n > 0 ? 4u : 2u);
  expect_same(c, q, qt, scale[0], amax[0], want_q, want_qt, want);
}

// Runs the kernel with `scale` on `values` and compares q (and q^T), scale_used and amax bit for
// bit with core; a scale core refuses (not finite and > 0) must give what a clipping scale gives:
// x's own tensorwise quantization. Outputs start as garbage so a missed store shows. Returns
// whether the scale used differs from the one given (the recast ran). Then the same case from a
// history whose scale is about `scale` (fmax / scale: Inf, -Inf, a negative or NaN for the bad
// ones, i.e. a refused, a never-filled and a NaN history).
bool check_delayed(const DelayedCase& c, const std::vector<float>& values, float scale) {
  SCOPED_TRACE(c.describe() + " scale=" + std::to_string(scale));
  const StridedInput in(values, c.rows, c.cols, c.dtype, c.layout);
  const Fp8Input& x = in.view();
  const size_t n = static_cast<size_t>(c.rows * c.cols);
  std::vector<uint8_t> want_q(n), want_qt(c.dual ? n : 0);
  const bool valid = scale > 0.f && std::isfinite(scale);
  if (!valid) {
    EXPECT_THROW(fp8_quantize_delayed(x, scale, c.fmt, c.pow2, want_q.data(), nullptr),
                 std::invalid_argument);
  }
  // For a bad scale, core with the largest finite scale: one that clips any nonzero x.
  const Fp8DelayedResult want = fp8_quantize_delayed(
      x, valid ? scale : kF32Max, c.fmt, c.pow2, want_q.data(), c.dual ? want_qt.data() : nullptr);
  std::vector<uint8_t> q(n, 0xaa), qt(c.dual ? n : 0, 0xaa);
  const std::vector<float> given = {scale};
  std::vector<float> used = {kNaN}, amax = {1e30f};
  cuda::Fp8DelayedArgs a = delayed_args(c, x, q, qt, used.data(), amax.data());
  a.scale = given.data();
  const uint64_t launches = cudasim::launch_count();
  EXPECT_EQ(cuda::fp8_quantize_delayed(a, nullptr), cudaSuccess) << cudasim::last_error_message();
  // The cast, the decision and the guarded recast, whatever the decision: no host sync.
  EXPECT_EQ(cudasim::launch_count() - launches, n > 0 ? 3u : 1u);
  expect_same(c, q, qt, used[0], amax[0], want_q, want_qt, want);
  check_history(c, values, {fp8_spec(c.fmt).max / scale, -1.f});
  return f32_bits(used[0]) != f32_bits(scale);
}

// Every format x input dtype x pow2 x scale (fits, x's own, clips) on each path: the flat
// single-pass kernel (contiguous, single output; odd widths take its element tail), the tiles
// with vector loads (contiguous dual, rows padded by 8), with scalar loads (a transposed view, a
// misaligned base), on shapes that are not multiples of 64 or 16.
TEST(Fp8Delayed, EveryFormatDtypeScaleAndPath) {
  const std::pair<Layout, bool> paths[] = {{Layout::kContiguous, false},
                                           {Layout::kContiguous, true},
                                           {Layout::kTransposed, false},
                                           {Layout::kOffset1, true},
                                           {Layout::kPadded8, true}};
  int cases = 0, redos = 0;
  uint32_t seed = 700;
  for (Fp8Format fmt : kFormats) {
    for (DType t : kInputDtypes) {
      for (bool pow2 : {false, true}) {
        for (const auto& [layout, dual] : paths) {
          const DelayedCase c{seed % 2 ? 6 : 70, seed % 2 ? 37 : 136, fmt, pow2, t, layout, dual};
          const std::vector<float> x = nasty(c.rows, c.cols, t, seed, seed % 3 == 0);
          ++seed;
          const StridedInput in(x, c.rows, c.cols, t, Layout::kContiguous);
          const float own = own_scale(in.view(), fmt);
          for (float f : kScaleFactors) {
            const bool redo = check_delayed(c, x, own * f);
            if (f != 1.f) {
              EXPECT_EQ(redo, f > 1.f) << c.describe();
            }
            redos += redo;
            ++cases;
          }
        }
      }
    }
  }
  RecordProperty("configurations", cases);
  RecordProperty("recasts", redos);
}

// Tails: 1x1, partial tiles both ways, and a contiguous input long enough that the flat
// kernel's grid-stride loop goes round with its 4-deep loads ragged and an n % 8 tail, the
// largest value last.
TEST(Fp8Delayed, ShapesWithTailsAndFlatLoops) {
  uint32_t k = 0;
  for (const Shape& sh : {Shape{1, 1}, Shape{5, 3}, Shape{33, 65}, Shape{130, 200}, Shape{251, 523},
                          Shape{257, 520}}) {
    std::vector<float> x = normal_values(sh.rows * sh.cols, 40 + k);
    x.back() = 300.f;
    for (bool dual : {false, true}) {
      const DelayedCase c{
          sh.rows, sh.cols, kFormats[k % 2], k % 3 == 0, kInputDtypes[k % 3], Layout::kContiguous,
          dual};
      const StridedInput in(x, sh.rows, sh.cols, c.dtype, Layout::kContiguous);
      const float own = own_scale(in.view(), c.fmt);
      EXPECT_FALSE(check_delayed(c, x, own * 0.5f));
      EXPECT_TRUE(check_delayed(c, x, own * 4.f));
      ++k;
    }
  }
}

// An all-zero, all-NaN or all-Inf x has nothing finite to clip: any valid scale is kept (amax 0);
// NaN and Inf keep their codes. An empty x writes nothing, keeps the scale and has amax 0.
TEST(Fp8Delayed, ZerosNonFiniteAndEmpty) {
  for (Fp8Format fmt : kFormats) {
    for (bool dual : {false, true}) {
      for (float v : {0.f, kNaN, kInf, -kInf}) {
        const std::vector<float> x(40 * 70, v);
        for (Layout l : {Layout::kContiguous, Layout::kTransposed}) {
          EXPECT_FALSE(check_delayed({40, 70, fmt, true, DType::kFloat32, l, dual}, x, 1e30f));
        }
      }
      for (const Shape& sh : {Shape{0, 16}, Shape{16, 0}, Shape{0, 0}}) {
        EXPECT_FALSE(check_delayed(
            {sh.rows, sh.cols, fmt, false, DType::kBFloat16, Layout::kContiguous, dual}, {}, 3.f));
      }
    }
  }
}

// A scale the CPU op would refuse (zero, negative, Inf, NaN) cannot be refused by the kernel
// without a host sync: it is treated as one that clips, so q is x's own tensorwise quantization
// and never cast with the bad scale. A tiny scale, valid, is used as given.
TEST(Fp8Delayed, InvalidScaleGivesOwnScale) {
  const std::vector<float> x = nasty(33, 65, DType::kFloat32, 9, false);
  for (const auto& [layout, dual] :
       {std::pair<Layout, bool>{Layout::kContiguous, false}, {Layout::kTransposed, true}}) {
    const DelayedCase c{33, 65, Fp8Format::kE4M3, true, DType::kFloat32, layout, dual};
    for (float bad : {0.f, -0.f, -2.f, kInf, -kInf, kNaN}) EXPECT_TRUE(check_delayed(c, x, bad));
    EXPECT_FALSE(check_delayed(c, x, 1e-45f));
  }
}

// Histories a layer holds or a load may bring: never filled (-1s), zeros, the smallest subnormal
// and other tiny maxima, the largest float, one entry, NaN (scale 1), +Inf (refused by core, x's
// own scale on the device), one longer than the warp (each lane takes several entries, the max
// last) and a strided view (whose skipped entries would give another scale that fits); on a
// nasty x (the flat kernel and the tiles), a moderate one (amax ~4: most histories' scales fit),
// zeros and an empty x.
TEST(Fp8History, NeverFilledTinyHugeNanInfLongAndStrided) {
  std::vector<float> long_history(1000, 0.5f);
  long_history.back() = 7.f;
  const std::vector<std::vector<float>> histories = {
      {-1.f, -1.f, -1.f, -1.f}, {0.f, -0.f},    {kSmallestAmax, -1.f},
      {1e-40f, 1e-30f},         {kF32Max, 1.f}, {3.f},
      {2.f, kNaN, 1.f},         {1.f, kInf},    long_history};
  const std::vector<float> x = nasty(70, 136, DType::kFloat32, 11, false);
  const std::vector<float> moderate = normal_values(70 * 136, 12);
  const std::vector<float> zeros(40 * 70, 0.f);
  for (Fp8Format fmt : kFormats) {
    for (const auto& [layout, dual] :
         {std::pair<Layout, bool>{Layout::kContiguous, false}, {Layout::kTransposed, true}}) {
      const DelayedCase c{70, 136, fmt, dual, DType::kFloat32, layout, dual};
      for (const std::vector<float>& h : histories) {
        check_history(c, x, h);
        check_history(c, moderate, h);
        check_history({40, 70, fmt, false, DType::kBFloat16, layout, dual}, zeros, h);
        check_history({0, 16, fmt, dual, DType::kFloat16, Layout::kContiguous, dual}, {}, h);
      }
      check_history(c, moderate, {8.f, 1e3f, 16.f, 1e3f, 4.f}, 2);
    }
  }
}

}  // namespace
}  // namespace tierlift
