// The io_uring backend. One ring with a fixed queue depth, owned by one thread that both submits
// and reaps: it fills the submission queue from a pending list, submits the whole batch with one
// io_uring_submit_and_wait, then reaps every ready completion in one pass (no syscall per
// request). Short transfers and -EAGAIN are resubmitted for the rest of the block. New work wakes
// the thread through an eventfd polled inside the same ring, so the thread never spins.
//
// Staged blocks (core/io/staging.h) are copied by a Copier, never by the ring thread: a staged
// write takes its pool buffer on the ring thread, is copied in on the copier threads and comes
// back through `ready_` to be submitted; a staged read's bytes are copied out on the copier
// threads after its completion, and only then is the block reported done. The ring slot is freed
// as soon as the kernel is done with it, so copies overlap with the I/O of other blocks.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "core/io/backend.h"
#include "core/io/copier.h"
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
  explicit UringBackend(const BackendOptions& opts)
      : depth_(std::max(1, opts.queue_depth)),
        copier_(std::make_unique<Copier>(opts.copy_threads > 0 ? opts.copy_threads
                                                               : Copier::default_threads())) {
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
    thread_.join();   // returns once no staged block is left with the copier
    copier_.reset();  // joins the copier threads, whose last continuations may still be running
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
    finish(std::move(op), st);
    return true;
  }

  // Reports a block's completion; a staged read's bytes are copied out first, on the copier.
  // Runs on the ring thread without mu_ held.
  void finish(BlockOp op, const IoStatus& st) {
    if (!stage_holds_buffer(op)) {
      auto req = std::move(op.req);
      req->complete_one(st);
      return;
    }
    if (op.is_write) {
      stage_release(op);
      {
        std::lock_guard<std::mutex> lock(mu_);
        --staged_held_;
      }
      auto req = std::move(op.req);
      req->complete_one(st);
      return;
    }
    char* from = op.buf;
    char* to = op.user;
    const uint64_t n = op.done;  // after a failure: the bytes that did arrive
    copier_->copy(to, from, n, [this, op = std::move(op), st]() mutable {
      stage_release(op);
      {
        std::lock_guard<std::mutex> lock(mu_);
        --staged_held_;
      }
      wake();  // pool memory is free again: a waiting staged block may start
      auto req = std::move(op.req);
      req->complete_one(st);  // last: the engine may be closed and destroyed once it returns
    });
  }

  // Hands a staged write holding its pool buffer to the copier; once copied in it is queued for
  // submission ahead of new work.
  void copy_in(BlockOp op) {
    char* to = op.buf;
    const char* from = op.user;
    const uint64_t n = op.len;
    copier_->copy(to, from, n, [this, op = std::move(op)]() mutable {
      {
        std::lock_guard<std::mutex> lock(mu_);
        ready_.push_back(std::move(op));
      }
      wake();
    });
  }

  // Puts an op into a free ring slot and prepares its SQE. Called with mu_ held.
  void start(BlockOp op) {
    const int slot = free_slots_.back();
    free_slots_.pop_back();
    slots_[slot] = std::move(op);
    prep(slot);
  }

  void loop() {
    arm_wake_poll();
    std::vector<int> retry;
    std::vector<BlockOp> to_copy;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (int slot : retry) prep(slot);
        retry.clear();
        // Copied-in writes first: they already hold pool memory.
        while (!free_slots_.empty() && !ready_.empty()) {
          start(std::move(ready_.front()));
          ready_.pop_front();
        }
        while (!pending_.empty()) {
          BlockOp& op = pending_.front();
          // A staged write is copied in while the ring is full; anything else needs a slot.
          if (!(op.staged() && op.is_write) && free_slots_.empty()) break;
          // A staged op waits for pool memory only while ours (in the ring or with the copier)
          // will release some.
          if (stage_acquire(op, staged_held_ > 0) == Stage::kWait) break;
          if (stage_holds_buffer(op)) ++staged_held_;
          if (stage_holds_buffer(op) && op.is_write) {
            to_copy.push_back(std::move(op));  // takes a slot once its bytes are in
          } else if (free_slots_.empty()) {
            break;  // a staged write sent to the page cache instead: it waits for a slot
          } else {
            start(std::move(op));
          }
          pending_.pop_front();
        }
        if (stop_ && pending_.empty() && ready_.empty() && staged_held_ == 0 &&
            free_slots_.size() == static_cast<size_t>(depth_)) {
          return;
        }
      }
      for (auto& op : to_copy) copy_in(std::move(op));
      to_copy.clear();
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
  std::deque<BlockOp> ready_;  // staged writes copied in, waiting for a slot (guarded by mu_)
  int staged_held_ = 0;  // staged ops holding pool buffers, wherever they are (guarded by mu_)
  bool stop_ = false;
  std::unique_ptr<Copier> copier_;
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
