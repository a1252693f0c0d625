/* kernel_list.h — the one list of the backend seam's kernels.
 *
 * One row per kernel of pg_backend_ops (src/backend/pg_backend.h):
 *
 *   PG_KERNEL(name, (params), (args), cpu, cuda, selftest)
 *
 *   params    the seam's parameters after `const pg_backend *b` (every seam
 *             kernel returns PG_OK / PG_ERR); not named b
 *   args      the names of params, in order (the preprocessor cannot take
 *             them from the declarations)
 *   cpu       CALL: src/backend/pg_backend.c generates cpu_<name>, which
 *             calls void pg_<name>(args) (kernels.h) and returns PG_OK;
 *             OWN: pg_backend.c defines cpu_<name> by hand (host scalars,
 *             error codes, extra steps)
 *   cuda      CALL: src/backend/pg_backend_cuda.c generates cu_<name>, which
 *             calls int pg_cuda_<name>(ctx, args) (kernels.h) and turns its
 *             code into pg_error; OWN: cu_<name> is written by hand
 *   selftest  PG_SELFTEST(fn): the function of src/backend/pg_cuda_selftest.c
 *             that checks the CUDA kernel against the CPU kernel (one
 *             function may check several kernels); PG_NO_SELFTEST("why")
 *             where there is none, saying why
 *
 * What a row generates: the member `int (*name)(const pg_backend *b,
 * params)` of pg_backend_ops; for CALL the adapter, and a redeclaration of
 * pg_<name> / pg_cuda_<name> from params, so that a row that disagrees with
 * kernels.h's prototype does not compile; for OWN the adapter's prototype,
 * which the hand-written one must match; the backends' ops tables; and the
 * self-test's checklist, which names every row's function (a missing
 * function is an undeclared identifier) and runs each once, in the list's
 * order. A row without six columns does not compile.
 *
 * No include guard: a user defines PG_KERNEL, includes this file, and the
 * file undefines PG_KERNEL at its end. C11 and C++17 alike (nothing but
 * macro calls). */
#ifndef PG_KERNEL
#error "define PG_KERNEL(name, params, args, cpu, cuda, selftest) before including kernel_list.h"
#endif

/* ---- embeddings ---- */
PG_KERNEL(embedding_forward,
          (float *out, const int32_t *tokens, const float *weight, int N, int C, int row_start, int rows),
          (out, tokens, weight, N, C, row_start, rows), CALL, CALL, PG_SELFTEST(test_embedding))
PG_KERNEL(embedding_backward,
          (float *dweight, const float *dout, const int32_t *tokens, int N, int C, int row_start, int rows),
          (dweight, dout, tokens, N, C, row_start, rows), CALL, CALL, PG_SELFTEST(test_embedding))
PG_KERNEL(position_forward, (float *out, const float *wpe, int N, int T, int C), (out, wpe, N, T, C), CALL, CALL,
          PG_SELFTEST(test_embedding))
PG_KERNEL(position_backward, (float *dwpe, const float *dout, int N, int T, int C), (dwpe, dout, N, T, C), CALL,
          CALL, PG_SELFTEST(test_embedding))

/* ---- layer norm, matmul ---- */
PG_KERNEL(layernorm_forward,
          (float *out, float *mean, float *rstd, const float *inp, const float *weight, const float *bias, int N,
           int C),
          (out, mean, rstd, inp, weight, bias, N, C), CALL, CALL, PG_SELFTEST(test_layernorm))
PG_KERNEL(layernorm_backward,
          (float *dinp, float *dweight, float *dbias, const float *dout, const float *inp, const float *weight,
           const float *mean, const float *rstd, int N, int C),
          (dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C), CALL, CALL, PG_SELFTEST(test_layernorm))
PG_KERNEL(matmul_forward, (float *out, const float *inp, const float *weight, const float *bias, int N, int C, int OC),
          (out, inp, weight, bias, N, C, OC), CALL, CALL, PG_SELFTEST(test_matmul))
PG_KERNEL(matmul_backward,
          (float *dinp, float *dweight, float *dbias, const float *dout, const float *inp, const float *weight, int N,
           int C, int OC),
          (dinp, dweight, dbias, dout, inp, weight, N, C, OC), CALL, CALL, PG_SELFTEST(test_matmul))

