#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "core/io/aligned_pool.h"
#include "core/io/crc32c.h"

namespace tierlift::io {
namespace {

TEST(IoCrc32c, KnownVector) {
  const char* s = "123456789";
  EXPECT_EQ(crc32c(0, s, 9), 0xE3069283u);
  EXPECT_EQ(crc32c_portable(0, s, 9), 0xE3069283u);
}

TEST(IoCrc32c, HardwareMatchesTableAndIsIncremental) {
  std::mt19937 rng(1);
  std::vector<unsigned char> data(10007);
  for (auto& b : data) b = static_cast<unsigned char>(rng());
  for (size_t n : {0ul, 1ul, 7ul, 8ul, 9ul, 4096ul, 10007ul}) {
    EXPECT_EQ(crc32c(0, data.data(), n), crc32c_portable(0, data.data(), n)) << n;
  }
  uint32_t c = crc32c(0, data.data(), 1000);
  c = crc32c(c, data.data() + 1000, data.size() - 1000);
  EXPECT_EQ(c, crc32c(0, data.data(), data.size()));
  data[5000] ^= 1;
  EXPECT_NE(c, crc32c(0, data.data(), data.size()));
}

TEST(IoAlignedPool, AlignedBudgetedAndCoalescing) {
  AlignedPool pool(64 * 1024);
  EXPECT_EQ(pool.budget(), 64u * 1024);
  void* a = pool.try_acquire(1);
  void* b = pool.try_acquire(8192);
  void* c = pool.try_acquire(4096 * 13);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_NE(c, nullptr);
  for (void* p : {a, b, c}) EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % kAlign, 0u);
  EXPECT_EQ(pool.in_use(), 64u * 1024);
  EXPECT_EQ(pool.try_acquire(1), nullptr);  // budget exhausted
  pool.release(b);
  pool.release(a);
  void* d = pool.try_acquire(3 * 4096);  // needs a and b coalesced
  EXPECT_EQ(d, a);
  pool.release(d);
  pool.release(c);
  EXPECT_EQ(pool.in_use(), 0u);
  void* all = pool.try_acquire(64 * 1024);
  EXPECT_NE(all, nullptr);
  pool.release(all);
}

TEST(IoAlignedPool, ArenaStartsOnA2MiBBoundaryAndIsUsableToTheEnd) {
  for (size_t n : {size_t{4096}, size_t{3} << 20, (size_t{4} << 20) + 4096}) {
    AlignedPool pool(n);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(pool.arena()) % (size_t{2} << 20), 0u) << n;
    char* p = static_cast<char*>(pool.try_acquire(n));
    ASSERT_EQ(p, pool.arena());
    std::memset(p, 0x5a, n);  // every byte of the budget is mapped and writable
    EXPECT_EQ(p[n - 1], 0x5a);
    pool.release(p);
  }
}

TEST(IoAlignedPool, RejectsBadRequests) {
  AlignedPool pool(8192);
  EXPECT_THROW(pool.try_acquire(0), std::invalid_argument);
  EXPECT_THROW(pool.try_acquire(8193), std::invalid_argument);
  int x = 0;
  EXPECT_THROW(pool.release(&x), std::invalid_argument);
  EXPECT_THROW(AlignedPool(0), std::invalid_argument);
}

}  // namespace
}  // namespace tierlift::io
