// CRC-32C throughput per path: the 3-stream hardware path (crc32c), the one-stream hardware
// path it replaced (crc32c_one_stream) and the byte table, on one chunk of a swap file's size.
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

void BM_Crc32cThreeStreams(benchmark::State& s) { run(s, crc32c); }
void BM_Crc32cOneStream(benchmark::State& s) { run(s, crc32c_one_stream); }
void BM_Crc32cTable(benchmark::State& s) { run(s, crc32c_portable); }
BENCHMARK(BM_Crc32cThreeStreams)->Arg(4096)->Arg(1 << 20)->Arg(16 << 20);
BENCHMARK(BM_Crc32cOneStream)->Arg(4096)->Arg(1 << 20)->Arg(16 << 20);
BENCHMARK(BM_Crc32cTable)->Arg(1 << 20);

}  // namespace
}  // namespace tierlift::io
