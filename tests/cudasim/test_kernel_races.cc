// Race tests of every kernel in csrc/cuda that uses an atomic, a barrier, shared memory or a warp
// collective, on shapes small enough for ThreadSanitizer: CI's race run (scripts/tsan_races.sh)
// runs this suite and the simulator's own tests in the TSan build, and every other build runs it
// with the rest. Each test launches its kernels with several blocks contending on every atomic
// (the inputs' magnitudes rise with the position, so most blocks raise an amax other blocks have
// raised) and 8 or 16 warps across every barrier, on 4 OS threads, and compares every output bit
// with core. A plain store where an atomic belongs, or a barrier missing between two uses of a
// shared slot, is a TSan report here even where the simulator's bits stay right
// (docs/cudasim.md).
//
// Each test names the kernels it launches (kernels(...), also a gtest property), and
// tests/python/test_cudasim_races.py checks that every kernel of csrc/cuda with an atomic, a
// barrier, shared memory or a warp collective is named here and that the race run selects this
// suite.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/gather/gather.h"
#include "core/lowp/fp4.h"
#include "core/lowp/fp4_quant.h"
#include "core/lowp/quantize.h"
#include "core/optim/adam.h"
#include "core/optim/adam_compact.h"
#include "core/util/dtype.h"
#include "core/util/fingerprint.h"
#include "cuda/adam.cuh"
#include "cuda/adam_compact.cuh"
#include "cuda/fingerprint.cuh"
#include "cuda/fp4_quant.cuh"
#include "cuda/fp8_quant.cuh"
#include "cuda/gather.cuh"
#include "cuda/multi_tensor.cuh"
#include "cudasim/launch.h"
#include "tests/cudasim/lowp_input.h"

namespace tierlift {
namespace {

using cudasim_test::kNaN;
using cudasim_test::Layout;
using cudasim_test::same_bits;
using cudasim_test::StridedInput;

// Blocks run on 4 OS threads whatever the core count, so up to 4 are unordered at a time.
class KernelRaces : public ::testing::Test {
 protected:
  void SetUp() override { cudasim::set_threads(4); }
  void TearDown() override { cudasim::set_threads(0); }
  // The kernels the test launches (test_cudasim_races.py reads these names).
  static void kernels(const char* names) { RecordProperty("kernels", names); }
};

// The launches `body` makes.
template <typename Body>
uint64_t launches_of(Body&& body) {
  const uint64_t before = cudasim::launch_count();
  body();
  return cudasim::launch_count() - before;
}

// n normal values times 1 + k / 64 at position k: the amax of a later block of consecutive
// elements (or tile) is mostly above that of every earlier one, so most blocks' atomics raise it.
std::vector<float> rising(int64_t n, uint32_t seed) {
  std::vector<float> x = cudasim_test::normal_values(n, seed);
  for (int64_t k = 0; k < n; ++k) x[k] *= 1.f + static_cast<float>(k) / 64.f;
  return x;
}

// NaN, +Inf and -Inf in a few places of x: the FP8 casts encode their groups again exactly.
std::vector<float> with_non_finite(std::vector<float> x) {
  const float special[] = {kNaN, cudasim_test::kInf, -cudasim_test::kInf};
  for (size_t k = 5; k < x.size(); k += 997) x[k] = special[k % 3];
  return x;
}

// fp8_quantize of a rising fp32 input (with NaN and Inf where non_finite) against core (codes
// and scales; x^T's too when dual); `launches` kernel launches expected.
void check_fp8(int64_t rows, int64_t cols, Fp8Scaling scaling, Layout layout, bool dual,
               uint64_t launches, bool non_finite = false) {
  SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) + " scaling " +
               std::to_string(static_cast<int>(scaling)) + " " + cudasim_test::layout_name(layout) +
               (dual ? " dual" : "") + (non_finite ? " non-finite" : ""));
  std::vector<float> values = rising(rows * cols, 11);
  if (non_finite) values = with_non_finite(values);
  const StridedInput in(values, rows, cols, DType::kFloat32, layout);
  const Fp8Input& x = in.view();
  const Fp8Blocks b = fp8_blocks(scaling, rows, cols);
  const Fp8Blocks bt = fp8_blocks(scaling, cols, rows);
  const size_t n = static_cast<size_t>(rows * cols);
  const size_t ns = static_cast<size_t>(b.grid_rows * b.grid_cols);
  const size_t nst = dual ? static_cast<size_t>(bt.grid_rows * bt.grid_cols) : 0;
  const Fp8Format fmt = Fp8Format::kE4M3;
  std::vector<uint8_t> want_q(n), want_qt(dual ? n : 0);
  std::vector<float> want_s(ns), want_st(nst);
  if (dual) {
    fp8_quantize_dual(x, scaling, fmt, false, want_q.data(), want_s.data(), want_qt.data(),
                      want_st.data());
  } else {
    fp8_quantize(x, scaling, fmt, false, want_q.data(), want_s.data());
  }
  std::vector<uint8_t> q(n, 0xaa), qt(dual ? n : 0, 0xaa);
  std::vector<float> s(ns, kNaN), st(nst, kNaN);
  cuda::Fp8QuantArgs a;
  cudasim_test::set_input(a, x);
  a.scaling = scaling;
  a.fmt = fmt;
  a.q = q.data();
  a.scales = s.data();
  if (dual) {
    a.qt = qt.data();
    a.scales_t = st.data();
  }
  EXPECT_EQ(launches_of([&] {
              ASSERT_EQ(cuda::fp8_quantize(a, nullptr), cudaSuccess)
                  << cudasim::last_error_message();
            }),
            launches);
  EXPECT_TRUE(same_bits("scales", s, want_s, b.grid_cols));
  EXPECT_TRUE(same_bits("q", q, want_q, cols));
  if (dual) {
    EXPECT_TRUE(same_bits("scales_t", st, want_st, bt.grid_cols));
    EXPECT_TRUE(same_bits("qt", qt, want_qt, rows));
  }
}

