// Runs a launch: blocks spread over OS threads, each block's threads as fibers resumed in a
// seeded random order (thread by thread, or warp by warp), barriers and warp collectives as
// rendezvous that check CUDA's rules; shared memory poisoned at each block start. Under
// ThreadSanitizer the rendezvous are also happens-before edges among exactly their participants.
#include "cudasim/scheduler.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cudasim/errors.h"
#include "cudasim/fiber.h"
#include "cudasim/launch.h"
#include "cudasim/sanitizer.h"
#include "cudasim/shared_memory.h"

namespace cudasim {

thread_local Coords current;

namespace {

constexpr int kWarp = 32;

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::kShflIdx:
      return "__shfl_sync";
    case WarpOp::kShflUp:
      return "__shfl_up_sync";
    case WarpOp::kShflDown:
      return "__shfl_down_sync";
    case WarpOp::kShflXor:
      return "__shfl_xor_sync";
    case WarpOp::kBallot:
      return "__ballot_sync";
    case WarpOp::kAny:
      return "__any_sync";
    case WarpOp::kAll:
      return "__all_sync";
    default:
      return "__syncwarp";
  }
}

std::string hex(unsigned mask) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", mask);
  return buf;
}

std::string site(const char* file, int line) {
  const char* slash = file ? std::strrchr(file, '/') : nullptr;
  return std::string(slash ? slash + 1 : (file ? file : "?")) + ":" + std::to_string(line);
}

std::string dim(uint3 d) {
  return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}

// PTX shfl.sync's source lane for a collective of `width` lanes (a power of two up to 32); the
// caller's own lane when the computed one is outside its segment.
int source_lane(WarpOp op, int lane, int arg, int width) {
  const int seg = kWarp - width;  // the bits of the lane id above the segment
  const int b = arg & 31;
  const int max_lane = (lane & seg) | (op == WarpOp::kShflUp ? 0 : (31 & ~seg));
  int j = lane;
  bool ok = false;
  switch (op) {
    case WarpOp::kShflUp:
      j = lane - b;
      ok = j >= max_lane;
      break;
    case WarpOp::kShflDown:
      j = lane + b;
      ok = j <= max_lane;
      break;
    case WarpOp::kShflXor:
      j = lane ^ b;
      ok = j <= max_lane;
      break;
    default:
      j = (lane & seg) | (b & ~seg);
      ok = j <= max_lane;
  }
  return ok ? j : lane;
}

// A happens-before edge among the threads of one barrier or warp collective (ThreadSanitizer
// builds): each releases it on arrival and acquires it once the rendezvous is complete. A fresh
// heap object per rendezvous, freed by its last participant: freeing resets TSan's clock for the
// address, so a later rendezvous never inherits an earlier one's edges.
struct SyncPoint {
  int pending;  // participants yet to acquire
};

struct SimThread {
  enum State : uint8_t { kReady, kBarrier, kWarp, kDone };
  uint3 idx{};
  State state = kReady;
  const char* file = nullptr;  // where it waits
  int line = 0;
  WarpOp op = WarpOp::kSync;
  unsigned mask = 0;
  int arg = 0, width = kWarp;
  uint64_t value = 0;
  SyncPoint* sync = nullptr;  // to acquire when resumed (ThreadSanitizer builds)
};

struct Launch {
  const char* name;
  dim3 grid, block;
  void (*body)(void*);
  void* ctx;
  uint64_t seed;
  uint64_t id;
  Schedule schedule;
  char* sync;  // [0]: released before the launch, [1]: released by every thread at its end
};

// Fibers (each with its mapped stack) outlive launches and the OS threads that ran them: a block
// takes as many as it has threads and gives them back when it ends.
class FiberPool {
 public:
  void take(size_t n, std::vector<std::unique_ptr<Fiber>>* out) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (out->size() < n && !free_.empty()) {
        out->push_back(std::move(free_.back()));
        free_.pop_back();
      }
    }
    while (out->size() < n) out->push_back(std::make_unique<Fiber>());
  }
  void give(std::vector<std::unique_ptr<Fiber>>* fibers) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& f : *fibers) free_.push_back(std::move(f));
    fibers->clear();
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<Fiber>> free_;
};

