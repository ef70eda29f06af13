// Kernel launch in the simulator, and the knobs a test or a user may turn.
//
// A launch runs every block of the grid; each block runs all its threads as fibers on one OS
// thread, resuming them in a seeded random order between barriers so that a missing barrier
// shows up as a wrong result. Blocks are spread over several OS threads. The launch returns when
// the grid is done (streams are synchronous here); a rule broken inside a kernel becomes
// cudaErrorLaunchFailure for cudaGetLastError(), and its message goes to stderr and to
// last_error_message(). Environment: TIERLIFT_CUDASIM_SEED (default: random, printed with any
// error), TIERLIFT_CUDASIM_THREADS (OS threads per launch, default min(4, cores)),
// TIERLIFT_CUDASIM_SCHEDULE (`thread`, the default, or `warp`: see Schedule).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace cudasim {

cudaError_t run_kernel(const char* name, dim3 grid, dim3 block, size_t shared_bytes,
                       void (*body)(void* ctx), void* ctx);

template <typename... Params, typename... Args>
void launch(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
            cudaStream_t /*stream: launches are synchronous*/, Args&&... args) {
  // Converted once, like the kernel's parameter buffer; each thread gets its own copies.
  struct Call {
    void (*kernel)(Params...);
    std::tuple<std::decay_t<Params>...> params;
  } call{kernel, std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)};
  run_kernel(
      name, grid, block, shared_bytes,
      [](void* ctx) {
        auto* c = static_cast<Call*>(ctx);
        std::apply(c->kernel, c->params);
      },
      &call);
}

// The order in which a block's threads run between rendezvous. kThread: one random ready thread
// at a time, each to its next barrier or warp collective, so warps interleave finely. kWarp: a
// random warp runs alone until its next __syncthreads (or its end) before another warp moves,
// so one warp gets far ahead of others (a missing barrier before reusing a shared slot shows).
enum class Schedule { kThread, kWarp };

uint64_t seed();
void set_seed(uint64_t seed);
Schedule schedule();
void set_schedule(Schedule s);
void reset_schedule();  // back to TIERLIFT_CUDASIM_SCHEDULE
// Bytes of __shared__ variables (all kernels of the program), poisoned at each block start.
size_t shared_memory_bytes();
int threads();
void set_threads(int n);
// The message of the last kernel error (empty if none yet); kept after cudaGetLastError().
std::string last_error_message();
// Launches run so far (each counts once, failed ones too).
uint64_t launch_count();

}  // namespace cudasim
