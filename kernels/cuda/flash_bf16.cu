// Causal flash attention on bf16 q|k|v with tensor-core products (WMMA 16x16x16, bf16 operands, float32
// accumulators): kernels.h's pg_cuda_flash_bf16_* (the contract is pg_flash_bf16_*'s there).
//
// Every warp works alone on 16 rows (a WMMA tile): no block barrier, only __syncwarp between a fragment's
// store to the warp's shared scratch and the lanes' reads of it. WMMA does not say which lane holds which
// element of a fragment, so row-wise work (the softmax's max, sum and rescale, the masks) goes through that
// scratch: lane l owns row l / 2 and 8 columns (l % 2) * 8 .. + 7 of every 16-column tile, in registers.
//
// Forward (one warp per 16 query rows of one head): keys in steps of 64 up to the diagonal; per step the
// scores S = Q K^T (float32; scaled, plus ALiBi's slope (j - i) with slopes), the running max and sum of an online softmax in float32, P = exp(S - max)
// rounded to bf16 for the product P V (FlashAttention's rounding: the normaliser sums the float32 P), and the
// output rows rescaled in the lanes' registers. out = acc / sum, lse = max + log(sum).
// Backward (FlashAttention-2's scheme, deterministic): delta = rowsum(dO * out) per row (one warp per row);
// dK and dV per 16 key rows of a kv head, walking the group's query heads and then the query tiles from the
// diagonal down, in that fixed order, in WMMA accumulators; dQ in a pass of its own per 16 query rows, keys
// in order. P and dS are recomputed from lse and rounded to bf16 for their products. No atomics: every
// element of dqkv is written once, by one warp.
#include "common.cuh"

#include <cuda_bf16.h>
#include <mma.h>

using namespace pgcu;
namespace wmma = nvcuda::wmma;

