// A pool of 4 KiB-aligned buffers carved from one arena allocated up front, so the total never
// exceeds an explicit byte budget (unbudgeted swap buffers take down machines with little RAM).
// One arena also lets io_uring register it once as a fixed buffer.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

namespace tierlift::io {

constexpr size_t kAlign = 4096;
inline size_t round_up(size_t n, size_t a = kAlign) { return (n + a - 1) / a * a; }
inline bool is_aligned(uint64_t v, size_t a = kAlign) { return v % a == 0; }

class AlignedPool {
 public:
  explicit AlignedPool(size_t budget_bytes);  // rounds the budget up to 4 KiB
  ~AlignedPool();
  AlignedPool(const AlignedPool&) = delete;
  AlignedPool& operator=(const AlignedPool&) = delete;

  // A buffer of round_up(n) bytes, or nullptr when that much is not free now.
  // Throws std::invalid_argument when n is 0 or larger than the whole budget.
  void* try_acquire(size_t n);
  // Like try_acquire but waits until enough is released.
  void* acquire(size_t n);
  void release(void* p);

  void* arena() const { return arena_; }
  size_t budget() const { return budget_; }
  size_t in_use() const;
  bool contains(const void* p, size_t n) const;

 private:
  void* take_locked(size_t n);

  size_t budget_;
  char* arena_ = nullptr;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<size_t, size_t> free_;  // offset -> length, coalesced
  std::map<size_t, size_t> used_;  // offset -> length
  size_t in_use_ = 0;
};

}  // namespace tierlift::io
