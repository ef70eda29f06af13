// The 64-bit content fingerprint (csrc/core/util/fingerprint.h) of device memory, computed on
// the device: the same value the CPU paths give for the same bytes, so a fingerprint taken of a
// host copy and one taken of the device tensor compare equal exactly when the bytes do. The
// offloaded optimizer checks GPU gradients and weights this way without copying them down.
//
// One warp per range: its 32 threads are 4 groups of the fingerprint's 8 lanes, each group
// summing 4 of a 1 KiB block's 16 stripes (sums within a block commute), and 4 blocks are loaded
// before their scrambles are chained, so a warp keeps 4 KiB of loads in flight. A range may
// start at any byte; 8-byte words are read whole where the range is 8-byte aligned.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tierlift {
namespace cuda {

struct FingerprintRange {
  const void* data = nullptr;  // device memory
  uint64_t bytes = 0;
};

// out[i] = fingerprint64(ranges[i].data, ranges[i].bytes) for i < count; `ranges` and `out` are
// device memory.
cudaError_t fingerprint_ranges(const FingerprintRange* ranges, int64_t count, uint64_t* out,
                               cudaStream_t stream);

}  // namespace cuda
}  // namespace tierlift
