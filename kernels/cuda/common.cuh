// common.cuh — what the CUDA kernels share (private to kernels/cuda).
//
// Conventions: kernels use fixed block sizes (constants below), so the
// partition of every reduction, and therefore its rounding, depends only on
// the problem size. No float atomics. Block reductions go warp by warp with
// __shfl_xor_sync (a fixed butterfly) and then across warps through shared
// memory in warp order. Every thread of a block calls them.
#pragma once

#ifndef PG_WITH_CUDA
#define PG_WITH_CUDA 1
#endif

#include <cublas_v2.h>

#include "pg_cublas.h" // cuBLAS is opened on first use (see src/backend/pg_cublas.h)
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "kernels.h"

namespace pgcu {

constexpr int WARP = 32;
constexpr int BLOCK = 256;             // threads per block of the 1-D kernels
constexpr int ROWS_PER_BLOCK = BLOCK / WARP; // one warp per row kernels
constexpr int64_t MAX_GRID = 1 << 20;  // grid-stride kernels launch at most this many blocks

inline cudaStream_t stream_of(const pg_cuda_ctx *ctx) { return ctx ? (cudaStream_t)ctx->stream : (cudaStream_t)0; }

// 0, or the launch error (the error of an earlier asynchronous failure too).
inline int launch_status() {
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : (int)e;
}

inline int cublas_status(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS ? 0 : PG_CUDA_CUBLAS_ERR + (int)s; }

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

// bf16 -> float32, exact.
__device__ __forceinline__ float bf16_value(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

// Blocks for a grid-stride loop over n elements.
inline unsigned grid_for(int64_t n, int per_block) {
  int64_t b = (n + per_block - 1) / per_block;
  return (unsigned)(b < 1 ? 1 : (b > MAX_GRID ? MAX_GRID : b));
}

template <typename T> __device__ __forceinline__ T warp_sum(T v) {
  for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over a 1-D block (blockDim.x a multiple of 32, at most 1024); every
// thread gets the result. The leading barrier lets a kernel call it twice.
template <typename T> __device__ T block_sum(T v) {
  __shared__ T part[WARP];
  const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP, nw = blockDim.x / WARP;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) part[wid] = v;
  __syncthreads();
  T r = lane < nw ? part[lane] : T(0);
  return warp_sum(r);
}

__device__ inline float block_max(float v) {
  __shared__ float part[WARP];
  const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP, nw = blockDim.x / WARP;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) part[wid] = v;
  __syncthreads();
  float r = lane < nw ? part[lane] : -INFINITY;
  return warp_max(r);
}

// Row-major sgemm in cblas's terms (CblasRowMajor, the CPU kernels' calls
// verbatim): C[M,N] = alpha op(A) op(B) + beta C. cuBLAS is column-major and a
// row-major matrix is its transpose, so this computes C^T = op(B)^T op(A)^T:
// operands swapped, M and N swapped, the transpose flags unchanged.
inline int gemm_rm(cublasHandle_t h, bool ta, bool tb, int M, int N, int K, float alpha, const float *A, int lda,
                   const float *B, int ldb, float beta, float *C, int ldc) {
  const pg_cublas_api *b = pg_cublas();
  if (!b) return cublas_status(CUBLAS_STATUS_NOT_INITIALIZED);
  return cublas_status(b->Sgemm(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha,
                                   B, ldb, A, lda, &beta, C, ldc));
}

// The same with bf16 A and B (their bits as uint16_t) and a float32 C, through
// GemmEx with CUBLAS_COMPUTE_32F: products and sums in float32 (not the _FAST_
// modes that round the inputs further, nor a 16-bit accumulator).
inline int gemm_rm(cublasHandle_t h, bool ta, bool tb, int M, int N, int K, float alpha, const uint16_t *A, int lda,
                   const uint16_t *B, int ldb, float beta, float *C, int ldc) {
  const pg_cublas_api *b = pg_cublas();
  if (!b) return cublas_status(CUBLAS_STATUS_NOT_INITIALIZED);
  return cublas_status(b->GemmEx(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha,
                                 B, CUDA_R_16BF, ldb, A, CUDA_R_16BF, lda, &beta, C, CUDA_R_32F, ldc,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// The same over `batch` matrices at fixed strides (in floats).
inline int gemm_rm_batched(cublasHandle_t h, bool ta, bool tb, int M, int N, int K, float alpha, const float *A,
                           int lda, long long sa, const float *B, int ldb, long long sb, float beta, float *C, int ldc,
                           long long sc, int batch) {
  const pg_cublas_api *b = pg_cublas();
  if (!b) return cublas_status(CUBLAS_STATUS_NOT_INITIALIZED);
  return cublas_status(b->SgemmStridedBatched(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N,
                                                 M, K, &alpha, B, ldb, sb, A, lda, sa, &beta, C, ldc, sc, batch));
}

// The context's cuBLAS handle bound to its stream, or NULL (PG_CUDA_EINVAL).
inline cublasHandle_t blas_of(const pg_cuda_ctx *ctx) {
  if (!ctx || !ctx->cublas) return nullptr;
  cublasHandle_t h = (cublasHandle_t)ctx->cublas;
  const pg_cublas_api *b = pg_cublas();
  if (!b || b->SetStream(h, stream_of(ctx)) != CUBLAS_STATUS_SUCCESS) return nullptr;
  return h;
}

// dst[c] += sum over r of src[r*ld + c], c < cols (matmul.cu): columns in
// blocks of 32, rows split over 16 thread rows, partials added in row order.
int col_sum_add(cudaStream_t s, float *dst, const float *src, int rows, int64_t cols, int64_t ld);
int col_sum_add(cudaStream_t s, float *dst, const uint16_t *src, int rows, int64_t cols, int64_t ld); // bf16 widened

// out[N,OC] rows = bias[OC] (matmul.cu): the start of a product with a bias,
// which the GEMM then adds to with beta = 1 (sgemm's and the bf16 GemmEx's).
int bias_rows(cudaStream_t s, float *out, const float *bias, int N, int OC);

// A linear layer's products for either operand type T (float, or bf16 bits
// as uint16_t; the output and gradients are float32 either way), one
// definition for pg_cuda_matmul_* and pg_cuda_matmul_bf16_*.
// Forward: out[N,OC] = inp[N,C] @ weight[OC,C]^T (+ bias).
template <typename T>
int linear_forward(const pg_cuda_ctx *ctx, float *out, const T *inp, const T *weight, const float *bias, int N, int C,
                   int OC) {
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
  return gemm_rm(h, false, true, N, OC, C, 1.0f, inp, C, weight, C, beta, out, OC);
}

// Backward: dinp = dout @ weight (NULL: skip), dweight += dout^T @ inp (beta = 1
// accumulates micro-batches into the float32 gradient), dbias += the column
// sums of the float32 output gradient dout_f32 (NULL: of dout's values, widened).
template <typename T>
int linear_backward(const pg_cuda_ctx *ctx, float *dinp, float *dweight, float *dbias, const float *dout_f32,
                    const T *dout, const T *inp, const T *weight, int N, int C, int OC) {
  cudaStream_t s = stream_of(ctx);
  if (N <= 0 || OC <= 0) {
    if (dinp && N > 0 && C > 0) return (int)cudaMemsetAsync(dinp, 0, (size_t)N * C * sizeof(float), s);
    return 0;
  }
  if (C > 0 && (dinp || dweight)) {
    cublasHandle_t h = blas_of(ctx);
    if (!h) return PG_CUDA_EINVAL;
    if (dinp)
      if (int rc = gemm_rm(h, false, false, N, C, OC, 1.0f, dout, OC, weight, C, 0.0f, dinp, C)) return rc;
    if (dweight)
      if (int rc = gemm_rm(h, true, false, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dweight, C)) return rc;
  }
  if (dbias) return dout_f32 ? col_sum_add(s, dbias, dout_f32, N, OC, OC) : col_sum_add(s, dbias, dout, N, OC, OC);
  return 0;
}

} // namespace pgcu
