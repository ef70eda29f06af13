// tierlift::cuda::adam_step (csrc/cuda/adam.cu) run in the CPU simulator, compared bit for bit
// with the CPU kernel's scalar path (core adam_range_scalar, the reference the CUDA kernel
// follows operation for operation). Every buffer is a std::vector of exactly numel elements, so
// AddressSanitizer catches any element the kernel touches outside its tensors.
//
// Covered: every grad dtype x param-copy dtype, Adam/AdamW, weight decay 0 and not, amsgrad,
// maximize, AMP unscaling (grad_scale read from device memory), several steps, empty tensors,
// numels around the 64Ki-element chunk, more tensors than one launch's pack holds
// (kAdamPackTensors), and tensors whose chunks straddle two and three launches (with the
// blocks per launch lowered through pack_block_limit). Mirrors tests/python/test_optim.py's gpu
// tests, scaled down for the simulator. The vector path's alignment edges:
// test_kernel_adam_vec.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "core/optim/adam.h"
#include "core/util/dtype.h"
#include "cuda/adam.cuh"
#include "cuda/multi_tensor.cuh"
#include "cudasim/launch.h"
#include "tests/cudasim/dtypes.h"

namespace tierlift {
namespace {

using cudasim_test::dtype_name;
using cudasim_test::kInputDtypes;

constexpr int64_t kChunk = int64_t{1} << 16;   // elements per block in adam.cu
constexpr int kPack = cuda::kAdamPackTensors;  // tensors per launch

// Test data repeats with this period (a prime, so coprime with the chunk size). The reference
// side keeps one period of each tensor: the 21M-element test needs no second full copy, and an
// element that the kernel skips, updates twice or takes from the wrong offset still differs from
// its reference.
constexpr int64_t kPeriod = 10007;

// splitmix64: cheap and deterministic.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform(float lo, float hi) {  // [lo, hi)
    return lo + (hi - lo) * static_cast<float>(next() >> 40) * 0x1p-24f;
  }

 private:
  uint64_t s_;
};

// v[j] = value(j) for the first period, then that period repeated up to v.size().
template <typename T, typename F>
void fill_periodic(std::vector<T>& v, F value) {
  const size_t n = v.size(), m = std::min<size_t>(n, kPeriod);
  for (size_t j = 0; j < m; ++j) v[j] = value(j);
  for (size_t off = m; off < n; off += m) {
    std::memcpy(&v[off], v.data(), std::min(m, n - off) * sizeof(T));
  }
}

// Weights with values whose low-precision copies round to inf, to subnormals and to signed zero,
// and NaNs of either sign (the fp16 copy keeps the sign: sign | 0x7e00, as core and c10 write it).
float param_value(Rng& rng, size_t j) {
  if (j % 97 == 3) return j % 2 ? 1e5f : -7e4f;  // fp16 copy: +-inf
  if (j % 107 == 13)
    return std::copysign(std::numeric_limits<float>::quiet_NaN(), j % 2 ? 1.f : -1.f);
  if (j % 89 == 5) return 3e-6f;  // fp16 copy: subnormal
  if (j % 101 == 7) return -0.f;  // with exp_avg and grad 0 too: stays -0 (copy -0)
  if (j % 103 == 11) return 0.f;
  return rng.uniform(-2.f, 2.f);
}

// Gradients spanning many magnitudes, including fp16 subnormals and exact zeros.
float grad_value(Rng& rng, size_t j) {
  if (j % 67 == 1 || j % 101 == 7) return 0.f;
  if (j % 71 == 2) return -2e-6f;
  if (j % 73 == 4) return 6e4f;
  const float scales[] = {1.f, 1e-1f, 1e-3f, 1e-6f};
  return rng.uniform(-1.f, 1.f) * scales[j % 4];
}

struct Config {
  DType grad_type = DType::kFloat32;
  DType copy_type = DType::kNone;
  bool amsgrad = false;
};

// One tensor's buffers, each exactly numel elements (or empty when unused).
struct TensorData {
  int64_t numel = 0;
  std::vector<float> param, exp_avg, exp_avg_sq, max_exp_avg_sq;
  std::vector<float> grad32, copy32;
  std::vector<uint16_t> grad16, copy16;