namespace {

constexpr int TILE = 16;                // WMMA's m = n = k
constexpr int TILE_ELEMS = TILE * TILE; // a 16x16 tile
constexpr int WARPS = 4;                // warps per block (each on its own 16 rows)
constexpr int STEP_TILES = 4;           // forward: key tiles per online-softmax step (64 keys)

typedef wmma::fragment<wmma::matrix_a, TILE, TILE, TILE, __nv_bfloat16, wmma::row_major> frag_a;
typedef wmma::fragment<wmma::matrix_a, TILE, TILE, TILE, __nv_bfloat16, wmma::col_major> frag_a_t; // A^T read
typedef wmma::fragment<wmma::matrix_b, TILE, TILE, TILE, __nv_bfloat16, wmma::row_major> frag_b;
typedef wmma::fragment<wmma::matrix_b, TILE, TILE, TILE, __nv_bfloat16, wmma::col_major> frag_b_t; // B^T read
typedef wmma::fragment<wmma::accumulator, TILE, TILE, TILE, float> frag_c;

__device__ __forceinline__ const __nv_bfloat16 *bf(const uint16_t *p) {
  return reinterpret_cast<const __nv_bfloat16 *>(p);
}

// C (16x16) = A (16 x D, rows lda apart) times B^T where B is 16 x D (rows ldb apart): the rows' dot products
// (Q K^T, dO V^T), over D in tiles of 16.
template <int D>
__device__ void rows_dot(frag_c &c, const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb) {
  wmma::fill_fragment(c, 0.0f);
  for (int t = 0; t < D / TILE; t++) {
    frag_a fa;
    frag_b_t fb;
    wmma::load_matrix_sync(fa, bf(a + t * TILE), (unsigned)lda);
    wmma::load_matrix_sync(fb, bf(b + t * TILE), (unsigned)ldb);
    wmma::mma_sync(c, fa, fb, c);
  }
}

// The same with A's tiles already in fragments (the forward's query rows, loaded once).
template <int D> __device__ void rows_dot(frag_c &c, const frag_a *a, const uint16_t *b, int64_t ldb) {
  wmma::fill_fragment(c, 0.0f);
  for (int t = 0; t < D / TILE; t++) {
    frag_b_t fb;
    wmma::load_matrix_sync(fb, bf(b + t * TILE), (unsigned)ldb);
    wmma::mma_sync(c, a[t], fb, c);
  }
}

// The lane's 8 values of a 16x16 accumulator (row lane / 2, columns (lane % 2) * 8 + e), through the warp's
// scratch.
__device__ __forceinline__ void lane_values(float v[8], float *scratch, const frag_c &c, int lane) {
  wmma::store_matrix_sync(scratch, c, TILE, wmma::mem_row_major);
  __syncwarp();
  const float *row = scratch + (lane >> 1) * TILE + (lane & 1) * 8;
  for (int e = 0; e < 8; e++) v[e] = row[e];
  __syncwarp(); // the scratch is free again
}

// A visible score: scale (q . k), with ALiBi (slope not NULL) plus slope (kj - qi), each operation rounded as the
// float32 kernels' (kernels/cuda/attention.cu's score, the CPU's score_tile) are.
__device__ __forceinline__ float alibi_score(float dot, float scale, const float *slope, int kj, int qi) {
  const float s = __fmul_rn(dot, scale);
  return slope ? __fadd_rn(s, __fmul_rn(*slope, (float)(kj - qi))) : s;
}

// An accumulator tile stored as float32 at f (rows ld apart; NULL: not) and as its bf16 rounding at h (NULL: not),
// the latter through the warp's scratch (WMMA stores float32 accumulators only).
__device__ void store_tile(float *f, uint16_t *h, int64_t ld, const frag_c &c, float *sc, int lane) {
  if (f) wmma::store_matrix_sync(f, c, (unsigned)ld, wmma::mem_row_major);
  if (!h) return;
  float v[8];
  lane_values(v, sc, c, lane);
  uint16_t *row = h + (int64_t)(lane >> 1) * ld + (lane & 1) * 8;
  for (int e = 0; e < 8; e++) row[e] = bf16_round_bits(v[e]);
}

// ---- forward ----

template <int D>
__global__ void flash_bf16_forward_kernel(float *out, uint16_t *out16, float *lse, const uint16_t *qkv,
                                          const float *slopes, int T, int NH, int NKV, float scale) {
  alignas(32) __shared__ float scratch[WARPS][TILE_ELEMS];
  alignas(32) __shared__ uint16_t ptile[WARPS][TILE * STEP_TILES * TILE];
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int q0 = (blockIdx.x * WARPS + warp) * TILE, h = blockIdx.y, b = blockIdx.z, g = h / (NH / NKV);
  if (q0 >= T) return; // the whole warp
  const int64_t W = (int64_t)(NH + 2 * NKV) * D, C = (int64_t)NH * D;
  const uint16_t *base = qkv + (int64_t)b * T * W;
  const uint16_t *q = base + (int64_t)q0 * W + (int64_t)h * D, *k = base + (int64_t)(NH + g) * D;
  const uint16_t *v = base + (int64_t)(NH + NKV + g) * D;
  const float *slope = slopes ? slopes + h : nullptr;
  float *sc = scratch[warp];
  uint16_t *pt = ptile[warp];
  const int row = lane >> 1, col0 = (lane & 1) * 8, qi = q0 + row;
  frag_a qa[D / TILE];
  for (int t = 0; t < D / TILE; t++) wmma::load_matrix_sync(qa[t], bf(q + t * TILE), (unsigned)W);

  float o[D / TILE][8];
  for (int t = 0; t < D / TILE; t++)
    for (int e = 0; e < 8; e++) o[t][e] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  const int kend = q0 + TILE; // keys 0 .. q0 + 15 (T % 16 == 0: all below T)
  for (int k0 = 0; k0 < kend; k0 += STEP_TILES * TILE) {
    // every row sees key k0 <= q0 (k0 and q0 are multiples of 16, k0 < q0 + 16): the step's max is finite
    const int nt = (kend - k0) / TILE < STEP_TILES ? (kend - k0) / TILE : STEP_TILES;
    float s[STEP_TILES][8], mt = -INFINITY;
    for (int j = 0; j < STEP_TILES; j++) {
      if (j < nt) {
        frag_c acc;
        rows_dot<D>(acc, qa, k + (int64_t)(k0 + j * TILE) * W, W);
        lane_values(s[j], sc, acc, lane);
        for (int e = 0; e < 8; e++) {
          const int kj = k0 + j * TILE + col0 + e;
          s[j][e] = kj <= qi ? alibi_score(s[j][e], scale, slope, kj, qi) : -INFINITY;
          mt = fmaxf(mt, s[j][e]);
        }
      } else {
        for (int e = 0; e < 8; e++) s[j][e] = -INFINITY;
      }
    }
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1)); // the row's other lane
    const float mn = fmaxf(m, mt), alpha = expf(m - mn);   // m = -inf at first: alpha 0
    float rs = 0.0f;
    for (int j = 0; j < STEP_TILES; j++)
      for (int e = 0; e < 8; e++) {
        const float p = expf(s[j][e] - mn); // masked: 0
        rs += p;
        pt[row * (STEP_TILES * TILE) + j * TILE + col0 + e] = bf16_round_bits(p);
      }
    rs += __shfl_xor_sync(0xffffffffu, rs, 1);
    l = l * alpha + rs;
    m = mn;
    __syncwarp(); // P is in shared memory
    frag_a pa[STEP_TILES];
    for (int j = 0; j < STEP_TILES; j++)
      if (j < nt) wmma::load_matrix_sync(pa[j], bf(pt + j * TILE), STEP_TILES * TILE);
    for (int t = 0; t < D / TILE; t++) {
      frag_c acc;
      wmma::fill_fragment(acc, 0.0f);
      for (int j = 0; j < STEP_TILES; j++)
        if (j < nt) {
          frag_b vb;
          wmma::load_matrix_sync(vb, bf(v + (int64_t)(k0 + j * TILE) * W + t * TILE), (unsigned)W);
          wmma::mma_sync(acc, pa[j], vb, acc);
        }
      float pv[8];
      lane_values(pv, sc, acc, lane);
      for (int e = 0; e < 8; e++) o[t][e] = o[t][e] * alpha + pv[e];
    }
  }
  const int64_t at = ((int64_t)b * T + qi) * C + (int64_t)h * D + col0;
  for (int t = 0; t < D / TILE; t++)
    for (int e = 0; e < 8; e++) {
      const float v = o[t][e] / l;
      out[at + t * TILE + e] = v;
      if (out16) out16[at + t * TILE + e] = bf16_round_bits(v); // the module's bf16 output, in this pass
    }
  if ((lane & 1) == 0) lse[((int64_t)b * NH + h) * T + qi] = m + logf(l);
}

