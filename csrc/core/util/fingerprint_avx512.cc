// AVX-512 (F) path of the fingerprint: the eight lanes in one 512-bit register. The target
// pragma compiles just this file for AVX-512; cpu_features decides at run time whether it may
// be called.
#pragma GCC target("avx512f,avx2")
#include <immintrin.h>

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

}  // namespace

uint64_t fingerprint64_avx512(const void* data, size_t n) { return run<Avx512Lanes>(data, n); }

}  // namespace tierlift
