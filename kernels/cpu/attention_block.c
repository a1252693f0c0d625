/* Block attention for context parallelism's ring (kernels.h): the attention
 * of a range of query rows over one block of key rows at a time, folded into
 * an online softmax (running max, running sum, unnormalised output) and
 * finished once every block is in; the backward recomputes the probabilities
 * of a block from the finished log-sum-exp (FlashAttention-2's scheme). The
 * training attention (pg_attention_forward / pg_attention_backward, at the
 * end) is the same tiles over a whole sequence as one block of itself.
 *
 * Query rows go in tiles of PG_BLK_Q, keys in tiles of PG_BLK_K: the score
 * tile of one (batch row, head) lives on the thread's stack, so no [Tq, Tk]
 * buffer is needed. The products are sgemms over strided rows, and the score
 * is the decode path's (attention.c), operation for operation:
 * sgemm's scale (q . k), then + m (float)(kpos - qpos) with ALiBi, each term
 * rounded separately, then pg_cpu_expf. A tile wholly above the diagonal is
 * skipped; inside a tile the hidden scores get probability 0.
 *
 * Forward: parallel over (batch row, head, query tile), each computed by one
 * thread. Backward: over (batch row, key/value head), the group's query heads
 * and the query tiles in order, so the key and value gradients are summed in
 * a fixed order; when there are fewer such pairs than threads, in two passes
 * instead (dq over (batch row, head, query tile), dk and dv over (batch row,
 * key/value head, key tile)), which recompute the probabilities once more but
 * make every sum in the same order as the one pass: the same bits for any
 * thread count either way. */
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

/* One query tile [i0, i0 + nq) of one (b, h) pair: q at its first query row's head, k and v at the first key
 * row's kv head, acc at its first row's head (rows NH HS apart), mx and sm at the tile's first row (nq values). */
static void block_forward_tile(float *acc, float *mx, float *sm, const float *q, int64_t ldq, const float *k,
                               const float *v, int64_t ldk, const float *slope, int i0, int nq, int Tk, int HS,
                               int64_t ldacc, float scale, int64_t q_pos0, int64_t k_pos0) {
  float S[PG_BLK_Q * PG_BLK_K];
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
      const float m_old = mx[r], m_new = fmaxf(m_old, pg_cpu_maxf(s, n));
      if (m_new != m_old) { /* rescale what is summed so far (from -inf: all of it is 0) */
        const float c = pg_cpu_expf(m_old - m_new);
        float *a = acc + (int64_t)(i0 + r) * ldacc;
#pragma omp simd
        for (int d = 0; d < HS; d++) a[d] *= c;
        sm[r] *= c;
        mx[r] = m_new;
      }
#pragma omp simd
      for (int c = 0; c < n; c++) s[c] = pg_cpu_expf(s[c] - m_new);
      memset(s + n, 0, (size_t)(nk - n) * sizeof(float));
      sm[r] += pg_cpu_sumf(s, n);
    }
    /* acc[i0 : i0 + nq] += P V[j0 : j0 + nk] */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, HS, nk, 1.0f, S, PG_BLK_K, v + (int64_t)j0 * ldk,
                (int)ldk, 1.0f, acc + (int64_t)i0 * ldacc, (int)ldacc);
  }
}

void pg_attention_block_forward(float *acc, float *mx, float *sm, const float *q, int64_t q_stride, const float *k,
                                const float *v, int64_t kv_stride, const float *slopes, int B, int Tq, int Tk, int NH,
                                int NKV, int HS, int64_t q_pos0, int64_t k_pos0) {
  if (bad_block_shape(B, Tq, Tk, NH, NKV, HS)) return;
  const int group = NH / NKV;
  const int64_t ldacc = (int64_t)NH * HS;
  const float scale = 1.0f / sqrtf((float)HS);
  const int64_t tiles = (Tq + PG_BLK_Q - 1) / PG_BLK_Q, items = (int64_t)B * NH * tiles;
#pragma omp parallel for schedule(static) if ((int64_t)B * NH * Tq * Tk * HS > PG_PAR_MIN)
  for (int64_t w = 0; w < items; w++) {
    const int64_t bh = w / tiles;
    const int b = (int)(bh / NH), h = (int)(bh % NH), g = h / group, i0 = (int)(w % tiles) * PG_BLK_Q;
    const int64_t st = bh * Tq + i0; /* mx, sm: [B, NH, Tq] */
    block_forward_tile(acc + (int64_t)b * Tq * ldacc + (int64_t)h * HS, mx + st, sm + st,
                       q + (int64_t)b * Tq * q_stride + (int64_t)h * HS, q_stride,
                       k + (int64_t)b * Tk * kv_stride + (int64_t)g * HS, v + (int64_t)b * Tk * kv_stride + (int64_t)g * HS,
                       kv_stride, slopes ? slopes + h : NULL, i0, pg_cpu_min(PG_BLK_Q, Tq - i0), Tk, HS, ldacc, scale,
                       q_pos0, k_pos0);
  }
}

