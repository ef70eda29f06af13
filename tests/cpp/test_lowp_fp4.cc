#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "core/lowp/fp4.h"
#include "core/lowp/fp4_quant.h"
#include "core/lowp/fp8.h"

namespace tierlift {
namespace {

// rows * cols standard-normal values, reproducible from `seed`.
std::vector<float> normal_values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = normal(rng);
  return x;
}

const float kGrid[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};

TEST(LowpFp4Codec, EveryCodeDecodesAndRoundTrips) {
  for (int c = 0; c < 16; ++c) {
    const float v = fp4::e2m1_decode(static_cast<uint8_t>(c));
    EXPECT_EQ(std::fabs(v), kGrid[c & 7]) << c;
    EXPECT_EQ(std::signbit(v), c >= 8) << c;
    EXPECT_EQ(fp4::e2m1_encode_rne(v), c) << c;
    EXPECT_EQ(fp4::e2m1_encode_sr(v, 0.f), c) << c;  // grid points never move
  }
}

TEST(LowpFp4Codec, RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(fp4::e2m1_encode_rne(0.25f), 0);  // tie -> 0 (even)
  EXPECT_EQ(fp4::e2m1_encode_rne(0.2500001f), 1);
  EXPECT_EQ(fp4::e2m1_encode_rne(0.75f), 2);  // tie -> 1.0
  EXPECT_EQ(fp4::e2m1_encode_rne(1.25f), 2);  // tie -> 1.0
  EXPECT_EQ(fp4::e2m1_encode_rne(1.75f), 4);  // tie -> 2.0
  EXPECT_EQ(fp4::e2m1_encode_rne(2.5f), 4);
  EXPECT_EQ(fp4::e2m1_encode_rne(3.5f), 6);
  EXPECT_EQ(fp4::e2m1_encode_rne(5.f), 6);
  EXPECT_EQ(fp4::e2m1_encode_rne(5.0001f), 7);
  EXPECT_EQ(fp4::e2m1_encode_rne(1e30f), 7);
  EXPECT_EQ(fp4::e2m1_encode_rne(-std::numeric_limits<float>::infinity()), 15);
  EXPECT_EQ(fp4::e2m1_encode_rne(std::numeric_limits<float>::quiet_NaN()), 0);
  EXPECT_EQ(fp4::e2m1_encode_rne(-0.1f), 8);
}

// The E2M1 RNE encode written the obvious way: the grid value nearest to |v| (distances in
// double: exact near every midpoint, where neighbours are within a factor 2), ties to the even
// code, 6 and above (Inf included) -> 6, the sign bit copied, NaN -> +0.
uint8_t nearest_e2m1(float v) {
  if (std::isnan(v)) return 0;
  const uint8_t sign = std::signbit(v) ? 8 : 0;
  const double a = std::fabs(static_cast<double>(v));
  if (a >= 6.) return sign | 7;  // far above 6, double distances to 4 and 6 round alike
  int best = 0;
  for (int c = 1; c < 8; ++c) {
    const double d = std::fabs(a - kGrid[c]), d_best = std::fabs(a - kGrid[best]);
    if (d < d_best || (d == d_best && c % 2 == 0)) best = c;
  }
  return static_cast<uint8_t>(sign | best);
}

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Compares the encode with nearest_e2m1 on bit patterns lo, lo + stride, .. <= hi, both signs;
// returns the mismatches (the first few are reported).
int64_t encode_mismatches(uint32_t lo, uint32_t hi, uint32_t stride) {
  int64_t bad = 0;
  for (uint64_t u = lo; u <= hi; u += stride) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      const float v = bits_float(static_cast<uint32_t>(u) | sign);
      const uint8_t got = fp4::e2m1_encode_rne(v), want = nearest_e2m1(v);
      if (got != want && ++bad <= 5) {
        ADD_FAILURE() << std::hex << "bits 0x" << (static_cast<uint32_t>(u) | sign) << ": 0x"
                      << int{got} << " != 0x" << int{want};
      }
    }
  }
  return bad;
}

