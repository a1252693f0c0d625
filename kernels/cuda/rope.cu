// Rotary position embeddings, transformers' rotate_half convention (kernels.h),
// in place. One thread per rotated pair (v[i], v[i + HS/2]) of a head; the
// CPU kernel's arithmetic with separately rounded operations (no FMA), so the
// same values.
#include "common.cuh"

using namespace pgcu;

// An element of a rotated row, float32 or bf16 (widened on load, rounded once on store).
__device__ __forceinline__ float rope_load(float v) { return v; }
__device__ __forceinline__ float rope_load(uint16_t v) { return bf16_value(v); }
__device__ __forceinline__ void rope_store(float *p, float v) { *p = v; }
__device__ __forceinline__ void rope_store(uint16_t *p, float v) { *p = bf16_round_bits(v); }

// sign = +1: rotate by the position's angle (forward); -1: by its opposite
// (backward, the transpose). Rows of float32 or of bf16 (the same operations on the widened values).
template <typename E>
__global__ void rope_kernel(E *x, const float *cos_t, const float *sin_t, int64_t pairs, int T, int heads, int half,
                            int HS, int ld, float sign) {
  for (int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; p < pairs; p += (int64_t)gridDim.x * blockDim.x) {
    const int i = (int)(p % half);
    const int64_t nh = p / half;
    const int h = (int)(nh % heads);
    const int64_t n = nh / heads;
    const int64_t t = n % T;
    E *v = x + n * ld + (int64_t)h * HS;
    const float c = cos_t[t * half + i], sn = sign * sin_t[t * half + i];
    const float a = rope_load(v[i]), b = rope_load(v[i + half]);
    rope_store(&v[i], __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, sn)));
    rope_store(&v[i + half], __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, sn)));
  }
}

template <typename E>
static int rope(const pg_cuda_ctx *ctx, E *x, const float *cos_t, const float *sin_t, int N, int T, int heads, int HS,
                int ld, float sign) {
  if (N <= 0 || T <= 0 || heads <= 0 || HS < 2) return 0;
  const int half = HS / 2;
  const int64_t pairs = (int64_t)N * heads * half;
  // one name per launch: the emulator's rewrite takes the launched name as it stands
  auto kernel = rope_kernel<E>;
  kernel<<<grid_for(pairs, BLOCK), BLOCK, 0, stream_of(ctx)>>>(x, cos_t, sin_t, pairs, T, heads, half, HS, ld, sign);
  return launch_status();
}

extern "C" int pg_cuda_rope_bf16_forward(const pg_cuda_ctx *ctx, uint16_t *x, const float *cos_t, const float *sin_t,
                                         int N, int T, int heads, int HS, int ld) {
  return rope(ctx, x, cos_t, sin_t, N, T, heads, HS, ld, 1.0f);
}

extern "C" int pg_cuda_rope_forward(const pg_cuda_ctx *ctx, float *x, const float *cos_t, const float *sin_t, int N,
                                    int T, int heads, int HS, int ld) {
  return rope(ctx, x, cos_t, sin_t, N, T, heads, HS, ld, 1.0f);
}

extern "C" int pg_cuda_rope_backward(const pg_cuda_ctx *ctx, float *dx, const float *cos_t, const float *sin_t, int N,
                                     int T, int heads, int HS, int ld) {
  return rope(ctx, dx, cos_t, sin_t, N, T, heads, HS, ld, -1.0f);
}
