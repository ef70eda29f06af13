#include <gtest/gtest.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/util/thread_pool.h"

namespace tierlift {
namespace {

TEST(ThreadPool, CoversEveryIndexExactlyOnce) {
  ThreadPool pool(4);
  for (int64_t n : {1, 7, 64, 1000, 12345}) {
    std::vector<std::atomic<int>> hits(n);
    pool.parallel_for(n, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) hits[i]++;
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
  }
}

TEST(ThreadPool, RangesStartOnGrainBoundaries) {
  ThreadPool pool(3);
  pool.parallel_for(1000, 64, [&](int64_t b, int64_t) { EXPECT_EQ(b % 64, 0); });
}

TEST(ThreadPool, RethrowsWorkerException) {
  ThreadPool pool(2);
  EXPECT_THROW(pool.parallel_for(100, 1,
                                 [&](int64_t b, int64_t) {
                                   if (b > 0) throw std::runtime_error("boom");
                                 }),
               std::runtime_error);
  // The pool still works afterwards.
  std::atomic<int64_t> sum{0};
  pool.parallel_for(100, 1, [&](int64_t b, int64_t e) { sum += e - b; });
  EXPECT_EQ(sum.load(), 100);
}

// A capped thread's calls run on at most its cap of threads (ranges, not just workers: a
// range per thread), cover every index, and leave other threads' calls uncapped.
TEST(ThreadPool, ThreadLimitCapsTheCallingThreadOnly) {
  ThreadPool pool(4);
  auto ranges = [&](int64_t n) {
    std::atomic<int> count{0};
    std::atomic<int64_t> sum{0};
    pool.parallel_for(n, 1, [&](int64_t b, int64_t e) {
      count++;
      sum += e - b;
    });
    EXPECT_EQ(sum.load(), n);
    return count.load();
  };
  EXPECT_EQ(ranges(1000), 4);
  ThreadPool::set_thread_limit(2);
  EXPECT_EQ(ThreadPool::thread_limit(), 2);
  EXPECT_EQ(ranges(1000), 2);
  int other = 0;
  std::thread([&] { other = ranges(1000); }).join();
  EXPECT_EQ(other, 4);
  ThreadPool::set_thread_limit(9);  // above the pool's size: all of it
  EXPECT_EQ(ranges(1000), 4);
  ThreadPool::set_thread_limit(-3);  // negative: no cap
  EXPECT_EQ(ThreadPool::thread_limit(), 0);
  ThreadPool::set_thread_limit(1);  // one thread: inline on the caller
  EXPECT_EQ(ranges(1000), 1);
  ThreadPool::set_thread_limit(0);
  EXPECT_EQ(ranges(1000), 4);
}

// The pool's default size follows the affinity mask (a container's cpuset, taskset), not the
// machine's CPU count: a thread pinned to one CPU counts one.
TEST(ThreadPool, UsableCpusFollowsTheAffinityMask) {
  cpu_set_t all;
  ASSERT_EQ(sched_getaffinity(0, sizeof(all), &all), 0);
  EXPECT_EQ(ThreadPool::usable_cpus(), CPU_COUNT(&all));
  int first = 0;
  while (!CPU_ISSET(first, &all)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  EXPECT_EQ(ThreadPool::usable_cpus(), 1);
  ASSERT_EQ(sched_setaffinity(0, sizeof(all), &all), 0);
  EXPECT_EQ(ThreadPool::usable_cpus(), CPU_COUNT(&all));
}

TEST(ThreadPool, NestedCallRunsInline) {
  ThreadPool pool(2);
  std::atomic<int64_t> sum{0};
  pool.parallel_for(4, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      pool.parallel_for(10, 1, [&](int64_t b2, int64_t e2) { sum += e2 - b2; });
    }
  });
  EXPECT_EQ(sum.load(), 40);
}

}  // namespace
}  // namespace tierlift

namespace tierlift {
namespace {

TEST(ThreadPool, WorksInForkedChild) {
  ThreadPool pool(2);
  std::atomic<int64_t> warm{0};
  pool.parallel_for(100, 1, [&](int64_t b, int64_t e) { warm += e - b; });  // threads running
  const pid_t pid = fork();
  if (pid == 0) {
    std::atomic<int64_t> sum{0};
    pool.parallel_for(1000, 1, [&](int64_t b, int64_t e) { sum += e - b; });
    _exit(sum.load() == 1000 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace tierlift
