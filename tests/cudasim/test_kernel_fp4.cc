// tierlift::cuda::fp4_quantize (csrc/cuda/fp4_quant.cu) run in the CPU simulator, compared bit
// for bit with core's fp4_quantize (csrc/core/lowp/fp4_quant.h): codes, scales, tensor scale and
// clip mask.
//
// Covered: every scale rule (floor, rceil and quest: the one-kernel MXFP4 path; nv: the two-pass
// NVFP4 path with its workspace and tensor scale), Hadamard 0/16/32 with several sign masks, RNE
// and stochastic rounding over several Philox seeds and offsets (including counters past 2^32),
// 1-D and 16x16 NVFP4 blocks, the clip mask on and off, fp32/bf16/fp16 inputs, strided inputs
// (transposed, padded, misaligned, every other column), tails (rows * cols not a multiple of the
// 256-thread block, rows not a multiple of 16 for 16x16 blocks), empty inputs, and zeros, huge
// values (whose rotation overflows), +-Inf, NaN (their blocks get the NaN scale: in either half
// of a warp, in any row of a 16x16 block), blocks of fp32 subnormals and values whose scale
// exponent clamps. Mirrors the gpu tests of tests/python/test_lowp_fp4.py, scaled down for
// the simulator. Inputs live in buffers of exactly the bytes they span (lowp_input.h), outputs
// and the NVFP4 workspace in vectors of exactly their size, so AddressSanitizer catches any
// access outside them.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
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
using cudasim_test::normal_values;
using cudasim_test::same_bits;
using cudasim_test::StridedInput;
using fp4::ScaleRule;

const ScaleRule kRules[] = {ScaleRule::kFloor, ScaleRule::kRceil, ScaleRule::kQuest,
                            ScaleRule::kNv};

const char* rule_name(ScaleRule r) {
  switch (r) {
    case ScaleRule::kFloor:
      return "floor";
    case ScaleRule::kRceil:
      return "rceil";
    case ScaleRule::kQuest:
      return "quest";
    case ScaleRule::kNv:
      return "nv";
  }
  return "?";
}

// test_lowp_fp4.py's _input(): N(0, 9) values with 100, NaN, +Inf, a zero block and a block of
// fp32 subnormals; and where the shape allows: -Inf, two of the input type's largest value side
// by side (their Hadamard sum overflows to Inf), a block of NaN, a block of ~1e36 (Inf in fp16)
// and a block of ~1e-38 (its MX exponent clamps at -127); large values in the last row of
// 16-row groups.
std::vector<float> fp4_input(int64_t rows, int64_t cols, DType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 3.f);
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (float& v : x) v = normal(rng);
  auto set = [&](int64_t i, int64_t j0, int64_t j1, auto value) {
    if (i >= rows) return;
    for (int64_t j = j0; j < j1 && j < cols; ++j) x[i * cols + j] = value();
  };
  set(0, 3, 4, [] { return 100.f; });
  set(1, 9, 10, [] { return -kInf; });
  set(2, 5, 6, [] { return kNaN; });
  set(3, 7, 8, [] { return kInf; });
  set(4, 0, 32, [] { return 0.f; });
  set(5, 64, 96, [] { return 1e-40f; });
  set(6, 32, 48, [&] { return 1e36f * normal(rng); });
  const float huge = cudasim_test::huge_of(dtype);
  set(7, 0, 2, [&] { return huge; });
  set(7, 18, 19, [&] { return -huge; });
  set(8, 16, 32, [] { return kNaN; });
  set(9, 0, 16, [&] { return 1e-38f * normal(rng); });
  // Block maxima in the last row of a 16-row group and in the last row of the matrix (a partial
  // group), which a 16x16 block scale must not miss.
  set(15, 20, 21, [] { return 40.f; });
  set(31, 40, 41, [] { return -60.f; });
  if (rows > 16) set(rows - 1, 50, 51, [] { return 30.f; });
  // NaN/Inf deeper in: a later 16-row group, and the second half of a warp in the last row.
  set(30, 100, 101, [] { return kNaN; });
  if (rows > 16) set(rows - 1, 120, 121, [] { return kInf; });
  return x;
}

