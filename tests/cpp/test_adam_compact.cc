// Compact-state Adam (core/optim/adam_compact.h): the v code's error bound and edge cases, SIMD
// paths against the scalar path bit for bit, the scalar path against adam_step's fp32 arithmetic
// on the decoded state, threading and 1024-aligned slices against one whole-tensor call.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "core/optim/adam_compact.h"

namespace tierlift {
namespace {

TEST(CompactCode, ZeroIsExactAndOnlyZeroEncodesToZero) {
  EXPECT_EQ(encode_v(0.0f, 1.0f), 0);
  EXPECT_EQ(encode_v(0.0f, 0.0f), 0);
  EXPECT_EQ(decode_v(0, 123.0f), 0.0f);
  EXPECT_EQ(decode_v(0, 0.0f), 0.0f);
  // Far below the code's range (and below fp32's subnormals relative to the max): code 1.
  EXPECT_EQ(encode_v(1e-30f, 1.0f), 1);
  EXPECT_EQ(encode_v(std::numeric_limits<float>::denorm_min(), 1e30f), 1);
  EXPECT_GT(decode_v(1, 1.0f), 0.0f);
  EXPECT_EQ(encode_v(1.0f, 1.0f), 255);
  EXPECT_EQ(decode_v(255, 3.5f), 3.5f);
}

TEST(CompactCode, EveryCodeRoundTripsAndCodesAreMonotonic) {
  for (float scale : {1.0f, 3.0e-7f, 17.25f, 6.0e30f}) {
    float prev = 0.0f;
    for (int c = 1; c < 256; ++c) {
      const float v = decode_v(static_cast<uint8_t>(c), scale);
      ASSERT_GT(v, prev) << c;
      ASSERT_EQ(encode_v(v, scale), c) << c << " scale " << scale;
      prev = v;
    }
  }
}

// The bound documented in adam_compact.h: relative error <= 2^-4 (+ two fp32 roundings) for
// v >= 2^-31 of the block max; below that, never zero and never below v.
TEST(CompactCode, RelativeErrorIsBoundedOverThirtyOneBinades) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> expo(-31.0, 0.0), unit(0.5, 2.0);
  double worst = 0.0;
  for (int k = 0; k < 200000; ++k) {
    const float scale = static_cast<float>(unit(rng) * std::pow(10.0, (k % 13) - 6));
    const float v = static_cast<float>(scale * std::exp2(expo(rng)));
    if (v > scale || v < std::ldexp(scale, -31)) continue;
    const float back = decode_v(encode_v(v, scale), scale);
    worst = std::max(worst, std::fabs(static_cast<double>(back) - v) / v);
  }
  EXPECT_LE(worst, 0.0625 + 1e-6);
  EXPECT_GT(worst, 0.05);  // the bound is tight: the 3-bit mantissa's half step
  const float tiny = std::ldexp(1.0f, -40);
  EXPECT_GE(decode_v(encode_v(tiny, 1.0f), 1.0f), tiny);
}

TEST(CompactCode, QuantizeMarksNonFiniteBlocksNan) {
  std::vector<float> v(300, 1.0f);
  v[5] = std::numeric_limits<float>::infinity();
  std::vector<uint8_t> codes(300);
  std::vector<float> scales(2);
  quantize_exp_avg_sq(v.data(), 300, codes.data(), scales.data());
  EXPECT_TRUE(std::isnan(scales[0]));
  EXPECT_EQ(scales[1], 1.0f);
  EXPECT_EQ(codes[0], 255);
  std::vector<float> back(300);
  dequantize_exp_avg_sq(codes.data(), scales.data(), 300, back.data());
  EXPECT_TRUE(std::isnan(back[0]));
  EXPECT_EQ(back[299], 1.0f);
}

// Parameter, gradient and state data: magnitudes over many binades inside each block, exact
// zeros, and some all-zero blocks (grad and state), as a layer with dead units has.
struct State {
  int64_t n;
  std::vector<float> param, grad32;
  std::vector<uint16_t> grad16, m, copy16;
  std::vector<uint8_t> codes;
  std::vector<float> scales, copy32;

