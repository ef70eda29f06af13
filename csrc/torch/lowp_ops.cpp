// CPU and CUDA implementations of the FP8 quantizer ops (schemas in schemas.cpp, lowp block):
//   fp8_quantize(x, scaling, fp8_dtype, pow2_scale) -> (q, scales)
//   fp8_quantize_dual(...) -> (q, scales, qt, scales_t)   qt = quantization of x^T
//   fp8_quantize_delayed(x, scale, fp8_dtype, dual, pow2_scale) -> (q, scale_used, qt?, amax)
//     tensor scaling with a scale chosen ahead: one pass over x unless the scale would clip
//   fp8_quantize_from_history(x, history, fp8_dtype, dual, pow2_scale) -> (q, scale, qt?, amax)
//     the same with the scale an amax history gives, computed where x is
// x is a 2-D fp32/bf16/fp16 tensor with any strides; q is float8_e4m3fn/float8_e5m2 row-major,
// scales fp32 [ceil(rows/block_h), ceil(cols/block_w)]. CPU calls core/lowp, CUDA cuda/fp8_quant.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>

#include "checks.h"
#include "core/lowp/quantize.h"

#ifdef TIERLIFT_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/fp8_quant.cuh"
#endif

namespace tierlift {
namespace {

Fp8Scaling parse_scaling(const std::string& s) {
  if (s == "tensor") return Fp8Scaling::kTensor;
  if (s == "row") return Fp8Scaling::kRow;
  if (s == "col") return Fp8Scaling::kCol;
  if (s == "1x128") return Fp8Scaling::kBlock1x128;
  if (s == "128x128") return Fp8Scaling::kBlock128x128;
  TORCH_CHECK_VALUE(
      false, "scaling must be one of 'tensor', 'row', 'col', '1x128', '128x128', got '", s, "'");
}

Fp8Format parse_format(at::ScalarType t) {
  if (t == at::kFloat8_e4m3fn) return Fp8Format::kE4M3;
  if (t == at::kFloat8_e5m2) return Fp8Format::kE5M2;
  TORCH_CHECK_TYPE(false, "fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got ", t);
}

struct Prepared {
  Fp8Input in;
  Fp8Scaling scaling;
  Fp8Format fmt;
  at::Tensor q, scales, qt, scales_t;
};

Prepared prepare(const at::Tensor& x, const std::string& scaling, at::ScalarType fp8_dtype,
                 bool dual, c10::DeviceType backend) {
  TL_CHECK_DENSE(x);
  TORCH_CHECK_VALUE(x.device().type() == backend, "x must be on ", backend, ", got ", x.device());
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be 2-D (reshape to [rows, cols]), got ", x.dim(),
                    "-D shape ", x.sizes());
  Prepared p;
  p.scaling = parse_scaling(scaling);
  p.fmt = parse_format(fp8_dtype);
  p.in.data = x.data_ptr();
  p.in.dtype = to_core_dtype(x.scalar_type(), "x");
  p.in.rows = x.size(0);
  p.in.cols = x.size(1);
  p.in.row_stride = x.stride(0);
  p.in.col_stride = x.stride(1);
  const Fp8Blocks b = fp8_blocks(p.scaling, p.in.rows, p.in.cols);
  p.q = at::empty({p.in.rows, p.in.cols}, x.options().dtype(fp8_dtype));
  p.scales = at::empty({b.grid_rows, b.grid_cols}, x.options().dtype(at::kFloat));
  if (dual) {
    const Fp8Blocks bt = fp8_blocks(p.scaling, p.in.cols, p.in.rows);
    p.qt = at::empty({p.in.cols, p.in.rows}, x.options().dtype(fp8_dtype));
    p.scales_t = at::empty({bt.grid_rows, bt.grid_cols}, x.options().dtype(at::kFloat));
  }
  return p;
}

uint8_t* bytes(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

// Delayed scaling's x is prepared as tensor scaling; its scale (or history) is an fp32 tensor on
// x's device (a device pointer on CUDA, so no host sync). Tensor scaling's scales [1, 1] receive
// scale_used; amax [1] is the other output beside q and qt.
struct PreparedDelayed {
  Prepared p;
  at::Tensor amax;
};

PreparedDelayed prepare_delayed(const at::Tensor& x, at::ScalarType fp8_dtype, bool dual,
                                c10::DeviceType backend) {
  PreparedDelayed d{prepare(x, "tensor", fp8_dtype, false, backend), {}};
  if (dual) d.p.qt = at::empty({d.p.in.cols, d.p.in.rows}, x.options().dtype(fp8_dtype));
  d.amax = at::empty({1}, x.options().dtype(at::kFloat));
  return d;
}

void check_scale(const at::Tensor& x, const at::Tensor& scale) {
  TL_CHECK_DENSE(scale);
  TORCH_CHECK_VALUE(scale.numel() == 1, "scale must have one element, got shape ", scale.sizes());
  TL_CHECK_DTYPE(scale, at::kFloat);
  TORCH_CHECK_VALUE(scale.device() == x.device(), "scale must be on x's device ", x.device(),
                    ", got ", scale.device());
}

std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, at::Tensor> delayed_outputs(
    const PreparedDelayed& d) {
  std::optional<at::Tensor> qt;
  if (d.p.qt.defined()) qt = d.p.qt;
  return {d.p.q, d.p.scales, qt, d.amax};
}

// An amax history: a 1-D fp32 tensor of at least one entry on x's device (any stride).
void check_history(const at::Tensor& x, const at::Tensor& history) {
  TL_CHECK_DENSE(history);
  TORCH_CHECK_VALUE(history.dim() == 1 && history.numel() >= 1 &&
                        history.scalar_type() == at::kFloat && history.device() == x.device(),
                    "history must be a 1-D float32 tensor of at least one entry on x's device ",
                    x.device(), ", got ", history.scalar_type(), " ", history.sizes(), " on ",
                    history.device());
}

std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, at::Tensor>
fp8_quantize_from_history_cpu(const at::Tensor& x, const at::Tensor& history,
                              at::ScalarType fp8_dtype, bool dual, bool pow2_scale) {
  PreparedDelayed d = prepare_delayed(x, fp8_dtype, dual, c10::DeviceType::CPU);
  check_history(x, history);
  Fp8DelayedResult r;
  try {
    r = fp8_quantize_from_history(d.p.in, history.data_ptr<float>(), history.numel(),
                                  history.stride(0), d.p.fmt, pow2_scale, bytes(d.p.q),
                                  dual ? bytes(d.p.qt) : nullptr);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  d.p.scales.fill_(r.scale_used);
  d.amax.fill_(r.amax);
  return delayed_outputs(d);
}

std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, at::Tensor> fp8_quantize_delayed_cpu(
    const at::Tensor& x, const at::Tensor& scale, at::ScalarType fp8_dtype, bool dual,
    bool pow2_scale) {
  PreparedDelayed d = prepare_delayed(x, fp8_dtype, dual, c10::DeviceType::CPU);
  check_scale(x, scale);
  const float s = scale.item<float>();
  TORCH_CHECK_VALUE(std::isfinite(s) && s > 0.f, "scale must be finite and > 0, got ", s);
  const Fp8DelayedResult r = fp8_quantize_delayed(d.p.in, s, d.p.fmt, pow2_scale, bytes(d.p.q),
                                                  dual ? bytes(d.p.qt) : nullptr);
  d.p.scales.fill_(r.scale_used);
  d.amax.fill_(r.amax);
  return delayed_outputs(d);
}

std::tuple<at::Tensor, at::Tensor> fp8_quantize_cpu(const at::Tensor& x, c10::string_view scaling,
                                                    at::ScalarType fp8_dtype, bool pow2_scale) {
  Prepared p = prepare(x, std::string(scaling), fp8_dtype, false, c10::DeviceType::CPU);
  fp8_quantize(p.in, p.scaling, p.fmt, pow2_scale, bytes(p.q), p.scales.data_ptr<float>());
  return {p.q, p.scales};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fp8_quantize_dual_cpu(
    const at::Tensor& x, c10::string_view scaling, at::ScalarType fp8_dtype, bool pow2_scale) {
  Prepared p = prepare(x, std::string(scaling), fp8_dtype, true, c10::DeviceType::CPU);
  fp8_quantize_dual(p.in, p.scaling, p.fmt, pow2_scale, bytes(p.q), p.scales.data_ptr<float>(),
                    bytes(p.qt), p.scales_t.data_ptr<float>());
  return {p.q, p.scales, p.qt, p.scales_t};
}

#ifdef TIERLIFT_WITH_CUDA
void launch(const at::Tensor& x, const Prepared& p, bool pow2_scale) {
  TORCH_CHECK_VALUE(x.size(1) <= 65535 * 32, "x has ", x.size(1),
                    " columns; the CUDA quantizer "
                    "takes at most ",
                    65535 * 32, " (quantize column chunks separately)");
  c10::cuda::CUDAGuard guard(x.device());
  cuda::Fp8QuantArgs a;
  a.x = p.in.data;
  a.dtype = p.in.dtype;
  a.rows = p.in.rows;
  a.cols = p.in.cols;
  a.row_stride = p.in.row_stride;
  a.col_stride = p.in.col_stride;
  a.scaling = p.scaling;
  a.fmt = p.fmt;
  a.pow2_scale = pow2_scale;
  a.q = bytes(p.q);
  a.scales = p.scales.data_ptr<float>();
  if (p.qt.defined()) {
    a.qt = bytes(p.qt);
    a.scales_t = p.scales_t.data_ptr<float>();
  }
  const cudaError_t err = cuda::fp8_quantize(a, at::cuda::getCurrentCUDAStream(x.device().index()));
  TORCH_CHECK(err == cudaSuccess, "fp8_quantize: CUDA launch failed: ", cudaGetErrorString(err));
}

std::tuple<at::Tensor, at::Tensor> fp8_quantize_cuda(const at::Tensor& x, c10::string_view scaling,
                                                     at::ScalarType fp8_dtype, bool pow2_scale) {
  Prepared p = prepare(x, std::string(scaling), fp8_dtype, false, c10::DeviceType::CUDA);
  launch(x, p, pow2_scale);
  return {p.q, p.scales};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fp8_quantize_dual_cuda(
    const at::Tensor& x, c10::string_view scaling, at::ScalarType fp8_dtype, bool pow2_scale) {
  Prepared p = prepare(x, std::string(scaling), fp8_dtype, true, c10::DeviceType::CUDA);
  launch(x, p, pow2_scale);
  return {p.q, p.scales, p.qt, p.scales_t};
}

// The kernels' arguments for x and its outputs q, q^T and amax (the scales are the caller's).
cuda::Fp8DelayedArgs delayed_args(const at::Tensor& x, const PreparedDelayed& d, bool dual,
                                  bool pow2_scale) {
  TORCH_CHECK_VALUE(x.size(1) <= 65535 * 64 || (!dual && x.is_contiguous()), "x has ", x.size(1),
                    " columns; the CUDA quantizer takes at most ", 65535 * 64,
                    " for a strided or dual input (quantize column chunks separately)");
  cuda::Fp8DelayedArgs a;
  a.x = d.p.in.data;
  a.dtype = d.p.in.dtype;
  a.rows = d.p.in.rows;
  a.cols = d.p.in.cols;
  a.row_stride = d.p.in.row_stride;
  a.col_stride = d.p.in.col_stride;
  a.fmt = d.p.fmt;
  a.pow2_scale = pow2_scale;
  a.q = bytes(d.p.q);
  if (d.p.qt.defined()) a.qt = bytes(d.p.qt);
  a.amax = d.amax.data_ptr<float>();
  return a;
}

// The scale stays on the device: a scale that is not finite and > 0 cannot be refused without a
// host sync, so the kernel treats it as one that would clip (x's own scale, see fp8_quant.cuh).
std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, at::Tensor> fp8_quantize_delayed_cuda(
    const at::Tensor& x, const at::Tensor& scale, at::ScalarType fp8_dtype, bool dual,
    bool pow2_scale) {
  PreparedDelayed d = prepare_delayed(x, fp8_dtype, dual, c10::DeviceType::CUDA);
  check_scale(x, scale);
  c10::cuda::CUDAGuard guard(x.device());
  cuda::Fp8DelayedArgs a = delayed_args(x, d, dual, pow2_scale);
  const at::Tensor s = scale.contiguous();
  a.scale = s.data_ptr<float>();
  a.scale_used = d.p.scales.data_ptr<float>();
  const cudaError_t err =
      cuda::fp8_quantize_delayed(a, at::cuda::getCurrentCUDAStream(x.device().index()));
  TORCH_CHECK(err == cudaSuccess,
              "fp8_quantize_delayed: CUDA launch failed: ", cudaGetErrorString(err));
  return delayed_outputs(d);
}

// The history's scale and the scale the casts use stay in a device scratch: no host sync.
std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, at::Tensor>
fp8_quantize_from_history_cuda(const at::Tensor& x, const at::Tensor& history,
                               at::ScalarType fp8_dtype, bool dual, bool pow2_scale) {
  PreparedDelayed d = prepare_delayed(x, fp8_dtype, dual, c10::DeviceType::CUDA);
  check_history(x, history);
  const at::Tensor scratch = at::empty({2}, history.options());
  c10::cuda::CUDAGuard guard(x.device());
  cuda::Fp8HistoryArgs h;
  h.delayed = delayed_args(x, d, dual, pow2_scale);
  h.delayed.scale_used = scratch.data_ptr<float>() + 1;
  h.history = history.data_ptr<float>();
  h.history_len = history.numel();
  h.history_stride = history.stride(0);
  h.given = scratch.data_ptr<float>();
  h.scale = d.p.scales.data_ptr<float>();
  const cudaError_t err =
      cuda::fp8_quantize_from_history(h, at::cuda::getCurrentCUDAStream(x.device().index()));
  TORCH_CHECK(err == cudaSuccess,
              "fp8_quantize_from_history: CUDA launch failed: ", cudaGetErrorString(err));
  return delayed_outputs(d);
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(tierlift, CPU, m) {
  m.impl("fp8_quantize", &fp8_quantize_cpu);
  m.impl("fp8_quantize_dual", &fp8_quantize_dual_cpu);
  m.impl("fp8_quantize_delayed", &fp8_quantize_delayed_cpu);
  m.impl("fp8_quantize_from_history", &fp8_quantize_from_history_cpu);
}

#ifdef TIERLIFT_WITH_CUDA
TORCH_LIBRARY_IMPL(tierlift, CUDA, m) {
  m.impl("fp8_quantize", &fp8_quantize_cuda);
  m.impl("fp8_quantize_dual", &fp8_quantize_dual_cuda);
  m.impl("fp8_quantize_delayed", &fp8_quantize_delayed_cuda);
  m.impl("fp8_quantize_from_history", &fp8_quantize_from_history_cuda);
}
#endif

}  // namespace tierlift
