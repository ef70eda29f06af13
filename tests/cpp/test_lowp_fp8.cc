#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "core/lowp/fp8.h"
#include "core/lowp/quantize.h"

namespace tierlift {
namespace {

const Fp8Format kFormats[] = {Fp8Format::kE4M3, Fp8Format::kE5M2};

bool is_nan_code(uint8_t q, Fp8Format f) { return std::isnan(fp8_decode(q, f)); }

TEST(LowpFp8Codec, KnownValues) {
  EXPECT_EQ(fp8_encode(448.f, Fp8Format::kE4M3), 0x7e);
  EXPECT_EQ(fp8_encode(-448.f, Fp8Format::kE4M3), 0xfe);
  EXPECT_EQ(fp8_encode(1.f, Fp8Format::kE4M3), 0x38);
  EXPECT_EQ(fp8_encode(std::ldexp(1.f, -9), Fp8Format::kE4M3), 0x01);   // smallest subnormal
  EXPECT_EQ(fp8_encode(std::ldexp(1.f, -10), Fp8Format::kE4M3), 0x00);  // tie -> even (0)
  EXPECT_EQ(fp8_encode(std::ldexp(3.f, -10), Fp8Format::kE4M3), 0x02);  // tie -> even (2)
  EXPECT_EQ(fp8_encode(57344.f, Fp8Format::kE5M2), 0x7b);
  EXPECT_EQ(fp8_encode(1.f, Fp8Format::kE5M2), 0x3c);
  EXPECT_EQ(fp8_encode(std::ldexp(1.f, -16), Fp8Format::kE5M2), 0x01);
  EXPECT_EQ(fp8_decode(0x7e, Fp8Format::kE4M3), 448.f);
  EXPECT_EQ(fp8_decode(0x7b, Fp8Format::kE5M2), 57344.f);
  EXPECT_EQ(fp8_decode(0x7c, Fp8Format::kE5M2), std::numeric_limits<float>::infinity());
}

TEST(LowpFp8Codec, SaturatesFiniteKeepsNaNAndInf) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (Fp8Format f : kFormats) {
    const float mx = fp8_spec(f).max;
    const uint8_t max_code = fp8_encode(mx, f);
    for (float big : {mx * 1.0001f, mx * 2.f, 1e30f, std::numeric_limits<float>::max()}) {
      EXPECT_EQ(fp8_encode(big, f), max_code) << big;
      EXPECT_EQ(fp8_encode(-big, f), max_code | 0x80) << -big;
    }
    EXPECT_EQ(fp8_encode(nan, f), 0x7f);
    EXPECT_EQ(fp8_encode(-nan, f), 0x7f);  // canonical NaN, sign dropped
    EXPECT_TRUE(is_nan_code(fp8_encode(nan, f), f));
    if (f == Fp8Format::kE5M2) {  // inf stays inf
      EXPECT_EQ(fp8_encode(inf, f), 0x7c);
      EXPECT_EQ(fp8_encode(-inf, f), 0xfc);
    } else {  // E4M3 has no inf: NaN, never a plausible +-448
      EXPECT_EQ(fp8_encode(inf, f), 0x7f);
      EXPECT_EQ(fp8_encode(-inf, f), 0x7f);
    }
    EXPECT_EQ(fp8_encode(0.f, f), 0x00);
    EXPECT_EQ(fp8_encode(-0.f, f), 0x80);
    EXPECT_EQ(fp8_encode(1e-30f, f), 0x00);
    EXPECT_EQ(fp8_encode(std::numeric_limits<float>::denorm_min(), f), 0x00);
  }
}

TEST(LowpFp8Codec, EveryCodeRoundTripsAndMidpointsRoundToEven) {
  for (Fp8Format f : kFormats) {
    std::vector<float> finite;
    for (int c = 0; c < 128; ++c) {
      const float v = fp8_decode(static_cast<uint8_t>(c), f);
      if (!std::isfinite(v)) continue;
      EXPECT_EQ(fp8_encode(v, f), c) << c;
      EXPECT_EQ(fp8_encode(-v, f), c | 0x80) << c;
      finite.push_back(v);
    }
    for (size_t i = 0; i + 1 < finite.size(); ++i) {
      const float lo = finite[i], hi = finite[i + 1];
      ASSERT_LT(lo, hi);
      const float mid = lo + (hi - lo) / 2.f;  // exact: fp8 values have few mantissa bits
      const int even = (i % 2 == 0) ? static_cast<int>(i) : static_cast<int>(i + 1);
      EXPECT_EQ(fp8_encode(mid, f), even) << mid;
      EXPECT_EQ(fp8_encode(std::nextafter(mid, hi), f), static_cast<int>(i + 1)) << mid;
      EXPECT_EQ(fp8_encode(std::nextafter(mid, lo), f), static_cast<int>(i)) << mid;
    }
  }
}

TEST(LowpFp8Scale, SafeForZeroTinyAndPowerOfTwo) {
  for (Fp8Format f : kFormats) {
    for (float amax : {0.f, 1e-38f, 1e-20f, 1e-12f, 1.f, 3.f, 1000.f, 3.4e38f}) {
      for (bool pow2 : {false, true}) {
        const float s = fp8_scale(amax, f, pow2);
        EXPECT_TRUE(std::isfinite(s) && s > 0.f) << amax;
        EXPECT_LE(amax * s, fp8_spec(f).max * (pow2 ? 1.f : 1.0000001f)) << amax;
        if (pow2) {
          int e;
          EXPECT_EQ(std::frexp(s, &e), 0.5f) << s;
        }
      }
    }
    EXPECT_EQ(fp8_scale(2.f, f, false), fp8_spec(f).max / 2.f);
    EXPECT_EQ(fp8_scale(3.f, Fp8Format::kE4M3, true), 128.f);  // 149.33 rounded down
  }
}

// Naive per-element recomputation of a blocked quantization, for comparison.
struct Expected {
  std::vector<uint8_t> q;
  std::vector<float> scales;
};

Expected naive(const std::vector<float>& x, int64_t rows, int64_t cols, Fp8Scaling sc, Fp8Format f,
               bool pow2) {
  const Fp8Blocks b = fp8_blocks(sc, rows, cols);
  Expected e;
  e.scales.assign(b.grid_rows * b.grid_cols, 0.f);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      float& m = e.scales[(i / b.rows) * b.grid_cols + j / b.cols];
      const float a = std::fabs(x[i * cols + j]);
      if (std::isfinite(a) && a > m) m = a;
    }
  }
  for (float& s : e.scales) s = fp8_scale(s, f, pow2);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const float s = e.scales[(i / b.rows) * b.grid_cols + j / b.cols];
      e.q.push_back(fp8_encode(x[i * cols + j] * s, f));
    }
  }
  return e;
}

