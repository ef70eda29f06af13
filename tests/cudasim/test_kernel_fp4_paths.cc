// The FP4 kernels' lean path (csrc/cuda/fp4_quant.cu, kLean: contiguous 16-byte aligned rows, no
// Hadamard, round-to-nearest, no clip mask, aligned codes: the benchmark's call), compared bit for
// bit with core's fp4_quantize. test_kernel_fp4.cc covers the general path; its cases mostly carry
// a mask, a rotation or stochastic rounding, so this file gives the lean path the same scrutiny:
// NaN, +Inf and -Inf at every position of a block (the block's NaN test is a compare of its
// largest |x| bits, and NVFP4's tensor amax must still take the block's finite elements), zero
// blocks, subnormals, the largest finite values, exponents that clamp, tails, every rule, 1-D and
// 16x16 NVFP4 blocks and every input dtype; and that each of those conditions, broken one at a
// time, leaves the lean path.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/lowp/fp4.h"
#include "core/lowp/fp4_quant.h"
#include "core/util/dtype.h"
#include "cuda/fp4_quant.cuh"
#include "cudasim/launch.h"
#include "tests/cudasim/lowp_input.h"

namespace tierlift {
namespace {

using cudasim_test::kInf;
using cudasim_test::kInputDtypes;
using cudasim_test::kNaN;
using cudasim_test::Layout;
using cudasim_test::same_bits;
using cudasim_test::StridedInput;
using fp4::ScaleRule;

const ScaleRule kRules[] = {ScaleRule::kFloor, ScaleRule::kRceil, ScaleRule::kQuest,
                            ScaleRule::kNv};

struct PathCase {
  ScaleRule rule;
  bool block_2d;
  DType dtype;
  Layout layout = Layout::kContiguous;
  int hadamard = 0;
  bool stochastic = false;
  bool mask = false;
};

// Runs the kernel on `x` ([rows, cols]) and compares codes, scales and tensor scale (and the
// mask where asked) with core's fp4_quantize.
void check(const std::vector<float>& x, int64_t rows, int64_t cols, const PathCase& c) {
  SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) + " rule " +
               std::to_string(static_cast<int>(c.rule)) + (c.block_2d ? " 16x16 " : " ") +
               cudasim_test::dtype_name(c.dtype) + " " + cudasim_test::layout_name(c.layout) +
               (c.hadamard ? " hadamard" : "") + (c.stochastic ? " sr" : "") +
               (c.mask ? " mask" : ""));
  const StridedInput in(x, rows, cols, c.dtype, c.layout);
  const Fp8Input& view = in.view();
  Fp4Config cfg;
  cfg.rule = c.rule;
  cfg.hadamard = c.hadamard;
  cfg.signs = c.hadamard ? 0x5a5a5a5au : 0u;
  cfg.stochastic = c.stochastic;
  cfg.seed = 5;
  cfg.block_2d = c.block_2d;
  ASSERT_NO_THROW(fp4_validate(view, cfg));
  int64_t grows = 0, gcols = 0;
  fp4_scale_shape(cfg, rows, cols, &grows, &gcols);
  const size_t n = static_cast<size_t>(rows * cols), ns = static_cast<size_t>(grows * gcols);
  const bool nv = c.rule == ScaleRule::kNv;
  std::vector<uint8_t> want_codes(n / 2), want_scales(ns), want_mask(c.mask ? n : 0);
  std::vector<float> want_ts(1);
  fp4_quantize(
      view, cfg,
      {want_codes.data(), want_scales.data(), want_ts.data(), c.mask ? want_mask.data() : nullptr});

