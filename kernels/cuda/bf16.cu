// Precision bf16 on the GPU: float32 -> bf16 rounding and the bf16 GEMMs
// (cublasGemmEx: bf16 inputs, float32 sums and output). bf16 values are their
// bits (uint16_t), as on the CPU (kernels.h), so no cuda_bf16.h type crosses
// the C interface.
#include "common.cuh"

using namespace pgcu;

// pg_bf16_round's integer arithmetic, so the device makes the CPU's bits:
// round to nearest, ties to even (adding 0x7fff plus the kept lowest bit
// carries into the upper half exactly when the dropped half is above the tie,
// or at the tie with an odd upper half); a NaN stays a quiet NaN (the carry
// could turn it into inf).
__device__ __forceinline__ uint16_t bf16_round_bits(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__global__ void bf16_from_f32_kernel(uint16_t *dst, const float *src, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = bf16_round_bits(src[i]);
}

extern "C" int pg_cuda_bf16_from_f32(const pg_cuda_ctx *ctx, uint16_t *dst, const float *src, int64_t n) {
  if (n <= 0) return 0;
  bf16_from_f32_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(dst, src, n);
  return launch_status();
}

// gemm_rm (common.cuh) with bf16 A and B: row-major C[M,N] (float32) = alpha
// op(A) op(B) + beta C, as cuBLAS's column-major C^T = op(B)^T op(A)^T.
// CUBLAS_COMPUTE_32F: products and sums in float32 (not the _FAST_ modes that
// round the inputs further, nor a 16-bit accumulator).
static int gemm_bf16_rm(cublasHandle_t h, bool ta, bool tb, int M, int N, int K, float alpha, const uint16_t *A,
                        int lda, const uint16_t *B, int ldb, float beta, float *C, int ldc) {
  const pg_cublas_api *b = pg_cublas();
  if (!b) return cublas_status(CUBLAS_STATUS_NOT_INITIALIZED);
  return cublas_status(b->GemmEx(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha,
                                 B, CUDA_R_16BF, ldb, A, CUDA_R_16BF, lda, &beta, C, CUDA_R_32F, ldc,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

extern "C" int pg_cuda_matmul_bf16_forward(const pg_cuda_ctx *ctx, float *out, const uint16_t *inp,
                                           const uint16_t *weight, const float *bias, int N, int C, int OC) {
  if (N <= 0 || OC <= 0) return 0;
  cudaStream_t s = stream_of(ctx);
  float beta = 0.0f;
  if (bias) {
    if (int rc = bias_rows(s, out, bias, N, OC)) return rc;
    beta = 1.0f;
  }
  if (C <= 0) return bias ? 0 : (int)cudaMemsetAsync(out, 0, (size_t)N * OC * sizeof(float), s);
  cublasHandle_t h = blas_of(ctx);
  if (!h) return PG_CUDA_EINVAL;
  // out[N,OC] = inp[N,C] @ weight[OC,C]^T
  return gemm_bf16_rm(h, false, true, N, OC, C, 1.0f, inp, C, weight, C, beta, out, OC);
}

extern "C" int pg_cuda_matmul_bf16_backward(const pg_cuda_ctx *ctx, float *dinp, float *dweight, float *dbias,
                                            const float *dout_f32, const uint16_t *dout, const uint16_t *inp,
                                            const uint16_t *weight, int N, int C, int OC) {
  cudaStream_t s = stream_of(ctx);
  if (N <= 0 || OC <= 0) {
    if (dinp && N > 0 && C > 0) return (int)cudaMemsetAsync(dinp, 0, (size_t)N * C * sizeof(float), s);
    return 0;
  }
  if (C > 0 && (dinp || dweight)) {
    cublasHandle_t h = blas_of(ctx);
    if (!h) return PG_CUDA_EINVAL;
    // dinp[N,C] = dout[N,OC] @ weight[OC,C]
    if (dinp)
      if (int rc = gemm_bf16_rm(h, false, false, N, C, OC, 1.0f, dout, OC, weight, C, 0.0f, dinp, C)) return rc;
    // dweight[OC,C] += dout^T @ inp (beta = 1 accumulates micro-batches into the float32 gradient)
    if (dweight)
      if (int rc = gemm_bf16_rm(h, true, false, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dweight, C)) return rc;
  }
  if (dbias) return col_sum_add(s, dbias, dout_f32, N, OC, OC);
  return 0;
}