/* One row of the finish: o = a / s (o may be a, in place), *lse = m + logf(s); s == 0 (no key seen): o 0, *lse
 * -INFINITY. */
static void finish_row(float *o, const float *a, float m, float s, float *lse, int HS) {
  if (s == 0.0f) {
    memset(o, 0, (size_t)HS * sizeof(float));
    *lse = -INFINITY;
    return;
  }
  const float inv = 1.0f / s;
#pragma omp simd
  for (int d = 0; d < HS; d++) o[d] = a[d] * inv;
  *lse = m + logf(s);
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
      finish_row(out + row * out_stride + (int64_t)h * HS, acc + row * ldacc + (int64_t)h * HS, mx[st], sm[st],
                 lse + st, HS);
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

/* The pointers of one (b, h) pair of the backward at its first rows (query rows for q, dq, dout, lse, delta;
 * key rows for k, v, dk, dv), and what every tile needs. */
typedef struct block_pair {
  float *dq, *dk, *dv;
  const float *q, *k, *v, *dout, *lse, *delta, *slope;
  int64_t lddq, lddkv, ldq, ldk, lddo, q_pos0, k_pos0;
  int Tq, Tk, HS;
  float scale;
} block_pair;

static block_pair pair_at(float *dq, int64_t dq_stride, float *dk, float *dv, int64_t dkv_stride, const float *q,
                          int64_t q_stride, const float *k, const float *v, int64_t kv_stride, const float *dout,
                          int64_t dout_stride, const float *lse, const float *delta, const float *slopes, int b,
                          int h, int g, int Tq, int Tk, int NH, int HS, float scale, int64_t q_pos0, int64_t k_pos0) {
  const int64_t krow = (int64_t)b * Tk, qrow = (int64_t)b * Tq, st = ((int64_t)b * NH + h) * Tq;
  block_pair p = {dq + qrow * dq_stride + (int64_t)h * HS, dk + krow * dkv_stride + (int64_t)g * HS,
                  dv + krow * dkv_stride + (int64_t)g * HS, q + qrow * q_stride + (int64_t)h * HS,
                  k + krow * kv_stride + (int64_t)g * HS, v + krow * kv_stride + (int64_t)g * HS,
                  dout + qrow * dout_stride + (int64_t)h * HS, lse + st, delta + st, slopes ? slopes + h : NULL,
                  dq_stride, dkv_stride, q_stride, kv_stride, dout_stride, q_pos0, k_pos0, Tq, Tk, HS, scale};
  return p;
}

/* The probabilities P and dS = scale P (dP - delta) (attention.c's scale folded in) of query tile [i0, i0 + nq)
 * against key tile [j0, j0 + nk), 0 where hidden; 0 when the whole tile is above the diagonal. */
static int tile_grads(float *P, float *dS, const block_pair *p, int i0, int nq, int j0, int nk) {
  const int64_t qpos = p->q_pos0 + i0, kpos = p->k_pos0 + j0;
  if (kpos > qpos + nq - 1) return 0;
  score_tile(P, p->q + (int64_t)i0 * p->ldq, p->ldq, p->k + (int64_t)j0 * p->ldk, p->ldk, nq, nk, p->HS, p->scale,
             p->slope, qpos, kpos);
  /* dP = dO V^T */
  for (int r = 0; r < nq; r++) memset(dS + (int64_t)r * PG_BLK_K, 0, (size_t)nk * sizeof(float));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nk, p->HS, 1.0f, p->dout + (int64_t)i0 * p->lddo,
              (int)p->lddo, p->v + (int64_t)j0 * p->ldk, (int)p->ldk, 1.0f, dS, PG_BLK_K);
  const float scale = p->scale;
  for (int r = 0; r < nq; r++) {
    float *pr = P + (int64_t)r * PG_BLK_K, *d = dS + (int64_t)r * PG_BLK_K;
    const int n = visible_keys(qpos + r, kpos, nk);
    const float l = p->lse[i0 + r], dl = p->delta[i0 + r];
#pragma omp simd
    for (int c = 0; c < n; c++) {
      pr[c] = pg_cpu_expf(pr[c] - l);
      d[c] = scale * pr[c] * (d[c] - dl);
    }
    for (int c = n; c < nk; c++) pr[c] = d[c] = 0.0f;
  }
  return 1;
}

