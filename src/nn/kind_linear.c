/* kind_linear.c: the Linear kind, plain, column-parallel or row-parallel. */
#include "module_impl.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- linear */

typedef struct linear_state {
  pg_linear_opts o;
  int in_l, out_l;          /* local widths of the matmul */
  int block_l[PG_PARAM_MAX_BLOCKS]; /* column: this rank's width of each output block */
  pg_param *w, *b;
  const float **saved_x;    /* [nslots] input rows of the local matmul */
  float *x_local;           /* row mode, input split here: [nslots][rows*in_l] */
  float *scratch;           /* column gather: [T][rows*out_l]; row split: dx_local [rows*in_l]; column gather bwd: dy_local */
  bf16_mm mm;
  float *rows_full;         /* sequence parallelism, one micro-batch: column: the gathered input [rows*in];
                               row: the partial output, then the gathered output gradient [rows*out] */
} linear_state;

static int linear_alloc(pg_module *m, int nslots, int max_rows) {
  linear_state *s = m->state;
  int T = tp_size(m->ctx), sp = sp_active(m), local = mod_rows_max(m, max_rows);
  /* sequence parallelism: a column-parallel layer takes this rank's rows and
   * gives all of them (its input gradient is reduce-scattered in place), a
   * row-parallel one the other way round; a plain one is row-wise */
  int out_rows = sp && s->o.mode == PG_LINEAR_COLUMN ? max_rows : local;
  int in_rows = sp && s->o.mode != PG_LINEAR_PLAIN ? max_rows : local;
  if (alloc_leaf_rows(m, nslots, max_rows, out_rows, in_rows) || alloc_ptrs(&s->saved_x, nslots)) return PG_ERR;
  if (sp && s->o.mode != PG_LINEAR_PLAIN &&
      !alloc_floats(m, &s->rows_full, (size_t)max_rows * (s->o.mode == PG_LINEAR_COLUMN ? s->in_l : s->out_l)))
    return pg_fail("out of memory");
  size_t rows = (size_t)max_rows;
  if (s->o.mode == PG_LINEAR_ROW && !s->o.input_is_parallel && T > 1) {
    if (!alloc_floats(m, &s->x_local, (size_t)nslots * rows * s->in_l)) return pg_fail("out of memory");
    m->saved_bytes_per_slot += rows * s->in_l * sizeof(float);
  }
  size_t scratch = 0;
  if (s->o.mode == PG_LINEAR_COLUMN && s->o.gather_output && T > 1) scratch = (size_t)T * rows * s->out_l;
  if (s->o.mode == PG_LINEAR_ROW && !s->o.input_is_parallel && T > 1) scratch = (size_t)T * rows * s->in_l;
  if (scratch && !alloc_floats(m, &s->scratch, scratch)) return pg_fail("out of memory");
  return mm_alloc(m, &s->mm, s->w->numel, max_rows, s->in_l, s->out_l);
}

static int linear_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  linear_state *s = m->state;
  if (check_rows(m, slot, io)) return PG_ERR;
  int N = io->B * io->T, T = tp_size(m->ctx), sp = sp_active(m);
  float *out = slot_out(m, slot);
  const float *b = s->b ? s->b->data : NULL;
  switch (s->o.mode) {
  case PG_LINEAR_PLAIN:
    if (mm_fwd(m, &s->mm, io, s->w, out, x, b, mod_rows(m, io), s->in_l, s->out_l)) return PG_ERR;
    break;
  case PG_LINEAR_COLUMN: {
    /* sequence parallelism: the rows of every rank (kept: only this rank's, gathered again in backward) */
    const float *xa = x;
    if (sp && pg_sp_gather_rows(m, s->rows_full, x, N, s->in_l, PG_FLOAT32)) return PG_ERR;
    if (sp) xa = s->rows_full;
    if (s->o.gather_output && T > 1) {
      float *local = s->scratch + (size_t)tp_rank(m->ctx) * N * s->out_l; /* computed in place in the gather slot */
      if (mm_fwd(m, &s->mm, io, s->w, local, xa, b, N, s->in_l, s->out_l) ||
          pg_tp_gather_forward(m, out, local, s->scratch, N, s->out_l, s->o.blocks, s->block_l))
        return PG_ERR;
    } else if (mm_fwd(m, &s->mm, io, s->w, out, xa, b, N, s->in_l, s->out_l)) {
      return PG_ERR;
    }
    break;
  }
  case PG_LINEAR_ROW: {
    const float *xl = x;
    if (!s->o.input_is_parallel && T > 1) {
      float *dst = s->x_local + (size_t)slot * m->max_rows * s->in_l;
      if (pg_tp_scatter_forward(m, dst, x, N, s->in_l, 1, &s->in_l)) return PG_ERR;
      xl = dst;
    }
    x = xl;
    /* The bias goes into one member's partial product (its sgemm starts from
     * the bias rows), so the sum over the group holds it once and no extra
     * pass over the output is needed; with T = 1 this is the plain layer. */
    /* sequence parallelism: the partial sums of every row, reduce-scattered to this rank's rows */
    float *part = sp ? s->rows_full : out;
    if (mm_fwd(m, &s->mm, io, s->w, part, xl, tp_rank(m->ctx) == 0 ? b : NULL, N, s->in_l, s->out_l))
      return PG_ERR;
    if (sp ? pg_sp_reduce_scatter_rows(m, part, out, N, s->out_l, act_dtype(m->out_bf16))
           : pg_tp_reduce_forward(m, out, (int64_t)N * s->out_l, act_dtype(m->out_bf16)))
      return PG_ERR;
    break;
  }
  }
  s->saved_x[slot] = x;
  *y = out;
  return PG_OK;
}

