// Causal self-attention, multi-head or grouped-query, over the fused layout
// [B, T, (NH + 2 NKV) HS] (kernels.h): query head h = kvh * G + g (G = NH /
// NKV query heads per key/value head) attends with key/value head kvh.
//
// Every product is a strided-batched sgemm over a grid of (batch row b,
// key/value head kvh, head in the group g): an operand's matrix for (b, kvh, g)
// starts at fixed strides along each axis (a key is shared by its group's
// heads: stride 0 along g). gemm_grid batches the longest axis along which
// the output moves and loops over the two others (for MHA, G = 1: one call
// per batch row over the heads, or per head over the batch rows). The
// products are the CPU kernel's, over whole [T, T] blocks (the CPU skips most
// of the masked triangle; here the softmax writes exact zeros above the
// diagonal, so the extra products only add zeros). Softmax and its backward:
// one warp per row; ALiBi's biases are added in the softmax kernel.
// Backward, per batch row (the scratch holds one row's
// NH [T, T] blocks): the key and value gradients of a key/value head are its
// group's products added in head order (g = 0 writes, beta = 1 for the
// others: sgemms queued on one stream run in order), no atomics.
#include "common.cuh"

using namespace pgcu;

// p[0..t] = softmax(p[0..t]) (scores already scaled), p[t+1..T) = 0; t = row % T.
// slopes (ALiBi, NULL: none): the row's head h = (row / T) % NH adds
// slopes[h] * (j - t) to score j first, each operation rounded as on the CPU
// (no FMA). Every lane reads back only the columns it wrote.
__global__ void att_softmax_kernel(float *att, const float *slopes, int64_t rows, int T, int NH) {
  const int lane = threadIdx.x % WARP;
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  if (row >= rows) return;
  const int t = (int)(row % T);
  float *p = att + row * T;
  if (slopes) {
    const float m = slopes[(row / T) % NH];
    for (int j = lane; j <= t; j += WARP) p[j] = __fadd_rn(p[j], __fmul_rn(m, (float)(j - t)));
  }
  float mx = -INFINITY;
  for (int j = lane; j <= t; j += WARP) mx = fmaxf(mx, p[j]);
  mx = warp_max(mx);
  float s = 0.0f;
  for (int j = lane; j <= t; j += WARP) {
    const float e = expf(p[j] - mx);
    p[j] = e;
    s += e;
  }
  const float inv = 1.0f / warp_sum(s);
  for (int j = lane; j < T; j += WARP) p[j] = j <= t ? p[j] * inv : 0.0f;
}

// Softmax backward with the score scale folded in, in place over dP:
// dS = scale * P (dP - sum_j P dP) for j <= t, 0 above the diagonal.
__global__ void att_softmax_backward_kernel(float *dS, const float *P, int64_t rows, int T, float scale) {
  const int lane = threadIdx.x % WARP;
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  if (row >= rows) return;
  const int t = (int)(row % T);
  float *d = dS + row * T;
  const float *p = P + row * T;
  float dot = 0.0f;
  for (int j = lane; j <= t; j += WARP) dot += p[j] * d[j];
  dot = warp_sum(dot);
  for (int j = lane; j < T; j += WARP) d[j] = j <= t ? scale * p[j] * (d[j] - dot) : 0.0f;
}

