/* The cuda backend: device memory and the kernels of kernels/cuda on one
 * device and one stream (pg_backend.h). Every operation is queued on the
 * backend's stream; copies that touch host memory wait for it, so the host
 * may read (or reuse) its buffer when they return. Errors read
 * "<what> on cuda:<dev>: <CUDA or cuBLAS message>". */
#include "pg_backend.h"

#include "pg_error.h"

#ifndef PG_WITH_CUDA

const pg_backend *pg_backend_cuda(int ordinal) {
  (void)ordinal;
  return pg_fail_null("device = 'cuda': this build has no CUDA (rebuild where nvcc is found, or make emu)");
}

#else

#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "pg_cuda.h"
#include "pg_size.h"

#define PG_CUDA_MAX_DEVICES 64

typedef struct cuda_impl {
  pg_cuda_ctx ctx;
  double *scalars; /* device scratch: 1 result + PG_CUDA_SUMSQ_BLOCKS partials */
  /* the fused AdamW step's last table (cu_adamw_update_pieces), laid out as the kernel reads it: starts
   * [adamw_cap + 1] then pieces [adamw_cap]; on the host (to tell whether the next step's is the same) and on the
   * device */
  void *adamw_host, *adamw_dev;
  int adamw_n, adamw_cap;
} cuda_impl;

static pg_backend backends[PG_CUDA_MAX_DEVICES];
static cuda_impl impls[PG_CUDA_MAX_DEVICES];

static cudaStream_t stream_of(const pg_backend *b) { return (cudaStream_t)((cuda_impl *)b->impl)->ctx.stream; }
static const pg_cuda_ctx *ctx_of(const pg_backend *b) { return &((cuda_impl *)b->impl)->ctx; }

static int cuda_failed(const pg_backend *b, const char *what, cudaError_t e) {
  (void)cudaGetLastError(); /* clear a sticky-free error so the next call reports its own */
  return pg_fail("%s on cuda:%d: %s", what, b->ordinal, cudaGetErrorString(e));
}

/* A kernel's return code (kernels.h: 0, a CUDA error, a cuBLAS status, EINVAL). */
static int kernel_rc(const pg_backend *b, const char *what, int rc) {
  return rc ? pg_fail("%s on cuda:%d: %s", what, b->ordinal, pg_cuda_strerror(rc)) : PG_OK;
}

static int wait_stream(const pg_backend *b, const char *what) {
  cudaError_t e = cudaStreamSynchronize(stream_of(b));
  return e == cudaSuccess ? PG_OK : cuda_failed(b, what, e);
}

static void *cu_alloc(const pg_backend *b, size_t bytes) {
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
  if (e != cudaSuccess) {
    cuda_failed(b, "allocating device memory", e);
    return pg_fail_null("%s (%zu bytes)", pg_error(), bytes);
  }
  if (bytes && (e = cudaMemsetAsync(p, 0, bytes, stream_of(b))) != cudaSuccess) {
    cudaFree(p);
    cuda_failed(b, "clearing device memory", e);
    return NULL;
  }
  return p;
}

static void cu_release(const pg_backend *b, void *p) {
  (void)b;
  cudaFree(p); /* waits for the work that may still use it */
}

static int cu_zero(const pg_backend *b, void *p, size_t bytes) {
  cudaError_t e = bytes ? cudaMemsetAsync(p, 0, bytes, stream_of(b)) : cudaSuccess;
  return e == cudaSuccess ? PG_OK : cuda_failed(b, "clearing device memory", e);
}

static enum cudaMemcpyKind kind_of(pg_copy_kind k) {
  return k == PG_COPY_HOST_TO_DEVICE   ? cudaMemcpyHostToDevice
         : k == PG_COPY_DEVICE_TO_HOST ? cudaMemcpyDeviceToHost
                                       : cudaMemcpyDeviceToDevice;
}

