// Out-of-place Adam steps (AdamTensor / CompactAdamTensor *_from sources): on every SIMD path,
// reading the old state from one buffer and writing the new state to another gives the bits of
// the in-place step, and leaves the sources as they were. The offloaded step relies on it: it
// reads generation g of its host state and writes generation g + 1 without copying either. Into
// vector-aligned destinations the SIMD bodies store non-temporally; both alignments are tested.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "core/optim/adam.h"
#include "core/optim/adam_compact.h"

namespace tierlift {
namespace {

std::vector<SimdLevel> levels() {
  std::vector<SimdLevel> out{SimdLevel::kScalar};
  if (cpu_simd_level() >= SimdLevel::kAvx2) out.push_back(SimdLevel::kAvx2);
  if (cpu_simd_level() >= SimdLevel::kAvx512) out.push_back(SimdLevel::kAvx512);
  return out;
}

std::vector<float> normal(int64_t n, uint32_t seed, float scale, bool positive = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = positive ? std::fabs(dist(rng)) * scale : dist(rng) * scale;
  return v;
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Destination buffers of n floats starting `shift` floats after a 64-byte boundary: shift 0 lets
// the SIMD bodies store non-temporally, any other shift takes the ordinary stores.
struct Dest {
  std::vector<float> storage;
  float* data;
  Dest(int64_t n, int shift) : storage(n + 16 + shift, -7.f) {
    const auto at = reinterpret_cast<uintptr_t>(storage.data());
    data = storage.data() + ((64 - at % 64) % 64) / sizeof(float) + shift;
  }
  std::vector<float> values(int64_t n) const { return {data, data + n}; }
};

TEST(AdamOutOfPlace, MatchesInPlaceOnEveryPath) {
  for (const int64_t n : {1, 17, 1031, 40000}) {
    for (const bool amsgrad : {false, true}) {
      for (const SimdLevel level : levels()) {
        for (const int shift : {0, 1}) {
          AdamHyper h;
          h.lr = 1e-2;
          h.weight_decay = 0.1;
          h.amsgrad = amsgrad;
          h.step = 3;
          const AdamScalars s = adam_scalars(h);
          const auto g = normal(n, 1, 0.1f);
          const auto p0 = normal(n, 2, 1.0f), m0 = normal(n, 3, 0.1f);
          const auto v0 = normal(n, 4, 0.01f, true), x0 = normal(n, 5, 0.02f, true);
          // In place.
          auto p = p0, m = m0, v = v0, x = x0;
          std::vector<uint16_t> copy(n), copy_oop(n, 0xffff);
          AdamTensor t;
          t.param = p.data();
          t.grad = g.data();
          t.exp_avg = m.data();
          t.exp_avg_sq = v.data();
          t.max_exp_avg_sq = x.data();
          t.param_copy = copy.data();
          t.copy_type = DType::kBFloat16;
          t.numel = n;
          adam_step_range(level, s, t, 0, n);
          // Out of place: the destinations start as garbage, the sources must not change.
          const auto ps = p0, ms = m0, vs = v0, xs = x0;
          Dest pdb(n, shift), mdb(n, shift), vdb(n, shift), xdb(n, shift);
          AdamTensor o = t;
          o.param = pdb.data;
          o.exp_avg = mdb.data;
          o.exp_avg_sq = vdb.data;
          o.max_exp_avg_sq = xdb.data;
          o.param_copy = copy_oop.data();
          o.param_from = ps.data();
          o.exp_avg_from = ms.data();
          o.exp_avg_sq_from = vs.data();
          o.max_exp_avg_sq_from = xs.data();
          adam_step_range(level, s, o, 0, n);
          const auto pd = pdb.values(n), md = mdb.values(n), vd = vdb.values(n), xd = xdb.values(n);
          ASSERT_TRUE(same_bits(p, pd)) << n << " " << static_cast<int>(level) << " " << shift;
          ASSERT_TRUE(same_bits(m, md));
          ASSERT_TRUE(same_bits(v, vd));
          if (amsgrad) {
            ASSERT_TRUE(same_bits(x, xd));
          }
          ASSERT_TRUE(same_bits(copy, copy_oop));
          ASSERT_TRUE(same_bits(ps, p0) && same_bits(ms, m0) && same_bits(vs, v0) &&
                      same_bits(xs, x0));
        }
      }
    }
  }
}

TEST(AdamOutOfPlace, ThreadedStepAndRefreshRefusal) {
  const int64_t n = 100000;  // several thread chunks
  AdamHyper h;
  h.step = 2;
  const auto g = normal(n, 1, 0.1f);
  auto p = normal(n, 2, 1.0f), m = normal(n, 3, 0.1f), v = normal(n, 4, 0.01f, true);
  const auto ps = p, ms = m, vs = v;
  std::vector<float> pd(n), md(n), vd(n);
  AdamTensor o;
  o.param = pd.data();
  o.grad = g.data();
  o.exp_avg = md.data();
  o.exp_avg_sq = vd.data();
  o.param_from = ps.data();
  o.exp_avg_from = ms.data();
  o.exp_avg_sq_from = vs.data();
  o.numel = n;
  adam_step(h, &o, 1);
  AdamTensor t = o;
  t.param = p.data();
  t.exp_avg = m.data();
  t.exp_avg_sq = v.data();
  t.param_from = t.exp_avg_from = t.exp_avg_sq_from = nullptr;
  adam_step(h, &t, 1);
  EXPECT_TRUE(same_bits(p, pd) && same_bits(m, md) && same_bits(v, vd));
  std::vector<uint16_t> copy(n);
  o.param_copy = copy.data();
  o.copy_type = DType::kBFloat16;
  h.refresh_from_copy = true;
  EXPECT_THROW(adam_step(h, &o, 1), std::invalid_argument);
}

TEST(AdamOutOfPlace, CompactMatchesInPlaceOnEveryPath) {
  for (const int64_t n : {256, 1000, 40960}) {
    for (const SimdLevel level : levels()) {
      AdamHyper h;
      h.lr = 1e-2;
      h.weight_decay = 0.1;
      h.step = 4;
      const AdamScalars s = adam_scalars(h);
      const auto g = normal(n, 1, 0.1f);
      const auto p0 = normal(n, 2, 1.0f), mf = normal(n, 3, 0.1f);
      const auto vf = normal(n, 4, 0.01f, true);
      std::vector<uint16_t> m0(n);
      for (int64_t i = 0; i < n; ++i) m0[i] = f32_to_bf16(mf[i]);
      const int64_t nb = compact_scale_count(n);
      std::vector<uint8_t> c0(n);
      std::vector<float> sc0(nb);
      quantize_exp_avg_sq(vf.data(), n, c0.data(), sc0.data());
      auto p = p0;
      auto m = m0;
      auto c = c0;
      auto sc = sc0;
      CompactAdamTensor t;
      t.param = p.data();
      t.grad = g.data();
      t.exp_avg = m.data();
      t.exp_avg_sq = c.data();
      t.exp_avg_sq_scale = sc.data();
      t.numel = n;
      adam_compact_step_range(level, s, t, 0, n);
      const auto ps = p0;
      const auto ms = m0;
      const auto cs = c0;
      const auto scs = sc0;
      std::vector<float> pd(n, -7.f), scd(nb, -7.f);
      std::vector<uint16_t> md(n, 0xffff);
      std::vector<uint8_t> cd(n, 3);
      CompactAdamTensor o = t;
      o.param = pd.data();
      o.exp_avg = md.data();
      o.exp_avg_sq = cd.data();
      o.exp_avg_sq_scale = scd.data();
      o.param_from = ps.data();
      o.exp_avg_from = ms.data();
      o.exp_avg_sq_from = cs.data();
      o.exp_avg_sq_scale_from = scs.data();
      adam_compact_step_range(level, s, o, 0, n);
      ASSERT_TRUE(same_bits(p, pd)) << n << " " << static_cast<int>(level);
      ASSERT_TRUE(same_bits(m, md));
      ASSERT_TRUE(same_bits(c, cd));
      ASSERT_TRUE(same_bits(sc, scd));
      ASSERT_TRUE(same_bits(ps, p0) && same_bits(ms, m0) && same_bits(cs, c0) &&
                  same_bits(scs, sc0));
    }
  }
}

}  // namespace
}  // namespace tierlift
