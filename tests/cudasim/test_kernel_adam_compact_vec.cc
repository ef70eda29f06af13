// The two layouts of tierlift::cuda::adam_compact_step (csrc/cuda/adam_compact.cu) at their
// edges, in the CPU simulator, bit for bit against core's scalar kernel. The kernel steps a
// whole code block of a tensor whose arrays are all aligned with 16-byte accesses (8-byte for
// the v codes), 8 consecutive elements per lane; a tensor with any array off, and the last
// partial code block of every tensor, take the scalar layout. Here arrays start at chosen
// element offsets from a 64-byte boundary (views at odd offsets; one array off while the others
// are not, including offsets aligned for a narrower access only, and fp32 arrays 16 bytes off,
// which the vector path takes), tensors are packed back to back as in a flat shard, numels are
// tiny, below one code block, and not multiples of 8 or 256; every grad and copy dtype; AMP
// unscaling on and off; copies refreshed after edits and not. A NaN or infinite v in one lane's
// 8 elements must turn its whole code block NaN (scale NaN, every code 255) on either layout.
// Every byte around each tensor is a canary the kernel must not touch; in the sanitizer build,
// UBSan's alignment check fails any vector access the alignment test let through wrongly.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
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
#include "tests/cudasim/canary_buffer.h"
#include "tests/cudasim/dtypes.h"

namespace tierlift {
namespace {

using cudasim_test::CanaryBuffer;
using cudasim_test::dtype_name;
using cudasim_test::kInputDtypes;
using cudasim_test::round_to;
using cudasim_test::widen;

constexpr int64_t kChunk = int64_t{1} << 16;  // elements per CUDA block in adam_compact.cu
constexpr int64_t kGuard = 32;                // canary elements around each tensor

enum Array { kParam, kGrad, kM, kCodes, kScales, kCopy, kArrays };
const char* const kArrayNames[kArrays] = {"param",  "grad", "exp_avg", "exp_avg_sq codes",
                                          "scales", "copy"};

// The first element of each array, in elements past a 64-byte boundary.
using Leads = std::array<int, kArrays>;

struct Config {
  DType grad_type = DType::kFloat32;
  DType copy_type = DType::kNone;
};

// Every code block b with b % 4 == 2 is all zeros: m, v and gradients.
bool dead(int64_t i) { return (i / kCompactBlock) % 4 == 2; }

// Every tensor's arrays at the given leads; the same values whatever the layout.
class Model {
 public:
  Model(const std::vector<int64_t>& numels, const Config& c, const Leads& leads, bool packed)
      : numels_(numels), c_(c) {
    std::vector<int64_t> scale_counts;
    for (int64_t n : numels) scale_counts.push_back(compact_scale_count(n));
    const int elems[kArrays] = {4, c.grad_type == DType::kFloat32 ? 4 : 2, 2, 1,
                                4, c.copy_type == DType::kFloat32 ? 4 : 2};
    for (int a = 0; a < kArrays; ++a) {
      if (a == kCopy && c.copy_type == DType::kNone) continue;
      buf_[a] =
          CanaryBuffer(elems[a], a == kScales ? scale_counts : numels, leads[a], packed, kGuard);
      has_[a] = true;
    }
    for (size_t k = 0; k < numels.size(); ++k) {
      const int64_t n = numels[k];
      std::mt19937 rng(static_cast<uint32_t>(23 + k));
      std::normal_distribution<float> normal(0.f, 1.f);
      std::uniform_real_distribution<float> expo(-14.f, 2.f);
      std::vector<float> v(n);
      for (int64_t i = 0; i < n; ++i) {
        buf_[kParam].set(k, i, f32_bits(normal(rng)));
        buf_[kM].set(k, i, dead(i) ? 0 : f32_to_bf16(normal(rng) * 1e-3f));
        v[i] = dead(i) || i % 29 == 0 ? 0.f : std::exp2(2 * expo(rng));
        // Junk before the first step, which does not refresh: it must not matter.
        if (has_[kCopy]) buf_[kCopy].set(k, i, round_to(c.copy_type, 0.5f));
      }
      std::vector<uint8_t> codes(n);
      std::vector<float> scales(compact_scale_count(n));
      quantize_exp_avg_sq(v.data(), n, codes.data(), scales.data());
      for (int64_t i = 0; i < n; ++i) buf_[kCodes].set(k, i, codes[i]);
      for (size_t b = 0; b < scales.size(); ++b) buf_[kScales].set(k, b, f32_bits(scales[b]));
    }
  }