// ---- backward ----

// delta[b, h, t] = sum over d of dO * out (float32, a fixed butterfly): one warp per row of one head.
__global__ void flash_bf16_delta_kernel(float *delta, const uint16_t *dout, const float *out, int B, int T, int NH,
                                        int HS) {
  const int lane = threadIdx.x % WARP;
  const int64_t rows = (int64_t)B * T * NH, stride = (int64_t)gridDim.x * (BLOCK / WARP);
  for (int64_t r = (int64_t)blockIdx.x * (BLOCK / WARP) + threadIdx.x / WARP; r < rows; r += stride) {
    const int h = (int)(r % NH); // rows (b, t, h), h fastest
    const int64_t bt = r / NH, b = bt / T, t = bt % T;
    const uint16_t *g = dout + bt * NH * HS + (int64_t)h * HS;
    const float *o = out + bt * NH * HS + (int64_t)h * HS;
    float s = 0.0f;
    for (int d = lane; d < HS; d += WARP) s += bf16_value(g[d]) * o[d];
    s = warp_sum(s);
    if (lane == 0) delta[(b * NH + h) * T + t] = s;
  }
}

// One 16x16 tile of queries q0.. (rows of q and dO at qp, dp) against keys k0.. (rows of k and v at kp, vp):
// P = exp(score - lse) (causal mask; alibi_score), dS = scale P (dO V^T - delta), rounded to bf16 into the warp's pt and
// dst ([query][key], row-major, 16 apart).
template <int D>
__device__ void p_ds_tile(uint16_t *pt, uint16_t *dst, float *sc, const uint16_t *qp, const uint16_t *dp,
                          const uint16_t *kp, const uint16_t *vp, int64_t W, int64_t C, int q0, int k0, float lse_row,
                          float delta_row, float scale, const float *slope, int lane) {
  const int row = lane >> 1, col0 = (lane & 1) * 8;
  frag_c acc;
  float p[8], dpv[8];
  rows_dot<D>(acc, qp, W, kp, W);
  lane_values(p, sc, acc, lane);
  for (int e = 0; e < 8; e++) {
    const int kj = k0 + col0 + e, qi = q0 + row;
    p[e] = kj <= qi ? expf(alibi_score(p[e], scale, slope, kj, qi) - lse_row) : 0.0f;
  }
  rows_dot<D>(acc, dp, C, vp, W);
  lane_values(dpv, sc, acc, lane);
  for (int e = 0; e < 8; e++) {
    pt[row * TILE + col0 + e] = bf16_round_bits(p[e]);
    dst[row * TILE + col0 + e] = bf16_round_bits(p[e] * (dpv[e] - delta_row) * scale);
  }
  __syncwarp(); // P and dS are in shared memory
}

