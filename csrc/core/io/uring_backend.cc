// The io_uring backend. One ring with a fixed queue depth, owned by one thread that both submits
// and reaps: it fills the submission queue from a pending list, submits the whole batch with one
// io_uring_submit_and_wait, then reaps every ready completion in one pass (no syscall per
// request). Short transfers and -EAGAIN are resubmitted for the rest of the block. New work wakes
// the thread through an eventfd polled inside the same ring, so the thread never spins.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "core/io/backend.h"
#include "core/io/staging.h"

#ifdef TIERLIFT_HAVE_URING
#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>

#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#endif

namespace tierlift::io {

namespace {
// Plain read(2), not std::ifstream: a toolchain that links libstdc++ statically into the
// extension can leave its stream locale half-bound to the process's libstdc++ (seen as a crash
// in codecvt on a GPU machine's compiler).
[[maybe_unused]] std::string disabled_by_sysctl() {
  const int fd = open("/proc/sys/kernel/io_uring_disabled", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  char c = 0;
  const bool two = read(fd, &c, 1) == 1 && c == '2';
  close(fd);
  return two ? "io_uring is disabled by /proc/sys/kernel/io_uring_disabled=2" : "";
}
}  // namespace

#ifdef TIERLIFT_HAVE_URING
namespace {

constexpr uint64_t kWakeTag = ~0ull;
constexpr unsigned kFixedFiles = 256;  // sparse fixed-file table; further files use plain fds

class UringBackend final : public IoBackend {
 public:
  explicit UringBackend(const BackendOptions& opts) : depth_(std::max(1, opts.queue_depth)) {
    io_uring_params params{};
    if (opts.sqpoll) {
      params.flags |= IORING_SETUP_SQPOLL;
      params.sq_thread_idle = 50;
    }
    // One extra entry for the eventfd poll.
    int r = io_uring_queue_init_params(static_cast<unsigned>(depth_ + 1), &ring_, &params);
    if (r < 0)
      throw IoError(-r, "io_uring", 0, std::string("io_uring_queue_init: ") + std::strerror(-r));
    efd_ = eventfd(0, EFD_CLOEXEC);
    if (efd_ < 0) {
      const int e = errno;
      io_uring_queue_exit(&ring_);
      throw IoError(e, "eventfd", 0, std::string("eventfd: ") + std::strerror(e));
    }
    if (opts.fixed_base != nullptr) {  // before the ring thread starts: no concurrent enter
      iovec iov{opts.fixed_base, opts.fixed_len};
      fixed_ = io_uring_register_buffers(&ring_, &iov, 1) == 0;
    }
    // Sparse file table (Linux 5.19+); descriptors are installed on first use.
    if (io_uring_register_files_sparse(&ring_, kFixedFiles) == 0) {
      for (int i = kFixedFiles - 1; i >= 0; --i) free_file_slots_.push_back(i);
      fixed_files_ = true;
    }
    slots_.resize(depth_);
    for (int i = depth_ - 1; i >= 0; --i) free_slots_.push_back(i);
    thread_ = std::thread([this] { loop(); });
  }

  ~UringBackend() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake();
    thread_.join();
    io_uring_queue_exit(&ring_);
    close(efd_);
  }

  const char* name() const override { return "io_uring"; }

