// The vector path of tierlift::cuda::adam_step (csrc/cuda/adam.cu) at its edges, in the CPU
// simulator, bit for bit against core's scalar kernel: the kernel moves 4 elements per access
// only when every array of a tensor is aligned to 4 elements, and steps the rest one by one.
// Here arrays start at chosen element offsets from a 64-byte boundary (views at odd offsets, one
// array misaligned while the others are not, fp32 arrays 8 bytes off, 16-bit arrays 4 bytes
// off), tensors are packed back to back in one buffer as a flat shard holds them, and sizes are
// tiny or not multiples of 4, with bf16/fp16 and fp32 copies refreshed from edited values,
// amsgrad on. Every byte around each tensor is a canary the kernel must not touch.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/optim/adam.h"
#include "core/util/dtype.h"
#include "cuda/adam.cuh"
#include "cudasim/launch.h"
#include "tests/cudasim/canary_buffer.h"
#include "tests/cudasim/dtypes.h"

namespace tierlift {
namespace {

using cudasim_test::CanaryBuffer;
using cudasim_test::dtype_name;
using cudasim_test::kInputDtypes;
using cudasim_test::round_to;
using cudasim_test::widen;

constexpr int64_t kChunk = int64_t{1} << 16;  // elements per block in adam.cu
constexpr int64_t kGuard = 16;                // canary elements around each tensor

enum Array { kParam, kGrad, kM, kV, kVmax, kCopy, kArrays };
const char* const kArrayNames[kArrays] = {"param",      "grad",           "exp_avg",
                                          "exp_avg_sq", "max_exp_avg_sq", "copy"};

// The first element of each array, in elements past a 64-byte boundary.
using Leads = std::array<int, kArrays>;

struct Config {
  DType grad_type = DType::kFloat32;
  DType copy_type = DType::kNone;
  bool amsgrad = true;
};

// Every tensor's arrays at the given leads; the same values whatever the layout.
class Model {
 public:
  Model(const std::vector<int64_t>& numels, const Config& c, const Leads& leads, bool packed)
      : numels_(numels), c_(c) {
    for (int a = 0; a < kArrays; ++a) {
      int elem = 4;
      if (a == kGrad && c.grad_type != DType::kFloat32) elem = 2;
      if (a == kCopy && c.copy_type != DType::kFloat32) elem = 2;
      if ((a == kVmax && !c.amsgrad) || (a == kCopy && c.copy_type == DType::kNone)) continue;
      buf_[a] = CanaryBuffer(elem, numels, leads[a], packed, kGuard);
      has_[a] = true;
    }
    for (size_t k = 0; k < numels.size(); ++k) {
      std::mt19937 rng(static_cast<uint32_t>(17 + k));
      std::normal_distribution<float> normal(0.f, 1.f);
      for (int64_t i = 0; i < numels[k]; ++i) {
        const float p = i % 13 == 5 ? (i % 2 ? -0.f : 0.f) : normal(rng);
        const float m = normal(rng) * 1e-3f;
        const float v = std::exp2(-12.f + normal(rng));
        buf_[kParam].set(k, i, f32_bits(p));
        buf_[kM].set(k, i, f32_bits(m));
        buf_[kV].set(k, i, f32_bits(i % 29 == 0 ? 0.f : v));
        if (has_[kVmax]) buf_[kVmax].set(k, i, f32_bits(v * (i % 2 ? 0.5f : 1.5f)));
        // Junk before the first step, which does not refresh: it must not matter.
        if (has_[kCopy]) buf_[kCopy].set(k, i, round_to(c.copy_type, 0.5f));
      }
    }
  }

  void set_grads(int step) {
    for (size_t k = 0; k < numels_.size(); ++k) {
      std::mt19937 rng(static_cast<uint32_t>(7919 * step + k));
      std::normal_distribution<float> normal(0.f, 1.f);
      for (int64_t i = 0; i < numels_[k]; ++i) {
        const float g = i % 31 == 0 ? 0.f : normal(rng) * 1e-2f;
        buf_[kGrad].set(k, i, round_to(c_.grad_type, g));
      }
    }
  }

