// tierlift::cuda::adam_step (csrc/cuda/adam.cu) with amsgrad and NaN gradients, in the CPU
// simulator: the running max must be torch.maximum(max_exp_avg_sq, exp_avg_sq), NaN where either
// is (a NaN v is kept, not dropped), on the vector path (every array 16-byte aligned) and the
// element path (one array off by an element), bit for bit with core's scalar kernel.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/optim/adam.h"
#include "cuda/adam.cuh"
#include "cudasim/launch.h"

namespace tierlift {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kN = 203;

// n floats starting `lead` elements past a 64-byte boundary inside an owned buffer.
struct Array {
  std::vector<float> buf;
  float* p;
  Array(int64_t n, int lead) : buf(n + 32) {
    const auto at = reinterpret_cast<uintptr_t>(buf.data());
    p = buf.data() + ((64 - at % 64) % 64) / 4 + lead;
  }
  std::vector<float> values() const { return std::vector<float>(p, p + kN); }
};

struct Case {
  Array param, grad, m, v, vmax;
  explicit Case(int vmax_lead)
      : param(kN, 0), grad(kN, 0), m(kN, 0), v(kN, 0), vmax(kN, vmax_lead) {
    std::mt19937 rng(5);
    std::normal_distribution<float> dist(0.f, 1.f);
    for (int64_t i = 0; i < kN; ++i) {
      param.p[i] = dist(rng);
      m.p[i] = 0.f;
      v.p[i] = 0.f;
      vmax.p[i] = i % 17 == 4 ? kNaN : (i % 23 == 9 ? 1e3f : 0.f);
    }
  }
  void fill_grad(int64_t step) {
    std::mt19937 rng(static_cast<uint32_t>(100 + step));
    std::normal_distribution<float> dist(0.f, 1.f);
    for (int64_t i = 0; i < kN; ++i) {
      float g = dist(rng) * (step % 2 ? 0.1f : 3.f);
      if ((i + step) % 13 == 0) g = step % 2 ? kNaN : -kNaN;
      if ((i + 2 * step) % 29 == 0) g = i % 2 ? kInf : -kInf;
      grad.p[i] = g;
    }
  }
};

int differences(const std::vector<float>& a, const std::vector<float>& b) {
  int n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], 4) != 0;
  return n;
}

TEST(AdamKernelAmsgradNaN, RunningMaxIsNaNWhereEitherIsOnBothPaths) {
  for (const int vmax_lead : {0, 1}) {  // 0: the vector path; 1: element by element
    AdamHyper h;
    h.lr = 1e-2;
    h.weight_decay = 0.1;
    h.amsgrad = true;
    Case sim(vmax_lead), ref(vmax_lead);
    int nan_from_v = 0;
    for (int64_t step = 1; step <= 3; ++step) {
      h.step = step;
      const AdamScalars s = adam_scalars(h);
      sim.fill_grad(step);
      ref.fill_grad(step);
      const std::vector<float> old_vmax = sim.vmax.values();
      cuda::AdamTensorPtrs p{sim.param.p, sim.grad.p, sim.m.p, sim.v.p, sim.vmax.p, nullptr, kN};
      ASSERT_EQ(cuda::adam_step(&p, 1, DType::kFloat32, DType::kNone, s, nullptr), cudaSuccess)
          << cudasim::last_error_message();
      AdamTensor t;
      t.param = ref.param.p;
      t.grad = ref.grad.p;
      t.exp_avg = ref.m.p;
      t.exp_avg_sq = ref.v.p;
      t.max_exp_avg_sq = ref.vmax.p;
      t.numel = kN;
      adam_range_scalar(s, t, 0, kN);
      EXPECT_EQ(differences(sim.param.values(), ref.param.values()), 0) << "param, step " << step;
      EXPECT_EQ(differences(sim.m.values(), ref.m.values()), 0) << "exp_avg, step " << step;
      EXPECT_EQ(differences(sim.v.values(), ref.v.values()), 0) << "exp_avg_sq, step " << step;
      EXPECT_EQ(differences(sim.vmax.values(), ref.vmax.values()), 0) << "max, step " << step;
      for (int64_t i = 0; i < kN; ++i) {
        const float old = old_vmax[i], v = sim.v.p[i];
        if (std::isnan(old) || std::isnan(v)) {
          ASSERT_TRUE(std::isnan(sim.vmax.p[i])) << "lead " << vmax_lead << " i " << i;
          nan_from_v += !std::isnan(old);
        } else {
          EXPECT_EQ(sim.vmax.p[i], old < v ? v : old) << "i " << i;
        }
      }
    }
    EXPECT_GT(nan_from_v, 0) << "no NaN v met a finite running max";
  }
}

}  // namespace
}  // namespace tierlift
