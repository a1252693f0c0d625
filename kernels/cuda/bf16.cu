// Precision bf16 on the GPU: float32 -> bf16 rounding and the bf16 GEMMs
// (cublasGemmEx: bf16 inputs, float32 sums and output). bf16 values are their
// bits (uint16_t), as on the CPU (kernels.h), so no cuda_bf16.h type crosses
// the C interface.
#include "common.cuh"

using namespace pgcu;

__global__ void bf16_from_f32_kernel(uint16_t *dst, const float *src, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = bf16_round_bits(src[i]);
}

extern "C" int pg_cuda_bf16_from_f32(const pg_cuda_ctx *ctx, uint16_t *dst, const float *src, int64_t n) {
  if (n <= 0) return 0;
  bf16_from_f32_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(dst, src, n);
  return launch_status();
}

__global__ void bf16_to_f32_kernel(float *dst, const uint16_t *src, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = bf16_value(src[i]);
}

extern "C" int pg_cuda_bf16_to_f32(const pg_cuda_ctx *ctx, float *dst, const uint16_t *src, int64_t n) {
  if (n <= 0) return 0;
  bf16_to_f32_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(dst, src, n);
  return launch_status();
}

// The products: common.cuh's linear_forward / linear_backward with bf16
// operands (gemm_rm's GemmEx overload: float32 products and sums).
extern "C" int pg_cuda_matmul_bf16_forward(const pg_cuda_ctx *ctx, float *out, const uint16_t *inp,
                                           const uint16_t *weight, const float *bias, int N, int C, int OC) {
  return linear_forward(ctx, out, inp, weight, bias, N, C, OC);
}

extern "C" int pg_cuda_matmul_bf16_backward(const pg_cuda_ctx *ctx, float *dinp, float *dweight, float *dbias,
                                            const float *dout_f32, const uint16_t *dout, const uint16_t *inp,
                                            const uint16_t *weight, int N, int C, int OC) {
  return linear_backward(ctx, dinp, dweight, dbias, dout_f32, dout, inp, weight, N, C, OC);
}
