/* kind_moe.c: the mixture-of-experts kind (Mixtral's sparse feed-forward block), with expert parallelism. */
#include "module_impl.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pg_rng.h"
#include "pg_size.h"

/* ---------------------------------------------------------------- mixture of experts */

/* The token -> expert choices of a micro-batch are laid out grouped by
 * expert (tokens in order within an expert): choice j of token t sits at
 * grouped row pos[t K + j], so each expert's rows are contiguous and run as
 * one GEMM. A token's output then sums its K choices in j order, whatever
 * the grouping, so the result does not depend on how experts are grouped.
 *
 * Expert parallelism (the context's expert group of G > 1 members): member j
 * holds experts [j nl, (j + 1) nl) (nl = experts / G), so the grouped rows
 * are also grouped by member. Forward sends each member its rows (an
 * all-to-all), the member runs its experts over the rows of all G members
 * (expert-major: expert l's rows from member 0, then member 1, ...), and
 * sends the outputs back in the order they came; the home rank sums each
 * token's K outputs in j order as above. Backward sends the weighted output
 * gradients the same way and the input gradients back. A token's arithmetic
 * is the serial one: each row goes through the same GEMMs, and its sum over
 * its choices happens at home in the same order.
 *
 * Capacity (capacity_factor = c > 0): each expert takes at most
 * ceil(c x seq_len x top_k / experts) choices of each sequence (a row of the
 * batch), first choices before second ones, earlier tokens first (GShard's
 * priority); the choices beyond are dropped: they add 0 to the token's output
 * (the residual carries it) and get no gradient. Per sequence, so that every
 * layout (data, micro-batches, experts, context) drops the same choices. */
typedef struct moe_state {
  pg_moe_opts o;
  int hidden_l;          /* this rank's columns of each expert's hidden width */
  int G, ep, nl;         /* expert group size, our place in it, experts held here */
  int64_t X;             /* rows the expert side can receive in one micro-batch */
  pg_param *gate;
  pg_param **w1, **w2, **w3; /* [nl]: experts ep nl .. ep nl + nl - 1 */
  /* per slot, kept from forward to backward; in the backend's memory unless marked host (a device engine runs
   * routing, grouping, gather and combine on the device and reads back only sizes and totals) */
  const float **saved_x;
  float *probs, *lse, *weight; /* [nslots][rows * E], [rows], [rows * K] */
  int32_t *expert, *pos;       /* [nslots][rows * K]; pos -1: a dropped choice */
  int32_t *token;              /* [nslots][rows * K]: grouped row -> its token */
  int32_t *offsets;            /* host [nslots][E + 1]: each expert's first grouped row (GEMM sizes, exchanges) */
  int64_t *cnt;                /* [nslots][G nl]: rows from member i for our expert l, at i nl + l */
  float *xr;                   /* G > 1: [nslots][X * dim] the received rows' inputs, expert-major */
  float *gu;                   /* [nslots][X * 2 hidden_l]: w1 x | w3 x of each row the experts ran */
  float *y;                    /* [nslots][rows * K * dim]: each grouped row's expert output (unweighted) */
  double *stats;               /* host [nslots][2 E]: this layer's choices and summed probabilities */
  /* scratch, one micro-batch */
  float *logits, *wcat, *dwcat, *xg, *act, *dyg, *dxg, *da, *dgu, *dweight, *dx_router;
  float *bufa, *bufb;          /* G > 1: [X * dim] rows in transit */
  float *xj;                   /* jitter: [rows * dim] the router's input, x times the noise */
  float *dprob;                /* [E] */
  int64_t *eoff, *cur;         /* [nl + 1], [nl] */
  int64_t *sc, *rc;            /* [G] counts of an all-to-all */
  int64_t *orows;              /* [2 G]: rows to each member, rows from each member */
  int64_t *ecount;             /* [E] */
  int32_t *fill;               /* [max_rows E] choices of each expert in each sequence (moe_drop's scratch) */
  int32_t *off_d;              /* [E + 1] the grouping's offsets, where the backend writes them */
  double *stats_d;             /* [2 E] the routing totals, likewise */
  float *lse_h, *dprob_h;      /* host [rows], [E]: the z-loss's lse, the load balance's gradient */
  int32_t *cp_all, *cp_seq;    /* context parallelism with capacity: [C rows K] every context rank's choices,
                                * [C rows K] one whole sequence's choices then kept flags, in sequence order */
  /* precision "bf16" (as linear's bf16_mm): the router's and the experts' products on bf16 operands with float32
   * sums, working weights remade at each call's first forward, the operands rounded into the engine's scratch */
  int bf16;
  uint16_t *gate16, *w13_16, *w2_16; /* [E D], [nl][2 hidden_l D] (w1 rows, then w3's), [nl][D hidden_l] */
  int64_t bf16_need;                 /* scratch elements of either operand: max(rows, X) max(2 hidden_l, D, E) */
  size_t bf16_bytes;
  long refreshes;
} moe_state;

static void moe_free_bf16(pg_module *m) {
  moe_state *s = m->state;
  uint16_t *b[] = {s->gate16, s->w13_16, s->w2_16};
  for (size_t i = 0; i < sizeof b / sizeof b[0]; i++) pg_be_release(home_backend(BE(m)), b[i]);
  s->gate16 = s->w13_16 = s->w2_16 = NULL;
  s->bf16_bytes = 0;
  s->bf16_need = 0;
}

/* The working weights of precision bf16 (in the backend's memory; never a recomputed block's arena: they live
 * from a call's first forward to its last backward), and the operand scratch it needs of the engine
 * (pg_module_bf16_scratch). */
