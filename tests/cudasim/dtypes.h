// The element types the simulated kernel tests sweep, and their names in test names and traces.
#pragma once

#include "core/util/dtype.h"

namespace tierlift {
namespace cudasim_test {

// The input (and gradient) types every kernel accepts.
constexpr DType kInputDtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "f32";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat16:
      return "f16";
    default:
      return "none";
  }
}

}  // namespace cudasim_test
}  // namespace tierlift
