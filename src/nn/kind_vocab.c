/* kind_vocab.c: the vocabulary-parallel kinds: the token (+ position)
 * embedding and the LM head with its fused cross-entropy (or its logits). */
#include "module_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- embedding */

typedef struct embedding_state {
  int vocab, padded_l, row_start, positions;
  pg_param *wte, *wpe;
  float *full; /* sequence parallelism, one micro-batch: the partial sums of every row, then their gradient */
} embedding_state;

static int embedding_alloc(pg_module *m, int nslots, int max_rows) {
  embedding_state *s = m->state;
  /* sequence parallelism: the output is this rank's rows */
  if (alloc_leaf_rows(m, nslots, max_rows, mod_rows_max(m, max_rows), 0)) return PG_ERR;
  if (sp_active(m) && !alloc_floats(m, &s->full, (size_t)max_rows * m->out_width)) return pg_fail("out of memory");
  return PG_OK;
}

/* Context parallelism (pg_io.cp_chunk): row b's two chunks sit at their own positions of the whole sequence
 * (pg_cp_position): the position table's rows from each chunk's first position on. backward: their gradients. */
static int cp_on(const pg_module *m, const pg_io *io) { return m->ctx && m->ctx->context > 1 && io->cp_chunk > 0; }
static int cp_positions(pg_module *m, embedding_state *s, const pg_io *io, float *rows, int backward) {
  int L = io->cp_chunk, C = m->out_width;
  for (int b = 0; b < io->B; b++)
    for (int c = 0; c < 2; c++) {
      float *r = rows + ((size_t)b * io->T + (size_t)c * L) * C;
      size_t at = (size_t)pg_cp_position(m->ctx->context, m->ctx->cp_rank, L, (int64_t)c * L) * C;
      if (backward ? KERNEL(m, position_backward, s->wpe->grad + at, r, L, L, C)
                   : KERNEL(m, position_forward, r, s->wpe->data + at, L, L, C))
        return PG_ERR;
    }
  return PG_OK;
}

static int embedding_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  (void)x;
  embedding_state *s = m->state;
  if (check_rows(m, slot, io)) return PG_ERR;
  int64_t seq = cp_on(m, io) ? (int64_t)m->ctx->context * io->T : io->T;
  if (s->positions && seq > s->positions)
    return pg_fail("%s: sequence length %lld exceeds the %d positions", m->name, (long long)seq, s->positions);
  int N = io->B * io->T, C = m->out_width;
  float *out = slot_out(m, slot);
  if (sp_active(m)) {
    /* every row's lookup in this rank's vocabulary slice; the positions go
     * into the first rank's, so the sum holds them once (and the same bits:
     * every other partial of a row is 0); this rank's rows of the sum */
    if (KERNEL(m, embedding_forward, s->full, io->tokens, s->wte->data, N, C, s->row_start, s->padded_l) ||
        (s->wpe && tp_rank(m->ctx) == 0 &&
         (cp_on(m, io) ? cp_positions(m, s, io, s->full, 0) : KERNEL(m, position_forward, s->full, s->wpe->data, N, io->T, C))) ||
        pg_sp_reduce_scatter_rows(m, s->full, out, N, C, PG_FLOAT32))
      return PG_ERR;
    *y = out;
    return PG_OK;
  }
  if (KERNEL(m, embedding_forward, out, io->tokens, s->wte->data, N, C, s->row_start, s->padded_l)) return PG_ERR;
  /* Each rank looked up only the ids in its vocabulary slice (others are 0). */
  if (pg_tp_reduce_forward(m, out, (int64_t)N * C, PG_FLOAT32)) return PG_ERR;
  if (s->wpe && io->decode) { /* decoding: row b's positions start at pos[b] (a row of the table each) */
    for (int b = 0; b < io->B; b++) {
      int p = io->decode->pos[b];
      if (p < 0 || p > s->positions - io->T)
        return pg_fail("%s: positions %d..%d exceed the %d positions", m->name, p, p + io->T - 1, s->positions);
      if (KERNEL(m, position_forward, out + (size_t)b * io->T * C, s->wpe->data + (size_t)p * C, io->T, io->T, C))
        return PG_ERR;
    }
  } else if (s->wpe && (cp_on(m, io) ? cp_positions(m, s, io, out, 0)
                                      : KERNEL(m, position_forward, out, s->wpe->data, N, io->T, C)))
    return PG_ERR;
  *y = out;
  return PG_OK;
}