static int moe_alloc_bf16(pg_module *m, int64_t rows) {
  moe_state *s = m->state;
  moe_free_bf16(m);
  int64_t E = s->o.experts, D = s->o.dim, H = s->hidden_l, nl = s->nl;
  int64_t wide = 2 * H > D ? 2 * H : D;
  if (E > wide) wide = E;
  int64_t n_gate = pg_size_product(2, (int64_t[]){E, D}), n_w = pg_size_product(3, (int64_t[]){nl, 2 * H, D}),
          n_op = pg_size_product(2, (int64_t[]){rows, wide});
  if (n_gate < 0 || n_w < 0 || n_op < 0 || (uint64_t)(n_gate + n_w + n_w / 2) > SIZE_MAX / 2)
    return pg_fail("%s: its bf16 working weights and operands are too large", m->name);
  const pg_backend *home = home_backend(BE(m));
  s->gate16 = home->ops->alloc(home, (size_t)(n_gate > 0 ? n_gate : 1) * 2);
  s->w13_16 = home->ops->alloc(home, (size_t)(n_w > 0 ? n_w : 1) * 2);
  s->w2_16 = home->ops->alloc(home, (size_t)(n_w / 2 > 0 ? n_w / 2 : 1) * 2);
  if (!s->gate16 || !s->w13_16 || !s->w2_16) {
    moe_free_bf16(m);
    return pg_fail("out of memory for %s (bf16 working weights)", m->name);
  }
  s->bf16_bytes = (size_t)(n_gate + n_w + n_w / 2) * 2;
  s->bf16_need = n_op;
  return PG_OK;
}

/* The bf16 working weights from the float32 masters (each call's first forward; see bf16_mm). */
static int moe_refresh_bf16(pg_module *m) {
  moe_state *s = m->state;
  size_t half = (size_t)s->hidden_l * s->o.dim;
  if (KERNEL(m, bf16_from_f32, s->gate16, s->gate->data, s->gate->numel)) return PG_ERR;
  for (int l = 0; l < s->nl; l++)
    if (KERNEL(m, bf16_from_f32, s->w13_16 + 2 * half * l, s->w1[l]->data, (int64_t)half) ||
        KERNEL(m, bf16_from_f32, s->w13_16 + 2 * half * l + half, s->w3[l]->data, (int64_t)half) ||
        KERNEL(m, bf16_from_f32, s->w2_16 + half * l, s->w2[l]->data, (int64_t)half))
      return PG_ERR;
  s->refreshes++;
  return PG_OK;
}

/* out[n,OC] = x[n,C] w^T: float32 on w32, or bf16 on w16. */
static int moe_mm_forward(pg_module *m, const pg_io *io, float *out, const float *x, const float *w32,
                          const uint16_t *w16, int n, int C, int OC) {
  if (((moe_state *)m->state)->bf16) return bf16_product_forward(m, io, out, x, w16, NULL, n, C, OC);
  return KERNEL(m, matmul_forward, out, x, w32, NULL, n, C, OC);
}

/* dinp = dy w (overwritten), dw += dy^T x; float32 or bf16 as moe_mm_forward. */
static int moe_mm_backward(pg_module *m, const pg_io *io, float *dinp, float *dw, const float *dy, const float *x,
                           const float *w32, const uint16_t *w16, int n, int C, int OC) {
  if (((moe_state *)m->state)->bf16) return bf16_product_backward(m, io, dinp, dw, NULL, dy, x, w16, n, C, OC);
  return KERNEL(m, matmul_backward, dinp, dw, NULL, dy, x, w32, n, C, OC);
}

/* n zeroed int32 in the backend's memory at *arr (the previous ones released); NULL when there is no room. */
static int32_t *moe_ints(pg_module *m, int32_t **arr, size_t n) {
  pg_be_release(BE(m), *arr);
  *arr = BE(m)->ops->alloc(BE(m), (n ? n : 1) * sizeof(int32_t));
  return *arr;
}

/* What a device engine cannot run yet, by name (the router's jitter noise and context parallelism's capacity
 * are drawn and decided on the host). */
static int moe_device_check(const pg_module *m) {
  const moe_state *s = m->state;
  const char *be = BE(m)->name;
  if (BE(m)->device == PG_CPU) return PG_OK;
  if (s->o.jitter > 0)
    return pg_fail("%s: the moe kind's jitter (router noise drawn on the host) runs on the cpu backend only for now, "
                   "not %s", m->name, be);
  if (m->ctx && m->ctx->context > 1 && s->o.capacity_factor > 0)
    return pg_fail("%s: the moe kind's capacity_factor under context parallelism (decided on the host) runs on the "
                   "cpu backend only for now, not %s", m->name, be);
  return PG_OK;
}

