/* kind_attention.c: the causal self-attention core (multi-head or grouped-query, optional RoPE). */
#include "module_impl.h"
#include "pg_env.h"
#include "pg_size.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- attention */

typedef struct attention_state {
  pg_attention_opts o;
  int heads_l, kv_l, max_seq;
  float *saved;   /* [nslots][saved_floats]: each row's log-sum-exp [B, heads_l, T] (the flash kernels' lse), and
                     with bf16 q|k|v the float32 output [rows, out_width] after it (the backward's delta reads it) */
  float *scratch; /* backward (attention_scratch_floats: linear in the rows) */
  float *rotated; /* with RoPE: [nslots][rows * in_width], q|k rotated, v copied (on tensor cores as bf16 bits:
                     the first half of the slot's room, which stays float32-sized for the other shapes' core) */
  float *cos_t, *sin_t; /* with RoPE: [max_seq, head_dim / 2] on the backend */
  float *slopes;  /* with ALiBi: this rank's heads_l slopes on the backend */
  const float **saved_x;
  int saved_slot; /* recompute: the micro-batch whose lse (and output) saved holds (-1: none) */
  int flash_bf16_env; /* PG_FLASH_BF16 (default on): whether tensor_cores may pick the bf16 flash kernels */
  /* decoding (pg_io.decode), on the home backend: keys and values [cache_rows][max_seq][kv_l head_dim],
   * the positions each sequence holds (host), the new rows' q|k|v in float32 (widened, rotated), the scores */
  float *kcache, *vcache, *dec_x, *dec_scores;
  int32_t *cached;
  int cache_rows;
  size_t dec_x_n, dec_scores_n;
  /* context parallelism (cp_on), the ring: per slot the log-sum-exp of every query row [nslots][B, 2, heads_l, L]
   * (and with bf16 q|k|v the float32 output [nslots][rows, out_width], the backward's delta reads it); shared by
   * the micro-batches, the two key/value blocks of the exchange [2][rows, 2 kv_l head_dim] and their gradients,
   * the online softmax's state (acc [rows, out_width], max and sum [B, 2, heads_l, L]) and delta */
  float *cp_lse, *cp_out, *cp_kv[2], *cp_dkv[3], *cp_acc, *cp_mx, *cp_sm, *cp_delta;
  float *cp_mx0; /* [rows * heads_l] -INFINITY, the running maxima's start (copied, as device memory has no fill) */
} attention_state;

/* Context parallelism: the module's context splits sequences (pg_io.cp_chunk says how). */
static int cp_size(const pg_module *m) { return m->ctx ? m->ctx->context : 1; }
static int cp_on(const pg_module *m, const pg_io *io) { return cp_size(m) > 1 && io->cp_chunk > 0; }

/* The lse part of `saved`, rounded up to 8 floats: the float32 output after it starts 32 bytes aligned, as the
 * tensor-core kernels' tiles need (out_width is a multiple of the head size, 64 or 128, there). */
static size_t lse_floats(const pg_module *m, const attention_state *s) {
  return ((size_t)m->max_rows * s->heads_l + 7) / 8 * 8;
}

/* Whether this call's core runs the bf16 flash kernels on tensor cores (kernels.h's pg_flash_bf16_*, ALiBi's
 * bias too): on a device, with bf16 q|k|v, the whole sequence (the ring folds
 * blocks: pg_attention_block_*) and a shape pg_flash_bf16_unsupported takes (head size 64 or 128, T a multiple
 * of 16); else the float32 core on the widened q|k|v. Then q|k|v (rotated by RoPE, rounded to bf16 as
 * autocast's are) and dy stay bf16, and P and dS are rounded to bf16 for their products, as FlashAttention's
 * and PyTorch's SDPA flash backend do: the same layouts agree bitwise, but not with PG_FLASH_BF16=0's float32
 * core, which they meet within bf16's rounding. */
static int tensor_cores(const pg_module *m, const attention_state *s, const pg_io *io) {
  return BE(m)->device == PG_CUDA && m->in_bf16 && s->flash_bf16_env && !cp_on(m, io) &&
         !pg_flash_bf16_unsupported(io->B, io->T, s->heads_l, s->kv_l, s->o.head_dim);
}

/* What the whole-sequence backward keeps of one micro-batch (the CP ring keeps its own): the rows' log-sum-exp,
 * and with bf16 q|k|v the float32 output. Linear in the rows: no [T, T] probabilities (flash attention). */
static size_t saved_floats(const pg_module *m, const attention_state *s) {
  size_t rows = (size_t)m->max_rows;
  return lse_floats(m, s) + (m->in_bf16 ? rows * m->out_width : 0);
}

/* The saved lse (and output) of `slot`: its own with every slot kept; recomputed, the rank's arena (shared by the
 * attentions of every layer) or, in a module without an engine, its one buffer. */
static float *attention_saved(pg_module *m, attention_state *s, int slot) {
  if (m->arena) return (float *)m->arena->region;
  return s->saved + (s->o.recompute ? 0 : (size_t)slot * saved_floats(m, s));
}

/* The float32 output the forward writes and the backward reads: the slot's output, or with bf16 q|k|v the copy
 * after the lse in `saved` (the slot's output is its bf16 rounding). */
static float *f32_out(pg_module *m, attention_state *s, float *saved, int slot) {
  return m->in_bf16 ? saved + lse_floats(m, s) : slot_out(m, slot);
}

/* Recomputed: whether the buffer still holds this slot's lse (and output) (no
 * other micro-batch's, nor another layer's, forward ran since). */
static int attention_holds(const pg_module *m, const attention_state *s, int slot) {
  if (m->arena) return m->arena->owner == m && m->arena->owner_slot == slot;
  return s->saved_slot == slot;
}

