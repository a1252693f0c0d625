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

#define PG_CUDA_MAX_DEVICES 64

typedef struct cuda_impl {
  pg_cuda_ctx ctx;
  double *scalars; /* device scratch: 1 result + PG_CUDA_SUMSQ_BLOCKS partials */
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

/* One adapter per kernel: the kernel's return code becomes PG_OK / pg_error. */
#define CUDA_KERNEL(name, params, args)                                                                                \
  static int cu_##name params { return kernel_rc(b, #name, pg_cuda_##name args); }

CUDA_KERNEL(embedding_forward,
            (const pg_backend *b, float *out, const int32_t *tokens, const float *weight, int N, int C, int row_start,
             int rows),
            (ctx_of(b), out, tokens, weight, N, C, row_start, rows))
CUDA_KERNEL(embedding_backward,
            (const pg_backend *b, float *dweight, const float *dout, const int32_t *tokens, int N, int C, int row_start,
             int rows),
            (ctx_of(b), dweight, dout, tokens, N, C, row_start, rows))
CUDA_KERNEL(position_forward, (const pg_backend *b, float *out, const float *wpe, int N, int T, int C),
            (ctx_of(b), out, wpe, N, T, C))
CUDA_KERNEL(position_backward, (const pg_backend *b, float *dwpe, const float *dout, int N, int T, int C),
            (ctx_of(b), dwpe, dout, N, T, C))
CUDA_KERNEL(layernorm_forward,
            (const pg_backend *b, float *out, float *mean, float *rstd, const float *inp, const float *weight,
             const float *bias, int N, int C),
            (ctx_of(b), out, mean, rstd, inp, weight, bias, N, C))
CUDA_KERNEL(layernorm_backward,
            (const pg_backend *b, float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
             const float *weight, const float *mean, const float *rstd, int N, int C),
            (ctx_of(b), dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C))
CUDA_KERNEL(matmul_forward,
            (const pg_backend *b, float *out, const float *inp, const float *weight, const float *bias, int N, int C,
             int OC),
            (ctx_of(b), out, inp, weight, bias, N, C, OC))
CUDA_KERNEL(matmul_backward,
            (const pg_backend *b, float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
             const float *weight, int N, int C, int OC),
            (ctx_of(b), dinp, dweight, dbias, dout, inp, weight, N, C, OC))
CUDA_KERNEL(attention_forward,
            (const pg_backend *b, float *out, float *att, const float *qkv, const float *slopes, int B, int T, int NH,
             int NKV, int HS),
            (ctx_of(b), out, att, qkv, slopes, B, T, NH, NKV, HS))
CUDA_KERNEL(attention_backward,
            (const pg_backend *b, float *dqkv, float *scratch, const float *dout, const float *qkv, const float *att,
             int B, int T, int NH, int NKV, int HS),
            (ctx_of(b), dqkv, scratch, dout, qkv, att, B, T, NH, NKV, HS))
CUDA_KERNEL(rope_forward,
            (const pg_backend *b, float *x, const float *cos_t, const float *sin_t, int N, int T, int heads, int HS,
             int ld),
            (ctx_of(b), x, cos_t, sin_t, N, T, heads, HS, ld))
CUDA_KERNEL(rope_backward,
            (const pg_backend *b, float *dx, const float *cos_t, const float *sin_t, int N, int T, int heads, int HS,
             int ld),
            (ctx_of(b), dx, cos_t, sin_t, N, T, heads, HS, ld))
CUDA_KERNEL(rmsnorm_forward,
            (const pg_backend *b, float *out, float *rstd, const float *inp, const float *weight, int N, int C,
             float eps),
            (ctx_of(b), out, rstd, inp, weight, N, C, eps))
CUDA_KERNEL(rmsnorm_backward,
            (const pg_backend *b, float *dinp, float *dweight, const float *dout, const float *inp,
             const float *weight, const float *rstd, int N, int C),
            (ctx_of(b), dinp, dweight, dout, inp, weight, rstd, N, C))
CUDA_KERNEL(swiglu_forward, (const pg_backend *b, float *out, const float *inp, int N, int H),
            (ctx_of(b), out, inp, N, H))
CUDA_KERNEL(swiglu_backward, (const pg_backend *b, float *dinp, const float *inp, const float *dout, int N, int H),
            (ctx_of(b), dinp, inp, dout, N, H))
CUDA_KERNEL(gelu_forward, (const pg_backend *b, float *out, const float *inp, int64_t n), (ctx_of(b), out, inp, n))
CUDA_KERNEL(gelu_backward, (const pg_backend *b, float *dinp, const float *inp, const float *dout, int64_t n),
            (ctx_of(b), dinp, inp, dout, n))
CUDA_KERNEL(residual_forward, (const pg_backend *b, float *out, const float *a, const float *x, int64_t n),
            (ctx_of(b), out, a, x, n))
CUDA_KERNEL(xent_row_max, (const pg_backend *b, float *row_max, const float *logits, int N, int V, int valid),
            (ctx_of(b), row_max, logits, N, V, valid))
CUDA_KERNEL(xent_sumexp,
            (const pg_backend *b, float *sumexp, float *target_logit, const float *logits, const float *row_max,
             const int32_t *targets, int N, int V, int valid, int vocab_start),
            (ctx_of(b), sumexp, target_logit, logits, row_max, targets, N, V, valid, vocab_start))
CUDA_KERNEL(adamw_update,
            (const pg_backend *b, float *param, const float *grad, float *m, float *v, int64_t n, float lr, float beta1,
             float beta2, float eps, float weight_decay, int step, float grad_scale),
            (ctx_of(b), param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale))

CUDA_KERNEL(bf16_from_f32, (const pg_backend *b, uint16_t *dst, const float *src, int64_t n),
            (ctx_of(b), dst, src, n))
CUDA_KERNEL(bf16_to_f32, (const pg_backend *b, float *dst, const uint16_t *src, int64_t n), (ctx_of(b), dst, src, n))
CUDA_KERNEL(gelu_bf16_forward, (const pg_backend *b, uint16_t *out, const uint16_t *inp, int64_t n),
            (ctx_of(b), out, inp, n))
CUDA_KERNEL(gelu_bf16_backward,
            (const pg_backend *b, uint16_t *dinp, const uint16_t *inp, const uint16_t *dout, int64_t n),
            (ctx_of(b), dinp, inp, dout, n))
CUDA_KERNEL(swiglu_bf16_forward, (const pg_backend *b, uint16_t *out, const uint16_t *inp, int N, int H),
            (ctx_of(b), out, inp, N, H))
CUDA_KERNEL(swiglu_bf16_backward,
            (const pg_backend *b, uint16_t *dinp, const uint16_t *inp, const uint16_t *dout, int N, int H),
            (ctx_of(b), dinp, inp, dout, N, H))
CUDA_KERNEL(residual_bf16_forward, (const pg_backend *b, float *out, const float *a, const uint16_t *x, int64_t n),
            (ctx_of(b), out, a, x, n))
CUDA_KERNEL(matmul_bf16_forward,
            (const pg_backend *b, float *out, const uint16_t *inp, const uint16_t *weight, const float *bias, int N,
             int C, int OC),
            (ctx_of(b), out, inp, weight, bias, N, C, OC))
CUDA_KERNEL(matmul_bf16_backward,
            (const pg_backend *b, float *dinp, float *dweight, float *dbias, const float *dout_f32,
             const uint16_t *dout, const uint16_t *inp, const uint16_t *weight, int N, int C, int OC),
            (ctx_of(b), dinp, dweight, dbias, dout_f32, dout, inp, weight, N, C, OC))

static int64_t cu_attention_scratch_floats(const pg_backend *b, int T, int NH) {
  (void)b;
  return pg_cuda_attention_scratch_floats(T, NH);
}

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

static const pg_backend_ops cuda_ops = {
    .alloc = cu_alloc,
    .release = cu_release,
    .zero = cu_zero,
    .copy = cu_copy,
    .copy2d = cu_copy2d,
    .sync = cu_sync,
    .embedding_forward = cu_embedding_forward,
    .embedding_backward = cu_embedding_backward,
    .position_forward = cu_position_forward,
    .position_backward = cu_position_backward,
    .layernorm_forward = cu_layernorm_forward,
    .layernorm_backward = cu_layernorm_backward,
    .matmul_forward = cu_matmul_forward,
    .matmul_backward = cu_matmul_backward,
    .attention_forward = cu_attention_forward,
    .attention_backward = cu_attention_backward,
    .attention_scratch_floats = cu_attention_scratch_floats,
    .rope_forward = cu_rope_forward,
    .rope_backward = cu_rope_backward,
    .rmsnorm_forward = cu_rmsnorm_forward,
    .rmsnorm_backward = cu_rmsnorm_backward,
    .swiglu_forward = cu_swiglu_forward,
    .swiglu_backward = cu_swiglu_backward,
    .gelu_forward = cu_gelu_forward,
    .gelu_backward = cu_gelu_backward,
    .residual_forward = cu_residual_forward,
    .xent_row_max = cu_xent_row_max,
    .xent_sumexp = cu_xent_sumexp,
    .xent_finish = cu_xent_finish,
    .adamw_update = cu_adamw_update,
    .sum_squares = cu_sum_squares,
    .bf16_from_f32 = cu_bf16_from_f32,
    .matmul_bf16_forward = cu_matmul_bf16_forward,
    .matmul_bf16_backward = cu_matmul_bf16_backward,
    .bf16_to_f32 = cu_bf16_to_f32,
    .gelu_bf16_forward = cu_gelu_bf16_forward,
    .gelu_bf16_backward = cu_gelu_bf16_backward,
    .swiglu_bf16_forward = cu_swiglu_bf16_forward,
    .swiglu_bf16_backward = cu_swiglu_bf16_backward,
    .residual_bf16_forward = cu_residual_bf16_forward,
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
