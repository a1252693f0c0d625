/* pg_cuda_selftest: every CUDA kernel (kernels/cuda) against its CPU kernel
 * (kernels/cpu) on random inputs, with stated tolerances (pg_cuda.h). On a
 * GPU through pg.cuda.selftest(); on the CPU emulator through
 * scripts/cuda_emu_test.sh (make cuda-emu). What runs is the checklist at
 * the end, made from kernels/kernel_list.h: every seam kernel names its
 * test function there, so a kernel without one does not compile. */
#include "pg_cuda.h"

#include <stdio.h>
#include <string.h>

#include "pg_error.h"

#ifndef PG_WITH_CUDA

int pg_cuda_selftest(char *report, size_t n) {
  const char *why = "built without CUDA (nvcc was not found, or make CUDA=0)";
  if (report && n) snprintf(report, n, "%s", why);
  return pg_fail("%s", why);
}

#else /* PG_WITH_CUDA */

#include <cuda_runtime.h>
#include <math.h>
#include <omp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "pg_cpu_bf16_gemm.h"
#include "pg_cublas.h" /* pg_cuda_lt: the cuBLASLt path's cache */ /* the CPU reference of the bf16 GEMM */

/* ---- the self-test ---- */

#define ST_MAX_BUFS 2048 /* every buffer of the run (freed at its end) */

typedef struct selftest {
  char *out;
  size_t cap, len;
  int checks, failed, broken; /* broken: a CUDA call failed, stop testing */
  pg_cuda_ctx ctx;
  void *dev[ST_MAX_BUFS], *host[ST_MAX_BUFS];
  int ndev, nhost;
  uint64_t rng;
} selftest;

static void say(selftest *st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(selftest *st, const char *fmt, ...) {
  if (!st->out || st->len + 1 >= st->cap) return;
  va_list ap;
  va_start(ap, fmt);
  int w = vsnprintf(st->out + st->len, st->cap - st->len, fmt, ap);
  va_end(ap);
  if (w > 0) st->len = st->len + (size_t)w < st->cap ? st->len + (size_t)w : st->cap - 1;
}

static void broken(selftest *st, const char *what, const char *why) {
  if (!st->broken) say(st, "  FAIL  %s: %s\n", what, why);
  st->broken = 1;
  st->failed++;
}

/* xorshift64*: uniform floats in [lo, hi) */
static float st_uniform(selftest *st, float lo, float hi) {
  st->rng ^= st->rng >> 12;
  st->rng ^= st->rng << 25;
  st->rng ^= st->rng >> 27;
  uint64_t r = st->rng * 2685821657736338717ull;
  return lo + (hi - lo) * (float)((r >> 40) * (1.0 / 16777216.0));
}

static void *h_alloc(selftest *st, size_t bytes) {
  if (st->nhost >= ST_MAX_BUFS) {
    broken(st, "host buffer", "too many buffers");
    return NULL;
  }
  void *p = calloc(1, bytes ? bytes : 1);
  if (p) st->host[st->nhost++] = p;
  else broken(st, "host", "out of memory");
  return p;
}

static float *h_rand(selftest *st, int64_t n, float lo, float hi) {
  float *p = h_alloc(st, (size_t)n * sizeof(float));
  if (p)
    for (int64_t i = 0; i < n; i++) p[i] = st_uniform(st, lo, hi);
  return p;
}

static float *h_copy(selftest *st, const float *src, int64_t n) {
  float *p = h_alloc(st, (size_t)n * sizeof(float));
  if (p && src) memcpy(p, src, (size_t)n * sizeof(float));
  return p;
}

static int32_t *h_tokens(selftest *st, int64_t n, int32_t below) {
  int32_t *p = h_alloc(st, (size_t)n * sizeof(int32_t));
  if (p)
    for (int64_t i = 0; i < n; i++) p[i] = (int32_t)(st_uniform(st, 0.0f, 1.0f) * (float)below) % below;
  return p;
}

/* A device copy of host memory (NULL and `broken` on failure). */
static void *d_put(selftest *st, const void *h, size_t bytes) {
  if (st->broken || !h) return NULL; /* already reported */
  if (st->ndev >= ST_MAX_BUFS) {
    broken(st, "device buffer", "too many buffers");
    return NULL;
  }
  void *d = pg_cuda_malloc(bytes);
  if (!d) {
    broken(st, "cudaMalloc", pg_error());
    return NULL;
  }
  st->dev[st->ndev++] = d;
  if (pg_cuda_memcpy(d, h, bytes, PG_CUDA_HOST_TO_DEVICE) != PG_OK) {
    broken(st, "copy to device", pg_error());
    return NULL;
  }
  return d;
}

static float *d_floats(selftest *st, const float *h, int64_t n) { return d_put(st, h, (size_t)n * sizeof(float)); }

/* A kernel's return code: 1 when fine. */
static int launched(selftest *st, const char *name, int rc) {
  if (rc == 0) return 1;
  char why[256];
  snprintf(why, sizeof why, "launch failed: %s (code %d)", pg_cuda_strerror(rc), rc);
  broken(st, name, why);
  return 0;
}

/* Synchronises, copies n values back and compares elementwise:
 * |got - want| <= atol + rtol |want| (rtol = atol = 0: equal values). */
static void check_f(selftest *st, const char *name, const float *dev, const float *want, int64_t n, double rtol,
                    double atol) {
  if (st->broken || !dev || !want) return;
  if (pg_cuda_synchronize() != PG_OK) {
    broken(st, name, pg_error());
    return;
  }
  float *got = h_alloc(st, (size_t)n * sizeof(float));
  if (!got) return;
  if (pg_cuda_memcpy(got, dev, (size_t)n * sizeof(float), PG_CUDA_DEVICE_TO_HOST) != PG_OK) {
    broken(st, name, pg_error());
    return;
  }
  const int exact = rtol == 0 && atol == 0;
  double worst = 0, max_err = 0;
  int64_t wi = -1;
  for (int64_t i = 0; i < n; i++) {
    const float g = got[i], w = want[i];
    double err = 0;
    int bad = 0;
    if (g == w || (isnan(g) && isnan(w))) {
      /* equal (or NaN where the CPU has NaN) */
    } else if (isnan(g) || isnan(w) || isinf(g) || isinf(w)) {
      bad = 1, err = INFINITY;
    } else {
      err = fabs((double)g - (double)w);
      bad = exact || !(err <= atol + rtol * fabs((double)w));
    }
    if (err > max_err) max_err = err;
    if (bad && (wi < 0 || err > worst)) worst = err, wi = i;
  }
  st->checks++;
  char tol[64];
  if (exact) snprintf(tol, sizeof tol, "exact");
  else snprintf(tol, sizeof tol, "rtol %.0e, atol %.0e", rtol, atol);
  if (wi < 0) {
    say(st, "  ok    %-34s max |err| %-9.2g (%s, %lld values)\n", name, max_err, tol, (long long)n);
  } else {
    st->failed++;
    say(st, "  FAIL  %-34s element %lld: got %.9g, want %.9g (%s)\n", name, (long long)wi, (double)got[wi],
        (double)want[wi], tol);
  }
}

static void check_d(selftest *st, const char *name, const double *dev, double want, double rtol) {
  if (st->broken || !dev) return;
  double got = 0;
  if (pg_cuda_synchronize() != PG_OK || pg_cuda_memcpy(&got, dev, sizeof got, PG_CUDA_DEVICE_TO_HOST) != PG_OK) {
    broken(st, name, pg_error());
    return;
  }
  st->checks++;
  double err = fabs(got - want);
  if (err <= rtol * fabs(want)) {
    say(st, "  ok    %-34s |err| %-9.2g     (rtol %.0e)\n", name, err, rtol);
  } else {
    st->failed++;
    say(st, "  FAIL  %-34s got %.17g, want %.17g (rtol %.0e)\n", name, got, want, rtol);
  }
}

/* Pulls n floats of a device buffer to a new host array (for repeat checks). */
static float *d_get(selftest *st, const float *dev, int64_t n) {
  if (st->broken || !dev) return NULL;
  float *h = h_alloc(st, (size_t)n * sizeof(float));
  if (!h) return NULL;
  if (pg_cuda_synchronize() != PG_OK || pg_cuda_memcpy(h, dev, (size_t)n * sizeof(float), PG_CUDA_DEVICE_TO_HOST)) {
    broken(st, "copy to host", pg_error());
    return NULL;
  }
  return h;
}

static int reload(selftest *st, float *dev, const float *h, int64_t n) {
  if (st->broken || !dev || !h) return 0;
  if (pg_cuda_memcpy(dev, h, (size_t)n * sizeof(float), PG_CUDA_HOST_TO_DEVICE) != PG_OK) {
    broken(st, "copy to device", pg_error());
    return 0;
  }
  return 1;
}

/* Sizes: odd and not multiples of 32, so that every tail path runs. */
enum { ST_B = 2, ST_T = 37, ST_C = 48, ST_NH = 3, ST_OC = 80, ST_N = ST_B * ST_T };
#define TOL_POINT 1e-5, 1e-6 /* pointwise: rtol, atol */
#define TOL_REDUCE 1e-5, 1e-5 /* row and column reductions */
#define TOL_GEMM 1e-4, 1e-5   /* sgemm-based */

static void test_embedding(selftest *st) {
  const int N = ST_N, C = ST_C, rows = 30, row_start = 20;
  const pg_cuda_ctx *ctx = &st->ctx;
  int32_t *tok = h_tokens(st, N, 60); /* about half in [20, 50), with repeats */
  float *w = h_rand(st, (int64_t)rows * C, -1, 1), *garbage = h_rand(st, (int64_t)N * C, 100, 200);
  float *out = h_alloc(st, (size_t)N * C * sizeof(float));
  if (!tok || !w || !garbage || !out) return;
  pg_embedding_forward(out, tok, w, N, C, row_start, rows);
  int32_t *d_tok = d_put(st, tok, (size_t)N * sizeof(int32_t));
  float *d_w = d_floats(st, w, (int64_t)rows * C), *d_out = d_floats(st, garbage, (int64_t)N * C);
  if (st->broken) return;
  if (launched(st, "embedding_forward", pg_cuda_embedding_forward(ctx, d_out, d_tok, d_w, N, C, row_start, rows)))
    check_f(st, "embedding_forward", d_out, out, (int64_t)N * C, 0, 0);

  /* backward: the CPU's order of additions, so the same values */
  float *dout = h_rand(st, (int64_t)N * C, -1, 1), *dw0 = h_rand(st, (int64_t)rows * C, -1, 1);
  float *dw = h_copy(st, dw0, (int64_t)rows * C);
  if (!dout || !dw) return;
  pg_embedding_backward(dw, dout, tok, N, C, row_start, rows);
  float *d_dout = d_floats(st, dout, (int64_t)N * C), *d_dw = d_floats(st, dw0, (int64_t)rows * C);
  if (st->broken) return;
  if (launched(st, "embedding_backward", pg_cuda_embedding_backward(ctx, d_dw, d_dout, d_tok, N, C, row_start, rows)))
    check_f(st, "embedding_backward", d_dw, dw, (int64_t)rows * C, 0, 0);

  /* many repeats over several scan tiles */
  const int N2 = 2100, C2 = 8, rows2 = 16;
  int32_t *tok2 = h_tokens(st, N2, 20);
  float *dout2 = h_rand(st, (int64_t)N2 * C2, -1, 1), *dw2_0 = h_rand(st, (int64_t)rows2 * C2, -1, 1);
  float *dw2 = h_copy(st, dw2_0, (int64_t)rows2 * C2);
  if (!tok2 || !dout2 || !dw2) return;
  pg_embedding_backward(dw2, dout2, tok2, N2, C2, 0, rows2);
  int32_t *d_tok2 = d_put(st, tok2, (size_t)N2 * sizeof(int32_t));
  float *d_dout2 = d_floats(st, dout2, (int64_t)N2 * C2), *d_dw2 = d_floats(st, dw2_0, (int64_t)rows2 * C2);
  if (st->broken) return;
  if (launched(st, "embedding_backward (2100 tokens)",
               pg_cuda_embedding_backward(ctx, d_dw2, d_dout2, d_tok2, N2, C2, 0, rows2)))
    check_f(st, "embedding_backward (2100 tokens)", d_dw2, dw2, (int64_t)rows2 * C2, 0, 0);

  /* positions */
  const int T = ST_T;
  float *wpe = h_rand(st, (int64_t)T * C, -1, 1), *o0 = h_rand(st, (int64_t)N * C, -1, 1);
  float *o = h_copy(st, o0, (int64_t)N * C), *dwpe0 = h_rand(st, (int64_t)T * C, -1, 1);
  float *dwpe = h_copy(st, dwpe0, (int64_t)T * C);
  if (!wpe || !o || !dwpe) return;
  pg_position_forward(o, wpe, N, T, C);
  pg_position_backward(dwpe, dout, N, T, C);
  float *d_wpe = d_floats(st, wpe, (int64_t)T * C), *d_o = d_floats(st, o0, (int64_t)N * C);
  float *d_dwpe = d_floats(st, dwpe0, (int64_t)T * C);
  if (st->broken) return;
  if (launched(st, "position_forward", pg_cuda_position_forward(ctx, d_o, d_wpe, N, T, C)))
    check_f(st, "position_forward", d_o, o, (int64_t)N * C, 0, 0);
  if (launched(st, "position_backward", pg_cuda_position_backward(ctx, d_dwpe, d_dout, N, T, C)))
    check_f(st, "position_backward", d_dwpe, dwpe, (int64_t)T * C, TOL_REDUCE);
}

static void test_layernorm(selftest *st) {
  const int N = ST_N, C = ST_C;
  const pg_cuda_ctx *ctx = &st->ctx;
  float *x = h_rand(st, (int64_t)N * C, 2, 4); /* mean far from 0: the two-pass variance matters */
  float *w = h_rand(st, C, 0.5f, 1.5f), *b = h_rand(st, C, -0.5f, 0.5f);
  float *out = h_alloc(st, (size_t)N * C * sizeof(float)), *mean = h_alloc(st, N * sizeof(float));
  float *rstd = h_alloc(st, N * sizeof(float)), *garbage = h_rand(st, (int64_t)N * C, 100, 200);
  if (!x || !w || !b || !out || !mean || !rstd || !garbage) return;
  pg_layernorm_forward(out, mean, rstd, x, w, b, N, C);
  float *d_x = d_floats(st, x, (int64_t)N * C), *d_w = d_floats(st, w, C), *d_b = d_floats(st, b, C);
  float *d_out = d_floats(st, garbage, (int64_t)N * C), *d_mean = d_floats(st, garbage, N);
  float *d_rstd = d_floats(st, garbage, N);
  if (st->broken) return;
  if (launched(st, "layernorm_forward",
               pg_cuda_layernorm_forward(ctx, d_out, d_mean, d_rstd, d_x, d_w, d_b, N, C))) {
    check_f(st, "layernorm_forward.out", d_out, out, (int64_t)N * C, TOL_REDUCE);
    check_f(st, "layernorm_forward.mean", d_mean, mean, N, TOL_REDUCE);
    check_f(st, "layernorm_forward.rstd", d_rstd, rstd, N, TOL_REDUCE);
  }
  /* backward from the CPU's statistics (the same inputs on both sides) */
  float *dout = h_rand(st, (int64_t)N * C, -1, 1), *dw0 = h_rand(st, C, -1, 1), *db0 = h_rand(st, C, -1, 1);
  float *dx = h_alloc(st, (size_t)N * C * sizeof(float)), *dw = h_copy(st, dw0, C), *db = h_copy(st, db0, C);
  if (!dout || !dx || !dw || !db) return;
  pg_layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, N, C);
  float *d_dout = d_floats(st, dout, (int64_t)N * C), *d_dx = d_floats(st, garbage, (int64_t)N * C);
  float *d_dw = d_floats(st, dw0, C), *d_db = d_floats(st, db0, C);
  if (!reload(st, d_mean, mean, N) || !reload(st, d_rstd, rstd, N)) return;
  if (launched(st, "layernorm_backward",
               pg_cuda_layernorm_backward(ctx, d_dx, d_dw, d_db, d_dout, d_x, d_w, d_mean, d_rstd, N, C))) {
    check_f(st, "layernorm_backward.dinp", d_dx, dx, (int64_t)N * C, TOL_REDUCE);
    check_f(st, "layernorm_backward.dweight", d_dw, dw, C, TOL_REDUCE);
    check_f(st, "layernorm_backward.dbias", d_db, db, C, TOL_REDUCE);
  }
  /* determinism: a second run from the same state gives the same values */
  float *first = d_get(st, d_dw, C);
  if (!first || !reload(st, d_dw, dw0, C)) return;
  if (launched(st, "layernorm_backward (repeat)",
               pg_cuda_layernorm_backward(ctx, NULL, d_dw, NULL, d_dout, d_x, d_w, d_mean, d_rstd, N, C)))
    check_f(st, "layernorm_backward.dweight (repeat)", d_dw, first, C, 0, 0);
}