static void attention_claim(pg_module *m, attention_state *s, int slot) {
  if (m->arena) {
    m->arena->owner = slot >= 0 ? m : NULL;
    m->arena->owner_slot = slot;
  }
  s->saved_slot = slot;
}

static int attention_alloc(pg_module *m, int nslots, int max_rows) {
  attention_state *s = m->state;
  if (alloc_leaf(m, nslots, max_rows) || alloc_ptrs(&s->saved_x, nslots) ||
      pg_env_bool("PG_FLASH_BF16", &s->flash_bf16_env))
    return PG_ERR;
  /* context parallelism keeps its own (cp_lse, cp_out below) */
  size_t per_slot = cp_size(m) > 1 ? 0 : saved_floats(m, s);
  if (per_slot && (m->arena ? !arena_buffer(m->arena, per_slot * sizeof(float))
                            : !alloc_floats(m, &s->saved, (size_t)(s->o.recompute ? 1 : nslots) * per_slot)))
    return pg_fail("out of memory for %s (attention log-sum-exp)", m->name);
  /* the whole-sequence backward's delta; the ring has its own */
  if (cp_size(m) == 1 &&
      !alloc_floats(m, &s->scratch, (size_t)KERNEL(m, attention_scratch_floats, max_rows, s->heads_l)))
    return pg_fail("out of memory for %s (attention backward)", m->name);
  attention_claim(m, s, -1);
  if (!s->o.recompute) m->saved_bytes_per_slot += per_slot * sizeof(float);
  if (cp_size(m) > 1) {
    size_t rows = (size_t)max_rows, stats = rows * s->heads_l, kv = rows * 2 * s->kv_l * s->o.head_dim;
    size_t out = m->in_bf16 ? rows * m->out_width : 0;
    int ok = alloc_floats(m, &s->cp_lse, (size_t)nslots * stats) && (!out || alloc_floats(m, &s->cp_out, nslots * out));
    for (int i = 0; i < 2 && ok; i++) ok = alloc_floats(m, &s->cp_kv[i], kv) != NULL;
    for (int i = 0; i < 3 && ok; i++) ok = alloc_floats(m, &s->cp_dkv[i], kv) != NULL;
    ok = ok && alloc_floats(m, &s->cp_acc, rows * m->out_width) && alloc_floats(m, &s->cp_mx, stats) &&
         alloc_floats(m, &s->cp_sm, stats) && alloc_floats(m, &s->cp_delta, stats) &&
         alloc_floats(m, &s->cp_mx0, stats);
    float *start = ok ? malloc(stats * sizeof(float)) : NULL;
    for (size_t i = 0; start && i < stats; i++) start[i] = -INFINITY;
    ok = start && !BE(m)->ops->copy(BE(m), s->cp_mx0, start, stats * sizeof(float), PG_COPY_HOST_TO_DEVICE);
    free(start);
    if (!ok) return pg_fail("out of memory for %s (the context-parallel ring)", m->name);
    m->saved_bytes_per_slot += (stats + out) * sizeof(float);
  }
  if (s->o.rope_theta > 0) {
    size_t rot = (size_t)max_rows * m->in_width, table = (size_t)s->max_seq * (s->o.head_dim / 2);
    const pg_backend *home = home_backend(BE(m)); /* the tables outlive a recomputed block's buffers */
    pg_be_release(home, s->cos_t);
    pg_be_release(home, s->sin_t);
    s->cos_t = pg_be_floats(home, table);
    s->sin_t = pg_be_floats(home, table);
    if (!alloc_floats(m, &s->rotated, (size_t)nslots * rot) || !s->cos_t || !s->sin_t)
      return pg_fail("out of memory for %s (rotary embeddings)", m->name);
    m->saved_bytes_per_slot += rot * sizeof(float);
    float *host = malloc(2 * table * sizeof(float));
    if (!host) return pg_fail("out of memory");
    pg_rope_table(host, host + table, s->max_seq, s->o.head_dim, s->o.rope_theta, &s->o.rope_scaling);
    int rc = KERNEL(m, copy, s->cos_t, host, table * sizeof(float), PG_COPY_HOST_TO_DEVICE) ||
             KERNEL(m, copy, s->sin_t, host + table, table * sizeof(float), PG_COPY_HOST_TO_DEVICE);
    free(host);
    if (rc) return PG_ERR;
  }
  if (s->o.alibi) { /* this rank's heads [r H/T, (r + 1) H/T) of the full count's slopes */
    const pg_backend *home = home_backend(BE(m));
    pg_be_release(home, s->slopes);
    s->slopes = pg_be_floats(home, (size_t)s->heads_l);
    float *host = malloc((size_t)s->o.heads * sizeof(float));
    if (!s->slopes || !host) {
      free(host);
      return pg_fail("out of memory for %s (ALiBi slopes)", m->name);
    }
    pg_alibi_slopes(host, s->o.heads);
    int rc = KERNEL(m, copy, s->slopes, host + (size_t)tp_rank(m->ctx) * s->heads_l, (size_t)s->heads_l * sizeof(float),
                    PG_COPY_HOST_TO_DEVICE);
    free(host);
    if (rc) return PG_ERR;
  }
  return PG_OK;
}

/* ---------------------------------------------------------------- decoding with the key/value cache */