static int linear_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  linear_state *s = m->state;
  int N = io->B * io->T, T = tp_size(m->ctx), sp = sp_active(m);
  const float *x = s->saved_x[slot];
  float *db = s->b ? s->b->grad : NULL;
  /* a bf16 input's gradient: summed in float32 (over the tensor group too), then rounded (linear_takes_bf16) */
  float *dinp = !m->in_width ? NULL : m->in_bf16 ? io->wide_scratch[1] : m->dinp;
  switch (s->o.mode) {
  case PG_LINEAR_PLAIN:
    if (mod_rows(m, io) && mm_bwd(m, &s->mm, io, dinp, s->w, db, dy, x, mod_rows(m, io), s->in_l, s->out_l))
      return PG_ERR;
    break;
  case PG_LINEAR_COLUMN: {
    const float *dyl = dy;
    if (s->o.gather_output && T > 1) {
      if (pg_tp_scatter_forward(m, s->scratch, dy, N, s->out_l, s->o.blocks, s->block_l)) return PG_ERR;
      dyl = s->scratch;
    }
    if (sp && pg_sp_gather_rows(m, s->rows_full, x, N, s->in_l, PG_FLOAT32)) return PG_ERR; /* every rank's rows, again */
    if (sp) x = s->rows_full;
    if (mm_bwd(m, &s->mm, io, dinp, s->w, db, dyl, x, N, s->in_l, s->out_l)) return PG_ERR;
    /* Each rank saw all of x but produced only its output columns: the input
     * gradient is a sum over the group (sequence parallelism: this rank's rows of it). */
    if (sp) {
      if (pg_sp_reduce_scatter_rows(m, dinp, NULL, N, s->in_l, PG_FLOAT32)) return PG_ERR;
      dinp += (size_t)sp_row0(m, N) * s->in_l;
    } else if (pg_tp_copy_backward(m, dinp, (int64_t)N * s->in_l)) {
      return PG_ERR;
    }
    break;
  }
  case PG_LINEAR_ROW:
    /* sequence parallelism: the output gradient of every row (the bias's is then the same on every rank) */
    if (sp && pg_sp_gather_rows(m, s->rows_full, dy, N, s->out_l, act_dtype(m->out_bf16))) return PG_ERR;
    if (sp) dy = s->rows_full;
    if (!s->o.input_is_parallel && T > 1) {
      float *dxl = s->scratch + (size_t)tp_rank(m->ctx) * N * s->in_l;
      if (mm_bwd(m, &s->mm, io, dxl, s->w, db, dy, x, N, s->in_l, s->out_l) ||
          pg_tp_gather_forward(m, dinp, dxl, s->scratch, N, s->in_l, 1, &s->in_l))
        return PG_ERR;
    } else if (mm_bwd(m, &s->mm, io, dinp, s->w, db, dy, x, N, s->in_l, s->out_l)) {
      return PG_ERR;
    }
    break;
  }
  if (dinp && m->in_bf16) {
    int64_t in_rows = s->o.mode == PG_LINEAR_PLAIN ? mod_rows(m, io) : N;
    if (KERNEL(m, bf16_from_f32, bits(m->dinp), dinp, in_rows * m->in_width)) return PG_ERR;
    dinp = m->dinp;
  }
  *dx = dinp;
  return PG_OK;
}

