// Block attention for context parallelism's ring (kernels.h's
// pg_attention_block_*), the CPU kernels' contract on the device.
//
// Simple and deterministic rather than fast: the forward and the query
// gradient take one block per (batch row, head, query row), the key and
// value gradients one block per (batch row, kv head, key row), walking the
// group's query heads in order and their visible queries. Keys (queries) go
// in tiles of BLK: each warp takes the tile's rows w, w + NWARP, ..., its
// lanes the columns of the dot products (a fixed butterfly, warp_sum), lane
// 0 writes the row's probability to shared memory, then each thread adds the
// tile into its own output columns in row order. Every sum has a fixed
// partition and order and no atomics, so the same inputs give the same bits.
// The score is the CPU's operations in that order (scale * (q . k), then +
// m (kpos - qpos), each rounded); the dot product's partition is not the CPU
// sgemm's (the self-test's tolerance).
#include "common.cuh"

using namespace pgcu;

namespace {

constexpr int BLK = 128;          // threads per block = keys (or queries) per tile
constexpr int NWARP = BLK / WARP; // warps per block

bool bad_block_shape(int B, int Tq, int Tk, int NH, int NKV, int HS) {
  return B < 0 || Tq < 0 || Tk < 0 || NH < 0 || NKV <= 0 || HS <= 0 || NH % NKV;
}

// The number of keys of the block visible at query position qpos: keys j with k_pos0 + j <= qpos.
__device__ __forceinline__ int visible(int64_t qpos, int64_t k_pos0, int Tk) {
  const int64_t n = qpos - k_pos0 + 1;
  return n <= 0 ? 0 : (n >= Tk ? Tk : (int)n);
}

// a . b over n columns, lanes over the columns, every lane of the warp gets the sum.
__device__ __forceinline__ float warp_dot(const float *a, const float *b, int n) {
  float s = 0.0f;
  for (int d = threadIdx.x % WARP; d < n; d += WARP) s = __fadd_rn(s, __fmul_rn(a[d], b[d]));
  return warp_sum(s);
}

// scale (q . k) (+ m (kpos - qpos)), each operation rounded as on the CPU; a warp's lanes together.
__device__ __forceinline__ float warp_score(const float *q, const float *k, int HS, float scale, const float *slope,
                                            int64_t kpos, int64_t qpos) {
  float s = __fmul_rn(scale, warp_dot(q, k, HS));
  if (slope) s = __fadd_rn(s, __fmul_rn(*slope, (float)(kpos - qpos)));
  return s;
}

// Block (b, h, i) = blockIdx.x = (b NH + h) Tq + i, the index of its mx and sm.
__global__ void block_forward_kernel(float *acc, float *mx, float *sm, const float *q, int64_t qs, const float *k,
                                     const float *v, int64_t kvs, const float *slopes, int Tq, int Tk, int NH, int G,
                                     int HS, int64_t q_pos0, int64_t k_pos0, float scale) {
  const int64_t row = blockIdx.x, bh = row / Tq, b = bh / NH;
  const int i = (int)(row % Tq), h = (int)(bh % NH), g = h / G, tid = threadIdx.x;
  const int64_t qpos = q_pos0 + i;
  const int n = visible(qpos, k_pos0, Tk);
  if (n == 0) return; // the whole block: the row's state unchanged
  const float *qr = q + (b * Tq + i) * qs + (int64_t)h * HS;
  const float *kb = k + b * Tk * kvs + (int64_t)g * HS, *vb = v + b * Tk * kvs + (int64_t)g * HS;
  float *a = acc + (b * Tq + i) * (int64_t)NH * HS + (int64_t)h * HS;
  const float *slope = slopes ? slopes + h : nullptr;
  __shared__ float p[BLK];
  const int warp = tid / WARP, lane = tid % WARP;
  float lmax = -INFINITY;
  for (int j = warp; j < n; j += NWARP)
    lmax = fmaxf(lmax, warp_score(qr, kb + j * kvs, HS, scale, slope, k_pos0 + j, qpos));
  lmax = block_max(lmax);
  const float m_old = mx[row], m_new = fmaxf(m_old, lmax);
  const float c = m_new != m_old ? expf(m_old - m_new) : 1.0f; // from -inf: 0
  for (int d = tid; d < HS; d += BLK) a[d] = __fmul_rn(a[d], c); // each thread keeps its own columns below
  float lsum = 0.0f; // lane 0 of each warp: its rows' probabilities
  for (int j0 = 0; j0 < n; j0 += BLK) {
    const int nt = n - j0 < BLK ? n - j0 : BLK;
    __syncthreads(); // the previous tile read
    for (int jj = warp; jj < nt; jj += NWARP) {
      const float e = expf(warp_score(qr, kb + (j0 + jj) * kvs, HS, scale, slope, k_pos0 + j0 + jj, qpos) - m_new);
      if (lane == 0) {
        p[jj] = e;
        lsum += e;
      }
    }
    __syncthreads();
    for (int d = tid; d < HS; d += BLK) {
      float s = a[d];
      for (int jj = 0; jj < nt; jj++) s = __fadd_rn(s, __fmul_rn(p[jj], vb[(j0 + jj) * kvs + d]));
      a[d] = s;
    }
  }
  lsum = block_sum(lsum);
  if (tid == 0) {
    mx[row] = m_new;
    sm[row] = __fadd_rn(__fmul_rn(sm[row], c), lsum);
  }
}

// One thread per element (b, i, h, d) of acc [B, Tq, NH, HS].
__global__ void block_finish_kernel(float *out, int64_t os, float *lse, const float *acc, const float *mx,
                                    const float *sm, int Tq, int NH, int HS, int64_t total) {
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
    const int d = (int)(e % HS);
    const int64_t rh = e / HS, r = rh / NH; // r = b Tq + i
    const int h = (int)(rh % NH);
    const int64_t b = r / Tq, i = r % Tq, st = (b * NH + h) * Tq + i;
    const float s = sm[st];
    out[r * os + (int64_t)h * HS + d] = s == 0.0f ? 0.0f : __fmul_rn(acc[e], 1.0f / s);
    if (d == 0) lse[st] = s == 0.0f ? -INFINITY : __fadd_rn(mx[st], logf(s));
  }
}

