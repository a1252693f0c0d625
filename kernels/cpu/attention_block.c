/* Block attention for context parallelism's ring (kernels.h): the attention
 * of a range of query rows over one block of key rows at a time, folded into
 * an online softmax (running max, running sum, unnormalised output) and
 * finished once every block is in; the backward recomputes the probabilities
 * of a block from the finished log-sum-exp (FlashAttention-2's scheme).
 *
 * Query rows go in tiles of PG_BLK_Q, keys in tiles of PG_BLK_K: the score
 * tile of one (batch row, head) lives on the thread's stack, so no [Tq, Tk]
 * buffer is needed. The products are sgemms over strided rows, as in
 * attention.c, and the score is attention.c's, operation for operation:
 * sgemm's scale (q . k), then + m (float)(kpos - qpos) with ALiBi, each term
 * rounded separately, then pg_cpu_expf. A tile wholly above the diagonal is
 * skipped; inside a tile the hidden scores get probability 0.
 *
 * Parallel over (batch row, head) pairs in the forward, over (batch row,
 * key/value head) in the backward (the group's query heads in order, so the
 * key and value gradients are summed in a fixed order): one thread computes
 * one pair entirely, the bits do not depend on the thread count. */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "kernels.h"
#include "pg_cpu.h"

#define PG_BLK_Q 64
#define PG_BLK_K 64

static int bad_block_shape(int B, int Tq, int Tk, int NH, int NKV, int HS) {
  return B <= 0 || Tq <= 0 || Tk <= 0 || NH <= 0 || NKV <= 0 || HS <= 0 || NH % NKV;
}

/* Keys [0, n) of the tile starting at key j0 are visible to the query at qpos when k_pos0 + j0 + j <= qpos:
 * n = clamp(qpos - (k_pos0 + j0) + 1, 0, width). */
static int visible_keys(int64_t qpos, int64_t kpos, int width) {
  int64_t n = qpos - kpos + 1;
  return n <= 0 ? 0 : (n >= width ? width : (int)n);
}

/* S[r, c] (rows PG_BLK_K apart) = scale q_r . k_c (+ m (kpos - qpos)) for the nq x nk tile, the visible entries
 * only meaningful. */
static void score_tile(float *S, const float *q, int64_t ldq, const float *k, int64_t ldk, int nq, int nk, int HS,
                       float scale, const float *slope, int64_t qpos, int64_t kpos) {
  for (int r = 0; r < nq; r++) memset(S + (int64_t)r * PG_BLK_K, 0, (size_t)nk * sizeof(float));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nk, HS, scale, q, (int)ldq, k, (int)ldk, 1.0f, S,
              PG_BLK_K);
  if (slope) {
    const float m = *slope;
    for (int r = 0; r < nq; r++) {
      float *s = S + (int64_t)r * PG_BLK_K;
      const int64_t d0 = kpos - (qpos + r);
#pragma omp simd
      for (int c = 0; c < nk; c++) s[c] += m * (float)(d0 + c);
    }
  }
}

/* One (b, h) pair of the forward: q at its first query row's head, k and v at the first key row's kv head, acc
 * at its first row's head (rows NH HS apart), mx and sm its Tq values. */
static void block_forward_head(float *acc, float *mx, float *sm, const float *q, int64_t ldq, const float *k,
                               const float *v, int64_t ldk, const float *slope, int Tq, int Tk, int HS, int64_t ldacc,
                               float scale, int64_t q_pos0, int64_t k_pos0) {
  float S[PG_BLK_Q * PG_BLK_K];
  for (int i0 = 0; i0 < Tq; i0 += PG_BLK_Q) {
    const int nq = pg_cpu_min(PG_BLK_Q, Tq - i0);
    const int64_t qpos = q_pos0 + i0, qlast = qpos + nq - 1;
    for (int j0 = 0; j0 < Tk; j0 += PG_BLK_K) {
      const int nk = pg_cpu_min(PG_BLK_K, Tk - j0);
      const int64_t kpos = k_pos0 + j0;
      if (kpos > qlast) break; /* this tile and every later one are above the diagonal */
      score_tile(S, q + (int64_t)i0 * ldq, ldq, k + (int64_t)j0 * ldk, ldk, nq, nk, HS, scale, slope, qpos, kpos);
      for (int r = 0; r < nq; r++) {
        float *s = S + (int64_t)r * PG_BLK_K;
        const int n = visible_keys(qpos + r, kpos, nk);
        if (n == 0) { /* nothing visible: a zero row, the state unchanged */
          memset(s, 0, (size_t)nk * sizeof(float));
          continue;
        }
        const int i = i0 + r;
        const float m_old = mx[i], m_new = fmaxf(m_old, pg_cpu_maxf(s, n));
        if (m_new != m_old) { /* rescale what is summed so far (from -inf: all of it is 0) */
          const float c = pg_cpu_expf(m_old - m_new);
          float *a = acc + (int64_t)i * ldacc;
#pragma omp simd
          for (int d = 0; d < HS; d++) a[d] *= c;
          sm[i] *= c;
          mx[i] = m_new;
        }
#pragma omp simd
        for (int c = 0; c < n; c++) s[c] = pg_cpu_expf(s[c] - m_new);
        memset(s + n, 0, (size_t)(nk - n) * sizeof(float));
        sm[i] += pg_cpu_sumf(s, n);
      }
      /* acc[i0 : i0 + nq] += P V[j0 : j0 + nk] */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, HS, nk, 1.0f, S, PG_BLK_K, v + (int64_t)j0 * ldk,
                  (int)ldk, 1.0f, acc + (int64_t)i0 * ldacc, (int)ldacc);
    }
  }
}