static void test_matmul(selftest *st) {
  const int N = ST_N, C = ST_C, OC = ST_OC;
  const pg_cuda_ctx *ctx = &st->ctx;
  float *x = h_rand(st, (int64_t)N * C, -1, 1), *w = h_rand(st, (int64_t)OC * C, -1, 1);
  float *b = h_rand(st, OC, -1, 1), *garbage = h_rand(st, (int64_t)N * (C > OC ? C : OC), 100, 200);
  float *out = h_alloc(st, (size_t)N * OC * sizeof(float)), *out_nb = h_alloc(st, (size_t)N * OC * sizeof(float));
  if (!x || !w || !b || !garbage || !out || !out_nb) return;
  pg_matmul_forward(out, x, w, b, N, C, OC);
  pg_matmul_forward(out_nb, x, w, NULL, N, C, OC);
  float *d_x = d_floats(st, x, (int64_t)N * C), *d_w = d_floats(st, w, (int64_t)OC * C), *d_b = d_floats(st, b, OC);
  float *d_out = d_floats(st, garbage, (int64_t)N * OC);
  if (st->broken) return;
  if (launched(st, "matmul_forward", pg_cuda_matmul_forward(ctx, d_out, d_x, d_w, d_b, N, C, OC)))
    check_f(st, "matmul_forward (bias)", d_out, out, (int64_t)N * OC, TOL_GEMM);
  if (!reload(st, d_out, garbage, (int64_t)N * OC)) return;
  if (launched(st, "matmul_forward", pg_cuda_matmul_forward(ctx, d_out, d_x, d_w, NULL, N, C, OC)))
    check_f(st, "matmul_forward (no bias)", d_out, out_nb, (int64_t)N * OC, TOL_GEMM);

  float *dout = h_rand(st, (int64_t)N * OC, -1, 1), *dw0 = h_rand(st, (int64_t)OC * C, -1, 1);
  float *db0 = h_rand(st, OC, -1, 1), *dx = h_alloc(st, (size_t)N * C * sizeof(float));
  float *dw = h_copy(st, dw0, (int64_t)OC * C), *db = h_copy(st, db0, OC);
  if (!dout || !dx || !dw || !db) return;
  pg_matmul_backward(dx, dw, db, dout, x, w, N, C, OC);
  float *d_dout = d_floats(st, dout, (int64_t)N * OC), *d_dx = d_floats(st, garbage, (int64_t)N * C);
  float *d_dw = d_floats(st, dw0, (int64_t)OC * C), *d_db = d_floats(st, db0, OC);
  if (st->broken) return;
  if (launched(st, "matmul_backward", pg_cuda_matmul_backward(ctx, d_dx, d_dw, d_db, d_dout, d_x, d_w, N, C, OC))) {
    check_f(st, "matmul_backward.dinp", d_dx, dx, (int64_t)N * C, TOL_GEMM);
    check_f(st, "matmul_backward.dweight", d_dw, dw, (int64_t)OC * C, TOL_GEMM);
    check_f(st, "matmul_backward.dbias", d_db, db, OC, TOL_REDUCE);
  }
}


/* n values of elem bytes each (bf16, int32 or double: kind says which, for the message) of a device buffer against
 * the CPU's, bit for bit: the three exact checks share it. */
typedef enum { EXACT_BF16, EXACT_I32, EXACT_F64 } exact_kind;
static void check_exact(selftest *st, const char *name, const void *dev, const void *want, int64_t n,
                        exact_kind kind) {
  if (st->broken || !dev || !want) return;
  const size_t es = kind == EXACT_BF16 ? 2 : kind == EXACT_I32 ? 4 : 8;
  unsigned char *got = h_alloc(st, (size_t)n * es);
  if (!got) return;
  if (pg_cuda_synchronize() != PG_OK || pg_cuda_memcpy(got, dev, (size_t)n * es, PG_CUDA_DEVICE_TO_HOST) != PG_OK) {
    broken(st, name, pg_error());
    return;
  }
  st->checks++;
  const unsigned char *w = want;
  for (int64_t i = 0; i < n; i++)
    if (memcmp(got + i * es, w + i * es, es)) {
      st->failed++;
      if (kind == EXACT_BF16)
        say(st, "  FAIL  %-34s element %lld: got 0x%04x, want 0x%04x (bit for bit)\n", name, (long long)i,
            ((const uint16_t *)got)[i], ((const uint16_t *)want)[i]);
      else if (kind == EXACT_I32)
        say(st, "  FAIL  %-34s element %lld: got %d, want %d (exact)\n", name, (long long)i,
            (int)((const int32_t *)got)[i], (int)((const int32_t *)want)[i]);
      else
        say(st, "  FAIL  %-34s element %lld: got %.17g, want %.17g (exact)\n", name, (long long)i,
            ((const double *)got)[i], ((const double *)want)[i]);
      return;
    }
  say(st, "  ok    %-34s bit for bit (%lld values)\n", name, (long long)n);
}
static void check_bf16(selftest *st, const char *name, const uint16_t *dev, const uint16_t *want, int64_t n) {
  check_exact(st, name, dev, want, n, EXACT_BF16);
}
static void check_i32(selftest *st, const char *name, const int32_t *dev, const int32_t *want, int64_t n) {
  check_exact(st, name, dev, want, n, EXACT_I32);
}
static void check_f64(selftest *st, const char *name, const double *dev, const double *want, int64_t n) {
  check_exact(st, name, dev, want, n, EXACT_F64);
}

/* ---- precision bf16's forward product through cuBLASLt (kernels/cuda/bf16.cu) ----
 * The context's cuBLASLt path (when it has one) against the CPU's bf16 GEMM, with and without the bias epilogue;
 * the per-shape cache (a repeat asks no heuristic); operands less aligned than 256 bytes (their own entry); a bias
 * not 16-byte aligned (GemmEx: no cuBLASLt product); and the GemmEx path of the same products (context without
 * cuBLASLt) against the CPU too. x [N,C], w [OC,C], b [OC]: host float32, rounded to bf16 here. */
