// The one validation layer between Python and the kernels. Every op checks its inputs with
// these macros; a failed check becomes a Python exception (ValueError/TypeError/IndexError via
// TORCH_CHECK_*), naming the argument and what was expected.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "core/util/dtype.h"

#define TL_CHECK_DEVICE(x, dev) \
  TORCH_CHECK_VALUE((x).device() == (dev), #x " must be on ", (dev), ", got ", (x).device())
#define TL_CHECK_CPU(x) \
  TORCH_CHECK_VALUE((x).device().is_cpu(), #x " must be a CPU tensor, got ", (x).device())
#define TL_CHECK_CONTIGUOUS(x) \
  TORCH_CHECK_VALUE((x).is_contiguous(), #x " must be contiguous (call .contiguous())")
#define TL_CHECK_DTYPE(x, dt) \
  TORCH_CHECK_TYPE((x).scalar_type() == (dt), #x " must be ", (dt), ", got ", (x).scalar_type())
#define TL_CHECK_SHAPE(x, ...)                                                              \
  TORCH_CHECK_VALUE((x).sizes() == at::IntArrayRef({__VA_ARGS__}), #x " must have shape (", \
                    #__VA_ARGS__, "), got ", (x).sizes())
#define TL_CHECK_DENSE(x)                                                                       \
  TORCH_CHECK_VALUE((x).layout() == at::kStrided, #x " must be a dense (strided) tensor, got ", \
                    (x).layout())

namespace tierlift {

// fp32/bf16/fp16 -> core DType; anything else is a TypeError naming `what`.
inline DType to_core_dtype(at::ScalarType t, const char* what) {
  switch (t) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      TORCH_CHECK_TYPE(false, what, " must be float32, bfloat16 or float16, got ", t);
  }
}

}  // namespace tierlift
