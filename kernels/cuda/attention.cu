// Causal self-attention, multi-head or grouped-query, over the fused layout
// [B, T, (NH + 2 NKV) HS] (kernels.h): query head h = kvh * G + g (G = NH /
// NKV query heads per key/value head) attends with key/value head kvh.
//
// Training: flash attention in float32 (pg_attention_forward's contract:
// out and lse, nothing of size T^2), FlashAttention-2's scheme. Query and key
// rows go in tiles of TB; a block's score tile lives in shared memory, and so
// do the tiles of the rows it reads again and again (K and V in the forward
// and the dQ pass, Q and dO in the dK/dV pass) when the head size fits
// HS_STAGED; larger heads read those rows from global memory (the same
// arithmetic). Every output element belongs to one thread of one block, which
// sums its terms in a fixed order: no atomics, the same inputs give the same
// bits.
//   forward: a block per (b, h, query tile) folds the key tiles up to the
//     diagonal into an online softmax (running max m, sum l per row), the
//     unnormalised output accumulated in out itself, then out /= l and
//     lse = m + log l.
//   backward: delta = rowsum(dO * O) (pg_cuda_attention_block_delta); dK, dV:
//     a block per (b, kv head, key tile) walks the group's query heads and the
//     query tiles from the diagonal down, in order, recomputing p = exp(s - lse)
//     and ds = scale p (dO . v - delta); dQ in its own pass: a block per (b, h,
//     query tile) walks the key tiles up to the diagonal in order.
// The score is the CPU's operations in that order (scale * (q . k), then +
// m (kpos - qpos), each rounded); the dot products' order is not the CPU
// sgemm's (the self-test's tolerance).
#include "common.cuh"

using namespace pgcu;