  void submit(std::vector<BlockOp> ops) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& op : ops) pending_.push_back(std::move(op));
    }
    wake();
  }

  bool fixed_buffers() const override { return fixed_; }
  bool fixed_files() const override { return fixed_files_; }

  void release_fd(int fd) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = file_slot_.find(fd);
    if (it == file_slot_.end()) return;
    int none = -1;
    io_uring_register_files_update(&ring_, static_cast<unsigned>(it->second), &none, 1);
    free_file_slots_.push_back(it->second);
    file_slot_.erase(it);
  }

 private:
  void wake() {
    uint64_t one = 1;
    ssize_t n = write(efd_, &one, sizeof(one));
    (void)n;  // an eventfd write only fails on counter overflow, which still wakes the reader
  }

  void arm_wake_poll() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    io_uring_prep_poll_add(sqe, efd_, POLLIN);
    io_uring_sqe_set_data64(sqe, kWakeTag);
  }

  // Fixed-file index of fd, installing it on first use; -1 when the table is full or absent.
  // Called with mu_ held.
  int fixed_file(int fd) {
    if (!fixed_files_) return -1;
    auto it = file_slot_.find(fd);
    if (it != file_slot_.end()) return it->second;
    if (free_file_slots_.empty()) return -1;
    const int idx = free_file_slots_.back();
    if (io_uring_register_files_update(&ring_, static_cast<unsigned>(idx), &fd, 1) != 1) return -1;
    free_file_slots_.pop_back();
    file_slot_[fd] = idx;
    return idx;
  }

  void prep(int slot) {
    BlockOp& op = slots_[slot];
    const uint64_t left = op.len - op.done;
    const uint64_t off = op.offset + op.done;
    const bool direct_ok = op.direct_now();
    const int fd = direct_ok || op.buffered_fd < 0 ? op.fd : op.buffered_fd;
    const unsigned n = static_cast<unsigned>(left);
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    char* buf = op.buf + op.done;
    if (op.fixed_index >= 0 && fixed_) {
      if (op.is_write)
        io_uring_prep_write_fixed(sqe, fd, buf, n, off, op.fixed_index);
      else
        io_uring_prep_read_fixed(sqe, fd, buf, n, off, op.fixed_index);
    } else if (op.is_write) {
      io_uring_prep_write(sqe, fd, buf, n, off);
    } else {
      io_uring_prep_read(sqe, fd, buf, n, off);
    }
    const int file_index = fixed_file(fd);
    if (file_index >= 0) {
      sqe->fd = file_index;
      sqe->flags |= IOSQE_FIXED_FILE;
    }
    io_uring_sqe_set_data64(sqe, static_cast<uint64_t>(slot));
  }

  // Returns true when the op is finished (ok or failed), false when it must be resubmitted.
  bool on_complete(int slot, int res) {
    BlockOp& op = slots_[slot];
    if (res == -EAGAIN || res == -EINTR) return false;
    if (res == -EINVAL && op.direct_now() && op.buffered_fd >= 0) {
      op.direct = false;  // the drive refused this alignment after all: the page cache can't
      return false;
    }
    IoStatus st;
    if (res < 0) {
      st = op.error(-res);
    } else if (res == 0) {
      st = op.error(op.is_write ? ENOSPC : kErrEof);
    } else {
      op.done += static_cast<uint64_t>(res);
      if (op.done < op.len) return false;
    }
    if (op.staged()) {
      stage_end(op);
      --staged_inflight_;
    }
    auto req = std::move(op.req);
    req->complete_one(st);
    return true;
  }

  void loop() {
    arm_wake_poll();
    std::vector<int> retry;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (int slot : retry) prep(slot);
        retry.clear();
        while (!free_slots_.empty() && !pending_.empty()) {
          // A staged op waits for pool memory only while ours in flight will release some.
          if (stage_begin(pending_.front(), staged_inflight_ > 0) == Stage::kWait) break;
          if (pending_.front().staged()) ++staged_inflight_;
          const int slot = free_slots_.back();
          free_slots_.pop_back();
          slots_[slot] = std::move(pending_.front());
          pending_.pop_front();
          prep(slot);
        }
        if (stop_ && pending_.empty() && free_slots_.size() == static_cast<size_t>(depth_)) return;
      }
      int r = io_uring_submit_and_wait(&ring_, 1);
      if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY) {
        std::fprintf(stderr, "tierlift io_uring: submit failed: %s\n", std::strerror(-r));
      }
      io_uring_cqe* cqe;
      unsigned head, seen = 0;
      bool rearm = false;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        ++seen;
        const uint64_t tag = io_uring_cqe_get_data64(cqe);
        if (tag == kWakeTag) {
          uint64_t v;
          ssize_t n = read(efd_, &v, sizeof(v));
          (void)n;
          rearm = true;
          continue;
        }
        const int slot = static_cast<int>(tag);
        if (on_complete(slot, cqe->res)) {
          std::lock_guard<std::mutex> lock(mu_);
          free_slots_.push_back(slot);
        } else {
          retry.push_back(slot);
        }
      }
      io_uring_cq_advance(&ring_, seen);
      if (rearm) arm_wake_poll();
    }
  }

  const int depth_;
  io_uring ring_{};
  int efd_ = -1;
  bool fixed_ = false;
  bool fixed_files_ = false;
  std::unordered_map<int, int> file_slot_;  // fd -> fixed-file index (guarded by mu_)
  std::vector<int> free_file_slots_;
  std::vector<BlockOp> slots_;
  std::vector<int> free_slots_;
  std::mutex mu_;
  std::deque<BlockOp> pending_;
  int staged_inflight_ = 0;  // staged ops holding pool buffers (ring thread only)
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

std::unique_ptr<IoBackend> make_uring_backend(const BackendOptions& opts) {
  std::string why = disabled_by_sysctl();
  if (!why.empty()) throw IoError(EPERM, "io_uring", 0, why);
  return std::make_unique<UringBackend>(opts);
}

std::string uring_unavailable_reason() {
  std::string why = disabled_by_sysctl();
  if (!why.empty()) return why;
  io_uring ring;
  int r = io_uring_queue_init(4, &ring, 0);
  if (r < 0) return std::string("io_uring_queue_init failed: ") + std::strerror(-r);
  io_uring_queue_exit(&ring);
  return "";
}

#else  // !TIERLIFT_HAVE_URING

std::unique_ptr<IoBackend> make_uring_backend(const BackendOptions&) {
  throw std::runtime_error("tierlift was built without liburing (apt-get install liburing-dev)");
}

std::string uring_unavailable_reason() {
  return "tierlift was built without liburing (apt-get install liburing-dev and rebuild)";
}

#endif

}  // namespace tierlift::io
