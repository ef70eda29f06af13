// A cooperative fiber on its own mmap'd stack (with a guard page below it). The simulator runs
// every GPU thread of a block as one: resume() runs it until it calls yield() (at a barrier or a
// warp collective) or returns. On x86-64 a switch saves the callee-saved registers and swaps
// stack pointers (a few ns: kernels switch at every shuffle); elsewhere it is ucontext, whose
// swapcontext makes a system call per switch. Switches are annotated for AddressSanitizer, so
// ASan follows the stacks and reports errors inside kernels normally, and for ThreadSanitizer:
// each start() is a new TSan fiber on a freshly mapped stack (no history from an earlier run),
// and switches carry no happens-before edge (the scheduler adds CUDA's own).
#pragma once

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <cstddef>

namespace cudasim {

class Fiber {
 public:
  using Entry = void (*)(void* arg);

  Fiber();
  ~Fiber();
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;

  // Prepares the fiber to run entry(arg) from the top of its stack on the next resume().
  void start(Entry entry, void* arg);
  // Runs the fiber until it yields or its entry returns; returns true if it has returned.
  bool resume();
  // Called on the fiber: back to whoever resumed it.
  void yield();
  // The name ThreadSanitizer gives this fiber in its reports (copied; no-op in other builds).
  void set_name(const char* name);
  // For a fiber left suspended (its block failed): releases `sync` on its behalf, as if it had
  // run to its end, so the host's later use of the kernel's memory is ordered after it
  // (ThreadSanitizer builds; no-op otherwise).
  void release_abandoned(void* sync);

 private:
  static void main(Fiber* self);
#if !defined(__x86_64__)
  static void trampoline(unsigned hi, unsigned lo);
#endif
  void switch_to_fiber();
  void switch_out(bool for_good);

  static constexpr size_t kStackBytes = 256 << 10;
  char* mapping_ = nullptr;  // guard page + stack
#if defined(__x86_64__)
  void* sp_ = nullptr;         // the fiber's saved stack pointer while it is switched out
  void* caller_sp_ = nullptr;  // the resumer's while the fiber runs
#else
  ucontext_t context_{};
  ucontext_t caller_{};
#endif
  Entry entry_ = nullptr;
  void* arg_ = nullptr;
  bool finished_ = true;
  void* fake_stack_ = nullptr;  // ASan's fake stack of this fiber while it is switched out
  const void* caller_bottom_ = nullptr;
  size_t caller_size_ = 0;
  void* tsan_fiber_ = nullptr;   // this run's TSan context (ThreadSanitizer builds)
  void* tsan_caller_ = nullptr;  // the resumer's TSan context while the fiber runs
};

}  // namespace cudasim