TEST(LowpFp4Codec, EncodeMatchesNearestGridValue) {
  // Every float with |v| in [2^-3, 8] (where the codes change), both signs.
  EXPECT_EQ(encode_mismatches(float_bits(0.125f), float_bits(8.f), 1), 0);
  // Every other magnitude, strided (the prime stride walks all low-bit residues).
  EXPECT_EQ(encode_mismatches(0, 0x7fffffffu, 4099), 0);
  // Each grid point and midpoint +- 4 ulp, the subnormal and overflow edges, the specials.
  std::vector<float> edges = {0.f,
                              std::numeric_limits<float>::denorm_min(),
                              std::numeric_limits<float>::min(),
                              std::numeric_limits<float>::max(),
                              std::numeric_limits<float>::infinity(),
                              16777216.f,
                              8388608.f};
  for (int c = 0; c < 8; ++c) {
    edges.push_back(kGrid[c]);
    if (c < 7) edges.push_back(0.5f * (kGrid[c] + kGrid[c + 1]));
  }
  for (float e : edges) {
    const uint32_t u = float_bits(e);
    EXPECT_EQ(encode_mismatches(u < 4 ? 0 : u - 4, u > 0x7f7ffffbu ? 0x7f800000u : u + 4, 1), 0)
        << e;
  }
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0xffc00000u, 0xffffffffu}) {
    EXPECT_EQ(fp4::e2m1_encode_rne(bits_float(nan)), 0) << std::hex << nan;
  }
}

// All 2^32 inputs (~25 s optimized): --gtest_also_run_disabled_tests --gtest_filter='*AllFloats*'
TEST(LowpFp4Codec, DISABLED_EncodeMatchesNearestGridValueOnAllFloats) {
  EXPECT_EQ(encode_mismatches(0, 0x7fffffffu, 1), 0);
}

TEST(LowpFp4Codec, E4M3MatchesFp8Encode) {
  for (int c = 0; c < 0x7f; ++c) {
    const float v = fp8_decode(static_cast<uint8_t>(c), Fp8Format::kE4M3);
    EXPECT_EQ(fp4::e4m3_decode_nonneg(static_cast<uint8_t>(c)), v);
    EXPECT_EQ(fp4::e4m3_encode_nonneg(v), c);
    const float next = c < 0x7e ? fp8_decode(static_cast<uint8_t>(c + 1), Fp8Format::kE4M3) : 500.f;
    const float mid = 0.5f * (v + next);
    for (float w : {mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e9f)}) {
      EXPECT_EQ(fp4::e4m3_encode_nonneg(w), fp8_encode(w, Fp8Format::kE4M3)) << w;
    }
  }
  EXPECT_EQ(fp4::e4m3_encode_nonneg(1e30f), 0x7e);
  EXPECT_TRUE(std::isnan(fp4::e4m3_decode_nonneg(fp4::kE4M3Nan)));
}

TEST(LowpFp4Scale, NanScales) {
  EXPECT_TRUE(std::isnan(fp4::e8m0_decode(fp4::kE8M0Nan)));
  EXPECT_EQ(fp4::e8m0_decode(254), std::ldexp(1.f, 127));
  EXPECT_EQ(fp4::e8m0_decode(0), std::ldexp(1.f, -127));
  const float st = fp4::nv_tensor_scale(10.f);
  EXPECT_EQ(fp4::nv_scale_code(std::numeric_limits<float>::infinity(), st), fp4::kE4M3Nan);
  EXPECT_TRUE(std::isnan(fp4::nv_multiplier(fp4::kE4M3Nan, st)));
  EXPECT_EQ(fp4::nv_multiplier(0, st), 0.f);  // all-zero block
}