/* ---- attention (scratch: attention_scratch_floats of pg_backend_ops, written by hand: a size, no kernel) ---- */
/* slopes: NULL, or NH ALiBi slopes in this backend's memory */
/* flash-style (kernels.h): the forward keeps lse[B, NH, T] (the rows' log-sum-exp), no [T, T] probabilities */
PG_KERNEL(attention_forward,
          (float *out, float *lse, const float *qkv, const float *slopes, int B, int T, int NH, int NKV, int HS),
          (out, lse, qkv, slopes, B, T, NH, NKV, HS), CALL, CALL, PG_SELFTEST(test_attention))
PG_KERNEL(attention_backward,
          (float *dqkv, float *scratch, const float *dout, const float *qkv, const float *out, const float *lse,
           const float *slopes, int B, int T, int NH, int NKV, int HS),
          (dqkv, scratch, dout, qkv, out, lse, slopes, B, T, NH, NKV, HS), CALL, CALL, PG_SELFTEST(test_attention))

/* decoding with a key/value cache: one sequence's new rows at positions pos.. (kernels.h) */
PG_KERNEL(attention_cached,
          (float *out, float *scores, float *kcache, float *vcache, const float *qkv, const float *slopes, int T,
           int pos, int NH, int NKV, int HS),
          (out, scores, kcache, vcache, qkv, slopes, T, pos, NH, NKV, HS), CALL, CALL,
          PG_SELFTEST(test_attention_cached))

/* block attention: context parallelism's ring (kernels.h's pg_attention_block_*): the online-softmax fold of one
 * key block, its finish, FlashAttention-2's delta, and the block's backward (accumulating dq, dk, dv) */
PG_KERNEL(attention_block_forward,
          (float *acc, float *mx, float *sm, const float *q, int64_t q_stride, const float *k, const float *v,
           int64_t kv_stride, const float *slopes, int B, int Tq, int Tk, int NH, int NKV, int HS, int64_t q_pos0,
           int64_t k_pos0),
          (acc, mx, sm, q, q_stride, k, v, kv_stride, slopes, B, Tq, Tk, NH, NKV, HS, q_pos0, k_pos0), CALL, CALL,
          PG_SELFTEST(test_attention_block))
PG_KERNEL(attention_block_finish,
          (float *out, int64_t out_stride, float *lse, const float *acc, const float *mx, const float *sm, int B,
           int Tq, int NH, int HS),
          (out, out_stride, lse, acc, mx, sm, B, Tq, NH, HS), CALL, CALL, PG_SELFTEST(test_attention_block))
PG_KERNEL(attention_block_delta,
          (float *delta, const float *dout, int64_t dout_stride, const float *out, int64_t out_stride, int B, int Tq,
           int NH, int HS),
          (delta, dout, dout_stride, out, out_stride, B, Tq, NH, HS), CALL, CALL, PG_SELFTEST(test_attention_block))
PG_KERNEL(attention_block_backward,
          (float *dq, int64_t dq_stride, float *dk, float *dv, int64_t dkv_stride, const float *q, int64_t q_stride,
           const float *k, const float *v, int64_t kv_stride, const float *dout, int64_t dout_stride,
           const float *lse, const float *delta, const float *slopes, int B, int Tq, int Tk, int NH, int NKV, int HS,
           int64_t q_pos0, int64_t k_pos0),
          (dq, dq_stride, dk, dv, dkv_stride, q, q_stride, k, v, kv_stride, dout, dout_stride, lse, delta, slopes, B,
           Tq, Tk, NH, NKV, HS, q_pos0, k_pos0),
          CALL, CALL, PG_SELFTEST(test_attention_block))

/* ---- RoPE (cos_t, sin_t: pg_rope_table's tables in this backend's memory), RMSNorm, SwiGLU, GELU ---- */
PG_KERNEL(rope_forward,
          (float *x, const float *cos_t, const float *sin_t, int N, int T, int heads, int HS, int ld),
          (x, cos_t, sin_t, N, T, heads, HS, ld), CALL, CALL, PG_SELFTEST(test_rope))
PG_KERNEL(rope_backward,
          (float *dx, const float *cos_t, const float *sin_t, int N, int T, int heads, int HS, int ld),
          (dx, cos_t, sin_t, N, T, heads, HS, ld), CALL, CALL, PG_SELFTEST(test_rope))
