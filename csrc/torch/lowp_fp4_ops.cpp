// CPU and CUDA implementations of the FP4 quantizer op (schema in schemas.cpp, lowp block):
//   fp4_quantize(x, scale_rule, hadamard, signs, stochastic, seed, offset, block_2d, want_mask)
//     -> (codes uint8 [rows, cols/2], scales uint8 [grid], tensor_scale fp32 [1], mask bool)
// scale_rule floor | rceil | quest (MXFP4: E8M0 scale codes per 1x32) or nv (NVFP4: E4M3 scale
// codes per 1x16 or 16x16, tensor scale s_t). mask is [rows, cols] (True = not saturated) when
// want_mask, else empty. CPU calls core/lowp/fp4_quant, CUDA cuda/fp4_quant.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <stdexcept>
#include <string>
#include <tuple>

#include "checks.h"
#include "core/lowp/fp4_quant.h"

#ifdef TIERLIFT_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/fp4_quant.cuh"
#endif

namespace tierlift {
namespace {

using Result = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

fp4::ScaleRule parse_rule(const std::string& s) {
  if (s == "floor") return fp4::ScaleRule::kFloor;
  if (s == "rceil") return fp4::ScaleRule::kRceil;
  if (s == "quest") return fp4::ScaleRule::kQuest;
  if (s == "nv") return fp4::ScaleRule::kNv;
  TORCH_CHECK_VALUE(false, "scale_rule must be one of 'floor', 'rceil', 'quest', 'nv', got '", s,
                    "'");
}

struct Prepared {
  Fp8Input in;
  Fp4Config cfg;
  at::Tensor codes, scales, tensor_scale, mask;
};

Prepared prepare(const at::Tensor& x, c10::string_view scale_rule, int64_t hadamard, int64_t signs,
                 bool stochastic, int64_t seed, int64_t offset, bool block_2d, bool want_mask,
                 c10::DeviceType backend) {
  TL_CHECK_DENSE(x);
  TORCH_CHECK_VALUE(x.device().type() == backend, "x must be on ", backend, ", got ", x.device());
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be 2-D (reshape to [rows, cols]), got ", x.dim(),
                    "-D shape ", x.sizes());
  TORCH_CHECK_VALUE(signs >= 0 && signs <= 0xffffffffLL, "signs must be a 32-bit mask, got ",
                    signs);
  TORCH_CHECK_VALUE(hadamard >= 0 && hadamard <= 32, "hadamard must be 0, 16 or 32, got ",
                    hadamard);
  Prepared p;
  p.cfg.rule = parse_rule(std::string(scale_rule));
  p.cfg.hadamard = static_cast<int>(hadamard);
  p.cfg.signs = static_cast<uint32_t>(signs);
  p.cfg.stochastic = stochastic;
  p.cfg.seed = static_cast<uint64_t>(seed);
  p.cfg.offset = static_cast<uint64_t>(offset);
  p.cfg.block_2d = block_2d;
  p.in.data = x.data_ptr();
  p.in.dtype = to_core_dtype(x.scalar_type(), "x");
  p.in.rows = x.size(0);
  p.in.cols = x.size(1);
  p.in.row_stride = x.stride(0);
  p.in.col_stride = x.stride(1);
  try {
    fp4_validate(p.in, p.cfg);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  int64_t gr, gc;
  fp4_scale_shape(p.cfg, p.in.rows, p.in.cols, &gr, &gc);
  const auto u8 = x.options().dtype(at::kByte);
  p.codes = at::empty({p.in.rows, p.in.cols / 2}, u8);
  p.scales = at::empty({gr, gc}, u8);
  const float ts0 = p.cfg.rule == fp4::ScaleRule::kNv ? fp4::nv_tensor_scale(0.f) : 1.f;
  p.tensor_scale = at::full({1}, ts0, x.options().dtype(at::kFloat));
  p.mask = want_mask ? at::empty({p.in.rows, p.in.cols}, x.options().dtype(at::kBool))
                     : at::empty({0}, x.options().dtype(at::kBool));
  return p;
}

uint8_t* bytes(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

Result fp4_quantize_cpu(const at::Tensor& x, c10::string_view scale_rule, int64_t hadamard,
                        int64_t signs, bool stochastic, int64_t seed, int64_t offset, bool block_2d,
                        bool want_mask) {
  Prepared p = prepare(x, scale_rule, hadamard, signs, stochastic, seed, offset, block_2d,
                       want_mask, c10::DeviceType::CPU);
  Fp4Output out;
  out.codes = bytes(p.codes);
  out.scales = bytes(p.scales);
  out.tensor_scale = p.tensor_scale.data_ptr<float>();
  out.mask = want_mask ? bytes(p.mask) : nullptr;
  fp4_quantize(p.in, p.cfg, out);
  return {p.codes, p.scales, p.tensor_scale, p.mask};
}

#ifdef TIERLIFT_WITH_CUDA
Result fp4_quantize_cuda(const at::Tensor& x, c10::string_view scale_rule, int64_t hadamard,
                         int64_t signs, bool stochastic, int64_t seed, int64_t offset,
                         bool block_2d, bool want_mask) {
  Prepared p = prepare(x, scale_rule, hadamard, signs, stochastic, seed, offset, block_2d,
                       want_mask, c10::DeviceType::CUDA);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor ws;
  cuda::Fp4QuantArgs a;
  a.x = p.in.data;
  a.dtype = p.in.dtype;
  a.rows = p.in.rows;
  a.cols = p.in.cols;
  a.row_stride = p.in.row_stride;
  a.col_stride = p.in.col_stride;
  a.rule = p.cfg.rule;
  a.hadamard = p.cfg.hadamard;
  a.signs = p.cfg.signs;
  a.stochastic = stochastic;
  a.seed = p.cfg.seed;
  a.offset = p.cfg.offset;
  a.block_2d = block_2d;
  a.codes = bytes(p.codes);
  a.scales = bytes(p.scales);
  a.tensor_scale = p.tensor_scale.data_ptr<float>();
  a.mask = want_mask ? bytes(p.mask) : nullptr;
  if (p.cfg.rule == fp4::ScaleRule::kNv) {
    ws =
        at::empty({cuda::nv_workspace_floats(p.in.rows, p.in.cols)}, x.options().dtype(at::kFloat));
    a.workspace = ws.data_ptr<float>();
  }
  const cudaError_t err = cuda::fp4_quantize(a, at::cuda::getCurrentCUDAStream(x.device().index()));
  TORCH_CHECK(err == cudaSuccess, "fp4_quantize: CUDA launch failed: ", cudaGetErrorString(err));
  return {p.codes, p.scales, p.tensor_scale, p.mask};
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(tierlift, CPU, m) { m.impl("fp4_quantize", &fp4_quantize_cpu); }

#ifdef TIERLIFT_WITH_CUDA
TORCH_LIBRARY_IMPL(tierlift, CUDA, m) { m.impl("fp4_quantize", &fp4_quantize_cuda); }
#endif

}  // namespace tierlift
