/* Fused softmax + cross-entropy over a (slice of the) vocabulary, in three
 * steps so that vocab-parallel callers can reduce the row statistics across
 * ranks between them. Only the first `valid` columns of a slice are real. */
#include <math.h>

#include "kernels.h"
#include "pg_cpu.h"

#define PG_XENT_BLOCK 256

void pg_xent_row_max(float *row_max, const float *logits, int N, int V, int valid) {
#pragma omp parallel for schedule(static) if ((int64_t)N * valid > PG_PAR_MIN)
  for (int n = 0; n < N; n++) {
    /* a slice without valid columns never wins the max */
    row_max[n] = valid > 0 ? pg_cpu_maxf(logits + (int64_t)n * V, valid) : -INFINITY;
  }
}

/* Is the (global) target id a real column of this slice? Column index or -1. */
static inline int64_t target_col(int32_t target, int valid, int vocab_start) {
  int64_t c = (int64_t)target - vocab_start;
  return c >= 0 && c < valid ? c : -1;
}

void pg_xent_sumexp(float *sumexp, float *target_logit, const float *logits, const float *row_max,
                    const int32_t *targets, int N, int V, int valid, int vocab_start) {
#pragma omp parallel for schedule(static) if ((int64_t)N * valid > PG_PAR_MIN)
  for (int n = 0; n < N; n++) {
    const float *x = logits + (int64_t)n * V;
    float mx = row_max[n];
    /* exps vectorised into a block buffer, then added into 8 double lanes
     * (double: tens of thousands of terms; fixed lanes: fixed rounding) */
    float buf[PG_XENT_BLOCK];
    double lane[PG_LANES] = {0};
    for (int c0 = 0; c0 < valid; c0 += PG_XENT_BLOCK) {
      int w = pg_cpu_min(PG_XENT_BLOCK, valid - c0), j = 0;
#pragma omp simd
      for (int c = 0; c < w; c++) buf[c] = pg_cpu_expf(x[c0 + c] - mx);
      for (; j + PG_LANES <= w; j += PG_LANES)
        for (int l = 0; l < PG_LANES; l++) lane[l] += buf[j + l];
      for (; j < w; j++) lane[0] += buf[j];
    }
    double s = 0;
    for (int l = 0; l < PG_LANES; l++) s += lane[l];
    sumexp[n] = (float)s;
    int64_t tc = target_col(targets[n], valid, vocab_start);
    target_logit[n] = tc >= 0 ? x[tc] : 0.0f;
  }
}

static inline double row_loss(const float *row_max, const float *sumexp, const float *target_logit, int n) {
  return log((double)sumexp[n]) + row_max[n] - target_logit[n];
}

double pg_xent_finish(float *losses, float *dlogits, const float *logits, const float *row_max, const float *sumexp,
                      const float *target_logit, const int32_t *targets, int N, int V, int valid, int vocab_start,
                      float dloss) {
  /* dlogits may alias logits: each element is read before it is written. */
#pragma omp parallel for schedule(static) if ((int64_t)N * V > PG_PAR_MIN)
  for (int n = 0; n < N; n++) {
    if (losses) losses[n] = (float)row_loss(row_max, sumexp, target_logit, n);
    if (!dlogits) continue;
    const float *x = logits + (int64_t)n * V;
    float *d = dlogits + (int64_t)n * V;
    float mx = row_max[n], scale = dloss / sumexp[n];
#pragma omp simd
    for (int c = 0; c < valid; c++) d[c] = pg_cpu_expf(x[c] - mx) * scale;
    for (int c = valid; c < V; c++) d[c] = 0.0f; /* padding: never predicted */
    int64_t tc = target_col(targets[n], valid, vocab_start);
    if (tc >= 0) d[tc] -= dloss;
  }
  /* The total in row order on one thread: deterministic, and N logs are cheap. */
  double total = 0;
  for (int n = 0; n < N; n++) total += row_loss(row_max, sumexp, target_logit, n);
  return total;
}