static int moe_alloc(pg_module *m, int nslots, int max_rows) {
  moe_state *s = m->state;
  if (moe_device_check(m)) return PG_ERR;
  if (alloc_leaf(m, nslots, max_rows) || alloc_ptrs(&s->saved_x, nslots)) return PG_ERR;
  int64_t E = s->o.experts, K = s->o.top_k, D = s->o.dim, H = s->hidden_l, R = (int64_t)max_rows * K;
  /* top-k picks an expert at most once per token: a member receives at most
   * min(nl, K) rows per token of each member */
  int64_t X = s->G == 1 ? R : (int64_t)s->G * max_rows * (s->nl < K ? s->nl : K);
  int64_t dims[3] = {nslots, X, 2 * H + 2 * D};
  if (R > INT32_MAX || X > INT32_MAX || pg_size_product(3, dims) < 0 ||
      pg_size_product(2, (int64_t[]){nslots, (int64_t)max_rows * E}) < 0)
    return pg_fail("%s: %d slots of %d rows x top_k=%d are too many for the expert buffers", m->name, nslots, max_rows,
                   (int)K);
  s->X = X;
  size_t S = (size_t)nslots, rows = (size_t)max_rows, G = (size_t)s->G, nl = (size_t)s->nl;
  free(s->offsets);
  free(s->stats);
  free(s->cnt);
  free(s->lse_h);
  free(s->dprob_h);
  pg_be_release(BE(m), s->stats_d);
  s->offsets = malloc(S * (E + 1) * sizeof(int32_t));
  s->stats = calloc(S * 2 * E, sizeof(double));
  s->cnt = calloc(S * G * nl, sizeof(int64_t));
  s->lse_h = malloc(rows * sizeof(float));
  s->dprob_h = malloc((size_t)E * sizeof(float));
  s->stats_d = BE(m)->ops->alloc(BE(m), (size_t)E * 2 * sizeof(double));
  if (!moe_ints(m, &s->expert, S * R) || !moe_ints(m, &s->pos, S * R) || !moe_ints(m, &s->token, S * R) ||
      !moe_ints(m, &s->fill, rows * E) || !moe_ints(m, &s->off_d, (size_t)E + 1) || !s->offsets || !s->stats ||
      !s->cnt || !s->lse_h || !s->dprob_h || !s->stats_d ||
      !alloc_floats(m, &s->probs, S * rows * E) || !alloc_floats(m, &s->lse, S * rows) ||
      !alloc_floats(m, &s->weight, S * R) || !alloc_floats(m, &s->gu, S * X * 2 * H) ||
      !alloc_floats(m, &s->y, S * R * D) || !alloc_floats(m, &s->logits, rows * E) ||
      !alloc_floats(m, &s->wcat, (size_t)2 * H * D) || !alloc_floats(m, &s->dwcat, (size_t)2 * H * D) ||
      !alloc_floats(m, &s->xg, R * D) || !alloc_floats(m, &s->act, X * H) || !alloc_floats(m, &s->dyg, R * D) ||
      !alloc_floats(m, &s->dxg, R * D) || !alloc_floats(m, &s->da, X * H) || !alloc_floats(m, &s->dgu, X * 2 * H) ||
      !alloc_floats(m, &s->dweight, R) || !alloc_floats(m, &s->dx_router, rows * D) || !alloc_floats(m, &s->dprob, E) ||
      (s->o.jitter > 0 && !alloc_floats(m, &s->xj, rows * D)))
    return pg_fail("out of memory for %s (expert buffers)", m->name);
  if (s->G > 1 && (!alloc_floats(m, &s->xr, S * X * D) || !alloc_floats(m, &s->bufa, X * D) ||
                   !alloc_floats(m, &s->bufb, X * D)))
    return pg_fail("out of memory for %s (expert-parallel buffers)", m->name);
  if (m->ctx && m->ctx->context > 1 && s->o.capacity_factor > 0) {
    free(s->cp_all);
    free(s->cp_seq);
    size_t C = (size_t)m->ctx->context;
    if (pg_size_product(3, (int64_t[]){(int64_t)C, R, (int64_t)sizeof(int32_t)}) < 0)
      return pg_fail("%s: context=%d x %lld choices are too many for the context group's buffers", m->name, (int)C,
                     (long long)R);
    s->cp_all = malloc(C * R * sizeof(int32_t));
    s->cp_seq = malloc(C * R * sizeof(int32_t));
    if (!s->cp_all || !s->cp_seq) return pg_fail("out of memory for %s (the context group's choices)", m->name);
  }
  if (s->bf16 && moe_alloc_bf16(m, (int64_t)max_rows > X ? (int64_t)max_rows : X))
    return PG_ERR;
  m->saved_bytes_per_slot += (rows * (E + 1) + R * (1 + D) + X * 2 * H + (s->G > 1 ? X * D : 0)) * sizeof(float) +
                             R * 3 * sizeof(int32_t);
  return PG_OK;
}

/* Expert l's [w1; w3] shards as one [2 hidden_l, dim] matrix, so that one
 * GEMM gives the gate|up rows the SwiGLU kernels take. */
static int moe_stack_w13(pg_module *m, int l) {
  moe_state *s = m->state;
  size_t n = (size_t)s->hidden_l * s->o.dim * sizeof(float);
  const pg_backend *be = BE(m);
  return be->ops->copy(be, s->wcat, s->w1[l]->data, n, PG_COPY_DEVICE_TO_DEVICE) ||
         be->ops->copy(be, (char *)s->wcat + n, s->w3[l]->data, n, PG_COPY_DEVICE_TO_DEVICE);
}

/* The load-balancing loss over the micro-batch's totals, and the gradient it
 * gives every row's router probabilities (dprob, scaled by `scale`):
 * aux = E sum_e C_e P_e / (N L)^2 with C_e the choices of e and P_e the summed
 * probabilities over the N rows of all L layers (transformers' form: the mean
 * over the concatenated layers' rows of the one-hot choices, summed over the
 * k choices, times the mean probability). */
static double moe_balance(const moe_state *s, const double *totals, int N, int L, float *dprob, double scale) {
  int E = s->o.experts;
  double nl = (double)N * L, aux = 0;
  for (int e = 0; e < E; e++) {
    aux += totals[e] * totals[E + e];
    if (dprob) dprob[e] = (float)(scale * E * totals[e] / (nl * nl));
  }
  return E * aux / (nl * nl);
}

/* Switch Transformer's jitter: the router's input times uniform noise in
 * [1 - j, 1 + j], in training only. The noise is a function of (seed, this
 * layer's name, the engine's step, the token's row in the global batch,
 * the feature), so every layout (and a recomputation) draws the same; the
 * experts see x itself. Returns the router's input: x, or s->xj. */
static uint64_t moe_jitter_key(const pg_module *m, const pg_io *io) {
  return pg_rng_subkey(pg_rng_key(m->ctx ? m->ctx->seed : 0, m->name), (uint64_t)io->step);
}

/* Local row t's place in the global batch: with context parallelism (pg_io.cp_chunk) its sequence's place times
 * the whole length plus its position in the whole sequence (pg_cp_position), as the serial model numbers it. */
static int64_t moe_global_row(const pg_module *m, const pg_io *io, int t) {
  int L = io->cp_chunk;
  if (!(m->ctx && m->ctx->context > 1 && L > 0)) return io->global_row0 + t;
  int64_t C = m->ctx->context, Tl = 2 * (int64_t)L, seq = io->global_row0 / Tl + t / Tl;
  return seq * C * Tl + pg_cp_position((int)C, m->ctx->cp_rank, L, t % Tl);
}

