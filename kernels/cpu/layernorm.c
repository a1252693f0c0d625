/* Normalisation over the last dimension: layer norm (eps PG_LAYERNORM_EPS) and
 * RMS norm (LLaMA, eps given). */
#include <math.h>

#include "kernels.h"
#include "pg_cpu.h"

/* Row sums in 8 double lanes, fixed order (vectorisable, same bits everywhere). */
static inline double sum_f64(const float *x, int n) {
  double lane[PG_LANES] = {0};
  int i = 0;
  for (; i + PG_LANES <= n; i += PG_LANES)
    for (int l = 0; l < PG_LANES; l++) lane[l] += x[i + l];
  for (; i < n; i++) lane[0] += x[i];
  double s = 0;
  for (int l = 0; l < PG_LANES; l++) s += lane[l];
  return s;
}

/* Sum of (x - m)^2, likewise. */
static inline double centred_sq_f64(const float *x, float m, int n) {
  double lane[PG_LANES] = {0};
  int i = 0;
  for (; i + PG_LANES <= n; i += PG_LANES)
    for (int l = 0; l < PG_LANES; l++) {
      double d = (double)x[i + l] - m;
      lane[l] += d * d;
    }
  for (; i < n; i++) {
    double d = (double)x[i] - m;
    lane[0] += d * d;
  }
  double s = 0;
  for (int l = 0; l < PG_LANES; l++) s += lane[l];
  return s;
}

void pg_layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *weight,
                          const float *bias, int N, int C) {
#pragma omp parallel for schedule(static) if ((int64_t)N * C > PG_PAR_MIN)
  for (int n = 0; n < N; n++) {
    const float *x = inp + (int64_t)n * C;
    /* Two passes, accumulated in double: the variance of the centred values
     * does not cancel catastrophically when |mean| >> std. */
    float m = (float)(sum_f64(x, C) / C);
    float r = (float)(1.0 / sqrt(centred_sq_f64(x, m, C) / C + (double)PG_LAYERNORM_EPS));
    float *o = out + (int64_t)n * C;
    for (int c = 0; c < C; c++) o[c] = (x[c] - m) * r * weight[c] + bias[c];
    mean[n] = m;
    rstd[n] = r;
  }
}

void pg_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                           const float *weight, const float *mean, const float *rstd, int N, int C) {
#pragma omp parallel if ((int64_t)N * C > PG_PAR_MIN)
  {
    /* dinp, per row: with xh = (x - mean) rstd and g = dout * weight,
     * dx = rstd (g - mean(g) - xh mean(g xh)). */
    if (dinp) {
#pragma omp for schedule(static) nowait
      for (int n = 0; n < N; n++) {
        const float *x = inp + (int64_t)n * C, *dy = dout + (int64_t)n * C;
        float m = mean[n], r = rstd[n];
        /* sums of g and g xh in 8 double lanes each */
        double lg[PG_LANES] = {0}, lgx[PG_LANES] = {0};
        int c = 0;
        for (; c + PG_LANES <= C; c += PG_LANES)
          for (int l = 0; l < PG_LANES; l++) {
            float g = dy[c + l] * weight[c + l];
            lg[l] += g;
            lgx[l] += (double)g * ((x[c + l] - m) * r);
          }
        for (; c < C; c++) {
          float g = dy[c] * weight[c];
          lg[0] += g;
          lgx[0] += (double)g * ((x[c] - m) * r);
        }
        double sg = 0, sgx = 0;
        for (int l = 0; l < PG_LANES; l++) {
          sg += lg[l];
          sgx += lgx[l];
        }
        float mg = (float)(sg / C), mgx = (float)(sgx / C);
        float *dx = dinp + (int64_t)n * C;
        for (int c = 0; c < C; c++) dx[c] = r * (dy[c] * weight[c] - mg - (x[c] - m) * r * mgx);
      }
    }
    /* dweight, dbias: sums over rows, split by columns (deterministic, no
     * scratch). Partial sums per 64-column block, then added once. */
    if (dweight || dbias) {
      int c0, c1;
      pg_cpu_cols(C, omp_get_thread_num(), omp_get_num_threads(), &c0, &c1);
      for (int b0 = c0; b0 < c1; b0 += 64) {
        int b1 = pg_cpu_min(b0 + 64, c1), w = b1 - b0;
        float aw[64] = {0}, ab[64] = {0};
        for (int n = 0; n < N; n++) {
          const float *x = inp + (int64_t)n * C + b0, *dy = dout + (int64_t)n * C + b0;
          float m = mean[n], r = rstd[n];
          for (int j = 0; j < w; j++) {
            aw[j] += dy[j] * ((x[j] - m) * r);
            ab[j] += dy[j];
          }
        }
        for (int j = 0; j < w; j++) {
          if (dweight) dweight[b0 + j] += aw[j];
          if (dbias) dbias[b0 + j] += ab[j];
        }
      }
    }
  }
}