static void test_bf16_lt(selftest *st, const float *x, const float *w, const float *b, int N, int C, int OC) {
  pg_cuda_ctx *ctx = &st->ctx;
  pg_cuda_lt *lt = ctx->lt;
  if (st->broken) return;
  if (!lt) {
    say(st, "  none  %-34s no cuBLASLt in this context (PG_CUBLASLT=0, or it did not load)\n",
        "matmul_bf16 (cuBLASLt)");
    return;
  }
  /* x twice: at cudaMalloc's 256-byte alignment and one bf16 further; the bias aligned and one float further */
  const int64_t nx = (int64_t)N * C, nout = (int64_t)N * OC;
  uint16_t *x16 = h_alloc(st, ((size_t)nx + 1) * 2), *w16 = h_alloc(st, (size_t)OC * C * 2);
  float *bb = h_alloc(st, ((size_t)OC + 1) * sizeof(float)), *want = h_alloc(st, (size_t)nout * sizeof(float));
  float *want_nb = h_alloc(st, (size_t)nout * sizeof(float)), *garbage = h_rand(st, nout, 100, 200);
  if (!x16 || !w16 || !bb || !want || !want_nb || !garbage) return;
  pg_bf16_from_f32(x16 + 1, x, nx);
  pg_bf16_from_f32(w16, w, (int64_t)OC * C);
  memcpy(bb + 1, b, (size_t)OC * sizeof(float));
  if (pg_matmul_bf16_forward(want, x16 + 1, w16, b, N, C, OC) ||
      pg_matmul_bf16_forward(want_nb, x16 + 1, w16, NULL, N, C, OC)) {
    broken(st, "CPU bf16 GEMM", pg_bf16_gemm_error());
    return;
  }
  uint16_t *x_off = d_put(st, x16, ((size_t)nx + 1) * 2), *x_al = d_put(st, x16 + 1, (size_t)nx * 2);
  uint16_t *d_w16 = d_put(st, w16, (size_t)OC * C * 2);
  float *b_off = d_floats(st, bb, OC + 1), *d_b2 = d_floats(st, b, OC), *d_out = d_floats(st, garbage, nout);
  if (st->broken) return;
  x_off += 1, b_off += 1;
  /* heuristic queries before each call (the first shape may be test_bf16's, already cached) */
  long long hq[4];
  const long long p0 = lt->products;
  hq[0] = lt->heuristics;
  if (launched(st, "matmul_bf16_forward (cuBLASLt, bias)",
               pg_cuda_matmul_bf16_forward(ctx, d_out, x_al, d_w16, d_b2, N, C, OC)))
    check_f(st, "matmul_bf16_forward (cuBLASLt, bias)", d_out, want, nout, TOL_GEMM);
  if (!reload(st, d_out, garbage, nout)) return;
  hq[1] = lt->heuristics;
  if (launched(st, "matmul_bf16_forward (cuBLASLt, bias)",
               pg_cuda_matmul_bf16_forward(ctx, d_out, x_al, d_w16, d_b2, N, C, OC)))
    check_f(st, "matmul_bf16_forward (cuBLASLt, repeat)", d_out, want, nout, TOL_GEMM);
  if (!reload(st, d_out, garbage, nout)) return;
  hq[2] = lt->heuristics;
  if (launched(st, "matmul_bf16_forward (cuBLASLt, no bias)",
               pg_cuda_matmul_bf16_forward(ctx, d_out, x_al, d_w16, NULL, N, C, OC)))
    check_f(st, "matmul_bf16_forward (cuBLASLt, no bias)", d_out, want_nb, nout, TOL_GEMM);
  if (!reload(st, d_out, garbage, nout)) return;
  hq[3] = lt->heuristics;
  if (launched(st, "matmul_bf16_forward (cuBLASLt, x off 256)",
               pg_cuda_matmul_bf16_forward(ctx, d_out, x_off, d_w16, d_b2, N, C, OC)))
    check_f(st, "matmul_bf16_forward (Lt, x unaligned)", d_out, want, nout, TOL_GEMM);
  const long long h1 = lt->heuristics, p1 = lt->products;
  if (!reload(st, d_out, garbage, nout)) return;
  if (launched(st, "matmul_bf16_forward (bias off 16)",
               pg_cuda_matmul_bf16_forward(ctx, d_out, x_al, d_w16, b_off, N, C, OC)))
    check_f(st, "matmul_bf16_forward (GemmEx, bias unaligned)", d_out, want, nout, TOL_GEMM);
  /* the GemmEx path: the context without its cuBLASLt state */
  ctx->lt = NULL;
  if (!reload(st, d_out, garbage, nout)) {
    ctx->lt = lt;
    return;
  }
  const int rc = pg_cuda_matmul_bf16_forward(ctx, d_out, x_al, d_w16, d_b2, N, C, OC);
  ctx->lt = lt;
  if (launched(st, "matmul_bf16_forward (GemmEx)", rc))
    check_f(st, "matmul_bf16_forward (GemmEx)", d_out, want, nout, TOL_GEMM);
  if (st->broken) return;
  /* the repeat asks no heuristic, the other epilogue and the other alignment one each; four cuBLASLt products,
   * none for the unaligned bias or without the state */
  const long long repeat = hq[2] - hq[1], other_epilogue = hq[3] - hq[2], other_alignment = h1 - hq[3];
  st->checks++;
  if (repeat == 0 && other_epilogue == 1 && other_alignment == 1 && p1 - p0 == 4 && lt->products == p1 &&
      lt->heuristics == h1) {
    say(st, "  ok    %-34s a heuristic query per shape, epilogue and alignment\n", "matmul_bf16 (cuBLASLt cache)");
  } else {
    st->failed++;
    say(st, "  FAIL  %-34s queries: repeat %lld, no bias %lld, unaligned x %lld (want 0, 1, 1); %lld products "
        "(want 4); %lld queries and %lld products after\n", "matmul_bf16 (cuBLASLt cache)", repeat, other_epilogue,
        other_alignment, p1 - p0, lt->heuristics - h1, lt->products - p1);
  }
}

static void test_bf16_rounded(selftest *st, const uint16_t *d_x16, const uint16_t *d_w16, const float *d_b,
                              const float *want, int N, int C, int OC);

/* Precision bf16: the rounding (bit for bit, ties and specials included) and the GemmEx products against the CPU's
 * bf16 GEMMs on the same bf16 operands (both sum exact products in float32, in other orders: TOL_GEMM). */
static void test_bf16(selftest *st) {
  const int N = ST_N, C = ST_C, OC = ST_OC;
  const pg_cuda_ctx *ctx = &st->ctx;
  /* ties to even both ways, just above and below a tie, NaNs (quiet, signalling, negative), infinities, the
   * largest float (rounds to inf), the largest value that stays finite, subnormals, zeros */
  static const uint32_t special[] = {0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f807fffu, 0x7fc00001u, 0x7f800001u,
                                     0xffc12345u, 0x7f800000u, 0xff800000u, 0x7f7fffffu, 0x7f7f7fffu, 0x00008000u,
                                     0x00018000u, 0x80000001u, 0x00000000u, 0x80000000u};
  const int64_t ns = (int64_t)(sizeof special / sizeof *special), nr = (int64_t)N * C + ns;
  float *x = h_rand(st, nr, -3, 3);
  uint16_t *want = h_alloc(st, (size_t)nr * sizeof(uint16_t));
  if (!x || !want) return;
  memcpy(x + (int64_t)N * C, special, sizeof special);
  pg_bf16_from_f32(want, x, nr);
  float *d_x = d_floats(st, x, nr);
  uint16_t *d_r = d_put(st, x, (size_t)nr * sizeof(uint16_t)); /* x's first bytes: garbage to overwrite */
  if (st->broken) return;
  if (launched(st, "bf16_from_f32", pg_cuda_bf16_from_f32(ctx, d_r, d_x, nr)))
    check_bf16(st, "bf16_from_f32", d_r, want, nr);

  /* the GEMMs on bf16 operands: x [N,C] (want's first N*C), w [OC,C], dout [N,OC] */
  float *w = h_rand(st, (int64_t)OC * C, -1, 1), *b = h_rand(st, OC, -1, 1), *dout = h_rand(st, (int64_t)N * OC, -1, 1);
  float *dw0 = h_rand(st, (int64_t)OC * C, -1, 1), *db0 = h_rand(st, OC, -1, 1);
  float *garbage = h_rand(st, (int64_t)N * (C > OC ? C : OC), 100, 200);
  uint16_t *w16 = h_alloc(st, (size_t)OC * C * 2), *dout16 = h_alloc(st, (size_t)N * OC * 2);
  float *out = h_alloc(st, (size_t)N * OC * sizeof(float)), *dx = h_alloc(st, (size_t)N * C * sizeof(float));
  float *dw = h_copy(st, dw0, (int64_t)OC * C), *db = h_copy(st, db0, OC);
  if (!w || !b || !dout || !garbage || !w16 || !dout16 || !out || !dx || !dw || !db) return;
  pg_bf16_from_f32(w16, w, (int64_t)OC * C);
  pg_bf16_from_f32(dout16, dout, (int64_t)N * OC);
  if (pg_matmul_bf16_forward(out, want, w16, b, N, C, OC) ||
      pg_matmul_bf16_backward(dx, dw, dout16, want, w16, N, C, OC)) {
    broken(st, "CPU bf16 GEMM", pg_bf16_gemm_error());
    return;
  }
  pg_bias_backward(db, dout, N, OC);
  uint16_t *d_w16 = d_put(st, w16, (size_t)OC * C * 2), *d_dout16 = d_put(st, dout16, (size_t)N * OC * 2);
  float *d_b = d_floats(st, b, OC), *d_out = d_floats(st, garbage, (int64_t)N * OC);
  float *d_dout = d_floats(st, dout, (int64_t)N * OC), *d_dx = d_floats(st, garbage, (int64_t)N * C);
  float *d_dw = d_floats(st, dw0, (int64_t)OC * C), *d_db = d_floats(st, db0, OC);
  if (st->broken) return;
  if (launched(st, "matmul_bf16_forward", pg_cuda_matmul_bf16_forward(ctx, d_out, d_r, d_w16, d_b, N, C, OC)))
    check_f(st, "matmul_bf16_forward", d_out, out, (int64_t)N * OC, TOL_GEMM);
  test_bf16_lt(st, x, w, b, N, C, OC);
  test_bf16_rounded(st, d_r, d_w16, d_b, out, N, C, OC);
  if (launched(st, "matmul_bf16_backward",
               pg_cuda_matmul_bf16_backward(ctx, d_dx, d_dw, d_db, d_dout, d_dout16, d_r, d_w16, N, C, OC))) {
    check_f(st, "matmul_bf16_backward.dinp", d_dx, dx, (int64_t)N * C, TOL_GEMM);
    check_f(st, "matmul_bf16_backward.dweight", d_dw, dw, (int64_t)OC * C, TOL_GEMM);
    check_f(st, "matmul_bf16_backward.dbias", d_db, db, OC, TOL_REDUCE);
  }
  /* the bias gradient of a bf16 dout without its float32 copy (dout_f32 NULL): its widened values' column sums,
   * against the CPU's (TOL_REDUCE: other orders) and against the device's own sums of the widened copy (the
   * same values in the same order: the same bits) */
  float *db16 = h_copy(st, db0, OC), *dout_w = h_alloc(st, (size_t)N * OC * sizeof(float));
  if (!db16 || !dout_w || !reload(st, d_db, db0, OC)) return;
  pg_bias_backward_bf16(db16, dout16, N, OC);
  pg_bf16_to_f32(dout_w, dout16, (int64_t)N * OC);
  float *d_dout_w = d_floats(st, dout_w, (int64_t)N * OC), *d_db_w = d_floats(st, db0, OC);
  if (st->broken) return;
  if (launched(st, "matmul_bf16_backward (bf16 dbias)",
               pg_cuda_matmul_bf16_backward(ctx, NULL, NULL, d_db, NULL, d_dout16, d_r, d_w16, N, C, OC)))
    check_f(st, "matmul_bf16_backward.dbias (bf16)", d_db, db16, OC, TOL_REDUCE);
  float *from16 = d_get(st, d_db, OC);
  if (from16 && launched(st, "matmul_bf16_backward (widened dbias)",
                         pg_cuda_matmul_bf16_backward(ctx, NULL, NULL, d_db_w, d_dout_w, d_dout16, d_r, d_w16, N,
                                                      C, OC)))
    check_f(st, "matmul_bf16_backward.dbias (bf16 = widened)", d_db_w, from16, OC, 0, 0);
}

/* n bf16 values of a device buffer against the CPU's, widened: |got - want| <= atol + rtol |want|. */
static void check_bf16_close(selftest *st, const char *name, const uint16_t *dev, const uint16_t *want, int64_t n,
                             double rtol, double atol) {
  if (st->broken || !dev || !want) return;
  uint16_t *got = h_alloc(st, (size_t)n * sizeof(uint16_t));
  if (!got) return;
  if (pg_cuda_synchronize() != PG_OK ||
      pg_cuda_memcpy(got, dev, (size_t)n * sizeof(uint16_t), PG_CUDA_DEVICE_TO_HOST) != PG_OK) {
    broken(st, name, pg_error());
    return;
  }
  st->checks++;
  double max_err = 0;
  for (int64_t i = 0; i < n; i++) {
    const float g = pg_bf16_value(got[i]), x = pg_bf16_value(want[i]);
    if (g == x || (isnan(g) && isnan(x))) continue;
    const double err = isnan(g) || isnan(x) || isinf(g) || isinf(x) ? INFINITY : fabs((double)g - (double)x);
    if (!(err <= atol + rtol * fabs((double)x))) {
      st->failed++;
      say(st, "  FAIL  %-34s element %lld: got %.9g, want %.9g (rtol %.0e, atol %.0e)\n", name, (long long)i,
          (double)g, (double)x, rtol, atol);
      return;
    }
    if (err > max_err) max_err = err;
  }
  say(st, "  ok    %-34s max |err| %-9.2g (rtol %.0e, atol %.0e, %lld values)\n", name, max_err, rtol, atol,
      (long long)n);
}

/* The bf16 activations and the widening: the CPU's formulas on the same bf16 inputs, each result rounded to
 * bf16, so a float32 difference of an ulp (CUDA's expf) moves a result by at most one bf16 ulp (2^-7
 * relative: TOL_BF16); the widening and the residual add are exact. */
#define TOL_BF16 1e-2, 1e-6

