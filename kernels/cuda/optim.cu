// AdamW update and the deterministic sum of squares (gradient norms).
#include "common.cuh"

using namespace pgcu;

// The scalar factors exactly as the CPU kernel computes them (double, then rounded once).
struct adamw_factors {
  float beta1, beta2, eps, grad_scale, decay, step_size, bc2_sqrt, one_b1, one_b2;
};

static adamw_factors adamw_factors_for(float lr, float beta1, float beta2, float eps, float weight_decay, int step,
                                       float grad_scale) {
  const double bc1 = 1.0 - pow((double)beta1, step), bc2 = 1.0 - pow((double)beta2, step);
  adamw_factors f;
  f.beta1 = beta1, f.beta2 = beta2, f.eps = eps, f.grad_scale = grad_scale;
  f.decay = (float)(1.0 - (double)lr * weight_decay);
  f.step_size = (float)((double)lr / bc1);
  f.bc2_sqrt = (float)sqrt(bc2);
  f.one_b1 = (float)(1.0 - beta1), f.one_b2 = (float)(1.0 - beta2);
  return f;
}

// One element: the CPU kernel's arithmetic in its order, each operation
// rounded on its own (the _rn intrinsics are never contracted into FMAs), so
// the result has the same bits as pg_adamw_update.
__device__ __forceinline__ void adamw_element(float *param, const float *grad, float *m, float *v, int64_t i,
                                              const adamw_factors &f, float decay) {
  const float g = __fmul_rn(grad[i], f.grad_scale);
  const float p = __fmul_rn(param[i], decay);
  const float mi = __fadd_rn(__fmul_rn(f.beta1, m[i]), __fmul_rn(f.one_b1, g));
  const float vi = __fadd_rn(__fmul_rn(f.beta2, v[i]), __fmul_rn(__fmul_rn(f.one_b2, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), f.bc2_sqrt), f.eps);
  param[i] = __fsub_rn(p, __fmul_rn(f.step_size, __fdiv_rn(mi, denom)));
  m[i] = mi;
  v[i] = vi;
}

__global__ void adamw_kernel(float *param, const float *grad, float *m, float *v, int64_t n, adamw_factors f) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    adamw_element(param, grad, m, v, i, f, f.decay);
}

extern "C" int pg_cuda_adamw_update(const pg_cuda_ctx *ctx, float *param, const float *grad, float *m, float *v,
                                    int64_t n, float lr, float beta1, float beta2, float eps, float weight_decay,
                                    int step, float grad_scale) {
  if (n <= 0) return 0;
  const adamw_factors f = adamw_factors_for(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  adamw_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(param, grad, m, v, n, f);
  return launch_status();
}

// Block j: elements [j C, (j + 1) C) of the pieces end to end. Every thread
// bisects starts for the piece holding the chunk's first element (the same
// loads in every thread), then the block walks the pieces the chunk covers.
// decay_off: the factor of a piece without decay, as the per-piece call with
// weight_decay 0 computes it (1).
__global__ void adamw_pieces_kernel(const pg_adamw_piece *pieces, const int64_t *starts, int npieces, int64_t total,
                                    adamw_factors f, float decay_off) {
  int64_t c0 = (int64_t)blockIdx.x * PG_CUDA_ADAMW_CHUNK;
  const int64_t c1 = c0 + PG_CUDA_ADAMW_CHUNK < total ? c0 + PG_CUDA_ADAMW_CHUNK : total;
  int lo = 0, hi = npieces - 1; // the last k with starts[k] <= c0
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    if (starts[mid] <= c0) lo = mid;
    else hi = mid - 1;
  }
  for (int k = lo; c0 < c1 && k < npieces; k++) {
    const int64_t s = starts[k], e = starts[k + 1] < c1 ? starts[k + 1] : c1;
    const pg_adamw_piece pc = pieces[k];
    const float decay = pc.decay ? f.decay : decay_off;
    for (int64_t i = c0 + threadIdx.x; i < e; i += blockDim.x)
      adamw_element(pc.param, pc.grad, pc.m, pc.v, i - s, f, decay);
    c0 = e;
  }
}

extern "C" int pg_cuda_adamw_update_pieces(const pg_cuda_ctx *ctx, const pg_adamw_piece *pieces,
                                           const int64_t *starts, int npieces, int64_t total, float lr, float beta1,
                                           float beta2, float eps, float weight_decay, int step, float grad_scale) {
  if (npieces < 0 || total < 0 || (npieces > 0 && (!pieces || !starts))) return PG_CUDA_EINVAL;
  if (npieces == 0 || total == 0) return 0;
  const int64_t blocks = (total + PG_CUDA_ADAMW_CHUNK - 1) / PG_CUDA_ADAMW_CHUNK;
  if (blocks > 0x7fffffff) return PG_CUDA_EINVAL;
  const adamw_factors f = adamw_factors_for(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  const float decay_off = adamw_factors_for(lr, beta1, beta2, eps, 0.0f, step, grad_scale).decay;
  adamw_pieces_kernel<<<(unsigned)blocks, BLOCK, 0, stream_of(ctx)>>>(pieces, starts, npieces, total, f, decay_off);
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
