/* pg_cuda: the runtime's door to NVIDIA GPUs.
 *
 * Compiled to real code only when the build found nvcc (PG_WITH_CUDA, see the
 * Makefile); otherwise every function reports "built without CUDA". Nothing
 * here runs at start-up: the CUDA runtime is first touched by the first call,
 * so a binary linked against the CUDA libraries starts on a machine without a
 * driver or a GPU, and only pg_cuda_available() says no.
 *
 * What exists: device discovery, device memory, a stream + cuBLAS context for
 * the kernels of kernels.h, and a self-test of every CUDA kernel against its
 * CPU twin. Not yet: device tensors in the engine, NCCL communicators per
 * parallel group (see docs/DESIGN.md, "GPUs"). */
#ifndef PG_CUDA_H
#define PG_CUDA_H

#include <stddef.h>

#include "kernels.h"

/* 1 when this build has the CUDA kernels, else 0. */
int pg_cuda_built(void);

/* 1 when at least one device can be used; else 0 and a reason in reason[n]
 * ("built without CUDA", or what the CUDA runtime said: no driver, no device). */
int pg_cuda_available(char *reason, size_t n);

/* Number of devices (0 when none or no driver). PG_ERR only when built without CUDA. */
int pg_cuda_device_count(int *count);

/* Library versions as integers (CUDA runtime 13000 = 13.0; driver 0 when none;
 * cuBLAS major*10000 + minor*100 + patch; NCCL as ncclGetVersion). None needs
 * a device. PG_ERR when built without CUDA. */
typedef struct pg_cuda_versions {
  int runtime, driver, cublas, nccl;
} pg_cuda_versions;
int pg_cuda_get_versions(pg_cuda_versions *v);

/* Device memory on the current device. pg_cuda_malloc returns NULL and sets
 * pg_error() on failure; pg_cuda_free(NULL) does nothing. */
void *pg_cuda_malloc(size_t bytes);
void pg_cuda_free(void *p);

typedef enum { PG_CUDA_HOST_TO_DEVICE, PG_CUDA_DEVICE_TO_HOST, PG_CUDA_DEVICE_TO_DEVICE } pg_cuda_copy_kind;
/* Synchronous copy of `bytes` bytes. */
int pg_cuda_memcpy(void *dst, const void *src, size_t bytes, pg_cuda_copy_kind kind);
/* Waits for all work on the current device; reports errors of earlier kernels. */
int pg_cuda_synchronize(void);

/* 1 when p points into device memory. Always 0 until pg_cuda_in_use() was
 * called (by the cuda backend): a process that never used a GPU makes no
 * CUDA call for it. */
int pg_cuda_is_device_memory(const void *p);
void pg_cuda_in_use(void);

#ifdef PG_WITH_CUDA
/* A new stream and a cuBLAS handle bound to it, on the current device, with
 * full FP32 sgemm (TF32 off). */
int pg_cuda_ctx_init(pg_cuda_ctx *ctx);
void pg_cuda_ctx_destroy(pg_cuda_ctx *ctx);
#endif

/* Runs every CUDA kernel of kernels.h on small random inputs and compares
 * with the CPU kernels (tolerances in the report). PG_OK when all pass;
 * PG_ERR when one fails or no device is available (the report says which). */
int pg_cuda_selftest(char *report, size_t n);

#endif
