// Fused softmax + cross-entropy over a (slice of the) vocabulary, in the
// three steps of the CPU kernels (so that vocab-parallel callers can reduce
// the row statistics across ranks between them). One block per row; only the
// first `valid` columns of a slice are real.
#include "common.cuh"

using namespace pgcu;

// Is the (global) target id a real column of this slice? Column index or -1.
__device__ __forceinline__ int64_t target_col(int32_t target, int valid, int vocab_start) {
  const int64_t c = (int64_t)target - vocab_start;
  return c >= 0 && c < valid ? c : -1;
}

__global__ void xent_row_max_kernel(float *row_max, const float *logits, int V, int valid) {
  const float *x = logits + (int64_t)blockIdx.x * V;
  float mx = -INFINITY; // a slice without valid columns never wins the max
  for (int c = threadIdx.x; c < valid; c += blockDim.x) mx = fmaxf(mx, x[c]);
  mx = block_max(mx);
  if (threadIdx.x == 0) row_max[blockIdx.x] = mx;
}

// Sums in double, as the CPU (tens of thousands of terms per row).
__global__ void xent_sumexp_kernel(float *sumexp, float *target_logit, const float *logits, const float *row_max,
                                   const int32_t *targets, int V, int valid, int vocab_start) {
  const int64_t n = blockIdx.x;
  const float *x = logits + n * V;
  const float mx = row_max[n];
  double s = 0.0;
  for (int c = threadIdx.x; c < valid; c += blockDim.x) s += (double)expf(x[c] - mx);
  s = block_sum(s);
  if (threadIdx.x == 0) {
    sumexp[n] = (float)s;
    const int64_t tc = target_col(targets[n], valid, vocab_start);
    target_logit[n] = tc >= 0 ? x[tc] : 0.0f;
  }
}

__device__ __forceinline__ double row_loss(const float *row_max, const float *sumexp, const float *target_logit,
                                           int64_t n) {
  return log((double)sumexp[n]) + row_max[n] - target_logit[n];
}

// dlogits = (softmax - onehot(target)) * dloss, padded columns 0. dlogits may
// alias logits: each element is read and then written by the same thread.
__global__ void xent_finish_kernel(float *losses, float *dlogits, const float *logits, const float *row_max,
                                   const float *sumexp, const float *target_logit, const int32_t *targets, int V,
                                   int valid, int vocab_start, float dloss) {
  const int64_t n = blockIdx.x;
  if (losses && threadIdx.x == 0) losses[n] = (float)row_loss(row_max, sumexp, target_logit, n);
  if (!dlogits) return;
  const float *x = logits + n * V;
  float *d = dlogits + n * V;
  const float mx = row_max[n], scale = dloss / sumexp[n];
  const int64_t tc = target_col(targets[n], valid, vocab_start);
  for (int c = threadIdx.x; c < V; c += blockDim.x) {
    float g = c < valid ? expf(x[c] - mx) * scale : 0.0f; // padding: never predicted
    if (c == tc) g -= dloss;
    d[c] = g;
  }
}

// *loss_sum = sum of the N row losses in double: one block, fixed order.
__global__ void xent_loss_sum_kernel(double *loss_sum, const float *row_max, const float *sumexp,
                                     const float *target_logit, int N) {
  double s = 0.0;
  for (int n = threadIdx.x; n < N; n += blockDim.x) s += row_loss(row_max, sumexp, target_logit, n);
  s = block_sum(s);
  if (threadIdx.x == 0) *loss_sum = s;
}

extern "C" int pg_cuda_xent_row_max(const pg_cuda_ctx *ctx, float *row_max, const float *logits, int N, int V,
                                    int valid) {
  if (N <= 0) return 0;
  xent_row_max_kernel<<<N, BLOCK, 0, stream_of(ctx)>>>(row_max, logits, V, valid);
  return launch_status();
}

extern "C" int pg_cuda_xent_sumexp(const pg_cuda_ctx *ctx, float *sumexp, float *target_logit, const float *logits,
                                   const float *row_max, const int32_t *targets, int N, int V, int valid,
                                   int vocab_start) {
  if (N <= 0) return 0;
  xent_sumexp_kernel<<<N, BLOCK, 0, stream_of(ctx)>>>(sumexp, target_logit, logits, row_max, targets, V, valid,
                                                      vocab_start);
  return launch_status();
}

extern "C" int pg_cuda_xent_finish(const pg_cuda_ctx *ctx, float *losses, float *dlogits, const float *logits,
                                   const float *row_max, const float *sumexp, const float *target_logit,
                                   const int32_t *targets, int N, int V, int valid, int vocab_start, float dloss,
                                   double *loss_sum) {
  cudaStream_t s = stream_of(ctx);
  if (N <= 0) return loss_sum ? (int)cudaMemsetAsync(loss_sum, 0, sizeof(double), s) : 0;
  if (losses || dlogits) {
    xent_finish_kernel<<<N, BLOCK, 0, s>>>(losses, dlogits, logits, row_max, sumexp, target_logit, targets, V, valid,
                                           vocab_start, dloss);
    if (int rc = launch_status()) return rc;
  }
  if (loss_sum) {
    xent_loss_sum_kernel<<<1, BLOCK, 0, s>>>(loss_sum, row_max, sumexp, target_logit, N);
    return launch_status();
  }
  return 0;
}