namespace {

constexpr int TB = 32;                 // query rows and key rows per tile
constexpr int NT = 128;                // threads per block
constexpr int NW = NT / WARP;          // warps per block
constexpr int HS_STAGED = 128;         // head sizes up to this stage their row tiles in shared memory
constexpr int TP = TB + 1;             // the score tiles' row pitch (no bank conflicts down a column)

bool bad_shape(int B, int T, int NH, int NKV, int HS) {
  return B < 0 || T < 0 || NH < 0 || NKV <= 0 || HS <= 0 || NH % NKV;
}

// The fused layout of one (b) sequence's heads.
struct qkv_layout {
  int64_t ld, ldo; // row strides of qkv (and dqkv), of out (and dout)
  int NH, NKV, HS;
  __device__ int64_t kcol(int g) const { return (int64_t)(NH + g) * HS; }
  __device__ int64_t vcol(int g) const { return (int64_t)(NH + NKV + g) * HS; }
};

// Rows [0, n) of one head (rows ld apart from src) into tile ([TB][HS], rows HS apart) when HS fits: returns
// where to read the rows from, with their stride in *ldt (the tile, or src itself). The caller syncs.
__device__ const float *stage_rows(float *tile, const float *src, int64_t ld, int n, int HS, int64_t *ldt) {
  if (HS > HS_STAGED) {
    *ldt = ld;
    return src;
  }
  for (int e = threadIdx.x; e < n * HS; e += NT) tile[e] = src[(int64_t)(e / HS) * ld + e % HS];
  *ldt = HS;
  return tile;
}

__device__ __forceinline__ float dot(const float *a, const float *b, int n) {
  float s = 0.0f;
  for (int d = 0; d < n; d++) s += a[d] * b[d];
  return s;
}

// scale (q . k) (+ m (kpos - qpos)), each operation rounded as on the CPU.
__device__ __forceinline__ float score(const float *q, const float *k, int HS, float scale, const float *slope, int kpos,
                                       int qpos) {
  float s = __fmul_rn(scale, dot(q, k, HS));
  if (slope) s = __fadd_rn(s, __fmul_rn(*slope, (float)(kpos - qpos)));
  return s;
}

__global__ void flash_forward_kernel(float *out, float *lse, const float *qkv, const float *slopes, int T,
                                     qkv_layout L, float scale) {
  __shared__ float Ks[TB * HS_STAGED], Vs[TB * HS_STAGED], S[TB * TP], m[TB], l[TB], corr[TB];
  const int64_t bh = blockIdx.x, b = bh / L.NH;
  const int h = (int)(bh % L.NH), g = h / (L.NH / L.NKV), HS = L.HS, tid = threadIdx.x;
  const int warp = tid / WARP, lane = tid % WARP;
  const int i0 = blockIdx.y * TB, nq = T - i0 < TB ? T - i0 : TB;
  const float *row0 = qkv + b * T * L.ld, *q = row0 + (int64_t)i0 * L.ld + (int64_t)h * HS;
  const float *k = row0 + L.kcol(g), *v = row0 + L.vcol(g), *slope = slopes ? slopes + h : nullptr;
  float *o = out + (b * T + i0) * L.ldo + (int64_t)h * HS;
  for (int e = tid; e < nq * HS; e += NT) o[(int64_t)(e / HS) * L.ldo + e % HS] = 0.0f;
  for (int r = tid; r < nq; r += NT) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  for (int j0 = 0; j0 < i0 + nq; j0 += TB) { // key tiles up to the diagonal
    const int nk = T - j0 < TB ? T - j0 : TB;
    __syncthreads(); // the previous tile read (and the start written)
    int64_t ldk, ldv;
    const float *kt = stage_rows(Ks, k + (int64_t)j0 * L.ld, L.ld, nk, HS, &ldk);
    const float *vt = stage_rows(Vs, v + (int64_t)j0 * L.ld, L.ld, nk, HS, &ldv);
    __syncthreads();
    for (int e = tid; e < nq * TB; e += NT) {
      const int r = e / TB, c = e % TB;
      S[r * TP + c] = c < nk && j0 + c <= i0 + r
                          ? score(q + (int64_t)r * L.ld, kt + c * ldk, HS, scale, slope, j0 + c, i0 + r)
                          : -INFINITY;
    }
    __syncthreads();
    for (int r = warp; r < nq; r += NW) { // a warp per row: the online softmax's step
      float mt = -INFINITY;
      for (int c = lane; c < nk; c += WARP) mt = fmaxf(mt, S[r * TP + c]);
      mt = warp_max(mt);
      const float m_old = m[r], m_new = fmaxf(m_old, mt);
      float sum = 0.0f;
      for (int c = lane; c < TB; c += WARP) {
        const bool seen = c < nk && j0 + c <= i0 + r;
        const float p = seen ? expf(S[r * TP + c] - m_new) : 0.0f;
        S[r * TP + c] = p;
        sum += p;
      }
      sum = warp_sum(sum);
      if (lane == 0) { // rescale what is summed so far (from -inf: all of it is 0)
        const float c = m_new != m_old ? expf(m_old - m_new) : 1.0f;
        corr[r] = c;
        l[r] = __fadd_rn(__fmul_rn(l[r], c), sum);
        m[r] = m_new;
      }
    }
    __syncthreads();
    for (int e = tid; e < nq * HS; e += NT) {
      const int r = e / HS, d = e % HS;
      float *od = o + (int64_t)r * L.ldo + d;
      float acc = __fmul_rn(*od, corr[r]);
      for (int c = 0; c < nk; c++) acc += S[r * TP + c] * vt[c * ldv + d];
      *od = acc;
    }
  }
  __syncthreads();
  for (int e = tid; e < nq * HS; e += NT) { // every row has seen key 0: l > 0
    const int r = e / HS, d = e % HS;
    o[(int64_t)r * L.ldo + d] *= 1.0f / l[r];
    if (d == 0) lse[bh * T + i0 + r] = __fadd_rn(m[r], logf(l[r]));
  }
}

// The tile of p = exp(s - lse) and ds = scale p (dO . v - delta) of query rows [i0, i0 + nq) against key rows
// [j0, j0 + nk), 0 where hidden: q, dO (rows ldq, lddo apart), k, v (ldk, ldv) and lse, delta at the tiles'
// first rows.
__device__ void tile_grads(float *P, float *dS, const float *q, int64_t ldq, const float *dO, int64_t lddo,
                           const float *k, int64_t ldk, const float *v, int64_t ldv, const float *lse,
                           const float *delta, int i0, int nq, int j0, int nk, int HS, float scale,
                           const float *slope) {
  for (int e = threadIdx.x; e < TB * TB; e += NT) {
    const int r = e / TB, c = e % TB;
    float p = 0.0f, ds = 0.0f;
    if (r < nq && c < nk && j0 + c <= i0 + r) {
      p = expf(score(q + r * ldq, k + c * ldk, HS, scale, slope, j0 + c, i0 + r) - lse[r]);
      ds = __fmul_rn(__fmul_rn(scale, p), dot(dO + r * lddo, v + c * ldv, HS) - delta[r]);
    }
    P[r * TP + c] = p;
    dS[r * TP + c] = ds;
  }
}

// dK, dV of key tile blockIdx.y of (b, kv head g) = blockIdx.x: the group's heads in order, their query tiles
// from the diagonal on, in order.
__global__ void flash_dkv_kernel(float *dqkv, const float *qkv, const float *dout, const float *lse,
                                 const float *delta, const float *slopes, int T, qkv_layout L, float scale) {
  __shared__ float Qs[TB * HS_STAGED], dOs[TB * HS_STAGED], P[TB * TP], dS[TB * TP];
  const int64_t bg = blockIdx.x, b = bg / L.NKV;
  const int g = (int)(bg % L.NKV), G = L.NH / L.NKV, HS = L.HS, tid = threadIdx.x;
  const int j0 = blockIdx.y * TB, nk = T - j0 < TB ? T - j0 : TB;
  const int64_t base = b * T * L.ld, krow = base + (int64_t)j0 * L.ld;
  const float *k = qkv + krow + L.kcol(g), *v = qkv + krow + L.vcol(g);
  float *dk = dqkv + krow + L.kcol(g), *dv = dqkv + krow + L.vcol(g);
  for (int e = tid; e < nk * HS; e += NT) dk[(int64_t)(e / HS) * L.ld + e % HS] = dv[(int64_t)(e / HS) * L.ld + e % HS] = 0.0f;
  for (int eh = 0; eh < G; eh++) {
    const int h = g * G + eh;
    const float *slope = slopes ? slopes + h : nullptr;
    const int64_t st = (b * L.NH + h) * T;
    for (int i0 = j0; i0 < T; i0 += TB) { // query tiles that see the keys: i >= j0
      const int nq = T - i0 < TB ? T - i0 : TB;
      __syncthreads(); // the previous tile read
      int64_t ldq, lddo;
      const float *qt = stage_rows(Qs, qkv + base + (int64_t)i0 * L.ld + (int64_t)h * HS, L.ld, nq, HS, &ldq);
      const float *dot_ = stage_rows(dOs, dout + (b * T + i0) * L.ldo + (int64_t)h * HS, L.ldo, nq, HS, &lddo);
      __syncthreads();
      tile_grads(P, dS, qt, ldq, dot_, lddo, k, L.ld, v, L.ld, lse + st + i0, delta + st + i0, i0, nq, j0, nk, HS,
                 scale, slope);
      __syncthreads();
      for (int e = tid; e < nk * HS; e += NT) {
        const int c = e / HS, d = e % HS;
        float *dvd = dv + (int64_t)c * L.ld + d, *dkd = dk + (int64_t)c * L.ld + d;
        float sv = *dvd, sk = *dkd;
        for (int r = 0; r < nq; r++) {
          sv += P[r * TP + c] * dot_[r * lddo + d];
          sk += dS[r * TP + c] * qt[r * ldq + d];
        }
        *dvd = sv;
        *dkd = sk;
      }
    }
  }
}

// dQ of query tile blockIdx.y of (b, h) = blockIdx.x: the key tiles up to the diagonal, in order.
__global__ void flash_dq_kernel(float *dqkv, const float *qkv, const float *dout, const float *lse,
                                const float *delta, const float *slopes, int T, qkv_layout L, float scale) {
  __shared__ float Ks[TB * HS_STAGED], Vs[TB * HS_STAGED], P[TB * TP], dS[TB * TP];
  const int64_t bh = blockIdx.x, b = bh / L.NH;
  const int h = (int)(bh % L.NH), g = h / (L.NH / L.NKV), HS = L.HS, tid = threadIdx.x;
  const int i0 = blockIdx.y * TB, nq = T - i0 < TB ? T - i0 : TB;
  const int64_t base = b * T * L.ld, qrow = base + (int64_t)i0 * L.ld + (int64_t)h * HS, st = bh * T + i0;
  const float *q = qkv + qrow, *dO = dout + (b * T + i0) * L.ldo + (int64_t)h * HS;
  const float *slope = slopes ? slopes + h : nullptr;
  float *dq = dqkv + qrow;
  for (int e = tid; e < nq * HS; e += NT) dq[(int64_t)(e / HS) * L.ld + e % HS] = 0.0f;
  for (int j0 = 0; j0 < i0 + nq; j0 += TB) {
    const int nk = T - j0 < TB ? T - j0 : TB;
    __syncthreads();
    int64_t ldk, ldv;
    const float *kt = stage_rows(Ks, qkv + base + (int64_t)j0 * L.ld + L.kcol(g), L.ld, nk, HS, &ldk);
    const float *vt = stage_rows(Vs, qkv + base + (int64_t)j0 * L.ld + L.vcol(g), L.ld, nk, HS, &ldv);
    __syncthreads();
    tile_grads(P, dS, q, L.ld, dO, L.ldo, kt, ldk, vt, ldv, lse + st, delta + st, i0, nq, j0, nk, HS, scale, slope);
    __syncthreads();
    for (int e = tid; e < nq * HS; e += NT) {
      const int r = e / HS, d = e % HS;
      float *dqd = dq + (int64_t)r * L.ld + d;
      float s = *dqd;
      for (int c = 0; c < nk; c++) s += dS[r * TP + c] * kt[c * ldk + d];
      *dqd = s;
    }
  }
}

// The launch grid: x the (b, head) pairs, y the tiles of T; 0 when it does not fit CUDA's limits.
bool flash_grid(int64_t pairs, int T, dim3 *grid) {
  const int64_t tiles = ((int64_t)T + TB - 1) / TB;
  if (pairs > INT32_MAX || tiles > 65535) return false;
  *grid = dim3((unsigned)pairs, (unsigned)tiles);
  return true;
}

} // namespace

