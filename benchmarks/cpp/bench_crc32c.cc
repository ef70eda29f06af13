// CRC-32C throughput per path: crc32c (the VPCLMULQDQ fold where the CPU has it), the 3-stream
// crc32-instruction path, the one-stream path and the byte table, from a buffer in cache (4 KiB,
// 1 MiB) and from memory (16 MiB).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "core/io/crc32c.h"

namespace tierlift::io {
namespace {

using CrcFn = uint32_t (*)(uint32_t, const void*, size_t);

void run(benchmark::State& state, CrcFn fn) {
  const auto n = static_cast<size_t>(state.range(0));
  std::vector<unsigned char> data(n);
  std::mt19937 rng(1);
  for (auto& b : data) b = static_cast<unsigned char>(rng());
  uint32_t c = 0;
  for (auto _ : state) {
    c = fn(c, data.data(), n);
    benchmark::DoNotOptimize(c);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n));
}

void BM_Crc32c(benchmark::State& s) { run(s, crc32c); }
void BM_Crc32cThreeStreams(benchmark::State& s) { run(s, crc32c_three_streams); }
void BM_Crc32cOneStream(benchmark::State& s) { run(s, crc32c_one_stream); }
void BM_Crc32cTable(benchmark::State& s) { run(s, crc32c_portable); }
BENCHMARK(BM_Crc32c)->Arg(4096)->Arg(1 << 20)->Arg(16 << 20);
BENCHMARK(BM_Crc32cThreeStreams)->Arg(4096)->Arg(1 << 20)->Arg(16 << 20);
BENCHMARK(BM_Crc32cOneStream)->Arg(4096)->Arg(1 << 20)->Arg(16 << 20);
BENCHMARK(BM_Crc32cTable)->Arg(1 << 20);

}  // namespace
}  // namespace tierlift::io
