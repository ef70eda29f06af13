// What the vector-path tests of the Adam kernels share: one array of several tensors laid out
// at chosen element offsets from a 64-byte boundary (or packed back to back, as in a flat
// shard), every byte outside the tensors a canary the kernel must not touch; and core's
// rounding of an fp32 value to a storage dtype and back.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "core/util/dtype.h"

namespace tierlift {
namespace cudasim_test {

// x rounded to `t` (bf16/fp16 bits in the low 16 bits; fp32 bits), and back: core's conversions.
inline uint32_t round_to(DType t, float x) {
  if (t == DType::kBFloat16) return f32_to_bf16(x);
  if (t == DType::kFloat16) return f32_to_f16(x);
  return f32_bits(x);
}
inline float widen(DType t, uint32_t bits) {
  if (t == DType::kBFloat16) return bf16_to_f32(static_cast<uint16_t>(bits));
  if (t == DType::kFloat16) return f16_to_f32(static_cast<uint16_t>(bits));
  return bits_f32(bits);
}

// One array of every tensor in one allocation (counts[k] elements of `elem` bytes for tensor k),
// `guard` canary elements at least around each, canaries everywhere else.
class CanaryBuffer {
 public:
  static constexpr unsigned char kCanary = 0xa5;

  CanaryBuffer() = default;
  CanaryBuffer(int elem, const std::vector<int64_t>& counts, int lead, bool packed, int64_t guard)
      : elem_(elem), counts_(counts) {
    int64_t pos = guard;
    const int64_t per64 = 64 / elem_;
    for (size_t k = 0; k < counts.size(); ++k) {
      // Each tensor on its own 64-byte boundary plus `lead`, or right after the last one.
      if (!packed || k == 0) pos = (pos + guard + per64 - 1) / per64 * per64 + lead;
      start_.push_back(pos);
      pos += counts[k];
    }
    size_ = static_cast<size_t>(pos + guard);
    bytes_.assign(size_ * elem_ + 64, kCanary);
    const auto addr = reinterpret_cast<uintptr_t>(bytes_.data());
    base_ = bytes_.data() + (64 - addr % 64) % 64;
  }

  void* at(size_t k) { return base_ + start_[k] * elem_; }
  uint32_t get(size_t k, int64_t i) const {
    uint32_t u = 0;
    std::memcpy(&u, base_ + (start_[k] + i) * elem_, elem_);
    return u;
  }
  void set(size_t k, int64_t i, uint32_t u) {
    std::memcpy(base_ + (start_[k] + i) * elem_, &u, elem_);
  }
  int64_t count(size_t k) const { return counts_[k]; }

  // Bytes outside every tensor that are no longer canaries.
  int64_t touched_canaries() const {
    std::vector<bool> inside(size_, false);
    for (size_t k = 0; k < start_.size(); ++k) {
      for (int64_t i = 0; i < counts_[k]; ++i) inside[start_[k] + i] = true;
    }
    int64_t n = 0;
    for (size_t e = 0; e < size_; ++e) {
      if (inside[e]) continue;
      for (int b = 0; b < elem_; ++b) n += base_[e * elem_ + b] != kCanary;
    }
    return n;
  }

 private:
  int elem_ = 4;
  std::vector<int64_t> counts_, start_;
  std::vector<unsigned char> bytes_;
  unsigned char* base_ = nullptr;
  size_t size_ = 0;
};

}  // namespace cudasim_test
}  // namespace tierlift
