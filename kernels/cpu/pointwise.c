/* Elementwise ops: GELU (tanh approximation) and the residual add. */
#include <math.h>

#include "kernels.h"
#include "pg_cpu.h"

#define PG_GELU_K 0.7978845608028654f /* sqrt(2/pi) */
#define PG_GELU_A 0.044715f

void pg_gelu_forward(float *out, const float *inp, int64_t n) {
#pragma omp parallel for schedule(static) if (n > PG_PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    float x = inp[i];
    out[i] = 0.5f * x * (1.0f + tanhf(PG_GELU_K * (x + PG_GELU_A * x * x * x)));
  }
}

void pg_gelu_backward(float *dinp, const float *inp, const float *dout, int64_t n) {
  /* d/dx [x/2 (1 + tanh u)] = (1 + tanh u)/2 + x/2 (1 - tanh^2 u) u',
   * u = k (x + a x^3), u' = k (1 + 3 a x^2). */
#pragma omp parallel for schedule(static) if (n > PG_PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    float x = inp[i];
    float th = tanhf(PG_GELU_K * (x + PG_GELU_A * x * x * x));
    float du = PG_GELU_K * (1.0f + 3.0f * PG_GELU_A * x * x);
    dinp[i] = dout[i] * (0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du);
  }
}

void pg_residual_forward(float *out, const float *a, const float *b, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > PG_PAR_MIN)
  for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

void pg_residual_backward(float *da, float *db, const float *dout, int64_t n) {
  if (da) {
#pragma omp parallel for simd schedule(static) if (n > PG_PAR_MIN)
    for (int64_t i = 0; i < n; i++) da[i] += dout[i];
  }
  if (db) {
#pragma omp parallel for simd schedule(static) if (n > PG_PAR_MIN)
    for (int64_t i = 0; i < n; i++) db[i] += dout[i];
  }
}
