#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/gather/gather.h"

namespace tierlift {
namespace {

std::vector<uint8_t> make_table(int64_t rows, int64_t row_bytes, uint32_t seed) {
  std::vector<uint8_t> t(static_cast<size_t>(rows * row_bytes));
  std::mt19937 rng(seed);
  for (auto& b : t) b = static_cast<uint8_t>(rng());
  return t;
}

template <typename Idx>
void check_gather(int64_t rows, int64_t row_bytes, int64_t count, size_t misalign) {
  // Offsetting table and output by `misalign` bytes exercises odd alignments.
  std::vector<uint8_t> storage = make_table(rows * row_bytes + 16, 1, 7);
  const uint8_t* table = storage.data() + misalign;
  std::mt19937 rng(11);
  std::vector<Idx> index(count);
  for (auto& v : index) v = static_cast<Idx>(rng() % rows);
  if (count > 2) index[1] = index[0];  // duplicates
  std::vector<uint8_t> out_storage(count * row_bytes + 16, 0xAB);
  uint8_t* out = out_storage.data() + (misalign * 3) % 16;
  GatherIndex gi{index.data(), sizeof(Idx) == 4 ? IndexType::kInt32 : IndexType::kInt64, count};
  ASSERT_EQ(gather_rows({table, rows, row_bytes}, gi, out), kNoBadIndex);
  for (int64_t i = 0; i < count; ++i) {
    ASSERT_EQ(std::memcmp(out + i * row_bytes, table + index[i] * row_bytes, row_bytes), 0)
        << "row " << i << " row_bytes " << row_bytes;
  }
}

TEST(GatherTest, MatchesNaiveCopyForManyRowSizes) {
  for (int64_t rb : {1, 2, 3, 4, 7, 8, 16, 31, 32, 64, 100, 128, 512, 4096, 5000}) {
    for (size_t mis : {0, 1, 5}) {
      check_gather<int64_t>(97, rb, 300, mis);
      check_gather<int32_t>(97, rb, 300, mis);
    }
  }
}

TEST(GatherTest, ManyRowsUseAllThreads) { check_gather<int64_t>(5000, 64, 100000, 0); }

TEST(GatherTest, EmptyIndexIsNoOp) {
  auto table = make_table(4, 8, 1);
  GatherIndex gi{nullptr, IndexType::kInt64, 0};
  EXPECT_EQ(gather_rows({table.data(), 4, 8}, gi, nullptr), kNoBadIndex);
  EXPECT_EQ(find_bad_index(gi, 4), kNoBadIndex);
}

TEST(GatherTest, ReportsFirstBadPositionAndSkipsIt) {
  const int64_t rows = 10, rb = 16, n = 50000;
  auto table = make_table(rows, rb, 3);
  for (int64_t bad : {int64_t{-1}, rows, std::numeric_limits<int64_t>::max(),
                      std::numeric_limits<int64_t>::min()}) {
    std::vector<int64_t> index(n, 2);
    index[40000] = bad;
    index[30001] = bad;
    std::vector<uint8_t> out(n * rb, 0);
    GatherIndex gi{index.data(), IndexType::kInt64, n};
    EXPECT_EQ(find_bad_index(gi, rows), 30001);
    EXPECT_EQ(gather_rows({table.data(), rows, rb}, gi, out.data()), 30001);
    EXPECT_EQ(out[30001 * rb], 0);  // the bad row is never written
    EXPECT_EQ(std::memcmp(out.data(), table.data() + 2 * rb, rb), 0);
  }
  std::vector<int32_t> idx32 = {0, 1, -5, 3};
  EXPECT_EQ(find_bad_index({idx32.data(), IndexType::kInt32, 4}, rows), 2);
  EXPECT_EQ(index_value({idx32.data(), IndexType::kInt32, 4}, 2), -5);
}

// The table sits right before a PROT_NONE page: any read past its end would fault.
TEST(GatherTest, NeverReadsOutsideTheTable) {
  const long page = sysconf(_SC_PAGESIZE);
  void* mem = mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  char* guard = static_cast<char*>(mem) + page;
  ASSERT_EQ(mprotect(guard, page, PROT_NONE), 0);
  const int64_t rb = 24, rows = 10;
  char* table = guard - rows * rb;
  for (int64_t i = 0; i < rows * rb; ++i) table[i] = static_cast<char>(i);
  std::vector<int64_t> index = {9, 10, 11, 1 << 20, -1, 0, 9};
  std::vector<char> out(index.size() * rb, 0);
  EXPECT_EQ(gather_rows({table, rows, rb}, {index.data(), IndexType::kInt64, 7}, out.data()), 1);
  EXPECT_EQ(std::memcmp(out.data() + 6 * rb, table + 9 * rb, rb), 0);
  munmap(mem, 2 * page);
}

TEST(GatherTest, SixtyFourBitOffsets) {
  // Row 3 of a table with 2^30-byte rows starts beyond 2^31 bytes; only the index arithmetic
  // is exercised (a sparse mapping, rows other than the one gathered are never touched).
  const int64_t rb = int64_t{1} << 30, rows = 4;
  void* mem = mmap(nullptr, rows * rb, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) GTEST_SKIP() << "cannot reserve 4 GiB of address space";
  char* table = static_cast<char*>(mem);
  // Use a small "row" view: a table of 16-byte rows covering the whole mapping.
  const int64_t small_rb = 16, small_rows = rows * rb / small_rb;
  const int64_t far_row = small_rows - 1;  // offset 4 GiB - 16
  std::memset(table + far_row * small_rb, 0x5A, small_rb);
  std::vector<int64_t> index = {far_row};
  std::vector<char> out(small_rb, 0);
  EXPECT_EQ(
      gather_rows({table, small_rows, small_rb}, {index.data(), IndexType::kInt64, 1}, out.data()),
      kNoBadIndex);
  EXPECT_EQ(out[0], 0x5A);
  EXPECT_EQ(out[15], 0x5A);
  munmap(mem, rows * rb);
}

TEST(GatherTest, ForkedChildGathersWithoutThePool) {
  check_gather<int64_t>(100, 32, 20000, 0);  // starts the pool in the parent
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::vector<uint8_t> table = make_table(100, 32, 5);
    std::vector<int64_t> index(20000, 7);
    std::vector<uint8_t> out(20000 * 32);
    const int64_t r =
        gather_rows({table.data(), 100, 32}, {index.data(), IndexType::kInt64, 20000}, out.data());
    _exit(in_forked_child() && r == kNoBadIndex &&
                  std::memcmp(out.data() + 19999 * 32, table.data() + 7 * 32, 32) == 0
              ? 0
              : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace tierlift
