// Warp shuffles and votes (the *_sync forms, masks honoured) on top of the scheduler's warp
// rendezvous. Values of up to 8 bytes are exchanged as raw bits, so every type round-trips.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cudasim/scheduler.h"

namespace cudasim {

template <typename T>
inline T shuffle(WarpOp op, unsigned mask, T var, int arg, int width, const char* file, int line) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a wide type");
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = warp_collective(op, mask, bits, arg, width, file, line);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

}  // namespace cudasim

#define CUDASIM_SHUFFLE(name, op)                                                        \
  template <typename T>                                                                  \
  inline T name(unsigned mask, T var, int arg, int width = 32,                           \
                const char* file = __builtin_FILE(), int line = __builtin_LINE()) {      \
    return ::cudasim::shuffle(::cudasim::WarpOp::op, mask, var, arg, width, file, line); \
  }
CUDASIM_SHUFFLE(__shfl_sync, kShflIdx)
CUDASIM_SHUFFLE(__shfl_up_sync, kShflUp)
CUDASIM_SHUFFLE(__shfl_down_sync, kShflDown)
CUDASIM_SHUFFLE(__shfl_xor_sync, kShflXor)
#undef CUDASIM_SHUFFLE

inline unsigned __ballot_sync(unsigned mask, int pred, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  return static_cast<unsigned>(
      cudasim::warp_collective(cudasim::WarpOp::kBallot, mask, pred != 0, 0, 32, file, line));
}
inline int __any_sync(unsigned mask, int pred, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
  return static_cast<int>(
      cudasim::warp_collective(cudasim::WarpOp::kAny, mask, pred != 0, 0, 32, file, line));
}
inline int __all_sync(unsigned mask, int pred, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
  return static_cast<int>(
      cudasim::warp_collective(cudasim::WarpOp::kAll, mask, pred != 0, 0, 32, file, line));
}
inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(),
                       int line = __builtin_LINE()) {
  cudasim::warp_collective(cudasim::WarpOp::kSync, mask, 0, 0, 32, file, line);
}