void pg_attention_block_forward(float *acc, float *mx, float *sm, const float *q, int64_t q_stride, const float *k,
                                const float *v, int64_t kv_stride, const float *slopes, int B, int Tq, int Tk, int NH,
                                int NKV, int HS, int64_t q_pos0, int64_t k_pos0) {
  if (bad_block_shape(B, Tq, Tk, NH, NKV, HS)) return;
  const int group = NH / NKV;
  const int64_t ldacc = (int64_t)NH * HS;
  const float scale = 1.0f / sqrtf((float)HS);
#pragma omp parallel for schedule(static) if ((int64_t)B * NH * Tq * Tk * HS > PG_PAR_MIN)
  for (int bh = 0; bh < B * NH; bh++) {
    const int b = bh / NH, h = bh % NH, g = h / group;
    const int64_t st = (int64_t)bh * Tq; /* mx, sm: [B, NH, Tq] */
    block_forward_head(acc + (int64_t)b * Tq * ldacc + (int64_t)h * HS, mx + st, sm + st,
                       q + (int64_t)b * Tq * q_stride + (int64_t)h * HS, q_stride,
                       k + (int64_t)b * Tk * kv_stride + (int64_t)g * HS, v + (int64_t)b * Tk * kv_stride + (int64_t)g * HS,
                       kv_stride, slopes ? slopes + h : NULL, Tq, Tk, HS, ldacc, scale, q_pos0, k_pos0);
  }
}

void pg_attention_block_finish(float *out, int64_t out_stride, float *lse, const float *acc, const float *mx,
                               const float *sm, int B, int Tq, int NH, int HS) {
  if (B <= 0 || Tq <= 0 || NH <= 0 || HS <= 0) return;
  const int64_t ldacc = (int64_t)NH * HS;
#pragma omp parallel for schedule(static) if ((int64_t)B * NH * Tq * HS > PG_PAR_MIN)
  for (int bh = 0; bh < B * NH; bh++) {
    const int b = bh / NH, h = bh % NH;
    for (int i = 0; i < Tq; i++) {
      const int64_t st = (int64_t)bh * Tq + i, row = (int64_t)b * Tq + i;
      const float *a = acc + row * ldacc + (int64_t)h * HS;
      float *o = out + row * out_stride + (int64_t)h * HS;
      const float s = sm[st];
      if (s == 0.0f) { /* no key seen */
        memset(o, 0, (size_t)HS * sizeof(float));
        lse[st] = -INFINITY;
        continue;
      }
      const float inv = 1.0f / s;
#pragma omp simd
      for (int d = 0; d < HS; d++) o[d] = a[d] * inv;
      lse[st] = mx[st] + logf(s);
    }
  }
}

void pg_attention_block_delta(float *delta, const float *dout, int64_t dout_stride, const float *out,
                              int64_t out_stride, int B, int Tq, int NH, int HS) {
  if (B <= 0 || Tq <= 0 || NH <= 0 || HS <= 0) return;
#pragma omp parallel for schedule(static) if ((int64_t)B * NH * Tq * HS > PG_PAR_MIN)
  for (int bh = 0; bh < B * NH; bh++) {
    const int b = bh / NH, h = bh % NH;
    for (int i = 0; i < Tq; i++) {
      const int64_t row = (int64_t)b * Tq + i;
      delta[(int64_t)bh * Tq + i] =
          pg_cpu_dotf(dout + row * dout_stride + (int64_t)h * HS, out + row * out_stride + (int64_t)h * HS, HS);
    }
  }
}

/* One (b, h) pair of the backward over the block; pointers at the pair's first row as in the forward, lse and
 * delta its Tq values. dk and dv are the kv head's, shared with the other heads of the group (added in order by
 * the caller's loop). */
