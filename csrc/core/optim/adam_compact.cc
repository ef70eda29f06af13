#include "core/optim/adam_compact.h"

#include <algorithm>
#include <limits>

#include "core/optim/adam_driver.h"

namespace tierlift {

void quantize_exp_avg_sq(const float* v, int64_t n, uint8_t* codes, float* scales) {
  for (int64_t b = 0; b < n; b += kCompactBlock) {
    const int64_t e = std::min(n, b + kCompactBlock);
    float vmax = 0.0f;
    bool finite = true;
    for (int64_t i = b; i < e; ++i) {
      finite = finite && v[i] - v[i] == 0.0f;
      vmax = vmax < v[i] ? v[i] : vmax;
    }
    const float scale = finite ? vmax : std::numeric_limits<float>::quiet_NaN();
    scales[b / kCompactBlock] = scale;
    for (int64_t i = b; i < e; ++i) codes[i] = finite ? encode_v(v[i], scale) : 255;
  }
}

void dequantize_exp_avg_sq(const uint8_t* codes, const float* scales, int64_t n, float* v) {
  for (int64_t i = 0; i < n; ++i) v[i] = decode_v(codes[i], scales[i / kCompactBlock]);
}

void adam_compact_step_range(SimdLevel level, const AdamScalars& s, const CompactAdamTensor& t,
                             int64_t begin, int64_t end) {
  switch (level) {
    case SimdLevel::kAvx512:
      return adam_compact_range_avx512(s, t, begin, end);
    case SimdLevel::kAvx2:
      return adam_compact_range_avx2(s, t, begin, end);
    default:
      return adam_compact_range_scalar(s, t, begin, end);
  }
}

namespace {

void validate(const AdamHyper& h, const CompactAdamTensor& t, size_t index) {
  constexpr const char* kOp = "adam_compact_step";
  if (h.amsgrad) {
    adam_detail::fail_tensor(kOp, index,
                             "amsgrad is not supported with compact state (use fp32 state)");
  }
  adam_detail::validate_tensor(kOp, h, t, index, t.exp_avg && t.exp_avg_sq && t.exp_avg_sq_scale,
                               [&] {
                                 if (h.refresh_from_copy && out_of_place(t)) {
                                   adam_detail::fail_tensor(kOp, index,
                                                            "refresh_from_copy updates the weight "
                                                            "in place; it takes no sources");
                                 }
                               });
}

}  // namespace

void adam_compact_step(const AdamHyper& hyper, const CompactAdamTensor* tensors, size_t count) {
  for (size_t i = 0; i < count; ++i) validate(hyper, tensors[i], i);
  const AdamScalars s = adam_scalars(hyper);
  const SimdLevel level = active_simd_level();
  // Whole blocks per chunk: a block's scale depends on all of it.
  static_assert(adam_detail::kThreadChunk % kCompactBlock == 0, "chunks must hold whole blocks");
  adam_detail::run_chunks(tensors, count, hyper.refresh_from_copy,
                          [&](const CompactAdamTensor& t, int64_t begin, int64_t end) {
                            adam_compact_step_range(level, s, t, begin, end);
                          });
}

}  // namespace tierlift