// Tensor scaling. Contiguous: the flat reduction, 8 blocks raising both amaxes (x's and x^T's),
// one amax-to-scale launch per grid, the cast over 4 tiles. Transposed: the tiled amax, 2
// blocks of 4 tiles each (span) raising one slot per grid, with the barrier between the two
// grids' merges; the cast over 5 tiles.
TEST_F(KernelRaces, Fp8TensorAmaxFlatAndTiled) {
  kernels("amax_flat_kernel amax_tiles_kernel amax_to_scale_kernel cast_tiles_kernel");
  check_fp8(64, 256, Fp8Scaling::kTensor, Layout::kContiguous, true, 4);
  check_fp8(320, 64, Fp8Scaling::kTensor, Layout::kTransposed, true, 4);
}

// 128x128 blocks (2 tiles of a row of tiles raise each slot; x^T's grid merged after x's),
// row and column amaxes of the dual output (one tile per block: the column tiles raise each
// row's slot, the row tiles each column's), columns over 320 rows (2 blocks of 4 tiles raise
// each column's slot) and one element per block (column scaling of a single row, reduced per
// column).
TEST_F(KernelRaces, Fp8BlockRowColumnAndElementAmaxTiles) {
  kernels("amax_tiles_kernel amax_to_scale_kernel cast_tiles_kernel");
  check_fp8(128, 256, Fp8Scaling::kBlock128x128, Layout::kContiguous, true, 4);
  check_fp8(128, 128, Fp8Scaling::kRow, Layout::kContiguous, true, 4);
  check_fp8(320, 64, Fp8Scaling::kCol, Layout::kContiguous, false, 3);
  check_fp8(1, 40, Fp8Scaling::kCol, Layout::kContiguous, false, 3);
}