static float moe_noise(const pg_module *m, uint64_t key, const pg_io *io, int t, int d) {
  const moe_state *s = m->state;
  uint64_t at = (uint64_t)moe_global_row(m, io, t) * (uint64_t)s->o.dim + (uint64_t)d;
  return (float)(1 - s->o.jitter) + (float)(2 * s->o.jitter) * pg_uniform_at(key, at);
}

static const float *moe_jitter(pg_module *m, const pg_io *io, const float *x, int N) {
  moe_state *s = m->state;
  if (!(s->o.jitter > 0) || !io->want_grad) return x;
  uint64_t key = moe_jitter_key(m, io);
  int D = s->o.dim;
  for (int t = 0; t < N; t++)
    for (int d = 0; d < D; d++) s->xj[(size_t)t * D + d] = x[(size_t)t * D + d] * moe_noise(m, key, io, t, d);
  return s->xj;
}

/* Each expert's capacity in a sequence of T tokens (kernels.h's pg_moe_drop): ceil(c T K / E) with
 * capacity_factor c; INT32_MAX keeps every choice. */
static int moe_capacity(const moe_state *s, int T) {
  if (!(s->o.capacity_factor > 0)) return INT32_MAX;
  double c = ceil(s->o.capacity_factor * T * s->o.top_k / s->o.experts);
  return c > INT32_MAX ? INT32_MAX : (int)c;
}

/* The same under context parallelism: a sequence's tokens are spread over the context group (chunks r and
 * 2C-1-r of each, pg_cp_position), so every member's choices are gathered, each whole sequence's put in order,
 * the rule above applied to it as the serial model does, and each member keeps its own rows' decisions. */
static int moe_drop_cp(pg_module *m, const pg_io *io, const int32_t *expert, int32_t *pos, int N) {
  moe_state *s = m->state;
  if (!(s->o.capacity_factor > 0)) return PG_OK;
  int C = m->ctx->context, r = m->ctx->cp_rank, L = io->cp_chunk, K = s->o.top_k, Tl = io->T;
  int64_t n = (int64_t)N * K;
  memcpy(s->cp_all + (size_t)r * n, expert, (size_t)n * sizeof(int32_t));
  if (pg_all_gather_buf(m->ctx, PG_MODE_CONTEXT, s->cp_all, n, PG_INT32)) return PG_ERR;
  int T = C * Tl; /* the whole sequence */
  for (int b = 0; b < N / Tl; b++) {
    for (int q = 0; q < C; q++)
      for (int t = 0; t < Tl; t++)
        for (int j = 0; j < K; j++)
          s->cp_seq[pg_cp_position(C, q, L, t) * K + j] = s->cp_all[(size_t)q * n + ((size_t)b * Tl + t) * K + j];
    /* the serial rule over the sequence's T tokens; cp_seq then says which choices are kept (1) */
    int E = s->o.experts, cap = moe_capacity(s, T);
    for (int e = 0; e < E; e++) s->fill[e] = 0;
    for (int j = 0; j < K; j++)
      for (int t = 0; t < T; t++) {
        int i = t * K + j;
        s->cp_seq[i] = s->fill[s->cp_seq[i]]++ < cap;
      }
    for (int t = 0; t < Tl; t++)
      for (int j = 0; j < K; j++)
        if (!s->cp_seq[pg_cp_position(C, r, L, t) * K + j]) pos[((size_t)b * Tl + t) * K + j] = -1;
  }
  return PG_OK;
}

/* Rows between source-major order (member i's rows for our expert 0, 1, ...,
 * then member i + 1's) and expert-major order (our expert l's rows from
 * member 0, 1, ...); also sets eoff (expert-major starts). */
static int moe_permute(pg_module *m, const int64_t *cnt, const float *src, float *dst, size_t W, int to_expert) {
  moe_state *s = m->state;
  int G = s->G, nl = s->nl;
  s->eoff[0] = 0;
  for (int l = 0; l < nl; l++) {
    int64_t n = 0;
    for (int i = 0; i < G; i++) n += cnt[i * nl + l];
    s->eoff[l + 1] = s->eoff[l] + n;
    s->cur[l] = s->eoff[l];
  }
  if (!src) return PG_OK;
  int64_t so = 0;
  for (int i = 0; i < G; i++)
    for (int l = 0; l < nl; l++) {
      int64_t n = cnt[i * nl + l], eo = s->cur[l];
      s->cur[l] += n;
      const float *a = to_expert ? src + so * W : src + eo * W;
      float *b = to_expert ? dst + eo * W : dst + so * W;
      if (n && BE(m)->ops->copy(BE(m), b, a, (size_t)n * W * sizeof(float), PG_COPY_DEVICE_TO_DEVICE)) return PG_ERR;
      so += n;
    }
  return PG_OK;
}

/* The all-to-all of rows between the expert group's members: `out_rows[j]`
 * rows of width W to member j, `in_rows[i]` from member i. */
static int moe_exchange(pg_module *m, const float *send, const int64_t *out_rows, float *recv, const int64_t *in_rows,
                        size_t W) {
  moe_state *s = m->state;
  for (int j = 0; j < s->G; j++) {
    s->sc[j] = out_rows[j] * (int64_t)W;
    s->rc[j] = in_rows[j] * (int64_t)W;
  }
  return pg_all_to_all_v(m->ctx, PG_MODE_EXPERT, send, s->sc, recv, s->rc, PG_FLOAT32);
}

/* Rows per member: of the grouped rows (by expert offsets off), and of the received ones (cnt). */
static void moe_rows(const moe_state *s, const int32_t *off, const int64_t *cnt, int64_t *out_rows, int64_t *in_rows) {
  for (int j = 0; j < s->G; j++) {
    out_rows[j] = off[(j + 1) * s->nl] - off[j * s->nl];
    in_rows[j] = 0;
    for (int l = 0; l < s->nl; l++) in_rows[j] += cnt[j * s->nl + l];
  }
}