struct Fp4Case {
  int64_t rows, cols;
  ScaleRule rule;
  int hadamard;
  uint32_t signs;
  bool stochastic;
  uint64_t seed, offset;
  bool block_2d;
  bool mask;
  DType dtype;
  Layout layout;
  bool odd_outputs = false;  // codes and mask one byte past an aligned address: byte stores

  std::string describe() const {
    char buf[64];
    std::snprintf(buf, sizeof(buf), " h=%d signs=0x%x", hadamard, signs);
    return std::to_string(rows) + "x" + std::to_string(cols) + " " + rule_name(rule) + buf +
           (stochastic ? " sr seed=" + std::to_string(seed) + " offset=" + std::to_string(offset)
                       : std::string(" rne")) +
           (block_2d ? " 16x16" : "") + (mask ? " mask" : "") + " " +
           cudasim_test::dtype_name(dtype) + " " + cudasim_test::layout_name(layout) +
           (odd_outputs ? " odd outputs" : "");
  }
};

// Launches the kernel on c's input and compares everything it writes with core. Kernel outputs
// start as garbage (0xaa bytes, a NaN tensor scale for NVFP4) so a missed store shows; the
// tensor scale of MXFP4 and of an empty input starts as the torch binding sets it (1, or s_t of
// amax 0), since the kernel leaves it then. `values` replaces fp4_input's data; the kernel's
// scales are stored in `*kernel_scales` when given.
void check(const Fp4Case& c, const std::vector<float>* values = nullptr,
           std::vector<uint8_t>* kernel_scales = nullptr) {
  SCOPED_TRACE(c.describe());
  const std::vector<float> generated =
      values ? std::vector<float>()
             : fp4_input(c.rows, c.cols, c.dtype, static_cast<uint32_t>(7 + c.rows * c.cols));
  const StridedInput in(values ? *values : generated, c.rows, c.cols, c.dtype, c.layout);
  const Fp8Input& x = in.view();
  Fp4Config cfg;
  cfg.rule = c.rule;
  cfg.hadamard = c.hadamard;
  cfg.signs = c.signs;
  cfg.stochastic = c.stochastic;
  cfg.seed = c.seed;
  cfg.offset = c.offset;
  cfg.block_2d = c.block_2d;
  ASSERT_NO_THROW(fp4_validate(x, cfg));
  int64_t grows = 0, gcols = 0;
  fp4_scale_shape(cfg, c.rows, c.cols, &grows, &gcols);
  const size_t n = static_cast<size_t>(c.rows * c.cols);
  const size_t ns = static_cast<size_t>(grows * gcols);
  const bool nv = c.rule == ScaleRule::kNv;

  std::vector<uint8_t> want_codes(n / 2), want_scales(ns), want_mask(c.mask ? n : 0);
  std::vector<float> want_ts(1);
  Fp4Output out;  // empty vectors give null pointers, as empty tensors do
  out.codes = want_codes.data();
  out.scales = want_scales.data();
  out.tensor_scale = want_ts.data();
  out.mask = c.mask ? want_mask.data() : nullptr;
  fp4_quantize(x, cfg, out);

  // With odd_outputs the kernel writes one byte into these buffers (never that first byte).
  const size_t skip = c.odd_outputs ? 1 : 0;
  std::vector<uint8_t> codes_buf(n / 2 + skip, 0xaa), mask_buf(c.mask ? n + skip : 0, 0xaa);
  std::vector<uint8_t> scales(ns, 0xaa);
  const float ts0 = nv ? fp4::nv_tensor_scale(0.f) : 1.f;
  std::vector<float> ts(1, nv && n > 0 ? kNaN : ts0);
  std::vector<float> workspace(nv ? cuda::nv_workspace_floats(c.rows, c.cols) : 0, kNaN);
  cuda::Fp4QuantArgs a;
  cudasim_test::set_input(a, x);
  a.rule = c.rule;
  a.hadamard = c.hadamard;
  a.signs = c.signs;
  a.stochastic = c.stochastic;
  a.seed = c.seed;
  a.offset = c.offset;
  a.block_2d = c.block_2d;
  a.codes = codes_buf.data() + skip;
  a.scales = scales.data();
  a.tensor_scale = ts.data();
  a.mask = c.mask ? mask_buf.data() + skip : nullptr;
  a.workspace = nv ? workspace.data() : nullptr;
  const uint64_t launches = cudasim::launch_count();
  ASSERT_EQ(cuda::fp4_quantize(a, nullptr), cudaSuccess) << cudasim::last_error_message();
  EXPECT_EQ(cudasim::launch_count() - launches, n == 0 ? 0u : (nv ? 2u : 1u))
      << "MXFP4 is one kernel, NVFP4 two";
  if (skip) {
    EXPECT_EQ(codes_buf[0], 0xaa);
    if (c.mask) {
      EXPECT_EQ(mask_buf[0], 0xaa);
    }
  }
  const std::vector<uint8_t> codes(codes_buf.begin() + skip, codes_buf.end());
  const std::vector<uint8_t> mask(c.mask ? mask_buf.begin() + skip : mask_buf.end(),
                                  mask_buf.end());
  EXPECT_TRUE(same_bits("scales", scales, want_scales, gcols));
  EXPECT_TRUE(same_bits("tensor_scale", ts, want_ts, 1));
  EXPECT_TRUE(same_bits("codes", codes, want_codes, c.cols / 2));
  EXPECT_TRUE(same_bits("mask", mask, want_mask, c.cols));
  if (kernel_scales) *kernel_scales = scales;
}