static int cu_copy(const pg_backend *b, void *dst, const void *src, size_t bytes, pg_copy_kind kind) {
  if (!bytes || dst == src) return PG_OK;
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind_of(kind), stream_of(b));
  if (e != cudaSuccess) return cuda_failed(b, "copying memory", e);
  return kind == PG_COPY_DEVICE_TO_DEVICE ? PG_OK : wait_stream(b, "copying memory");
}

static int cu_copy2d(const pg_backend *b, void *dst, size_t dpitch, const void *src, size_t spitch, size_t width_bytes,
                     size_t rows, pg_copy_kind kind) {
  if (!rows || !width_bytes) return PG_OK;
  cudaError_t e = cudaMemcpy2DAsync(dst, dpitch, src, spitch, width_bytes, rows, kind_of(kind), stream_of(b));
  if (e != cudaSuccess) return cuda_failed(b, "copying a strided block", e);
  return kind == PG_COPY_DEVICE_TO_DEVICE ? PG_OK : wait_stream(b, "copying a strided block");
}

static int cu_sync(const pg_backend *b) { return wait_stream(b, "synchronising"); }

/* The adapters, from kernels/kernel_list.h. CALL: the kernel of
 * kernels/cuda on this backend's stream and cuBLAS handle, its return code
 * made PG_OK / pg_error; the redeclaration makes a row whose parameters are
 * not the kernel's a compile error. OWN: written below. */
#define PG_CUDA_ARGS(...) __VA_ARGS__
#define CUDA_CALL(name, params, args)                                                                                  \
  int pg_cuda_##name(const pg_cuda_ctx *ctx, PG_CUDA_ARGS params);                                                     \
  static int cu_##name PG_BACKEND_PARAMS params {                                                                      \
    return kernel_rc(b, #name, pg_cuda_##name(ctx_of(b), PG_CUDA_ARGS args));                                          \
  }
#define CUDA_OWN(name, params, args) static int cu_##name PG_BACKEND_PARAMS params;
#define PG_KERNEL(name, params, args, cpu, cuda, selftest) CUDA_##cuda(name, params, args)
#include "kernel_list.h"

static int64_t cu_attention_scratch_floats(const pg_backend *b, int64_t rows, int NH) {
  (void)b;
  return pg_cuda_attention_scratch_floats(rows, NH);
}

/* ---- the OWN adapters ---- */

/* The device double scratch of results the host reads. */
static double *scalars(const pg_backend *b) {
  cuda_impl *im = b->impl;
  if (!im->scalars) im->scalars = cu_alloc(b, (1 + PG_CUDA_SUMSQ_BLOCKS) * sizeof(double));
  return im->scalars;
}

static int cu_xent_finish(const pg_backend *b, float *losses, float *dlogits, const float *logits, const float *row_max,
                          const float *sumexp, const float *target_logit, const int32_t *targets, int N, int V,
                          int valid, int vocab_start, float dloss, double *loss_sum) {
  double *d = loss_sum ? scalars(b) : NULL;
  if (loss_sum && !d) return PG_ERR;
  if (kernel_rc(b, "xent_finish",
                pg_cuda_xent_finish(ctx_of(b), losses, dlogits, logits, row_max, sumexp, target_logit, targets, N, V,
                                    valid, vocab_start, dloss, d)))
    return PG_ERR;
  return loss_sum ? cu_copy(b, loss_sum, d, sizeof(double), PG_COPY_DEVICE_TO_HOST) : PG_OK;
}

static int cu_sum_squares(const pg_backend *b, const float *x, int64_t n, double *out) {
  double *d = scalars(b);
  if (!d) return PG_ERR;
  if (kernel_rc(b, "sum_squares", pg_cuda_sum_squares(ctx_of(b), d, x, n, d + 1))) return PG_ERR;
  return cu_copy(b, out, d, sizeof(double), PG_COPY_DEVICE_TO_HOST);
}

/* The tensor-core kernels' WMMA tiles load and store 32-byte aligned: a buffer that is not (a device view at an
 * offset) is refused by name here rather than as the kernel's invalid argument. */
