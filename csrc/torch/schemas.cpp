// The one place where every tierlift op's schema is declared. Backend files add only their
// implementations (TORCH_LIBRARY_IMPL(tierlift, CPU/CUDA, m)); fake kernels live in
// python/tierlift/ops.py. Keep each op family in its own block.
#include <torch/library.h>

TORCH_LIBRARY(tierlift, m) {
  // ---- optim: fused Adam/AdamW over lists of tensors (csrc/torch/optim_ops.cpp) ----
  // params are fp32 (weights or master weights), updated in place with their moments.
  // param_copies is empty or one tensor per param that receives the new weight in its dtype.
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] param_copies, "
      "float lr, float beta1, float beta2, float eps, float weight_decay, int step, "
      "bool decoupled, bool amsgrad, bool maximize) -> ()");

  // ---- io ----

  // ---- gather ----

  // ---- lowp ----

  // ---- zero: flat shard buffers (csrc/torch/zero_ops.cpp) ----
  // flatten_pack_ copies `tensors` back to back into the 1-D `flat` (same dtype and device) and
  // zeroes the rest of `flat` (the padding to a multiple of the world size); unflatten_ copies
  // consecutive slices of `flat` back into `tensors`.
  m.def("flatten_pack_(Tensor(a!) flat, Tensor[] tensors) -> ()");
  m.def("unflatten_(Tensor flat, Tensor(a!)[] tensors) -> ()");
}