FiberPool& fiber_pool() {
  static FiberPool* pool = new FiberPool;  // never destroyed: blocks may end during exit
  return *pool;
}

class BlockRun;
thread_local BlockRun* running_block = nullptr;

class BlockRun {
 public:
  BlockRun(const Launch& l, uint3 block_idx, uint64_t linear_block)
      : launch_(l),
        block_idx_(block_idx),
        rng_(splitmix64(l.seed ^ splitmix64(l.id * 0x100000001b3ull + linear_block))) {
    const int n = static_cast<int>(l.block.x * l.block.y * l.block.z);
    threads_.resize(n);
    ready_.resize((n + kWarp - 1) / kWarp);
    if (tsan::kEnabled) open_.resize(ready_.size());
    for (int t = 0; t < n; ++t) {
      threads_[t].idx = {t % l.block.x, (t / l.block.x) % l.block.y, t / (l.block.x * l.block.y)};
    }
    fiber_pool().take(n, &fibers_);
  }

  ~BlockRun() { fiber_pool().give(&fibers_); }
  BlockRun(const BlockRun&) = delete;
  BlockRun& operator=(const BlockRun&) = delete;

  // Returns the error message, empty on success.
  std::string run() {
    tsan::Ignore ignore;  // the OS thread's side: `current`, the poison, the bookkeeping
    const int n = static_cast<int>(threads_.size());
    current.block_idx = block_idx_;
    current.block_dim = launch_.block;
    current.grid_dim = launch_.grid;
    running_block = this;
    poison_shared();
    for (int t = 0; t < n; ++t) {
      fibers_[t]->start(&BlockRun::entry, this);
      if (tsan::kEnabled) name_fiber(t);
      make_ready(t);
    }
    while (ready_count_ > 0 && error_.empty()) {
      const int t = pick();
      running_ = t;
      current.thread_idx = threads_[t].idx;
      if (fibers_[t]->resume() && error_.empty()) on_exit(t);
    }
    if (error_.empty() && done_ != n) report_deadlock();
    if (tsan::kEnabled && !error_.empty()) {
      for (auto& f : fibers_) f->release_abandoned(&launch_.sync[1]);
    }
    running_block = nullptr;
    return error_;
  }

  void barrier(const char* file, int line) {
    tsan::Ignore ignore;  // on the fiber: the scheduler's state, not the kernel's
    SimThread& me = threads_[running_];
    me.state = SimThread::kBarrier;
    me.file = file;
    me.line = line;
    ++at_barrier_;
    if (tsan::kEnabled) {
      if (barrier_sync_ == nullptr)
        barrier_sync_ = new SyncPoint{static_cast<int>(threads_.size())};
      arrive(me, barrier_sync_);
    }
    if (done_ > 0) {
      fail(running_, "reaches __syncthreads at " + site(file, line) + " after " + who(first_done_) +
                         " returned: the barrier can never complete");
    } else if (at_barrier_ == static_cast<int>(threads_.size())) {
      for (size_t t = 0; t < threads_.size(); ++t) {
        if (threads_[t].file != file || threads_[t].line != line) {
          fail(static_cast<int>(t),
               "waits at __syncthreads at " + site(threads_[t].file, threads_[t].line) + " while " +
                   who(running_) + " waits at " + site(file, line) + " (divergent barrier)");
          break;
        }
      }
      release_all_at(SimThread::kBarrier);
      at_barrier_ = 0;
      barrier_sync_ = nullptr;  // the next barrier is a new edge
    }
    wait(me);
  }

