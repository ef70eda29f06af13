// AVX2 + FMA + F16C path: 8 fp32 lanes, for the fp32-state and the compact-state step. The target
// pragma compiles just this file for those instructions; cpu_features decides at run time whether
// it may be called.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "core/optim/adam_compact_impl.h"
#include "core/optim/adam_impl.h"

namespace tierlift {
namespace {

struct Avx2Vec {
  using R = __m256;
  static constexpr int kWidth = 8;
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R x) { _mm256_storeu_ps(p, x); }
  // Non-temporal: p aligned to the vector; fence() orders these stores before what follows.
  static void stream(float* p, R x) { _mm256_stream_ps(p, x); }
  static void fence() { _mm_sfence(); }
  static R load_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static void store_bf16(uint16_t* p, R x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_srli_epi32(r, 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                             _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)), nan));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static R load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_f16(uint16_t* p, R x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R div(R a, R b) { return _mm256_div_ps(a, b); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R sqrt(R a) { return _mm256_sqrt_ps(a); }
  static R max(R a, R b) { return _mm256_max_ps(b, a); }  // a < b ? b : a, as ScalarVec
  static R max_nan(R a, R b) {  // b where b is NaN, else max(a, b), as ScalarVec
    return _mm256_blendv_ps(max(a, b), b, _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
  }
  static R neg(R a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  using I = __m256i;
  static I load_u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_u8(uint8_t* p, I x) {  // lanes hold 0..255: keep each one's low byte
    const __m256i pick =
        _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12,
                         -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i b = _mm256_shuffle_epi8(x, pick);
    const __m128i both =
        _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), both);
  }
  static I as_int(R x) { return _mm256_castps_si256(x); }
  static R as_float(I x) { return _mm256_castsi256_ps(x); }
  static I set1_i(int32_t x) { return _mm256_set1_epi32(x); }
  static I add_i(I a, I b) { return _mm256_add_epi32(a, b); }
  static I and_i(I a, I b) { return _mm256_and_si256(a, b); }
  static I min_i(I a, I b) { return _mm256_min_epi32(a, b); }
  static I max_i(I a, I b) { return _mm256_max_epi32(a, b); }
  template <int k>
  static I slli(I a) {
    return _mm256_slli_epi32(a, k);
  }
  template <int k>
  static I srli(I a) {
    return _mm256_srli_epi32(a, k);
  }
  static R zero_where_code_zero(I code, R x) {
    const __m256i zero = _mm256_cmpeq_epi32(code, _mm256_setzero_si256());
    return _mm256_andnot_ps(_mm256_castsi256_ps(zero), x);
  }
  static I zero_code_where_zero(R v, I code) {
    const __m256 zero = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_EQ_OQ);
    return _mm256_andnot_si256(_mm256_castps_si256(zero), code);
  }
};

}  // namespace

void adam_range_avx2(const AdamScalars& s, const AdamTensor& t, int64_t begin, int64_t end) {
  adam_detail::dispatch<Avx2Vec, adam_detail::ScalarVec>(s, t, begin, end);
}

void adam_compact_range_avx2(const AdamScalars& s, const CompactAdamTensor& t, int64_t begin,
                             int64_t end) {
  adam_detail::compact_dispatch<Avx2Vec, adam_detail::ScalarVec>(s, t, begin, end);
}

}  // namespace tierlift
