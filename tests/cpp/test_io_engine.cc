// Engine tests, run once per backend (threads, io_uring). io_uring cases skip cleanly where the
// kernel or the sandbox forbids it.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/io/engine.h"
#include "io_test_util.h"

namespace tierlift::io {
namespace {

using iotest::make_temp_dir;
using iotest::random_bytes;

class IoEngineTest : public iotest::BackendDirTest {
 protected:
  std::unique_ptr<Engine> make(size_t block = 64 * 1024, int depth = 8, size_t pool = 1 << 20) {
    EngineOptions o;
    o.backend = GetParam();
    o.block_size = block;
    o.queue_depth = depth;
    o.pool_bytes = pool;
    return std::make_unique<Engine>(o);
  }
};

TEST_P(IoEngineTest, RoundTripRandomSizesAndAlignments) {
  auto eng = make();
  EXPECT_EQ(std::string(eng->backend_name()), GetParam() == "uring" ? "io_uring" : "threads");
  // Root has no RLIMIT_MEMLOCK cap, so the 1 MiB pool must register as a fixed buffer.
  if (GetParam() == "uring" && geteuid() == 0) {
    EXPECT_TRUE(eng->fixed_buffers());
  }
  if (GetParam() == "threads") {
    EXPECT_FALSE(eng->fixed_files());
  }
  std::mt19937 rng(7);
  const std::string path = dir_ + "/a.bin";
  for (int iter = 0; iter < 12; ++iter) {
    const size_t n = 1 + rng() % (300 * 1024);
    const size_t mis = iter % 3 == 0 ? 0 : 1 + rng() % 64;  // misaligned user buffers too
    const uint64_t off = (iter % 2 == 0) ? 4096 * (rng() % 8) : rng() % 10000;
    auto src = random_bytes(n + mis, iter);
    std::vector<unsigned char> dst(n + mis, 0);
    ASSERT_TRUE(eng->write(src.data() + mis, n, {path}, off)->wait().ok());
    IoStatus st = eng->read(dst.data() + mis, n, {path}, off)->wait();
    ASSERT_TRUE(st.ok()) << st.message("read");
    ASSERT_EQ(0, std::memcmp(src.data() + mis, dst.data() + mis, n)) << "iter " << iter;
  }
  IoStatus synced = eng->sync();
  EXPECT_TRUE(synced.ok()) << synced.message("sync");
  EXPECT_EQ(eng->pool().in_use(), 0u);
}

TEST_P(IoEngineTest, ManyRequestsInFlightAndStriping) {
  auto eng = make(16 * 1024, 16);
  const std::vector<std::string> paths = {dir_ + "/s0", dir_ + "/s1", dir_ + "/s2"};
  const size_t chunk = 48 * 1024;
  const int count = 64;
  void* mem = nullptr;
  ASSERT_EQ(posix_memalign(&mem, 4096, chunk * count), 0);
  std::unique_ptr<void, decltype(&std::free)> hold(mem, &std::free);
  auto* data = static_cast<unsigned char*>(mem);
  auto src = random_bytes(chunk * count, 3);
  std::memcpy(data, src.data(), src.size());
  std::vector<std::shared_ptr<IoRequest>> reqs;
  for (int i = 0; i < count; ++i)
    reqs.push_back(eng->write(data + i * chunk, chunk, paths, i * chunk));
  for (auto& r : reqs) ASSERT_TRUE(r->wait().ok());
  ASSERT_TRUE(eng->sync().ok());
  // Each stripe file holds a third of the data.
  for (const auto& p : paths) {
    struct stat s;
    ASSERT_EQ(stat(p.c_str(), &s), 0);
    EXPECT_EQ(static_cast<size_t>(s.st_size), chunk * count / 3);
    EXPECT_EQ(s.st_mode & 0777, 0600u);
  }
  std::memset(data, 0, chunk * count);
  reqs.clear();
  for (int i = 0; i < count; ++i)
    reqs.push_back(eng->read(data + i * chunk, chunk, paths, i * chunk));
  for (auto& r : reqs) ASSERT_TRUE(r->wait().ok());
  EXPECT_EQ(0, std::memcmp(data, src.data(), src.size()));
}

TEST_P(IoEngineTest, ReadPastEndOfFileFails) {
  auto eng = make();
  const std::string path = dir_ + "/short.bin";
  auto src = random_bytes(5000, 1);
  ASSERT_TRUE(eng->write(src.data(), src.size(), {path}, 0)->wait().ok());
  std::vector<unsigned char> dst(8192);
  IoStatus st = eng->read(dst.data(), dst.size(), {path}, 0)->wait();
  EXPECT_EQ(st.err, kErrEof);
  EXPECT_EQ(st.path, path);
  EXPECT_EQ(st.offset, 5000u);
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), 5000));  // what exists was read
}

