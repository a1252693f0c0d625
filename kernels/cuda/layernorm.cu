// Normalisation over the last dimension: layer norm (eps PG_LAYERNORM_EPS) and
// RMS norm (LLaMA, eps given).
#include "common.cuh"

using namespace pgcu;

// One warp per row. Two passes (mean, then the centred squares) as on the
// CPU: no cancellation when |mean| >> std. 1/sqrt in double, as the CPU.
__global__ void layernorm_forward_kernel(float *out, float *mean, float *rstd, const float *inp,
                                         const float *weight, const float *bias, int N, int C) {
  const int lane = threadIdx.x % WARP;
  const int64_t n = (int64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  if (n >= N) return; // whole warps only: no block-wide barrier below
  const float *x = inp + n * C;
  float s = 0.0f;
  for (int c = lane; c < C; c += WARP) s += x[c];
  const float m = (float)((double)warp_sum(s) / C);
  float q = 0.0f;
  for (int c = lane; c < C; c += WARP) {
    const float d = x[c] - m;
    q += d * d;
  }
  const float r = (float)(1.0 / sqrt((double)warp_sum(q) / C + (double)PG_LAYERNORM_EPS));
  float *o = out + n * C;
  for (int c = lane; c < C; c += WARP) o[c] = (x[c] - m) * r * weight[c] + bias[c];
  if (lane == 0) {
    mean[n] = m;
    rstd[n] = r;
  }
}

// dinp, one warp per row: with xh = (x - mean) rstd and g = dout * weight,
// dx = rstd (g - mean(g) - xh mean(g xh)).
__global__ void layernorm_backward_kernel(float *dinp, const float *dout, const float *inp, const float *weight,
                                          const float *mean, const float *rstd, int N, int C) {
  const int lane = threadIdx.x % WARP;
  const int64_t n = (int64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  if (n >= N) return;
  const float *x = inp + n * C, *dy = dout + n * C;
  const float m = mean[n], r = rstd[n];
  float sg = 0.0f, sgx = 0.0f;
  for (int c = lane; c < C; c += WARP) {
    const float g = dy[c] * weight[c];
    sg += g;
    sgx += g * ((x[c] - m) * r);
  }
  const float mg = warp_sum(sg) / C, mgx = warp_sum(sgx) / C;
  float *dx = dinp + n * C;
  for (int c = lane; c < C; c += WARP) dx[c] = r * (dy[c] * weight[c] - mg - (x[c] - m) * r * mgx);
}

constexpr int LN_COLS = WARP, LN_ROWS = 16;

// dweight[c] += sum_n dout xh, dbias[c] += sum_n dout: columns in blocks of
// 32, rows split over 16 thread rows, partials added in order (no atomics).
__global__ void layernorm_param_grad_kernel(float *dweight, float *dbias, const float *dout, const float *inp,
                                            const float *mean, const float *rstd, int N, int C) {
  __shared__ float pw[LN_ROWS][LN_COLS + 1], pb[LN_ROWS][LN_COLS + 1];
  const int c = blockIdx.x * LN_COLS + threadIdx.x;
  float aw = 0.0f, ab = 0.0f;
  if (c < C)
    for (int n = threadIdx.y; n < N; n += LN_ROWS) {
      const int64_t i = (int64_t)n * C + c;
      aw += dout[i] * ((inp[i] - mean[n]) * rstd[n]);
      ab += dout[i];
    }
  pw[threadIdx.y][threadIdx.x] = aw;
  pb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float sw = 0.0f, sb = 0.0f;
    for (int y = 0; y < LN_ROWS; y++) {
      sw += pw[y][threadIdx.x];
      sb += pb[y][threadIdx.x];
    }
    if (dweight) dweight[c] += sw;
    if (dbias) dbias[c] += sb;
  }
}

static unsigned row_blocks(int N) { return (unsigned)((N + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK); }

extern "C" int pg_cuda_layernorm_forward(const pg_cuda_ctx *ctx, float *out, float *mean, float *rstd,
                                         const float *inp, const float *weight, const float *bias, int N, int C) {
  if (N <= 0 || C <= 0) return 0;
  layernorm_forward_kernel<<<row_blocks(N), BLOCK, 0, stream_of(ctx)>>>(out, mean, rstd, inp, weight, bias, N, C);
  return launch_status();
}

extern "C" int pg_cuda_layernorm_backward(const pg_cuda_ctx *ctx, float *dinp, float *dweight, float *dbias,
                                          const float *dout, const float *inp, const float *weight,
                                          const float *mean, const float *rstd, int N, int C) {
  if (N <= 0 || C <= 0) return 0;
  cudaStream_t s = stream_of(ctx);
  if (dinp) {
    layernorm_backward_kernel<<<row_blocks(N), BLOCK, 0, s>>>(dinp, dout, inp, weight, mean, rstd, N, C);
    if (int rc = launch_status()) return rc;
  }
  if (dweight || dbias) {
    const unsigned blocks = (unsigned)((C + LN_COLS - 1) / LN_COLS);
    layernorm_param_grad_kernel<<<blocks, dim3(LN_COLS, LN_ROWS), 0, s>>>(dweight, dbias, dout, inp, mean, rstd, N,
                                                                          C);
    return launch_status();
  }
  return 0;
}

// ---- RMS normalisation (LLaMA) ----

// One warp per row: the sum of squares in double (as the CPU), rstd =
// 1 / sqrt(mean + eps) in double; out = (x rstd) weight, transformers' order,
// separately rounded (no FMA) as on the CPU.
__global__ void rmsnorm_forward_kernel(float *out, float *rstd, const float *inp, const float *weight, int N, int C,
                                       float eps) {
  const int lane = threadIdx.x % WARP;
  const int64_t n = (int64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  if (n >= N) return; // whole warps only: no block-wide barrier below
  const float *x = inp + n * C;
  double q = 0.0;
  for (int c = lane; c < C; c += WARP) q += (double)x[c] * x[c];
  const float r = (float)(1.0 / sqrt(warp_sum(q) / C + (double)eps));
  float *o = out + n * C;
  for (int c = lane; c < C; c += WARP) o[c] = __fmul_rn(__fmul_rn(x[c], r), weight[c]);
  if (lane == 0) rstd[n] = r;
}

// dinp, one warp per row: with xh = x rstd and g = dout * weight,
// dx = rstd (g - xh mean(g xh)), the mean's sum in double (as the CPU).
__global__ void rmsnorm_backward_kernel(float *dinp, const float *dout, const float *inp, const float *weight,
                                        const float *rstd, int N, int C) {
  const int lane = threadIdx.x % WARP;
  const int64_t n = (int64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  if (n >= N) return;
  const float *x = inp + n * C, *dy = dout + n * C;
  const float r = rstd[n];
  double sgx = 0.0;
  for (int c = lane; c < C; c += WARP) sgx += (double)__fmul_rn(dy[c], weight[c]) * __fmul_rn(x[c], r);
  const float mgx = (float)(warp_sum(sgx) / C);
  float *dx = dinp + n * C;
  for (int c = lane; c < C; c += WARP)
    dx[c] = __fmul_rn(r, __fsub_rn(__fmul_rn(dy[c], weight[c]), __fmul_rn(__fmul_rn(x[c], r), mgx)));
}

// dweight[c] += sum_n dout (x rstd): as layernorm_param_grad_kernel, columns
// in blocks of 32, rows split over 16 thread rows, partials added in order.
__global__ void rmsnorm_param_grad_kernel(float *dweight, const float *dout, const float *inp, const float *rstd,
                                          int N, int C) {
  __shared__ float pw[LN_ROWS][LN_COLS + 1];
  const int c = blockIdx.x * LN_COLS + threadIdx.x;
  float aw = 0.0f;
  if (c < C)
    for (int n = threadIdx.y; n < N; n += LN_ROWS) {
      const int64_t i = (int64_t)n * C + c;
      aw = __fadd_rn(aw, __fmul_rn(dout[i], __fmul_rn(inp[i], rstd[n])));
    }
  pw[threadIdx.y][threadIdx.x] = aw;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float sw = 0.0f;
    for (int y = 0; y < LN_ROWS; y++) sw += pw[y][threadIdx.x];
    dweight[c] += sw;
  }
}

extern "C" int pg_cuda_rmsnorm_forward(const pg_cuda_ctx *ctx, float *out, float *rstd, const float *inp,
                                       const float *weight, int N, int C, float eps) {
  if (N <= 0 || C <= 0) return 0;
  rmsnorm_forward_kernel<<<row_blocks(N), BLOCK, 0, stream_of(ctx)>>>(out, rstd, inp, weight, N, C, eps);
  return launch_status();
}

extern "C" int pg_cuda_rmsnorm_backward(const pg_cuda_ctx *ctx, float *dinp, float *dweight, const float *dout,
                                        const float *inp, const float *weight, const float *rstd, int N, int C) {
  if (N <= 0 || C <= 0) return 0;
  cudaStream_t s = stream_of(ctx);
  if (dinp) {
    rmsnorm_backward_kernel<<<row_blocks(N), BLOCK, 0, s>>>(dinp, dout, inp, weight, rstd, N, C);
    if (int rc = launch_status()) return rc;
  }
  if (dweight) {
    const unsigned blocks = (unsigned)((C + LN_COLS - 1) / LN_COLS);
    rmsnorm_param_grad_kernel<<<blocks, dim3(LN_COLS, LN_ROWS), 0, s>>>(dweight, dout, inp, rstd, N, C);
    return launch_status();
  }
  return 0;
}