extern "C" int64_t pg_cuda_attention_scratch_floats(int64_t rows, int NH) {
  return rows * (NH > 0 ? NH : 1); // delta, one per query row and head
}

extern "C" int pg_cuda_attention_forward(const pg_cuda_ctx *ctx, float *out, float *lse, const float *qkv,
                                         const float *slopes, int B, int T, int NH, int NKV, int HS) {
  if (B <= 0 || T <= 0 || NH <= 0) return 0;
  if (bad_shape(B, T, NH, NKV, HS)) return PG_CUDA_EINVAL;
  dim3 grid;
  if (!flash_grid((int64_t)B * NH, T, &grid)) return PG_CUDA_EINVAL;
  const qkv_layout L = {(int64_t)(NH + 2 * NKV) * HS, (int64_t)NH * HS, NH, NKV, HS};
  flash_forward_kernel<<<grid, NT, 0, stream_of(ctx)>>>(out, lse, qkv, slopes, T, L, 1.0f / sqrtf((float)HS));
  return launch_status();
}

extern "C" int pg_cuda_attention_backward(const pg_cuda_ctx *ctx, float *dqkv, float *scratch, const float *dout,
                                          const float *qkv, const float *out, const float *lse, const float *slopes,
                                          int B, int T, int NH, int NKV, int HS) {
  if (B <= 0 || T <= 0 || NH <= 0) return 0;
  if (bad_shape(B, T, NH, NKV, HS)) return PG_CUDA_EINVAL;
  dim3 qgrid, kgrid;
  if (!flash_grid((int64_t)B * NH, T, &qgrid) || !flash_grid((int64_t)B * NKV, T, &kgrid)) return PG_CUDA_EINVAL;
  const qkv_layout L = {(int64_t)(NH + 2 * NKV) * HS, (int64_t)NH * HS, NH, NKV, HS};
  const float scale = 1.0f / sqrtf((float)HS);
  float *delta = scratch;
  if (int rc = pg_cuda_attention_block_delta(ctx, delta, dout, L.ldo, out, L.ldo, B, T, NH, HS)) return rc;
  cudaStream_t s = stream_of(ctx);
  flash_dkv_kernel<<<kgrid, NT, 0, s>>>(dqkv, qkv, dout, lse, delta, slopes, T, L, scale);
  if (int rc = launch_status()) return rc;
  flash_dq_kernel<<<qgrid, NT, 0, s>>>(dqkv, qkv, dout, lse, delta, slopes, T, L, scale);
  return launch_status();
}