/* ---- RMS normalisation (LLaMA) ---- */

static inline double sq_f64(const float *x, int n) {
  double lane[PG_LANES] = {0};
  int i = 0;
  for (; i + PG_LANES <= n; i += PG_LANES)
    for (int l = 0; l < PG_LANES; l++) lane[l] += (double)x[i + l] * x[i + l];
  for (; i < n; i++) lane[0] += (double)x[i] * x[i];
  double s = 0;
  for (int l = 0; l < PG_LANES; l++) s += lane[l];
  return s;
}

void pg_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight, int N, int C, float eps) {
#pragma omp parallel for schedule(static) if ((int64_t)N * C > PG_PAR_MIN)
  for (int n = 0; n < N; n++) {
    const float *x = inp + (int64_t)n * C;
    float r = (float)(1.0 / sqrt(sq_f64(x, C) / C + (double)eps));
    float *o = out + (int64_t)n * C;
    /* (x * rstd) * weight: transformers' order */
    for (int c = 0; c < C; c++) o[c] = (x[c] * r) * weight[c];
    rstd[n] = r;
  }
}

void pg_rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                         const float *rstd, int N, int C) {
#pragma omp parallel if ((int64_t)N * C > PG_PAR_MIN)
  {
    /* With xh = x rstd and g = dout * weight: dx = rstd (g - xh mean(g xh)). */
    if (dinp) {
#pragma omp for schedule(static) nowait
      for (int n = 0; n < N; n++) {
        const float *x = inp + (int64_t)n * C, *dy = dout + (int64_t)n * C;
        float r = rstd[n];
        double lgx[PG_LANES] = {0};
        int c = 0;
        for (; c + PG_LANES <= C; c += PG_LANES)
          for (int l = 0; l < PG_LANES; l++) lgx[l] += (double)(dy[c + l] * weight[c + l]) * (x[c + l] * r);
        for (; c < C; c++) lgx[0] += (double)(dy[c] * weight[c]) * (x[c] * r);
        double sgx = 0;
        for (int l = 0; l < PG_LANES; l++) sgx += lgx[l];
        float mgx = (float)(sgx / C);
        float *dx = dinp + (int64_t)n * C;
        for (int c2 = 0; c2 < C; c2++) dx[c2] = r * (dy[c2] * weight[c2] - (x[c2] * r) * mgx);
      }
    }
    /* dweight: column sums over rows, split by columns (deterministic). */
    if (dweight) {
      int c0, c1;
      pg_cpu_cols(C, omp_get_thread_num(), omp_get_num_threads(), &c0, &c1);
      for (int b0 = c0; b0 < c1; b0 += 64) {
        int b1 = pg_cpu_min(b0 + 64, c1), w = b1 - b0;
        float aw[64] = {0};
        for (int n = 0; n < N; n++) {
          const float *x = inp + (int64_t)n * C + b0, *dy = dout + (int64_t)n * C + b0;
          float r = rstd[n];
          for (int j = 0; j < w; j++) aw[j] += dy[j] * (x[j] * r);
        }
        for (int j = 0; j < w; j++) dweight[b0 + j] += aw[j];
      }
    }
  }
}
