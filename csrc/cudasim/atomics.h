// Device atomics on the host. Blocks of a launch may run on several OS threads at once, so these
// are real atomic read-modify-writes (compare-and-swap loops where the CPU has no direct form);
// inside a block the fibers never interleave within one call. Relaxed, as CUDA's atomicX are:
// an atomic orders nothing else, so under ThreadSanitizer it hides no race on other data.
#pragma once

#include <cstdint>

#include "cudasim/intrinsics.h"

namespace cudasim {

template <typename T, typename F>
inline T atomic_update(T* addr, F f) {
  T old = __atomic_load_n(addr, __ATOMIC_RELAXED);
  while (
      !__atomic_compare_exchange_n(addr, &old, f(old), false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}

template <typename T>
inline T atomic_float_update(T* addr, T v) {  // float/double add through their bit patterns
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  const U old = atomic_update(reinterpret_cast<U*>(addr),
                              [v](U bits) { return bit_cast<U>(bit_cast<T>(bits) + v); });
  return bit_cast<T>(old);
}

}  // namespace cudasim

#define CUDASIM_INTEGER_ATOMICS(T)                                                                 \
  inline T atomicAdd(T* a, T v) { return __atomic_fetch_add(a, v, __ATOMIC_RELAXED); }             \
  inline T atomicSub(T* a, T v) { return __atomic_fetch_sub(a, v, __ATOMIC_RELAXED); }             \
  inline T atomicAnd(T* a, T v) { return __atomic_fetch_and(a, v, __ATOMIC_RELAXED); }             \
  inline T atomicOr(T* a, T v) { return __atomic_fetch_or(a, v, __ATOMIC_RELAXED); }               \
  inline T atomicXor(T* a, T v) { return __atomic_fetch_xor(a, v, __ATOMIC_RELAXED); }             \
  inline T atomicExch(T* a, T v) { return __atomic_exchange_n(a, v, __ATOMIC_RELAXED); }           \
  inline T atomicMax(T* a, T v) {                                                                  \
    return ::cudasim::atomic_update(a, [v](T o) { return o < v ? v : o; });                        \
  }                                                                                                \
  inline T atomicMin(T* a, T v) {                                                                  \
    return ::cudasim::atomic_update(a, [v](T o) { return v < o ? v : o; });                        \
  }                                                                                                \
  inline T atomicCAS(T* a, T expected, T desired) {                                                \
    __atomic_compare_exchange_n(a, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED); \
    return expected;                                                                               \
  }

CUDASIM_INTEGER_ATOMICS(int)
CUDASIM_INTEGER_ATOMICS(unsigned int)
CUDASIM_INTEGER_ATOMICS(long long)
CUDASIM_INTEGER_ATOMICS(unsigned long long)
#undef CUDASIM_INTEGER_ATOMICS

// A sequentially consistent fence across the OS threads that run blocks (ThreadSanitizer does
// not model fences: kernels hand data between blocks of one launch through atomics).
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

inline float atomicAdd(float* a, float v) { return cudasim::atomic_float_update(a, v); }
inline double atomicAdd(double* a, double v) { return cudasim::atomic_float_update(a, v); }
inline float atomicExch(float* a, float v) {
  return cudasim::bit_cast<float>(
      atomicExch(reinterpret_cast<unsigned int*>(a), cudasim::bit_cast<unsigned int>(v)));
}
