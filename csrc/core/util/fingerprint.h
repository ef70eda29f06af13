// A 64-bit content fingerprint of a byte range, for the in-memory "are these bytes still the
// same?" checks of the offloaded optimizer (the overlap's kept chunks, the parameter watch).
// It only has to catch accidental changes, is never written to disk and is never compared
// across machines, so it trades CRC-32C's guarantees for speed: eight independent 64-bit lanes
// over 64-byte stripes, each word xor-ed with a per-position key and folded with a 32x32->64
// multiply (the one multiply AVX2 has), plus the word itself added to the neighbouring lane,
// so no bit of the input is lost; every 1 KiB the lanes are scrambled, so the order of blocks
// matters too. It runs near memory bandwidth where CRC-32C is bound by its dependency chain.
//
// The scalar, AVX2 and AVX-512 paths compute exactly the same value for the same bytes (tests
// check it); fingerprint64 picks one with active_simd_level() (TIERLIFT_SIMD forces one).
// Values are defined for little-endian machines only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tierlift {

uint64_t fingerprint64(const void* data, size_t n);

// One path each, for tests and benchmarks. The SIMD ones may only be called where
// cpu_simd_level() says the CPU runs them.
uint64_t fingerprint64_scalar(const void* data, size_t n);
uint64_t fingerprint64_avx2(const void* data, size_t n);
uint64_t fingerprint64_avx512(const void* data, size_t n);

struct ByteRange {
  const void* data;
  size_t size;
};

// fingerprint64 of each range. With `threads` > 1 and enough bytes in all, the ranges are
// split between up to that many threads of ThreadPool::global() by bytes (each range is
// hashed by one thread, so the values do not depend on the split).
std::vector<uint64_t> fingerprint64_many(const std::vector<ByteRange>& ranges, int threads);

// Passes that read the bytes anyway and take the fingerprint with them, so that a later
// "still the same?" check costs no pass of its own. Same value as fingerprint64.

// fingerprint64 of n bytes of floats `width` (2 or 4) bytes wide, and whether every one is
// finite: none has all bits of `exp_mask` (its exponent field: 0x7F800000 for fp32, 0x7F80
// for bf16, 0x7C00 for fp16) set. n is a multiple of width.
struct FiniteFingerprint {
  uint64_t value;
  bool finite;
};
FiniteFingerprint fingerprint64_finite(const void* data, size_t n, int width, uint32_t exp_mask);

// Copies n bytes from src to dst (not overlapping) and returns their fingerprint64.
uint64_t fingerprint64_copy(void* dst, const void* src, size_t n);

FiniteFingerprint fingerprint64_finite_scalar(const void* data, size_t n, int width,
                                              uint32_t exp_mask);
FiniteFingerprint fingerprint64_finite_avx2(const void* data, size_t n, int width,
                                            uint32_t exp_mask);
FiniteFingerprint fingerprint64_finite_avx512(const void* data, size_t n, int width,
                                              uint32_t exp_mask);
uint64_t fingerprint64_copy_scalar(void* dst, const void* src, size_t n);
uint64_t fingerprint64_copy_avx2(void* dst, const void* src, size_t n);
uint64_t fingerprint64_copy_avx512(void* dst, const void* src, size_t n);

struct FloatRange {
  const void* data;
  size_t size;
  int width;
  uint32_t exp_mask;
};

// fingerprint64_finite of each range, split between threads as fingerprint64_many does.
std::vector<FiniteFingerprint> fingerprint64_finite_many(const std::vector<FloatRange>& ranges,
                                                         int threads);

// One range to copy; with `check`, dst must still hold the bytes whose fingerprint is `want`.
struct CheckedCopy {
  void* dst;
  const void* src;
  size_t size;
  bool check;
  uint64_t want;
};
struct CheckedCopyResult {
  bool copied;
  std::vector<uint64_t> values;  // fingerprint64 of each range's new bytes, when copied
};

// All or nothing per group: if every checked dst of a group still has its `want`
// fingerprint, copies every range of the group and returns the fingerprints of the copied
// bytes; else copies nothing of that group. Each group is checked, then copied, by one
// thread (a group that fits in cache is read from memory once); groups are split between up
// to `threads` threads by bytes.
std::vector<CheckedCopyResult> fingerprint64_copy_checked(
    const std::vector<std::vector<CheckedCopy>>& groups, int threads);

}  // namespace tierlift