/* Room for `rows` sequences: a larger cache keeps what the smaller one held. */
static int cache_reserve(pg_module *m, attention_state *s, int rows) {
  if (rows <= s->cache_rows) return PG_OK;
  const pg_backend *home = home_backend(BE(m)); /* the cache outlives a recomputed block's buffers */
  int64_t dims[4] = {rows, s->max_seq, s->kv_l, s->o.head_dim};
  int64_t n = pg_size_product(4, dims);
  if (n < 0 || (uint64_t)n > SIZE_MAX / sizeof(float))
    return pg_fail("%s: a key/value cache of %d sequences x %d positions is too large", m->name, rows, s->max_seq);
  float *k = pg_be_floats(home, (size_t)n), *v = pg_be_floats(home, (size_t)n);
  int32_t *cached = realloc(s->cached, (size_t)rows * sizeof *cached);
  if (cached) s->cached = cached;
  if (!k || !v || !cached) {
    pg_be_release(home, k);
    pg_be_release(home, v);
    return pg_fail("out of memory for %s (key/value cache of %d sequences)", m->name, rows);
  }
  size_t old = (size_t)s->cache_rows * s->max_seq * s->kv_l * s->o.head_dim * sizeof(float);
  if (old && (KERNEL(m, copy, k, s->kcache, old, PG_COPY_DEVICE_TO_DEVICE) ||
              KERNEL(m, copy, v, s->vcache, old, PG_COPY_DEVICE_TO_DEVICE))) {
    pg_be_release(home, k);
    pg_be_release(home, v);
    return PG_ERR;
  }
  pg_be_release(home, s->kcache);
  pg_be_release(home, s->vcache);
  s->kcache = k;
  s->vcache = v;
  for (int r = s->cache_rows; r < rows; r++) s->cached[r] = 0;
  s->cache_rows = rows;
  return PG_OK;
}

static float *dec_buffer(pg_module *m, float **buf, size_t *have, size_t n) {
  if (n <= *have) return *buf;
  const pg_backend *home = home_backend(BE(m));
  pg_be_release(home, *buf);
  *have = 0;
  if (!(*buf = pg_be_floats(home, n))) return NULL;
  *have = n;
  return *buf;
}

/* Row b: sequence row0 + b's next T tokens at pos[b]: their keys and values
 * join the cache, their queries attend over it. Forward only: saved_x, the
 * probabilities and the slots' other buffers are left as they are. */
static int attention_decode(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  attention_state *s = m->state;
  const pg_decode *d = io->decode;
  if (check_rows(m, slot, io)) return PG_ERR;
  int B = io->B, T = io->T, hd = s->o.head_dim, W = m->in_width, kvw = s->kv_l * hd, half = hd / 2;
  int64_t N = (int64_t)B * T;
  if (d->row0 < 0 || d->row0 + B > d->cache_rows)
    return pg_fail("%s: sequences %d..%d are outside the cache's %d", m->name, d->row0, d->row0 + B - 1, d->cache_rows);
  if (cache_reserve(m, s, d->cache_rows)) return PG_ERR;
  int longest = 0;
  for (int b = 0; b < B; b++) {
    int p = d->pos[b], row = d->row0 + b;
    if (p < 0 || p > s->max_seq - T)
      return pg_fail("%s: positions %d..%d of sequence %d exceed the model's %d", m->name, p, p + T - 1, row,
                     s->max_seq);
    if (p > s->cached[row])
      return pg_fail("%s: sequence %d continues at position %d but its cache holds %d positions", m->name, row, p,
                     s->cached[row]);
    if (p + T > longest) longest = p + T;
  }
  if (!dec_buffer(m, &s->dec_scores, &s->dec_scores_n, (size_t)s->heads_l * T * longest))
    return pg_fail("out of memory for %s (decoding scores)", m->name);
  const float *xf = x;
  if (s->cos_t || m->in_bf16) { /* a float32 copy to rotate (x belongs to its producer) */
    float *w = dec_buffer(m, &s->dec_x, &s->dec_x_n, (size_t)N * W);
    if (!w) return pg_fail("out of memory for %s (decoding q|k|v)", m->name);
    if (m->in_bf16 ? KERNEL(m, bf16_to_f32, w, cbits(x), N * W)
                   : KERNEL(m, copy, w, x, (size_t)N * W * sizeof(float), PG_COPY_DEVICE_TO_DEVICE))
      return PG_ERR;
    for (int b = 0; s->cos_t && b < B; b++) { /* the tables' rows from the sequence's position on */
      float *r = w + (size_t)b * T * W;
      const float *c = s->cos_t + (size_t)d->pos[b] * half, *sn = s->sin_t + (size_t)d->pos[b] * half;
      if (KERNEL(m, rope_forward, r, c, sn, T, T, s->heads_l, hd, W) ||
          KERNEL(m, rope_forward, r + (size_t)s->heads_l * hd, c, sn, T, T, s->kv_l, hd, W))
        return PG_ERR;
    }
    xf = w;
  }
  float *out = m->in_bf16 ? io->wide_scratch[1] : slot_out(m, slot);
  size_t seq = (size_t)s->max_seq * kvw;
  for (int b = 0; b < B; b++) {
    size_t at = (size_t)(d->row0 + b) * seq;
    if (KERNEL(m, attention_cached, out + (size_t)b * T * m->out_width, s->dec_scores, s->kcache + at, s->vcache + at,
               xf + (size_t)b * T * W, s->slopes, T, d->pos[b], s->heads_l, s->kv_l, hd))
      return PG_ERR;
    s->cached[d->row0 + b] = d->pos[b] + T;
  }
  if (m->in_bf16 && KERNEL(m, bf16_from_f32, bits(slot_out(m, slot)), out, N * m->out_width)) return PG_ERR;
  *y = slot_out(m, slot);
  return PG_OK;
}

