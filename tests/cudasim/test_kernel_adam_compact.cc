// tierlift::cuda::adam_compact_step (csrc/cuda/adam_compact.cu) run in the CPU simulator,
// compared bit for bit with the CPU kernel's scalar path (core adam_compact_range_scalar): the
// weights, the bf16 m, the v codes and the block scales. Every buffer is a std::vector of exactly
// its size, so AddressSanitizer catches any access outside a tensor.
//
// Covered: every grad dtype x param-copy dtype, Adam/AdamW, weight decay 0 and not, maximize,
// several steps, empty tensors, tails shorter than a code block, numels around the 64Ki-element
// chunk, blocks with zero gradients and state, huge dynamic range inside blocks, a non-finite
// gradient (its block turns NaN on both sides), and more tensors than one launch's pack holds.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/optim/adam_compact.h"
#include "core/util/dtype.h"
#include "cuda/adam_compact.cuh"
#include "cudasim/launch.h"
#include "tests/cudasim/dtypes.h"

namespace tierlift {
namespace {

using cudasim_test::dtype_name;
using cudasim_test::kInputDtypes;

constexpr int64_t kChunk = int64_t{1} << 16;  // elements per CUDA block in adam_compact.cu

struct TensorData {
  int64_t numel;
  std::vector<float> param, grad32, copy32;
  std::vector<uint16_t> grad16, m, copy16;
  std::vector<uint8_t> codes;
  std::vector<float> scales;

  TensorData(int64_t n, uint64_t seed)
      : numel(n),
        param(n),
        grad32(n),
        copy32(n),
        grad16(n),
        m(n),
        copy16(n),
        codes(n),
        scales(compact_scale_count(n)) {
    std::mt19937 rng(static_cast<uint32_t>(seed));
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_real_distribution<float> expo(-14.f, 2.f);
    std::vector<float> v(n);
    for (int64_t i = 0; i < n; ++i) {
      const bool dead = (i / kCompactBlock) % 4 == 2;  // all-zero blocks
      param[i] = normal(rng);
      m[i] = dead ? 0 : f32_to_bf16(normal(rng) * 1e-3f);
      v[i] = dead || i % 29 == 0 ? 0.f : std::exp2(2 * expo(rng));
    }
    quantize_exp_avg_sq(v.data(), n, codes.data(), scales.data());
  }

  void set_grads(DType grad_type, uint64_t seed) {
    std::mt19937 rng(static_cast<uint32_t>(seed));
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_real_distribution<float> expo(-14.f, 2.f);
    for (int64_t i = 0; i < numel; ++i) {
      const bool dead = (i / kCompactBlock) % 4 == 2 || i % 31 == 0;
      const float g = dead ? 0.f : normal(rng) * std::exp2(expo(rng));
      grad32[i] = g;
      grad16[i] = grad_type == DType::kFloat16 ? f32_to_f16(g) : f32_to_bf16(g);
    }
  }

  const void* grad(DType t) const {
    return t == DType::kFloat32 ? static_cast<const void*>(grad32.data()) : grad16.data();
  }
  void* copy(DType t) {
    if (t == DType::kNone) return nullptr;
    return t == DType::kFloat32 ? static_cast<void*>(copy32.data()) : copy16.data();
  }
};

template <typename T>
::testing::AssertionResult same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      return ::testing::AssertionFailure() << "first difference at [" << i << "]";
    }
  }
  return ::testing::AssertionSuccess();
}

struct Case {
  DType grad_type = DType::kFloat32;
  DType copy_type = DType::kNone;
  bool decoupled = true;
  double weight_decay = 0.01;
  bool maximize = false;
  float grad_scale = 0.f;  // > 0: AMP, the gradients are unscaled by it
};

