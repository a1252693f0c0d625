/* Token and position embeddings (forward and backward). */
#include <string.h>

#include "kernels.h"
#include "pg_cpu.h"

void pg_embedding_forward(float *out, const int32_t *tokens, const float *weight, int N, int C, int row_start,
                          int rows) {
#pragma omp parallel for schedule(static) if ((int64_t)N * C > PG_PAR_MIN)
  for (int n = 0; n < N; n++) {
    float *o = out + (int64_t)n * C;
    int64_t r = (int64_t)tokens[n] - row_start; /* 64-bit: no overflow for any id/start */
    if (r >= 0 && r < rows) memcpy(o, weight + r * C, (size_t)C * sizeof(float));
    else memset(o, 0, (size_t)C * sizeof(float)); /* another shard's token: it adds its row there */
  }
}

void pg_embedding_backward(float *dweight, const float *dout, const int32_t *tokens, int N, int C, int row_start,
                           int rows) {
  /* Repeated tokens hit the same row, so rows cannot be split across threads
   * without atomics; columns can. Each thread adds all rows in order. */
#pragma omp parallel if ((int64_t)N * C > PG_PAR_MIN)
  {
    int c0, c1;
    pg_cpu_cols(C, omp_get_thread_num(), omp_get_num_threads(), &c0, &c1);
    for (int n = 0; n < N && c0 < c1; n++) {
      int64_t r = (int64_t)tokens[n] - row_start;
      if (r < 0 || r >= rows) continue;
      float *dw = dweight + r * C;
      const float *d = dout + (int64_t)n * C;
      for (int c = c0; c < c1; c++) dw[c] += d[c];
    }
  }
}

void pg_position_forward(float *out, const float *wpe, int N, int T, int C) {
#pragma omp parallel for schedule(static) if ((int64_t)N * C > PG_PAR_MIN)
  for (int n = 0; n < N; n++) {
    float *o = out + (int64_t)n * C;
    const float *w = wpe + (int64_t)(n % T) * C;
    for (int c = 0; c < C; c++) o[c] += w[c];
  }
}

void pg_position_backward(float *dwpe, const float *dout, int N, int T, int C) {
  /* Each position t is its own reduction over the batch: split over t, add
   * the batch rows in order. */
  int B = T > 0 ? N / T : 0;
#pragma omp parallel for schedule(static) if ((int64_t)N * C > PG_PAR_MIN)
  for (int t = 0; t < T; t++) {
    float *dw = dwpe + (int64_t)t * C;
    for (int b = 0; b < B; b++) {
      const float *d = dout + ((int64_t)b * T + t) * C;
      for (int c = 0; c < C; c++) dw[c] += d[c];
    }
  }
}
