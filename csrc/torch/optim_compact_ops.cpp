// CPU and CUDA implementations of tierlift::adam_compact_step_ (schema in schemas.cpp).
// Validates every tensor, then hands raw pointers to core/optim/adam_compact (CPU) or
// cuda/adam_compact (GPU).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "adam_common.h"
#include "checks.h"
#include "core/optim/adam_compact.h"

#ifdef TIERLIFT_WITH_CUDA
#include <utility>

#include "cuda/adam_compact.cuh"
#endif

namespace tierlift {
namespace {

struct CompactArgs {
  at::TensorList params, grads, exp_avgs, exp_avg_sqs, scales, param_copies;
  AdamHyper hyper;
  // Out of place (CPU): the old weights, m, v codes and scales are read from these.
  SourceList params_from, exp_avgs_from, exp_avg_sqs_from, scales_from;
};

void check_args(const CompactArgs& a, c10::DeviceType backend) {
  const size_t n = a.params.size();
  TORCH_CHECK_VALUE(a.grads.size() == n && a.exp_avgs.size() == n && a.exp_avg_sqs.size() == n &&
                        a.scales.size() == n,
                    "adam_compact_step_: params, grads, exp_avgs, exp_avg_sqs and "
                    "exp_avg_sq_scales must have the same length, got ",
                    n, ", ", a.grads.size(), ", ", a.exp_avgs.size(), ", ", a.exp_avg_sqs.size(),
                    ", ", a.scales.size());
  TORCH_CHECK_VALUE(a.param_copies.empty() || a.param_copies.size() == n,
                    "adam_compact_step_: param_copies must be empty or one per param");
  TORCH_CHECK_VALUE(a.hyper.step >= 1, "adam_compact_step_: step must be >= 1, got ", a.hyper.step);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = a.params[i];
    TORCH_CHECK_VALUE(p.device().type() == backend, "adam_compact_step_: params[", i, "] is on ",
                      p.device(), " but this call runs on ", backend);
    auto check = [&](const at::Tensor& t, const char* name, int64_t numel,
                     c10::optional<at::ScalarType> dtype) {
      check_dense_beside("adam_compact_step_", t, name, i, p);
      TORCH_CHECK_VALUE(t.numel() == numel, "adam_compact_step_: ", name, "[", i, "] has ",
                        t.numel(), " elements, expected ", numel);
      check_contiguous("adam_compact_step_", t, name, i);
      if (dtype) {
        TORCH_CHECK_TYPE(t.scalar_type() == *dtype, "adam_compact_step_: ", name, "[", i,
                         "] must be ", *dtype, ", got ", t.scalar_type());
      } else {
        to_core_dtype(t.scalar_type(), name);
      }
    };
    const int64_t numel = p.numel();
    check(p, "params", numel, at::kFloat);
    check(a.grads[i], "grads", numel, c10::nullopt);
    check(a.exp_avgs[i], "exp_avgs", numel, at::kBFloat16);
    check(a.exp_avg_sqs[i], "exp_avg_sqs", numel, at::kByte);
    check(a.scales[i], "exp_avg_sq_scales", compact_scale_count(numel), at::kFloat);
    if (!a.param_copies.empty()) check(a.param_copies[i], "param_copies", numel, c10::nullopt);
  }
  check_sources("adam_compact_step_", a.params_from, a.params, "params_from");
  check_sources("adam_compact_step_", a.exp_avgs_from, a.exp_avgs, "exp_avgs_from");
  check_sources("adam_compact_step_", a.exp_avg_sqs_from, a.exp_avg_sqs, "exp_avg_sqs_from");
  check_sources("adam_compact_step_", a.scales_from, a.scales, "exp_avg_sq_scales_from");
}

CompactAdamTensor core_view(const CompactArgs& a, size_t i) {
  CompactAdamTensor t;
  t.param = a.params[i].data_ptr<float>();
  t.grad = a.grads[i].data_ptr();
  t.grad_type = to_core_dtype(a.grads[i].scalar_type(), "grads");
  t.exp_avg = static_cast<uint16_t*>(a.exp_avgs[i].data_ptr());
  t.exp_avg_sq = a.exp_avg_sqs[i].data_ptr<uint8_t>();
  t.exp_avg_sq_scale = a.scales[i].data_ptr<float>();
  if (!a.param_copies.empty()) {
    t.param_copy = a.param_copies[i].data_ptr();
    t.copy_type = to_core_dtype(a.param_copies[i].scalar_type(), "param_copies");
  }
  t.numel = a.params[i].numel();
  t.param_from = source_ptr<float>(a.params_from, i);
  t.exp_avg_from = source_ptr<uint16_t>(a.exp_avgs_from, i);
  t.exp_avg_sq_from = source_ptr<uint8_t>(a.exp_avg_sqs_from, i);
  t.exp_avg_sq_scale_from = source_ptr<float>(a.scales_from, i);
  return t;
}

CompactArgs make_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList scales,
                      at::TensorList param_copies, double lr, double beta1, double beta2,
                      double eps, double weight_decay, int64_t step, bool decoupled,
                      bool maximize) {
  return {params,
          grads,
          exp_avgs,
          exp_avg_sqs,
          scales,
          param_copies,
          adam_hyper(lr, beta1, beta2, eps, weight_decay, step, decoupled, false, maximize)};
}