TEST(LowpFp4Scale, E8M0Rules) {
  using fp4::ScaleRule;
  EXPECT_EQ(fp4::mx_exponent(6.f, ScaleRule::kFloor), 0);  // floor(log2 6) - 2 = 0
  EXPECT_EQ(fp4::mx_exponent(8.f, ScaleRule::kFloor), 1);
  EXPECT_EQ(fp4::mx_exponent(7.99f, ScaleRule::kFloor), 0);  // 7.99 saturates to 6
  EXPECT_EQ(fp4::mx_exponent(6.f, ScaleRule::kRceil), 0);    // 6/6 = 1 = 2^0
  EXPECT_EQ(fp4::mx_exponent(6.01f, ScaleRule::kRceil), 1);
  EXPECT_EQ(fp4::mx_exponent(3.f, ScaleRule::kRceil), -1);
  EXPECT_EQ(fp4::mx_exponent(0.f, ScaleRule::kFloor), -127);
  EXPECT_EQ(fp4::mx_exponent(1e-45f, ScaleRule::kFloor), -127);  // subnormal clamps
  EXPECT_EQ(fp4::mx_exponent(std::numeric_limits<float>::max(), ScaleRule::kFloor), 125);
  EXPECT_EQ(fp4::mx_exponent(std::numeric_limits<float>::max(), ScaleRule::kRceil), 126);
  EXPECT_EQ(fp4::pow2(-127), std::ldexp(1.f, -127));
  EXPECT_EQ(fp4::pow2(-149), std::ldexp(1.f, -149));
}

TEST(LowpFp4Hadamard, OrthogonalAndSelfInverse) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (int n : {16, 32}) {
    std::vector<float> x(n), y(n);
    double nx = 0, ny = 0;
    for (int i = 0; i < n; ++i) nx += (x[i] = nd(rng)) * x[i];
    y = x;
    fp4::hadamard_block(y.data(), n, 0);
    for (int i = 0; i < n; ++i) ny += y[i] * y[i];
    EXPECT_NEAR(nx, ny, 1e-4 * nx);
    fp4::hadamard_block(y.data(), n, 0);
    for (int i = 0; i < n; ++i) EXPECT_NEAR(y[i], x[i], 1e-5f);
    // Columns of H: transform of unit vectors, mutually orthogonal.
    std::vector<float> e1(n, 0.f), e2(n, 0.f);
    e1[3] = 1.f;
    e2[n - 1] = 1.f;
    fp4::hadamard_block(e1.data(), n, 0b101u);
    fp4::hadamard_block(e2.data(), n, 0b101u);
    double dot = 0;
    for (int i = 0; i < n; ++i) dot += e1[i] * e2[i];
    EXPECT_NEAR(dot, 0.0, 1e-6);
  }
}

TEST(LowpFp4Philox, KnownAnswer) {
  // Random123's philox4x32-10 known-answer vector (counter 0, key 0).
  EXPECT_EQ(fp4::philox_word(0, 0, 0), 0x6627e8d5u);
  EXPECT_EQ(fp4::philox_word(0, 0, 1), 0xe169c58du);
  EXPECT_EQ(fp4::philox_word(0, 0, 2), 0xbc57ac4cu);
  EXPECT_EQ(fp4::philox_word(0, 0, 3), 0x9b00dbd8u);
}

TEST(LowpFp4Sr, UnbiasedWithinStatedBound) {
  // E[decode(sr(v))] = v. For N draws the mean's std dev is <= step / (2 sqrt N); we allow 5x.
  const int n = 200000;
  for (float v : {0.1f, 0.7f, 1.3f, 2.2f, 3.9f, 5.5f, -4.6f}) {
    double sum = 0;
    for (int i = 0; i < n; ++i)
      sum += fp4::e2m1_decode(fp4::e2m1_encode_sr(v, fp4::philox_uniform(7, 0, i)));
    const float step = std::fabs(v) < 2.f ? 0.5f : (std::fabs(v) < 4.f ? 1.f : 2.f);
    EXPECT_NEAR(sum / n, v, 5.0 * step / (2.0 * std::sqrt(static_cast<double>(n)))) << v;
  }
}

