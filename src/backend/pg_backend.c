/* The CPU backend: host memory (huge-page aligned for large buffers) and the
 * kernels of kernels/cpu, called exactly as the runtime called them before
 * the seam, so results are bit for bit what they were. */
#include "pg_backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"
#include "pg_clock.h"
#include "pg_context.h"
#include "pg_cpu_bf16_gemm.h"
#include "pg_cuda.h"
#include "pg_error.h"
#include "pg_size.h"

static void *cpu_alloc(const pg_backend *b, size_t bytes) {
  (void)b;
  void *p = pg_alloc_zeroed(bytes ? bytes : 1);
  if (!p) return pg_fail_null("out of memory allocating %zu bytes on the CPU", bytes);
  return p;
}

static void cpu_release(const pg_backend *b, void *p) {
  (void)b;
  free(p);
}

static int cpu_zero(const pg_backend *b, void *p, size_t bytes) {
  (void)b;
  pg_zero_bytes(p, bytes);
  return PG_OK;
}

static int cpu_copy(const pg_backend *b, void *dst, const void *src, size_t bytes, pg_copy_kind kind) {
  (void)b;
  (void)kind;
  if (bytes && dst != src) memmove(dst, src, bytes);
  return PG_OK;
}

static int cpu_copy2d(const pg_backend *b, void *dst, size_t dpitch, const void *src, size_t spitch, size_t width_bytes,
                      size_t rows, pg_copy_kind kind) {
  (void)b;
  (void)kind;
  char *d = dst;
  const char *s = src;
#pragma omp parallel for schedule(static) if ((int64_t)(rows * width_bytes) > 131072)
  for (size_t r = 0; r < rows; r++)
    memcpy(d + r * dpitch, s + r * spitch, width_bytes);
  return PG_OK;
}

static int cpu_sync(const pg_backend *b) {
  (void)b;
  return PG_OK;
}

/* The adapters, from kernels/kernel_list.h. CALL: the kernel of kernels/cpu
 * called as it is, and PG_OK; the redeclaration makes a row whose
 * parameters are not the kernel's a compile error. OWN: written below. */
#define CPU_CALL(name, params, args)                                                                                   \
  void pg_##name params;                                                                                               \
  static int cpu_##name PG_BACKEND_PARAMS params {                                                                     \
    (void)b;                                                                                                           \
    pg_##name args;                                                                                                    \
    return PG_OK;                                                                                                      \
  }
#define CPU_OWN(name, params, args) static int cpu_##name PG_BACKEND_PARAMS params;
#define PG_KERNEL(name, params, args, cpu, cuda, selftest) CPU_##cpu(name, params, args)
#include "kernel_list.h"

static int64_t cpu_attention_scratch_floats(const pg_backend *b, int64_t rows, int NH) {
  (void)b;
  return pg_attention_scratch_floats(rows, NH);
}

/* ---- the OWN adapters ---- */

static int cpu_xent_finish(const pg_backend *b, float *losses, float *dlogits, const float *logits,
                           const float *row_max, const float *sumexp, const float *target_logit, const int32_t *targets,
                           int N, int V, int valid, int vocab_start, float dloss, double *loss_sum) {
  (void)b;
  double s =
      pg_xent_finish(losses, dlogits, logits, row_max, sumexp, target_logit, targets, N, V, valid, vocab_start, dloss);
  if (loss_sum) *loss_sum = s;
  return PG_OK;
}

static int cpu_sum_squares(const pg_backend *b, const float *x, int64_t n, double *out) {
  (void)b;
  *out = pg_sum_squares(x, n);
  return PG_OK;
}

/* The bf16 GEMMs fail only when out of memory or when oneDNN fails (kernels.h). */
static int cpu_matmul_bf16_forward(const pg_backend *b, float *out, const uint16_t *inp, const uint16_t *weight,
                                   const float *bias, int N, int C, int OC) {
  (void)b;
  if (pg_matmul_bf16_forward(out, inp, weight, bias, N, C, OC)) return pg_fail("bf16 GEMM: %s", pg_bf16_gemm_error());
  return PG_OK;
}