  std::vector<uint8_t> codes(n / 2, 0xaa), scales(ns, 0xaa), mask(c.mask ? n : 0, 0xaa);
  std::vector<float> ts(1, nv ? kNaN : 1.f);
  std::vector<float> workspace(nv ? cuda::nv_workspace_floats(rows, cols) : 0, kNaN);
  cuda::Fp4QuantArgs a;
  cudasim_test::set_input(a, view);
  a.rule = c.rule;
  a.hadamard = cfg.hadamard;
  a.signs = cfg.signs;
  a.stochastic = c.stochastic;
  a.seed = cfg.seed;
  a.block_2d = c.block_2d;
  a.codes = codes.data();
  a.scales = scales.data();
  a.tensor_scale = ts.data();
  a.mask = c.mask ? mask.data() : nullptr;
  a.workspace = nv ? workspace.data() : nullptr;
  const uint64_t launches = cudasim::launch_count();
  ASSERT_EQ(cuda::fp4_quantize(a, nullptr), cudaSuccess) << cudasim::last_error_message();
  EXPECT_EQ(cudasim::launch_count() - launches, nv ? 2u : 1u);
  EXPECT_TRUE(same_bits("scales", scales, want_scales, gcols));
  EXPECT_TRUE(same_bits("tensor_scale", ts, want_ts, 1));
  EXPECT_TRUE(same_bits("codes", codes, want_codes, cols / 2));
  EXPECT_TRUE(same_bits("mask", mask, want_mask, cols));
}

// Every rule with 1-D and (NVFP4) 16x16 blocks, for every input dtype.
std::vector<PathCase> lean_cases() {
  std::vector<PathCase> cases;
  for (ScaleRule rule : kRules) {
    for (bool b2 : {false, true}) {
      if (b2 && rule != ScaleRule::kNv) continue;
      for (DType t : kInputDtypes) cases.push_back({rule, b2, t});
    }
  }
  return cases;
}

// 3 x 32 rows x 64 columns: row r holds a NaN (r < 32), +Inf (r < 64) or -Inf at column r % 32
// of the first 32-column block and at column 63 - r % 32 of the second, among values up to ~20,
// with a large finite value beside the first (in the same 16-element block: the NVFP4 tensor
// amax must take it, the Inf not; the largest of them, in row 95, is the tensor amax); then
// finite rows: an all-zero row, a row of subnormals, large values, values whose MX exponent
// clamps, the largest values (QuEST's clip overflows: exponent 127), 1e30 beside 1e-30 (v
// subnormal), every multiple of 1/4 up to 7.75 (each E2M1 tie) scaled by 2^0, 2^20, 2^-20,
// 2^-133 (subnormal x) and 2^100, and normal rows.
TEST(Fp4KernelLean, NonFiniteAtEveryPositionOfABlock) {
  const int64_t cols = 64;
  for (DType t : kInputDtypes) {
    std::vector<float> x = cudasim_test::normal_values(110 * cols, 23);
    for (float& v : x) v *= 6.f;
    for (int64_t r = 0; r < 96; ++r) {
      const float bad = r < 32 ? kNaN : (r < 64 ? kInf : -kInf);
      x[r * cols + r % 32] = bad;
      x[r * cols + 63 - r % 32] = bad;
      x[r * cols + (r % 32 ^ 1)] = static_cast<float>(r % 2 ? 1000 + r : -1000 - r);
    }
    for (int64_t j = 0; j < cols; ++j) {
      x[96 * cols + j] = 0.f;
      x[97 * cols + j] = std::ldexp(1.f, -140) * static_cast<float>(j + 1);
      x[98 * cols + j] = j % 3 ? -900.f : 900.f;
      x[99 * cols + j] = 1e-38f * static_cast<float>(j % 5);
      x[100 * cols + j] = j % 2 ? -cudasim_test::huge_of(t) : cudasim_test::huge_of(t);
      x[101 * cols + j] = j % 2 ? 1e30f : -1e-30f;
      const float tie = 0.25f * static_cast<float>(j % 32) * (j < 32 ? 1.f : -1.f);
      int r = 102;
      for (int e : {0, 20, -20, -133, 100}) x[r++ * cols + j] = std::ldexp(tie, e);
    }
    for (const PathCase& c : lean_cases()) {
      if (c.dtype == t) check(x, 110, cols, c);
    }
  }
}

