/* kind_lua.c: the kinds computed by Lua callbacks: a module written in Lua (custom) and an objective. */
#include "module_impl.h"

#include <stdlib.h>

/* ---------------------------------------------------------------- custom (Lua) */

typedef struct custom_state {
  pg_custom_fns fns;
  pg_tp_region input, output;
} custom_state;

static int custom_alloc(pg_module *m, int nslots, int max_rows) { return alloc_leaf(m, nslots, max_rows); }

static int custom_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  custom_state *s = m->state;
  if (check_rows(m, slot, io)) return PG_ERR;
  int rows = io->B * io->T;
  if (s->fns.forward(s->fns.ud, home_backend(m->be), slot, io, x, rows, slot_out(m, slot))) return PG_ERR;
  if (s->output == PG_TP_REDUCE && pg_tp_reduce_forward(m, slot_out(m, slot), (int64_t)rows * m->out_width, PG_FLOAT32))
    return PG_ERR;
  *y = slot_out(m, slot);
  return PG_OK;
}

static int custom_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  custom_state *s = m->state;
  int rows = io->B * io->T;
  if (s->fns.backward(s->fns.ud, home_backend(m->be), slot, io, dy, rows, m->dinp)) return PG_ERR;
  if (s->input == PG_TP_COPY && pg_tp_copy_backward(m, m->dinp, (int64_t)rows * m->in_width)) return PG_ERR;
  *dx = m->dinp;
  return PG_OK;
}

static void custom_destroy(pg_module *m) {
  custom_state *s = m->state;
  if (s->fns.release) s->fns.release(s->fns.ud);
}

/* ---------------------------------------------------------------- objective (Lua) */

typedef struct objective_state {
  pg_objective_fns fns;
  const float **saved_x; /* per slot: the stage output the loss is taken of */
} objective_state;

static int objective_alloc(pg_module *m, int nslots, int max_rows) {
  objective_state *s = m->state;
  return alloc_leaf(m, nslots, max_rows) || alloc_ptrs(&s->saved_x, nslots) ? PG_ERR : PG_OK;
}

/* Training calls the objective once, in backward (loss and gradient
 * together: nothing to keep between the two); evaluation in forward. */
static int objective_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  objective_state *s = m->state;
  if (check_rows(m, slot, io)) return PG_ERR;
  s->saved_x[slot] = x;
  *y = NULL;
  if (io->want_grad || io->logits) return PG_OK;
  double loss = 0;
  if (s->fns.call(s->fns.ud, io, x, io->B * io->T, m->in_width, NULL, &loss)) return PG_ERR;
  io->loss_sum += loss * io->B * io->T; /* the engine averages loss_sum over the batch's rows */
  return PG_OK;
}

static int objective_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  (void)dy;
  objective_state *s = m->state;
  double loss = 0;
  if (s->fns.call(s->fns.ud, io, s->saved_x[slot], io->B * io->T, m->in_width, m->dinp, &loss)) return PG_ERR;
  io->loss_sum += loss * io->B * io->T;
  *dx = m->dinp;
  return PG_OK;
}

static void objective_destroy(pg_module *m) {
  objective_state *s = m->state;
  if (s->fns.release) s->fns.release(s->fns.ud);
  free(s->saved_x);
}

pg_module *pg_objective_new(pg_context *ctx, const char *name, int width, const pg_objective_fns *fns) {
  if (width < 1) return pg_fail_null("%s: an objective needs the stage's output width, not %d", name, width);
  pg_module *m = module_new(&pg_kind_objective, ctx, name, width, 0, sizeof(objective_state));
  if (!m) return NULL;
  ((objective_state *)m->state)->fns = *fns;
  return m;
}

pg_module *pg_custom_new(pg_context *ctx, const char *name, int in_width, int out_width, pg_tp_region input,
                         pg_tp_region output, const pg_custom_fns *fns, pg_param **params, int nparams) {
  if (in_width < 1 || out_width < 1)
    return pg_fail_null("%s: a module written in Lua needs positive widths (in=%d, out=%d)", name, in_width, out_width);
  if (input == PG_TP_REDUCE || output == PG_TP_COPY)
    return pg_fail_null("%s: input is replicated, copy or split; output replicated, reduce or split", name);
  pg_module *m = module_new(&pg_kind_custom, ctx, name, in_width, out_width, sizeof(custom_state));
  if (!m) return NULL;
  custom_state *s = m->state;
  s->fns = *fns;
  s->input = input;
  s->output = output;
  for (int i = 0; i < nparams; i++)
    if (add_param(m, params[i])) {
      for (int k = i + 1; k < nparams; k++) pg_param_free(params[k]);
      pg_module_free(m);
      return NULL;
    }
  return m;
}

/* Their Lua callbacks take whole micro-batches (a module written in Lua goes
 * between sp_gather and sp_scatter under sequence parallelism; an objective
 * takes every row). A module written in Lua runs on any backend: its
 * callbacks get the module's buffers in the backend's memory (its pg.ops
 * calls run the seam's kernels there); the objective reads and writes host
 * memory (targets on the host, losses as host numbers), so it stays on the
 * CPU. A module written in Lua is "lua" in descriptions (the bindings build
 * it from the Lua table), "custom" in messages; the objective never comes
 * from a description: the bindings end a stage with it. */
const pg_module_kind pg_kind_custom = {
    .ops = {"custom", custom_alloc, custom_forward, custom_backward, custom_destroy},
    .traits = {.name = "lua",
               .assembly = PG_KIND_LUA,
               .sp = PG_SP_ALL_ROWS,
               .flags = PG_KIND_WRITTEN_IN_LUA},
};

const pg_module_kind pg_kind_objective = {
    .ops = {"objective", objective_alloc, objective_forward, objective_backward, objective_destroy},
    .traits = {.name = "objective",
               .assembly = PG_KIND_INTERNAL,
               .sp = PG_SP_ALL_ROWS,
               .host_only = "a objective written in Lua runs on the cpu backend only",
               .flags = PG_KIND_WRITTEN_IN_LUA},
};