/* The rounded product (pg_cuda_matmul_bf16_forward_rounded) through cuBLASLt's bf16 D where the context has it and
 * through GemmEx and the rounding without it, against the CPU's float32 product `want` rounded: the device's sums
 * are TOL_GEMM from the CPU's, so a value next to a rounding boundary may land one bf16 step (2^-7 relative at
 * most) away: TOL_BF16. */
static void test_bf16_rounded(selftest *st, const uint16_t *d_x16, const uint16_t *d_w16, const float *d_b,
                              const float *want, int N, int C, int OC) {
  pg_cuda_ctx *ctx = &st->ctx;
  const int64_t n = (int64_t)N * OC, nf = (n + 1) / 2; /* nf floats hold the n bf16 values */
  uint16_t *want16 = h_alloc(st, (size_t)n * sizeof(uint16_t));
  float *garbage = h_rand(st, n, 100, 200);
  if (st->broken || !want16 || !garbage) return;
  pg_bf16_from_f32(want16, want, n);
  uint16_t *d_out16 = d_put(st, garbage, (size_t)nf * sizeof(float));
  float *d_sums = d_floats(st, garbage, n);
  if (st->broken) return;
  pg_cuda_lt *lt = ctx->lt;
  for (int pass = 0; pass < 2; pass++) { /* 0: the context's (cuBLASLt if it has it), 1: GemmEx and the rounding */
    const char *name = pass == 0 && lt ? "matmul_bf16_forward_rounded (Lt)" : "matmul_bf16_forward_rounded";
    if (pass == 1) ctx->lt = NULL;
    const long long p0 = lt ? lt->products : 0;
    const int rc = pg_cuda_matmul_bf16_forward_rounded(ctx, d_out16, d_sums, d_x16, d_w16, d_b, N, C, OC);
    ctx->lt = lt;
    if (launched(st, name, rc)) check_bf16_close(st, name, d_out16, want16, n, TOL_BF16);
    /* whether cuBLASLt wrote the bf16 D itself: its heuristic may offer no algorithm for bf16 D with a float32
     * bias and float32 split-K reductions (then GemmEx and the rounding ran: correct, one pass more) */
    if (pass == 0 && lt && lt->products == p0)
      say(st, "  none  %-34s cuBLASLt offered no algorithm for bf16 D: GemmEx and the rounding ran\n",
          "matmul_bf16_forward_rounded (Lt)");
    if (!reload(st, (float *)(void *)d_out16, garbage, nf)) return;
    if (!lt) return; /* the one path, checked */
  }
}

static void test_bf16_pointwise(selftest *st) {
  const int N = ST_N, H = 101;
  const int64_t n = (int64_t)N * H, n2 = 2 * n;
  const pg_cuda_ctx *ctx = &st->ctx;
  float *x = h_rand(st, n2, -6, 6), *dy = h_rand(st, n2, -1, 1), *a = h_rand(st, n2, -1, 1);
  float *garbage = h_rand(st, n2, 100, 200);
  uint16_t *x16 = h_alloc(st, (size_t)n2 * 2), *dy16 = h_alloc(st, (size_t)n2 * 2), *r16 = h_alloc(st, (size_t)n2 * 2);
  float *r = h_alloc(st, (size_t)n2 * sizeof(float));
  if (!x || !dy || !a || !garbage || !x16 || !dy16 || !r16 || !r) return;
  pg_bf16_from_f32(x16, x, n2);
  pg_bf16_from_f32(dy16, dy, n2);
  uint16_t *d_x16 = d_put(st, x16, (size_t)n2 * 2), *d_dy16 = d_put(st, dy16, (size_t)n2 * 2);
  uint16_t *d_r16 = d_put(st, garbage, (size_t)n2 * 2);
  float *d_a = d_floats(st, a, n2), *d_r = d_floats(st, garbage, n2);
  if (st->broken) return;

  pg_bf16_to_f32(r, x16, n2);
  if (launched(st, "bf16_to_f32", pg_cuda_bf16_to_f32(ctx, d_r, d_x16, n2)))
    check_f(st, "bf16_to_f32", d_r, r, n2, 0, 0);
  pg_residual_bf16_forward(r, a, x16, n2);
  if (!reload(st, d_r, garbage, n2)) return;
  if (launched(st, "residual_bf16_forward", pg_cuda_residual_bf16_forward(ctx, d_r, d_a, d_x16, n2)))
    check_f(st, "residual_bf16_forward", d_r, r, n2, 0, 0);

  pg_gelu_bf16_forward(r16, x16, n2);
  if (launched(st, "gelu_bf16_forward", pg_cuda_gelu_bf16_forward(ctx, d_r16, d_x16, n2)))
    check_bf16_close(st, "gelu_bf16_forward", d_r16, r16, n2, TOL_BF16);
  pg_gelu_bf16_backward(r16, x16, dy16, n2);
  if (launched(st, "gelu_bf16_backward", pg_cuda_gelu_bf16_backward(ctx, d_r16, d_x16, d_dy16, n2)))
    check_bf16_close(st, "gelu_bf16_backward", d_r16, r16, n2, TOL_BF16);

  /* SwiGLU on [N, 2H] (gates to -6..6), H odd */
  pg_swiglu_bf16_forward(r16, x16, N, H);
  if (launched(st, "swiglu_bf16_forward", pg_cuda_swiglu_bf16_forward(ctx, d_r16, d_x16, N, H)))
    check_bf16_close(st, "swiglu_bf16_forward", d_r16, r16, n, TOL_BF16);
  pg_swiglu_bf16_backward(r16, x16, dy16, N, H);
  if (launched(st, "swiglu_bf16_backward", pg_cuda_swiglu_bf16_backward(ctx, d_r16, d_x16, d_dy16, N, H)))
    check_bf16_close(st, "swiglu_bf16_backward", d_r16, r16, n2, TOL_BF16);
}

/* ---- flash attention on bf16 q|k|v (pg_cuda_flash_bf16_*) against the CPU twin (pg_flash_bf16_*: the float32
 * block attention on the same bf16 values) ----
 * Tolerances, for inputs in [-X, X] (X = ST_FLASH_X) and u = 2^-24: a score sums HS exact products in float32 on
 * both sides, in other orders: each side within gamma_HS = HS u / (1 - HS u) of HS X^2 scale, so the two differ by
 * ds <= 2 gamma_HS HS X^2 scale (HS 128: 6.9e-4); lse by ds plus its own few roundings (atol ds + 1e-5). The
 * device rounds P to bf16 for P V (relative 2^-9) and each p moves by e^(2 ds) - 1 relative (in numerator and
 * normaliser), so out moves by at most (2^-9 + 2 ds + 4 ds) X (atol, elementwise). The backward's
 * gradients are sums over rows of terms with one factor rounded to bf16 (P or dS: 2^-9 relative each, on top of
 * p's e^(2 ds) - 1), and dS = P (dP - delta) cancels: an elementwise bound would need the reference's sums of
 * |terms|, so the bound is norm-wise, |err| <= 2^-7 max|want| (the two roundings' 2^-8, doubled for the
 * cancellation; the emulator measures about 2^-10). delta sums HS float32 products of the same values on both
 * sides (1e-4 of its largest). With ALiBi both sides add slope (j - i) to the scaled sum, each rounding once more
 * (u of the sum and of the bias, at most slope T): ds grows by 2 u (HS X^2 scale + slope T).
 * Determinism: a repeated backward gives the same bits. */
#define ST_FLASH_X 2.0
static double flash_score_err(int HS, int T, double slope) {
  const double u = 0x1p-24, gamma = HS * u / (1 - HS * u), sum = HS * ST_FLASH_X * ST_FLASH_X / sqrt((double)HS);
  return 2 * gamma * sum + (slope > 0 ? 2 * u * (sum + slope * T) : 0);
}

static double max_abs(const float *x, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; i++) m = fabs((double)x[i]) > m ? fabs((double)x[i]) : m;
  return m;
}

static void flash_bf16_case(selftest *st, int B, int T, int NH, int NKV, int HS, int alibi) {
  const int64_t W = (int64_t)(NH + 2 * NKV) * HS, C = (int64_t)NH * HS;
  const int64_t nq = (int64_t)B * T * W, no = (int64_t)B * T * C, nr = (int64_t)B * NH * T;
  const pg_cuda_ctx *ctx = &st->ctx;
  char what[48], name[112];
  snprintf(what, sizeof what, " (T %d, %d/%d heads, hs %d%s)", T, NH, NKV, HS, alibi ? ", alibi" : "");
#define ST_NAME(s) (snprintf(name, sizeof name, "flash_bf16_%s%.47s", s, what), name)
  float *x = h_rand(st, nq, -ST_FLASH_X, ST_FLASH_X), *dy = h_rand(st, no, -1, 1);
  float *out = h_alloc(st, (size_t)no * sizeof(float)), *lse = h_alloc(st, (size_t)nr * sizeof(float));
  float *delta = h_alloc(st, (size_t)nr * sizeof(float)), *dx = h_alloc(st, (size_t)nq * sizeof(float));
  float *garbage = h_rand(st, nq, 100, 200);
  uint16_t *x16 = h_alloc(st, (size_t)nq * 2), *dy16 = h_alloc(st, (size_t)no * 2);
  float *slopes = alibi ? h_alloc(st, (size_t)NH * sizeof(float)) : NULL;
  if (!x || !dy || !out || !lse || !delta || !dx || !garbage || !x16 || !dy16 || (alibi && !slopes)) return;
  if (slopes) pg_alibi_slopes(slopes, NH);
  pg_bf16_from_f32(x16, x, nq);
  pg_bf16_from_f32(dy16, dy, no);
  if (pg_flash_bf16_forward(out, NULL, lse, x16, slopes, B, T, NH, NKV, HS) ||
      pg_flash_bf16_backward(dx, NULL, delta, dy16, out, x16, lse, slopes, B, T, NH, NKV, HS)) {
    broken(st, ST_NAME("CPU twin"), "refused or out of memory");
    return;
  }
  uint16_t *d_x16 = d_put(st, x16, (size_t)nq * 2), *d_dy16 = d_put(st, dy16, (size_t)no * 2);
  float *d_out = d_floats(st, garbage, no), *d_lse = d_floats(st, garbage, nr);
  float *d_delta = d_floats(st, garbage, nr), *d_dx = d_floats(st, garbage, nq);
  float *d_slopes = slopes ? d_put(st, slopes, (size_t)NH * sizeof(float)) : NULL;
  uint16_t *d_out16 = d_put(st, garbage, (size_t)no * 2);
  if (st->broken) return;
  const double ds = flash_score_err(HS, T, slopes ? slopes[0] : 0); /* slopes[0] the largest */
  if (!launched(st, ST_NAME("forward"),
                pg_cuda_flash_bf16_forward(ctx, d_out, d_out16, d_lse, d_x16, d_slopes, B, T, NH, NKV, HS)))
    return;
  check_f(st, ST_NAME("forward.out"), d_out, out, no, 0, (0x1p-9 + 6 * ds) * ST_FLASH_X);
  /* the bf16 output written in the same pass: the rounding of the device's own float32 output, bit for bit */
  float *dev_out = d_get(st, d_out, no);
  uint16_t *out16 = h_alloc(st, (size_t)no * 2);
  if (!dev_out || !out16) return;
  pg_bf16_from_f32(out16, dev_out, no);
  check_bf16(st, ST_NAME("forward.out16"), d_out16, out16, no);
  check_f(st, ST_NAME("forward.lse"), d_lse, lse, nr, 0, ds + 1e-5);
  /* the backward from the CPU's out and lse (the contract both backwards share) */
  if (!reload(st, d_out, out, no) || !reload(st, d_lse, lse, nr)) return;
  if (!launched(st, ST_NAME("backward"), pg_cuda_flash_bf16_backward(ctx, d_dx, NULL, d_delta, d_dy16, d_out,
                                                                       d_x16, d_lse, d_slopes, B, T, NH, NKV, HS)))
    return;
  check_f(st, ST_NAME("backward.delta"), d_delta, delta, nr, 0, 1e-4 * max_abs(delta, nr) + 1e-6);
  check_f(st, ST_NAME("backward.dqkv"), d_dx, dx, nq, 0, 0x1p-7 * max_abs(dx, nq));
  float *first = d_get(st, d_dx, nq);
  if (!first || !reload(st, d_dx, garbage, nq)) return;
  if (launched(st, ST_NAME("backward (repeat)"), pg_cuda_flash_bf16_backward(ctx, d_dx, NULL, d_delta, d_dy16,
                                                                               d_out, d_x16, d_lse, d_slopes, B, T,
                                                                               NH, NKV, HS)))
    check_f(st, ST_NAME("backward.dqkv (repeat)"), d_dx, first, nq, 0, 0);
  /* the bf16 gradient alone (dqkv NULL), written in the same pass: the rounding of the float32 one, bit for bit */
  uint16_t *want16 = h_alloc(st, (size_t)nq * 2), *d_dx16 = d_put(st, garbage, (size_t)nq * 2);
  if (!want16 || !d_dx16) return;
  pg_bf16_from_f32(want16, first, nq);
  if (launched(st, ST_NAME("backward (bf16 only)"), pg_cuda_flash_bf16_backward(ctx, NULL, d_dx16, d_delta, d_dy16,
                                                                                  d_out, d_x16, d_lse, d_slopes, B,
                                                                                  T, NH, NKV, HS)))
    check_bf16(st, ST_NAME("backward.dqkv16"), d_dx16, want16, nq);
#undef ST_NAME
}

