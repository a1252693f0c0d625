/* cuda_emu/cuda_runtime.h — a stand-in for the CUDA runtime, for running the
 * CUDA kernels on the CPU where no GPU exists (scripts/cuda_emu_test.sh).
 * Only what kernels/cuda and src/backend/pg_cuda.c use. Device memory is host memory;
 * a launch runs its blocks one after another, each block's threads as fibers
 * that switch at __syncthreads and warp collectives (see emu.cpp). Work on a
 * non-blocking stream waits in the stream's queue until something the CUDA
 * runtime would make wait for it does (see emu.cpp: "streams"). It checks
 * logic, indexing, barriers and stream order; it says nothing about speed.
 * Not the real API: never installed, never linked into the library. */
#ifndef PG_CUDA_EMU_RUNTIME_H
#define PG_CUDA_EMU_RUNTIME_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorLaunchFailure = 719
} cudaError_t;

enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice };

typedef struct CUstream_st *cudaStream_t;
#define cudaStreamNonBlocking 0x01
typedef struct CUevent_st *cudaEvent_t;
#define cudaEventDisableTiming 0x02

struct cudaDeviceProp {
  char name[256];
  int major, minor;
};

cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaGetDevice(int *dev);
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int dev);
cudaError_t cudaRuntimeGetVersion(int *v);
cudaError_t cudaDriverGetVersion(int *v);
cudaError_t cudaGetLastError(void);
const char *cudaGetErrorString(cudaError_t e);
const char *cudaGetErrorName(cudaError_t e);
cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind);
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind, cudaStream_t s);
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                              enum cudaMemcpyKind kind, cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaSetDevice(int dev);
enum cudaMemoryType { cudaMemoryTypeUnregistered = 0, cudaMemoryTypeHost = 1, cudaMemoryTypeDevice = 2 };
struct cudaPointerAttributes {
  enum cudaMemoryType type;
  int device;
  void *devicePointer, *hostPointer;
};
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaMallocHost(void **p, size_t bytes);
cudaError_t cudaFreeHost(void *p);

/* emulator's own: is [p, p + bytes) inside one live device allocation? */
int pg_emu_is_device(const void *p, size_t bytes);

#ifdef __cplusplus
}

/* ---- device side ---- */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <memory>
#include <tuple>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static /* blocks run one at a time: one instance per block */

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

/* set by the scheduler for the fiber that runs */
extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;

void __syncthreads(void);
int __syncthreads_or(int p);
unsigned __ballot_sync(unsigned mask, int p);
/* waits until every live lane of the warp is here (a warp barrier: what one lane wrote before it, the others
 * see after it) */
void __syncwarp(unsigned mask = 0xffffffffu);
/* exchange 8 bytes with lane (lane ^ m) of this warp */
uint64_t pg_emu_shfl_xor(uint64_t v, int m);

template <typename T> T __shfl_xor_sync(unsigned mask, T v, int m) {
  (void)mask;
  static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof v);
  bits = pg_emu_shfl_xor(bits, m);
  T r;
  memcpy(&r, &bits, sizeof r);
  return r;
}

inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline unsigned __float_as_uint(float f) {
  unsigned u;
  memcpy(&u, &f, sizeof u);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
/* separately rounded operations (the emulator builds with -ffp-contract=off) */
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }

typedef void (*pg_emu_body)(void *);
/* Runs body(arg) for every thread of every block; sets the last error on a bad configuration. */
void pg_emu_run(dim3 grid, dim3 block, const char *name, pg_emu_body body, void *arg);

/* Is the configuration launchable? (sets the last error when not, as a launch does) */
bool pg_emu_launchable(dim3 grid, dim3 block, const char *name);
/* Runs work now, or queues it on a non-blocking stream s (emu.cpp: "streams"). */
void pg_emu_submit(cudaStream_t s, std::function<void()> work);

template <typename... P> struct pg_emu_launcher {
  void (*kernel)(P...);
  dim3 grid, block;
  const char *name;
  cudaStream_t stream;
  template <typename... A> void operator()(A... a) {
    if (!pg_emu_launchable(grid, block, name)) return;
    /* the arguments are copied at the launch, as CUDA copies them */
    auto args = std::make_shared<std::tuple<P...>>(static_cast<P>(a)...);
    void (*k)(P...) = kernel;
    dim3 g = grid, b = block;
    const char *n = name;
    pg_emu_submit(stream, [k, args, g, b, n] {
      struct call {
        void (*kernel)(P...);
        std::tuple<P...> *args;
        static void run(void *self) {
          call *c = (call *)self;
          std::apply(c->kernel, *c->args);
        }
      } c{k, args.get()};
      pg_emu_run(g, b, n, &call::run, &c);
    });
  }
};

/* kernel<<<grid, block, smem, stream>>>(args) becomes
 * pg_emu_launch(kernel, grid, block, smem, stream)(args) (scripts/cuda_emu_test.sh) */
template <typename... P>
pg_emu_launcher<P...> pg_emu_launch_named(const char *name, void (*kernel)(P...), dim3 grid, dim3 block,
                                         size_t smem = 0, cudaStream_t s = 0) {
  (void)smem;
  return pg_emu_launcher<P...>{kernel, grid, block, name, s};
}
#define pg_emu_launch(kernel, ...) pg_emu_launch_named(#kernel, kernel, __VA_ARGS__)

#endif /* __cplusplus */

#endif
