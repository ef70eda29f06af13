#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <random>
#include <vector>

#include "core/optim/adam.h"

namespace tierlift {
namespace {

struct Buffers {
  std::vector<float> param, grad, m, v, vmax;
  std::vector<uint16_t> grad16, copy16;
  std::vector<float> copy32;
  explicit Buffers(int64_t n, uint32_t seed)
      : param(n), grad(n), m(n), v(n), vmax(n), grad16(n), copy16(n), copy32(n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.f, 1.f);
    for (int64_t i = 0; i < n; ++i) {
      param[i] = dist(rng);
      grad[i] = dist(rng) * 0.1f;
      grad16[i] = f32_to_bf16(grad[i]);
    }
  }
  AdamTensor view(DType grad_type, DType copy_type) {
    AdamTensor t;
    t.param = param.data();
    t.grad = grad_type == DType::kFloat32 ? static_cast<const void*>(grad.data()) : grad16.data();
    t.grad_type = grad_type;
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.max_exp_avg_sq = vmax.data();
    t.copy_type = copy_type;
    t.param_copy = copy_type == DType::kFloat32 ? static_cast<void*>(copy32.data()) : copy16.data();
    t.numel = static_cast<int64_t>(param.size());
    return t;
  }
};

// Double-precision Adam for one element, the textbook formula.
void reference_step(const AdamHyper& h, double& p, double g, double& m, double& v, double& vmax) {
  if (h.maximize) g = -g;
  if (h.decoupled)
    p *= 1.0 - h.lr * h.weight_decay;
  else
    g += h.weight_decay * p;
  m = h.beta1 * m + (1 - h.beta1) * g;
  v = h.beta2 * v + (1 - h.beta2) * g * g;
  vmax = std::max(vmax, v);
  const double vh = h.amsgrad ? vmax : v;
  const double bc1 = 1 - std::pow(h.beta1, h.step), bc2 = 1 - std::pow(h.beta2, h.step);
  p -= h.lr / bc1 * m / (std::sqrt(vh) / std::sqrt(bc2) + h.eps);
}

class AdamPaths : public ::testing::TestWithParam<std::tuple<int64_t, bool, bool, bool>> {};

// Every SIMD path must give the scalar path's bits: same operation order, IEEE div/sqrt/fma.
TEST_P(AdamPaths, SimdPathsAreBitIdenticalToScalar) {
  const auto [n, decoupled, amsgrad, maximize] = GetParam();
  AdamHyper h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  h.decoupled = decoupled;
  h.amsgrad = amsgrad;
  h.maximize = maximize;
  for (DType gt : {DType::kFloat32, DType::kBFloat16}) {
    for (DType ct : {DType::kNone, DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      Buffers ref(n, 7), b2(n, 7), b512(n, 7);
      for (int64_t step = 1; step <= 5; ++step) {
        h.step = step;
        const AdamScalars s = adam_scalars(h);
        adam_step_range(SimdLevel::kScalar, s, ref.view(gt, ct), 0, n);
        if (cpu_simd_level() >= SimdLevel::kAvx2)
          adam_step_range(SimdLevel::kAvx2, s, b2.view(gt, ct), 0, n);
        if (cpu_simd_level() >= SimdLevel::kAvx512)
          adam_step_range(SimdLevel::kAvx512, s, b512.view(gt, ct), 0, n);
      }
      for (Buffers* b : {&b2, &b512}) {
        if ((b == &b2 && cpu_simd_level() < SimdLevel::kAvx2) ||
            (b == &b512 && cpu_simd_level() < SimdLevel::kAvx512))
          continue;
        ASSERT_EQ(0, std::memcmp(ref.param.data(), b->param.data(), n * 4));
        ASSERT_EQ(0, std::memcmp(ref.m.data(), b->m.data(), n * 4));
        ASSERT_EQ(0, std::memcmp(ref.v.data(), b->v.data(), n * 4));
        if (ct == DType::kFloat32) {
          ASSERT_EQ(0, std::memcmp(ref.copy32.data(), b->copy32.data(), n * 4));
        }
        if (ct == DType::kBFloat16 || ct == DType::kFloat16) {
          ASSERT_EQ(0, std::memcmp(ref.copy16.data(), b->copy16.data(), n * 2));
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, AdamPaths,
                         ::testing::Combine(::testing::Values(1, 15, 16, 17, 100, 1031),
                                            ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Bool()));

TEST(Adam, MatchesDoubleReferenceOverManySteps) {
  const int64_t n = 4099;
  Buffers b(n, 3);
  std::vector<double> p(b.param.begin(), b.param.end()), m(n, 0), v(n, 0), vmax(n, 0);
  AdamHyper h;
  h.lr = 1e-3;
  h.weight_decay = 0.01;
  for (int64_t step = 1; step <= 100; ++step) {
    h.step = step;
    AdamTensor t = b.view(DType::kFloat32, DType::kNone);
    adam_step(h, &t, 1);
    for (int64_t i = 0; i < n; ++i) reference_step(h, p[i], b.grad[i], m[i], v[i], vmax[i]);
  }
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(b.param[i], p[i], 1e-5 * std::max(1.0, std::fabs(p[i]))) << i;
  }
}

TEST(Adam, CopyHoldsRoundedParam) {
  const int64_t n = 333;
  Buffers b(n, 5);
  AdamHyper h;
  AdamTensor t = b.view(DType::kBFloat16, DType::kBFloat16);
  adam_step(h, &t, 1);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(b.copy16[i], f32_to_bf16(b.param[i]));
}

// The benchmarks' bound must move every byte the step moves, tails and all: each stored stream
// gets the gradient added once, and the low-precision copy receives the new weight.
TEST(Adam, MemoryPassTouchesEveryElementTheStepTouches) {
  const int64_t n = 3 * (1 << 15) + 37;  // several threading chunks and a scalar tail
  Buffers b(n, 5);
  const std::vector<float> p0 = b.param;
  AdamTensor t = b.view(DType::kBFloat16, DType::kBFloat16);
  adam_memory_pass(&t, 1);
  for (int64_t i = 0; i < n; ++i) {
    const float g = bf16_to_f32(b.grad16[i]);
    ASSERT_EQ(b.param[i], p0[i] + g) << i;
    ASSERT_EQ(b.m[i], g) << i;
    ASSERT_EQ(b.v[i], g) << i;
    ASSERT_EQ(b.copy16[i], f32_to_bf16(p0[i] + g)) << i;
  }
  t.param = nullptr;
  EXPECT_THROW(adam_memory_pass(&t, 1), std::invalid_argument);
}

TEST(Adam, RejectsInconsistentInput) {
  Buffers b(8, 1);
  AdamHyper h;
  h.amsgrad = true;
  AdamTensor t = b.view(DType::kFloat32, DType::kNone);
  t.max_exp_avg_sq = nullptr;
  EXPECT_THROW(adam_step(h, &t, 1), std::invalid_argument);
  h.amsgrad = false;
  h.step = 0;
  EXPECT_THROW(adam_step(h, &t, 1), std::invalid_argument);
}

// refresh_from_copy: a weight edited through its low-precision copy (or any edit of an fp32
// copy) is stepped from the copy's value, in every thread chunk; the others are untouched.
TEST(Adam, RefreshFromCopyStepsFromTheEditedCopy) {
  const int64_t n = 100000;  // several thread chunks
  const int64_t edited[] = {0, 4095, 4096, 40000, n - 1};
  AdamHyper h;
  h.lr = 1e-2;
  for (DType ct : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    Buffers fused(n, 11), by_hand(n, 11), ignored(n, 11);
    for (Buffers* b : {&fused, &by_hand, &ignored}) {
      h.step = 1;
      const AdamTensor t = b->view(DType::kFloat32, ct);
      adam_step(h, &t, 1);        // writes the copies
      for (int64_t j : edited) {  // the user scales these weights by -3 through the copy
        if (ct == DType::kFloat32) {
          b->copy32[j] *= -3.f;
        } else {
          const float w =
              ct == DType::kBFloat16 ? bf16_to_f32(b->copy16[j]) : f16_to_f32(b->copy16[j]);
          b->copy16[j] = ct == DType::kBFloat16 ? f32_to_bf16(w * -3.f) : f32_to_f16(w * -3.f);
        }
      }
    }
    for (int64_t j : edited) {
      by_hand.param[j] = ct == DType::kFloat32    ? by_hand.copy32[j]
                         : ct == DType::kBFloat16 ? bf16_to_f32(by_hand.copy16[j])
                                                  : f16_to_f32(by_hand.copy16[j]);
    }
    h.step = 2;
    AdamTensor tf = fused.view(DType::kFloat32, ct), th = by_hand.view(DType::kFloat32, ct);
    AdamHyper refresh = h;
    refresh.refresh_from_copy = true;
    adam_step(refresh, &tf, 1);
    adam_step(h, &th, 1);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(f32_bits(fused.param[i]), f32_bits(by_hand.param[i])) << i;
      ASSERT_EQ(f32_bits(fused.m[i]), f32_bits(by_hand.m[i])) << i;
      ASSERT_EQ(f32_bits(fused.v[i]), f32_bits(by_hand.v[i])) << i;
    }
    AdamTensor ti = ignored.view(DType::kFloat32, ct);
    adam_step(h, &ti, 1);  // without refresh the edits are overwritten
    for (int64_t j : edited) EXPECT_NE(f32_bits(ignored.param[j]), f32_bits(fused.param[j])) << j;
  }
}

TEST(Dtype, HalfConversionsRoundTripAndRoundToNearestEven) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_f16(f), h) << h;
    ASSERT_EQ(f32_to_bf16(bf16_to_f32(static_cast<uint16_t>(h))), h) << h;
  }
  EXPECT_EQ(f32_to_bf16(bits_f32(0x3f808000u)), 0x3f80);  // tie -> even
  EXPECT_EQ(f32_to_bf16(bits_f32(0x3f818000u)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(f32_to_f16(65520.f), 0x7c00);                 // rounds to inf
  EXPECT_EQ(f32_to_f16(65519.f), 0x7bff);
}

}  // namespace
}  // namespace tierlift
