// CRC-32C paths against each other: the VPCLMULQDQ fold (crc32c, where the CPU has it), the
// 3-stream and one-stream crc32-instruction paths and the byte table must agree for every length,
// alignment, incoming register and split of the data.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/io/crc32c.h"

namespace tierlift::io {
namespace {

std::vector<unsigned char> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

TEST(Crc32c, CheckValue) {
  const char* s = "123456789";
  EXPECT_EQ(crc32c(0, s, 9), 0xE3069283u);
  EXPECT_EQ(crc32c_one_stream(0, s, 9), 0xE3069283u);
  EXPECT_EQ(crc32c_portable(0, s, 9), 0xE3069283u);
  EXPECT_EQ(crc32c(0, s, 0), 0u);
  // 32 zero bytes and 32 0xFF bytes (RFC 3720, B.4).
  std::vector<unsigned char> z(32, 0), f(32, 0xFF);
  EXPECT_EQ(crc32c(0, z.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(crc32c(0, f.data(), 32), 0x62A8AB43u);
}

TEST(Crc32c, RandomLengthsUpTo64KiB) {
  const auto data = random_bytes(64 * 1024, 7);
  std::mt19937 rng(11);
  std::vector<size_t> lengths = {
      0, 1, 7, 8, 767, 768, 769, 3 * 4096 - 1, 3 * 4096, 3 * 4096 + 1, 64 * 1024};
  for (int i = 0; i < 200; ++i) lengths.push_back(rng() % (64 * 1024 + 1));
  for (size_t n : lengths) {
    const uint32_t want = crc32c_portable(0, data.data(), n);
    EXPECT_EQ(crc32c(0, data.data(), n), want) << n;
    EXPECT_EQ(crc32c_one_stream(0, data.data(), n), want) << n;
    EXPECT_EQ(crc32c_three_streams(0, data.data(), n), want) << n;
  }
}

// The fold's edges: around its 1 KiB threshold and its 256-byte blocks, each with a nonzero
// incoming register (it enters the fold as an xor into the first bytes).
TEST(Crc32c, FoldBoundaries) {
  const auto data = random_bytes(4096 + 64, 23);
  for (size_t n = 1024 - 8; n <= 4096 + 64; n += (n < 1300 ? 1 : 61)) {
    for (uint32_t start : {0u, 0xFFFFFFFFu, 0x12345678u}) {
      EXPECT_EQ(crc32c(start, data.data(), n), crc32c_portable(start, data.data(), n))
          << n << " " << start;
    }
  }
}

TEST(Crc32c, SeveralMiB) {
  const auto data = random_bytes((5 << 20) + 4093, 3);
  for (size_t n : {size_t{1} << 20, (size_t{3} << 20) + 517, data.size()}) {
    const uint32_t want = crc32c_portable(0, data.data(), n);
    EXPECT_EQ(crc32c(0, data.data(), n), want) << n;
    EXPECT_EQ(crc32c_three_streams(0, data.data(), n), want) << n;
  }
}

TEST(Crc32c, EveryAlignment) {
  const auto data = random_bytes(40000 + 16, 5);
  for (size_t off = 0; off < 16; ++off) {
    for (size_t n : {size_t{13}, size_t{1000}, size_t{12345}, size_t{40000}}) {
      EXPECT_EQ(crc32c(0, data.data() + off, n), crc32c_portable(0, data.data() + off, n))
          << "offset " << off << " length " << n;
    }
  }
}

TEST(Crc32c, Incremental) {
  const auto data = random_bytes(100000, 9);
  const uint32_t whole = crc32c(0, data.data(), data.size());
  std::mt19937 rng(13);
  std::vector<size_t> splits = {0, 1, 255, 256, 768, 12288, 12289, data.size()};
  for (int i = 0; i < 50; ++i) splits.push_back(rng() % (data.size() + 1));
  for (size_t k : splits) {
    const uint32_t a = crc32c(0, data.data(), k);
    EXPECT_EQ(crc32c(a, data.data() + k, data.size() - k), whole) << k;
    EXPECT_EQ(crc32c_portable(crc32c_portable(0, data.data(), k), data.data() + k, data.size() - k),
              whole)
        << k;
  }
}

TEST(Crc32c, DetectsEveryBitFlipInABlock) {
  auto data = random_bytes(3 * 4096 + 100, 17);
  const uint32_t good = crc32c(0, data.data(), data.size());
  std::mt19937 rng(19);
  for (int i = 0; i < 300; ++i) {
    const size_t byte = rng() % data.size();
    const auto bit = static_cast<unsigned char>(1u << (rng() % 8));
    data[byte] ^= bit;
    EXPECT_NE(crc32c(0, data.data(), data.size()), good) << byte;
    data[byte] ^= bit;
  }
}

}  // namespace
}  // namespace tierlift::io