static void attention_release_cache(pg_module *m) {
  attention_state *s = m->state;
  const pg_backend *home = home_backend(BE(m));
  pg_be_release(home, s->kcache);
  pg_be_release(home, s->vcache);
  pg_be_release(home, s->dec_x);
  pg_be_release(home, s->dec_scores);
  free(s->cached);
  s->kcache = s->vcache = s->dec_x = s->dec_scores = NULL;
  s->cached = NULL;
  s->cache_rows = 0;
  s->dec_x_n = s->dec_scores_n = 0;
}

/* RoPE on rows [N, in_width] (q then k heads): by the row's place in its sequence, or under context
 * parallelism by each chunk's true positions (the tables' rows from the chunk's first position on). */
static int rope_rows(pg_module *m, attention_state *s, const pg_io *io, float *buf, int backward) {
  int hd = s->o.head_dim, half = hd / 2, W = m->in_width, N = io->B * io->T;
  float *kb = buf + (size_t)s->heads_l * hd;
  if (!cp_on(m, io))
    return backward ? KERNEL(m, rope_backward, buf, s->cos_t, s->sin_t, N, io->T, s->heads_l, hd, W) ||
                          KERNEL(m, rope_backward, kb, s->cos_t, s->sin_t, N, io->T, s->kv_l, hd, W)
                    : KERNEL(m, rope_forward, buf, s->cos_t, s->sin_t, N, io->T, s->heads_l, hd, W) ||
                          KERNEL(m, rope_forward, kb, s->cos_t, s->sin_t, N, io->T, s->kv_l, hd, W);
  int L = io->cp_chunk;
  for (int b = 0; b < io->B; b++)
    for (int c = 0; c < 2; c++) {
      size_t row = (size_t)b * io->T + (size_t)c * L;
      int64_t pos = pg_cp_position(m->ctx->context, m->ctx->cp_rank, L, (int64_t)c * L);
      const float *cs = s->cos_t + (size_t)pos * half, *sn = s->sin_t + (size_t)pos * half;
      float *q = buf + row * W, *k = kb + row * W;
      if (backward ? KERNEL(m, rope_backward, q, cs, sn, L, L, s->heads_l, hd, W) ||
                         KERNEL(m, rope_backward, k, cs, sn, L, L, s->kv_l, hd, W)
                   : KERNEL(m, rope_forward, q, cs, sn, L, L, s->heads_l, hd, W) ||
                         KERNEL(m, rope_forward, k, cs, sn, L, L, s->kv_l, hd, W))
        return PG_ERR;
    }
  return PG_OK;
}

/* The same forward rotation on bf16 rows in place (the tensor-core path: the whole sequence, never the ring's
 * chunks): rope_forward's arithmetic on the widened values, rounded once. */
static int rope_rows_bf16(pg_module *m, attention_state *s, const pg_io *io, uint16_t *buf) {
  int hd = s->o.head_dim, W = m->in_width, N = io->B * io->T;
  return KERNEL(m, rope_bf16_forward, buf, s->cos_t, s->sin_t, N, io->T, s->heads_l, hd, W) ||
         KERNEL(m, rope_bf16_forward, buf + (size_t)s->heads_l * hd, s->cos_t, s->sin_t, N, io->T, s->kv_l, hd, W);
}

/* ---------------------------------------------------------------- context parallelism: the ring */

/* Rank r holds chunks r and 2C-1-r of every sequence (pg_cp_position) as its 2L rows. Its queries meet every
 * context rank's keys and values: the blocks go round the context group (rank r sends to r+1, receives from
 * r-1), each folded into an online softmax (kernels.h's pg_attention_block_*) while the next one travels, so
 * after C steps every query has seen every key before it. Backward passes the blocks round again with their
 * gradients, each rank adding its queries' part; after C steps a block's gradient is complete one rank before
 * its owner, and goes home in a last hop. The pairs (query chunk, key chunk) are folded one sequence at a
 * time, those with no visible key (the key chunk after the query chunk) skipped. */

typedef struct ring_pair { size_t q_row, k_row; int64_t q_pos, k_pos; size_t stat; } ring_pair;

/* The n-th (b, query chunk, key chunk) pair of this rank's rows with block src's, 0 when nothing is visible. */
static int ring_pair_at(const pg_module *m, const pg_io *io, int src, int n, ring_pair *p) {
  int L = io->cp_chunk, C = cp_size(m), b = n / 4, cq = (n / 2) % 2, ck = n % 2;
  p->q_row = (size_t)b * io->T + (size_t)cq * L;
  p->k_row = (size_t)b * io->T + (size_t)ck * L;
  p->q_pos = pg_cp_position(C, m->ctx->cp_rank, L, (int64_t)cq * L);
  p->k_pos = pg_cp_position(C, src, L, (int64_t)ck * L);
  p->stat = ((size_t)b * 2 + cq) * ((attention_state *)m->state)->heads_l * L;
  return p->k_pos <= p->q_pos + L - 1;
}

/* Block of this rank's keys and values, packed [rows, 2 kv_l head_dim] (k then v, as in the q|k|v row). */
static int ring_pack(const pg_module *m, const attention_state *s, int64_t N, const float *x, float *kv) {
  size_t w = (size_t)2 * s->kv_l * s->o.head_dim, q = (size_t)s->heads_l * s->o.head_dim;
  return BE(m)->ops->copy2d(BE(m), kv, w * sizeof(float), x + q, (size_t)m->in_width * sizeof(float),
                            w * sizeof(float), (size_t)N, PG_COPY_DEVICE_TO_DEVICE);
}

/* The ring's buffers live in the backend's memory (the device's on a device engine): cleared, copied and summed
 * through the seam. */
static int ring_zero(const pg_module *m, float *p, int64_t n) {
  return BE(m)->ops->zero(BE(m), p, (size_t)n * sizeof(float));
}