static int embedding_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  (void)slot;
  embedding_state *s = m->state;
  int N = io->B * io->T, C = m->out_width;
  /* sequence parallelism: every row's gradient (the positions' is then the same on every rank) */
  if (sp_active(m) && pg_sp_gather_rows(m, s->full, dy, N, C, PG_FLOAT32)) return PG_ERR;
  if (sp_active(m)) dy = s->full;
  if (KERNEL(m, embedding_backward, s->wte->grad, dy, io->tokens, N, C, s->row_start, s->padded_l) ||
      (s->wpe && (cp_on(m, io) ? cp_positions(m, s, io, (float *)dy, 1)
                               : KERNEL(m, position_backward, s->wpe->grad, dy, N, io->T, C))))
    return PG_ERR;
  *dx = NULL;
  return PG_OK;
}

static void embedding_destroy(pg_module *m) { pg_be_release(BE(m), ((embedding_state *)m->state)->full); }

static int check_vocab(const char *name, int vocab, int padded, int T) {
  if (vocab < 1) return pg_fail("%s: vocabulary size must be positive, not %d", name, vocab);
  if (padded < vocab) return pg_fail("%s: padded vocabulary %d is smaller than the vocabulary %d", name, padded, vocab);
  if (padded % T) return pg_fail("%s: padded vocabulary %d is not divisible by tensor=%d", name, padded, T);
  return PG_OK;
}

pg_module *pg_embedding_new(pg_context *ctx, const char *name, int vocab, int padded_vocab, int width, int positions,
                            float init_std) {
  int T = tp_size(ctx), r = tp_rank(ctx);
  if (check_vocab(name, vocab, padded_vocab, T)) return NULL;
  if (width < 1) return pg_fail_null("%s: embedding width must be positive, not %d", name, width);
  pg_module *m = module_new(&pg_kind_embedding, ctx, name, 0, width, sizeof(embedding_state));
  if (!m) return NULL;
  embedding_state *s = m->state;
  s->vocab = vocab;
  s->padded_l = padded_vocab / T;
  s->row_start = r * s->padded_l;
  s->positions = positions;
  int64_t wshape[2] = {padded_vocab, width}, pshape[2] = {positions, width};
  if (add_param(m, param_make(name, "wte", 2, wshape, 0, 1, T, r, PG_INIT_NORMAL, init_std))) goto fail;
  s->wte = m->params[0];
  s->wte->valid_rows = vocab;
  s->wte->replicated = 0;
  if (positions > 0) {
    if (add_param(m, param_make(name, "wpe", 2, pshape, 0, 1, 1, 0, PG_INIT_NORMAL, init_std))) goto fail;
    s->wpe = m->params[1];
  }
  return m;
fail:
  pg_module_free(m);
  return NULL;
}

/* A head on the same stage ties to the token weight (pg_embedding_weight). */
static pg_param *embedding_tie_weight(pg_module *m) { return ((embedding_state *)m->state)->wte; }

/* ---------------------------------------------------------------- lm head + cross-entropy */

