// The fused FP8 row and 1x128 kernels (csrc/cuda/fp8_quant.cu) run in the CPU simulator, compared
// bit for bit with core's fp8_quantize (codes and scales) on the shapes that reach their edges:
//  - NaN / +-Inf at every position of a 128-element block and of a row (every group of four
//    codes the branch-free encoder packs, every lane's share), where a warp's other blocks are
//    clean, and rows or blocks with nothing finite or nothing but zeros;
//  - rows of 1 to 20000 elements: each thread count of the row kernel (32 to 512 threads, 32
//    elements each in registers), the 16384-element register limit and the two-pass path past it;
//  - 1x128 tails (cols not a multiple of 128) and grids whose last warp runs past the last block;
//  - 8-, 4- and 1-element loads: aligned, 8-byte aligned (bf16/fp16), misaligned or padded rows;
//  - the multiply-and-shift division that finds a lane's row, checked on the host.
// Every case runs the three input types, both formats, with and without power-of-two scales.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/lowp/fp8.h"
#include "core/lowp/quantize.h"
#include "core/util/dtype.h"
#include "cuda/fp8_quant.cuh"
#include "cudasim/cudasim.h"
#include "cudasim/launch.h"
#include "tests/cudasim/lowp_input.h"

// After cudasim.h, which gives its device code the intrinsics on the host.
#include "cuda/fp8_device.cuh"

namespace tierlift {
namespace {

using cudasim_test::kInf;
using cudasim_test::kInputDtypes;
using cudasim_test::kNaN;
using cudasim_test::Layout;
using cudasim_test::normal_values;
using cudasim_test::same_bits;
using cudasim_test::StridedInput;

struct RowCase {
  int64_t rows, cols;
  Fp8Scaling scaling;
  Fp8Format fmt;
  bool pow2;
  DType dtype;
  Layout layout;

