// tierlift::advance_steps_ (schema in schemas.cpp): the optimizers' per-parameter step counts
// advanced in one call. torch keeps one 1-element fp32 tensor per parameter; adding 1 to each
// through the dispatcher (a += per tensor, or _foreach_add_, which loops over add_ on the CPU)
// costs microseconds a tensor, more than the rest of a small parameter's step. A count on the
// CPU in fp32 is incremented here directly, with the version bump an in-place add makes; any
// other (another dtype or device, as a loaded checkpoint may hold) takes add_.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace tierlift {
namespace {

bool direct(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.layout() == at::kStrided;
}

// The count as an integer, as int(tensor.item()) gives it (a count must be finite).
int64_t count_of(double v, size_t i) {
  TORCH_CHECK_VALUE(std::isfinite(v) && std::fabs(v) < 9.2e18, "advance_steps_: steps[", i, "] is ",
                    v, " after the increment, not a finite step count");
  return static_cast<int64_t>(v);
}

std::vector<int64_t> advance_steps(at::TensorList steps) {
  // Every check before any change.
  for (size_t i = 0; i < steps.size(); ++i) {
    const at::Tensor& t = steps[i];
    TORCH_CHECK_VALUE(t.numel() == 1, "advance_steps_: steps[", i,
                      "] must hold one element (a step count), got ", t.numel());
    if (direct(t)) count_of(static_cast<double>(*t.data_ptr<float>()) + 1.0, i);
  }
  std::vector<int64_t> counts;
  counts.reserve(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    const at::Tensor& t = steps[i];
    if (direct(t)) {
      float* v = t.data_ptr<float>();
      *v += 1.f;  // fp32 arithmetic, as add_(1) rounds it
      t.unsafeGetTensorImpl()->bump_version();
      counts.push_back(count_of(*v, i));
    } else {
      t.add_(1);
      counts.push_back(count_of(t.item<double>(), i));
    }
  }
  return counts;
}

}  // namespace

TORCH_LIBRARY_IMPL(tierlift, CompositeExplicitAutograd, m) {
  m.impl("advance_steps_", &advance_steps);
}

}  // namespace tierlift