// dK and dV of 16 key rows of kv head g: over the group's query heads in order, each over the query tiles from
// the diagonal on, in order.
template <int D>
__global__ void flash_bf16_dkv_kernel(float *dqkv, uint16_t *dqkv16, const uint16_t *dout, const uint16_t *qkv,
                                      const float *lse, const float *delta, const float *slopes, int T, int NH,
                                      int NKV, float scale) {
  alignas(32) __shared__ float scratch[WARPS][TILE_ELEMS];
  alignas(32) __shared__ uint16_t ptile[WARPS][TILE_ELEMS], dstile[WARPS][TILE_ELEMS];
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int k0 = (blockIdx.x * WARPS + warp) * TILE, g = blockIdx.y, b = blockIdx.z, rep = NH / NKV;
  if (k0 >= T) return;
  const int64_t W = (int64_t)(NH + 2 * NKV) * D, C = (int64_t)NH * D;
  const uint16_t *base = qkv + (int64_t)b * T * W;
  const uint16_t *kp = base + (int64_t)k0 * W + (int64_t)(NH + g) * D;
  const uint16_t *vp = base + (int64_t)k0 * W + (int64_t)(NH + NKV + g) * D;
  const int row = lane >> 1;
  frag_c dk[D / TILE], dv[D / TILE];
  for (int t = 0; t < D / TILE; t++) wmma::fill_fragment(dk[t], 0.0f), wmma::fill_fragment(dv[t], 0.0f);
  for (int h = g * rep; h < (g + 1) * rep; h++) {
    const int64_t st = ((int64_t)b * NH + h) * T;
    for (int q0 = k0; q0 < T; q0 += TILE) {
      const uint16_t *qp = base + (int64_t)q0 * W + (int64_t)h * D;
      const uint16_t *dp = dout + ((int64_t)b * T + q0) * C + (int64_t)h * D;
      p_ds_tile<D>(ptile[warp], dstile[warp], scratch[warp], qp, dp, kp, vp, W, C, q0, k0, lse[st + q0 + row],
                   delta[st + q0 + row], scale, slopes ? slopes + h : nullptr, lane);
      frag_a_t pa, dsa; // P^T and dS^T: the tiles read column-major
      wmma::load_matrix_sync(pa, bf(ptile[warp]), TILE);
      wmma::load_matrix_sync(dsa, bf(dstile[warp]), TILE);
      for (int t = 0; t < D / TILE; t++) {
        frag_b fb;
        wmma::load_matrix_sync(fb, bf(dp + t * TILE), (unsigned)C);
        wmma::mma_sync(dv[t], pa, fb, dv[t]); // dV += P^T dO
        wmma::load_matrix_sync(fb, bf(qp + t * TILE), (unsigned)W);
        wmma::mma_sync(dk[t], dsa, fb, dk[t]); // dK += dS^T Q
      }
    }
  }
  const int64_t dk_at = ((int64_t)b * T + k0) * W + (int64_t)(NH + g) * D, dv_at = dk_at + (int64_t)NKV * D;
  for (int t = 0; t < D / TILE; t++) {
    store_tile(dqkv ? dqkv + dk_at + t * TILE : nullptr, dqkv16 ? dqkv16 + dk_at + t * TILE : nullptr, W, dk[t],
               scratch[warp], lane);
    store_tile(dqkv ? dqkv + dv_at + t * TILE : nullptr, dqkv16 ? dqkv16 + dv_at + t * TILE : nullptr, W, dv[t],
               scratch[warp], lane);
  }
}