/* rope_forward on bf16 rows in place: widened, rotated with rope_forward's arithmetic, rounded once */
PG_KERNEL(rope_bf16_forward,
          (uint16_t *x, const float *cos_t, const float *sin_t, int N, int T, int heads, int HS, int ld),
          (x, cos_t, sin_t, N, T, heads, HS, ld), CALL, CALL, PG_SELFTEST(test_rope))
PG_KERNEL(rmsnorm_forward, (float *out, float *rstd, const float *inp, const float *weight, int N, int C, float eps),
          (out, rstd, inp, weight, N, C, eps), CALL, CALL, PG_SELFTEST(test_rmsnorm))
PG_KERNEL(rmsnorm_backward,
          (float *dinp, float *dweight, const float *dout, const float *inp, const float *weight, const float *rstd,
           int N, int C),
          (dinp, dweight, dout, inp, weight, rstd, N, C), CALL, CALL, PG_SELFTEST(test_rmsnorm))
PG_KERNEL(swiglu_forward, (float *out, const float *inp, int N, int H), (out, inp, N, H), CALL, CALL,
          PG_SELFTEST(test_swiglu))
PG_KERNEL(swiglu_backward, (float *dinp, const float *inp, const float *dout, int N, int H), (dinp, inp, dout, N, H),
          CALL, CALL, PG_SELFTEST(test_swiglu))
PG_KERNEL(gelu_forward, (float *out, const float *inp, int64_t n), (out, inp, n), CALL, CALL,
          PG_SELFTEST(test_pointwise))
PG_KERNEL(gelu_backward, (float *dinp, const float *inp, const float *dout, int64_t n), (dinp, inp, dout, n), CALL,
          CALL, PG_SELFTEST(test_pointwise))
/* out = a + x (x: b is the backend) */
PG_KERNEL(residual_forward, (float *out, const float *a, const float *x, int64_t n), (out, a, x, n), CALL, CALL,
          PG_SELFTEST(test_pointwise))

/* ---- cross-entropy ---- */
PG_KERNEL(xent_row_max, (float *row_max, const float *logits, int N, int V, int valid), (row_max, logits, N, V, valid),
          CALL, CALL, PG_SELFTEST(test_xent))
PG_KERNEL(xent_sumexp,
          (float *sumexp, float *target_logit, const float *logits, const float *row_max, const int32_t *targets,
           int N, int V, int valid, int vocab_start),
          (sumexp, target_logit, logits, row_max, targets, N, V, valid, vocab_start), CALL, CALL,
          PG_SELFTEST(test_xent))
/* *loss_sum (host; NULL: not wanted) = the sum of the row losses: the CPU kernel returns it, the CUDA kernel
 * writes a device double that the adapter copies back */
PG_KERNEL(xent_finish,
          (float *losses, float *dlogits, const float *logits, const float *row_max, const float *sumexp,
           const float *target_logit, const int32_t *targets, int N, int V, int valid, int vocab_start, float dloss,
           double *loss_sum),
          (losses, dlogits, logits, row_max, sumexp, target_logit, targets, N, V, valid, vocab_start, dloss, loss_sum),
          OWN, OWN, PG_SELFTEST(test_xent))

/* ---- optimizer ---- */
PG_KERNEL(adamw_update,
          (float *param, const float *grad, float *m, float *v, int64_t n, float lr, float beta1, float beta2,
           float eps, float weight_decay, int step, float grad_scale),
          (param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale), CALL, CALL,
          PG_SELFTEST(test_optim))
/* *out (host) = the sum of squares, deterministic (CUDA: fixed chunks in the backend's device scratch) */
PG_KERNEL(sum_squares, (const float *x, int64_t n, double *out), (x, n, out), OWN, OWN, PG_SELFTEST(test_optim))
/* the fused step (kernels.h's pg_adamw_piece): the table in host memory, its pointers in this backend's; CUDA keeps
 * a device copy of the last table (uploaded when it changes) and runs one launch over every piece */
PG_KERNEL(adamw_update_pieces,
          (const pg_adamw_piece *pieces, int npieces, float lr, float beta1, float beta2, float eps, float weight_decay,
           int step, float grad_scale),
          (pieces, npieces, lr, beta1, beta2, eps, weight_decay, step, grad_scale), CALL, OWN,
          PG_SELFTEST(test_adamw_pieces))

