/* kind_kv_heads.c: grouped-query attention with fewer key/value heads than
 * tensor ranks (tensor = T > kv_heads, T a multiple of kv_heads).
 *
 * Megatron replicates each key/value head's weights over the T / kv_heads
 * ranks whose query heads use it and sums their gradients over those
 * replicas. pipegoose keeps the weights split evenly instead — the column-
 * parallel q|k|v gives rank r piece r of the k block and of the v block,
 * kv_heads * head_dim / T columns each, as for any T — and replicates the
 * activations: this module, between that Linear and the attention core,
 * all-gathers the k|v pieces over the tensor group and hands the core this
 * rank's query heads and the one key/value head they use (head r / (T /
 * kv_heads)). Backward is the transpose: each rank's gradient of its head
 * (from its query heads only) is put into that head's pieces of a zeroed
 * buffer, and a reduce-scatter over the tensor group leaves every rank the
 * sum of its own pieces over the ranks sharing the head. The same sums as
 * Megatron's replica reduction, taken on the activations: the parameters
 * stay one even split, so the engine, the optimizer, checkpoints, gathers,
 * loads and exports see nothing new, and no replica can drift. */
#include "module_impl.h"

#include <stdint.h>

typedef struct kv_heads_state {
  int head_dim;
  int q_w;   /* this rank's query columns: heads / T * head_dim */
  int piece; /* this rank's columns of the k block (and of the v block): kv_heads * head_dim / T */
  int head;  /* the key/value head this rank's query heads use */
  int group; /* T / kv_heads: the ranks sharing a head, which are also the pieces of one head */
  float *full; /* [T][rows][2 piece] elements: every rank's k|v pieces (forward) or their gradients (backward) */
} kv_heads_state;

static int kv_heads_alloc(pg_module *m, int nslots, int max_rows) {
  kv_heads_state *s = m->state;
  if (alloc_leaf_rows(m, nslots, max_rows, max_rows, max_rows)) return PG_ERR;
  size_t n = (size_t)tp_size(m->ctx) * max_rows * 2 * s->piece; /* float room holds bf16 elements too */
  if (!alloc_floats(m, &s->full, n)) return pg_fail("out of memory for %s (key/value heads)", m->name);
  return PG_OK;
}

static inline char *at(const void *p, size_t elems, size_t es) { return (char *)p + elems * es; }

/* Rows of columns: n columns of es bytes from src (row pitch spitch elements) to dst (dpitch), N rows. */
static int cols(pg_module *m, void *dst, size_t dpitch, const void *src, size_t spitch, size_t n, size_t es, int N) {
  return BE(m)->ops->copy2d(BE(m), dst, dpitch * es, src, spitch * es, n * es, (size_t)N, PG_COPY_DEVICE_TO_DEVICE);
}

static int kv_heads_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  kv_heads_state *s = m->state;
  if (check_rows(m, slot, io)) return PG_ERR;
  int N = io->B * io->T, T = tp_size(m->ctx), r = tp_rank(m->ctx), hd = s->head_dim;
  size_t es = act_bytes(m->in_bf16), in_w = (size_t)m->in_width, out_w = (size_t)m->out_width, pw = 2 * (size_t)s->piece;
  float *out = slot_out(m, slot);
  /* this rank's k|v pieces into its block of rows, then every rank's */
  if (cols(m, at(s->full, (size_t)r * N * pw, es), pw, at(x, s->q_w, es), in_w, pw, es, N) ||
      pg_all_gather_rows(m->ctx, PG_MODE_TENSOR, s->full, (int64_t)T * N, (int64_t)pw, act_dtype(m->in_bf16)) ||
      cols(m, out, out_w, x, in_w, (size_t)s->q_w, es, N))
    return PG_ERR;
  for (int j = 0; j < s->group; j++) { /* head `head`'s pieces, in column order: k, then v */
    const char *src = at(s->full, (size_t)(s->head * s->group + j) * N * pw, es);
    if (cols(m, at(out, (size_t)s->q_w + (size_t)j * s->piece, es), out_w, src, pw, (size_t)s->piece, es, N) ||
        cols(m, at(out, (size_t)s->q_w + hd + (size_t)j * s->piece, es), out_w, at(src, (size_t)s->piece, es), pw,
             (size_t)s->piece, es, N))
      return PG_ERR;
  }
  *y = out;
  return PG_OK;
}

