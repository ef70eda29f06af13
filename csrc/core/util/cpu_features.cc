#include "core/util/cpu_features.h"

#include <cstdlib>
#include <cstring>

namespace tierlift {

SimdLevel cpu_simd_level() {
  static const SimdLevel level = [] {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl")) {
      return SimdLevel::kAvx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return SimdLevel::kAvx2;
#endif
    return SimdLevel::kScalar;
  }();
  return level;
}

SimdLevel active_simd_level() {
  const SimdLevel best = cpu_simd_level();
  const char* forced = std::getenv("TIERLIFT_SIMD");
  if (forced == nullptr || *forced == '\0') return best;
  SimdLevel want = best;
  if (std::strcmp(forced, "scalar") == 0) want = SimdLevel::kScalar;
  if (std::strcmp(forced, "avx2") == 0) want = SimdLevel::kAvx2;
  if (std::strcmp(forced, "avx512") == 0) want = SimdLevel::kAvx512;
  return want <= best ? want : best;
}

const char* simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAvx512:
      return "avx512";
    case SimdLevel::kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

}  // namespace tierlift
