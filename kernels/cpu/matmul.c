/* Linear layers through OpenBLAS sgemm. weight is [OC, C] (torch layout). */
#include <math.h>
#include <cblas.h>
#include <string.h>

#include "kernels.h"
#include "pg_cpu.h"

#define PG_FEW_ROWS 8 /* at most this many rows: the weight read once, row by row (pg_matmul_forward) */

/* prefer-vector-width: gcc tunes AVX-512 machines to 256-bit vectors unless told */
__attribute__((target("prefer-vector-width=512"))) void pg_matmul_forward(float *out, const float *inp, const float *weight, const float *bias, int N, int C, int OC) {
  if (N <= 0 || OC <= 0) return;
  float beta = 0.0f;
  if (bias) {
    /* Start from the bias and let sgemm add the product (beta = 1): no second pass. */
#pragma omp parallel for schedule(static) if ((int64_t)N * OC > PG_PAR_MIN)
    for (int n = 0; n < N; n++) memcpy(out + (int64_t)n * OC, bias, (size_t)OC * sizeof(float));
    beta = 1.0f;
  }
  if (C <= 0) {
    if (!bias) memset(out, 0, (size_t)N * OC * sizeof(float));
    return;
  }
  /* A few rows (decoding steps, pg_engine_decode: a row per sequence): sgemm would first copy all of the
   * weight into its packed layout (measured: a third of a decoding step's time at 1 and at 8 rows); here each
   * weight row is read once, for every input row's dot product while it is in cache. The lanes are fused
   * multiply-adds (fmaf: exactly rounded, so every build gives the same bits; -std=c11 contracts nothing
   * itself) on 512-bit vectors where the machine has them (the function's target): a batch-8 decoding step,
   * bound by this loop, ran 1.28x faster with both. */
  if (N <= PG_FEW_ROWS) {
#pragma omp parallel for schedule(static) if ((int64_t)OC * C > PG_PAR_MIN)
    for (int o = 0; o < OC; o++) {
      const float *w = weight + (int64_t)o * C;
      float lane[PG_FEW_ROWS][16] = {{0}}; /* 16 lanes per row, a fixed order whatever the rows */
      int i = 0;
      for (; i + 16 <= C; i += 16)
        for (int n = 0; n < N; n++) {
          const float *x = inp + (int64_t)n * C + i;
#pragma omp simd
          for (int j = 0; j < 16; j++) lane[n][j] = fmaf(w[i + j], x[j], lane[n][j]);
        }
      for (int n = 0; n < N; n++) {
        for (int k = i; k < C; k++) lane[n][0] += w[k] * inp[(int64_t)n * C + k];
        float dot = 0.0f;
        for (int j = 0; j < 16; j++) dot += lane[n][j];
        float *y = out + (int64_t)n * OC + o;
        *y = beta != 0.0f ? *y + dot : dot;
      }
    }
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C, beta, out, OC);
}

void pg_matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                        const float *weight, int N, int C, int OC) {
  if (N <= 0 || OC <= 0) {
    if (dinp && N > 0 && C > 0) memset(dinp, 0, (size_t)N * C * sizeof(float));
    return;
  }
  if (C > 0) {
    /* dinp[N,C] = dout[N,OC] @ weight[OC,C] */
    if (dinp) cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, weight, C, 0.0f, dinp, C);
    /* dweight[OC,C] += dout^T @ inp (beta = 1 accumulates micro-batches) */
    if (dweight)
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dweight, C);
  }
  if (dbias) pg_bias_backward(dbias, dout, N, OC);
}

/* dbias += the column sums of dout (float32 f32, or bf16 b16 widened: the same values, the same order, the same
 * bits), split by columns: each thread adds all rows in order. */
static void bias_columns(float *dbias, const float *f32, const uint16_t *b16, int N, int OC) {
  if (N <= 0 || OC <= 0) return;
#pragma omp parallel if ((int64_t)N * OC > PG_PAR_MIN)
  {
    int c0, c1;
    pg_cpu_cols(OC, omp_get_thread_num(), omp_get_num_threads(), &c0, &c1);
    for (int b0 = c0; b0 < c1; b0 += 64) {
      int w = pg_cpu_min(b0 + 64, c1) - b0;
      float acc[64] = {0};
      for (int n = 0; n < N; n++) {
        const int64_t at = (int64_t)n * OC + b0;
        if (f32)
          for (int j = 0; j < w; j++) acc[j] += f32[at + j];
        else
          for (int j = 0; j < w; j++) acc[j] += pg_bf16_value(b16[at + j]);
      }
      for (int j = 0; j < w; j++) dbias[b0 + j] += acc[j];
    }
  }
}

void pg_bias_backward(float *dbias, const float *dout, int N, int OC) { bias_columns(dbias, dout, NULL, N, OC); }

void pg_bias_backward_bf16(float *dbias, const uint16_t *dout, int N, int OC) {
  bias_columns(dbias, NULL, dout, N, OC);
}