TEST_P(IoEngineTest, OpenErrorsCarryErrnoAndPath) {
  auto eng = make();
  char b[16] = {};
  try {
    eng->read(b, sizeof(b), {dir_ + "/missing"}, 0);
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_EQ(e.err(), ENOENT);
    EXPECT_EQ(e.path(), dir_ + "/missing");
  }
  EXPECT_THROW(eng->write(b, sizeof(b), {dir_ + "/nodir/x"}, 0), IoError);
}

// A striped request whose second file cannot be opened keeps none of the first file's
// descriptors and does not leave that file behind when the request created it.
TEST_P(IoEngineTest, FailedStripeOpenKeepsNoDescriptorOfTheOthers) {
  auto eng = make();
  auto open_fds = [] {
    int n = 0;
    for (int fd = 0; fd < 4096; ++fd) n += ::fcntl(fd, F_GETFD) >= 0;
    return n;
  };
  const std::string first = dir_ + "/stripe0.bin";
  std::vector<unsigned char> b(8192, 1);
  const int before = open_fds();
  EXPECT_THROW(eng->write(b.data(), b.size(), {first, dir_ + "/nodir/stripe1.bin"}, 0), IoError);
  EXPECT_EQ(open_fds(), before);
  EXPECT_NE(::access(first.c_str(), F_OK), 0) << "the failed request left its new file behind";
  // A file that existed before the request stays.
  ASSERT_TRUE(eng->write(b.data(), b.size(), {first}, 0)->wait().ok());
  eng->forget(first);
  const int kept = open_fds();
  EXPECT_THROW(eng->write(b.data(), b.size(), {first, dir_ + "/nodir/stripe1.bin"}, 0), IoError);
  EXPECT_EQ(open_fds(), kept);
  EXPECT_EQ(::access(first.c_str(), F_OK), 0);
}

// Out of descriptors is an error that names the limit, never a "no O_DIRECT" fallback, and
// leaves no file and no cached descriptor behind.
TEST_P(IoEngineTest, TooManyOpenFilesIsAnErrorNotABufferedFallback) {
  auto eng = make();
  eng->take_warnings();
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  int top = 0;
  for (int fd = 0; fd < 4096; ++fd) {
    if (::fcntl(fd, F_GETFD) >= 0) top = fd;
  }
  struct rlimit low = old;
  low.rlim_cur = static_cast<rlim_t>(top + 16);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<int> held;
  for (int fd; (fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) held.push_back(fd);
  ASSERT_EQ(errno, EMFILE);
  const std::string path = dir_ + "/state.bin";
  std::vector<unsigned char> b(8192, 1);
  std::vector<std::string> messages;
  for (int free_slots : {1, 0}) {  // the O_DIRECT open fails, then the buffered one
    if (free_slots == 1) {
      ::close(held.back());
      held.pop_back();
    } else {
      held.push_back(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    }
    try {
      eng->write(b.data(), b.size(), {path}, 0);
      ADD_FAILURE() << "expected IoError with " << free_slots << " free descriptor(s)";
    } catch (const IoError& e) {
      EXPECT_EQ(e.err(), EMFILE);
      EXPECT_EQ(e.path(), path);
      messages.push_back(e.what());
    }
    EXPECT_NE(::access(path.c_str(), F_OK), 0) << "a failed open left the file behind";
  }
  for (int fd : held) ::close(fd);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &old), 0);
  for (const auto& m : messages) {
    EXPECT_NE(m.find(path), std::string::npos) << m;
    EXPECT_NE(m.find("RLIMIT_NOFILE = " + std::to_string(top + 16)), std::string::npos) << m;
    EXPECT_NE(m.find("ulimit -n"), std::string::npos) << m;
  }
  EXPECT_TRUE(eng->take_warnings().empty());
  ASSERT_TRUE(eng->write(b.data(), b.size(), {path}, 0)->wait().ok());  // nothing was cached
}

