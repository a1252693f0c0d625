// emu.cpp — the CPU stand-in for the CUDA runtime, cuBLAS and NCCL that
// scripts/cuda_emu_test.sh links the CUDA kernels and src/backend/pg_cuda.c against
// (see cuda_runtime.h here).
//
// A launch runs its blocks one after another. A block's threads are fibers
// on one OS thread: a fiber runs until it reaches a barrier or returns. On
// x86-64 a fiber switch is a few instructions (callee-saved registers and the
// stack pointer: glibc's swapcontext makes a system call per switch, which
// made a small GPT step take minutes); elsewhere, and under AddressSanitizer
// (which must see stack switches), ucontext. Barriers are exact: __syncthreads and __syncthreads_or release when
// every live thread of the block waits there; warp collectives (__shfl_xor_sync,
// __ballot_sync, __syncwarp, mma.h's wmma operations) when every live thread of the warp does. Anything else
// (threads of one warp in different collectives, some threads of a block at
// __syncthreads forever) is reported as a deadlock and aborts.
//
// Streams. Work queued on a stream made with cudaStreamNonBlocking (kernels,
// cuBLAS, cudaMemsetAsync, device-bound cudaMemcpyAsync) is not done when it
// is queued: it waits, in order, until the host waits for it as the CUDA
// runtime would: cudaStreamSynchronize of that stream, cudaDeviceSynchronize,
// cudaFree (an implicit device synchronisation), a cudaMemcpyAsync to host
// memory on that stream (pageable memory: it returns when the copy is done),
// and an NCCL call on that stream (which then runs at once: NCCL's own
// progress never waits for the host). cudaMemcpy on the legacy default stream
// does not wait for a non-blocking stream, here as on a GPU, so a host that
// copies a buffer the stream is still writing or reading sees the stale data
// deterministically instead of now and then. A cudaMemcpyAsync from host
// memory reads its source when it is called (CUDA stages pageable memory).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <deque>
#include <functional>
#include <map>
#include <vector>

#include "cublasLt.h"
#include "cublas_v2.h"
#include "cuda_runtime.h"
#include "kernels.h" // pg_bf16_round / pg_bf16_value: NCCL's bf16 sums
#include "mma.h"
#include "nccl.h"

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define PG_EMU_FAST_SWITCH 1
// pg_emu_switch(&save, to): pushes the callee-saved registers, stores the
// stack pointer in save, continues on the stack `to` (popping its registers).
extern "C" void pg_emu_switch(void **save, void *to);
__asm__(".text\n"
        ".globl pg_emu_switch\n"
        ".type pg_emu_switch, @function\n"
        "pg_emu_switch:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
        "  ret\n"
        ".size pg_emu_switch, .-pg_emu_switch\n");
#else
#define PG_EMU_FAST_SWITCH 0
#endif

namespace {

enum State { RUNNABLE, AT_BLOCK_BARRIER, AT_WARP_BARRIER, DONE };

struct Fiber {
#if PG_EMU_FAST_SWITCH
  void *sp;
#else
  ucontext_t ctx;
#endif
  State state;
  uint3 tid;
};

constexpr size_t STACK = 128 * 1024;
std::vector<Fiber> fibers;
// fiber stacks, reused by every launch, freed at exit
struct Stacks : std::vector<char *> {
  ~Stacks() {
    for (char *p : *this) free(p);
  }
} stacks;
#if PG_EMU_FAST_SWITCH
void *scheduler_sp;
#else
ucontext_t scheduler;
#endif
int current = -1;
pg_emu_body cur_body;
void *cur_arg;
const char *cur_name = "";
cudaError_t last_error = cudaSuccess;

// PG_EMU_STATS=1: one line at exit with what the process asked of the "device"
static long long n_launches, n_cublas, n_nccl;
static struct emu_stats {
  ~emu_stats() {
    const char *v = getenv("PG_EMU_STATS");
    if (v && *v && strcmp(v, "0"))
      fprintf(stderr, "emu: %lld kernel launches, %lld cublas calls, %lld nccl calls\n", n_launches, n_cublas, n_nccl);
  }
} emu_stats_at_exit;

// per-thread slots of the collectives
std::vector<uint64_t> slots;
std::vector<int> flags;

std::map<uintptr_t, size_t> allocations; // device "memory": start -> bytes

void wait_at(State s) {
  if (current < 0) {
    fprintf(stderr, "cuda_emu: a barrier outside a kernel\n");
    abort();
  }
  Fiber &f = fibers[current];
  f.state = s;
#if PG_EMU_FAST_SWITCH
  pg_emu_switch(&f.sp, scheduler_sp);
#else
  swapcontext(&f.ctx, &scheduler);
#endif
  threadIdx = f.tid; // resumed: this fiber's index again
}

void trampoline() {
  cur_body(cur_arg);
  fibers[current].state = DONE;
#if PG_EMU_FAST_SWITCH
  void *dead;
  pg_emu_switch(&dead, scheduler_sp); // never resumed
  abort();
#endif
  // ucontext: uc_link returns to the scheduler
}

void run_block(int nthreads) {
  if ((int)fibers.size() < nthreads) fibers.resize(nthreads);
  while ((int)stacks.size() < nthreads) {
    char *st = (char *)malloc(STACK);
    if (!st) {
      fprintf(stderr, "cuda_emu: out of memory for fiber stacks\n");
      abort();
    }
    stacks.push_back(st);
  }
  for (int i = 0; i < nthreads; i++) {
    Fiber &f = fibers[i];
    f.tid = uint3{i % blockDim.x, (i / blockDim.x) % blockDim.y, i / (blockDim.x * blockDim.y)};
    f.state = RUNNABLE;
#if PG_EMU_FAST_SWITCH
    // a stack that pg_emu_switch "returns" into trampoline from: six zero
    // registers, trampoline's address, and a zero return address above it
    // so that trampoline starts with the stack aligned as after a call
    uintptr_t top = ((uintptr_t)stacks[i] + STACK) & ~(uintptr_t)15;
    void **sp = (void **)top;
    *--sp = nullptr;
    *--sp = (void *)trampoline;
    for (int r = 0; r < 6; r++) *--sp = nullptr;
    f.sp = sp;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks[i];
    f.ctx.uc_stack.ss_size = STACK;
    f.ctx.uc_link = &scheduler;
    makecontext(&f.ctx, trampoline, 0);
#endif
  }
  const int warps = (nthreads + 31) / 32;
  for (;;) {
    for (int i = 0; i < nthreads; i++) {
      if (fibers[i].state != RUNNABLE) continue;
      current = i;
      threadIdx = fibers[i].tid;
#if PG_EMU_FAST_SWITCH
      pg_emu_switch(&scheduler_sp, fibers[i].sp);
#else
      swapcontext(&scheduler, &fibers[i].ctx);
#endif
    }
    current = -1;
    // everyone waits or is done: release what can be released
    int live = 0, at_block = 0;
    bool released = false;
    for (int w = 0; w < warps; w++) {
      int wl = 0, ww = 0;
      for (int i = w * 32; i < nthreads && i < (w + 1) * 32; i++) {
        if (fibers[i].state == DONE) continue;
        wl++;
        if (fibers[i].state == AT_WARP_BARRIER) ww++;
        if (fibers[i].state == AT_BLOCK_BARRIER) at_block++;
      }
      live += wl;
      if (ww && ww == wl) {
        for (int i = w * 32; i < nthreads && i < (w + 1) * 32; i++)
          if (fibers[i].state == AT_WARP_BARRIER) fibers[i].state = RUNNABLE;
        released = true;
      }
    }
    if (live == 0) return;
    if (released) continue;
    if (at_block == live) {
      for (int i = 0; i < nthreads; i++)
        if (fibers[i].state == AT_BLOCK_BARRIER) fibers[i].state = RUNNABLE;
      continue;
    }
    fprintf(stderr, "cuda_emu: deadlock in %s, block (%u, %u, %u): %d live threads, %d at __syncthreads\n", cur_name,
            blockIdx.x, blockIdx.y, blockIdx.z, live, at_block);
    abort();
  }
}

int linear_tid() { return (int)(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)); }