std::vector<float> random_matrix(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> x(n);
  for (auto& v : x)
    v = dist(rng) * std::exp2(static_cast<float>(static_cast<int>(rng() % 20)) - 10.f);
  return x;
}

const Fp8Scaling kScalings[] = {Fp8Scaling::kTensor, Fp8Scaling::kRow, Fp8Scaling::kCol,
                                Fp8Scaling::kBlock1x128, Fp8Scaling::kBlock128x128};

TEST(LowpFp8Quantize, MatchesNaiveForEveryScaling) {
  const int64_t shapes[][2] = {{1, 1}, {3, 5}, {130, 257}, {256, 128}, {700, 33}};
  for (auto& shape : shapes) {
    const int64_t rows = shape[0], cols = shape[1];
    std::vector<float> x = random_matrix(rows * cols, static_cast<uint32_t>(rows * 31 + cols));
    if (rows * cols > 10) {
      x[3] = std::numeric_limits<float>::quiet_NaN();
      x[7] = -std::numeric_limits<float>::infinity();
    }
    for (Fp8Scaling sc : kScalings) {
      for (Fp8Format f : kFormats) {
        for (bool pow2 : {false, true}) {
          const Expected e = naive(x, rows, cols, sc, f, pow2);
          std::vector<uint8_t> q(rows * cols);
          std::vector<float> scales(e.scales.size());
          Fp8Input in{x.data(), DType::kFloat32, rows, cols, cols, 1};
          fp8_quantize(in, sc, f, pow2, q.data(), scales.data());
          ASSERT_EQ(scales, e.scales) << rows << "x" << cols << " sc=" << int(sc);
          ASSERT_EQ(q, e.q) << rows << "x" << cols << " sc=" << int(sc);
        }
      }
    }
  }
}

TEST(LowpFp8Quantize, DualIsQuantizeOfTransposeAndBf16Input) {
  const int64_t rows = 200, cols = 300;
  const std::vector<float> xf = random_matrix(rows * cols, 7);
  std::vector<uint16_t> x(rows * cols);
  std::vector<float> xr(rows * cols), xt(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) {
    x[i] = f32_to_bf16(xf[i]);
    xr[i] = bf16_to_f32(x[i]);
  }
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) xt[j * rows + i] = xr[i * cols + j];
  }
  for (Fp8Scaling sc : kScalings) {
    const Fp8Blocks b = fp8_blocks(sc, rows, cols), bt = fp8_blocks(sc, cols, rows);
    std::vector<uint8_t> q(rows * cols), qt(rows * cols);
    std::vector<float> s(b.grid_rows * b.grid_cols), st(bt.grid_rows * bt.grid_cols);
    Fp8Input in{x.data(), DType::kBFloat16, rows, cols, cols, 1};
    fp8_quantize_dual(in, sc, Fp8Format::kE4M3, true, q.data(), s.data(), qt.data(), st.data());
    const Expected e = naive(xr, rows, cols, sc, Fp8Format::kE4M3, true);
    const Expected et = naive(xt, cols, rows, sc, Fp8Format::kE4M3, true);
    EXPECT_EQ(q, e.q);
    EXPECT_EQ(s, e.scales);
    EXPECT_EQ(qt, et.q);
    EXPECT_EQ(st, et.scales);
  }
}

