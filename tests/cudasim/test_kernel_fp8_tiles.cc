// The FP8 tiled and flat kernels' hot paths (csrc/cuda/fp8_quant_tiles.cu, fp8_device.cuh) in
// the CPU simulator, bit for bit against core (csrc/core/lowp/quantize.h):
//  - the fast encoder (fp8dev::Fp8Encoder) against fp8.h's fp8_encode on bit patterns that walk
//    every exponent and every rounding case of both formats, and its non-finite flag;
//  - the tiles' block arithmetic (a tile's block is its index shifted, single-element blocks of
//    one row or one column are indexed per column or per row) on single rows and columns and on
//    dimensions up to 70000, not multiples of 64, contiguous and strided;
//  - NaN and +-Inf at every position of the 16-code groups of q and q^T and of the flat cast's
//    8-element vectors, which the kernels encode again on their exact path, with the delayed
//    cast's finite amax taken from the same vectors.
// test_kernel_fp8.cc covers every scaling, format, dtype and layout; this file the shapes and
// values that reach these paths' edges.
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
using cudasim_test::kNaN;
using cudasim_test::Layout;
using cudasim_test::normal_values;
using cudasim_test::same_bits;
using cudasim_test::StridedInput;

const Fp8Format kFormats[] = {Fp8Format::kE4M3, Fp8Format::kE5M2};
const Fp8Scaling kScalings[] = {Fp8Scaling::kTensor, Fp8Scaling::kRow, Fp8Scaling::kCol,
                                Fp8Scaling::kBlock1x128, Fp8Scaling::kBlock128x128};

// Codes of 4 floats through the fast encoder: the packed word, and whether it flagged them.
uint32_t fast_codes(const float (&x)[4], Fp8Format fmt, bool* special) {
  const cuda::fp8dev::Fp8Encoder enc = cuda::fp8dev::Fp8Encoder::of(fmt);
  bool s = false;
  const uint32_t w = enc.pack4(x, s);
  *special = s;
  return w;
}

// Every sign and exponent, with mantissas whose top 6 bits take every value (the kept bits, the
// rounding bit and the ones below it in both formats) and whose low 17 bits are 0, 1, all ones,
// a lone top bit or all but it: exact values, ties, and either side of a tie, subnormal fp32
// inputs, the saturation range, +-Inf and NaNs. Groups of 4 consecutive patterns.
TEST(Fp8Encoder, MatchesEncodeOnEveryExponentAndRoundingCase) {
  const uint32_t lows[] = {0u, 1u, 0x1ffffu, 0x10000u, 0xffffu};
  std::vector<uint32_t> patterns;
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (uint32_t e = 0; e < 256; ++e) {
      for (uint32_t top = 0; top < 64; ++top) {
        for (uint32_t low : lows) patterns.push_back(sign | e << 23 | top << 17 | low);
      }
    }
  }
  ASSERT_EQ(patterns.size() % 4, 0u);
  for (Fp8Format fmt : kFormats) {
    int64_t bad = 0, groups = 0, flagged = 0;
    for (size_t k = 0; k < patterns.size(); k += 4) {
      float x[4];
      bool finite = true;
      uint32_t want = 0;
      for (int b = 0; b < 4; ++b) {
        x[b] = bits_f32(patterns[k + b]);
        finite = finite && std::isfinite(x[b]);
        want |= static_cast<uint32_t>(fp8_encode(x[b], fmt)) << (8 * b);
      }
      bool special = false;
      const uint32_t got = fast_codes(x, fmt, &special);
      ++groups;
      flagged += special;
      EXPECT_EQ(special, !finite) << std::hex << patterns[k];
      if (finite && got != want && bad++ < 5) {
        ADD_FAILURE() << std::hex << "x[0] bits 0x" << patterns[k] << ": fast 0x" << got
                      << ", fp8_encode 0x" << want;
      }
    }
    EXPECT_EQ(bad, 0);
    EXPECT_GT(flagged, 0);
    EXPECT_LT(flagged, groups / 50);
  }
}

