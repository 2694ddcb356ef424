// The CUDA execution model on the host CPU, for running kernels/*.cu where there is no GPU (raypaged/kernels/host.py
// compiles a .cu file's text after this header with the host C++ compiler). Each CUDA thread is a fiber on the
// calling OS thread; the blocks of a grid run one after another, the fibers of a block by turns, each until it
// reaches a barrier (__syncthreads, a warp collective) or ends. So barriers, shuffles, shared memory and the
// tensor-core fragments (mma.sync m16n8k16, ldmatrix .trans) behave as the PTX ISA defines them, and a barrier
// some threads never reach is reported instead of hanging. The turns alternate in direction and shared memory
// starts each block as 0xff bytes, so a race between a block's threads, or a read of shared memory nobody wrote,
// changes the result. cp.async copies at once. Not a performance model.
#ifndef RAYPAGED_HOST_RUNTIME_H
#define RAYPAGED_HOST_RUNTIME_H
#if !defined(__x86_64__)
#error "the host runtime switches fibers in x86-64 assembly"
#endif

#include <math.h>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#define RP_HOST_EMULATION 1
#define __CUDA_ARCH__ 900  // the device code paths of an sm_90 GPU (an H100 / H200)
#define __CUDACC_RTC__ 1   // as NVRTC (cupy.RawModule) compiles them
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// one instance, shared by the fibers of the block that is running; all of them in one section, which each block
// starts by filling with 0xff bytes (NaN as a float), as a GPU's shared memory holds anything at a block's start
#define __shared__ static __attribute__((section("rp_host_shared"), aligned(16)))
#define __align__(n) alignas(n)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
static constexpr int warpSize = 32;

