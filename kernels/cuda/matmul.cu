// Linear layers through cuBLAS sgemm. weight is [OC, C] (torch layout); the
// products are the CPU kernel's cblas calls, translated by gemm_rm.
#include "common.cuh"

using namespace pgcu;

namespace pgcu {

constexpr int CS_COLS = WARP; // columns per block (one warp wide: coalesced rows)
constexpr int CS_ROWS = 16;   // thread rows per block

__device__ __forceinline__ float widened(float v) { return v; }
__device__ __forceinline__ float widened(uint16_t v) { return bf16_value(v); }

// dst[c] += sum_r src[r*ld + c] (float32, or bf16 widened: the same sums of the same values). Thread (x, y) adds
// rows y, y + 16, ... of its column; thread row 0 then adds the 16 partials in order.
template <typename T>
__global__ void col_sum_add_kernel(float *dst, const T *src, int rows, int64_t cols, int64_t ld) {
  __shared__ float part[CS_ROWS][CS_COLS + 1];
  const int64_t c = (int64_t)blockIdx.x * CS_COLS + threadIdx.x;
  float acc = 0.0f;
  if (c < cols)
    for (int r = threadIdx.y; r < rows; r += CS_ROWS) acc += widened(src[(int64_t)r * ld + c]);
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float s = 0.0f;
    for (int y = 0; y < CS_ROWS; y++) s += part[y][threadIdx.x];
    dst[c] += s;
  }
}

template <typename T> int col_sum_add_of(cudaStream_t s, float *dst, const T *src, int rows, int64_t cols, int64_t ld) {
  if (rows <= 0 || cols <= 0) return 0;
  const int64_t blocks = (cols + CS_COLS - 1) / CS_COLS;
  if (blocks > 0x7fffffff) return PG_CUDA_EINVAL;
  // one name per launch: the emulator's rewrite takes the launched name as it stands
  auto sum = col_sum_add_kernel<T>;
  sum<<<(unsigned)blocks, dim3(CS_COLS, CS_ROWS), 0, s>>>(dst, src, rows, cols, ld);
  return launch_status();
}

int col_sum_add(cudaStream_t s, float *dst, const float *src, int rows, int64_t cols, int64_t ld) {
  return col_sum_add_of(s, dst, src, rows, cols, ld);
}

int col_sum_add(cudaStream_t s, float *dst, const uint16_t *src, int rows, int64_t cols, int64_t ld) {
  return col_sum_add_of(s, dst, src, rows, cols, ld);
}

// out[n, :] = bias, flat over N*OC elements (then sgemm adds the product, beta = 1).
__global__ void bias_rows_kernel(float *out, const float *bias, int64_t total, int OC) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = bias[i % OC];
}

int bias_rows(cudaStream_t s, float *out, const float *bias, int N, int OC) {
  const int64_t total = (int64_t)N * OC;
  bias_rows_kernel<<<grid_for(total, BLOCK), BLOCK, 0, s>>>(out, bias, total, OC);
  return launch_status();
}

} // namespace pgcu

extern "C" int pg_cuda_matmul_forward(const pg_cuda_ctx *ctx, float *out, const float *inp, const float *weight,
                                      const float *bias, int N, int C, int OC) {
  return linear_forward(ctx, out, inp, weight, bias, N, C, OC);
}

extern "C" int pg_cuda_matmul_backward(const pg_cuda_ctx *ctx, float *dinp, float *dweight, float *dbias,
                                       const float *dout, const float *inp, const float *weight, int N, int C,
                                       int OC) {
  return linear_backward(ctx, dinp, dweight, dbias, dout, dout, inp, weight, N, C, OC);
}
