#include "cuda/launch.cuh"
#include "tests/cudasim/sim_kernels.cuh"

namespace simtest {
namespace {

constexpr unsigned kFull = 0xffffffffu;

__global__ void shuffle_kernel(Shuffle kind, int arg, int width, const uint32_t* in,
                               uint32_t* out) {
  const uint32_t v = in[threadIdx.x];
  uint32_t r = 0;
  switch (kind) {
    case Shuffle::kIdx:
      r = __shfl_sync(kFull, v, arg, width);
      break;
    case Shuffle::kUp:
      r = __shfl_up_sync(kFull, v, arg, width);
      break;
    case Shuffle::kDown:
      r = __shfl_down_sync(kFull, v, arg, width);
      break;
    case Shuffle::kXor:
      r = __shfl_xor_sync(kFull, v, arg, width);
      break;
  }
  out[threadIdx.x] = r;
}

__global__ void votes_kernel(const int* pred, uint32_t* out) {
  const int p = pred[threadIdx.x];
  out[3 * threadIdx.x] = __ballot_sync(kFull, p);
  out[3 * threadIdx.x + 1] = __any_sync(kFull, p);
  out[3 * threadIdx.x + 2] = __all_sync(kFull, p);
}

__global__ void block_sum_kernel(const float* in, float* sums) {
  __shared__ float s[256];
  s[threadIdx.x] = in[blockIdx.x * 256 + threadIdx.x];
  __syncthreads();
  for (unsigned h = 128; h > 0; h >>= 1) {
    if (threadIdx.x < h) s[threadIdx.x] += s[threadIdx.x + h];
    __syncthreads();
  }
  if (threadIdx.x == 0) sums[blockIdx.x] = s[0];
}

__global__ void atomics_kernel(unsigned long long* counter, int* max) {
  atomicAdd(counter, 1ull);
  atomicMax(max, static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x));
}

__global__ void empty_kernel() {}

template <bool kBarrier>
__global__ void transpose_kernel(const float* x, float* out, int rows, int cols) {
  __shared__ float tile[32][33];
  const int r0 = blockIdx.y * 32, c0 = blockIdx.x * 32;
  for (int k = 0; k < 4; ++k) {
    const int r = r0 + threadIdx.y * 4 + k, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[threadIdx.y * 4 + k][threadIdx.x] = x[r * cols + c];
  }
  if (kBarrier) __syncthreads();
  for (int k = 0; k < 4; ++k) {
    const int c = c0 + threadIdx.y * 4 + k, r = r0 + threadIdx.x;  // out row c, column r
    if (r < rows && c < cols) out[c * rows + r] = tile[threadIdx.x][threadIdx.y * 4 + k];
  }
}

__global__ void copy_off_by_one_kernel(const float* in, float* out, int n) {
  for (int i = threadIdx.x; i <= n; i += blockDim.x) {
    if (i < n)
      out[i] = in[i];
    else
      out[i - 1] += in[i] * 0.f;  // the read past the end
  }
}

// Lanes 0-15 sum their half-warp, but the first step (xor 16) reads lanes 16-31, which the
// mask leaves out.
__global__ void warp_sum_wrong_mask_kernel(const float* in, float* out) {
  float v = in[threadIdx.x];
  if (threadIdx.x < 16) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0x0000ffffu, v, o);
  }
  out[threadIdx.x] = v;
}

// Every lane uses the half-warp mask, so lanes 16-31 call with a mask that leaves them out.
__global__ void mask_leaves_out_caller_kernel(const float* in, float* out) {
  float v = in[threadIdx.x];
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0x0000ffffu, v, o);
  out[threadIdx.x] = v;
}

__global__ void exit_before_barrier_kernel(float* out) {
  if (threadIdx.x == 5) return;
  out[threadIdx.x] = 1.f;
  __syncthreads();
  out[threadIdx.x] += 1.f;
}

__global__ void divergent_barrier_kernel(float* out) {
  if (threadIdx.x < 32) {
    out[threadIdx.x] = 1.f;
    __syncthreads();
  } else {
    out[threadIdx.x] = 2.f;
    __syncthreads();
  }
}

__global__ void shuffle_vs_barrier_kernel(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x == 0) {
    __syncthreads();
  } else {
    v = __shfl_xor_sync(kFull, v, 1);
  }
  out[threadIdx.x] = v;
}

// Reads its shared slot before anything writes it: sees the block's poison.
__global__ void read_before_write_kernel(uint32_t* out) {
  __shared__ uint32_t s[64];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s[threadIdx.x];
  s[threadIdx.x] = threadIdx.x;
}

// Per round: each warp's max into slot[warp] (shuffles), barrier, every thread reads all slots;
// without kReuseBarrier the next round's slot write is not ordered after other warps' reads.
template <bool kReuseBarrier>
__global__ void reuse_slot_kernel(const float* in, float* out, int rounds) {
  __shared__ float slot[8];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int r = 0; r < rounds; ++r) {
    float v = in[(blockIdx.x * rounds + r) * blockDim.x + threadIdx.x];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
    if (lane == 0) slot[warp] = v;
    __syncthreads();
    float m = slot[0];
    for (int w = 1; w < warps; ++w) m = fmaxf(m, slot[w]);
    out[(blockIdx.x * rounds + r) * blockDim.x + threadIdx.x] = m;
    if (kReuseBarrier) __syncthreads();
  }
}

