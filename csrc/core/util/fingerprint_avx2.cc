// AVX2 path of the fingerprint: the eight lanes in two 256-bit registers. The target pragma
// compiles just this file for AVX2; cpu_features decides at run time whether it may be called.
#pragma GCC target("avx2")
#include <immintrin.h>

#include <type_traits>

#include "core/util/fingerprint.h"
#include "core/util/fingerprint_impl.h"

namespace tierlift {
namespace {

// a * kMul mod 2^64 from two 32x32->64 multiplies (kMul has 32 bits).
inline __m256i mul_k(__m256i a) {
  const __m256i k = _mm256_set1_epi64x(static_cast<long long>(kMul));
  const __m256i lo = _mm256_mul_epu32(a, k);
  const __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), k);
  return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

inline __m256i load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

inline __m256i step(__m256i acc, __m256i d, __m256i key) {
  const __m256i x = _mm256_xor_si256(d, key);
  const __m256i prod = _mm256_mul_epu32(x, _mm256_srli_epi64(x, 32));
  // 0x4E swaps the two 64-bit words of each 128-bit half: lane i gets d[i ^ 1].
  return _mm256_add_epi64(acc, _mm256_add_epi64(prod, _mm256_shuffle_epi32(d, 0x4E)));
}

inline __m256i scramble_one(__m256i a, const uint64_t* key) {
  a = _mm256_xor_si256(a, _mm256_srli_epi64(a, kShift));
  return mul_k(_mm256_xor_si256(a, load(key)));
}

struct Avx2Lanes {
  __m256i a0, a1;
  explicit Avx2Lanes(const uint64_t* init) : a0(load(init)), a1(load(init + 4)) {}
  void stripe(const unsigned char* p, const uint64_t* key) {
    a0 = step(a0, load(p), load(key));
    a1 = step(a1, load(p + 32), load(key + 4));
  }
  void scramble() {
    a0 = scramble_one(a0, kKeys.scramble);
    a1 = scramble_one(a1, kKeys.scramble + 4);
  }
  void store(uint64_t* out) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), a0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 4), a1);
  }
};

// The finite check on 256-bit words: an element with all bits of the mask set is Inf or NaN.
template <int W>
struct Avx2Finite {
  using Word = std::conditional_t<W == 4, uint32_t, uint16_t>;
  Word mask;
  __m256i m = W == 4 ? _mm256_set1_epi32(static_cast<int>(mask))
                     : _mm256_set1_epi16(static_cast<short>(mask));
  __m256i bad = _mm256_setzero_si256();
  void test(__m256i d) {
    const __m256i x = _mm256_and_si256(d, m);
    bad = _mm256_or_si256(bad, W == 4 ? _mm256_cmpeq_epi32(x, m) : _mm256_cmpeq_epi16(x, m));
  }
  void stripe(const unsigned char* p, size_t) {
    test(load(p));
    test(load(p + 32));
  }
  void tail(const unsigned char* p, size_t at, size_t) { stripe(p, at); }
  bool finite() const { return _mm256_testz_si256(bad, bad) != 0; }
};

}  // namespace

uint64_t fingerprint64_avx2(const void* data, size_t n) { return run<Avx2Lanes>(data, n); }

FiniteFingerprint fingerprint64_finite_avx2(const void* data, size_t n, int width,
                                            uint32_t exp_mask) {
  return run_finite<Avx2Lanes, Avx2Finite>(data, n, width, exp_mask);
}

uint64_t fingerprint64_copy_avx2(void* dst, const void* src, size_t n) {
  return run<Avx2Lanes>(src, n, CopyVisit{static_cast<unsigned char*>(dst)});
}

}  // namespace tierlift