/* Starts the step's exchange: block `mine` to the next context rank, the previous one's into `theirs` (on a
 * device engine with NCCL, on the context group's stream: the compute queued after it runs meanwhile). */
static int ring_start(pg_module *m, float *mine, float *theirs, int64_t n, int tag, pg_request **sq,
                      pg_request **rq) {
  int C = cp_size(m), r = m->ctx->cp_rank;
  return pg_iexchange_buf(m->ctx, PG_MODE_CONTEXT, mine, theirs, n, (r + 1) % C, (r + C - 1) % C, tag, sq, rq);
}

static int ring_wait(pg_request **sq, pg_request **rq) {
  int a = pg_wait(rq), b = pg_wait(sq); /* both, whatever the first gives */
  return a || b;
}

static int cp_attention_forward(pg_module *m, attention_state *s, int slot, const pg_io *io, const float *xf,
                                float *out) {
  int C = cp_size(m), r = m->ctx->cp_rank, L = io->cp_chunk, hd = s->o.head_dim, W = m->in_width;
  int OW = m->out_width, kvs = 2 * s->kv_l * hd;
  int64_t N = (int64_t)io->B * io->T, nkv = N * kvs, nstat = N * s->heads_l;
  float *lse = s->cp_lse + (size_t)slot * m->max_rows * s->heads_l;
  if (ring_zero(m, s->cp_acc, N * OW) || ring_zero(m, s->cp_sm, nstat) ||
      BE(m)->ops->copy(BE(m), s->cp_mx, s->cp_mx0, (size_t)nstat * sizeof(float), PG_COPY_DEVICE_TO_DEVICE) ||
      ring_pack(m, s, N, xf, s->cp_kv[0]))
    return PG_ERR;
  int cur = 0, rc = PG_OK;
  for (int step = 0; step < C && !rc; step++) {
    int src = (r - step + C) % C;
    pg_request *sq = NULL, *rq = NULL;
    if (step < C - 1) rc = ring_start(m, s->cp_kv[cur], s->cp_kv[1 - cur], nkv, 0, &sq, &rq);
    const float *kv = s->cp_kv[cur];
    for (int n = 0; n < 4 * io->B && !rc; n++) {
      ring_pair p;
      if (!ring_pair_at(m, io, src, n, &p)) continue;
      rc = KERNEL(m, attention_block_forward, s->cp_acc + p.q_row * OW, s->cp_mx + p.stat, s->cp_sm + p.stat,
                  xf + p.q_row * W, W, kv + p.k_row * kvs, kv + p.k_row * kvs + s->kv_l * hd, kvs, s->slopes, 1, L,
                  L, s->heads_l, s->kv_l, hd, p.q_pos, p.k_pos);
    }
    if (step < C - 1) rc = ring_wait(&sq, &rq) || rc;
    cur = 1 - cur;
  }
  if (rc) return PG_ERR;
  for (int b = 0; b < io->B; b++)
    for (int c = 0; c < 2; c++) {
      size_t row = (size_t)b * io->T + (size_t)c * L, stat = ((size_t)b * 2 + c) * s->heads_l * L;
      if (KERNEL(m, attention_block_finish, out + row * OW, OW, lse + stat, s->cp_acc + row * OW, s->cp_mx + stat,
                 s->cp_sm + stat, 1, L, s->heads_l, hd))
        return PG_ERR;
    }
  /* bf16: the float32 output the backward's delta reads (the slot's output is rounded) */
  if (s->cp_out && BE(m)->ops->copy(BE(m), s->cp_out + (size_t)slot * m->max_rows * OW, out,
                                     (size_t)N * OW * sizeof(float), PG_COPY_DEVICE_TO_DEVICE))
    return PG_ERR;
  return PG_OK;
}