/* Head sizes 64 and 128, multi-head, grouped-query and multi-query, T not a multiple of a block's 64 rows; a
 * head size the kernels do not take is refused (the caller's fall-back), not computed. */
static void test_flash_bf16(selftest *st) {
  flash_bf16_case(st, 2, 48, 3, 3, 64, 0);
  flash_bf16_case(st, 1, 80, 4, 2, 64, 0);
  flash_bf16_case(st, 2, 32, 2, 1, 128, 0);
  flash_bf16_case(st, 1, 80, 2, 2, 128, 0);
  flash_bf16_case(st, 1, 80, 4, 4, 64, 1); /* ALiBi (BLOOM): slopes 2^-2 .. 2^-8 */
  flash_bf16_case(st, 2, 32, 2, 2, 128, 1);
  if (st->broken) return;
  st->checks++;
  if (pg_flash_bf16_unsupported(1, 32, 2, 2, 96) && pg_flash_bf16_unsupported(1, 40, 2, 2, 64) &&
      pg_cuda_flash_bf16_forward(&st->ctx, NULL, NULL, NULL, NULL, NULL, 1, 32, 2, 2, 96) == PG_CUDA_EINVAL) {
    say(st, "  ok    %-34s refused (hs 96, T 40)\n", "flash_bf16 shapes");
  } else {
    st->failed++;
    say(st, "  FAIL  %-34s hs 96 or T 40 not refused\n", "flash_bf16 shapes");
  }
}

/* One attention shape: B sequences of T rows, NH query heads, NKV key/value heads of HS columns; slopes: NULL or
 * NH ALiBi slopes (host). The flash kernels: out and lse against the CPU's (sums in another order: TOL_GEMM), the
 * backward from the CPU's out and lse (the same inputs), then once more for the same bits (no atomics). */
static void attention_case(selftest *st, int B, int T, int NH, int NKV, int HS, const float *slopes) {
  const int N = B * T, W = (NH + 2 * NKV) * HS, C = NH * HS;
  const pg_cuda_ctx *ctx = &st->ctx;
  const int64_t nqkv = (int64_t)N * W, nlse = (int64_t)N * NH;
  char what[64] = "", name[128];
  snprintf(what, sizeof what, " (T=%d HS=%d", T, HS);
  if (NKV != NH) snprintf(what + strlen(what), sizeof what - strlen(what), " %d/%d heads", NH, NKV);
  snprintf(what + strlen(what), sizeof what - strlen(what), slopes ? " alibi)" : ")");
#define ST_NAME(s) (snprintf(name, sizeof name, "attention_%s%.63s", s, what), name)
  float *qkv = h_rand(st, nqkv, -1, 1), *garbage = h_rand(st, nqkv, 100, 200);
  float *out = h_alloc(st, (size_t)N * C * sizeof(float)), *lse = h_alloc(st, (size_t)nlse * sizeof(float));
  if (!qkv || !garbage || !out || !lse) return;
  pg_attention_forward(out, lse, qkv, slopes, B, T, NH, NKV, HS);
  float *d_qkv = d_floats(st, qkv, nqkv), *d_out = d_floats(st, garbage, (int64_t)N * C);
  float *d_lse = d_floats(st, garbage, nlse), *d_slopes = slopes ? d_floats(st, slopes, NH) : NULL;
  if (st->broken) return;
  if (launched(st, ST_NAME("forward"),
               pg_cuda_attention_forward(ctx, d_out, d_lse, d_qkv, d_slopes, B, T, NH, NKV, HS))) {
    check_f(st, ST_NAME("forward.out"), d_out, out, (int64_t)N * C, TOL_GEMM);
    check_f(st, ST_NAME("forward.lse"), d_lse, lse, nlse, TOL_GEMM);
  }
  float *dout = h_rand(st, (int64_t)N * C, -1, 1), *dqkv = h_alloc(st, (size_t)nqkv * sizeof(float));
  float *scratch = h_alloc(st, (size_t)pg_attention_scratch_floats(N, NH) * sizeof(float));
  float *d_scratch = d_floats(st, garbage, pg_cuda_attention_scratch_floats(N, NH));
  if (!dout || !dqkv || !scratch || !d_scratch) return;
  pg_attention_backward(dqkv, scratch, dout, qkv, out, lse, slopes, B, T, NH, NKV, HS);
  float *d_dout = d_floats(st, dout, (int64_t)N * C), *d_dqkv = d_floats(st, garbage, nqkv);
  /* the CPU's forward results: the same inputs */
  if (!reload(st, d_out, out, (int64_t)N * C) || !reload(st, d_lse, lse, nlse)) return;
  if (launched(st, ST_NAME("backward"), pg_cuda_attention_backward(ctx, d_dqkv, d_scratch, d_dout, d_qkv, d_out,
                                                                   d_lse, d_slopes, B, T, NH, NKV, HS)))
    check_f(st, ST_NAME("backward.dqkv"), d_dqkv, dqkv, nqkv, TOL_GEMM);
  float *first = d_get(st, d_dqkv, nqkv);
  if (!first || !reload(st, d_dqkv, garbage, nqkv)) return;
  if (launched(st, ST_NAME("backward (repeat)"), pg_cuda_attention_backward(ctx, d_dqkv, d_scratch, d_dout, d_qkv,
                                                                            d_out, d_lse, d_slopes, B, T, NH, NKV,
                                                                            HS)))
    check_f(st, ST_NAME("backward.dqkv (repeat)"), d_dqkv, first, nqkv, 0, 0);
#undef ST_NAME
}

/* Multi-head, grouped-query (two query heads per key/value head) and multi-query attention; ALiBi with 3 heads
 * (an odd count: slopes 2^-4, 2^-8 and the extra 2^-2, whose biases reach 9 at T = 37) and with 4 of 8 heads
 * (grouped-query, the second tensor-parallel rank's slice); GPT-2's head size 64 (the device's K/V tiles in shared
 * memory), an odd head size 13, one past the tiles' staging (129: rows read from global memory), and T = 70 (the
 * CPU's 64-row tiles and the device's 32-row ones both split the sequence, neither at 70). */
static void test_attention(selftest *st) {
  attention_case(st, ST_B, ST_T, ST_NH, ST_NH, ST_C / ST_NH, NULL);
  attention_case(st, ST_B, ST_T, 4, 2, 12, NULL);
  attention_case(st, ST_B, ST_T, 4, 1, 12, NULL);
  float slopes3[ST_NH], slopes8[8];
  pg_alibi_slopes(slopes3, ST_NH);
  pg_alibi_slopes(slopes8, 8);
  attention_case(st, ST_B, ST_T, ST_NH, ST_NH, ST_C / ST_NH, slopes3);
  attention_case(st, ST_B, ST_T, 4, 2, 12, slopes8 + 4);
  attention_case(st, 1, 70, 2, 1, 64, NULL);
  attention_case(st, ST_B, ST_T, ST_NH, ST_NH, 13, slopes3);
  attention_case(st, 1, 40, 2, 2, 129, NULL);
}

/* Decoding with a key/value cache: T new rows at position pos of a cache
 * whose first pos rows hold earlier keys and values (random), grouped-query
 * and ALiBi; the cache rows written must be the CPU's bits (copies), the
 * output the CPU's sums in another order (TOL_GEMM). */
static void attention_cached_case(selftest *st, int T, int pos, int NH, int NKV, int HS, const float *slopes) {
  const int W = (NH + 2 * NKV) * HS, L = pos + T, kvw = NKV * HS, C = NH * HS;
  const pg_cuda_ctx *ctx = &st->ctx;
  const int64_t nqkv = (int64_t)T * W, ncache = (int64_t)L * kvw, nscores = (int64_t)NH * T * L;
  char name[96];
  float *qkv = h_rand(st, nqkv, -1, 1), *k0 = h_rand(st, ncache, -1, 1), *v0 = h_rand(st, ncache, -1, 1);
  float *garbage = h_rand(st, nscores > (int64_t)T * C ? nscores : (int64_t)T * C, 100, 200);
  float *k = h_copy(st, k0, ncache), *v = h_copy(st, v0, ncache), *out = h_alloc(st, (size_t)T * C * sizeof(float));
  float *scores = h_alloc(st, (size_t)nscores * sizeof(float));
  if (!qkv || !k0 || !v0 || !garbage || !k || !v || !out || !scores) return;
  pg_attention_cached(out, scores, k, v, qkv, slopes, T, pos, NH, NKV, HS);
  float *d_qkv = d_floats(st, qkv, nqkv), *d_k = d_floats(st, k0, ncache), *d_v = d_floats(st, v0, ncache);
  float *d_out = d_floats(st, garbage, (int64_t)T * C), *d_scores = d_floats(st, garbage, nscores);
  float *d_slopes = slopes ? d_floats(st, slopes, NH) : NULL;
  if (st->broken) return;
  snprintf(name, sizeof name, "attention_cached (T %d at %d, %d/%d heads%s)", T, pos, NH, NKV, slopes ? ", alibi" : "");
  if (launched(st, name, pg_cuda_attention_cached(ctx, d_out, d_scores, d_k, d_v, d_qkv, d_slopes, T, pos, NH, NKV, HS))) {
    check_f(st, name, d_out, out, (int64_t)T * C, TOL_GEMM);
    check_f(st, "attention_cached.kcache", d_k, k, ncache, 0, 0);
    check_f(st, "attention_cached.vcache", d_v, v, ncache, 0, 0);
  }
}

static void test_attention_cached(selftest *st) {
  float slopes8[8];
  pg_alibi_slopes(slopes8, 8);
  attention_cached_case(st, 1, 0, 4, 4, 8, NULL);
  attention_cached_case(st, 1, 37, 4, 2, 12, NULL);
  attention_cached_case(st, 5, 11, 4, 1, 12, NULL);
  attention_cached_case(st, ST_T, 0, 4, 2, 12, slopes8 + 4);
  attention_cached_case(st, 3, 20, 4, 4, 12, slopes8 + 4);
}

/* Block attention (context parallelism's ring): a query chunk of Tq rows at position q_pos0 of the fused
 * layout, folded over three key blocks of the same layout (random rows: the kernels only see positions): one
 * wholly visible, one cut by the diagonal, one where the first rows see no key (their state must stay as it
 * is). Each kernel gets the CPU's inputs (the CPU's state is reloaded before the next one), so each check is
 * that kernel's own rounding: the device's dot products run in column order, the CPU's are sgemm's (TOL_GEMM);
 * finish and delta are a division and a row sum (TOL_REDUCE). The backward accumulates into random gradients
 * and repeats bitwise. */