/* ---- precision bf16 (kernels.h's bf16 contracts; bf16 values are uint16_t bits) ---- */
/* dst = src rounded to bf16 (nearest, ties to even; NaN kept), the same bits on every backend */
PG_KERNEL(bf16_from_f32, (uint16_t *dst, const float *src, int64_t n), (dst, src, n), CALL, CALL,
          PG_SELFTEST(test_bf16))
/* out[N,OC] = inp[N,C] @ weight[OC,C]^T (+ bias), bf16 operands, float32 sums and result; the CPU GEMM returns
 * an error code (out of memory, oneDNN) */
PG_KERNEL(matmul_bf16_forward,
          (float *out, const uint16_t *inp, const uint16_t *weight, const float *bias, int N, int C, int OC),
          (out, inp, weight, bias, N, C, OC), OWN, CALL, PG_SELFTEST(test_bf16))
/* out16 = the float32 sums of matmul_bf16_forward's product (+ bias) rounded once to bf16 (to nearest even): where
 * the backend can, the product writes bf16 itself (CUDA: cuBLASLt's bf16 D, converted after the bias, split-K
 * partial sums reduced in float32 only; one pass fewer), else through sums ([N, OC] float32 scratch) and
 * bf16_from_f32. The CPU and the emulator give matmul_bf16_forward-then-bf16_from_f32's bits; a GPU's cuBLASLt
 * picks its own algorithm for bf16 D, whose float32 sums may be ordered otherwise than its float32 one's */
PG_KERNEL(matmul_bf16_forward_rounded,
          (uint16_t *out16, float *sums, const uint16_t *inp, const uint16_t *weight, const float *bias, int N, int C,
           int OC),
          (out16, sums, inp, weight, bias, N, C, OC), OWN, CALL, PG_SELFTEST(test_bf16))
/* dinp = dout @ weight (NULL: skip), dweight += dout^T @ inp (NULL: skip), on the bf16 operands; dbias (NULL:
 * skip) += the column sums of the float32 dout_f32 (the bias gradient is not rounded), or with dout_f32 NULL of
 * dout's bf16 values widened (the same sums, no widened copy in memory): on the CPU a second kernel,
 * pg_bias_backward / pg_bias_backward_bf16 */
PG_KERNEL(matmul_bf16_backward,
          (float *dinp, float *dweight, float *dbias, const float *dout_f32, const uint16_t *dout,
           const uint16_t *inp, const uint16_t *weight, int N, int C, int OC),
          (dinp, dweight, dbias, dout_f32, dout, inp, weight, N, C, OC), OWN, CALL, PG_SELFTEST(test_bf16))
/* dst = src widened (exact) */
PG_KERNEL(bf16_to_f32, (float *dst, const uint16_t *src, int64_t n), (dst, src, n), CALL, CALL,
          PG_SELFTEST(test_bf16_pointwise))
/* bf16 activations (kernels.h's pg_*_bf16_*): bf16 in and out, float32 arithmetic, each result rounded */
PG_KERNEL(gelu_bf16_forward, (uint16_t *out, const uint16_t *inp, int64_t n), (out, inp, n), CALL, CALL,
          PG_SELFTEST(test_bf16_pointwise))
PG_KERNEL(gelu_bf16_backward, (uint16_t *dinp, const uint16_t *inp, const uint16_t *dout, int64_t n),
          (dinp, inp, dout, n), CALL, CALL, PG_SELFTEST(test_bf16_pointwise))
PG_KERNEL(swiglu_bf16_forward, (uint16_t *out, const uint16_t *inp, int N, int H), (out, inp, N, H), CALL, CALL,
          PG_SELFTEST(test_bf16_pointwise))
PG_KERNEL(swiglu_bf16_backward, (uint16_t *dinp, const uint16_t *inp, const uint16_t *dout, int N, int H),
          (dinp, inp, dout, N, H), CALL, CALL, PG_SELFTEST(test_bf16_pointwise))
/* out = a + x: a bf16 branch added to the float32 stream */
PG_KERNEL(residual_bf16_forward, (float *out, const float *a, const uint16_t *x, int64_t n), (out, a, x, n), CALL,
          CALL, PG_SELFTEST(test_bf16_pointwise))