struct Rotation {
  int hadamard;
  uint32_t signs;
};
const Rotation kRotations[] = {{0, 0}, {16, 0x8421}, {32, 0xdeadbeef}};

// test_cuda_matches_cpu_bitwise's CASES (rule x rotation x RNE/SR x 1-D/16x16 for nv) for every
// input dtype on test_lowp_fp4.py's 37x128 input (4736 elements: 18.5 thread blocks; 37 rows: a
// partial row of 16x16 blocks).
TEST(Fp4Kernel, EveryRuleRotationRoundingAndBlock) {
  int cases = 0;
  for (ScaleRule rule : kRules) {
    for (const Rotation& rot : kRotations) {
      for (bool sr : {false, true}) {
        for (bool b2 : {false, true}) {
          if (b2 && rule != ScaleRule::kNv) continue;
          for (DType t : kInputDtypes) {
            check({37, 128, rule, rot.hadamard, rot.signs, sr, 42, 3, b2, true, t,
                   Layout::kContiguous});
            ++cases;
          }
        }
      }
    }
  }
  RecordProperty("configurations", cases);
}

// More sign masks: none, all, the first or last element of a block, a pattern.
TEST(Fp4Kernel, HadamardSignMasks) {
  const Rotation masks[] = {{16, 0},          {16, 0xffff},     {16, 1},
                            {16, 0x8000},     {32, 0},          {32, 0xffffffff},
                            {32, 0x80000000}, {32, 0x12345678}, {32, 0x5555}};
  int cases = 0;
  int k = 0;
  for (ScaleRule rule : kRules) {
    for (const Rotation& m : masks) {
      const bool b2 = rule == ScaleRule::kNv && k % 2;
      check({10, 64, rule, m.hadamard, m.signs, k % 3 == 0, 5, 0, b2, true, kInputDtypes[k % 3],
             Layout::kContiguous});
      ++k;
      ++cases;
    }
  }
  RecordProperty("configurations", cases);
}