// dQ of 16 query rows of head h: keys up to the diagonal, in order.
template <int D>
__global__ void flash_bf16_dq_kernel(float *dqkv, uint16_t *dqkv16, const uint16_t *dout, const uint16_t *qkv,
                                     const float *lse, const float *delta, const float *slopes, int T, int NH, int NKV,
                                     float scale) {
  alignas(32) __shared__ float scratch[WARPS][TILE_ELEMS];
  alignas(32) __shared__ uint16_t ptile[WARPS][TILE_ELEMS], dstile[WARPS][TILE_ELEMS];
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int q0 = (blockIdx.x * WARPS + warp) * TILE, h = blockIdx.y, b = blockIdx.z, g = h / (NH / NKV);
  if (q0 >= T) return;
  const int64_t W = (int64_t)(NH + 2 * NKV) * D, C = (int64_t)NH * D, st = ((int64_t)b * NH + h) * T;
  const uint16_t *base = qkv + (int64_t)b * T * W;
  const uint16_t *qp = base + (int64_t)q0 * W + (int64_t)h * D;
  const uint16_t *dp = dout + ((int64_t)b * T + q0) * C + (int64_t)h * D;
  const int row = lane >> 1;
  const float lse_row = lse[st + q0 + row], delta_row = delta[st + q0 + row];
  frag_c dq[D / TILE];
  for (int t = 0; t < D / TILE; t++) wmma::fill_fragment(dq[t], 0.0f);
  for (int k0 = 0; k0 <= q0; k0 += TILE) {
    const uint16_t *kp = base + (int64_t)k0 * W + (int64_t)(NH + g) * D;
    const uint16_t *vp = base + (int64_t)k0 * W + (int64_t)(NH + NKV + g) * D;
    p_ds_tile<D>(ptile[warp], dstile[warp], scratch[warp], qp, dp, kp, vp, W, C, q0, k0, lse_row, delta_row, scale,
                 slopes ? slopes + h : nullptr, lane);
    frag_a dsa;
    wmma::load_matrix_sync(dsa, bf(dstile[warp]), TILE);
    for (int t = 0; t < D / TILE; t++) {
      frag_b kb;
      wmma::load_matrix_sync(kb, bf(kp + t * TILE), (unsigned)W);
      wmma::mma_sync(dq[t], dsa, kb, dq[t]); // dQ += dS K
    }
  }
  const int64_t dq_at = ((int64_t)b * T + q0) * W + (int64_t)h * D;
  for (int t = 0; t < D / TILE; t++)
    store_tile(dqkv ? dqkv + dq_at + t * TILE : nullptr, dqkv16 ? dqkv16 + dq_at + t * TILE : nullptr, W, dq[t],
               scratch[warp], lane);
}