// ---- decoding with a key/value cache (pg_attention_cached) ----
// The new rows' keys and values into the cache (one thread per element), then
// one block per (query row t, head h): its scores against the cached keys
// 0 .. pos + t, the block's max and sum, then each thread one output column.
// The scores go to the scratch in global memory (a block reads back only its
// own row, after a barrier).
__global__ void att_cache_store_kernel(float *kc, float *vc, const float *qkv, int T, int pos, int NH, int NKV,
                                       int HS) {
  const int64_t kvw = (int64_t)NKV * HS, ld = (int64_t)(NH + 2 * NKV) * HS;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < T * kvw; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / kvw, c = i % kvw;
    kc[(pos + t) * kvw + c] = qkv[t * ld + (int64_t)NH * HS + c];
    vc[(pos + t) * kvw + c] = qkv[t * ld + (int64_t)NH * HS + kvw + c];
  }
}

__global__ void att_cached_kernel(float *out, float *scores, const float *kc, const float *vc, const float *qkv,
                                  const float *slopes, int T, int pos, int NH, int NKV, int HS, float scale) {
  const int t = blockIdx.x / NH, h = blockIdx.x % NH, kvh = h / (NH / NKV), at = pos + t, L = pos + T;
  const int64_t kvw = (int64_t)NKV * HS, ld = (int64_t)(NH + 2 * NKV) * HS;
  const float *q = qkv + t * ld + (int64_t)h * HS, *k = kc + (int64_t)kvh * HS, *v = vc + (int64_t)kvh * HS;
  float *p = scores + ((int64_t)h * T + t) * L;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j <= at; j += blockDim.x) {
    float s = 0.0f;
    for (int d = 0; d < HS; d++) s += q[d] * k[j * kvw + d];
    s = __fmul_rn(scale, s);
    if (slopes) s = __fadd_rn(s, __fmul_rn(slopes[h], (float)(j - at)));
    p[j] = s;
    mx = fmaxf(mx, s);
  }
  mx = block_max(mx);
  float sum = 0.0f;
  for (int j = threadIdx.x; j <= at; j += blockDim.x) {
    const float e = expf(p[j] - mx);
    p[j] = e;
    sum += e;
  }
  const float inv = 1.0f / block_sum(sum);
  __syncthreads(); // every thread's probabilities written before any reads them
  for (int d = threadIdx.x; d < HS; d += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j <= at; j++) acc += (p[j] * inv) * v[j * kvw + d];
    out[t * (int64_t)NH * HS + (int64_t)h * HS + d] = acc;
  }
}

extern "C" int pg_cuda_attention_cached(const pg_cuda_ctx *ctx, float *out, float *scores, float *kcache,
                                        float *vcache, const float *qkv, const float *slopes, int T, int pos, int NH,
                                        int NKV, int HS) {
  if (T <= 0 || NH <= 0) return 0;
  if (pos < 0 || bad_shape(1, T, NH, NKV, HS) || (int64_t)T * NH > INT32_MAX) return PG_CUDA_EINVAL;
  cudaStream_t st = stream_of(ctx);
  att_cache_store_kernel<<<grid_for((int64_t)T * NKV * HS, BLOCK), BLOCK, 0, st>>>(kcache, vcache, qkv, T, pos, NH,
                                                                                    NKV, HS);
  if (int rc = launch_status()) return rc;
  att_cached_kernel<<<(unsigned)(T * NH), 128, 0, st>>>(out, scores, kcache, vcache, qkv, slopes, T, pos, NH, NKV, HS,
                                                         1.0f / sqrtf((float)HS));
  return launch_status();
}