// The fused kernels: row scaling (a block of 1 to 16 warps per row meeting at a barrier over the
// shared warp maxima, again over a second set when the row holds an Inf; rows in registers and
// past them) and 1x128 blocks (shuffles over 4 lanes, or 32 for a misaligned input).
TEST_F(KernelRaces, Fp8FusedRowAndBlock1x128) {
  kernels("row_kernel block1x128_kernel block1x128_any_kernel");
  check_fp8(3, 600, Fp8Scaling::kRow, Layout::kContiguous, false, 1);
  check_fp8(3, 2100, Fp8Scaling::kRow, Layout::kContiguous, false, 1, true);
  check_fp8(2, 16400, Fp8Scaling::kRow, Layout::kContiguous, false, 1, true);
  check_fp8(32, 256, Fp8Scaling::kBlock1x128, Layout::kContiguous, false, 1);
  check_fp8(5, 300, Fp8Scaling::kBlock1x128, Layout::kOffset1, false, 1);
}

// fp8_quantize_delayed of a rising fp32 input (with NaN and Inf where non_finite) against core,
// with a scale that fits (the cast's blocks raise the amax) and one that clips (the guarded
// recast runs every block); with a history, fp8_quantize_from_history of that history instead.
void check_fp8_delayed(int64_t rows, int64_t cols, Layout layout, bool dual,
                       const std::vector<float>& history = {}, bool non_finite = false) {
  std::vector<float> values = rising(rows * cols, 13);
  if (non_finite) values = with_non_finite(values);
  const StridedInput in(values, rows, cols, DType::kFloat32, layout);
  const Fp8Input& x = in.view();
  const size_t n = static_cast<size_t>(rows * cols);
  std::vector<uint8_t> want_q(n), want_qt(dual ? n : 0);
  uint8_t* want_qt_or_null = dual ? want_qt.data() : nullptr;
  float own = 0.f;
  fp8_quantize(x, Fp8Scaling::kTensor, Fp8Format::kE4M3, false, want_q.data(), &own);
  const bool from_history = !history.empty();
  for (float scale :
       from_history ? std::vector<float>{0.f} : std::vector<float>{own / 2, own * 4}) {
    SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) + " " +
                 cudasim_test::layout_name(layout) + (dual ? " dual" : "") +
                 (from_history ? " history" : " scale=" + std::to_string(scale)));
    const int64_t len = static_cast<int64_t>(history.size());
    const Fp8DelayedResult want =
        from_history ? fp8_quantize_from_history(x, history.data(), len, 1, Fp8Format::kE4M3, false,
                                                 want_q.data(), want_qt_or_null)
                     : fp8_quantize_delayed(x, scale, Fp8Format::kE4M3, false, want_q.data(),
                                            want_qt_or_null);
    std::vector<uint8_t> q(n, 0xaa), qt(dual ? n : 0, 0xaa);
    std::vector<float> given = {scale}, used = {kNaN}, returned = {kNaN}, amax = {kNaN};
    cuda::Fp8HistoryArgs h;
    cuda::Fp8DelayedArgs& a = h.delayed;
    cudasim_test::set_input(a, x);
    a.scale = given.data();
    a.q = q.data();
    if (dual) a.qt = qt.data();
    a.scale_used = used.data();
    a.amax = amax.data();
    h.history = history.data();
    h.history_len = len;
    h.given = given.data();
    h.scale = returned.data();
    ASSERT_EQ(from_history ? cuda::fp8_quantize_from_history(h, nullptr)
                           : cuda::fp8_quantize_delayed(a, nullptr),
              cudaSuccess)
        << cudasim::last_error_message();
    if (from_history) {
      EXPECT_NE(f32_bits(used[0]), f32_bits(given[0]));  // the history's scale clips: a recast
    }
    EXPECT_TRUE(
        same_bits("scale", from_history ? returned : used, std::vector<float>{want.scale_used}, 1));
    EXPECT_TRUE(same_bits("amax", amax, std::vector<float>{want.amax}, 1));
    EXPECT_TRUE(same_bits("q", q, want_q, cols));
    if (dual) {
      EXPECT_TRUE(same_bits("qt", qt, want_qt, rows));
    }
  }
}