  uint64_t collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width,
                      const char* file, int line) {
    tsan::Ignore ignore;
    const int t = running_;
    SimThread& me = threads_[t];
    const int lane = t % kWarp, base = t - lane;
    // Built only on the error paths: a std::string alive across yield() would leak when the
    // block is abandoned after an error.
    auto call = [&] {
      return std::string(op_name(op)) + " (mask " + hex(mask) + ") at " + site(file, line);
    };
    if (!((mask >> lane) & 1u)) {
      fail(t,
           "calls " + call() + " with a mask that leaves out its own lane " + std::to_string(lane));
    } else if (width < 1 || width > kWarp || (width & (width - 1)) != 0) {
      fail(t, "calls " + call() + " with width " + std::to_string(width));
    }
    for (int b = 0; b < kWarp && error_.empty(); ++b) {
      if (!((mask >> b) & 1u)) continue;
      if (base + b >= static_cast<int>(threads_.size())) {
        fail(t, "calls " + call() + " naming lane " + std::to_string(b) +
                    ", which does not exist in a block of " + std::to_string(threads_.size()) +
                    " threads");
      } else if (threads_[base + b].state == SimThread::kDone) {
        fail(t, "calls " + call() + " naming lane " + std::to_string(b) + ", which has returned");
      }
    }
    me.state = SimThread::kWarp;
    me.op = op;
    me.mask = mask;
    me.value = value;
    me.arg = arg;
    me.width = width;
    me.file = file;
    me.line = line;
    if (tsan::kEnabled) arrive(me, open_sync(t / kWarp, mask));
    if (error_.empty()) try_complete_warp(base, mask);
    wait(me);
    return me.value;
  }

 private:
  static void entry(void* self) {
    void (*body)(void*);
    void* ctx;
    char* sync;
    {
      tsan::Ignore ignore;
      const Launch& l = static_cast<BlockRun*>(self)->launch_;
      body = l.body, ctx = l.ctx, sync = l.sync;
    }
    tsan::acquire(&sync[0]);  // everything the host did before the launch
    body(ctx);
    tsan::release(&sync[1]);  // ... and this thread's work, before what the host does after it
  }

  // Suspends the running fiber (called inside a tsan::Ignore scope) until its rendezvous is
  // complete. The ignore is lifted across the switch: a fiber left suspended when its block fails
  // holds none when TSan destroys it.
  void wait(SimThread& me) {
    Fiber* self = fibers_[running_].get();
    tsan::ignore_end();
    self->yield();
    tsan::ignore_begin();
    depart(me);
  }

  void make_ready(int t) {
    ready_[t / kWarp].push_back(t);
    ++ready_count_;
  }

  // The next thread to resume. kThread: any ready thread. kWarp: a ready thread of the warp that
  // ran last while it has one (so a warp runs on to its next __syncthreads, or its end, before
  // any other warp moves), else of a random warp.
  int pick() {
    int w = focus_;
    if (launch_.schedule != Schedule::kWarp || w < 0 || ready_[w].empty()) {
      size_t k = static_cast<size_t>(rng_() % ready_count_);
      for (w = 0; k >= ready_[w].size(); ++w) k -= ready_[w].size();
      focus_ = w;
      return take(w, k);
    }
    return take(w, static_cast<size_t>(rng_() % ready_[w].size()));
  }

  int take(int w, size_t k) {
    std::vector<int>& r = ready_[w];
    const int t = r[k];
    r[k] = r.back();
    r.pop_back();
    --ready_count_;
    return t;
  }

  // Fills this OS thread's __shared__ variables with a pattern drawn per block (0xAB bytes, NaN
  // 0xFF bytes, or 0x7F bytes: a float near FLT_MAX), so a read before the block's own write
  // sees garbage every time and in any reduction (fmaxf drops a NaN, a sum drops a tiny value).
  void poison_shared() {
    static constexpr unsigned char kPatterns[] = {0xAB, 0xFF, 0x7F};
    fill_shared_memory(kPatterns[rng_() % 3]);
  }

  void name_fiber(int t) {
    char name[64];
    std::snprintf(name, sizeof name, "block %s thread %s %s", dim(block_idx_).c_str(),
                  dim(threads_[t].idx).c_str(), launch_.name);
    fibers_[t]->set_name(name);
  }

  // ThreadSanitizer edges (scheduler calls only where tsan::kEnabled): on arrival the thread
  // releases the rendezvous' SyncPoint, once resumed it acquires it.
  static void arrive(SimThread& me, SyncPoint* sync) {
    tsan::release(sync);
    me.sync = sync;
  }
  static void depart(SimThread& me) {
    if (!tsan::kEnabled || me.sync == nullptr) return;
    tsan::acquire(me.sync);
    if (--me.sync->pending == 0) delete me.sync;
    me.sync = nullptr;
  }
  // The SyncPoint of the warp collective with `mask` that lanes of warp w are gathering at.
  SyncPoint* open_sync(int w, unsigned mask) {
    for (const auto& [m, sync] : open_[w]) {
      if (m == mask) return sync;
    }
    open_[w].emplace_back(mask, new SyncPoint{__builtin_popcount(mask)});
    return open_[w].back().second;
  }
  void close_sync(int w, unsigned mask) {
    auto& open = open_[w];
    for (size_t k = 0; k < open.size(); ++k) {
      if (open[k].first == mask) {
        open[k] = open.back();
        open.pop_back();
        return;
      }
    }
  }

  std::string who(int t) const {
    return "thread " + dim(threads_[t].idx) + " (warp " + std::to_string(t / kWarp) + " lane " +
           std::to_string(t % kWarp) + ")";
  }

  void fail(int t, const std::string& what) {
    if (!error_.empty()) return;
    std::ostringstream os;
    os << "cudasim: kernel " << launch_.name << ", block " << dim(block_idx_) << ", " << who(t)
       << ": " << what << " [TIERLIFT_CUDASIM_SEED=" << launch_.seed
       << (launch_.schedule == Schedule::kWarp ? " TIERLIFT_CUDASIM_SCHEDULE=warp" : "") << "]";
    error_ = os.str();
  }

  void release_all_at(SimThread::State s) {
    for (size_t t = 0; t < threads_.size(); ++t) {
      if (threads_[t].state == s) {
        threads_[t].state = SimThread::kReady;
        make_ready(static_cast<int>(t));
      }
    }
  }

  void try_complete_warp(int base, unsigned mask) {
    for (int b = 0; b < kWarp; ++b) {
      if (((mask >> b) & 1u) && threads_[base + b].state != SimThread::kWarp) return;
    }
    const SimThread& first = threads_[base + __builtin_ctz(mask)];
    for (int b = 0; b < kWarp; ++b) {
      if (!((mask >> b) & 1u)) continue;
      const SimThread& o = threads_[base + b];
      if (o.mask != first.mask || o.op != first.op || o.width != first.width) {
        fail(base + b, std::string("waits in ") + op_name(o.op) + " (mask " + hex(o.mask) +
                           ") at " + site(o.file, o.line) + " while lane " +
                           std::to_string(__builtin_ctz(mask)) + " waits in " + op_name(first.op) +
                           " (mask " + hex(first.mask) + ") at " + site(first.file, first.line));
        return;
      }
    }
    uint64_t result[kWarp];
    if (first.op == WarpOp::kBallot || first.op == WarpOp::kAny || first.op == WarpOp::kAll ||
        first.op == WarpOp::kSync) {
      unsigned ballot = 0;
      for (int b = 0; b < kWarp; ++b) {
        if (((mask >> b) & 1u) && threads_[base + b].value != 0) ballot |= 1u << b;
      }
      const uint64_t r = first.op == WarpOp::kBallot ? ballot
                         : first.op == WarpOp::kAny  ? (ballot != 0)
                         : first.op == WarpOp::kAll  ? (ballot == mask)
                                                     : 0;
      std::fill(result, result + kWarp, r);
    } else {
      for (int b = 0; b < kWarp; ++b) {
        if (!((mask >> b) & 1u)) continue;
        const SimThread& o = threads_[base + b];
        const int src = source_lane(o.op, b, o.arg, o.width);
        if (!((mask >> src) & 1u)) {
          fail(base + b, std::string("reads lane ") + std::to_string(src) + " in " + op_name(o.op) +
                             " at " + site(o.file, o.line) + ", but mask " + hex(mask) +
                             " leaves that lane out");
          return;
        }
        result[b] = threads_[base + src].value;
      }
    }
    if (tsan::kEnabled) close_sync(base / kWarp, mask);
    for (int b = 0; b < kWarp; ++b) {
      if (!((mask >> b) & 1u)) continue;
      threads_[base + b].value = result[b];
      threads_[base + b].state = SimThread::kReady;
      make_ready(base + b);
    }
  }

  void on_exit(int t) {
    threads_[t].state = SimThread::kDone;
    if (done_++ == 0) first_done_ = t;
    if (at_barrier_ > 0) {
      for (size_t w = 0; w < threads_.size(); ++w) {
        if (threads_[w].state == SimThread::kBarrier) {
          fail(t, "returns while " + who(static_cast<int>(w)) + " waits at __syncthreads at " +
                      site(threads_[w].file, threads_[w].line) +
                      ": the barrier can never complete");
          return;
        }
      }
    }
    const int lane = t % kWarp, base = t - lane;
    for (int b = 0; b < kWarp && base + b < static_cast<int>(threads_.size()); ++b) {
      const SimThread& o = threads_[base + b];
      if (o.state == SimThread::kWarp && ((o.mask >> lane) & 1u)) {
        fail(t, std::string("returns while lane ") + std::to_string(b) + " waits for it in " +
                    op_name(o.op) + " (mask " + hex(o.mask) + ") at " + site(o.file, o.line));
        return;
      }
    }
  }

  void report_deadlock() {
    for (size_t t = 0; t < threads_.size(); ++t) {
      const SimThread& o = threads_[t];
      if (o.state == SimThread::kWarp) {
        const int base = static_cast<int>(t) - static_cast<int>(t) % kWarp;
        for (int b = 0; b < kWarp; ++b) {
          if (!((o.mask >> b) & 1u)) continue;
          const SimThread& p = threads_[base + b];
          if (p.state == SimThread::kBarrier) {
            fail(static_cast<int>(t),
                 std::string("waits in ") + op_name(o.op) + " (mask " + hex(o.mask) + ") at " +
                     site(o.file, o.line) + " for lane " + std::to_string(b) +
                     ", which waits at __syncthreads at " + site(p.file, p.line) + ": deadlock");
            return;
          }
        }
      }
    }
    for (size_t t = 0; t < threads_.size(); ++t) {
      if (threads_[t].state != SimThread::kDone) {
        fail(static_cast<int>(t),
             "never completes (deadlock at " + site(threads_[t].file, threads_[t].line) + ")");
        return;
      }
    }
  }

  const Launch& launch_;
  uint3 block_idx_;
  std::mt19937_64 rng_;
  std::vector<SimThread> threads_;
  std::vector<std::unique_ptr<Fiber>> fibers_;
  std::vector<std::vector<int>> ready_;  // per warp
  size_t ready_count_ = 0;
  int focus_ = -1;  // the warp picked last
  SyncPoint* barrier_sync_ = nullptr;
  std::vector<std::vector<std::pair<unsigned, SyncPoint*>>> open_;  // per warp: (mask, edge)
  int running_ = -1;
  int at_barrier_ = 0;
  int done_ = 0;
  int first_done_ = -1;
  std::string error_;
};

