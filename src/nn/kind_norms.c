/* kind_norms.c: the LayerNorm and RMSNorm kinds (row-wise, replicated parameters). */
#include "module_impl.h"

#include <stdlib.h>

/* ---------------------------------------------------------------- layernorm */

typedef struct layernorm_state {
  pg_param *w, *b;
  float *mean, *rstd; /* [nslots][rows] */
  const float **saved_x;
} layernorm_state;

static int layernorm_alloc(pg_module *m, int nslots, int max_rows) {
  layernorm_state *s = m->state;
  if (alloc_leaf(m, nslots, max_rows) || alloc_ptrs(&s->saved_x, nslots)) return PG_ERR;
  size_t rows = (size_t)m->slot_rows;
  if (!alloc_floats(m, &s->mean, (size_t)nslots * rows) || !alloc_floats(m, &s->rstd, (size_t)nslots * rows))
    return pg_fail("out of memory");
  m->saved_bytes_per_slot += 2 * rows * sizeof(float);
  return PG_OK;
}

static int layernorm_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  layernorm_state *s = m->state;
  if (check_rows(m, slot, io)) return PG_ERR;
  int N = mod_rows(m, io), C = m->in_width;
  size_t off = (size_t)slot * m->slot_rows;
  if (N && KERNEL(m, layernorm_forward, slot_out(m, slot), s->mean + off, s->rstd + off, x, s->w->data, s->b->data, N, C))
    return PG_ERR;
  s->saved_x[slot] = x;
  *y = slot_out(m, slot);
  return PG_OK;
}

static int layernorm_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  layernorm_state *s = m->state;
  int N = mod_rows(m, io), C = m->in_width;
  size_t off = (size_t)slot * m->slot_rows;
  if (N && KERNEL(m, layernorm_backward, m->dinp, s->w->grad, s->b->grad, dy, s->saved_x[slot], s->w->data, s->mean + off,
             s->rstd + off, N, C))
    return PG_ERR;
  *dx = m->dinp;
  return PG_OK;
}

static void layernorm_destroy(pg_module *m) {
  layernorm_state *s = m->state;
  pg_be_release(BE(m), s->mean);
  pg_be_release(BE(m), s->rstd);
  free(s->saved_x);
}

pg_module *pg_layernorm_new(pg_context *ctx, const char *name, int width) {
  if (width < 1) return pg_fail_null("%s: LayerNorm width must be positive, not %d", name, width);
  pg_module *m = module_new(&pg_kind_layernorm, ctx, name, width, width, sizeof(layernorm_state));
  if (!m) return NULL;
  int64_t shape[1] = {width};
  if (add_param(m, param_make(name, "weight", 1, shape, 0, 1, 1, 0, PG_INIT_ONES, 0)) ||
      add_param(m, param_make(name, "bias", 1, shape, 0, 1, 1, 0, PG_INIT_ZEROS, 0))) {
    pg_module_free(m);
    return NULL;
  }
  layernorm_state *s = m->state;
  s->w = m->params[0];
  s->b = m->params[1];
  return m;
}

/* ---------------------------------------------------------------- rmsnorm */

typedef struct rmsnorm_state {
  float eps;
  pg_param *w;
  float *rstd; /* [nslots][rows] */
  const float **saved_x;
} rmsnorm_state;

static int rmsnorm_alloc(pg_module *m, int nslots, int max_rows) {
  rmsnorm_state *s = m->state;
  if (alloc_leaf(m, nslots, max_rows) || alloc_ptrs(&s->saved_x, nslots)) return PG_ERR;
  if (!alloc_floats(m, &s->rstd, (size_t)nslots * m->slot_rows)) return pg_fail("out of memory");
  m->saved_bytes_per_slot += (size_t)m->slot_rows * sizeof(float);
  return PG_OK;
}

static int rmsnorm_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  rmsnorm_state *s = m->state;
  if (check_rows(m, slot, io)) return PG_ERR;
  if (mod_rows(m, io) && KERNEL(m, rmsnorm_forward, slot_out(m, slot), s->rstd + (size_t)slot * m->slot_rows, x, s->w->data,
             mod_rows(m, io), m->in_width, s->eps))
    return PG_ERR;
  s->saved_x[slot] = x;
  *y = slot_out(m, slot);
  return PG_OK;
}

static int rmsnorm_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  rmsnorm_state *s = m->state;
  if (mod_rows(m, io) && KERNEL(m, rmsnorm_backward, m->dinp, s->w->grad, dy, s->saved_x[slot], s->w->data,
             s->rstd + (size_t)slot * m->slot_rows, mod_rows(m, io), m->in_width))
    return PG_ERR;
  *dx = m->dinp;
  return PG_OK;
}

static void rmsnorm_destroy(pg_module *m) {
  rmsnorm_state *s = m->state;
  pg_be_release(BE(m), s->rstd);
  free(s->saved_x);
}

pg_module *pg_rmsnorm_new(pg_context *ctx, const char *name, int width, float eps) {
  if (width < 1) return pg_fail_null("%s: RMSNorm width must be positive, not %d", name, width);
  if (!(eps >= 0)) return pg_fail_null("%s: RMSNorm eps must be >= 0, not %g", name, (double)eps);
  pg_module *m = module_new(&pg_kind_rmsnorm, ctx, name, width, width, sizeof(rmsnorm_state));
  if (!m) return NULL;
  int64_t shape[1] = {width};
  if (add_param(m, param_make(name, "weight", 1, shape, 0, 1, 1, 0, PG_INIT_ONES, 0))) {
    pg_module_free(m);
    return NULL;
  }
  rmsnorm_state *s = m->state;
  s->eps = eps;
  s->w = m->params[0];
  return m;
}

static pg_module *build_layernorm(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env) {
  (void)env;
  int bad = 0, width = DESC_INT(d, "width", 0);
  return bad ? NULL : pg_layernorm_new(ctx, name, width);
}

static pg_module *build_rmsnorm(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env) {
  (void)env;
  int bad = 0, width = DESC_INT(d, "width", 0);
  float eps = (float)DESC_NUMBER_REQ(d, "eps");
  return bad ? NULL : pg_rmsnorm_new(ctx, name, width, eps);
}

/* Row-wise under sequence parallelism: their replicated weights then see this rank's rows only. */
const pg_module_kind pg_kind_layernorm = {
    .ops = {"layernorm", layernorm_alloc, layernorm_forward, layernorm_backward, layernorm_destroy},
    .traits = {.name = "layernorm", .assembly = PG_KIND_BUILT, .sp = PG_SP_ROW_WISE},
    .build = build_layernorm,
};

const pg_module_kind pg_kind_rmsnorm = {
    .ops = {"rmsnorm", rmsnorm_alloc, rmsnorm_forward, rmsnorm_backward, rmsnorm_destroy},
    .traits = {.name = "rmsnorm", .assembly = PG_KIND_BUILT, .sp = PG_SP_ROW_WISE},
    .build = build_rmsnorm,
};
