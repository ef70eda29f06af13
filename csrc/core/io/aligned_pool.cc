// First-fit allocator over one aligned arena, with neighbour coalescing on release.
//
// The arena is its own mapping, starting on a 2 MiB boundary and advised MADV_HUGEPAGE: O_DIRECT
// requests from it then see physically contiguous 2 MiB pieces instead of scattered 4 KiB pages
// (measured on a virtio disk: 7.5 against 2.4 GB/s read into a 64 MB buffer). The mapping is
// exactly the budget long, so huge pages never take memory beyond it.
#include "core/io/aligned_pool.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>

namespace tierlift::io {

namespace {
constexpr size_t kHugePage = size_t{2} << 20;

// An anonymous mapping of n bytes starting on a kHugePage boundary (n a multiple of kAlign).
char* map_arena(size_t n) {
  const size_t span = n + kHugePage;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  const uintptr_t base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t start = round_up(base, kHugePage);
  if (start > base) munmap(raw, start - base);
  const uintptr_t end = start + n;
  if (base + span > end) munmap(reinterpret_cast<void*>(end), base + span - end);
  char* arena = reinterpret_cast<char*>(start);
#ifdef MADV_HUGEPAGE
  if (n >= kHugePage) madvise(arena, n, MADV_HUGEPAGE);  // advice only: no huge pages is fine
#endif
  return arena;
}
}  // namespace

AlignedPool::AlignedPool(size_t budget_bytes) : budget_(round_up(budget_bytes)) {
  if (budget_ == 0) throw std::invalid_argument("AlignedPool: budget_bytes must be > 0");
  arena_ = map_arena(budget_);
  free_[0] = budget_;
}

AlignedPool::~AlignedPool() { munmap(arena_, budget_); }

void* AlignedPool::take_locked(size_t n) {
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < n) continue;
    const size_t off = it->first, len = it->second;
    free_.erase(it);
    if (len > n) free_[off + n] = len - n;
    used_[off] = n;
    in_use_ += n;
    return arena_ + off;
  }
  return nullptr;
}

void* AlignedPool::try_acquire(size_t n) {
  if (n == 0) throw std::invalid_argument("AlignedPool: cannot acquire 0 bytes");
  n = round_up(n);
  if (n > budget_) {
    throw std::invalid_argument("AlignedPool: request of " + std::to_string(n) +
                                " bytes exceeds the pool budget of " + std::to_string(budget_));
  }
  std::lock_guard<std::mutex> lock(mu_);
  return take_locked(n);
}

void* AlignedPool::acquire(size_t n) {
  if (void* p = try_acquire(n)) return p;
  n = round_up(n);
  std::unique_lock<std::mutex> lock(mu_);
  void* p = nullptr;
  cv_.wait(lock, [&] { return (p = take_locked(n)) != nullptr; });
  return p;
}

void AlignedPool::release(void* p) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  const size_t off = static_cast<size_t>(static_cast<char*>(p) - arena_);
  auto u = used_.find(off);
  if (u == used_.end()) throw std::invalid_argument("AlignedPool: release of a foreign pointer");
  size_t len = u->second;
  used_.erase(u);
  in_use_ -= len;
  size_t start = off;
  auto next = free_.lower_bound(off);
  if (next != free_.end() && next->first == off + len) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      len += prev->second;
      free_.erase(prev);
    }
  }
  free_[start] = len;
  cv_.notify_all();
}

size_t AlignedPool::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

bool AlignedPool::contains(const void* p, size_t n) const {
  const char* c = static_cast<const char*>(p);
  return c >= arena_ && c + n <= arena_ + budget_;
}

}  // namespace tierlift::io
