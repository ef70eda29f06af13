// CRC-32C (Castagnoli), the checksum the swap store keeps per block and verifies on every read.
// Large buffers are folded with AVX-512 VPCLMULQDQ where the CPU has it; else the SSE4.2 crc32
// instruction runs on three interleaved streams (about 3x one stream's rate); else a table.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tierlift::io {

// Extends `crc` (0 for a fresh checksum) over n bytes; crc32c("123456789") == 0xE3069283.
uint32_t crc32c(uint32_t crc, const void* data, size_t n);
uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n);  // table path, for tests
// The crc32-instruction path without the fold, for tests and benchmarks.
uint32_t crc32c_three_streams(uint32_t crc, const void* data, size_t n);
// One hardware dependency chain (the pre-3-stream path), for tests and benchmarks; the table
// path on CPUs without SSE4.2.
uint32_t crc32c_one_stream(uint32_t crc, const void* data, size_t n);

}  // namespace tierlift::io
