/* Elementwise ops: GELU (tanh approximation), SwiGLU and the residual add. */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "kernels.h"
#include "pg_cpu.h"

#define PG_GELU_K 0.7978845608028654f /* sqrt(2/pi) */
#define PG_GELU_A 0.044715f

/* 0.5 (1 + tanh u) = 1 / (1 + e^(-2u)): the logistic form has no
 * cancellation when tanh u is near -1, and runs on the vectorised exp
 * (glibc's tanhf costs ~50 ns here and does not vectorise). The formulas
 * are one inline function each, shared by the float32 and bf16 loops, so
 * the two precisions run the same arithmetic on the same float32 values. */
static inline float gelu_value(float x) {
  float u = PG_GELU_K * (x + PG_GELU_A * x * x * x);
  return x / (1.0f + pg_cpu_expf(-2.0f * u)); /* e = inf for very negative u: x / inf = 0 */
}

/* With s = 0.5 (1 + tanh u) = 1 / (1 + e), e = e^(-2u):
 * d/dx [x s] = s + 2 x s (1 - s) u',  u' = k (1 + 3 a x^2).
 * 1 - s = e s when e < 1 (s near 1: no cancellation), else 1 - s. */
static inline float gelu_slope(float x) {
  float u = PG_GELU_K * (x + PG_GELU_A * x * x * x);
  float du = PG_GELU_K * (1.0f + 3.0f * PG_GELU_A * x * x);
  float e = pg_cpu_expf(-2.0f * u);
  float s = 1.0f / (1.0f + e);
  float one_s = e < 1.0f ? e * s : 1.0f - s;
  return s + 2.0f * x * s * one_s * du;
}

void pg_gelu_forward(float *out, const float *inp, int64_t n) {
#pragma omp parallel for simd schedule(static) if (parallel : n > PG_PAR_MIN)
  for (int64_t i = 0; i < n; i++) out[i] = gelu_value(inp[i]);
}

void pg_gelu_backward(float *dinp, const float *inp, const float *dout, int64_t n) {
#pragma omp parallel for simd schedule(static) if (parallel : n > PG_PAR_MIN)
  for (int64_t i = 0; i < n; i++) dinp[i] = dout[i] * gelu_slope(inp[i]);
}

void pg_gelu_bf16_forward(uint16_t *out, const uint16_t *inp, int64_t n) {
#pragma omp parallel for simd schedule(static) if (parallel : n > PG_PAR_MIN)
  for (int64_t i = 0; i < n; i++) out[i] = pg_bf16_round(gelu_value(pg_bf16_value(inp[i])));
}

void pg_gelu_bf16_backward(uint16_t *dinp, const uint16_t *inp, const uint16_t *dout, int64_t n) {
#pragma omp parallel for simd schedule(static) if (parallel : n > PG_PAR_MIN)
  for (int64_t i = 0; i < n; i++)
    dinp[i] = pg_bf16_round(pg_bf16_value(dout[i]) * gelu_slope(pg_bf16_value(inp[i])));
}

