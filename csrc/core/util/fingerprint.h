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

}  // namespace tierlift
