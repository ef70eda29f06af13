#include "core/util/fingerprint_keys.h"
#include "cuda/fingerprint.cuh"
#include "cuda/launch.cuh"

namespace tierlift {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int kParts = kWarp / kLanes;               // a block's stripes split 4 ways
constexpr int kPerPart = kStripesPerBlock / kParts;  // stripes per thread and block
constexpr int kWordsPerBlock = kStripesPerBlock * kLanes;
constexpr uint64_t kBlockBytes = kStripe * kStripesPerBlock;
constexpr int kAhead = 4;  // blocks whose loads are issued before the first of them is summed
constexpr unsigned kFull = 0xFFFFFFFFu;

// kKeys without its 64-byte alignment, which a kernel parameter cannot have (1.2 KB: within the
// parameter space, read through the constant cache).
struct KernelKeys {
  uint64_t stripe[kStripesPerBlock][kLanes];
  uint64_t scramble[kLanes];
  uint64_t init[kLanes];
  uint64_t out[kLanes];
};

KernelKeys kernel_keys() {
  KernelKeys k{};
  for (int s = 0; s < kStripesPerBlock; ++s) {
    for (int i = 0; i < kLanes; ++i) k.stripe[s][i] = kKeys.stripe[s][i];
  }
  for (int i = 0; i < kLanes; ++i) {
    k.scramble[i] = kKeys.scramble[i];
    k.init[i] = kKeys.init[i];
    k.out[i] = kKeys.out[i];
  }
  return k;
}

// The 8 bytes at offset `at` of a range of n bytes, little-endian, bytes past n read as zero.
__device__ __forceinline__ uint64_t word_at(const unsigned char* p, uint64_t at, uint64_t n,
                                            bool aligned) {
  if (aligned && at + 8 <= n) return *reinterpret_cast<const uint64_t*>(p + at);
  uint64_t w = 0;
  for (int k = 0; k < 8; ++k) {
    if (at + k < n) w |= static_cast<uint64_t>(p[at + k]) << (8 * k);
  }
  return w;
}

// One stripe word's term for lane li: lo32(x) * hi32(x) + the neighbouring lane's word. Every
// thread of the warp calls it (the shuffle needs them all).
__device__ __forceinline__ uint64_t term(uint64_t d, uint64_t key) {
  const uint64_t neighbour = __shfl_xor_sync(kFull, d, 1);
  const uint64_t x = d ^ key;
  return (x & 0xFFFFFFFFu) * (x >> 32) + neighbour;
}

// The sum of a lane's terms over the warp's 4 parts: every thread of lane li gets it.
__device__ __forceinline__ uint64_t lane_sum(uint64_t part) {
  part += __shfl_xor_sync(kFull, part, 8);
  return part + __shfl_xor_sync(kFull, part, 16);
}

__device__ __forceinline__ uint64_t scramble(uint64_t acc, uint64_t key) {
  return ((acc ^ (acc >> kShift)) ^ key) * kMul;
}

__global__ void __launch_bounds__(kThreads)
    fingerprint_kernel(const FingerprintRange* __restrict__ ranges, int64_t count,
                       uint64_t* __restrict__ out, KernelKeys keys) {
  const int lane = threadIdx.x % kWarp;
  const int li = lane % kLanes;    // the accumulator this thread adds to
  const int part = lane / kLanes;  // its stripes of a block: part, part + 4, part + 8, ...
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / kWarp);
  // This thread's keys, in registers: indexed by lane, a kernel parameter is read through the
  // constant cache, which serves one address at a time (a warp's 32 distinct stripe keys took
  // 32 turns per load, and ptxas reloaded them every 4 KiB).
  uint64_t stripe_key[kPerPart];
  TIERLIFT_UNROLL
  for (int j = 0; j < kPerPart; ++j) stripe_key[j] = keys.stripe[part + kParts * j][li];
  const uint64_t scramble_key = keys.scramble[li];
  // The loop is warp-uniform: all 32 threads of a warp take the same ranges.
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / kWarp; r < count;
       r += warps) {
    const auto* p = static_cast<const unsigned char*>(ranges[r].data);
    const uint64_t n = ranges[r].bytes;
    const bool aligned = reinterpret_cast<uintptr_t>(p) % 8 == 0;
    uint64_t acc = keys.init[li];
    const uint64_t blocks = n / kBlockBytes;
    uint64_t b = 0;
    if (aligned) {
      const auto* w = reinterpret_cast<const uint64_t*>(p);
      for (; b + kAhead <= blocks; b += kAhead) {
        uint64_t d[kAhead][kPerPart];
        TIERLIFT_UNROLL
        for (int a = 0; a < kAhead; ++a) {
          TIERLIFT_UNROLL
          for (int j = 0; j < kPerPart; ++j) {
            d[a][j] = w[(b + a) * kWordsPerBlock + (part + kParts * j) * kLanes + li];
          }
        }
        TIERLIFT_UNROLL
        for (int a = 0; a < kAhead; ++a) {
          uint64_t sum = 0;
          TIERLIFT_UNROLL
          for (int j = 0; j < kPerPart; ++j) {
            sum += term(d[a][j], stripe_key[j]);
          }
          acc = scramble(acc + lane_sum(sum), scramble_key);
        }
      }
    }
    for (; b < blocks; ++b) {  // the last blocks, or every block of an unaligned range
      uint64_t sum = 0;
      TIERLIFT_UNROLL
      for (int j = 0; j < kPerPart; ++j) {
        const int s = part + kParts * j;
        sum += term(word_at(p, b * kBlockBytes + s * kStripe + li * 8, n, aligned), stripe_key[j]);
      }
      acc = scramble(acc + lane_sum(sum), scramble_key);
    }
    // The rest (< 1 KiB): whole stripes, then the last one padded with zeros; no scramble.
    const uint64_t base = blocks * kBlockBytes;
    const uint64_t stripes = (n - base + kStripe - 1) / kStripe;
    uint64_t sum = 0;
    TIERLIFT_UNROLL
    for (int j = 0; j < kPerPart; ++j) {
      const int s = part + kParts * j;
      const bool used = static_cast<uint64_t>(s) < stripes;
      const uint64_t t =
          term(used ? word_at(p, base + s * kStripe + li * 8, n, aligned) : 0, stripe_key[j]);
      if (used) sum += t;
    }
    acc += lane_sum(sum);
    uint64_t lanes[kLanes];
    TIERLIFT_UNROLL
    for (int i = 0; i < kLanes; ++i) lanes[i] = __shfl_sync(kFull, acc, i);
    if (lane == 0) out[r] = finish(lanes, n, keys.out);
  }
}

}  // namespace

cudaError_t fingerprint_ranges(const FingerprintRange* ranges, int64_t count, uint64_t* out,
                               cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  constexpr int64_t kWarpsPerBlock = kThreads / kWarp;
  const int64_t needed = (count + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int blocks = static_cast<int>(needed < int64_t{sms} * 8 ? needed : int64_t{sms} * 8);
  TIERLIFT_LAUNCH(blocks, kThreads, 0, stream, fingerprint_kernel)
  (ranges, count, out, kernel_keys());
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace tierlift