// Delayed tensor scaling. Contiguous single output: the flat cast, 8 blocks raising the amax
// after the barrier over their warp maxima. Dual: the tiled cast, 12 tiles raising it; then the
// one-thread decision and the recast, whose blocks all read the decided scale.
TEST_F(KernelRaces, Fp8DelayedFlatAndTiled) {
  kernels("cast_flat_kernel cast_tiles_kernel delayed_scale_kernel");
  check_fp8_delayed(64, 256, Layout::kContiguous, false);
  check_fp8_delayed(130, 200, Layout::kContiguous, true);
}

// NaN and Inf in x: the tiled cast's groups holding them are encoded again from shared memory
// (q and q^T), the flat cast's vectors loaded again and their codes stored a second time by the
// same thread.
TEST_F(KernelRaces, Fp8NonFiniteGroupsEncodedAgain) {
  kernels("amax_tiles_kernel cast_tiles_kernel cast_flat_kernel");
  check_fp8(130, 200, Fp8Scaling::kCol, Layout::kContiguous, true, 4, true);
  check_fp8_delayed(64, 256, Layout::kContiguous, false, {}, true);
}

// fp8_quantize_from_history: the one-warp history kernel (each lane takes several of 100
// entries, then a shuffle max and a vote over NaN) writes the scale the cast's blocks read; the
// history's scale clips the rising input, so the recast's blocks run too.
TEST_F(KernelRaces, Fp8FromHistory) {
  kernels("history_scale_kernel cast_flat_kernel cast_tiles_kernel delayed_scale_kernel");
  std::vector<float> history(100, 1e-3f);
  history[57] = 0.01f;
  check_fp8_delayed(130, 200, Layout::kContiguous, false, history);
  check_fp8_delayed(130, 200, Layout::kContiguous, true, history);
}

// fp4_quantize of a rising fp32 input against core (codes, scales, tensor scale, clip mask).
void check_fp4(int64_t rows, int64_t cols, fp4::ScaleRule rule, int hadamard, bool stochastic,
               bool block_2d) {
  SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols) + " rule " +
               std::to_string(static_cast<int>(rule)) + " h=" + std::to_string(hadamard) +
               (stochastic ? " sr" : "") + (block_2d ? " 16x16" : ""));
  const StridedInput in(rising(rows * cols, 5), rows, cols, DType::kFloat32, Layout::kContiguous);
  const Fp8Input& x = in.view();
  Fp4Config cfg;
  cfg.rule = rule;
  cfg.hadamard = hadamard;
  cfg.signs = hadamard ? 0x8421u : 0;
  cfg.stochastic = stochastic;
  cfg.seed = 42;
  cfg.offset = 3;
  cfg.block_2d = block_2d;
  ASSERT_NO_THROW(fp4_validate(x, cfg));
  int64_t grows = 0, gcols = 0;
  fp4_scale_shape(cfg, rows, cols, &grows, &gcols);
  const size_t n = static_cast<size_t>(rows * cols), ns = static_cast<size_t>(grows * gcols);
  const bool nv = rule == fp4::ScaleRule::kNv;
  std::vector<uint8_t> want_codes(n / 2), want_scales(ns), want_mask(n);
  std::vector<float> want_ts(1);
  fp4_quantize(x, cfg, {want_codes.data(), want_scales.data(), want_ts.data(), want_mask.data()});

  std::vector<uint8_t> codes(n / 2, 0xaa), scales(ns, 0xaa), mask(n, 0xaa);
  std::vector<float> ts(1, nv ? kNaN : 1.f),
      workspace(nv ? cuda::nv_workspace_floats(rows, cols) : 0, kNaN);
  cuda::Fp4QuantArgs a;
  cudasim_test::set_input(a, x);
  a.rule = rule;
  a.hadamard = hadamard;
  a.signs = cfg.signs;
  a.stochastic = stochastic;
  a.seed = cfg.seed;
  a.offset = cfg.offset;
  a.block_2d = block_2d;
  a.codes = codes.data();
  a.scales = scales.data();
  a.tensor_scale = ts.data();
  a.mask = mask.data();
  a.workspace = nv ? workspace.data() : nullptr;
  EXPECT_EQ(launches_of([&] {
              ASSERT_EQ(cuda::fp4_quantize(a, nullptr), cudaSuccess)
                  << cudasim::last_error_message();
            }),
            nv ? 2u : 1u);
  EXPECT_TRUE(same_bits("scales", scales, want_scales, gcols));
  EXPECT_TRUE(same_bits("tensor_scale", ts, want_ts, 1));
  EXPECT_TRUE(same_bits("codes", codes, want_codes, cols / 2));
  EXPECT_TRUE(same_bits("mask", mask, want_mask, cols));
}

