// Token and position embeddings on the GPU (forward and backward).
#include "common.cuh"

using namespace pgcu;

// One block per token row.
__global__ void embedding_forward_kernel(float *out, const int32_t *tokens, const float *weight, int C,
                                         int row_start, int rows) {
  const int64_t n = blockIdx.x;
  const int64_t r = (int64_t)tokens[n] - row_start; // 64-bit: no overflow for any id/start
  float *o = out + n * C;
  if (r >= 0 && r < rows) {
    const float *w = weight + r * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = w[c];
  } else {
    for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = 0.0f; // another shard's token
  }
}

constexpr int EMB_TILE = 1024; // tokens scanned per step (a multiple of BLOCK)

// Repeated tokens add into the same row, so rows cannot be split across blocks
// without atomics. Instead block n works only if n is the first occurrence of
// its token; it then adds every occurrence's dout row, in increasing n, each
// column by one thread: the order of the CPU kernel, hence its exact bits.
// Scanning is O(N^2 / BLOCK) comparisons, cheap next to the row traffic at
// the sizes used here; a sort-based grouping is the next step if it shows up.
__global__ void embedding_backward_kernel(float *dweight, const float *dout, const int32_t *tokens, int N, int C,
                                          int row_start, int rows) {
  __shared__ unsigned hits[EMB_TILE / WARP];
  const int n = blockIdx.x;
  const int32_t tok = tokens[n];
  const int64_t r = (int64_t)tok - row_start;
  if (r < 0 || r >= rows) return; // the same for the whole block
  // An earlier occurrence owns this token: then stop (a block-uniform answer).
  for (int t0 = 0; t0 < n; t0 += EMB_TILE) {
    int seen = 0;
    for (int i = t0 + (int)threadIdx.x; i < n && i < t0 + EMB_TILE; i += blockDim.x) seen |= tokens[i] == tok;
    if (__syncthreads_or(seen)) return;
  }
  float *dw = dweight + r * C;
  for (int m0 = n; m0 < N; m0 += EMB_TILE) {
    // hit bits of this tile, one 32-bit word per warp-sized group of tokens
    for (int i = threadIdx.x; i < EMB_TILE; i += blockDim.x) {
      const bool hit = m0 + i < N && tokens[m0 + i] == tok;
      const unsigned bits = __ballot_sync(0xffffffffu, hit);
      if (i % WARP == 0) hits[i / WARP] = bits;
    }
    __syncthreads();
    for (int w = 0; w < EMB_TILE / WARP; w++) {
      unsigned bits = hits[w];
      while (bits) {
        const int j = __ffs(bits) - 1;
        bits &= bits - 1;
        const float *d = dout + (int64_t)(m0 + w * WARP + j) * C;
        for (int c = threadIdx.x; c < C; c += blockDim.x) dw[c] += d[c];
      }
    }
    __syncthreads(); // every thread has read hits before the next tile overwrites them
  }
}

// out[n, c] += wpe[n % T, c], flat over N*C elements.
__global__ void position_forward_kernel(float *out, const float *wpe, int64_t total, int T, int C) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t n = i / C, c = i % C;
    out[i] += wpe[(n % T) * C + c];
  }
}

extern "C" int pg_cuda_embedding_forward(const pg_cuda_ctx *ctx, float *out, const int32_t *tokens,
                                         const float *weight, int N, int C, int row_start, int rows) {
  if (N <= 0 || C <= 0) return 0;
  embedding_forward_kernel<<<N, BLOCK, 0, stream_of(ctx)>>>(out, tokens, weight, C, row_start, rows);
  return launch_status();
}

extern "C" int pg_cuda_embedding_backward(const pg_cuda_ctx *ctx, float *dweight, const float *dout,
                                          const int32_t *tokens, int N, int C, int row_start, int rows) {
  if (N <= 0 || C <= 0 || rows <= 0) return 0;
  embedding_backward_kernel<<<N, BLOCK, 0, stream_of(ctx)>>>(dweight, dout, tokens, N, C, row_start, rows);
  return launch_status();
}

extern "C" int pg_cuda_position_forward(const pg_cuda_ctx *ctx, float *out, const float *wpe, int N, int T, int C) {
  if (N <= 0 || T <= 0 || C <= 0) return 0;
  const int64_t total = (int64_t)N * C;
  position_forward_kernel<<<grid_for(total, BLOCK), BLOCK, 0, stream_of(ctx)>>>(out, wpe, total, T, C);
  return launch_status();
}

extern "C" int pg_cuda_position_backward(const pg_cuda_ctx *ctx, float *dwpe, const float *dout, int N, int T,
                                         int C) {
  // dwpe[t, c] += sum over b of dout[b*T + t, c]: the column sums of dout seen
  // as B rows of T*C floats.
  if (T <= 0 || C <= 0 || N / T <= 0) return 0;
  return col_sum_add(stream_of(ctx), dwpe, dout, N / T, (int64_t)T * C, (int64_t)T * C);
}
