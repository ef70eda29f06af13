// The simulator's own semantics (shuffles, votes, barriers, shared memory, atomics, launch
// checks) and the planted bugs it must catch: a read past the end (AddressSanitizer), a missing
// __syncthreads (wrong result under randomized order), a wrong shuffle mask, a thread leaving
// before a barrier, divergent barriers; each one an error naming kernel, block and thread.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cudasim/launch.h"
#include "tests/cudasim/sim_kernels.cuh"

namespace simtest {
namespace {

// The lane a shuffle reads, per the CUDA programming guide (written independently of the
// simulator): own lane when the source leaves the width segment, except that xor may read from
// earlier segments (only a later one gives the caller's own value).
int expected_source(Shuffle kind, int lane, int arg, int width) {
  const int start = lane / width * width;
  int src = lane;
  switch (kind) {
    case Shuffle::kIdx:
      src = start + (arg % width + width) % width;
      break;
    case Shuffle::kUp:
      src = lane - arg;
      break;
    case Shuffle::kDown:
      src = lane + arg;
      break;
    case Shuffle::kXor:
      src = lane ^ arg;
      break;
  }
  if (kind == Shuffle::kXor) return src >= start + width ? lane : src;
  return (src < start || src >= start + width) ? lane : src;
}

TEST(CudaSim, ShufflesFollowPtxForEveryWidth) {
  const int threads = 96;
  std::vector<uint32_t> in(threads), out(threads);
  for (int t = 0; t < threads; ++t) in[t] = 1000u + 7u * t;
  int cases = 0;
  for (Shuffle kind : {Shuffle::kIdx, Shuffle::kUp, Shuffle::kDown, Shuffle::kXor}) {
    for (int width : {1, 2, 4, 8, 16, 32}) {
      for (int arg : {0, 1, 3, 5, 8, 16, 31}) {
        if (kind == Shuffle::kXor && arg >= 32) continue;
        ASSERT_EQ(shuffle(kind, arg, width, in.data(), out.data(), threads), cudaSuccess)
            << cudasim::last_error_message();
        for (int t = 0; t < threads; ++t) {
          const int lane = t % 32;
          const int src = t - lane + expected_source(kind, lane, arg, width);
          ASSERT_EQ(out[t], in[src]) << "kind " << static_cast<int>(kind) << " width " << width
                                     << " arg " << arg << " thread " << t;
        }
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 4 * 6 * 7);
}

TEST(CudaSim, VotesOverTheWarp) {
  const int threads = 64;
  std::mt19937 rng(1);
  for (int round = 0; round < 4; ++round) {
    std::vector<int> pred(threads);
    for (int t = 0; t < threads; ++t) pred[t] = round == 0 ? 1 : round == 1 ? 0 : rng() % 3;
    std::vector<uint32_t> out(3 * threads);
    ASSERT_EQ(votes(pred.data(), out.data(), threads), cudaSuccess);
    for (int w = 0; w < threads / 32; ++w) {
      uint32_t ballot = 0;
      for (int l = 0; l < 32; ++l) ballot |= (pred[32 * w + l] != 0 ? 1u : 0u) << l;
      for (int l = 0; l < 32; ++l) {
        const int t = 32 * w + l;
        EXPECT_EQ(out[3 * t], ballot);
        EXPECT_EQ(out[3 * t + 1], ballot != 0 ? 1u : 0u);
        EXPECT_EQ(out[3 * t + 2], ballot == 0xffffffffu ? 1u : 0u);
      }
    }
  }
}

TEST(CudaSim, SharedMemoryIsPerBlockAndBarriersOrderIt) {
  const int blocks = 24;
  std::vector<float> in(blocks * 256), sums(blocks);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i % 1000);  // exact sums
  for (int threads : {1, 3}) {
    cudasim::set_threads(threads);
    ASSERT_EQ(block_sums(in.data(), sums.data(), blocks), cudaSuccess);
    for (int b = 0; b < blocks; ++b) {
      const float want = std::accumulate(in.begin() + b * 256, in.begin() + (b + 1) * 256, 0.f);
      EXPECT_EQ(sums[b], want) << "block " << b << " with " << threads << " OS threads";
    }
  }
  cudasim::set_threads(0);
}

TEST(CudaSim, AtomicsAcrossBlocksOnSeveralOsThreads) {
  cudasim::set_threads(4);
  unsigned long long counter = 0;
  int max = -1;
  ASSERT_EQ(atomics(&counter, &max, 64, 96), cudaSuccess);
  EXPECT_EQ(counter, 64ull * 96);
  EXPECT_EQ(max, 64 * 96 - 1);
  cudasim::set_threads(0);
}

TEST(CudaSim, BadLaunchConfigurationsAreRefused) {
  EXPECT_EQ(empty_launch(dim3(1), dim3(1024)), cudaSuccess);
  EXPECT_EQ(empty_launch(dim3(1), dim3(1025)), cudaErrorInvalidConfiguration);
  EXPECT_EQ(empty_launch(dim3(1), dim3(32, 32, 2)), cudaErrorInvalidConfiguration);
  EXPECT_EQ(empty_launch(dim3(0), dim3(32)), cudaErrorInvalidConfiguration);
  EXPECT_EQ(empty_launch(dim3(1, 65536), dim3(32)), cudaErrorInvalidConfiguration);
  EXPECT_NE(cudasim::last_error_message().find("empty_kernel"), std::string::npos);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // taken by the launcher already
}

TEST(CudaSim, TiledTransposeWithItsBarrierIsExactForEverySeed) {
  const int rows = 70, cols = 45;
  std::vector<float> x(rows * cols), out(rows * cols);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    cudasim::set_seed(seed);
    ASSERT_EQ(transpose(x.data(), out.data(), rows, cols, true), cudaSuccess);
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < cols; ++c) ASSERT_EQ(out[c * rows + r], x[r * cols + c]) << seed;
    }
  }
}