// NVFP4: pass 1's per-block warp maxima meet in shared memory across a barrier, and 4 blocks
// raise the tensor amax; pass 2 reads it. 1-D blocks with the Hadamard rotation's cross-lane
// butterflies, and 16x16 blocks with stochastic rounding.
TEST_F(KernelRaces, Fp4NvTensorAmaxAcrossBlocks) {
  kernels("nv_amax_kernel nv_encode_kernel");
  check_fp4(32, 256, fp4::ScaleRule::kNv, 16, false, false);
  check_fp4(32, 256, fp4::ScaleRule::kNv, 0, true, true);
}

// MXFP4: one kernel of warp collectives only (Hadamard butterflies, block max, QuEST's sum of
// squares across lanes, the NaN/Inf ballot, whole warps leaving together); 2 blocks each.
TEST_F(KernelRaces, Fp4MxWarpCollectives) {
  kernels("mx_kernel");
  check_fp4(16, 256, fp4::ScaleRule::kQuest, 32, false, false);
  check_fp4(16, 256, fp4::ScaleRule::kFloor, 0, true, false);
}

AdamScalars adam_scalars_at(int64_t step) {
  AdamHyper h;
  h.lr = 1e-2;
  h.weight_decay = 0.1;
  h.step = step;
  return adam_scalars(h);
}

template <typename T>
int differences(const std::vector<T>& a, const std::vector<T>& b) {
  int n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
  return n;
}

// The fp32-state Adam step over several tensors: a chunk of 2^16 elements per block, blocks
// unordered with each other, packs split after 2 blocks (3 launches; a tensor continued from
// the last launch). No atomics or barriers: two blocks writing the same element (a packing or
// chunk error) is the race this looks for. Against core's scalar step.
TEST_F(KernelRaces, AdamMultiTensorChunksAndPacks) {
  kernels("adam_kernel");
  const int64_t sizes[] = {1000, 1, (int64_t{1} << 16) + 300, 77};
  constexpr int kCount = 4;
  struct State {
    std::vector<float> param, grad, m, v;
    std::vector<uint16_t> copy;
  };
  std::vector<State> sim(kCount), ref(kCount);
  std::vector<cuda::AdamTensorPtrs> p;
  const AdamScalars s = adam_scalars_at(1);
  for (int k = 0; k < kCount; ++k) {
    const int64_t n = sizes[k];
    State& st = sim[k];
    st.param = cudasim_test::normal_values(n, 30 + k);
    st.grad = cudasim_test::normal_values(n, 40 + k);
    st.m.assign(n, 0.f);
    st.v.assign(n, 0.f);
    st.copy.assign(n, 0);
    ref[k] = st;
    p.push_back(
        {st.param.data(), st.grad.data(), st.m.data(), st.v.data(), nullptr, st.copy.data(), n});
    AdamTensor t;
    t.param = ref[k].param.data();
    t.grad = ref[k].grad.data();
    t.exp_avg = ref[k].m.data();
    t.exp_avg_sq = ref[k].v.data();
    t.param_copy = ref[k].copy.data();
    t.copy_type = DType::kBFloat16;
    t.numel = n;
    adam_range_scalar(s, t, 0, n);
  }
  struct BlockLimit {
    int64_t saved = cuda::pack_block_limit();
    BlockLimit() { cuda::pack_block_limit() = 2; }
    ~BlockLimit() { cuda::pack_block_limit() = saved; }
  } limit;
  EXPECT_EQ(launches_of([&] {
              ASSERT_EQ(
                  cuda::adam_step(p.data(), kCount, DType::kFloat32, DType::kBFloat16, s, nullptr),
                  cudaSuccess)
                  << cudasim::last_error_message();
            }),
            3u);
  for (int k = 0; k < kCount; ++k) {
    SCOPED_TRACE("tensor " + std::to_string(k));
    EXPECT_EQ(differences(sim[k].param, ref[k].param), 0);
    EXPECT_EQ(differences(sim[k].m, ref[k].m), 0);
    EXPECT_EQ(differences(sim[k].v, ref[k].v), 0);
    EXPECT_EQ(differences(sim[k].copy, ref[k].copy), 0);
  }
}