static unsigned row_blocks(int64_t rows) { return (unsigned)((rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK); }

namespace {

// An sgemm operand over the (b, kvh, g) grid: matrix (b, kvh, g) starts at
// p + b s[0] + kvh s[1] + g s[2] (floats), rows ld apart.
struct grid_mat {
  const float *p;
  int ld;
  long long s[3];
};

// C(b, kvh, g) = alpha op(A(b, kvh, g)) op(B(b, kvh, g)) + beta C(b, kvh, g) over
// n[0] x n[1] x n[2] matrices, row-major as gemm_rm. The batched axis is the
// longest one along which C moves (C's matrices must be distinct along it).
int gemm_grid(cublasHandle_t h, bool ta, bool tb, int M, int N, int K, float alpha, grid_mat A, grid_mat B,
              float beta, float *C, int ldc, const long long cs[3], const int n[3]) {
  int ax = -1;
  for (int d = 0; d < 3; d++)
    if (cs[d] != 0 && (ax < 0 || n[d] > n[ax])) ax = d;
  if (ax < 0) { // a single matrix
    if (n[0] != 1 || n[1] != 1 || n[2] != 1) return PG_CUDA_EINVAL;
    ax = 0;
  }
  const int o1 = ax == 0 ? 1 : 0, o2 = ax == 2 ? 1 : 2; // the two looped axes, in order
  for (int i = 0; i < n[o1]; i++)
    for (int j = 0; j < n[o2]; j++) {
      const long long a0 = i * A.s[o1] + j * A.s[o2], b0 = i * B.s[o1] + j * B.s[o2], c0 = i * cs[o1] + j * cs[o2];
      if (int rc = gemm_rm_batched(h, ta, tb, M, N, K, alpha, A.p + a0, A.ld, A.s[ax], B.p + b0, B.ld, B.s[ax], beta,
                                   C + c0, ldc, cs[ax], n[ax]))
        return rc;
    }
  return 0;
}

bool bad_shape(int B, int T, int NH, int NKV, int HS) {
  return B < 0 || T < 0 || NH < 0 || NKV <= 0 || HS <= 0 || NH % NKV;
}

} // namespace

extern "C" int64_t pg_cuda_attention_scratch_floats(int T, int NH) {
  // dP, then dS in place, for the NH heads of one batch row
  return (int64_t)(NH > 0 ? NH : 1) * T * T;
}

extern "C" int pg_cuda_attention_forward(const pg_cuda_ctx *ctx, float *out, float *att, const float *qkv,
                                         const float *slopes, int B, int T, int NH, int NKV, int HS) {
  if (B <= 0 || T <= 0 || NH <= 0) return 0;
  if (bad_shape(B, T, NH, NKV, HS)) return PG_CUDA_EINVAL;
  cublasHandle_t h = blas_of(ctx);
  if (!h) return PG_CUDA_EINVAL;
  const int G = NH / NKV, ld = (NH + 2 * NKV) * HS, ldo = NH * HS;
  const float scale = 1.0f / sqrtf((float)HS);
  const long long TT = (long long)T * T, row = (long long)T * ld;
  const int n[3] = {B, NKV, G};
  // query head (b, kvh, g): columns (kvh G + g) HS; its key and value heads NH + kvh and NH + NKV + kvh
  const grid_mat Q = {qkv, ld, {row, (long long)G * HS, HS}};
  const grid_mat K = {qkv + (int64_t)NH * HS, ld, {row, HS, 0}};
  const grid_mat V = {qkv + (int64_t)(NH + NKV) * HS, ld, {row, HS, 0}};
  const long long ps[3] = {(long long)NH * TT, (long long)G * TT, TT}; // att[b, h]
  // scores S = scale * Q K^T
  if (int rc = gemm_grid(h, false, true, T, T, HS, scale, Q, K, 0.0f, att, T, ps, n)) return rc;
  const int64_t rows = (int64_t)B * NH * T;
  att_softmax_kernel<<<row_blocks(rows), BLOCK, 0, stream_of(ctx)>>>(att, slopes, rows, T, NH);
  if (int rc = launch_status()) return rc;
  // out[b, :, h] = P V
  const grid_mat P = {att, T, {ps[0], ps[1], ps[2]}};
  const long long os[3] = {(long long)T * ldo, (long long)G * HS, HS};
  return gemm_grid(h, false, false, T, HS, T, 1.0f, P, V, 0.0f, out, ldo, os, n);
}

extern "C" int pg_cuda_attention_backward(const pg_cuda_ctx *ctx, float *dqkv, float *scratch, const float *dout,
                                          const float *qkv, const float *att, int B, int T, int NH, int NKV, int HS) {
  if (B <= 0 || T <= 0 || NH <= 0) return 0;
  if (bad_shape(B, T, NH, NKV, HS)) return PG_CUDA_EINVAL;
  cublasHandle_t h = blas_of(ctx);
  if (!h) return PG_CUDA_EINVAL;
  const int G = NH / NKV, ld = (NH + 2 * NKV) * HS, ldo = NH * HS;
  const float scale = 1.0f / sqrtf((float)HS);
  const long long TT = (long long)T * T;
  const int64_t kcol = (int64_t)NH * HS, vcol = (int64_t)(NH + NKV) * HS;
  const long long qs[3] = {0, (long long)G * HS, HS}, kvs[3] = {0, HS, 0}, ps[3] = {0, (long long)G * TT, TT};
  const int n[3] = {1, NKV, G};
  float *dS = scratch;
  for (int b = 0; b < B; b++) {
    const int64_t base = (int64_t)b * T * ld;
    const float *q = qkv + base, *dO = dout + (int64_t)b * T * ldo, *P = att + (int64_t)b * NH * TT;
    float *dq = dqkv + base;
    const grid_mat K = {q + kcol, ld, {kvs[0], kvs[1], kvs[2]}};
    const grid_mat V = {q + vcol, ld, {kvs[0], kvs[1], kvs[2]}}, dOm = {dO, ldo, {qs[0], qs[1], qs[2]}};
    // dP = dO V^T
    if (int rc = gemm_grid(h, false, true, T, T, HS, 1.0f, dOm, V, 0.0f, dS, T, ps, n)) return rc;
    const int64_t rows = (int64_t)NH * T;
    att_softmax_backward_kernel<<<row_blocks(rows), BLOCK, 0, stream_of(ctx)>>>(dS, P, rows, T, scale);
    if (int rc = launch_status()) return rc;
    // dQ = dS K (overwritten)
    const grid_mat dSm = {dS, T, {ps[0], ps[1], ps[2]}};
    if (int rc = gemm_grid(h, false, false, T, HS, T, 1.0f, dSm, K, 0.0f, dq, ld, qs, n)) return rc;
    // dK = sum over the group of dS^T Q, dV = sum of P^T dO: head g = 0 writes, the others add, in order
    const int n1[3] = {1, NKV, 1};
    for (int g = 0; g < G; g++) {
      const float beta = g ? 1.0f : 0.0f;
      const grid_mat dSg = {dS + g * TT, T, {ps[0], ps[1], 0}}, Pg = {P + g * TT, T, {ps[0], ps[1], 0}};
      const grid_mat Qg = {q + (int64_t)g * HS, ld, {qs[0], qs[1], 0}};
      const grid_mat dOg = {dO + (int64_t)g * HS, ldo, {qs[0], qs[1], 0}};
      if (int rc = gemm_grid(h, true, false, T, HS, T, 1.0f, dSg, Qg, beta, dq + kcol, ld, kvs, n1)) return rc;
      if (int rc = gemm_grid(h, true, false, T, HS, T, 1.0f, Pg, dOg, beta, dq + vcol, ld, kvs, n1)) return rc;
    }
  }
  return 0;
}

// ---- decoding with a key/value cache (pg_attention_cached) ----
// The new rows' keys and values into the cache (one thread per element), then
// one block per (query row t, head h): its scores against the cached keys
// 0 .. pos + t, the block's max and sum, then each thread one output column.
// The scores go to the scratch in global memory (a block reads back only its
// own row, after a barrier).
__global__ void att_cache_store_kernel(float *kc, float *vc, const float *qkv, int T, int pos, int NH, int NKV,
                                       int HS) {
  const int64_t kvw = (int64_t)NKV * HS, ld = (int64_t)(NH + 2 * NKV) * HS;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < T * kvw; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / kvw, c = i % kvw;
    kc[(pos + t) * kvw + c] = qkv[t * ld + (int64_t)NH * HS + c];
    vc[(pos + t) * kvw + c] = qkv[t * ld + (int64_t)NH * HS + kvw + c];
  }
}