TEST_P(IoEngineTest, DeviceFullIsEnospc) {
  auto eng = make();
  std::vector<unsigned char> b(8192, 1);
  IoStatus st = eng->write(b.data(), b.size(), {"/dev/full"}, 0)->wait();
  EXPECT_EQ(st.err, ENOSPC);
  EXPECT_EQ(st.path, "/dev/full");
  // /dev/full refuses O_DIRECT with EINVAL at open: the buffered fallback warns once.
  auto w = eng->take_warnings();
  ASSERT_EQ(w.size(), 1u);
  EXPECT_NE(w[0].find("O_DIRECT"), std::string::npos);
}

TEST_P(IoEngineTest, TmpfsFallsBackToBufferedWithWarning) {
  const std::string shm = make_temp_dir("/dev/shm");
  if (shm.empty()) GTEST_SKIP() << "/dev/shm not available";
  const std::string probe = shm + "/probe";
  const int fd = ::open(probe.c_str(), O_CREAT | O_RDWR | O_DIRECT, 0600);
  if (fd >= 0) {  // tmpfs has O_DIRECT since Linux 6.6
    ::close(fd);
    std::string cmd = "rm -rf '" + shm + "'";
    ASSERT_EQ(std::system(cmd.c_str()), 0);
    GTEST_SKIP() << "tmpfs supports O_DIRECT on this kernel; the fallback cannot be provoked";
  }
  auto eng = make();
  eng->take_warnings();
  auto src = random_bytes(10000, 9);
  std::vector<unsigned char> dst(10000);
  ASSERT_TRUE(eng->write(src.data(), src.size(), {shm + "/t"}, 0)->wait().ok());
  ASSERT_TRUE(eng->read(dst.data(), dst.size(), {shm + "/t"}, 0)->wait().ok());
  EXPECT_EQ(src, dst);
  auto w = eng->take_warnings();
  ASSERT_EQ(w.size(), 1u);
  EXPECT_NE(w[0].find("O_DIRECT"), std::string::npos);
  std::string cmd = "rm -rf '" + shm + "'";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
}

TEST_P(IoEngineTest, ForgetReleasesDescriptorsForReuse) {
  // Descriptor numbers are reused after forget(); a stale fixed-file entry would send the
  // second file's I/O to the first file.
  auto eng = make();
  for (int i = 0; i < 40; ++i) {
    const std::string p = dir_ + "/f" + std::to_string(i);
    auto src = random_bytes(8192, i);
    ASSERT_TRUE(eng->write(src.data(), src.size(), {p}, 0)->wait().ok());
    eng->forget(p);
    std::vector<unsigned char> dst(8192);
    ASSERT_TRUE(eng->read(dst.data(), dst.size(), {p}, 0)->wait().ok());
    eng->forget(p);
    ASSERT_EQ(src, dst) << i;
  }
}

// An ordinary buffer (1 byte past alignment: too loose for any drive's O_DIRECT) far larger
// than the pool streams through it block by block, every byte still O_DIRECT.
TEST_P(IoEngineTest, LooselyAlignedMemoryIsStagedThroughASmallPool) {
  const size_t block = 64 * 1024, n = 8 << 20;
  auto eng = make(block, /*depth=*/16, /*pool=*/4 * block);  // fewer pool blocks than the queue
  if (!eng->take_warnings().empty()) GTEST_SKIP() << "no O_DIRECT here";
  auto src = random_bytes(n + 1, 11);
  std::vector<unsigned char> dst(n + 1, 0);
  const std::string path = dir_ + "/staged.bin";
  ASSERT_TRUE(eng->write(src.data() + 1, n, {path}, 0)->wait().ok());
  ASSERT_TRUE(eng->take_warnings().empty()) << "the file system refused O_DIRECT";
  ASSERT_TRUE(eng->read(dst.data() + 1, n, {path}, 0)->wait().ok());
  EXPECT_EQ(0, std::memcmp(src.data() + 1, dst.data() + 1, n));
  const PathBytes& b = eng->path_bytes();
  EXPECT_EQ(b.direct.load(), 0u);
  EXPECT_EQ(b.buffered.load() + b.staged.load(), 2 * n);
  // io_uring waits for its own staged blocks to return pool memory; the thread backend (a
  // fallback) sends a block through the page cache when the pool is short.
  if (GetParam() == "uring") {
    EXPECT_EQ(b.staged.load(), 2 * n);
  }
  EXPECT_GT(b.staged.load(), 0u);
  EXPECT_TRUE(eng->sync().ok());
  EXPECT_EQ(eng->pool().in_use(), 0u);
}