// The compact Adam step: 3 blocks, the first with 10 code blocks, so its 8 warps each reduce a
// code block's max with shuffles and a vote, read its old scale on every lane before lane 0
// overwrites it, and warps 0 and 1 loop to a second code block (warp 1's partial, on the scalar
// layout). Two steps (the second decodes the first's v codes), against core's scalar step.
TEST_F(KernelRaces, AdamCompactCodeBlocksAcrossWarps) {
  kernels("adam_compact_kernel");
  const int64_t sizes[] = {9 * kCompactBlock + 17, kCompactBlock, 100};
  constexpr int kCount = 3;
  struct State {
    std::vector<float> param, grad, scales;
    std::vector<uint16_t> m, copy;
    std::vector<uint8_t> codes;
  };
  std::vector<State> sim(kCount), ref(kCount);
  for (int k = 0; k < kCount; ++k) {
    const int64_t n = sizes[k];
    State& st = sim[k];
    st.param = cudasim_test::normal_values(n, 50 + k);
    st.grad = rising(n, 60 + k);
    st.scales.assign(compact_scale_count(n), 0.f);
    st.m.assign(n, 0);
    st.copy.assign(n, 0);
    st.codes.assign(n, 0);
    ref[k] = st;
  }
  for (int64_t step = 1; step <= 2; ++step) {
    const AdamScalars s = adam_scalars_at(step);
    std::vector<cuda::CompactAdamTensorPtrs> p;
    for (int k = 0; k < kCount; ++k) {
      State& st = sim[k];
      p.push_back({st.param.data(), st.grad.data(), st.m.data(), st.codes.data(), st.scales.data(),
                   st.copy.data(), sizes[k]});
      CompactAdamTensor t;
      t.param = ref[k].param.data();
      t.grad = ref[k].grad.data();
      t.exp_avg = ref[k].m.data();
      t.exp_avg_sq = ref[k].codes.data();
      t.exp_avg_sq_scale = ref[k].scales.data();
      t.param_copy = ref[k].copy.data();
      t.copy_type = DType::kBFloat16;
      t.numel = sizes[k];
      adam_compact_range_scalar(s, t, 0, sizes[k]);
    }
    EXPECT_EQ(launches_of([&] {
                ASSERT_EQ(cuda::adam_compact_step(p.data(), kCount, DType::kFloat32,
                                                  DType::kBFloat16, s, nullptr),
                          cudaSuccess)
                    << cudasim::last_error_message();
              }),
              1u);
    for (int k = 0; k < kCount; ++k) {
      SCOPED_TRACE("step " + std::to_string(step) + " tensor " + std::to_string(k));
      EXPECT_EQ(differences(sim[k].param, ref[k].param), 0);
      EXPECT_EQ(differences(sim[k].m, ref[k].m), 0);
      EXPECT_EQ(differences(sim[k].codes, ref[k].codes), 0);
      EXPECT_EQ(differences(sim[k].scales, ref[k].scales), 0);
      EXPECT_EQ(differences(sim[k].copy, ref[k].copy), 0);
    }
  }
}