  void set_grads(int step) {
    for (size_t k = 0; k < numels_.size(); ++k) {
      std::mt19937 rng(static_cast<uint32_t>(7919 * step + k));
      std::normal_distribution<float> normal(0.f, 1.f);
      std::uniform_real_distribution<float> expo(-14.f, 2.f);
      for (int64_t i = 0; i < numels_[k]; ++i) {
        const float g = dead(i) || i % 31 == 0 ? 0.f : normal(rng) * std::exp2(expo(rng));
        set_grad(k, i, g);
      }
    }
  }
  void set_grad(size_t k, int64_t i, float g) { buf_[kGrad].set(k, i, round_to(c_.grad_type, g)); }

  // What a user does to the weights between steps (a new value, the other sign, the next
  // representable value) on three elements in seven; the others keep the master's rounding.
  void edit_copies(int round) {
    const uint32_t sign = c_.copy_type == DType::kFloat32 ? 0x80000000u : 0x8000u;
    for (size_t k = 0; k < numels_.size(); ++k) {
      for (int64_t i = 0; i < numels_[k]; ++i) {
        const uint32_t mine = round_to(c_.copy_type, bits_f32(buf_[kParam].get(k, i)));
        const int64_t r = (i + round) % 7;
        if (r == 0) buf_[kCopy].set(k, i, round_to(c_.copy_type, bits_f32(mine) * 0.5f + 0.25f));
        if (r == 1) buf_[kCopy].set(k, i, mine ^ sign);
        if (r == 2) buf_[kCopy].set(k, i, mine + 1);
      }
    }
  }

