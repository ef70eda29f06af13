// The Python module tierlift._C: importing it registers every op (static initializers in the
// other csrc/torch files) and exposes the stateful engines as pybind11 classes plus build facts.
#include <torch/extension.h>

#include "core/util/cpu_features.h"
#include "core/util/thread_pool.h"

namespace tierlift {
// Each engine family adds its classes here (defined next to its implementation).
void bind_gather(pybind11::module_& m);
void bind_io(pybind11::module_& m);
}  // namespace tierlift

PYBIND11_MODULE(_C, m) {
  m.doc() = "tierlift compiled core (ops are under torch.ops.tierlift)";
#ifdef TIERLIFT_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
#ifdef TIERLIFT_HAVE_URING
  m.attr("with_uring") = true;
#else
  m.attr("with_uring") = false;
#endif
  m.def(
      "cpu_simd_level", [] { return tierlift::simd_level_name(tierlift::cpu_simd_level()); },
      "Best SIMD level this CPU supports: avx512, avx2 or scalar.");
  m.def(
      "active_simd_level", [] { return tierlift::simd_level_name(tierlift::active_simd_level()); },
      "SIMD level the CPU kernels use now (TIERLIFT_SIMD can force a lower one).");
  m.def(
      "num_threads", [] { return tierlift::ThreadPool::global().num_threads(); },
      "Threads in tierlift's CPU pool (TIERLIFT_NUM_THREADS).");
  m.def(
      "set_thread_limit", [](int limit) { tierlift::ThreadPool::set_thread_limit(limit); },
      "Caps the pool threads the calling thread's CPU kernels use (0: all of them).");
  m.def(
      "thread_limit", [] { return tierlift::ThreadPool::thread_limit(); },
      "The calling thread's cap set by set_thread_limit (0: none).");
  tierlift::bind_gather(m);
  tierlift::bind_io(m);
}
