// The host-side driver both CPU Adam state layouts share (adam.cc: fp32 state, adam_compact.cc:
// compact state): the per-tensor checks they have in common and the split of the step into
// chunks run on ThreadPool::global(). Internal to core/optim.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/optim/adam.h"
#include "core/optim/copy_refresh.h"
#include "core/util/thread_pool.h"

namespace tierlift {
namespace adam_detail {

// 32K elements: ~1 MB of traffic, amortizes dispatch. A multiple of 64, so SIMD bodies never
// split a vector between threads, and of the compact state's blocks.
constexpr int64_t kThreadChunk = 1 << 15;

[[noreturn]] inline void fail_tensor(const char* op, size_t index, const std::string& what) {
  throw std::invalid_argument(std::string(op) + ": tensor " + std::to_string(index) + ": " + what);
}

// The checks of one tensor (AdamTensor or CompactAdamTensor) that every layout makes, in this
// order; `state_set` says whether the layout's state pointers are all non-null and
// layout_checks() runs the layout's own checks between the pointer and the type checks. Throws
// std::invalid_argument "<op>: tensor <index>: <what>".
template <typename Tensor, typename LayoutChecks>
void validate_tensor(const char* op, const AdamHyper& h, const Tensor& t, size_t index,
                     bool state_set, LayoutChecks&& layout_checks) {
  if (t.numel < 0) fail_tensor(op, index, "negative numel");
  if (t.numel == 0) return;
  if (!t.param || !t.grad || !state_set) fail_tensor(op, index, "null param, grad or state");
  layout_checks();
  if (t.copy_type != DType::kNone && !t.param_copy) {
    fail_tensor(op, index, "copy_type set but param_copy is null");
  }
  if (t.grad_type == DType::kNone) fail_tensor(op, index, "grad_type must be a float type");
  if (h.step < 1) fail_tensor(op, index, "step must be >= 1");
  if (h.unscale && !grad_scale_usable(h.grad_scale)) {
    fail_tensor(op, index,
                "grad_scale must be finite and > 0, got " + std::to_string(h.grad_scale));
  }
}

// Cuts every tensor into kThreadChunk-element ranges and runs step_range(tensor, begin, end) on
// each, spread over ThreadPool::global(); with `refresh`, refresh_from_copy on the range first.
template <typename Tensor, typename StepRange>
void run_chunks(const Tensor* tensors, size_t count, bool refresh, StepRange&& step_range) {
  struct Chunk {
    size_t tensor;
    int64_t begin, end;
  };
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < count; ++i) {
    for (int64_t b = 0; b < tensors[i].numel; b += kThreadChunk) {
      chunks.push_back({i, b, std::min(tensors[i].numel, b + kThreadChunk)});
    }
  }
  ThreadPool::global().parallel_for(
      static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
        for (int64_t c = lo; c < hi; ++c) {
          const Chunk& ch = chunks[c];
          const Tensor& t = tensors[ch.tensor];
          if (refresh) {
            refresh_from_copy(t.param, t.param_copy, t.copy_type, ch.begin, ch.end);
          }
          step_range(t, ch.begin, ch.end);
        }
      });
}

}  // namespace adam_detail
}  // namespace tierlift
