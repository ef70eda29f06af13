// AVX-512 (F) path of the fingerprint: the eight lanes in one 512-bit register. The target
// pragma compiles just this file for AVX-512; cpu_features decides at run time whether it may
// be called.
#pragma GCC target("avx512f,avx2")
// GCC 12's own _mm512_undefined_* (`__m512i __Y = __Y;`) trips -Wmaybe-uninitialized at every
// inlined intrinsic: dozens of false warnings that would bury real ones in the build log.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <type_traits>

#include "core/util/fingerprint.h"
#include "core/util/fingerprint_impl.h"

namespace tierlift {
namespace {

inline __m512i load(const void* p) { return _mm512_loadu_si512(p); }

struct Avx512Lanes {
  __m512i a;
  explicit Avx512Lanes(const uint64_t* init) : a(load(init)) {}
  void stripe(const unsigned char* p, const uint64_t* key) {
    const __m512i d = load(p);
    const __m512i x = _mm512_xor_si512(d, load(key));
    const __m512i prod = _mm512_mul_epu32(x, _mm512_srli_epi64(x, 32));
    // _MM_PERM_BADC swaps the two 64-bit words of each 128-bit quarter: lane i gets d[i ^ 1].
    a = _mm512_add_epi64(a, _mm512_add_epi64(prod, _mm512_shuffle_epi32(d, _MM_PERM_BADC)));
  }
  void scramble() {
    const __m512i k = _mm512_set1_epi64(static_cast<long long>(kMul));
    __m512i x = _mm512_xor_si512(a, _mm512_srli_epi64(a, kShift));
    x = _mm512_xor_si512(x, load(kKeys.scramble));
    const __m512i lo = _mm512_mul_epu32(x, k);
    const __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), k);
    a = _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
  }
  void store(uint64_t* out) const { _mm512_storeu_si512(out, a); }
};

// The finite check on one 512-bit word per stripe (AVX-512F compares 32-bit lanes only;
// 16-bit floats are compared in two AVX2 halves).
template <int W>
struct Avx512Finite {
  using Word = std::conditional_t<W == 4, uint32_t, uint16_t>;
  Word mask;
  bool bad = false;
  void stripe(const unsigned char* p, size_t) {
    if constexpr (W == 4) {
      const __m512i m = _mm512_set1_epi32(static_cast<int>(mask));
      bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(load(p), m), m) != 0;
    } else {
      const __m256i m = _mm256_set1_epi16(static_cast<short>(mask));
      const auto* q = static_cast<const void*>(p);
      const __m256i lo = _mm256_loadu_si256(static_cast<const __m256i*>(q));
      const __m256i hi = _mm256_loadu_si256(static_cast<const __m256i*>(q) + 1);
      const __m256i eq = _mm256_or_si256(_mm256_cmpeq_epi16(_mm256_and_si256(lo, m), m),
                                         _mm256_cmpeq_epi16(_mm256_and_si256(hi, m), m));
      bad |= _mm256_testz_si256(eq, eq) == 0;
    }
  }
  void tail(const unsigned char* p, size_t at, size_t) { stripe(p, at); }
  bool finite() const { return !bad; }
};

}  // namespace

uint64_t fingerprint64_avx512(const void* data, size_t n) { return run<Avx512Lanes>(data, n); }

FiniteFingerprint fingerprint64_finite_avx512(const void* data, size_t n, int width,
                                              uint32_t exp_mask) {
  return run_finite<Avx512Lanes, Avx512Finite>(data, n, width, exp_mask);
}

uint64_t fingerprint64_copy_avx512(void* dst, const void* src, size_t n) {
  return run<Avx512Lanes>(src, n, CopyVisit{static_cast<unsigned char*>(dst)});
}

}  // namespace tierlift