  std::vector<cuda::CompactAdamTensorPtrs> ptrs() {
    std::vector<cuda::CompactAdamTensorPtrs> out;
    for (size_t k = 0; k < numels_.size(); ++k) {
      out.push_back({static_cast<float*>(buf_[kParam].at(k)), buf_[kGrad].at(k),
                     static_cast<uint16_t*>(buf_[kM].at(k)),
                     static_cast<uint8_t*>(buf_[kCodes].at(k)),
                     static_cast<float*>(buf_[kScales].at(k)),
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
      CompactAdamTensor t;
      t.param = static_cast<float*>(buf_[kParam].at(k));
      t.grad = buf_[kGrad].at(k);
      t.grad_type = c_.grad_type;
      t.exp_avg = static_cast<uint16_t*>(buf_[kM].at(k));
      t.exp_avg_sq = static_cast<uint8_t*>(buf_[kCodes].at(k));
      t.exp_avg_sq_scale = static_cast<float*>(buf_[kScales].at(k));
      t.param_copy = has_[kCopy] ? buf_[kCopy].at(k) : nullptr;
      t.copy_type = c_.copy_type;
      t.numel = numels_[k];
      adam_compact_range_scalar(s, t, 0, numels_[k]);
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
        for (int64_t i = 0; i < buf_[a].count(k); ++i) {
          if (buf_[a].get(k, i) != ref.buf_[a].get(k, i) && differ++ == 0) first = i;
        }
        EXPECT_EQ(differ, 0) << at << ", tensor " << k << " (numel " << numels_[k]
                             << "): first at [" << first << "]";
      }
    }
  }

  float scale(size_t k, int64_t b) const { return bits_f32(buf_[kScales].get(k, b)); }
  uint32_t code(size_t k, int64_t i) const { return buf_[kCodes].get(k, i); }

 private:
  std::vector<int64_t> numels_;
  Config c_;
  std::array<CanaryBuffer, kArrays> buf_;
  std::array<bool, kArrays> has_{};
};

// One step's hyperparameters and whether it refreshes from edited copies.
struct Step {
  bool decoupled = true;
  bool maximize = false;
  float grad_scale = 0.f;  // > 0: AMP, the gradients are unscaled by it
  bool refresh = false;
  bool edit = false;
};

// AdamW plain; Adam with an L2 term, unscaled, refreshed after edits; AdamW maximizing,
// unscaled by a scale below one, refreshed with nothing edited.
const Step kSteps[] = {{true, false, 0.f, false, false},
                       {false, false, 1000.f, true, true},
                       {true, true, 0.375f, true, false}};

AdamScalars scalars(const Step& st, int step) {
  AdamHyper h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  h.decoupled = st.decoupled;
  h.maximize = st.maximize;
  h.step = step;
  h.unscale = st.grad_scale > 0.f;
  h.grad_scale = h.unscale ? st.grad_scale : 1.f;
  return adam_scalars(h);
}

// One kernel step of `sim` and core's of `ref`.
void step_both(Model& sim, Model& ref, const Config& c, const Step& st, int step) {
  const AdamScalars s = scalars(st, step);
  const bool refresh = st.refresh && c.copy_type != DType::kNone;
  std::vector<cuda::CompactAdamTensorPtrs> p = sim.ptrs();
  // The kernel reads the scale through a pointer (device memory on a GPU), core by value.
  const float grad_scale = st.grad_scale;
  const cudaError_t err =
      cuda::adam_compact_step(p.data(), static_cast<int>(p.size()), c.grad_type, c.copy_type, s,
                              nullptr, grad_scale > 0.f ? &grad_scale : nullptr, refresh);
  ASSERT_EQ(err, cudaSuccess) << cudasim::last_error_message();
  ref.step_core(s, refresh);
}

// Three steps (kSteps) of the kernel on `leads`/`packed` against core on aligned arrays.
void run(const std::vector<int64_t>& numels, const Config& c, const Leads& leads, bool packed) {
  Model sim(numels, c, leads, packed), ref(numels, c, Leads{}, false);
  for (int step = 1; step <= 3; ++step) {
    const Step& st = kSteps[step - 1];
    if (st.edit && c.copy_type != DType::kNone) {
      sim.edit_copies(step);
      ref.edit_copies(step);
    }
    sim.set_grads(step);
    ref.set_grads(step);
    step_both(sim, ref, c, st, step);
    sim.expect_same(ref, "step " + std::to_string(step));
    if (::testing::Test::HasFailure()) return;
  }
}

constexpr DType kCopyTypes[] = {DType::kNone, DType::kFloat32, DType::kBFloat16, DType::kFloat16};

// Below one code block, around one, not multiples of 8 or of 256.
const std::vector<int64_t> kRagged = {1, 7, 8, 9, 200, 255, 256, 257, 263, 1000, 2056};

using DtypeParam = std::tuple<DType, DType>;

class AdamCompactVec : public ::testing::TestWithParam<DtypeParam> {};

// Aligned arrays: whole code blocks on the vector path, partial ones on the scalar layout.
// And a second chunk that ends in a partial code block.
TEST_P(AdamCompactVec, AlignedRaggedSizes) {
  const auto [g, c] = GetParam();
  std::vector<int64_t> numels = kRagged;
  numels.push_back(kChunk + 264);
  run(numels, {g, c}, Leads{}, false);
}

// Every array one element past its boundary (views at an odd offset): the scalar layout.
TEST_P(AdamCompactVec, EveryArrayAtAnOddOffset) {
  const auto [g, c] = GetParam();
  run(kRagged, {g, c}, Leads{1, 1, 1, 1, 1, 1}, false);
}

// Tensors back to back in one buffer per array, as in a flat shard: tensors after a numel that
// is not a multiple of 8 start off; then the arrays disagree on which (grads and copies shifted).
TEST_P(AdamCompactVec, PackedBackToBack) {
  const auto [g, c] = GetParam();
  const std::vector<int64_t> numels = {256, 3, 512, 5, 1024, 8, 2056, 2, 768};
  run(numels, {g, c}, Leads{}, true);
  run(numels, {g, c}, Leads{0, 8, 0, 0, 0, 4}, true);
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, AdamCompactVec,
                         ::testing::Combine(::testing::ValuesIn(kInputDtypes),
                                            ::testing::ValuesIn(kCopyTypes)),
                         [](const ::testing::TestParamInfo<DtypeParam>& info) {
                           return std::string("Grad") + dtype_name(std::get<0>(info.param)) +
                                  "_Copy" + dtype_name(std::get<1>(info.param));
                         });

// One array off while the others are aligned, for each array in turn: 1, 2 and 4 elements.
// fp32 arrays 4 elements off are 16-byte aligned, which the vector path takes; every other
// offset is aligned for a narrower access only (16-bit arrays 8 bytes off, codes 4 bytes off).
TEST(AdamCompactVecOneArray, EachArrayMisalignedAlone) {
  for (const Config& c :
       {Config{DType::kBFloat16, DType::kBFloat16}, Config{DType::kFloat16, DType::kFloat32},
        Config{DType::kFloat32, DType::kFloat16}}) {
    for (int a = 0; a < kArrays; ++a) {
      for (int lead : {1, 2, 4}) {
        SCOPED_TRACE(std::string(kArrayNames[a]) + " " + std::to_string(lead) +
                     " elements off, grad " + dtype_name(c.grad_type) + ", copy " +
                     dtype_name(c.copy_type));
        Leads leads{};
        leads[a] = lead;
        run({263, 2061}, c, leads, false);
        if (HasFailure()) return;
      }
    }
  }
}

// A NaN gradient in one lane's 8 elements of a whole code block (block 1: lane 5 on the vector
// path), an infinite one in the partial last block, a finite one whose v overflows in block 4,
// and an all-zero block 2: each poisoned block reads back NaN on both sides (scale NaN, all 256
// codes 255, or every code of the partial block), the others stay finite, the zero block zero.
TEST(AdamCompactVecOneArray, NonFiniteVInOneLanePoisonsItsWholeBlock) {
  const int64_t n = 5 * kCompactBlock + 20;
  const int64_t nan_at = kCompactBlock + 8 * 5 + 3, inf_at = 5 * kCompactBlock + 7;
  const int64_t overflow_at = 4 * kCompactBlock + 8 * 31;
  for (const Leads& leads : {Leads{}, Leads{1, 1, 1, 1, 1, 1}}) {
    for (DType g : kInputDtypes) {
      SCOPED_TRACE(std::string("grad ") + dtype_name(g) + (leads[0] ? ", scalar" : ", vector"));
      const Config c{g, DType::kBFloat16};
      Model sim({n}, c, leads, false), ref({n}, c, Leads{}, false);
      for (int step = 1; step <= 2; ++step) {
        sim.set_grads(step);
        ref.set_grads(step);
        for (Model* m : {&sim, &ref}) {
          // fp16: +Inf, as the simulator's __half2float widens an fp16 NaN to another payload
          // than core's f16_to_f32 (the weight's NaN bits would differ, not the block's codes).
          m->set_grad(0, nan_at,
                      g == DType::kFloat16 ? std::numeric_limits<float>::infinity()
                                           : std::numeric_limits<float>::quiet_NaN());
          m->set_grad(0, inf_at, std::numeric_limits<float>::infinity());
          // Finite in every dtype; v = (1 - beta2) g^2 overflows only for the fp32 gradient.
          m->set_grad(0, overflow_at, g == DType::kFloat32 ? 3e38f : 60000.f);
        }
        step_both(sim, ref, c, kSteps[0], step);
        sim.expect_same(ref, "step " + std::to_string(step));
        for (int64_t b : {1, 5}) {
          EXPECT_TRUE(std::isnan(sim.scale(0, b))) << "block " << b;
          int not255 = 0;
          for (int64_t i = b * kCompactBlock; i < std::min(n, (b + 1) * kCompactBlock); ++i) {
            not255 += sim.code(0, i) != 255;
          }
          EXPECT_EQ(not255, 0) << "block " << b;
        }
        EXPECT_EQ(std::isnan(sim.scale(0, 4)), g == DType::kFloat32) << "block 4";
        EXPECT_TRUE(std::isfinite(sim.scale(0, 0)) && std::isfinite(sim.scale(0, 3)));
        EXPECT_EQ(sim.scale(0, 2), 0.f) << "the zero block";
        if (HasFailure()) return;
      }
    }
  }
}

}  // namespace
}  // namespace tierlift