/* Our experts over rows grouped expert-major (eoff): gate|up and output. */
static int moe_experts_forward(pg_module *m, const pg_io *io, const float *x, float *gu, float *y) {
  moe_state *s = m->state;
  int D = s->o.dim, H = s->hidden_l;
  size_t half = (size_t)H * D;
  for (int l = 0; l < s->nl; l++) {
    int64_t r0 = s->eoff[l], n = s->eoff[l + 1] - r0;
    if (!n) continue;
    if (!s->bf16 && moe_stack_w13(m, l)) return PG_ERR;
    if (moe_mm_forward(m, io, gu + r0 * 2 * H, x + r0 * D, s->wcat, s->w13_16 + 2 * half * l, (int)n, D, 2 * H) ||
        KERNEL(m, swiglu_forward, s->act + r0 * H, gu + r0 * 2 * H, (int)n, H) ||
        moe_mm_forward(m, io, y + r0 * D, s->act + r0 * H, s->w2[l]->data, s->w2_16 + half * l, (int)n, H, D))
      return PG_ERR;
  }
  return PG_OK;
}

/* Their backward: input gradients of the rows into dx, weight gradients added. */
static int moe_experts_backward(pg_module *m, const pg_io *io, const float *x, const float *gu, const float *dy,
                                float *dx) {
  moe_state *s = m->state;
  int D = s->o.dim, H = s->hidden_l;
  size_t half = (size_t)H * D;
  for (int l = 0; l < s->nl; l++) {
    int64_t r0 = s->eoff[l], n = s->eoff[l + 1] - r0;
    if (!n) continue;
    const float *gu_e = gu + r0 * 2 * H;
    float *act = s->act + r0 * H, *da = s->da + r0 * H, *dgu = s->dgu + r0 * 2 * H;
    /* act recomputed: cheaper to keep gate|up only */
    if (KERNEL(m, swiglu_forward, act, gu_e, (int)n, H) ||
        moe_mm_backward(m, io, da, s->w2[l]->grad, dy + r0 * D, act, s->w2[l]->data, s->w2_16 + half * l, (int)n, H,
                        D) ||
        KERNEL(m, swiglu_backward, dgu, gu_e, da, (int)n, H) || (!s->bf16 && moe_stack_w13(m, l)) ||
        BE(m)->ops->zero(BE(m), s->dwcat, 2 * half * sizeof(float)) ||
        moe_mm_backward(m, io, dx + r0 * D, s->dwcat, dgu, x + r0 * D, s->wcat, s->w13_16 + 2 * half * l, (int)n, D,
                        2 * H) ||
        KERNEL(m, residual_forward, s->w1[l]->grad, s->w1[l]->grad, s->dwcat, (int64_t)half) ||
        KERNEL(m, residual_forward, s->w3[l]->grad, s->w3[l]->grad, s->dwcat + half, (int64_t)half))
      return PG_ERR;
  }
  return PG_OK;
}

/* Context parallelism: this rank's rows are two chunks of each sequence (pg_io.cp_chunk); the routing totals are
 * then summed over data x context, where the dense gradients are averaged. */
static int moe_cp_on(const pg_module *m, const pg_io *io) { return m->ctx && m->ctx->context > 1 && io->cp_chunk > 0; }
static pg_mode moe_totals_group(const pg_module *m) {
  return m->ctx && m->ctx->context > 1 ? PG_MODE_DATA_CONTEXT : PG_MODE_DATA;
}
static int moe_totals_size(const pg_module *m) { return m->ctx ? m->ctx->group[moe_totals_group(m)].size : 1; }