static int cp_attention_backward(pg_module *m, attention_state *s, int slot, const pg_io *io, const float *x,
                                 const float *dy, float *dinp) {
  int C = cp_size(m), r = m->ctx->cp_rank, L = io->cp_chunk, hd = s->o.head_dim, W = m->in_width;
  int OW = m->out_width, kvs = 2 * s->kv_l * hd;
  int64_t N = (int64_t)io->B * io->T, nkv = N * kvs;
  const float *lse = s->cp_lse + (size_t)slot * m->max_rows * s->heads_l;
  const float *out = s->cp_out ? s->cp_out + (size_t)slot * m->max_rows * OW : slot_out(m, slot);
  for (int b = 0; b < io->B; b++)
    for (int c = 0; c < 2; c++) {
      size_t row = (size_t)b * io->T + (size_t)c * L, stat = ((size_t)b * 2 + c) * s->heads_l * L;
      if (KERNEL(m, attention_block_delta, s->cp_delta + stat, dy + row * OW, OW, out + row * OW, OW, 1, L,
                 s->heads_l, hd))
        return PG_ERR;
    }
  /* dkv: this step's contributions (from zero), the block's partial sum arriving from the previous rank
   * (received while the step computes), the sum leaving for the next rank (sent while the next step computes) */
  float *mine = s->cp_dkv[0], *in = s->cp_dkv[1], *outgoing = s->cp_dkv[2];
  pg_request *dsq = NULL, *drq = NULL;
  if (ring_zero(m, dinp, N * W) || ring_pack(m, s, N, x, s->cp_kv[0])) return PG_ERR;
  int cur = 0, rc = PG_OK;
  for (int step = 0; step < C && !rc; step++) {
    int src = (r - step + C) % C;
    pg_request *sq = NULL, *rq = NULL;
    if (step < C - 1) rc = ring_start(m, s->cp_kv[cur], s->cp_kv[1 - cur], nkv, 1, &sq, &rq);
    const float *kv = s->cp_kv[cur];
    rc = rc || ring_zero(m, mine, nkv);
    for (int n = 0; n < 4 * io->B && !rc; n++) {
      ring_pair p;
      if (!ring_pair_at(m, io, src, n, &p)) continue;
      rc = KERNEL(m, attention_block_backward, dinp + p.q_row * W, W, mine + p.k_row * kvs,
                  mine + p.k_row * kvs + s->kv_l * hd, kvs, x + p.q_row * W, W, kv + p.k_row * kvs,
                  kv + p.k_row * kvs + s->kv_l * hd, kvs, dy + p.q_row * OW, OW, lse + p.stat, s->cp_delta + p.stat,
                  s->slopes, 1, L, L, s->heads_l, s->kv_l, hd, p.q_pos, p.k_pos);
    }
    if (step < C - 1) rc = ring_wait(&sq, &rq) || rc;
    /* the block's partial sum from the ranks before (none for this rank's own block, step 0) joins ours */
    if (step > 0 && !rc && !(rc = pg_wait(&drq))) rc = KERNEL(m, residual_forward, mine, mine, in, nkv);
    /* and goes on to the next rank (the last step: home, to its owner), whose partial for our next block we
     * receive meanwhile */
    if (!rc) rc = ring_wait(&dsq, &drq);
    if (!rc) {
      float *t = outgoing;
      outgoing = mine;
      mine = t;
      rc = ring_start(m, outgoing, in, nkv, 2, &dsq, &drq);
    }
    cur = 1 - cur;
  }
  rc = ring_wait(&dsq, &drq) || rc;
  if (rc) return PG_ERR;
  const float *dkv = in; /* this rank's keys' and values' gradient, complete */
  size_t q = (size_t)s->heads_l * hd;
  return BE(m)->ops->copy2d(BE(m), dinp + q, (size_t)W * sizeof(float), dkv, (size_t)kvs * sizeof(float),
                            (size_t)kvs * sizeof(float), (size_t)N, PG_COPY_DEVICE_TO_DEVICE);
}

/* The whole-sequence core (flash attention, kernels.h): the one place each kernel is called. out and saved:
 * f32_out and attention_saved of the slot; x the q|k|v and dy the output's gradient, bf16 on tensor cores
 * (tensor_cores), else float32; dx float32. out16 (bf16 q|k|v; NULL: not now): the module's bf16 output, the
 * rounding of out, which the tensor-core kernel writes in its own pass and the float32 core in one after. */
static int core_forward(pg_module *m, const attention_state *s, const pg_io *io, float *out, uint16_t *out16,
                        float *saved, const float *x) {
  int N = io->B * io->T;
  if (tensor_cores(m, s, io))
    return KERNEL(m, flash_bf16_forward, out, out16, saved, cbits(x), s->slopes, io->B, io->T, s->heads_l, s->kv_l,
                  s->o.head_dim);
  return KERNEL(m, attention_forward, out, saved, x, s->slopes, io->B, io->T, s->heads_l, s->kv_l, s->o.head_dim) ||
         (out16 && KERNEL(m, bf16_from_f32, out16, out, (int64_t)N * m->out_width));
}

/* dx16 (bf16 q|k|v without RoPE; NULL: not now): the module's bf16 input gradient, the rounding of dx, which the
 * tensor-core kernels write in their own pass instead of dx (not written then), the float32 core in one after. */
static int core_backward(pg_module *m, const attention_state *s, const pg_io *io, float *dx, uint16_t *dx16,
                         const float *dy, const float *x, const float *out, const float *saved) {
  if (tensor_cores(m, s, io))
    return KERNEL(m, flash_bf16_backward, dx16 ? NULL : dx, dx16, s->scratch, cbits(dy), out, cbits(x), saved,
                  s->slopes, io->B, io->T, s->heads_l, s->kv_l, s->o.head_dim);
  int64_t n = (int64_t)io->B * io->T * m->in_width;
  return KERNEL(m, attention_backward, dx, s->scratch, dy, x, out, saved, s->slopes, io->B, io->T, s->heads_l,
                s->kv_l, s->o.head_dim) ||
         (dx16 && KERNEL(m, bf16_from_f32, dx16, dx, n));
}