// Steps the same tensors in the simulator and on the CPU `steps` times, comparing after each;
// `launches` is how many packs the kernel should split a step into. `poison` puts a NaN
// gradient into tensor 0, element poison (if >= 0), on both sides.
void run_steps(const std::vector<int64_t>& numels, const Case& c, int steps, uint64_t launches,
               int64_t poison = -1) {
  std::vector<TensorData> sim, ref;
  for (size_t k = 0; k < numels.size(); ++k) {
    sim.emplace_back(numels[k], 1000 + 10 * k);
    ref.emplace_back(numels[k], 1000 + 10 * k);
  }
  for (int step = 1; step <= steps; ++step) {
    AdamHyper h;
    h.lr = 1e-2;
    h.weight_decay = c.weight_decay;
    h.decoupled = c.decoupled;
    h.maximize = c.maximize;
    h.step = step;
    h.unscale = c.grad_scale > 0.f;
    h.grad_scale = h.unscale ? c.grad_scale : 1.f;
    const AdamScalars s = adam_scalars(h);
    std::vector<cuda::CompactAdamTensorPtrs> ptrs;
    for (size_t k = 0; k < numels.size(); ++k) {
      for (TensorData* t : {&sim[k], &ref[k]}) {
        t->set_grads(c.grad_type, 7919 * step + k);
        if (k == 0 && poison >= 0) {
          t->grad32[poison] = std::numeric_limits<float>::quiet_NaN();
          t->grad16[poison] = 0x7fc0;  // NaN in bf16 and fp16 alike
        }
      }
      TensorData& t = sim[k];
      ptrs.push_back({t.param.data(), t.grad(c.grad_type), t.m.data(), t.codes.data(),
                      t.scales.data(), t.copy(c.copy_type), t.numel});
    }
    const uint64_t before = cudasim::launch_count();
    // The kernel reads the scale through a pointer (device memory on a GPU), core by value.
    const cudaError_t err =
        cuda::adam_compact_step(ptrs.data(), static_cast<int>(ptrs.size()), c.grad_type,
                                c.copy_type, s, nullptr, h.unscale ? &h.grad_scale : nullptr);
    ASSERT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
    EXPECT_EQ(cudasim::launch_count() - before, launches) << "launches in step " << step;
    for (TensorData& t : ref) {
      CompactAdamTensor a;
      a.param = t.param.data();
      a.grad = t.grad(c.grad_type);
      a.grad_type = c.grad_type;
      a.exp_avg = t.m.data();
      a.exp_avg_sq = t.codes.data();
      a.exp_avg_sq_scale = t.scales.data();
      a.param_copy = t.copy(c.copy_type);
      a.copy_type = c.copy_type;
      a.numel = t.numel;
      adam_compact_range_scalar(s, a, 0, t.numel);
    }
    for (size_t k = 0; k < numels.size(); ++k) {
      const std::string at = "step " + std::to_string(step) + ", tensor " + std::to_string(k) +
                             " (numel " + std::to_string(numels[k]) + ")";
      EXPECT_TRUE(same_bits(sim[k].param, ref[k].param)) << at << ": param";
      EXPECT_TRUE(same_bits(sim[k].m, ref[k].m)) << at << ": exp_avg";
      EXPECT_TRUE(same_bits(sim[k].codes, ref[k].codes)) << at << ": exp_avg_sq codes";
      EXPECT_TRUE(same_bits(sim[k].scales, ref[k].scales)) << at << ": scales";
      EXPECT_TRUE(same_bits(sim[k].copy32, ref[k].copy32)) << at << ": fp32 copy";
      EXPECT_TRUE(same_bits(sim[k].copy16, ref[k].copy16)) << at << ": 16-bit copy";
    }
    if (::testing::Test::HasFailure()) return;
  }
}

constexpr DType kCopyTypes[] = {DType::kNone, DType::kFloat32, DType::kBFloat16, DType::kFloat16};

using Param = std::tuple<DType, DType, bool, bool, bool>;

class AdamCompactKernel : public ::testing::TestWithParam<Param> {};

TEST_P(AdamCompactKernel, MatchesCoreBitForBit) {
  const auto [g, copy, decoupled, wd, maximize] = GetParam();
  // Empty tensors first, between and last; one element; tails shorter than a code block.
  run_steps({0, 1, 255, 0, 1031, 0}, {g, copy, decoupled, wd ? 0.1 : 0.0, maximize}, 2, 1);
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  const auto [g, c, decoupled, wd, maximize] = info.param;
  return std::string("Grad") + dtype_name(g) + "_Copy" + dtype_name(c) +
         (decoupled ? "_AdamW" : "_Adam") + (wd ? "_Wd" : "_NoWd") + (maximize ? "_Maximize" : "");
}

INSTANTIATE_TEST_SUITE_P(AllCombinations, AdamCompactKernel,
                         ::testing::Combine(::testing::ValuesIn(kInputDtypes),
                                            ::testing::ValuesIn(kCopyTypes), ::testing::Bool(),
                                            ::testing::Bool(), ::testing::Bool()),
                         param_name);

TEST(AdamCompactKernelSizes, TensorsAroundTheChunkSizeMatchCore) {
  run_steps({kChunk - 1, kChunk, kChunk + 1, 2 * kChunk + 123},
            {DType::kBFloat16, DType::kBFloat16, true, 0.01, false}, 2, 1);
}

TEST(AdamCompactKernelSizes, ManyTensorsAcrossPacks) {
  std::vector<int64_t> numels;
  for (int k = 0; k < 30; ++k) {
    numels.push_back(k % 6 == 0 ? 70000 : 1 + 37 * k);
    if (k % 7 == 0) numels.push_back(0);
  }
  run_steps(numels, {DType::kFloat16, DType::kFloat16, false, 0.1, true}, 2, 2);
}

// AMP: gradients unscaled by a scale in device memory (a power of two, 1000, one below 1).
TEST(AdamCompactKernelUnscale, MatchesCoreBitForBit) {
  for (DType g : kInputDtypes) {
    for (float scale : {65536.f, 1000.f, 0.375f}) {
      SCOPED_TRACE(std::string("grad ") + dtype_name(g) + ", scale " + std::to_string(scale));
      run_steps({1, 255, 0, kChunk + 1031}, {g, DType::kBFloat16, true, 0.1, false, scale}, 2, 1);
      run_steps({1031}, {g, DType::kNone, false, 0.1, true, scale}, 2, 1);
      if (HasFailure()) return;
    }
  }
}

TEST(AdamCompactKernelSizes, NonFiniteGradientPoisonsItsBlockOnBothSides) {
  run_steps({1000}, {DType::kFloat32, DType::kNone, true, 0.0, false}, 2, 1, /*poison=*/300);
}

}  // namespace
}  // namespace tierlift