static void linear_destroy(pg_module *m) {
  linear_state *s = m->state;
  free(s->saved_x);
  pg_be_release(BE(m), s->x_local);
  pg_be_release(BE(m), s->scratch);
  mm_free(m, &s->mm);
  pg_be_release(BE(m), s->rows_full);
}

pg_module *pg_linear_new(pg_context *ctx, const char *name, const pg_linear_opts *o) {
  int T = tp_size(ctx), r = tp_rank(ctx), blocks = o->blocks > 0 ? o->blocks : 1;
  if (o->in < 1 || o->out < 1) return pg_fail_null("%s: Linear widths must be positive (in=%d, out=%d)", name, o->in, o->out);
  if (blocks > PG_PARAM_MAX_BLOCKS) return pg_fail_null("%s: at most %d output blocks, not %d", name, PG_PARAM_MAX_BLOCKS, blocks);
  int64_t sizes[PG_PARAM_MAX_BLOCKS];
  int given = o->block_sizes[0] > 0;
  int64_t total = 0;
  for (int b = 0; b < blocks; b++) {
    sizes[b] = given ? o->block_sizes[b] : o->out / blocks;
    if (sizes[b] < 1) return pg_fail_null("%s: output block %d has width %lld", name, b + 1, (long long)sizes[b]);
    total += sizes[b];
  }
  if (given && total != o->out)
    return pg_fail_null("%s: output blocks add up to %lld columns, not out=%d", name, (long long)total, o->out);
  if (!given && o->out % blocks)
    return pg_fail_null("%s: output width %d is not divisible into %d blocks", name, o->out, blocks);
  for (int b = 0; o->mode == PG_LINEAR_COLUMN && b < blocks; b++)
    if (sizes[b] % T)
      return pg_fail_null("%s: column-parallel output width %d is not divisible by tensor=%d%s", name, o->out, T,
                          blocks > 1 ? " in each of its blocks" : "");
  if (o->mode == PG_LINEAR_ROW && o->in % T)
    return pg_fail_null("%s: row-parallel input width %d is not divisible by tensor=%d", name, o->in, T);
  int in_l = o->mode == PG_LINEAR_ROW ? o->in / T : o->in;
  int out_l = o->mode == PG_LINEAR_COLUMN ? o->out / T : o->out;
  int in_w = (o->mode == PG_LINEAR_ROW && o->input_is_parallel) ? in_l : o->in;
  int out_w = (o->mode == PG_LINEAR_COLUMN && !o->gather_output) ? out_l : o->out;
  pg_module *m = module_new(&pg_kind_linear, ctx, name, in_w, out_w, sizeof(linear_state));
  if (!m) return NULL;
  linear_state *s = m->state;
  s->o = *o;
  s->o.blocks = blocks;
  s->in_l = in_l;
  s->out_l = out_l;
  for (int b = 0; b < blocks; b++) s->block_l[b] = (int)(sizes[b] / (o->mode == PG_LINEAR_COLUMN ? T : 1));
  int64_t wshape[2] = {o->out, o->in}, bshape[1] = {o->out};
  int column = o->mode == PG_LINEAR_COLUMN;
  int parts = o->mode == PG_LINEAR_PLAIN ? 1 : T;
  if (add_param(m, param_make_blocks(name, "weight", 2, wshape, column ? 0 : 1, column ? blocks : 1,
                                     column ? sizes : NULL, parts, r, PG_INIT_NORMAL, o->init_std))) {
    pg_module_free(m);
    return NULL;
  }
  s->w = m->params[0];
  if (o->bias) {
    int bparts = o->mode == PG_LINEAR_COLUMN ? T : 1; /* a row-parallel bias is added after the reduce: replicated */
    if (add_param(m, param_make_blocks(name, "bias", 1, bshape, 0, blocks, sizes, bparts, r, PG_INIT_ZEROS, 0))) {
      pg_module_free(m);
      return NULL;
    }
    s->b = m->params[1];
  }
  return m;
}