// Shapes with a partial warp or thread block, single rows, rows not a multiple of 16 (16x16
// blocks), and NVFP4-only widths (cols % 32 == 16).
TEST(Fp4KernelLean, ShapesWithTails) {
  struct Shape {
    int64_t rows, cols;
  };
  int k = 0;
  for (Shape sh : {Shape{1, 32}, Shape{3, 32}, Shape{31, 32}, Shape{9, 160}, Shape{33, 96},
                   Shape{37, 128}, Shape{1, 16}, Shape{17, 48}, Shape{35, 80}}) {
    std::vector<float> x = cudasim_test::normal_values(sh.rows * sh.cols, 31 + k);
    x[(sh.rows * sh.cols) / 2] = kInf;  // one bad block in the middle
    x[(sh.rows * sh.cols) / 3] = cudasim_test::huge_of(kInputDtypes[k % 3]);
    for (const PathCase& c : lean_cases()) {
      if (sh.cols % 32 && c.rule != ScaleRule::kNv) continue;
      check(x, sh.rows, sh.cols, c);
    }
    ++k;
  }
}

// Each condition of the lean path, broken alone (rows padded, an unaligned base, a rotation,
// stochastic rounding, a clip mask), takes the general path with the same results as core.
TEST(Fp4KernelLean, EachConditionBrokenAloneStillMatches) {
  std::vector<float> x = cudasim_test::normal_values(19 * 64, 41);
  x[5 * 64 + 7] = kNaN;
  for (ScaleRule rule : kRules) {
    for (const PathCase& c :
         {PathCase{rule, false, DType::kBFloat16, Layout::kPadded8},
          PathCase{rule, false, DType::kBFloat16, Layout::kOffset4},
          PathCase{rule, false, DType::kFloat32, Layout::kContiguous, 32},
          PathCase{rule, false, DType::kFloat16, Layout::kContiguous, 0, true},
          PathCase{rule, false, DType::kBFloat16, Layout::kContiguous, 0, false, true}}) {
      check(x, 19, 64, c);
    }
  }
}

// The MXFP4 lean encode's magnitude of x * 2^-ex without the multiply against the reference's
// magnitude of fl(x * 2^-ex): every finite bf16 value (every fp32 exponent, sign and top 7
// mantissa bits) at every exponent it is used for, and every float within 8 ulps of each E2M1
// grid point and midpoint in every binade, at the exponents that bring it near the grid.
TEST(Fp4KernelLean, ScaledMagnitudeMatchesTheMultiplied) {
  int64_t checked = 0, bad = 0;
  auto check = [&](float x, int ex) {
    const uint32_t want = fp4::e2m1_magnitude_rne(x * fp4::pow2(-ex));
    const uint32_t got = fp4::e2m1_magnitude_rne_scaled(x, fp4::mx_step_bound(ex));
    ++checked;
    if (got != want && ++bad <= 5) {
      ADD_FAILURE() << "x " << x << " ex " << ex << ": " << got << ", want " << want;
    }
  };
  for (uint32_t h = 0; h < 65536; ++h) {
    const float x = fp4::from_bits(h << 16);
    if (!std::isfinite(x)) continue;
    for (int ex = -126; ex <= 126; ++ex) check(x, ex);
  }
  const float grid[] = {0.25f, 0.5f, 0.75f, 1.f, 1.25f, 1.5f, 1.75f, 2.f,
                        2.5f,  3.f,  3.5f,  4.f, 5.f,   6.f,  7.f,   8.f};
  for (int ex = -126; ex <= 126; ++ex) {
    for (float g : grid) {
      const float x = std::ldexp(g, ex);
      if (x == 0.f || !std::isfinite(x)) continue;
      for (int d = -8; d <= 8; ++d) check(fp4::from_bits(fp4::bits(x) + d), ex);
    }
  }
  EXPECT_EQ(bad, 0);
  RecordProperty("checked", std::to_string(checked));
}

}  // namespace
}  // namespace tierlift
