// Elementwise ops on the GPU: GELU (tanh approximation), SwiGLU and the residual add.
// The CPU kernel's formulas, with CUDA's expf (within 2 ulp).
#include "common.cuh"

using namespace pgcu;

#define PG_GELU_K 0.7978845608028654f // sqrt(2/pi)
#define PG_GELU_A 0.044715f

#define GRID_STRIDE(i, n) \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

// The formulas, one device function each, shared by the float32 and bf16
// kernels (the bf16 ones widen their inputs exactly and round each result).

// 0.5 (1 + tanh u) = 1 / (1 + e^(-2u)): no cancellation when tanh u is near -1.
__device__ __forceinline__ float gelu_value(float x) {
  const float u = PG_GELU_K * (x + PG_GELU_A * x * x * x);
  return x / (1.0f + expf(-2.0f * u)); // e = inf for very negative u: x / inf = 0
}

// d/dx [x s] = s + 2 x s (1 - s) u', s = 1 / (1 + e), e = e^(-2u), u' = k (1 + 3 a x^2);
// 1 - s = e s when e < 1 (s near 1: no cancellation).
__device__ __forceinline__ float gelu_slope(float x) {
  const float u = PG_GELU_K * (x + PG_GELU_A * x * x * x);
  const float du = PG_GELU_K * (1.0f + 3.0f * PG_GELU_A * x * x);
  const float e = expf(-2.0f * u);
  const float s = 1.0f / (1.0f + e);
  const float one_s = e < 1.0f ? e * s : 1.0f - s;
  return s + 2.0f * x * s * one_s * du;
}

// silu(g) u, silu(g) = g / (1 + e^-g) (e^-g = inf for very negative g: silu = -0, as on the CPU).
__device__ __forceinline__ float swiglu_value(float g, float u) {
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

// s = 1 / (1 + e^-g): d/dg = dout u s (1 + g (1 - s)), d/du = dout g s.
__device__ __forceinline__ void swiglu_slopes(float g, float u, float dy, float *dg, float *du) {
  const float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)));
  *du = __fmul_rn(dy, __fmul_rn(g, s));
  *dg = __fmul_rn(__fmul_rn(dy, u), __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, s)))));
}

__global__ void gelu_forward_kernel(float *out, const float *inp, int64_t n) {
  GRID_STRIDE(i, n) out[i] = gelu_value(inp[i]);
}

__global__ void gelu_backward_kernel(float *dinp, const float *inp, const float *dout, int64_t n) {
  GRID_STRIDE(i, n) dinp[i] = dout[i] * gelu_slope(inp[i]);
}

__global__ void gelu_bf16_forward_kernel(uint16_t *out, const uint16_t *inp, int64_t n) {
  GRID_STRIDE(i, n) out[i] = bf16_round_bits(gelu_value(bf16_value(inp[i])));
}

__global__ void gelu_bf16_backward_kernel(uint16_t *dinp, const uint16_t *inp, const uint16_t *dout, int64_t n) {
  GRID_STRIDE(i, n) dinp[i] = bf16_round_bits(bf16_value(dout[i]) * gelu_slope(bf16_value(inp[i])));
}

// SwiGLU over rows of [gate | up] (H columns each).
__global__ void swiglu_forward_kernel(float *out, const float *inp, int64_t n, int H) {
  GRID_STRIDE(i, n) {
    const int64_t r = i / H, c = i % H;
    out[i] = swiglu_value(inp[2 * r * H + c], inp[2 * r * H + H + c]);
  }
}

__global__ void swiglu_backward_kernel(float *dinp, const float *inp, const float *dout, int64_t n, int H) {
  GRID_STRIDE(i, n) {
    const int64_t r = i / H, c = i % H, gi = 2 * r * H + c, ui = gi + H;
    swiglu_slopes(inp[gi], inp[ui], dout[i], &dinp[gi], &dinp[ui]);
  }
}

__global__ void swiglu_bf16_forward_kernel(uint16_t *out, const uint16_t *inp, int64_t n, int H) {
  GRID_STRIDE(i, n) {
    const int64_t r = i / H, c = i % H;
    out[i] = bf16_round_bits(swiglu_value(bf16_value(inp[2 * r * H + c]), bf16_value(inp[2 * r * H + H + c])));
  }
}

