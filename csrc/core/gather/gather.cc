#include "core/gather/gather.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "core/util/thread_pool.h"

namespace tierlift {
namespace {

std::atomic<bool> g_forked_child{false};

// Registered at load time, so it runs in every child forked afterwards.
const bool g_atfork_registered = [] {
  pthread_atfork(nullptr, nullptr, [] { g_forked_child.store(true); });
  return true;
}();

constexpr int64_t kPrefetchDistance = 8;  // rows ahead; random rows miss every cache level

// Smallest bad position seen by any worker (positions, not values, so "first" is well defined).
void record_bad(std::atomic<int64_t>& first_bad, int64_t pos) {
  int64_t cur = first_bad.load(std::memory_order_relaxed);
  while ((cur == kNoBadIndex || pos < cur) &&
         !first_bad.compare_exchange_weak(cur, pos, std::memory_order_relaxed)) {
  }
}

// Rows per task: enough bytes per task that the pool's hand-off cost is amortised.
int64_t grain_for(int64_t row_bytes) {
  const int64_t target_bytes = 64 * 1024;
  return std::max<int64_t>(16, target_bytes / std::max<int64_t>(row_bytes, 1));
}

// The pool runs serially by itself in a forked child (see thread_pool.h).
void run_parallel(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  ThreadPool::global().parallel_for(n, grain, fn);
}

template <typename Idx, int64_t kFixedBytes>
void gather_range(const char* table, int64_t num_rows, int64_t row_bytes, const Idx* index,
                  int64_t begin, int64_t end, char* out, std::atomic<int64_t>& first_bad) {
  const int64_t bytes = kFixedBytes > 0 ? kFixedBytes : row_bytes;
  for (int64_t i = begin; i < end; ++i) {
    if (i + kPrefetchDistance < end) {
      const int64_t ahead = static_cast<int64_t>(index[i + kPrefetchDistance]);
      if (ahead >= 0 && ahead < num_rows) __builtin_prefetch(table + ahead * bytes);
    }
    const int64_t row = static_cast<int64_t>(index[i]);
    if (row < 0 || row >= num_rows) {
      record_bad(first_bad, i);
      continue;
    }
    // A constant size lets the compiler inline the copy as a few vector moves.
    std::memcpy(out + i * bytes, table + row * bytes, static_cast<size_t>(bytes));
  }
}

template <typename Idx>
void gather_typed(const GatherTable& t, const Idx* index, int64_t count, char* out,
                  std::atomic<int64_t>& first_bad) {
  const char* table = static_cast<const char*>(t.data);
  const int64_t rb = t.row_bytes;
  run_parallel(count, grain_for(rb), [&](int64_t b, int64_t e) {
    switch (rb) {
      case 4:
        return gather_range<Idx, 4>(table, t.num_rows, rb, index, b, e, out, first_bad);
      case 8:
        return gather_range<Idx, 8>(table, t.num_rows, rb, index, b, e, out, first_bad);
      case 16:
        return gather_range<Idx, 16>(table, t.num_rows, rb, index, b, e, out, first_bad);
      case 32:
        return gather_range<Idx, 32>(table, t.num_rows, rb, index, b, e, out, first_bad);
      case 64:
        return gather_range<Idx, 64>(table, t.num_rows, rb, index, b, e, out, first_bad);
      case 128:
        return gather_range<Idx, 128>(table, t.num_rows, rb, index, b, e, out, first_bad);
      default:
        return gather_range<Idx, 0>(table, t.num_rows, rb, index, b, e, out, first_bad);
    }
  });
}

template <typename Idx>
int64_t find_bad_typed(const Idx* index, int64_t count, int64_t num_rows) {
  std::atomic<int64_t> first_bad{kNoBadIndex};
  run_parallel(count, 1 << 14, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t v = static_cast<int64_t>(index[i]);
      if (v < 0 || v >= num_rows) {
        record_bad(first_bad, i);
        return;  // later positions in this range cannot be smaller
      }
    }
  });
  return first_bad.load();
}

}  // namespace

bool in_forked_child() { return g_atfork_registered && g_forked_child.load(); }

int64_t index_value(const GatherIndex& index, int64_t i) {
  return index.type == IndexType::kInt32 ? static_cast<const int32_t*>(index.data)[i]
                                         : static_cast<const int64_t*>(index.data)[i];
}

int64_t find_bad_index(const GatherIndex& index, int64_t num_rows) {
  if (index.count <= 0) return kNoBadIndex;
  return index.type == IndexType::kInt32
             ? find_bad_typed(static_cast<const int32_t*>(index.data), index.count, num_rows)
             : find_bad_typed(static_cast<const int64_t*>(index.data), index.count, num_rows);
}

int64_t gather_rows(const GatherTable& table, const GatherIndex& index, void* out) {
  if (index.count <= 0) return kNoBadIndex;
  std::atomic<int64_t> first_bad{kNoBadIndex};
  char* dst = static_cast<char*>(out);
  if (table.row_bytes <= 0) return find_bad_index(index, table.num_rows);
  if (index.type == IndexType::kInt32) {
    gather_typed(table, static_cast<const int32_t*>(index.data), index.count, dst, first_bad);
  } else {
    gather_typed(table, static_cast<const int64_t*>(index.data), index.count, dst, first_bad);
  }
  return first_bad.load();
}

}  // namespace tierlift
