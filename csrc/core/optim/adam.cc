#include "core/optim/adam.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/util/thread_pool.h"

namespace tierlift {

AdamScalars adam_scalars(const AdamHyper& h) {
  AdamScalars s;
  // Bias corrections in double, then rounded to float: what torch's single-tensor Adam does
  // (Python floats multiplied into fp32 tensors).
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  s.beta1 = static_cast<float>(h.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.eps = static_cast<float>(h.eps);
  s.weight_decay = static_cast<float>(h.weight_decay);
  s.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  s.neg_step_size = static_cast<float>(-(h.lr / bc1));
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.decoupled = h.decoupled;
  s.amsgrad = h.amsgrad;
  s.maximize = h.maximize;
  return s;
}

void adam_step_range(SimdLevel level, const AdamScalars& s, const AdamTensor& t, int64_t begin,
                     int64_t end) {
  switch (level) {
    case SimdLevel::kAvx512:
      return adam_range_avx512(s, t, begin, end);
    case SimdLevel::kAvx2:
      return adam_range_avx2(s, t, begin, end);
    default:
      return adam_range_scalar(s, t, begin, end);
  }
}

namespace {

void validate(const AdamHyper& h, const AdamTensor& t, size_t index) {
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument("adam_step: tensor " + std::to_string(index) + ": " + what);
  };
  if (t.numel < 0) fail("negative numel");
  if (t.numel == 0) return;
  if (!t.param || !t.grad || !t.exp_avg || !t.exp_avg_sq) fail("null param, grad or state");
  if (h.amsgrad && !t.max_exp_avg_sq) fail("amsgrad needs max_exp_avg_sq");
  if (t.copy_type != DType::kNone && !t.param_copy) fail("copy_type set but param_copy is null");
  if (t.grad_type == DType::kNone) fail("grad_type must be a float type");
  if (h.step < 1) fail("step must be >= 1");
}

// One piece of work: a contiguous range of one tensor. Ranges are multiples of 64 elements so
// SIMD bodies never split a vector between threads.
struct Chunk {
  size_t tensor;
  int64_t begin, end;
};

void run_chunks(const AdamScalars& s, const AdamTensor* tensors, size_t count) {
  const SimdLevel level = active_simd_level();
  constexpr int64_t kChunk = 1 << 15;  // 32K elements: ~1 MB of traffic, amortizes dispatch
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
          adam_step_range(level, s, tensors[ch.tensor], ch.begin, ch.end);
        }
      });
}

}  // namespace

void adam_step(const AdamHyper& hyper, const AdamTensor* tensors, size_t count) {
  for (size_t i = 0; i < count; ++i) validate(hyper, tensors[i], i);
  run_chunks(adam_scalars(hyper), tensors, count);
}

void adam_memory_pass(const AdamTensor* tensors, size_t count) {
  const AdamHyper hyper;
  for (size_t i = 0; i < count; ++i) validate(hyper, tensors[i], i);
  AdamScalars s = adam_scalars(hyper);
  s.memory_only = true;
  run_chunks(s, tensors, count);
}

}  // namespace tierlift