static void block_backward_head(float *dq, int64_t lddq, float *dk, float *dv, int64_t lddkv, const float *q,
                                int64_t ldq, const float *k, const float *v, int64_t ldk, const float *dout,
                                int64_t lddo, const float *lse, const float *delta, const float *slope, int Tq, int Tk,
                                int HS, float scale, int64_t q_pos0, int64_t k_pos0) {
  float P[PG_BLK_Q * PG_BLK_K], dS[PG_BLK_Q * PG_BLK_K];
  for (int i0 = 0; i0 < Tq; i0 += PG_BLK_Q) {
    const int nq = pg_cpu_min(PG_BLK_Q, Tq - i0);
    const int64_t qpos = q_pos0 + i0, qlast = qpos + nq - 1;
    for (int j0 = 0; j0 < Tk; j0 += PG_BLK_K) {
      const int nk = pg_cpu_min(PG_BLK_K, Tk - j0);
      const int64_t kpos = k_pos0 + j0;
      if (kpos > qlast) break;
      score_tile(P, q + (int64_t)i0 * ldq, ldq, k + (int64_t)j0 * ldk, ldk, nq, nk, HS, scale, slope, qpos, kpos);
      /* dP = dO V^T */
      for (int r = 0; r < nq; r++) memset(dS + (int64_t)r * PG_BLK_K, 0, (size_t)nk * sizeof(float));
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nk, HS, 1.0f, dout + (int64_t)i0 * lddo, (int)lddo,
                  v + (int64_t)j0 * ldk, (int)ldk, 1.0f, dS, PG_BLK_K);
      /* P = exp(S - lse) where visible, else 0; dS = scale P (dP - delta) (attention.c's scale folded in) */
      for (int r = 0; r < nq; r++) {
        float *p = P + (int64_t)r * PG_BLK_K, *d = dS + (int64_t)r * PG_BLK_K;
        const int n = visible_keys(qpos + r, kpos, nk);
        const float l = lse[i0 + r], dl = delta[i0 + r];
#pragma omp simd
        for (int c = 0; c < n; c++) {
          p[c] = pg_cpu_expf(p[c] - l);
          d[c] = scale * p[c] * (d[c] - dl);
        }
        for (int c = n; c < nk; c++) p[c] = d[c] = 0.0f;
      }
      /* dQ[i0 :] += dS K, dV[j0 :] += P^T dO, dK[j0 :] += dS^T Q */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, HS, nk, 1.0f, dS, PG_BLK_K, k + (int64_t)j0 * ldk,
                  (int)ldk, 1.0f, dq + (int64_t)i0 * lddq, (int)lddq);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nk, HS, nq, 1.0f, P, PG_BLK_K, dout + (int64_t)i0 * lddo,
                  (int)lddo, 1.0f, dv + (int64_t)j0 * lddkv, (int)lddkv);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nk, HS, nq, 1.0f, dS, PG_BLK_K, q + (int64_t)i0 * ldq,
                  (int)ldq, 1.0f, dk + (int64_t)j0 * lddkv, (int)lddkv);
    }
  }
}

void pg_attention_block_backward(float *dq, int64_t dq_stride, float *dk, float *dv, int64_t dkv_stride,
                                 const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                                 const float *dout, int64_t dout_stride, const float *lse, const float *delta,
                                 const float *slopes, int B, int Tq, int Tk, int NH, int NKV, int HS, int64_t q_pos0,
                                 int64_t k_pos0) {
  if (bad_block_shape(B, Tq, Tk, NH, NKV, HS)) return;
  const int group = NH / NKV;
  const float scale = 1.0f / sqrtf((float)HS);
#pragma omp parallel for schedule(static) if ((int64_t)B * NH * Tq * Tk * HS > PG_PAR_MIN)
  for (int bg = 0; bg < B * NKV; bg++) {
    const int b = bg / NKV, g = bg % NKV;
    const int64_t krow = (int64_t)b * Tk, qrow = (int64_t)b * Tq;
    for (int e = 0; e < group; e++) {
      const int h = g * group + e;
      const int64_t st = ((int64_t)b * NH + h) * Tq;
      block_backward_head(dq + qrow * dq_stride + (int64_t)h * HS, dq_stride, dk + krow * dkv_stride + (int64_t)g * HS,
                          dv + krow * dkv_stride + (int64_t)g * HS, dkv_stride,
                          q + qrow * q_stride + (int64_t)h * HS, q_stride, k + krow * kv_stride + (int64_t)g * HS,
                          v + krow * kv_stride + (int64_t)g * HS, kv_stride,
                          dout + qrow * dout_stride + (int64_t)h * HS, dout_stride, lse + st, delta + st,
                          slopes ? slopes + h : NULL, Tq, Tk, HS, scale, q_pos0, k_pos0);
    }
  }
}
