// tierlift::cuda::gather_rows (csrc/cuda/gather.cu) run in the CPU simulator, compared byte for
// byte with core gather_rows (csrc/core/gather). Every buffer is allocated with its exact size
// (plus the leading misalignment bytes, which must stay untouched), so AddressSanitizer catches
// any byte the kernel reads or writes past a table, cache, index or output.
//
// Covered: rows of 1 byte to 4 KiB + 4 (one warp to a whole block per row), table and output
// bases misaligned so that every copy unit (16/8/4/2/1 bytes) is used, int32 and int64 indices,
// repeated/sorted/unsorted indices, more rows than the grid has groups (the grid-stride loop), a
// GPU cache table with cache slots, an empty index, and out-of-range indices in both reporting
// modes; each for both kernels (grouped and warp per row) and processing orders (as given, sorted
// by row, shuffled). Mirrors tests/python/test_gnn.py's gpu tests, scaled down for the simulator.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/gather/gather.h"
#include "cuda/gather.cuh"

namespace tierlift {
namespace {

constexpr uint8_t kUnwritten = 0xA5;  // output fill: rows the kernel must not write keep it
constexpr unsigned long long kNone = ~0ull;

// `bytes` bytes starting `offset` bytes into an allocation of exactly offset + bytes.
class Buffer {
 public:
  Buffer(size_t bytes, size_t offset, uint8_t fill)
      : storage_(offset + bytes, fill), offset_(offset) {}
  uint8_t* data() { return storage_.data() + offset_; }
  const uint8_t* data() const { return storage_.data() + offset_; }
  const std::vector<uint8_t>& storage() const { return storage_; }

