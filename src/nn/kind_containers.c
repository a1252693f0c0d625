/* kind_containers.c: the kinds that hold modules: sequential, residual and
 * recompute (full activation recomputation). */
#include "module_impl.h"

#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- sequential, residual */

static int sequential_alloc(pg_module *m, int nslots, int max_rows) {
  m->nslots = nslots;
  m->max_rows = max_rows;
  for (int i = 0; i < m->nchildren; i++)
    if (pg_module_alloc(m->children[i], nslots, max_rows)) return PG_ERR;
  return PG_OK;
}

static int sequential_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  for (int i = 0; i < m->nchildren; i++) {
    const float *next = NULL;
    if (pg_module_forward(m->children[i], slot, io, x, &next)) return PG_ERR;
    x = next;
  }
  *y = x;
  return PG_OK;
}

static int sequential_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  for (int i = m->nchildren - 1; i >= 0; i--) {
    const float *prev = NULL;
    if (pg_module_backward(m->children[i], slot, io, dy, &prev)) return PG_ERR;
    dy = prev;
  }
  *dx = dy;
  return PG_OK;
}

static int adopt_children(pg_module *m, pg_module **children, int n) {
  m->children = calloc((size_t)(n > 0 ? n : 1), sizeof *m->children);
  if (!m->children) return pg_fail("out of memory");
  memcpy(m->children, children, (size_t)n * sizeof *children);
  m->nchildren = n;
  return PG_OK;
}

pg_module *pg_sequential_new(pg_context *ctx, const char *name, pg_module **children, int n) {
  if (n < 1) return pg_fail_null("%s: a Sequential needs at least one module", name);
  for (int i = 1; i < n; i++)
    if (children[i]->in_width != children[i - 1]->out_width)
      return pg_fail_null("%s: module %d (%s) produces width %d but module %d (%s) takes width %d", name, i,
                          children[i - 1]->name, children[i - 1]->out_width, i + 1, children[i]->name,
                          children[i]->in_width);
  pg_module *m = module_new(&pg_kind_sequential, ctx, name, children[0]->in_width, children[n - 1]->out_width, 0);
  if (!m) return NULL;
  if (adopt_children(m, children, n)) {
    m->nchildren = 0;
    pg_module_free(m);
    return NULL;
  }
  return m;
}

/* The stream x is float32; the branch's output may be bf16 (precision bf16, a branch ending in a Linear or GELU):
 * it is added widened, and the branch gets its output gradient rounded, as autocast's add of a float32 and a bf16
 * tensor does. */
typedef struct residual_state {
  uint16_t *dy16; /* bf16 branch: [rows * width], the branch's output gradient */
} residual_state;

static int residual_alloc(pg_module *m, int nslots, int max_rows) {
  residual_state *s = m->state;
  if (alloc_leaf(m, nslots, max_rows) || pg_module_alloc(m->children[0], nslots, max_rows)) return PG_ERR;
  pg_be_release(BE(m), s->dy16);
  s->dy16 = NULL;
  size_t n = (size_t)m->slot_rows * m->out_width;
  if (m->children[0]->out_bf16 && n && !(s->dy16 = BE(m)->ops->alloc(BE(m), n * sizeof(uint16_t))))
    return pg_fail("%s: no room for its branch's bf16 gradient: %s", m->name, pg_error());
  return PG_OK;
}

static int residual_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  if (check_rows(m, slot, io)) return PG_ERR;
  const float *f = NULL;
  if (pg_module_forward(m->children[0], slot, io, x, &f)) return PG_ERR;
  int64_t n = (int64_t)mod_rows(m, io) * m->out_width;
  if (n && (m->children[0]->out_bf16 ? KERNEL(m, residual_bf16_forward, slot_out(m, slot), x, cbits(f), n)
                                     : KERNEL(m, residual_forward, slot_out(m, slot), x, f, n)))
    return PG_ERR;
  *y = slot_out(m, slot);
  return PG_OK;
}

static int residual_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  residual_state *s = m->state;
  const float *dinner = NULL, *dbranch = dy;
  if (m->children[0]->out_bf16) {
    if (KERNEL(m, bf16_from_f32, s->dy16, dy, (int64_t)mod_rows(m, io) * m->out_width)) return PG_ERR;
    dbranch = (const float *)(const void *)s->dy16;
  }
  if (pg_module_backward(m->children[0], slot, io, dbranch, &dinner)) return PG_ERR;
  /* dx = dy + d(inner)/dx */
  if (mod_rows(m, io) && KERNEL(m, residual_forward, m->dinp, dy, dinner, (int64_t)mod_rows(m, io) * m->in_width))
    return PG_ERR;
  *dx = m->dinp;
  return PG_OK;
}

static void residual_destroy(pg_module *m) { pg_be_release(BE(m), ((residual_state *)m->state)->dy16); }

pg_module *pg_residual_new(pg_context *ctx, const char *name, pg_module *inner) {
  if (inner->in_width != inner->out_width || inner->in_width < 1)
    return pg_fail_null("%s: a Residual needs a module with equal input and output widths (%s: %d -> %d)", name,
                        inner->name, inner->in_width, inner->out_width);
  pg_module *m = module_new(&pg_kind_residual, ctx, name, inner->in_width, inner->out_width, sizeof(residual_state));
  if (!m) return NULL;
  if (adopt_children(m, &inner, 1)) {
    pg_module_free(m);
    return NULL;
  }
  return m;
}