// Stochastic rounding draws the same Philox stream as core: seeds with high bits set, offsets
// that are not a multiple of 4 (the element's word moves) and counters whose high word is used
// (offset past 2^34) or wraps around 2^64.
TEST(Fp4Kernel, StochasticSeedsAndOffsets) {
  const uint64_t seeds[] = {0, 1, 0xffffffffull, 0x123456789abcdef0ull, ~0ull};
  const uint64_t offsets[] = {0, 1, 2, 7, (uint64_t{1} << 34) - 5, ~uint64_t{0} - 100};
  int cases = 0;
  int k = 0;
  for (uint64_t seed : seeds) {
    for (uint64_t offset : offsets) {
      const ScaleRule rule = kRules[k % 4];
      const Rotation& rot = kRotations[k % 3];
      check({8, 64, rule, rot.hadamard, rot.signs, true, seed, offset,
             rule == ScaleRule::kNv && k % 8 == 3, true, DType::kFloat32, Layout::kContiguous});
      ++k;
      ++cases;
    }
  }
  RecordProperty("configurations", cases);
}

// Shapes whose element count leaves a partial thread block or warp, single rows and blocks,
// rows not a multiple of 16 (16x16 blocks), with and without the clip mask.
TEST(Fp4Kernel, ShapesWithTailsAndMaskOff) {
  struct Shape {
    int64_t rows, cols;
  };
  int cases = 0;
  int k = 0;
  for (Shape sh : {Shape{1, 32}, Shape{3, 32}, Shape{31, 32}, Shape{9, 160}, Shape{33, 96}}) {
    for (ScaleRule rule : kRules) {
      for (bool mask : {true, false}) {
        const Rotation& rot = kRotations[k % 3];
        check({sh.rows, sh.cols, rule, rot.hadamard, rot.signs, k % 2 == 1, 11, 5,
               rule == ScaleRule::kNv && k % 4 < 2, mask, kInputDtypes[k % 3],
               Layout::kContiguous});
        ++k;
        ++cases;
      }
    }
  }
  // NVFP4 only (cols a multiple of 16, not 32).
  for (Shape sh : {Shape{1, 16}, Shape{3, 16}, Shape{16, 16}, Shape{17, 48}, Shape{35, 80}}) {
    for (int hadamard : {0, 16}) {
      for (bool b2 : {false, true}) {
        for (bool mask : {true, false}) {
          check({sh.rows, sh.cols, ScaleRule::kNv, hadamard, hadamard ? 0xa5c3u : 0u, k % 2 == 1,
                 11, 5, b2, mask, kInputDtypes[k % 3], Layout::kContiguous});
          ++k;
          ++cases;
        }
      }
    }
  }
  RecordProperty("configurations", cases);
}

// Any strides: a transposed view, padded and misaligned rows, every other column (strided loads);
// rows padded by 8 (vector loads), a base 4 elements past an aligned address (vector loads of
// fp32, strided ones of bf16).
TEST(Fp4Kernel, StridedInputs) {
  int cases = 0;
  int k = 0;
  for (Layout l : {Layout::kTransposed, Layout::kPadded2, Layout::kOffset1, Layout::kEveryOther,
                   Layout::kPadded8, Layout::kOffset4}) {
    for (ScaleRule rule : kRules) {
      for (DType t : {DType::kFloat32, DType::kBFloat16}) {
        const Rotation& rot = kRotations[k % 3];
        check({13, 96, rule, rot.hadamard, rot.signs, k % 2 == 0, 9, 1,
               rule == ScaleRule::kNv && k % 4 < 2, true, t, l});
        ++k;
        ++cases;
      }
    }
  }
  RecordProperty("configurations", cases);
}

// No elements: no launch, no codes; core's scales (none) and tensor scale are what the binding
// pre-fills.
TEST(Fp4Kernel, EmptyInputs) {
  struct Shape {
    int64_t rows, cols;
  };
  int cases = 0;
  for (Shape sh : {Shape{0, 64}, Shape{8, 0}, Shape{0, 0}}) {
    for (ScaleRule rule : kRules) {
      for (bool b2 : {false, true}) {
        if (b2 && rule != ScaleRule::kNv) continue;
        check({sh.rows, sh.cols, rule, 0, 0, false, 0, 0, b2, true, DType::kFloat32,
               Layout::kContiguous});
        ++cases;
      }
    }
  }
  RecordProperty("configurations", cases);
}