/* the product into the float32 scratch, then the rounding: no GEMM here writes bf16 */
static int cpu_matmul_bf16_forward_rounded(const pg_backend *b, uint16_t *out16, float *sums, const uint16_t *inp,
                                           const uint16_t *weight, const float *bias, int N, int C, int OC) {
  if (cpu_matmul_bf16_forward(b, sums, inp, weight, bias, N, C, OC)) return PG_ERR;
  pg_bf16_from_f32(out16, sums, (int64_t)N * OC);
  return PG_OK;
}

static int cpu_matmul_bf16_backward(const pg_backend *b, float *dinp, float *dweight, float *dbias,
                                    const float *dout_f32, const uint16_t *dout, const uint16_t *inp,
                                    const uint16_t *weight, int N, int C, int OC) {
  (void)b;
  if (pg_matmul_bf16_backward(dinp, dweight, dout, inp, weight, N, C, OC))
    return pg_fail("bf16 GEMM: %s", pg_bf16_gemm_error());
  if (dbias && dout_f32) pg_bias_backward(dbias, dout_f32, N, OC);
  if (dbias && !dout_f32) pg_bias_backward_bf16(dbias, dout, N, OC);
  return PG_OK;
}

static int cpu_flash_bf16_forward(const pg_backend *b, float *out, uint16_t *out16, float *lse, const uint16_t *qkv,
                                  const float *slopes, int B, int T, int NH, int NKV, int HS) {
  (void)b;
  if (pg_backend_flash_bf16_refused("flash_bf16_forward", B, T, NH, NKV, HS)) return PG_ERR;
  if (pg_flash_bf16_forward(out, out16, lse, qkv, slopes, B, T, NH, NKV, HS))
    return pg_fail("flash_bf16_forward: out of memory");
  return PG_OK;
}

static int cpu_flash_bf16_backward(const pg_backend *b, float *dqkv, uint16_t *dqkv16, float *delta, const uint16_t *dout,
                                   const float *out, const uint16_t *qkv, const float *lse, const float *slopes,
                                   int B, int T, int NH, int NKV, int HS) {
  (void)b;
  if (pg_backend_flash_bf16_refused("flash_bf16_backward", B, T, NH, NKV, HS)) return PG_ERR;
  if (!dqkv && !dqkv16) return pg_fail("flash_bf16_backward: neither dqkv nor dqkv16 to write");
  if (pg_flash_bf16_backward(dqkv, dqkv16, delta, dout, out, qkv, lse, slopes, B, T, NH, NKV, HS))
    return pg_fail("flash_bf16_backward: out of memory");
  return PG_OK;
}

static const pg_backend_ops cpu_ops = {
    .alloc = cpu_alloc,
    .release = cpu_release,
    .zero = cpu_zero,
    .copy = cpu_copy,
    .copy2d = cpu_copy2d,
    .sync = cpu_sync,
#define PG_KERNEL(name, params, args, cpu, cuda, selftest) .name = cpu_##name,
#include "kernel_list.h"
    .attention_scratch_floats = cpu_attention_scratch_floats,
};

static void release_on(void *data, void *backend) { pg_be_release(backend, data); }

pg_storage *pg_backend_storage(const pg_backend *b, size_t bytes) {
  if (b->device == PG_CPU) return pg_storage_new(bytes, PG_CPU); /* huge-page policy of pg_tensor.c */
  void *p = b->ops->alloc(b, bytes);
  if (!p) return NULL;
  pg_storage *s = pg_storage_wrap(p, bytes, b->device, b->ordinal, release_on, (void *)b);
  if (!s) b->ops->release(b, p);
  return s;
}

static const pg_backend cpu_backend = {.name = "cpu", .device = PG_CPU, .ordinal = 0, .ops = &cpu_ops, .impl = NULL};