// With the whole pool held by the caller, staging would wait forever: those blocks go through
// the page cache instead, and the data is still right.
TEST_P(IoEngineTest, StagingNeverWaitsOnAPoolHeldByTheCaller) {
  const size_t block = 64 * 1024, n = 1 << 20;
  auto eng = make(block, 8, 2 * block);
  void* held = eng->pool().acquire(2 * block);
  auto src = random_bytes(n + 3, 12);
  std::vector<unsigned char> dst(n + 3, 0);
  const std::string path = dir_ + "/held.bin";
  ASSERT_TRUE(eng->write(src.data() + 3, n, {path}, 0)->wait().ok());
  ASSERT_TRUE(eng->read(dst.data() + 3, n, {path}, 0)->wait().ok());
  EXPECT_EQ(0, std::memcmp(src.data() + 3, dst.data() + 3, n));
  EXPECT_EQ(eng->path_bytes().buffered.load(), 2 * n);
  eng->pool().release(held);
  EXPECT_EQ(eng->pool().in_use(), 0u);
}

// Aligned user memory goes to the drive in place; a request tail below a page goes through the
// page cache on its own, so the rest of its block stays direct.
TEST_P(IoEngineTest, AlignedMemoryIsDirectAndOnlyTheTailIsBuffered) {
  auto eng = make(64 * 1024, 8, 1 << 20);
  if (!eng->take_warnings().empty()) GTEST_SKIP() << "no O_DIRECT here";
  const size_t n = 3 * 64 * 1024 + 100;
  void* mem = nullptr;
  ASSERT_EQ(posix_memalign(&mem, 4096, n), 0);
  std::unique_ptr<void, decltype(&std::free)> owned(mem, &std::free);
  auto src = random_bytes(n, 13);
  std::memcpy(mem, src.data(), n);
  const std::string path = dir_ + "/direct.bin";
  ASSERT_TRUE(eng->write(mem, n, {path}, 8192)->wait().ok());
  ASSERT_TRUE(eng->take_warnings().empty()) << "the file system refused O_DIRECT";
  std::memset(mem, 0, n);
  ASSERT_TRUE(eng->read(mem, n, {path}, 8192)->wait().ok());
  EXPECT_EQ(0, std::memcmp(mem, src.data(), n));
  EXPECT_EQ(eng->path_bytes().direct.load(), 2 * (n - 100));
  EXPECT_EQ(eng->path_bytes().buffered.load(), 2 * 100u);
  EXPECT_TRUE(eng->sync().ok());
}

TEST_P(IoEngineTest, ZeroLengthRequestCompletes) {
  auto eng = make();
  auto r = eng->write(nullptr, 0, {dir_ + "/z"}, 0);
  EXPECT_TRUE(r->wait().ok());
  EXPECT_TRUE(r->done());
}

TEST_P(IoEngineTest, BufferedModeRoundTrip) {
  EngineOptions o;
  o.backend = GetParam();
  o.direct = false;
  o.block_size = 8192;
  Engine eng(o);
  auto src = random_bytes(50001, 4);
  std::vector<unsigned char> dst(src.size());
  ASSERT_TRUE(eng.write(src.data(), src.size(), {dir_ + "/b"}, 123)->wait().ok());
  ASSERT_TRUE(eng.read(dst.data(), dst.size(), {dir_ + "/b"}, 123)->wait().ok());
  EXPECT_EQ(src, dst);
}

TEST_P(IoEngineTest, UseAfterCloseAndBadOptions) {
  auto eng = make();
  eng->close();
  eng->close();
  char b[8];
  EXPECT_THROW(eng->read(b, 8, {dir_ + "/x"}, 0), std::logic_error);
  EngineOptions o;
  o.backend = GetParam();
  o.block_size = 1000;
  EXPECT_THROW(Engine{o}, std::invalid_argument);
  o.block_size = 4096;
  o.backend = "bogus";
  EXPECT_THROW(Engine{o}, std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(Backends, IoEngineTest, ::testing::Values("threads", "uring"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace tierlift::io