/* ---------------------------------------------------------------- recompute (full) */

typedef struct recompute_state {
  const float **saved_x; /* per slot: the block's input (its producer keeps it) */
} recompute_state;

static int recompute_alloc(pg_module *m, int nslots, int max_rows) {
  recompute_state *s = m->state;
  pg_be_release(BE(m), m->out);
  m->out = NULL;
  m->nslots = nslots;
  m->max_rows = max_rows;
  m->slot_rows = mod_rows_max(m, max_rows); /* the block's output: this rank's rows with sequence parallelism */
  size_t out_n = (size_t)nslots * m->slot_rows * m->out_width;
  if (!(m->out = pg_be_floats(BE(m), out_n)))
    return pg_fail("%s outputs (%zu floats on %s): %s", m->name, out_n, BE(m)->name, pg_error());
  m->saved_bytes_per_slot = out_n / nslots * sizeof(float);
  if (alloc_ptrs(&s->saved_x, nslots)) return PG_ERR;
  if (!m->arena) return pg_module_alloc(m->children[0], 1, max_rows); /* the block's own micro-batch of buffers */
  /* the arena's (shared with every recomputed block): the input gradient
   * handed back must outlive the next block's recomputation and backward,
   * which reuse the region (GPT's and LLaMA's blocks happen to read it before
   * overwriting it; a block of other modules need not) */
  pg_be_release(BE(m), m->dinp);
  if (!(m->dinp = pg_be_floats(BE(m), (size_t)max_rows * m->in_width)))
    return pg_fail("%s input gradients: %s", m->name, pg_error());
  return arena_alloc_block(m->arena, m->children[0], max_rows);
}

static int recompute_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  recompute_state *s = m->state;
  if (check_rows(m, slot, io)) return PG_ERR;
  const float *f = NULL;
  if (pg_module_forward(m->children[0], 0, io, x, &f) ||
      (mod_rows(m, io) && KERNEL(m, copy, slot_out(m, slot), f, (size_t)mod_rows(m, io) * m->out_width * sizeof(float),
                                     PG_COPY_DEVICE_TO_DEVICE)))
    return PG_ERR;
  s->saved_x[slot] = x;
  *y = slot_out(m, slot);
  return PG_OK;
}

static int recompute_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  recompute_state *s = m->state;
  const float *f = NULL;
  /* the block's activations of this micro-batch, again, then its backward */
  io->recomputing = 1;
  int rc = pg_module_forward(m->children[0], 0, io, s->saved_x[slot], &f);
  io->recomputing = 0;
  if (rc || pg_module_backward(m->children[0], 0, io, dy, dx)) return PG_ERR;
  if (!m->arena) return PG_OK;
  if (KERNEL(m, copy, m->dinp, *dx, (size_t)io->B * io->T * m->in_width * sizeof(float), PG_COPY_DEVICE_TO_DEVICE))
    return PG_ERR;
  *dx = m->dinp;
  return PG_OK;
}

static void recompute_destroy(pg_module *m) {
  recompute_state *s = m->state;
  free(s->saved_x);
}

pg_module *pg_recompute_new(pg_context *ctx, const char *name, pg_module *inner) {
  pg_module *m = module_new(&pg_kind_recompute, ctx, name, inner->in_width, inner->out_width, sizeof(recompute_state));
  if (!m) return NULL;
  if (adopt_children(m, &inner, 1)) {
    pg_module_free(m);
    return NULL;
  }
  return m;
}

/* ---------------------------------------------------------------- their descriptors */

/* pg_module_assemble's: the list of children, or the one inner module. */
static pg_module *assemble_sequential(pg_context *ctx, const char *name, pg_module **children, int n) {
  return pg_sequential_new(ctx, name, children, n);
}

static pg_module *assemble_residual(pg_context *ctx, const char *name, pg_module **children, int n) {
  if (n != 1) return pg_fail_null("%s: a residual wraps one module, not %d", name, n);
  return pg_residual_new(ctx, name, children[0]);
}

static pg_module *assemble_recompute(pg_context *ctx, const char *name, pg_module **children, int n) {
  if (n != 1) return pg_fail_null("%s: a recompute wraps one module, not %d", name, n);
  return pg_recompute_new(ctx, name, children[0]);
}

/* All three are row-wise under sequence parallelism (their children say
 * what their rows are); the sequential's element types are its chain's, and
 * the residual adds a bf16 branch to its float32 stream. */
const pg_module_kind pg_kind_sequential = {
    .ops = {"sequential", sequential_alloc, sequential_forward, sequential_backward, NULL},
    .traits = {.name = "sequential", .assembly = PG_KIND_LIST, .sp = PG_SP_ROW_WISE},
    .assemble = assemble_sequential,
};

const pg_module_kind pg_kind_residual = {
    .ops = {"residual", residual_alloc, residual_forward, residual_backward, residual_destroy},
    .traits = {.name = "residual", .assembly = PG_KIND_WRAPPER, .sp = PG_SP_ROW_WISE, .flags = PG_KIND_BF16_BRANCH},
    .assemble = assemble_residual,
};

const pg_module_kind pg_kind_recompute = {
    .ops = {"recompute", recompute_alloc, recompute_forward, recompute_backward, recompute_destroy},
    .traits = {.name = "recompute", .assembly = PG_KIND_WRAPPER, .sp = PG_SP_ROW_WISE, .flags = PG_KIND_RECOMPUTES},
    .assemble = assemble_recompute,
};