static pg_module *build_linear(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env) {
  (void)env;
  const char *mode = d->ops->string(d, "mode", "plain");
  int bad = 0;
  pg_linear_opts o = {.in = DESC_INT(d, "in", 0), .out = DESC_INT(d, "out", 0), .bias = d->ops->boolean(d, "bias", 1),
                      .blocks = DESC_INT(d, "blocks", 1), .gather_output = d->ops->boolean(d, "gather_output", 0),
                      .input_is_parallel = d->ops->boolean(d, "input_is_parallel", 0)};
  if (bad) return NULL;
  o.mode = !strcmp(mode, "column") ? PG_LINEAR_COLUMN : !strcmp(mode, "row") ? PG_LINEAR_ROW : PG_LINEAR_PLAIN;
  int64_t sizes[PG_PARAM_MAX_BLOCKS];
  int n = d->ops->integers(d, "block_sizes", sizes, PG_PARAM_MAX_BLOCKS);
  if (n >= 0 && (n != o.blocks || n > PG_PARAM_MAX_BLOCKS))
    return pg_fail_null("%s: %d block sizes for %d blocks", name, n, o.blocks);
  for (int i = 0; i < n; i++) {
    if (sizes[i] < 1 || sizes[i] > INT32_MAX) return pg_fail_null("%s: block %d has width %lld", name, i + 1, (long long)sizes[i]);
    o.block_sizes[i] = (int)sizes[i];
  }
  o.init_std = (float)DESC_NUMBER_REQ(d, "init_std");
  return bad ? NULL : pg_linear_new(ctx, name, &o);
}

/* ---------------------------------------------------------------- its traits */

static int linear_mode(const pg_module *m) { return (int)((const linear_state *)m->state)->o.mode; }

static void linear_bf16_on(pg_module *m) { ((linear_state *)m->state)->mm.on = 1; }

/* Precision bf16 (module_bf16.c's rule): a Linear's output is bf16 unless a column-parallel one gathers it. */
static int linear_makes_bf16(const pg_module *m) {
  const linear_state *s = m->state;
  return !(s->o.mode == PG_LINEAR_COLUMN && s->o.gather_output && tp_size(m->ctx) > 1);
}

/* A bf16 input reaches the GEMM as it is: not where it is gathered (a column-parallel layer under sequence
 * parallelism) or split here (a row-parallel one given the full width). */
static int linear_takes_bf16(const pg_module *m) {
  const linear_state *s = m->state;
  if (s->o.mode == PG_LINEAR_COLUMN) return !sp_active(m);
  if (s->o.mode == PG_LINEAR_ROW) return s->o.input_is_parallel || tp_size(m->ctx) == 1;
  return 1;
}

/* Its products' operands, and the float32 room of its bf16 activations (pg_io.wide_scratch), max_rows rows. */
static void linear_bf16_need(const pg_module *m, pg_bf16_need *need) {
  const linear_state *s = m->state;
  mm_need(&s->mm, need);
  int64_t rows = m->max_rows, wide[PG_WIDE_SCRATCH] = {0};
  if (m->out_bf16) wide[0] = rows * s->out_l; /* the sums before rounding; backward: the bias's widened dy */
  if (m->in_bf16) wide[1] = rows * s->in_l;   /* the input gradient before rounding */
  raise_wide(need, wide);
}

static size_t linear_bf16_bytes(const pg_module *m) { return ((const linear_state *)m->state)->mm.bytes; }

static void linear_bf16_gathered(pg_module *m) {
  linear_state *s = m->state;
  mm_gathered(m, &s->mm, s->w);
}

/* Sequence parallelism by mode: a plain layer is row-wise; a column-parallel
 * one gathers this rank's rows; a row-parallel one needs every row of its
 * input and reduce-scatters its output to this rank's rows. */
const pg_module_kind pg_kind_linear = {
    .ops = {"linear", linear_alloc, linear_forward, linear_backward, linear_destroy},
    .traits = {.name = "linear",
               .assembly = PG_KIND_BUILT,
               .nmodes = 3,
               .modes = {[PG_LINEAR_PLAIN] = "plain", [PG_LINEAR_COLUMN] = "column", [PG_LINEAR_ROW] = "row"},
               .sp_modes = {[PG_LINEAR_PLAIN] = PG_SP_ROW_WISE, [PG_LINEAR_COLUMN] = PG_SP_GATHERS,
                            [PG_LINEAR_ROW] = PG_SP_SCATTERS}},
    .build = build_linear,
    .mode = linear_mode,
    .bf16_on = linear_bf16_on,
    .takes_bf16 = linear_takes_bf16,
    .makes_bf16 = linear_makes_bf16,
    .bf16_need = linear_bf16_need,
    .bf16_bytes = linear_bf16_bytes,
    .bf16_gathered = linear_bf16_gathered,
};
