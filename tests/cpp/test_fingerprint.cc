// The 64-bit content fingerprint: fixed values (so a change to the function is a decision, not
// an accident), every SIMD path equal to the scalar one for every length and alignment, any one
// flipped bit detected, and the threaded batch equal to one call per range.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/util/cpu_features.h"
#include "core/util/fingerprint.h"

namespace tierlift {
namespace {

std::vector<unsigned char> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

// Bytes i -> (i * 31 + 7) mod 256, so the vectors below can be recomputed anywhere.
std::vector<unsigned char> pattern(size_t n) {
  std::vector<unsigned char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>(i * 31 + 7);
  return v;
}

using Fn = uint64_t (*)(const void*, size_t);

// The paths this CPU runs, by name.
std::vector<std::pair<std::string, Fn>> simd_paths() {
  std::vector<std::pair<std::string, Fn>> out;
  if (cpu_simd_level() >= SimdLevel::kAvx2) out.emplace_back("avx2", fingerprint64_avx2);
  if (cpu_simd_level() >= SimdLevel::kAvx512) out.emplace_back("avx512", fingerprint64_avx512);
  return out;
}

TEST(Fingerprint, KnownAnswers) {
  // Computed by the scalar path (and by tierlift.reference.fingerprint, which agrees).
  const struct {
    size_t n;
    uint64_t want;
  } cases[] = {
      {0, 0xe187d6c36add289eull},    {1, 0x7c2ba9f43a993d28ull},
      {3, 0xcdfc053a4ad7b78bull},    {63, 0x1d07209406e7d3f5ull},
      {64, 0x813f0ed27028c09full},   {65, 0x8204279f14bde0b4ull},
      {1023, 0x1d4a22c538394436ull}, {1024, 0xf41e39c49b4276feull},
      {1025, 0x92b5aa6330ed6c37ull}, {4096 + 17, 0xa3469f9748fff71bull},
  };
  const auto data = pattern(4096 + 17);
  for (const auto& c : cases) {
    EXPECT_EQ(fingerprint64_scalar(data.data(), c.n), c.want) << c.n;
    EXPECT_EQ(fingerprint64(data.data(), c.n), c.want) << c.n;
  }
  const std::vector<unsigned char> zeros(100, 0);
  EXPECT_EQ(fingerprint64_scalar(zeros.data(), 100), 0x68240dce49abe74dull);
}

TEST(Fingerprint, SimdEqualsScalarForEveryLengthAndAlignment) {
  const auto paths = simd_paths();
  if (paths.empty()) GTEST_SKIP() << "this CPU has neither AVX2 nor AVX-512";
  const auto data = random_bytes(300 + 64 + 8, 5);
  for (size_t off : {0, 1, 3, 7, 13, 33, 63}) {
    for (size_t n = 0; n <= 300; ++n) {
      const uint64_t want = fingerprint64_scalar(data.data() + off, n);
      for (const auto& [name, fn] : paths) {
        EXPECT_EQ(fn(data.data() + off, n), want) << name << " n=" << n << " offset=" << off;
      }
    }
  }
  // Past several 1 KiB blocks (the lanes are scrambled between blocks), odd lengths.
  const auto big = random_bytes(20000, 9);
  for (size_t n : {1024 * 3 - 1, 1024 * 3, 1024 * 3 + 1, 1024 * 16 + 63, 19999}) {
    const uint64_t want = fingerprint64_scalar(big.data() + 1, n);
    for (const auto& [name, fn] : paths) EXPECT_EQ(fn(big.data() + 1, n), want) << name << n;
  }
}

TEST(Fingerprint, DispatchFollowsTierliftSimd) {
  const char* was = std::getenv("TIERLIFT_SIMD");
  const std::string saved = was ? was : "";
  const auto data = random_bytes(5000, 3);
  const uint64_t want = fingerprint64_scalar(data.data() + 1, 4999);
  for (const char* level : {"scalar", "avx2", "avx512", ""}) {
    setenv("TIERLIFT_SIMD", level, 1);
    EXPECT_EQ(fingerprint64(data.data() + 1, 4999), want) << level;
    EXPECT_EQ(fingerprint64_many({{data.data() + 1, 4999}}, 2)[0], want) << level;
  }
  if (was) {
    setenv("TIERLIFT_SIMD", saved.c_str(), 1);
  } else {
    unsetenv("TIERLIFT_SIMD");
  }
}

// Every single-bit change of a 300-byte buffer (and of one spanning several blocks) changes the
// value, on every path; and no two of those values collide.
TEST(Fingerprint, AnyFlippedBitChangesTheValue) {
  auto paths = simd_paths();
  paths.emplace_back("scalar", fingerprint64_scalar);
  for (size_t n : {size_t{300}, size_t{2100}}) {
    auto data = random_bytes(n, 17 + n);
    for (const auto& [name, fn] : paths) {
      const uint64_t base = fn(data.data(), n);
      std::set<uint64_t> seen = {base};
      for (size_t bit = 0; bit < n * 8; ++bit) {
        data[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
        const uint64_t v = fn(data.data(), n);
        data[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
        EXPECT_NE(v, base) << name << " n=" << n << " bit=" << bit;
        seen.insert(v);
      }
      EXPECT_EQ(seen.size(), n * 8 + 1) << name << " n=" << n;
    }
  }
}

// What the optimizer's checks meet: a zeroed tail is not the same as a shorter buffer, moved
// or swapped blocks and a scaled buffer are all seen.
TEST(Fingerprint, StructuredChanges) {
  const auto data = random_bytes(8192, 21);
  const uint64_t base = fingerprint64(data.data(), data.size());
  std::vector<unsigned char> padded(data.begin(), data.begin() + 100);
  padded.resize(128, 0);
  EXPECT_NE(fingerprint64(data.data(), 100), fingerprint64(padded.data(), 128));
  EXPECT_NE(fingerprint64(data.data(), 0), fingerprint64(padded.data() + 100, 28));
  auto swapped = data;  // two 1 KiB blocks exchanged
  std::swap_ranges(swapped.begin(), swapped.begin() + 1024, swapped.begin() + 4096);
  EXPECT_NE(fingerprint64(swapped.data(), swapped.size()), base);
  auto stripes = data;  // two 64-byte stripes of one block exchanged
  std::swap_ranges(stripes.begin() + 64, stripes.begin() + 128, stripes.begin() + 512);
  EXPECT_NE(fingerprint64(stripes.data(), stripes.size()), base);
  std::vector<float> f(2048, 0.5f), g(2048, 1.0f);  // a gradient scaled by 2
  EXPECT_NE(fingerprint64(f.data(), f.size() * 4), fingerprint64(g.data(), g.size() * 4));
}

TEST(Fingerprint, ManyEqualsOneByOne) {
  const auto data = random_bytes(3 << 20, 13);
  std::vector<ByteRange> ranges;
  std::mt19937 rng(2);
  for (size_t at = 0; at < data.size();) {
    const size_t n = std::min<size_t>(data.size() - at, rng() % (400 << 10));
    ranges.push_back({data.data() + at, n});
    at += n;
  }
  ranges.push_back({data.data(), 0});
  for (int threads : {1, 2, 3, 8}) {
    const auto got = fingerprint64_many(ranges, threads);
    ASSERT_EQ(got.size(), ranges.size());
    for (size_t i = 0; i < ranges.size(); ++i) {
      EXPECT_EQ(got[i], fingerprint64(ranges[i].data, ranges[i].size)) << threads << " " << i;
    }
  }
  EXPECT_TRUE(fingerprint64_many({}, 2).empty());
}

// The fused passes: the same value as the plain fingerprint on every path, every length and
// alignment; the finite check sees an Inf or NaN anywhere (the padded tail included) and only
// those; the copy writes exactly the n bytes.
struct FusedPath {
  std::string name;
  FiniteFingerprint (*finite)(const void*, size_t, int, uint32_t);
  uint64_t (*copy)(void*, const void*, size_t);
};

std::vector<FusedPath> fused_paths() {
  std::vector<FusedPath> out = {{"scalar", fingerprint64_finite_scalar, fingerprint64_copy_scalar},
                                {"dispatch", fingerprint64_finite, fingerprint64_copy}};
  if (cpu_simd_level() >= SimdLevel::kAvx2) {
    out.push_back({"avx2", fingerprint64_finite_avx2, fingerprint64_copy_avx2});
  }
  if (cpu_simd_level() >= SimdLevel::kAvx512) {
    out.push_back({"avx512", fingerprint64_finite_avx512, fingerprint64_copy_avx512});
  }
  return out;
}

TEST(FingerprintFused, FiniteGivesTheValueAndFindsInfAndNan) {
  const struct {
    int width;
    uint32_t exp;
  } kinds[] = {{4, 0x7F800000u}, {2, 0x7F80u}, {2, 0x7C00u}};
  auto data = random_bytes(4096 + 64, 31);
  for (const auto& k : kinds) {
    // Random elements, every one finite.
    for (size_t i = 0; i + k.width <= data.size(); i += k.width) {
      uint32_t w = 0;
      std::memcpy(&w, &data[i], k.width);
      w &= ~(k.exp & (0u - k.exp));  // clear the exponent's lowest bit: never all ones
      std::memcpy(&data[i], &w, k.width);
    }
    for (const auto& path : fused_paths()) {
      for (size_t off : {0, 4, 12}) {
        for (size_t n : {0, 2, 4, 60, 64, 68, 1022, 1024, 1028, 4096}) {
          if (n % k.width) continue;
          const auto got = path.finite(data.data() + off, n, k.width, k.exp);
          EXPECT_EQ(got.value, fingerprint64_scalar(data.data() + off, n)) << path.name << n;
          EXPECT_TRUE(got.finite) << path.name << " n=" << n << " off=" << off;
          for (size_t at : {size_t{0}, n / 2, n - k.width}) {
            if (n == 0) break;
            at = at / k.width * k.width;
            auto bad = data;
            uint32_t w = 0;
            std::memcpy(&w, &bad[off + at], k.width);
            w |= k.exp;  // Inf or NaN, whatever the mantissa
            std::memcpy(&bad[off + at], &w, k.width);
            EXPECT_FALSE(path.finite(bad.data() + off, n, k.width, k.exp).finite)
                << path.name << " n=" << n << " at=" << at;
          }
        }
      }
    }
  }
}

TEST(FingerprintFused, CopyGivesTheValueAndWritesExactlyN) {
  const auto src = random_bytes(5000 + 3, 41);
  for (const auto& path : fused_paths()) {
    for (size_t n : {0, 1, 63, 64, 65, 1023, 1024, 1025, 4999}) {
      for (size_t off : {0, 3}) {
        std::vector<unsigned char> dst(n + 16, 0xA5);
        EXPECT_EQ(path.copy(dst.data() + 8, src.data() + off, n),
                  fingerprint64_scalar(src.data() + off, n))
            << path.name << " n=" << n;
        EXPECT_EQ(std::memcmp(dst.data() + 8, src.data() + off, n), 0) << path.name << n;
        for (size_t i = 0; i < 8; ++i) {
          EXPECT_EQ(dst[i], 0xA5);
          EXPECT_EQ(dst[n + 8 + i], 0xA5);
        }
      }
    }
  }
}

TEST(FingerprintFused, FiniteManyEqualsOneByOne) {
  std::vector<float> f(3 << 18);
  std::mt19937 rng(4);
  std::normal_distribution<float> normal;
  for (auto& x : f) x = normal(rng);
  f[(1 << 18) + 5] = std::numeric_limits<float>::quiet_NaN();
  std::vector<FloatRange> ranges;
  for (size_t at = 0; at < f.size();) {
    const size_t n = std::min<size_t>(f.size() - at, rng() % (100 << 10));
    ranges.push_back({f.data() + at, n * 4, 4, 0x7F800000u});
    at += n;
  }
  for (int threads : {1, 2, 3}) {
    const auto got = fingerprint64_finite_many(ranges, threads);
    ASSERT_EQ(got.size(), ranges.size());
    int bad = 0;
    for (size_t i = 0; i < ranges.size(); ++i) {
      EXPECT_EQ(got[i].value, fingerprint64(ranges[i].data, ranges[i].size));
      bad += !got[i].finite;
    }
    EXPECT_EQ(bad, 1) << threads;
  }
}

// All or nothing per group: a group whose checked destination changed (any one bit) is not
// written at all; the others are, whatever the thread split.
TEST(FingerprintFused, CopyCheckedIsAllOrNothingPerGroup) {
  const auto src = random_bytes(3 << 20, 51);
  for (int threads : {1, 2, 3}) {
    auto dst = random_bytes(src.size(), 52);
    const auto before = dst;
    std::vector<std::vector<CheckedCopy>> groups(6);
    const size_t part = src.size() / 12;
    for (size_t i = 0; i < 12; ++i) {
      auto* d = dst.data() + i * part;
      groups[i / 2].push_back({d, src.data() + i * part, part, i % 3 != 2, fingerprint64(d, part)});
    }
    groups[1][1].want ^= uint64_t{1} << 40;  // group 1: its second range changed
    dst[4 * part + 77] ^= 0x10;              // group 2: one flipped bit in its first range
    const auto got = fingerprint64_copy_checked(groups, threads);
    ASSERT_EQ(got.size(), groups.size());
    for (size_t g = 0; g < groups.size(); ++g) {
      const bool refused = g == 1 || g == 2;
      EXPECT_EQ(got[g].copied, !refused) << g;
      for (size_t j = 0; j < 2; ++j) {
        const size_t i = g * 2 + j;
        const auto* want = refused ? before.data() + i * part : src.data() + i * part;
        if (g == 2 && j == 0) continue;  // the flipped bit itself
        EXPECT_EQ(std::memcmp(dst.data() + i * part, want, part), 0) << threads << " " << i;
        if (!refused) {
          EXPECT_EQ(got[g].values[j], fingerprint64(src.data() + i * part, part));
        }
      }
    }
  }
  EXPECT_TRUE(fingerprint64_copy_checked({}, 2).empty());
}

}  // namespace
}  // namespace tierlift