typedef struct lm_head_state {
  int vocab, padded_l, vocab_start, valid;
  int logits_out; /* pg_lm_logits_new: the logits slice is the output, no loss */
  pg_param *w;
  int owns_w;
  float *stats;   /* [nslots][3][rows]: row max, sum of exp, target logit */
  float *logits;  /* [rows * padded_l] scratch: logits, then dlogits in place */
  int logits_slot; /* which slot's dlogits the scratch holds (-1: none) */
  float *gather;  /* eval logits gather: [T][rows * padded_l] */
  float *red;     /* [2 * rows] reduction buffer */
  float *x_full;  /* sequence parallelism, one micro-batch: every rank's rows of the input */
  const float **saved_x;
  bf16_mm mm;
} lm_head_state;

static int lm_head_alloc(pg_module *m, int nslots, int max_rows) {
  lm_head_state *s = m->state;
  /* sequence parallelism: the input is this rank's rows, gathered; the input
   * gradient is every row's, reduce-scattered in place */
  if (alloc_leaf_rows(m, nslots, max_rows, max_rows, max_rows) || alloc_ptrs(&s->saved_x, nslots)) return PG_ERR;
  if (sp_active(m) && !alloc_floats(m, &s->x_full, (size_t)max_rows * m->in_width)) return pg_fail("out of memory");
  int T = tp_size(m->ctx);
  s->logits_slot = -1;
  /* the logits output lives in the per-slot outputs (alloc_leaf); only evaluation gathers */
  if (s->logits_out) {
    if (T > 1 && !alloc_floats(m, &s->gather, (size_t)T * max_rows * s->padded_l))
      return pg_fail("out of memory for %s (logits)", m->name);
    return mm_alloc(m, &s->mm, s->w->numel, max_rows, m->in_width, s->padded_l);
  }
  if (!alloc_floats(m, &s->stats, (size_t)nslots * 3 * max_rows) ||
      !alloc_floats(m, &s->logits, (size_t)max_rows * s->padded_l) || !alloc_floats(m, &s->red, 2 * (size_t)max_rows) ||
      (T > 1 && !alloc_floats(m, &s->gather, (size_t)T * max_rows * s->padded_l)))
    return pg_fail("out of memory for %s (logits)", m->name);
  m->saved_bytes_per_slot += 3 * (size_t)max_rows * sizeof(float);
  return mm_alloc(m, &s->mm, s->w->numel, max_rows, m->in_width, s->padded_l);
}

/* Global softmax statistics for the rows, reduced over the vocabulary slices. */
static int lm_head_stats(pg_module *m, lm_head_state *s, float *st, const int32_t *targets, int N) {
  float *rmax = st, *sumexp = st + m->max_rows, *tlogit = st + 2 * (size_t)m->max_rows;
  if (KERNEL(m, xent_row_max, rmax, s->logits, N, s->padded_l, s->valid) ||
      pg_all_reduce_buf(m->ctx, PG_MODE_TENSOR, rmax, N, PG_FLOAT32, PG_REDUCE_MAX) ||
      KERNEL(m, xent_sumexp, sumexp, tlogit, s->logits, rmax, targets, N, s->padded_l, s->valid, s->vocab_start))
    return PG_ERR;
  if (tp_size(m->ctx) > 1) { /* one reduction for both sums */
    size_t bytes = (size_t)N * sizeof(float);
    const pg_copy_kind on = PG_COPY_DEVICE_TO_DEVICE;
    if (KERNEL(m, copy, s->red, sumexp, bytes, on) || KERNEL(m, copy, s->red + N, tlogit, bytes, on) ||
        pg_all_reduce_buf(m->ctx, PG_MODE_TENSOR, s->red, 2 * (int64_t)N, PG_FLOAT32, PG_REDUCE_SUM) ||
        KERNEL(m, copy, sumexp, s->red, bytes, on) || KERNEL(m, copy, tlogit, s->red + N, bytes, on))
      return PG_ERR;
  }
  return PG_OK;
}

/* Evaluation: the full logits (host), real vocabulary columns only, from
 * every rank's slice `mine`. */
