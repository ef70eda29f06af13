// CRC-32C: a hardware path (SSE4.2 crc32, 8 bytes per instruction) selected at run time, and a
// byte-at-a-time table path for other CPUs. All paths give identical results.
//
// Why three streams: the crc32 instruction has a latency of about 3 cycles and a throughput of
// one per cycle, so a single dependency chain uses a third of what the unit can do. Large
// buffers are therefore cut into rounds of 3 blocks of B bytes; three independent registers run
// over the three blocks in one interleaved loop, and are then joined exactly.
//
// The join is GF(2) algebra. Without the pre/post inversion, the CRC register is linear in
// (register, data), and feeding n zero bytes to a register r gives r * x^(8n) mod P (P the
// Castagnoli polynomial, bit-reflected). For blocks a, b, c of B bytes each, with the incoming
// register r on a and zero registers on b and c:
//   reg(r, a||b||c) = shift(shift(reg(r, a), B) ^ reg(0, b), B) ^ reg(0, c)
// where shift(r, B) = r * x^(8B) mod P. That product is linear in r, so it is precomputed once
// per block size as four 256-entry tables (one per byte of r): a shift costs 4 lookups.
// Two block sizes keep the tail short: 3 x 4 KiB rounds for large buffers, then 3 x 256 B rounds,
// then the single-stream loop for the last < 768 bytes. Small buffers take the single stream.
//
// Where the CPU has AVX-512 with VPCLMULQDQ, large buffers are folded instead: the crc32
// instruction peaks at 8 bytes a cycle, a carry-less multiply of a 512-bit register folds 64.
// Four 64-byte accumulators each take every fourth 64-byte block; folding a 128-bit lane V
// forward over F bits is V.lo * (x^(F+32) mod P) ^ V.hi * (x^(F-32) mod P) in the reflected,
// shifted-by-one form PCLMULQDQ needs (the same rule gives zlib's published fold constants for
// the gzip polynomial). The result stays congruent to the message, so the 256 accumulator bytes
// are then fed to the crc32 instruction like data, and the tail follows them.
#include "core/io/crc32c.h"

#include <array>
#include <cstring>

#include "core/util/cpu_features.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tierlift::io {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[i] = c;
  }
  return t;
}

// r * x mod P in the reflected representation (bit 31 holds x^0, bit 0 holds x^31).
constexpr uint32_t mul_x(uint32_t r) { return (r & 1) ? (r >> 1) ^ kPoly : r >> 1; }

// a * b mod P, both reflected: walk a's coefficients from x^0 up, b times x^i at step i.
uint32_t mul_mod_p(uint32_t a, uint32_t b) {
  uint32_t out = 0;
  for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) out ^= b;
    b = mul_x(b);
  }
  return out;
}

// The linear operator r -> r * x^(8 * bytes) mod P as four byte tables.
struct ZeroShift {
  std::array<std::array<uint32_t, 256>, 4> t{};

  explicit ZeroShift(size_t bytes) {
    uint32_t xn = 1u << 31;  // x^0
    for (size_t i = 0; i < 8 * bytes; ++i) xn = mul_x(xn);
    for (int k = 0; k < 4; ++k) {
      for (uint32_t v = 0; v < 256; ++v) t[k][v] = mul_mod_p(xn, v << (8 * k));
    }
  }

  uint32_t operator()(uint32_t r) const {
    return t[0][r & 0xFF] ^ t[1][(r >> 8) & 0xFF] ^ t[2][(r >> 16) & 0xFF] ^ t[3][r >> 24];
  }
};

#if defined(__x86_64__)
constexpr size_t kBigBlock = 4096;   // bytes per stream in a large round
constexpr size_t kSmallBlock = 256;  // bytes per stream in a small round

__attribute__((target("sse4.2"))) inline uint64_t load_crc_u64(uint64_t c, const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return _mm_crc32_u64(c, v);
}

// One dependency chain over n bytes of the raw (uninverted) register.
__attribute__((target("sse4.2"))) uint32_t serial_raw(uint32_t c32, const unsigned char* p,
                                                      size_t n) {
  uint64_t c = c32;
  for (; n >= 8; n -= 8, p += 8) c = load_crc_u64(c, p);
  c32 = static_cast<uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

// As many rounds of 3 x `block` bytes as fit in n; advances p and n past them.
template <size_t block>
__attribute__((target("sse4.2"))) uint32_t three_streams(uint32_t c32, const unsigned char*& p,
                                                         size_t& n, const ZeroShift& shift) {
  static_assert(block % 8 == 0, "block must be a multiple of 8 bytes");
  while (n >= 3 * block) {
    uint64_t a = c32, b = 0, c = 0;
    const unsigned char* pa = p;
    const unsigned char* pb = p + block;
    const unsigned char* pc = p + 2 * block;
    for (size_t i = 0; i < block; i += 8) {
      a = load_crc_u64(a, pa + i);
      b = load_crc_u64(b, pb + i);
      c = load_crc_u64(c, pc + i);
    }
    c32 = shift(shift(static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b)) ^
          static_cast<uint32_t>(c);
    p += 3 * block;
    n -= 3 * block;
  }
  return c32;
}

__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t crc, const void* data, size_t n) {
  static const ZeroShift big(kBigBlock);
  static const ZeroShift small(kSmallBlock);
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  c = three_streams<kBigBlock>(c, p, n, big);
  c = three_streams<kSmallBlock>(c, p, n, small);
  return ~serial_raw(c, p, n);
}

