/* kind_sp.c: the sequence-parallel transitions, sp_gather and sp_scatter. */
#include "module_impl.h"

/* ---------------------------------------------------------------- sequence-parallel transitions */

/* sp_gather: this rank's rows in, every row out (and the way back: this
 * rank's rows of a gradient that is the same on every rank). */
static int sp_gather_alloc(pg_module *m, int nslots, int max_rows) {
  return alloc_leaf_rows(m, nslots, max_rows, max_rows, mod_rows_max(m, max_rows));
}

static int sp_gather_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  if (check_rows(m, slot, io) || pg_sp_gather_rows(m, slot_out(m, slot), x, (int64_t)io->B * io->T, m->out_width, PG_FLOAT32))
    return PG_ERR;
  *y = slot_out(m, slot);
  return PG_OK;
}

static int sp_gather_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  (void)slot;
  int64_t N = (int64_t)io->B * io->T;
  size_t bytes = (size_t)mod_rows(m, io) * m->in_width * sizeof(float);
  if (bytes && KERNEL(m, copy, m->dinp, dy + (size_t)sp_row0(m, N) * m->in_width, bytes, PG_COPY_DEVICE_TO_DEVICE))
    return PG_ERR;
  *dx = m->dinp;
  return PG_OK;
}

/* sp_scatter: every row (the same on every rank) in, this rank's rows out
 * (and the way back: the gradient's rows gathered). */
static int sp_scatter_alloc(pg_module *m, int nslots, int max_rows) {
  return alloc_leaf_rows(m, nslots, max_rows, mod_rows_max(m, max_rows), max_rows);
}

static int sp_scatter_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  if (check_rows(m, slot, io)) return PG_ERR;
  int64_t N = (int64_t)io->B * io->T;
  size_t bytes = (size_t)mod_rows(m, io) * m->out_width * sizeof(float);
  if (bytes && KERNEL(m, copy, slot_out(m, slot), x + (size_t)sp_row0(m, N) * m->out_width, bytes,
                      PG_COPY_DEVICE_TO_DEVICE))
    return PG_ERR;
  *y = slot_out(m, slot);
  return PG_OK;
}

static int sp_scatter_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  (void)slot;
  if (pg_sp_gather_rows(m, m->dinp, dy, (int64_t)io->B * io->T, m->in_width, PG_FLOAT32)) return PG_ERR;
  *dx = m->dinp;
  return PG_OK;
}

static pg_module *sp_transition_new(const pg_module_kind *kind, pg_context *ctx, const char *name, int width) {
  if (width < 1) return pg_fail_null("%s: %s needs a positive width, not %d", name, kind->ops.kind, width);
  pg_module *m = module_new(kind, ctx, name, width, width, 0);
  if (m) m->sp = 1;
  return m;
}

pg_module *pg_sp_gather_new(pg_context *ctx, const char *name, int width) {
  return sp_transition_new(&pg_kind_sp_gather, ctx, name, width);
}

pg_module *pg_sp_scatter_new(pg_context *ctx, const char *name, int width) {
  return sp_transition_new(&pg_kind_sp_scatter, ctx, name, width);
}

static pg_module *build_sp_gather(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env) {
  (void)env;
  int bad = 0, width = DESC_INT(d, "width", 0);
  return bad ? NULL : pg_sp_gather_new(ctx, name, width);
}

static pg_module *build_sp_scatter(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env) {
  (void)env;
  int bad = 0, width = DESC_INT(d, "width", 0);
  return bad ? NULL : pg_sp_scatter_new(ctx, name, width);
}

const pg_module_kind pg_kind_sp_gather = {
    .ops = {"sp_gather", sp_gather_alloc, sp_gather_forward, sp_gather_backward, NULL},
    .traits = {.name = "sp_gather", .assembly = PG_KIND_BUILT, .sp = PG_SP_TRANSITION},
    .build = build_sp_gather,
};

const pg_module_kind pg_kind_sp_scatter = {
    .ops = {"sp_scatter", sp_scatter_alloc, sp_scatter_forward, sp_scatter_backward, NULL},
    .traits = {.name = "sp_scatter", .assembly = PG_KIND_BUILT, .sp = PG_SP_TRANSITION},
    .build = build_sp_scatter,
};