static int attention_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  attention_state *s = m->state;
  if (io->decode) return attention_decode(m, slot, io, x, y);
  if (check_rows(m, slot, io)) return PG_ERR;
  int64_t seq = cp_on(m, io) ? (int64_t)cp_size(m) * io->T : io->T;
  if (seq > s->max_seq) return pg_fail("%s: sequence length %lld exceeds the model's %d", m->name, (long long)seq, s->max_seq);
  if (cp_size(m) > 1 && !cp_on(m, io))
    return pg_fail("%s: attention under context=%d holds two chunks of each sequence, which only an engine's "
                   "micro-batches describe (pg.parallelize)", m->name, cp_size(m));
  if (cp_on(m, io) && s->o.recompute)
    return pg_fail("%s: recomputed attention with context=%d is not supported: recompute whole blocks instead", m->name,
                   cp_size(m));
  int N = io->B * io->T;
  int64_t n_in = (int64_t)N * m->in_width;
  float *saved = cp_on(m, io) ? NULL : attention_saved(m, s, slot);
  /* bf16 q|k|v (in_bf16): the core runs on their float32 values (softmax in float32, as torch's math path
   * upcasts), its output rounded once; saved_x keeps the bf16 input, or with RoPE the float32 rotated copy.
   * On tensor cores the core takes them bf16 as they are, with RoPE rotated in a bf16 copy (widened, rotated
   * and rounded again in one pass, as autocast rounds its rotated q and k). */
  const float *xf = x;
  int tc = tensor_cores(m, s, io);
  if (s->rotated) { /* q and k rotated by their positions, in a copy (x belongs to its producer) */
    float *rot = s->rotated + (size_t)slot * m->max_rows * m->in_width;
    if (tc ? KERNEL(m, copy, rot, x, (size_t)n_in * sizeof(uint16_t), PG_COPY_DEVICE_TO_DEVICE) ||
                 rope_rows_bf16(m, s, io, bits(rot))
           : (m->in_bf16 ? KERNEL(m, bf16_to_f32, rot, cbits(x), n_in)
                         : KERNEL(m, copy, rot, x, (size_t)n_in * sizeof(float), PG_COPY_DEVICE_TO_DEVICE)) ||
                 rope_rows(m, s, io, rot, 0))
      return PG_ERR;
    x = xf = rot;
  } else if (m->in_bf16 && !tc) {
    if (KERNEL(m, bf16_to_f32, io->wide_scratch[0], cbits(x), n_in)) return PG_ERR;
    xf = io->wide_scratch[0];
  }
  float *out = cp_on(m, io) ? (m->in_bf16 ? io->wide_scratch[1] : slot_out(m, slot)) : f32_out(m, s, saved, slot);
  uint16_t *out16 = m->in_bf16 ? bits(slot_out(m, slot)) : NULL; /* bf16: the slot's output, out rounded */
  if (cp_on(m, io) ? cp_attention_forward(m, s, slot, io, xf, out) ||
                         (out16 && KERNEL(m, bf16_from_f32, out16, out, (int64_t)N * m->out_width))
                   : core_forward(m, s, io, out, out16, saved, xf))
    return PG_ERR;
  s->saved_x[slot] = x;
  attention_claim(m, s, slot);
  *y = slot_out(m, slot);
  return PG_OK;
}

static int attention_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  attention_state *s = m->state;
  int N = io->B * io->T;
  int64_t n_in = (int64_t)N * m->in_width;
  float *saved = cp_on(m, io) ? NULL : attention_saved(m, s, slot);
  /* bf16 (in_bf16): q|k|v widened into wide_scratch[0] (unless RoPE saved them rotated in float32), the output
   * gradient into [1], the input gradient made in [2] and rounded at the end */
  const float *x = s->saved_x[slot];
  float *dinp = m->in_bf16 ? io->wide_scratch[2] : m->dinp;
  int tc = tensor_cores(m, s, io); /* the core takes q|k|v and dy bf16 */
  if (m->in_bf16 && !s->rotated && !tc) {
    if (KERNEL(m, bf16_to_f32, io->wide_scratch[0], cbits(x), n_in)) return PG_ERR;
    x = io->wide_scratch[0];
  }
  /* recompute: another micro-batch's forward ran since; the output written again is the same bits (the next
   * module has used it already; bf16: its float32 copy) */
  float *out = cp_on(m, io) ? NULL : f32_out(m, s, saved, slot);
  if (s->o.recompute && !attention_holds(m, s, slot) && core_forward(m, s, io, out, NULL, saved, x)) return PG_ERR;
  attention_claim(m, s, -1); /* backward may overwrite what it reads */
  if (m->in_bf16 && !tc) {
    if (KERNEL(m, bf16_to_f32, io->wide_scratch[1], cbits(dy), (int64_t)N * m->out_width)) return PG_ERR;
    dy = io->wide_scratch[1];
  }
  /* bf16 without RoPE: the core rounds into the module's input gradient itself; else it is rounded below, after
   * the ring or the rotation back */
  uint16_t *dinp16 = m->in_bf16 && !s->rotated && !cp_on(m, io) ? bits(m->dinp) : NULL;
  if (cp_on(m, io) ? cp_attention_backward(m, s, slot, io, x, dy, dinp)
                   : core_backward(m, s, io, dinp, dinp16, dy, x, out, saved))
    return PG_ERR;
  /* the gradient of the rotated q and k, rotated back */
  if (s->rotated && rope_rows(m, s, io, dinp, 1)) return PG_ERR;
  if (m->in_bf16 && !dinp16 && KERNEL(m, bf16_from_f32, bits(m->dinp), dinp, n_in)) return PG_ERR;
  *dx = m->dinp;
  return PG_OK;
}

static void attention_destroy(pg_module *m) {
  attention_state *s = m->state;
  pg_be_release(BE(m), s->saved);
  pg_be_release(BE(m), s->scratch);
  pg_be_release(BE(m), s->rotated);
  pg_be_release(home_backend(BE(m)), s->cos_t);
  pg_be_release(home_backend(BE(m)), s->sin_t);
  pg_be_release(home_backend(BE(m)), s->slopes);
  float *cp[] = {s->cp_lse, s->cp_out, s->cp_kv[0], s->cp_kv[1], s->cp_dkv[0], s->cp_dkv[1], s->cp_dkv[2], s->cp_acc, s->cp_mx,
                 s->cp_sm, s->cp_delta, s->cp_mx0};
  for (size_t i = 0; i < sizeof cp / sizeof *cp; i++) pg_be_release(BE(m), cp[i]);
  free(s->saved_x);
  attention_release_cache(m);
}

