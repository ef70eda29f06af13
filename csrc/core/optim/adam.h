// Fused Adam / AdamW step on the CPU: one pass over memory per tensor.
//
// For every element it reads the gradient (fp32, bf16 or fp16), the fp32 weight and the fp32
// moments, and writes the weight and moments back, plus, optionally, a low-precision copy of the
// new weight (the bf16 parameter that goes back to the GPU, or the bf16 parameter whose fp32
// master this is). The arithmetic follows torch.optim.Adam/AdamW's order of operations
// (no FMA contraction, true division and sqrt) so results agree with torch to rounding.
// AVX-512, AVX2 and scalar paths share one templated body (adam_impl.h); the path is chosen
// at run time (core/util/cpu_features.h) and the work is split across ThreadPool::global().
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/util/cpu_features.h"
#include "core/util/dtype.h"

namespace tierlift {

struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;       // the step number being taken (1 for the first step)
  bool decoupled = true;  // AdamW (true) or Adam with L2 penalty (false)
  bool amsgrad = false;
  bool maximize = false;
  // AMP: the gradients are still multiplied by GradScaler's scale (finite, > 0); each one is
  // multiplied by grad_unscale_factor(grad_scale) before use, as GradScaler.unscale_ would.
  bool unscale = false;
  float grad_scale = 1.0f;
  // Before stepping, each weight whose param_copy is no longer the weight rounded to copy_type
  // takes the copy's value (it was edited through the copy); fp32 copies are taken whole.
  bool refresh_from_copy = false;
};

// GradScaler.unscale_'s factor: the fp32 scale's reciprocal in double, rounded to fp32
// (torch: scale.double().reciprocal().float()). The CUDA kernels compute the same on the device.
inline float grad_unscale_factor(float grad_scale) {
  return static_cast<float>(1.0 / static_cast<double>(grad_scale));
}

// Whether unscaling by grad_scale is an ordinary finite factor. A scale of 0, inf or NaN (or so
// small that its reciprocal overflows) is refused: under GradScaler it would turn every gradient
// into inf/NaN or zero, a step torch skips rather than takes.
inline bool grad_scale_usable(float grad_scale) {
  const float inv = grad_unscale_factor(grad_scale);
  return grad_scale > 0.0f && grad_scale <= 3.4028235e38f && inv <= 3.4028235e38f;
}

struct AdamTensor {
  float* param = nullptr;  // fp32 weights (or fp32 master weights), updated in place
  const void* grad = nullptr;
  DType grad_type = DType::kFloat32;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  float* max_exp_avg_sq = nullptr;  // required when amsgrad
  void* param_copy = nullptr;       // optional: receives the updated weight in copy_type
  DType copy_type = DType::kNone;
  int64_t numel = 0;
  // Optional, out of place: the step reads the old weight and moments from these and writes the
  // new ones to the pointers above (the offloaded step reads generation g of its state and writes
  // generation g + 1 without copying either). Null: read where it writes (in place). Each must be
  // the state it replaces or not overlap it at all. The arithmetic is the same either way.
  const float* param_from = nullptr;
  const float* exp_avg_from = nullptr;
  const float* exp_avg_sq_from = nullptr;
  const float* max_exp_avg_sq_from = nullptr;
};

// `t` with every source left null pointing at the state it updates: what the kernel loads from.
inline AdamTensor with_sources(AdamTensor t) {
  if (!t.param_from) t.param_from = t.param;
  if (!t.exp_avg_from) t.exp_avg_from = t.exp_avg;
  if (!t.exp_avg_sq_from) t.exp_avg_sq_from = t.exp_avg_sq;
  if (!t.max_exp_avg_sq_from) t.max_exp_avg_sq_from = t.max_exp_avg_sq;
  return t;
}

// Whether any source is set (the step is out of place).
inline bool out_of_place(const AdamTensor& t) {
  return t.param_from || t.exp_avg_from || t.exp_avg_sq_from || t.max_exp_avg_sq_from;
}

// Scalars derived once per step in double precision, rounded to float as torch does.
struct AdamScalars {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay;
  float decay;          // 1 - lr * weight_decay (AdamW)
  float neg_step_size;  // -lr / (1 - beta1^step)
  float bc2_sqrt;       // sqrt(1 - beta2^step)
  bool decoupled, amsgrad, maximize;
  bool unscale = false;         // multiply each gradient by inv_grad_scale first (AMP)
  float inv_grad_scale = 1.0f;  // grad_unscale_factor(AdamHyper::grad_scale)
  bool memory_only = false;     // adam_memory_pass: the loads and stores without the arithmetic
};

AdamScalars adam_scalars(const AdamHyper& h);

// Throws std::invalid_argument on inconsistent input (null pointers, amsgrad without buffer, a
// grad_scale that is not finite and > 0).
void adam_step(const AdamHyper& hyper, const AdamTensor* tensors, size_t count);

// The bytes adam_step moves, without its arithmetic: the same loads and stores (amsgrad off), cut
// into the same chunks over the same threads, with one add per stored stream. What the step can
// reach on this machine, i.e. its memory-bandwidth bound, for benchmarks; it leaves the state
// meaningless.
void adam_memory_pass(const AdamTensor* tensors, size_t count);

// Same as adam_step, on an explicit SIMD level and without threading (used by tests and
// benchmarks).
void adam_step_range(SimdLevel level, const AdamScalars& s, const AdamTensor& t, int64_t begin,
                     int64_t end);

// Per-ISA entry points (adam_scalar.cc, adam_avx2.cc, adam_avx512.cc).
void adam_range_scalar(const AdamScalars& s, const AdamTensor& t, int64_t begin, int64_t end);
void adam_range_avx2(const AdamScalars& s, const AdamTensor& t, int64_t begin, int64_t end);
void adam_range_avx512(const AdamScalars& s, const AdamTensor& t, int64_t begin, int64_t end);

}  // namespace tierlift