static void attention_block_case(selftest *st, int NH, int NKV, int HS, const float *slopes) {
  enum { B = 2, TQ = 13, TK = 11, NBLK = 3 };
  const int64_t q_pos0 = 20, k_pos0[NBLK] = {0, 11, 22};
  const int W = (NH + 2 * NKV) * HS, C = NH * HS;
  const int64_t nq = (int64_t)B * TQ * W, nkv = (int64_t)B * TK * W, nacc = (int64_t)B * TQ * C, nst = (int64_t)B * NH * TQ;
  const pg_cuda_ctx *ctx = &st->ctx;
  char what[40] = "", name[112];
  snprintf(what, sizeof what, " (%d/%d heads, hs %d%s)", NH, NKV, HS, slopes ? ", alibi" : "");
#define ST_NAME(s) (snprintf(name, sizeof name, "attention_block_%s%.39s", s, what), name)
  float *qc = h_rand(st, nq, -1, 1), *acc = h_alloc(st, (size_t)nacc * sizeof(float));
  float *mx = h_alloc(st, (size_t)nst * sizeof(float)), *sm = h_alloc(st, (size_t)nst * sizeof(float));
  float *kv[NBLK];
  for (int k = 0; k < NBLK; k++) kv[k] = h_rand(st, nkv, -1, 1);
  if (!qc || !acc || !mx || !sm || !kv[0] || !kv[1] || !kv[2]) return;
  memset(acc, 0, (size_t)nacc * sizeof(float));
  for (int64_t i = 0; i < nst; i++) mx[i] = -INFINITY, sm[i] = 0.0f;
  float *d_q = d_floats(st, qc, nq), *d_acc = d_floats(st, acc, nacc), *d_mx = d_floats(st, mx, nst);
  float *d_sm = d_floats(st, sm, nst), *d_slopes = slopes ? d_floats(st, slopes, NH) : NULL;
  float *d_kv[NBLK];
  for (int k = 0; k < NBLK; k++) d_kv[k] = d_floats(st, kv[k], nkv);
  if (st->broken) return;
  /* forward: fold the blocks in the order 1, 2, 0 (any order is allowed) */
  static const int order[NBLK] = {1, 2, 0};
  for (int o = 0; o < NBLK; o++) {
    const int k = order[o];
    pg_attention_block_forward(acc, mx, sm, qc, W, kv[k] + (int64_t)NH * HS, kv[k] + (int64_t)(NH + NKV) * HS, W,
                               slopes, B, TQ, TK, NH, NKV, HS, q_pos0, k_pos0[k]);
    if (!launched(st, ST_NAME("forward"),
                  pg_cuda_attention_block_forward(ctx, d_acc, d_mx, d_sm, d_q, W, d_kv[k] + (int64_t)NH * HS,
                                                  d_kv[k] + (int64_t)(NH + NKV) * HS, W, d_slopes, B, TQ, TK, NH, NKV,
                                                  HS, q_pos0, k_pos0[k])))
      return;
    check_f(st, ST_NAME("forward.acc"), d_acc, acc, nacc, TOL_GEMM);
    check_f(st, ST_NAME("forward.mx"), d_mx, mx, nst, TOL_GEMM);
    check_f(st, ST_NAME("forward.sm"), d_sm, sm, nst, TOL_GEMM);
    if (!reload(st, d_acc, acc, nacc) || !reload(st, d_mx, mx, nst) || !reload(st, d_sm, sm, nst)) return;
  }
  /* finish into the query columns of a fused-layout buffer (out_stride W) */
  float *out = h_rand(st, nq, 100, 200), *lse = h_alloc(st, (size_t)nst * sizeof(float));
  if (!out || !lse) return;
  float *d_out = d_floats(st, out, nq), *d_lse = d_floats(st, out, nst);
  if (st->broken) return;
  pg_attention_block_finish(out, W, lse, acc, mx, sm, B, TQ, NH, HS);
  if (launched(st, ST_NAME("finish"), pg_cuda_attention_block_finish(ctx, d_out, W, d_lse, d_acc, d_mx, d_sm, B, TQ,
                                                                     NH, HS))) {
    check_f(st, ST_NAME("finish.out"), d_out, out, nq, TOL_REDUCE);
    check_f(st, ST_NAME("finish.lse"), d_lse, lse, nst, TOL_REDUCE);
  }
  if (!reload(st, d_out, out, nq) || !reload(st, d_lse, lse, nst)) return;
  /* delta from a dout with rows C apart and the finished out (W apart) */
  float *dout = h_rand(st, nacc, -1, 1), *delta = h_alloc(st, (size_t)nst * sizeof(float));
  if (!dout || !delta) return;
  float *d_dout = d_floats(st, dout, nacc), *d_delta = d_floats(st, out, nst);
  if (st->broken) return;
  pg_attention_block_delta(delta, dout, C, out, W, B, TQ, NH, HS);
  if (launched(st, ST_NAME("delta"), pg_cuda_attention_block_delta(ctx, d_delta, d_dout, C, d_out, W, B, TQ, NH, HS)))
    check_f(st, ST_NAME("delta"), d_delta, delta, nst, TOL_REDUCE);
  if (!reload(st, d_delta, delta, nst)) return;
  /* backward per block into random starting gradients: dq in a [B, TQ, W] buffer's query columns, dk and dv in
   * the key block's gradient buffer (the fused layout) */
  for (int k = 0; k < NBLK; k++) {
    float *dq0 = h_rand(st, nq, -1, 1), *dkv0 = h_rand(st, nkv, -1, 1);
    float *dq = h_copy(st, dq0, nq), *dkv = h_copy(st, dkv0, nkv);
    if (!dq0 || !dkv0 || !dq || !dkv) return;
    float *d_dq = d_floats(st, dq0, nq), *d_dkv = d_floats(st, dkv0, nkv);
    if (st->broken) return;
    const float *kk = kv[k] + (int64_t)NH * HS, *vv = kv[k] + (int64_t)(NH + NKV) * HS;
    pg_attention_block_backward(dq, W, dkv + (int64_t)NH * HS, dkv + (int64_t)(NH + NKV) * HS, W, qc, W, kk, vv, W,
                                dout, C, lse, delta, slopes, B, TQ, TK, NH, NKV, HS, q_pos0, k_pos0[k]);
    float *dk_dev = d_dkv + (int64_t)NH * HS, *dv_dev = d_dkv + (int64_t)(NH + NKV) * HS;
    const float *kd = d_kv[k] + (int64_t)NH * HS, *vd = d_kv[k] + (int64_t)(NH + NKV) * HS;
    if (!launched(st, ST_NAME("backward"),
                  pg_cuda_attention_block_backward(ctx, d_dq, W, dk_dev, dv_dev, W, d_q, W, kd, vd, W, d_dout, C,
                                                   d_lse, d_delta, d_slopes, B, TQ, TK, NH, NKV, HS, q_pos0,
                                                   k_pos0[k])))
      return;
    check_f(st, ST_NAME("backward.dq"), d_dq, dq, nq, TOL_GEMM);
    check_f(st, ST_NAME("backward.dkv"), d_dkv, dkv, nkv, TOL_GEMM);
    if (k != 1) continue;
    float *first_q = d_get(st, d_dq, nq), *first_kv = d_get(st, d_dkv, nkv);
    if (!first_q || !first_kv || !reload(st, d_dq, dq0, nq) || !reload(st, d_dkv, dkv0, nkv)) return;
    if (launched(st, ST_NAME("backward (repeat)"),
                 pg_cuda_attention_block_backward(ctx, d_dq, W, dk_dev, dv_dev, W, d_q, W, kd, vd, W, d_dout, C,
                                                  d_lse, d_delta, d_slopes, B, TQ, TK, NH, NKV, HS, q_pos0,
                                                  k_pos0[k]))) {
      check_f(st, ST_NAME("backward.dq (repeat)"), d_dq, first_q, nq, 0, 0);
      check_f(st, ST_NAME("backward.dkv (repeat)"), d_dkv, first_kv, nkv, 0, 0);
    }
  }
#undef ST_NAME
}

/* Multi-head with HS 16, grouped-query with ALiBi (the second tensor-parallel rank's 4 of 8 heads), multi-query
 * with HS 136. */
static void test_attention_block(selftest *st) {
  float slopes8[8];
  pg_alibi_slopes(slopes8, 8);
  attention_block_case(st, 3, 3, 16, NULL);
  attention_block_case(st, 4, 2, 12, slopes8 + 4);
  attention_block_case(st, 2, 1, 136, slopes8); /* a head wider than a block's 128 threads */
}

/* RoPE over the query and key heads of a grouped-query qkv block (the value
 * heads and the row tails stay as they are); tables longer than T. The CPU's
 * operations, separately rounded: the same values. */
static void test_rope(selftest *st) {
  const int N = ST_N, T = ST_T, NH = 4, NKV = 2, HS = 12, heads = NH + NKV, ld = (NH + 2 * NKV) * HS + 3;
  const int max_T = T + 5, half = HS / 2;
  const pg_cuda_ctx *ctx = &st->ctx;
  const int64_t n = (int64_t)N * ld;
  float *cos_t = h_alloc(st, (size_t)max_T * half * sizeof(float));
  float *sin_t = h_alloc(st, (size_t)max_T * half * sizeof(float));
  float *x0 = h_rand(st, n, -2, 2), *dx0 = h_rand(st, n, -2, 2);
  float *x = h_copy(st, x0, n), *dx = h_copy(st, dx0, n);
  if (!cos_t || !sin_t || !x || !dx) return;
  pg_rope_table(cos_t, sin_t, max_T, HS, 10000.0, NULL);
  pg_rope_forward(x, cos_t, sin_t, N, T, heads, HS, ld);
  pg_rope_backward(dx, cos_t, sin_t, N, T, heads, HS, ld);
  float *d_cos = d_floats(st, cos_t, (int64_t)max_T * half), *d_sin = d_floats(st, sin_t, (int64_t)max_T * half);
  float *d_x = d_floats(st, x0, n), *d_dx = d_floats(st, dx0, n);
  if (st->broken) return;
  if (launched(st, "rope_forward", pg_cuda_rope_forward(ctx, d_x, d_cos, d_sin, N, T, heads, HS, ld)))
    check_f(st, "rope_forward (in place)", d_x, x, n, 0, 0);
  if (launched(st, "rope_backward", pg_cuda_rope_backward(ctx, d_dx, d_cos, d_sin, N, T, heads, HS, ld)))
    check_f(st, "rope_backward (in place)", d_dx, dx, n, 0, 0);
  /* on bf16 rows: the CPU's bits, which are rope_forward's on the widened values, rounded */
  uint16_t *x16 = h_alloc(st, (size_t)n * 2), *want16 = h_alloc(st, (size_t)n * 2);
  float *wide = h_alloc(st, (size_t)n * sizeof(float));
  if (!x16 || !want16 || !wide) return;
  pg_bf16_from_f32(x16, x0, n);
  pg_bf16_to_f32(wide, x16, n);
  pg_rope_forward(wide, cos_t, sin_t, N, T, heads, HS, ld);
  pg_bf16_from_f32(want16, wide, n);
  uint16_t *d_x16 = d_put(st, x16, (size_t)n * 2);
  pg_rope_bf16_forward(x16, cos_t, sin_t, N, T, heads, HS, ld);
  st->checks++;
  if (memcmp(x16, want16, (size_t)n * 2)) {
    st->failed++;
    say(st, "  FAIL  %-34s the CPU's bf16 rotation is not the widened rotation rounded\n", "rope_bf16_forward (CPU)");
  }
  if (d_x16 && launched(st, "rope_bf16_forward", pg_cuda_rope_bf16_forward(ctx, d_x16, d_cos, d_sin, N, T, heads, HS, ld)))
    check_bf16(st, "rope_bf16_forward (in place)", d_x16, want16, n);
}

static void test_rmsnorm(selftest *st) {
  const int N = ST_N, C = ST_C;
  const float eps = 1e-6f;
  const pg_cuda_ctx *ctx = &st->ctx;
  float *x = h_rand(st, (int64_t)N * C, -2, 2), *w = h_rand(st, C, 0.5f, 1.5f);
  float *out = h_alloc(st, (size_t)N * C * sizeof(float)), *rstd = h_alloc(st, N * sizeof(float));
  float *garbage = h_rand(st, (int64_t)N * C, 100, 200);
  if (!x || !w || !out || !rstd || !garbage) return;
  pg_rmsnorm_forward(out, rstd, x, w, N, C, eps);
  float *d_x = d_floats(st, x, (int64_t)N * C), *d_w = d_floats(st, w, C);
  float *d_out = d_floats(st, garbage, (int64_t)N * C), *d_rstd = d_floats(st, garbage, N);
  if (st->broken) return;
  if (launched(st, "rmsnorm_forward", pg_cuda_rmsnorm_forward(ctx, d_out, d_rstd, d_x, d_w, N, C, eps))) {
    check_f(st, "rmsnorm_forward.out", d_out, out, (int64_t)N * C, TOL_REDUCE);
    check_f(st, "rmsnorm_forward.rstd", d_rstd, rstd, N, TOL_REDUCE);
  }
  /* backward from the CPU's rstd; dweight accumulates onto what is there */
  float *dout = h_rand(st, (int64_t)N * C, -1, 1), *dw0 = h_rand(st, C, -1, 1);
  float *dx = h_alloc(st, (size_t)N * C * sizeof(float)), *dw = h_copy(st, dw0, C);
  if (!dout || !dx || !dw) return;
  pg_rmsnorm_backward(dx, dw, dout, x, w, rstd, N, C);
  float *d_dout = d_floats(st, dout, (int64_t)N * C), *d_dx = d_floats(st, garbage, (int64_t)N * C);
  float *d_dw = d_floats(st, dw0, C);
  if (!reload(st, d_rstd, rstd, N)) return;
  if (launched(st, "rmsnorm_backward",
               pg_cuda_rmsnorm_backward(ctx, d_dx, d_dw, d_dout, d_x, d_w, d_rstd, N, C))) {
    check_f(st, "rmsnorm_backward.dinp", d_dx, dx, (int64_t)N * C, TOL_REDUCE);
    check_f(st, "rmsnorm_backward.dweight (+=)", d_dw, dw, C, TOL_REDUCE);
  }
  /* determinism, and dinp = NULL: only the weight's gradient */
  float *first = d_get(st, d_dw, C);
  if (!first || !reload(st, d_dw, dw0, C)) return;
  if (launched(st, "rmsnorm_backward (repeat)",
               pg_cuda_rmsnorm_backward(ctx, NULL, d_dw, d_dout, d_x, d_w, d_rstd, N, C)))
    check_f(st, "rmsnorm_backward.dweight (repeat)", d_dw, first, C, 0, 0);
}