static int moe_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  moe_state *s = m->state;
  if (check_rows(m, slot, io)) return PG_ERR;
  int N = io->B * io->T, E = s->o.experts, K = s->o.top_k, D = s->o.dim, H = s->hidden_l;
  size_t rows = (size_t)m->max_rows, Rmax = rows * K;
  float *probs = s->probs + slot * rows * E, *lse = s->lse + slot * rows, *weight = s->weight + slot * Rmax;
  int32_t *expert = s->expert + slot * Rmax, *pos = s->pos + slot * Rmax, *token = s->token + slot * Rmax;
  int32_t *off = s->offsets + (size_t)slot * (E + 1);
  int64_t *cnt = s->cnt + (size_t)slot * s->G * s->nl;
  float *gu = s->gu + slot * (size_t)s->X * 2 * H, *ye = s->y + slot * Rmax * D, *out = slot_out(m, slot);
  double *stats = s->stats + (size_t)slot * 2 * E;
  const pg_backend *be = BE(m);
  if (s->bf16 && io->mb == 0 && !io->recomputing && moe_refresh_bf16(m)) return PG_ERR;
  /* route: every tensor rank computes the same (router and x replicated); the totals and the grouping's offsets
   * come back to the host (the auxiliary losses; the experts' GEMM sizes and exchanges) */
  if (moe_mm_forward(m, io, s->logits, moe_jitter(m, io, x, N), s->gate->data, s->gate16, N, D, E) ||
      KERNEL(m, moe_route_forward, probs, lse, expert, weight, s->logits, N, E, K) ||
      KERNEL(m, moe_route_stats, s->stats_d, s->stats_d + E, probs, expert, N, E, K) ||
      be->ops->copy(be, stats, s->stats_d, 2 * (size_t)E * sizeof(double), PG_COPY_DEVICE_TO_HOST))
    return PG_ERR;
  /* decoding with the key/value cache drops nothing (transformers' Mixtral has no capacity): a capacity per
   * sequence of io->T tokens would differ between a prompt's prefill and its one-token steps */
  int cap = moe_cp_on(m, io) || io->decode ? INT32_MAX : moe_capacity(s, io->T);
  if (KERNEL(m, moe_drop, pos, s->fill, expert, N, io->T, E, K, cap)) return PG_ERR;
  if (moe_cp_on(m, io) && moe_drop_cp(m, io, expert, pos, N)) return PG_ERR; /* host memory: moe_device_check */
  /* group by expert (stable in token then choice order) */
  if (KERNEL(m, moe_group, pos, token, s->off_d, expert, N, E, K) ||
      be->ops->copy(be, off, s->off_d, ((size_t)E + 1) * sizeof(int32_t), PG_COPY_DEVICE_TO_HOST))
    return PG_ERR;
  int Rk = off[E]; /* the choices kept */
  if (KERNEL(m, moe_gather, s->xg, x, token, Rk, D)) return PG_ERR;
  if (s->G == 1) {
    for (int e = 0; e <= E; e++) s->eoff[e] = off[e];
    if (moe_experts_forward(m, io, s->xg, gu, ye)) return PG_ERR;
  } else {
    /* each member's experts' row counts, then the rows, to it; outputs back */
    for (int e = 0; e < E; e++) s->ecount[e] = off[e + 1] - off[e];
    for (int j = 0; j < s->G; j++) s->sc[j] = s->rc[j] = s->nl;
    int64_t *orows = s->orows;
    int rc = pg_all_to_all_v(m->ctx, PG_MODE_EXPERT, s->ecount, s->sc, cnt, s->rc, PG_INT64);
    if (!rc) {
      /* X bounds the rows when every member's micro-batch fits this rank's
       * buffers; members with larger ones (different batches on the data
       * ranks) fail together here, not in the exchange that would follow */
      moe_rows(s, off, cnt, orows, orows + s->G);
      int64_t in_total = 0;
      for (int i = 0; i < s->G; i++) in_total += orows[s->G + i];
      int32_t over = in_total > s->X;
      rc = pg_all_reduce_buf(m->ctx, PG_MODE_EXPERT, &over, 1, PG_INT32, PG_REDUCE_MAX);
      if (!rc && over)
        rc = pg_fail("%s: a member of the expert group receives more rows than it holds (this rank %lld, room for %lld): "
                     "every data rank of an expert group must run micro-batches of the same size", m->name,
                     (long long)in_total, (long long)s->X);
    }
    float *xr = s->xr + slot * (size_t)s->X * D;
    if (!rc) rc = moe_exchange(m, s->xg, orows, s->bufa, orows + s->G, (size_t)D);
    if (!rc) rc = moe_permute(m, cnt, s->bufa, xr, (size_t)D, 1);
    if (!rc) rc = moe_experts_forward(m, io, xr, gu, s->bufb);
    if (!rc) rc = moe_permute(m, cnt, s->bufb, s->bufa, (size_t)D, 0);
    if (!rc) rc = moe_exchange(m, s->bufa, orows + s->G, ye, orows, (size_t)D);
    if (rc) return PG_ERR;
  }
  /* each token's kept choices, weighted, in choice order */
  if (KERNEL(m, moe_combine, out, ye, pos, weight, N, K, D)) return PG_ERR;
  /* w2 is row-parallel: each rank holds a partial sum of every expert's output */
  if (pg_tp_reduce_forward(m, out, (int64_t)N * D, PG_FLOAT32)) return PG_ERR;
  s->saved_x[slot] = x;
  *y = out;
  if (!io->want_grad || io->recomputing) return PG_OK;
  /* the auxiliary losses, as the objective counts them: times the rows */
  const double *totals = stats;
  int L = 1, Dg = 1;
  if (io->router) {
    for (int i = 0; i < 2 * E; i++) io->router[i] += stats[i];
    totals = io->router;
    L = s->o.layers;
    /* the load balance of the global batch, as transformers' over the batch:
     * after the last layer the totals are summed over the data group (each
     * micro-batch with the same one of the other ranks; over data x context
     * under context parallelism), and hold the whole model's and the whole
     * group's from then on (backward, the engine's expert_tokens) */
    Dg = moe_totals_size(m);
    if (s->o.layer == s->o.layers - 1 &&
        pg_all_reduce_buf(m->ctx, moe_totals_group(m), io->router, 2 * (int64_t)E, PG_FLOAT64, PG_REDUCE_SUM))
      return PG_ERR;
  }
  if (s->o.aux_loss_coef != 0 && (!io->router || s->o.layer == s->o.layers - 1))
    io->aux_sum += (double)N * s->o.aux_loss_coef * moe_balance(s, totals, N * Dg, L, NULL, 0);
  if (s->o.z_loss_coef != 0) {
    double z = 0;
    if (be->ops->copy(be, s->lse_h, lse, (size_t)N * sizeof(float), PG_COPY_DEVICE_TO_HOST)) return PG_ERR;
    for (int t = 0; t < N; t++) z += (double)s->lse_h[t] * s->lse_h[t];
    io->aux_sum += s->o.z_loss_coef * z / L; /* N x (z / (N L)) */
  }
  return PG_OK;
}

