// CPU and CUDA implementations of tierlift::adam_step_ (schema in schemas.cpp).
// Validates every tensor, then hands raw pointers to core/optim (CPU) or cuda/adam (GPU).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "adam_common.h"
#include "checks.h"
#include "core/optim/adam.h"

#ifdef TIERLIFT_WITH_CUDA
#include <utility>

#include "cuda/adam.cuh"
#endif

namespace tierlift {
namespace {

struct AdamArgs {
  at::TensorList params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies;
  AdamHyper hyper;
  // Out of place (CPU): the old weights and moments are read from these.
  SourceList params_from, exp_avgs_from, exp_avg_sqs_from, max_exp_avg_sqs_from;
};

// Checks shared by both backends; returns the device every tensor must be on.
void check_adam_args(const AdamArgs& a, c10::DeviceType backend) {
  const size_t n = a.params.size();
  TORCH_CHECK_VALUE(a.grads.size() == n && a.exp_avgs.size() == n && a.exp_avg_sqs.size() == n,
                    "adam_step_: params, grads, exp_avgs and exp_avg_sqs must have the same "
                    "length, got ",
                    n, ", ", a.grads.size(), ", ", a.exp_avgs.size(), ", ", a.exp_avg_sqs.size());
  TORCH_CHECK_VALUE(!a.hyper.amsgrad || a.max_exp_avg_sqs.size() == n,
                    "adam_step_: amsgrad needs one max_exp_avg_sq per param");
  TORCH_CHECK_VALUE(a.param_copies.empty() || a.param_copies.size() == n,
                    "adam_step_: param_copies must be empty or one per param");
  TORCH_CHECK_VALUE(a.hyper.step >= 1, "adam_step_: step must be >= 1, got ", a.hyper.step);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = a.params[i];
    TORCH_CHECK_VALUE(p.device().type() == backend, "adam_step_: params[", i, "] is on ",
                      p.device(), " but this call runs on ", backend);
    auto same = [&](const at::Tensor& t, const char* name, bool fp32) {
      check_dense_beside("adam_step_", t, name, i, p);
      TORCH_CHECK_VALUE(t.numel() == p.numel(), "adam_step_: ", name, "[", i, "] has ", t.numel(),
                        " elements, params[", i, "] has ", p.numel());
      check_contiguous("adam_step_", t, name, i);
      if (fp32) {
        TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "adam_step_: ", name, "[", i,
                         "] must be float32, got ", t.scalar_type());
      } else {
        to_core_dtype(t.scalar_type(), name);
      }
    };
    same(p, "params", true);
    same(a.grads[i], "grads", false);
    same(a.exp_avgs[i], "exp_avgs", true);
    same(a.exp_avg_sqs[i], "exp_avg_sqs", true);
    if (a.hyper.amsgrad) same(a.max_exp_avg_sqs[i], "max_exp_avg_sqs", true);
    if (!a.param_copies.empty()) same(a.param_copies[i], "param_copies", false);
  }
  check_sources("adam_step_", a.params_from, a.params, "params_from");
  check_sources("adam_step_", a.exp_avgs_from, a.exp_avgs, "exp_avgs_from");
  check_sources("adam_step_", a.exp_avg_sqs_from, a.exp_avg_sqs, "exp_avg_sqs_from");
  if (a.hyper.amsgrad) {
    check_sources("adam_step_", a.max_exp_avg_sqs_from, a.max_exp_avg_sqs, "max_exp_avg_sqs_from");
  }
}

AdamTensor core_view(const AdamArgs& a, size_t i) {
  AdamTensor t;
  t.param = a.params[i].data_ptr<float>();
  t.grad = a.grads[i].data_ptr();
  t.grad_type = to_core_dtype(a.grads[i].scalar_type(), "grads");
  t.exp_avg = a.exp_avgs[i].data_ptr<float>();
  t.exp_avg_sq = a.exp_avg_sqs[i].data_ptr<float>();
  if (a.hyper.amsgrad) t.max_exp_avg_sq = a.max_exp_avg_sqs[i].data_ptr<float>();
  if (!a.param_copies.empty()) {
    t.param_copy = a.param_copies[i].data_ptr();
    t.copy_type = to_core_dtype(a.param_copies[i].scalar_type(), "param_copies");
  }
  t.numel = a.params[i].numel();
  t.param_from = source_ptr<float>(a.params_from, i);
  t.exp_avg_from = source_ptr<float>(a.exp_avgs_from, i);
  t.exp_avg_sq_from = source_ptr<float>(a.exp_avg_sqs_from, i);
  if (a.hyper.amsgrad) t.max_exp_avg_sq_from = source_ptr<float>(a.max_exp_avg_sqs_from, i);
  return t;
}

