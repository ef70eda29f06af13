// Staged I/O (caller memory too loosely aligned for O_DIRECT, copied through the pool): the
// copier threads on their own, then the engine with many staged requests in flight, odd sizes
// and pointers, a pool far smaller than the data in flight, read errors and close() mid-flight.
// Engine cases run once per backend (threads, io_uring).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/io/copier.h"
#include "core/io/engine.h"
#include "io_test_util.h"

namespace tierlift::io {
namespace {

using iotest::random_bytes;

// Waits for a request, but aborts the test binary instead of hanging when the engine deadlocks
// (a lost wake-up, a pool wait that never ends).
IoStatus wait_or_abort(const std::shared_ptr<IoRequest>& r, double seconds = 60) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!r->done()) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "request not done after %.0f s: the engine hangs\n", seconds);
      std::abort();
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return r->wait();
}

// Waits for every request (none is left writing into freed memory when an assertion fails
// afterwards); returns the first failure.
IoStatus wait_all_or_abort(const std::vector<std::shared_ptr<IoRequest>>& reqs) {
  IoStatus first;
  for (const auto& r : reqs) {
    IoStatus st = wait_or_abort(r);
    if (!st.ok() && first.ok()) first = st;
  }
  return first;
}

TEST(IoCopier, CopiesEveryPieceBeforeItsContinuation) {
  Copier copier(3, /*piece=*/4096);
  EXPECT_EQ(copier.num_threads(), 3);
  // Sizes around the piece size, and several submitters at once.
  const std::vector<size_t> sizes = {0, 1, 4095, 4096, 4097, 3 * 4096 + 17, 100000};
  constexpr int kSubmitters = 4, kRounds = 25;
  std::atomic<int> done{0}, bad{0};
  std::vector<std::thread> submitters;
  std::vector<std::vector<unsigned char>> src(kSubmitters * kRounds * sizes.size());
  std::vector<std::vector<unsigned char>> dst(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    const size_t n = sizes[i % sizes.size()];
    src[i] = random_bytes(n + 1, static_cast<unsigned>(i));
    dst[i].assign(n + 1, 0xEE);
  }
  for (int t = 0; t < kSubmitters; ++t) {
    submitters.emplace_back([&, t] {
      for (size_t i = t; i < src.size(); i += kSubmitters) {
        const size_t n = sizes[i % sizes.size()];
        // Odd source address; the byte after the copy must stay untouched.
        copier.copy(dst[i].data(), src[i].data() + 1, n, [&, i, n] {
          if (std::memcmp(dst[i].data(), src[i].data() + 1, n) != 0 || dst[i][n] != 0xEE) ++bad;
          ++done;
        });
      }
    });
  }
  for (auto& t : submitters) t.join();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (done.load() < static_cast<int>(src.size()) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(done.load(), static_cast<int>(src.size()));
  EXPECT_EQ(bad.load(), 0);
}

// The copies run on more than one thread at a time: two continuations that each wait for the
// other to start can only both finish when two copier threads run them side by side.
TEST(IoCopier, RunsCopiesOnSeveralThreadsAtOnce) {
  auto copier = std::make_unique<Copier>(2);
  std::mutex mu;
  std::condition_variable cv;
  int started = 0;
  int met = 0;
  char from[2] = {1, 2}, to[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    copier->copy(&to[i], &from[i], 1, [&] {
      std::unique_lock<std::mutex> lock(mu);
      ++started;
      cv.notify_all();
      if (cv.wait_for(lock, std::chrono::seconds(10), [&] { return started == 2; })) ++met;
    });
  }
  copier.reset();  // waits for both continuations
  EXPECT_EQ(met, 2);
  EXPECT_EQ(to[0], 1);
  EXPECT_EQ(to[1], 2);
}

// The destructor finishes queued copies (and their continuations) before joining.
TEST(IoCopier, DestructorDrainsQueuedCopies) {
  constexpr size_t kPart = 64 * 1024;
  std::vector<unsigned char> src = random_bytes(64 * kPart, 5), dst(64 * kPart, 0);
  std::atomic<int> done{0};
  {
    Copier copier(2, /*piece=*/8192);
    for (size_t i = 0; i < 64; ++i) {
      copier.copy(dst.data() + i * kPart, src.data() + i * kPart, kPart, [&] { ++done; });
    }
  }
  EXPECT_EQ(done.load(), 64);
  EXPECT_EQ(src, dst);
  EXPECT_THROW(Copier(0), std::invalid_argument);
}

class IoStagedTest : public iotest::BackendDirTest {
 protected:
  std::unique_ptr<Engine> make(size_t block, int depth, size_t pool, int copy_threads = 3) {
    EngineOptions o;
    o.backend = GetParam();
    o.block_size = block;
    o.queue_depth = depth;
    o.pool_bytes = pool;
    o.copy_threads = copy_threads;
    auto eng = std::make_unique<Engine>(o);
    return eng;
  }
  // Whether O_DIRECT works in dir_ (it does not on tmpfs before Linux 6.6): staging needs it.
  bool direct_here(Engine& eng) {
    eng.take_warnings();
    char b[4096] = {1};
    const std::string p = dir_ + "/probe";
    if (!eng.write(b, sizeof(b), {p}, 0)->wait().ok()) return false;
    eng.forget(p);
    return eng.take_warnings().empty();
  }
};

// 48 requests of odd sizes from odd addresses in flight together each way, with 3 copier
// threads: every byte lands where it belongs, and all the aligned bulk went through staging.
TEST_P(IoStagedTest, ManyConcurrentRequestsOddSizesAndPointers) {
  const size_t block = 64 * 1024;
  auto eng = make(block, /*depth=*/8, /*pool=*/16 * block);
  if (!direct_here(*eng)) GTEST_SKIP() << "no O_DIRECT in " << dir_;
  const uint64_t staged0 = eng->path_bytes().staged.load();
  std::mt19937 rng(21);
  constexpr int kCount = 48;
  std::vector<size_t> lens(kCount), mis(kCount);
  std::vector<uint64_t> offs(kCount);
  std::vector<std::string> paths(kCount);
  uint64_t expect_staged = 0;
  for (int i = 0; i < kCount; ++i) {
    lens[i] = 1 + rng() % (5 * block);
    mis[i] = 1 + 2 * (rng() % 32);  // odd: below any drive's O_DIRECT memory alignment
    // Even offsets keep every block's memory odd (block starts are offset % block bytes in).
    offs[i] = i % 3 == 0 ? 4096 * (rng() % 16) : 2 * (rng() % 50000);
    paths[i] = dir_ + "/r" + std::to_string(i % 6);  // several requests share a file
    offs[i] += (i / 6) * 8 * block;                  // ... at disjoint ranges
    // The engine's split: per block, whole pages at a page-aligned file offset are staged.
    for (uint64_t pos = 0; pos < lens[i];) {
      const uint64_t at = offs[i] + pos, n = std::min<uint64_t>(lens[i] - pos, block - at % block);
      if (at % 4096 == 0) expect_staged += n - n % 4096;
      pos += n;
    }
  }
  std::vector<std::vector<unsigned char>> src(kCount), dst(kCount);
  for (int i = 0; i < kCount; ++i) {
    src[i] = random_bytes(lens[i] + mis[i], 100 + i);
    dst[i].assign(lens[i] + mis[i] + 1, 0xA5);
  }
  std::vector<std::shared_ptr<IoRequest>> reqs;
  for (int i = 0; i < kCount; ++i)
    reqs.push_back(eng->write(src[i].data() + mis[i], lens[i], {paths[i]}, offs[i]));
  IoStatus st = wait_all_or_abort(reqs);
  ASSERT_TRUE(st.ok()) << st.message("write");
  reqs.clear();
  for (int i = 0; i < kCount; ++i)
    reqs.push_back(eng->read(dst[i].data() + mis[i], lens[i], {paths[i]}, offs[i]));
  st = wait_all_or_abort(reqs);
  ASSERT_TRUE(st.ok()) << st.message("read");
  for (int i = 0; i < kCount; ++i) {
    EXPECT_EQ(0, std::memcmp(dst[i].data() + mis[i], src[i].data() + mis[i], lens[i])) << i;
    EXPECT_EQ(dst[i][mis[i] - 1], 0xA5) << "byte before request " << i << " overwritten";
    EXPECT_EQ(dst[i][mis[i] + lens[i]], 0xA5) << "byte after request " << i << " overwritten";
  }
  // Offsets on a page boundary keep whole pages direct (staged here); with io_uring nothing
  // falls back to the page cache, because the engine's own staged blocks always free the pool.
  if (GetParam() == "uring") {
    EXPECT_EQ(eng->path_bytes().staged.load() - staged0, 2 * expect_staged);
  }
  EXPECT_GT(eng->path_bytes().staged.load() - staged0, 0u);
  EXPECT_TRUE(eng->sync().ok());
  EXPECT_EQ(eng->pool().in_use(), 0u);
}

// Far more staged data in flight than the pool holds (32 requests of 3.5 blocks through a
// 2-block pool, queue depth 16, one copier thread): blocks wait for pool memory in turn, nothing
// deadlocks, and on io_uring every aligned byte is still staged.
TEST_P(IoStagedTest, PoolFarSmallerThanTheDataInFlight) {
  const size_t block = 32 * 1024, len = 3 * block + block / 2;
  auto eng = make(block, /*depth=*/16, /*pool=*/2 * block, /*copy_threads=*/1);
  if (!direct_here(*eng)) GTEST_SKIP() << "no O_DIRECT in " << dir_;
  const uint64_t staged0 = eng->path_bytes().staged.load();
  constexpr int kCount = 32;
  auto src = random_bytes(kCount * len + 1, 31);
  std::vector<unsigned char> dst(kCount * len + 1, 0);
  const std::string path = dir_ + "/small_pool.bin";
  std::vector<std::shared_ptr<IoRequest>> reqs;
  for (int i = 0; i < kCount; ++i)
    reqs.push_back(eng->write(src.data() + 1 + i * len, len, {path}, i * len));
  ASSERT_TRUE(wait_all_or_abort(reqs).ok());
  reqs.clear();
  for (int i = 0; i < kCount; ++i)
    reqs.push_back(eng->read(dst.data() + 1 + i * len, len, {path}, i * len));
  ASSERT_TRUE(wait_all_or_abort(reqs).ok());
  EXPECT_EQ(0, std::memcmp(src.data() + 1, dst.data() + 1, kCount * len));
  if (GetParam() == "uring") {
    EXPECT_EQ(eng->path_bytes().staged.load() - staged0, 2u * kCount * len);
  }
  EXPECT_EQ(eng->pool().in_use(), 0u);
}

// A staged read that runs past the end of the file reports the same error as before (errno,
// path, offset where the file ends), copies out the bytes that did arrive, and no others.
TEST_P(IoStagedTest, ReadPastEndCopiesOutWhatArrived) {
  const size_t block = 16 * 1024;
  auto eng = make(block, 4, 8 * block);
  if (!direct_here(*eng)) GTEST_SKIP() << "no O_DIRECT in " << dir_;
  const std::string path = dir_ + "/short.bin";
  const size_t have = 5 * block + 4096;  // the file ends on a page inside block 5
  auto src = random_bytes(have + 1, 41);
  ASSERT_TRUE(wait_or_abort(eng->write(src.data() + 1, have, {path}, 0)).ok());
  std::vector<unsigned char> dst(8 * block + 1, 0x5A);
  IoStatus st = wait_or_abort(eng->read(dst.data() + 1, 8 * block, {path}, 0));
  EXPECT_EQ(st.err, kErrEof);
  EXPECT_EQ(st.path, path);
  EXPECT_EQ(st.offset, have);
  EXPECT_EQ(0, std::memcmp(dst.data() + 1, src.data() + 1, have));
  EXPECT_TRUE(std::all_of(dst.begin() + 1 + have, dst.end(), [](auto c) { return c == 0x5A; }))
      << "bytes past the end of the file were written into the caller's buffer";
  EXPECT_EQ(eng->pool().in_use(), 0u);
}

// close() and the destructor with staged reads and writes still in flight: both wait for every
// block (copies included), every request finishes ok, and the pool is whole again.
TEST_P(IoStagedTest, CloseWithStagedIoInFlight) {
  const size_t block = 64 * 1024, len = 4 * block + 123;
  auto src = random_bytes(len + 1, 51);
  const std::string path = dir_ + "/closing.bin";
  for (int round = 0; round < 4; ++round) {
    auto eng = make(block, 8, 3 * block, /*copy_threads=*/2);
    if (!direct_here(*eng)) GTEST_SKIP() << "no O_DIRECT in " << dir_;
    ASSERT_TRUE(wait_or_abort(eng->write(src.data() + 1, len, {path}, 0)).ok());
    std::vector<std::vector<unsigned char>> dst(12, std::vector<unsigned char>(len + 1, 0));
    std::vector<std::shared_ptr<IoRequest>> reads, writes;
    for (int i = 0; i < 12; ++i) {
      reads.push_back(eng->read(dst[i].data() + 1, len, {path}, 0));
      writes.push_back(eng->write(src.data() + 1, len, {dir_ + "/w" + std::to_string(i)}, 0));
    }
    AlignedPool* pool = &eng->pool();
    if (round % 2 == 0) {
      eng->close();
      EXPECT_EQ(pool->in_use(), 0u);
      EXPECT_TRUE(eng->closed());
    } else {
      eng.reset();  // the destructor closes
    }
    for (int i = 0; i < 12; ++i) {
      EXPECT_TRUE(reads[i]->done() && writes[i]->done());
      EXPECT_TRUE(reads[i]->wait().ok());
      EXPECT_TRUE(writes[i]->wait().ok());
      EXPECT_EQ(0, std::memcmp(dst[i].data() + 1, src.data() + 1, len)) << "round " << round;
    }
  }
}

TEST_P(IoStagedTest, CopyThreadsOutOfRangeAreRefused) {
  EXPECT_THROW(make(4096, 4, 1 << 20, -1), std::invalid_argument);
  EXPECT_THROW(make(4096, 4, 1 << 20, 257), std::invalid_argument);
  EXPECT_NO_THROW(make(4096, 4, 1 << 20, 0));
}

INSTANTIATE_TEST_SUITE_P(Backends, IoStagedTest, ::testing::Values("threads", "uring"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace tierlift::io