// One warp per row (b, h, i) = (b NH + h) Tq + i of delta.
__global__ void block_delta_kernel(float *delta, const float *dout, int64_t dos, const float *out, int64_t os,
                                   int Tq, int NH, int HS, int64_t rows) {
  const int lane = threadIdx.x % WARP;
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
  if (row >= rows) return;
  const int64_t bh = row / Tq, b = bh / NH, i = row % Tq, h = bh % NH;
  const float *x = dout + (b * Tq + i) * dos + h * HS, *y = out + (b * Tq + i) * os + h * HS;
  float s = 0.0f;
  for (int d = lane; d < HS; d += WARP) s += x[d] * y[d];
  s = warp_sum(s);
  if (lane == 0) delta[row] = s;
}

// dq: one block per (b, h, i) as the forward.
__global__ void block_dq_kernel(float *dq, int64_t dqs, const float *q, int64_t qs, const float *k, const float *v,
                                int64_t kvs, const float *dout, int64_t dos, const float *lse, const float *delta,
                                const float *slopes, int Tq, int Tk, int NH, int G, int HS, int64_t q_pos0,
                                int64_t k_pos0, float scale) {
  const int64_t row = blockIdx.x, bh = row / Tq, b = bh / NH;
  const int i = (int)(row % Tq), h = (int)(bh % NH), g = h / G, tid = threadIdx.x;
  const int64_t qpos = q_pos0 + i;
  const int n = visible(qpos, k_pos0, Tk);
  if (n == 0) return;
  const float *qr = q + (b * Tq + i) * qs + (int64_t)h * HS, *dor = dout + (b * Tq + i) * dos + (int64_t)h * HS;
  const float *kb = k + b * Tk * kvs + (int64_t)g * HS, *vb = v + b * Tk * kvs + (int64_t)g * HS;
  float *dqr = dq + (b * Tq + i) * dqs + (int64_t)h * HS;
  const float *slope = slopes ? slopes + h : nullptr;
  const float l = lse[row], dl = delta[row];
  __shared__ float ds[BLK];
  const int warp = tid / WARP, lane = tid % WARP;
  for (int j0 = 0; j0 < n; j0 += BLK) {
    const int nt = n - j0 < BLK ? n - j0 : BLK;
    __syncthreads();
    for (int jj = warp; jj < nt; jj += NWARP) {
      const int j = j0 + jj;
      const float p = expf(warp_score(qr, kb + j * kvs, HS, scale, slope, k_pos0 + j, qpos) - l);
      const float dp = warp_dot(dor, vb + j * kvs, HS);
      if (lane == 0) ds[jj] = __fmul_rn(__fmul_rn(scale, p), dp - dl);
    }
    __syncthreads();
    for (int d = tid; d < HS; d += BLK) {
      float s = dqr[d];
      for (int jj = 0; jj < nt; jj++) s = __fadd_rn(s, __fmul_rn(ds[jj], kb[(j0 + jj) * kvs + d]));
      dqr[d] = s;
    }
  }
}

