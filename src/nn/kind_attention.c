/* kind_attention.c: the causal self-attention core (multi-head or grouped-query, optional RoPE). */
#include "module_impl.h"
#include "pg_size.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- attention */

typedef struct attention_state {
  pg_attention_opts o;
  int heads_l, kv_l, max_seq;
  float *att;     /* [nslots][rows * heads_l * max_seq] probabilities */
  float *scratch; /* backward */
  float *rotated; /* with RoPE: [nslots][rows * in_width], q|k rotated, v copied */
  float *cos_t, *sin_t; /* with RoPE: [max_seq, head_dim / 2] on the backend */
  float *slopes;  /* with ALiBi: this rank's heads_l slopes on the backend */
  const float **saved_x;
  int att_slot;   /* recompute: the micro-batch whose probabilities att holds (-1: none) */
  /* decoding (pg_io.decode), on the home backend: keys and values [cache_rows][max_seq][kv_l head_dim],
   * the positions each sequence holds (host), the new rows' q|k|v in float32 (widened, rotated), the scores */
  float *kcache, *vcache, *dec_x, *dec_scores;
  int32_t *cached;
  int cache_rows;
  size_t dec_x_n, dec_scores_n;
  /* context parallelism (cp_on): every context rank's q|k|v of the micro-batch in sequence order [nslots][B, C T,
   * in_width] and the probabilities over the whole sequence [nslots][B, heads_l, C T, C T]; one staging buffer
   * for the gathers and two for the whole sequence's output (or its gradient) and input gradient */
  float *cp_x, *cp_att, *cp_stage, *cp_full, *cp_dfull;
} attention_state;

/* Context parallelism: the module's context splits sequences (pg_io.cp_chunk says how). */
static int cp_size(const pg_module *m) { return m->ctx ? m->ctx->context : 1; }
static int cp_on(const pg_module *m, const pg_io *io) { return cp_size(m) > 1 && io->cp_chunk > 0; }

/* The probabilities of `slot`: its own with every slot kept; recomputed, the
 * rank's arena (shared by the attentions of every layer) or, in a module
 * without an engine, its one buffer. */
static float *attention_probs(pg_module *m, attention_state *s, int slot) {
  if (m->arena) return (float *)m->arena->region;
  return s->att + (s->o.recompute ? 0 : (size_t)slot * m->max_rows * s->heads_l * s->max_seq);
}

/* Recomputed: whether the buffer still holds this slot's probabilities (no
 * other micro-batch's, nor another layer's, forward ran since). */
static int attention_holds(const pg_module *m, const attention_state *s, int slot) {
  if (m->arena) return m->arena->owner == m && m->arena->owner_slot == slot;
  return s->att_slot == slot;
}

static void attention_claim(pg_module *m, attention_state *s, int slot) {
  if (m->arena) {
    m->arena->owner = slot >= 0 ? m : NULL;
    m->arena->owner_slot = slot;
  }
  s->att_slot = slot;
}

