// The one place where every tierlift op's schema is declared. Backend files add only their
// implementations (TORCH_LIBRARY_IMPL(tierlift, CPU/CUDA, m)); fake kernels live in
// python/tierlift/ops.py. Keep each op family in its own block. One exception: the optimizer's
// step under torch.compile, tierlift::adam_group_step_, is made of the optim ops below and is
// defined with them in python/tierlift/ops.py.
#include <torch/library.h>

TORCH_LIBRARY(tierlift, m) {
  // ---- optim: fused Adam/AdamW over lists of tensors (csrc/torch/optim_ops.cpp) ----
  // params are fp32 (weights or master weights), updated in place with their moments.
  // param_copies is empty or one tensor per param that receives the new weight in its dtype.
  // grad_scale (AMP): None, or GradScaler's scale as a 1-element float32 tensor on the params'
  // device; every gradient is multiplied by (float)(1 / (double)scale) first, as unscale_ does.
  // refresh_from_copies (needs param_copies): each copy is the model weight whose master the
  // param is; an element whose copy is not the param rounded to the copy's dtype (bit for bit)
  // is stepped from the copy's value (the weight was changed outside the optimizer).
  // *_from (CPU only; None: in place): per param, the tensor the old weight or moment is read
  // from, while the new one goes to params/exp_avgs/...: a step out of place, with the same
  // arithmetic. Each is the tensor it stands in for or memory apart from it.
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] param_copies, "
      "float lr, float beta1, float beta2, float eps, float weight_decay, int step, "
      "bool decoupled, bool amsgrad, bool maximize, Tensor? grad_scale=None, "
      "bool refresh_from_copies=False, Tensor[]? params_from=None, "
      "Tensor[]? exp_avgs_from=None, Tensor[]? exp_avg_sqs_from=None, "
      "Tensor[]? max_exp_avg_sqs_from=None) -> ()");
  // The same loads and stores as adam_step_ without its arithmetic (CPU only): the step's
  // memory-bandwidth bound, for benchmarks. Leaves the tensors' values meaningless.
  m.def(
      "adam_memory_pass_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] param_copies) -> ()");

  // Adam/AdamW with compact state (csrc/torch/optim_compact_ops.cpp): per param, exp_avgs is
  // bf16, exp_avg_sqs uint8 codes and exp_avg_sq_scales fp32 [ceil(numel / 256)] block maxima
  // (format: csrc/core/optim/adam_compact.h). No amsgrad. *_from as in adam_step_.
  m.def(
      "adam_compact_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] exp_avg_sq_scales, Tensor(e!)[] param_copies, "
      "float lr, float beta1, float beta2, float eps, float weight_decay, int step, "
      "bool decoupled, bool maximize, Tensor? grad_scale=None, "
      "bool refresh_from_copies=False, Tensor[]? params_from=None, "
      "Tensor[]? exp_avgs_from=None, Tensor[]? exp_avg_sqs_from=None, "
      "Tensor[]? exp_avg_sq_scales_from=None) -> ()");
  // Adds 1 to each optimizer step count (a 1-element tensor, fp32 as torch keeps it) in place
  // and returns the new counts as integers: one call for a whole param group instead of one
  // dispatcher call per parameter (csrc/torch/step_ops.cpp). Eager only: torch.compile cannot
  // functionalize integers returned by an op that mutates (a compiled step uses
  // adam_group_step_, which keeps the counts inside).
  m.def("advance_steps_(Tensor(a!)[] steps) -> int[]");

  // ---- io ----

  // ---- gather: zero-copy feature row gather (csrc/torch/gather_ops.cpp) ----
  // out[i] = table[index[i]]; on CUDA, table is pinned mapped host memory (or a CUDA tensor) and
  // rows whose cache_slots entry is >= 0 are read from cache_table instead. Bad index: IndexError,
  // or with bad_index (int64 [2], -1 = none yet) its (position, value) is stored there instead,
  // and the CUDA op does not synchronise (the caller checks later). locality: "index" reads rows
  // in index order, "sorted" in ascending row order (each still lands at its own position).
  // kernel: "auto" | "warp" | "grouped" (the CUDA kernel's shape). The CPU gather ignores both.
  m.def(
      "gather_rows(Tensor table, Tensor index, Tensor? cache_table, Tensor? cache_slots, "
      "Tensor(a!) out, Tensor(b!)? bad_index=None, str locality=\"index\", "
      "str kernel=\"auto\") -> ()");

  // ---- lowp: FP8 quantizers (csrc/torch/lowp_ops.cpp) ----
  // x: 2-D fp32/bf16/fp16; scaling: tensor | row | col | 1x128 | 128x128; fp8_dtype:
  // float8_e4m3fn | float8_e5m2. Returns q (row-major) and fp32 scales (q = cast(x * scale));
  // the dual op also returns the quantization of x^T (x's column-major copy) and its scales.
  m.def(
      "fp8_quantize(Tensor x, str scaling, ScalarType fp8_dtype, bool pow2_scale) "
      "-> (Tensor, Tensor)");
  m.def(
      "fp8_quantize_dual(Tensor x, str scaling, ScalarType fp8_dtype, bool pow2_scale) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  // Delayed scaling (tensor scaling with a scale chosen ahead, e.g. from an amax history):
  // scale is a one-element fp32 tensor on x's device. Returns q = cast(x * scale_used),
  // scale_used [1, 1] (scale, or x's own scale where scale would clip a finite value), q^T when
  // dual (else None) and x's finite amax [1], for the next scale.
  m.def(
      "fp8_quantize_delayed(Tensor x, Tensor scale, ScalarType fp8_dtype, bool dual, "
      "bool pow2_scale) -> (Tensor, Tensor, Tensor?, Tensor)");
  // The same with the scale taken from an amax history (1-D fp32 on x's device, >= 1 entries):
  // that of its max, at least the smallest fp32 subnormal, computed on the device (no sync).
  // Returns (q, scale [1, 1], q^T or None, amax [1]); scale is 1 where amax is 0.
  m.def(
      "fp8_quantize_from_history(Tensor x, Tensor history, ScalarType fp8_dtype, bool dual, "
      "bool pow2_scale) -> (Tensor, Tensor, Tensor?, Tensor)");
  // FP4 (csrc/torch/lowp_fp4_ops.cpp): x 2-D fp32/bf16/fp16, optionally rotated by a Hadamard
  // transform (0/16/32 columns, `signs` a bit mask of negated inputs), quantized along rows to
  // E2M1 with RNE or Philox(seed, offset) stochastic rounding. scale_rule floor|rceil|quest:
  // MXFP4 (E8M0 per 1x32); nv: NVFP4 (E4M3 per 1x16, or 16x16 with block_2d, and an fp32 tensor
  // scale). Returns codes uint8 [rows, cols/2], scale codes uint8, tensor_scale fp32 [1] and the
  // clip mask bool [rows, cols] (empty unless want_mask).
  m.def(
      "fp4_quantize(Tensor x, str scale_rule, int hadamard, int signs, bool stochastic, "
      "int seed, int offset, bool block_2d, bool want_mask) -> (Tensor, Tensor, Tensor, Tensor)");

  // ---- zero: flat shard buffers (csrc/torch/zero_ops.cpp) ----
  // flatten_pack_ copies `tensors` back to back into the 1-D `flat` (same dtype and device) and
  // zeroes the rest of `flat` (the padding to a multiple of the world size); unflatten_ copies
  // consecutive slices of `flat` back into `tensors`.
  m.def("flatten_pack_(Tensor(a!) flat, Tensor[] tensors) -> ()");
  m.def("unflatten_(Tensor flat, Tensor(a!)[] tensors) -> ()");
}