 private:
  std::vector<uint8_t> storage_;
  size_t offset_;
};

Buffer random_buffer(size_t bytes, size_t offset, uint32_t seed) {
  Buffer b(bytes, offset, 0);
  std::mt19937 rng(seed);
  for (size_t i = 0; i < bytes; ++i) b.data()[i] = static_cast<uint8_t>(rng());
  return b;
}

// The copy unit gather.cu's pick_unit chooses for a row (the widest on which both agree).
int unit_for(const void* src, const void* dst) {
  const uintptr_t diff = reinterpret_cast<uintptr_t>(src) ^ reinterpret_cast<uintptr_t>(dst);
  for (int unit : {16, 8, 4, 2}) {
    if (diff % unit == 0) return unit;
  }
  return 1;
}

enum class Report { kNone, kFirstBad, kBadPair, kBoth };

// The processing order handed to the kernel: none, the rows' ascending order (what the op's
// locality="sorted" passes), or a random permutation.
enum class Order { kNone, kSorted, kShuffled };

struct Case {
  int64_t num_rows = 0;
  int64_t row_bytes = 0;
  std::vector<int64_t> index;  // stored as int32 when !int64_index
  bool int64_index = true;
  size_t table_offset = 0, out_offset = 0;
  // GPU cache: cache_slot has num_rows entries when used.
  std::vector<int32_t> cache_slot;
  int64_t cache_rows = 0;
  size_t cache_offset = 0;
  Report report = Report::kFirstBad;
  unsigned long long bad_pair_before[2] = {kNone, 0};
  cuda::GatherKernel kernel = cuda::GatherKernel::kAuto;
  Order order = Order::kNone;
};

struct Outcome {
  std::set<int> units;  // copy units the kernel used for the good rows
  cuda::GatherPlan plan;
};

// Output positions in the order the kernel is to read them.
std::vector<int64_t> processing_order(const Case& c) {
  std::vector<int64_t> order(c.index.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  if (c.order == Order::kSorted) {  // as stored: int32 values wrap like the kernel reads them
    auto value = [&](int64_t i) {
      return c.int64_index ? c.index[i] : int64_t{static_cast<int32_t>(c.index[i])};
    };
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t x, int64_t y) { return value(x) < value(y); });
  } else if (c.order == Order::kShuffled) {
    std::shuffle(order.begin(), order.end(), std::mt19937(77));
  }
  return order;
}

bool is_bad(const Case& c, int64_t v) { return v < 0 || v >= c.num_rows; }

// Runs the kernel and core on `c`, and checks output bytes, first_bad and bad_pair.
Outcome check_case(const Case& c) {
  Outcome result;
  const int64_t count = static_cast<int64_t>(c.index.size());
  const int64_t rb = c.row_bytes;
  const Buffer table = random_buffer(c.num_rows * rb, c.table_offset, 17);
  const bool cached = !c.cache_slot.empty();
  const Buffer cache = random_buffer(c.cache_rows * rb, c.cache_offset, 23);

  // Exactly sized (no spare capacity for an overrun to hide in).
  std::vector<int64_t> index64(c.int64_index ? count : 0);
  std::vector<int32_t> index32(c.int64_index ? 0 : count);
  for (int64_t i = 0; i < count; ++i) {
    if (c.int64_index) {
      index64[i] = c.index[i];
    } else {
      index32[i] = static_cast<int32_t>(c.index[i]);
    }
  }
  const std::vector<int32_t> cache_slot(c.cache_slot.begin(), c.cache_slot.end());
  const void* index = c.int64_index ? static_cast<const void*>(index64.data())
                                    : static_cast<const void*>(index32.data());
  // What the kernel reads: the values in processing order, and that order (exactly sized too).
  const bool ordered = c.order != Order::kNone;
  const std::vector<int64_t> order = ordered ? processing_order(c) : std::vector<int64_t>();
  std::vector<int64_t> read64(ordered && c.int64_index ? count : 0);
  std::vector<int32_t> read32(ordered && !c.int64_index ? count : 0);
  for (int64_t k = 0; ordered && k < count; ++k) {
    if (c.int64_index) {
      read64[k] = index64[order[k]];
    } else {
      read32[k] = index32[order[k]];
    }
  }
  const void* kernel_index = !ordered        ? index
                             : c.int64_index ? static_cast<const void*>(read64.data())
                                             : static_cast<const void*>(read32.data());

  // Expected: core's gather from the table as the kernel sees it (cached rows replaced).
  std::vector<uint8_t> effective(table.data(), table.data() + c.num_rows * rb);
  for (int64_t r = 0; cached && r < c.num_rows; ++r) {
    const int32_t slot = c.cache_slot[r];
    if (slot >= 0 && slot < c.cache_rows) {
      std::memcpy(&effective[r * rb], cache.data() + int64_t{slot} * rb, rb);
    }
  }
  Buffer want(count * rb, c.out_offset, kUnwritten);
  const GatherIndex gi{index, c.int64_index ? IndexType::kInt64 : IndexType::kInt32, count};
  const int64_t core_bad = gather_rows({effective.data(), c.num_rows, rb}, gi, want.data());

  Buffer got(count * rb, c.out_offset, kUnwritten);
  std::vector<unsigned long long> first_bad(1, kNone);
  std::vector<unsigned long long> bad_pair(c.bad_pair_before, c.bad_pair_before + 2);
  cuda::GatherArgs a;
  a.table = table.data();
  a.num_rows = c.num_rows;
  a.row_bytes = rb;
  a.index = kernel_index;
  a.index_is_int64 = c.int64_index;
  a.count = count;
  a.kernel = c.kernel;
  if (ordered) a.order = order.data();
  if (cached) {
    a.cache_table = cache.data();
    a.cache_slot = cache_slot.data();
    a.cache_rows = c.cache_rows;
  }
  a.out = got.data();
  if (c.report == Report::kFirstBad || c.report == Report::kBoth) a.first_bad = first_bad.data();
  if (c.report == Report::kBadPair || c.report == Report::kBoth) a.bad_pair = bad_pair.data();
  result.plan = cuda::plan_gather(a);
  const cudaError_t err = cuda::gather_rows(a, nullptr);
  EXPECT_EQ(err, cudaSuccess) << cudaGetErrorString(err);

  // Every output byte, the leading misalignment bytes included.
  const std::vector<uint8_t>& g = got.storage();
  const std::vector<uint8_t>& w = want.storage();
  const auto [gi_end, wi_end] = std::mismatch(g.begin(), g.end(), w.begin());
  if (gi_end != g.end()) {
    const int64_t at =
        static_cast<int64_t>(gi_end - g.begin()) - static_cast<int64_t>(c.out_offset);
    const int64_t row = at < 0 ? -1 : at / rb;
    int64_t differ = 0;
    for (size_t i = 0; i < g.size(); ++i) differ += g[i] != w[i];
    ADD_FAILURE() << differ << " output bytes differ; first at output byte " << at << " (position "
                  << row << ", byte " << (at < 0 ? at : at % rb) << " of the row"
                  << (row >= 0 ? ", index value " + std::to_string(c.index[row]) : "")
                  << "): kernel " << int{*gi_end} << ", core " << int{*wi_end};
  }

  const unsigned long long want_first = core_bad == kNoBadIndex ? kNone : core_bad;
  if (a.first_bad != nullptr) {
    EXPECT_EQ(first_bad[0], want_first) << "first_bad";
  }
  if (a.bad_pair != nullptr) {
    if (c.bad_pair_before[0] != kNone || core_bad == kNoBadIndex) {
      EXPECT_EQ(bad_pair[0], c.bad_pair_before[0]) << "bad_pair[0] must be left as it was";
      EXPECT_EQ(bad_pair[1], c.bad_pair_before[1]) << "bad_pair[1] must be left as it was";
    } else {
      const unsigned long long pos = bad_pair[0];
      if (pos < static_cast<unsigned long long>(count) &&
          is_bad(c, c.index[static_cast<size_t>(pos)])) {
        // The value is read back through the index's own type, so int32 values sign-extend.
        EXPECT_EQ(bad_pair[1], static_cast<unsigned long long>(
                                   c.int64_index ? index64[pos] : int64_t{index32[pos]}))
            << "bad_pair = {" << pos << ", " << bad_pair[1] << "} is not one pair";
      } else {
        ADD_FAILURE() << "bad_pair[0] = " << pos << " is not a bad position";
      }
    }
  }

  for (int64_t i = 0; i < count; ++i) {
    const uint8_t* dst = got.data() + i * rb;
    if (is_bad(c, c.index[i])) {
      EXPECT_TRUE(std::all_of(dst, dst + rb, [](uint8_t b) { return b == kUnwritten; }))
          << "the row of bad position " << i << " (index " << c.index[i] << ") was written";
      continue;
    }
    const int64_t r = c.index[i];
    const int32_t slot = cached ? c.cache_slot[r] : -1;
    const uint8_t* src = slot >= 0 && slot < c.cache_rows ? cache.data() + int64_t{slot} * rb
                                                          : table.data() + r * rb;
    result.units.insert(unit_for(src, dst));
  }
  return result;
}

std::vector<int64_t> random_index(int64_t rows, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int64_t> idx(n);
  for (auto& v : idx) v = static_cast<int64_t>(rng() % rows);
  for (int64_t i = 1; i < n; i += 7) idx[i] = idx[0];  // duplicates, as make_index does
  return idx;
}

// ---- Row sizes x misaligned bases x index types ----

using RowParam = std::tuple<int64_t, bool>;

class GatherKernelRows : public ::testing::TestWithParam<RowParam> {};

// Like test_cuda_gather_matches_index_select: odd row sizes and offsets, both index types. The
// table base takes all 16 offsets against an aligned output, then both bases move: rows of a
// multiple of 16 bytes take every copy unit; other sizes mix units from row to row.
TEST_P(GatherKernelRows, MatchesCoreForMisalignedBases) {
  const auto [row_bytes, int64_index] = GetParam();
  std::vector<std::pair<size_t, size_t>> offsets;  // {table, output}
  for (size_t t = 0; t < 16; ++t) offsets.push_back({t, 0});
  for (auto both : {std::pair<size_t, size_t>{4, 12}, {3, 7}, {15, 1}, {9, 9}}) {
    offsets.push_back(both);
  }
  std::set<int> units;
  for (const auto& [table_offset, out_offset] : offsets) {
    SCOPED_TRACE("table offset " + std::to_string(table_offset) + ", out offset " +
                 std::to_string(out_offset));
    Case c;
    c.num_rows = 41;
    c.row_bytes = row_bytes;
    c.index = random_index(c.num_rows, 45, static_cast<uint32_t>(row_bytes));
    c.index[2] = 0;
    c.index[3] = c.num_rows - 1;
    c.int64_index = int64_index;
    c.table_offset = table_offset;
    c.out_offset = out_offset;
    const Outcome o = check_case(c);
    units.insert(o.units.begin(), o.units.end());
    if (HasFailure()) return;
  }
  EXPECT_EQ(units, (std::set<int>{1, 2, 4, 8, 16})) << "not every copy unit was exercised";
}

std::string row_name(const ::testing::TestParamInfo<RowParam>& info) {
  return "Row" + std::to_string(std::get<0>(info.param)) + "B_" +
         (std::get<1>(info.param) ? "Int64" : "Int32");
}

INSTANTIATE_TEST_SUITE_P(RowSizes, GatherKernelRows,
                         ::testing::Combine(::testing::Values(1, 3, 7, 16, 130, 512, 1000, 4096,
                                                              4100),
                                            ::testing::Bool()),
                         row_name);

// ---- Index patterns ----

TEST(GatherKernel, SortedUnsortedAndRepeatedIndices) {
  const int64_t rows = 97, n = 120;
  std::vector<std::pair<std::string, std::vector<int64_t>>> patterns;
  std::vector<int64_t> v = random_index(rows, n, 5);
  patterns.push_back({"random with duplicates", v});
  std::sort(v.begin(), v.end());
  patterns.push_back({"sorted", v});
  std::reverse(v.begin(), v.end());
  patterns.push_back({"reverse sorted", v});
  patterns.push_back({"one row repeated", std::vector<int64_t>(n, 42)});
  std::vector<int64_t> ends(n);
  for (int64_t i = 0; i < n; ++i) ends[i] = i % 2 ? rows - 1 : 0;
  patterns.push_back({"first and last rows", ends});
  for (const auto& [name, index] : patterns) {
    for (int64_t rb : {12, 130, 2048}) {
      for (bool int64_index : {false, true}) {
        SCOPED_TRACE(name + ", row bytes " + std::to_string(rb) +
                     (int64_index ? ", int64" : ", int32"));
        Case c;
        c.num_rows = rows;
        c.row_bytes = rb;
        c.index = index;
        c.int64_index = int64_index;
        c.table_offset = 5;
        check_case(c);
        if (HasFailure()) return;
      }
    }
  }
}

// More groups of rows than the grid holds (the simulator reports few SMs): every group loops.
TEST(GatherKernel, MoreRowsThanTheGridLoopsOverThem) {
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  const int64_t max_blocks = int64_t{sms} * 16;  // gather.cu's grid cap
  // Warp per row: one warp per row up to 512 bytes (8 rows per block), a whole block per row
  // above 3.5 KiB. Grouped: 32 entries per warp, 256 per block, whatever the row size.
  struct Shape {
    int64_t row_bytes, per_block;
    cuda::GatherKernel kernel;
    size_t offset;
  };
  const Shape shapes[] = {{7, 8, cuda::GatherKernel::kWarpPerRow, 1},
                          {4100, 1, cuda::GatherKernel::kAuto, 1},
                          {7, 256, cuda::GatherKernel::kGrouped, 1},
                          {64, 256, cuda::GatherKernel::kGrouped, 0}};
  for (const Shape& shape : shapes) {
    const int64_t n = 2 * max_blocks * shape.per_block + 5;
    SCOPED_TRACE("row bytes " + std::to_string(shape.row_bytes) + ", rows " + std::to_string(n));
    for (Order order : {Order::kNone, Order::kShuffled}) {
      Case c;
      c.num_rows = 300;
      c.row_bytes = shape.row_bytes;
      c.index = random_index(c.num_rows, n, 9);
      c.table_offset = shape.offset;
      c.out_offset = shape.offset;
      c.kernel = shape.kernel;
      c.order = order;
      check_case(c);
    }
  }
}

// ---- GPU cache ----

// Like test_cuda_gather_with_cache: hot rows come from the cache table; slot -1 (and any negative
// slot) and slots >= cache_rows read the host table.
TEST(GatherKernel, CachedRowsComeFromTheCacheTable) {
  const int64_t rows = 200, cache_rows = 40;
  for (int64_t rb : {3, 130, 512, 4100}) {
    for (bool int64_index : {false, true}) {
      SCOPED_TRACE("row bytes " + std::to_string(rb) + (int64_index ? ", int64" : ", int32"));
      Case c;
      c.num_rows = rows;
      c.row_bytes = rb;
      c.int64_index = int64_index;
      c.cache_rows = cache_rows;
      c.cache_slot.assign(rows, -1);
      for (int64_t r = 0; r < rows; r += 5) c.cache_slot[r] = static_cast<int32_t>(r / 5);
      c.cache_slot[1] = static_cast<int32_t>(cache_rows);     // ignored: >= cache_rows
      c.cache_slot[2] = std::numeric_limits<int32_t>::max();  // ignored
      c.cache_slot[3] = -7;                                   // not cached
      c.cache_slot[199] = static_cast<int32_t>(cache_rows - 1);
      c.index = random_index(rows, 60, 3);
      for (int64_t i = 0; i < 6; ++i) c.index[10 + i] = i;
      c.index[16] = 199;
      c.table_offset = 1;
      c.cache_offset = 8;
      c.out_offset = 4;
      check_case(c);
      if (HasFailure()) return;
    }
  }
}

// ---- Empty index ----

TEST(GatherKernel, EmptyIndexIsANoOp) {
  cuda::GatherArgs a;
  a.num_rows = 10;
  a.row_bytes = 8;
  EXPECT_EQ(cuda::gather_rows(a, nullptr), cudaSuccess);  // null index and output

  for (Report report : {Report::kFirstBad, Report::kBadPair, Report::kBoth}) {
    Case c;
    c.num_rows = 10;
    c.row_bytes = 8;
    c.report = report;
    check_case(c);
  }
}

// ---- Out-of-range indices ----

// Bad values at positions 5 (= num_rows), 9 (-1), 40, 77, 150 and the last; the rest good.
std::vector<int64_t> index_with_bad(int64_t rows, int64_t n, bool int64_index) {
  std::vector<int64_t> idx = random_index(rows, n, 31);
  const int64_t lo =
      int64_index ? std::numeric_limits<int64_t>::min() : std::numeric_limits<int32_t>::min();
  const int64_t hi =
      int64_index ? std::numeric_limits<int64_t>::max() : std::numeric_limits<int32_t>::max();
  idx[5] = rows;
  idx[9] = -1;
  idx[40] = lo;
  idx[77] = hi;
  idx[150] = rows + 1000;
  idx[n - 1] = -rows;
  return idx;
}

class GatherKernelBadIndex : public ::testing::TestWithParam<bool> {};

// first_bad gets the smallest bad position (atomicMin over all groups), the bad rows stay
// unwritten, the good ones are copied (checked against core, which does the same). Rows of zero
// bytes (a table with no feature columns) still have their indices checked, as core does.
TEST_P(GatherKernelBadIndex, FirstBadIsTheSmallestBadPosition) {
  const bool int64_index = GetParam();
  for (int64_t rb : {0, 24, 1000}) {
    SCOPED_TRACE("row bytes " + std::to_string(rb));
    Case c;
    c.num_rows = 50;
    c.row_bytes = rb;
    c.int64_index = int64_index;
    c.index = index_with_bad(c.num_rows, 200, int64_index);
    check_case(c);
    // Only the last position bad, then only the first.
    c.index = random_index(c.num_rows, 200, 4);
    c.index[199] = c.num_rows;
    check_case(c);
    c.index[0] = -3;
    check_case(c);
  }
}

// Every index out of range: all the grid's blocks (on several host threads) contend for
// first_bad and bad_pair at once, and first_bad must still be position 0.
TEST_P(GatherKernelBadIndex, EveryIndexOutOfRangeInEveryBlock) {
  Case c;
  c.num_rows = 10;
  c.row_bytes = 16;
  c.int64_index = GetParam();
  c.report = Report::kBoth;
  for (int64_t i = 0; i < 3000; ++i) c.index.push_back(i % 2 ? -1 - i : c.num_rows + i);
  check_case(c);
}

// Deferred mode: bad_pair holds the position and value of one bad index. Many bad indices in
// different blocks (run on different host threads) race for it; the pair must stay consistent.
TEST_P(GatherKernelBadIndex, BadPairHoldsOneConsistentPair) {
  const bool int64_index = GetParam();
  Case c;
  c.num_rows = 64;
  c.row_bytes = 8;
  c.int64_index = int64_index;
  c.report = Report::kBadPair;
  c.index = random_index(c.num_rows, 300, 8);
  // Each bad value names its position, so a pair mixed from two writers would show.
  for (int64_t i = 3; i < 300; i += 11) c.index[i] = i % 2 ? c.num_rows + i : -i;
  for (int run = 0; run < 5; ++run) {
    SCOPED_TRACE("run " + std::to_string(run));
    check_case(c);
  }
  c.report = Report::kBoth;
  check_case(c);
  c.index = index_with_bad(c.num_rows, 300, int64_index);
  check_case(c);
}

// An unreported pair from an earlier call is kept; the good rows are still copied.
TEST_P(GatherKernelBadIndex, BadPairIsNotOverwritten) {
  const bool int64_index = GetParam();
  Case c;
  c.num_rows = 64;
  c.row_bytes = 130;
  c.int64_index = int64_index;
  c.index = index_with_bad(c.num_rows, 200, int64_index);
  c.bad_pair_before[0] = 3;
  c.bad_pair_before[1] = 77;
  for (Report report : {Report::kBadPair, Report::kBoth}) {
    c.report = report;
    check_case(c);
  }
  // No bad index: an empty pair stays empty.
  c.index = random_index(c.num_rows, 200, 6);
  c.bad_pair_before[0] = kNone;
  c.report = Report::kBadPair;
  check_case(c);
}

// Without first_bad or bad_pair the kernel still skips bad rows.
TEST_P(GatherKernelBadIndex, BadRowsAreSkippedWithoutReporting) {
  Case c;
  c.num_rows = 50;
  c.row_bytes = 7;
  c.int64_index = GetParam();
  c.index = index_with_bad(c.num_rows, 200, c.int64_index);
  c.report = Report::kNone;
  check_case(c);
}

INSTANTIATE_TEST_SUITE_P(IndexTypes, GatherKernelBadIndex, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Int64" : "Int32";
                         });