/* gate values out to -12..12 (silu's tails), H odd */
static void test_swiglu(selftest *st) {
  const int N = ST_N, H = 101;
  const int64_t n = (int64_t)N * H;
  const pg_cuda_ctx *ctx = &st->ctx;
  float *inp = h_rand(st, 2 * n, -2, 2), *dout = h_rand(st, n, -1, 1), *garbage = h_rand(st, 2 * n, 100, 200);
  float *out = h_alloc(st, (size_t)n * sizeof(float)), *dinp = h_alloc(st, (size_t)2 * n * sizeof(float));
  if (!inp || !dout || !garbage || !out || !dinp) return;
  for (int r = 0; r < N; r++)
    for (int c = 0; c < H; c++) inp[(int64_t)r * 2 * H + c] *= 6.0f;
  pg_swiglu_forward(out, inp, N, H);
  pg_swiglu_backward(dinp, inp, dout, N, H);
  float *d_inp = d_floats(st, inp, 2 * n), *d_dout = d_floats(st, dout, n);
  float *d_out = d_floats(st, garbage, n), *d_dinp = d_floats(st, garbage, 2 * n);
  if (st->broken) return;
  if (launched(st, "swiglu_forward", pg_cuda_swiglu_forward(ctx, d_out, d_inp, N, H)))
    check_f(st, "swiglu_forward", d_out, out, n, TOL_POINT);
  if (launched(st, "swiglu_backward", pg_cuda_swiglu_backward(ctx, d_dinp, d_inp, d_dout, N, H)))
    check_f(st, "swiglu_backward", d_dinp, dinp, 2 * n, TOL_POINT);
}

static void test_pointwise(selftest *st) {
  const int64_t n = 10007;
  const pg_cuda_ctx *ctx = &st->ctx;
  float *x = h_rand(st, n, -6, 6), *y = h_rand(st, n, -1, 1), *dout = h_rand(st, n, -1, 1);
  float *garbage = h_rand(st, n, 100, 200), *r = h_alloc(st, (size_t)n * sizeof(float));
  float *da0 = h_rand(st, n, -1, 1), *db0 = h_rand(st, n, -1, 1);
  float *da = h_copy(st, da0, n), *db = h_copy(st, db0, n);
  if (!x || !y || !dout || !garbage || !r || !da || !db) return;
  float *d_x = d_floats(st, x, n), *d_y = d_floats(st, y, n), *d_dout = d_floats(st, dout, n);
  float *d_r = d_floats(st, garbage, n), *d_da = d_floats(st, da0, n), *d_db = d_floats(st, db0, n);
  if (st->broken) return;
  pg_gelu_forward(r, x, n);
  if (launched(st, "gelu_forward", pg_cuda_gelu_forward(ctx, d_r, d_x, n)))
    check_f(st, "gelu_forward", d_r, r, n, TOL_POINT);
  pg_gelu_backward(r, x, dout, n);
  if (!reload(st, d_r, garbage, n)) return;
  if (launched(st, "gelu_backward", pg_cuda_gelu_backward(ctx, d_r, d_x, d_dout, n)))
    check_f(st, "gelu_backward", d_r, r, n, TOL_POINT);
  pg_residual_forward(r, x, y, n);
  if (!reload(st, d_r, garbage, n)) return;
  if (launched(st, "residual_forward", pg_cuda_residual_forward(ctx, d_r, d_x, d_y, n)))
    check_f(st, "residual_forward", d_r, r, n, 0, 0);
  pg_residual_backward(da, db, dout, n);
  if (launched(st, "residual_backward", pg_cuda_residual_backward(ctx, d_da, d_db, d_dout, n))) {
    check_f(st, "residual_backward.da", d_da, da, n, 0, 0);
    check_f(st, "residual_backward.db", d_db, db, n, 0, 0);
  }
}

static void test_xent(selftest *st) {
  /* a vocabulary slice: global columns [300, 1300), the last 10 padding; targets
   * over [0, 1600), so some rows' targets are in another slice */
  const int N = ST_N, V = 1000, valid = 990, vocab_start = 300;
  const pg_cuda_ctx *ctx = &st->ctx;
  const float dloss = 1.0f / N;
  float *logits = h_rand(st, (int64_t)N * V, -4, 4);
  int32_t *tgt = h_tokens(st, N, 1600);
  float *mx = h_alloc(st, N * sizeof(float)), *se = h_alloc(st, N * sizeof(float));
  float *tl = h_alloc(st, N * sizeof(float)), *loss = h_alloc(st, N * sizeof(float));
  float *garbage = h_rand(st, N, 100, 200);
  if (!logits || !tgt || !mx || !se || !tl || !loss || !garbage) return;
  for (int n = 0; n < N; n++)
    for (int c = valid; c < V; c++) logits[(int64_t)n * V + c] = 1e30f; /* padding must be ignored */
  pg_xent_row_max(mx, logits, N, V, valid);
  pg_xent_sumexp(se, tl, logits, mx, tgt, N, V, valid, vocab_start);
  float *dlogits = h_copy(st, logits, (int64_t)N * V);
  if (!dlogits) return;
  double total = pg_xent_finish(loss, dlogits, dlogits, mx, se, tl, tgt, N, V, valid, vocab_start, dloss);

  float *d_logits = d_floats(st, logits, (int64_t)N * V);
  int32_t *d_tgt = d_put(st, tgt, (size_t)N * sizeof(int32_t));
  float *d_mx = d_floats(st, garbage, N), *d_se = d_floats(st, garbage, N), *d_tl = d_floats(st, garbage, N);
  float *d_loss = d_floats(st, garbage, N);
  double *d_total = d_put(st, &(double){-1.0}, sizeof(double));
  if (st->broken) return;
  if (launched(st, "xent_row_max", pg_cuda_xent_row_max(ctx, d_mx, d_logits, N, V, valid)))
    check_f(st, "xent_row_max", d_mx, mx, N, 0, 0);
  if (!reload(st, d_mx, mx, N)) return;
  if (launched(st, "xent_sumexp",
               pg_cuda_xent_sumexp(ctx, d_se, d_tl, d_logits, d_mx, d_tgt, N, V, valid, vocab_start))) {
    check_f(st, "xent_sumexp.sumexp", d_se, se, N, TOL_REDUCE);
    check_f(st, "xent_sumexp.target_logit", d_tl, tl, N, 0, 0);
  }
  /* finish from the CPU's statistics, dlogits in place over the logits */
  if (!reload(st, d_se, se, N) || !reload(st, d_tl, tl, N)) return;
  if (launched(st, "xent_finish", pg_cuda_xent_finish(ctx, d_loss, d_logits, d_logits, d_mx, d_se, d_tl, d_tgt, N, V,
                                                      valid, vocab_start, dloss, d_total))) {
    check_f(st, "xent_finish.losses", d_loss, loss, N, TOL_REDUCE);
    check_f(st, "xent_finish.dlogits (in place)", d_logits, dlogits, (int64_t)N * V, 1e-5, 1e-7);
    check_d(st, "xent_finish.loss_sum", d_total, total, 1e-9);
  }
}

static void test_optim(selftest *st) {
  const int64_t n = 10007;
  const pg_cuda_ctx *ctx = &st->ctx;
  float *p0 = h_rand(st, n, -1, 1), *g = h_rand(st, n, -1, 1), *m0 = h_rand(st, n, -0.1f, 0.1f);
  float *v0 = h_rand(st, n, 0, 0.01f);
  float *p = h_copy(st, p0, n), *m = h_copy(st, m0, n), *v = h_copy(st, v0, n);
  if (!p0 || !g || !m0 || !v0 || !p || !m || !v) return;
  pg_adamw_update(p, g, m, v, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3, 0.7f);
  float *d_p = d_floats(st, p0, n), *d_g = d_floats(st, g, n), *d_m = d_floats(st, m0, n), *d_v = d_floats(st, v0, n);
  if (st->broken) return;
  if (launched(st, "adamw_update", pg_cuda_adamw_update(ctx, d_p, d_g, d_m, d_v, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f,
                                                        3, 0.7f))) {
    /* the CPU's operations in its order: the same values */
    check_f(st, "adamw_update.param", d_p, p, n, 0, 0);
    check_f(st, "adamw_update.m", d_m, m, n, 0, 0);
    check_f(st, "adamw_update.v", d_v, v, n, 0, 0);
  }
  const int64_t big = 100003;
  float *x = h_rand(st, big, -2, 2);
  double zero = 0;
  if (!x) return;
  double want = pg_sum_squares(x, big);
  float *d_x = d_floats(st, x, big);
  double *d_out = d_put(st, &zero, sizeof zero);
  double *d_scratch = d_put(st, (double[PG_CUDA_SUMSQ_BLOCKS]){0}, PG_CUDA_SUMSQ_BLOCKS * sizeof(double));
  if (st->broken) return;
  if (launched(st, "sum_squares", pg_cuda_sum_squares(ctx, d_out, d_x, big, d_scratch)))
    check_d(st, "sum_squares", d_out, want, 1e-12);
}

/* ---- mixture of experts (kernels/cuda/moe.cu) ---- */



/* Routing of N rows over E experts (top K; logits with ties, so the lower index must win on both), capacity per
 * sequence of T rows (tight enough to drop; the last sequence short), grouping, gather and combine, forward and
 * backward. Decisions and gathers exact; softmax values within expf's few ulp (TOL_POINT); sums over K terms or
 * over D products (dweight) within TOL_REDUCE. */
