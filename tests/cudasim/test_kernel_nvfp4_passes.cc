// NVFP4's two passes (csrc/cuda/fp4_quant.cu) around their hand-over: pass 1's last thread block
// to finish derives the tensor scale s_t and the multiplier s_t / sb of every E4M3 code once, into
// the workspace tail; pass 2 reads them and takes amax / 6 by two fmas (fp4::div6_rn), so it
// divides nowhere. Checked here: div6_rn against the division for every float it can meet, the
// tail's contents after a run (the count of finished blocks, the tensor amax, s_t and all 128
// multipliers), the launch count, and the outputs bit for bit with core's fp4_quantize on the
// shapes and values the hand-over depends on: one block and many, sizes that are not a multiple
// of the thread block, all-zero and all-NaN/Inf tensors (tensor amax 0: s_t = 1), tensors so small
// that s_t is capped and amax / 6 is below 2^-125 (div6_rn's division), 1-D and 16x16 blocks,
// every input dtype, on the lean path and off it; and under 4 OS threads, the race run's suite.
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

constexpr int64_t kElemsPerThreadBlock = 256 * 16;  // fp4_quant.cu: 256 threads x 16 elements

struct NvCase {
  bool block_2d;
  DType dtype;
  Layout layout = Layout::kContiguous;
  int hadamard = 0;
};

// Runs NVFP4 on `x` ([rows, cols]) and compares codes, scales and tensor scale with core; checks
// the two launches and the workspace tail pass 1 leaves for pass 2.
void check(const std::vector<float>& x, int64_t rows, int64_t cols, const NvCase& c) {
  SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) + (c.block_2d ? " 16x16 " : " ") +
               cudasim_test::dtype_name(c.dtype) + " " + cudasim_test::layout_name(c.layout) +
               (c.hadamard ? " hadamard" : ""));
  const StridedInput in(x, rows, cols, c.dtype, c.layout);
  const Fp8Input& view = in.view();
  Fp4Config cfg;
  cfg.rule = fp4::ScaleRule::kNv;
  cfg.hadamard = c.hadamard;
  cfg.signs = c.hadamard ? 0x96a5u : 0u;
  cfg.block_2d = c.block_2d;
  ASSERT_NO_THROW(fp4_validate(view, cfg));
  int64_t grows = 0, gcols = 0;
  fp4_scale_shape(cfg, rows, cols, &grows, &gcols);
  const size_t n = static_cast<size_t>(rows * cols), ns = static_cast<size_t>(grows * gcols);
  std::vector<uint8_t> want_codes(n / 2), want_scales(ns);
  std::vector<float> want_ts(1);
  fp4_quantize(view, cfg, {want_codes.data(), want_scales.data(), want_ts.data(), nullptr});

  std::vector<uint8_t> codes(n / 2, 0xaa), scales(ns, 0xaa);
  std::vector<float> ts(1, kNaN), workspace(cuda::nv_workspace_floats(rows, cols), kNaN);
  cuda::Fp4QuantArgs a;
  cudasim_test::set_input(a, view);
  a.rule = cfg.rule;
  a.hadamard = cfg.hadamard;
  a.signs = cfg.signs;
  a.block_2d = c.block_2d;
  a.codes = codes.data();
  a.scales = scales.data();
  a.tensor_scale = ts.data();
  a.workspace = workspace.data();
  const uint64_t launches = cudasim::launch_count();
  ASSERT_EQ(cuda::fp4_quantize(a, nullptr), cudaSuccess) << cudasim::last_error_message();
  EXPECT_EQ(cudasim::launch_count() - launches, 2u);  // pass 1 and pass 2 (and one memset)
  EXPECT_TRUE(same_bits("scales", scales, want_scales, gcols));
  EXPECT_TRUE(same_bits("tensor_scale", ts, want_ts, 1));
  EXPECT_TRUE(same_bits("codes", codes, want_codes, cols / 2));

  // The tail: every thread block counted once, the finite tensor amax, s_t, and each code's
  // multiplier as the reference computes it.
  const float* tail = workspace.data() + n / 16;
  const int64_t blocks =
      (static_cast<int64_t>(n) + kElemsPerThreadBlock - 1) / kElemsPerThreadBlock;
  EXPECT_EQ(fp4::bits(tail[cuda::kNvTailDone]), static_cast<uint32_t>(blocks));
  float amax = 0.f;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) amax = std::fmax(amax, fp4::finite_abs(x[i * cols + j]));
  }
  const float st = fp4::nv_tensor_scale(fp4::from_bits(fp4::bits(tail[cuda::kNvTailAmax])));
  EXPECT_EQ(fp4::bits(tail[cuda::kNvTailScale]), fp4::bits(want_ts[0]));
  EXPECT_EQ(fp4::bits(st), fp4::bits(want_ts[0]));
  if (c.hadamard == 0 && c.dtype == DType::kFloat32) {
    EXPECT_EQ(fp4::bits(tail[cuda::kNvTailAmax]), fp4::bits(amax));
  }
  int wrong = 0;
  for (int code = 0; code < 128; ++code) {
    const float want = fp4::nv_multiplier(static_cast<uint8_t>(code), want_ts[0]);
    const float got = tail[cuda::kNvTailMultipliers + code];
    if (fp4::bits(got) != fp4::bits(want) && ++wrong <= 3) {
      ADD_FAILURE() << "multiplier of code " << code << ": " << got << ", want " << want;
    }
  }
}

