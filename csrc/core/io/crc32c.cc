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
#include "core/io/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
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
}  // namespace

uint32_t crc32c_one_stream(uint32_t crc, const void* data, size_t n) {
#if defined(__x86_64__)
  if (have_sse42()) return ~serial_raw(~crc, static_cast<const unsigned char*>(data), n);
#endif
  return crc32c_portable(crc, data, n);
}

uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
#if defined(__x86_64__)
  if (have_sse42()) return crc32c_sse42(crc, data, n);
#endif
  return crc32c_portable(crc, data, n);
}

}  // namespace tierlift::io
