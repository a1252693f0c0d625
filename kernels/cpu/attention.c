/* Causal self-attention (multi-head or grouped-query) over the fused
 * q|k|v layout [B, T, (NH + 2 NKV) HS] (kernels.h).
 *
 * Every (batch, head) pair is independent: one OpenMP thread takes a pair and
 * runs its products through sgemm, reading Q, K, V in place with leading
 * dimension (NH + 2 NKV) HS (OpenBLAS's OpenMP build runs single-threaded inside a
 * parallel region, which is what we want here). Rows are processed in blocks
 * of PG_ATT_BLOCK so that the products skip most of the masked upper
 * triangle: query block [r0, r1) only needs keys [0, r1). Each pair is
 * computed entirely by one thread (backward: each key/value head with its
 * query heads), so results do not depend on the thread count.
 *
 * ALiBi (slopes given): score[t, j] = scale q_t . k_j + m_h (j - t), each
 * term rounded separately (no FMA: the CUDA kernel's bits). transformers
 * adds m_h j (build_alibi_tensor); softmax is invariant to a per-row
 * constant, so m_h (j - t) is the same math and the more accurate one: the
 * keys that carry the probability sit near the diagonal, where m_h (j - t)
 * is small and exact to its float32 rounding, while m_h j grows with t (at
 * m = 0.5, t = 2048 the scores near the diagonal are ~1024 and keep only
 * ~6e-5 of absolute precision, which the probabilities inherit). */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "kernels.h"
#include "pg_cpu.h"

#define PG_ATT_BLOCK 64

/* C[M, N] (leading dimension ldc) = alpha op(A) op(B), for the small
 * products here. OpenBLAS clears C itself when beta = 0, in a pass that took
 * 10-25% of a 64 x 64 x 64 product (scripts/bench_kernels.lua's attention
 * shapes; 19% of the attention's profile): clearing the rows with memset and
 * accumulating (beta = 1) gives the same values faster (0 + x = x; only the
 * sign of an exact zero can differ). */
static void gemm_into_zero(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, float alpha, const float *A,
                           int lda, const float *B, int ldb, float *C, int ldc) {
  for (int i = 0; i < M; i++) memset(C + (int64_t)i * ldc, 0, (size_t)N * sizeof(float));
  cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, 1.0f, C, ldc);
}

/* One (b, h) pair. q, k, v point at the head's columns of row 0 (all ld
 * apart); P is its [T, T] probability matrix; o its output columns (ld ldo);
 * slope: NULL or the head's ALiBi slope. */
/* One query row of causal attention probabilities in place: p[0 .. at] are its scores against keys 0 .. at
 * (ALiBi's m * (j - at) added when slope is given), softmaxed; p[at + 1 .. width) set to exact zeros (backward
 * and the P V products read them). The training forward and the cached decode share it, so their rows are
 * the same arithmetic. */
static void causal_softmax_row(float *p, int at, int width, const float *slope) {
  if (slope) {
    const float m = *slope;
#pragma omp simd
    for (int j = 0; j <= at; j++) p[j] += m * (float)(j - at);
  }
  float mx = pg_cpu_maxf(p, at + 1);
#pragma omp simd
  for (int j = 0; j <= at; j++) p[j] = pg_cpu_expf(p[j] - mx);
  float inv = 1.0f / pg_cpu_sumf(p, at + 1);
#pragma omp simd
  for (int j = 0; j <= at; j++) p[j] *= inv;
  memset(p + at + 1, 0, (size_t)(width - at - 1) * sizeof(float));
}

static void att_forward_head(float *o, float *P, const float *q, const float *k, const float *v, const float *slope,
                             int T, int ld, int ldo, int hs, float scale) {
  for (int r0 = 0; r0 < T; r0 += PG_ATT_BLOCK) {
    int r1 = pg_cpu_min(r0 + PG_ATT_BLOCK, T);
    /* scores S[r0:r1, 0:r1] = scale * Q K^T */
    gemm_into_zero(CblasNoTrans, CblasTrans, r1 - r0, r1, hs, scale, q + (int64_t)r0 * ld, ld, k, ld,
                   P + (int64_t)r0 * T, T);
    for (int t = r0; t < r1; t++) causal_softmax_row(P + (int64_t)t * T, t, T, slope);
    /* out[r0:r1] = P[r0:r1, 0:r1] V[0:r1] */
    gemm_into_zero(CblasNoTrans, CblasNoTrans, r1 - r0, hs, r1, 1.0f, P + (int64_t)r0 * T, T, v, ld,
                   o + (int64_t)r0 * ldo, ldo);
  }
}