  TensorData(int64_t n, const Config& c, uint64_t seed)
      : numel(n), param(n), exp_avg(n), exp_avg_sq(n) {
    Rng r1(seed), r2(seed + 1), r3(seed + 2), r4(seed + 3);
    fill_periodic(param, [&](size_t j) { return param_value(r1, j); });
    fill_periodic(exp_avg, [&](size_t j) { return j % 101 == 7 ? 0.f : r2.uniform(-0.1f, 0.1f); });
    fill_periodic(exp_avg_sq, [&](size_t) {
      const float r = r3.uniform(0.f, 0.1f);
      return r * r;
    });
    if (c.amsgrad) {
      // Half above, half below exp_avg_sq, so both sides of the max are taken.
      max_exp_avg_sq.resize(n);
      fill_periodic(max_exp_avg_sq,
                    [&](size_t j) { return exp_avg_sq[j] * r4.uniform(0.5f, 1.5f); });
    }
    if (c.grad_type == DType::kFloat32) {
      grad32.resize(n);
    } else {
      grad16.resize(n);
    }
    if (c.copy_type == DType::kFloat32) copy32.resize(n);
    if (c.copy_type == DType::kBFloat16 || c.copy_type == DType::kFloat16) copy16.resize(n);
  }

  void set_grads(DType grad_type, uint64_t seed) {
    Rng rng(seed);
    if (grad_type == DType::kFloat32) {
      fill_periodic(grad32, [&](size_t j) { return grad_value(rng, j); });
    } else if (grad_type == DType::kBFloat16) {
      fill_periodic(grad16, [&](size_t j) { return f32_to_bf16(grad_value(rng, j)); });
    } else {
      fill_periodic(grad16, [&](size_t j) { return f32_to_f16(grad_value(rng, j)); });
    }
  }

  const void* grad() const {
    return grad32.empty() ? static_cast<const void*>(grad16.data()) : grad32.data();
  }
  void* copy() { return copy32.empty() ? static_cast<void*>(copy16.data()) : copy32.data(); }
};

// The same tensors twice: every element stepped by the CUDA kernel, one period of each tensor by
// the CPU kernel.
class TwinModel {
 public:
  TwinModel(const std::vector<int64_t>& numels, const Config& c) : config_(c) {
    for (size_t k = 0; k < numels.size(); ++k) {
      sim_.emplace_back(numels[k], c, 1000 + 10 * k);
      ref_.emplace_back(std::min(numels[k], kPeriod), c, 1000 + 10 * k);
    }
  }

  // One optimizer step on both sides with fresh gradients.
  void step(const AdamHyper& h) {
    for (size_t k = 0; k < sim_.size(); ++k) {
      const uint64_t seed = static_cast<uint64_t>(h.step) * 7919 + k;
      sim_[k].set_grads(config_.grad_type, seed);
      ref_[k].set_grads(config_.grad_type, seed);
    }
    const AdamScalars s = adam_scalars(h);
    std::vector<cuda::AdamTensorPtrs> ptrs;
    for (TensorData& t : sim_) {
      ptrs.push_back({t.param.data(), t.grad(), t.exp_avg.data(), t.exp_avg_sq.data(),
                      config_.amsgrad ? t.max_exp_avg_sq.data() : nullptr,
                      config_.copy_type == DType::kNone ? nullptr : t.copy(), t.numel});
    }
    const uint64_t launches_before = cudasim::launch_count();
    // The kernel reads the scale through a pointer (device memory on a GPU), core by value.
    const float scale = h.grad_scale;
    const cudaError_t err =
        cuda::adam_step(ptrs.data(), static_cast<int>(ptrs.size()), config_.grad_type,
                        config_.copy_type, s, nullptr, h.unscale ? &scale : nullptr);
    ASSERT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
    launches_ = cudasim::launch_count() - launches_before;
    for (TensorData& t : ref_) {
      AdamTensor a;
      a.param = t.param.data();
      a.grad = t.grad();
      a.grad_type = config_.grad_type;
      a.exp_avg = t.exp_avg.data();
      a.exp_avg_sq = t.exp_avg_sq.data();
      a.max_exp_avg_sq = config_.amsgrad ? t.max_exp_avg_sq.data() : nullptr;
      a.param_copy = config_.copy_type == DType::kNone ? nullptr : t.copy();
      a.copy_type = config_.copy_type;
      a.numel = t.numel;
      adam_range_scalar(s, a, 0, t.numel);
    }
  }