AdamArgs make_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                   at::TensorList param_copies, double lr, double beta1, double beta2, double eps,
                   double weight_decay, int64_t step, bool decoupled, bool amsgrad, bool maximize) {
  return {params,
          grads,
          exp_avgs,
          exp_avg_sqs,
          max_exp_avg_sqs,
          param_copies,
          adam_hyper(lr, beta1, beta2, eps, weight_decay, step, decoupled, amsgrad, maximize)};
}

void adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                   at::TensorList param_copies, double lr, double beta1, double beta2, double eps,
                   double weight_decay, int64_t step, bool decoupled, bool amsgrad, bool maximize,
                   const c10::optional<at::Tensor>& grad_scale, bool refresh_from_copies,
                   SourceList params_from, SourceList exp_avgs_from, SourceList exp_avg_sqs_from,
                   SourceList max_exp_avg_sqs_from) {
  check_grad_scale("adam_step_", grad_scale, params, c10::DeviceType::CPU);
  AdamArgs a = make_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, lr,
                         beta1, beta2, eps, weight_decay, step, decoupled, amsgrad, maximize);
  a.params_from = params_from;
  a.exp_avgs_from = exp_avgs_from;
  a.exp_avg_sqs_from = exp_avg_sqs_from;
  a.max_exp_avg_sqs_from = max_exp_avg_sqs_from;
  set_grad_scale(a.hyper, grad_scale);
  check_adam_args(a, c10::DeviceType::CPU);
  check_refresh("adam_step_", refresh_from_copies, param_copies);
  TORCH_CHECK_VALUE(!refresh_from_copies || !params_from.has_value(),
                    "adam_step_: refresh_from_copies updates params in place; it cannot be "
                    "combined with params_from");
  a.hyper.refresh_from_copy = refresh_from_copies;  // per chunk, just before its step
  std::vector<AdamTensor> views;
  views.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) views.push_back(core_view(a, i));
  adam_step(a.hyper, views.data(), views.size());
}

void adam_memory_pass_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, at::TensorList param_copies) {
  const AdamArgs a = make_args(params, grads, exp_avgs, exp_avg_sqs, {}, param_copies, 1e-3, 0.9,
                               0.999, 1e-8, 0.0, 1, true, false, false);
  check_adam_args(a, c10::DeviceType::CPU);
  std::vector<AdamTensor> views;
  views.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) views.push_back(core_view(a, i));
  adam_memory_pass(views.data(), views.size());
}

#ifdef TIERLIFT_WITH_CUDA
void adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                    at::TensorList param_copies, double lr, double beta1, double beta2, double eps,
                    double weight_decay, int64_t step, bool decoupled, bool amsgrad, bool maximize,
                    const c10::optional<at::Tensor>& grad_scale, bool refresh_from_copies,
                    SourceList params_from, SourceList exp_avgs_from, SourceList exp_avg_sqs_from,
                    SourceList max_exp_avg_sqs_from) {
  check_no_sources("adam_step_",
                   {&params_from, &exp_avgs_from, &exp_avg_sqs_from, &max_exp_avg_sqs_from});
  check_grad_scale("adam_step_", grad_scale, params, c10::DeviceType::CUDA);
  const AdamArgs a =
      make_args(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, lr, beta1,
                beta2, eps, weight_decay, step, decoupled, amsgrad, maximize);
  check_adam_args(a, c10::DeviceType::CUDA);
  check_refresh("adam_step_", refresh_from_copies, param_copies);
  const float* scale = grad_scale_ptr(grad_scale);
  const AdamScalars s = adam_scalars(a.hyper);
  launch_grouped<cuda::AdamTensorPtrs>(
      "adam_step_", params,
      [&](size_t i) {
        const AdamTensor t = core_view(a, i);
        return std::make_pair(std::make_pair(t.grad_type, t.copy_type),
                              cuda::AdamTensorPtrs{t.param, t.grad, t.exp_avg, t.exp_avg_sq,
                                                   t.max_exp_avg_sq, t.param_copy, t.numel});
      },
      [&](const cuda::AdamTensorPtrs* ptrs, int count, DType grad_type, DType copy_type,
          cudaStream_t stream) {
        return cuda::adam_step(ptrs, count, grad_type, copy_type, s, stream, scale,
                               refresh_from_copies);
      });
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(tierlift, CPU, m) {
  m.impl("adam_step_", &adam_step_cpu);
  m.impl("adam_memory_pass_", &adam_memory_pass_cpu);
}

#ifdef TIERLIFT_WITH_CUDA
TORCH_LIBRARY_IMPL(tierlift, CUDA, m) { m.impl("adam_step_", &adam_step_cuda); }
#endif

}  // namespace tierlift
