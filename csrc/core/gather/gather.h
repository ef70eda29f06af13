// Multithreaded, bounds-checked CPU row gather: out[i, :] = table[index[i], :] for a row-major
// table of `num_rows` rows of `row_bytes` bytes each. Torch-free; the torch op and the CUDA
// path's host-side validation both call it.
//
// Rows are copied whole with memcpy (any row size, 64-bit offsets), the index is split into
// contiguous ranges over ThreadPool::global(), and each worker prefetches a few rows ahead
// because the reads are random and the table is usually far larger than the caches. Every index
// is checked before its row is read: a negative or out-of-range index is never dereferenced; the
// call reports the first bad position (rows for good positions are still copied).
#pragma once

#include <cstdint>

namespace tierlift {

enum class IndexType : uint8_t { kInt32 = 0, kInt64 = 1 };

// No bad index: gather_rows / find_bad_index return this.
constexpr int64_t kNoBadIndex = -1;

struct GatherTable {
  const void* data = nullptr;  // num_rows * row_bytes readable bytes
  int64_t num_rows = 0;
  int64_t row_bytes = 0;
};

struct GatherIndex {
  const void* data = nullptr;  // count int32 or int64 values
  IndexType type = IndexType::kInt64;
  int64_t count = 0;
};

// Reads index value i (no bounds check on i itself; callers pass i < count).
int64_t index_value(const GatherIndex& index, int64_t i);

// Position of the first index value outside [0, num_rows), or kNoBadIndex. Multithreaded.
int64_t find_bad_index(const GatherIndex& index, int64_t num_rows);

// Copies table rows index[0..count) into `out` (count * row_bytes bytes, must not overlap the
// table). Returns kNoBadIndex, or the first bad position (its output row is left untouched).
// In a process forked from one whose thread pool was running, it runs on the calling thread
// (the pool's workers do not survive fork()).
int64_t gather_rows(const GatherTable& table, const GatherIndex& index, void* out);

// True in a child created by fork() after this library was loaded.
bool in_forked_child();

}  // namespace tierlift