  std::string describe() const {
    return std::to_string(rows) + "x" + std::to_string(cols) +
           (scaling == Fp8Scaling::kRow ? " row" : " 1x128") +
           (fmt == Fp8Format::kE4M3 ? " e4m3" : " e5m2") + (pow2 ? " pow2" : "") + " " +
           cudasim_test::dtype_name(dtype) + " " + cudasim_test::layout_name(layout);
  }
};

// Quantizes `values` laid out as c.layout with one fused kernel launch and compares codes and
// scales with core. Outputs start as garbage (0xaa codes, NaN scales) so a missed store shows.
void check(const RowCase& c, const std::vector<float>& values) {
  SCOPED_TRACE(c.describe());
  const StridedInput in(values, c.rows, c.cols, c.dtype, c.layout);
  const Fp8Input& x = in.view();
  const Fp8Blocks b = fp8_blocks(c.scaling, c.rows, c.cols);
  const size_t n = static_cast<size_t>(c.rows * c.cols);
  const size_t ns = static_cast<size_t>(b.grid_rows * b.grid_cols);
  std::vector<uint8_t> want_q(n);
  std::vector<float> want_s(ns);
  fp8_quantize(x, c.scaling, c.fmt, c.pow2, want_q.data(), want_s.data());

  std::vector<uint8_t> q(n, 0xaa);
  std::vector<float> s(ns, kNaN);
  cuda::Fp8QuantArgs a;
  cudasim_test::set_input(a, x);
  a.scaling = c.scaling;
  a.fmt = c.fmt;
  a.pow2_scale = c.pow2;
  a.q = q.data();
  a.scales = s.data();
  const uint64_t launches = cudasim::launch_count();
  ASSERT_EQ(cuda::fp8_quantize(a, nullptr), cudaSuccess) << cudasim::last_error_message();
  EXPECT_EQ(cudasim::launch_count() - launches, 1u) << "expected the fused one-kernel path";
  EXPECT_TRUE(same_bits("scales", s, want_s, b.grid_cols));
  EXPECT_TRUE(same_bits("q", q, want_q, c.cols));
}

// Normal values over ~30 binades (so some codes are subnormal), fixed by the seed.
std::vector<float> spread(int64_t n, uint32_t seed) {
  std::vector<float> x = normal_values(n, seed);
  for (int64_t k = 0; k < n; ++k)
    x[k] = std::ldexp(x[k], static_cast<int>((k * 7 + seed) % 30) - 15);
  return x;
}

const Fp8Scaling kFused[] = {Fp8Scaling::kRow, Fp8Scaling::kBlock1x128};
const float kSpecial[] = {kNaN, kInf, -kInf, -kNaN};

// Case k of a sweep: format, pow2 and input type rotate so that every combination occurs.
RowCase rotate(int64_t rows, int64_t cols, Fp8Scaling sc, Layout l, int k) {
  return {rows,
          cols,
          sc,
          k % 2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3,
          (k / 2) % 2 == 1,
          kInputDtypes[k % 3],
          l};
}

// Row r holds NaN / +-Inf at position r of its first 128 elements (all positions of a block:
// every group of four codes, every lane's first and second load) and is clean after it, so a
// warp's other blocks are clean while one is redone; a last row holds nothing finite, and one
// before it nothing but zeros.
TEST(Fp8RowKernels, NonFiniteAtEveryPositionOfABlock) {
  const int64_t rows = 130, cols = 256;
  std::vector<float> x = spread(rows * cols, 11);
  for (int64_t r = 0; r < 128; ++r) x[r * cols + r] = kSpecial[r % 4];
  for (int64_t j = 0; j < cols; ++j) {
    x[128 * cols + j] = 0.f;
    x[129 * cols + j] = kSpecial[j % 4];
  }
  int k = 0;
  for (Fp8Scaling sc : kFused) {
    for (DType t : kInputDtypes) {
      for (Fp8Format fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
        for (Layout l : {Layout::kContiguous, Layout::kOffset4, Layout::kOffset1}) {
          check({rows, cols, sc, fmt, k++ % 2 == 1, t, l}, x);
        }
      }
    }
  }
}

// The row kernel's in-register rows (one Inf or NaN at each of the 64 positions of a short row,
// and at the first, middle and last position of rows at each thread count) and its two-pass
// rows past 16384 elements, where the amax is reduced again without the Inf.
TEST(Fp8RowKernels, NonFiniteAnywhereInARow) {
  {
    const int64_t rows = 64, cols = 64;
    std::vector<float> x = spread(rows * cols, 12);
    for (int64_t r = 0; r < rows; ++r) x[r * cols + r] = kSpecial[r % 4];
    for (int k = 0; k < 6; ++k)
      check(rotate(rows, cols, Fp8Scaling::kRow, Layout::kContiguous, k), x);
  }
  int k = 0;
  for (int64_t cols : {1000, 2048, 4096, 8192, 14336, 16384, 16392, 20000}) {
    const int64_t rows = 4;
    std::vector<float> x = spread(rows * cols, 13);
    x[0] = kInf;                                                           // row 0: first element
    x[1 * cols + cols / 2 + 3] = -kInf;                                    // row 1: middle
    x[3 * cols - 1] = kNaN;                                                // row 2: last
    for (int64_t j = 0; j < cols; ++j) x[3 * cols + j] = kSpecial[j % 4];  // row 3: nothing finite
    for (Layout l : {Layout::kContiguous, Layout::kOffset4}) {
      check(rotate(rows, cols, Fp8Scaling::kRow, l, k++), x);
    }
  }
}

// Rows of 1 to 20000 elements: below, at and past each thread count's capacity (32 threads hold
// 1024 elements, 512 threads 16384) and the two-pass path past it, with 8-, 4- and 1-element
// loads; an all-zero row in each (its scale is the safe one).
TEST(Fp8RowKernels, RowLengthsAcrossThreadCountsAndTheRegisterLimit) {
  int k = 0;
  for (int64_t cols : {1,    2,    3,    4,     5,     8,     12,    31,    32,    33,
                       100,  1016, 1024, 1032,  2040,  2048,  2056,  4088,  4096,  4104,
                       8184, 8192, 8200, 14336, 16376, 16384, 16385, 16388, 16392, 20000}) {
    const int64_t rows = cols > 4096 ? 2 : 3;
    std::vector<float> x = spread(rows * cols, static_cast<uint32_t>(cols));
    for (int64_t j = 0; j < cols; ++j) x[(rows - 1) * cols + j] = 0.f;
    for (Layout l : {Layout::kContiguous, Layout::kOffset4, Layout::kOffset1}) {
      check(rotate(rows, cols, Fp8Scaling::kRow, l, k++), x);
    }
  }
}

// 1x128 blocks: widths with tails (a last block of 8 .. 120 elements, whole ones), rows whose
// block counts leave the grid's last warp, or part of it, without a block, and padded rows.
TEST(Fp8RowKernels, BlocksWithTailsAndRaggedGrids) {
  int k = 0;
  const std::pair<int64_t, int64_t> shapes[] = {{1, 8},    {3, 120},  {5, 128},  {7, 136},
                                                {2, 248},  {9, 264},  {33, 384}, {4, 1000},
                                                {3, 4104}, {1, 20000}};
  for (const auto& [rows, cols] : shapes) {
    std::vector<float> x = spread(rows * cols, static_cast<uint32_t>(rows * cols));
    if (rows > 1) {
      for (int64_t j = 0; j < cols; ++j) x[(rows - 1) * cols + j] = 0.f;
    }
    for (Layout l : {Layout::kContiguous, Layout::kOffset4, Layout::kOffset1, Layout::kPadded8,
                     Layout::kPadded4}) {
      check(rotate(rows, cols, Fp8Scaling::kBlock1x128, l, k++), x);
    }
  }
}

// Many rows of few blocks: each lane's row comes from the multiply-and-shift division by the
// block count per row, for counts 1 .. 9 and 33.
TEST(Fp8RowKernels, ManyRowsOfFewBlocks) {
  int k = 0;
  for (int64_t gc : {1, 2, 3, 5, 7, 9, 33}) {
    const int64_t rows = gc > 8 ? 17 : 70, cols = 128 * gc - 8 * (gc % 3);
    check(rotate(rows, cols, Fp8Scaling::kBlock1x128, Layout::kContiguous, k++),
          spread(rows * cols, static_cast<uint32_t>(gc)));
  }
}

// The division that finds a 1x128 lane's row: exact for every divisor up to 2^12 against many
// numerators, and for divisors around powers of two up to 2^31 - 1 against numerators near 2^31.
TEST(Fp8RowKernels, MultiplyShiftDivisionIsExact) {
  auto expect_exact = [](uint32_t d, uint32_t n) {
    ASSERT_EQ(cuda::fp8dev::FastDiv::of(d).div(n), n / d) << n << " / " << d;
  };
  std::vector<uint32_t> ns;
  for (uint32_t n = 0; n < 2000; ++n) ns.push_back(n);
  for (uint32_t e = 12; e <= 31; ++e) {
    for (int64_t dn : {-3, -2, -1, 0, 1, 2, 3}) {
      const int64_t n = (int64_t{1} << e) + dn;
      if (n >= 0 && n < (int64_t{1} << 31)) ns.push_back(static_cast<uint32_t>(n));
    }
  }
  for (uint32_t d = 1; d <= 4096; ++d) {
    for (uint32_t n : ns) expect_exact(d, n);
  }
  for (uint32_t e = 12; e <= 31; ++e) {
    for (int64_t dd : {-1, 0, 1, 3}) {
      const int64_t d = (int64_t{1} << e) + dd;
      if (d < 1 || d >= (int64_t{1} << 31)) continue;
      for (uint32_t n : ns) expect_exact(static_cast<uint32_t>(d), n);
      for (uint32_t n = 0x7fffffffu; n > 0x7fffffffu - 100000u; --n) {
        expect_exact(static_cast<uint32_t>(d), n);
      }
    }
  }
}

}  // namespace
}  // namespace tierlift