  // What a user does to the weights between steps: a new value, the other sign, the next
  // representable value, on three elements in seven; the others keep the master's rounding.
  void edit_copies(int round) {
    const uint32_t sign = c_.copy_type == DType::kFloat32 ? 0x80000000u : 0x8000u;
    for (size_t k = 0; k < numels_.size(); ++k) {
      for (int64_t i = 0; i < numels_[k]; ++i) {
        const uint32_t mine = round_to(c_.copy_type, bits_f32(buf_[kParam].get(k, i)));
        switch ((i + round) % 7) {
          case 0:
            buf_[kCopy].set(k, i, round_to(c_.copy_type, bits_f32(mine) * 0.5f + 0.25f));
            break;
          case 1:
            buf_[kCopy].set(k, i, mine ^ sign);
            break;
          case 2:
            buf_[kCopy].set(k, i, mine + 1);
            break;
          default:
            break;
        }
      }
    }
  }

  std::vector<cuda::AdamTensorPtrs> ptrs() {
    std::vector<cuda::AdamTensorPtrs> out;
    for (size_t k = 0; k < numels_.size(); ++k) {
      out.push_back({static_cast<float*>(buf_[kParam].at(k)), buf_[kGrad].at(k),
                     static_cast<float*>(buf_[kM].at(k)), static_cast<float*>(buf_[kV].at(k)),
                     has_[kVmax] ? static_cast<float*>(buf_[kVmax].at(k)) : nullptr,
                     has_[kCopy] ? buf_[kCopy].at(k) : nullptr, numels_[k]});
    }
    return out;
  }

  // core's step: refresh_master's rule with core's conversions, then the scalar kernel.
  void step_core(const AdamScalars& s, bool refresh) {
    for (size_t k = 0; k < numels_.size(); ++k) {
      if (refresh && has_[kCopy]) {
        for (int64_t i = 0; i < numels_[k]; ++i) {
          const uint32_t have = buf_[kCopy].get(k, i);
          if (have != round_to(c_.copy_type, bits_f32(buf_[kParam].get(k, i)))) {
            buf_[kParam].set(k, i, f32_bits(widen(c_.copy_type, have)));
          }
        }
      }
      AdamTensor t;
      t.param = static_cast<float*>(buf_[kParam].at(k));
      t.grad = buf_[kGrad].at(k);
      t.grad_type = c_.grad_type;
      t.exp_avg = static_cast<float*>(buf_[kM].at(k));
      t.exp_avg_sq = static_cast<float*>(buf_[kV].at(k));
      t.max_exp_avg_sq = has_[kVmax] ? static_cast<float*>(buf_[kVmax].at(k)) : nullptr;
      t.param_copy = has_[kCopy] ? buf_[kCopy].at(k) : nullptr;
      t.copy_type = c_.copy_type;
      t.numel = numels_[k];
      adam_range_scalar(s, t, 0, numels_[k]);
    }
  }

  // Every element of every array against `ref`, and the canaries.
  void expect_same(const Model& ref, const std::string& where) const {
    for (int a = 0; a < kArrays; ++a) {
      if (!has_[a]) continue;
      const std::string at = where + ", " + kArrayNames[a];
      EXPECT_EQ(buf_[a].touched_canaries(), 0) << at << ": bytes outside the tensors";
      for (size_t k = 0; k < numels_.size(); ++k) {
        int64_t differ = 0, first = -1;
        for (int64_t i = 0; i < numels_[k]; ++i) {
          if (buf_[a].get(k, i) != ref.buf_[a].get(k, i) && differ++ == 0) first = i;
        }
        EXPECT_EQ(differ, 0) << at << ", tensor " << k << " (numel " << numels_[k]
                             << "): first at [" << first << "]";
      }
    }
  }

