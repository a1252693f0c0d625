/* kernels.h — the arithmetic border.
 *
 * One function per op and direction. Every array is float32 (token ids
 * int32), row-major and contiguous. N is the number of token rows (batch x
 * time), C a feature width, OC an output width, V a vocabulary width.
 * No MPI, no Lua, no allocation: scratch is passed in by the caller.
 *
 * Conventions, for every backward:
 *   - input gradients (dinp, dqkv, dx...) are OVERWRITTEN;
 *   - parameter gradients (dweight, dbias...) are ACCUMULATED (+=), so
 *     micro-batches add up in the same buffer;
 *   - a NULL gradient pointer means "not needed": skip that product.
 * Results are deterministic for a given thread count (static partitions,
 * fixed reduction order), so replicas on different ranks agree bitwise.
 *
 * The kernels the runtime calls through the backend seam are also rows of
 * kernel_list.h (the seam's members, both backends' adapters and the CUDA
 * self-test's checklist come from there); a row must agree with the
 * prototypes here, or the backends do not compile. */
#ifndef PG_KERNELS_H
#define PG_KERNELS_H

#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PG_LAYERNORM_EPS 1e-5f

/* ---- embeddings ---- */

/* out[n,:] = weight[tokens[n] - row_start, :] when row_start <= tokens[n] <
 * row_start + rows, else 0 (vocab-parallel: each rank holds `rows` rows). */
void pg_embedding_forward(float *out, const int32_t *tokens, const float *weight, int N, int C, int row_start,
                          int rows);
/* dweight[tokens[n] - row_start, :] += dout[n, :] for in-range tokens. */
void pg_embedding_backward(float *dweight, const float *dout, const int32_t *tokens, int N, int C, int row_start,
                           int rows);
/* out[b*T + t, :] += wpe[t, :] for N = B*T rows. */
void pg_position_forward(float *out, const float *wpe, int N, int T, int C);
/* dwpe[t, :] += sum over b of dout[b*T + t, :]. */
void pg_position_backward(float *dwpe, const float *dout, int N, int T, int C);

/* ---- layer norm (eps PG_LAYERNORM_EPS) ---- */

/* out = (inp - mean) * rstd * weight + bias, per row; saves mean[N], rstd[N]. */
void pg_layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *weight,
                          const float *bias, int N, int C);
void pg_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                           const float *weight, const float *mean, const float *rstd, int N, int C);

/* ---- matmul (OpenBLAS sgemm) ---- */

/* out[N,OC] = inp[N,C] @ weight[OC,C]^T (+ bias[OC] if not NULL). */
void pg_matmul_forward(float *out, const float *inp, const float *weight, const float *bias, int N, int C, int OC);
/* dinp = dout @ weight; dweight += dout^T @ inp; dbias += column sums of dout. */
void pg_matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                        const float *weight, int N, int C, int OC);

/* Column sums of dout [N, OC] added to dbias [OC] (a linear layer's bias gradient). */
void pg_bias_backward(float *dbias, const float *dout, int N, int OC);
/* The same on bf16 dout, widened (exact): pg_bias_backward's bits on the widened values, without them in memory. */
void pg_bias_backward_bf16(float *dbias, const uint16_t *dout, int N, int OC);

/* ---- bfloat16 ----
 * A bf16 value is the upper 16 bits of a float32 (uint16_t here). float32 ->
 * bf16 rounds to nearest, ties to even, as torch's .to(torch.bfloat16) does;
 * NaN stays a (quiet) NaN, +-inf stays inf, values past the largest bf16
 * round to inf. bf16 -> float32 is exact. */
void pg_bf16_from_f32(uint16_t *dst, const float *src, int64_t n);
void pg_bf16_to_f32(float *dst, const uint16_t *src, int64_t n);
/* int8 block coding (DiLoCo's quantised exchange): each block of `block` values (a multiple of 4) becomes one
 * word holding the float32 scale absmax / 127, then block / 4 words of four int8 codes round(v / scale) in
 * [-127, 127], lowest byte first; an all-zero block has scale 0 and codes 0. So |decoded - v| <= scale / 2.
 * words: nblocks * (1 + block / 4). */
