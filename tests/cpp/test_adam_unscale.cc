// AMP unscaling in the CPU Adam kernels (AdamHyper::unscale / grad_scale): a step on gradients
// still multiplied by GradScaler's scale gives the bits of the same step on gradients that were
// first multiplied by grad_unscale_factor(scale) in fp32 (what GradScaler.unscale_ writes into
// fp32 .grad), on every SIMD path, threaded or not, for fp32 and compact state; unusable scales
// are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "core/optim/adam.h"
#include "core/optim/adam_compact.h"

namespace tierlift {
namespace {

constexpr SimdLevel kLevels[] = {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512};

// Scaled gradients in fp32 and bf16 (the bf16 ones rounded from the fp32 ones), and the fp32
// gradients GradScaler.unscale_ would leave: each scaled value (as the kernel reads it) times
// the fp32 factor.
struct Grads {
  std::vector<float> scaled32, unscaled_from32, unscaled_from16;
  std::vector<uint16_t> scaled16;
  Grads(int64_t n, float scale, uint32_t seed)
      : scaled32(n), unscaled_from32(n), unscaled_from16(n), scaled16(n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_real_distribution<float> expo(-20.f, 4.f);
    const float inv = grad_unscale_factor(scale);
    for (int64_t i = 0; i < n; ++i) {
      scaled32[i] = i % 29 == 0 ? 0.f : normal(rng) * std::exp2(expo(rng)) * scale;
      scaled16[i] = f32_to_bf16(scaled32[i]);
      unscaled_from32[i] = scaled32[i] * inv;
      unscaled_from16[i] = bf16_to_f32(scaled16[i]) * inv;
    }
  }
  const void* scaled(DType t) const {
    return t == DType::kFloat32 ? static_cast<const void*>(scaled32.data()) : scaled16.data();
  }
  const float* unscaled(DType t) const {
    return t == DType::kFloat32 ? unscaled_from32.data() : unscaled_from16.data();
  }
};

struct Fp32State {
  std::vector<float> p, m, v, vmax;
  std::vector<uint16_t> copy;
  explicit Fp32State(int64_t n) : p(n), m(n), v(n), vmax(n), copy(n) {
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (int64_t i = 0; i < n; ++i) p[i] = normal(rng);
  }
  AdamTensor view(const void* grad, DType grad_type) {
    AdamTensor t;
    t.param = p.data();
    t.grad = grad;
    t.grad_type = grad_type;
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.max_exp_avg_sq = vmax.data();
    t.param_copy = copy.data();
    t.copy_type = DType::kBFloat16;
    t.numel = static_cast<int64_t>(p.size());
    return t;
  }
  bool operator==(const Fp32State& o) const {
    const size_t n = p.size();
    return std::memcmp(p.data(), o.p.data(), n * 4) == 0 &&
           std::memcmp(m.data(), o.m.data(), n * 4) == 0 &&
           std::memcmp(v.data(), o.v.data(), n * 4) == 0 &&
           std::memcmp(vmax.data(), o.vmax.data(), n * 4) == 0 &&
           std::memcmp(copy.data(), o.copy.data(), n * 2) == 0;
  }
};

AdamHyper hyper(int64_t step, bool decoupled, bool amsgrad, bool maximize) {
  AdamHyper h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  h.step = step;
  h.decoupled = decoupled;
  h.amsgrad = amsgrad;
  h.maximize = maximize;
  return h;
}

TEST(GradUnscaleFactor, IsTheDoubleReciprocalRoundedToFloat) {
  EXPECT_EQ(grad_unscale_factor(65536.f), 0x1p-16f);
  EXPECT_EQ(grad_unscale_factor(1000.f), static_cast<float>(1.0 / 1000.0));
  EXPECT_EQ(grad_unscale_factor(3.f), static_cast<float>(1.0 / 3.0));
  EXPECT_TRUE(grad_scale_usable(1e-30f));
  EXPECT_TRUE(grad_scale_usable(3e38f));
  for (float bad : {0.f, -1.f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN(), 1e-40f}) {
    EXPECT_FALSE(grad_scale_usable(bad)) << bad;
  }
}

// (numel, scale, decoupled, amsgrad, maximize)
using Param = std::tuple<int64_t, float, bool, bool, bool>;
class AdamUnscale : public ::testing::TestWithParam<Param> {};

TEST_P(AdamUnscale, Fp32StateEqualsStepOnUnscaledGradients) {
  const auto [n, scale, decoupled, amsgrad, maximize] = GetParam();
  for (DType gt : {DType::kFloat32, DType::kBFloat16}) {
    for (SimdLevel level : kLevels) {
      if (cpu_simd_level() < level) continue;
      SCOPED_TRACE(std::to_string(static_cast<int>(level)) + " grad " +
                   std::to_string(static_cast<int>(gt)));
      Fp32State got(n), want(n);
      for (int64_t step = 1; step <= 3; ++step) {
        const Grads g(n, scale, 40 + step);
        AdamHyper h = hyper(step, decoupled, amsgrad, maximize);
        adam_step_range(level, adam_scalars(h), want.view(g.unscaled(gt), DType::kFloat32), 0, n);
        h.unscale = true;
        h.grad_scale = scale;
        adam_step_range(level, adam_scalars(h), got.view(g.scaled(gt), gt), 0, n);
      }
      ASSERT_TRUE(got == want);
    }
  }
}

struct CompactState {
  std::vector<float> p, scales;
  std::vector<uint16_t> m, copy;
  std::vector<uint8_t> codes;
  explicit CompactState(int64_t n) : p(n), scales(compact_scale_count(n)), m(n), copy(n), codes(n) {
    std::mt19937 rng(6);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (int64_t i = 0; i < n; ++i) p[i] = normal(rng);
  }
  CompactAdamTensor view(const void* grad, DType grad_type) {
    CompactAdamTensor t;
    t.param = p.data();
    t.grad = grad;
    t.grad_type = grad_type;
    t.exp_avg = m.data();
    t.exp_avg_sq = codes.data();
    t.exp_avg_sq_scale = scales.data();
    t.param_copy = copy.data();
    t.copy_type = DType::kBFloat16;
    t.numel = static_cast<int64_t>(p.size());
    return t;
  }
  bool operator==(const CompactState& o) const {
    const size_t n = p.size();
    return std::memcmp(p.data(), o.p.data(), n * 4) == 0 &&
           std::memcmp(m.data(), o.m.data(), n * 2) == 0 && codes == o.codes &&
           std::memcmp(scales.data(), o.scales.data(), scales.size() * 4) == 0 &&
           std::memcmp(copy.data(), o.copy.data(), n * 2) == 0;
  }
};

TEST_P(AdamUnscale, CompactStateEqualsStepOnUnscaledGradients) {
  const auto [n, scale, decoupled, amsgrad, maximize] = GetParam();
  if (amsgrad) GTEST_SKIP() << "compact state has no amsgrad";
  for (DType gt : {DType::kFloat32, DType::kBFloat16}) {
    for (SimdLevel level : kLevels) {
      if (cpu_simd_level() < level) continue;
      CompactState got(n), want(n);
      for (int64_t step = 1; step <= 3; ++step) {
        const Grads g(n, scale, 70 + step);
        AdamHyper h = hyper(step, decoupled, false, maximize);
        adam_compact_step_range(level, adam_scalars(h), want.view(g.unscaled(gt), DType::kFloat32),
                                0, n);
        h.unscale = true;
        h.grad_scale = scale;
        adam_compact_step_range(level, adam_scalars(h), got.view(g.scaled(gt), gt), 0, n);
      }
      ASSERT_TRUE(got == want) << "level " << static_cast<int>(level) << " grad "
                               << static_cast<int>(gt);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, AdamUnscale,
                         ::testing::Combine(::testing::Values(1, 17, 257, 1031),
                                            ::testing::Values(65536.f, 1000.f, 0.375f),
                                            ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Bool()));

// The threaded entry points take the scale from AdamHyper like the ranges do.
TEST(AdamUnscaleThreaded, WholeStepMatchesUnscaledGradients) {
  const int64_t n = 3 * (1 << 15) + 77;
  const Grads g(n, 1000.f, 9);
  Fp32State got(n), want(n);
  AdamHyper h = hyper(1, true, false, false);
  AdamTensor w = want.view(g.unscaled(DType::kBFloat16), DType::kFloat32);
  adam_step(h, &w, 1);
  h.unscale = true;
  h.grad_scale = 1000.f;
  AdamTensor t = got.view(g.scaled(DType::kBFloat16), DType::kBFloat16);
  adam_step(h, &t, 1);
  EXPECT_TRUE(got == want);

  CompactState cgot(n), cwant(n);
  CompactAdamTensor cw = cwant.view(g.unscaled(DType::kFloat32), DType::kFloat32);
  h.unscale = false;
  adam_compact_step(h, &cw, 1);
  h.unscale = true;
  CompactAdamTensor ct = cgot.view(g.scaled(DType::kFloat32), DType::kFloat32);
  adam_compact_step(h, &ct, 1);
  EXPECT_TRUE(cgot == cwant);
}

TEST(AdamUnscaleThreaded, RefusesUnusableScalesBeforeChangingAnything) {
  const int64_t n = 64;
  const Grads g(n, 2.f, 3);
  for (float bad : {0.f, -2.f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN(), 1e-40f}) {
    Fp32State st(n), before(n);
    AdamHyper h = hyper(1, true, false, false);
    h.unscale = true;
    h.grad_scale = bad;
    AdamTensor t = st.view(g.scaled(DType::kFloat32), DType::kFloat32);
    EXPECT_THROW(adam_step(h, &t, 1), std::invalid_argument) << bad;
    EXPECT_TRUE(st == before);
    CompactState cs(n), cbefore(n);
    CompactAdamTensor c = cs.view(g.scaled(DType::kFloat32), DType::kFloat32);
    EXPECT_THROW(adam_compact_step(h, &c, 1), std::invalid_argument) << bad;
    EXPECT_TRUE(cs == cbefore);
  }
}

}  // namespace
}  // namespace tierlift
