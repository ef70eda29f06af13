// Zero-copy row gather on the GPU, torch-free: out[i, :] = row index[i] of a table that lives
// in pinned, mapped host memory (read over PCIe/NVLink-C2C by the kernel itself, no staging
// copy), or of a GPU cache table when the row is hot.
//
// Shape (after EMOGI/PyTorch-Direct and WholeGraph): a group of 1-8 warps copies one row; lanes
// move the widest unit (16/8/4/2/1 bytes) on which source and destination agree modulo the
// unit, and the lane numbering is anchored at the 128-byte line below the row's first aligned
// unit, so every warp-wide load after the first is a whole, aligned 128-byte PCIe request.
// Offsets are 64-bit. Each index is bounds-checked on the device: a bad one is never
// dereferenced (its output row is left unwritten). The smallest bad position is recorded in
// `first_bad` for the op to read back (one synchronisation), or, in the deferred mode, the
// (position, value) of one bad index goes into `bad_pair`, which the caller checks later: the
// first writer claims slot 0 with a compare-and-swap, so the pair stays consistent and later
// calls do not overwrite an unreported error.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tierlift {
namespace cuda {

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
};

cudaError_t gather_rows(const GatherArgs& args, cudaStream_t stream);

// Device pointer of pinned host memory (cudaHostAlloc'd or cudaHostRegister'd), or an error.
cudaError_t mapped_device_pointer(const void* host, void** device);

// Page-locks and maps [ptr, ptr + bytes); read_only for mappings the process cannot write
// (e.g. a read-only mmap of a feature file).
cudaError_t host_register(void* ptr, size_t bytes, bool read_only);
cudaError_t host_unregister(void* ptr);

}  // namespace cuda
}  // namespace tierlift
