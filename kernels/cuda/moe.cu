// Mixture of experts on the GPU: the router (softmax, top-k, renormalised weights) and its backward, the routing
// totals, capacity, grouping by expert, and the gather / combine of the grouped rows. The experts' products are
// the backend's GEMMs (cuBLAS), one per expert.
//
// Integer decisions never differ from the CPU's on the same inputs: top-k compares logits (exact everywhere),
// capacity and grouping are the CPU's integer scans in its order. The float arithmetic is the CPU kernel's, in
// its order, each operation rounded on its own (_rn: never contracted into an FMA); only expf and log may round
// differently from the host's libm (CUDA's expf: within 2 ulp), so probabilities, weights and lse agree to a few
// ulp on a GPU and bit for bit on the emulator. Correctness first: one thread per row (routing), per sequence
// (capacity) or per output value (gather, combine), and grouping in one block.
#include "common.cuh"
#include "moe_pick.h"

using namespace pgcu;

#define GRID_STRIDE(i, n) \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

__global__ void moe_route_forward_kernel(float *probs, float *lse, int32_t *expert, float *weight,
                                         const float *logits, int N, int E, int K) {
  GRID_STRIDE(n, N) {
    const float *l = logits + n * E;
    float *p = probs + n * E;
    float mx = l[0];
    for (int e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
    double sum = 0;
    for (int e = 0; e < E; e++) {
      p[e] = expf(__fsub_rn(l[e], mx));
      sum += (double)p[e];
    }
    const float inv = (float)(1.0 / sum);
    for (int e = 0; e < E; e++) p[e] = __fmul_rn(p[e], inv);
    lse[n] = __fadd_rn(mx, (float)log(sum));
    int32_t *ex = expert + n * K;
    float *w = weight + n * K;
    float chosen = 0;
    for (int k = 0; k < K; k++) {
      const int best = pg_moe_pick(l, E, ex, k);
      ex[k] = best;
      w[k] = p[best];
      chosen = __fadd_rn(chosen, p[best]);
    }
    for (int k = 0; k < K; k++) w[k] = __fdiv_rn(w[k], chosen);
  }
}

__global__ void moe_route_backward_kernel(float *dlogits, const float *dweight, const float *dprob, float zscale,
                                          const float *probs, const float *lse, const int32_t *expert,
                                          const float *weight, int N, int E, int K) {
  GRID_STRIDE(n, N) {
    const float *p = probs + n * E;
    const int32_t *ex = expert + n * K;
    const float *w = weight + n * K, *dw = dweight + n * K;
    float *dl = dlogits + n * E;
    for (int e = 0; e < E; e++) dl[e] = dprob ? dprob[e] : 0.0f;
    float s = 0, dot = 0;
    for (int k = 0; k < K; k++) {
      s = __fadd_rn(s, p[ex[k]]);
      dot = __fadd_rn(dot, __fmul_rn(dw[k], w[k]));
    }
    for (int k = 0; k < K; k++) dl[ex[k]] = __fadd_rn(dl[ex[k]], __fdiv_rn(__fsub_rn(dw[k], dot), s));
    float pdp = 0;
    for (int e = 0; e < E; e++) pdp = __fadd_rn(pdp, __fmul_rn(p[e], dl[e]));
    const float z = __fmul_rn(__fmul_rn(2.0f, zscale), lse[n]);
    for (int e = 0; e < E; e++) dl[e] = __fadd_rn(__fmul_rn(p[e], __fsub_rn(dl[e], pdp)), __fmul_rn(z, p[e]));
  }
}

// One thread per expert, over the rows in order: the CPU's sums.
__global__ void moe_route_stats_kernel(double *counts, double *psum, const float *probs, const int32_t *expert,
                                       int N, int E, int K) {
  GRID_STRIDE(e, E) {
    double c = 0, ps = 0;
    for (int64_t n = 0; n < N; n++) {
      for (int k = 0; k < K; k++) c += expert[n * K + k] == e ? 1 : 0;
      ps += (double)probs[n * E + e];
    }
    counts[e] = c;
    psum[e] = ps;
  }
}

// One thread per sequence, the CPU's scan.
__global__ void moe_drop_kernel(int32_t *pos, int32_t *fill, const int32_t *expert, int N, int T, int E, int K,
                                int cap) {
  const int64_t nseq = ((int64_t)N + T - 1) / T;
  GRID_STRIDE(q, nseq) {
    int32_t *f = fill + q * E;
    const int64_t t0 = q * T, t1 = t0 + T < N ? t0 + T : N;
    for (int e = 0; e < E; e++) f[e] = 0;
    for (int j = 0; j < K; j++)
      for (int64_t t = t0; t < t1; t++) {
        const int64_t i = t * K + j;
        pos[i] = f[expert[i]]++ < cap ? 0 : -1;
      }
  }
}

// One block: each thread owns experts e = threadIdx.x, + blockDim.x, ... and touches only their choices; the
// offsets' prefix sum in between is thread 0's.
__global__ void moe_group_kernel(int32_t *pos, int32_t *token, int32_t *offsets, const int32_t *expert, int N, int E,
                                 int K) {
  const int64_t R = (int64_t)N * K;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t c = 0;
    for (int64_t i = 0; i < R; i++) c += expert[i] == e && pos[i] >= 0;
    offsets[e + 1] = c;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    offsets[0] = 0;
    for (int e = 0; e < E; e++) offsets[e + 1] += offsets[e];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t r = offsets[e];
    for (int64_t i = 0; i < R; i++)
      if (expert[i] == e && pos[i] >= 0) {
        pos[i] = r;
        token[r++] = (int32_t)(i / K);
      }
  }
}

