// tierlift::cuda::fingerprint_ranges (csrc/cuda/fingerprint.cu) run in the CPU simulator,
// compared with core's fingerprint64 (every SIMD path this CPU has) for the same bytes: the
// offloaded optimizer compares fingerprints of device tensors with fingerprints of their host
// copies, so they must agree bit for bit. Every range lies at the end of an allocation of exactly
// its size (after its leading misalignment), so AddressSanitizer catches a read past it.
//
// Covered: empty ranges; lengths around a word, a stripe and a 1 KiB block; whole blocks in the
// 4-block fast loop and the leftover blocks after it; starts at every offset modulo 8 (the
// unaligned byte path); more ranges than the grid has warps (the range-stride loop); two
// ranges over the same bytes; and one changed byte changing the value.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "core/util/cpu_features.h"
#include "core/util/fingerprint.h"
#include "cuda/fingerprint.cuh"

namespace tierlift {
namespace {

struct Bytes {
  std::vector<unsigned char> storage;
  size_t offset;
  const unsigned char* data() const { return storage.data() + offset; }
  size_t size() const { return storage.size() - offset; }
};

Bytes random_bytes(size_t n, size_t offset, uint32_t seed) {
  Bytes b{std::vector<unsigned char>(offset + n), offset};
  std::mt19937 rng(seed);
  for (auto& c : b.storage) c = static_cast<unsigned char>(rng());
  return b;
}

std::vector<uint64_t> on_device(const std::vector<cuda::FingerprintRange>& ranges) {
  std::vector<uint64_t> out(ranges.size(), 0);
  EXPECT_EQ(cuda::fingerprint_ranges(ranges.data(), static_cast<int64_t>(ranges.size()), out.data(),
                                     nullptr),
            cudaSuccess);
  return out;
}

// Every CPU path this machine runs gives the same value (fingerprint.h's promise).
uint64_t on_cpu(const unsigned char* p, size_t n) {
  const uint64_t want = fingerprint64_scalar(p, n);
  if (cpu_simd_level() >= SimdLevel::kAvx2) {
    EXPECT_EQ(fingerprint64_avx2(p, n), want);
  }
  if (cpu_simd_level() >= SimdLevel::kAvx512) {
    EXPECT_EQ(fingerprint64_avx512(p, n), want);
  }
  return want;
}

TEST(CudaSimFingerprint, MatchesCoreForEveryLengthAndAlignment) {
  const std::vector<size_t> lengths = {
      0,    1,    7,    8,    9,    63,   64,   65,   127,  500,           1023,
      1024, 1025, 2047, 2048, 4095, 4096, 4097, 4160, 5120, 8192 + 64 + 3, 9 * 1024 + 1000};
  std::vector<Bytes> bufs;
  for (size_t offset = 0; offset < 8; ++offset) {
    for (size_t n : lengths)
      bufs.push_back(random_bytes(n, offset, static_cast<uint32_t>(n * 8 + offset)));
  }
  std::vector<cuda::FingerprintRange> ranges;
  for (const auto& b : bufs) ranges.push_back({b.data(), b.size()});
  const auto got = on_device(ranges);
  for (size_t i = 0; i < bufs.size(); ++i) {
    EXPECT_EQ(got[i], on_cpu(bufs[i].data(), bufs[i].size()))
        << bufs[i].size() << " bytes at offset " << bufs[i].offset;
  }
}

TEST(CudaSimFingerprint, MoreRangesThanWarpsAndRepeatedRanges) {
  // 2,000 small ranges of one buffer, overlapping, some the same: the grid's warps loop over them.
  const Bytes b = random_bytes(40000, 0, 5);
  std::vector<cuda::FingerprintRange> ranges;
  for (size_t i = 0; i < 2000; ++i) {
    const size_t start = (i * 37) % 30000;
    ranges.push_back({b.data() + start, (i * 13) % 9000});
  }
  ranges.push_back(ranges.front());
  const auto got = on_device(ranges);
  for (size_t i = 0; i < ranges.size(); ++i) {
    EXPECT_EQ(got[i], on_cpu(static_cast<const unsigned char*>(ranges[i].data), ranges[i].bytes))
        << "range " << i;
  }
  EXPECT_EQ(got.back(), got.front());
}

TEST(CudaSimFingerprint, OneChangedByteChangesTheValue) {
  Bytes b = random_bytes(6 * 1024 + 100, 0, 9);
  const uint64_t before = on_device({{b.data(), b.size()}})[0];
  for (size_t at : {size_t{0}, size_t{1023}, size_t{4100}, b.size() - 1}) {
    b.storage[at] ^= 0x10;
    EXPECT_NE(on_device({{b.data(), b.size()}})[0], before) << "byte " << at;
    b.storage[at] ^= 0x10;
  }
  EXPECT_EQ(on_device({{b.data(), b.size()}})[0], before);
}

}  // namespace
}  // namespace tierlift
