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

FiniteFingerprint fingerprint64_finite_scalar(const void* data, size_t n, int width,
                                              uint32_t exp_mask) {
  return run_finite<ScalarLanes, ScalarFinite>(data, n, width, exp_mask);
}

uint64_t fingerprint64_copy_scalar(void* dst, const void* src, size_t n) {
  return run<ScalarLanes>(src, n, CopyVisit{static_cast<unsigned char*>(dst)});
}

namespace {

// One path's functions, picked once per call: TIERLIFT_SIMD is read per call, and getenv
// from pool threads would race with a setenv.
struct Path {
  uint64_t (*hash)(const void*, size_t);
  FiniteFingerprint (*finite)(const void*, size_t, int, uint32_t);
  uint64_t (*copy)(void*, const void*, size_t);
};

Path active_path() {
  switch (active_simd_level()) {
    case SimdLevel::kAvx512:
      return {fingerprint64_avx512, fingerprint64_finite_avx512, fingerprint64_copy_avx512};
    case SimdLevel::kAvx2:
      return {fingerprint64_avx2, fingerprint64_finite_avx2, fingerprint64_copy_avx2};
    default:
      return {fingerprint64_scalar, fingerprint64_finite_scalar, fingerprint64_copy_scalar};
  }
}

// Calls fn(i) for every item, items split between up to `threads` threads of the global pool
// by their bytes (each item on one thread, so results do not depend on the split).
template <class Fn>
void for_each_by_bytes(const std::vector<size_t>& bytes, int threads, Fn&& fn) {
  size_t total = 0;
  for (size_t b : bytes) total += b;
  const int parts = static_cast<int>(std::min<size_t>(
      {static_cast<size_t>(std::max(threads, 1)), bytes.size(), total / kParallelBytes + 1}));
  if (parts <= 1) {
    for (size_t i = 0; i < bytes.size(); ++i) fn(i);
    return;
  }
  // Part t takes the items that start in its share of the bytes.
  std::vector<size_t> first(parts + 1, bytes.size());
  size_t at = 0;
  int t = 0;
  first[0] = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    while (t + 1 < parts && at >= total / parts * (t + 1)) first[++t] = i;
    at += bytes[i];
  }
  ThreadPool::global().parallel_for(parts, 1, [&](int64_t b, int64_t e) {
    for (int64_t part = b; part < e; ++part) {
      for (size_t i = first[part]; i < first[part + 1]; ++i) fn(i);
    }
  });
}

}  // namespace

uint64_t fingerprint64(const void* data, size_t n) { return active_path().hash(data, n); }

FiniteFingerprint fingerprint64_finite(const void* data, size_t n, int width, uint32_t exp_mask) {
  return active_path().finite(data, n, width, exp_mask);
}

uint64_t fingerprint64_copy(void* dst, const void* src, size_t n) {
  return active_path().copy(dst, src, n);
}

std::vector<uint64_t> fingerprint64_many(const std::vector<ByteRange>& ranges, int threads) {
  std::vector<uint64_t> out(ranges.size());
  const auto fn = active_path().hash;
  std::vector<size_t> bytes;
  bytes.reserve(ranges.size());
  for (const auto& r : ranges) bytes.push_back(r.size);
  for_each_by_bytes(bytes, threads, [&](size_t i) { out[i] = fn(ranges[i].data, ranges[i].size); });
  return out;
}

std::vector<FiniteFingerprint> fingerprint64_finite_many(const std::vector<FloatRange>& ranges,
                                                         int threads) {
  std::vector<FiniteFingerprint> out(ranges.size());
  const auto fn = active_path().finite;
  std::vector<size_t> bytes;
  bytes.reserve(ranges.size());
  for (const auto& r : ranges) bytes.push_back(r.size);
  for_each_by_bytes(bytes, threads, [&](size_t i) {
    const auto& r = ranges[i];
    out[i] = fn(r.data, r.size, r.width, r.exp_mask);
  });
  return out;
}

std::vector<CheckedCopyResult> fingerprint64_copy_checked(
    const std::vector<std::vector<CheckedCopy>>& groups, int threads) {
  std::vector<CheckedCopyResult> out(groups.size());
  const Path path = active_path();
  std::vector<size_t> bytes;
  bytes.reserve(groups.size());
  for (const auto& g : groups) {
    size_t b = 0;
    for (const auto& r : g) b += r.size;
    bytes.push_back(b);
  }
  for_each_by_bytes(bytes, threads, [&](size_t i) {
    const auto& g = groups[i];
    for (const auto& r : g) {  // every check before any copy: the group is all or nothing
      if (r.check && path.hash(r.dst, r.size) != r.want) return;
    }
    out[i].values.reserve(g.size());
    for (const auto& r : g) out[i].values.push_back(path.copy(r.dst, r.src, r.size));
    out[i].copied = true;
  });
  return out;
}

}  // namespace tierlift
