/* pg_cuda: device discovery, device memory and the kernels' context. The
 * self-test of the CUDA kernels against the CPU kernels is pg_cuda_selftest.c.
 * See pg_cuda.h. */
#include "pg_cuda.h"

#include <stdio.h>
#include <string.h>

#include "pg_error.h"

#ifndef PG_WITH_CUDA

/* ---- built without CUDA: every entry point says so ---- */

#define PG_NO_CUDA "built without CUDA (nvcc was not found, or make CUDA=0)"

int pg_cuda_built(void) { return 0; }

int pg_cuda_available(char *reason, size_t n) {
  if (reason && n) snprintf(reason, n, "%s", PG_NO_CUDA);
  return 0;
}

int pg_cuda_device_count(int *count) {
  if (count) *count = 0;
  return pg_fail("%s", PG_NO_CUDA);
}

int pg_cuda_get_versions(pg_cuda_versions *v) {
  if (v) memset(v, 0, sizeof *v);
  return pg_fail("%s", PG_NO_CUDA);
}

void *pg_cuda_malloc(size_t bytes) {
  (void)bytes;
  return pg_fail_null("%s", PG_NO_CUDA);
}

void pg_cuda_free(void *p) { (void)p; }

int pg_cuda_memcpy(void *dst, const void *src, size_t bytes, pg_cuda_copy_kind kind) {
  (void)dst, (void)src, (void)bytes, (void)kind;
  return pg_fail("%s", PG_NO_CUDA);
}

int pg_cuda_synchronize(void) { return pg_fail("%s", PG_NO_CUDA); }
int pg_cuda_is_device_memory(const void *p) {
  (void)p;
  return 0;
}
void pg_cuda_in_use(void) {}

#else /* PG_WITH_CUDA */

#include <cublas_v2.h>

#include "pg_cublas.h"
#include "pg_env.h"
#include <cuda_runtime.h>
#include <math.h>
#include <nccl.h>
#include <omp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>

int pg_cuda_built(void) { return 1; }

int pg_cuda_device_count(int *count) {
  int c = 0;
  cudaError_t e = cudaGetDeviceCount(&c);
  if (e != cudaSuccess) {
    (void)cudaGetLastError(); /* not sticky: clear it */
    c = 0;
  }
  if (count) *count = c;
  return PG_OK;
}

int pg_cuda_available(char *reason, size_t n) {
  int c = 0;
  cudaError_t e = cudaGetDeviceCount(&c);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    int driver = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
    (void)cudaGetLastError();
    if (reason && n) {
      if (driver == 0)
        snprintf(reason, n, "no CUDA driver on this machine (%s: %s)", cudaGetErrorName(e), cudaGetErrorString(e));
      else
        snprintf(reason, n, "no usable CUDA device (%s: %s)", cudaGetErrorName(e), cudaGetErrorString(e));
    }
    return 0;
  }
  if (c <= 0) {
    if (reason && n) snprintf(reason, n, "no CUDA device found");
    return 0;
  }
  if (reason && n) reason[0] = '\0';
  return 1;
}

int pg_cuda_get_versions(pg_cuda_versions *v) {
  if (!v) return pg_fail("pg_cuda_get_versions: NULL");
  memset(v, 0, sizeof *v);
  if (cudaRuntimeGetVersion(&v->runtime) != cudaSuccess) v->runtime = 0;
  if (cudaDriverGetVersion(&v->driver) != cudaSuccess) v->driver = 0; /* 0: no driver */
  (void)cudaGetLastError();
  int major = 0, minor = 0, patch = 0;
  const pg_cublas_api *b = pg_cublas(); /* loads cuBLAS: 0 when it cannot */
  if (b && b->GetProperty(MAJOR_VERSION, &major) == CUBLAS_STATUS_SUCCESS &&
      b->GetProperty(MINOR_VERSION, &minor) == CUBLAS_STATUS_SUCCESS &&
      b->GetProperty(PATCH_LEVEL, &patch) == CUBLAS_STATUS_SUCCESS)
    v->cublas = major * 10000 + minor * 100 + patch;
  if (ncclGetVersion(&v->nccl) != ncclSuccess) v->nccl = 0;
  return PG_OK;
}