// ---- Kernels and processing orders ----

struct Variant {
  cuda::GatherKernel kernel;
  Order order;
  const char* name;
};

const Variant kVariants[] = {
    {cuda::GatherKernel::kWarpPerRow, Order::kNone, "Warp"},
    {cuda::GatherKernel::kWarpPerRow, Order::kSorted, "WarpSorted"},
    {cuda::GatherKernel::kWarpPerRow, Order::kShuffled, "WarpShuffled"},
    {cuda::GatherKernel::kGrouped, Order::kNone, "Grouped"},
    {cuda::GatherKernel::kGrouped, Order::kSorted, "GroupedSorted"},
    {cuda::GatherKernel::kGrouped, Order::kShuffled, "GroupedShuffled"},
};

using VariantParam = std::tuple<int, bool>;  // kVariants entry, int64 index

class GatherKernelVariants : public ::testing::TestWithParam<VariantParam> {
 protected:
  const Variant& variant() const { return kVariants[std::get<0>(GetParam())]; }
  bool int64_index() const { return std::get<1>(GetParam()); }
  Case make_case(int64_t rows, int64_t row_bytes) const {
    Case c;
    c.num_rows = rows;
    c.row_bytes = row_bytes;
    c.int64_index = int64_index();
    c.kernel = variant().kernel;
    c.order = variant().order;
    return c;
  }
};