static int moe_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  moe_state *s = m->state;
  int N = io->B * io->T, E = s->o.experts, K = s->o.top_k, D = s->o.dim, H = s->hidden_l, R = N * K;
  size_t rows = (size_t)m->max_rows, Rmax = rows * K;
  const float *x = s->saved_x[slot];
  float *probs = s->probs + slot * rows * E, *lse = s->lse + slot * rows, *weight = s->weight + slot * Rmax;
  int32_t *expert = s->expert + slot * Rmax, *pos = s->pos + slot * Rmax, *token = s->token + slot * Rmax;
  int32_t *off = s->offsets + (size_t)slot * (E + 1);
  int64_t *cnt = s->cnt + (size_t)slot * s->G * s->nl;
  float *gu = s->gu + slot * (size_t)s->X * 2 * H, *ye = s->y + slot * Rmax * D;
  const pg_backend *be = BE(m);
  /* d loss / d routing weight: dy . (the expert's full output), summed over the tensor group; 0 when dropped;
   * and the experts' output gradients, weighted, in grouped order */
  if (KERNEL(m, moe_combine_backward, s->dweight, s->dyg, dy, ye, pos, weight, N, K, D)) return PG_ERR;
  if (pg_all_reduce_buf(m->ctx, PG_MODE_TENSOR, s->dweight, R, PG_FLOAT32, PG_REDUCE_SUM)) return PG_ERR;
  /* the router: renormalised weights, load balancing, z-loss */
  const double *totals = io->router ? io->router : s->stats + (size_t)slot * 2 * E;
  int L = io->router ? s->o.layers : 1, Dg = io->router ? moe_totals_size(m) : 1;
  /* the objective counts each micro-batch's auxiliary losses times its rows: d/d aux = rows x dloss; the
   * load balance is the data group's (global totals), whose gradients the data group then averages: times Dg */
  double scale = (double)N * io->dloss;
  moe_balance(s, totals, N * Dg, L, s->dprob_h, scale * Dg * s->o.aux_loss_coef);
  float zscale = (float)(scale * s->o.z_loss_coef / ((double)N * L));
  if (be->ops->copy(be, s->dprob, s->dprob_h, (size_t)E * sizeof(float), PG_COPY_HOST_TO_DEVICE) ||
      KERNEL(m, moe_route_backward, s->logits, s->dweight, s->o.aux_loss_coef != 0 ? s->dprob : NULL, zscale, probs,
             lse, expert, weight, N, E, K))
    return PG_ERR;
  const float *xr = moe_jitter(m, io, x, N); /* the same noise again */
  if (moe_mm_backward(m, io, s->dx_router, s->gate->grad, s->logits, xr, s->gate->data, s->gate16, N, D, E))
    return PG_ERR;
  if (xr != x) { /* d(x u)/dx = u, the same noise */
    uint64_t key = moe_jitter_key(m, io);
    for (int t = 0; t < N; t++)
      for (int d = 0; d < D; d++) s->dx_router[(size_t)t * D + d] *= moe_noise(m, key, io, t, d);
  }
  /* the experts, each over its grouped rows */
  int Rk = off[E];
  if (s->G == 1) {
    if (KERNEL(m, moe_gather, s->xg, x, token, Rk, D)) return PG_ERR;
    for (int e = 0; e <= E; e++) s->eoff[e] = off[e];
    if (moe_experts_backward(m, io, s->xg, gu, s->dyg, s->dxg)) return PG_ERR;
  } else {
    int64_t *orows = s->orows;
    moe_rows(s, off, cnt, orows, orows + s->G);
    int rc = moe_exchange(m, s->dyg, orows, s->bufa, orows + s->G, (size_t)D);
    if (!rc) rc = moe_permute(m, cnt, s->bufa, s->bufb, (size_t)D, 1);
    if (!rc) rc = moe_experts_backward(m, io, s->xr + slot * (size_t)s->X * D, gu, s->bufb, s->bufa);
    if (!rc) rc = moe_permute(m, cnt, s->bufa, s->bufb, (size_t)D, 0);
    if (!rc) rc = moe_exchange(m, s->bufb, orows + s->G, s->dxg, orows, (size_t)D);
    if (rc) return PG_ERR;
  }
  /* w1/w3 are column-parallel: the experts' input gradient is a partial sum;
   * the router's is whole on every rank and joins after the reduction */
  if (KERNEL(m, moe_combine, m->dinp, s->dxg, pos, NULL, N, K, D) || pg_tp_copy_backward(m, m->dinp, (int64_t)N * D) ||
      KERNEL(m, residual_forward, m->dinp, m->dinp, s->dx_router, (int64_t)N * D))
    return PG_ERR;
  *dx = m->dinp;
  return PG_OK;
}

static void moe_destroy(pg_module *m) {
  moe_state *s = m->state;
  free(s->saved_x);
  free(s->w1);
  free(s->w2);
  free(s->w3);
  free(s->offsets);
  free(s->stats);
  free(s->cnt);
  free(s->lse_h);
  free(s->dprob_h);
  free(s->eoff);
  free(s->cur);
  free(s->sc);
  free(s->rc);
  free(s->orows);
  free(s->ecount);
  free(s->cp_all);
  free(s->cp_seq);
  float *bufs[] = {s->probs, s->lse, s->weight, s->gu, s->y, s->logits, s->wcat, s->dwcat, s->xg, s->act, s->dyg,
                   s->dxg, s->da, s->dgu, s->dweight, s->dx_router, s->dprob, s->xr, s->bufa, s->bufb, s->xj};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) pg_be_release(BE(m), bufs[i]);
  void *ibufs[] = {s->expert, s->pos, s->token, s->fill, s->off_d, s->stats_d};
  for (size_t i = 0; i < sizeof ibufs / sizeof ibufs[0]; i++) pg_be_release(BE(m), ibufs[i]);
  moe_free_bf16(m);
}

