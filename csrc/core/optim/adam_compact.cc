#include "core/optim/adam_compact.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/util/thread_pool.h"

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
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument("adam_compact_step: tensor " + std::to_string(index) + ": " + what);
  };
  if (h.amsgrad) fail("amsgrad is not supported with compact state (use fp32 state)");
  if (t.numel < 0) fail("negative numel");
  if (t.numel == 0) return;
  if (!t.param || !t.grad || !t.exp_avg || !t.exp_avg_sq || !t.exp_avg_sq_scale) {
    fail("null param, grad or state");
  }
  if (t.copy_type != DType::kNone && !t.param_copy) fail("copy_type set but param_copy is null");
  if (t.grad_type == DType::kNone) fail("grad_type must be a float type");
  if (h.step < 1) fail("step must be >= 1");
}

struct Chunk {
  size_t tensor;
  int64_t begin, end;
};

}  // namespace

void adam_compact_step(const AdamHyper& hyper, const CompactAdamTensor* tensors, size_t count) {
  for (size_t i = 0; i < count; ++i) validate(hyper, tensors[i], i);
  const AdamScalars s = adam_scalars(hyper);
  const SimdLevel level = active_simd_level();
  // Whole blocks per chunk (a block's scale depends on all of it); 32K elements as adam_step.
  constexpr int64_t kChunk = 1 << 15;
  static_assert(kChunk % kCompactBlock == 0, "chunks must hold whole blocks");
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < count; ++i) {
    for (int64_t b = 0; b < tensors[i].numel; b += kChunk) {
      chunks.push_back({i, b, std::min(tensors[i].numel, b + kChunk)});
    }
  }
  ThreadPool::global().parallel_for(
      static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
        for (int64_t c = lo; c < hi; ++c) {
          const Chunk& ch = chunks[c];
          adam_compact_step_range(level, s, tensors[ch.tensor], ch.begin, ch.end);
        }
      });
}

}  // namespace tierlift
