/* kind_pointwise.c: the elementwise activations, GELU and SwiGLU. */
#include "module_impl.h"

#include <stdlib.h>

/* ---------------------------------------------------------------- gelu */

typedef struct gelu_state {
  const float **saved_x;
} gelu_state;

static int gelu_alloc(pg_module *m, int nslots, int max_rows) {
  gelu_state *s = m->state;
  return alloc_leaf(m, nslots, max_rows) || alloc_ptrs(&s->saved_x, nslots) ? PG_ERR : PG_OK;
}

static int gelu_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  gelu_state *s = m->state;
  if (check_rows(m, slot, io)) return PG_ERR;
  int64_t n = (int64_t)mod_rows(m, io) * m->in_width;
  if (n && (m->in_bf16 ? KERNEL(m, gelu_bf16_forward, bits(slot_out(m, slot)), cbits(x), n)
                       : KERNEL(m, gelu_forward, slot_out(m, slot), x, n)))
    return PG_ERR;
  s->saved_x[slot] = x;
  *y = slot_out(m, slot);
  return PG_OK;
}

static int gelu_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  gelu_state *s = m->state;
  int64_t n = (int64_t)mod_rows(m, io) * m->in_width;
  if (n && (m->in_bf16 ? KERNEL(m, gelu_bf16_backward, bits(m->dinp), cbits(s->saved_x[slot]), cbits(dy), n)
                       : KERNEL(m, gelu_backward, m->dinp, s->saved_x[slot], dy, n)))
    return PG_ERR;
  *dx = m->dinp;
  return PG_OK;
}

static void gelu_destroy(pg_module *m) { free(((gelu_state *)m->state)->saved_x); }

pg_module *pg_gelu_new(pg_context *ctx, const char *name, int width) {
  if (width < 1) return pg_fail_null("%s: GELU width must be positive, not %d", name, width);
  return module_new(&pg_kind_gelu, ctx, name, width, width, sizeof(gelu_state));
}

/* ---------------------------------------------------------------- swiglu */

typedef struct swiglu_state {
  const float **saved_x;
} swiglu_state;

static int swiglu_alloc(pg_module *m, int nslots, int max_rows) {
  swiglu_state *s = m->state;
  return alloc_leaf(m, nslots, max_rows) || alloc_ptrs(&s->saved_x, nslots) ? PG_ERR : PG_OK;
}

static int swiglu_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  swiglu_state *s = m->state;
  if (check_rows(m, slot, io)) return PG_ERR;
  int rows = mod_rows(m, io);
  if (rows && (m->in_bf16 ? KERNEL(m, swiglu_bf16_forward, bits(slot_out(m, slot)), cbits(x), rows, m->out_width)
                          : KERNEL(m, swiglu_forward, slot_out(m, slot), x, rows, m->out_width)))
    return PG_ERR;
  s->saved_x[slot] = x;
  *y = slot_out(m, slot);
  return PG_OK;
}

static int swiglu_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  swiglu_state *s = m->state;
  int rows = mod_rows(m, io);
  if (rows && (m->in_bf16 ? KERNEL(m, swiglu_bf16_backward, bits(m->dinp), cbits(s->saved_x[slot]), cbits(dy), rows,
                                   m->out_width)
                          : KERNEL(m, swiglu_backward, m->dinp, s->saved_x[slot], dy, rows, m->out_width)))
    return PG_ERR;
  *dx = m->dinp;
  return PG_OK;
}

static void swiglu_destroy(pg_module *m) { free(((swiglu_state *)m->state)->saved_x); }

pg_module *pg_swiglu_new(pg_context *ctx, const char *name, int width) {
  if (width < 1) return pg_fail_null("%s: SwiGLU width must be positive, not %d", name, width);
  return module_new(&pg_kind_swiglu, ctx, name, 2 * width, width, sizeof(swiglu_state));
}

static pg_module *build_gelu(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env) {
  (void)env;
  int bad = 0, width = DESC_INT(d, "width", 0);
  return bad ? NULL : pg_gelu_new(ctx, name, width);
}

static pg_module *build_swiglu(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env) {
  (void)env;
  int bad = 0, width = DESC_INT(d, "width", 0);
  return bad ? NULL : pg_swiglu_new(ctx, name, width);
}

/* Elementwise: row-wise under sequence parallelism, and their output keeps their input's type under precision bf16. */
const pg_module_kind pg_kind_gelu = {
    .ops = {"gelu", gelu_alloc, gelu_forward, gelu_backward, gelu_destroy},
    .traits = {.name = "gelu", .assembly = PG_KIND_BUILT, .sp = PG_SP_ROW_WISE, .flags = PG_KIND_PASSES_BF16},
    .build = build_gelu,
};

const pg_module_kind pg_kind_swiglu = {
    .ops = {"swiglu", swiglu_alloc, swiglu_forward, swiglu_backward, swiglu_destroy},
    .traits = {.name = "swiglu", .assembly = PG_KIND_BUILT, .sp = PG_SP_ROW_WISE, .flags = PG_KIND_PASSES_BF16},
    .build = build_swiglu,
};
