// Causal multi-head self-attention over the fused qkv layout [B, T, 3C].
//
// For each batch row b, the NH heads are one strided-batched sgemm: head h of
// Q, K, V starts h*hs floats after head 0 (leading dimension 3C), its [T, T]
// block of att T*T floats after the previous head's. The products are the
// CPU kernel's, over whole [T, T] blocks (the CPU skips most of the masked
// triangle; here the softmax writes exact zeros above the diagonal, so the
// extra products only add zeros). Softmax and its backward: one warp per row.
#include "common.cuh"

using namespace pgcu;

// p[0..t] = softmax(p[0..t]) (scores already scaled), p[t+1..T) = 0; t = row % T.
__global__ void att_softmax_kernel(float *att, int64_t rows, int T) {
  const int lane = threadIdx.x % WARP;
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  if (row >= rows) return;
  const int t = (int)(row % T);
  float *p = att + row * T;
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

extern "C" int64_t pg_cuda_attention_scratch_floats(int T, int NH) {
  // dP, then dS in place, for the NH heads of one batch row
  return (int64_t)(NH > 0 ? NH : 1) * T * T;
}

extern "C" int pg_cuda_attention_forward(const pg_cuda_ctx *ctx, float *out, float *att, const float *qkv, int B,
                                         int T, int C, int NH) {
  if (B <= 0 || T <= 0 || C <= 0 || NH <= 0) return 0;
  if (C % NH) return PG_CUDA_EINVAL;
  cublasHandle_t h = blas_of(ctx);
  if (!h) return PG_CUDA_EINVAL;
  const int hs = C / NH, ld = 3 * C;
  const float scale = 1.0f / sqrtf((float)hs);
  const long long TT = (long long)T * T;
  for (int b = 0; b < B; b++) {
    const float *q = qkv + (int64_t)b * T * ld, *k = q + C;
    float *P = att + (int64_t)b * NH * TT;
    // scores S = scale * Q K^T, every head at once
    if (int rc = gemm_rm_batched(h, false, true, T, T, hs, scale, q, ld, hs, k, ld, hs, 0.0f, P, T, TT, NH)) return rc;
  }
  const int64_t rows = (int64_t)B * NH * T;
  att_softmax_kernel<<<row_blocks(rows), BLOCK, 0, stream_of(ctx)>>>(att, rows, T);
  if (int rc = launch_status()) return rc;
  for (int b = 0; b < B; b++) {
    const float *v = qkv + (int64_t)b * T * ld + 2 * C;
    const float *P = att + (int64_t)b * NH * TT;
    // out[b] = P V, head h into columns [h*hs, (h+1)*hs)
    if (int rc = gemm_rm_batched(h, false, false, T, hs, T, 1.0f, P, T, TT, v, ld, hs, 0.0f, out + (int64_t)b * T * C,
                                 C, hs, NH))
      return rc;
  }
  return 0;
}

extern "C" int pg_cuda_attention_backward(const pg_cuda_ctx *ctx, float *dqkv, float *scratch, const float *dout,
                                          const float *qkv, const float *att, int B, int T, int C, int NH) {
  if (B <= 0 || T <= 0 || C <= 0 || NH <= 0) return 0;
  if (C % NH) return PG_CUDA_EINVAL;
  cublasHandle_t h = blas_of(ctx);
  if (!h) return PG_CUDA_EINVAL;
  const int hs = C / NH, ld = 3 * C;
  const float scale = 1.0f / sqrtf((float)hs);
  const long long TT = (long long)T * T;
  float *dS = scratch;
  for (int b = 0; b < B; b++) {
    const int64_t base = (int64_t)b * T * ld;
    const float *q = qkv + base, *k = q + C, *v = q + 2 * C;
    float *dq = dqkv + base, *dk = dq + C, *dv = dq + 2 * C;
    const float *dO = dout + (int64_t)b * T * C;
    const float *P = att + (int64_t)b * NH * TT;
    // dP = dO V^T
    if (int rc = gemm_rm_batched(h, false, true, T, T, hs, 1.0f, dO, C, hs, v, ld, hs, 0.0f, dS, T, TT, NH)) return rc;
    const int64_t rows = (int64_t)NH * T;
    att_softmax_backward_kernel<<<row_blocks(rows), BLOCK, 0, stream_of(ctx)>>>(dS, P, rows, T, scale);
    if (int rc = launch_status()) return rc;
    // dQ = dS K, dK = dS^T Q, dV = P^T dO (overwritten: beta = 0)
    if (int rc = gemm_rm_batched(h, false, false, T, hs, T, 1.0f, dS, T, TT, k, ld, hs, 0.0f, dq, ld, hs, NH))
      return rc;
    if (int rc = gemm_rm_batched(h, true, false, T, hs, T, 1.0f, dS, T, TT, q, ld, hs, 0.0f, dk, ld, hs, NH)) return rc;
    if (int rc = gemm_rm_batched(h, true, false, T, hs, T, 1.0f, P, T, TT, dO, C, hs, 0.0f, dv, ld, hs, NH)) return rc;
  }
  return 0;
}