void pg_attention_forward(float *out, float *att, const float *qkv, const float *slopes, int B, int T, int NH, int NKV,
                          int HS) {
  if (B <= 0 || T <= 0 || NH <= 0 || NKV <= 0 || HS <= 0 || NH % NKV) return;
  const int ld = (NH + 2 * NKV) * HS, ldo = NH * HS, group = NH / NKV;
  const float scale = 1.0f / sqrtf((float)HS);
#pragma omp parallel for schedule(static)
  for (int bh = 0; bh < B * NH; bh++) {
    int b = bh / NH, h = bh % NH, kvh = h / group;
    const float *row0 = qkv + (int64_t)b * T * ld;
    att_forward_head(out + (int64_t)b * T * ldo + h * HS, att + (int64_t)bh * T * T, row0 + h * HS,
                     row0 + (NH + kvh) * HS, row0 + (NH + NKV + kvh) * HS, slopes ? slopes + h : NULL, T, ld, ldo, HS,
                     scale);
  }
}

/* Each power in double from the float32 base, rounded once: the correctly
 * rounded float32 of base^k (but for a double rounding, not met up to 128
 * heads). torch.pow (1.13, CPU, AVX2), which transformers calls, gives the
 * same bits for every head count up to 128 except 3 values 1 ulp lower,
 * where it took its vectorised pow (Sleef, a 1-ulp bound, on whole vectors of
 * 8; the tail goes through the correctly rounded scalar powf): 2^-0.5 to the
 * 13th (slopes[12] for 16 to 31 heads), 2^-0.25 to the 15th (slopes[14],
 * 32 to 63 heads), 2^-(1/16) to the 91st (slopes[109] for 112 to 127 heads,
 * BLOOM-176B's 112 among them; slopes[90] for 128). A relative 6e-8 on one
 * slope, far below the products' rounding; and on a GPU build_alibi_tensor
 * runs on the mask's device, where torch.pow is CUDA's powf (a bound of a
 * few ulps), so torch's slopes depend on the device and the correctly
 * rounded ones do not. scripts/make_bloom_reference.py --slopes prints
 * transformers' values. */
void pg_alibi_slopes(float *slopes, int n) {
  if (n < 1) return;
  int p = 1, lp = 0; /* p = 2^lp = 2^floor(log2 n) */
  while (p <= n / 2) {
    p *= 2;
    lp++;
  }
  const float base = (float)pow(2.0, -pow(2.0, -(double)(lp - 3)));
  for (int k = 1; k <= p; k++) slopes[k - 1] = (float)pow((double)base, (double)k);
  if (p == n) return;
  const float extra = (float)pow(2.0, -pow(2.0, -(double)(lp + 1 - 3)));
  for (int i = 0; i < n - p; i++) slopes[p + i] = (float)pow((double)extra, (double)(2 * i + 1)); /* n - p < p */
}

int64_t pg_attention_scratch_floats(int T, int threads) {
  /* one [T, T] matrix (dP, then dS in place) per thread */
  return (int64_t)T * T * (threads > 0 ? threads : 1);
}

/* C[M, N] (+)= alpha op(A) op(B): the first head of a group writes its key
 * and value gradients, the others add theirs. */
static void gemm_maybe_add(int add, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, float alpha,
                           const float *A, int lda, const float *B, int ldb, float *C, int ldc) {
  if (add) cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, 1.0f, C, ldc);
  else gemm_into_zero(ta, tb, M, N, K, alpha, A, lda, B, ldb, C, ldc);
}

/* One (b, h) pair; dS is this thread's [T, T] scratch. Pointers as in
 * att_forward_head, plus dq, dk, dv (ld) and dout (ld ldo). add: dk and dv
 * already hold another query head's share (grouped-query attention). */
static void att_backward_head(float *dq, float *dk, float *dv, int add, float *dS, const float *dout, const float *q,
                              const float *k, const float *v, const float *P, int T, int ld, int ldo, int hs,
                              float scale) {
  for (int r0 = 0; r0 < T; r0 += PG_ATT_BLOCK) {
    int r1 = pg_cpu_min(r0 + PG_ATT_BLOCK, T);
    /* dP[r0:r1, 0:r1] = dO V^T */
    gemm_into_zero(CblasNoTrans, CblasTrans, r1 - r0, r1, hs, 1.0f, dout + (int64_t)r0 * ldo, ldo, v, ld,
                   dS + (int64_t)r0 * T, T);
    /* softmax backward, with the score scale folded in:
     * dS = scale * P (dP - sum_j P dP), zero above the diagonal up to r1
     * (the dK product reads those columns; columns >= r1 are never read). */
    for (int t = r0; t < r1; t++) {
      const float *p = P + (int64_t)t * T;
      float *d = dS + (int64_t)t * T;
      float dot = pg_cpu_dotf(p, d, t + 1);
#pragma omp simd
      for (int j = 0; j <= t; j++) d[j] = scale * p[j] * (d[j] - dot);
      for (int j = t + 1; j < r1; j++) d[j] = 0.0f;
    }
    /* dQ[r0:r1] = dS[r0:r1, 0:r1] K[0:r1] */
    gemm_into_zero(CblasNoTrans, CblasNoTrans, r1 - r0, hs, r1, 1.0f, dS + (int64_t)r0 * T, T, k, ld,
                   dq + (int64_t)r0 * ld, ld);
  }
  /* dK and dV by key blocks [k0, k1): only queries t >= k0 see those keys.
   * dV = P^T dO, dK = dS^T Q. */
  for (int k0 = 0; k0 < T; k0 += PG_ATT_BLOCK) {
    int k1 = pg_cpu_min(k0 + PG_ATT_BLOCK, T);
    gemm_maybe_add(add, CblasTrans, CblasNoTrans, k1 - k0, hs, T - k0, 1.0f, P + (int64_t)k0 * T + k0, T,
                   dout + (int64_t)k0 * ldo, ldo, dv + (int64_t)k0 * ld, ld);
    gemm_maybe_add(add, CblasTrans, CblasNoTrans, k1 - k0, hs, T - k0, 1.0f, dS + (int64_t)k0 * T + k0, T,
                   q + (int64_t)k0 * ld, ld, dk + (int64_t)k0 * ld, ld);
  }
}

