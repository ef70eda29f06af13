// The fused FP8 row and 1x128 kernels' amax (csrc/cuda/fp8_quant.cu: a plain max of |x|, where
// fmaxf drops NaN, reduced again without Inf only when it comes out infinite) against core's
// finite amax, on the rows and blocks where the two could part: nothing but NaN (amax 0, no
// second reduction), NaN with -0.0, nothing but -0.0, subnormals alone or beside zeros, tiny
// normals whose scale overflows, and the largest finite values; each for 8-, 4- and 1-element
// loads, every input type, both formats, with and without power-of-two scales. And the row
// kernel's grid: a row count past the grid's limit is refused, not wrapped to a few rows. And the
// 1x128 launcher's middle case: too many lanes for the vector kernel, blocks few enough for 32-bit
// division.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/lowp/quantize.h"
#include "core/util/dtype.h"
#include "cuda/fp8_quant.cuh"
#include "cuda/launch.cuh"
#include "cudasim/launch.h"
#include "tests/cudasim/lowp_input.h"

namespace tierlift {
namespace {

using cudasim_test::kInputDtypes;
using cudasim_test::kNaN;
using cudasim_test::Layout;
using cudasim_test::same_bits;
using cudasim_test::StridedInput;

// One fused launch on `values` ([rows, cols] as `layout`), codes and scales bit for bit with core.
void check(const std::vector<float>& values, int64_t rows, int64_t cols, Fp8Scaling scaling,
           Fp8Format fmt, bool pow2, DType dtype, Layout layout) {
  SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) +
               (scaling == Fp8Scaling::kRow ? " row" : " 1x128") +
               (fmt == Fp8Format::kE4M3 ? " e4m3" : " e5m2") + (pow2 ? " pow2 " : " ") +
               cudasim_test::dtype_name(dtype) + " " + cudasim_test::layout_name(layout));
  const StridedInput in(values, rows, cols, dtype, layout);
  const Fp8Input& x = in.view();
  const Fp8Blocks b = fp8_blocks(scaling, rows, cols);
  const size_t n = static_cast<size_t>(rows * cols);
  const size_t ns = static_cast<size_t>(b.grid_rows * b.grid_cols);
  std::vector<uint8_t> want_q(n);
  std::vector<float> want_s(ns);
  fp8_quantize(x, scaling, fmt, pow2, want_q.data(), want_s.data());

  std::vector<uint8_t> q(n, 0xaa);
  std::vector<float> s(ns, kNaN);
  cuda::Fp8QuantArgs a;
  cudasim_test::set_input(a, x);
  a.scaling = scaling;
  a.fmt = fmt;
  a.pow2_scale = pow2;
  a.q = q.data();
  a.scales = s.data();
  const uint64_t launches = cudasim::launch_count();
  ASSERT_EQ(cuda::fp8_quantize(a, nullptr), cudaSuccess) << cudasim::last_error_message();
  EXPECT_EQ(cudasim::launch_count() - launches, 1u) << "expected the fused one-kernel path";
  EXPECT_TRUE(same_bits("scales", s, want_s, b.grid_cols));
  EXPECT_TRUE(same_bits("q", q, want_q, cols));
}

// Row r of `rows` rows of `cols` elements holds pattern r (each pattern a whole row, so a whole
// row's amax and, for cols = 256, two whole 1x128 blocks).
std::vector<float> patterns(int64_t cols) {
  const float sub = std::ldexp(1.f, -149), tiny = std::ldexp(1.f, -140);
  const float fmax = 3.40282347e38f;
  std::vector<std::vector<float>> rows;
  auto fill = [&](auto f) {
    std::vector<float> r(static_cast<size_t>(cols));
    for (int64_t j = 0; j < cols; ++j) r[j] = f(j);
    rows.push_back(r);
  };
  fill([&](int64_t) { return kNaN; });                                    // nothing but NaN
  fill([&](int64_t j) { return j % 2 ? -kNaN : kNaN; });                  // NaN of both signs
  fill([&](int64_t j) { return j % 3 ? -0.f : kNaN; });                   // -0.0 and NaN
  fill([&](int64_t) { return -0.f; });                                    // nothing but -0.0
  fill([&](int64_t j) { return j % 2 ? -0.f : 0.f; });                    // +-0.0
  fill([&](int64_t j) { return j == cols / 3 ? -sub : 0.f; });            // one subnormal
  fill([&](int64_t j) { return (j % 5 - 2) * sub * (j % 7 + 1); });       // subnormals only
  fill([&](int64_t j) { return j % 4 ? kNaN : (j % 8 ? sub : -tiny); });  // subnormals and NaN
  fill([&](int64_t j) { return (j % 2 ? -1.f : 1.f) * 1e-38f * (1 + j % 9); });  // tiny normals
  fill([&](int64_t j) { return j % 2 ? -fmax : fmax * 0.75f; });  // the largest finite
  fill([&](int64_t j) { return j % 5 ? -kNaN : -fmax; });         // the largest and NaN
  std::vector<float> out;
  for (const auto& r : rows) out.insert(out.end(), r.begin(), r.end());
  return out;
}

