// ThreadSanitizer hooks of the simulator (no-ops in other builds). Under -fsanitize=thread every
// simulated CUDA thread is a TSan fiber, switched to without synchronisation, so TSan orders two
// of its accesses only through what CUDA itself orders: the barriers and warp collectives both
// threads took part in (scheduler.cc releases on arrival and acquires on completion), atomics,
// and the launch (everything before it, everything after it). Two accesses to one address that
// none of these order, one of them a write, are reported as a data race.
#pragma once

#if defined(__SANITIZE_THREAD__)
#define CUDASIM_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define CUDASIM_TSAN 1
#endif
#endif

#ifdef CUDASIM_TSAN
#include <sanitizer/tsan_interface.h>

// The dynamic-annotation entry points libtsan exports (no public header declares them).
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
extern "C" void AnnotateIgnoreWritesBegin(const char* file, int line);
extern "C" void AnnotateIgnoreWritesEnd(const char* file, int line);
#endif

namespace cudasim {
namespace tsan {

#ifdef CUDASIM_TSAN
constexpr bool kEnabled = true;
inline void release(void* sync) { __tsan_release(sync); }
inline void acquire(void* sync) { __tsan_acquire(sync); }
// The simulator's own bookkeeping is shared by the fibers of a block and by the OS thread that
// runs them, deliberately without TSan-visible order: its accesses are not recorded.
inline void ignore_begin() {
  AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
  AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
}
inline void ignore_end() {
  AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
  AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
}
class Ignore {
 public:
  Ignore() { ignore_begin(); }
  ~Ignore() { ignore_end(); }
  Ignore(const Ignore&) = delete;
  Ignore& operator=(const Ignore&) = delete;
};
#else
constexpr bool kEnabled = false;
inline void release(void*) {}
inline void acquire(void*) {}
inline void ignore_begin() {}
inline void ignore_end() {}
class Ignore {
 public:
  Ignore() {}
};
#endif

}  // namespace tsan
}  // namespace cudasim