// Gathers 16-byte rows with every other index out of range through `kernel`, in a shuffled
// processing order if `shuffled`. Output bytes and first_bad against core; bad_pair one
// consistent pair (its winner's atomicCAS, then its write of the value).
void gather_every_other_bad(int64_t count, cuda::GatherKernel kernel, bool shuffled) {
  constexpr int64_t kRows = 10, kRowBytes = 16;
  constexpr uint8_t kUnwritten = 0xa5;
  std::vector<uint8_t> table(kRows * kRowBytes);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<uint8_t>(i * 7 + 3);
  std::vector<int64_t> index(count), order(count), read(count);
  for (int64_t i = 0; i < count; ++i) index[i] = i % 2 ? kRows + i : i % kRows;
  for (int64_t k = 0; k < count; ++k) order[k] = shuffled ? (k * 389) % count : k;
  for (int64_t k = 0; k < count; ++k) read[k] = index[order[k]];
  std::vector<uint8_t> want(count * kRowBytes, kUnwritten), got(want.size(), kUnwritten);
  const int64_t want_first = gather_rows({table.data(), kRows, kRowBytes},
                                         {index.data(), IndexType::kInt64, count}, want.data());
  std::vector<unsigned long long> first_bad(1, ~0ull), bad_pair{~0ull, 0};
  cuda::GatherArgs a;
  a.table = table.data();
  a.num_rows = kRows;
  a.row_bytes = kRowBytes;
  a.index = read.data();
  if (shuffled) a.order = order.data();
  a.count = count;
  a.out = got.data();
  a.first_bad = first_bad.data();
  a.bad_pair = bad_pair.data();
  a.kernel = kernel;
  ASSERT_EQ(cuda::plan_gather(a).grouped, kernel == cuda::GatherKernel::kGrouped);
  ASSERT_EQ(cuda::gather_rows(a, nullptr), cudaSuccess) << cudasim::last_error_message();
  EXPECT_EQ(differences(got, want), 0);
  EXPECT_EQ(want_first, 1);
  EXPECT_EQ(first_bad[0], static_cast<unsigned long long>(want_first));
  ASSERT_LT(bad_pair[0], static_cast<unsigned long long>(count));
  EXPECT_EQ(bad_pair[0] % 2, 1u) << "not a bad position";
  EXPECT_EQ(bad_pair[1], static_cast<unsigned long long>(index[bad_pair[0]]))
      << "bad_pair = {" << bad_pair[0] << ", " << bad_pair[1] << "} is not one pair";
}

// The warp kernel on 8 blocks of 8 one-warp groups, each group's lane 0 reporting its bad
// position through atomicMin (first_bad) and atomicCAS (bad_pair).
TEST_F(KernelRaces, GatherBadIndicesInEveryBlock) {
  kernels("gather_kernel");
  gather_every_other_bad(64, cuda::GatherKernel::kWarpPerRow, false);
}

// The grouped gather on 9 blocks (256 entries each, 16-byte rows: 32 one-lane groups per warp)
// in a shuffled processing order: each lane checks the index it loaded and reports a bad one
// through atomicMin and atomicCAS while the warp's shuffles hand the good ones to their groups.
TEST_F(KernelRaces, GatherGroupedShufflesAndBadIndicesInEveryBlock) {
  kernels("gather_grouped_kernel");
  gather_every_other_bad(8 * 256 + 37, cuda::GatherKernel::kGrouped, true);
}

// Fingerprints of 40 ranges on 5 blocks of 8 warps: each warp's shuffles (a lane's neighbour
// word, the sum over the 4 parts, the 8 lanes into lane 0) while other warps of its block and
// other blocks run on other threads. Every value against core.
TEST_F(KernelRaces, FingerprintShufflesInEveryWarp) {
  kernels("fingerprint_kernel");
  std::vector<unsigned char> bytes(40 * 3000);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(i * 131 + 7);
  std::vector<cuda::FingerprintRange> ranges;
  for (size_t i = 0; i < 40; ++i)
    ranges.push_back({bytes.data() + i * 3000 + i % 8, 2000 + i * 20});
  std::vector<uint64_t> got(ranges.size(), 0);
  ASSERT_EQ(cuda::fingerprint_ranges(ranges.data(), static_cast<int64_t>(ranges.size()), got.data(),
                                     nullptr),
            cudaSuccess)
      << cudasim::last_error_message();
  for (size_t i = 0; i < ranges.size(); ++i) {
    EXPECT_EQ(got[i], fingerprint64(ranges[i].data, ranges[i].bytes)) << "range " << i;
  }
}

}  // namespace
}  // namespace tierlift