static int kv_heads_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  (void)slot;
  kv_heads_state *s = m->state;
  int N = io->B * io->T, T = tp_size(m->ctx), r = tp_rank(m->ctx), hd = s->head_dim;
  size_t es = act_bytes(m->in_bf16), in_w = (size_t)m->in_width, out_w = (size_t)m->out_width, pw = 2 * (size_t)s->piece;
  if (BE(m)->ops->zero(BE(m), s->full, (size_t)T * N * pw * es)) return PG_ERR;
  for (int j = 0; j < s->group; j++) { /* this rank's share of its head's gradient, into the head's pieces */
    char *dst = at(s->full, (size_t)(s->head * s->group + j) * N * pw, es);
    if (cols(m, dst, pw, at(dy, (size_t)s->q_w + (size_t)j * s->piece, es), out_w, (size_t)s->piece, es, N) ||
        cols(m, at(dst, (size_t)s->piece, es), pw, at(dy, (size_t)s->q_w + hd + (size_t)j * s->piece, es), out_w,
             (size_t)s->piece, es, N))
      return PG_ERR;
  }
  /* the sum over the ranks of each rank's pieces (only the ranks sharing a head put anything there) */
  if (pg_reduce_scatter_rows(m->ctx, PG_MODE_TENSOR, s->full, (int64_t)T * N, (int64_t)pw, act_dtype(m->in_bf16),
                             PG_REDUCE_SUM) ||
      cols(m, m->dinp, in_w, dy, out_w, (size_t)s->q_w, es, N) ||
      cols(m, at(m->dinp, (size_t)s->q_w, es), in_w, at(s->full, (size_t)r * N * pw, es), pw, pw, es, N))
    return PG_ERR;
  *dx = m->dinp;
  return PG_OK;
}

static void kv_heads_destroy(pg_module *m) {
  kv_heads_state *s = m->state;
  pg_be_release(BE(m), s->full);
}

pg_module *pg_kv_heads_new(pg_context *ctx, const char *name, int heads, int kv_heads, int head_dim) {
  int T = tp_size(ctx);
  if (heads < 1 || kv_heads < 1 || head_dim < 1)
    return pg_fail_null("%s: key/value heads need positive heads, kv_heads and head_dim (%d, %d, %d)", name, heads,
                        kv_heads, head_dim);
  if (heads % T || T % kv_heads || kv_heads >= T)
    return pg_fail_null("%s: replicated key/value heads need tensor=%d dividing heads=%d and a multiple of "
                        "kv_heads=%d above it", name, T, heads, kv_heads);
  if ((int64_t)kv_heads * head_dim % T)
    return pg_fail_null("%s: tensor=%d does not divide the %d columns of the k block", name, T, kv_heads * head_dim);
  if ((int64_t)(heads + 2 * kv_heads) * head_dim > INT32_MAX / 2) return pg_fail_null("%s: attention width overflows", name);
  int q_w = heads / T * head_dim, piece = kv_heads * head_dim / T;
  pg_module *m = module_new(&pg_kind_kv_heads, ctx, name, q_w + 2 * piece, q_w + 2 * head_dim, sizeof(kv_heads_state));
  if (!m) return NULL;
  kv_heads_state *s = m->state;
  s->head_dim = head_dim;
  s->q_w = q_w;
  s->piece = piece;
  s->group = T / kv_heads;
  s->head = tp_rank(ctx) / s->group;
  return m;
}

static pg_module *build_kv_heads(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env) {
  (void)env;
  int bad = 0, heads = DESC_INT(d, "heads", 0), kv = DESC_INT(d, "kv_heads", 0), hd = DESC_INT(d, "head_dim", 0);
  return bad ? NULL : pg_kv_heads_new(ctx, name, heads, kv, hd);
}

/* Needs every row of its sequences, as the attention core after it; moves bf16 q|k|v as they are. */
const pg_module_kind pg_kind_kv_heads = {
    .ops = {"kv_heads", kv_heads_alloc, kv_heads_forward, kv_heads_backward, kv_heads_destroy},
    .traits = {.name = "kv_heads", .assembly = PG_KIND_BUILT, .sp = PG_SP_ALL_ROWS, .flags = PG_KIND_PASSES_BF16},
    .build = build_kv_heads,
};