  State(int64_t numel, uint32_t seed)
      : n(numel),
        param(numel),
        grad32(numel),
        grad16(numel),
        m(numel),
        copy16(numel),
        codes(numel),
        scales(compact_scale_count(numel)),
        copy32(numel) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_real_distribution<float> expo(-12.f, 2.f);
    std::vector<float> v(numel);
    for (int64_t i = 0; i < numel; ++i) {
      const bool dead = (i / kCompactBlock) % 5 == 3;
      param[i] = normal(rng);
      grad32[i] = dead || i % 37 == 0 ? 0.f : normal(rng) * std::exp2(expo(rng));
      grad16[i] = f32_to_bf16(grad32[i]);
      m[i] = dead ? 0 : f32_to_bf16(normal(rng) * 1e-3f);
      v[i] = dead || i % 41 == 0 ? 0.f : std::exp2(2 * expo(rng));
    }
    quantize_exp_avg_sq(v.data(), numel, codes.data(), scales.data());
  }
  void regrad(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_real_distribution<float> expo(-12.f, 2.f);
    for (int64_t i = 0; i < n; ++i) {
      if (grad32[i] == 0.f) continue;
      grad32[i] = normal(rng) * std::exp2(expo(rng));
      grad16[i] = f32_to_bf16(grad32[i]);
    }
  }
  CompactAdamTensor view(DType gt, DType ct, int64_t begin = 0, int64_t end = -1) {
    if (end < 0) end = n;
    CompactAdamTensor t;
    t.param = param.data() + begin;
    t.grad = gt == DType::kFloat32 ? static_cast<const void*>(grad32.data() + begin)
                                   : grad16.data() + begin;
    t.grad_type = gt;
    t.exp_avg = m.data() + begin;
    t.exp_avg_sq = codes.data() + begin;
    t.exp_avg_sq_scale = scales.data() + begin / kCompactBlock;
    t.copy_type = ct;
    if (ct == DType::kFloat32) t.param_copy = copy32.data() + begin;
    if (ct == DType::kBFloat16 || ct == DType::kFloat16) t.param_copy = copy16.data() + begin;
    t.numel = end - begin;
    return t;
  }
};

void expect_same(const State& a, const State& b, const char* what) {
  const int64_t n = a.n;
  ASSERT_EQ(0, std::memcmp(a.param.data(), b.param.data(), n * 4)) << what;
  ASSERT_EQ(0, std::memcmp(a.m.data(), b.m.data(), n * 2)) << what;
  ASSERT_EQ(0, std::memcmp(a.codes.data(), b.codes.data(), n)) << what;
  ASSERT_EQ(0, std::memcmp(a.scales.data(), b.scales.data(), a.scales.size() * 4)) << what;
  ASSERT_EQ(0, std::memcmp(a.copy16.data(), b.copy16.data(), n * 2)) << what;
  ASSERT_EQ(0, std::memcmp(a.copy32.data(), b.copy32.data(), n * 4)) << what;
}

AdamHyper hyper(bool decoupled, bool maximize, int64_t step) {
  AdamHyper h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  h.decoupled = decoupled;
  h.maximize = maximize;
  h.step = step;
  return h;
}

class CompactPaths : public ::testing::TestWithParam<std::tuple<int64_t, bool, bool>> {};