static int lm_head_full_logits(pg_module *m, lm_head_state *s, const float *mine, float *out, int N) {
  int width = s->padded_l, T = tp_size(m->ctx);
  size_t f = sizeof(float), piece = (size_t)N * width;
  if (T > 1 && (KERNEL(m, copy, s->gather + (size_t)tp_rank(m->ctx) * piece, mine, piece * f,
                       PG_COPY_DEVICE_TO_DEVICE) ||
                pg_all_gather_buf(m->ctx, PG_MODE_TENSOR, s->gather, (int64_t)piece, PG_FLOAT32)))
    return PG_ERR;
  /* slice k holds vocabulary columns [k width, (k+1) width), the real ones first */
  for (int k = 0; k < T && k * width < s->vocab; k++) {
    int cols = s->vocab - k * width < width ? s->vocab - k * width : width;
    const float *src = T > 1 ? s->gather + (size_t)k * piece : mine;
    if (KERNEL(m, copy2d, out + (size_t)k * width, (size_t)s->vocab * f, src, (size_t)width * f, (size_t)cols * f,
               (size_t)N, PG_COPY_DEVICE_TO_HOST))
      return PG_ERR;
  }
  return PG_OK;
}

static int lm_head_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  lm_head_state *s = m->state;
  if (check_rows(m, slot, io)) return PG_ERR;
  int N = io->B * io->T, C = m->in_width;
  float *logits = s->logits_out ? slot_out(m, slot) : s->logits;
  s->saved_x[slot] = x; /* sequence parallelism: this rank's rows, gathered again in backward */
  if (sp_active(m) && pg_sp_gather_rows(m, s->x_full, x, N, C, PG_FLOAT32)) return PG_ERR;
  if (sp_active(m)) x = s->x_full;
  if (mm_fwd(m, &s->mm, io, s->w, logits, x, NULL, N, C, s->padded_l)) return PG_ERR;
  s->logits_slot = -1;
  *y = s->logits_out ? logits : NULL;
  if (io->logits && lm_head_full_logits(m, s, logits, io->logits, N)) return PG_ERR;
  if (s->logits_out || !io->targets) return PG_OK;
  float *st = s->stats + (size_t)slot * 3 * m->max_rows;
  if (lm_head_stats(m, s, st, io->targets, N)) return PG_ERR;
  float *dl = io->want_grad ? s->logits : NULL;
  double loss_sum = 0;
  if (KERNEL(m, xent_finish, NULL, dl, s->logits, st, st + m->max_rows, st + 2 * (size_t)m->max_rows, io->targets, N,
             s->padded_l, s->valid, s->vocab_start, io->dloss, &loss_sum))
    return PG_ERR;
  io->loss_sum += loss_sum;
  if (dl) s->logits_slot = slot;
  return PG_OK;
}

/* x met every vocabulary slice: its gradient is the sum over the group
 * (sequence parallelism: this rank's rows of it). */
static int lm_head_input_grad(pg_module *m, int N, int C, const float **dx) {
  if (!sp_active(m)) {
    *dx = m->dinp;
    return pg_tp_copy_backward(m, m->dinp, (int64_t)N * C);
  }
  *dx = m->dinp + (size_t)sp_row0(m, N) * C;
  return pg_sp_reduce_scatter_rows(m, m->dinp, NULL, N, C, PG_FLOAT32);
}