// dk, dv: one block per (b, g, j) = (b NKV + g) Tk + j; the group's heads in order, their visible queries in
// tiles.
__global__ void block_dkv_kernel(float *dk, float *dv, int64_t dkvs, const float *q, int64_t qs, const float *k,
                                 const float *v, int64_t kvs, const float *dout, int64_t dos, const float *lse,
                                 const float *delta, const float *slopes, int Tq, int Tk, int NH, int NKV, int HS,
                                 int64_t q_pos0, int64_t k_pos0, float scale) {
  const int64_t row = blockIdx.x, bg = row / Tk, b = bg / NKV;
  const int j = (int)(row % Tk), g = (int)(bg % NKV), G = NH / NKV, tid = threadIdx.x;
  const int64_t kpos = k_pos0 + j, first = kpos - q_pos0; // queries i >= first see this key
  if (first >= Tq) return;
  const int i0 = first < 0 ? 0 : (int)first;
  const float *kr = k + (b * Tk + j) * kvs + (int64_t)g * HS, *vr = v + (b * Tk + j) * kvs + (int64_t)g * HS;
  float *dkr = dk + (b * Tk + j) * dkvs + (int64_t)g * HS, *dvr = dv + (b * Tk + j) * dkvs + (int64_t)g * HS;
  __shared__ float sp[BLK], sds[BLK];
  const int warp = tid / WARP, lane = tid % WARP;
  for (int e = 0; e < G; e++) {
    const int h = g * G + e;
    const float *slope = slopes ? slopes + h : nullptr;
    const float *qh = q + b * Tq * qs + (int64_t)h * HS, *doh = dout + b * Tq * dos + (int64_t)h * HS;
    const int64_t st0 = (b * NH + h) * Tq;
    for (int t0 = i0; t0 < Tq; t0 += BLK) {
      const int nt = Tq - t0 < BLK ? Tq - t0 : BLK;
      __syncthreads();
      for (int ii = warp; ii < nt; ii += NWARP) {
        const int i = t0 + ii;
        const float p = expf(warp_score(qh + i * qs, kr, HS, scale, slope, kpos, q_pos0 + i) - lse[st0 + i]);
        const float dp = warp_dot(doh + i * dos, vr, HS);
        if (lane == 0) {
          sp[ii] = p;
          sds[ii] = __fmul_rn(__fmul_rn(scale, p), dp - delta[st0 + i]);
        }
      }
      __syncthreads();
      for (int d = tid; d < HS; d += BLK) {
        float sv = dvr[d], sk = dkr[d];
        for (int ii = 0; ii < nt; ii++) {
          sv = __fadd_rn(sv, __fmul_rn(sp[ii], doh[(t0 + ii) * dos + d]));
          sk = __fadd_rn(sk, __fmul_rn(sds[ii], qh[(t0 + ii) * qs + d]));
        }
        dvr[d] = sv;
        dkr[d] = sk;
      }
    }
  }
}

} // namespace