  // Kernel launches of the last step.
  uint64_t launches() const { return launches_; }

  // Every state buffer of every tensor, bit for bit.
  void expect_identical(const std::string& where) const {
    for (size_t k = 0; k < sim_.size(); ++k) {
      const TensorData& a = sim_[k];
      const TensorData& b = ref_[k];
      const std::string at =
          where + ", tensor " + std::to_string(k) + " (numel " + std::to_string(a.numel) + ")";
      EXPECT_TRUE(same_bits(a.param, b.param)) << at << ": param";
      EXPECT_TRUE(same_bits(a.exp_avg, b.exp_avg)) << at << ": exp_avg";
      EXPECT_TRUE(same_bits(a.exp_avg_sq, b.exp_avg_sq)) << at << ": exp_avg_sq";
      EXPECT_TRUE(same_bits(a.max_exp_avg_sq, b.max_exp_avg_sq)) << at << ": max_exp_avg_sq";
      EXPECT_TRUE(same_bits(a.copy32, b.copy32)) << at << ": fp32 param copy";
      EXPECT_TRUE(same_bits(a.copy16, b.copy16)) << at << ": 16-bit param copy";
    }
  }

 private:
  // got[i] against want[i % want.size()]: memcmp a period at a time (the big test compares 21M
  // elements); on a difference, count them and name the first.
  template <typename T>
  static ::testing::AssertionResult same_bits(const std::vector<T>& got,
                                              const std::vector<T>& want) {
    const size_t n = got.size(), m = want.size();
    if (m != std::min<size_t>(n, kPeriod)) return ::testing::AssertionFailure() << "sizes differ";
    size_t first = n, count = 0;
    for (size_t off = 0; off < n; off += m) {
      const size_t len = std::min(m, n - off);
      if (std::memcmp(&got[off], want.data(), len * sizeof(T)) == 0) continue;
      for (size_t j = 0; j < len; ++j) {
        if (std::memcmp(&got[off + j], &want[j], sizeof(T)) == 0) continue;
        if (count++ == 0) first = off + j;
      }
    }
    if (count == 0) return ::testing::AssertionSuccess();
    uint32_t g = 0, w = 0;
    std::memcpy(&g, &got[first], sizeof(T));
    std::memcpy(&w, &want[first % m], sizeof(T));
    std::ostringstream os;
    os << count << " of " << n << " elements differ; first at [" << first << "]: kernel 0x"
       << std::hex << g << ", core 0x" << w;
    return ::testing::AssertionFailure() << os.str();
  }

  Config config_;
  std::vector<TensorData> sim_, ref_;
  uint64_t launches_ = 0;
};

struct Options {
  bool decoupled;  // AdamW
  double weight_decay;
  bool amsgrad;
  bool maximize;
  float grad_scale = 0.f;  // > 0: AMP, the gradients are unscaled by it
};

AdamHyper hyper(const Options& o, int64_t step) {
  AdamHyper h;
  h.lr = 1e-2;
  h.weight_decay = o.weight_decay;
  h.decoupled = o.decoupled;
  h.amsgrad = o.amsgrad;
  h.maximize = o.maximize;
  h.step = step;
  h.unscale = o.grad_scale > 0.f;
  h.grad_scale = h.unscale ? o.grad_scale : 1.f;
  return h;
}

// Steps the tensors `steps` times on both sides, comparing after each step. `launches` is how
// many packs adam.cu should split each step into (the packing the test means to exercise).
void run_steps(const std::vector<int64_t>& numels, DType grad_type, DType copy_type,
               const Options& o, int steps, uint64_t launches) {
  TwinModel model(numels, {grad_type, copy_type, o.amsgrad});
  for (int step = 1; step <= steps; ++step) {
    ASSERT_NO_FATAL_FAILURE(model.step(hyper(o, step)));
    EXPECT_EQ(model.launches(), launches) << "kernel launches in step " << step;
    model.expect_identical("step " + std::to_string(step));
    if (::testing::Test::HasFailure()) return;
  }
}