// Thread 0 of every block raises *max to its block's value: atomically, or by a plain
// read-compare-store (the planted bug: a lost update when blocks race).
template <bool kAtomic>
__global__ void block_max_kernel(const unsigned* values, unsigned* max) {
  if (threadIdx.x != 0) return;
  const unsigned v = values[blockIdx.x];
  if (kAtomic) {
    atomicMax(max, v);
  } else if (*max < v) {
    *max = v;
  }
}

}  // namespace

cudaError_t read_before_write(uint32_t* out, int blocks) {
  TIERLIFT_LAUNCH(blocks, 64, 0, nullptr, read_before_write_kernel)(out);
  return cudaGetLastError();
}

cudaError_t reuse_slot(const float* in, float* out, int blocks, int threads, int rounds,
                       bool with_barrier) {
  if (with_barrier) {
    TIERLIFT_LAUNCH(blocks, threads, 0, nullptr, reuse_slot_kernel<true>)(in, out, rounds);
  } else {
    TIERLIFT_LAUNCH(blocks, threads, 0, nullptr, reuse_slot_kernel<false>)(in, out, rounds);
  }
  return cudaGetLastError();
}

cudaError_t block_max(const unsigned* values, unsigned* max, int blocks, bool atomic) {
  if (atomic) {
    TIERLIFT_LAUNCH(blocks, 32, 0, nullptr, block_max_kernel<true>)(values, max);
  } else {
    TIERLIFT_LAUNCH(blocks, 32, 0, nullptr, block_max_kernel<false>)(values, max);
  }
  return cudaGetLastError();
}

cudaError_t shuffle(Shuffle kind, int arg, int width, const uint32_t* in, uint32_t* out,
                    int threads) {
  TIERLIFT_LAUNCH(1, threads, 0, nullptr, shuffle_kernel)(kind, arg, width, in, out);
  return cudaGetLastError();
}

cudaError_t votes(const int* pred, uint32_t* out, int threads) {
  TIERLIFT_LAUNCH(1, threads, 0, nullptr, votes_kernel)(pred, out);
  return cudaGetLastError();
}

cudaError_t block_sums(const float* in, float* sums, int blocks) {
  TIERLIFT_LAUNCH(blocks, 256, 0, nullptr, block_sum_kernel)(in, sums);
  return cudaGetLastError();
}

cudaError_t atomics(unsigned long long* counter, int* max, int blocks, int threads) {
  TIERLIFT_LAUNCH(blocks, threads, 0, nullptr, atomics_kernel)(counter, max);
  return cudaGetLastError();
}

cudaError_t empty_launch(dim3 grid, dim3 block) {
  TIERLIFT_LAUNCH(grid, block, 0, nullptr, empty_kernel)();
  return cudaGetLastError();
}

cudaError_t transpose(const float* x, float* out, int rows, int cols, bool with_barrier) {
  const dim3 grid((cols + 31) / 32, (rows + 31) / 32), block(32, 8);
  if (with_barrier) {
    TIERLIFT_LAUNCH(grid, block, 0, nullptr, transpose_kernel<true>)(x, out, rows, cols);
  } else {
    TIERLIFT_LAUNCH(grid, block, 0, nullptr, transpose_kernel<false>)(x, out, rows, cols);
  }
  return cudaGetLastError();
}

cudaError_t copy_off_by_one(const float* in, float* out, int n) {
  TIERLIFT_LAUNCH(1, 64, 0, nullptr, copy_off_by_one_kernel)(in, out, n);
  return cudaGetLastError();
}

cudaError_t warp_sum_wrong_mask(const float* in, float* out) {
  TIERLIFT_LAUNCH(1, 32, 0, nullptr, warp_sum_wrong_mask_kernel)(in, out);
  return cudaGetLastError();
}

cudaError_t mask_leaves_out_caller(const float* in, float* out) {
  TIERLIFT_LAUNCH(1, 32, 0, nullptr, mask_leaves_out_caller_kernel)(in, out);
  return cudaGetLastError();
}

cudaError_t exit_before_barrier(float* out) {
  TIERLIFT_LAUNCH(1, 64, 0, nullptr, exit_before_barrier_kernel)(out);
  return cudaGetLastError();
}

cudaError_t divergent_barrier(float* out) {
  TIERLIFT_LAUNCH(1, 64, 0, nullptr, divergent_barrier_kernel)(out);
  return cudaGetLastError();
}

cudaError_t shuffle_vs_barrier(float* out) {
  TIERLIFT_LAUNCH(1, 32, 0, nullptr, shuffle_vs_barrier_kernel)(out);
  return cudaGetLastError();
}

}  // namespace simtest