bool inside(const void *p, size_t bytes) {
  uintptr_t a = (uintptr_t)p;
  auto it = allocations.upper_bound(a);
  if (it == allocations.begin()) return false;
  --it;
  return a >= it->first && a + bytes <= it->first + it->second;
}

} // namespace

// ---- device side ----

void __syncthreads(void) { wait_at(AT_BLOCK_BARRIER); }

int __syncthreads_or(int p) {
  const int me = linear_tid();
  flags[me] = p != 0;
  wait_at(AT_BLOCK_BARRIER);
  int any = 0;
  for (int i = 0, n = (int)(blockDim.x * blockDim.y * blockDim.z); i < n; i++)
    if (fibers[i].state != DONE) any |= flags[i];
  wait_at(AT_BLOCK_BARRIER);
  return any;
}

unsigned __ballot_sync(unsigned mask, int p) {
  (void)mask;
  const int me = linear_tid(), base = me / 32 * 32;
  flags[me] = p != 0;
  wait_at(AT_WARP_BARRIER);
  unsigned bits = 0;
  const int n = (int)(blockDim.x * blockDim.y * blockDim.z);
  for (int i = base; i < base + 32 && i < n; i++)
    if (fibers[i].state != DONE && flags[i]) bits |= 1u << (i - base);
  wait_at(AT_WARP_BARRIER);
  return bits;
}

void __syncwarp(unsigned mask) {
  (void)mask;
  wait_at(AT_WARP_BARRIER);
}

// mma.h's warp collectives: the lane, and the wait for the whole warp
int nvcuda::wmma::pg_emu_wmma_lane() { return linear_tid() % 32; }
void nvcuda::wmma::pg_emu_wmma_enter() { wait_at(AT_WARP_BARRIER); }

uint64_t pg_emu_shfl_xor(uint64_t v, int m) {
  const int me = linear_tid(), partner = (me / 32 * 32) | ((me % 32) ^ m);
  slots[me] = v;
  wait_at(AT_WARP_BARRIER);
  if (partner >= (int)(blockDim.x * blockDim.y * blockDim.z) || fibers[partner].state == DONE) {
    fprintf(stderr, "cuda_emu: %s: shuffle with an absent lane %d\n", cur_name, partner);
    abort();
  }
  const uint64_t r = slots[partner];
  wait_at(AT_WARP_BARRIER);
  return r;
}

bool pg_emu_launchable(dim3 grid, dim3 block, const char *name) {
  const long long nthreads = (long long)block.x * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || nthreads <= 0 || nthreads > 1024 || block.z > 64 ||
      grid.y > 65535 || grid.z > 65535) {
    fprintf(stderr, "cuda_emu: %s: invalid launch configuration grid (%u, %u, %u) block (%u, %u, %u)\n", name, grid.x,
            grid.y, grid.z, block.x, block.y, block.z);
    last_error = cudaErrorInvalidConfiguration;
    return false;
  }
  return true;
}

void pg_emu_run(dim3 grid, dim3 block, const char *name, pg_emu_body body, void *arg) {
  n_launches++;
  if (!pg_emu_launchable(grid, block, name)) return;
  const long long nthreads = (long long)block.x * block.y * block.z;
  gridDim = grid;
  blockDim = block;
  cur_body = body;
  cur_arg = arg;
  cur_name = name;
  slots.assign(nthreads, 0);
  flags.assign(nthreads, 0);
  for (unsigned z = 0; z < grid.z; z++)
    for (unsigned y = 0; y < grid.y; y++)
      for (unsigned x = 0; x < grid.x; x++) {
        blockIdx = uint3{x, y, z};
        run_block((int)nthreads);
      }
}

// ---- streams ----