using PlanKey = std::tuple<bool, int, bool>;  // grouped, lanes, aligned

// Rows of 0 B to 4 KiB + 4: every lane count of the grouped kernel, odd sizes, both sides of its
// 512-byte limit; bases aligned (the batched 16-byte path) and misaligned (any unit). 70
// entries: two whole warp rounds and a partial one. Then checks which shapes ran.
TEST_P(GatherKernelVariants, MatchesCoreForEveryRowSize) {
  std::set<PlanKey> plans;
  for (int64_t rb : {0,   1,   3,   8,   12,  16,  24,  32,  48,   64,   100,
                     128, 130, 192, 256, 500, 512, 513, 528, 1000, 2048, 4100}) {
    for (auto [table_offset, out_offset] :
         {std::pair<size_t, size_t>{0, 0}, {16, 32}, {8, 0}, {0, 4}, {3, 7}, {15, 1}}) {
      SCOPED_TRACE("row bytes " + std::to_string(rb) + ", table offset " +
                   std::to_string(table_offset) + ", out offset " + std::to_string(out_offset));
      Case c = make_case(37, rb);
      c.index = random_index(c.num_rows, 70, static_cast<uint32_t>(rb + 1));
      c.index[2] = 0;
      c.index[3] = c.num_rows - 1;
      c.table_offset = table_offset;
      c.out_offset = out_offset;
      const Outcome o = check_case(c);
      plans.insert({o.plan.grouped, o.plan.lanes, o.plan.aligned});
      if (HasFailure()) return;
    }
  }
  const bool grouped = variant().kernel == cuda::GatherKernel::kGrouped;
  for (int lanes : {1, 2, 4, 8, 16, 32}) {  // every batched shape, and the unaligned ones
    EXPECT_EQ(plans.count({true, lanes, true}), grouped ? 1u : 0u) << lanes << " lanes, aligned";
  }
  for (int lanes : {16, 32}) {
    EXPECT_EQ(plans.count({true, lanes, false}), grouped ? 1u : 0u) << lanes << " lanes";
  }
  // Warp per row: 1 (grouped: none, rows up to 512 bytes are its own), 2, 4 and 8 warps.
  EXPECT_EQ(plans.count({false, 32, false}), grouped ? 0u : 1u) << "one warp per row";
  for (int lanes : {64, 128, 256}) {
    EXPECT_EQ(plans.count({false, lanes, false}), 1u) << lanes << " lanes per row, warp per row";
  }
}

