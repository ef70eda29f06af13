// refresh_from_copies in tierlift::cuda::adam_step and adam_compact_step (csrc/cuda/adam.cu,
// adam_compact.cu), run in the CPU simulator: the model weights (the copies) were edited outside
// the optimizer, and the kernel must step every edited element from the copy's value and every
// other element from its fp32 master, low bits kept. Compared bit for bit with a reference that
// first refreshes the masters as tierlift.offload.masters.refresh_master does (an element whose
// copy is not its master rounded to the copy's dtype takes the copy's value), written here with
// core's conversions, and then steps with core's scalar kernels.
//
// Covered: both kernels x every grad dtype x bf16/fp16/fp32 copies; edits to a different value,
// to the master's own rounding (no refresh: the low bits stay), to NaN, to the other signed zero
// and to the next representable value; steps with the flag off ignoring whatever the copies hold;
// tensors across two chunks; no copies with the flag on.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "core/optim/adam.h"
#include "core/optim/adam_compact.h"
#include "core/util/dtype.h"
#include "cuda/adam.cuh"
#include "cuda/adam_compact.cuh"
#include "tests/cudasim/dtypes.h"

namespace tierlift {
namespace {

using cudasim_test::dtype_name;
using cudasim_test::kInputDtypes;

constexpr int64_t kChunk = int64_t{1} << 16;  // elements per CUDA block in both kernels

// x rounded to `t` (bf16/fp16 bits in the low 16 bits; fp32 bits), and back: core's conversions.
uint32_t round_to(DType t, float x) {
  if (t == DType::kBFloat16) return f32_to_bf16(x);
  if (t == DType::kFloat16) return f32_to_f16(x);
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float widen(DType t, uint32_t bits) {
  if (t == DType::kBFloat16) return bf16_to_f32(static_cast<uint16_t>(bits));
  if (t == DType::kFloat16) return f16_to_f32(static_cast<uint16_t>(bits));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One tensor with both state layouts (the test steps one of them) and a copy of either width.
struct TensorData {
  int64_t numel;
  std::vector<float> param, grad32, m32, v32, copy32;
  std::vector<uint16_t> grad16, m16, copy16;
  std::vector<uint8_t> codes;
  std::vector<float> scales;

  TensorData(int64_t n, uint64_t seed)
      : numel(n),
        param(n),
        grad32(n),
        m32(n),
        v32(n),
        copy32(n),
        grad16(n),
        m16(n),
        copy16(n),
        codes(n),
        scales(compact_scale_count(n)) {
    std::mt19937 rng(static_cast<uint32_t>(seed));
    std::normal_distribution<float> normal(0.f, 1.f);
    for (int64_t i = 0; i < n; ++i) {
      param[i] = i % 13 == 0 ? (i % 2 ? -0.f : 0.f) : normal(rng);
      m32[i] = normal(rng) * 1e-3f;
      m16[i] = f32_to_bf16(m32[i]);
      v32[i] = i % 29 == 0 ? 0.f : std::exp2(-12.f + normal(rng));
      // Junk the copies hold before the first step: the flag is off there, so it must not
      // matter (a copy of 1.0 or 0.5 differs from almost every master).
      copy16[i] = i % 2 ? 0x3c00 : 0x3f00;
      copy32[i] = 0.5f;
    }
    quantize_exp_avg_sq(v32.data(), n, codes.data(), scales.data());
  }

  void set_grads(DType grad_type, uint64_t seed) {
    std::mt19937 rng(static_cast<uint32_t>(seed));
    std::normal_distribution<float> normal(0.f, 1.f);
    for (int64_t i = 0; i < numel; ++i) {
      grad32[i] = i % 31 == 0 ? 0.f : normal(rng) * 1e-2f;
      grad16[i] = grad_type == DType::kFloat16 ? f32_to_f16(grad32[i]) : f32_to_bf16(grad32[i]);
    }
  }

  const void* grad(DType t) const {
    return t == DType::kFloat32 ? static_cast<const void*>(grad32.data()) : grad16.data();
  }
  void* copy(DType t) {
    if (t == DType::kNone) return nullptr;
    return t == DType::kFloat32 ? static_cast<void*>(copy32.data()) : copy16.data();
  }
  uint32_t copy_bits(DType t, int64_t i) const {
    if (t != DType::kFloat32) return copy16[i];
    uint32_t u;
    std::memcpy(&u, &copy32[i], 4);
    return u;
  }
  void set_copy_bits(DType t, int64_t i, uint32_t bits) {
    if (t == DType::kFloat32) {
      std::memcpy(&copy32[i], &bits, 4);
    } else {
      copy16[i] = static_cast<uint16_t>(bits);
    }
  }

  // What a user does to the model weights between steps, on about half of the elements
  // (`round` varies which): a new value, the master's own rounding written back (the master
  // must keep its low bits), NaN, the other signed zero, the next representable value.
  void edit_copies(DType t, int round) {
    const uint32_t nan = t == DType::kBFloat16  ? 0x7fc0u
                         : t == DType::kFloat16 ? 0x7e00u
                                                : 0x7fc00000u;
    const uint32_t sign = t == DType::kFloat32 ? 0x80000000u : 0x8000u;
    for (int64_t i = 0; i < numel; ++i) {
      const uint32_t mine = round_to(t, param[i]);
      switch ((i + round) % 11) {
        case 0:
          set_copy_bits(t, i, round_to(t, param[i] * 0.5f + 0.25f));
          break;
        case 1:
          set_copy_bits(t, i, mine);
          break;
        case 2:
          set_copy_bits(t, i, nan);
          break;
        case 3:  // the sign flipped: -x, the other signed zero, a NaN of the other sign
          set_copy_bits(t, i, mine ^ sign);
          break;
        case 4:
          set_copy_bits(t, i, mine + 1);
          break;
        case 5:
          // A NaN master (from an earlier NaN edit) gets a finite value again.
          if (std::isnan(param[i])) set_copy_bits(t, i, round_to(t, 1.5f));
          break;
        default:
          break;
      }
    }
  }
};

// refresh_master's rule, element by element, with core's conversions.
void refresh_reference(TensorData& t, DType copy_type) {
  for (int64_t i = 0; i < t.numel; ++i) {
    const uint32_t have = t.copy_bits(copy_type, i);
    if (have != round_to(copy_type, t.param[i])) t.param[i] = widen(copy_type, have);
  }
}

// Bit for bit, except that any two fp32 NaNs are equal: which NaN's payload and sign an
// operation keeps depends on operand order, which the compiler may change (it does under the
// sanitizer build's flags), and torch does not promise it either.
template <typename T>
::testing::AssertionResult same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ";
  size_t count = 0, first = a.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if constexpr (std::is_same_v<T, float>) {
      if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    }
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0 && count++ == 0) first = i;
  }
  if (count == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << count << " of " << a.size() << " elements differ, first at [" << first << "]";
}

struct Case {
  bool compact;
  DType grad_type, copy_type;
};

// One step of `t` (the simulated side) with the CUDA kernel, and of `r` with core, after `r`'s
// masters were refreshed when `refresh`.
void step_both(const Case& c, std::vector<TensorData>& sim, std::vector<TensorData>& ref, int step,
               bool refresh) {
  AdamHyper h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  h.decoupled = step % 2 == 1;  // AdamW, then Adam with an L2 term
  h.step = step;
  const AdamScalars s = adam_scalars(h);
  std::vector<cuda::AdamTensorPtrs> ptrs;
  std::vector<cuda::CompactAdamTensorPtrs> compact_ptrs;
  for (size_t k = 0; k < sim.size(); ++k) {
    sim[k].set_grads(c.grad_type, 7919 * step + k);
    ref[k].set_grads(c.grad_type, 7919 * step + k);
    TensorData& t = sim[k];
    ptrs.push_back({t.param.data(), t.grad(c.grad_type), t.m32.data(), t.v32.data(), nullptr,
                    t.copy(c.copy_type), t.numel});
    compact_ptrs.push_back({t.param.data(), t.grad(c.grad_type), t.m16.data(), t.codes.data(),
                            t.scales.data(), t.copy(c.copy_type), t.numel});
  }
  const int count = static_cast<int>(sim.size());
  const cudaError_t err = c.compact
                              ? cuda::adam_compact_step(compact_ptrs.data(), count, c.grad_type,
                                                        c.copy_type, s, nullptr, nullptr, refresh)
                              : cuda::adam_step(ptrs.data(), count, c.grad_type, c.copy_type, s,
                                                nullptr, nullptr, refresh);
  ASSERT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
  for (TensorData& t : ref) {
    if (refresh && c.copy_type != DType::kNone) refresh_reference(t, c.copy_type);
    if (c.compact) {
      CompactAdamTensor a;
      a.param = t.param.data();
      a.grad = t.grad(c.grad_type);
      a.grad_type = c.grad_type;
      a.exp_avg = t.m16.data();
      a.exp_avg_sq = t.codes.data();
      a.exp_avg_sq_scale = t.scales.data();
      a.param_copy = t.copy(c.copy_type);
      a.copy_type = c.copy_type;
      a.numel = t.numel;
      adam_compact_range_scalar(s, a, 0, t.numel);
    } else {
      AdamTensor a;
      a.param = t.param.data();
      a.grad = t.grad(c.grad_type);
      a.grad_type = c.grad_type;
      a.exp_avg = t.m32.data();
      a.exp_avg_sq = t.v32.data();
      a.param_copy = t.copy(c.copy_type);
      a.copy_type = c.copy_type;
      a.numel = t.numel;
      adam_range_scalar(s, a, 0, t.numel);
    }
  }
}

void expect_same(const std::vector<TensorData>& sim, const std::vector<TensorData>& ref,
                 const std::string& where) {
  for (size_t k = 0; k < sim.size(); ++k) {
    const std::string at = where + ", tensor " + std::to_string(k);
    EXPECT_TRUE(same_bits(sim[k].param, ref[k].param)) << at << ": master";
    EXPECT_TRUE(same_bits(sim[k].m32, ref[k].m32)) << at << ": exp_avg";
    EXPECT_TRUE(same_bits(sim[k].v32, ref[k].v32)) << at << ": exp_avg_sq";
    EXPECT_TRUE(same_bits(sim[k].m16, ref[k].m16)) << at << ": compact exp_avg";
    EXPECT_TRUE(same_bits(sim[k].codes, ref[k].codes)) << at << ": v codes";
    EXPECT_TRUE(same_bits(sim[k].scales, ref[k].scales)) << at << ": v scales";
    EXPECT_TRUE(same_bits(sim[k].copy32, ref[k].copy32)) << at << ": fp32 copy";
    EXPECT_TRUE(same_bits(sim[k].copy16, ref[k].copy16)) << at << ": 16-bit copy";
  }
}

using Param = std::tuple<bool, DType, DType>;

class AdamKernelRefresh : public ::testing::TestWithParam<Param> {};

TEST_P(AdamKernelRefresh, EditedCopiesAreSteppedFromTheirValue) {
  const auto [compact, grad_type, copy_type] = GetParam();
  const Case c{compact, grad_type, copy_type};
  const std::vector<int64_t> numels = {1, 777, 0, kChunk + 300};
  std::vector<TensorData> sim, ref;
  for (size_t k = 0; k < numels.size(); ++k) {
    sim.emplace_back(numels[k], 100 + k);
    ref.emplace_back(numels[k], 100 + k);
  }
  // Step 1, flag off: the junk in the copies is only overwritten. Steps 2 and 4 follow edits;
  // step 3 follows none (every copy is its master's rounding: nothing is refreshed).
  for (int step = 1; step <= 4; ++step) {
    if (step % 2 == 0) {
      for (size_t k = 0; k < sim.size(); ++k) {
        sim[k].edit_copies(copy_type, step);
        ref[k].edit_copies(copy_type, step);
      }
      ASSERT_TRUE(same_bits(sim[1].param, ref[1].param)) << "before step " << step;
    }
    ASSERT_NO_FATAL_FAILURE(step_both(c, sim, ref, step, /*refresh=*/step > 1));
    expect_same(sim, ref, "step " + std::to_string(step));
    if (HasFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, AdamKernelRefresh,
                         ::testing::Combine(::testing::Bool(), ::testing::ValuesIn(kInputDtypes),
                                            ::testing::Values(DType::kBFloat16, DType::kFloat16,
                                                              DType::kFloat32)),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return std::string(std::get<0>(info.param) ? "Compact" : "Fp32State") +
                                  "_Grad" + dtype_name(std::get<1>(info.param)) + "_Copy" +
                                  dtype_name(std::get<2>(info.param));
                         });

// The edits must change something, or the test above would pass with the flag ignored.
TEST(AdamKernelRefreshSetup, EditsChangeTheStepWithoutRefresh) {
  for (DType copy_type : {DType::kBFloat16, DType::kFloat16}) {
    const Case c{false, DType::kFloat32, copy_type};
    std::vector<TensorData> sim, ref;
    sim.emplace_back(777, 5);
    ref.emplace_back(777, 5);
    ASSERT_NO_FATAL_FAILURE(step_both(c, sim, ref, 1, false));
    sim[0].edit_copies(copy_type, 2);
    ref[0].edit_copies(copy_type, 2);
    ASSERT_NO_FATAL_FAILURE(step_both(c, sim, ref, 2, /*refresh=*/true));
    std::vector<TensorData> plain;
    plain.emplace_back(777, 5);
    std::vector<TensorData> unused;
    unused.emplace_back(777, 5);
    ASSERT_NO_FATAL_FAILURE(step_both(c, plain, unused, 1, false));
    plain[0].edit_copies(copy_type, 2);
    ASSERT_NO_FATAL_FAILURE(step_both(c, plain, unused, 2, /*refresh=*/false));
    EXPECT_FALSE(same_bits(plain[0].param, sim[0].param)) << dtype_name(copy_type);
  }
}

// Without copies the flag has nothing to read: the step is the plain one.
TEST(AdamKernelRefreshSetup, NoCopiesIsThePlainStep) {
  for (bool compact : {false, true}) {
    const Case c{compact, DType::kBFloat16, DType::kNone};
    std::vector<TensorData> sim, ref;
    sim.emplace_back(kChunk + 3, 9);
    ref.emplace_back(kChunk + 3, 9);
    ASSERT_NO_FATAL_FAILURE(step_both(c, sim, ref, 1, /*refresh=*/true));
    ASSERT_NO_FATAL_FAILURE(step_both(c, sim, ref, 2, /*refresh=*/true));
    expect_same(sim, ref, compact ? "compact" : "fp32 state");
  }
}

}  // namespace
}  // namespace tierlift