static int flash_misaligned(const char *what, const char *name, const void *p) {
  if (((uintptr_t)p & 31u) == 0) return PG_OK;
  return pg_fail("%s: %s is not 32-byte aligned (a device view at an offset?): the tensor-core kernels need it; "
                 "pass a copy (:clone())", what, name);
}

static int cu_flash_bf16_forward(const pg_backend *b, float *out, uint16_t *out16, float *lse, const uint16_t *qkv,
                                 const float *slopes, int B, int T, int NH, int NKV, int HS) {
  if (pg_backend_flash_bf16_refused("flash_bf16_forward", B, T, NH, NKV, HS) ||
      flash_misaligned("flash_bf16_forward", "qkv", qkv) || flash_misaligned("flash_bf16_forward", "out", out))
    return PG_ERR;
  return kernel_rc(b, "flash_bf16_forward",
                   pg_cuda_flash_bf16_forward(ctx_of(b), out, out16, lse, qkv, slopes, B, T, NH, NKV, HS));
}

static int cu_flash_bf16_backward(const pg_backend *b, float *dqkv, uint16_t *dqkv16, float *delta, const uint16_t *dout,
                                  const float *out, const uint16_t *qkv, const float *lse, const float *slopes,
                                  int B, int T, int NH, int NKV, int HS) {
  if (pg_backend_flash_bf16_refused("flash_bf16_backward", B, T, NH, NKV, HS) ||
      flash_misaligned("flash_bf16_backward", "qkv", qkv) || flash_misaligned("flash_bf16_backward", "dout", dout) ||
      (dqkv && flash_misaligned("flash_bf16_backward", "dqkv", dqkv)))
    return PG_ERR;
  if (!dqkv && !dqkv16) return pg_fail("flash_bf16_backward: neither dqkv nor dqkv16 to write");
  return kernel_rc(b, "flash_bf16_backward", pg_cuda_flash_bf16_backward(ctx_of(b), dqkv, dqkv16, delta, dout, out,
                                                                         qkv, lse, slopes, B, T, NH, NKV, HS));
}

/* The fused AdamW step's table: starts, then pieces, of a table with room for cap pieces. */
static int64_t *adamw_starts(void *table) { return table; }
static pg_adamw_piece *adamw_pieces(void *table, int cap) {
  return (pg_adamw_piece *)((char *)table + ((size_t)cap + 1) * sizeof(int64_t));
}

static int same_piece(const pg_adamw_piece *x, const pg_adamw_piece *y) {
  return x->param == y->param && x->grad == y->grad && x->m == y->m && x->v == y->v && x->n == y->n &&
         !x->decay == !y->decay;
}

/* Makes the device table that of `pieces`. An optimizer's pieces are the same every step, so after its first step
 * this compares and uploads nothing; another table (a second optimizer, storage moved) is uploaded in its place. */
