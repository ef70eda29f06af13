// Engine: file table, request splitting/striping, bounce buffers and backend selection.
#include "core/io/engine.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace tierlift::io {

namespace {

std::string choose_backend(const EngineOptions& opts, std::string* warning) {
  std::string want = opts.backend;
  if (want == "auto") {
    const char* env = std::getenv("TIERLIFT_IO_BACKEND");
    if (env != nullptr && *env != '\0') want = env;
  }
  if (want != "auto" && want != "uring" && want != "threads") {
    throw std::invalid_argument("io backend must be auto, uring or threads (got '" + want +
                                "'; check TIERLIFT_IO_BACKEND)");
  }
  if (want != "auto") return want;
  const std::string why = uring_unavailable_reason();
  if (why.empty()) return "uring";
  *warning = "tierlift.io: io_uring is unavailable (" + why +
             "); using the pread/pwrite thread-pool backend, which is slower";
  return "threads";
}

int open_fd(const std::string& path, bool write, bool direct) {
  int flags = O_CLOEXEC | (write ? O_RDWR | O_CREAT : O_RDONLY) | (direct ? O_DIRECT : 0);
  int fd;
  do {
    fd = ::open(path.c_str(), flags, 0600);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// The file's O_DIRECT memory and offset alignment (Linux 6.1+ statx); 4 KiB when unknown.
void query_dio_align(int fd, uint32_t* mem_align, uint32_t* offset_align) {
  *mem_align = *offset_align = kAlign;
#ifdef STATX_DIOALIGN
  struct statx st {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &st) == 0 &&
      (st.stx_mask & STATX_DIOALIGN) != 0 && st.stx_dio_mem_align > 0 &&
      st.stx_dio_offset_align > 0) {
    *mem_align = st.stx_dio_mem_align;
    // Never below a page: a buffered tail sharing a page with a direct write leaves stale page
    // cache, which the kernel reports as EIO on the next fsync.
    *offset_align = std::max<uint32_t>(st.stx_dio_offset_align, kAlign);
  }
#else
  (void)fd;
#endif
}

}  // namespace

Engine::Engine(const EngineOptions& opts) : opts_(opts) {
  if (opts.queue_depth < 1 || opts.queue_depth > 4096) {
    throw std::invalid_argument("queue_depth must be in [1, 4096], got " +
                                std::to_string(opts.queue_depth));
  }
  if (opts.block_size == 0 || opts.block_size % kAlign != 0 || opts.block_size > (1u << 30)) {
    throw std::invalid_argument("block_size must be a positive multiple of 4096 up to 1 GiB, got " +
                                std::to_string(opts.block_size));
  }
  if (opts.pool_bytes == 0) throw std::invalid_argument("pool_bytes must be > 0");
  if (opts.copy_threads < 0 || opts.copy_threads > 256) {
    throw std::invalid_argument("copy_threads must be in [0, 256], got " +
                                std::to_string(opts.copy_threads));
  }
  std::string warning;
  name_ = choose_backend(opts, &warning);
  if (!warning.empty()) warnings_.push_back(warning);
  pool_ = std::make_unique<AlignedPool>(opts.pool_bytes);
  BackendOptions bo;
  bo.queue_depth = opts.queue_depth;
  bo.sqpoll = opts.sqpoll;
  bo.copy_threads = opts.copy_threads;
  bo.fixed_base = pool_->arena();
  bo.fixed_len = pool_->budget();
  backend_ = name_ == "uring" ? make_uring_backend(bo) : make_thread_backend(bo);
  name_ = backend_->name();
  fixed_ = backend_->fixed_buffers();
}

Engine::~Engine() {
  try {
    close();
  } catch (...) {  // destructors must not throw; close() reports errors to explicit callers
  }
}

void Engine::check_open(const char* op) const {
  if (backend_ == nullptr) {
    throw std::logic_error(std::string("io engine: ") + op + "() called after close()");
  }
}

std::vector<std::string> Engine::take_warnings() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  out.swap(warnings_);
  return out;
}