static void test_moe(selftest *st) {
  const int N = ST_N, E = 7, K = 2, D = ST_C, T = 16, nseq = (N + T - 1) / T, R = N * K;
  const int cap = 4; /* ceil(c T K / E) for c = 0.875: some choices dropped */
  const pg_cuda_ctx *ctx = &st->ctx;
  float *logits = h_rand(st, (int64_t)N * E, -3, 3), *x = h_rand(st, (int64_t)N * D, -1, 1);
  float *dy = h_rand(st, (int64_t)N * D, -1, 1), *ye = h_rand(st, (int64_t)R * D, -1, 1);
  float *dprob = h_rand(st, E, -0.1f, 0.1f);
  float *probs = h_alloc(st, (size_t)N * E * sizeof(float)), *lse = h_alloc(st, (size_t)N * sizeof(float));
  float *weight = h_alloc(st, (size_t)R * sizeof(float)), *dlogits = h_alloc(st, (size_t)N * E * sizeof(float));
  float *dweight = h_rand(st, R, -1, 1), *dw_back = h_alloc(st, (size_t)R * sizeof(float));
  float *xg = h_alloc(st, (size_t)R * D * sizeof(float)), *out = h_alloc(st, (size_t)N * D * sizeof(float));
  float *dyg = h_alloc(st, (size_t)R * D * sizeof(float)), *sum = h_alloc(st, (size_t)N * D * sizeof(float));
  int32_t *expert = h_alloc(st, (size_t)R * sizeof(int32_t)), *pos = h_alloc(st, (size_t)R * sizeof(int32_t));
  int32_t *token = h_alloc(st, (size_t)R * sizeof(int32_t)), *offsets = h_alloc(st, (size_t)(E + 1) * sizeof(int32_t));
  int32_t *fill = h_alloc(st, (size_t)nseq * E * sizeof(int32_t));
  double *stats = h_alloc(st, (size_t)2 * E * sizeof(double));
  if (st->broken) return;
  for (int n = 0; n < N; n += 5) logits[(int64_t)n * E + 3] = logits[(int64_t)n * E + 5]; /* ties */
  pg_moe_route_forward(probs, lse, expert, weight, logits, N, E, K);
  pg_moe_route_stats(stats, stats + E, probs, expert, N, E, K);
  pg_moe_drop(pos, fill, expert, N, T, E, K, cap);
  int32_t *pos_dropped = h_alloc(st, (size_t)R * sizeof(int32_t));
  if (!pos_dropped) return;
  memcpy(pos_dropped, pos, (size_t)R * sizeof(int32_t));
  pg_moe_group(pos, token, offsets, expert, N, E, K);
  const int Rk = offsets[E];
  pg_moe_gather(xg, x, token, Rk, D);
  pg_moe_combine(out, ye, pos, weight, N, K, D);
  pg_moe_combine(sum, ye, pos, NULL, N, K, D);
  pg_moe_combine_backward(dw_back, dyg, dy, ye, pos, weight, N, K, D);
  pg_moe_route_backward(dlogits, dweight, dprob, 0.01f, probs, lse, expert, weight, N, E, K);
  float *d_logits = d_floats(st, logits, (int64_t)N * E), *d_x = d_floats(st, x, (int64_t)N * D);
  float *d_dy = d_floats(st, dy, (int64_t)N * D), *d_ye = d_floats(st, ye, (int64_t)R * D);
  float *d_dprob = d_floats(st, dprob, E), *d_dweight = d_floats(st, dweight, R);
  float *d_probs = d_floats(st, probs, (int64_t)N * E), *d_lse = d_floats(st, lse, N);
  float *d_weight = d_floats(st, weight, R), *d_dlogits = d_floats(st, probs, (int64_t)N * E);
  float *d_xg = d_floats(st, ye, (int64_t)R * D), *d_out = d_floats(st, x, (int64_t)N * D);
  float *d_dyg = d_floats(st, ye, (int64_t)R * D), *d_dwb = d_floats(st, dweight, R);
  /* every output starts as garbage: the kernels must write all of it (dyg's dropped rows are never read) */
  int32_t *junk = h_alloc(st, (size_t)R * D * sizeof(int32_t));
  if (!junk) return;
  for (int64_t i = 0; i < (int64_t)R * D; i++) junk[i] = 0x7f7f7f7f;
  int32_t *d_expert = d_put(st, junk, (size_t)R * sizeof(int32_t)), *d_pos = d_put(st, junk, (size_t)R * sizeof(int32_t));
  int32_t *d_token = d_put(st, junk, (size_t)R * sizeof(int32_t));
  int32_t *d_off = d_put(st, junk, (size_t)(E + 1) * sizeof(int32_t));
  int32_t *d_fill = d_put(st, junk, (size_t)nseq * E * sizeof(int32_t));
  double *d_stats = d_put(st, junk, (size_t)2 * E * sizeof(double));
  if (st->broken) return;
  if (launched(st, "moe_route_forward",
               pg_cuda_moe_route_forward(ctx, d_probs, d_lse, d_expert, d_weight, d_logits, N, E, K))) {
    check_i32(st, "moe_route_forward.expert", d_expert, expert, R);
    check_f(st, "moe_route_forward.probs", d_probs, probs, (int64_t)N * E, TOL_POINT);
    check_f(st, "moe_route_forward.lse", d_lse, lse, N, TOL_POINT);
    check_f(st, "moe_route_forward.weight", d_weight, weight, R, TOL_POINT);
  }
  /* the rest from the CPU's routing, so that each kernel is checked on its own */
  if (!reload(st, d_probs, probs, (int64_t)N * E) || !reload(st, d_lse, lse, N) || !reload(st, d_weight, weight, R))
    return;
  if (launched(st, "moe_route_stats", pg_cuda_moe_route_stats(ctx, d_stats, d_stats + E, d_probs, d_expert, N, E, K)))
    check_f64(st, "moe_route_stats", d_stats, stats, 2 * E);
  if (launched(st, "moe_drop", pg_cuda_moe_drop(ctx, d_pos, d_fill, d_expert, N, T, E, K, cap)))
    check_i32(st, "moe_drop", d_pos, pos_dropped, R);
  if (launched(st, "moe_group", pg_cuda_moe_group(ctx, d_pos, d_token, d_off, d_expert, N, E, K))) {
    check_i32(st, "moe_group.pos", d_pos, pos, R);
    check_i32(st, "moe_group.offsets", d_off, offsets, E + 1);
    check_i32(st, "moe_group.token", d_token, token, Rk);
  }
  if (launched(st, "moe_gather", pg_cuda_moe_gather(ctx, d_xg, d_x, d_token, Rk, D)))
    check_f(st, "moe_gather", d_xg, xg, (int64_t)Rk * D, 0, 0);
  if (launched(st, "moe_combine", pg_cuda_moe_combine(ctx, d_out, d_ye, d_pos, d_weight, N, K, D)))
    check_f(st, "moe_combine", d_out, out, (int64_t)N * D, TOL_REDUCE);
  if (launched(st, "moe_combine (unweighted)", pg_cuda_moe_combine(ctx, d_out, d_ye, d_pos, NULL, N, K, D)))
    check_f(st, "moe_combine (unweighted)", d_out, sum, (int64_t)N * D, TOL_REDUCE);
  if (launched(st, "moe_combine_backward",
               pg_cuda_moe_combine_backward(ctx, d_dwb, d_dyg, d_dy, d_ye, d_pos, d_weight, N, K, D))) {
    check_f(st, "moe_combine_backward.dweight", d_dwb, dw_back, R, TOL_REDUCE);
    check_f(st, "moe_combine_backward.dyg", d_dyg, dyg, (int64_t)Rk * D, TOL_POINT);
  }
  if (launched(st, "moe_route_backward",
               pg_cuda_moe_route_backward(ctx, d_dlogits, d_dweight, d_dprob, 0.01f, d_probs, d_lse, d_expert,
                                          d_weight, N, E, K)))
    check_f(st, "moe_route_backward", d_dlogits, dlogits, (int64_t)N * E, TOL_REDUCE);
}

/* ---- the fused AdamW step ----
 * Pieces of a parameter buffer with gaps between them (left as they are), moments packed elsewhere in their order,
 * decay on some and off on others; lengths from 1 to several chunks, so that chunks start inside pieces, end inside
 * them and span several, a piece's first element sits anywhere in a chunk and one starts a chunk (at 3 x 4096).
 * The CPU's per-piece kernel on the same layout: the same bits. */
static void test_adamw_pieces(selftest *st) {
  _Static_assert(PG_CUDA_ADAMW_CHUNK == 4096, "the layout below puts a piece's start on chunk 3's first element");
  static const struct { int64_t gap, n; int decay; } layout[] = {
      {0, 5, 1}, {12, 1, 0}, {3, 9001, 1}, {0, 1, 0}, {100, 3280, 1}, {7, 4095, 0}, {1, 15000, 1}, {9, 333, 0}};
  enum { NP = sizeof layout / sizeof layout[0] };
  const pg_cuda_ctx *ctx = &st->ctx;
  int64_t at[NP], st_off[NP], np = 0, nm = 0;
  for (int k = 0; k < NP; k++) {
    np += layout[k].gap;
    at[k] = np, st_off[k] = nm;
    np += layout[k].n, nm += layout[k].n;
  }
  np += 11; /* a tail after the last piece */
  float *p0 = h_rand(st, np, -1, 1), *g = h_rand(st, np, -1, 1), *m0 = h_rand(st, nm, -0.1f, 0.1f);
  float *v0 = h_rand(st, nm, 0, 0.01f);
  float *p = h_copy(st, p0, np), *m = h_copy(st, m0, nm), *v = h_copy(st, v0, nm);
  if (!p0 || !g || !m0 || !v0 || !p || !m || !v) return;
  float *d_p = d_floats(st, p0, np), *d_g = d_floats(st, g, np), *d_m = d_floats(st, m0, nm);
  float *d_v = d_floats(st, v0, nm);
  if (st->broken) return;
  pg_adamw_piece host[NP], dev[NP];
  int64_t starts[NP + 1];
  starts[0] = 0;
  for (int k = 0; k < NP; k++) {
    host[k] = (pg_adamw_piece){p + at[k], g + at[k], m + st_off[k], v + st_off[k], layout[k].n, layout[k].decay};
    dev[k] = (pg_adamw_piece){d_p + at[k], d_g + at[k], d_m + st_off[k], d_v + st_off[k], layout[k].n,
                              layout[k].decay};
    starts[k + 1] = starts[k] + layout[k].n;
  }
  pg_adamw_update_pieces(host, NP, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3, 0.7f);
  pg_adamw_piece *d_table = d_put(st, dev, sizeof dev);
  int64_t *d_starts = d_put(st, starts, sizeof starts);
  if (st->broken) return;
  if (launched(st, "adamw_update_pieces", pg_cuda_adamw_update_pieces(ctx, d_table, d_starts, NP, starts[NP], 1e-3f,
                                                                      0.9f, 0.95f, 1e-8f, 0.1f, 3, 0.7f))) {
    check_f(st, "adamw_update_pieces.param (gaps kept)", d_p, p, np, 0, 0);
    check_f(st, "adamw_update_pieces.m", d_m, m, nm, 0, 0);
    check_f(st, "adamw_update_pieces.v", d_v, v, nm, 0, 0);
  }
}

/* ---- the checklist: every kernel of kernels/kernel_list.h names its test ----
 * A row's PG_SELFTEST(fn) is a reference to fn (a kernel whose test is not
 * written does not compile), PG_NO_SELFTEST("why") a decision with its
 * reason, said in the report. Each function runs once, in the list's order
 * of first mention. */
typedef void (*selftest_fn)(selftest *);
#define PG_SELFTEST(fn) fn, NULL
#define PG_NO_SELFTEST(why) NULL, why
static const struct {
  const char *kernel;
  selftest_fn test;
  const char *why_none;
} checklist[] = {
#define PG_KERNEL(name, params, args, cpu, cuda, selftest) {#name, selftest},
#include "kernel_list.h"
};

static void run_checklist(selftest *st) {
  const size_t rows = sizeof checklist / sizeof checklist[0];
  for (size_t i = 0; i < rows && !st->broken; i++) {
    if (!checklist[i].test) {
      say(st, "  none  %-34s no self-test: %s\n", checklist[i].kernel, checklist[i].why_none);
      continue;
    }
    size_t first = 0;
    while (checklist[first].test != checklist[i].test) first++;
    if (first == i) checklist[i].test(st);
  }
}

int pg_cuda_selftest(char *report, size_t n) {
  selftest *st = calloc(1, sizeof *st);
  if (!st) return pg_fail("pg_cuda_selftest: out of memory");
  st->out = report;
  st->cap = n;
  st->rng = 0x9E3779B97F4A7C15ull;
  if (report && n) report[0] = '\0';

  char why[256];
  if (!pg_cuda_available(why, sizeof why)) {
    say(st, "%s\n", why);
    free(st);
    return pg_fail("%s", why);
  }
  int dev = 0, count = 0;
  struct cudaDeviceProp prop;
  pg_cuda_versions ver;
  pg_cuda_device_count(&count);
  pg_cuda_get_versions(&ver);
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    snprintf(prop.name, sizeof prop.name, "unknown device");
    prop.major = prop.minor = 0;
  }
  say(st, "CUDA self-test on %s (device %d of %d, sm_%d%d; runtime %d, driver %d, cuBLAS %d, NCCL %d)\n", prop.name,
      dev, count, prop.major, prop.minor, ver.runtime, ver.driver, ver.cublas, ver.nccl);
  say(st, "each CUDA kernel against its CPU kernel: |gpu - cpu| <= atol + rtol |cpu|, or exact\n");

  if (pg_cuda_ctx_init(&st->ctx) != PG_OK) {
    broken(st, "context", pg_error());
  } else {
    run_checklist(st);
    (void)pg_cuda_synchronize();
    pg_cuda_ctx_destroy(&st->ctx);
  }
  for (int i = 0; i < st->ndev; i++) pg_cuda_free(st->dev[i]);
  for (int i = 0; i < st->nhost; i++) free(st->host[i]);
  say(st, "%d checks, %d failed%s\n", st->checks, st->failed, st->broken ? " (stopped at a CUDA error)" : "");
  int failed = st->failed;
  free(st);
  if (failed) return pg_fail("CUDA self-test: %d check(s) failed", failed);
  return PG_OK;
}

#endif /* PG_WITH_CUDA */