void pg_attention_backward(float *dqkv, float *scratch, const float *dout, const float *qkv, const float *att, int B,
                           int T, int NH, int NKV, int HS) {
  if (B <= 0 || T <= 0 || NH <= 0 || NKV <= 0 || HS <= 0 || NH % NKV) return;
  const int ld = (NH + 2 * NKV) * HS, ldo = NH * HS, group = NH / NKV;
  const float scale = 1.0f / sqrtf((float)HS);
  /* The caller sized scratch for omp_get_max_threads() threads; this region
   * has at most that many, and each uses its own [T, T] slice. A thread
   * takes a (batch row, key/value head) pair and its query heads in order,
   * so the key and value gradients are summed over the group in a fixed
   * order without atomics. */
#pragma omp parallel
  {
    float *dS = scratch + (int64_t)omp_get_thread_num() * T * T;
#pragma omp for schedule(static)
    for (int bk = 0; bk < B * NKV; bk++) {
      int b = bk / NKV, kvh = bk % NKV;
      int64_t row0 = (int64_t)b * T * ld, kcol = (int64_t)(NH + kvh) * HS, vcol = (int64_t)(NH + NKV + kvh) * HS;
      for (int g = 0; g < group; g++) {
        int h = kvh * group + g;
        att_backward_head(dqkv + row0 + h * HS, dqkv + row0 + kcol, dqkv + row0 + vcol, g > 0, dS,
                          dout + (int64_t)b * T * ldo + h * HS, qkv + row0 + h * HS, qkv + row0 + kcol,
                          qkv + row0 + vcol, att + ((int64_t)b * NH + h) * T * T, T, ld, ldo, HS, scale);
      }
    }
  }
}

/* Decoding: the new rows' keys and values into the cache, then per head the
 * scores of its T queries against the L = pos + T cached keys in one product
 * (the causal mask: query t sees keys 0 .. pos + t; the columns above are
 * computed, then set to 0 before the product with V, as the recompute path's
 * exact zeros). One OpenMP thread per head: the result does not depend on
 * the thread count. */
void pg_attention_cached(float *out, float *scores, float *kcache, float *vcache, const float *qkv,
                         const float *slopes, int T, int pos, int NH, int NKV, int HS) {
  if (T <= 0 || pos < 0 || NH <= 0 || NKV <= 0 || HS <= 0 || NH % NKV) return;
  const int ld = (NH + 2 * NKV) * HS, ldo = NH * HS, kvw = NKV * HS, group = NH / NKV, L = pos + T;
  const float scale = 1.0f / sqrtf((float)HS);
  for (int t = 0; t < T; t++) {
    memcpy(kcache + (int64_t)(pos + t) * kvw, qkv + (int64_t)t * ld + ldo, (size_t)kvw * sizeof(float));
    memcpy(vcache + (int64_t)(pos + t) * kvw, qkv + (int64_t)t * ld + ldo + kvw, (size_t)kvw * sizeof(float));
  }
#pragma omp parallel for schedule(static) if ((int64_t)NH * T * L * HS > PG_PAR_MIN)
  for (int h = 0; h < NH; h++) {
    const int kvh = h / group;
    float *P = scores + (int64_t)h * T * L;
    gemm_into_zero(CblasNoTrans, CblasTrans, T, L, HS, scale, qkv + h * HS, ld, kcache + kvh * HS, kvw, P, L);
    /* the query's position pos + t: keys 0 .. pos + t */
    for (int t = 0; t < T; t++) causal_softmax_row(P + (int64_t)t * L, pos + t, L, slopes ? slopes + h : NULL);
    gemm_into_zero(CblasNoTrans, CblasNoTrans, T, HS, L, 1.0f, P, L, vcache + kvh * HS, kvw, out + h * HS, ldo);
  }
}