TEST(LowpFp8Quantize, ZeroTensorGetsFiniteScaleAndDequantizeIsClose) {
  const int64_t rows = 64, cols = 256;
  std::vector<float> zeros(rows * cols, 0.f), out(rows * cols);
  std::vector<uint8_t> q(rows * cols);
  std::vector<float> s(1);
  Fp8Input in{zeros.data(), DType::kFloat32, rows, cols, cols, 1};
  fp8_quantize(in, Fp8Scaling::kTensor, Fp8Format::kE4M3, false, q.data(), s.data());
  EXPECT_TRUE(std::isfinite(s[0]) && s[0] > 0.f);
  fp8_dequantize(q.data(), rows, cols, Fp8Scaling::kTensor, Fp8Format::kE4M3, s.data(), out.data());
  for (float v : out) ASSERT_EQ(v, 0.f);

  const std::vector<float> x = random_matrix(rows * cols, 3);
  std::vector<float> s2(rows * 2);
  Fp8Input in2{x.data(), DType::kFloat32, rows, cols, cols, 1};
  fp8_quantize(in2, Fp8Scaling::kBlock1x128, Fp8Format::kE4M3, false, q.data(), s2.data());
  fp8_dequantize(q.data(), rows, cols, Fp8Scaling::kBlock1x128, Fp8Format::kE4M3, s2.data(),
                 out.data());
  for (int64_t i = 0; i < rows * cols; ++i) {
    const float amax_block = fp8_spec(Fp8Format::kE4M3).max / s2[i / 128];
    // Relative error 2^-4 for normals, absolute error half a subnormal step below.
    EXPECT_NEAR(out[i], x[i], std::fabs(x[i]) / 16.f + amax_block * std::ldexp(1.f, -18)) << i;
  }
}

// A NaN/Inf does not enter its block's amax (the scale stays set by the finite elements, not
// 448 / inf = 0) and dequantizes non-finite in its own place, for every scaling.
TEST(LowpFp8Quantize, NonFiniteInputsStayVisible) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t rows = 130, cols = 200;
  std::vector<float> x = random_matrix(rows * cols, 11);
  x[3 * cols + 5] = nan;
  x[10 * cols + 7] = inf;
  x[129 * cols + 199] = -inf;
  std::vector<float> clean(x);
  for (float& v : clean) v = std::isfinite(v) ? v : 0.f;
  for (Fp8Scaling sc : kScalings) {
    for (Fp8Format f : kFormats) {
      const Fp8Blocks b = fp8_blocks(sc, rows, cols);
      std::vector<uint8_t> q(rows * cols), q0(rows * cols);
      std::vector<float> s(b.grid_rows * b.grid_cols), s0(s.size()), out(rows * cols);
      fp8_quantize({x.data(), DType::kFloat32, rows, cols, cols, 1}, sc, f, false, q.data(),
                   s.data());
      fp8_quantize({clean.data(), DType::kFloat32, rows, cols, cols, 1}, sc, f, false, q0.data(),
                   s0.data());
      EXPECT_EQ(s, s0) << int(sc);
      fp8_dequantize(q.data(), rows, cols, sc, f, s.data(), out.data());
      for (int64_t k = 0; k < rows * cols; ++k) {
        if (std::isfinite(x[k])) {
          ASSERT_EQ(q[k], q0[k]) << k;
        } else if (std::isinf(x[k]) && f == Fp8Format::kE5M2) {
          ASSERT_EQ(out[k], x[k]) << k;
        } else {
          ASSERT_TRUE(std::isnan(out[k])) << k;
        }
      }
    }
  }
}

TEST(LowpFp8Quantize, RejectsBadInput) {
  std::vector<uint8_t> q(4);
  std::vector<float> s(1);
  Fp8Input in{nullptr, DType::kFloat32, 2, 2, 2, 1};
  EXPECT_THROW(fp8_quantize(in, Fp8Scaling::kTensor, Fp8Format::kE4M3, false, q.data(), s.data()),
               std::invalid_argument);
  in.rows = -1;
  EXPECT_THROW(fp8_quantize(in, Fp8Scaling::kTensor, Fp8Format::kE4M3, false, q.data(), s.data()),
               std::invalid_argument);
}

}  // namespace
}  // namespace tierlift