Fp8Input input(const std::vector<float>& x, int64_t rows, int64_t cols) {
  Fp8Input in;
  in.data = x.data();
  in.rows = rows;
  in.cols = cols;
  in.row_stride = cols;
  return in;
}

// fp4_quantize then fp4_dequantize of a row-major [rows, cols] matrix.
struct RoundTrip {
  std::vector<uint8_t> codes, scales, mask;
  std::vector<float> back;
  float tensor_scale = 0;
  int64_t scale_cols = 0;

  RoundTrip(const std::vector<float>& x, int64_t rows, int64_t cols, const Fp4Config& c)
      : codes(rows * cols / 2), mask(rows * cols), back(rows * cols) {
    int64_t gr;
    fp4_scale_shape(c, rows, cols, &gr, &scale_cols);
    scales.resize(gr * scale_cols);
    fp4_quantize(input(x, rows, cols), c,
                 {codes.data(), scales.data(), &tensor_scale, mask.data()});
    fp4_dequantize(codes.data(), scales.data(), tensor_scale, rows, cols, c.rule, c.block_2d,
                   back.data());
  }
};

TEST(LowpFp4Quant, MxRoundTripsGridValuesExactly) {
  const int64_t rows = 3, cols = 64;
  std::vector<float> x(rows * cols);
  for (size_t i = 0; i < x.size(); ++i) x[i] = kGrid[i % 8] * ((i % 3) ? 0.25f : -0.25f);
  for (auto rule : {fp4::ScaleRule::kFloor, fp4::ScaleRule::kRceil}) {
    Fp4Config c;
    c.rule = rule;
    std::vector<uint8_t> codes(rows * cols / 2), scales(rows * 2), mask(rows * cols);
    float ts;
    fp4_quantize(input(x, rows, cols), c, {codes.data(), scales.data(), &ts, mask.data()});
    std::vector<float> back(rows * cols);
    fp4_dequantize(codes.data(), scales.data(), ts, rows, cols, rule, false, back.data());
    for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(back[i], x[i]) << i;
    for (uint8_t m : mask) EXPECT_EQ(m, 1);
    EXPECT_EQ(scales[0], 127 - 2);  // amax 1.5 = 6 * 2^-2
  }
}

TEST(LowpFp4Quant, NvAndQuestErrorsAreSmallAndMaskMarksClipping) {
  const int64_t rows = 20, cols = 64;
  std::vector<float> x = normal_values(rows * cols, 3);
  x[5] = 40.f;  // an outlier QuEST clips
  for (auto rule : {fp4::ScaleRule::kNv, fp4::ScaleRule::kQuest}) {
    for (bool two_d : {false, true}) {
      if (two_d && rule != fp4::ScaleRule::kNv) continue;
      Fp4Config c;
      c.rule = rule;
      c.block_2d = two_d;
      const RoundTrip rt(x, rows, cols, c);
      const std::vector<float>& back = rt.back;
      const std::vector<uint8_t>& mask = rt.mask;
      double err = 0, ref = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        if (!mask[i]) continue;
        err += (back[i] - x[i]) * (back[i] - x[i]);
        ref += x[i] * x[i];
      }
      // A 16x16 block shares the outlier 40 scale with 15 other rows: coarser.
      EXPECT_LT(err / ref, two_d ? 0.15 : 0.05) << static_cast<int>(rule) << two_d;
      if (rule == fp4::ScaleRule::kQuest) {
        EXPECT_EQ(mask[5], 0);
      }
      if (rule == fp4::ScaleRule::kNv) {
        EXPECT_EQ(mask[5], 1);
      }
    }
  }
}