struct CUstream_st {
  unsigned flags;
  std::deque<std::function<void()>> queue;
};
namespace {
std::vector<cudaStream_t> live_streams;
bool deferred(cudaStream_t s) { return s && (s->flags & cudaStreamNonBlocking); }
// Does the queued work of s (every stream when s is null), in order.
void drain(cudaStream_t s) {
  for (cudaStream_t t : live_streams) {
    if (s && t != s) continue;
    while (!t->queue.empty()) {
      std::function<void()> w = std::move(t->queue.front());
      t->queue.pop_front();
      w();
    }
  }
}
} // namespace

void pg_emu_submit(cudaStream_t s, std::function<void()> work) {
  if (deferred(s))
    s->queue.push_back(std::move(work));
  else
    work();
}

// ---- runtime ----

extern "C" {

int pg_emu_is_device(const void *p, size_t bytes) { return inside(p, bytes); }

// The emulated node has PG_EMU_DEVICES devices (default 8: a GPU per rank of
// the usual test layouts), all backed by this process's memory.
static int emu_devices() {
  const char *v = getenv("PG_EMU_DEVICES");
  int n = v && *v ? atoi(v) : 8;
  return n > 0 ? n : 1;
}
static int emu_current_device;
cudaError_t cudaGetDeviceCount(int *count) {
  *count = emu_devices();
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int *dev) {
  *dev = emu_current_device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int dev) {
  (void)dev;
  memset(prop, 0, sizeof *prop);
  snprintf(prop->name, sizeof prop->name, "cuda_emu (CPU emulation)");
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int *v) {
  *v = 0;
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int *v) {
  *v = 0;
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) {
  cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}
const char *cudaGetErrorString(cudaError_t e) {
  switch (e) {
  case cudaSuccess: return "no error";
  case cudaErrorInvalidValue: return "invalid argument";
  case cudaErrorMemoryAllocation: return "out of memory";
  case cudaErrorInvalidConfiguration: return "invalid configuration argument";
  case cudaErrorInvalidDevicePointer: return "invalid device pointer";
  default: return "unspecified launch failure";
  }
}
const char *cudaGetErrorName(cudaError_t e) { return e == cudaSuccess ? "cudaSuccess" : "cudaError (emulated)"; }

// PG_EMU_MEMORY=bytes: the emulated device's memory (default: unlimited), so
// that "the model does not fit" can be tested
static size_t emu_in_use;
cudaError_t cudaMalloc(void **p, size_t bytes) {
  const char *limit = getenv("PG_EMU_MEMORY");
  if (limit && *limit && emu_in_use + bytes > (size_t)strtoull(limit, nullptr, 10)) {
    *p = nullptr;
    last_error = cudaErrorMemoryAllocation;
    return cudaErrorMemoryAllocation;
  }
  // aligned as cudaMalloc's (256 bytes): what WMMA's 32-byte tiles and vector loads rely on
  *p = aligned_alloc(256, bytes ? (bytes + 255) / 256 * 256 : 256);
  if (!*p) return cudaErrorMemoryAllocation;
  memset(*p, 0xA5, bytes); // not zero: kernels must write what they claim to
  allocations[(uintptr_t)*p] = bytes;
  emu_in_use += bytes;
  return cudaSuccess;
}
cudaError_t cudaFree(void *p) {
  if (!p) return cudaSuccess;
  drain(nullptr); // cudaFree synchronises the device
  auto it = allocations.find((uintptr_t)p);
  if (it == allocations.end()) return cudaErrorInvalidDevicePointer;
  emu_in_use -= it->second;
  allocations.erase(it);
  free(p);
  return cudaSuccess;
}
// Does each pointer lie on the side the kind says, and a device range inside one allocation?
static bool sides_ok(void *dst, size_t dst_span, const void *src, size_t src_span, enum cudaMemcpyKind kind,
                     bool *dst_dev, bool *src_dev) {
  *dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  *src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if ((*dst_dev && !inside(dst, dst_span)) || (*src_dev && !inside(src, src_span)) || (!*dst_dev && inside(dst, 1)) ||
      (!*src_dev && inside(src, 1))) {
    fprintf(stderr, "cuda_emu: a copy of %zu bytes: a pointer on the wrong side\n", src_span);
    return false;
  }
  return true;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind) {
  bool dst_dev, src_dev;
  if (!sides_ok(dst, bytes, src, bytes, kind, &dst_dev, &src_dev)) return cudaErrorInvalidValue;
  memmove(dst, src, bytes); // the legacy stream: waits for no non-blocking stream
  return cudaSuccess;
}
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                              enum cudaMemcpyKind kind, cudaStream_t s) {
  if (width > dpitch || width > spitch) return cudaErrorInvalidValue;
  bool dst_dev, src_dev;
  if (!sides_ok(dst, height ? (height - 1) * dpitch + width : 0, src, height ? (height - 1) * spitch + width : 0, kind,
                &dst_dev, &src_dev))
    return cudaErrorInvalidValue;
  if (!dst_dev) { // to host memory: done when it returns, after the stream's earlier work
    drain(s);
    for (size_t r = 0; r < height; r++) memmove((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
    return cudaSuccess;
  }
  if (!src_dev) { // from host memory: read now
    auto rows = std::make_shared<std::vector<char>>(height * width);
    for (size_t r = 0; r < height; r++) memcpy(rows->data() + r * width, (const char *)src + r * spitch, width);
    pg_emu_submit(s, [=] {
      for (size_t r = 0; r < height; r++) memcpy((char *)dst + r * dpitch, rows->data() + r * width, width);
    });
    return cudaSuccess;
  }
  pg_emu_submit(s, [=] {
    for (size_t r = 0; r < height; r++) memmove((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
  });
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind, cudaStream_t s) {
  return cudaMemcpy2DAsync(dst, bytes, src, bytes, bytes, 1, kind, s);
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (s) drain(s); // the legacy stream's own work is done when it is queued
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int dev) {
  if (dev < 0 || dev >= emu_devices()) return cudaErrorInvalidValue;
  emu_current_device = dev;
  return cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p) {
  memset(a, 0, sizeof *a);
  a->type = inside(p, 1) ? cudaMemoryTypeDevice : cudaMemoryTypeUnregistered;
  a->devicePointer = a->type == cudaMemoryTypeDevice ? (void *)p : nullptr;
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s) {
  if (!inside(p, bytes)) return cudaErrorInvalidValue;
  pg_emu_submit(s, [=] { memset(p, value, bytes); });
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
  drain(nullptr);
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
  *s = new CUstream_st{flags, {}};
  live_streams.push_back(*s);
  return cudaSuccess;
}
// An event stands for everything queued on its stream when it was recorded;
// waiting for it does the whole queue (earlier than a GPU might: allowed).
struct CUevent_st {
  cudaStream_t stream;
};
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
  (void)flags;
  *e = new CUevent_st{nullptr};
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  e->stream = s;
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags) {
  (void)s, (void)flags;
  if (e->stream) drain(e->stream);
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void **p, size_t bytes) { // page-locked host memory: host memory here
  *p = malloc(bytes ? bytes : 1);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeHost(void *p) {
  free(p);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  drain(s); // the stream's work finishes first
  for (size_t i = 0; i < live_streams.size(); i++)
    if (live_streams[i] == s) live_streams.erase(live_streams.begin() + (long)i);
  delete s;
  return cudaSuccess;
}

// ---- cuBLAS ----

struct cublasContext {
  cudaStream_t stream;
};

cublasStatus_t cublasCreate(cublasHandle_t *h) {
  *h = (cublasHandle_t)calloc(1, sizeof(struct cublasContext));
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t h) {
  free(h);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  h->stream = s;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode) {
  (void)mode;
  return h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}
cublasStatus_t cublasGetProperty(libraryPropertyType type, int *value) {
  *value = type == MAJOR_VERSION ? 0 : 0;
  return CUBLAS_STATUS_SUCCESS;
}
const char *cublasGetStatusString(cublasStatus_t s) {
  return s == CUBLAS_STATUS_SUCCESS ? "CUBLAS_STATUS_SUCCESS" : "cuBLAS error (emulated)";
}

// Extent in floats of a column-major rows x cols matrix with leading dimension ld.
static long long extent(int rows, int cols, int ld) { return rows && cols ? (long long)(cols - 1) * ld + rows : 0; }

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                         int k, const float *alpha, const float *A, int lda, long long sa,
                                         const float *B, int ldb, long long sb, const float *beta, float *C, int ldc,
                                         long long sc, int batch) {
  n_cublas++;
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  // cuBLAS's own checks
  const int ar = ta == CUBLAS_OP_N ? m : k, ac = ta == CUBLAS_OP_N ? k : m;
  const int br = tb == CUBLAS_OP_N ? k : n, bc = tb == CUBLAS_OP_N ? n : k;
  if (m < 0 || n < 0 || k < 0 || batch < 0 || lda < (ar > 1 ? ar : 1) || ldb < (br > 1 ? br : 1) ||
      ldc < (m > 1 ? m : 1)) {
    fprintf(stderr, "cuda_emu: sgemm: invalid value (m %d n %d k %d lda %d ldb %d ldc %d)\n", m, n, k, lda, ldb, ldc);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (m == 0 || n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;
  // every matrix inside device memory
  const long long ea = extent(ar, ac, lda) + (long long)(batch - 1) * sa;
  const long long eb = extent(br, bc, ldb) + (long long)(batch - 1) * sb;
  const long long ec = extent(m, n, ldc) + (long long)(batch - 1) * sc;
  if ((k > 0 && (!inside(A, ea * sizeof(float)) || !inside(B, eb * sizeof(float)))) || !inside(C, ec * sizeof(float))) {
    fprintf(stderr, "cuda_emu: sgemm: a matrix outside device memory (m %d n %d k %d batch %d)\n", m, n, k, batch);
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  // queued on the handle's stream; alpha and beta are host values, read now
  const float al = *alpha, be = *beta;
  pg_emu_submit(h->stream, [=] {
    for (int b = 0; b < batch; b++) {
      const float *Ab = A + b * sa, *Bb = B + b * sb;
      float *Cb = C + b * sc;
      for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
          double s = 0;
          for (int p = 0; p < k; p++) {
            const float a = ta == CUBLAS_OP_N ? Ab[i + (long long)p * lda] : Ab[p + (long long)i * lda];
            const float bv = tb == CUBLAS_OP_N ? Bb[p + (long long)j * ldb] : Bb[j + (long long)p * ldb];
            s += (double)a * bv;
          }
          float *c = Cb + i + (long long)j * ldc;
          // beta = 0: C is not read (it may hold anything)
          *c = (float)(al * s + (be == 0.0f ? 0.0 : (double)be * *c));
        }
    }
  });
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                           const float *alpha, const float *A, int lda, const float *B, int ldb, const float *beta,
                           float *C, int ldc) {
  // counted once, by the batched form
  return cublasSgemmStridedBatched(h, ta, tb, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1);
}

// The one GemmEx pipegoose calls (kernels/cuda/bf16.cu): bf16 A and B, float32
// C, CUBLAS_COMPUTE_32F (alpha and beta host floats). The bf16 inputs are
// widened exactly; each product of two bf16 values is exact in float32 (8 + 8
// significant bits), and the products are summed in float32 in order of k, so
// the result is what float32 accumulation gives, not the double sums of the
// sgemm above (a compute type that sums in double would hide a bf16 path
// that lost its float32 accumulator). Other types or compute types (the
// _FAST_ modes, a 16-bit accumulator) are refused: a caller asking for them
// is not computing what precision "bf16" promises.
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType Atype, int lda, const void *B,
                            cudaDataType Btype, int ldb, const void *beta, void *C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t algo) {
  (void)algo;
  n_cublas++;
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (Atype != CUDA_R_16BF || Btype != CUDA_R_16BF || Ctype != CUDA_R_32F || compute != CUBLAS_COMPUTE_32F) {
    fprintf(stderr,
            "cuda_emu: GemmEx: A type %d, B type %d, C type %d, compute type %d: only bf16 x bf16 -> float32 with "
            "CUBLAS_COMPUTE_32F is emulated\n",
            (int)Atype, (int)Btype, (int)Ctype, (int)compute);
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const int ar = ta == CUBLAS_OP_N ? m : k, ac = ta == CUBLAS_OP_N ? k : m;
  const int br = tb == CUBLAS_OP_N ? k : n, bc = tb == CUBLAS_OP_N ? n : k;
  if (m < 0 || n < 0 || k < 0 || lda < (ar > 1 ? ar : 1) || ldb < (br > 1 ? br : 1) || ldc < (m > 1 ? m : 1)) {
    fprintf(stderr, "cuda_emu: GemmEx: invalid value (m %d n %d k %d lda %d ldb %d ldc %d)\n", m, n, k, lda, ldb, ldc);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const uint16_t *a16 = (const uint16_t *)A, *b16 = (const uint16_t *)B;
  float *c32 = (float *)C;
  if ((k > 0 && (!inside(a16, extent(ar, ac, lda) * sizeof(uint16_t)) ||
                 !inside(b16, extent(br, bc, ldb) * sizeof(uint16_t)))) ||
      !inside(c32, extent(m, n, ldc) * sizeof(float))) {
    fprintf(stderr, "cuda_emu: GemmEx: a matrix outside device memory (m %d n %d k %d)\n", m, n, k);
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  const float al = *(const float *)alpha, be = *(const float *)beta;
  pg_emu_submit(h->stream, [=] {
    for (int j = 0; j < n; j++)
      for (int i = 0; i < m; i++) {
        float s = 0.0f;
        for (int p = 0; p < k; p++) {
          const uint16_t a = ta == CUBLAS_OP_N ? a16[i + (long long)p * lda] : a16[p + (long long)i * lda];
          const uint16_t bv = tb == CUBLAS_OP_N ? b16[p + (long long)j * ldb] : b16[j + (long long)p * ldb];
          s += pg_bf16_value(a) * pg_bf16_value(bv);
        }
        float *c = c32 + i + (long long)j * ldc;
        *c = al * s + (be == 0.0f ? 0.0f : be * *c); // beta = 0: C is not read
      }
  });
  return CUBLAS_STATUS_SUCCESS;
}

// ---- cuBLASLt (cublasLt.h here) ----

struct cublasLtContext {
  int unused;
};
struct cublasLtMatmulDescOpaque {
  cublasComputeType_t compute;
  cudaDataType scale;
  int32_t ta, tb;
  uint32_t epilogue;
  const void *bias;
  int32_t bias_type;
};
struct cublasLtMatrixLayoutOpaque {
  cudaDataType type;
  uint64_t rows, cols;
  int64_t ld;
};
struct cublasLtMatmulPreferenceOpaque {
  uint64_t max_workspace;
  uint32_t align[4];        // A, B, C, D
  uint32_t reduction_mask; // the split-K reductions allowed (cuBLASLt's default: all)
};

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
  *h = (cublasLtHandle_t)calloc(1, sizeof(struct cublasLtContext));
  return *h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  free(h);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute, cudaDataType scale) {
  *d = new cublasLtMatmulDescOpaque{compute, scale, CUBLAS_OP_N, CUBLAS_OP_N, CUBLASLT_EPILOGUE_DEFAULT, nullptr, -1};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}
// Each attribute has its type's size, as cuBLASLt checks.
static cublasStatus_t set_attr_bytes(void *dst, size_t size, const void *buf, size_t bytes) {
  if (!buf || bytes != size) return CUBLAS_STATUS_INVALID_VALUE;
  memcpy(dst, buf, size);
  return CUBLAS_STATUS_SUCCESS;
}
#define set_attr(dst, buf, bytes) set_attr_bytes(dst, sizeof *(dst), buf, bytes)
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t bytes) {
  switch (attr) {
  case CUBLASLT_MATMUL_DESC_TRANSA: return set_attr(&d->ta, buf, bytes);
  case CUBLASLT_MATMUL_DESC_TRANSB: return set_attr(&d->tb, buf, bytes);
  case CUBLASLT_MATMUL_DESC_EPILOGUE: return set_attr(&d->epilogue, buf, bytes);
  case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return set_attr(&d->bias, buf, bytes);
  case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: return set_attr(&d->bias_type, buf, bytes);
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
  if (ld < (int64_t)(rows > 1 ? rows : 1)) return CUBLAS_STATUS_INVALID_VALUE;
  *l = new cublasLtMatrixLayoutOpaque{type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  delete l;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) {
  *p = new cublasLtMatmulPreferenceOpaque{0, {256, 256, 256, 256}, CUBLASLT_REDUCTION_SCHEME_MASK}; // the defaults
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                    size_t bytes) {
  switch (attr) {
  case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: return set_attr(&p->max_workspace, buf, bytes);
  case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES: return set_attr(&p->align[0], buf, bytes);
  case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES: return set_attr(&p->align[1], buf, bytes);
  case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES: return set_attr(&p->align[2], buf, bytes);
  case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: return set_attr(&p->align[3], buf, bytes);
  case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK: return set_attr(&p->reduction_mask, buf, bytes);
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}

// What the emulation computes: bf16 A and B, float32 or bf16 C and D (the same type), CUBLAS_COMPUTE_32F, float32
// scale, D = C (in place), epilogue DEFAULT or BIAS (a float32 bias), op(A) of m x k and op(B) of k x n.
static bool lt_supported(cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                         cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t dl) {
  if (d->compute != CUBLAS_COMPUTE_32F || d->scale != CUDA_R_32F || a->type != CUDA_R_16BF ||
      b->type != CUDA_R_16BF || (dl->type != CUDA_R_32F && dl->type != CUDA_R_16BF) || c->type != dl->type ||
      c->rows != dl->rows || c->cols != dl->cols || c->ld != dl->ld)
    return false;
  if (d->epilogue != CUBLASLT_EPILOGUE_DEFAULT &&
      !(d->epilogue == CUBLASLT_EPILOGUE_BIAS && (d->bias_type == -1 || d->bias_type == CUDA_R_32F)))
    return false;
  const uint64_t m = d->ta == CUBLAS_OP_N ? a->rows : a->cols, ka = d->ta == CUBLAS_OP_N ? a->cols : a->rows;
  const uint64_t kb = d->tb == CUBLAS_OP_N ? b->rows : b->cols, n = d->tb == CUBLAS_OP_N ? b->cols : b->rows;
  return ka == kb && m == dl->rows && n == dl->cols;
}

static const uint64_t LT_EMU_ALGO = 0x4c54454d55ull, LT_EMU_WORKSPACE = 4096;

// One algorithm: it needs min(4 KiB, the allowed) of workspace and the alignments the preference promised
// (kept in the algorithm, as a real one is specialised for them).
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t dl, cublasLtMatmulPreference_t p, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int *returned) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!d || !a || !b || !c || !dl || !p || requested < 1 || !results || !returned) return CUBLAS_STATUS_INVALID_VALUE;
  *returned = 0;
  if (!lt_supported(d, a, b, c, dl)) return CUBLAS_STATUS_NOT_SUPPORTED;
  // a bf16 D: a real heuristic may pick split-K reducing the partial sums in bf16 (INPLACE, OUTPUT_TYPE: a second
  // rounding) unless the preference excludes them; the emulation offers its algorithm only where it is excluded
  if (dl->type == CUDA_R_16BF &&
      (p->reduction_mask & (CUBLASLT_REDUCTION_SCHEME_INPLACE | CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE)))
    return CUBLAS_STATUS_SUCCESS; // no algorithm found
  cublasLtMatmulHeuristicResult_t r;
  memset(&r, 0, sizeof r);
  r.algo.data[0] = LT_EMU_ALGO;
  r.workspaceSize = p->max_workspace < LT_EMU_WORKSPACE ? p->max_workspace : LT_EMU_WORKSPACE;
  r.algo.data[1] = r.workspaceSize;
  for (int i = 0; i < 4; i++) r.algo.data[2 + i] = p->align[i];
  r.algo.data[6] = (uint64_t)dl->type; // an algorithm is made for its D type, as a real one is
  r.state = CUBLAS_STATUS_SUCCESS;
  r.wavesCount = 1.0f;
  results[0] = r;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

static bool aligned_to(const void *ptr, uint64_t a) { return a && (uintptr_t)ptr % a == 0; }

// D = alpha op(A) op(B) + beta C, then the bias added to each row of D: products of the widened bf16 values
// summed in float32 in order of k, as the emulated GemmEx (so the result is the GemmEx path's: there the bias is
// written into D first and added with beta = 1, the same float32 addition).
cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t a, const void *B, cublasLtMatrixLayout_t b, const void *beta,
                              const void *C, cublasLtMatrixLayout_t c, void *D, cublasLtMatrixLayout_t dl,
                              const cublasLtMatmulAlgo_t *algo, void *workspace, size_t workspace_bytes,
                              cudaStream_t stream) {
  n_cublas++;
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!d || !a || !b || !c || !dl || !alpha || !beta || !algo || algo->data[0] != LT_EMU_ALGO)
    return CUBLAS_STATUS_INVALID_VALUE;
  if (!lt_supported(d, a, b, c, dl) || C != D) {
    fprintf(stderr, "cuda_emu: cublasLtMatmul: only bf16 x bf16 -> float32 or bf16 in place with CUBLAS_COMPUTE_32F "
                    "and the epilogue DEFAULT or BIAS is emulated\n");
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const uint64_t need = algo->data[1];
  if (workspace_bytes < need || (need && !inside(workspace, need))) {
    fprintf(stderr, "cuda_emu: cublasLtMatmul: the algorithm needs %llu bytes of device workspace, given %zu\n",
            (unsigned long long)need, workspace_bytes);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (algo->data[6] != (uint64_t)dl->type) {
    fprintf(stderr, "cuda_emu: cublasLtMatmul: an algorithm chosen for another D type\n");
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (!aligned_to(A, algo->data[2]) || !aligned_to(B, algo->data[3]) || !aligned_to(D, algo->data[5])) {
    fprintf(stderr, "cuda_emu: cublasLtMatmul: an operand less aligned than the algorithm was chosen for\n");
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const int m = (int)dl->rows, n = (int)dl->cols, k = (int)(d->ta == CUBLAS_OP_N ? a->cols : a->rows);
  const int64_t lda = a->ld, ldb = b->ld, ldd = dl->ld;
  const bool ta = d->ta != CUBLAS_OP_N, tb = d->tb != CUBLAS_OP_N;
  const uint16_t *a16 = (const uint16_t *)A, *b16 = (const uint16_t *)B;
  const bool d16 = dl->type == CUDA_R_16BF; // bf16 D: the float32 result rounded to nearest even, as cuBLASLt's
  const size_t d_size = d16 ? sizeof(uint16_t) : sizeof(float);
  float *d32 = (float *)D;
  uint16_t *dbf = (uint16_t *)D;
  const float *bias = d->epilogue == CUBLASLT_EPILOGUE_BIAS ? (const float *)d->bias : nullptr;
  if ((k > 0 && (!inside(a16, extent(ta ? k : m, ta ? m : k, (int)lda) * sizeof(uint16_t)) ||
                 !inside(b16, extent(tb ? n : k, tb ? k : n, (int)ldb) * sizeof(uint16_t)))) ||
      !inside(D, extent(m, n, (int)ldd) * d_size) ||
      (d->epilogue == CUBLASLT_EPILOGUE_BIAS && !inside(bias, (size_t)m * sizeof(float)))) {
    fprintf(stderr, "cuda_emu: cublasLtMatmul: a matrix or the bias outside device memory (m %d n %d k %d)\n", m, n,
            k);
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  const float al = *(const float *)alpha, be = *(const float *)beta;
  pg_emu_submit(stream, [=] {
    for (int j = 0; j < n; j++)
      for (int i = 0; i < m; i++) {
        float s = 0.0f;
        for (int p = 0; p < k; p++) {
          const uint16_t av = ta ? a16[p + (long long)i * lda] : a16[i + (long long)p * lda];
          const uint16_t bv = tb ? b16[j + (long long)p * ldb] : b16[p + (long long)j * ldb];
          s += pg_bf16_value(av) * pg_bf16_value(bv);
        }
        const long long at = i + (long long)j * ldd;
        const float c = be == 0.0f ? 0.0f : be * (d16 ? pg_bf16_value(dbf[at]) : d32[at]); // beta = 0: C is not read
        float v = al * s + c;
        if (bias) v += bias[i];
        if (d16)
          dbf[at] = pg_bf16_round(v);
        else
          d32[at] = v;
      }
  });
  return CUBLAS_STATUS_SUCCESS;
}

// ---- NCCL ----

ncclResult_t ncclGetVersion(int *version) {
  *version = 0;
  return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) { return r == ncclSuccess ? "no error" : "NCCL error (emulated)"; }

// Grouping needs nothing here: an emulated send never waits for its receiver
// (a snapshot in flight), so the sends and receives of a group, issued in any
// order, cannot wait on each other.
ncclResult_t ncclGroupStart(void) { return ncclSuccess; }
ncclResult_t ncclGroupEnd(void) { return ncclSuccess; }

#ifdef PG_EMU_MPI
} // extern "C"
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
extern "C" {

// ncclSend's copy in flight (MPI_Isend of a snapshot: the sender never waits
// for the receiver, as a GPU's host does not)
struct InFlight {
  MPI_Request request;
  std::vector<char> data;
};

struct ncclComm {
  MPI_Comm comm;
  int rank, size;
  std::vector<InFlight> sends; // done by the destroy at the latest
};

// A communicator over an MPI communicator it now owns.
static ncclComm_t comm_over(MPI_Comm mc) {
  ncclComm_t c = new ncclComm{mc, 0, 0, {}};
  MPI_Comm_rank(mc, &c->rank);
  MPI_Comm_size(mc, &c->size);
  return c;
}

static MPI_Datatype mpi_of(ncclDataType_t t) {
  switch (t) {
  case ncclInt32: return MPI_INT32_T;
  case ncclInt64: return MPI_INT64_T;
  case ncclFloat64: return MPI_DOUBLE;
  case ncclBfloat16: return MPI_UINT16_T;
  default: return MPI_FLOAT;
  }
}

// bf16 sums as NCCL makes them: each pairwise sum of the widened values rounded back (only sums are emulated).
static void bf16_sum(void *in, void *inout, int *len, MPI_Datatype *type) {
  const uint16_t *a = (const uint16_t *)in;
  uint16_t *b = (uint16_t *)inout;
  for (int i = 0; i < *len; i++) b[i] = pg_bf16_round(pg_bf16_value(a[i]) + pg_bf16_value(b[i]));
}

static MPI_Op op_of(ncclRedOp_t op, ncclDataType_t t) {
  if (t == ncclBfloat16) {
    static MPI_Op sum = MPI_OP_NULL;
    if (sum == MPI_OP_NULL) MPI_Op_create(bf16_sum, 1, &sum);
    return sum;
  }
  return op == ncclMax ? MPI_MAX : op == ncclMin ? MPI_MIN : MPI_SUM;
}

// the average: MPI's sum, then each element divided by the ranks (float32 only here)
static void average(void *buf, size_t n, ncclDataType_t t, ncclRedOp_t op, int size) {
  if (op != ncclAvg) return;
  if (t == ncclFloat32)
    for (size_t i = 0; i < n; i++) ((float *)buf)[i] /= (float)size;
  else if (t == ncclFloat64)
    for (size_t i = 0; i < n; i++) ((double *)buf)[i] /= size;
}

static bool on_device(const void *p, size_t bytes) {
  if (inside(p, bytes)) return true;
  fprintf(stderr, "cuda_emu: an NCCL call with a buffer outside device memory\n");
  return false;
}

static size_t size_of(ncclDataType_t t) { return t == ncclInt64 || t == ncclFloat64 ? 8 : t == ncclBfloat16 ? 2 : 4; }

// The id names the group by its first member's world rank: ncclCommInitRank
// splits MPI_COMM_WORLD by it, so every world rank must create its
// communicator of a kind at the same time (pipegoose creates them for all
// groups together, when a device engine is built).
ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  memset(id, 0, sizeof *id);
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  memcpy(id->internal, &r, sizeof r);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  int color;
  memcpy(&color, id.internal, sizeof color);
  MPI_Comm mc;
  if (MPI_Comm_split(MPI_COMM_WORLD, color, rank, &mc) != MPI_SUCCESS) return ncclSystemError;
  ncclComm_t c = comm_over(mc);
  if (c->rank != rank || c->size != nranks) {
    fprintf(stderr, "cuda_emu: ncclCommInitRank: rank %d of %d, the group has %d of %d\n", rank, nranks, c->rank,
            c->size);
    ncclCommDestroy(c);
    return ncclInvalidUsage;
  }
  *comm = c;
  return ncclSuccess;
}

// Releases the sends that the receivers have taken (all of them, waiting, when `all`).
static void reap(ncclComm_t c, bool all) {
  for (auto it = c->sends.begin(); it != c->sends.end();) {
    int done = 1;
    if (all) MPI_Wait(&it->request, MPI_STATUS_IGNORE);
    else MPI_Test(&it->request, &done, MPI_STATUS_IGNORE);
    it = done ? c->sends.erase(it) : it + 1;
  }
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
  (void)config;
  *newcomm = nullptr;
  MPI_Comm sub;
  if (MPI_Comm_split(comm->comm, color < 0 ? MPI_UNDEFINED : color, key, &sub) != MPI_SUCCESS) return ncclSystemError;
  if (sub != MPI_COMM_NULL) *newcomm = comm_over(sub);
  return ncclSuccess;
}

ncclResult_t ncclSend(const void *send, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  drain(stream); // in stream order, then at once (see "Streams" above)
  n_nccl++;
  size_t bytes = count * size_of(type);
  if (!on_device(send, bytes) || peer < 0 || peer >= comm->size || count > (size_t)1 << 30) return ncclInvalidArgument;
  reap(comm, false);
  // the snapshot's heap buffer stays put while the list grows or shrinks (moving a vector keeps its buffer)
  InFlight &f = comm->sends.emplace_back();
  f.data.assign((const char *)send, (const char *)send + bytes);
  if (MPI_Isend(f.data.data(), (int)count, mpi_of(type), peer, 0, comm->comm, &f.request)) {
    comm->sends.pop_back();
    return ncclSystemError;
  }
  return ncclSuccess;
}

ncclResult_t ncclRecv(void *recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
  drain(stream); // in stream order, then at once: the host waits here, the GPU would not
  n_nccl++;
  if (!on_device(recv, count * size_of(type)) || peer < 0 || peer >= comm->size || count > (size_t)1 << 30)
    return ncclInvalidArgument;
  return MPI_Recv(recv, (int)count, mpi_of(type), peer, 0, comm->comm, MPI_STATUS_IGNORE) ? ncclSystemError
                                                                                          : ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  reap(comm, true);
  MPI_Comm_free(&comm->comm);
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  drain(stream); // in stream order, then at once (see "Streams" above)
  n_nccl++;
  size_t bytes = count * size_of(type);
  if (!on_device(send, bytes) || !on_device(recv, bytes)) return ncclInvalidArgument;
  if (MPI_Allreduce(send == recv ? MPI_IN_PLACE : send, recv, (int)count, mpi_of(type), op_of(op, type), comm->comm))
    return ncclSystemError;
  average(recv, count, type, op, comm->size);
  return ncclSuccess;
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t recvcount, ncclDataType_t type, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) {
  drain(stream); // in stream order, then at once (see "Streams" above)
  n_nccl++;
  size_t es = size_of(type);
  if (!on_device(send, recvcount * es * comm->size) || !on_device(recv, recvcount * es)) return ncclInvalidArgument;
  // in place as NCCL defines it: recv = send + rank * recvcount
  const bool in_place = (const char *)recv == (const char *)send + (size_t)comm->rank * recvcount * es;
  void *tmp = in_place ? malloc(recvcount * es) : recv;
  if (!tmp) return ncclSystemError;
  int rc = MPI_Reduce_scatter_block(send, tmp, (int)recvcount, mpi_of(type), op_of(op, type), comm->comm);
  if (in_place) {
    memcpy(recv, tmp, recvcount * es);
    free(tmp);
  }
  if (rc) return ncclSystemError;
  average(recv, recvcount, type, op, comm->size);
  return ncclSuccess;
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t sendcount, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream) {
  drain(stream); // in stream order, then at once (see "Streams" above)
  n_nccl++;
  size_t es = size_of(type);
  if (!on_device(send, sendcount * es) || !on_device(recv, sendcount * es * comm->size)) return ncclInvalidArgument;
  const bool in_place = (const char *)send == (const char *)recv + (size_t)comm->rank * sendcount * es;
  if (MPI_Allgather(in_place ? MPI_IN_PLACE : send, (int)sendcount, mpi_of(type), recv, (int)sendcount, mpi_of(type),
                    comm->comm))
    return ncclSystemError;
  return ncclSuccess;
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t type, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  drain(stream); // in stream order, then at once (see "Streams" above)
  n_nccl++;
  size_t bytes = count * size_of(type);
  if (!on_device(recv, bytes) || (comm->rank == root && !on_device(send, bytes))) return ncclInvalidArgument;
  if (comm->rank == root && send != recv) memmove(recv, send, bytes);
  return MPI_Bcast(recv, (int)count, mpi_of(type), root, comm->comm) ? ncclSystemError : ncclSuccess;
}

// MPI_Reduce onto the root (in place there when send == recv, as NCCL allows); only the root's recv is written
ncclResult_t ncclReduce(const void *send, void *recv, size_t count, ncclDataType_t type, ncclRedOp_t op, int root,
                        ncclComm_t comm, cudaStream_t stream) {
  drain(stream); // in stream order, then at once (see "Streams" above)
  n_nccl++;
  size_t bytes = count * size_of(type);
  const bool root_here = comm->rank == root;
  if (root < 0 || root >= comm->size || !on_device(send, bytes) || (root_here && !on_device(recv, bytes)))
    return ncclInvalidArgument;
  if (MPI_Reduce(root_here && send == recv ? MPI_IN_PLACE : send, root_here ? recv : nullptr, (int)count,
                 mpi_of(type), op_of(op, type), root, comm->comm))
    return ncclSystemError;
  if (root_here) average(recv, count, type, op, comm->size);
  return ncclSuccess;
}
#endif // PG_EMU_MPI

} // extern "C"

// pipegoose opens cuBLAS on first use through a table (src/backend/pg_cublas.h); on
// the emulator the table holds the stand-ins above.
#include "pg_cublas.h"
extern "C" const pg_cublaslt_api *pg_cublaslt(void) {
  static const pg_cublaslt_api api = {cublasLtCreate,
                                      cublasLtDestroy,
                                      cublasLtMatmulDescCreate,
                                      cublasLtMatmulDescDestroy,
                                      cublasLtMatmulDescSetAttribute,
                                      cublasLtMatrixLayoutCreate,
                                      cublasLtMatrixLayoutDestroy,
                                      cublasLtMatmulPreferenceCreate,
                                      cublasLtMatmulPreferenceDestroy,
                                      cublasLtMatmulPreferenceSetAttribute,
                                      cublasLtMatmulAlgoGetHeuristic,
                                      cublasLtMatmul};
  return &api;
}
extern "C" const pg_cublas_api *pg_cublas(void) {
  static const pg_cublas_api api = {cublasCreate,          cublasDestroy, cublasSetStream,
                                    cublasSetMathMode,     cublasGetProperty,
                                    cublasGetStatusString, cublasSgemm,   cublasSgemmStridedBatched,
                                    cublasGemmEx};
  return &api;
}