const pg_backend *pg_backend_cpu(void) { return &cpu_backend; }

/* The rate of `reps` n x n x n products after one warm-up: float32 (matmul_forward) or, bf16, the bf16 GEMM
 * (matmul_bf16_forward on bf16 operands, float32 sums and output), each on zeroed operands. */
static int gemm_gflops(const pg_backend *b, int bf16, int n, int reps, double *gflops) {
  const char *what = bf16 ? "bf16_gemm_gflops" : "sgemm_gflops";
  if (n < 1 || reps < 1) return pg_fail("%s: n and reps must be positive (n=%d, reps=%d)", what, n, reps);
  size_t in = (size_t)n * n * (bf16 ? sizeof(uint16_t) : sizeof(float)), out = (size_t)n * n * sizeof(float);
  void *x = b->ops->alloc(b, in), *y = x ? b->ops->alloc(b, in) : NULL;
  float *z = y ? b->ops->alloc(b, out) : NULL;
  int rc = z ? PG_OK : PG_ERR;
  double t0 = 0; /* product 0 warms up */
  for (int i = 0; rc == PG_OK && i <= reps; i++) {
    if (i == 1 && (rc = b->ops->sync(b))) break;
    if (i == 1) t0 = pg_wtime();
    rc = bf16 ? b->ops->matmul_bf16_forward(b, z, x, y, NULL, n, n, n)
              : b->ops->matmul_forward(b, z, x, y, NULL, n, n, n);
    if (rc == PG_OK && i == reps && (rc = b->ops->sync(b)) == PG_OK)
      *gflops = 2.0 * n * (double)n * n * reps / (pg_wtime() - t0) / 1e9;
  }
  pg_be_release(b, x);
  pg_be_release(b, y);
  pg_be_release(b, z);
  return rc;
}

int pg_backend_sgemm_gflops(const pg_backend *b, int n, int reps, double *gflops) {
  return gemm_gflops(b, 0, n, reps, gflops);
}

int pg_backend_bf16_gemm_gflops(const pg_backend *b, int n, int reps, double *gflops) {
  return gemm_gflops(b, 1, n, reps, gflops);
}

int pg_backend_flash_bf16_refused(const char *what, int B, int T, int NH, int NKV, int HS) {
  const char *why = pg_flash_bf16_unsupported(B, T, NH, NKV, HS);
  if (!why) return PG_OK;
  return pg_fail("%s: %s (B %d, T %d, NH %d, NKV %d, HS %d): use the float32 attention", what, why, B, T, NH, NKV, HS);
}

int pg_backend_flash_bf16_seconds(const pg_backend *b, int B, int T, int NH, int NKV, int HS, int reps, double *fwd_s,
                                  double *bwd_s) {
  if (reps < 1) return pg_fail("flash_bf16_seconds: reps must be positive (reps=%d)", reps);
  if (pg_backend_flash_bf16_refused("flash_bf16_seconds", B, T, NH, NKV, HS)) return PG_ERR;
  const int64_t W = (int64_t)(NH + 2 * NKV) * HS, C = (int64_t)NH * HS;
  const int64_t n_qkv[] = {B, T, W}, n_out[] = {B, T, C}, n_row[] = {B, NH, T};
  const int64_t nq = pg_size_product(3, n_qkv), no = pg_size_product(3, n_out), nr = pg_size_product(3, n_row);
  if (nq < 0 || no < 0 || nr < 0)
    return pg_fail("flash_bf16_seconds: B %d x T %d x %lld columns is too large", B, T, (long long)W);
  uint16_t *qkv = b->ops->alloc(b, (size_t)nq * sizeof(uint16_t));
  uint16_t *dout = qkv ? b->ops->alloc(b, (size_t)no * sizeof(uint16_t)) : NULL;
  float *out = dout ? b->ops->alloc(b, (size_t)no * sizeof(float)) : NULL;
  float *dqkv = out ? b->ops->alloc(b, (size_t)nq * sizeof(float)) : NULL;
  float *lse = dqkv ? b->ops->alloc(b, (size_t)nr * 2 * sizeof(float)) : NULL; /* lse, then delta */
  int rc = lse ? PG_OK : PG_ERR;
  for (int pass = 0; rc == PG_OK && pass < 2; pass++) { /* 0: forward, 1: backward */
    double t0 = 0;
    for (int i = 0; rc == PG_OK && i <= reps; i++) { /* pass 0 warms up */
      if (i == 1 && (rc = b->ops->sync(b))) break;
      if (i == 1) t0 = pg_wtime();
      rc = pass == 0 ? b->ops->flash_bf16_forward(b, out, dout, lse, qkv, NULL, B, T, NH, NKV, HS)
                     : b->ops->flash_bf16_backward(b, dqkv, NULL, lse + nr, dout, out, qkv, lse, NULL, B, T, NH, NKV,
                                                   HS);
      if (rc == PG_OK && i == reps && (rc = b->ops->sync(b)) == PG_OK)
        *(pass == 0 ? fwd_s : bwd_s) = (pg_wtime() - t0) / reps;
    }
  }
  pg_be_release(b, qkv);
  pg_be_release(b, dout);
  pg_be_release(b, out);
  pg_be_release(b, dqkv);
  pg_be_release(b, lse);
  return rc;
}