void *pg_cuda_malloc(size_t bytes) {
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return pg_fail_null("cudaMalloc of %zu bytes failed: %s", bytes, cudaGetErrorString(e));
  }
  return p;
}

void pg_cuda_free(void *p) {
  if (p) cudaFree(p);
}

int pg_cuda_memcpy(void *dst, const void *src, size_t bytes, pg_cuda_copy_kind kind) {
  enum cudaMemcpyKind k = kind == PG_CUDA_HOST_TO_DEVICE   ? cudaMemcpyHostToDevice
                          : kind == PG_CUDA_DEVICE_TO_HOST ? cudaMemcpyDeviceToHost
                                                           : cudaMemcpyDeviceToDevice;
  cudaError_t e = cudaMemcpy(dst, src, bytes, k);
  if (e != cudaSuccess) return pg_fail("cudaMemcpy of %zu bytes failed: %s", bytes, cudaGetErrorString(e));
  return PG_OK;
}

int pg_cuda_synchronize(void) {
  cudaError_t e = cudaDeviceSynchronize();
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) return pg_fail("CUDA error: %s", cudaGetErrorString(e));
  return PG_OK;
}

static int cuda_used;

void pg_cuda_in_use(void) { cuda_used = 1; }

int pg_cuda_is_device_memory(const void *p) {
  if (!cuda_used || !p) return 0;
  struct cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError(); /* host memory unknown to CUDA: not an error */
    return 0;
  }
  return a.type == cudaMemoryTypeDevice;
}

int pg_cuda_ctx_init(pg_cuda_ctx *ctx) {
  memset(ctx, 0, sizeof *ctx);
  cudaStream_t s = NULL;
  cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (e != cudaSuccess) return pg_fail("cudaStreamCreate failed: %s", cudaGetErrorString(e));
  const pg_cublas_api *b = pg_cublas();
  if (!b) {
    cudaStreamDestroy(s);
    return PG_ERR; /* pg_cublas said why */
  }
  cublasHandle_t h = NULL;
  cublasStatus_t st = b->Create(&h);
  if (st != CUBLAS_STATUS_SUCCESS) {
    cudaStreamDestroy(s);
    return pg_fail("cublasCreate failed: %s", b->GetStatusString(st));
  }
  /* Full FP32 products: no TF32 (its 10-bit mantissa would break the CPU parity). */
  if ((st = b->SetMathMode(h, CUBLAS_DEFAULT_MATH)) != CUBLAS_STATUS_SUCCESS ||
      (st = b->SetStream(h, s)) != CUBLAS_STATUS_SUCCESS) {
    b->Destroy(h);
    cudaStreamDestroy(s);
    return pg_fail("cuBLAS set-up failed: %s", b->GetStatusString(st));
  }
  ctx->stream = s;
  ctx->cublas = h;
  /* cuBLASLt when it loads (PG_CUBLASLT=0: not even then); without it precision bf16's products use GemmEx */
  int want_lt = 1;
  if (pg_env_bool("PG_CUBLASLT", &want_lt)) {
    pg_cuda_ctx_destroy(ctx);
    return PG_ERR;
  }
  const pg_cublaslt_api *lt = want_lt ? pg_cublaslt() : NULL;
  pg_cuda_lt *state = lt ? calloc(1, sizeof *state) : NULL;
  if (state && lt->Create(&state->handle) != CUBLAS_STATUS_SUCCESS) {
    free(state);
    state = NULL;
  }
  ctx->lt = state;
  return PG_OK;
}

void pg_cuda_ctx_destroy(pg_cuda_ctx *ctx) {
  if (!ctx) return;
  pg_cuda_lt *lt = ctx->lt;
  if (lt) {
    pg_cublaslt()->Destroy(lt->handle);
    if (lt->workspace) cudaFree(lt->workspace);
    free(lt);
    ctx->lt = NULL;
  }
  const pg_cublas_api *b = ctx->cublas ? pg_cublas() : NULL;
  if (b) b->Destroy((cublasHandle_t)ctx->cublas);
  if (ctx->stream) cudaStreamDestroy((cudaStream_t)ctx->stream);
  ctx->cublas = ctx->stream = NULL;
}

#endif /* PG_WITH_CUDA */
