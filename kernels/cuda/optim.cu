// AdamW update and the deterministic sum of squares (gradient norms).
#include "common.cuh"

using namespace pgcu;

// The CPU kernel's arithmetic in its order, each operation rounded on its
// own (the _rn intrinsics are never contracted into FMAs), so the result has
// the same bits as pg_adamw_update.
__global__ void adamw_kernel(float *param, const float *grad, float *m, float *v, int64_t n, float beta1,
                             float beta2, float eps, float grad_scale, float decay, float step_size, float bc2_sqrt,
                             float one_b1, float one_b2) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const float g = __fmul_rn(grad[i], grad_scale);
    const float p = __fmul_rn(param[i], decay);
    const float mi = __fadd_rn(__fmul_rn(beta1, m[i]), __fmul_rn(one_b1, g));
    const float vi = __fadd_rn(__fmul_rn(beta2, v[i]), __fmul_rn(__fmul_rn(one_b2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
    param[i] = __fsub_rn(p, __fmul_rn(step_size, __fdiv_rn(mi, denom)));
    m[i] = mi;
    v[i] = vi;
  }
}

extern "C" int pg_cuda_adamw_update(const pg_cuda_ctx *ctx, float *param, const float *grad, float *m, float *v,
                                    int64_t n, float lr, float beta1, float beta2, float eps, float weight_decay,
                                    int step, float grad_scale) {
  if (n <= 0) return 0;
  // The scalar factors exactly as the CPU kernel computes them (double, then rounded once).
  const double bc1 = 1.0 - pow((double)beta1, step), bc2 = 1.0 - pow((double)beta2, step);
  const float decay = (float)(1.0 - (double)lr * weight_decay);
  const float step_size = (float)((double)lr / bc1);
  const float bc2_sqrt = (float)sqrt(bc2);
  const float one_b1 = (float)(1.0 - beta1), one_b2 = (float)(1.0 - beta2);
  adamw_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(param, grad, m, v, n, beta1, beta2, eps, grad_scale,
                                                                 decay, step_size, bc2_sqrt, one_b1, one_b2);
  return launch_status();
}

// Block k sums chunk [n k / K, n (k+1) / K) (K = PG_CUDA_SUMSQ_BLOCKS, fixed
// by n alone) in double, threads striding through it, then a block tree.
__global__ void sum_squares_partial_kernel(double *part, const float *x, int64_t n) {
  const int64_t k = blockIdx.x;
  const int64_t i0 = n * k / PG_CUDA_SUMSQ_BLOCKS, i1 = n * (k + 1) / PG_CUDA_SUMSQ_BLOCKS;
  double s = 0.0;
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) s += (double)x[i] * x[i];
  s = block_sum(s);
  if (threadIdx.x == 0) part[k] = s;
}

__global__ void sum_squares_final_kernel(double *out, const double *part) {
  double s = 0.0;
  for (int k = threadIdx.x; k < PG_CUDA_SUMSQ_BLOCKS; k += blockDim.x) s += part[k];
  s = block_sum(s);
  if (threadIdx.x == 0) *out = s;
}

extern "C" int pg_cuda_sum_squares(const pg_cuda_ctx *ctx, double *out, const float *x, int64_t n,
                                   double *scratch) {
  if (n < 0) return PG_CUDA_EINVAL;
  cudaStream_t s = stream_of(ctx);
  sum_squares_partial_kernel<<<PG_CUDA_SUMSQ_BLOCKS, BLOCK, 0, s>>>(scratch, x, n);
  if (int rc = launch_status()) return rc;
  sum_squares_final_kernel<<<1, BLOCK, 0, s>>>(out, scratch);
  return launch_status();
}