// fp8_quantize (or the dual) of `values` through the kernels against core: codes and scales.
void check(int64_t rows, int64_t cols, Fp8Scaling scaling, Fp8Format fmt, DType dtype,
           Layout layout, bool dual, const std::vector<float>& values) {
  SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) + " scaling " +
               std::to_string(static_cast<int>(scaling)) + " fmt " +
               std::to_string(static_cast<int>(fmt)) + " " + cudasim_test::dtype_name(dtype) + " " +
               cudasim_test::layout_name(layout) + (dual ? " dual" : ""));
  const StridedInput in(values, rows, cols, dtype, layout);
  const Fp8Input& x = in.view();
  const Fp8Blocks b = fp8_blocks(scaling, rows, cols);
  const Fp8Blocks bt = fp8_blocks(scaling, cols, rows);
  const size_t n = static_cast<size_t>(rows * cols);
  const size_t ns = static_cast<size_t>(b.grid_rows * b.grid_cols);
  const size_t nst = dual ? static_cast<size_t>(bt.grid_rows * bt.grid_cols) : 0;
  std::vector<uint8_t> want_q(n), want_qt(dual ? n : 0);
  std::vector<float> want_s(ns), want_st(nst);
  if (dual) {
    fp8_quantize_dual(x, scaling, fmt, false, want_q.data(), want_s.data(), want_qt.data(),
                      want_st.data());
  } else {
    fp8_quantize(x, scaling, fmt, false, want_q.data(), want_s.data());
  }
  std::vector<uint8_t> q(n, 0xaa), qt(dual ? n : 0, 0xaa);
  std::vector<float> s(ns, kNaN), st(nst, kNaN);
  cuda::Fp8QuantArgs a;
  cudasim_test::set_input(a, x);
  a.scaling = scaling;
  a.fmt = fmt;
  a.q = q.data();
  a.scales = s.data();
  if (dual) {
    a.qt = qt.data();
    a.scales_t = st.data();
  }
  ASSERT_EQ(cuda::fp8_quantize(a, nullptr), cudaSuccess) << cudasim::last_error_message();
  EXPECT_TRUE(same_bits("scales", s, want_s, b.grid_cols));
  EXPECT_TRUE(same_bits("q", q, want_q, cols));
  if (dual) {
    EXPECT_TRUE(same_bits("scales_t", st, want_st, bt.grid_cols));
    EXPECT_TRUE(same_bits("qt", qt, want_qt, rows));
  }
}

// Normal values whose magnitude rises along the matrix (so every block has its own amax and a
// block read from the wrong slot shows), NaN and Inf in a few places.
std::vector<float> rising(int64_t rows, int64_t cols, uint32_t seed) {
  std::vector<float> x = normal_values(rows * cols, seed);
  for (size_t k = 0; k < x.size(); ++k) x[k] *= 1.f + static_cast<float>(k % 977);
  if (x.size() > 40) x[17] = kNaN, x[31] = kInf, x[x.size() - 3] = -kInf;
  return x;
}

// A single row or column: the blocks of row scaling of one column and of column scaling of one
// row hold one element each (indexed per row, per column). Every scaling, single and dual,
// contiguous, transposed and with a column stride of 2.
TEST(Fp8Tiles, SingleRowsAndColumns) {
  int k = 0;
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 1}, {1, 7}, {1, 65}, {5, 1}, {129, 1}, {1, 300}, {300, 1}}) {
    const std::vector<float> x = rising(rows, cols, 10 + k);
    for (Fp8Scaling sc : kScalings) {
      for (bool dual : {false, true}) {
        for (Layout l : {Layout::kContiguous, Layout::kTransposed, Layout::kEveryOther}) {
          ++k;
          check(rows, cols, sc, kFormats[k % 2], cudasim_test::kInputDtypes[k % 3], l, dual, x);
        }
      }
    }
  }
}

// Block coordinates of tiles away from the origin: 128x128 blocks (a tile's block is its index
// shifted by one), whole columns and the tensor, widths that are not multiples of 64 or 128,
// contiguous (vector loads) and transposed or column-strided (element loads along either
// dimension), single and dual.
TEST(Fp8Tiles, LongDimensionsInTheBlockArithmetic) {
  int k = 0;
  for (const auto& [rows, cols] :
       std::vector<std::pair<int64_t, int64_t>>{{8, 1100}, {1100, 8}, {193, 136}, {136, 193}}) {
    const std::vector<float> x = rising(rows, cols, 50 + k);
    for (Fp8Scaling sc :
         {Fp8Scaling::kBlock128x128, Fp8Scaling::kCol, Fp8Scaling::kTensor, Fp8Scaling::kRow}) {
      for (Layout l : {Layout::kContiguous, Layout::kTransposed, Layout::kEveryOther}) {
        ++k;
        const bool dual = sc == Fp8Scaling::kRow || k % 2 == 0;
        check(rows, cols, sc, kFormats[k % 2], cudasim_test::kInputDtypes[k % 3], l, dual, x);
      }
    }
  }
}