// WMMA loads and stores want 32-byte aligned tiles: every tile starts at a multiple of 16 elements from the
// buffer, so the buffers' starts must be.
bool aligned32(const void *p) { return ((uintptr_t)p & 31u) == 0; }

dim3 tiles_grid(int T, int heads, int B) { return dim3((unsigned)((T / TILE + WARPS - 1) / WARPS), heads, B); }

template <int D>
int forward_hs(cudaStream_t s, float *out, uint16_t *out16, float *lse, const uint16_t *qkv, const float *slopes, int B,
               int T, int NH, int NKV) {
  // one name per launch: the emulator's rewrite takes the launched name as it stands
  auto forward = flash_bf16_forward_kernel<D>;
  forward<<<tiles_grid(T, NH, B), WARPS * WARP, 0, s>>>(out, out16, lse, qkv, slopes, T, NH, NKV,
                                                        1.0f / sqrtf((float)D));
  return launch_status();
}

template <int D>
int backward_hs(cudaStream_t s, float *dqkv, uint16_t *dqkv16, const float *delta, const uint16_t *dout,
                const uint16_t *qkv, const float *lse, const float *slopes, int B, int T, int NH, int NKV) {
  const float scale = 1.0f / sqrtf((float)D);
  auto dkv = flash_bf16_dkv_kernel<D>;
  dkv<<<tiles_grid(T, NKV, B), WARPS * WARP, 0, s>>>(dqkv, dqkv16, dout, qkv, lse, delta, slopes, T, NH, NKV,
                                                     scale);
  if (int rc = launch_status()) return rc;
  auto dq = flash_bf16_dq_kernel<D>;
  dq<<<tiles_grid(T, NH, B), WARPS * WARP, 0, s>>>(dqkv, dqkv16, dout, qkv, lse, delta, slopes, T, NH, NKV, scale);
  return launch_status();
}

} // namespace

extern "C" int pg_cuda_flash_bf16_forward(const pg_cuda_ctx *ctx, float *out, uint16_t *out16, float *lse,
                                          const uint16_t *qkv, const float *slopes, int B, int T, int NH, int NKV,
                                          int HS) {
  if (pg_flash_bf16_unsupported(B, T, NH, NKV, HS) || !aligned32(out) || !aligned32(qkv)) return PG_CUDA_EINVAL;
  cudaStream_t s = stream_of(ctx);
  return HS == 64 ? forward_hs<64>(s, out, out16, lse, qkv, slopes, B, T, NH, NKV)
                  : forward_hs<128>(s, out, out16, lse, qkv, slopes, B, T, NH, NKV);
}

extern "C" int pg_cuda_flash_bf16_backward(const pg_cuda_ctx *ctx, float *dqkv, uint16_t *dqkv16, float *delta,
                                           const uint16_t *dout, const float *out, const uint16_t *qkv,
                                           const float *lse, const float *slopes, int B, int T, int NH, int NKV,
                                           int HS) {
  if (pg_flash_bf16_unsupported(B, T, NH, NKV, HS) || (!dqkv && !dqkv16) || (dqkv && !aligned32(dqkv)) ||
      !aligned32(dout) || !aligned32(qkv))
    return PG_CUDA_EINVAL;
  cudaStream_t s = stream_of(ctx);
  const int64_t rows = (int64_t)B * T * NH;
  flash_bf16_delta_kernel<<<grid_for(rows, BLOCK / WARP), BLOCK, 0, s>>>(delta, dout, out, B, T, NH, HS);
  if (int rc = launch_status()) return rc;
  return HS == 64 ? backward_hs<64>(s, dqkv, dqkv16, delta, dout, qkv, lse, slopes, B, T, NH, NKV)
                  : backward_hs<128>(s, dqkv, dqkv16, delta, dout, qkv, lse, slopes, B, T, NH, NKV);
}
