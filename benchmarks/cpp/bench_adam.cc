// Microbenchmark of the fused CPU Adam step per SIMD path, single thread and pooled.
// Reports bytes/s with 28 bytes moved per fp32 element (read p, g, m, v; write p, m, v).
#include <benchmark/benchmark.h>

#include <vector>

#include "core/optim/adam.h"

namespace tierlift {
namespace {

void BM_AdamRange(benchmark::State& state) {
  const auto level = static_cast<SimdLevel>(state.range(0));
  const int64_t n = state.range(1);
  if (cpu_simd_level() < level) {
    state.SkipWithError("CPU lacks this SIMD level");
    return;
  }
  std::vector<float> p(n, 1.f), g(n, 0.01f), m(n, 0.f), v(n, 0.f);
  AdamTensor t;
  t.param = p.data();
  t.grad = g.data();
  t.exp_avg = m.data();
  t.exp_avg_sq = v.data();
  t.numel = n;
  const AdamScalars s = adam_scalars(AdamHyper{});
  for (auto _ : state) adam_step_range(level, s, t, 0, n);
  state.SetBytesProcessed(state.iterations() * n * 28);
  state.SetLabel(simd_level_name(level));
}
BENCHMARK(BM_AdamRange)->ArgsProduct({{0, 1, 2}, {1 << 16, 1 << 22}});

void BM_AdamPooled(benchmark::State& state) {
  const int64_t n = state.range(0);
  std::vector<float> p(n, 1.f), g(n, 0.01f), m(n, 0.f), v(n, 0.f);
  AdamTensor t;
  t.param = p.data();
  t.grad = g.data();
  t.exp_avg = m.data();
  t.exp_avg_sq = v.data();
  t.numel = n;
  AdamHyper h;
  for (auto _ : state) adam_step(h, &t, 1);
  state.SetBytesProcessed(state.iterations() * n * 28);
}
BENCHMARK(BM_AdamPooled)->Arg(1 << 24)->UseRealTime();

}  // namespace
}  // namespace tierlift
