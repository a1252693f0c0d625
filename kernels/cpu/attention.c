/* Causal self-attention's decoding path (pg_attention_cached) and ALiBi's
 * slopes, over the fused q|k|v layout [B, T, (NH + 2 NKV) HS] (kernels.h).
 * The training attention is flash-style, in attention_block.c.
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

/* One query row of causal attention probabilities in place: p[0 .. at] are its scores against keys 0 .. at
 * (ALiBi's m * (j - at) added when slope is given), softmaxed; p[at + 1 .. width) set to exact zeros (the P V
 * product reads them). */
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