Engine::File& Engine::open_file(const std::string& path, bool write) {
  auto& versions = files_[path];
  for (auto& f : versions) {
    if (f.writable || !write) return f;
  }
  File f;
  f.writable = write;
  const char* op = write ? "open for write" : "open for read";
  // A failed open must not leave behind a file that only this open created.
  const bool existed = !write || ::access(path.c_str(), F_OK) == 0;
  f.buffered_fd = open_fd(path, write, false);
  if (f.buffered_fd < 0) {
    const int e = errno;
    if (versions.empty()) files_.erase(path);
    throw IoError::from(IoStatus{e, path, 0}, op);
  }
  f.fd = f.buffered_fd;
  if (opts_.direct) {
    int dfd = open_fd(path, write, true);
    if (dfd >= 0) {
      f.fd = dfd;
      f.direct = true;
    } else if (errno != EINVAL) {
      // Only EINVAL means "no O_DIRECT here"; EMFILE, ENFILE, EACCES... are real failures that
      // buffered I/O would only postpone.
      const int e = errno;
      ::close(f.buffered_fd);
      if (!existed) ::unlink(path.c_str());
      if (versions.empty()) files_.erase(path);
      throw IoError::from(IoStatus{e, path, 0}, op);
    } else if (!warned_no_direct_) {
      warned_no_direct_ = true;
      warnings_.push_back("tierlift.io: the file system of '" + path +
                          "' does not support O_DIRECT (" + std::strerror(EINVAL) +
                          "); using buffered I/O through the page cache");
    }
  }
  if (f.direct) query_dio_align(f.fd, &f.dio_mem_align, &f.dio_align);
  f.path = std::make_unique<std::string>(path);
  // Older descriptors stay open until forget()/close(): requests in flight may still use them.
  versions.push_back(std::move(f));
  return versions.back();
}

std::shared_ptr<IoRequest> Engine::read(void* buf, size_t len,
                                        const std::vector<std::string>& paths, uint64_t offset) {
  return submit(static_cast<char*>(buf), len, paths, offset, false);
}

std::shared_ptr<IoRequest> Engine::write(const void* buf, size_t len,
                                         const std::vector<std::string>& paths, uint64_t offset) {
  return submit(static_cast<char*>(const_cast<void*>(buf)), len, paths, offset, true);
}

BlockOp Engine::plan_op(File& f, char* mem, uint64_t len, uint64_t file_offset, bool write) {
  BlockOp op;
  op.buf = mem;
  op.len = len;
  op.offset = file_offset;
  op.is_write = write;
  op.dio_align = f.dio_align;
  op.buffered_fd = f.buffered_fd;
  op.path = f.path.get();
  op.path_bytes = &path_bytes_;
  op.direct = f.direct && file_offset % f.dio_align == 0 && len % f.dio_align == 0;
  if (op.direct && reinterpret_cast<uintptr_t>(mem) % f.dio_mem_align == 0) {
    op.fixed_index = fixed_ && pool_->contains(mem, len) ? 0 : -1;
    path_bytes_.direct += len;
  } else if (op.direct && round_up(len) <= pool_->budget()) {
    op.user = mem;  // the backend gives it a pool buffer when it starts the op
    op.buf = nullptr;
    op.stage_pool = pool_.get();
    op.fixed_index = fixed_ ? 0 : -1;
    path_bytes_.staged += len;
  } else {
    op.direct = false;
    path_bytes_.buffered += len;
  }
  op.fd = op.direct ? f.fd : f.buffered_fd;
  return op;
}

