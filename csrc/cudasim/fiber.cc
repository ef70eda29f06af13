#include "cudasim/fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#if defined(__SANITIZE_ADDRESS__)
#define CUDASIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CUDASIM_ASAN 1
#endif
#endif

#include "cudasim/sanitizer.h"

#ifdef CUDASIM_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(__x86_64__)
// Saves the callee-saved registers on the current stack, stores the stack pointer in *save and
// continues on `next` (a stack saved by this function, or prepared by Fiber::start).
extern "C" void cudasim_switch_stack(void** save, void* next);
asm(R"(
  .text
  .globl cudasim_switch_stack
  .type cudasim_switch_stack, @function
cudasim_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cudasim_switch_stack, .-cudasim_switch_stack

  .globl cudasim_fiber_entry
  .type cudasim_fiber_entry, @function
cudasim_fiber_entry:
  movq %r12, %rdi
  call *%r13
  ud2
  .size cudasim_fiber_entry, .-cudasim_fiber_entry
)");
extern "C" void cudasim_fiber_entry();
#endif

namespace cudasim {
namespace {

size_t page_size() {
  static const size_t size = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

[[noreturn]] void die(const char* what) {
  std::perror(what);
  std::abort();
}

}  // namespace

Fiber::Fiber() {
  const size_t total = kStackBytes + page_size();
  void* m = mmap(nullptr, total, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) die("cudasim: mmap of a fiber stack");
  mapping_ = static_cast<char*>(m);
  if (mprotect(mapping_, page_size(), PROT_NONE) != 0) die("cudasim: stack guard page");
}

Fiber::~Fiber() {
#ifdef CUDASIM_TSAN
  if (tsan_fiber_ != nullptr) __tsan_destroy_fiber(tsan_fiber_);
#endif
  munmap(mapping_, kStackBytes + page_size());
}

void Fiber::set_name(const char* name) {
#ifdef CUDASIM_TSAN
  __tsan_set_fiber_name(tsan_fiber_, name);
#else
  (void)name;
#endif
}

void Fiber::release_abandoned(void* sync) {
#ifdef CUDASIM_TSAN
  if (finished_ || tsan_fiber_ == nullptr) return;
  void* self = __tsan_get_current_fiber();
  __tsan_switch_to_fiber(tsan_fiber_, __tsan_switch_to_fiber_no_sync);  // its clock, not its stack
  __tsan_release(sync);
  __tsan_switch_to_fiber(self, __tsan_switch_to_fiber_no_sync);
#else
  (void)sync;
#endif
}

void Fiber::start(Entry entry, void* arg) {
  entry_ = entry;
  arg_ = arg;
  finished_ = false;
  char* stack = mapping_ + page_size();
#ifdef CUDASIM_TSAN
  // A new TSan context (it inherits only the creating OS thread's history), and the stack mapped
  // afresh: TSan forgets the previous run's accesses to it, which no edge orders before this one.
  if (tsan_fiber_ != nullptr) __tsan_destroy_fiber(tsan_fiber_);
  if (mmap(stack, kStackBytes, PROT_READ | PROT_WRITE,
           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED) {
    die("cudasim: mmap of a fiber stack");
  }
  tsan_fiber_ = __tsan_create_fiber(0);
#endif
#ifdef CUDASIM_ASAN
  // A fiber abandoned mid-kernel (after a reported error) left its frames' redzones poisoned.
  __asan_unpoison_memory_region(stack, kStackBytes);
#endif
#if defined(__x86_64__)
  // The frame cudasim_switch_stack pops: r15, r14, r13 (= &main), r12 (= this), rbx, rbp, then
  // the return address cudasim_fiber_entry, which calls main(this) on a 16-byte aligned stack.
  auto* top = reinterpret_cast<void**>(stack + kStackBytes);  // 16-byte aligned
  void** frame = top - 9;
  frame[0] = nullptr;
  frame[1] = nullptr;
  frame[2] = reinterpret_cast<void*>(&Fiber::main);
  frame[3] = this;
  frame[4] = nullptr;
  frame[5] = nullptr;
  frame[6] = reinterpret_cast<void*>(&cudasim_fiber_entry);
  frame[7] = nullptr;
  frame[8] = nullptr;
  sp_ = frame;
#else
  if (getcontext(&context_) != 0) die("cudasim: getcontext");
  context_.uc_stack.ss_sp = stack;
  context_.uc_stack.ss_size = kStackBytes;
  context_.uc_link = nullptr;
  const auto p = reinterpret_cast<uintptr_t>(this);
  makecontext(&context_, reinterpret_cast<void (*)()>(&Fiber::trampoline), 2,
              static_cast<unsigned>(p >> 32), static_cast<unsigned>(p & 0xffffffffu));
#endif
}

void Fiber::switch_to_fiber() {
#ifdef CUDASIM_TSAN
  tsan_caller_ = __tsan_get_current_fiber();
  __tsan_switch_to_fiber(tsan_fiber_, __tsan_switch_to_fiber_no_sync);
#endif
#if defined(__x86_64__)
  cudasim_switch_stack(&caller_sp_, sp_);
#else
  if (swapcontext(&caller_, &context_) != 0) die("cudasim: swapcontext");
#endif
}

bool Fiber::resume() {
#ifdef CUDASIM_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, mapping_ + page_size(), kStackBytes);
#endif
  switch_to_fiber();
#ifdef CUDASIM_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  return finished_;
}

void Fiber::switch_out(bool for_good) {
#ifdef CUDASIM_ASAN
  __sanitizer_start_switch_fiber(for_good ? nullptr : &fake_stack_, caller_bottom_, caller_size_);
#else
  (void)for_good;
#endif
#ifdef CUDASIM_TSAN
  void* tsan_caller;
  {
    tsan::Ignore ignore;  // on the fiber: the Fiber object is not the kernel's memory
    tsan_caller = tsan_caller_;
  }
  __tsan_switch_to_fiber(tsan_caller, __tsan_switch_to_fiber_no_sync);
#endif
#if defined(__x86_64__)
  void* caller_sp;
  {
    tsan::Ignore ignore;
    caller_sp = caller_sp_;
  }
  cudasim_switch_stack(&sp_, caller_sp);
#else
  if (swapcontext(&context_, &caller_) != 0) die("cudasim: swapcontext");
#endif
#ifdef CUDASIM_ASAN
  __sanitizer_finish_switch_fiber(fake_stack_, &caller_bottom_, &caller_size_);
#endif
}

void Fiber::yield() { switch_out(false); }

#if !defined(__x86_64__)
void Fiber::trampoline(unsigned hi, unsigned lo) {
  main(reinterpret_cast<Fiber*>((static_cast<uintptr_t>(hi) << 32) | lo));
}
#endif

void Fiber::main(Fiber* self) {
#ifdef CUDASIM_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &self->caller_bottom_, &self->caller_size_);
#endif
  Entry entry;
  void* arg;
  {
    tsan::Ignore ignore;  // the Fiber object outlives this run: not the kernel's memory
    entry = self->entry_;
    arg = self->arg_;
  }
  entry(arg);
  {
    tsan::Ignore ignore;
    self->finished_ = true;
  }
  self->switch_out(true);
  std::abort();  // a finished fiber is never resumed
}

}  // namespace cudasim
