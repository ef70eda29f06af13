// The Adam kernels (csrc/cuda/adam_compact.cu, adam.cu) on the edges random inputs never reach,
// compared bit for bit with core's scalar paths: new v values whose ratio to their block's max
// lands exactly on a tie between two 8-bit v codes (ties go to even), a finite gradient so large
// that v overflows to +Inf (the block must turn NaN, as for a non-finite gradient), and +-Inf and
// NaN weights written to bf16 and fp16 copies (an infinite weight stays infinite).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "core/optim/adam.h"
#include "core/optim/adam_compact.h"
#include "core/util/dtype.h"
#include "cuda/adam.cuh"
#include "cuda/adam_compact.cuh"
#include "cudasim/launch.h"

namespace tierlift {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

AdamScalars scalars() {
  AdamHyper h;
  h.lr = 1e-2;
  h.weight_decay = 0.0;
  h.decoupled = true;
  h.step = 1;
  return adam_scalars(h);
}

// v after one step from v = 0 for gradient g, as both kernels compute it.
float new_v(const AdamScalars& s, float g) { return (s.one_minus_beta2 * g) * g; }

// A gradient whose new v, divided by block_max, is exactly the midpoint between two v codes
// (the 20 bits below the kept mantissa bits are 0x80000), with `top` (0..7) as the kept bits
// and 2^-e as the binade; NaN if no gradient near the estimate gets there.
float tie_gradient(const AdamScalars& s, float block_max, int top, int e) {
  const uint32_t target = (static_cast<uint32_t>(127 - e) << 23) | (top << 20) | 0x80000u;
  const float g0 = std::sqrt(from_bits(target) * block_max / s.one_minus_beta2);
  for (int d = 0; d < 4096; ++d) {
    const float g = from_bits(bits(g0) + (d % 2 ? d / 2 + 1 : -(d / 2)));
    if (bits(new_v(s, g) / block_max) == target) return g;
  }
  return kNaN;
}

template <typename T>
int differences(const std::vector<T>& a, const std::vector<T>& b) {
  int n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
  return n;
}

// Block 0: a max element, ties of every kept-bits pattern over 8 binades, and +-Inf/NaN weights.
// Block 1: a finite gradient whose v overflows. Block 2: ordinary values.
struct CompactCase {
  static constexpr int64_t kN = 3 * kCompactBlock;
  std::vector<float> param = std::vector<float>(kN), grad = std::vector<float>(kN, 0.f);
  std::vector<uint16_t> m = std::vector<uint16_t>(kN, 0), copy = std::vector<uint16_t>(kN, 0);
  std::vector<uint8_t> codes = std::vector<uint8_t>(kN, 0);
  std::vector<float> scales = std::vector<float>(3, 0.f);
  int ties = 0;