constexpr size_t kFoldBytes = 256;      // four 64-byte accumulators
constexpr size_t kMinFoldBytes = 1024;  // below this the fixed cost of the fold does not pay

// x^e mod P, reflected and shifted left by one bit: a fold constant for PCLMULQDQ.
uint64_t fold_constant(size_t e) {
  uint32_t r = 1u << 31;  // x^0
  for (size_t i = 0; i < e; ++i) r = mul_x(r);
  return static_cast<uint64_t>(r) << 1;
}

#define TIERLIFT_FOLD_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))

// Each 128-bit lane of x moved forward over the fold distance, plus the data that lands there.
TIERLIFT_FOLD_TARGET inline __m512i fold(__m512i x, __m512i k, __m512i data) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                   _mm512_clmulepi64_epi128(x, k, 0x11), data, 0x96);
}

// n >= kFoldBytes: folds every whole 256-byte block, then the tail takes the crc32 instruction.
TIERLIFT_FOLD_TARGET uint32_t crc32c_fold(uint32_t crc, const void* data, size_t n) {
  static const uint64_t k_lo = fold_constant(8 * kFoldBytes + 32);
  static const uint64_t k_hi = fold_constant(8 * kFoldBytes - 32);
  const auto* p = static_cast<const unsigned char*>(data);
  const __m512i k = _mm512_set_epi64(static_cast<int64_t>(k_hi), static_cast<int64_t>(k_lo),
                                     static_cast<int64_t>(k_hi), static_cast<int64_t>(k_lo),
                                     static_cast<int64_t>(k_hi), static_cast<int64_t>(k_lo),
                                     static_cast<int64_t>(k_hi), static_cast<int64_t>(k_lo));
  // The incoming register enters as an xor into the first four bytes.
  const __m512i init =
      _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, static_cast<int>(~crc));
  __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(p), init);
  __m512i x1 = _mm512_loadu_si512(p + 64);
  __m512i x2 = _mm512_loadu_si512(p + 128);
  __m512i x3 = _mm512_loadu_si512(p + 192);
  p += kFoldBytes;
  n -= kFoldBytes;
  for (; n >= kFoldBytes; n -= kFoldBytes, p += kFoldBytes) {
    x0 = fold(x0, k, _mm512_loadu_si512(p));
    x1 = fold(x1, k, _mm512_loadu_si512(p + 64));
    x2 = fold(x2, k, _mm512_loadu_si512(p + 128));
    x3 = fold(x3, k, _mm512_loadu_si512(p + 192));
  }
  alignas(64) unsigned char rest[kFoldBytes];
  _mm512_store_si512(rest, x0);
  _mm512_store_si512(rest + 64, x1);
  _mm512_store_si512(rest + 128, x2);
  _mm512_store_si512(rest + 192, x3);
  return ~serial_raw(serial_raw(0, rest, kFoldBytes), p, n);
}
#undef TIERLIFT_FOLD_TARGET
#endif

}  // namespace

uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n) {
  static const std::array<uint32_t, 256> table = make_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  while (n--) c = table[(c ^ *p++) & 0xFF] ^ (c >> 8);
  return ~c;
}

namespace {
bool have_sse42() {
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
  return hw;
#else
  return false;
#endif
}

bool have_fold() {
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul") &&
                         have_sse42() && cpu_simd_level() == SimdLevel::kAvx512;
  return hw;
#else
  return false;
#endif
}
}  // namespace

uint32_t crc32c_one_stream(uint32_t crc, const void* data, size_t n) {
#if defined(__x86_64__)
  if (have_sse42()) return ~serial_raw(~crc, static_cast<const unsigned char*>(data), n);
#endif
  return crc32c_portable(crc, data, n);
}

uint32_t crc32c_three_streams(uint32_t crc, const void* data, size_t n) {
#if defined(__x86_64__)
  if (have_sse42()) return crc32c_sse42(crc, data, n);
#endif
  return crc32c_portable(crc, data, n);
}

uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
#if defined(__x86_64__)
  // TIERLIFT_SIMD=avx2|scalar turns the fold off (tests cover both paths that way).
  if (n >= kMinFoldBytes && have_fold() && active_simd_level() == SimdLevel::kAvx512) {
    return crc32c_fold(crc, data, n);
  }
#endif
  return crc32c_three_streams(crc, data, n);
}

}  // namespace tierlift::io