extern "C" int pg_cuda_attention_block_forward(const pg_cuda_ctx *ctx, float *acc, float *mx, float *sm,
                                               const float *q, int64_t q_stride, const float *k, const float *v,
                                               int64_t kv_stride, const float *slopes, int B, int Tq, int Tk, int NH,
                                               int NKV, int HS, int64_t q_pos0, int64_t k_pos0) {
  if (bad_block_shape(B, Tq, Tk, NH, NKV, HS)) return PG_CUDA_EINVAL;
  if (B == 0 || Tq == 0 || Tk == 0 || NH == 0) return 0;
  const int64_t blocks = (int64_t)B * NH * Tq;
  if (blocks > INT32_MAX) return PG_CUDA_EINVAL;
  block_forward_kernel<<<(unsigned)blocks, BLK, 0, stream_of(ctx)>>>(acc, mx, sm, q, q_stride, k, v, kv_stride, slopes,
                                                                     Tq, Tk, NH, NH / NKV, HS, q_pos0, k_pos0,
                                                                     1.0f / sqrtf((float)HS));
  return launch_status();
}

extern "C" int pg_cuda_attention_block_finish(const pg_cuda_ctx *ctx, float *out, int64_t out_stride, float *lse,
                                              const float *acc, const float *mx, const float *sm, int B, int Tq,
                                              int NH, int HS) {
  if (B < 0 || Tq < 0 || NH < 0 || HS <= 0) return PG_CUDA_EINVAL;
  const int64_t total = (int64_t)B * Tq * NH * HS;
  if (total == 0) return 0;
  block_finish_kernel<<<grid_for(total, BLOCK), BLOCK, 0, stream_of(ctx)>>>(out, out_stride, lse, acc, mx, sm, Tq, NH,
                                                                             HS, total);
  return launch_status();
}

extern "C" int pg_cuda_attention_block_delta(const pg_cuda_ctx *ctx, float *delta, const float *dout,
                                             int64_t dout_stride, const float *out, int64_t out_stride, int B, int Tq,
                                             int NH, int HS) {
  if (B < 0 || Tq < 0 || NH < 0 || HS <= 0) return PG_CUDA_EINVAL;
  const int64_t rows = (int64_t)B * NH * Tq;
  if (rows == 0) return 0;
  const int64_t blocks = (rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;
  if (blocks > INT32_MAX) return PG_CUDA_EINVAL;
  block_delta_kernel<<<(unsigned)blocks, BLOCK, 0, stream_of(ctx)>>>(delta, dout, dout_stride, out, out_stride, Tq, NH,
                                                                      HS, rows);
  return launch_status();
}

extern "C" int pg_cuda_attention_block_backward(const pg_cuda_ctx *ctx, float *dq, int64_t dq_stride, float *dk,
                                                float *dv, int64_t dkv_stride, const float *q, int64_t q_stride,
                                                const float *k, const float *v, int64_t kv_stride, const float *dout,
                                                int64_t dout_stride, const float *lse, const float *delta,
                                                const float *slopes, int B, int Tq, int Tk, int NH, int NKV, int HS,
                                                int64_t q_pos0, int64_t k_pos0) {
  if (bad_block_shape(B, Tq, Tk, NH, NKV, HS)) return PG_CUDA_EINVAL;
  if (B == 0 || Tq == 0 || Tk == 0 || NH == 0) return 0;
  const int64_t qblocks = (int64_t)B * NH * Tq, kblocks = (int64_t)B * NKV * Tk;
  if (qblocks > INT32_MAX || kblocks > INT32_MAX) return PG_CUDA_EINVAL;
  const float scale = 1.0f / sqrtf((float)HS);
  cudaStream_t s = stream_of(ctx);
  block_dq_kernel<<<(unsigned)qblocks, BLK, 0, s>>>(dq, dq_stride, q, q_stride, k, v, kv_stride, dout, dout_stride,
                                                     lse, delta, slopes, Tq, Tk, NH, NH / NKV, HS, q_pos0, k_pos0,
                                                     scale);
  if (int rc = launch_status()) return rc;
  block_dkv_kernel<<<(unsigned)kblocks, BLK, 0, s>>>(dk, dv, dkv_stride, q, q_stride, k, v, kv_stride, dout,
                                                      dout_stride, lse, delta, slopes, Tq, Tk, NH, NKV, HS, q_pos0,
                                                      k_pos0, scale);
  return launch_status();
}