void pg_int8_encode(uint32_t *words, const float *src, int64_t nblocks, int64_t block);
void pg_int8_decode(float *dst, const uint32_t *words, int64_t nblocks, int64_t block);
static inline uint16_t pg_bf16_round(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN: keep it, quiet */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float pg_bf16_value(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* ---- float16 (IEEE binary16: 1 sign, 5 exponent, 10 mantissa bits) ----
 * A storage type only (fp16 checkpoints): every float16 value, subnormals,
 * infinities and NaN payloads included, is exactly a float32, so widening is
 * exact; rounding to float16 is to nearest, ties to even (as torch's
 * .to(torch.float16)), magnitudes from 65520 up becoming inf. */
void pg_f16_to_f32(float *dst, const uint16_t *src, int64_t n);
static inline float pg_f16_value(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
  float f;
  if (e == 0x1f) u = sign | 0x7f800000u | (m << 13); /* inf, NaN (payload kept) */
  else if (e) u = sign | ((e + 112u) << 23) | (m << 13); /* rebias 15 -> 127 */
  else { /* zero or subnormal: m * 2^-24, exact in float32 */
    f = (float)m * 0x1p-24f;
    memcpy(&u, &f, 4);
    u |= sign;
  }
  memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t pg_f16_round(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN: quiet */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520: inf */
  uint32_t h, rest, half;
  if (a < 0x38800000u) { /* below 2^-14: a float16 subnormal, a multiple of 2^-24 (1 << 10 is the smallest normal) */
    uint32_t shift = 126u - (a >> 23), mant = (a & 0x7fffffu) | 0x800000u; /* a = mant * 2^-24 / 2^shift */
    if (a < 0x33000000u) return sign; /* below 2^-25, half the smallest subnormal (float32 subnormals too) */
    h = mant >> shift, rest = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  } else {
    h = ((a >> 23) - 112u) << 10 | ((a >> 13) & 0x3ffu), rest = a & 0x1fffu, half = 0x1000u;
  }
  if (rest > half || (rest == half && (h & 1u))) h++; /* a carry moves into the exponent, as it should */
  return (uint16_t)(sign | h);
}

/* The bf16 GEMMs with float32 accumulation are the CPU backend's: src/backend/pg_cpu_bf16_gemm.h. */

/* ---- flash attention on bf16 q|k|v (the device's tensor-core kernels, kernels/cuda/flash_bf16.cu) ----
 * Causal self-attention of qkv [B, T, (NH + 2 NKV) HS] bf16 (pg_attention_forward's layout; query head h uses kv
 * head h / (NH / NKV)), without the [T, T] probabilities: out [B, T, NH HS] float32 and lse [B, NH, T] float32,
 * the natural log of the sum over visible keys of exp(score), score = scale (q . k), scale = 1 / sqrtf(HS), plus
 * with ALiBi (slopes: NH floats, or NULL) slopes[h] (j - i) for query i and key j, as pg_attention_forward's
 * (pg_attention_block_finish's lse: either backward takes either's). Shapes: HS 64 or 128, T a multiple of 16,
 * NKV dividing NH, B and NH at most 65535: pg_flash_bf16_unsupported says why not (NULL: supported), and a
 * caller falls back to the float32 attention. This CPU twin widens q|k|v (exact) and runs the block attention
 * (pg_attention_block_*) in float32: the reference the device's self-test compares with; the device rounds P
 * and dS to bf16 for its products (FlashAttention's rounding). 0, or 1 for a shape refused or when out of memory. */
const char *pg_flash_bf16_unsupported(int B, int T, int NH, int NKV, int HS);
int pg_flash_bf16_forward(float *out, uint16_t *out16, float *lse, const uint16_t *qkv, const float *slopes, int B,
                          int T, int NH, int NKV, int HS); /* out16 (NULL: none): out rounded to bf16 as well */
/* dqkv [B, T, (NH + 2 NKV) HS] float32 = the gradient of q|k|v (written, not accumulated) for dout [B, T, NH HS]
 * bf16, with the forward's out and lse; dqkv16 its bf16 rounding; either may be NULL (not written), not both;
 * delta: B NH T floats of scratch (FlashAttention-2's rowsum(dout out)). */
int pg_flash_bf16_backward(float *dqkv, uint16_t *dqkv16, float *delta, const uint16_t *dout, const float *out,
                           const uint16_t *qkv, const float *lse, const float *slopes, int B, int T, int NH, int NKV,
                           int HS);

/* ---- causal self-attention, multi-head / grouped-query ----
 * qkv is [B, T, (NH + 2 NKV) HS]: NH query heads, then NKV key heads, then
 * NKV value heads, HS columns each (head h of a part at columns h*HS of that
 * part). Query head h attends with key/value head h / (NH / NKV) (NKV
 * divides NH; NKV = NH is multi-head attention, NKV = 1 multi-query).
 * Scores are scaled by 1/sqrt(HS) and masked causally. out is [B, T, NH HS].
 *
 * Training: flash-style (the rows attention_forward / attention_backward of
 * kernel_list.h), tiled over query and key blocks with an online softmax;
 * nothing of size T^2 is kept or allocated. slopes: NULL, or ALiBi (BLOOM):
 * NH per-head slopes (pg_alibi_slopes, this call's heads), score[t, j] +=
 * slopes[h] * (j - t) after the scaling, before the softmax (transformers
 * adds slopes[h] * j: the same softmax, see attention.c). The forward writes
 * out and lse[B, NH, T], the natural-log log-sum-exp of each query row's
 * scaled (+ ALiBi) causal scores: p[t, j] = exp(s[t, j] - lse[t]); it is
 * all the backward keeps of the softmax. Deterministic: the same inputs give
 * the same bits for any thread count (no atomics, every sum in a fixed
 * order). Another backend's kernel (CUDA fp32, a bf16 one) keeps this
 * contract. */
void pg_attention_forward(float *out, float *lse, const float *qkv, const float *slopes, int B, int T, int NH, int NKV,
                          int HS);
/* dqkv[B,T,(NH+2NKV)HS] (overwritten) from dout[B, T, NH HS] and the forward's qkv, out and lse (slopes as
 * given to the forward); scratch holds at least pg_attention_scratch_floats(B T, NH) floats (FlashAttention-2's
 * delta, one per query row and head: linear in T). */
void pg_attention_backward(float *dqkv, float *scratch, const float *dout, const float *qkv, const float *out,
                           const float *lse, const float *slopes, int B, int T, int NH, int NKV, int HS);
int64_t pg_attention_scratch_floats(int64_t rows, int NH);
/* Decoding with a key/value cache, one sequence: qkv [T, (NH + 2 NKV) HS] holds its new rows, at
 * positions pos .. pos + T - 1. Their keys and values are written into kcache and vcache ([pos + T or more,
 * NKV HS]: position-major, the cache of this sequence), then query row t attends causally over the cached
 * positions 0 .. pos + t: score[t, j] = scale q_t . k_j (+ slopes[h] (j - (pos + t)) with ALiBi), softmax,
 * out[t] = sum_j p_j v_j (out [T, NH HS]). scores: NH T (pos + T) floats of scratch. The same products as
 * pg_attention_forward over the prefix, summed in another blocking (the last digits may differ). */
void pg_attention_cached(float *out, float *scores, float *kcache, float *vcache, const float *qkv,
                         const float *slopes, int T, int pos, int NH, int NKV, int HS);
/* ---- block attention: context parallelism's ring (flash-attention style, float32) ----
 * Attention of B x Tq query rows at positions q_pos0 .. q_pos0 + Tq - 1 over one block of B x Tk key/value
 * rows at positions k_pos0 .. k_pos0 + Tk - 1, as an online softmax that the blocks of a split key range are
 * folded into one at a time (in any order), then finished. Strided rows (all int64 index arithmetic): head h
 * of query row (b, i) at q + (b Tq + i) q_stride + h HS (q may point into a fused q|k|v buffer, q_stride =
 * (NH + 2 NKV) HS); key head g of row (b, j) at k + (b Tk + j) kv_stride + g HS, value head g at v + (same).
 * Query head h uses kv head h / (NH / NKV) (NKV divides NH), as pg_attention_forward. Causal: key j is
 * visible to query i iff k_pos0 + j <= q_pos0 + i. The score is pg_attention_forward's, operation for
 * operation: scale (q . k) with scale = 1 / sqrtf(HS), then + slopes[h] (float)(kpos - qpos) with ALiBi
 * (slopes NULL or NH floats). Strides below 2^31 (they are sgemm's leading dimensions). No scratch: keys are
 * taken in tiles on the stack. Deterministic for any thread count (each (b, h) or (b, kv head) is one
 * thread's, in a fixed order). */

/* Folds one key block into the online-softmax state: acc[B, Tq, NH, HS] (the unnormalised output, contiguous
 * NH HS per row; start 0), mx[B, NH, Tq] (running max; callers start it at -INFINITY), sm[B, NH, Tq] (running
 * sum of exp(score - mx); start 0). A row with no visible key in the block is left unchanged; blocks may be
 * folded in any order. */
void pg_attention_block_forward(float *acc, float *mx, float *sm, const float *q, int64_t q_stride, const float *k,
                                const float *v, int64_t kv_stride, const float *slopes, int B, int Tq, int Tk, int NH,
                                int NKV, int HS, int64_t q_pos0, int64_t k_pos0);
/* out row (b, i) at out + (b Tq + i) out_stride, head h at + h HS: acc / sm. lse[B, NH, Tq] = mx + logf(sm)
 * (the log-sum-exp the backward recomputes the probabilities from). sm == 0 (no key seen): out 0, lse
 * -INFINITY. */
void pg_attention_block_finish(float *out, int64_t out_stride, float *lse, const float *acc, const float *mx,
                               const float *sm, int B, int Tq, int NH, int HS);
/* delta[B, NH, Tq] = sum over d of dout * out for that head (FlashAttention-2's D); dout and out rows
 * strided as out above. */
void pg_attention_block_delta(float *delta, const float *dout, int64_t dout_stride, const float *out,
                              int64_t out_stride, int B, int Tq, int NH, int HS);
/* For one key block, recomputing p = exp(score - lse): dv += p^T dout, dp = dout v^T, ds = p (dp - delta),
 * dq += scale ds k, dk += scale ds^T q (over the query heads of each kv head). ACCUMULATES (+=) into dq (rows
 * dq_stride apart, as q), dk and dv (dk head g of key row (b, j) at dk + (b Tk + j) dkv_stride + g HS, dv
 * likewise). Deterministic: every sum in a fixed order, no atomics. */
void pg_attention_block_backward(float *dq, int64_t dq_stride, float *dk, float *dv, int64_t dkv_stride,
                                 const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                                 const float *dout, int64_t dout_stride, const float *lse, const float *delta,
                                 const float *slopes, int B, int Tq, int Tk, int NH, int NKV, int HS, int64_t q_pos0,
                                 int64_t k_pos0);

/* ALiBi's slopes for n heads (n >= 1), as transformers' build_alibi_tensor
 * (BLOOM): p = 2^floor(log2 n), slopes[k-1] = b^k (k = 1..p) with b =
 * 2^-(2^-(log2 p - 3)) rounded to float32; when p < n the other n - p are
 * e^1, e^3, e^5, ... with e the same rule at 2p. Each power is computed in
 * double from the float32 base and rounded once (see attention.c for where
 * that differs from torch by 1 ulp). */
void pg_alibi_slopes(float *slopes, int n);

/* ---- rotary position embeddings (transformers' rotate_half convention) ----
 * For a head vector v of HS (even) values at sequence position t and
 * i < HS/2: (v[i], v[i + HS/2]) is rotated by the angle t * inv_freq[i],
 * inv_freq[i] = 1 / theta^(2i / HS):
 *   v[i]        = v[i] cos - v[i + HS/2] sin
 *   v[i + HS/2] = v[i + HS/2] cos + v[i] sin.
 * Tables cos, sin are [max_T, HS/2] (pg_rope_table). Row n of x is at
 * position n % T (rows are B sequences of T); heads [0, heads) of a row are
 * the ones rotated, HS columns each, starting at column 0, rows ld floats
 * apart. In place. Backward rotates by the opposite angle (the transpose). */

/* The frequency scaling of transformers' rope_scaling (LLaMA's), types as in
 * its modeling_rope_utils.py (4.45.2). PG_ROPE_DYNAMIC changes the
 * frequencies only for sequences longer than max_position_embeddings, which
 * the attention refuses (max_seq is that length): for every sequence it
 * runs, its frequencies are the plain ones. */
typedef enum { PG_ROPE_PLAIN = 0, PG_ROPE_LINEAR, PG_ROPE_DYNAMIC, PG_ROPE_LLAMA3 } pg_rope_type;
typedef struct pg_rope_scaling {
  pg_rope_type type;
  double factor;                            /* linear, dynamic, llama3 */
  double low_freq_factor, high_freq_factor; /* llama3 (high > low) */
  double original_max;                      /* llama3: original_max_position_embeddings */
} pg_rope_scaling;
/* The type of a rope_scaling type name ("default", "linear", "dynamic", "llama3"); -1: another. */
int pg_rope_type_of(const char *name);

/* inv_freq[HS/2], each float32 step as transformers takes it: 1 /
 * theta^(float(2i) / HS); linear: / factor; llama3: wavelen = (1 / inv_freq)
 * * float(2 pi) (torch's scalar / tensor is reciprocal times scalar), low
 * frequencies (wavelen > original / low_freq_factor) / factor, the middle
 * band smoothed. scaling NULL (or PG_ROPE_PLAIN): plain. */
void pg_rope_inv_freq(float *inv_freq, int HS, double theta, const pg_rope_scaling *scaling);
/* The tables, on the host, of positions [0, max_T): angle = float(t) *
 * inv_freq[i] in float32 (pg_rope_inv_freq's), cos and sin of it in double rounded once. */
void pg_rope_table(float *cos_t, float *sin_t, int max_T, int HS, double theta, const pg_rope_scaling *scaling);
void pg_rope_forward(float *x, const float *cos_t, const float *sin_t, int N, int T, int heads, int HS, int ld);
void pg_rope_backward(float *dx, const float *cos_t, const float *sin_t, int N, int T, int heads, int HS, int ld);
/* x: bf16 rows (ld apart) = pg_rope_forward of their widened values, rounded to bf16 (one pass, the same bits as
 * widening, rotating and rounding) */
void pg_rope_bf16_forward(uint16_t *x, const float *cos_t, const float *sin_t, int N, int T, int heads, int HS, int ld);

/* ---- RMS normalisation (LLaMA) ----
 * out = inp * rstd * weight per row, rstd = 1 / sqrt(mean(inp^2) + eps)
 * (the sum in double); saves rstd[N]. */
void pg_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight, int N, int C, float eps);
void pg_rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                         const float *rstd, int N, int C);

/* ---- pointwise ---- */

/* GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
void pg_gelu_forward(float *out, const float *inp, int64_t n);
void pg_gelu_backward(float *dinp, const float *inp, const float *dout, int64_t n);
/* SwiGLU: inp is [N, 2H], gate columns [0, H), up columns [H, 2H);
 * out[N, H] = silu(gate) * up, silu(g) = g / (1 + e^-g). */
void pg_swiglu_forward(float *out, const float *inp, int N, int H);
void pg_swiglu_backward(float *dinp, const float *inp, const float *dout, int N, int H);
/* out = a + b (residual; out may be a: ZeRO-2 adds a reduced bucket into the shard in place). Backward is the
 * identity for both inputs. */
void pg_residual_forward(float *out, const float *a, const float *b, int64_t n);
/* The bf16 activations of precision "bf16": the same formulas on the bf16
 * values widened to float32 (exact), each result rounded to bf16 (nearest,
 * ties to even) as torch computes an op on bf16 tensors; SwiGLU's gradient
 * of gate and up rounded each. The residual adds a bf16 branch to the
 * float32 stream: out = a + b, not rounded. */
void pg_gelu_bf16_forward(uint16_t *out, const uint16_t *inp, int64_t n);
void pg_gelu_bf16_backward(uint16_t *dinp, const uint16_t *inp, const uint16_t *dout, int64_t n);
void pg_swiglu_bf16_forward(uint16_t *out, const uint16_t *inp, int N, int H);
void pg_swiglu_bf16_backward(uint16_t *dinp, const uint16_t *inp, const uint16_t *dout, int N, int H);
void pg_residual_bf16_forward(float *out, const float *a, const uint16_t *b, int64_t n);
/* da += dout; db += dout (either may be NULL). */
void pg_residual_backward(float *da, float *db, const float *dout, int64_t n);
/* p[0, bytes) = 0, split over the OpenMP threads from 4 MiB: one core's
 * stores do not reach the memory's bandwidth (zeroing GPT-2 124M's 496 MB of
 * gradients, 2 cores: 60 ms on one, 35 ms on both). */
void pg_zero_bytes(void *p, size_t bytes);

/* ---- mixture-of-experts router (Mixtral) ----
 * logits [N, E] over E experts. probs = softmax per row, lse[N] its
 * log-sum-exp; expert[N, K] the K most probable experts, most probable first,
 * ties to the lower index (torch.topk's order); weight[N, K] their
 * probabilities renormalised to sum to 1. */
void pg_moe_route_forward(float *probs, float *lse, int32_t *expert, float *weight, const float *logits, int N, int E,
                          int K);
/* dlogits [N, E] (overwritten) of
 *   sum_{n,k} dweight[n,k] weight[n,k] + sum_{n,e} dprob[e] probs[n,e] + zscale sum_n lse[n]^2,
 * dprob [E] (the load-balancing loss: the same for every row) or NULL. */
void pg_moe_route_backward(float *dlogits, const float *dweight, const float *dprob, float zscale, const float *probs,
                           const float *lse, const int32_t *expert, const float *weight, int N, int E, int K);
/* counts[e] = how many of the N x K choices are e, psum[e] = sum over rows of probs[n, e] (overwritten). */
void pg_moe_route_stats(double *counts, double *psum, const float *probs, const int32_t *expert, int N, int E, int K);
/* Capacity: pos[N K] = 0 for a kept choice, -1 for one past its expert's `cap` choices in its sequence (each T
 * rows; the last may be shorter): first choices before second ones, earlier tokens first (GShard's priority).
 * cap = INT32_MAX keeps every choice. fill: scratch of ceil(N / T) x E ints (one row per sequence). */
void pg_moe_drop(int32_t *pos, int32_t *fill, const int32_t *expert, int N, int T, int E, int K, int cap);
/* Grouping by expert, stable in token then choice order: every kept choice i (pos[i] >= 0) gets its grouped row
 * pos[i], token[pos[i]] = i / K its token, offsets[E + 1] each expert's first grouped row (offsets[E]: the rows
 * kept). Dropped choices keep pos -1. */
void pg_moe_group(int32_t *pos, int32_t *token, int32_t *offsets, const int32_t *expert, int N, int E, int K);
/* xg[r, D] = x[token[r], D] for the R grouped rows. */
void pg_moe_gather(float *xg, const float *x, const int32_t *token, int R, int D);
/* out[t, D] = sum over the kept choices j of token t, in j order, of weight[t K + j] ye[pos[t K + j], D]
 * (weight NULL: 1); 0 where every choice was dropped. */
void pg_moe_combine(float *out, const float *ye, const int32_t *pos, const float *weight, int N, int K, int D);
/* Its backward for the kept choices i: dweight[i] = dy[i / K] . ye[pos[i]] (summed in order of d; 0 when
 * dropped) and dyg[pos[i]] = weight[i] dy[i / K] (the grouped rows' output gradients). */
void pg_moe_combine_backward(float *dweight, float *dyg, const float *dy, const float *ye, const int32_t *pos,
                             const float *weight, int N, int K, int D);

/* ---- fused softmax + cross-entropy over a vocabulary (slice) ----
 * logits is [N, V]: this rank's slice of the vocabulary, global columns
 * [vocab_start, vocab_start + V). Only the first `valid` columns of the slice
 * are real tokens (the rest is padding: never predicted, gradient 0).
 * targets hold global token ids. Vocab-parallel use: reduce row_max with max
 * across the slices, then sumexp and target_logit with sum, then finish. */

/* row_max[n] = max over the valid columns. */
void pg_xent_row_max(float *row_max, const float *logits, int N, int V, int valid);
/* sumexp[n] = sum exp(logit - row_max[n]) over valid columns; target_logit[n]
 * = the target's logit when it falls in this slice, else 0. */
void pg_xent_sumexp(float *sumexp, float *target_logit, const float *logits, const float *row_max,
                    const int32_t *targets, int N, int V, int valid, int vocab_start);
/* losses[n] = log(sumexp[n]) + row_max[n] - target_logit[n] (may be NULL).
 * When dlogits is not NULL: dlogits = (softmax - onehot(target)) * dloss,
 * padded columns 0; dlogits may alias logits (the probabilities are never
 * kept). Returns the sum of losses over the N rows (in double). */
double pg_xent_finish(float *losses, float *dlogits, const float *logits, const float *row_max, const float *sumexp,
                      const float *target_logit, const int32_t *targets, int N, int V, int valid, int vocab_start,
                      float dloss);

/* ---- optimizer ---- */

/* AdamW (torch.optim.AdamW semantics) on n elements:
 *   g = grad * grad_scale (clipping factor)
 *   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
 *   param -= lr * (weight_decay * param + (m / (1-b1^step)) / (sqrt(v / (1-b2^step)) + eps))
 * (decay is decoupled: param *= 1 - lr*wd, then the Adam step). step >= 1. */
void pg_adamw_update(float *param, const float *grad, float *m, float *v, int64_t n, float lr, float beta1,
                     float beta2, float eps, float weight_decay, int step, float grad_scale);

/* One piece of a fused AdamW step: n elements of one parameter, its gradient and its moments (pointers in the
 * memory of the backend that runs the step), with weight decay or without (decay 0: torch's no-decay group). */
typedef struct pg_adamw_piece {
  float *param;
  const float *grad;
  float *m, *v;
  int64_t n;
  int decay; /* 1: weight_decay applies; 0: it does not */
} pg_adamw_piece;

/* pg_adamw_update on every piece in order, weight_decay where piece.decay and 0 elsewhere: the same bits as one call
 * per piece (the CUDA twin does the whole table in one launch). */
void pg_adamw_update_pieces(const pg_adamw_piece *pieces, int npieces, float lr, float beta1, float beta2, float eps,
                            float weight_decay, int step, float grad_scale);

/* Sum of squares in double, deterministic (fixed chunking). */
double pg_sum_squares(const float *x, int64_t n);

#ifdef PG_WITH_CUDA
/* ---- CUDA (kernels/cuda/, one .cu per family; built when nvcc is found, see the Makefile) ----
 *
 * The same ops with the same contracts (overwrite input gradients, accumulate
 * parameter gradients, NULL gradient = skip), on DEVICE pointers. Work is
 * queued on ctx->stream and is asynchronous: results are there once the
 * stream is synchronised. Every function returns 0 on success, else an error
 * code for pg_cuda_strerror() (launch and cuBLAS errors; errors of the kernels
 * themselves surface at the next synchronisation).
 *
 * Determinism: no float atomics anywhere; every reduction has a fixed
 * partition and order, so a run repeats bitwise on the same GPU model. sgemm
 * runs in full FP32 (the runtime creates the cuBLAS handle with TF32 off). */

/* What every CUDA kernel needs: a cudaStream_t and a cublasHandle_t already
 * bound to that stream (pg_cuda_ctx_init in src/backend/pg_cuda.h creates both). Kept
 * as void * so that this header needs no CUDA header. */
typedef struct pg_cuda_ctx {
  void *stream; /* cudaStream_t; NULL = the legacy default stream */
  void *cublas; /* cublasHandle_t; needed by matmul and attention */
  void *lt;     /* pg_cuda_lt (src/backend/pg_cublas.h), or NULL: precision bf16's products go through GemmEx */
} pg_cuda_ctx;

/* Error codes: 1..999 a cudaError_t, PG_CUDA_CUBLAS_ERR + s a cublasStatus_t s,
 * PG_CUDA_EINVAL a missing context, handle or argument. */
#define PG_CUDA_CUBLAS_ERR 1000
#define PG_CUDA_EINVAL 2000
const char *pg_cuda_strerror(int code);

int pg_cuda_embedding_forward(const pg_cuda_ctx *ctx, float *out, const int32_t *tokens, const float *weight, int N,
                              int C, int row_start, int rows);
/* Deterministic without atomics: one block per first occurrence of a token,
 * adding that token's rows in order (the CPU kernel's order, so the same bits). */
int pg_cuda_embedding_backward(const pg_cuda_ctx *ctx, float *dweight, const float *dout, const int32_t *tokens,
                               int N, int C, int row_start, int rows);
int pg_cuda_position_forward(const pg_cuda_ctx *ctx, float *out, const float *wpe, int N, int T, int C);
int pg_cuda_position_backward(const pg_cuda_ctx *ctx, float *dwpe, const float *dout, int N, int T, int C);

int pg_cuda_layernorm_forward(const pg_cuda_ctx *ctx, float *out, float *mean, float *rstd, const float *inp,
                              const float *weight, const float *bias, int N, int C);
int pg_cuda_layernorm_backward(const pg_cuda_ctx *ctx, float *dinp, float *dweight, float *dbias, const float *dout,
                               const float *inp, const float *weight, const float *mean, const float *rstd, int N,
                               int C);

int pg_cuda_matmul_forward(const pg_cuda_ctx *ctx, float *out, const float *inp, const float *weight,
                           const float *bias, int N, int C, int OC);
int pg_cuda_matmul_backward(const pg_cuda_ctx *ctx, float *dinp, float *dweight, float *dbias, const float *dout,
                            const float *inp, const float *weight, int N, int C, int OC);

/* Precision bf16 on the device (kernels/cuda/bf16.cu), the CPU's bf16
 * contracts above. bf16 is uint16_t here too (the bits, no cuda_bf16.h).
 * pg_cuda_bf16_from_f32 rounds exactly as pg_bf16_round (the same bits). The
 * GEMMs are cublasGemmEx with CUDA_R_16BF inputs, a CUDA_R_32F output and
 * CUBLAS_COMPUTE_32F (float32 sums, as torch.autocast's bf16 Linear); the
 * order of the sums is cuBLAS's. Backward: dinp overwritten (NULL: skip),
 * dweight += (NULL: skip), and dbias (NULL: skip) += the column sums of the
 * float32 dout_f32, or with dout_f32 NULL of the bf16 dout widened
 * (pg_cuda_matmul_backward's kernel: the bias gradient is not rounded, as on
 * the CPU). */
int pg_cuda_bf16_from_f32(const pg_cuda_ctx *ctx, uint16_t *dst, const float *src, int64_t n);
int pg_cuda_bf16_to_f32(const pg_cuda_ctx *ctx, float *dst, const uint16_t *src, int64_t n);
/* The bf16 activations (the CPU's pg_*_bf16_* contracts, CUDA's expf as the float32 kernels). */
int pg_cuda_gelu_bf16_forward(const pg_cuda_ctx *ctx, uint16_t *out, const uint16_t *inp, int64_t n);
int pg_cuda_gelu_bf16_backward(const pg_cuda_ctx *ctx, uint16_t *dinp, const uint16_t *inp, const uint16_t *dout,
                               int64_t n);
int pg_cuda_swiglu_bf16_forward(const pg_cuda_ctx *ctx, uint16_t *out, const uint16_t *inp, int N, int H);
int pg_cuda_swiglu_bf16_backward(const pg_cuda_ctx *ctx, uint16_t *dinp, const uint16_t *inp, const uint16_t *dout,
                                 int N, int H);
int pg_cuda_residual_bf16_forward(const pg_cuda_ctx *ctx, float *out, const float *a, const uint16_t *b, int64_t n);
int pg_cuda_matmul_bf16_forward(const pg_cuda_ctx *ctx, float *out, const uint16_t *inp, const uint16_t *weight,
                                const float *bias, int N, int C, int OC);
/* out16 = the float32 product (+ bias) rounded once to bf16: cuBLASLt writing bf16 D where it has an algorithm
 * (no float32 result in memory; split-K reduced in float32 only), else the GemmEx product into sums [N, OC] and
 * pg_cuda_bf16_from_f32 (kernel_list.h's matmul_bf16_forward_rounded: which bits hold where). */
int pg_cuda_matmul_bf16_forward_rounded(const pg_cuda_ctx *ctx, uint16_t *out16, float *sums, const uint16_t *inp,
                                        const uint16_t *weight, const float *bias, int N, int C, int OC);
int pg_cuda_matmul_bf16_backward(const pg_cuda_ctx *ctx, float *dinp, float *dweight, float *dbias,
                                 const float *dout_f32, const uint16_t *dout, const uint16_t *inp,
                                 const uint16_t *weight, int N, int C, int OC);
/* pg_flash_bf16_* on the device (device pointers, the same arguments): WMMA bf16 products with float32 sums,
 * online softmax in float32, deterministic backward (no atomics). PG_CUDA_EINVAL for a shape
 * pg_flash_bf16_unsupported refuses, or out, dqkv, dout or qkv not 32-byte aligned (WMMA's tiles). */
int pg_cuda_flash_bf16_forward(const pg_cuda_ctx *ctx, float *out, uint16_t *out16, float *lse, const uint16_t *qkv,
                               const float *slopes, int B, int T, int NH, int NKV, int HS);
int pg_cuda_flash_bf16_backward(const pg_cuda_ctx *ctx, float *dqkv, uint16_t *dqkv16, float *delta,
                                const uint16_t *dout, const float *out, const uint16_t *qkv, const float *lse,
                                const float *slopes, int B, int T, int NH, int NKV, int HS);

/* The flash attention's contract (pg_attention_forward / pg_attention_backward: out and lse, no [T, T] buffer;
 * slopes NULL or NH device floats). FlashAttention-2's scheme, deterministic without atomics: the forward one
 * block per (query tile, b, h); the backward delta, then dK/dV one block per (key tile, b, kv head) walking the
 * group's heads and the query tiles in order, then dQ in its own pass, one block per (query tile, b, h) walking
 * the key tiles in order. scratch: at least pg_cuda_attention_scratch_floats(rows = B T, NH) device floats. */
int pg_cuda_attention_forward(const pg_cuda_ctx *ctx, float *out, float *lse, const float *qkv, const float *slopes,
                              int B, int T, int NH, int NKV, int HS);
int pg_cuda_attention_backward(const pg_cuda_ctx *ctx, float *dqkv, float *scratch, const float *dout,
                               const float *qkv, const float *out, const float *lse, const float *slopes, int B, int T,
                               int NH, int NKV, int HS);
int64_t pg_cuda_attention_scratch_floats(int64_t rows, int NH);
/* As pg_attention_cached (kcache, vcache, scores: device floats). */
int pg_cuda_attention_cached(const pg_cuda_ctx *ctx, float *out, float *scores, float *kcache, float *vcache,
                             const float *qkv, const float *slopes, int T, int pos, int NH, int NKV, int HS);

/* The block attention of the ring (pg_attention_block_*; device pointers, the same arguments). Deterministic
 * without atomics: the forward and dq take one block per (b, h, query row), dk/dv one per (b, kv head, key
 * row) summing its queries (and the group's query heads) in a fixed order. */
int pg_cuda_attention_block_forward(const pg_cuda_ctx *ctx, float *acc, float *mx, float *sm, const float *q,
                                    int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                                    const float *slopes, int B, int Tq, int Tk, int NH, int NKV, int HS,
                                    int64_t q_pos0, int64_t k_pos0);
int pg_cuda_attention_block_finish(const pg_cuda_ctx *ctx, float *out, int64_t out_stride, float *lse,
                                   const float *acc, const float *mx, const float *sm, int B, int Tq, int NH, int HS);
int pg_cuda_attention_block_delta(const pg_cuda_ctx *ctx, float *delta, const float *dout, int64_t dout_stride,
                                  const float *out, int64_t out_stride, int B, int Tq, int NH, int HS);
int pg_cuda_attention_block_backward(const pg_cuda_ctx *ctx, float *dq, int64_t dq_stride, float *dk, float *dv,
                                     int64_t dkv_stride, const float *q, int64_t q_stride, const float *k,
                                     const float *v, int64_t kv_stride, const float *dout, int64_t dout_stride,
                                     const float *lse, const float *delta, const float *slopes, int B, int Tq, int Tk,
                                     int NH, int NKV, int HS, int64_t q_pos0, int64_t k_pos0);

/* cos_t, sin_t: device copies of pg_rope_table's tables. */
int pg_cuda_rope_forward(const pg_cuda_ctx *ctx, float *x, const float *cos_t, const float *sin_t, int N, int T,
                         int heads, int HS, int ld);
int pg_cuda_rope_backward(const pg_cuda_ctx *ctx, float *dx, const float *cos_t, const float *sin_t, int N, int T,
                          int heads, int HS, int ld);
int pg_cuda_rope_bf16_forward(const pg_cuda_ctx *ctx, uint16_t *x, const float *cos_t, const float *sin_t, int N,
                              int T, int heads, int HS, int ld);
int pg_cuda_rmsnorm_forward(const pg_cuda_ctx *ctx, float *out, float *rstd, const float *inp, const float *weight,
                            int N, int C, float eps);
int pg_cuda_rmsnorm_backward(const pg_cuda_ctx *ctx, float *dinp, float *dweight, const float *dout, const float *inp,
                             const float *weight, const float *rstd, int N, int C);
int pg_cuda_swiglu_forward(const pg_cuda_ctx *ctx, float *out, const float *inp, int N, int H);
int pg_cuda_swiglu_backward(const pg_cuda_ctx *ctx, float *dinp, const float *inp, const float *dout, int N, int H);

int pg_cuda_gelu_forward(const pg_cuda_ctx *ctx, float *out, const float *inp, int64_t n);
int pg_cuda_gelu_backward(const pg_cuda_ctx *ctx, float *dinp, const float *inp, const float *dout, int64_t n);
int pg_cuda_residual_forward(const pg_cuda_ctx *ctx, float *out, const float *a, const float *b, int64_t n);
int pg_cuda_residual_backward(const pg_cuda_ctx *ctx, float *da, float *db, const float *dout, int64_t n);

/* mixture of experts (kernels/cuda/moe.cu): the CPU contracts above; the same integer decisions from the same
 * inputs, bit for bit (top-k compares logits; capacity and grouping are integer scans in the CPU's order) */
int pg_cuda_moe_route_forward(const pg_cuda_ctx *ctx, float *probs, float *lse, int32_t *expert, float *weight,
                              const float *logits, int N, int E, int K);
int pg_cuda_moe_route_backward(const pg_cuda_ctx *ctx, float *dlogits, const float *dweight, const float *dprob,
                               float zscale, const float *probs, const float *lse, const int32_t *expert,
                               const float *weight, int N, int E, int K);
int pg_cuda_moe_route_stats(const pg_cuda_ctx *ctx, double *counts, double *psum, const float *probs,
                            const int32_t *expert, int N, int E, int K);
int pg_cuda_moe_drop(const pg_cuda_ctx *ctx, int32_t *pos, int32_t *fill, const int32_t *expert, int N, int T, int E,
                     int K, int cap);
int pg_cuda_moe_group(const pg_cuda_ctx *ctx, int32_t *pos, int32_t *token, int32_t *offsets, const int32_t *expert,
                      int N, int E, int K);
int pg_cuda_moe_gather(const pg_cuda_ctx *ctx, float *xg, const float *x, const int32_t *token, int R, int D);
int pg_cuda_moe_combine(const pg_cuda_ctx *ctx, float *out, const float *ye, const int32_t *pos, const float *weight,
                        int N, int K, int D);
int pg_cuda_moe_combine_backward(const pg_cuda_ctx *ctx, float *dweight, float *dyg, const float *dy, const float *ye,
                                 const int32_t *pos, const float *weight, int N, int K, int D);

int pg_cuda_xent_row_max(const pg_cuda_ctx *ctx, float *row_max, const float *logits, int N, int V, int valid);
int pg_cuda_xent_sumexp(const pg_cuda_ctx *ctx, float *sumexp, float *target_logit, const float *logits,
                        const float *row_max, const int32_t *targets, int N, int V, int valid, int vocab_start);
/* As pg_xent_finish; the sum of the row losses (double, fixed order) goes to
 * the device double *loss_sum instead of a return value (may be NULL). */
int pg_cuda_xent_finish(const pg_cuda_ctx *ctx, float *losses, float *dlogits, const float *logits,
                        const float *row_max, const float *sumexp, const float *target_logit, const int32_t *targets,
                        int N, int V, int valid, int vocab_start, float dloss, double *loss_sum);

/* The CPU kernel's arithmetic, operation for operation (no FMA contraction):
 * the same bits as pg_adamw_update. */
int pg_cuda_adamw_update(const pg_cuda_ctx *ctx, float *param, const float *grad, float *m, float *v, int64_t n,
                         float lr, float beta1, float beta2, float eps, float weight_decay, int step,
                         float grad_scale);

/* pg_adamw_update_pieces in one launch: pieces (npieces rows) and starts (npieces + 1: starts[0] = 0, starts[k + 1] =
 * starts[k] + pieces[k].n, starts[npieces] = total) in device memory; block j updates elements [j C, (j + 1) C) of
 * the pieces laid end to end (C = PG_CUDA_ADAMW_CHUNK), finding its first piece by bisection of starts. The same
 * bits as pg_adamw_update per piece. */
#define PG_CUDA_ADAMW_CHUNK 4096
int pg_cuda_adamw_update_pieces(const pg_cuda_ctx *ctx, const pg_adamw_piece *pieces, const int64_t *starts,
                                int npieces, int64_t total, float lr, float beta1, float beta2, float eps,
                                float weight_decay, int step, float grad_scale);

/* *out (a device double) = sum of squares of x, in PG_CUDA_SUMSQ_BLOCKS fixed
 * chunks; scratch holds PG_CUDA_SUMSQ_BLOCKS device doubles. */
#define PG_CUDA_SUMSQ_BLOCKS 256
int pg_cuda_sum_squares(const pg_cuda_ctx *ctx, double *out, const float *x, int64_t n, double *scratch);
#endif /* PG_WITH_CUDA */

#ifdef __cplusplus
}
#endif

#endif