constexpr DType kCopyTypes[] = {DType::kNone, DType::kFloat32, DType::kBFloat16, DType::kFloat16};

// ---- Every dtype combination x every option combination, small tensors ----

using DtypeOptionParam = std::tuple<DType, DType, bool, bool, bool, bool>;

class AdamKernelDtypeOptions : public ::testing::TestWithParam<DtypeOptionParam> {};

TEST_P(AdamKernelDtypeOptions, MatchesCoreBitForBit) {
  const auto [grad_type, copy_type, decoupled, weight_decay, amsgrad, maximize] = GetParam();
  const Options o{decoupled, weight_decay ? 0.1 : 0.0, amsgrad, maximize};
  // Empty tensors first, between and last; one tensor of 1 element; ragged tails.
  run_steps({0, 1, 777, 0, 3001, 0}, grad_type, copy_type, o, /*steps=*/2, /*launches=*/1);
}

std::string dtype_option_name(const ::testing::TestParamInfo<DtypeOptionParam>& info) {
  const auto [g, c, decoupled, wd, amsgrad, maximize] = info.param;
  return std::string("Grad") + dtype_name(g) + "_Copy" + dtype_name(c) +
         (decoupled ? "_AdamW" : "_Adam") + (wd ? "_Wd" : "_NoWd") + (amsgrad ? "_Amsgrad" : "") +
         (maximize ? "_Maximize" : "");
}

INSTANTIATE_TEST_SUITE_P(AllCombinations, AdamKernelDtypeOptions,
                         ::testing::Combine(::testing::ValuesIn(kInputDtypes),
                                            ::testing::ValuesIn(kCopyTypes), ::testing::Bool(),
                                            ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Bool()),
                         dtype_option_name);

// ---- AMP: the gradients unscaled by a scale in device memory, every dtype combination ----

class AdamKernelUnscale : public ::testing::TestWithParam<std::tuple<DType, DType, float>> {};

TEST_P(AdamKernelUnscale, MatchesCoreBitForBit) {
  const auto [grad_type, copy_type, scale] = GetParam();
  run_steps({1, 777, 0, kChunk + 5}, grad_type, copy_type, {true, 0.1, false, false, scale},
            /*steps=*/2, /*launches=*/1);
  run_steps({3001}, grad_type, copy_type, {false, 0.1, true, true, scale}, /*steps=*/2,
            /*launches=*/1);
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, AdamKernelUnscale,
                         ::testing::Combine(::testing::ValuesIn(kInputDtypes),
                                            ::testing::ValuesIn(kCopyTypes),
                                            ::testing::Values(65536.f, 1000.f, 0.375f)),
                         [](const ::testing::TestParamInfo<std::tuple<DType, DType, float>>& info) {
                           const float scale = std::get<2>(info.param);
                           return std::string("Grad") + dtype_name(std::get<0>(info.param)) +
                                  "_Copy" + dtype_name(std::get<1>(info.param)) + "_Scale" +
                                  (scale == 65536.f  ? "Pow2"
                                   : scale == 1000.f ? "1000"
                                                     : "Small");
                         });

// ---- Numels around the chunk size, every dtype combination ----

using DtypeParam = std::tuple<DType, DType>;

class AdamKernelChunks : public ::testing::TestWithParam<DtypeParam> {};

TEST_P(AdamKernelChunks, TensorsAroundTheChunkSizeMatchCore) {
  const auto [grad_type, copy_type] = GetParam();
  // One chunk minus one, exactly one, one plus one, two plus a ragged tail.
  run_steps({kChunk - 1, kChunk, kChunk + 1, 2 * kChunk + 123}, grad_type, copy_type,
            {true, 0.01, true, false}, /*steps=*/3, /*launches=*/1);
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, AdamKernelChunks,
                         ::testing::Combine(::testing::ValuesIn(kInputDtypes),
                                            ::testing::ValuesIn(kCopyTypes)),
                         [](const ::testing::TestParamInfo<DtypeParam>& info) {
                           return std::string("Grad") + dtype_name(std::get<0>(info.param)) +
                                  "_Copy" + dtype_name(std::get<1>(info.param));
                         });

