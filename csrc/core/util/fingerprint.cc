#include "core/util/fingerprint.h"

#include <algorithm>

#include "core/util/cpu_features.h"
#include "core/util/fingerprint_impl.h"
#include "core/util/thread_pool.h"

namespace tierlift {
namespace {

struct ScalarLanes {
  uint64_t acc[kLanes];
  explicit ScalarLanes(const uint64_t* init) { std::memcpy(acc, init, sizeof(acc)); }
  void stripe(const unsigned char* p, const uint64_t* key) {
    uint64_t d[kLanes];
    std::memcpy(d, p, sizeof(d));
    for (int i = 0; i < kLanes; ++i) {
      const uint64_t x = d[i] ^ key[i];
      acc[i] += (x & 0xFFFFFFFFu) * (x >> 32) + d[i ^ 1];
    }
  }
  void scramble() {
    for (int i = 0; i < kLanes; ++i) {
      acc[i] = ((acc[i] ^ (acc[i] >> kShift)) ^ kKeys.scramble[i]) * kMul;
    }
  }
  void store(uint64_t* out) const { std::memcpy(out, acc, sizeof(acc)); }
};

// Below this many bytes in all, waking the pool costs more than it saves.
constexpr size_t kParallelBytes = size_t{1} << 20;

}  // namespace

uint64_t fingerprint64_scalar(const void* data, size_t n) { return run<ScalarLanes>(data, n); }

uint64_t fingerprint64(const void* data, size_t n) {
  switch (active_simd_level()) {
    case SimdLevel::kAvx512:
      return fingerprint64_avx512(data, n);
    case SimdLevel::kAvx2:
      return fingerprint64_avx2(data, n);
    default:
      return fingerprint64_scalar(data, n);
  }
}

std::vector<uint64_t> fingerprint64_many(const std::vector<ByteRange>& ranges, int threads) {
  std::vector<uint64_t> out(ranges.size());
  // The path is picked once: TIERLIFT_SIMD is read per call, and getenv from pool threads
  // would race with a setenv.
  uint64_t (*fn)(const void*, size_t) = fingerprint64_scalar;
  if (active_simd_level() == SimdLevel::kAvx512) fn = fingerprint64_avx512;
  if (active_simd_level() == SimdLevel::kAvx2) fn = fingerprint64_avx2;
  size_t total = 0;
  for (const auto& r : ranges) total += r.size;
  const int parts = static_cast<int>(std::min<size_t>(
      {static_cast<size_t>(std::max(threads, 1)), ranges.size(), total / kParallelBytes + 1}));
  if (parts <= 1) {
    for (size_t i = 0; i < ranges.size(); ++i) out[i] = fn(ranges[i].data, ranges[i].size);
    return out;
  }
  // Part t takes the ranges that start in its share of the bytes.
  std::vector<size_t> first(parts + 1, ranges.size());
  size_t at = 0;
  int t = 0;
  first[0] = 0;
  for (size_t i = 0; i < ranges.size(); ++i) {
    while (t + 1 < parts && at >= total / parts * (t + 1)) first[++t] = i;
    at += ranges[i].size;
  }
  ThreadPool::global().parallel_for(parts, 1, [&](int64_t b, int64_t e) {
    for (int64_t part = b; part < e; ++part) {
      for (size_t i = first[part]; i < first[part + 1]; ++i) {
        out[i] = fn(ranges[i].data, ranges[i].size);
      }
    }
  });
  return out;
}

}  // namespace tierlift