BlockRun& block_or_die(const char* what) {
  if (running_block == nullptr) {
    std::fprintf(stderr, "cudasim: %s called outside a kernel\n", what);
    std::abort();
  }
  return *running_block;
}

std::atomic<uint64_t> launches{0};
std::atomic<int> thread_count{0};
std::atomic<int> schedule_set{-1};

uint64_t initial_seed() {
  if (const char* s = std::getenv("TIERLIFT_CUDASIM_SEED")) return std::strtoull(s, nullptr, 0);
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

std::atomic<uint64_t>& seed_value() {
  static std::atomic<uint64_t> value{initial_seed()};
  return value;
}

std::string config_error(dim3 grid, dim3 block, size_t shared) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64) {
    return "invalid block " + dim(block);
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
      grid.z > 65535) {
    return "invalid grid " + dim(grid);
  }
  if (shared != 0) return "dynamic shared memory is not simulated";
  return "";
}

}  // namespace

void syncthreads(const char* file, int line) {
  BlockRun& b = block_or_die("__syncthreads");
  b.barrier(file, line);
}

uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width,
                         const char* file, int line) {
  return block_or_die(op_name(op)).collective(op, mask, value, arg, width, file, line);
}

cudaError_t run_kernel(const char* name, dim3 grid, dim3 block, size_t shared_bytes,
                       void (*body)(void*), void* ctx) {
  const uint64_t id = launches++;
  if (running_block != nullptr) {
    set_error(cudaErrorNotSupported, std::string("cudasim: kernel ") + name +
                                         " launched from inside a kernel (not simulated)");
    return cudaErrorNotSupported;
  }
  if (std::string bad = config_error(grid, block, shared_bytes); !bad.empty()) {
    set_error(cudaErrorInvalidConfiguration, std::string("cudasim: kernel ") + name + ": " + bad);
    return cudaErrorInvalidConfiguration;
  }
  const std::unique_ptr<char[]> sync(new char[2]);  // heap: freeing it resets TSan's clocks
  tsan::release(&sync[0]);
  const Launch launch{name, grid, block, body, ctx, seed(), id, schedule(), sync.get()};
  const uint64_t total = uint64_t{grid.x} * grid.y * grid.z;
  // Under ThreadSanitizer each block runs on an OS thread of its own, created for it: TSan
  // forgets a finished thread's accesses to its thread_local __shared__ section, which the next
  // block (unordered with it, as on the GPU) reuses.
  auto run_block = [&launch](const uint3& idx, uint64_t b) {
    if (!tsan::kEnabled) return BlockRun(launch, idx, b).run();
    std::string err;
    std::thread([&] { err = BlockRun(launch, idx, b).run(); }).join();
    return err;
  };
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  uint64_t failed_block = UINT64_MAX;
  std::string message;
  auto work = [&] {
    for (uint64_t b; !failed.load(std::memory_order_relaxed) && (b = next++) < total;) {
      const uint3 idx{static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
                      static_cast<unsigned>(b / (uint64_t{grid.x} * grid.y))};
      std::string err = run_block(idx, b);
      if (!err.empty()) {
        std::lock_guard<std::mutex> lock(mu);
        failed = true;
        if (b < failed_block) failed_block = b, message = std::move(err);
      }
    }
  };
  const int workers = static_cast<int>(std::min<uint64_t>(threads(), total));
  std::vector<std::thread> pool;
  for (int w = 1; w < workers; ++w) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  tsan::acquire(&sync[1]);
  if (!message.empty()) {
    std::fprintf(stderr, "%s\n", message.c_str());
    set_error(cudaErrorLaunchFailure, message);
    return cudaErrorLaunchFailure;
  }
  return cudaSuccess;
}

uint64_t seed() { return seed_value().load(); }
void set_seed(uint64_t s) { seed_value() = s; }

int threads() {
  int n = thread_count.load();
  if (n > 0) return n;
  const char* env = std::getenv("TIERLIFT_CUDASIM_THREADS");
  n = env ? std::atoi(env) : static_cast<int>(std::min(4u, std::thread::hardware_concurrency()));
  return n > 0 ? n : 1;
}
void set_threads(int n) { thread_count = n; }

Schedule schedule() {
  const int set = schedule_set.load();
  if (set >= 0) return static_cast<Schedule>(set);
  const char* env = std::getenv("TIERLIFT_CUDASIM_SCHEDULE");
  return env != nullptr && std::strcmp(env, "warp") == 0 ? Schedule::kWarp : Schedule::kThread;
}
void set_schedule(Schedule s) { schedule_set = static_cast<int>(s); }
void reset_schedule() { schedule_set = -1; }

uint64_t launch_count() { return launches.load(); }

}  // namespace cudasim
