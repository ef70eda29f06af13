// Small kernels that exercise the simulator's CUDA semantics (shuffles, votes, barriers, shared
// memory, atomics) and deliberately broken copies of them that it must catch. Test code only:
// compiled like csrc/cuda/*.cu (host compiler + cudasim.h), launched through these wrappers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace simtest {

enum class Shuffle { kIdx, kUp, kDown, kXor };

// out[t] = the shuffle of in[t] across each warp (mask: all lanes), one block of `threads`.
cudaError_t shuffle(Shuffle kind, int arg, int width, const uint32_t* in, uint32_t* out,
                    int threads);
// out[3 * t + {0, 1, 2}] = __ballot_sync, __any_sync, __all_sync of pred[t] over the full warp.
cudaError_t votes(const int* pred, uint32_t* out, int threads);
// sums[b] = sum of in[b * 256 .. b * 256 + 255] via shared memory and __syncthreads.
cudaError_t block_sums(const float* in, float* sums, int blocks);
// Every thread of every block does atomicAdd(counter, 1) and atomicMax(max, its global id).
cudaError_t atomics(unsigned long long* counter, int* max, int blocks, int threads);
// A launch with the given configuration (to test that bad ones are refused).
cudaError_t empty_launch(dim3 grid, dim3 block);
// out = x^T for a rows x cols matrix via 32x32 shared-memory tiles (block 32x8).
// with_barrier = false is the planted bug: the __syncthreads between the tile's write and the
// transposed read is missing.
cudaError_t transpose(const float* x, float* out, int rows, int cols, bool with_barrier);

// out[b * 64 + t] = shared slot t of block b, read before the block writes it (the poison).
cudaError_t read_before_write(uint32_t* out, int blocks);
// out[(b * rounds + r) * threads + t] = max of in[(b * rounds + r) * threads + 0 .. threads - 1],
// through one shared slot per warp (threads <= 256) reused every round. with_barrier = false is
// the planted bug: no __syncthreads between a round's reads of the slots and the next round's
// writes (the write-after-read race compact Adam's second barrier prevents).
cudaError_t reuse_slot(const float* in, float* out, int blocks, int threads, int rounds,
                       bool with_barrier);
// *max = max(*max, values[0 .. blocks - 1]), one update per block; atomic = false is the
// planted bug: a plain read-compare-store instead of atomicMax.
cudaError_t block_max(const unsigned* values, unsigned* max, int blocks, bool atomic);

// Planted bugs.
// Copies n floats with `i <= n`: reads one element past the end of `in`.
cudaError_t copy_off_by_one(const float* in, float* out, int n);
// Half-warp sum with mask 0x0000ffff whose first step reads lanes 16-31 (xor 16).
cudaError_t warp_sum_wrong_mask(const float* in, float* out);
// All 32 lanes call a shuffle with mask 0x0000ffff.
cudaError_t mask_leaves_out_caller(const float* in, float* out);
// Thread 5 returns before the block's __syncthreads.
cudaError_t exit_before_barrier(float* out);
// Half the block waits at one __syncthreads, half at another.
cudaError_t divergent_barrier(float* out);
// Lane 0 waits at __syncthreads while the rest of its warp waits in a shuffle.
cudaError_t shuffle_vs_barrier(float* out);

}  // namespace simtest