// A block holding a NaN or Inf gets the NaN scale (E8M0 0xFF, E4M3 0x7F) on the device exactly
// where core puts it: in either half of a warp (NVFP4's 16-lane groups), in any row of a 16x16
// block (pass 2 max-reduces pass 1's +inf marks), spread by a rotation over its Hadamard block.
TEST(Fp4Kernel, NonFiniteBlocksGetTheNanScale) {
  const int64_t rows = 35, cols = 64;
  std::vector<float> x = normal_values(rows * cols, 3);
  const int64_t bad[][2] = {{0, 3}, {5, 20}, {31, 40}, {34, 63}};  // (row, col)
  x[0 * cols + 3] = kNaN, x[5 * cols + 20] = kInf, x[31 * cols + 40] = -kInf;
  x[34 * cols + 63] = kNaN;
  int cases = 0;
  for (ScaleRule rule : kRules) {
    for (int had : {0, 32}) {
      for (bool b2 : {false, true}) {
        if (b2 && rule != ScaleRule::kNv) continue;
        std::vector<uint8_t> scales;
        check({rows, cols, rule, had, had ? 0x1234u : 0u, false, 0, 0, b2, true, DType::kFloat32,
               Layout::kContiguous},
              &x, &scales);
        const bool nv = rule == ScaleRule::kNv;
        const int64_t b = nv ? 16 : 32, span = had > b ? had : b, gcols = cols / b;
        std::vector<uint8_t> want(scales.size(), 0);
        for (const auto& e : bad) {
          const int64_t g = b2 ? e[0] / 16 : e[0];
          for (int64_t j = e[1] / span * span; j < (e[1] / span + 1) * span; j += b) {
            want[g * gcols + j / b] = 1;
          }
        }
        std::vector<uint8_t> got(scales.size());
        for (size_t k = 0; k < scales.size(); ++k) {
          got[k] = scales[k] == (nv ? fp4::kE4M3Nan : fp4::kE8M0Nan);
        }
        EXPECT_TRUE(same_bits("NaN scales", got, want, gcols));
        ++cases;
      }
    }
  }
  RecordProperty("configurations", cases);
}

// Tensors of 1e-20 and 1e-30 in every rule keep their scales (no minimum amax; QuEST's rms on
// the block pre-scaled by a power of two), as does one of 1e20 (whose squares overflow fp32),
// with the scale edges in extra rows: an RCEIL/QuEST block whose clip / 6 is an fp32 subnormal
// just above 2^-127 (the exact ceil), and a block 1e-6 below the rest (NVFP4: the smallest E4M3
// scale, not 0).
TEST(Fp4Kernel, TinyTensorsAndScaleEdges) {
  const int64_t rows = 20, cols = 64;
  int cases = 0;
  int k = 0;
  for (float mag : {1e-20f, 1e-30f, 1e20f}) {
    std::vector<float> x = normal_values(rows * cols, 17);
    for (float& v : x) v *= mag;
    for (int64_t j = 0; j < 32; ++j) {
      const float t = std::ldexp(1.f, -126);
      x[1 * cols + j] = (3.f * t + std::ldexp(1.f, -148)) * (31 - j) / 31;
      x[2 * cols + j] = x[3 * cols + j] * 1e-6f;
    }
    for (ScaleRule rule : kRules) {
      for (int had : {0, 32}) {
        std::vector<uint8_t> scales;
        check({rows, cols, rule, had, had ? 0x9u : 0u, k % 2 == 1, 3, 0,
               rule == ScaleRule::kNv && k % 4 < 2, true,
               k % 3 ? DType::kFloat32 : DType::kBFloat16, Layout::kContiguous},
              &x, &scales);
        // A scale code 0 means 2^-127 (MX) or a zeroed block (NVFP4): rare here.
        int64_t nonzero = 0;
        for (uint8_t c : scales) nonzero += c != 0;
        EXPECT_GT(nonzero, static_cast<int64_t>(scales.size()) * 9 / 10);
        ++k;
        ++cases;
      }
    }
  }
  RecordProperty("configurations", cases);
}

