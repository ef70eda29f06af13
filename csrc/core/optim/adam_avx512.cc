// AVX-512 (F, BW, VL) path: 16 fp32 lanes, for the fp32-state and the compact-state step. The
// target pragma compiles just this file for those instructions; cpu_features decides at run time
// whether it may be called.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
// GCC 12's own _mm512_undefined_* (`__m512i __Y = __Y;`) trips -Wmaybe-uninitialized at every
// inlined intrinsic: false warnings by the thousand that would bury real ones in the build log.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include "core/optim/adam_compact_impl.h"
#include "core/optim/adam_impl.h"

namespace tierlift {
namespace {

struct Avx512Vec {
  using R = __m512;
  static constexpr int kWidth = 16;
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, R x) { _mm512_storeu_ps(p, x); }
  // Non-temporal: p aligned to the vector; fence() orders these stores before what follows.
  static void stream(float* p, R x) { _mm512_stream_ps(p, x); }
  static void fence() { _mm_sfence(); }
  static R load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static void store_bf16(uint16_t* p, R x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static R load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_f16(uint16_t* p, R x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R div(R a, R b) { return _mm512_div_ps(a, b); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R sqrt(R a) { return _mm512_sqrt_ps(a); }
  static R max(R a, R b) { return _mm512_max_ps(b, a); }  // a < b ? b : a, as ScalarVec
  static R max_nan(R a, R b) {  // b where b is NaN, else max(a, b), as ScalarVec
    return _mm512_mask_mov_ps(max(a, b), _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q), b);
  }
  static R neg(R a) {
    return _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  }
  using I = __m512i;
  static I load_u8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_u8(uint8_t* p, I x) {  // lanes hold 0..255
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x));
  }
  static I as_int(R x) { return _mm512_castps_si512(x); }
  static R as_float(I x) { return _mm512_castsi512_ps(x); }
  static I set1_i(int32_t x) { return _mm512_set1_epi32(x); }
  static I add_i(I a, I b) { return _mm512_add_epi32(a, b); }
  static I and_i(I a, I b) { return _mm512_and_si512(a, b); }
  static I min_i(I a, I b) { return _mm512_min_epi32(a, b); }
  static I max_i(I a, I b) { return _mm512_max_epi32(a, b); }
  template <int k>
  static I slli(I a) {
    return _mm512_slli_epi32(a, k);
  }
  template <int k>
  static I srli(I a) {
    return _mm512_srli_epi32(a, k);
  }
  static R zero_where_code_zero(I code, R x) {
    return _mm512_maskz_mov_ps(_mm512_test_epi32_mask(code, code), x);
  }
  static I zero_code_where_zero(R v, I code) {
    return _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NEQ_UQ), code);
  }
};

}  // namespace

void adam_range_avx512(const AdamScalars& s, const AdamTensor& t, int64_t begin, int64_t end) {
  adam_detail::dispatch<Avx512Vec, adam_detail::ScalarVec>(s, t, begin, end);
}

void adam_compact_range_avx512(const AdamScalars& s, const CompactAdamTensor& t, int64_t begin,
                               int64_t end) {
  adam_detail::compact_dispatch<Avx512Vec, adam_detail::ScalarVec>(s, t, begin, end);
}

}  // namespace tierlift
