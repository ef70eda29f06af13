// The fingerprint's one loop, shared by the scalar, AVX2 and AVX-512 files (its constants and
// keys: fingerprint_keys.h, shared with the CUDA kernel).
// Each path supplies a Lanes type holding the eight 64-bit accumulators with three operations:
//   stripe(p, key):   for lane i with word d[i] of the 64 bytes at p and x = d[i] ^ key[i],
//                     acc[i] += lo32(x) * hi32(x) + d[i ^ 1]
//   scramble():       acc[i] = ((acc[i] ^ (acc[i] >> kShift)) ^ kScramble[i]) * kMul (mod 2^64)
//   store(out):       the eight accumulators, lane 0 first
// so every path does the same integer arithmetic and gives the same value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/util/fingerprint.h"
#include "core/util/fingerprint_keys.h"

namespace tierlift {
// Anonymous: each ISA file gets its own copies, compiled for its own target; a shared inline
// copy could be the AVX-512 one, run on a CPU without it.
namespace {

// What a pass does with the bytes besides hashing them (nothing, here): stripe(p, at) sees
// the 64 bytes at offset `at`; tail(p, at, len) the last `len` < 64 bytes, at p in a 64-byte
// buffer padded with zeros.
struct NoVisit {
  void stripe(const unsigned char*, size_t) {}
  void tail(const unsigned char*, size_t, size_t) {}
};

// The one loop: full blocks, the remaining full stripes, then the last partial stripe padded
// with zeros (the length, mixed in by finish(), tells the paddings apart). `visit` sees every
// stripe right after it is hashed, while it is in registers or L1: a check or a copy fused
// into the same pass over memory.
template <class Lanes, class Visit = NoVisit>
uint64_t run(const void* data, size_t n, Visit&& visit = Visit{}) {
  const auto* p = static_cast<const unsigned char*>(data);
  const auto* start = p;
  Lanes acc(kKeys.init);
  size_t left = n;
  constexpr size_t kBlock = kStripe * kStripesPerBlock;
  for (; left >= kBlock; left -= kBlock, p += kBlock) {
    // Fully unrolled, GCC computes all 16 stripes' products first and spills them.
#pragma GCC unroll 2
    for (int s = 0; s < kStripesPerBlock; ++s) {
      acc.stripe(p + s * kStripe, kKeys.stripe[s]);
      visit.stripe(p + s * kStripe, p + s * kStripe - start);
    }
    acc.scramble();
  }
  int s = 0;
  for (; left >= kStripe; left -= kStripe, p += kStripe) {
    acc.stripe(p, kKeys.stripe[s++]);
    visit.stripe(p, p - start);
  }
  if (left > 0) {
    alignas(64) unsigned char tail[kStripe] = {};
    std::memcpy(tail, p, left);
    acc.stripe(tail, kKeys.stripe[s]);
    visit.tail(tail, p - start, left);
  }
  alignas(64) uint64_t lanes[kLanes];
  acc.store(lanes);
  return finish(lanes, n, kKeys.out);
}

// Copies every stripe to dst while it is hashed: the source is read once.
struct CopyVisit {
  unsigned char* dst;
  void stripe(const unsigned char* p, size_t at) { std::memcpy(dst + at, p, kStripe); }
  void tail(const unsigned char* p, size_t at, size_t len) { std::memcpy(dst + at, p, len); }
};

// Whether an element of W bytes has every bit of `mask` set (the exponent field of an IEEE
// Inf or NaN), one element at a time; the SIMD files have their own. The zero padding of the
// tail stripe never matches (mask is not 0).
template <int W>
struct ScalarFinite {
  using Word = std::conditional_t<W == 4, uint32_t, uint16_t>;
  Word mask;
  bool bad = false;
  void stripe(const unsigned char* p, size_t) {
    for (size_t i = 0; i < kStripe; i += W) {
      Word w;
      std::memcpy(&w, p + i, W);
      bad |= (w & mask) == mask;
    }
  }
  void tail(const unsigned char* p, size_t at, size_t) { stripe(p, at); }
  bool finite() const { return !bad; }
};

// fingerprint64 and the finite check in one pass, with the finite visitor F<W> of a path.
template <class Lanes, template <int> class F>
FiniteFingerprint run_finite(const void* data, size_t n, int width, uint32_t mask) {
  if (width == 4) {
    F<4> v{static_cast<typename F<4>::Word>(mask)};
    const uint64_t h = run<Lanes>(data, n, v);
    return {h, v.finite()};
  }
  F<2> v{static_cast<typename F<2>::Word>(mask)};
  const uint64_t h = run<Lanes>(data, n, v);
  return {h, v.finite()};
}

}  // namespace
}  // namespace tierlift