pg_module *pg_moe_new(pg_context *ctx, const char *name, const pg_moe_opts *o) {
  int T = tp_size(ctx), r = tp_rank(ctx), G = ctx ? ctx->expert : 1, ep = ctx ? ctx->ep_rank : 0;
  if (o->dim < 1 || o->hidden < 1) return pg_fail_null("%s: MoE needs positive dim and hidden (%d, %d)", name, o->dim, o->hidden);
  if (o->experts < 1) return pg_fail_null("%s: MoE needs at least 1 expert, not experts=%d", name, o->experts);
  if (o->top_k < 1 || o->top_k > o->experts)
    return pg_fail_null("%s: top_k=%d must be from 1 to experts=%d", name, o->top_k, o->experts);
  if (o->hidden % T)
    return pg_fail_null("%s: tensor=%d does not divide the experts' hidden width %d", name, T, o->hidden);
  if (o->experts % G)
    return pg_fail_null("%s: expert=%d does not divide experts=%d (each member of an expert group holds experts / "
                        "expert of them)", name, G, o->experts);
  if (o->layers < 1 || o->layer < 0 || o->layer >= o->layers)
    return pg_fail_null("%s: MoE layer %d of %d", name, o->layer, o->layers);
  if (!(o->aux_loss_coef >= 0) || !(o->z_loss_coef >= 0))
    return pg_fail_null("%s: aux_loss_coef and z_loss_coef must be >= 0 (%g, %g)", name, o->aux_loss_coef, o->z_loss_coef);
  if (!(o->jitter >= 0) || o->jitter >= 1)
    return pg_fail_null("%s: jitter must be from 0 to below 1 (noise in [1 - jitter, 1 + jitter]), not %g", name,
                        o->jitter);
  if (!(o->capacity_factor >= 0) || o->capacity_factor > 1e9)
    return pg_fail_null("%s: capacity_factor must be > 0 (0: no token dropped), not %g", name, o->capacity_factor);
  pg_module *m = module_new(&pg_kind_moe, ctx, name, o->dim, o->dim, sizeof(moe_state));
  if (!m) return NULL;
  moe_state *s = m->state;
  s->o = *o;
  s->hidden_l = o->hidden / T;
  s->G = G;
  s->ep = ep;
  s->nl = o->experts / G;
  int E = o->experts, nl = s->nl;
  s->w1 = calloc((size_t)nl, sizeof *s->w1);
  s->w2 = calloc((size_t)nl, sizeof *s->w2);
  s->w3 = calloc((size_t)nl, sizeof *s->w3);
  s->eoff = calloc((size_t)E + 1, sizeof *s->eoff); /* E + 1 >= nl + 1: the serial path copies all offsets */
  s->cur = calloc((size_t)nl, sizeof *s->cur);
  s->sc = calloc((size_t)G, sizeof *s->sc);
  s->rc = calloc((size_t)G, sizeof *s->rc);
  s->orows = calloc(2 * (size_t)G, sizeof *s->orows);
  s->ecount = calloc((size_t)E, sizeof *s->ecount);
  if (!s->w1 || !s->w2 || !s->w3 || !s->eoff || !s->cur || !s->sc || !s->rc || !s->orows || !s->ecount) {
    pg_module_free(m);
    return pg_fail_null("out of memory");
  }
  int64_t gshape[2] = {E, o->dim}, up[2] = {o->hidden, o->dim}, down[2] = {o->dim, o->hidden};
  if (add_param(m, param_make(name, "gate.weight", 2, gshape, 0, 1, 1, 0, PG_INIT_NORMAL, o->init_std))) goto fail;
  s->gate = m->params[0];
  for (int l = 0; l < nl; l++) {
    int e = ep * nl + l; /* parameters keep the serial model's names: checkpoints reslice across layouts */
    char w1[64], w2[64], w3[64];
    snprintf(w1, sizeof w1, "experts.%d.w1.weight", e);
    snprintf(w2, sizeof w2, "experts.%d.w2.weight", e);
    snprintf(w3, sizeof w3, "experts.%d.w3.weight", e);
    if (add_param(m, param_make(name, w1, 2, up, 0, 1, T, r, PG_INIT_NORMAL, o->init_std))) goto fail;
    s->w1[l] = m->params[m->nparams - 1];
    if (add_param(m, param_make(name, w2, 2, down, 1, 1, T, r, PG_INIT_NORMAL, o->init_std))) goto fail;
    s->w2[l] = m->params[m->nparams - 1];
    if (add_param(m, param_make(name, w3, 2, up, 0, 1, T, r, PG_INIT_NORMAL, o->init_std))) goto fail;
    s->w3[l] = m->params[m->nparams - 1];
    /* held by one member of the expert group: gradients averaged over expert_data (pg_engine.c) */
    s->w1[l]->expert = s->w2[l]->expert = s->w3[l]->expert = G > 1;
  }
  return m;
fail:
  pg_module_free(m);
  return NULL;
}

static pg_module *build_moe(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env) {
  (void)env;
  int bad = 0;
  pg_moe_opts o = {.dim = DESC_INT(d, "dim", 0), .hidden = DESC_INT(d, "hidden", 0),
                   .experts = DESC_INT(d, "experts", 0), .top_k = DESC_INT_REQ(d, "top_k"),
                   .layer = DESC_INT(d, "layer", 0), .layers = DESC_INT(d, "layers", 1),
                   .aux_loss_coef = d->ops->number(d, "aux_loss_coef", 0),
                   .z_loss_coef = d->ops->number(d, "z_loss_coef", 0),
                   .capacity_factor = d->ops->number(d, "capacity_factor", 0),
                   .jitter = d->ops->number(d, "jitter", 0),
                   .init_std = (float)DESC_NUMBER_REQ(d, "init_std")};
  return bad ? NULL : pg_moe_new(ctx, name, &o);
}

/* ---------------------------------------------------------------- its traits */

static void moe_bf16_on(pg_module *m) { ((moe_state *)m->state)->bf16 = 1; }

/* Both operand scratches hold max(rows, X) rows of its widest product. */
static void moe_bf16_need(const pg_module *m, pg_bf16_need *need) {
  const moe_state *moe = m->state;
  for (int k = 0; moe->bf16 && k < 2; k++)
    if (moe->bf16_need > need->operand[k]) need->operand[k] = moe->bf16_need;
}

static size_t moe_bf16_bytes(const pg_module *m) { return ((const moe_state *)m->state)->bf16_bytes; }

/* Routing needs every row of the micro-batch (sp_gather ... sp_scatter under
 * sequence parallelism); routing, grouping, gather and combine are backend
 * kernels (kernels/cuda/moe.cu on a device; what cannot run there yet is
 * refused by name in moe_device_check). Its layers share the routing totals
 * (pg_io.router), so parallelize numbers them. */
const pg_module_kind pg_kind_moe = {
    .ops = {"moe", moe_alloc, moe_forward, moe_backward, moe_destroy},
    .traits = {.name = "moe",
               .assembly = PG_KIND_BUILT,
               .sp = PG_SP_ALL_ROWS,
               .flags = PG_KIND_ROUTER},
    .build = build_moe,
    .bf16_on = moe_bf16_on,
    .bf16_need = moe_bf16_need,
    .bf16_bytes = moe_bf16_bytes,
};
