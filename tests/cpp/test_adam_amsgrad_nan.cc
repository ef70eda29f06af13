// amsgrad's running max with NaN gradients: torch computes torch.maximum(max_exp_avg_sq,
// exp_avg_sq), which is NaN where either is, so a NaN v turns the max NaN and keeps it NaN.
// Every path (scalar, AVX2, AVX-512) must do the same, with the same bits, and leave the max of
// finite values as it was.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/optim/adam.h"

namespace tierlift {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

struct State {
  std::vector<float> param, grad, m, v, vmax;
  explicit State(int64_t n) : param(n), grad(n), m(n, 0.f), v(n, 0.f), vmax(n, 0.f) {
    std::mt19937 rng(11);
    std::normal_distribution<float> dist(0.f, 1.f);
    for (int64_t i = 0; i < n; ++i) param[i] = dist(rng);
    // A running max loaded from a state dict that was already NaN, or larger than any new v.
    for (int64_t i = 4; i < n; i += 19) vmax[i] = kNaN;
    for (int64_t i = 9; i < n; i += 23) vmax[i] = 1e3f;
  }
  AdamTensor view() {
    AdamTensor t;
    t.param = param.data();
    t.grad = grad.data();
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.max_exp_avg_sq = vmax.data();
    t.numel = static_cast<int64_t>(param.size());
    return t;
  }
};

// Step `step`'s gradients: random, with NaN (both signs), +-Inf and exact zeros at positions
// that move from step to step, so some maxima turn NaN at a later step than others.
void fill_grad(std::vector<float>& g, int64_t step) {
  std::mt19937 rng(static_cast<uint32_t>(100 + step));
  std::normal_distribution<float> dist(0.f, 1.f);
  for (size_t i = 0; i < g.size(); ++i) {
    g[i] = dist(rng) * (step % 2 ? 0.1f : 3.f);
    if ((i + step) % 13 == 0) g[i] = step % 2 ? kNaN : -kNaN;
    if ((i + 2 * step) % 29 == 0) g[i] = i % 2 ? kInf : -kInf;
    if ((i + step) % 31 == 0) g[i] = 0.f;
  }
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

TEST(AdamAmsgradNaN, RunningMaxIsNaNWhereEitherIsAndSimdPathsAgreeBitwise) {
  for (const int64_t n : {1, 15, 16, 17, 100, 1031}) {
    for (const bool decoupled : {true, false}) {
      AdamHyper h;
      h.lr = 1e-2;
      h.weight_decay = 0.1;
      h.decoupled = decoupled;
      h.amsgrad = true;
      State ref(n), b2(n), b512(n);
      int64_t nan_from_v = 0;
      for (int64_t step = 1; step <= 4; ++step) {
        h.step = step;
        const AdamScalars s = adam_scalars(h);
        for (State* b : {&ref, &b2, &b512}) fill_grad(b->grad, step);
        const std::vector<float> old_vmax = ref.vmax;
        adam_step_range(SimdLevel::kScalar, s, ref.view(), 0, n);
        if (cpu_simd_level() >= SimdLevel::kAvx2)
          adam_step_range(SimdLevel::kAvx2, s, b2.view(), 0, n);
        if (cpu_simd_level() >= SimdLevel::kAvx512)
          adam_step_range(SimdLevel::kAvx512, s, b512.view(), 0, n);
        // torch.maximum(old, v): NaN where either is, else the larger, bit for bit.
        for (int64_t i = 0; i < n; ++i) {
          const float old = old_vmax[i], v = ref.v[i];
          if (std::isnan(old) || std::isnan(v)) {
            ASSERT_TRUE(std::isnan(ref.vmax[i])) << "n " << n << " step " << step << " i " << i;
            nan_from_v += !std::isnan(old);
          } else {
            const float want = old < v ? v : old;
            ASSERT_EQ(0, std::memcmp(&want, &ref.vmax[i], 4)) << "i " << i;
          }
        }
      }
      if (n >= 100) {
        EXPECT_GT(nan_from_v, 0) << "no NaN v met a finite running max";
      }
      for (State* b : {&b2, &b512}) {
        if ((b == &b2 && cpu_simd_level() < SimdLevel::kAvx2) ||
            (b == &b512 && cpu_simd_level() < SimdLevel::kAvx512))
          continue;
        const char* path = b == &b2 ? "avx2" : "avx512";
        EXPECT_TRUE(same_bits(ref.param, b->param)) << path << " n " << n;
        EXPECT_TRUE(same_bits(ref.m, b->m)) << path << " n " << n;
        EXPECT_TRUE(same_bits(ref.v, b->v)) << path << " n " << n;
        EXPECT_TRUE(same_bits(ref.vmax, b->vmax)) << path << " n " << n;
      }
    }
  }
}

}  // namespace
}  // namespace tierlift
