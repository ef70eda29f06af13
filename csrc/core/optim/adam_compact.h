// Adam / AdamW with compact moments (the memory layout of 8-bit Adam): the fp32 weight stays
// fp32, m is stored as bf16 and v as one byte per element plus one fp32 scale per block of
// kCompactBlock elements, 2 + 1 + 4/256 bytes per parameter instead of 8.
//
// Per element the kernel decodes m and v into fp32 registers, runs exactly adam_step's fp32
// arithmetic (adam_impl.h: decay_and_moments, apply_update), rounds m back to bf16 (nearest
// even) and keeps the new fp32 v of the whole block in a buffer; once the block is done its
// scale is the block's new max and every v is encoded against it. The weight update uses the
// unrounded new m and v, as the fp32 kernel does.
//
// The v code (exponent-mantissa, relative to the block max). v >= 0 always, so with r = v / max
// in [0, 1] a code c in 1..255 stands for the fp32 number whose bits are (c + kVCodeBase) << 20:
// 3 mantissa bits and the 32 binades below 1.0, so code 255 is r = 1 and code 1 is
// r = 1.25 * 2^-32. Code 0 is exactly zero and only zero encodes to it. Encoding rounds r's bits
// to the nearest code (ties to even), so for r >= 2^-31 (31 binades under the max) the relative
// error of a round trip is at most 2^-4 (half a step of the 3-bit mantissa) plus the two fp32
// roundings of v / max and r * max; in sqrt(v), which the step divides by, at most ~3.1%. A
// nonzero v below 1.1875 * 2^-32 of its block's max is encoded as code 1 (rounded up, never to
// zero: a zeroed v would make the update m / eps explode). Decoding underflows to zero only in
// blocks whose max is below ~2^-94, where sqrt(v) < 1e-14 is far below any eps. A linear (absmax)
// code would flush every v under max / 255 to zero instead.
//
// Blocks never straddle a 1024-aligned boundary, so any slice of a tensor that starts at a
// multiple of kCompactBlock (the offload layer's 1024-element chunks) can be stepped on its own
// with the matching slice of scales. A block with a NaN or infinite v stores scale NaN and code
// 255 everywhere: it reads back NaN, like the fp32 state of a diverged step would.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/optim/adam.h"
#include "core/util/cpu_features.h"
#include "core/util/dtype.h"

namespace tierlift {

constexpr int64_t kCompactBlock = 256;         // elements per v scale
constexpr int kVCodeShift = 20;                // 23 fp32 mantissa bits - 3 kept
constexpr int32_t kVCodeBase = 127 * 8 - 255;  // (bits of 1.0f) >> kVCodeShift, minus code 255

struct CompactAdamTensor {
  float* param = nullptr;  // fp32 weights or master weights, updated in place
  const void* grad = nullptr;
  DType grad_type = DType::kFloat32;
  uint16_t* exp_avg = nullptr;        // bf16 bits
  uint8_t* exp_avg_sq = nullptr;      // v codes
  float* exp_avg_sq_scale = nullptr;  // ceil(numel / kCompactBlock) block maxima
  void* param_copy = nullptr;         // optional: receives the updated weight in copy_type
  DType copy_type = DType::kNone;
  int64_t numel = 0;
  // Optional, out of place (as AdamTensor's): the old weight, m, v codes and scales are read from
  // these, the new ones written to the pointers above. Null: in place.
  const float* param_from = nullptr;
  const uint16_t* exp_avg_from = nullptr;
  const uint8_t* exp_avg_sq_from = nullptr;
  const float* exp_avg_sq_scale_from = nullptr;
};

// `t` with every source left null pointing at the state it updates: what the kernel loads from.
inline CompactAdamTensor with_sources(CompactAdamTensor t) {
  if (!t.param_from) t.param_from = t.param;
  if (!t.exp_avg_from) t.exp_avg_from = t.exp_avg;
  if (!t.exp_avg_sq_from) t.exp_avg_sq_from = t.exp_avg_sq;
  if (!t.exp_avg_sq_scale_from) t.exp_avg_sq_scale_from = t.exp_avg_sq_scale;
  return t;
}

inline bool out_of_place(const CompactAdamTensor& t) {
  return t.param_from || t.exp_avg_from || t.exp_avg_sq_from || t.exp_avg_sq_scale_from;
}

inline int64_t compact_scale_count(int64_t numel) {
  return (numel + kCompactBlock - 1) / kCompactBlock;
}

// One v against its block's max (finite, >= v >= 0); what every kernel path computes.
static inline uint8_t encode_v(float v, float block_max) {
  if (v == 0.0f) return 0;
  const uint32_t u = f32_bits(v / block_max);
  const int32_t q = static_cast<int32_t>((u + 0x7ffffu + ((u >> kVCodeShift) & 1u)) >> kVCodeShift);
  const int32_t c = q - kVCodeBase;
  return static_cast<uint8_t>(c < 1 ? 1 : (c > 255 ? 255 : c));
}

static inline float decode_v(uint8_t code, float block_max) {
  if (code == 0) return 0.0f;
  return bits_f32(static_cast<uint32_t>(code + kVCodeBase) << kVCodeShift) * block_max;
}

// Whole tensors, block by block (state conversion and tests): scales gets
// compact_scale_count(n) entries.
void quantize_exp_avg_sq(const float* v, int64_t n, uint8_t* codes, float* scales);
void dequantize_exp_avg_sq(const uint8_t* codes, const float* scales, int64_t n, float* v);

// Throws std::invalid_argument on inconsistent input (null pointers, amsgrad, which compact
// state does not support: its running max would need a third compact buffer).
void adam_compact_step(const AdamHyper& hyper, const CompactAdamTensor* tensors, size_t count);

// One range on an explicit SIMD level, unthreaded; `begin` is a multiple of kCompactBlock.
void adam_compact_step_range(SimdLevel level, const AdamScalars& s, const CompactAdamTensor& t,
                             int64_t begin, int64_t end);

// Per-ISA entry points (in adam_scalar.cc, adam_avx2.cc, adam_avx512.cc).
void adam_compact_range_scalar(const AdamScalars& s, const CompactAdamTensor& t, int64_t begin,
                               int64_t end);
void adam_compact_range_avx2(const AdamScalars& s, const CompactAdamTensor& t, int64_t begin,
                             int64_t end);
void adam_compact_range_avx512(const AdamScalars& s, const CompactAdamTensor& t, int64_t begin,
                               int64_t end);

}  // namespace tierlift
