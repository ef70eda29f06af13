// Scales of tiny tensors (FP8, MXFP4, NVFP4): no minimum-amax clamp, so 1e-20 and 1e-30 keep
// their precision; FLT_MAX caps where the quotient overflows; amax 0 gives scale 1; NVFP4 blocks
// far below the tensor amax get the smallest E4M3 subnormal; the RCEIL/QuEST ceil is exact where
// clip / 6 is an fp32 subnormal; the QuEST rms neither underflows nor overflows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/lowp/fp4.h"
#include "core/lowp/fp4_quant.h"
#include "core/lowp/fp8.h"
#include "core/lowp/quantize.h"

namespace tierlift {
namespace {

constexpr float kFltMax = std::numeric_limits<float>::max();
const Fp8Format kFormats[] = {Fp8Format::kE4M3, Fp8Format::kE5M2};

std::vector<float> scaled_normals(int64_t n, float mag, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = normal(rng) * mag;
  return x;
}

// ||back - x|| / ||x||, in double (fp32 squares of 1e-30 underflow).
double rel_err(const std::vector<float>& back, const std::vector<float>& x) {
  double e = 0, r = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double d = static_cast<double>(back[i]) - x[i];
    e += d * d;
    r += static_cast<double>(x[i]) * x[i];
  }
  return std::sqrt(e / r);
}

TEST(LowpTinyFp8, ScaleHasNoMinimumAmax) {
  for (Fp8Format f : kFormats) {
    const float fmax = fp8_spec(f).max;
    for (float amax : {1e-20f, 1e-30f, 1e-33f}) {
      const float s = fp8_scale(amax, f, false);
      EXPECT_EQ(s, fmax / amax) << amax;
      EXPECT_EQ(fp8_decode(fp8_encode(amax * s, f), f), fmax) << amax;  // the full range is used
    }
    for (bool pow2 : {false, true}) {
      EXPECT_EQ(fp8_scale(0.f, f, pow2), 1.f);
      EXPECT_EQ(fp8_scale(1e-40f, f, pow2), pow2 ? std::ldexp(1.f, 127) : kFltMax);  // capped
    }
  }
}

TEST(LowpTinyFp8, TinyTensorsRoundTrip) {
  const int64_t rows = 40, cols = 130;
  for (float mag : {1e-20f, 1e-30f}) {
    const std::vector<float> x = scaled_normals(rows * cols, mag, 1);
    for (Fp8Format f : kFormats) {
      for (Fp8Scaling sc : {Fp8Scaling::kTensor, Fp8Scaling::kRow, Fp8Scaling::kBlock1x128}) {
        const Fp8Blocks b = fp8_blocks(sc, rows, cols);
        std::vector<uint8_t> q(x.size());
        std::vector<float> scales(b.grid_rows * b.grid_cols), back(x.size());
        fp8_quantize(Fp8Input{x.data(), DType::kFloat32, rows, cols, cols, 1}, sc, f, true,
                     q.data(), scales.data());
        fp8_dequantize(q.data(), rows, cols, sc, f, scales.data(), back.data());
        EXPECT_LT(rel_err(back, x), f == Fp8Format::kE4M3 ? 0.04 : 0.08) << mag;
      }
    }
  }
}

TEST(LowpTinyFp4, NvTensorAndBlockScales) {
  EXPECT_EQ(fp4::nv_tensor_scale(0.f), 1.f);
  EXPECT_EQ(fp4::nv_tensor_scale(1e-30f), 2688.f / 1e-30f);
  EXPECT_EQ(fp4::nv_tensor_scale(1e-38f), fp4::kNvMaxTensorScale);
  EXPECT_EQ(fp4::kNvMaxTensorScale, kFltMax / 512.f);
  EXPECT_EQ(fp4::nv_multiplier(1, fp4::kNvMaxTensorScale), kFltMax);  // s_t / 2^-9: finite
  const float st = fp4::nv_tensor_scale(1.f);
  EXPECT_EQ(fp4::nv_scale_code(1e-6f, st), 1);  // 448e-6 < 2^-10 would round to 0
  EXPECT_EQ(fp4::nv_scale_code(1e-30f, st), 1);
  EXPECT_EQ(fp4::nv_scale_code(0.f, st), 0);
  EXPECT_EQ(fp4::nv_scale_code(1.f, st), 0x7e);  // 448
}

TEST(LowpTinyFp4, RceilCeilIsExactWhereClipOverSixIsSubnormal) {
  using fp4::ScaleRule;
  const float t = std::ldexp(1.f, -126);
  // 3 * 2^-126 + 2^-148: / 6 = 2^-127 + 2^-150.6 rounds onto 2^-127, yet needs 2^-126.
  EXPECT_EQ(fp4::mx_exponent(3.f * t + std::ldexp(1.f, -148), ScaleRule::kRceil), -126);
  EXPECT_EQ(fp4::mx_exponent(3.f * t, ScaleRule::kRceil), -127);
  EXPECT_EQ(fp4::mx_exponent(6.f * t, ScaleRule::kRceil), -126);
  EXPECT_EQ(fp4::mx_exponent(6.f * t + std::ldexp(1.f, -147), ScaleRule::kRceil), -125);
  EXPECT_EQ(fp4::mx_exponent(t, ScaleRule::kRceil), -127);
  EXPECT_EQ(fp4::mx_exponent(std::ldexp(1.f, -149), ScaleRule::kQuest), -127);
  EXPECT_EQ(fp4::mx_exponent(std::numeric_limits<float>::infinity(), ScaleRule::kQuest), 127);
}

TEST(LowpTinyFp4, QuestRmsNeitherUnderflowsNorOverflows) {
  for (float v : {1e-30f, 3e-25f, 1.f, 1e20f, 3e37f}) {
    std::vector<float> x(32, v);
    x[5] = -v;
    EXPECT_EQ(fp4::block_rms(x.data(), 32, v), v) << v;
  }
  const std::vector<float> x = scaled_normals(32, 1.f, 4);
  float amax = 0.f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  std::vector<float> tiny(32);
  for (int i = 0; i < 32; ++i) tiny[i] = std::ldexp(x[i], -100);
  EXPECT_EQ(fp4::block_rms(tiny.data(), 32, std::ldexp(amax, -100)),
            std::ldexp(fp4::block_rms(x.data(), 32, amax), -100));
}

TEST(LowpTinyFp4, TinyTensorsRoundTripInEveryRule) {
  const int64_t rows = 8, cols = 64;
  for (float mag : {1e-20f, 1e-30f}) {
    const std::vector<float> x = scaled_normals(rows * cols, mag, 2);
    for (auto rule : {fp4::ScaleRule::kFloor, fp4::ScaleRule::kRceil, fp4::ScaleRule::kQuest,
                      fp4::ScaleRule::kNv}) {
      Fp4Config c;
      c.rule = rule;
      int64_t gr, gc;
      fp4_scale_shape(c, rows, cols, &gr, &gc);
      std::vector<uint8_t> codes(x.size() / 2), scales(gr * gc);
      std::vector<float> back(x.size());
      float ts = 0.f;
      fp4_quantize(Fp8Input{x.data(), DType::kFloat32, rows, cols, cols, 1}, c,
                   {codes.data(), scales.data(), &ts, nullptr});
      fp4_dequantize(codes.data(), scales.data(), ts, rows, cols, rule, false, back.data());
      EXPECT_LT(rel_err(back, x), 0.2) << mag << " rule " << static_cast<int>(rule);
    }
  }
}

}  // namespace
}  // namespace tierlift