const char *pg_backend_place(const pg_backend *b, char *buf, size_t n) {
  if (b->device == PG_CPU) snprintf(buf, n, "cpu");
  else snprintf(buf, n, "%s:%d", pg_device_name(b->device), b->ordinal);
  return buf;
}

const pg_backend *pg_backend_of(const pg_storage *s) {
  return s->device == PG_CPU ? pg_backend_cpu() : pg_backend_cuda(s->device_index);
}

/* Every device backend's memory: today CUDA's (pg_cuda.c answers 0 in a build without it). */
int pg_backend_is_device_memory(const void *p) { return pg_cuda_is_device_memory(p); }

int pg_backend_tensor(const pg_backend *b, pg_tensor *out, pg_dtype dtype, int ndim, const int64_t *shape) {
  if (b->device == PG_CPU) return pg_tensor_init(out, dtype, ndim, shape);
  pg_storage *s = pg_backend_storage(b, (size_t)pg_shape_numel(ndim, shape) * pg_dtype_size(dtype));
  if (!s) return PG_ERR;
  int rc = pg_tensor_init_view(out, s, 0, dtype, ndim, shape);
  pg_storage_release(s); /* the view holds it */
  return rc;
}

int pg_backend_copy_tensor(pg_tensor *dst, const pg_tensor *src) {
  const pg_storage *ds = dst->storage, *ss = src->storage;
  if (ds->device == PG_CPU && ss->device == PG_CPU) return pg_tensor_copy(dst, src);
  if (dst->numel != src->numel || dst->dtype != src->dtype) {
    char a[128], b[128];
    return pg_fail("copy: destination %s and source %s differ", pg_tensor_describe(dst, a, sizeof a),
                   pg_tensor_describe(src, b, sizeof b));
  }
  pg_copy_kind kind = ss->device == PG_CPU   ? PG_COPY_HOST_TO_DEVICE
                      : ds->device == PG_CPU ? PG_COPY_DEVICE_TO_HOST
                                             : PG_COPY_DEVICE_TO_DEVICE;
  const pg_backend *b = pg_backend_of(ds->device != PG_CPU ? ds : ss);
  if (!b) return PG_ERR;
  return b->ops->copy(b, pg_tensor_data(dst), pg_tensor_data(src), (size_t)src->numel * pg_dtype_size(src->dtype),
                      kind);
}

/* outer rows of t before `dim`, and the elements of one index of `dim` (the dims after it) */
static void rows_around(const pg_tensor *t, int dim, int64_t *outer, int64_t *inner) {
  *outer = *inner = 1;
  for (int i = 0; i < dim; i++) *outer *= t->shape[i];
  for (int i = dim + 1; i < t->ndim; i++) *inner *= t->shape[i];
}