__global__ void swiglu_bf16_backward_kernel(uint16_t *dinp, const uint16_t *inp, const uint16_t *dout, int64_t n,
                                            int H) {
  GRID_STRIDE(i, n) {
    const int64_t r = i / H, c = i % H, gi = 2 * r * H + c, ui = gi + H;
    float dg, du;
    swiglu_slopes(bf16_value(inp[gi]), bf16_value(inp[ui]), bf16_value(dout[i]), &dg, &du);
    dinp[gi] = bf16_round_bits(dg);
    dinp[ui] = bf16_round_bits(du);
  }
}

__global__ void residual_forward_kernel(float *out, const float *a, const float *b, int64_t n) {
  GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}

__global__ void residual_bf16_forward_kernel(float *out, const float *a, const uint16_t *b, int64_t n) {
  GRID_STRIDE(i, n) out[i] = a[i] + bf16_value(b[i]);
}

// acc += dout (acc: da or db).
__global__ void accumulate_kernel(float *acc, const float *dout, int64_t n) {
  GRID_STRIDE(i, n) acc[i] += dout[i];
}

extern "C" int pg_cuda_gelu_forward(const pg_cuda_ctx *ctx, float *out, const float *inp, int64_t n) {
  if (n <= 0) return 0;
  gelu_forward_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(out, inp, n);
  return launch_status();
}

extern "C" int pg_cuda_gelu_backward(const pg_cuda_ctx *ctx, float *dinp, const float *inp, const float *dout,
                                     int64_t n) {
  if (n <= 0) return 0;
  gelu_backward_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(dinp, inp, dout, n);
  return launch_status();
}

extern "C" int pg_cuda_swiglu_forward(const pg_cuda_ctx *ctx, float *out, const float *inp, int N, int H) {
  if (N <= 0 || H <= 0) return 0;
  const int64_t n = (int64_t)N * H;
  swiglu_forward_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(out, inp, n, H);
  return launch_status();
}

extern "C" int pg_cuda_swiglu_backward(const pg_cuda_ctx *ctx, float *dinp, const float *inp, const float *dout, int N,
                                       int H) {
  if (N <= 0 || H <= 0) return 0;
  const int64_t n = (int64_t)N * H;
  swiglu_backward_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(dinp, inp, dout, n, H);
  return launch_status();
}

extern "C" int pg_cuda_residual_forward(const pg_cuda_ctx *ctx, float *out, const float *a, const float *b,
                                        int64_t n) {
  if (n <= 0) return 0;
  residual_forward_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(out, a, b, n);
  return launch_status();
}

extern "C" int pg_cuda_residual_backward(const pg_cuda_ctx *ctx, float *da, float *db, const float *dout,
                                         int64_t n) {
  if (n <= 0) return 0;
  if (da) {
    accumulate_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(da, dout, n);
    if (int rc = launch_status()) return rc;
  }
  if (db) {
    accumulate_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(db, dout, n);
    return launch_status();
  }
  return 0;
}

extern "C" int pg_cuda_gelu_bf16_forward(const pg_cuda_ctx *ctx, uint16_t *out, const uint16_t *inp, int64_t n) {
  if (n <= 0) return 0;
  gelu_bf16_forward_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(out, inp, n);
  return launch_status();
}

extern "C" int pg_cuda_gelu_bf16_backward(const pg_cuda_ctx *ctx, uint16_t *dinp, const uint16_t *inp,
                                          const uint16_t *dout, int64_t n) {
  if (n <= 0) return 0;
  gelu_bf16_backward_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(dinp, inp, dout, n);
  return launch_status();
}

extern "C" int pg_cuda_swiglu_bf16_forward(const pg_cuda_ctx *ctx, uint16_t *out, const uint16_t *inp, int N, int H) {
  if (N <= 0 || H <= 0) return 0;
  const int64_t n = (int64_t)N * H;
  swiglu_bf16_forward_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(out, inp, n, H);
  return launch_status();
}

extern "C" int pg_cuda_swiglu_bf16_backward(const pg_cuda_ctx *ctx, uint16_t *dinp, const uint16_t *inp,
                                            const uint16_t *dout, int N, int H) {
  if (N <= 0 || H <= 0) return 0;
  const int64_t n = (int64_t)N * H;
  swiglu_bf16_backward_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(dinp, inp, dout, n, H);
  return launch_status();
}

extern "C" int pg_cuda_residual_bf16_forward(const pg_cuda_ctx *ctx, float *out, const float *a, const uint16_t *b,
                                             int64_t n) {
  if (n <= 0) return 0;
  residual_bf16_forward_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(out, a, b, n);
  return launch_status();
}