// first_bad (the smallest bad position, whatever the order), bad_pair and the skipped rows, as
// for the default kernel, in every reporting mode.
TEST_P(GatherKernelVariants, BadIndicesAreReportedByPosition) {
  for (int64_t rb : {0, 24, 64, 1000}) {
    for (Report report : {Report::kFirstBad, Report::kBadPair, Report::kBoth, Report::kNone}) {
      SCOPED_TRACE("row bytes " + std::to_string(rb) + ", report " +
                   std::to_string(static_cast<int>(report)));
      Case c = make_case(50, rb);
      c.report = report;
      c.index = index_with_bad(c.num_rows, 200, int64_index());
      check_case(c);
      c.index = random_index(c.num_rows, 200, 4);  // only the last position bad, then the first
      c.index[199] = c.num_rows;
      check_case(c);
      c.index[0] = -3;
      check_case(c);
      if (HasFailure()) return;
    }
  }
  Case c = make_case(64, 64);  // an unreported pair is kept
  c.index = index_with_bad(c.num_rows, 200, int64_index());
  c.bad_pair_before[0] = 3;
  c.bad_pair_before[1] = 77;
  c.report = Report::kBoth;
  check_case(c);
}

// Hot rows from the cache table, on aligned bases (the batched path reads the cache too) and
// with the cache alone misaligned (then no batching).
TEST_P(GatherKernelVariants, CachedRowsComeFromTheCacheTable) {
  const int64_t rows = 200, cache_rows = 40;
  for (int64_t rb : {3, 64, 130, 256, 512, 4100}) {
    for (size_t cache_offset : {0, 8}) {
      SCOPED_TRACE("row bytes " + std::to_string(rb) + ", cache offset " +
                   std::to_string(cache_offset));
      Case c = make_case(rows, rb);
      c.cache_rows = cache_rows;
      c.cache_slot.assign(rows, -1);
      for (int64_t r = 0; r < rows; r += 5) c.cache_slot[r] = static_cast<int32_t>(r / 5);
      c.cache_slot[1] = static_cast<int32_t>(cache_rows);  // ignored: >= cache_rows
      c.cache_slot[3] = -7;                                // not cached
      c.cache_slot[199] = static_cast<int32_t>(cache_rows - 1);
      c.index = random_index(rows, 90, 3);
      for (int64_t i = 0; i < 6; ++i) c.index[10 + i] = i;
      c.index[16] = 199;
      c.index[17] = 40;  // slot 8
      c.cache_offset = cache_offset;
      const Outcome o = check_case(c);
      if (variant().kernel == cuda::GatherKernel::kGrouped && rb % 16 == 0 && rb <= 512) {
        EXPECT_EQ(o.plan.aligned, cache_offset == 0);
      }
      if (HasFailure()) return;
    }
  }
}

std::string variant_name(const ::testing::TestParamInfo<VariantParam>& info) {
  return std::string(kVariants[std::get<0>(info.param)].name) +
         (std::get<1>(info.param) ? "_Int64" : "_Int32");
}

INSTANTIATE_TEST_SUITE_P(Kernels, GatherKernelVariants,
                         ::testing::Combine(::testing::Range(0, 6), ::testing::Bool()),
                         variant_name);

// The default picks the grouped kernel up to 512-byte rows, warp per row above.
TEST(GatherKernel, AutoIsGroupedUpTo512ByteRows) {
  cuda::GatherArgs a;
  for (int64_t rb : {0, 64, 512, 513}) {
    a.row_bytes = rb;
    EXPECT_EQ(cuda::plan_gather(a).grouped, rb <= 512) << rb;
  }
  a.row_bytes = 64;
  a.kernel = cuda::GatherKernel::kWarpPerRow;
  EXPECT_FALSE(cuda::plan_gather(a).grouped);
}

}  // namespace
}  // namespace tierlift