/* dQ[i0 :] += dS K[j0 :] */
static void tile_dq(const block_pair *p, const float *dS, int i0, int nq, int j0, int nk) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, p->HS, nk, 1.0f, dS, PG_BLK_K,
              p->k + (int64_t)j0 * p->ldk, (int)p->ldk, 1.0f, p->dq + (int64_t)i0 * p->lddq, (int)p->lddq);
}

/* dV[j0 :] += P^T dO[i0 :], dK[j0 :] += dS^T Q[i0 :] */
static void tile_dkv(const block_pair *p, const float *P, const float *dS, int i0, int nq, int j0, int nk) {
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nk, p->HS, nq, 1.0f, P, PG_BLK_K,
              p->dout + (int64_t)i0 * p->lddo, (int)p->lddo, 1.0f, p->dv + (int64_t)j0 * p->lddkv, (int)p->lddkv);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nk, p->HS, nq, 1.0f, dS, PG_BLK_K,
              p->q + (int64_t)i0 * p->ldq, (int)p->ldq, 1.0f, p->dk + (int64_t)j0 * p->lddkv, (int)p->lddkv);
}

void pg_attention_block_backward(float *dq, int64_t dq_stride, float *dk, float *dv, int64_t dkv_stride,
                                 const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                                 const float *dout, int64_t dout_stride, const float *lse, const float *delta,
                                 const float *slopes, int B, int Tq, int Tk, int NH, int NKV, int HS, int64_t q_pos0,
                                 int64_t k_pos0) {
  if (bad_block_shape(B, Tq, Tk, NH, NKV, HS)) return;
  const int group = NH / NKV;
  const float scale = 1.0f / sqrtf((float)HS);
  const int par = (int64_t)B * NH * Tq * Tk * HS > PG_PAR_MIN;
  const int qtiles = (Tq + PG_BLK_Q - 1) / PG_BLK_Q, ktiles = (Tk + PG_BLK_K - 1) / PG_BLK_K;
#define PAIR(b, h, g)                                                                                                 \
  pair_at(dq, dq_stride, dk, dv, dkv_stride, q, q_stride, k, v, kv_stride, dout, dout_stride, lse, delta, slopes, b, \
          h, g, Tq, Tk, NH, HS, scale, q_pos0, k_pos0)
  if (!par || (int64_t)B * NKV >= omp_get_max_threads()) {
    /* one pass: per (b, kv head), its query heads, query tiles and key tiles in order */
#pragma omp parallel for schedule(static) if (par)
    for (int bg = 0; bg < B * NKV; bg++) {
      float P[PG_BLK_Q * PG_BLK_K], dS[PG_BLK_Q * PG_BLK_K];
      const int b = bg / NKV, g = bg % NKV;
      for (int e = 0; e < group; e++) {
        const block_pair p = PAIR(b, g * group + e, g);
        for (int i0 = 0; i0 < Tq; i0 += PG_BLK_Q) {
          const int nq = pg_cpu_min(PG_BLK_Q, Tq - i0);
          for (int j0 = 0; j0 < Tk; j0 += PG_BLK_K) {
            const int nk = pg_cpu_min(PG_BLK_K, Tk - j0);
            if (!tile_grads(P, dS, &p, i0, nq, j0, nk)) break;
            tile_dq(&p, dS, i0, nq, j0, nk);
            tile_dkv(&p, P, dS, i0, nq, j0, nk);
          }
        }
      }
    }
    return;
  }
  /* two passes, every sum in the one pass's order: dq[i0] over the key tiles in order; dk, dv [j0] over the
   * group's heads, then the query tiles, in order */
  const int64_t nq_items = (int64_t)B * NH * qtiles, nk_items = (int64_t)B * NKV * ktiles;
#pragma omp parallel for schedule(static)
  for (int64_t w = 0; w < nq_items; w++) {
    float P[PG_BLK_Q * PG_BLK_K], dS[PG_BLK_Q * PG_BLK_K];
    const int64_t bh = w / qtiles;
    const int b = (int)(bh / NH), h = (int)(bh % NH), i0 = (int)(w % qtiles) * PG_BLK_Q;
    const int nq = pg_cpu_min(PG_BLK_Q, Tq - i0);
    const block_pair p = PAIR(b, h, h / group);
    for (int j0 = 0; j0 < Tk; j0 += PG_BLK_K) {
      const int nk = pg_cpu_min(PG_BLK_K, Tk - j0);
      if (!tile_grads(P, dS, &p, i0, nq, j0, nk)) break;
      tile_dq(&p, dS, i0, nq, j0, nk);
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t w = 0; w < nk_items; w++) {
    float P[PG_BLK_Q * PG_BLK_K], dS[PG_BLK_Q * PG_BLK_K];
    const int64_t bg = w / ktiles;
    const int b = (int)(bg / NKV), g = (int)(bg % NKV), j0 = (int)(w % ktiles) * PG_BLK_K;
    const int nk = pg_cpu_min(PG_BLK_K, Tk - j0);
    for (int e = 0; e < group; e++) {
      const block_pair p = PAIR(b, g * group + e, g);
      for (int i0 = 0; i0 < Tq; i0 += PG_BLK_Q) {
        const int nq = pg_cpu_min(PG_BLK_Q, Tq - i0);
        if (tile_grads(P, dS, &p, i0, nq, j0, nk)) tile_dkv(&p, P, dS, i0, nq, j0, nk);
      }
    }
  }
#undef PAIR
}

/* ---- the whole-sequence training attention (kernels.h's pg_attention_forward / pg_attention_backward) ----
 * The sequence is one block of itself (q_pos0 = k_pos0 = 0, Tq = Tk = T): the forward folds every key tile
 * into a query tile's online softmax with the ring's tile kernel, the state of the tile (its rows' max and sum)
 * on the stack and the unnormalised output accumulated in out itself; the backward is the ring's, over the
 * whole sequence, with FlashAttention-2's delta in the scratch. Nothing of size T^2 is kept or allocated. */

void pg_attention_forward(float *out, float *lse, const float *qkv, const float *slopes, int B, int T, int NH, int NKV,
                          int HS) {
  if (bad_block_shape(B, T, T, NH, NKV, HS)) return;
  const int group = NH / NKV;
  const int64_t ld = (int64_t)(NH + 2 * NKV) * HS, ldo = (int64_t)NH * HS;
  const float scale = 1.0f / sqrtf((float)HS);
  const int64_t tiles = (T + PG_BLK_Q - 1) / PG_BLK_Q, items = (int64_t)B * NH * tiles;
  /* one thread per (batch row, head, query tile): its rows' sums in a fixed order whatever the thread count */
#pragma omp parallel for schedule(static)
  for (int64_t w = 0; w < items; w++) {
    float mx[PG_BLK_Q], sm[PG_BLK_Q];
    const int64_t bh = w / tiles;
    const int b = (int)(bh / NH), h = (int)(bh % NH), g = h / group, i0 = (int)(w % tiles) * PG_BLK_Q;
    const int nq = pg_cpu_min(PG_BLK_Q, T - i0);
    const float *row0 = qkv + (int64_t)b * T * ld;
    float *o = out + (int64_t)b * T * ldo + (int64_t)h * HS;
    for (int r = 0; r < nq; r++) {
      memset(o + (int64_t)(i0 + r) * ldo, 0, (size_t)HS * sizeof(float));
      mx[r] = -INFINITY;
      sm[r] = 0.0f;
    }
    block_forward_tile(o, mx, sm, row0 + (int64_t)h * HS, ld, row0 + (int64_t)(NH + g) * HS,
                       row0 + (int64_t)(NH + NKV + g) * HS, ld, slopes ? slopes + h : NULL, i0, nq, T, HS, ldo, scale,
                       0, 0);
    for (int r = 0; r < nq; r++) {
      float *orow = o + (int64_t)(i0 + r) * ldo;
      finish_row(orow, orow, mx[r], sm[r], lse + bh * T + i0 + r, HS);
    }
  }
}

int64_t pg_attention_scratch_floats(int64_t rows, int NH) { return rows * (NH > 0 ? NH : 1); }

void pg_attention_backward(float *dqkv, float *scratch, const float *dout, const float *qkv, const float *out,
                           const float *lse, const float *slopes, int B, int T, int NH, int NKV, int HS) {
  if (bad_block_shape(B, T, T, NH, NKV, HS)) return;
  const int64_t ld = (int64_t)(NH + 2 * NKV) * HS, ldo = (int64_t)NH * HS, kcol = ldo, vcol = (int64_t)(NH + NKV) * HS;
  memset(dqkv, 0, (size_t)((int64_t)B * T * ld) * sizeof(float)); /* the block backward accumulates */
  pg_attention_block_delta(scratch, dout, ldo, out, ldo, B, T, NH, HS);
  pg_attention_block_backward(dqkv, ld, dqkv + kcol, dqkv + vcol, ld, qkv, ld, qkv + kcol, qkv + vcol, ld, dout, ldo,
                              lse, scratch, slopes, B, T, T, NH, NKV, HS, 0, 0);
}