static int attention_alloc(pg_module *m, int nslots, int max_rows) {
  attention_state *s = m->state;
  if (alloc_leaf(m, nslots, max_rows) || alloc_ptrs(&s->saved_x, nslots)) return PG_ERR;
  size_t per_slot = (size_t)max_rows * s->heads_l * s->max_seq;
  if (m->arena ? !arena_buffer(m->arena, per_slot * sizeof(float))
               : !alloc_floats(m, &s->att, (size_t)(s->o.recompute ? 1 : nslots) * per_slot))
    return pg_fail("out of memory for %s (attention probabilities)", m->name);
  if (!alloc_floats(m, &s->scratch, (size_t)KERNEL(m, attention_scratch_floats, s->max_seq, s->heads_l)))
    return pg_fail("out of memory for %s (attention backward)", m->name);
  attention_claim(m, s, -1);
  if (!s->o.recompute) m->saved_bytes_per_slot += per_slot * sizeof(float);
  if (cp_size(m) > 1) {
    size_t C = (size_t)cp_size(m), rows = C * max_rows, w = (size_t)(m->in_width > m->out_width ? m->in_width : m->out_width);
    size_t x = rows * m->in_width, att = rows * s->heads_l * s->max_seq;
    if (!alloc_floats(m, &s->cp_x, (size_t)nslots * x) || !alloc_floats(m, &s->cp_att, (size_t)nslots * att) ||
        !alloc_floats(m, &s->cp_stage, rows * w) || !alloc_floats(m, &s->cp_full, rows * w) ||
        !alloc_floats(m, &s->cp_dfull, x))
      return pg_fail("out of memory for %s (context-parallel keys and values)", m->name);
    m->saved_bytes_per_slot += (x + att) * sizeof(float);
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

/* Context parallelism: this rank's rows [B, T, w] of every sequence gathered over the context group and put in
 * sequence order into whole [B, C T, w] (the ranks' chunks at their positions). */
static int cp_gather_sequences(pg_module *m, attention_state *s, const pg_io *io, const float *mine, int w,
                               float *whole) {
  int C = cp_size(m), T = io->T, L = io->cp_chunk;
  size_t per = (size_t)io->B * T * w;
  memcpy(s->cp_stage + (size_t)m->ctx->cp_rank * per, mine, per * sizeof(float));
  if (pg_all_gather_buf(m->ctx, PG_MODE_CONTEXT, s->cp_stage, (int64_t)per, PG_FLOAT32)) return PG_ERR;
  for (int r = 0; r < C; r++)
    for (int b = 0; b < io->B; b++)
      for (int t = 0; t < T; t++)
        memcpy(whole + ((size_t)b * C * T + (size_t)pg_cp_position(C, r, L, t)) * w,
               s->cp_stage + (size_t)r * per + ((size_t)b * T + t) * w, (size_t)w * sizeof(float));
  return PG_OK;
}

/* ... and back: this rank's rows of whole [B, C T, w] into mine [B, T, w]. */
static void cp_own_rows(const pg_module *m, const pg_io *io, const float *whole, int w, float *mine) {
  int C = cp_size(m), T = io->T, L = io->cp_chunk;
  for (int b = 0; b < io->B; b++)
    for (int t = 0; t < T; t++)
      memcpy(mine + ((size_t)b * T + t) * w,
             whole + ((size_t)b * C * T + (size_t)pg_cp_position(C, m->ctx->cp_rank, L, t)) * w,
             (size_t)w * sizeof(float));
}

static float *cp_slot_x(pg_module *m, attention_state *s, int slot) {
  return s->cp_x + (size_t)slot * cp_size(m) * m->max_rows * m->in_width;
}
static float *cp_slot_att(pg_module *m, attention_state *s, int slot) {
  return s->cp_att + (size_t)slot * cp_size(m) * m->max_rows * s->heads_l * s->max_seq;
}

/* The core under context parallelism: the whole sequences' q|k|v gathered over the context group, causal
 * attention over them, this rank's rows of the output. */
static int cp_attention_forward(pg_module *m, attention_state *s, int slot, const pg_io *io, const float *xf,
                                float *out) {
  float *x = cp_slot_x(m, s, slot);
  if (cp_gather_sequences(m, s, io, xf, m->in_width, x) ||
      KERNEL(m, attention_forward, s->cp_full, cp_slot_att(m, s, slot), x, s->slopes, io->B, cp_size(m) * io->T,
             s->heads_l, s->kv_l, s->o.head_dim))
    return PG_ERR;
  cp_own_rows(m, io, s->cp_full, m->out_width, out);
  return PG_OK;
}

/* Its backward: the output gradient of every rank's rows gathered, the whole q|k|v gradient (the same on every
 * context rank), this rank's rows of it. */
static int cp_attention_backward(pg_module *m, attention_state *s, int slot, const pg_io *io, const float *dy,
                                 float *dinp) {
  if (cp_gather_sequences(m, s, io, dy, m->out_width, s->cp_full) ||
      KERNEL(m, attention_backward, s->cp_dfull, s->scratch, s->cp_full, cp_slot_x(m, s, slot),
             cp_slot_att(m, s, slot), io->B, cp_size(m) * io->T, s->heads_l, s->kv_l, s->o.head_dim))
    return PG_ERR;
  cp_own_rows(m, io, s->cp_dfull, m->in_width, dinp);
  return PG_OK;
}

static int attention_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  attention_state *s = m->state;
  if (io->decode) return attention_decode(m, slot, io, x, y);
  if (check_rows(m, slot, io)) return PG_ERR;
  int64_t seq = cp_on(m, io) ? (int64_t)cp_size(m) * io->T : io->T;
  if (seq > s->max_seq) return pg_fail("%s: sequence length %lld exceeds the model's %d", m->name, (long long)seq, s->max_seq);
  if (cp_on(m, io) && s->o.recompute)
    return pg_fail("%s: recomputed attention with context=%d is not supported: recompute whole blocks instead", m->name,
                   cp_size(m));
  int N = io->B * io->T, hd = s->o.head_dim;
  int64_t n_in = (int64_t)N * m->in_width;
  float *att = attention_probs(m, s, slot);
  /* bf16 q|k|v (in_bf16): the core runs on their float32 values (softmax in float32, as torch's math path
   * upcasts), its output rounded once; saved_x keeps the bf16 input, or with RoPE the float32 rotated copy */
  const float *xf = x;
  if (s->rotated) { /* q and k rotated by their positions, in a copy (x belongs to its producer) */
    float *rot = s->rotated + (size_t)slot * m->max_rows * m->in_width;
    if ((m->in_bf16 ? KERNEL(m, bf16_to_f32, rot, cbits(x), n_in)
                    : KERNEL(m, copy, rot, x, (size_t)n_in * sizeof(float), PG_COPY_DEVICE_TO_DEVICE)) ||
        rope_rows(m, s, io, rot, 0))
      return PG_ERR;
    x = xf = rot;
  } else if (m->in_bf16) {
    if (KERNEL(m, bf16_to_f32, io->wide_scratch[0], cbits(x), n_in)) return PG_ERR;
    xf = io->wide_scratch[0];
  }
  float *out = m->in_bf16 ? io->wide_scratch[1] : slot_out(m, slot);
  if ((cp_on(m, io) ? cp_attention_forward(m, s, slot, io, xf, out)
                    : KERNEL(m, attention_forward, out, att, xf, s->slopes, io->B, io->T, s->heads_l, s->kv_l, hd)) ||
      (m->in_bf16 && KERNEL(m, bf16_from_f32, bits(slot_out(m, slot)), out, (int64_t)N * m->out_width)))
    return PG_ERR;
  s->saved_x[slot] = x;
  attention_claim(m, s, slot);
  *y = slot_out(m, slot);
  return PG_OK;
}

static int attention_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  attention_state *s = m->state;
  int N = io->B * io->T, hd = s->o.head_dim;
  int64_t n_in = (int64_t)N * m->in_width;
  float *att = attention_probs(m, s, slot);
  /* bf16 (in_bf16): q|k|v widened into wide_scratch[0] (unless RoPE saved them rotated in float32), the output
   * gradient into [1], the input gradient made in [2] and rounded at the end */
  const float *x = s->saved_x[slot];
  float *dinp = m->in_bf16 ? io->wide_scratch[2] : m->dinp;
  if (m->in_bf16 && !s->rotated) {
    if (KERNEL(m, bf16_to_f32, io->wide_scratch[0], cbits(x), n_in)) return PG_ERR;
    x = io->wide_scratch[0];
  }
  /* recompute: another micro-batch's forward ran since; the output written
   * again is the same (the next module has used it already; bf16: into scratch, overwritten below) */
  if (s->o.recompute && !attention_holds(m, s, slot) &&
      KERNEL(m, attention_forward, m->in_bf16 ? dinp : slot_out(m, slot), att, x, s->slopes, io->B, io->T, s->heads_l,
             s->kv_l, hd))
    return PG_ERR;
  attention_claim(m, s, -1); /* backward may overwrite what it reads */
  if (m->in_bf16) {
    if (KERNEL(m, bf16_to_f32, io->wide_scratch[1], cbits(dy), (int64_t)N * m->out_width)) return PG_ERR;
    dy = io->wide_scratch[1];
  }
  if (cp_on(m, io) ? cp_attention_backward(m, s, slot, io, dy, dinp)
                   : KERNEL(m, attention_backward, dinp, s->scratch, dy, x, att, io->B, io->T, s->heads_l, s->kv_l, hd))
    return PG_ERR;
  /* the gradient of the rotated q and k, rotated back */
  if (s->rotated && rope_rows(m, s, io, dinp, 1)) return PG_ERR;
  if (m->in_bf16 && KERNEL(m, bf16_from_f32, bits(m->dinp), dinp, n_in)) return PG_ERR;
  *dx = m->dinp;
  return PG_OK;
}

static void attention_destroy(pg_module *m) {
  attention_state *s = m->state;
  pg_be_release(BE(m), s->att);
  pg_be_release(BE(m), s->scratch);
  pg_be_release(BE(m), s->rotated);
  pg_be_release(home_backend(BE(m)), s->cos_t);
  pg_be_release(home_backend(BE(m)), s->sin_t);
  pg_be_release(home_backend(BE(m)), s->slopes);
  pg_be_release(BE(m), s->cp_x);
  pg_be_release(BE(m), s->cp_att);
  pg_be_release(BE(m), s->cp_stage);
  pg_be_release(BE(m), s->cp_full);
  pg_be_release(BE(m), s->cp_dfull);
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

/* Selective recomputation: the probabilities of one micro-batch, from the rank's arena. */
static int attention_selective(const pg_module *m, size_t *bytes) {
  const attention_state *s = m->state;
  if (!s->o.recompute) return 0;
  *bytes = (size_t)m->max_rows * s->heads_l * s->max_seq * sizeof(float);
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