// A block holding a NaN or Inf gets the NaN scale and dequantizes to all NaN (E2M1 has neither);
// every other block, and the NVFP4 tensor scale, is what it would be without it.
TEST(LowpFp4Quant, NonFiniteBlocksDequantizeToNaN) {
  const int64_t rows = 20, cols = 64;
  std::vector<float> x = normal_values(rows * cols, 9);
  x[1 * cols + 5] = std::numeric_limits<float>::quiet_NaN();
  x[2 * cols + 40] = std::numeric_limits<float>::infinity();
  x[18 * cols + 63] = -std::numeric_limits<float>::infinity();
  std::vector<float> clean(x);
  for (float& v : clean) v = std::isfinite(v) ? v : 0.f;
  for (auto rule : {fp4::ScaleRule::kFloor, fp4::ScaleRule::kRceil, fp4::ScaleRule::kQuest,
                    fp4::ScaleRule::kNv}) {
    for (bool two_d : {false, true}) {
      if (two_d && rule != fp4::ScaleRule::kNv) continue;
      const int64_t b = fp4_block(rule);
      auto bad = [&](int64_t i, int64_t j) {
        auto same = [&](int64_t i2, int64_t j2) {
          return (two_d ? i / 16 == i2 / 16 : i == i2) && j / b == j2 / b;
        };
        return same(1, 5) || same(2, 40) || same(18, 63);
      };
      Fp4Config c;
      c.rule = rule;
      c.block_2d = two_d;
      const RoundTrip rt(x, rows, cols, c), rt0(clean, rows, cols, c);
      const uint8_t nan_code = rule == fp4::ScaleRule::kNv ? fp4::kE4M3Nan : fp4::kE8M0Nan;
      EXPECT_EQ(rt.tensor_scale, rt0.tensor_scale);
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < cols; ++j) {
          const int64_t k = i * cols + j;
          const uint8_t sc = rt.scales[(two_d ? i / 16 : i) * rt.scale_cols + j / b];
          if (bad(i, j)) {
            ASSERT_TRUE(std::isnan(rt.back[k])) << i << "," << j;
            ASSERT_EQ(sc, nan_code);
            ASSERT_EQ(rt.mask[k], 0);
            ASSERT_EQ((rt.codes[k / 2] >> (4 * (k & 1))) & 15, 0);
          } else {
            ASSERT_EQ(rt.back[k], rt0.back[k]) << i << "," << j;
            ASSERT_NE(sc, nan_code);
          }
        }
      }
    }
  }
}

TEST(LowpFp4Quant, RejectsBadConfigs) {
  std::vector<float> x(48, 1.f);
  std::vector<uint8_t> codes(24), scales(2);
  float ts;
  Fp4Config c;
  EXPECT_THROW(fp4_quantize(input(x, 1, 48), c, {codes.data(), scales.data(), &ts, nullptr}),
               std::invalid_argument);  // 48 % 32
  c.rule = fp4::ScaleRule::kNv;
  c.hadamard = 8;
  EXPECT_THROW(fp4_validate(input(x, 1, 48), c), std::invalid_argument);
  c.hadamard = 0;
  c.signs = 1;  // signs without a rotation
  EXPECT_THROW(fp4_validate(input(x, 1, 48), c), std::invalid_argument);
  c.signs = 0;
  c.rule = fp4::ScaleRule::kFloor;
  c.block_2d = true;
  EXPECT_THROW(fp4_validate(input(x, 1, 64), c), std::invalid_argument);
}

TEST(LowpFp4Quant, HadamardSrIsDeterministicAndOffsetShiftsTheStream) {
  const int64_t rows = 4, cols = 64;
  std::vector<float> x = normal_values(rows * cols, 5);
  auto run = [&](uint64_t seed, uint64_t offset) {
    Fp4Config c;
    c.rule = fp4::ScaleRule::kRceil;
    c.hadamard = 32;
    c.signs = 0x80000001u;
    c.stochastic = true;
    c.seed = seed;
    c.offset = offset;
    std::vector<uint8_t> codes(rows * cols / 2), scales(rows * 2);
    float ts;
    fp4_quantize(input(x, rows, cols), c, {codes.data(), scales.data(), &ts, nullptr});
    return codes;
  };
  EXPECT_EQ(run(1, 0), run(1, 0));
  EXPECT_NE(run(1, 0), run(2, 0));
  EXPECT_NE(run(1, 0), run(1, 4));
}

}  // namespace
}  // namespace tierlift