static int lm_head_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  lm_head_state *s = m->state;
  int N = io->B * io->T, C = m->in_width;
  const float *x = s->saved_x[slot];
  if (sp_active(m) && pg_sp_gather_rows(m, s->x_full, x, N, C, PG_FLOAT32)) return PG_ERR; /* every rank's rows, again */
  if (sp_active(m)) x = s->x_full;
  if (s->logits_out) { /* dy: the objective's gradient of this rank's logits slice */
    if (mm_bwd(m, &s->mm, io, m->dinp, s->w, NULL, dy, x, N, C, s->padded_l)) return PG_ERR;
    return lm_head_input_grad(m, N, C, dx);
  }
  if (s->logits_slot != slot) { /* another micro-batch ran since: recompute from the saved statistics */
    float *st = s->stats + (size_t)slot * 3 * m->max_rows;
    if ((s->mm.on ? mm_forward(m, &s->mm, io, 0, s->w, s->logits, x, NULL, N, C, s->padded_l)
                 : KERNEL(m, matmul_forward, s->logits, x, s->w->data, NULL, N, C, s->padded_l)) ||
        KERNEL(m, xent_finish, NULL, s->logits, s->logits, st, st + m->max_rows, st + 2 * (size_t)m->max_rows,
               io->targets, N, s->padded_l, s->valid, s->vocab_start, io->dloss, NULL))
      return PG_ERR;
  }
  s->logits_slot = -1;
  if (mm_bwd(m, &s->mm, io, m->dinp, s->w, NULL, s->logits, x, N, C, s->padded_l))
    return PG_ERR;
  return lm_head_input_grad(m, N, C, dx);
}

static void lm_head_destroy(pg_module *m) {
  lm_head_state *s = m->state;
  pg_be_release(BE(m), s->stats);
  pg_be_release(BE(m), s->logits);
  pg_be_release(BE(m), s->gather);
  pg_be_release(BE(m), s->red);
  pg_be_release(BE(m), s->x_full);
  free(s->saved_x);
  mm_free(m, &s->mm);
}

static pg_module *lm_head_make(pg_context *ctx, const char *name, int vocab, int padded_vocab, int width,
                               pg_param *weight, const char *weight_name, int tied_copy, float init_std,
                               int logits_out) {
  int T = tp_size(ctx), r = tp_rank(ctx);
  if (check_vocab(name, vocab, padded_vocab, T)) return NULL;
  if (weight && (weight->ndim != 2 || weight->shape[0] != padded_vocab / T || weight->shape[1] != width))
    return pg_fail_null("%s: tied weight %s has shape [%lld, %lld], expected [%d, %d]", name, weight->name,
                        (long long)weight->shape[0], (long long)weight->shape[1], padded_vocab / T, width);
  pg_module *m = module_new(&pg_kind_lm_head, ctx, name, width, logits_out ? padded_vocab / T : 0,
                           sizeof(lm_head_state));
  if (!m) return NULL;
  lm_head_state *s = m->state;
  s->logits_out = logits_out;
  s->vocab = vocab;
  s->padded_l = padded_vocab / T;
  s->vocab_start = r * s->padded_l;
  s->valid = vocab - s->vocab_start;
  if (s->valid < 0) s->valid = 0;
  if (s->valid > s->padded_l) s->valid = s->padded_l;
  if (weight) {
    s->w = weight;
  } else {
    int64_t wshape[2] = {padded_vocab, width};
    pg_param *p = param_make(NULL, weight_name, 2, wshape, 0, 1, T, r, PG_INIT_NORMAL, init_std);
    if (add_param(m, p)) {
      pg_module_free(m);
      return NULL;
    }
    s->w = p;
    s->owns_w = 1;
    p->valid_rows = vocab;
    p->replicated = 0;
    p->tied_copy = tied_copy;
  }
  return m;
}

pg_module *pg_lm_head_new(pg_context *ctx, const char *name, int vocab, int padded_vocab, int width, pg_param *weight,
                          const char *weight_name, int tied_copy, float init_std) {
  return lm_head_make(ctx, name, vocab, padded_vocab, width, weight, weight_name, tied_copy, init_std, 0);
}

pg_module *pg_lm_logits_new(pg_context *ctx, const char *name, int vocab, int padded_vocab, int width,
                            pg_param *weight, const char *weight_name, int tied_copy, float init_std) {
  return lm_head_make(ctx, name, vocab, padded_vocab, width, weight, weight_name, tied_copy, init_std, 1);
}

