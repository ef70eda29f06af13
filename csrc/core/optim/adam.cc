#include "core/optim/adam.h"

#include <cmath>

#include "core/optim/adam_driver.h"

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
  s.unscale = h.unscale;
  s.inv_grad_scale = h.unscale ? grad_unscale_factor(h.grad_scale) : 1.0f;
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
  adam_detail::validate_tensor("adam_step", h, t, index, t.exp_avg && t.exp_avg_sq, [&] {
    if (h.amsgrad && !t.max_exp_avg_sq) {
      adam_detail::fail_tensor("adam_step", index, "amsgrad needs max_exp_avg_sq");
    }
    if (h.refresh_from_copy && out_of_place(t)) {
      adam_detail::fail_tensor(
          "adam_step", index, "refresh_from_copy updates the weight in place; it takes no sources");
    }
  });
}

void run_chunks(const AdamScalars& s, const AdamTensor* tensors, size_t count, bool refresh) {
  const SimdLevel level = active_simd_level();
  adam_detail::run_chunks(tensors, count, refresh,
                          [&](const AdamTensor& t, int64_t begin, int64_t end) {
                            adam_step_range(level, s, t, begin, end);
                          });
}

}  // namespace

void adam_step(const AdamHyper& hyper, const AdamTensor* tensors, size_t count) {
  for (size_t i = 0; i < count; ++i) validate(hyper, tensors[i], i);
  run_chunks(adam_scalars(hyper), tensors, count, hyper.refresh_from_copy);
}

void adam_memory_pass(const AdamTensor* tensors, size_t count) {
  const AdamHyper hyper;
  for (size_t i = 0; i < count; ++i) validate(hyper, tensors[i], i);
  AdamScalars s = adam_scalars(hyper);
  s.memory_only = true;
  run_chunks(s, tensors, count, false);
}

}  // namespace tierlift