void adam_compact_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList scales,
                           at::TensorList param_copies, double lr, double beta1, double beta2,
                           double eps, double weight_decay, int64_t step, bool decoupled,
                           bool maximize, const c10::optional<at::Tensor>& grad_scale,
                           bool refresh_from_copies, SourceList params_from,
                           SourceList exp_avgs_from, SourceList exp_avg_sqs_from,
                           SourceList scales_from) {
  check_grad_scale("adam_compact_step_", grad_scale, params, c10::DeviceType::CPU);
  CompactArgs a = make_args(params, grads, exp_avgs, exp_avg_sqs, scales, param_copies, lr, beta1,
                            beta2, eps, weight_decay, step, decoupled, maximize);
  a.params_from = params_from;
  a.exp_avgs_from = exp_avgs_from;
  a.exp_avg_sqs_from = exp_avg_sqs_from;
  a.scales_from = scales_from;
  set_grad_scale(a.hyper, grad_scale);
  check_args(a, c10::DeviceType::CPU);
  check_refresh("adam_compact_step_", refresh_from_copies, param_copies);
  TORCH_CHECK_VALUE(!refresh_from_copies || !params_from.has_value(),
                    "adam_compact_step_: refresh_from_copies updates params in place; it cannot "
                    "be combined with params_from");
  a.hyper.refresh_from_copy = refresh_from_copies;  // per chunk, just before its step
  std::vector<CompactAdamTensor> views;
  views.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) views.push_back(core_view(a, i));
  adam_compact_step(a.hyper, views.data(), views.size());
}

#ifdef TIERLIFT_WITH_CUDA
void adam_compact_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                            at::TensorList exp_avg_sqs, at::TensorList scales,
                            at::TensorList param_copies, double lr, double beta1, double beta2,
                            double eps, double weight_decay, int64_t step, bool decoupled,
                            bool maximize, const c10::optional<at::Tensor>& grad_scale,
                            bool refresh_from_copies, SourceList params_from,
                            SourceList exp_avgs_from, SourceList exp_avg_sqs_from,
                            SourceList scales_from) {
  check_no_sources("adam_compact_step_",
                   {&params_from, &exp_avgs_from, &exp_avg_sqs_from, &scales_from});
  check_grad_scale("adam_compact_step_", grad_scale, params, c10::DeviceType::CUDA);
  const CompactArgs a = make_args(params, grads, exp_avgs, exp_avg_sqs, scales, param_copies, lr,
                                  beta1, beta2, eps, weight_decay, step, decoupled, maximize);
  check_args(a, c10::DeviceType::CUDA);
  check_refresh("adam_compact_step_", refresh_from_copies, param_copies);
  const float* scale = grad_scale_ptr(grad_scale);
  const AdamScalars s = adam_scalars(a.hyper);
  launch_grouped<cuda::CompactAdamTensorPtrs>(
      "adam_compact_step_", params,
      [&](size_t i) {
        const CompactAdamTensor t = core_view(a, i);
        return std::make_pair(
            std::make_pair(t.grad_type, t.copy_type),
            cuda::CompactAdamTensorPtrs{t.param, t.grad, t.exp_avg, t.exp_avg_sq,
                                        t.exp_avg_sq_scale, t.param_copy, t.numel});
      },
      [&](const cuda::CompactAdamTensorPtrs* ptrs, int count, DType grad_type, DType copy_type,
          cudaStream_t stream) {
        return cuda::adam_compact_step(ptrs, count, grad_type, copy_type, s, stream, scale,
                                       refresh_from_copies);
      });
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(tierlift, CPU, m) { m.impl("adam_compact_step_", &adam_compact_step_cpu); }

#ifdef TIERLIFT_WITH_CUDA
TORCH_LIBRARY_IMPL(tierlift, CUDA, m) { m.impl("adam_compact_step_", &adam_compact_step_cuda); }
#endif

}  // namespace tierlift