// The lean path with 1-D and 16x16 blocks for every dtype, and off it: padded rows (strided
// loads), an unaligned base, a Hadamard rotation (pass 1's amaxes are of the rotated values).
std::vector<NvCase> cases() {
  std::vector<NvCase> out;
  for (bool b2 : {false, true}) {
    for (DType t : kInputDtypes) out.push_back({b2, t});
    out.push_back({b2, DType::kBFloat16, Layout::kPadded8});
    out.push_back({b2, DType::kFloat16, Layout::kOffset4});
    out.push_back({b2, DType::kFloat32, Layout::kContiguous, 16});
  }
  return out;
}

// fp4::div6_rn (two fmas, a division below 2^-125) equals fp32 x / 6 for every finite x >= 0
// the kernel can meet: every float below 2^-122 (subnormal quotients, the fallback's edge, and
// subnormal remainders), and every significand at exponents 0, 60 and 127 of the largest (above
// 2^-122 the fma steps only scale with the exponent). The same check over all 2^31 non-negative
// finite floats was run once, with no difference.
TEST(Nvfp4Passes, DivideBySixMatchesTheDivision) {
  int64_t checked = 0, bad = 0;
  auto check_bits = [&](uint32_t u) {
    const float x = fp4::from_bits(u);
    const float want = x / 6.f;
    const float got = fp4::div6_rn(x);
    ++checked;
    if (fp4::bits(got) != fp4::bits(want) && ++bad <= 5) {
      ADD_FAILURE() << "x " << x << " (bits " << u << "): " << got << ", want " << want;
    }
  };
  for (uint32_t u = 0; u < (5u << 23); ++u) check_bits(u);  // x < 2^-122
  for (uint32_t e : {127u, 187u, 254u}) {
    for (uint32_t m = 0; m < (1u << 23); ++m) check_bits((e << 23) | m);
  }
  EXPECT_EQ(bad, 0);
  RecordProperty("checked", std::to_string(checked));
}

// One thread block, a partial one, several, and many (32: more than the simulator's OS threads,
// so blocks finish in varying order): sizes that are and are not multiples of the thread block.
TEST(Nvfp4Passes, OneAndManyThreadBlocks) {
  struct Shape {
    int64_t rows, cols;
  };
  int k = 0;
  for (Shape sh : {Shape{1, 16}, Shape{16, 16}, Shape{16, 256}, Shape{17, 256}, Shape{33, 272},
                   Shape{160, 304}, Shape{256, 512}}) {
    std::vector<float> x = cudasim_test::normal_values(sh.rows * sh.cols, 71 + k);
    x[(sh.rows * sh.cols) * 2 / 3] = -7.5f;  // the tensor amax, in a late block
    for (const NvCase& c : cases()) check(x, sh.rows, sh.cols, c);
    ++k;
  }
}

// All zero (tensor amax 0: s_t = 1, every scale and code 0), all NaN/Inf (the tensor amax over
// finite elements is 0 as well; every block the NaN scale), and a tensor of tiny values whose
// s_t is capped (FLT_MAX * 2^-9) and whose block amaxes fall below 2^-125, where div6_rn
// divides: fp32 only (bf16 keeps them; fp16 flushes them to 0, also checked).
TEST(Nvfp4Passes, ZeroNonFiniteAndTinyTensors) {
  const int64_t rows = 48, cols = 96;
  std::vector<float> zero(rows * cols, 0.f), bad(rows * cols), tiny(rows * cols);
  std::vector<float> g = cudasim_test::normal_values(rows * cols, 5);
  for (int64_t i = 0; i < rows * cols; ++i) {
    bad[i] = i % 3 == 0 ? kNaN : (i % 3 == 1 ? kInf : -kInf);
    tiny[i] = g[i] * std::ldexp(1.f, -128 - static_cast<int>(i % 7));
  }
  tiny[17] = std::ldexp(1.f, -123);  // one block with amax / 6 just above 2^-125
  for (const NvCase& c : cases()) {
    check(zero, rows, cols, c);
    check(bad, rows, cols, c);
    check(tiny, rows, cols, c);
  }
}

// The race run's suite (scripts/tsan_races.sh selects KernelRaces*): 9 and 33 thread blocks on 4
// OS threads raise the tensor amax and the count of finished blocks together; the last reads the
// amax after every count and writes the tail that pass 2 reads.
class KernelRacesNvfp4 : public ::testing::Test {
 protected:
  void SetUp() override { cudasim::set_threads(4); }
  void TearDown() override { cudasim::set_threads(0); }
};

TEST_F(KernelRacesNvfp4, LastBlockHandsTheTensorScaleToPass2) {
  RecordProperty("kernels", "nv_amax_kernel nv_encode_kernel");
  for (int64_t rows : {72, 264}) {
    std::vector<float> x(rows * 512);
    for (size_t i = 0; i < x.size(); ++i) x[i] = 0.001f * static_cast<float>(i % 4099);
    check(x, rows, 512, {false, DType::kFloat32});
    check(x, rows, 512, {true, DType::kBFloat16});
  }
}

}  // namespace
}  // namespace tierlift