namespace rp_host {

constexpr size_t STACK_BYTES = 64 * 1024;
constexpr int EXCHANGE_BYTES = 64;  // a lane's share of a warp collective

struct Barrier {
  int arrived = 0;
  unsigned generation = 0;
};

// Switch stacks: save the callee-saved registers on this stack, store its pointer in *from, continue on `to`
// (x86-64 System V; the scheduler and the fibers switch only through here, as plain calls).
extern "C" void rp_host_switch(void** from, void* to);
asm(R"(
  .text
  .p2align 4
  .hidden rp_host_switch
  .globl rp_host_switch
  .type rp_host_switch, @function
rp_host_switch:
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
  .size rp_host_switch, .-rp_host_switch
)");

struct Fiber {
  void* sp = nullptr;  // its saved stack pointer while it is not running
  dim3 thread_idx;
  int warp = 0, lane = 0;
  bool done = false;
  char* stack = nullptr;
};

// fiber stacks, kept from launch to launch (not zeroed: a thread's locals start as anything, as on a GPU)
inline std::vector<char*>& stack_pool(size_t count) {
  static std::vector<char*> pool;
  while (pool.size() < count) pool.push_back(new char[STACK_BYTES]);
  return pool;
}

struct Warp {
  Barrier barrier;
  unsigned alive = 0;  // lanes that have not returned
  unsigned mask = 0;   // the lanes of the collective being waited on
  unsigned char exchange[32][EXCHANGE_BYTES];
};

struct Launch {
  dim3 grid, block, block_idx;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  Barrier block_barrier;
  int alive = 0;
  unsigned long events = 0;  // arrivals, releases and returns: progress
  void (*body)(void*) = nullptr;
  void* body_arg = nullptr;
  void* scheduler_sp = nullptr;
  std::vector<unsigned char> dynamic_shared;
  char error[512] = {0};
};

inline Launch* launch = nullptr;
inline Fiber* current = nullptr;

// what a launch returns (raypaged/kernels/host.py reads the same numbers)
enum Status { DONE = 0, FAILED = 1, BAD_ARGUMENTS = 2, REFUSED = 3 };

// The grid's error: "block (x, y, z)" and what went wrong there.
template <typename... A> inline void block_error(const char* format, A... args) {
  const int n = snprintf(launch->error, sizeof(launch->error), "block (%u, %u, %u)", launch->block_idx.x,
                         launch->block_idx.y, launch->block_idx.z);
  snprintf(launch->error + n, sizeof(launch->error) - n, format, args...);
}

inline void yield() { rp_host_switch(&current->sp, launch->scheduler_sp); }

// Stop the grid with `message` (the fiber that fails never runs again).
[[noreturn]] inline void fail(const char* message) {
  if (!launch->error[0]) {
    block_error(" thread (%u, %u, %u): %s", current->thread_idx.x, current->thread_idx.y, current->thread_idx.z, message);
  }
  current->done = true;
  yield();
  __builtin_unreachable();
}

inline void release(Barrier& barrier) {
  barrier.arrived = 0;
  ++barrier.generation;
  ++launch->events;
}

// Wait until `expected` members have arrived (members that return meanwhile no longer count: the scheduler
// releases the barrier when the ones left have all arrived).
inline void arrive(Barrier& barrier, int expected) {
  ++launch->events;
  if (++barrier.arrived >= expected) {
    release(barrier);
    return;
  }
  const unsigned generation = barrier.generation;
  while (barrier.generation == generation && !launch->error[0]) yield();
  if (launch->error[0]) fail("stopped");
}

inline Warp& my_warp() { return launch->warps[current->warp]; }

// A warp collective over the lanes of `mask`: every one of them must still be running.
inline void warp_sync(unsigned mask) {
  Warp& warp = my_warp();
  if ((mask & warp.alive) != mask) fail("a warp collective's mask names lanes that have returned or do not exist");
  if (!(mask >> current->lane & 1u)) fail("a warp collective's mask leaves out the calling lane");
  warp.mask = mask;
  arrive(warp.barrier, __builtin_popcount(mask & warp.alive));
}

inline unsigned char* slot(int lane) { return my_warp().exchange[lane]; }

template <typename T> inline T shuffle(unsigned mask, T value, int source, int width) {
  static_assert(sizeof(T) <= EXCHANGE_BYTES, "shuffled value too large");
  if (width <= 0 || width > 32 || (width & (width - 1))) fail("a shuffle's width must be a power of 2 up to 32");
  std::memcpy(slot(current->lane), &value, sizeof(T));
  warp_sync(mask);
  const int base = current->lane & ~(width - 1);
  T result;
  if (source < base || source >= base + width || !(mask >> source & 1u)) {
    result = value;  // outside the segment (or not a participant): the lane keeps its own value
  } else {
    std::memcpy(&result, slot(source), sizeof(T));
  }
  warp_sync(mask);
  return result;
}

// ---- the grid ----
inline void fiber_main() {
  launch->body(launch->body_arg);
  current->done = true;
  Warp& warp = my_warp();
  warp.alive &= ~(1u << current->lane);
  --launch->alive;
  ++launch->events;
  yield();
}

// Barriers whose remaining members have all arrived, now that a member has returned; a warp collective waiting
// on a lane that returned is an error (on a GPU it may hang or read garbage).
inline void release_after_return() {
  if (launch->block_barrier.arrived) {  // CUDA: __syncthreads only where every thread of the block reaches it
    block_error(": a thread returned while others wait at __syncthreads");
    return;
  }
  for (Warp& warp : launch->warps) {
    if (!warp.barrier.arrived) continue;
    if (warp.mask & ~warp.alive) {
      block_error(" warp %d: a warp collective's mask names lanes that have returned", int(&warp - launch->warps.data()));
      return;
    }
    if (warp.barrier.arrived >= __builtin_popcount(warp.alive)) release(warp.barrier);
  }
}

// the linker's bounds of the section of the __shared__ variables (none: the weak symbols stay null)
extern "C" char __start_rp_host_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_rp_host_shared[] __attribute__((weak, visibility("hidden")));

inline int run_block() {
  Launch& l = *launch;
  if (__start_rp_host_shared != nullptr) {
    std::memset(__start_rp_host_shared, 0xff, size_t(__stop_rp_host_shared - __start_rp_host_shared));
  }
  std::fill(l.dynamic_shared.begin(), l.dynamic_shared.end(), (unsigned char)0xff);
  const int threads = int(l.block.x * l.block.y * l.block.z);
  for (int t = 0; t < threads; ++t) {
    Fiber& f = l.fibers[t];
    f.thread_idx = dim3{unsigned(t % l.block.x), unsigned(t / l.block.x % l.block.y), unsigned(t / (l.block.x * l.block.y))};
    f.warp = t / 32, f.lane = t % 32, f.done = false;
    // the first switch to the fiber pops six zero registers and returns into fiber_main, with the stack
    // aligned as after a call (a zero return address above it: fiber_main never returns)
    void** top = reinterpret_cast<void**>(f.stack + STACK_BYTES);
    top[-1] = nullptr;
    top[-2] = reinterpret_cast<void*>(&fiber_main);
    for (int r = 3; r <= 8; ++r) top[-r] = nullptr;
    f.sp = top - 8;
  }
  l.alive = threads;
  l.block_barrier = Barrier{};
  for (int w = 0; w < int(l.warps.size()); ++w) {
    l.warps[w].barrier = Barrier{};
    const int lanes = threads - 32 * w < 32 ? threads - 32 * w : 32;
    l.warps[w].alive = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
  }
  // The threads take turns in one direction, then the other, pass after pass (and blocks start alternately): a
  // thread that reads what another wrote without a barrier between them sees the write in some passes and not in
  // others, so such a race changes the kernel's result here instead of staying hidden behind one fixed order.
  int pass = int(l.block_idx.x + l.block_idx.y + l.block_idx.z);
  while (l.alive > 0) {
    const unsigned long before = l.events;
    const bool backwards = pass++ & 1;
    for (int i = 0; i < threads; ++i) {
      Fiber& f = l.fibers[backwards ? threads - 1 - i : i];
      if (f.done) continue;
      current = &f;
      rp_host_switch(&l.scheduler_sp, f.sp);
      if (l.error[0]) return FAILED;
      if (f.done) release_after_return();
      if (l.error[0]) return FAILED;
    }
    if (l.events == before) {
      current = nullptr;
      block_error(": %d threads wait at barriers the others never reach (a __syncthreads or warp collective inside "
                  "a branch)", l.alive);
      return FAILED;
    }
  }
  return DONE;
}

inline int run_grid(void (*body)(void*), void* arg, const unsigned* grid, const unsigned* block, size_t shared_bytes,
                    char* error, size_t error_bytes) {
  Launch l;
  l.grid = dim3{grid[0], grid[1], grid[2]};
  l.block = dim3{block[0], block[1], block[2]};
  const int threads = int(l.block.x * l.block.y * l.block.z);  // 1 to 1024: launch_kernel checked
  l.fibers.resize(threads);
  std::vector<char*>& stacks = stack_pool(threads);
  for (int t = 0; t < threads; ++t) l.fibers[t].stack = stacks[t];
  l.warps.resize((threads + 31) / 32);
  l.dynamic_shared.resize(shared_bytes ? shared_bytes : 1);  // its exact size: AddressSanitizer sees an overrun
  l.body = body;
  l.body_arg = arg;
  Launch* outer = launch;
  launch = &l;
  int status = DONE;
  for (unsigned z = 0; z < l.grid.z && !status; ++z) {
    for (unsigned y = 0; y < l.grid.y && !status; ++y) {
      for (unsigned x = 0; x < l.grid.x && !status; ++x) {
        l.block_idx = dim3{x, y, z};
        status = run_block();
      }
    }
  }
  if (status) snprintf(error, error_bytes, "%s", l.error);
  launch = outer;
  current = nullptr;
  return status;
}

// ---- a kernel's launch from its parameters as cuLaunchKernel takes them ----

// kind of a parameter: 'f' floating point, 'i' anything else (integers, pointers, structs passed by value)
template <typename P> constexpr char kind_of() { return std::is_floating_point<P>::value ? 'f' : 'i'; }

template <typename... P> struct Call {
  void (*kernel)(P...);
  void** args;
};

template <typename P> inline P read_argument(void* source) {
  P value;
  std::memcpy(&value, source, sizeof(P));
  return value;
}

template <typename... P, size_t... I> inline void invoke(Call<P...>* call, std::index_sequence<I...>) {
  call->kernel(read_argument<P>(call->args[I])...);
}

template <typename... P> inline void call_body(void* arg) {
  invoke(static_cast<Call<P...>*>(arg), std::index_sequence_for<P...>{});
}

template <typename... P>
inline int launch_kernel(void (*kernel)(P...), const char* name, int max_threads, const unsigned* grid,
                         const unsigned* block, size_t shared_bytes, void** args, const size_t* sizes,
                         const char* kinds, int nargs, char* error, size_t error_bytes) {
  constexpr int n = sizeof...(P);
  // launches a GPU refuses
  const long threads = long(block[0]) * block[1] * block[2];
  if (grid[0] * grid[1] * grid[2] == 0 || threads < 1 || threads > 1024) {
    snprintf(error, error_bytes, "%s: a grid of (%u, %u, %u) blocks of %ld threads (CUDA allows 1 to 1024)", name,
             grid[0], grid[1], grid[2], threads);
    return REFUSED;
  }
  if (threads > max_threads) {  // "too many resources requested for launch"
    snprintf(error, error_bytes, "%s: a block of %ld threads, more than its __launch_bounds__ (%d)", name, threads,
             max_threads);
    return REFUSED;
  }
  if (shared_bytes > 48 * 1024) {  // the most dynamic shared memory without cudaFuncSetAttribute
    snprintf(error, error_bytes, "%s: %zu bytes of dynamic shared memory, more than the 49152 a launch may ask for "
             "without opting in", name, shared_bytes);
    return REFUSED;
  }
  const size_t want[] = {sizeof(P)..., 0};
  const char want_kind[] = {kind_of<P>()..., 0};
  if (nargs != n) {
    snprintf(error, error_bytes, "%s takes %d arguments, got %d", name, n, nargs);
    return BAD_ARGUMENTS;
  }
  for (int i = 0; i < n; ++i) {
    if (sizes[i] != want[i] || kinds[i] != want_kind[i]) {
      snprintf(error, error_bytes,
               "%s: argument %d is a %zu-byte %s, the kernel's parameter a %zu-byte %s (cupy passes a Python int as "
               "8 bytes and a float as a double: pass numpy scalars of the parameter's type)",
               name, i, sizes[i], kinds[i] == 'f' ? "float" : "integer", want[i],
               want_kind[i] == 'f' ? "float" : "integer or pointer");
      return BAD_ARGUMENTS;
    }
  }
  Call<P...> call{kernel, args};
  return run_grid(call_body<P...>, &call, grid, block, shared_bytes, error, error_bytes);
}

}  // namespace rp_host

#include "host_device.h"  // number formats, tensor-core fragments, the CUDA functions kernels call

#endif  // RAYPAGED_HOST_RUNTIME_H