/* ---- flash attention on bf16 q|k|v (kernels.h's pg_flash_bf16_*): the device's tensor-core kernels; the CPU
 * twin runs the float32 block attention on the widened inputs. Both refuse, naming why, a shape that
 * pg_flash_bf16_unsupported refuses (pg_backend_flash_bf16_refused): the caller then takes attention_forward /
 * attention_backward. delta: B NH T floats of scratch; out16 (NULL: none) the output's bf16 rounding too, written
 * in the same pass. ---- */
PG_KERNEL(flash_bf16_forward,
          (float *out, uint16_t *out16, float *lse, const uint16_t *qkv, const float *slopes, int B, int T, int NH,
           int NKV, int HS),
          (out, out16, lse, qkv, slopes, B, T, NH, NKV, HS), OWN, OWN, PG_SELFTEST(test_flash_bf16))
/* dqkv float32 and/or (NULL: not written) dqkv16, its bf16 rounding, written in the same pass */
PG_KERNEL(flash_bf16_backward,
          (float *dqkv, uint16_t *dqkv16, float *delta, const uint16_t *dout, const float *out, const uint16_t *qkv,
           const float *lse, const float *slopes, int B, int T, int NH, int NKV, int HS),
          (dqkv, dqkv16, delta, dout, out, qkv, lse, slopes, B, T, NH, NKV, HS), OWN, OWN,
          PG_SELFTEST(test_flash_bf16))
/* ---- mixture of experts (kernels.h's pg_moe_*: routing, capacity, grouping, gather and combine; the experts'
 * products are the backend's GEMMs) ---- */
PG_KERNEL(moe_route_forward,
          (float *probs, float *lse, int32_t *expert, float *weight, const float *logits, int N, int E, int K),
          (probs, lse, expert, weight, logits, N, E, K), CALL, CALL, PG_SELFTEST(test_moe))
PG_KERNEL(moe_route_backward,
          (float *dlogits, const float *dweight, const float *dprob, float zscale, const float *probs,
           const float *lse, const int32_t *expert, const float *weight, int N, int E, int K),
          (dlogits, dweight, dprob, zscale, probs, lse, expert, weight, N, E, K), CALL, CALL, PG_SELFTEST(test_moe))
PG_KERNEL(moe_route_stats,
          (double *counts, double *psum, const float *probs, const int32_t *expert, int N, int E, int K),
          (counts, psum, probs, expert, N, E, K), CALL, CALL, PG_SELFTEST(test_moe))
PG_KERNEL(moe_drop, (int32_t *pos, int32_t *fill, const int32_t *expert, int N, int T, int E, int K, int cap),
          (pos, fill, expert, N, T, E, K, cap), CALL, CALL, PG_SELFTEST(test_moe))
PG_KERNEL(moe_group, (int32_t *pos, int32_t *token, int32_t *offsets, const int32_t *expert, int N, int E, int K),
          (pos, token, offsets, expert, N, E, K), CALL, CALL, PG_SELFTEST(test_moe))
PG_KERNEL(moe_gather, (float *xg, const float *x, const int32_t *token, int R, int D), (xg, x, token, R, D), CALL,
          CALL, PG_SELFTEST(test_moe))
PG_KERNEL(moe_combine, (float *out, const float *ye, const int32_t *pos, const float *weight, int N, int K, int D),
          (out, ye, pos, weight, N, K, D), CALL, CALL, PG_SELFTEST(test_moe))
PG_KERNEL(moe_combine_backward,
          (float *dweight, float *dyg, const float *dy, const float *ye, const int32_t *pos, const float *weight,
           int N, int K, int D),
          (dweight, dyg, dy, ye, pos, weight, N, K, D), CALL, CALL, PG_SELFTEST(test_moe))
/* ---- pg.ops on device tensors: what a module written in Lua calls and no module kind did ---- */
/* da += dout, db += dout (either NULL: skipped): pg.ops.residual_backward's contract */
PG_KERNEL(residual_backward, (float *da, float *db, const float *dout, int64_t n), (da, db, dout, n), CALL, CALL,
          PG_SELFTEST(test_pointwise))

#undef PG_KERNEL