pg_module *pg_attention_new(pg_context *ctx, const char *name, const pg_attention_opts *o) {
  int T = tp_size(ctx), H = o->heads, KV = o->kv_heads > 0 ? o->kv_heads : o->heads, hd = o->head_dim;
  if (H < 1 || hd < 1) return pg_fail_null("%s: attention needs positive heads and head_dim (%d, %d)", name, H, hd);
  if (H % KV) return pg_fail_null("%s: kv_heads=%d does not divide heads=%d", name, KV, H);
  if (H % T) return pg_fail_null("%s: tensor=%d does not divide heads=%d", name, T, H);
  /* Key/value heads are split over the tensor group; when fewer than its ranks, each rank's one comes whole
   * from a kv_heads module before this one (kind_kv_heads.c) */
  if (o->kv_gathered ? T % KV || KV >= T : KV % T)
    return pg_fail_null(o->kv_gathered ? "%s: gathered key/value heads need tensor=%d a multiple of kv_heads=%d above it"
                                       : "%s: tensor=%d does not divide kv_heads=%d (a kv_heads module gathers the "
                                         "heads when tensor is a multiple of kv_heads)",
                        name, T, KV);
  if (o->max_seq < 1) return pg_fail_null("%s: attention needs a positive maximum sequence length, not %d", name, o->max_seq);
  if (o->rope_theta > 0 && hd % 2) return pg_fail_null("%s: rotary embeddings need an even head_dim, not %d", name, hd);
  if (o->alibi && o->rope_theta > 0)
    return pg_fail_null("%s: ALiBi and rotary embeddings (rope_theta=%g) exclude each other: give one", name,
                        o->rope_theta);
  if ((int64_t)(H + 2 * KV) * hd > INT32_MAX / 2) return pg_fail_null("%s: attention width overflows", name);
  int kv_l = o->kv_gathered ? 1 : KV / T;
  pg_module *m = module_new(&pg_kind_attention, ctx, name, (H / T + 2 * kv_l) * hd, H / T * hd, sizeof(attention_state));
  if (!m) return NULL;
  attention_state *s = m->state;
  s->o = *o;
  s->o.kv_heads = KV;
  s->heads_l = H / T;
  s->kv_l = kv_l;
  s->max_seq = o->max_seq;
  return m;
}

/* rope_type (a rope_scaling type name, default plain) and its numbers: rope_factor, rope_low_freq_factor,
 * rope_high_freq_factor, rope_original_max (models/common.lua's rope_scaling checks them for the user) */
static int rope_scaling_of(const char *name, const pg_desc *d, pg_rope_scaling *out) {
  const char *type = d->ops->string(d, "rope_type", "default");
  int k = pg_rope_type_of(type);
  if (k < 0) return pg_fail("%s: rope_scaling type '%s' is not one pipegoose computes", name, type);
  *out = (pg_rope_scaling){.type = (pg_rope_type)k, .factor = d->ops->number(d, "rope_factor", 1),
                           .low_freq_factor = d->ops->number(d, "rope_low_freq_factor", 0),
                           .high_freq_factor = d->ops->number(d, "rope_high_freq_factor", 0),
                           .original_max = d->ops->number(d, "rope_original_max", 0)};
  if (k != PG_ROPE_PLAIN && !(out->factor > 0))
    return pg_fail("%s: rope_scaling factor must be positive, not %g", name, out->factor);
  if (k == PG_ROPE_LLAMA3 && !(out->low_freq_factor > 0 && out->high_freq_factor > out->low_freq_factor &&
                               out->original_max > 0))
    return pg_fail("%s: llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor and a positive "
                   "original_max_position_embeddings (%g, %g, %g)", name, out->low_freq_factor,
                   out->high_freq_factor, out->original_max);
  return PG_OK;
}

static pg_module *build_attention(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env) {
  (void)env;
  int bad = 0;
  pg_attention_opts o = {.heads = DESC_INT(d, "heads", 0), .kv_heads = DESC_INT(d, "kv_heads", 0),
                         .head_dim = DESC_INT(d, "head_dim", 0), .max_seq = DESC_INT(d, "max_seq", 0),
                         .rope_theta = d->ops->number(d, "rope_theta", 0), .alibi = d->ops->boolean(d, "alibi", 0),
                         .recompute = d->ops->boolean(d, "recompute", 0),
                         .kv_gathered = d->ops->boolean(d, "kv_gathered", 0)};
  if (rope_scaling_of(name, d, &o.rope_scaling)) return NULL;
  return bad ? NULL : pg_attention_new(ctx, name, &o);
}

/* Selective recomputation: the saved lse (and float32 output) of one micro-batch, from the rank's arena. */
static int attention_selective(const pg_module *m, size_t *bytes) {
  const attention_state *s = m->state;
  if (!s->o.recompute) return 0;
  *bytes = saved_floats(m, s) * sizeof(float);
  return 1;
}

/* The float32 room of bf16 q|k|v (pg_io.wide_scratch), max_rows rows: the core computes in float32. */
static void attention_bf16_need(const pg_module *m, pg_bf16_need *need) {
  if (!m->in_bf16) return;
  int64_t rows = m->max_rows, in = m->in_width, out = m->out_width, wide[PG_WIDE_SCRATCH] = {0};
  wide[0] = rows * in;                    /* q|k|v widened */
  wide[1] = rows * (in > out ? in : out); /* the output before rounding; its gradient widened */
  wide[2] = rows * in;                    /* the input gradient before rounding */
  raise_wide(need, wide);
}

/* Needs every row of its sequences (sp_gather ... sp_scatter under sequence parallelism); keeps bf16 q|k|v bf16. */
const pg_module_kind pg_kind_attention = {
    .ops = {"attention", attention_alloc, attention_forward, attention_backward, attention_destroy},
    .traits = {.name = "attention",
               .assembly = PG_KIND_BUILT,
               .sp = PG_SP_ALL_ROWS,
               .flags = PG_KIND_PASSES_BF16 | PG_KIND_SELECTIVE},
    .build = build_attention,
    .bf16_need = attention_bf16_need,
    .selective = attention_selective,
    .release_cache = attention_release_cache,
};