int pg_backend_narrow_copy(pg_tensor *out, const pg_tensor *t, int dim, int64_t start, int64_t len) {
  if (t->storage->device == PG_CPU) return pg_tensor_narrow_copy(out, t, dim, start, len);
  if (pg_tensor_check_narrow(t, dim, start, len)) return PG_ERR;
  const pg_backend *b = pg_backend_of(t->storage);
  int64_t shape[PG_MAX_DIMS], outer, inner;
  memcpy(shape, t->shape, sizeof shape);
  shape[dim] = len;
  if (!b || pg_backend_tensor(b, out, t->dtype, t->ndim, shape)) return PG_ERR;
  rows_around(t, dim, &outer, &inner);
  size_t es = pg_dtype_size(t->dtype), run = (size_t)(len * inner) * es;
  if (!run || !outer) return PG_OK;
  int rc = b->ops->copy2d(b, pg_tensor_data(out), run, (const char *)pg_tensor_data(t) + (size_t)(start * inner) * es,
                          (size_t)(t->shape[dim] * inner) * es, run, (size_t)outer, PG_COPY_DEVICE_TO_DEVICE);
  if (rc) pg_tensor_release(out);
  return rc;
}

int pg_backend_cat(pg_tensor *out, const pg_tensor *const *ts, int n, int dim) {
  if (n >= 1 && ts[0]->storage->device == PG_CPU) {
    for (int i = 1; i < n; i++)
      if (ts[i]->storage->device != PG_CPU)
        return pg_fail("cat: tensor %d is on the device, tensor 1 on the cpu: copy them to one device first", i + 1);
    return pg_tensor_cat(out, ts, n, dim);
  }
  int64_t shape[PG_MAX_DIMS], outer, inner;
  if (pg_tensor_cat_shape(ts, n, dim, shape)) return PG_ERR;
  const pg_backend *b = pg_backend_of(ts[0]->storage);
  if (!b) return PG_ERR;
  char where[48];
  for (int i = 1; i < n; i++)
    if (pg_backend_of(ts[i]->storage) != b)
      return pg_fail("cat: tensor %d is on another device than tensor 1 (%s): copy them to one device first", i + 1,
                     pg_backend_place(b, where, sizeof where));
  if (pg_backend_tensor(b, out, ts[0]->dtype, ts[0]->ndim, shape)) return PG_ERR;
  rows_around(out, dim, &outer, &inner);
  size_t es = pg_dtype_size(out->dtype), row = (size_t)(shape[dim] * inner) * es, at = 0;
  for (int i = 0; i < n && outer; i++) {
    size_t run = (size_t)(ts[i]->shape[dim] * inner) * es;
    if (run && b->ops->copy2d(b, (char *)pg_tensor_data(out) + at, row, pg_tensor_data(ts[i]), run, run, (size_t)outer,
                              PG_COPY_DEVICE_TO_DEVICE)) {
      pg_tensor_release(out);
      return PG_ERR;
    }
    at += run;
  }
  return PG_OK;
}

const pg_backend *pg_backend_named(const char *device) {
  if (!strcmp(device, "cpu")) return pg_backend_cpu();
  if (!strcmp(device, "cuda")) {
    int count = 0;
    char why[256];
    if (!pg_cuda_available(why, sizeof why)) return pg_fail_null("device = 'cuda': %s", why);
    if (pg_cuda_device_count(&count)) return NULL;
    return pg_backend_cuda(pg_node_rank() % count);
  }
  int n = -1, used = 0;
  if (sscanf(device, "cuda:%d%n", &n, &used) == 1 && device[used] == 0 && n >= 0) return pg_backend_cuda(n);
  return pg_fail_null("device must be 'cpu', 'cuda' or 'cuda:N', not '%s'", device);
}