// --- Planted bugs -----------------------------------------------------------------------------

TEST(CudaSimPlantedBug, MissingBarrierGivesWrongResultsUnderRandomOrder) {
  const int rows = 70, cols = 45;
  std::vector<float> x(rows * cols);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i + 1);
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer reports the race itself (test_races.cc runs it the same way).
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  setenv("TSAN_OPTIONS", "halt_on_error=1", 1);
  std::vector<float> out(rows * cols);
  EXPECT_DEATH(transpose(x.data(), out.data(), rows, cols, false),
               "ThreadSanitizer: data race.*transpose_kernel");
  return;
#endif
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    cudasim::set_seed(seed);
    std::vector<float> out(rows * cols, -1.f);
    ASSERT_EQ(transpose(x.data(), out.data(), rows, cols, false), cudaSuccess);
    int wrong = 0;
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < cols; ++c) wrong += out[c * rows + r] != x[r * cols + c];
    }
    EXPECT_GT(wrong, 0) << "missing __syncthreads not caught with seed " << seed;
  }
}

TEST(CudaSimPlantedBug, ReadPastTheEndIsCaughtByAddressSanitizer) {
#if !defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "needs the AddressSanitizer build (-DTIERLIFT_SANITIZE=ON)";
#else
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const int n = 100;
  std::vector<float> in(n, 1.f), out(n);
  EXPECT_DEATH(copy_off_by_one(in.data(), out.data(), n), "heap-buffer-overflow");
#endif
}

void expect_error(cudaError_t got, const std::vector<std::string>& words) {
  EXPECT_EQ(got, cudaErrorLaunchFailure);
  const std::string msg = cudasim::last_error_message();
  for (const std::string& w : words) EXPECT_NE(msg.find(w), std::string::npos) << msg;
  EXPECT_NE(msg.find("TIERLIFT_CUDASIM_SEED="), std::string::npos) << msg;
}

TEST(CudaSimPlantedBug, WrongShuffleMaskIsAnError) {
  std::vector<float> in(32, 1.f), out(32);
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    cudasim::set_seed(seed);
    expect_error(warp_sum_wrong_mask(in.data(), out.data()),
                 {"warp_sum_wrong_mask_kernel", "block (0,0,0)", "reads lane 1", "__shfl_xor_sync",
                  "mask 0x0000ffff leaves that lane out", "sim_kernels.cu:"});
    expect_error(mask_leaves_out_caller(in.data(), out.data()),
                 {"mask_leaves_out_caller_kernel", "mask 0x0000ffff", "leaves out its own lane"});
  }
}

TEST(CudaSimPlantedBug, ThreadLeavingBeforeABarrierIsAnErrorNotAHang) {
  std::vector<float> out(64);
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    cudasim::set_seed(seed);
    expect_error(exit_before_barrier(out.data()), {"exit_before_barrier_kernel", "thread (5,0,0)",
                                                   "__syncthreads", "can never complete"});
  }
}

TEST(CudaSimPlantedBug, DivergentBarriersAreAnError) {
  std::vector<float> out(64);
  expect_error(divergent_barrier(out.data()), {"divergent_barrier_kernel", "divergent barrier"});
}

TEST(CudaSimPlantedBug, ShuffleWaitingOnALaneAtABarrierIsADeadlockError) {
  std::vector<float> out(32);
  expect_error(shuffle_vs_barrier(out.data()), {"shuffle_vs_barrier_kernel", "deadlock"});
}

}  // namespace
}  // namespace simtest