static int adamw_table(const pg_backend *b, const pg_adamw_piece *pieces, int npieces) {
  cuda_impl *im = b->impl;
  if (im->adamw_host && npieces == im->adamw_n) {
    const pg_adamw_piece *have = adamw_pieces(im->adamw_host, im->adamw_cap);
    int k = 0;
    while (k < npieces && same_piece(&have[k], &pieces[k])) k++;
    if (k == npieces) return PG_OK;
  }
  const size_t bytes = ((size_t)npieces + 1) * sizeof(int64_t) + (size_t)npieces * sizeof(pg_adamw_piece);
  if (npieces > im->adamw_cap) {
    void *host = malloc(bytes), *dev = host ? cu_alloc(b, bytes) : NULL;
    if (!dev) {
      free(host);
      return host ? PG_ERR : pg_fail("fused AdamW step: out of host memory for a table of %d pieces", npieces);
    }
    free(im->adamw_host);
    if (im->adamw_dev) cu_release(b, im->adamw_dev);
    im->adamw_host = host, im->adamw_dev = dev, im->adamw_cap = npieces;
  }
  im->adamw_n = 0; /* until the upload succeeds */
  int64_t *starts = adamw_starts(im->adamw_host);
  pg_adamw_piece *table = adamw_pieces(im->adamw_host, im->adamw_cap);
  starts[0] = 0;
  for (int k = 0; k < npieces; k++) {
    if (pieces[k].n < 0) return pg_fail("fused AdamW step: piece %d has %lld elements", k, (long long)pieces[k].n);
    if (pg_add_overflows(starts[k], pieces[k].n, &starts[k + 1]))
      return pg_fail("fused AdamW step: the pieces' sizes overflow int64");
    table[k] = pieces[k];
  }
  /* starts, then (at the same offset as on the host) the pieces */
  if (cu_copy(b, im->adamw_dev, starts, ((size_t)npieces + 1) * sizeof(int64_t), PG_COPY_HOST_TO_DEVICE) ||
      cu_copy(b, adamw_pieces(im->adamw_dev, im->adamw_cap), table, (size_t)npieces * sizeof(pg_adamw_piece),
              PG_COPY_HOST_TO_DEVICE))
    return PG_ERR;
  im->adamw_n = npieces;
  return PG_OK;
}

static int cu_adamw_update_pieces(const pg_backend *b, const pg_adamw_piece *pieces, int npieces, float lr, float beta1,
                                  float beta2, float eps, float weight_decay, int step, float grad_scale) {
  if (npieces < 0) return pg_fail("fused AdamW step: %d pieces", npieces);
  if (npieces == 0) return PG_OK;
  if (adamw_table(b, pieces, npieces)) return PG_ERR;
  cuda_impl *im = b->impl;
  return kernel_rc(b, "adamw_update_pieces",
                   pg_cuda_adamw_update_pieces(ctx_of(b), adamw_pieces(im->adamw_dev, im->adamw_cap),
                                               adamw_starts(im->adamw_dev), npieces,
                                               adamw_starts(im->adamw_host)[npieces], lr, beta1, beta2, eps,
                                               weight_decay, step, grad_scale));
}

static const pg_backend_ops cuda_ops = {
    .alloc = cu_alloc,
    .release = cu_release,
    .zero = cu_zero,
    .copy = cu_copy,
    .copy2d = cu_copy2d,
    .sync = cu_sync,
#define PG_KERNEL(name, params, args, cpu, cuda, selftest) .name = cu_##name,
#include "kernel_list.h"
    .attention_scratch_floats = cu_attention_scratch_floats,
};

const pg_backend *pg_backend_cuda(int ordinal) {
  if (ordinal < 0 || ordinal >= PG_CUDA_MAX_DEVICES) return pg_fail_null("cuda:%d is not a device number", ordinal);
  if (backends[ordinal].ops) return &backends[ordinal];
  char why[256];
  if (!pg_cuda_available(why, sizeof why)) return pg_fail_null("device = 'cuda': %s", why);
  int count = 0;
  if (pg_cuda_device_count(&count)) return NULL;
  if (ordinal >= count)
    return pg_fail_null("device = 'cuda': this rank wants cuda:%d but the node has %d device%s", ordinal, count,
                        count == 1 ? "" : "s");
  cudaError_t e = cudaSetDevice(ordinal);
  if (e != cudaSuccess) return pg_fail_null("selecting cuda:%d: %s", ordinal, cudaGetErrorString(e));
  if (pg_cuda_ctx_init(&impls[ordinal].ctx)) return pg_fail_null("cuda:%d: %s", ordinal, pg_error());
  pg_cuda_in_use();
  backends[ordinal] = (pg_backend){.name = "cuda",
                                   .device = PG_CUDA,
                                   .ordinal = ordinal,
                                   .ops = &cuda_ops,
                                   .impl = &impls[ordinal],
                                   .stream = impls[ordinal].ctx.stream};
  return &backends[ordinal];
}

#endif
