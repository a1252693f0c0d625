/* pg_backend: where the runtime's memory lives and what computes on it.
 *
 * The modules, the engine and the optimizer never allocate, clear or copy
 * their working memory themselves and never call a kernel directly: they go
 * through a backend. A backend is a table of operations on memory of one
 * device: allocate / free / clear / copy (plain and strided, between host
 * and device), synchronise, and the kernels of kernels.h with the contracts
 * written there, all returning PG_OK or PG_ERR with pg_error() set.
 *
 * Backends: "cpu" (kernels/cpu: today's arithmetic, bit for bit) and, in a
 * build with CUDA, "cuda" (kernels/cuda on one device and one stream).
 * Pointers handed to a backend's kernels are that backend's memory; host
 * pointers go in and out only through copy/copy2d. Scalars that the runtime
 * reads on the host (a loss sum, a sum of squares) are returned in host
 * doubles. */
#ifndef PG_BACKEND_H
#define PG_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "pg_tensor.h"

typedef enum {
  PG_COPY_HOST_TO_DEVICE = 0,
  PG_COPY_DEVICE_TO_HOST,
  PG_COPY_DEVICE_TO_DEVICE
} pg_copy_kind;

typedef struct pg_backend pg_backend;
typedef struct pg_adamw_piece pg_adamw_piece; /* kernels.h: a piece of the fused AdamW step */

typedef struct pg_backend_ops {
  /* ---- memory ---- */
  /* `bytes` zeroed bytes (NULL and pg_error() when there is no room). */
  void *(*alloc)(const pg_backend *b, size_t bytes);
  void (*release)(const pg_backend *b, void *p); /* NULL: nothing */
  int (*zero)(const pg_backend *b, void *p, size_t bytes);
  int (*copy)(const pg_backend *b, void *dst, const void *src, size_t bytes, pg_copy_kind kind);
  /* rows x width_bytes, rows dpitch / spitch bytes apart (column blocks of matrices). */
  int (*copy2d)(const pg_backend *b, void *dst, size_t dpitch, const void *src, size_t spitch, size_t width_bytes,
                size_t rows, pg_copy_kind kind);
  /* Everything queued so far has finished (and its errors are reported). */
  int (*sync)(const pg_backend *b);

  /* ---- kernels: one member per row of kernels/kernel_list.h (the contracts of kernels.h) ----
   *   int (*name)(const pg_backend *b, params); */
#define PG_BACKEND_PARAMS(...) (const pg_backend *b, __VA_ARGS__)
#define PG_KERNEL(name, params, args, cpu, cuda, selftest) int(*name) PG_BACKEND_PARAMS params;
#include "kernel_list.h"

  /* ---- sizes ---- */
  /* floats of scratch attention_backward needs for up to `rows` query rows (B T) of NH heads */
  int64_t (*attention_scratch_floats)(const pg_backend *b, int64_t rows, int NH);
} pg_backend_ops;

struct pg_backend {
  const char *name;   /* "cpu" or "cuda" */
  pg_device device;
  int ordinal;        /* device number (0 on the CPU) */
  const pg_backend_ops *ops;
  void *impl;         /* the backend's own state (CUDA: stream and cuBLAS handle) */
  void *stream;       /* the device's queue (cudaStream_t) its work and collectives go on; NULL on the CPU */
};

/* The CPU backend (one, shared; never freed). */
const pg_backend *pg_backend_cpu(void);
/* The backend of CUDA device `ordinal` (created on first use, one per device
 * and process, never freed: a stream and a cuBLAS handle); NULL and
 * pg_error() when the build has no CUDA or the device cannot be used. */
const pg_backend *pg_backend_cuda(int ordinal);
/* By name: "cpu"; "cuda" (device node-rank mod the node's devices, so ranks
 * on a node spread over its GPUs); "cuda:N". NULL and pg_error() otherwise. */
const pg_backend *pg_backend_named(const char *device);

/* A storage (pg_tensor.h) of `bytes` zeroed bytes in the backend's memory,
 * released there when its last reference goes: what tensors of the runtime's
 * buffers (flat parameters and gradients, optimizer state) view. */
pg_storage *pg_backend_storage(const pg_backend *b, size_t bytes);

/* The backend's FP32 product rate, the peak the benchmarks compare with:
 * `reps` products of n x n matrices (its matmul_forward: cuBLAS with TF32
 * off, or OpenBLAS) after one warm-up, timed on the host around a
 * synchronisation; *gflops set. */
int pg_backend_sgemm_gflops(const pg_backend *b, int n, int reps, double *gflops);
/* The same for the bf16 GEMM with float32 sums (matmul_bf16_forward: cublasGemmEx with
 * CUBLAS_COMPUTE_32F, or oneDNN / widen-and-sgemm): the peak precision "bf16"'s MFU is measured against. */
int pg_backend_bf16_gemm_gflops(const pg_backend *b, int n, int reps, double *gflops);

/* PG_OK when the flash_bf16 kernels take this shape, else PG_ERR with an error naming what (e.g.
 * "flash_bf16_forward: the head size is not 64 or 128 (...)"): kernels.h's pg_flash_bf16_unsupported, the
 * check both backends' flash_bf16_* adapters make first; a caller falls back to the float32 attention. */
int pg_backend_flash_bf16_refused(const char *what, int B, int T, int NH, int NKV, int HS);
/* The flash_bf16 kernels' time on backend b: `reps` forward and `reps` backward passes of causal attention on
 * B x T rows, NH heads, NKV kv heads of HS (zeroed inputs: the kernels' work does not depend on the values),
 * after one warm-up of each, each timed on the host around a synchronisation; *fwd_s, *bwd_s the seconds per
 * pass. */
int pg_backend_flash_bf16_seconds(const pg_backend *b, int B, int T, int NH, int NKV, int HS, int reps, double *fwd_s,
                                  double *bwd_s);
/* buf = "cpu" or "cuda:N": where b's memory is, as t:device() says it (messages, info.device); returns buf. */
const char *pg_backend_place(const pg_backend *b, char *buf, size_t n);

/* The backend whose memory holds a storage (cpu, or cuda of its device). */
const pg_backend *pg_backend_of(const pg_storage *s);

/* Whether `p` points into a device backend's memory rather than the host's:
 * what the collectives ask before they pick NCCL or stage a buffer through
 * the host. 0 in a build without a device backend. */
int pg_backend_is_device_memory(const void *p);

/* A new zeroed tensor (own storage) in backend b's memory. */
int pg_backend_tensor(const pg_backend *b, pg_tensor *out, pg_dtype dtype, int ndim, const int64_t *shape);
/* dst = src element for element, each on any device (pg_tensor_copy between
 * host tensors; otherwise the device side's backend copies). */
int pg_backend_copy_tensor(pg_tensor *dst, const pg_tensor *src);

/* pg_tensor_narrow_copy and pg_tensor_cat on any device: host tensors
 * through those; device tensors (all of one backend) by the backend's
 * strided copies, in its memory. Moving values, no arithmetic: the same bits
 * everywhere. */
int pg_backend_narrow_copy(pg_tensor *out, const pg_tensor *t, int dim, int64_t start, int64_t len);
int pg_backend_cat(pg_tensor *out, const pg_tensor *const *ts, int n, int dim);

/* Zeroed working memory, and its release: shorthands. */
static inline float *pg_be_floats(const pg_backend *b, size_t n) { return b->ops->alloc(b, n * sizeof(float)); }
static inline void pg_be_release(const pg_backend *b, void *p) {
  if (p) b->ops->release(b, p);
}

#endif
