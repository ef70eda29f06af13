// Zero-copy row gather on the GPU, torch-free: out[i, :] = row index[i] of a table that lives
// in pinned, mapped host memory (read over PCIe/NVLink-C2C by the kernel itself, no staging
// copy), or of a GPU cache table when the row is hot.
//
// Two kernels, chosen per launch (GatherKernel). The grouped one (rows up to 512 bytes) gives
// each row a group of lanes sized to it (16 bytes a lane: 4 lanes for a 64-byte row, so a warp
// moves 8 rows at once); a warp loads 32 indices in one coalesced load, each lane checks its
// own, and shuffles hand them to the groups; where every row is a whole number of 16-byte
// units on 16-byte-aligned bases, each thread issues the loads of up to 8 rows before their
// stores, so many more requests are in flight than with one row per warp. The warp-per-row one
// (every row above 512 bytes, and small rows on request, as tierlift had it) gives a row 1-8
// warps. Both move the widest unit (16/8/4/2/1 bytes) on which source and destination agree
// modulo the unit; where a group spans at least a 128-byte line per round, its lanes are
// anchored at the line below the row's first aligned unit, so every later load is a whole,
// aligned 128-byte PCIe request (after EMOGI/PyTorch-Direct and WholeGraph).
//
// `order` (optional, a permutation of [0, count)) sets the processing order: the k-th row read
// is index[k] and goes to output position order[k]. With index sorted and order its argsort,
// rows are fetched in address order (neighbouring requests share host pages) while every row
// still lands at its own position.
//
// Offsets are 64-bit. Each index is bounds-checked on the device: a bad one is never
// dereferenced (its output row is left unwritten). The smallest bad position is recorded in
// `first_bad` for the op to read back (one synchronisation), or, in the deferred mode, the
// (position, value) of one bad index goes into `bad_pair`, which the caller checks later: the
// first writer claims slot 0 with a compare-and-swap, so the pair stays consistent and later
// calls do not overwrite an unreported error. Positions are output positions in both modes,
// whatever the order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tierlift {
namespace cuda {

enum class GatherKernel : uint8_t {
  kAuto = 0,        // grouped where it applies (rows up to 512 bytes), else warp per row
  kWarpPerRow = 1,  // 1-8 warps per row, one row in flight per group
  kGrouped = 2,     // lanes sized to the row; rows above 512 bytes fall back to warp per row
};

struct GatherArgs {
  const void* table = nullptr;  // device-accessible pointer to the host table
  int64_t num_rows = 0;
  int64_t row_bytes = 0;
  const void* index = nullptr;  // device memory, int32 or int64
  bool index_is_int64 = true;
  int64_t count = 0;
  const void* cache_table = nullptr;    // device memory, cache_rows * row_bytes, or null
  const int32_t* cache_slot = nullptr;  // device memory, num_rows entries (-1: not cached)
  int64_t cache_rows = 0;
  void* out = nullptr;                      // device memory, count * row_bytes
  unsigned long long* first_bad = nullptr;  // device memory set to ~0ull, or null
  unsigned long long* bad_pair = nullptr;   // device memory [2]: {~0ull, any}, or null
  const int64_t* order = nullptr;           // device memory, count entries (a permutation), or null
  GatherKernel kernel = GatherKernel::kAuto;
};

// How gather_rows runs a launch (what the tests and the benchmark's labels rely on).
struct GatherPlan {
  bool grouped = false;  // the grouped kernel (else warp per row)
  int lanes = 0;         // threads per row
  bool aligned = false;  // grouped: whole 16-byte units on aligned bases, loads batched
};

GatherPlan plan_gather(const GatherArgs& args);

cudaError_t gather_rows(const GatherArgs& args, cudaStream_t stream);

// Device pointer of pinned host memory (cudaHostAlloc'd or cudaHostRegister'd), or an error.
cudaError_t mapped_device_pointer(const void* host, void** device);

// Page-locks and maps [ptr, ptr + bytes); read_only for mappings the process cannot write
// (e.g. a read-only mmap of a feature file).
cudaError_t host_register(void* ptr, size_t bytes, bool read_only);
cudaError_t host_unregister(void* ptr);

}  // namespace cuda
}  // namespace tierlift