__global__ void moe_gather_kernel(float *xg, const float *x, const int32_t *token, int64_t n, int D) {
  GRID_STRIDE(i, n) xg[i] = x[(int64_t)token[i / D] * D + i % D];
}

__global__ void moe_combine_kernel(float *out, const float *ye, const int32_t *pos, const float *weight, int64_t n,
                                   int K, int D) {
  GRID_STRIDE(i, n) {
    const int64_t t = i / D, d = i % D;
    float acc = 0;
    for (int j = 0; j < K; j++) {
      const int32_t p = pos[t * K + j];
      if (p < 0) continue;
      acc = __fadd_rn(acc, __fmul_rn(weight ? weight[t * K + j] : 1.0f, ye[(int64_t)p * D + d]));
    }
    out[i] = acc;
  }
}

// dweight: one thread per choice, summed in order of d.
__global__ void moe_dweight_kernel(float *dweight, const float *dy, const float *ye, const int32_t *pos, int64_t R,
                                   int K, int D) {
  GRID_STRIDE(i, R) {
    float acc = 0;
    if (pos[i] >= 0) {
      const float *a = dy + (i / K) * D, *b = ye + (int64_t)pos[i] * D;
      for (int d = 0; d < D; d++) acc = __fadd_rn(acc, __fmul_rn(a[d], b[d]));
    }
    dweight[i] = acc;
  }
}

// dyg: one thread per value of the kept choices' rows.
__global__ void moe_scatter_kernel(float *dyg, const float *dy, const int32_t *pos, const float *weight, int64_t n,
                                   int K, int D) {
  GRID_STRIDE(v, n) {
    const int64_t i = v / D, d = v % D;
    if (pos[i] >= 0) dyg[(int64_t)pos[i] * D + d] = __fmul_rn(weight[i], dy[(i / K) * D + d]);
  }
}

extern "C" int pg_cuda_moe_route_forward(const pg_cuda_ctx *ctx, float *probs, float *lse, int32_t *expert,
                                         float *weight, const float *logits, int N, int E, int K) {
  if (N <= 0 || E <= 0 || K <= 0) return 0;
  moe_route_forward_kernel<<<grid_for(N, BLOCK), BLOCK, 0, stream_of(ctx)>>>(probs, lse, expert, weight, logits, N,
                                                                             E, K);
  return launch_status();
}

extern "C" int pg_cuda_moe_route_backward(const pg_cuda_ctx *ctx, float *dlogits, const float *dweight,
                                          const float *dprob, float zscale, const float *probs, const float *lse,
                                          const int32_t *expert, const float *weight, int N, int E, int K) {
  if (N <= 0 || E <= 0 || K <= 0) return 0;
  moe_route_backward_kernel<<<grid_for(N, BLOCK), BLOCK, 0, stream_of(ctx)>>>(dlogits, dweight, dprob, zscale, probs,
                                                                              lse, expert, weight, N, E, K);
  return launch_status();
}

extern "C" int pg_cuda_moe_route_stats(const pg_cuda_ctx *ctx, double *counts, double *psum, const float *probs,
                                       const int32_t *expert, int N, int E, int K) {
  if (E <= 0) return 0;
  moe_route_stats_kernel<<<grid_for(E, BLOCK), BLOCK, 0, stream_of(ctx)>>>(counts, psum, probs, expert, N, E, K);
  return launch_status();
}

extern "C" int pg_cuda_moe_drop(const pg_cuda_ctx *ctx, int32_t *pos, int32_t *fill, const int32_t *expert, int N,
                                int T, int E, int K, int cap) {
  if (N <= 0 || T <= 0 || E <= 0 || K <= 0) return 0;
  const int64_t nseq = ((int64_t)N + T - 1) / T;
  moe_drop_kernel<<<grid_for(nseq, BLOCK), BLOCK, 0, stream_of(ctx)>>>(pos, fill, expert, N, T, E, K, cap);
  return launch_status();
}

extern "C" int pg_cuda_moe_group(const pg_cuda_ctx *ctx, int32_t *pos, int32_t *token, int32_t *offsets,
                                 const int32_t *expert, int N, int E, int K) {
  if (E <= 0) return 0;
  moe_group_kernel<<<1, E < BLOCK ? E : BLOCK, 0, stream_of(ctx)>>>(pos, token, offsets, expert, N, E, K);
  return launch_status();
}

extern "C" int pg_cuda_moe_gather(const pg_cuda_ctx *ctx, float *xg, const float *x, const int32_t *token, int R,
                                  int D) {
  const int64_t n = (int64_t)R * D;
  if (n <= 0) return 0;
  moe_gather_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(xg, x, token, n, D);
  return launch_status();
}

extern "C" int pg_cuda_moe_combine(const pg_cuda_ctx *ctx, float *out, const float *ye, const int32_t *pos,
                                   const float *weight, int N, int K, int D) {
  const int64_t n = (int64_t)N * D;
  if (n <= 0) return 0;
  moe_combine_kernel<<<grid_for(n, BLOCK), BLOCK, 0, stream_of(ctx)>>>(out, ye, pos, weight, n, K, D);
  return launch_status();
}

extern "C" int pg_cuda_moe_combine_backward(const pg_cuda_ctx *ctx, float *dweight, float *dyg, const float *dy,
                                            const float *ye, const int32_t *pos, const float *weight, int N, int K,
                                            int D) {
  const int64_t R = (int64_t)N * K;
  if (R <= 0) return 0;
  moe_dweight_kernel<<<grid_for(R, BLOCK), BLOCK, 0, stream_of(ctx)>>>(dweight, dy, ye, pos, R, K, D);
  if (D > 0)
    moe_scatter_kernel<<<grid_for(R * D, BLOCK), BLOCK, 0, stream_of(ctx)>>>(dyg, dy, pos, weight, R * D, K, D);
  return launch_status();
}
