// One way to launch a kernel that both builds understand. Under nvcc it is the <<<...>>> launch;
// in the CPU simulator build (TIERLIFT_CUDASIM, see csrc/cudasim/) it runs every thread of every
// block as a fiber on the host. Written as
//
//   TIERLIFT_LAUNCH(grid, block, shared_bytes, stream, kernel<T>)(arg0, arg1, ...);
//
// The kernel comes last so that template arguments with commas need no parentheses.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#ifdef TIERLIFT_CUDASIM
#include "cudasim/launch.h"
#endif

namespace tierlift {
namespace cuda {

template <typename... Params>
class KernelLaunch {
 public:
  KernelLaunch(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared,
               cudaStream_t stream)
      : name_(name),
        kernel_(kernel),
        grid_(grid),
        block_(block),
        shared_(shared),
        stream_(stream) {}

  template <typename... Args>
  void operator()(Args&&... args) const {
#ifdef TIERLIFT_CUDASIM
    ::cudasim::launch(name_, kernel_, grid_, block_, shared_, stream_, std::forward<Args>(args)...);
#else
    (void)name_;
    auto* kernel = kernel_;  // nvcc does not parse a member directly before <<<
    // clang-format off
    kernel<<<grid_, block_, shared_, stream_>>>(std::forward<Args>(args)...);
    // clang-format on
#endif
  }

 private:
  const char* name_;
  void (*kernel_)(Params...);
  dim3 grid_, block_;
  size_t shared_;
  cudaStream_t stream_;
};

template <typename... Params>
KernelLaunch(const char*, void (*)(Params...), dim3, dim3, size_t, cudaStream_t)
    -> KernelLaunch<Params...>;

// The largest count that kernels index with 32-bit arithmetic before falling back to 64-bit
// (only past INT32_MAX elements otherwise). Tests lower it so that the fallbacks run on small
// shapes; nothing else changes it. Host side: launchers pass the decision to their kernels.
inline int64_t& narrow_index_limit() {
  static int64_t limit = INT32_MAX;
  return limit;
}

}  // namespace cuda
}  // namespace tierlift

#define TIERLIFT_LAUNCH(grid, block, shared, stream, ...) \
  ::tierlift::cuda::KernelLaunch(#__VA_ARGS__, __VA_ARGS__, grid, block, shared, stream)

// `#pragma unroll` for nvcc (arrays indexed by the unrolled loop's counter stay in registers);
// nothing for the host compiler of the simulator, which does not know the pragma.
#ifdef TIERLIFT_CUDASIM
#define TIERLIFT_UNROLL
#else
#define TIERLIFT_UNROLL _Pragma("unroll")
#endif