std::shared_ptr<IoRequest> Engine::submit(char* buf, size_t len,
                                          const std::vector<std::string>& paths, uint64_t offset,
                                          bool write) {
  check_open(write ? "write" : "read");
  if (paths.empty()) throw std::invalid_argument("paths must name at least one file");
  if (buf == nullptr && len > 0) throw std::invalid_argument("buffer is null");
  const size_t bs = opts_.block_size;
  if (paths.size() > 1 && offset % bs != 0) {
    throw std::invalid_argument("striped I/O needs an offset that is a multiple of block_size (" +
                                std::to_string(bs) + "), got " + std::to_string(offset));
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<File*> files;
  // The files this call opens (and whether it created them): a failed open of a later stripe
  // closes them again, so a refused request keeps no descriptor and leaves no new file.
  std::vector<std::pair<std::string, bool>> opened;
  try {
    for (const auto& p : paths) {
      auto it = files_.find(p);
      const size_t had = it == files_.end() ? 0 : it->second.size();
      const bool existed = ::access(p.c_str(), F_OK) == 0;
      files.push_back(&open_file(p, write));
      if (files_[p].size() > had) opened.emplace_back(p, !existed);
    }
  } catch (...) {
    for (auto& [path, created] : opened) drop_newest(path, created);
    throw;
  }

  std::vector<BlockOp> ops;
  uint64_t pos = 0;
  while (pos < len) {
    const uint64_t logical = offset + pos;
    const uint64_t stripe = logical / bs;
    const uint64_t n = std::min<uint64_t>(len - pos, bs - logical % bs);
    File* f = files[stripe % files.size()];
    const uint64_t file_offset = (stripe / files.size()) * bs + logical % bs;
    // A tail below the direct-I/O granularity goes through the page cache on its own, so the
    // rest of the block stays direct.
    uint64_t bulk = n;
    if (f->direct && file_offset % f->dio_align == 0) bulk = n - n % f->dio_align;
    if (bulk > 0) ops.push_back(plan_op(*f, buf + pos, bulk, file_offset, write));
    if (bulk < n) ops.push_back(plan_op(*f, buf + pos + bulk, n - bulk, file_offset + bulk, write));
    if (write) f->written = true;
    pos += n;
  }
  auto req = std::make_shared<IoRequest>(write, std::max<int64_t>(1, ops.size()));
  for (auto& op : ops) op.req = req;
  inflight_.erase(std::remove_if(inflight_.begin(), inflight_.end(),
                                 [](const std::shared_ptr<IoRequest>& r) { return r->done(); }),
                  inflight_.end());
  inflight_.push_back(req);
  if (ops.empty()) {
    req->complete_one(IoStatus{});  // zero-length request: one synthetic completion
    return req;
  }
  backend_->submit(std::move(ops));
  return req;
}

void Engine::wait_all(IoStatus* first_error) {
  std::vector<std::shared_ptr<IoRequest>> reqs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reqs.swap(inflight_);
  }
  for (auto& r : reqs) {
    IoStatus st = r->wait();
    if (first_error != nullptr && !st.ok() && first_error->ok()) *first_error = st;
  }
}

IoStatus Engine::sync() {
  check_open("sync");
  IoStatus first;
  wait_all(&first);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [path, versions] : files_) {
    for (auto& f : versions) {
      if (!f.written) continue;
      f.written = false;
      if (::fdatasync(f.buffered_fd) != 0 && first.ok()) first = IoStatus{errno, path, 0};
    }
  }
  return first;
}

void Engine::close_file(File& f) {
  if (f.fd != f.buffered_fd) {
    backend_->release_fd(f.fd);
    ::close(f.fd);
  }
  backend_->release_fd(f.buffered_fd);
  ::close(f.buffered_fd);
}

void Engine::drop_newest(const std::string& path, bool created) {
  auto it = files_.find(path);
  if (it == files_.end() || it->second.empty()) return;
  close_file(it->second.back());
  it->second.pop_back();
  if (it->second.empty()) files_.erase(it);
  if (created) ::unlink(path.c_str());
}

void Engine::forget(const std::string& path) {
  check_open("forget");
  wait_all(nullptr);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = files_.find(path);
  if (it == files_.end()) return;
  for (auto& f : it->second) close_file(f);
  files_.erase(it);
}

void Engine::close() {
  if (backend_ == nullptr) return;
  wait_all(nullptr);
  backend_.reset();  // joins the backend's threads
  for (auto& [path, versions] : files_) {
    for (auto& f : versions) {
      if (f.fd != f.buffered_fd) ::close(f.fd);
      ::close(f.buffered_fd);
    }
  }
  files_.clear();
}

}  // namespace tierlift::io