// 70000 columns, past 65535 in every index: 128x128 blocks over q's column tiles and, in the dual
// output, over x^T's row tiles.
TEST(Fp8Tiles, SeventyThousandColumns) {
  check(2, 70000, Fp8Scaling::kBlock128x128, Fp8Format::kE4M3, DType::kBFloat16,
        Layout::kContiguous, true, rising(2, 70000, 90));
}

// A NaN, +Inf or -Inf at each of the 16 positions of q's code groups (rows) and of q^T's
// (columns), with per-code scales (column blocks along q's rows, row blocks along q^T's) and
// one scale per group: each such group is encoded again exactly, its finite codes too.
TEST(Fp8Tiles, NonFiniteAtEveryPositionOfAGroup) {
  const int64_t rows = 70, cols = 136;
  std::vector<float> x = normal_values(rows * cols, 3);
  const float special[] = {kNaN, kInf, -kInf};
  for (int n = 0; n < 16; ++n) {
    x[(2 * n) * cols + 16 + n] = special[n % 3];             // q: row 2n, group 1, position n
    x[(32 + n) * cols + 70 + 2 * n] = special[(n + 1) % 3];  // q^T: column 70 + 2n, position n
  }
  int k = 0;
  for (Fp8Scaling sc : kScalings) {
    for (Fp8Format fmt : kFormats) {
      for (Layout l : {Layout::kContiguous, Layout::kTransposed}) {
        check(rows, cols, sc, fmt, cudasim_test::kInputDtypes[k++ % 3], l, true, x);
      }
    }
  }
}

// Delayed scaling's flat cast (contiguous x, no q^T) against core: q, scale_used and the finite
// amax, with NaN or Inf at each position of its 8-element vectors, next to the largest finite
// value; and scales so large that finite products overflow to Inf in the first cast.
TEST(Fp8Tiles, DelayedFlatCastWithNonFiniteVectors) {
  const int64_t rows = 24, cols = 136;  // the flat kernel's vectors: 8 aligned elements
  for (Fp8Format fmt : kFormats) {
    for (int pos = 0; pos < 8; ++pos) {
      std::vector<float> x = normal_values(rows * cols, 20 + pos);
      const float special[] = {kNaN, kInf, -kInf};
      for (int64_t v = 0; v < rows * cols / 8; v += 7) {
        x[8 * v + pos] = special[v % 3];
        x[8 * v + (pos + 3) % 8] = v == 7 * 40 ? -900.f : x[8 * v + (pos + 3) % 8];
      }
      for (float scale : {0.25f, 1e30f, kF32Max}) {
        SCOPED_TRACE("pos " + std::to_string(pos) + " scale " + std::to_string(scale));
        const StridedInput in(x, rows, cols, DType::kFloat32, Layout::kContiguous);
        std::vector<uint8_t> want_q(x.size()), q(x.size(), 0xaa);
        const Fp8DelayedResult want =
            fp8_quantize_delayed(in.view(), scale, fmt, false, want_q.data(), nullptr);
        const std::vector<float> given = {scale};
        std::vector<float> used = {kNaN}, amax = {1e30f};
        cuda::Fp8DelayedArgs a;
        a.x = in.view().data;
        a.dtype = DType::kFloat32;
        a.rows = rows;
        a.cols = cols;
        a.row_stride = cols;
        a.fmt = fmt;
        a.scale = given.data();
        a.q = q.data();
        a.scale_used = used.data();
        a.amax = amax.data();
        ASSERT_EQ(cuda::fp8_quantize_delayed(a, nullptr), cudaSuccess)
            << cudasim::last_error_message();
        EXPECT_TRUE(same_bits("amax", amax, std::vector<float>{want.amax}, 1));
        EXPECT_TRUE(same_bits("scale", used, std::vector<float>{want.scale_used}, 1));
        EXPECT_TRUE(same_bits("q", q, want_q, cols));
      }
    }
  }
}

}  // namespace
}  // namespace tierlift