// ---- Packs: more tensors than one launch holds ----

TEST(AdamKernel, NoTensorsAndOnlyEmptyTensorsAreNoOps) {
  const AdamScalars s = adam_scalars(AdamHyper{});
  EXPECT_EQ(cuda::adam_step(nullptr, 0, DType::kFloat32, DType::kNone, s, nullptr), cudaSuccess);
  run_steps({0, 0, 0}, DType::kFloat32, DType::kNone, {true, 0.0, false, false}, 1,
            /*launches=*/0);
}

// One fewer, as many and one more non-empty tensors than a pack holds, and two packs' worth,
// put the pack's tensor limit before, at and after the last tensor; empty tensors take no slot.
// The tensor that closes a pack spans two chunks.
TEST(AdamKernel, PackBoundaryAtTheTensorLimit) {
  for (int tensors : {kPack - 1, kPack, kPack + 1, 2 * kPack, 2 * kPack + 1}) {
    SCOPED_TRACE("non-empty tensors: " + std::to_string(tensors));
    std::vector<int64_t> numels;
    for (int k = 0; k < tensors; ++k) {
      if (k % 5 == 2) numels.push_back(0);
      numels.push_back(k % kPack == kPack - 1 ? kChunk + 9 : 1 + 37 * k);
    }
    run_steps(numels, DType::kBFloat16, DType::kBFloat16, {true, 0.01, true, false}, 2,
              /*launches=*/(tensors + kPack - 1) / kPack);
    if (HasFailure()) return;
  }
}

// Like test_cuda_kernel_many_tensors_across_packs: tensors of a few and of 70000 elements (two
// chunks each) plus empty ones; a pack and a half of non-empty tensors make two packs.
TEST(AdamKernel, ManyTensorsAcrossPacks) {
  std::vector<int64_t> numels;
  for (int k = 0; k < kPack + kPack / 2; ++k) {
    numels.push_back(k % 6 == 0 ? 70000 : 1 + k);
    if (k % 7 == 0) numels.push_back(0);
  }
  for (DType g : kInputDtypes) {
    SCOPED_TRACE(std::string("grad ") + dtype_name(g));
    run_steps(numels, g, DType::kFloat16, {false, 0.1, false, true}, 2, /*launches=*/2);
    if (HasFailure()) return;
  }
}

// pack_block_limit() lowered for one test.
class BlockLimit {
 public:
  explicit BlockLimit(int64_t limit) : saved_(cuda::pack_block_limit()) {
    cuda::pack_block_limit() = limit;
  }
  ~BlockLimit() { cuda::pack_block_limit() = saved_; }

 private:
  int64_t saved_;
};

// More chunks than a launch's blocks: with 5 blocks a launch, the third tensor (12 chunks,
// ragged) runs in three launches: from pack slot 2 of the first, alone in the second, and from
// slot 0 of the third, followed there by another tensor; the last tensor takes a fourth.
TEST(AdamKernel, TensorSplitAcrossLaunches) {
  const BlockLimit limit(5);
  const int64_t big = 12 * kChunk - 4321;
  for (DType g : kInputDtypes) {
    SCOPED_TRACE(std::string("grad ") + dtype_name(g));
    run_steps({1000, 5, big, 7, kChunk + 1}, g, DType::kBFloat16, {true, 0.01, true, false}, 1,
              /*launches=*/4);
    if (HasFailure()) return;
  }
}

// A launch of a single block, and of blocks exactly filling a tensor.
TEST(AdamKernel, OneBlockPerLaunch) {
  const BlockLimit limit(1);
  run_steps({3, 2 * kChunk, 0, 1}, DType::kFloat32, DType::kNone, {false, 0.1, true, true}, 2,
            /*launches=*/4);
}

}  // namespace
}  // namespace tierlift
