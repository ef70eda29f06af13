// The block scheduler's interface to device code: the running thread's coordinates, the block
// barrier and the warp rendezvous that every shuffle and vote goes through. A thread that breaks
// a rule (a barrier some thread can no longer reach, a warp collective whose mask leaves out the
// caller, names an exited lane or disagrees between lanes, a read from a lane outside the mask,
// a deadlock) ends its block with an error naming the kernel, block, thread and source line; the
// launch then fails instead of hanging.
#pragma once

#include <vector_types.h>

#include <cstdint>

namespace cudasim {

struct Coords {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
// Coordinates of the fiber running on this OS thread (set by the scheduler before each resume).
extern thread_local Coords current;

enum class WarpOp : uint8_t { kShflIdx, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll, kSync };

void syncthreads(const char* file, int line);

// Meets the other lanes of `mask` in the same collective. Shuffles return the value of the source
// lane that PTX's shfl.sync picks for (arg, width) (the caller's own value when the source falls
// outside its width segment); votes return the ballot of (value != 0) over the mask.
uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width,
                         const char* file, int line);

}  // namespace cudasim

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  cudasim::syncthreads(file, line);
}
