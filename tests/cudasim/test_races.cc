// Ordering bugs the simulator must find, planted in small kernels (sim_kernels.cu): a shared
// slot rewritten before other warps read it (no barrier between the two uses), and a plain
// read-compare-store where an atomicMax belongs. The warp-ahead schedule shows the first as
// wrong bits in every build; the ThreadSanitizer build reports both as data races naming kernel,
// block, thread and source line. Also: shared memory is poisoned at every block start.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cudasim/launch.h"
#include "tests/cudasim/sim_kernels.cuh"

namespace simtest {
namespace {

#if defined(__SANITIZE_THREAD__)
constexpr bool kTsan = true;
#else
constexpr bool kTsan = false;
#endif

// The child of a death test re-runs the binary, so TSAN_OPTIONS set here reaches it: the first
// report ends it.
void halt_on_race() {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const char* old = std::getenv("TSAN_OPTIONS");
  setenv("TSAN_OPTIONS", ((old ? std::string(old) + " " : "") + "halt_on_error=1").c_str(), 1);
}

struct ScheduleScope {
  explicit ScheduleScope(cudasim::Schedule s) { cudasim::set_schedule(s); }
  ~ScheduleScope() { cudasim::reset_schedule(); }
};

constexpr int kBlocks = 3, kThreads = 256, kRounds = 6;

std::vector<float> slot_input() {
  std::vector<float> in(kBlocks * kRounds * kThreads);
  std::mt19937 rng(7);
  for (float& x : in) x = static_cast<float>(rng() % 100000);
  return in;
}

// Wrong outputs of reuse_slot against the per-round maxima.
int reuse_slot_wrong(const std::vector<float>& in, bool with_barrier) {
  std::vector<float> out(in.size(), -1.f);
  EXPECT_EQ(reuse_slot(in.data(), out.data(), kBlocks, kThreads, kRounds, with_barrier),
            cudaSuccess);
  int wrong = 0;
  for (int g = 0; g < kBlocks * kRounds; ++g) {
    float want = in[g * kThreads];
    for (int t = 1; t < kThreads; ++t) want = std::max(want, in[g * kThreads + t]);
    for (int t = 0; t < kThreads; ++t) wrong += out[g * kThreads + t] != want;
  }
  return wrong;
}

TEST(CudaSimRaces, ReusedSlotWithItsBarrierIsExactInBothSchedules) {
  const std::vector<float> in = slot_input();
  for (auto s : {cudasim::Schedule::kThread, cudasim::Schedule::kWarp}) {
    ScheduleScope scope(s);
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      cudasim::set_seed(seed);
      EXPECT_EQ(reuse_slot_wrong(in, true), 0) << "seed " << seed;
    }
  }
}

TEST(CudaSimRaces, MissingBarrierBeforeReusingASlot) {
  const std::vector<float> in = slot_input();
  if (kTsan) {
    halt_on_race();
    EXPECT_DEATH(reuse_slot_wrong(in, false),
                 "ThreadSanitizer: data race.*reuse_slot_kernel.*sim_kernels.cu:[0-9]+.*"
                 "block \\([0-9],0,0\\) thread \\([0-9]+,0,0\\)");
    return;
  }
  // The warp-ahead schedule lets a warp rewrite its slot before the others read it.
  ScheduleScope scope(cudasim::Schedule::kWarp);
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    cudasim::set_seed(seed);
    EXPECT_GT(reuse_slot_wrong(in, false), 0) << "missing barrier not caught with seed " << seed;
  }
}

TEST(CudaSimRaces, AtomicMaxAcrossBlocksIsExact) {
  const int blocks = 64;
  std::vector<unsigned> values(blocks);
  for (int b = 0; b < blocks; ++b) values[b] = 1000u + 3u * b;  // rising: every block updates
  cudasim::set_threads(4);
  unsigned max = 0;
  ASSERT_EQ(block_max(values.data(), &max, blocks, true), cudaSuccess);
  EXPECT_EQ(max, values.back());
  cudasim::set_threads(0);
}

TEST(CudaSimRaces, PlainStoreWhereAnAtomicBelongs) {
  if (!kTsan) GTEST_SKIP() << "a lost update is a matter of timing: the TSan build reports it";
  const int blocks = 16;
  std::vector<unsigned> values(blocks);
  for (int b = 0; b < blocks; ++b) values[b] = 1000u + 3u * b;
  halt_on_race();
  EXPECT_DEATH(
      {
        cudasim::set_threads(2);
        unsigned max = 0;
        block_max(values.data(), &max, blocks, false);
      },
      "ThreadSanitizer: data race.*block_max_kernel.*sim_kernels.cu:[0-9]+");
}

TEST(CudaSimRaces, SharedMemoryIsPoisonedAtEveryBlockStart) {
  EXPECT_GE(cudasim::shared_memory_bytes(), 64 * sizeof(uint32_t));
  const int blocks = 24;
  std::vector<uint32_t> out(blocks * 64);
  std::set<uint32_t> seen;
  for (uint64_t seed = 1; seed <= 2; ++seed) {
    cudasim::set_seed(seed);
    ASSERT_EQ(read_before_write(out.data(), blocks), cudaSuccess);
    for (int b = 0; b < blocks; ++b) {
      for (int t = 0; t < 64; ++t) {
        const uint32_t v = out[b * 64 + t];
        ASSERT_TRUE(v == 0xababababu || v == 0xffffffffu || v == 0x7f7f7f7fu)
            << std::hex << v << " in block " << b;
        ASSERT_EQ(v, out[b * 64]) << "one pattern per block";
      }
      seen.insert(out[b * 64]);
    }
  }
  EXPECT_EQ(seen.size(), 3u) << "the pattern is drawn per block";
}

TEST(CudaSimRaces, ErrorsNameTheWarpSchedule) {
  ScheduleScope scope(cudasim::Schedule::kWarp);
  std::vector<float> out(64);
  EXPECT_EQ(divergent_barrier(out.data()), cudaErrorLaunchFailure);
  EXPECT_NE(cudasim::last_error_message().find("TIERLIFT_CUDASIM_SCHEDULE=warp"), std::string::npos)
      << cudasim::last_error_message();
}

}  // namespace
}  // namespace simtest
