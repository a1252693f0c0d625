/* The router of a mixture-of-experts block (Mixtral's): softmax over the
 * experts, the top K per row, their probabilities renormalised. Rows are
 * independent and the expert count is small, so each row is one plain loop
 * (no lanes: E is often below a vector's width). */
#include <math.h>
#include <string.h>

#include "kernels.h"
#include "moe_pick.h"
#include "pg_cpu.h"

void pg_moe_route_forward(float *probs, float *lse, int32_t *expert, float *weight, const float *logits, int N, int E,
                          int K) {
#pragma omp parallel for schedule(static) if ((int64_t)N * E > PG_PAR_MIN)
  for (int n = 0; n < N; n++) {
    const float *l = logits + (int64_t)n * E;
    float *p = probs + (int64_t)n * E;
    float mx = l[0];
    for (int e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
    double sum = 0;
    for (int e = 0; e < E; e++) {
      p[e] = expf(l[e] - mx);
      sum += p[e];
    }
    float inv = (float)(1.0 / sum);
    for (int e = 0; e < E; e++) p[e] *= inv;
    lse[n] = mx + (float)log(sum);
    /* top K by repeated selection on the logits (moe_pick.h: the rule both backends share) */
    int32_t *ex = expert + (int64_t)n * K;
    float *w = weight + (int64_t)n * K;
    float chosen = 0;
    for (int k = 0; k < K; k++) {
      const int best = pg_moe_pick(l, E, ex, k);
      ex[k] = best;
      w[k] = p[best];
      chosen += p[best];
    }
    for (int k = 0; k < K; k++) w[k] /= chosen;
  }
}

void pg_moe_route_backward(float *dlogits, const float *dweight, const float *dprob, float zscale, const float *probs,
                           const float *lse, const int32_t *expert, const float *weight, int N, int E, int K) {
#pragma omp parallel for schedule(static) if ((int64_t)N * E > PG_PAR_MIN)
  for (int n = 0; n < N; n++) {
    const float *p = probs + (int64_t)n * E;
    const int32_t *ex = expert + (int64_t)n * K;
    const float *w = weight + (int64_t)n * K, *dw = dweight + (int64_t)n * K;
    float *dl = dlogits + (int64_t)n * E; /* d/dprob first, then d/dlogit in place */
    for (int e = 0; e < E; e++) dl[e] = dprob ? dprob[e] : 0.0f;
    /* w_k = p_k / s with s the chosen probabilities' sum: dw_k/dp_i = (delta_ki - w_k) / s */
    float s = 0, dot = 0;
    for (int k = 0; k < K; k++) {
      s += p[ex[k]];
      dot += dw[k] * w[k];
    }
    for (int k = 0; k < K; k++) dl[ex[k]] += (dw[k] - dot) / s;
    /* softmax: dl_e = p_e (dp_e - sum_f p_f dp_f); the z-loss adds 2 zscale lse p_e */
    float pdp = 0;
    for (int e = 0; e < E; e++) pdp += p[e] * dl[e];
    for (int e = 0; e < E; e++) dl[e] = p[e] * (dl[e] - pdp) + 2.0f * zscale * lse[n] * p[e];
  }
}

void pg_moe_route_stats(double *counts, double *psum, const float *probs, const int32_t *expert, int N, int E, int K) {
  for (int e = 0; e < E; e++) counts[e] = psum[e] = 0;
  for (int n = 0; n < N; n++) { /* in row order: the same sums on every rank */
    for (int k = 0; k < K; k++) counts[expert[(int64_t)n * K + k]] += 1;
    for (int e = 0; e < E; e++) psum[e] += probs[(int64_t)n * E + e];
  }
}

void pg_moe_drop(int32_t *pos, int32_t *fill, const int32_t *expert, int N, int T, int E, int K, int cap) {
  for (int t0 = 0; t0 < N; t0 += T) {
    int32_t *f = fill + (int64_t)(t0 / T) * E;
    for (int e = 0; e < E; e++) f[e] = 0;
    for (int j = 0; j < K; j++)
      for (int t = t0; t < t0 + T && t < N; t++) {
        int64_t i = (int64_t)t * K + j;
        pos[i] = f[expert[i]]++ < cap ? 0 : -1;
      }
  }
}

void pg_moe_group(int32_t *pos, int32_t *token, int32_t *offsets, const int32_t *expert, int N, int E, int K) {
  int64_t R = (int64_t)N * K;
  for (int e = 0; e <= E; e++) offsets[e] = 0;
  for (int64_t i = 0; i < R; i++)
    if (pos[i] >= 0) offsets[expert[i] + 1]++;
  for (int e = 0; e < E; e++) offsets[e + 1] += offsets[e];
  for (int64_t i = 0; i < R; i++) { /* offsets[e] walks from e's first row to e + 1's */
    if (pos[i] < 0) continue;
    pos[i] = offsets[expert[i]]++;
    token[pos[i]] = (int32_t)(i / K);
  }
  for (int e = E; e > 0; e--) offsets[e] = offsets[e - 1];
  offsets[0] = 0;
}

void pg_moe_gather(float *xg, const float *x, const int32_t *token, int R, int D) {
#pragma omp parallel for schedule(static) if ((int64_t)R * D > PG_PAR_MIN)
  for (int r = 0; r < R; r++) memcpy(xg + (int64_t)r * D, x + (int64_t)token[r] * D, (size_t)D * sizeof(float));
}

void pg_moe_combine(float *out, const float *ye, const int32_t *pos, const float *weight, int N, int K, int D) {
#pragma omp parallel for schedule(static) if ((int64_t)N * K * D > PG_PAR_MIN)
  for (int t = 0; t < N; t++) {
    float *o = out + (int64_t)t * D;
    for (int d = 0; d < D; d++) o[d] = 0;
    for (int j = 0; j < K; j++) {
      int64_t i = (int64_t)t * K + j;
      if (pos[i] < 0) continue;
      const float *src = ye + (int64_t)pos[i] * D;
      float w = weight ? weight[i] : 1.0f;
      for (int d = 0; d < D; d++) o[d] += w * src[d];
    }
  }
}

void pg_moe_combine_backward(float *dweight, float *dyg, const float *dy, const float *ye, const int32_t *pos,
                             const float *weight, int N, int K, int D) {
  int64_t R = (int64_t)N * K;
#pragma omp parallel for schedule(static) if (R * D > PG_PAR_MIN)
  for (int64_t i = 0; i < R; i++) {
    float acc = 0;
    if (pos[i] >= 0) {
      const float *a = dy + (i / K) * D, *b = ye + (int64_t)pos[i] * D;
      float *g = dyg + (int64_t)pos[i] * D, w = weight[i];
      for (int d = 0; d < D; d++) {
        acc += a[d] * b[d];
        g[d] = w * a[d];
      }
    }
    dweight[i] = acc;
  }
}