// The gpu test's own shape (67x256, 67 thread blocks) for a few heavy configurations.
TEST(Fp4Kernel, GpuTestShape) {
  check({67, 256, ScaleRule::kNv, 32, 0xdeadbeef, true, 42, 3, true, true, DType::kFloat32,
         Layout::kContiguous});
  check({67, 256, ScaleRule::kQuest, 32, 0xdeadbeef, true, 42, 3, false, true, DType::kBFloat16,
         Layout::kContiguous});
  check({67, 256, ScaleRule::kFloor, 16, 0x8421, false, 42, 3, false, true, DType::kFloat32,
         Layout::kContiguous});
  RecordProperty("configurations", 3);
}

// The kernels' row of a thread, t / (threads per row) by multiply and shift, against the
// division: every divisor up to 2^12 and each power of two +-1 up to 2^31 - 1, at the multiples
// of d +-1 nearest 0 and 2^31 - 1, where the excess over t / d is largest.
TEST(Fp4Kernel, RowDividerMatchesDivision) {
  std::vector<int64_t> divisors;
  for (int64_t d = 1; d <= 4096; ++d) divisors.push_back(d);
  for (int l = 12; l <= 31; ++l) {
    for (int64_t d : {(int64_t{1} << l) - 1, int64_t{1} << l, (int64_t{1} << l) + 1}) {
      if (d < (int64_t{1} << 31)) divisors.push_back(d);
    }
  }
  std::mt19937 rng(7);
  for (int r = 0; r < 2000; ++r) divisors.push_back(1 + (rng() & 0x7fffffffu) % 0x7fffffff);
  const int64_t kTop = (int64_t{1} << 31) - 1;
  int64_t bad = 0;
  for (int64_t d : divisors) {
    const cuda::Div31 div = cuda::Div31::make(d);
    ASSERT_NE(div.magic, 0u) << d;
    std::vector<int64_t> ts = {0, 1, kTop, kTop - 1};
    for (int64_t q : {int64_t{1}, int64_t{2}, int64_t{3}, kTop / d - 1, kTop / d}) {
      for (int64_t e : {-1, 0, 1}) ts.push_back(q * d + e);
    }
    for (int64_t t : ts) {
      if (t < 0 || t > kTop) continue;
      if (div.div(static_cast<uint32_t>(t)) != static_cast<uint32_t>(t / d) && ++bad <= 5) {
        ADD_FAILURE() << "t " << t << " / d " << d << ": " << div.div(static_cast<uint32_t>(t));
      }
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(cuda::Div31::make(int64_t{1} << 31).magic, 0u);  // the kernels divide instead
  EXPECT_EQ(cuda::Div31::make(0).magic, 0u);
}

// Codes and clip mask at addresses too misaligned for the packed 8- and 16-byte stores: byte
// stores, on both paths and with both loads.
TEST(Fp4Kernel, MisalignedOutputsTakeByteStores) {
  int k = 0;
  for (ScaleRule rule : kRules) {
    for (Layout l : {Layout::kContiguous, Layout::kTransposed}) {
      const Rotation& rot = kRotations[k % 3];
      Fp4Case c{19,
                64,
                rule,
                rot.hadamard,
                rot.signs,
                k % 2 == 1,
                3,
                2,
                rule == ScaleRule::kNv && k % 4 < 2,
                true,
                kInputDtypes[k % 3],
                l};
      c.odd_outputs = true;
      check(c);
      ++k;
    }
  }
}

}  // namespace
}  // namespace tierlift