void pg_residual_forward(float *out, const float *a, const float *b, int64_t n) {
#pragma omp parallel for simd schedule(static) if (parallel : n > PG_PAR_MIN)
  for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

void pg_residual_bf16_forward(float *out, const float *a, const uint16_t *b, int64_t n) {
#pragma omp parallel for simd schedule(static) if (parallel : n > PG_PAR_MIN)
  for (int64_t i = 0; i < n; i++) out[i] = a[i] + pg_bf16_value(b[i]);
}

void pg_residual_backward(float *da, float *db, const float *dout, int64_t n) {
  if (da) {
#pragma omp parallel for simd schedule(static) if (parallel : n > PG_PAR_MIN)
    for (int64_t i = 0; i < n; i++) da[i] += dout[i];
  }
  if (db) {
#pragma omp parallel for simd schedule(static) if (parallel : n > PG_PAR_MIN)
    for (int64_t i = 0; i < n; i++) db[i] += dout[i];
  }
}

/* SwiGLU: silu(g) u with silu(g) = g s, s = 1 / (1 + e^-g) (torch's form).
 * d silu(g) / dg = s (1 + g (1 - s)); d/du = silu(g). */
static inline float swiglu_value(float g, float u) { return (g / (1.0f + pg_cpu_expf(-g))) * u; }

static inline void swiglu_slopes(float g, float u, float dy, float *dg, float *du) {
  float s = 1.0f / (1.0f + pg_cpu_expf(-g));
  *du = dy * (g * s);
  *dg = dy * u * (s * (1.0f + g * (1.0f - s)));
}

void pg_swiglu_forward(float *out, const float *inp, int N, int H) {
#pragma omp parallel for schedule(static) if ((int64_t)N * H > PG_PAR_MIN)
  for (int n = 0; n < N; n++) {
    const float *g = inp + (int64_t)n * 2 * H, *u = g + H;
    float *o = out + (int64_t)n * H;
#pragma omp simd
    for (int i = 0; i < H; i++) o[i] = swiglu_value(g[i], u[i]);
  }
}

void pg_swiglu_backward(float *dinp, const float *inp, const float *dout, int N, int H) {
#pragma omp parallel for schedule(static) if ((int64_t)N * H > PG_PAR_MIN)
  for (int n = 0; n < N; n++) {
    const float *g = inp + (int64_t)n * 2 * H, *u = g + H, *dy = dout + (int64_t)n * H;
    float *dg = dinp + (int64_t)n * 2 * H, *du = dg + H;
#pragma omp simd
    for (int i = 0; i < H; i++) swiglu_slopes(g[i], u[i], dy[i], &dg[i], &du[i]);
  }
}

void pg_swiglu_bf16_forward(uint16_t *out, const uint16_t *inp, int N, int H) {
#pragma omp parallel for schedule(static) if ((int64_t)N * H > PG_PAR_MIN)
  for (int n = 0; n < N; n++) {
    const uint16_t *g = inp + (int64_t)n * 2 * H, *u = g + H;
    uint16_t *o = out + (int64_t)n * H;
#pragma omp simd
    for (int i = 0; i < H; i++) o[i] = pg_bf16_round(swiglu_value(pg_bf16_value(g[i]), pg_bf16_value(u[i])));
  }
}

void pg_swiglu_bf16_backward(uint16_t *dinp, const uint16_t *inp, const uint16_t *dout, int N, int H) {
#pragma omp parallel for schedule(static) if ((int64_t)N * H > PG_PAR_MIN)
  for (int n = 0; n < N; n++) {
    const uint16_t *g = inp + (int64_t)n * 2 * H, *u = g + H, *dy = dout + (int64_t)n * H;
    uint16_t *dg = dinp + (int64_t)n * 2 * H, *du = dg + H;
#pragma omp simd
    for (int i = 0; i < H; i++) {
      float a, b;
      swiglu_slopes(pg_bf16_value(g[i]), pg_bf16_value(u[i]), pg_bf16_value(dy[i]), &a, &b);
      dg[i] = pg_bf16_round(a);
      du[i] = pg_bf16_round(b);
    }
  }
}

#define PG_ZERO_PAR_MIN ((size_t)4 << 20)

void pg_zero_bytes(void *p, size_t bytes) {
  if (bytes < PG_ZERO_PAR_MIN) {
    if (bytes) memset(p, 0, bytes);
    return;
  }
#pragma omp parallel
  {
    /* Pieces on 64-byte boundaries, so that no cache line is written by two threads. */
    size_t nt = (size_t)omp_get_num_threads(), id = (size_t)omp_get_thread_num();
    size_t lo = bytes / 64 * id / nt * 64, hi = id + 1 == nt ? bytes : bytes / 64 * (id + 1) / nt * 64;
    memset((char *)p + lo, 0, hi - lo);
  }
}