TEST_P(CompactPaths, SimdPathsAreBitIdenticalToScalar) {
  const auto [n, decoupled, maximize] = GetParam();
  for (DType gt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (DType ct : {DType::kNone, DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      State ref(n, 7), b2(n, 7), b512(n, 7);
      for (int64_t step = 1; step <= 4; ++step) {
        const AdamScalars s = adam_scalars(hyper(decoupled, maximize, step));
        for (State* b : {&ref, &b2, &b512}) b->regrad(100 + step);
        adam_compact_step_range(SimdLevel::kScalar, s, ref.view(gt, ct), 0, n);
        if (cpu_simd_level() >= SimdLevel::kAvx2)
          adam_compact_step_range(SimdLevel::kAvx2, s, b2.view(gt, ct), 0, n);
        if (cpu_simd_level() >= SimdLevel::kAvx512)
          adam_compact_step_range(SimdLevel::kAvx512, s, b512.view(gt, ct), 0, n);
      }
      if (cpu_simd_level() >= SimdLevel::kAvx2) expect_same(ref, b2, "avx2");
      if (cpu_simd_level() >= SimdLevel::kAvx512) expect_same(ref, b512, "avx512");
    }
  }
}

// The compact step is adam_step's fp32 arithmetic on the decoded state, then the encoding.
TEST_P(CompactPaths, IsTheFp32StepOnDecodedState) {
  const auto [n, decoupled, maximize] = GetParam();
  State st(n, 3);
  for (int64_t step = 1; step <= 3; ++step) {
    const AdamHyper h = hyper(decoupled, maximize, step);
    st.regrad(step);
    std::vector<float> p = st.param, m(n), v(n);
    for (int64_t i = 0; i < n; ++i) m[i] = bf16_to_f32(st.m[i]);
    dequantize_exp_avg_sq(st.codes.data(), st.scales.data(), n, v.data());
    AdamTensor t;
    t.param = p.data();
    t.grad = st.grad16.data();
    t.grad_type = DType::kBFloat16;
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.numel = n;
    adam_step_range(SimdLevel::kScalar, adam_scalars(h), t, 0, n);
    std::vector<uint8_t> codes(n);
    std::vector<float> scales(st.scales.size());
    quantize_exp_avg_sq(v.data(), n, codes.data(), scales.data());

    CompactAdamTensor c = st.view(DType::kBFloat16, DType::kNone);
    adam_compact_step(h, &c, 1);
    ASSERT_EQ(0, std::memcmp(p.data(), st.param.data(), n * 4));
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(st.m[i], f32_to_bf16(m[i])) << i;
    ASSERT_EQ(codes, st.codes);
    ASSERT_EQ(0, std::memcmp(scales.data(), st.scales.data(), scales.size() * 4));
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CompactPaths,
                         ::testing::Combine(::testing::Values(1, 15, 17, 255, 256, 257, 1031, 5000),
                                            ::testing::Bool(), ::testing::Bool()));

// Threads split by 32K-element chunks, the offload layer by 1024-aligned slices: both must give
// the bits of one unthreaded call over the whole tensor.
TEST(CompactAdam, ThreadedAndSlicedMatchWholeTensor) {
  const int64_t n = 3 * (1 << 15) + 1029;
  State whole(n, 9), threaded(n, 9), sliced(n, 9);
  for (int64_t step = 1; step <= 2; ++step) {
    const AdamHyper h = hyper(true, false, step);
    adam_compact_step_range(active_simd_level(), adam_scalars(h),
                            whole.view(DType::kBFloat16, DType::kBFloat16), 0, n);
    CompactAdamTensor t = threaded.view(DType::kBFloat16, DType::kBFloat16);
    adam_compact_step(h, &t, 1);
    std::vector<CompactAdamTensor> slices;
    for (int64_t b = 0; b < n; b += 3 * 1024) {
      slices.push_back(sliced.view(DType::kBFloat16, DType::kBFloat16, b, std::min(n, b + 3072)));
    }
    adam_compact_step(h, slices.data(), slices.size());
  }
  expect_same(whole, threaded, "threaded");
  expect_same(whole, sliced, "sliced");
}

TEST(CompactAdam, NonFiniteGradientPoisonsOnlyItsBlock) {
  const int64_t n = 600;
  State st(n, 5);
  st.grad32[300] = std::numeric_limits<float>::quiet_NaN();
  CompactAdamTensor t = st.view(DType::kFloat32, DType::kNone);
  adam_compact_step(hyper(true, false, 1), &t, 1);
  EXPECT_FALSE(std::isnan(st.scales[0]));
  EXPECT_TRUE(std::isnan(st.scales[1]));
  EXPECT_FALSE(std::isnan(st.scales[2]));
  for (int64_t i = 256; i < 512; ++i) ASSERT_EQ(st.codes[i], 255);
}

TEST(CompactAdam, RejectsAmsgradAndNullState) {
  State st(8, 1);
  AdamHyper h;
  h.amsgrad = true;
  CompactAdamTensor t = st.view(DType::kFloat32, DType::kNone);
  EXPECT_THROW(adam_compact_step(h, &t, 1), std::invalid_argument);
  h.amsgrad = false;
  t.exp_avg_sq_scale = nullptr;
  EXPECT_THROW(adam_compact_step(h, &t, 1), std::invalid_argument);
}

}  // namespace
}  // namespace tierlift