  explicit CompactCase(const AdamScalars& s) {
    for (int64_t i = 0; i < kN; ++i) {
      param[i] = 0.25f + 0.001f * static_cast<float>(i % 97);
      grad[i] = 1e-3f * static_cast<float>(i % 13 + 1);
    }
    grad[0] = 1.f;  // block 0's max: every other |g| there is below 1
    const float block_max = new_v(s, 1.f);
    int k = 1;
    for (int e = 1; e <= 8; ++e) {
      for (int top = 0; top < 8; ++top) {
        const float g = tie_gradient(s, block_max, top, e);
        if (std::isnan(g)) continue;
        grad[k] = (k % 2) ? g : -g;
        ++k, ++ties;
      }
    }
    param[100] = kInf, param[101] = -kInf, param[102] = kNaN;
    grad[kCompactBlock + 7] = 3e38f;  // finite; (1 - beta2) * g * g overflows
    param[kCompactBlock + 8] = kInf;  // inside the NaN block
  }
};

TEST(AdamKernelEdges, CompactVCodeTiesOverflowAndInfiniteWeights) {
  const AdamScalars s = scalars();
  for (DType copy_type : {DType::kBFloat16, DType::kFloat16}) {
    CompactCase sim(s), ref(s);
    ASSERT_GE(sim.ties, 32) << "too few v values on a code midpoint";
    cuda::CompactAdamTensorPtrs p{sim.param.data(), sim.grad.data(),   sim.m.data(),
                                  sim.codes.data(), sim.scales.data(), sim.copy.data(),
                                  CompactCase::kN};
    ASSERT_EQ(cuda::adam_compact_step(&p, 1, DType::kFloat32, copy_type, s, nullptr), cudaSuccess)
        << cudasim::last_error_message();
    CompactAdamTensor t;
    t.param = ref.param.data();
    t.grad = ref.grad.data();
    t.exp_avg = ref.m.data();
    t.exp_avg_sq = ref.codes.data();
    t.exp_avg_sq_scale = ref.scales.data();
    t.param_copy = ref.copy.data();
    t.copy_type = copy_type;
    t.numel = CompactCase::kN;
    adam_compact_range_scalar(s, t, 0, CompactCase::kN);
    EXPECT_EQ(differences(sim.codes, ref.codes), 0) << "v codes";
    EXPECT_EQ(differences(sim.scales, ref.scales), 0) << "scales";
    EXPECT_EQ(differences(sim.param, ref.param), 0) << "param";
    EXPECT_EQ(differences(sim.copy, ref.copy), 0) << "copy";
    EXPECT_TRUE(std::isnan(sim.scales[1])) << "an overflowing v marks its block";
    EXPECT_EQ(sim.codes[kCompactBlock + 7], 255);
    EXPECT_TRUE(std::isinf(sim.param[100]) && std::isinf(sim.param[101]));
    if (copy_type == DType::kBFloat16) {
      EXPECT_EQ(sim.copy[100], 0x7f80) << "+Inf weight in bf16";
      EXPECT_EQ(sim.copy[101], 0xff80) << "-Inf weight in bf16";
    } else {
      EXPECT_EQ(sim.copy[100], 0x7c00) << "+Inf weight in fp16";
      EXPECT_EQ(sim.copy[101], 0xfc00) << "-Inf weight in fp16";
    }
  }
}

TEST(AdamKernelEdges, NonFiniteWeightsInEveryCopyType) {
  const AdamScalars s = scalars();
  const int64_t n = 600;
  for (DType copy_type : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    std::vector<float> param(n), grad(n), m(n, 0.f), v(n, 0.f);
    for (int64_t i = 0; i < n; ++i) {
      param[i] = 0.5f - 0.001f * static_cast<float>(i);
      grad[i] = 0.01f * static_cast<float>(i % 7) - 0.03f;
    }
    param[3] = kInf, param[4] = -kInf, param[5] = kNaN, param[6] = -kNaN;
    grad[7] = kInf, grad[8] = kNaN;
    std::vector<float> param_ref = param, grad_ref = grad, m_ref = m, v_ref = v;
    std::vector<uint32_t> copy(n, 0), copy_ref(n, 0);  // wide enough for every copy type
    cuda::AdamTensorPtrs p{param.data(), grad.data(), m.data(), v.data(), nullptr, copy.data(), n};
    ASSERT_EQ(cuda::adam_step(&p, 1, DType::kFloat32, copy_type, s, nullptr), cudaSuccess)
        << cudasim::last_error_message();
    AdamTensor t;
    t.param = param_ref.data();
    t.grad = grad_ref.data();
    t.exp_avg = m_ref.data();
    t.exp_avg_sq = v_ref.data();
    t.param_copy = copy_ref.data();
    t.copy_type = copy_type;
    t.numel = n;
    adam_range_scalar(s, t, 0, n);
    EXPECT_EQ(differences(param, param_ref), 0);
    EXPECT_EQ(differences(m, m_ref), 0);
    EXPECT_EQ(differences(v, v_ref), 0);
    EXPECT_EQ(differences(copy, copy_ref), 0) << "copy type " << static_cast<int>(copy_type);
    if (copy_type == DType::kBFloat16) {
      const auto* c16 = reinterpret_cast<const uint16_t*>(copy.data());
      EXPECT_EQ(c16[3], 0x7f80);
      EXPECT_EQ(c16[4], 0xff80);
    }
  }
}

}  // namespace
}  // namespace tierlift