 private:
  std::vector<int64_t> numels_;
  Config c_;
  std::array<CanaryBuffer, kArrays> buf_;
  std::array<bool, kArrays> has_{};
};

// Three steps of the kernel on `leads`/`packed` against core on aligned arrays: junk copies
// without refresh, then refresh after edits, then refresh with nothing edited.
void run(const std::vector<int64_t>& numels, const Config& c, const Leads& leads, bool packed) {
  Model sim(numels, c, leads, packed), ref(numels, c, Leads{}, false);
  for (int step = 1; step <= 3; ++step) {
    AdamHyper h;
    h.lr = 1e-2;
    h.weight_decay = 0.1;
    h.decoupled = step != 2;  // AdamW, and Adam with an L2 term
    h.amsgrad = c.amsgrad;
    h.step = step;
    const AdamScalars s = adam_scalars(h);
    const bool refresh = step > 1 && c.copy_type != DType::kNone;
    if (step == 2 && refresh) {
      sim.edit_copies(step);
      ref.edit_copies(step);
    }
    sim.set_grads(step);
    ref.set_grads(step);
    std::vector<cuda::AdamTensorPtrs> p = sim.ptrs();
    const cudaError_t err = cuda::adam_step(p.data(), static_cast<int>(p.size()), c.grad_type,
                                            c.copy_type, s, nullptr, nullptr, refresh);
    ASSERT_EQ(err, cudaSuccess) << cudasim::last_error_message();
    ref.step_core(s, refresh);
    sim.expect_same(ref, "step " + std::to_string(step));
    if (::testing::Test::HasFailure()) return;
  }
}

constexpr DType kCopyTypes[] = {DType::kNone, DType::kFloat32, DType::kBFloat16, DType::kFloat16};

const std::vector<int64_t> kRagged = {1, 2, 3, 4, 5, 7, 8, 1023, kChunk + 3, 2 * kChunk - 1};

using DtypeParam = std::tuple<DType, DType>;

class AdamKernelVec : public ::testing::TestWithParam<DtypeParam> {};

// Aligned arrays: the vector path, then a scalar tail of 0 to 3 elements.
TEST_P(AdamKernelVec, AlignedRaggedSizes) {
  const auto [g, c] = GetParam();
  run(kRagged, {g, c}, Leads{}, false);
}

// Every array one element past its boundary (views at an odd offset): the scalar path.
TEST_P(AdamKernelVec, EveryArrayAtAnOddOffset) {
  const auto [g, c] = GetParam();
  run(kRagged, {g, c}, Leads{1, 1, 1, 1, 1, 1}, false);
}

// Tensors back to back in one buffer per array, as in a flat shard: some tensors start aligned,
// others 1 to 3 elements off; then the arrays disagree on which (grads and copies shifted).
TEST_P(AdamKernelVec, PackedBackToBack) {
  const auto [g, c] = GetParam();
  const std::vector<int64_t> numels = {3, 5, 4, 1000, 7, 8, kChunk + 1, 2, 9};
  run(numels, {g, c}, Leads{}, true);
  run(numels, {g, c}, Leads{0, 2, 0, 0, 0, 1}, true);
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, AdamKernelVec,
                         ::testing::Combine(::testing::ValuesIn(kInputDtypes),
                                            ::testing::ValuesIn(kCopyTypes)),
                         [](const ::testing::TestParamInfo<DtypeParam>& info) {
                           return std::string("Grad") + dtype_name(std::get<0>(info.param)) +
                                  "_Copy" + dtype_name(std::get<1>(info.param));
                         });

// One array off while the others are aligned, for each array in turn: 1 element, and the
// offsets that are aligned for a narrower access but not for the vector (fp32 arrays 2
// elements = 8 bytes, 16-bit arrays 2 elements = 4 bytes).
TEST(AdamKernelVecOneArray, EachArrayMisalignedAlone) {
  for (const Config& c :
       {Config{DType::kBFloat16, DType::kBFloat16}, Config{DType::kFloat16, DType::kFloat16},
        Config{DType::kFloat32, DType::kFloat32}}) {
    for (int a = 0; a < kArrays; ++a) {
      for (int lead : {1, 2}) {
        SCOPED_TRACE(std::string(kArrayNames[a]) + " " + std::to_string(lead) +
                     " elements off, grad " + dtype_name(c.grad_type) + ", copy " +
                     dtype_name(c.copy_type));
        Leads leads{};
        leads[a] = lead;
        run({6, kChunk + 5}, c, leads, false);
        if (HasFailure()) return;
      }
    }
  }
}

// bf16/fp16 weights with fp32 masters, amsgrad off (the common mixed-precision step), tiny.
TEST(AdamKernelVecOneArray, TinyMixedPrecisionTensors) {
  for (DType copy : {DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(dtype_name(copy));
    run({1, 2, 3, 4, 5, 6, 7, 8, 9}, {copy, copy, false}, Leads{}, true);
    run({1, 2, 3, 4, 5, 6, 7, 8, 9}, {copy, copy, false}, Leads{}, false);
    if (HasFailure()) return;
  }
}

}  // namespace
}  // namespace tierlift