__global__ void att_cached_kernel(float *out, float *scores, const float *kc, const float *vc, const float *qkv,
                                  const float *slopes, int T, int pos, int NH, int NKV, int HS, float scale) {
  const int t = blockIdx.x / NH, h = blockIdx.x % NH, kvh = h / (NH / NKV), at = pos + t, L = pos + T;
  const int64_t kvw = (int64_t)NKV * HS, ld = (int64_t)(NH + 2 * NKV) * HS;
  const float *q = qkv + t * ld + (int64_t)h * HS, *k = kc + (int64_t)kvh * HS, *v = vc + (int64_t)kvh * HS;
  float *p = scores + ((int64_t)h * T + t) * L;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j <= at; j += blockDim.x) {
    float s = 0.0f;
    for (int d = 0; d < HS; d++) s += q[d] * k[j * kvw + d];
    s = __fmul_rn(scale, s);
    if (slopes) s = __fadd_rn(s, __fmul_rn(slopes[h], (float)(j - at)));
    p[j] = s;
    mx = fmaxf(mx, s);
  }
  mx = block_max(mx);
  float sum = 0.0f;
  for (int j = threadIdx.x; j <= at; j += blockDim.x) {
    const float e = expf(p[j] - mx);
    p[j] = e;
    sum += e;
  }
  const float inv = 1.0f / block_sum(sum);
  __syncthreads(); // every thread's probabilities written before any reads them
  for (int d = threadIdx.x; d < HS; d += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j <= at; j++) acc += (p[j] * inv) * v[j * kvw + d];
    out[t * (int64_t)NH * HS + (int64_t)h * HS + d] = acc;
  }
}

extern "C" int pg_cuda_attention_cached(const pg_cuda_ctx *ctx, float *out, float *scores, float *kcache,
                                        float *vcache, const float *qkv, const float *slopes, int T, int pos, int NH,
                                        int NKV, int HS) {
  if (T <= 0 || NH <= 0) return 0;
  if (pos < 0 || bad_shape(1, T, NH, NKV, HS) || (int64_t)T * NH > INT32_MAX) return PG_CUDA_EINVAL;
  cudaStream_t st = stream_of(ctx);
  att_cache_store_kernel<<<grid_for((int64_t)T * NKV * HS, BLOCK), BLOCK, 0, st>>>(kcache, vcache, qkv, T, pos, NH,
                                                                                    NKV, HS);
  if (int rc = launch_status()) return rc;
  att_cached_kernel<<<(unsigned)(T * NH), 128, 0, st>>>(out, scores, kcache, vcache, qkv, slopes, T, pos, NH, NKV, HS,
                                                         1.0f / sqrtf((float)HS));
  return launch_status();
}
