// refresh_from_copy: before a range of a tensor is stepped, each weight whose low-precision copy
// (the bf16/fp16 parameter a model computes with) is no longer that weight rounded to the copy's
// type was edited through the copy (load_state_dict, an EMA swap, p.mul_ under no_grad), and
// takes the copy's value, as torch would step from it. Run per thread chunk just before the
// chunk's step, so the range is read while it is in cache. Internal to core/optim.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/util/dtype.h"

namespace tierlift {
namespace adam_detail {

// Whether any of the n bf16 values differs from the fp32 p rounded to bf16 (f32_to_bf16's
// rounding, NaN as 0x7fc0), with no branch per element so that the compiler vectorizes it.
inline bool bf16_block_differs(const float* p, const uint16_t* have, int64_t n) {
  uint32_t differs = 0;
  for (int64_t j = 0; j < n; ++j) {
    uint32_t u;
    std::memcpy(&u, p + j, sizeof(u));
    const uint32_t rounded = (u + ((u >> 16) & 1u) + 0x7fffu) >> 16;
    const uint32_t mine = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : (rounded & 0xffffu);
    differs |= mine ^ have[j];
  }
  return differs != 0;
}

// Elements [begin, end) of param from its copy, with the conversions the kernels write copies
// with. Edited elements are rare: a bf16 block without a difference is skipped after the
// branch-free check, and only a block with one is fixed element by element.
inline void refresh_from_copy(float* param, const void* copy, DType copy_type, int64_t begin,
                              int64_t end) {
  if (copy_type == DType::kNone) return;
  if (copy_type == DType::kFloat32) {
    if (copy != param) {
      std::memcpy(param + begin, static_cast<const float*>(copy) + begin,
                  static_cast<size_t>(end - begin) * sizeof(float));
    }
    return;
  }
  const auto* have = static_cast<const uint16_t*>(copy);
  const bool bf16 = copy_type == DType::kBFloat16;
  constexpr int64_t kBlock = 4096;
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t e = b + kBlock < end ? b + kBlock : end;
    if (bf16 && !bf16_block_differs(param + b, have + b, e - b)) continue;
    for (int64_t j = b; j < e; ++j) {
      const uint16_t mine = bf16 ? f32_to_bf16(param[j]) : f32_to_f16(param[j]);
      if (have[j] != mine) param[j] = bf16 ? bf16_to_f32(have[j]) : f16_to_f32(have[j]);
    }
  }
}

}  // namespace adam_detail
}  // namespace tierlift
