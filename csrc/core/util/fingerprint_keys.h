// The fingerprint's constants, keys and final mix (fingerprint.h), shared by the CPU paths
// (fingerprint_impl.h) and the CUDA kernel (csrc/cuda/fingerprint.cu), so that both compute the
// same value for the same bytes. Per lane i of eight, for each 64-byte stripe s of a 1 KiB block,
// with word d[i] and x = d[i] ^ stripe[s][i]:  acc[i] += lo32(x) * hi32(x) + d[i ^ 1]; after
// each whole block acc[i] = ((acc[i] ^ (acc[i] >> kShift)) ^ scramble[i]) * kMul (mod 2^64).
// Additions within a block commute, so a kernel may sum a block's stripes in any order.
#pragma once

#include <cstddef>
#include <cstdint>

#ifdef __CUDACC__
#define TIERLIFT_FP_HD __host__ __device__ __forceinline__
#else
#define TIERLIFT_FP_HD inline
#endif

namespace tierlift {
// Anonymous: each ISA file gets its own copies, compiled for its own target; a shared inline
// copy could be the AVX-512 one, run on a CPU without it.
namespace {

constexpr int kLanes = 8;
constexpr size_t kStripe = 64;
constexpr int kStripesPerBlock = 16;  // the lanes are scrambled after every 1 KiB
constexpr int kShift = 29;
constexpr uint64_t kMul = 0x9E3779B1u;  // odd, 32 bits: SIMD multiplies it with mul_epu32

// Key material: a Weyl sequence through a xor-shift-multiply mixer, computed at compile time.
constexpr TIERLIFT_FP_HD uint64_t mix(uint64_t z) {
  z ^= z >> 32;
  z *= 0xD6E8FEB86659FD93ull;
  z ^= z >> 29;
  z *= 0xA0761D6478BD642Full;
  z ^= z >> 32;
  return z;
}
constexpr uint64_t key_at(int i) {
  return mix(0x243F6A8885A308D3ull + (i + 1) * 0x9E3779B97F4A7C15ull);
}

struct Keys {
  alignas(64) uint64_t stripe[kStripesPerBlock][kLanes];
  alignas(64) uint64_t scramble[kLanes];
  uint64_t init[kLanes];
  uint64_t out[kLanes];
};

constexpr Keys make_keys() {
  Keys k{};
  int at = 0;
  for (int s = 0; s < kStripesPerBlock; ++s) {
    for (int i = 0; i < kLanes; ++i) k.stripe[s][i] = key_at(at++);
  }
  for (int i = 0; i < kLanes; ++i) k.scramble[i] = key_at(at++);
  for (int i = 0; i < kLanes; ++i) k.init[i] = key_at(at++);
  for (int i = 0; i < kLanes; ++i) k.out[i] = key_at(at++);
  return k;
}

// Host copy. Device code cannot read a host constexpr array: the kernel gets Keys as an argument.
constexpr Keys kKeys = make_keys();

// 64x64->128 multiply folded to 64 bits (high half xor low half).
TIERLIFT_FP_HD uint64_t fold_mul(uint64_t a, uint64_t b) {
#ifdef __CUDA_ARCH__
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 r = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(r) ^ static_cast<uint64_t>(r >> 64);
#endif
}

// The eight lanes and the length into one value: chained folded multiplies (lane order
// matters), then a final avalanche so every input bit reaches every output bit.
TIERLIFT_FP_HD uint64_t finish(const uint64_t acc[kLanes], size_t n, const uint64_t* out_keys) {
  uint64_t h = static_cast<uint64_t>(n) * 0x9E3779B97F4A7C15ull ^ out_keys[0];
  for (int j = 0; j < kLanes; j += 2) {
    h = fold_mul(h ^ acc[j] ^ out_keys[j], acc[j + 1] ^ out_keys[j + 1]);
  }
  return mix(h ^ static_cast<uint64_t>(n));
}

}  // namespace
}  // namespace tierlift