TEST(Fp8RowAmaxEdges, NanZerosSubnormalsAndExtremesMatchCore) {
  for (int64_t cols : {8, 256, 1000, 16384, 16392}) {
    const std::vector<float> x = patterns(cols);
    const int64_t rows = static_cast<int64_t>(x.size()) / cols;
    int k = 0;
    for (Fp8Scaling sc : {Fp8Scaling::kRow, Fp8Scaling::kBlock1x128}) {
      if (sc == Fp8Scaling::kBlock1x128 && cols > 1000) continue;  // the row path's widths
      for (DType t : kInputDtypes) {
        for (Layout l : {Layout::kContiguous, Layout::kOffset4, Layout::kOffset1}) {
          const Fp8Format fmt = k % 2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
          const bool pow2 = (k / 2) % 2 == 1;
          check(x, rows, cols, sc, fmt, pow2, t, l);
          ++k;
        }
      }
    }
  }
}

// The row kernel takes one thread block per row, and a grid holds at most 2^31 - 1 of them: a
// row count past 2^32 used to wrap (2^32 + 1 rows launched one block and reported success, the
// other rows' codes and scales never written). It is refused before any launch.
TEST(Fp8RowAmaxEdges, RowCountPastTheGridIsRefused) {
  for (int64_t rows : {(int64_t{1} << 32) + 1, (int64_t{1} << 31)}) {
    SCOPED_TRACE(rows);
    std::vector<float> x(1, 1.f), s(1, kNaN);
    std::vector<uint8_t> q(1, 0xaa);
    cuda::Fp8QuantArgs a;
    a.x = x.data();
    a.dtype = DType::kFloat32;
    a.rows = rows;
    a.cols = 1;
    a.row_stride = 1;
    a.col_stride = 1;
    a.scaling = Fp8Scaling::kRow;
    a.fmt = Fp8Format::kE4M3;
    a.q = q.data();
    a.scales = s.data();
    const uint64_t launches = cudasim::launch_count();
    EXPECT_NE(cuda::fp8_quantize(a, nullptr), cudaSuccess);
    EXPECT_EQ(cudasim::launch_count() - launches, 0u);
    EXPECT_EQ(q[0], 0xaa);
    (void)cudaGetLastError();  // clear the sticky error for the next test
  }
}

// Between 2^29 and 2^31 1x128 blocks, the vector kernel's lanes (4 per block) pass 2^31 but the
// blocks still fit 32-bit division: the 128 / kW lanes per block kernel with its narrow index,
// forced on small shapes by a limit between the block and lane counts.
TEST(Fp8RowAmaxEdges, BlocksPastTheVectorKernelsLanesDivideNarrow) {
  const int64_t saved = cuda::narrow_index_limit();
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{7, 300}, {5, 1024}}) {
    const int64_t nblocks = rows * ((cols + 127) / 128);
    cuda::narrow_index_limit() = nblocks;  // lanes = 4 * nblocks past it, the blocks not
    std::vector<float> x = cudasim_test::normal_values(rows * cols, 3);
    x[cols + 5] = kNaN;
    int k = 0;
    for (DType t : kInputDtypes) {
      for (Layout l : {Layout::kContiguous, Layout::kOffset4}) {
        check(x, rows, cols, Fp8Scaling::kBlock1x128, k % 2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3,
              k % 3 == 0, t, l);
        ++k;
      }
    }
  }
  cuda::narrow_index_limit() = saved;
}

}  // namespace
}  // namespace tierlift