static pg_module *build_embedding(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env) {
  int bad = 0, vocab = DESC_INT(d, "vocab", 0), padded = DESC_INT(d, "padded_vocab", 0);
  int width = DESC_INT(d, "width", 0), positions = DESC_INT(d, "positions", 0);
  if (bad) return NULL;
  float std = (float)DESC_NUMBER_REQ(d, "init_std");
  if (bad) return NULL;
  pg_module *m = pg_embedding_new(ctx, name, vocab, padded, width, positions, std);
  if (m && env && env->nembeddings < 8) env->embeddings[env->nembeddings++] = m;
  return m;
}

/* tie = the name of an embedding weight built earlier in this stage, or none
 * (the head then owns "<name>.weight", or the tied name on a later stage). */
static pg_module *build_lm_head(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env) {
  const char *tie = d->ops->string(d, "tie", NULL);
  pg_param *w = NULL;
  for (int i = 0; tie && env && i < env->nembeddings && !w; i++) {
    pg_param *p = pg_embedding_weight(env->embeddings[i]);
    if (p && !strcmp(p->name, tie)) w = p;
  }
  char own[512];
  snprintf(own, sizeof own, "%s%sweight", name, *name ? "." : "");
  int bad = 0, vocab = DESC_INT(d, "vocab", 0), padded = DESC_INT(d, "padded_vocab", 0);
  int width = DESC_INT(d, "width", 0);
  if (bad) return NULL;
  const char *output = d->ops->string(d, "output", "loss");
  float std = (float)DESC_NUMBER_REQ(d, "init_std");
  if (bad) return NULL;
  if (!strcmp(output, "logits")) return pg_lm_logits_new(ctx, name, vocab, padded, width, w, tie ? tie : own, tie != NULL, std);
  if (strcmp(output, "loss")) return pg_fail_null("%s: output must be 'loss' or 'logits', not '%s'", name, output);
  return pg_lm_head_new(ctx, name, vocab, padded, width, w, tie ? tie : own, tie != NULL, std);
}

/* ---------------------------------------------------------------- their traits */

static void lm_head_bf16_on(pg_module *m) { ((lm_head_state *)m->state)->mm.on = 1; }

static void lm_head_bf16_need(const pg_module *m, pg_bf16_need *need) {
  mm_need(&((const lm_head_state *)m->state)->mm, need);
}

static size_t lm_head_bf16_bytes(const pg_module *m) { return ((const lm_head_state *)m->state)->mm.bytes; }

/* a tied head reads the embedding's weight, which the embedding reads as float32: it keeps its own copy */
static void lm_head_bf16_gathered(pg_module *m) {
  lm_head_state *s = m->state;
  if (s->owns_w) mm_gathered(m, &s->mm, s->w);
}

/* A tied head writes the gradient of the embedding's weight, which it does not own. */
static pg_param *lm_head_borrowed(const pg_module *m) {
  const lm_head_state *s = m->state;
  return s->owns_w ? NULL : s->w;
}

/* The embedding gives this rank's rows (its partial sums reduce-scattered); the head gathers them. */
const pg_module_kind pg_kind_embedding = {
    .ops = {"embedding", embedding_alloc, embedding_forward, embedding_backward, embedding_destroy},
    .traits = {.name = "embedding", .assembly = PG_KIND_BUILT, .sp = PG_SP_SCATTERS},
    .build = build_embedding,
    .tie_weight = embedding_tie_weight,
};

const pg_module_kind pg_kind_lm_head = {
    .ops = {"lm_head", lm_head_alloc, lm_head_forward, lm_head_backward, lm_head_destroy},
    .traits = {.name = "lm_head", .assembly = PG_KIND_BUILT, .sp = PG_SP_GATHERS, .flags = PG_KIND_HEAD},
    .build = build_lm_head,
    .bf16_on = lm_head_bf16_on,
    .bf16_need = lm_head_bf16_need,
    .bf16_bytes = lm_head_bf16_bytes,
    .bf16_gathered = lm_head_bf16_gathered,
    .borrowed = lm_head_borrowed,
};
