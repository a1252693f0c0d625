#include "pg_module.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "pg_backend.h"
#include "pg_comm.h"
#include "pg_error.h"
#include "pg_rng.h"
#include "pg_size.h"

/* ---------------------------------------------------------------- helpers */

static int tp_size(const pg_context *ctx) { return ctx ? ctx->tensor : 1; }

/* The module's backend: every buffer, copy and kernel goes through it. */
#define BE(m) ((m)->be)
#define KERNEL(m, op, ...) ((m)->be->ops->op((m)->be, __VA_ARGS__))
static int tp_rank(const pg_context *ctx) { return ctx ? ctx->tp_rank : 0; }

static char *join_name(const char *prefix, const char *suffix) {
  size_t a = prefix ? strlen(prefix) : 0, b = strlen(suffix);
  char *s = malloc(a + b + 2);
  if (!s) return NULL;
  if (a) {
    memcpy(s, prefix, a);
    s[a] = '.';
    memcpy(s + a + 1, suffix, b + 1);
  } else {
    memcpy(s, suffix, b + 1);
  }
  return s;
}

static pg_module *module_new(const pg_module_ops *ops, pg_context *ctx, const char *name, int in_w, int out_w,
                             size_t state_size) {
  pg_module *m = calloc(1, sizeof *m);
  if (!m) return pg_fail_null("out of memory");
  m->ops = ops;
  m->ctx = ctx;
  m->be = pg_backend_cpu();
  m->name = strdup(name ? name : "");
  m->in_width = in_w;
  m->out_width = out_w;
  if (state_size) m->state = calloc(1, state_size);
  if (!m->name || (state_size && !m->state)) {
    free(m->name);
    free(m->state);
    free(m);
    return pg_fail_null("out of memory");
  }
  return m;
}

/* sizes: the blocks' lengths along split_dim (NULL: `blocks` equal blocks). */
static pg_param *param_make_blocks(const char *module_name, const char *suffix, int ndim, const int64_t *full_shape,
                                   int split_dim, int blocks, const int64_t *sizes, int parts, int index,
                                   pg_init_kind init, float std) {
  /* Widths reach here as ints, a product of two or more can outgrow every
   * buffer (and the engine adds them up): too many elements is an error. */
  if (pg_size_product(ndim, full_shape) < 0)
    return pg_fail_null("parameter '%s%s%s': its sizes multiply to more than 2^59 elements",
                        module_name ? module_name : "", module_name && *module_name ? "." : "", suffix);
  pg_param *p = calloc(1, sizeof *p);
  if (!p) return pg_fail_null("out of memory");
  p->name = join_name(module_name, suffix);
  if (!p->name) {
    free(p);
    return pg_fail_null("out of memory");
  }
  p->ndim = ndim;
  for (int i = 0; i < ndim; i++) {
    p->full_shape[i] = full_shape[i];
    p->shape[i] = full_shape[i];
  }
  if (parts > 1) p->shape[split_dim] = full_shape[split_dim] / parts;
  p->numel = pg_size_product(ndim, p->shape); /* no more than the full shape's */
  p->split_dim = parts > 1 ? split_dim : -1;
  p->split_blocks = blocks > 0 ? blocks : 1;
  for (int b = 0; b < p->split_blocks; b++)
    p->split_sizes[b] = sizes ? sizes[b] : full_shape[split_dim] / p->split_blocks;
  p->split_parts = parts;
  p->split_index = index;
  p->valid_rows = -1;
  p->init = init;
  p->init_std = std;
  p->weight_decay = ndim >= 2;
  p->replicated = parts == 1;
  return p;
}

static pg_param *param_make(const char *module_name, const char *suffix, int ndim, const int64_t *full_shape,
                            int split_dim, int blocks, int parts, int index, pg_init_kind init, float std) {
  return param_make_blocks(module_name, suffix, ndim, full_shape, split_dim, blocks, NULL, parts, index, init, std);
}

int pg_init_from_name(const char *name, pg_init_kind *out) {
  static const char *const names[] = {[PG_INIT_ZEROS] = "zeros", [PG_INIT_ONES] = "ones", [PG_INIT_NORMAL] = "normal"};
  for (int i = 0; i < 3; i++)
    if (name && !strcmp(name, names[i])) {
      *out = (pg_init_kind)i;
      return PG_OK;
    }
  return pg_fail("init must be 'normal', 'zeros' or 'ones', got '%s'", name ? name : "(none)");
}

pg_param *pg_param_new(const char *name, int ndim, const int64_t *shape, pg_init_kind init, float std) {
  if (ndim < 1 || ndim > PG_PARAM_MAX_DIMS) return pg_fail_null("parameter '%s': 1 to %d dimensions, not %d", name, PG_PARAM_MAX_DIMS, ndim);
  for (int i = 0; i < ndim; i++)
    if (shape[i] < 1) return pg_fail_null("parameter '%s': dimension %d has size %lld", name, i + 1, (long long)shape[i]);
  return param_make(NULL, name, ndim, shape, 0, 1, 1, 0, init, std); /* NULL: pg_error() says why */
}

pg_param *pg_param_new_split(pg_context *ctx, const char *name, int ndim, const int64_t *full_shape, int split_dim,
                             int blocks, const int64_t *sizes, pg_init_kind init, float std) {
  int T = tp_size(ctx);
  if (ndim < 1 || ndim > PG_PARAM_MAX_DIMS) return pg_fail_null("parameter '%s': 1 to %d dimensions, not %d", name, PG_PARAM_MAX_DIMS, ndim);
  if (split_dim < 0 || split_dim >= ndim)
    return pg_fail_null("parameter '%s': split dimension %d of %d", name, split_dim + 1, ndim);
  if (blocks < 1 || blocks > PG_PARAM_MAX_BLOCKS)
    return pg_fail_null("parameter '%s': 1 to %d blocks, not %d", name, PG_PARAM_MAX_BLOCKS, blocks);
  int64_t total = 0;
  for (int d = 0; d < ndim; d++)
    if (full_shape[d] < 1) return pg_fail_null("parameter '%s': dimension %d has size %lld", name, d + 1, (long long)full_shape[d]);
  for (int b = 0; b < blocks; b++) {
    int64_t n = sizes ? sizes[b] : full_shape[split_dim] / blocks;
    if (n < 1 || n % T)
      return pg_fail_null("parameter '%s': block %d of dimension %d has %lld rows, not divisible by tensor=%d", name, b + 1,
                          split_dim + 1, (long long)n, T);
    if (pg_add_overflows(total, n, &total))
      return pg_fail_null("parameter '%s': its blocks add up to more than 2^63", name);
  }
  if (total != full_shape[split_dim])
    return pg_fail_null("parameter '%s': its blocks add up to %lld, not the %lld of dimension %d", name, (long long)total,
                        (long long)full_shape[split_dim], split_dim + 1);
  pg_param *p = param_make_blocks(NULL, name, ndim, full_shape, split_dim, blocks, sizes, T, tp_rank(ctx), init, std);
  if (!p) return NULL;
  p->replicated = T == 1;
  return p;
}

void pg_param_free(pg_param *p) {
  if (!p) return;
  free(p->name);
  free(p);
}

static int add_param(pg_module *m, pg_param *p) {
  if (!p) return PG_ERR; /* its maker said why */
  pg_param **np = realloc(m->params, (size_t)(m->nparams + 1) * sizeof *np);
  if (!np) {
    pg_param_free(p);
    return pg_fail("out of memory");
  }
  m->params = np;
  m->params[m->nparams++] = p;
  return PG_OK;
}

int64_t pg_param_full_index(const pg_param *p, int64_t local) {
  return pg_param_full_index_of(p, local, p->split_index);
}

int64_t pg_param_full_index_of(const pg_param *p, int64_t local, int index) {
  int64_t coord[PG_PARAM_MAX_DIMS];
  for (int d = p->ndim - 1; d >= 0; d--) {
    coord[d] = local % p->shape[d];
    local /= p->shape[d];
  }
  if (p->split_dim >= 0) { /* the shard is piece `index` of each block, one after the other */
    int d = p->split_dim;
    int64_t local_start = 0, full_start = 0;
    for (int b = 0; b < p->split_blocks; b++) {
      int64_t piece = p->split_sizes[b] / p->split_parts;
      if (coord[d] < local_start + piece || b == p->split_blocks - 1) {
        coord[d] = full_start + index * piece + (coord[d] - local_start);
        break;
      }
      local_start += piece;
      full_start += p->split_sizes[b];
    }
  }
  int64_t full = 0;
  for (int d = 0; d < p->ndim; d++) full = full * p->full_shape[d] + coord[d];
  return full;
}

void pg_param_init(pg_param *p, uint64_t seed) {
  float *x = p->data;
  if (p->init == PG_INIT_ZEROS) {
    memset(x, 0, (size_t)p->numel * sizeof *x);
    return;
  }
  if (p->init == PG_INIT_ONES) {
    for (int64_t i = 0; i < p->numel; i++) x[i] = 1.0f;
    return;
  }
  uint64_t key = pg_rng_key(seed, p->name);
  int64_t row_elems = p->numel / p->shape[0], full_row_elems = 1;
  for (int d = 1; d < p->ndim; d++) full_row_elems *= p->full_shape[d];
  (void)row_elems;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < p->numel; i++) {
    int64_t f = pg_param_full_index(p, i);
    if (p->valid_rows >= 0 && f / full_row_elems >= p->valid_rows) x[i] = 0.0f;
    else x[i] = p->init_std * pg_normal_at(key, (uint64_t)f);
  }
}

void pg_param_load_full(pg_param *p, const float *full, int64_t full_rows) {
  int64_t row = 1;
  for (int d = 1; d < p->ndim; d++) row *= p->full_shape[d];
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < p->numel; i++) {
    int64_t f = pg_param_full_index(p, i);
    p->data[i] = f / row < full_rows ? full[f] : 0.0f;
  }
}

void pg_param_shard_copy(const pg_param *p, float *full, int64_t full_numel, float *piece, int64_t lo, int64_t n,
                         int to_full) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) {
    int64_t f = pg_param_full_index(p, lo + i);
    if (to_full) {
      if (f < full_numel) full[f] = piece[i];
    } else {
      piece[i] = f < full_numel ? full[f] : 0.0f;
    }
  }
}

/* Output per slot and one input-gradient buffer, plus the saved-input table. */
typedef struct io_buffers {
  const float **inputs; /* [nslots] the x each forward saw */
} io_buffers;

/* ---------------------------------------------------------------- sequence parallelism, rows */

static int sp_active(const pg_module *m) { return m->sp && tp_size(m->ctx) > 1; }

/* The rows a row-wise module works on: this rank's share of the micro-batch
 * with sequence parallelism (pg_sp_rows), else all of them. */
static int mod_rows(const pg_module *m, const pg_io *io) {
  int64_t N = (int64_t)io->B * io->T;
  return (int)(sp_active(m) ? pg_sp_rows(N, tp_size(m->ctx), tp_rank(m->ctx)) : N);
}

/* The most rows of that kind in a micro-batch of max_rows. */
static int mod_rows_max(const pg_module *m, int max_rows) {
  return (int)(sp_active(m) ? pg_sp_rows_max(max_rows, tp_size(m->ctx)) : max_rows);
}

/* This rank's first row of a micro-batch's N (0 without sequence parallelism). */
static int64_t sp_row0(const pg_module *m, int64_t N) {
  return sp_active(m) ? pg_sp_row0(N, tp_size(m->ctx), tp_rank(m->ctx)) : 0;
}

/* Bytes of an activation element: bf16 or float32 (pg_module.in_bf16 / out_bf16). */
static size_t act_bytes(int bf16) { return bf16 ? sizeof(uint16_t) : sizeof(float); }

static pg_dtype act_dtype(int bf16) { return bf16 ? PG_BFLOAT16 : PG_FLOAT32; }

/* The bf16 elements behind an activation pointer of a bf16 edge (pg_module.in_bf16 / out_bf16). */
static uint16_t *bits(float *p) { return (uint16_t *)(void *)p; }
static const uint16_t *cbits(const float *p) { return (const uint16_t *)(const void *)p; }

/* Output per slot (out_rows each) and one input-gradient buffer (in_rows). */
static int alloc_leaf_rows(pg_module *m, int nslots, int max_rows, int out_rows, int in_rows) {
  pg_be_release(BE(m), m->out);
  pg_be_release(BE(m), m->dinp);
  m->out = NULL;
  m->dinp = NULL;
  m->nslots = nslots;
  m->max_rows = max_rows;
  m->slot_rows = out_rows;
  size_t out_n = (size_t)nslots * out_rows * m->out_width, din_n = (size_t)in_rows * m->in_width;
  /* bf16 elements: half as many floats' room, rounded up */
  size_t out_f = m->out_bf16 ? (out_n + 1) / 2 : out_n, din_f = m->in_bf16 ? (din_n + 1) / 2 : din_n;
  if (out_n && !(m->out = pg_be_floats(BE(m), out_f)))
    return pg_fail("%s outputs (%zu elements on %s): %s", m->name, out_n, BE(m)->name, pg_error());
  if (din_n && !(m->dinp = pg_be_floats(BE(m), din_f)))
    return pg_fail("%s gradients (%zu elements on %s): %s", m->name, din_n, BE(m)->name, pg_error());
  m->saved_bytes_per_slot = (size_t)out_rows * m->out_width * act_bytes(m->out_bf16);
  return PG_OK;
}

/* A row-wise module: its input and output rows are the same (this rank's with sequence parallelism). */
static int alloc_leaf(pg_module *m, int nslots, int max_rows) {
  int rows = mod_rows_max(m, max_rows);
  return alloc_leaf_rows(m, nslots, max_rows, rows, rows);
}

static float *slot_out(pg_module *m, int slot) {
  return (float *)(void *)((char *)m->out + (size_t)slot * m->slot_rows * m->out_width * act_bytes(m->out_bf16));
}

static int check_rows(pg_module *m, int slot, const pg_io *io) {
  if (slot < 0 || slot >= m->nslots) return pg_fail("%s: slot %d out of range (%d slots)", m->name, slot, m->nslots);
  if ((int64_t)io->B * io->T > m->max_rows)
    return pg_fail("%s: %d x %d rows exceed the %d allocated", m->name, io->B, io->T, m->max_rows);
  return PG_OK;
}

/* A saved pointer per slot: kept in a small array reallocated at alloc. */
static int alloc_ptrs(const float ***arr, int nslots) {
  free(*arr);
  *arr = calloc((size_t)nslots, sizeof **arr);
  return *arr ? PG_OK : pg_fail("out of memory");
}

/* A working buffer of n floats on the module's backend (replacing *arr). */
static float *alloc_floats(pg_module *m, float **arr, size_t n) {
  pg_be_release(BE(m), *arr);
  *arr = n ? pg_be_floats(BE(m), n) : NULL;
  return *arr;
}

/* ---------------------------------------------------------------- recomputation's shared memory */

/* A backend of its own (a copy of the home backend whose alloc carves from
 * the region and whose release does nothing) is what the modules inside a
 * recomputed block see, so their alloc code is the same with or without
 * recomputation. Kernels, copies and the device's stream are the home
 * backend's. */
struct pg_recompute_arena {
  pg_backend be;        /* first: the alloc/release callbacks get back to the arena from it */
  pg_backend_ops ops;
  const pg_backend *home;
  char *region;         /* on the home backend */
  size_t cap, used;     /* bytes */
  size_t requested;     /* since the last begin: what the region must hold */
  void **spare;         /* outgrown regions and the overflow of a measuring pass: released at reset / free */
  int nspare, spare_cap;
  const pg_module *owner; /* selective: whose probabilities the region holds, and of which slot */
  int owner_slot;
};

#define ARENA_ALIGN 64

static int arena_keep(pg_recompute_arena *a, void *p) {
  if (a->nspare == a->spare_cap) {
    int cap = a->spare_cap ? 2 * a->spare_cap : 8;
    void **n = realloc(a->spare, (size_t)cap * sizeof *n);
    if (!n) return pg_fail("out of memory");
    a->spare = n;
    a->spare_cap = cap;
  }
  a->spare[a->nspare++] = p;
  return PG_OK;
}

/* Zeroed bytes from the region; past its end (a pass that measures a block
 * larger than the region), from the home backend, kept on the spare list. */
static void *arena_alloc(const pg_backend *b, size_t bytes) {
  pg_recompute_arena *a = (pg_recompute_arena *)b;
  size_t need = (bytes + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN;
  if (need < bytes || a->requested > SIZE_MAX - need) return pg_fail_null("recomputation buffers overflow size_t");
  a->requested += need;
  if (a->used + need <= a->cap) {
    void *p = a->region + a->used;
    a->used += need;
    return a->home->ops->zero(a->home, p, bytes) ? NULL : p;
  }
  void *p = a->home->ops->alloc(a->home, bytes);
  if (p && arena_keep(a, p)) {
    a->home->ops->release(a->home, p);
    return NULL;
  }
  return p;
}

static void arena_release(const pg_backend *b, void *p) {
  (void)b;
  (void)p; /* the region outlives the modules; the spare list is released by reset and free */
}

pg_recompute_arena *pg_recompute_arena_new(const pg_backend *home) {
  pg_recompute_arena *a = calloc(1, sizeof *a);
  if (!a) return pg_fail_null("out of memory");
  a->home = home;
  a->ops = *home->ops;
  a->ops.alloc = arena_alloc;
  a->ops.release = arena_release;
  a->be = *home;
  a->be.ops = &a->ops;
  return a;
}

static void arena_drop_spare(pg_recompute_arena *a) {
  for (int i = 0; i < a->nspare; i++) a->home->ops->release(a->home, a->spare[i]);
  a->nspare = 0;
}

void pg_recompute_arena_free(pg_recompute_arena *a) {
  if (!a) return;
  arena_drop_spare(a);
  free(a->spare);
  if (a->region) a->home->ops->release(a->home, a->region);
  free(a);
}

void pg_recompute_arena_reset(pg_recompute_arena *a) {
  if (!a) return;
  arena_drop_spare(a);
  a->owner = NULL;
}

static void arena_begin(pg_recompute_arena *a) {
  a->used = a->requested = 0;
  a->owner = NULL;
}

/* After a pass that asked for more than the region holds: a region of that
 * size (the old one stays, on the spare list, for the blocks placed in it). */
static int arena_grow(pg_recompute_arena *a) {
  if (a->requested <= a->cap) return PG_OK;
  char *r = a->home->ops->alloc(a->home, a->requested);
  if (!r) return pg_fail("recomputation buffers (%zu bytes on %s): %s", a->requested, a->home->name, pg_error());
  if (a->region && arena_keep(a, a->region)) {
    a->home->ops->release(a->home, r);
    return PG_ERR;
  }
  a->region = r;
  a->cap = a->requested;
  return PG_OK;
}

/* Allocates `inner` (one micro-batch) in the arena: a pass that measures,
 * and when the block outgrew the region, a larger region and the pass again. */
static int arena_alloc_block(pg_recompute_arena *a, pg_module *inner, int max_rows) {
  arena_begin(a);
  if (pg_module_alloc(inner, 1, max_rows)) return PG_ERR;
  if (a->requested <= a->cap) return PG_OK;
  if (arena_grow(a)) return PG_ERR;
  arena_begin(a);
  return pg_module_alloc(inner, 1, max_rows);
}

/* Selective recomputation: the region as one buffer of `bytes` (the largest
 * asked for), claimed by whoever computes into it. */
static float *arena_buffer(pg_recompute_arena *a, size_t bytes) {
  arena_begin(a);
  a->requested = bytes;
  if (arena_grow(a)) return NULL;
  return (float *)a->region;
}

/* Where a module's lasting buffers go (tables filled once at alloc): never
 * the arena, whose region the next block's buffers reuse. */
static const pg_backend *home_backend(const pg_backend *b) {
  return b->ops->alloc == arena_alloc ? ((const pg_recompute_arena *)b)->home : b;
}

/* ---------------------------------------------------------------- tensor-parallel pieces */

int pg_tp_reduce_forward(pg_module *m, void *y, int64_t n, pg_dtype dtype) {
  return pg_all_reduce_buf(m->ctx, PG_MODE_TENSOR, y, n, dtype, PG_REDUCE_SUM);
}

int pg_tp_copy_backward(pg_module *m, float *dx, int64_t n) {
  return pg_all_reduce_buf(m->ctx, PG_MODE_TENSOR, dx, n, PG_FLOAT32, PG_REDUCE_SUM);
}

/* Bug fix (kept from the Linear this came from): the gather used to ignore
 * the blocks, so a column-parallel Linear with blocks = 3 and gather_output
 * returned q0|k0|v0|q1|k1|v1 instead of q|k|v (and took the wrong columns of
 * dy in backward). */
int pg_tp_gather_forward(pg_module *m, float *full, const float *mine, float *scratch, int N, int w, int blocks,
                         const int *bw) {
  int T = tp_size(m->ctx), r = tp_rank(m->ctx);
  size_t piece = (size_t)N * w, f = sizeof(float);
  if (scratch + (size_t)r * piece != mine &&
      BE(m)->ops->copy(BE(m), scratch + (size_t)r * piece, mine, piece * f, PG_COPY_DEVICE_TO_DEVICE))
    return PG_ERR;
  if (pg_all_gather_buf(m->ctx, PG_MODE_TENSOR, scratch, (int64_t)piece, PG_FLOAT32)) return PG_ERR;
  for (int k = 0; k < T; k++)
    for (int b = 0, local = 0; b < blocks; local += bw[b], b++)
      if (BE(m)->ops->copy2d(BE(m), full + (size_t)T * local + (size_t)k * bw[b], (size_t)T * w * f,
                             scratch + (size_t)k * piece + local, (size_t)w * f, (size_t)bw[b] * f, (size_t)N,
                             PG_COPY_DEVICE_TO_DEVICE))
        return PG_ERR;
  return PG_OK;
}

int pg_tp_scatter_forward(pg_module *m, float *mine, const float *full, int N, int w, int blocks, const int *bw) {
  int T = tp_size(m->ctx), r = tp_rank(m->ctx);
  size_t f = sizeof(float);
  for (int b = 0, local = 0; b < blocks; local += bw[b], b++)
    if (BE(m)->ops->copy2d(BE(m), mine + local, (size_t)w * f, full + (size_t)T * local + (size_t)r * bw[b],
                           (size_t)T * w * f, (size_t)bw[b] * f, (size_t)N, PG_COPY_DEVICE_TO_DEVICE))
      return PG_ERR;
  return PG_OK;
}

/* ---------------------------------------------------------------- bf16 products */

/* Precision "bf16" (pg_module_set_precision) for the modules whose products
 * are GEMMs with a weight (linear, lm_head): each product runs as a bf16
 * GEMM with float32 sums (the backend's matmul_bf16_*: oneDNN or
 * widen-and-sgemm on the CPU, cublasGemmEx on CUDA), as torch.autocast runs a
 * Linear. The weight's bf16 working copy lives in the backend's memory (device
 * memory on CUDA, so a step makes no host round trip) and is made from the
 * float32 master at the first forward of each call (micro-batch 0, not a
 * recomputation): the optimizer, a checkpoint load or a write from Lua
 * change the master between calls, never within one, so every micro-batch
 * of a call uses the current weights and one conversion per weight and step
 * serves all of them. The module's input and output gradient stay float32
 * between modules; they are rounded into the caller's scratch
 * (pg_io.bf16_scratch, the engine's, in the same backend's memory) for each
 * GEMM. */
typedef struct bf16_mm {
  int on;
  uint16_t *w;    /* the working weight: numel bf16, in the backend's memory */
  size_t bytes;
  int64_t need[2]; /* scratch elements: [0] the input or output gradient, [1] the input */
  long refreshes;  /* working copies made so far */
} bf16_mm;

/* The working weight lasts from one call to the next: the home backend's
 * memory, never a recomputed block's shared arena. */
static void mm_free(pg_module *m, bf16_mm *mm) {
  pg_be_release(home_backend(BE(m)), mm->w);
  mm->w = NULL;
  mm->bytes = 0;
}

static int mm_alloc(pg_module *m, bf16_mm *mm, int64_t wnumel, int rows, int64_t in, int64_t out) {
  mm_free(m, mm);
  if (!mm->on) return PG_OK;
  int64_t a[2] = {rows, in > out ? in : out}, b[2] = {rows, in};
  mm->need[0] = pg_size_product(2, a);
  mm->need[1] = pg_size_product(2, b);
  if (mm->need[0] < 0 || mm->need[1] < 0 || wnumel < 0 || (uint64_t)wnumel > SIZE_MAX / 2)
    return pg_fail("%s: bf16 operands of %d rows x %lld columns are too large", m->name, rows,
                   (long long)(in > out ? in : out));
  size_t wn = (size_t)(wnumel > 0 ? wnumel : 1);
  if (!(mm->w = home_backend(BE(m))->ops->alloc(home_backend(BE(m)), wn * 2)))
    return pg_fail("%s: no room for its bf16 working weight: %s", m->name, pg_error());
  mm->bytes = wn * 2;
  return PG_OK;
}

static int mm_scratch(pg_module *m, const pg_io *io) {
  if (!io->bf16_scratch[0] || !io->bf16_scratch[1])
    return pg_fail("%s: precision bf16 needs the engine's operand scratch (pg_io.bf16_scratch)", m->name);
  for (int k = 0; k < PG_WIDE_SCRATCH && (m->in_bf16 || m->out_bf16); k++)
    if (!io->wide_scratch[k])
      return pg_fail("%s: bf16 activations need the engine's float32 scratch (pg_io.wide_scratch)", m->name);
  return PG_OK;
}

/* The backend said what failed (a GEMM, a launch); the module adds its name. */
static int mm_fail(pg_module *m) { return pg_fail("%s: %s", m->name, pg_error()); }

/* An operand of a bf16 product: p's elements when they are bf16 already (an activation of a bf16 edge), else p
 * rounded into the engine's operand scratch k. NULL: the kernel failed. */
static const uint16_t *operand16(pg_module *m, const pg_io *io, int k, const float *p, int is_bf16, int64_t n) {
  if (is_bf16) return cbits(p);
  return KERNEL(m, bf16_from_f32, io->bf16_scratch[k], p, n) ? NULL : io->bf16_scratch[k];
}

/* The bf16 products on a working weight w16 (any module's: linear's, lm_head's, an expert's), the float32
 * operands rounded into the engine's scratch. out[N,OC] = x[N,C] @ w^T (+ bias), summed in float32 and, where the
 * module's output is bf16 (out_bf16), rounded once into out (through the float32 wide_scratch[0]). */
static int bf16_product_forward(pg_module *m, const pg_io *io, float *out, const float *x, const uint16_t *w16,
                                const float *bias, int N, int C, int OC) {
  if (mm_scratch(m, io)) return PG_ERR;
  const uint16_t *x16 = operand16(m, io, 0, x, m->in_bf16, (int64_t)N * C);
  float *sums = m->out_bf16 ? io->wide_scratch[0] : out;
  if (!x16 || KERNEL(m, matmul_bf16_forward, sums, x16, w16, bias, N, C, OC) ||
      (m->out_bf16 && KERNEL(m, bf16_from_f32, bits(out), sums, (int64_t)N * OC)))
    return mm_fail(m);
  return PG_OK;
}

/* dinp = dy @ w in float32 (NULL: skip; a module whose input is bf16 rounds it after its collectives),
 * dw += dy^T @ x, dbias += column sums of dy's float32 values (NULL: skip). */
static int bf16_product_backward(pg_module *m, const pg_io *io, float *dinp, float *dw, float *dbias, const float *dy,
                                 const float *x, const uint16_t *w16, int N, int C, int OC) {
  if (mm_scratch(m, io)) return PG_ERR;
  const uint16_t *dy16 = operand16(m, io, 0, dy, m->out_bf16, (int64_t)N * OC);
  const uint16_t *x16 = dy16 ? operand16(m, io, 1, x, m->in_bf16, (int64_t)N * C) : NULL;
  const float *dy32 = dy;
  if (x16 && dbias && m->out_bf16) { /* the bias sums the gradient's values, widened */
    if (KERNEL(m, bf16_to_f32, io->wide_scratch[0], dy16, (int64_t)N * OC)) return mm_fail(m);
    dy32 = io->wide_scratch[0];
  }
  if (!x16 || KERNEL(m, matmul_bf16_backward, dinp, dw, dbias, dy32, dy16, x16, w16, N, C, OC)) return mm_fail(m);
  return PG_OK;
}

/* out[N,OC] = x[N,C] @ w^T (+ bias), x rounded to bf16; refresh: remake the working weight first. */
static int mm_forward(pg_module *m, bf16_mm *mm, const pg_io *io, int refresh, const pg_param *w, float *out,
                      const float *x, const float *bias, int N, int C, int OC) {
  if (refresh) {
    if (KERNEL(m, bf16_from_f32, mm->w, w->data, w->numel)) return mm_fail(m);
    mm->refreshes++;
  }
  return bf16_product_forward(m, io, out, x, mm->w, bias, N, C, OC);
}

/* A linear-kind product: the backend's float32 kernel, or the bf16 one. */
static int mm_fwd(pg_module *m, bf16_mm *mm, const pg_io *io, const pg_param *w, float *out, const float *x,
                  const float *bias, int N, int C, int OC) {
  int refresh = io->mb == 0 && !io->recomputing;
  if (N == 0) { /* a sequence-parallel rank without rows: the working weight is still remade for the others */
    if (mm->on && refresh) {
      if (KERNEL(m, bf16_from_f32, mm->w, w->data, w->numel)) return mm_fail(m);
      mm->refreshes++;
    }
    return PG_OK;
  }
  if (mm->on) return mm_forward(m, mm, io, refresh, w, out, x, bias, N, C, OC);
  return KERNEL(m, matmul_forward, out, x, w->data, bias, N, C, OC);
}

/* dinp = dy @ w (NULL: skip), w->grad += dy^T @ x, dbias += column sums of the float32 dy (NULL: skip). */
static int mm_bwd(pg_module *m, bf16_mm *mm, const pg_io *io, float *dinp, const pg_param *w, float *dbias,
                  const float *dy, const float *x, int N, int C, int OC) {
  if (!mm->on) return KERNEL(m, matmul_backward, dinp, w->grad, dbias, dy, x, w->data, N, C, OC);
  return bf16_product_backward(m, io, dinp, w->grad, dbias, dy, x, mm->w, N, C, OC);
}

int pg_sp_gather_rows(pg_module *m, void *full, const void *mine, int64_t N, int w, pg_dtype dtype) {
  int T = tp_size(m->ctx), r = tp_rank(m->ctx);
  size_t es = pg_dtype_size(dtype);
  char *at = (char *)full + (size_t)pg_sp_row0(N, T, r) * w * es;
  size_t bytes = (size_t)pg_sp_rows(N, T, r) * w * es;
  if ((const void *)at != mine && bytes && BE(m)->ops->copy(BE(m), at, mine, bytes, PG_COPY_DEVICE_TO_DEVICE))
    return PG_ERR;
  return T > 1 ? pg_all_gather_rows(m->ctx, PG_MODE_TENSOR, full, N, w, dtype) : PG_OK;
}

int pg_sp_reduce_scatter_rows(pg_module *m, void *full, void *mine, int64_t N, int w, pg_dtype dtype) {
  int T = tp_size(m->ctx), r = tp_rank(m->ctx);
  size_t es = pg_dtype_size(dtype);
  if (T > 1 && pg_reduce_scatter_rows(m->ctx, PG_MODE_TENSOR, full, N, w, dtype, PG_REDUCE_SUM)) return PG_ERR;
  size_t bytes = (size_t)pg_sp_rows(N, T, r) * w * es;
  if (!mine || !bytes) return PG_OK;
  return BE(m)->ops->copy(BE(m), mine, (char *)full + (size_t)pg_sp_row0(N, T, r) * w * es, bytes,
                          PG_COPY_DEVICE_TO_DEVICE);
}

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

static const pg_module_ops linear_ops = {"linear", linear_alloc, linear_forward, linear_backward, linear_destroy};

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
  pg_module *m = module_new(&linear_ops, ctx, name, in_w, out_w, sizeof(linear_state));
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

static const pg_module_ops layernorm_ops = {"layernorm", layernorm_alloc, layernorm_forward, layernorm_backward,
                                            layernorm_destroy};

pg_module *pg_layernorm_new(pg_context *ctx, const char *name, int width) {
  if (width < 1) return pg_fail_null("%s: LayerNorm width must be positive, not %d", name, width);
  pg_module *m = module_new(&layernorm_ops, ctx, name, width, width, sizeof(layernorm_state));
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

static const pg_module_ops gelu_ops = {"gelu", gelu_alloc, gelu_forward, gelu_backward, gelu_destroy};

pg_module *pg_gelu_new(pg_context *ctx, const char *name, int width) {
  if (width < 1) return pg_fail_null("%s: GELU width must be positive, not %d", name, width);
  return module_new(&gelu_ops, ctx, name, width, width, sizeof(gelu_state));
}

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
} attention_state;

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
    pg_rope_table(host, host + table, s->max_seq, s->o.head_dim, s->o.rope_theta);
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

static int attention_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  attention_state *s = m->state;
  if (check_rows(m, slot, io)) return PG_ERR;
  if (io->T > s->max_seq) return pg_fail("%s: sequence length %d exceeds the model's %d", m->name, io->T, s->max_seq);
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
        KERNEL(m, rope_forward, rot, s->cos_t, s->sin_t, N, io->T, s->heads_l, hd, m->in_width) ||
        KERNEL(m, rope_forward, rot + (size_t)s->heads_l * hd, s->cos_t, s->sin_t, N, io->T, s->kv_l, hd, m->in_width))
      return PG_ERR;
    x = xf = rot;
  } else if (m->in_bf16) {
    if (KERNEL(m, bf16_to_f32, io->wide_scratch[0], cbits(x), n_in)) return PG_ERR;
    xf = io->wide_scratch[0];
  }
  float *out = m->in_bf16 ? io->wide_scratch[1] : slot_out(m, slot);
  if (KERNEL(m, attention_forward, out, att, xf, s->slopes, io->B, io->T, s->heads_l, s->kv_l, hd) ||
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
  if (KERNEL(m, attention_backward, dinp, s->scratch, dy, x, att, io->B, io->T, s->heads_l, s->kv_l, hd)) return PG_ERR;
  /* the gradient of the rotated q and k, rotated back */
  if (s->rotated &&
      (KERNEL(m, rope_backward, dinp, s->cos_t, s->sin_t, N, io->T, s->heads_l, hd, m->in_width) ||
       KERNEL(m, rope_backward, dinp + (size_t)s->heads_l * hd, s->cos_t, s->sin_t, N, io->T, s->kv_l, hd,
              m->in_width)))
    return PG_ERR;
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
  free(s->saved_x);
}

static const pg_module_ops attention_ops = {"attention", attention_alloc, attention_forward, attention_backward,
                                            attention_destroy};

pg_module *pg_attention_new(pg_context *ctx, const char *name, const pg_attention_opts *o) {
  int T = tp_size(ctx), H = o->heads, KV = o->kv_heads > 0 ? o->kv_heads : o->heads, hd = o->head_dim;
  if (H < 1 || hd < 1) return pg_fail_null("%s: attention needs positive heads and head_dim (%d, %d)", name, H, hd);
  if (H % KV) return pg_fail_null("%s: kv_heads=%d does not divide heads=%d", name, KV, H);
  if (H % T) return pg_fail_null("%s: tensor=%d does not divide heads=%d", name, T, H);
  /* Key/value heads are split over the tensor group, never replicated. */
  if (KV % T)
    return pg_fail_null("%s: tensor=%d does not divide kv_heads=%d (key/value heads are split over the tensor group, "
                        "not replicated)", name, T, KV);
  if (o->max_seq < 1) return pg_fail_null("%s: attention needs a positive maximum sequence length, not %d", name, o->max_seq);
  if (o->rope_theta > 0 && hd % 2) return pg_fail_null("%s: rotary embeddings need an even head_dim, not %d", name, hd);
  if (o->alibi && o->rope_theta > 0)
    return pg_fail_null("%s: ALiBi and rotary embeddings (rope_theta=%g) exclude each other: give one", name,
                        o->rope_theta);
  if ((int64_t)(H + 2 * KV) * hd > INT32_MAX / 2) return pg_fail_null("%s: attention width overflows", name);
  pg_module *m = module_new(&attention_ops, ctx, name, (H + 2 * KV) / T * hd, H / T * hd, sizeof(attention_state));
  if (!m) return NULL;
  attention_state *s = m->state;
  s->o = *o;
  s->o.kv_heads = KV;
  s->heads_l = H / T;
  s->kv_l = KV / T;
  s->max_seq = o->max_seq;
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

static const pg_module_ops rmsnorm_ops = {"rmsnorm", rmsnorm_alloc, rmsnorm_forward, rmsnorm_backward, rmsnorm_destroy};

pg_module *pg_rmsnorm_new(pg_context *ctx, const char *name, int width, float eps) {
  if (width < 1) return pg_fail_null("%s: RMSNorm width must be positive, not %d", name, width);
  if (!(eps >= 0)) return pg_fail_null("%s: RMSNorm eps must be >= 0, not %g", name, (double)eps);
  pg_module *m = module_new(&rmsnorm_ops, ctx, name, width, width, sizeof(rmsnorm_state));
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

static const pg_module_ops swiglu_ops = {"swiglu", swiglu_alloc, swiglu_forward, swiglu_backward, swiglu_destroy};

pg_module *pg_swiglu_new(pg_context *ctx, const char *name, int width) {
  if (width < 1) return pg_fail_null("%s: SwiGLU width must be positive, not %d", name, width);
  return module_new(&swiglu_ops, ctx, name, 2 * width, width, sizeof(swiglu_state));
}

/* ---------------------------------------------------------------- mixture of experts */

/* The token -> expert choices of a micro-batch are laid out grouped by
 * expert (tokens in order within an expert): choice j of token t sits at
 * grouped row pos[t K + j], so each expert's rows are contiguous and run as
 * one GEMM. A token's output then sums its K choices in j order, whatever
 * the grouping, so the result does not depend on how experts are grouped.
 *
 * Expert parallelism (the context's expert group of G > 1 members): member j
 * holds experts [j nl, (j + 1) nl) (nl = experts / G), so the grouped rows
 * are also grouped by member. Forward sends each member its rows (an
 * all-to-all), the member runs its experts over the rows of all G members
 * (expert-major: expert l's rows from member 0, then member 1, ...), and
 * sends the outputs back in the order they came; the home rank sums each
 * token's K outputs in j order as above. Backward sends the weighted output
 * gradients the same way and the input gradients back. A token's arithmetic
 * is the serial one: each row goes through the same GEMMs, and its sum over
 * its choices happens at home in the same order.
 *
 * Capacity (capacity_factor = c > 0): each expert takes at most
 * ceil(c x seq_len x top_k / experts) choices of each sequence (a row of the
 * batch), first choices before second ones, earlier tokens first (GShard's
 * priority); the choices beyond are dropped: they add 0 to the token's output
 * (the residual carries it) and get no gradient. Per sequence, so that every
 * layout (data, micro-batches, experts) drops the same choices. */
typedef struct moe_state {
  pg_moe_opts o;
  int hidden_l;          /* this rank's columns of each expert's hidden width */
  int G, ep, nl;         /* expert group size, our place in it, experts held here */
  int64_t X;             /* rows the expert side can receive in one micro-batch */
  pg_param *gate;
  pg_param **w1, **w2, **w3; /* [nl]: experts ep nl .. ep nl + nl - 1 */
  /* per slot, kept from forward to backward */
  const float **saved_x;
  float *probs, *lse, *weight; /* [nslots][rows * E], [rows], [rows * K] */
  int32_t *expert, *pos;       /* [nslots][rows * K]; pos -1: a dropped choice */
  int32_t *token;              /* [nslots][rows * K]: grouped row -> its token */
  int32_t *offsets;            /* [nslots][E + 1]: each expert's first grouped row */
  int64_t *cnt;                /* [nslots][G nl]: rows from member i for our expert l, at i nl + l */
  float *xr;                   /* G > 1: [nslots][X * dim] the received rows' inputs, expert-major */
  float *gu;                   /* [nslots][X * 2 hidden_l]: w1 x | w3 x of each row the experts ran */
  float *y;                    /* [nslots][rows * K * dim]: each grouped row's expert output (unweighted) */
  double *stats;               /* [nslots][2 E]: this layer's choices and summed probabilities */
  /* scratch, one micro-batch */
  float *logits, *wcat, *dwcat, *xg, *act, *dyg, *dxg, *da, *dgu, *dweight, *dx_router;
  float *bufa, *bufb;          /* G > 1: [X * dim] rows in transit */
  float *xj;                   /* jitter: [rows * dim] the router's input, x times the noise */
  float *dprob;                /* [E] */
  int64_t *eoff, *cur;         /* [nl + 1], [nl] */
  int64_t *sc, *rc;            /* [G] counts of an all-to-all */
  int64_t *orows;              /* [2 G]: rows to each member, rows from each member */
  int64_t *ecount;             /* [E] */
  int32_t *fill;               /* [E] choices of each expert in the current sequence */
  /* precision "bf16" (as linear's bf16_mm): the router's and the experts' products on bf16 operands with float32
   * sums, working weights remade at each call's first forward, the operands rounded into the engine's scratch */
  int bf16;
  uint16_t *gate16, *w13_16, *w2_16; /* [E D], [nl][2 hidden_l D] (w1 rows, then w3's), [nl][D hidden_l] */
  int64_t bf16_need;                 /* scratch elements of either operand: max(rows, X) max(2 hidden_l, D, E) */
  size_t bf16_bytes;
  long refreshes;
} moe_state;

static void moe_free_bf16(moe_state *s) {
  uint16_t *b[] = {s->gate16, s->w13_16, s->w2_16};
  for (size_t i = 0; i < sizeof b / sizeof b[0]; i++) free(b[i]);
  s->gate16 = s->w13_16 = s->w2_16 = NULL;
  s->bf16_bytes = 0;
  s->bf16_need = 0;
}

/* The working weights of precision bf16 (host memory: moe runs on the cpu backend), and the operand scratch it
 * needs of the engine (pg_module_bf16_scratch). */
static int moe_alloc_bf16(pg_module *m, int64_t rows) {
  moe_state *s = m->state;
  moe_free_bf16(s);
  int64_t E = s->o.experts, D = s->o.dim, H = s->hidden_l, nl = s->nl;
  int64_t wide = 2 * H > D ? 2 * H : D;
  if (E > wide) wide = E;
  int64_t n_gate = pg_size_product(2, (int64_t[]){E, D}), n_w = pg_size_product(3, (int64_t[]){nl, 2 * H, D}),
          n_op = pg_size_product(2, (int64_t[]){rows, wide});
  if (n_gate < 0 || n_w < 0 || n_op < 0 || (uint64_t)(n_gate + n_w + n_w / 2) > SIZE_MAX / 2)
    return pg_fail("%s: its bf16 working weights and operands are too large", m->name);
  s->gate16 = malloc((size_t)(n_gate > 0 ? n_gate : 1) * 2);
  s->w13_16 = malloc((size_t)(n_w > 0 ? n_w : 1) * 2);
  s->w2_16 = malloc((size_t)(n_w / 2 > 0 ? n_w / 2 : 1) * 2);
  if (!s->gate16 || !s->w13_16 || !s->w2_16) {
    moe_free_bf16(s);
    return pg_fail("out of memory for %s (bf16 working weights)", m->name);
  }
  s->bf16_bytes = (size_t)(n_gate + n_w + n_w / 2) * 2;
  s->bf16_need = n_op;
  return PG_OK;
}

/* The bf16 working weights from the float32 masters (each call's first forward; see bf16_mm). */
static void moe_refresh_bf16(moe_state *s) {
  size_t half = (size_t)s->hidden_l * s->o.dim;
  pg_bf16_from_f32(s->gate16, s->gate->data, s->gate->numel);
  for (int l = 0; l < s->nl; l++) {
    pg_bf16_from_f32(s->w13_16 + 2 * half * l, s->w1[l]->data, (int64_t)half);
    pg_bf16_from_f32(s->w13_16 + 2 * half * l + half, s->w3[l]->data, (int64_t)half);
    pg_bf16_from_f32(s->w2_16 + half * l, s->w2[l]->data, (int64_t)half);
  }
  s->refreshes++;
}

/* out[n,OC] = x[n,C] w^T: float32 on w32, or bf16 on w16. */
static int moe_mm_forward(pg_module *m, const pg_io *io, float *out, const float *x, const float *w32,
                          const uint16_t *w16, int n, int C, int OC) {
  if (((moe_state *)m->state)->bf16) return bf16_product_forward(m, io, out, x, w16, NULL, n, C, OC);
  pg_matmul_forward(out, x, w32, NULL, n, C, OC);
  return PG_OK;
}

/* dinp = dy w (overwritten), dw += dy^T x; float32 or bf16 as moe_mm_forward. */
static int moe_mm_backward(pg_module *m, const pg_io *io, float *dinp, float *dw, const float *dy, const float *x,
                           const float *w32, const uint16_t *w16, int n, int C, int OC) {
  if (((moe_state *)m->state)->bf16) return bf16_product_backward(m, io, dinp, dw, NULL, dy, x, w16, n, C, OC);
  pg_matmul_backward(dinp, dw, NULL, dy, x, w32, n, C, OC);
  return PG_OK;
}

static int moe_alloc(pg_module *m, int nslots, int max_rows) {
  moe_state *s = m->state;
  if (alloc_leaf(m, nslots, max_rows) || alloc_ptrs(&s->saved_x, nslots)) return PG_ERR;
  int64_t E = s->o.experts, K = s->o.top_k, D = s->o.dim, H = s->hidden_l, R = (int64_t)max_rows * K;
  /* top-k picks an expert at most once per token: a member receives at most
   * min(nl, K) rows per token of each member */
  int64_t X = s->G == 1 ? R : (int64_t)s->G * max_rows * (s->nl < K ? s->nl : K);
  int64_t dims[3] = {nslots, X, 2 * H + 2 * D};
  if (R > INT32_MAX || X > INT32_MAX || pg_size_product(3, dims) < 0 ||
      pg_size_product(2, (int64_t[]){nslots, (int64_t)max_rows * E}) < 0)
    return pg_fail("%s: %d slots of %d rows x top_k=%d are too many for the expert buffers", m->name, nslots, max_rows,
                   (int)K);
  s->X = X;
  size_t S = (size_t)nslots, rows = (size_t)max_rows, G = (size_t)s->G, nl = (size_t)s->nl;
  free(s->expert);
  free(s->pos);
  free(s->token);
  free(s->offsets);
  free(s->stats);
  free(s->cnt);
  s->expert = malloc(S * R * sizeof(int32_t));
  s->pos = malloc(S * R * sizeof(int32_t));
  s->token = malloc(S * R * sizeof(int32_t));
  s->offsets = malloc(S * (E + 1) * sizeof(int32_t));
  s->stats = calloc(S * 2 * E, sizeof(double));
  s->cnt = calloc(S * G * nl, sizeof(int64_t));
  if (!s->expert || !s->pos || !s->token || !s->offsets || !s->stats || !s->cnt ||
      !alloc_floats(m, &s->probs, S * rows * E) || !alloc_floats(m, &s->lse, S * rows) ||
      !alloc_floats(m, &s->weight, S * R) || !alloc_floats(m, &s->gu, S * X * 2 * H) ||
      !alloc_floats(m, &s->y, S * R * D) || !alloc_floats(m, &s->logits, rows * E) ||
      !alloc_floats(m, &s->wcat, (size_t)2 * H * D) || !alloc_floats(m, &s->dwcat, (size_t)2 * H * D) ||
      !alloc_floats(m, &s->xg, R * D) || !alloc_floats(m, &s->act, X * H) || !alloc_floats(m, &s->dyg, R * D) ||
      !alloc_floats(m, &s->dxg, R * D) || !alloc_floats(m, &s->da, X * H) || !alloc_floats(m, &s->dgu, X * 2 * H) ||
      !alloc_floats(m, &s->dweight, R) || !alloc_floats(m, &s->dx_router, rows * D) || !alloc_floats(m, &s->dprob, E) ||
      (s->o.jitter > 0 && !alloc_floats(m, &s->xj, rows * D)))
    return pg_fail("out of memory for %s (expert buffers)", m->name);
  if (s->G > 1 && (!alloc_floats(m, &s->xr, S * X * D) || !alloc_floats(m, &s->bufa, X * D) ||
                   !alloc_floats(m, &s->bufb, X * D)))
    return pg_fail("out of memory for %s (expert-parallel buffers)", m->name);
  if (s->bf16 && moe_alloc_bf16(m, (int64_t)max_rows > X ? (int64_t)max_rows : X))
    return PG_ERR;
  m->saved_bytes_per_slot += (rows * (E + 1) + R * (1 + D) + X * 2 * H + (s->G > 1 ? X * D : 0)) * sizeof(float) +
                             R * 3 * sizeof(int32_t);
  return PG_OK;
}

/* Expert l's [w1; w3] shards as one [2 hidden_l, dim] matrix, so that one
 * GEMM gives the gate|up rows the SwiGLU kernels take. */
static void moe_stack_w13(moe_state *s, int l) {
  size_t n = (size_t)s->hidden_l * s->o.dim;
  memcpy(s->wcat, s->w1[l]->data, n * sizeof(float));
  memcpy(s->wcat + n, s->w3[l]->data, n * sizeof(float));
}

/* The grouped rows' inputs, gathered from x. */
static void moe_gather(moe_state *s, const float *x, const int32_t *token, int R) {
  size_t D = (size_t)s->o.dim;
  for (int r = 0; r < R; r++) memcpy(s->xg + r * D, x + (size_t)token[r] * D, D * sizeof(float));
}

/* The load-balancing loss over the micro-batch's totals, and the gradient it
 * gives every row's router probabilities (dprob, scaled by `scale`):
 * aux = E sum_e C_e P_e / (N L)^2 with C_e the choices of e and P_e the summed
 * probabilities over the N rows of all L layers (transformers' form: the mean
 * over the concatenated layers' rows of the one-hot choices, summed over the
 * k choices, times the mean probability). */
static double moe_balance(const moe_state *s, const double *totals, int N, int L, float *dprob, double scale) {
  int E = s->o.experts;
  double nl = (double)N * L, aux = 0;
  for (int e = 0; e < E; e++) {
    aux += totals[e] * totals[E + e];
    if (dprob) dprob[e] = (float)(scale * E * totals[e] / (nl * nl));
  }
  return E * aux / (nl * nl);
}

/* Switch Transformer's jitter: the router's input times uniform noise in
 * [1 - j, 1 + j], in training only. The noise is a function of (seed, this
 * layer's name, the engine's step, the token's row in the global batch,
 * the feature), so every layout (and a recomputation) draws the same; the
 * experts see x itself. Returns the router's input: x, or s->xj. */
static uint64_t moe_jitter_key(const pg_module *m, const pg_io *io) {
  return pg_rng_subkey(pg_rng_key(m->ctx ? m->ctx->seed : 0, m->name), (uint64_t)io->step);
}

static float moe_noise(const moe_state *s, uint64_t key, const pg_io *io, int t, int d) {
  uint64_t at = (uint64_t)(io->global_row0 + t) * (uint64_t)s->o.dim + (uint64_t)d;
  return (float)(1 - s->o.jitter) + (float)(2 * s->o.jitter) * pg_uniform_at(key, at);
}

static const float *moe_jitter(pg_module *m, const pg_io *io, const float *x, int N) {
  moe_state *s = m->state;
  if (!(s->o.jitter > 0) || !io->want_grad) return x;
  uint64_t key = moe_jitter_key(m, io);
  int D = s->o.dim;
  for (int t = 0; t < N; t++)
    for (int d = 0; d < D; d++) s->xj[(size_t)t * D + d] = x[(size_t)t * D + d] * moe_noise(s, key, io, t, d);
  return s->xj;
}

/* The choices beyond an expert's capacity in each sequence of T tokens:
 * their pos becomes -1 (first choices before second ones, earlier tokens
 * first). */
static void moe_drop(moe_state *s, const int32_t *expert, int32_t *pos, int N, int T) {
  int E = s->o.experts, K = s->o.top_k;
  if (!(s->o.capacity_factor > 0)) return;
  double c = ceil(s->o.capacity_factor * T * K / E);
  int cap = c > INT32_MAX ? INT32_MAX : (int)c;
  for (int t0 = 0; t0 < N; t0 += T) {
    for (int e = 0; e < E; e++) s->fill[e] = 0;
    for (int j = 0; j < K; j++)
      for (int t = t0; t < t0 + T && t < N; t++) {
        int i = t * K + j;
        if (s->fill[expert[i]]++ >= cap) pos[i] = -1;
      }
  }
}

/* Rows between source-major order (member i's rows for our expert 0, 1, ...,
 * then member i + 1's) and expert-major order (our expert l's rows from
 * member 0, 1, ...); also sets eoff (expert-major starts). */
static void moe_permute(moe_state *s, const int64_t *cnt, const float *src, float *dst, size_t W, int to_expert) {
  int G = s->G, nl = s->nl;
  s->eoff[0] = 0;
  for (int l = 0; l < nl; l++) {
    int64_t n = 0;
    for (int i = 0; i < G; i++) n += cnt[i * nl + l];
    s->eoff[l + 1] = s->eoff[l] + n;
    s->cur[l] = s->eoff[l];
  }
  if (!src) return;
  int64_t so = 0;
  for (int i = 0; i < G; i++)
    for (int l = 0; l < nl; l++) {
      int64_t n = cnt[i * nl + l], eo = s->cur[l];
      s->cur[l] += n;
      const float *a = to_expert ? src + so * W : src + eo * W;
      float *b = to_expert ? dst + eo * W : dst + so * W;
      memcpy(b, a, (size_t)n * W * sizeof(float));
      so += n;
    }
}

/* The all-to-all of rows between the expert group's members: `out_rows[j]`
 * rows of width W to member j, `in_rows[i]` from member i. */
static int moe_exchange(pg_module *m, const float *send, const int64_t *out_rows, float *recv, const int64_t *in_rows,
                        size_t W) {
  moe_state *s = m->state;
  for (int j = 0; j < s->G; j++) {
    s->sc[j] = out_rows[j] * (int64_t)W;
    s->rc[j] = in_rows[j] * (int64_t)W;
  }
  return pg_all_to_all_v(m->ctx, PG_MODE_EXPERT, send, s->sc, recv, s->rc, PG_FLOAT32);
}

/* Rows per member: of the grouped rows (by expert offsets off), and of the received ones (cnt). */
static void moe_rows(const moe_state *s, const int32_t *off, const int64_t *cnt, int64_t *out_rows, int64_t *in_rows) {
  for (int j = 0; j < s->G; j++) {
    out_rows[j] = off[(j + 1) * s->nl] - off[j * s->nl];
    in_rows[j] = 0;
    for (int l = 0; l < s->nl; l++) in_rows[j] += cnt[j * s->nl + l];
  }
}

/* Our experts over rows grouped expert-major (eoff): gate|up and output. */
static int moe_experts_forward(pg_module *m, const pg_io *io, const float *x, float *gu, float *y) {
  moe_state *s = m->state;
  int D = s->o.dim, H = s->hidden_l;
  size_t half = (size_t)H * D;
  for (int l = 0; l < s->nl; l++) {
    int64_t r0 = s->eoff[l], n = s->eoff[l + 1] - r0;
    if (!n) continue;
    if (!s->bf16) moe_stack_w13(s, l);
    if (moe_mm_forward(m, io, gu + r0 * 2 * H, x + r0 * D, s->wcat, s->w13_16 + 2 * half * l, (int)n, D, 2 * H))
      return PG_ERR;
    pg_swiglu_forward(s->act + r0 * H, gu + r0 * 2 * H, (int)n, H);
    if (moe_mm_forward(m, io, y + r0 * D, s->act + r0 * H, s->w2[l]->data, s->w2_16 + half * l, (int)n, H, D))
      return PG_ERR;
  }
  return PG_OK;
}

/* Their backward: input gradients of the rows into dx, weight gradients added. */
static int moe_experts_backward(pg_module *m, const pg_io *io, const float *x, const float *gu, const float *dy,
                                float *dx) {
  moe_state *s = m->state;
  int D = s->o.dim, H = s->hidden_l;
  size_t half = (size_t)H * D;
  for (int l = 0; l < s->nl; l++) {
    int64_t r0 = s->eoff[l], n = s->eoff[l + 1] - r0;
    if (!n) continue;
    const float *gu_e = gu + r0 * 2 * H;
    float *act = s->act + r0 * H, *da = s->da + r0 * H, *dgu = s->dgu + r0 * 2 * H;
    pg_swiglu_forward(act, gu_e, (int)n, H); /* recomputed: cheaper to keep gate|up only */
    if (moe_mm_backward(m, io, da, s->w2[l]->grad, dy + r0 * D, act, s->w2[l]->data, s->w2_16 + half * l, (int)n, H,
                        D))
      return PG_ERR;
    pg_swiglu_backward(dgu, gu_e, da, (int)n, H);
    if (!s->bf16) moe_stack_w13(s, l);
    memset(s->dwcat, 0, 2 * half * sizeof(float));
    if (moe_mm_backward(m, io, dx + r0 * D, s->dwcat, dgu, x + r0 * D, s->wcat, s->w13_16 + 2 * half * l, (int)n, D,
                        2 * H))
      return PG_ERR;
    for (size_t i = 0; i < half; i++) {
      s->w1[l]->grad[i] += s->dwcat[i];
      s->w3[l]->grad[i] += s->dwcat[half + i];
    }
  }
  return PG_OK;
}

static int moe_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  moe_state *s = m->state;
  if (check_rows(m, slot, io)) return PG_ERR;
  int N = io->B * io->T, E = s->o.experts, K = s->o.top_k, D = s->o.dim, H = s->hidden_l, R = N * K;
  size_t rows = (size_t)m->max_rows, Rmax = rows * K;
  float *probs = s->probs + slot * rows * E, *lse = s->lse + slot * rows, *weight = s->weight + slot * Rmax;
  int32_t *expert = s->expert + slot * Rmax, *pos = s->pos + slot * Rmax, *token = s->token + slot * Rmax;
  int32_t *off = s->offsets + (size_t)slot * (E + 1);
  int64_t *cnt = s->cnt + (size_t)slot * s->G * s->nl;
  float *gu = s->gu + slot * (size_t)s->X * 2 * H, *ye = s->y + slot * Rmax * D, *out = slot_out(m, slot);
  double *stats = s->stats + (size_t)slot * 2 * E;
  if (s->bf16 && io->mb == 0 && !io->recomputing) moe_refresh_bf16(s);
  /* route: every tensor rank computes the same (router and x replicated) */
  if (moe_mm_forward(m, io, s->logits, moe_jitter(m, io, x, N), s->gate->data, s->gate16, N, D, E)) return PG_ERR;
  pg_moe_route_forward(probs, lse, expert, weight, s->logits, N, E, K);
  pg_moe_route_stats(stats, stats + E, probs, expert, N, E, K);
  for (int i = 0; i < R; i++) pos[i] = 0;
  moe_drop(s, expert, pos, N, io->T);
  /* group by expert (a counting sort, stable in token then choice order) */
  for (int e = 0; e <= E; e++) off[e] = 0;
  for (int i = 0; i < R; i++)
    if (pos[i] >= 0) off[expert[i] + 1]++;
  for (int e = 0; e < E; e++) off[e + 1] += off[e];
  for (int i = 0; i < R; i++) { /* off[e] walks from e's first row to e + 1's */
    if (pos[i] < 0) continue;
    pos[i] = off[expert[i]]++;
    token[pos[i]] = i / K;
  }
  for (int e = E; e > 0; e--) off[e] = off[e - 1];
  off[0] = 0;
  int Rk = off[E]; /* the choices kept */
  moe_gather(s, x, token, Rk);
  if (s->G == 1) {
    for (int e = 0; e <= E; e++) s->eoff[e] = off[e];
    if (moe_experts_forward(m, io, s->xg, gu, ye)) return PG_ERR;
  } else {
    /* each member's experts' row counts, then the rows, to it; outputs back */
    for (int e = 0; e < E; e++) s->ecount[e] = off[e + 1] - off[e];
    for (int j = 0; j < s->G; j++) s->sc[j] = s->rc[j] = s->nl;
    int64_t *orows = s->orows;
    int rc = pg_all_to_all_v(m->ctx, PG_MODE_EXPERT, s->ecount, s->sc, cnt, s->rc, PG_INT64);
    if (!rc) {
      /* X bounds the rows when every member's micro-batch fits this rank's
       * buffers; members with larger ones (different batches on the data
       * ranks) fail together here, not in the exchange that would follow */
      moe_rows(s, off, cnt, orows, orows + s->G);
      int64_t in_total = 0;
      for (int i = 0; i < s->G; i++) in_total += orows[s->G + i];
      int32_t over = in_total > s->X;
      rc = pg_all_reduce_buf(m->ctx, PG_MODE_EXPERT, &over, 1, PG_INT32, PG_REDUCE_MAX);
      if (!rc && over)
        rc = pg_fail("%s: a member of the expert group receives more rows than it holds (this rank %lld, room for %lld): "
                     "every data rank of an expert group must run micro-batches of the same size", m->name,
                     (long long)in_total, (long long)s->X);
    }
    float *xr = s->xr + slot * (size_t)s->X * D;
    if (!rc) rc = moe_exchange(m, s->xg, orows, s->bufa, orows + s->G, (size_t)D);
    if (!rc) {
      moe_permute(s, cnt, s->bufa, xr, (size_t)D, 1);
      rc = moe_experts_forward(m, io, xr, gu, s->bufb);
      moe_permute(s, cnt, s->bufb, s->bufa, (size_t)D, 0);
      if (!rc) rc = moe_exchange(m, s->bufa, orows + s->G, ye, orows, (size_t)D);
    }
    if (rc) return PG_ERR;
  }
  /* each token's kept choices, weighted, in choice order */
  for (int t = 0; t < N; t++) {
    float *o = out + (size_t)t * D;
    for (int d = 0; d < D; d++) o[d] = 0;
    for (int j = 0; j < K; j++) {
      if (pos[t * K + j] < 0) continue;
      const float *src = ye + (size_t)pos[t * K + j] * D;
      float w = weight[t * K + j];
      for (int d = 0; d < D; d++) o[d] += w * src[d];
    }
  }
  /* w2 is row-parallel: each rank holds a partial sum of every expert's output */
  if (pg_tp_reduce_forward(m, out, (int64_t)N * D, PG_FLOAT32)) return PG_ERR;
  s->saved_x[slot] = x;
  *y = out;
  if (!io->want_grad || io->recomputing) return PG_OK;
  /* the auxiliary losses, as the objective counts them: times the rows */
  const double *totals = stats;
  int L = 1, Dg = 1;
  if (io->router) {
    for (int i = 0; i < 2 * E; i++) io->router[i] += stats[i];
    totals = io->router;
    L = s->o.layers;
    /* the load balance of the global batch, as transformers' over the batch:
     * after the last layer the totals are summed over the data group (each
     * micro-batch with the same one of the other ranks), and hold the whole
     * model's and the whole data group's from then on (backward, the engine's
     * expert_tokens) */
    Dg = m->ctx ? m->ctx->data : 1;
    if (s->o.layer == s->o.layers - 1 &&
        pg_all_reduce_buf(m->ctx, PG_MODE_DATA, io->router, 2 * (int64_t)E, PG_FLOAT64, PG_REDUCE_SUM))
      return PG_ERR;
  }
  if (s->o.aux_loss_coef != 0 && (!io->router || s->o.layer == s->o.layers - 1))
    io->aux_sum += (double)N * s->o.aux_loss_coef * moe_balance(s, totals, N * Dg, L, NULL, 0);
  if (s->o.z_loss_coef != 0) {
    double z = 0;
    for (int t = 0; t < N; t++) z += (double)lse[t] * lse[t];
    io->aux_sum += s->o.z_loss_coef * z / L; /* N x (z / (N L)) */
  }
  return PG_OK;
}

static int moe_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  moe_state *s = m->state;
  int N = io->B * io->T, E = s->o.experts, K = s->o.top_k, D = s->o.dim, H = s->hidden_l, R = N * K;
  size_t rows = (size_t)m->max_rows, Rmax = rows * K;
  const float *x = s->saved_x[slot];
  float *probs = s->probs + slot * rows * E, *lse = s->lse + slot * rows, *weight = s->weight + slot * Rmax;
  int32_t *expert = s->expert + slot * Rmax, *pos = s->pos + slot * Rmax, *token = s->token + slot * Rmax;
  int32_t *off = s->offsets + (size_t)slot * (E + 1);
  int64_t *cnt = s->cnt + (size_t)slot * s->G * s->nl;
  float *gu = s->gu + slot * (size_t)s->X * 2 * H, *ye = s->y + slot * Rmax * D;
  /* d loss / d routing weight: dy . (the expert's full output), summed over the tensor group; 0 when dropped */
  for (int i = 0; i < R; i++) {
    float acc = 0;
    if (pos[i] >= 0) {
      const float *a = dy + (size_t)(i / K) * D, *b = ye + (size_t)pos[i] * D;
      for (int d = 0; d < D; d++) acc += a[d] * b[d];
    }
    s->dweight[i] = acc;
  }
  if (pg_all_reduce_buf(m->ctx, PG_MODE_TENSOR, s->dweight, R, PG_FLOAT32, PG_REDUCE_SUM)) return PG_ERR;
  /* the router: renormalised weights, load balancing, z-loss */
  const double *totals = io->router ? io->router : s->stats + (size_t)slot * 2 * E;
  int L = io->router ? s->o.layers : 1, Dg = io->router && m->ctx ? m->ctx->data : 1;
  /* the objective counts each micro-batch's auxiliary losses times its rows: d/d aux = rows x dloss; the
   * load balance is the data group's (global totals), whose gradients the data group then averages: times Dg */
  double scale = (double)N * io->dloss;
  moe_balance(s, totals, N * Dg, L, s->dprob, scale * Dg * s->o.aux_loss_coef);
  float zscale = (float)(scale * s->o.z_loss_coef / ((double)N * L));
  pg_moe_route_backward(s->logits, s->dweight, s->o.aux_loss_coef != 0 ? s->dprob : NULL, zscale, probs, lse, expert,
                        weight, N, E, K);
  const float *xr = moe_jitter(m, io, x, N); /* the same noise again */
  if (moe_mm_backward(m, io, s->dx_router, s->gate->grad, s->logits, xr, s->gate->data, s->gate16, N, D, E))
    return PG_ERR;
  if (xr != x) { /* d(x u)/dx = u, the same noise */
    uint64_t key = moe_jitter_key(m, io);
    for (int t = 0; t < N; t++)
      for (int d = 0; d < D; d++) s->dx_router[(size_t)t * D + d] *= moe_noise(s, key, io, t, d);
  }
  /* the experts, each over its grouped rows */
  for (int i = 0; i < R; i++) {
    if (pos[i] < 0) continue;
    const float *a = dy + (size_t)(i / K) * D;
    float *b = s->dyg + (size_t)pos[i] * D, w = weight[i];
    for (int d = 0; d < D; d++) b[d] = w * a[d];
  }
  int Rk = off[E];
  if (s->G == 1) {
    moe_gather(s, x, token, Rk);
    for (int e = 0; e <= E; e++) s->eoff[e] = off[e];
    if (moe_experts_backward(m, io, s->xg, gu, s->dyg, s->dxg)) return PG_ERR;
  } else {
    int64_t *orows = s->orows;
    moe_rows(s, off, cnt, orows, orows + s->G);
    int rc = moe_exchange(m, s->dyg, orows, s->bufa, orows + s->G, (size_t)D);
    if (!rc) {
      moe_permute(s, cnt, s->bufa, s->bufb, (size_t)D, 1);
      rc = moe_experts_backward(m, io, s->xr + slot * (size_t)s->X * D, gu, s->bufb, s->bufa);
      moe_permute(s, cnt, s->bufa, s->bufb, (size_t)D, 0);
      if (!rc) rc = moe_exchange(m, s->bufb, orows + s->G, s->dxg, orows, (size_t)D);
    }
    if (rc) return PG_ERR;
  }
  for (int t = 0; t < N; t++) {
    float *o = m->dinp + (size_t)t * D;
    for (int d = 0; d < D; d++) o[d] = 0;
    for (int j = 0; j < K; j++) {
      if (pos[t * K + j] < 0) continue;
      const float *src = s->dxg + (size_t)pos[t * K + j] * D;
      for (int d = 0; d < D; d++) o[d] += src[d];
    }
  }
  /* w1/w3 are column-parallel: the experts' input gradient is a partial sum;
   * the router's is whole on every rank and joins after the reduction */
  if (pg_tp_copy_backward(m, m->dinp, (int64_t)N * D)) return PG_ERR;
  for (size_t i = 0; i < (size_t)N * D; i++) m->dinp[i] += s->dx_router[i];
  *dx = m->dinp;
  return PG_OK;
}

static void moe_destroy(pg_module *m) {
  moe_state *s = m->state;
  free(s->saved_x);
  free(s->w1);
  free(s->w2);
  free(s->w3);
  free(s->expert);
  free(s->pos);
  free(s->token);
  free(s->offsets);
  free(s->stats);
  free(s->cnt);
  free(s->eoff);
  free(s->cur);
  free(s->sc);
  free(s->rc);
  free(s->orows);
  free(s->ecount);
  free(s->fill);
  float *bufs[] = {s->probs, s->lse, s->weight, s->gu, s->y, s->logits, s->wcat, s->dwcat, s->xg, s->act, s->dyg,
                   s->dxg, s->da, s->dgu, s->dweight, s->dx_router, s->dprob, s->xr, s->bufa, s->bufb, s->xj};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) pg_be_release(BE(m), bufs[i]);
  moe_free_bf16(s);
}

static const pg_module_ops moe_ops = {"moe", moe_alloc, moe_forward, moe_backward, moe_destroy};

pg_module *pg_moe_new(pg_context *ctx, const char *name, const pg_moe_opts *o) {
  int T = tp_size(ctx), r = tp_rank(ctx), G = ctx ? ctx->expert : 1, ep = ctx ? ctx->ep_rank : 0;
  if (o->dim < 1 || o->hidden < 1) return pg_fail_null("%s: MoE needs positive dim and hidden (%d, %d)", name, o->dim, o->hidden);
  if (o->experts < 1) return pg_fail_null("%s: MoE needs at least 1 expert, not experts=%d", name, o->experts);
  if (o->top_k < 1 || o->top_k > o->experts)
    return pg_fail_null("%s: top_k=%d must be from 1 to experts=%d", name, o->top_k, o->experts);
  if (o->hidden % T)
    return pg_fail_null("%s: tensor=%d does not divide the experts' hidden width %d", name, T, o->hidden);
  if (o->experts % G)
    return pg_fail_null("%s: expert=%d does not divide experts=%d (each member of an expert group holds experts / "
                        "expert of them)", name, G, o->experts);
  if (o->layers < 1 || o->layer < 0 || o->layer >= o->layers)
    return pg_fail_null("%s: MoE layer %d of %d", name, o->layer, o->layers);
  if (!(o->aux_loss_coef >= 0) || !(o->z_loss_coef >= 0))
    return pg_fail_null("%s: aux_loss_coef and z_loss_coef must be >= 0 (%g, %g)", name, o->aux_loss_coef, o->z_loss_coef);
  if (!(o->jitter >= 0) || o->jitter >= 1)
    return pg_fail_null("%s: jitter must be from 0 to below 1 (noise in [1 - jitter, 1 + jitter]), not %g", name,
                        o->jitter);
  if (!(o->capacity_factor >= 0) || o->capacity_factor > 1e9)
    return pg_fail_null("%s: capacity_factor must be > 0 (0: no token dropped), not %g", name, o->capacity_factor);
  pg_module *m = module_new(&moe_ops, ctx, name, o->dim, o->dim, sizeof(moe_state));
  if (!m) return NULL;
  moe_state *s = m->state;
  s->o = *o;
  s->hidden_l = o->hidden / T;
  s->G = G;
  s->ep = ep;
  s->nl = o->experts / G;
  int E = o->experts, nl = s->nl;
  s->w1 = calloc((size_t)nl, sizeof *s->w1);
  s->w2 = calloc((size_t)nl, sizeof *s->w2);
  s->w3 = calloc((size_t)nl, sizeof *s->w3);
  s->eoff = calloc((size_t)E + 1, sizeof *s->eoff); /* E + 1 >= nl + 1: the serial path copies all offsets */
  s->cur = calloc((size_t)nl, sizeof *s->cur);
  s->sc = calloc((size_t)G, sizeof *s->sc);
  s->rc = calloc((size_t)G, sizeof *s->rc);
  s->orows = calloc(2 * (size_t)G, sizeof *s->orows);
  s->ecount = calloc((size_t)E, sizeof *s->ecount);
  s->fill = calloc((size_t)E, sizeof *s->fill);
  if (!s->w1 || !s->w2 || !s->w3 || !s->eoff || !s->cur || !s->sc || !s->rc || !s->orows || !s->ecount || !s->fill) {
    pg_module_free(m);
    return pg_fail_null("out of memory");
  }
  int64_t gshape[2] = {E, o->dim}, up[2] = {o->hidden, o->dim}, down[2] = {o->dim, o->hidden};
  if (add_param(m, param_make(name, "gate.weight", 2, gshape, 0, 1, 1, 0, PG_INIT_NORMAL, o->init_std))) goto fail;
  s->gate = m->params[0];
  for (int l = 0; l < nl; l++) {
    int e = ep * nl + l; /* parameters keep the serial model's names: checkpoints reslice across layouts */
    char w1[64], w2[64], w3[64];
    snprintf(w1, sizeof w1, "experts.%d.w1.weight", e);
    snprintf(w2, sizeof w2, "experts.%d.w2.weight", e);
    snprintf(w3, sizeof w3, "experts.%d.w3.weight", e);
    if (add_param(m, param_make(name, w1, 2, up, 0, 1, T, r, PG_INIT_NORMAL, o->init_std))) goto fail;
    s->w1[l] = m->params[m->nparams - 1];
    if (add_param(m, param_make(name, w2, 2, down, 1, 1, T, r, PG_INIT_NORMAL, o->init_std))) goto fail;
    s->w2[l] = m->params[m->nparams - 1];
    if (add_param(m, param_make(name, w3, 2, up, 0, 1, T, r, PG_INIT_NORMAL, o->init_std))) goto fail;
    s->w3[l] = m->params[m->nparams - 1];
    /* held by one member of the expert group: gradients averaged over expert_data (pg_engine.c) */
    s->w1[l]->expert = s->w2[l]->expert = s->w3[l]->expert = G > 1;
  }
  return m;
fail:
  pg_module_free(m);
  return NULL;
}

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

static int embedding_forward(pg_module *m, int slot, pg_io *io, const float *x, const float **y) {
  (void)x;
  embedding_state *s = m->state;
  if (check_rows(m, slot, io)) return PG_ERR;
  if (s->positions && io->T > s->positions)
    return pg_fail("%s: sequence length %d exceeds the %d positions", m->name, io->T, s->positions);
  int N = io->B * io->T, C = m->out_width;
  float *out = slot_out(m, slot);
  if (sp_active(m)) {
    /* every row's lookup in this rank's vocabulary slice; the positions go
     * into the first rank's, so the sum holds them once (and the same bits:
     * every other partial of a row is 0); this rank's rows of the sum */
    if (KERNEL(m, embedding_forward, s->full, io->tokens, s->wte->data, N, C, s->row_start, s->padded_l) ||
        (s->wpe && tp_rank(m->ctx) == 0 && KERNEL(m, position_forward, s->full, s->wpe->data, N, io->T, C)) ||
        pg_sp_reduce_scatter_rows(m, s->full, out, N, C, PG_FLOAT32))
      return PG_ERR;
    *y = out;
    return PG_OK;
  }
  if (KERNEL(m, embedding_forward, out, io->tokens, s->wte->data, N, C, s->row_start, s->padded_l)) return PG_ERR;
  /* Each rank looked up only the ids in its vocabulary slice (others are 0). */
  if (pg_tp_reduce_forward(m, out, (int64_t)N * C, PG_FLOAT32)) return PG_ERR;
  if (s->wpe && KERNEL(m, position_forward, out, s->wpe->data, N, io->T, C)) return PG_ERR;
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
      (s->wpe && KERNEL(m, position_backward, s->wpe->grad, dy, N, io->T, C)))
    return PG_ERR;
  *dx = NULL;
  return PG_OK;
}

static void embedding_destroy(pg_module *m) { pg_be_release(BE(m), ((embedding_state *)m->state)->full); }

static const pg_module_ops embedding_ops = {"embedding", embedding_alloc, embedding_forward, embedding_backward,
                                            embedding_destroy};

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
  pg_module *m = module_new(&embedding_ops, ctx, name, 0, width, sizeof(embedding_state));
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

pg_param *pg_embedding_weight(pg_module *m) {
  if (!m || m->ops != &embedding_ops) return NULL;
  return ((embedding_state *)m->state)->wte;
}

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

static const pg_module_ops lm_head_ops = {"lm_head", lm_head_alloc, lm_head_forward, lm_head_backward, lm_head_destroy};

static pg_module *lm_head_make(pg_context *ctx, const char *name, int vocab, int padded_vocab, int width,
                               pg_param *weight, const char *weight_name, int tied_copy, float init_std,
                               int logits_out) {
  int T = tp_size(ctx), r = tp_rank(ctx);
  if (check_vocab(name, vocab, padded_vocab, T)) return NULL;
  if (weight && (weight->ndim != 2 || weight->shape[0] != padded_vocab / T || weight->shape[1] != width))
    return pg_fail_null("%s: tied weight %s has shape [%lld, %lld], expected [%d, %d]", name, weight->name,
                        (long long)weight->shape[0], (long long)weight->shape[1], padded_vocab / T, width);
  pg_module *m = module_new(&lm_head_ops, ctx, name, width, logits_out ? padded_vocab / T : 0,
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

static const pg_module_ops sequential_ops = {"sequential", sequential_alloc, sequential_forward, sequential_backward,
                                             NULL};

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
  pg_module *m = module_new(&sequential_ops, ctx, name, children[0]->in_width, children[n - 1]->out_width, 0);
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

static const pg_module_ops residual_ops = {"residual", residual_alloc, residual_forward, residual_backward,
                                           residual_destroy};

pg_module *pg_residual_new(pg_context *ctx, const char *name, pg_module *inner) {
  if (inner->in_width != inner->out_width || inner->in_width < 1)
    return pg_fail_null("%s: a Residual needs a module with equal input and output widths (%s: %d -> %d)", name,
                        inner->name, inner->in_width, inner->out_width);
  pg_module *m = module_new(&residual_ops, ctx, name, inner->in_width, inner->out_width, sizeof(residual_state));
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

static const pg_module_ops recompute_ops = {"recompute", recompute_alloc, recompute_forward, recompute_backward,
                                            recompute_destroy};

pg_module *pg_recompute_new(pg_context *ctx, const char *name, pg_module *inner) {
  pg_module *m = module_new(&recompute_ops, ctx, name, inner->in_width, inner->out_width, sizeof(recompute_state));
  if (!m) return NULL;
  if (adopt_children(m, &inner, 1)) {
    pg_module_free(m);
    return NULL;
  }
  return m;
}

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

static const pg_module_ops sp_gather_ops = {"sp_gather", sp_gather_alloc, sp_gather_forward, sp_gather_backward, NULL};

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

static const pg_module_ops sp_scatter_ops = {"sp_scatter", sp_scatter_alloc, sp_scatter_forward, sp_scatter_backward,
                                             NULL};

static pg_module *sp_transition_new(const pg_module_ops *ops, pg_context *ctx, const char *name, int width) {
  if (width < 1) return pg_fail_null("%s: %s needs a positive width, not %d", name, ops->kind, width);
  pg_module *m = module_new(ops, ctx, name, width, width, 0);
  if (m) m->sp = 1;
  return m;
}

pg_module *pg_sp_gather_new(pg_context *ctx, const char *name, int width) {
  return sp_transition_new(&sp_gather_ops, ctx, name, width);
}

pg_module *pg_sp_scatter_new(pg_context *ctx, const char *name, int width) {
  return sp_transition_new(&sp_scatter_ops, ctx, name, width);
}

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
  if (s->fns.forward(s->fns.ud, slot, io, x, rows, slot_out(m, slot))) return PG_ERR;
  if (s->output == PG_TP_REDUCE && pg_tp_reduce_forward(m, slot_out(m, slot), (int64_t)rows * m->out_width, PG_FLOAT32))
    return PG_ERR;
  *y = slot_out(m, slot);
  return PG_OK;
}

static int custom_backward(pg_module *m, int slot, pg_io *io, const float *dy, const float **dx) {
  custom_state *s = m->state;
  int rows = io->B * io->T;
  if (s->fns.backward(s->fns.ud, slot, io, dy, rows, m->dinp)) return PG_ERR;
  if (s->input == PG_TP_COPY && pg_tp_copy_backward(m, m->dinp, (int64_t)rows * m->in_width)) return PG_ERR;
  *dx = m->dinp;
  return PG_OK;
}

static void custom_destroy(pg_module *m) {
  custom_state *s = m->state;
  if (s->fns.release) s->fns.release(s->fns.ud);
}

static const pg_module_ops custom_ops = {"custom", custom_alloc, custom_forward, custom_backward, custom_destroy};

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

static const pg_module_ops objective_ops = {"objective", objective_alloc, objective_forward, objective_backward,
                                            objective_destroy};

pg_module *pg_objective_new(pg_context *ctx, const char *name, int width, const pg_objective_fns *fns) {
  if (width < 1) return pg_fail_null("%s: an objective needs the stage's output width, not %d", name, width);
  pg_module *m = module_new(&objective_ops, ctx, name, width, 0, sizeof(objective_state));
  if (!m) return NULL;
  ((objective_state *)m->state)->fns = *fns;
  return m;
}

int pg_tp_region_from_name(const char *name, int is_input, pg_tp_region *out) {
  /* the middle name differs: an input may be "copy" (copy-to), an output "reduce" (reduce-from) */
  const char *middle = is_input ? "copy" : "reduce";
  if (name && !strcmp(name, "replicated")) *out = PG_TP_REPLICATED;
  else if (name && !strcmp(name, middle)) *out = is_input ? PG_TP_COPY : PG_TP_REDUCE;
  else if (name && !strcmp(name, "split")) *out = PG_TP_SPLIT;
  else
    return pg_fail("tensor_parallel.%s must be 'replicated', '%s' or 'split', got '%s'", is_input ? "input" : "output",
                   middle, name ? name : "(none)");
  return PG_OK;
}

pg_module *pg_custom_new(pg_context *ctx, const char *name, int in_width, int out_width, pg_tp_region input,
                         pg_tp_region output, const pg_custom_fns *fns, pg_param **params, int nparams) {
  if (in_width < 1 || out_width < 1)
    return pg_fail_null("%s: a module written in Lua needs positive widths (in=%d, out=%d)", name, in_width, out_width);
  if (input == PG_TP_REDUCE || output == PG_TP_COPY)
    return pg_fail_null("%s: input is replicated, copy or split; output replicated, reduce or split", name);
  pg_module *m = module_new(&custom_ops, ctx, name, in_width, out_width, sizeof(custom_state));
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

/* ---------------------------------------------------------------- the registry of kinds */

/* An int field of a description. A value that does not fit an int is an
 * error naming the module, the key and the value (a vocab of 2^32 + 64 was
 * cast to 64 and built 64 rows); the first one is kept and *bad set, so that
 * a builder reads all its fields and then returns NULL once. */
static int desc_int(const pg_desc *d, const char *name, const char *key, int def, int *bad) {
  int64_t v = d->ops->integer(d, key, def);
  if (v >= INT_MIN && v <= INT_MAX) return (int)v;
  if (!*bad)
    pg_fail("%s: %s = %lld does not fit a C int (at most %d)", *name ? name : "module", key, (long long)v, INT_MAX);
  *bad = 1;
  return 0;
}
#define DESC_INT(d, key, def) desc_int((d), name, (key), (def), &bad)

static pg_module *build_linear(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env) {
  (void)env;
  const char *mode = d->ops->string(d, "mode", "plain");
  int bad = 0;
  pg_linear_opts o = {.in = DESC_INT(d, "in", 0), .out = DESC_INT(d, "out", 0), .bias = d->ops->boolean(d, "bias", 1),
                      .blocks = DESC_INT(d, "blocks", 1), .gather_output = d->ops->boolean(d, "gather_output", 0),
                      .input_is_parallel = d->ops->boolean(d, "input_is_parallel", 0),
                      .init_std = (float)d->ops->number(d, "init_std", 0.02)};
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
  return pg_linear_new(ctx, name, &o);
}

static pg_module *build_layernorm(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env) {
  (void)env;
  int bad = 0, width = DESC_INT(d, "width", 0);
  return bad ? NULL : pg_layernorm_new(ctx, name, width);
}

static pg_module *build_rmsnorm(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env) {
  (void)env;
  int bad = 0, width = DESC_INT(d, "width", 0);
  return bad ? NULL : pg_rmsnorm_new(ctx, name, width, (float)d->ops->number(d, "eps", 1e-5));
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

static pg_module *build_moe(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env) {
  (void)env;
  int bad = 0;
  pg_moe_opts o = {.dim = DESC_INT(d, "dim", 0), .hidden = DESC_INT(d, "hidden", 0),
                   .experts = DESC_INT(d, "experts", 0), .top_k = DESC_INT(d, "top_k", 2),
                   .layer = DESC_INT(d, "layer", 0), .layers = DESC_INT(d, "layers", 1),
                   .aux_loss_coef = d->ops->number(d, "aux_loss_coef", 0),
                   .z_loss_coef = d->ops->number(d, "z_loss_coef", 0),
                   .capacity_factor = d->ops->number(d, "capacity_factor", 0),
                   .jitter = d->ops->number(d, "jitter", 0),
                   .init_std = (float)d->ops->number(d, "init_std", 0.02)};
  return bad ? NULL : pg_moe_new(ctx, name, &o);
}

static pg_module *build_attention(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env) {
  (void)env;
  int bad = 0;
  pg_attention_opts o = {.heads = DESC_INT(d, "heads", 0), .kv_heads = DESC_INT(d, "kv_heads", 0),
                         .head_dim = DESC_INT(d, "head_dim", 0), .max_seq = DESC_INT(d, "max_seq", 0),
                         .rope_theta = d->ops->number(d, "rope_theta", 0), .alibi = d->ops->boolean(d, "alibi", 0),
                         .recompute = d->ops->boolean(d, "recompute", 0)};
  return bad ? NULL : pg_attention_new(ctx, name, &o);
}

static pg_module *build_embedding(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env) {
  int bad = 0, vocab = DESC_INT(d, "vocab", 0), padded = DESC_INT(d, "padded_vocab", 0);
  int width = DESC_INT(d, "width", 0), positions = DESC_INT(d, "positions", 0);
  if (bad) return NULL;
  pg_module *m =
      pg_embedding_new(ctx, name, vocab, padded, width, positions, (float)d->ops->number(d, "init_std", 0.02));
  if (m && env && env->nembeddings < 8) env->embeddings[env->nembeddings++] = m;
  return m;
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
  float std = (float)d->ops->number(d, "init_std", 0.02);
  if (!strcmp(output, "logits")) return pg_lm_logits_new(ctx, name, vocab, padded, width, w, tie ? tie : own, tie != NULL, std);
  if (strcmp(output, "loss")) return pg_fail_null("%s: output must be 'loss' or 'logits', not '%s'", name, output);
  return pg_lm_head_new(ctx, name, vocab, padded, width, w, tie ? tie : own, tie != NULL, std);
}

typedef pg_module *(*kind_builder)(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env);

static const struct {
  const char *kind;
  kind_builder build;
} kinds[] = {
    {"linear", build_linear},       {"layernorm", build_layernorm}, {"rmsnorm", build_rmsnorm},
    {"gelu", build_gelu},           {"swiglu", build_swiglu},       {"attention", build_attention},
    {"embedding", build_embedding}, {"lm_head", build_lm_head},     {"moe", build_moe},
    {"sp_gather", build_sp_gather}, {"sp_scatter", build_sp_scatter},
};

pg_module *pg_module_build(pg_context *ctx, const char *kind, const char *name, const pg_desc *d, pg_module_env *env) {
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
    if (!strcmp(kinds[i].kind, kind)) return kinds[i].build(ctx, name, d, env);
  return pg_fail_null("%s: unknown module kind '%s'", name, kind);
}

/* ---------------------------------------------------------------- tree */

void pg_module_free(pg_module *m) {
  if (!m) return;
  for (int i = 0; i < m->nchildren; i++) pg_module_free(m->children[i]);
  if (m->ops->destroy && m->state) m->ops->destroy(m);
  for (int i = 0; i < m->nparams; i++) pg_param_free(m->params[i]);
  free(m->params);
  free(m->children);
  pg_be_release(BE(m), m->out);
  pg_be_release(BE(m), m->dinp);
  free(m->state);
  free(m->name);
  free(m);
}

int pg_module_use_recompute_arena(pg_module *m, pg_recompute_arena *a) {
  if (m->nslots) return pg_fail("%s: recomputation's memory must be chosen before the buffers are allocated", m->name);
  if (m->ops == &recompute_ops) {
    m->arena = a;
    /* the block inside allocates from the arena; anything recomputing within it is already covered */
    return pg_module_set_backend(m->children[0], &a->be);
  }
  if (m->ops == &attention_ops && ((attention_state *)m->state)->o.recompute) m->arena = a;
  for (int i = 0; i < m->nchildren; i++)
    if (pg_module_use_recompute_arena(m->children[i], a)) return PG_ERR;
  return PG_OK;
}

int pg_module_set_backend(pg_module *m, const pg_backend *be) {
  if (m->be != be && (m->out || m->dinp || m->nslots))
    return pg_fail("%s: the backend must be chosen before the buffers are allocated", m->name);
  /* their Lua callbacks read and write host memory */
  if ((m->ops == &custom_ops || m->ops == &objective_ops) && be->device != PG_CPU)
    return pg_fail("%s: a %s written in Lua runs on the cpu backend only, not %s", m->name,
                   m->ops == &custom_ops ? "module" : "objective", be->name);
  /* its routing, grouping and auxiliary losses run on the host; no device kernels yet */
  if (m->ops == &moe_ops && be->device != PG_CPU)
    return pg_fail("%s: the moe kind (mixture of experts) runs on the cpu backend only for now, not %s", m->name,
                   be->name);
  m->be = be;
  for (int i = 0; i < m->nchildren; i++)
    if (pg_module_set_backend(m->children[i], be)) return PG_ERR;
  return PG_OK;
}

static int bf16_products(pg_module *m) {
  if (m->out || m->dinp || m->nslots)
    return pg_fail("%s: the precision must be chosen before the buffers are allocated", m->name);
  if (m->ops == &moe_ops) ((moe_state *)m->state)->bf16 = 1;
  if (m->ops == &linear_ops) ((linear_state *)m->state)->mm.on = 1;
  if (m->ops == &lm_head_ops) ((lm_head_state *)m->state)->mm.on = 1;
  for (int i = 0; i < m->nchildren; i++)
    if (bf16_products(m->children[i])) return PG_ERR;
  return PG_OK;
}

/* The element types of precision bf16's activations, torch.autocast's: a Linear's output is bf16, and GELU,
 * SwiGLU and the attention core keep their input's type; norms, the residual stream, the embedding, the heads
 * and moe take and give float32, and so does a module written in Lua, which computes in float32 (as a region
 * of torch code run with autocast off: its neighbours' products still run bf16). Where a module would make bf16
 * that its consumer cannot take, it makes float32 instead, so every edge has one type that both ends agree on.
 * A row-parallel Linear's output is bf16 like any Linear's: each rank rounds its partial sums and the tensor
 * group sums them in bf16 (all-reduce, or reduce-scatter of rows under sequence parallelism), so those
 * collectives move half the bytes, as Megatron's do. A column-parallel one whose output is gathered
 * (gather_output) makes float32. */
static int passes_bf16(const pg_module *m) {
  return m->ops == &gelu_ops || m->ops == &swiglu_ops || m->ops == &attention_ops;
}

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

/* Whether m can take a bf16 input, given whether its consumer can take a bf16 output. */
static int takes_bf16(const pg_module *m, int consumer_takes) {
  if (m->ops == &linear_ops) return linear_takes_bf16(m);
  if (passes_bf16(m)) return consumer_takes;
  if (m->ops == &sequential_ops) {
    for (int i = m->nchildren - 1; i >= 0; i--) consumer_takes = takes_bf16(m->children[i], consumer_takes);
    return consumer_takes;
  }
  return 0;
}

/* in_bf16: m's producer gives bf16 (only where takes_bf16 said yes); consumer_takes: m's consumer can take it. */
static void assign_types(pg_module *m, int in_bf16, int consumer_takes) {
  m->in_bf16 = in_bf16;
  m->out_bf16 = m->ops == &linear_ops ? linear_makes_bf16(m) && consumer_takes : passes_bf16(m) ? in_bf16 : 0;
  if (m->ops == &sequential_ops) {
    for (int i = 0; i < m->nchildren; i++) {
      int next_takes = consumer_takes; /* what child i's consumer (the rest of the chain) takes */
      for (int j = m->nchildren - 1; j > i; j--) next_takes = takes_bf16(m->children[j], next_takes);
      assign_types(m->children[i], in_bf16, next_takes);
      in_bf16 = m->children[i]->out_bf16;
    }
    m->out_bf16 = in_bf16;
    return;
  }
  /* the residual adds a bf16 branch to its float32 stream; anything else holding modules takes float32 from them */
  for (int i = 0; i < m->nchildren; i++) assign_types(m->children[i], 0, m->ops == &residual_ops);
}

int pg_module_set_precision(pg_module *m, pg_precision p) {
  if (p == PG_PRECISION_FP32) return PG_OK;
  if (bf16_products(m)) return PG_ERR;
  assign_types(m, 0, 0);
  return PG_OK;
}

/* Float32 room a module's bf16 activations need (pg_io.wide_scratch), in elements of max_rows rows. */
static void wide_need(const pg_module *m, int64_t wide[PG_WIDE_SCRATCH]) {
  int64_t rows = m->max_rows, in = m->in_width, out = m->out_width;
  if (m->ops == &linear_ops) {
    const linear_state *s = m->state;
    if (m->out_bf16) wide[0] = rows * s->out_l; /* the sums before rounding; backward: the bias's widened dy */
    if (m->in_bf16) wide[1] = rows * s->in_l;   /* the input gradient before rounding */
  } else if (m->ops == &attention_ops && m->in_bf16) {
    wide[0] = rows * in;                  /* q|k|v widened */
    wide[1] = rows * (in > out ? in : out); /* the output before rounding; its gradient widened */
    wide[2] = rows * in;                  /* the input gradient before rounding */
  }
}

void pg_module_bf16_scratch(const pg_module *m, pg_bf16_need *need) {
  const bf16_mm *mm = m->ops == &linear_ops    ? &((const linear_state *)m->state)->mm
                      : m->ops == &lm_head_ops ? &((const lm_head_state *)m->state)->mm
                                               : NULL;
  for (int k = 0; mm && mm->on && k < 2; k++)
    if (mm->need[k] > need->operand[k]) need->operand[k] = mm->need[k];
  const moe_state *moe = m->ops == &moe_ops ? m->state : NULL;
  for (int k = 0; moe && moe->bf16 && k < 2; k++)
    if (moe->bf16_need > need->operand[k]) need->operand[k] = moe->bf16_need;
  int64_t wide[PG_WIDE_SCRATCH] = {0};
  wide_need(m, wide);
  for (int k = 0; k < PG_WIDE_SCRATCH; k++)
    if (wide[k] > need->wide[k]) need->wide[k] = wide[k];
  for (int i = 0; i < m->nchildren; i++) pg_module_bf16_scratch(m->children[i], need);
}

size_t pg_module_bf16_bytes(const pg_module *m) {
  size_t b = 0;
  if (m->ops == &linear_ops) b += ((const linear_state *)m->state)->mm.bytes;
  if (m->ops == &lm_head_ops) b += ((const lm_head_state *)m->state)->mm.bytes;
  if (m->ops == &moe_ops) b += ((const moe_state *)m->state)->bf16_bytes;
  for (int i = 0; i < m->nchildren; i++) b += pg_module_bf16_bytes(m->children[i]);
  return b;
}

int pg_module_sequence_parallel(pg_module *m) {
  if (tp_size(m->ctx) == 1) return PG_OK; /* every rank's rows are all the rows */
  if (m->out || m->dinp || m->nslots)
    return pg_fail("%s: sequence parallelism must be turned on before the buffers are allocated", m->name);
  if (m->ops == &attention_ops || m->ops == &moe_ops || m->ops == &custom_ops || m->ops == &objective_ops)
    return pg_fail("%s: the %s kind needs every row of the micro-batch; under sequence parallelism it goes between "
                   "sp_gather and sp_scatter", m->name, m->ops->kind);
  /* replicated parameters of a row-wise module see only this rank's rows */
  int row_wise = m->ops == &layernorm_ops || m->ops == &rmsnorm_ops ||
                 (m->ops == &linear_ops && ((linear_state *)m->state)->o.mode == PG_LINEAR_PLAIN);
  for (int i = 0; row_wise && i < m->nparams; i++)
    if (m->params[i]->replicated) m->params[i]->sequence_parallel = 1;
  m->sp = 1;
  return PG_OK;
}

int pg_module_alloc(pg_module *m, int nslots, int max_rows) {
  if (nslots < 1 || max_rows < 1) return pg_fail("%s: cannot allocate %d slots of %d rows", m->name, nslots, max_rows);
  return m->ops->alloc(m, nslots, max_rows);
}

static int collect(pg_module *m, pg_param ***arr, int *n, int *cap) {
  for (int i = 0; i < m->nparams; i++) {
    if (*n == *cap) {
      *cap = *cap ? *cap * 2 : 16;
      pg_param **na = realloc(*arr, (size_t)*cap * sizeof *na);
      if (!na) return pg_fail("out of memory");
      *arr = na;
    }
    (*arr)[(*n)++] = m->params[i];
  }
  for (int i = 0; i < m->nchildren; i++)
    if (collect(m->children[i], arr, n, cap)) return PG_ERR;
  return PG_OK;
}

pg_param **pg_module_collect_params(pg_module *m, int *n) {
  pg_param **arr = NULL;
  int cap = 0;
  *n = 0;
  if (collect(m, &arr, n, &cap)) {
    free(arr);
    return NULL;
  }
  if (!arr) arr = calloc(1, sizeof *arr);
  return arr;
}

size_t pg_module_saved_bytes(const pg_module *m) {
  size_t b = m->saved_bytes_per_slot;
  if (m->ops == &recompute_ops) return b; /* the block inside keeps one micro-batch: pg_module_fixed_bytes */
  for (int i = 0; i < m->nchildren; i++) b += pg_module_saved_bytes(m->children[i]);
  return b;
}

size_t pg_module_fixed_bytes(const pg_module *m) {
  if (m->ops == &attention_ops && ((const attention_state *)m->state)->o.recompute)
    return (size_t)m->max_rows * ((const attention_state *)m->state)->heads_l *
           ((const attention_state *)m->state)->max_seq * sizeof(float);
  if (m->ops == &recompute_ops) return pg_module_saved_bytes(m->children[0]) + pg_module_fixed_bytes(m->children[0]);
  size_t b = 0;
  for (int i = 0; i < m->nchildren; i++) {
    size_t c = pg_module_fixed_bytes(m->children[i]);
    if (c > b) b = c;
  }
  return b;
}

/* ---------------------------------------------------------------- who writes which gradients */

int pg_module_borrowed_params(const pg_module *m, pg_param **out, int cap) {
  int n = 0;
  if (m->ops == &lm_head_ops) {
    const lm_head_state *s = m->state;
    if (!s->owns_w) {
      if (n < cap) out[n] = s->w;
      n++;
    }
  }
  for (int i = 0; i < m->nchildren; i++)
    n += pg_module_borrowed_params(m->children[i], out ? out + (n < cap ? n : cap) : NULL, n < cap ? cap - n : 0);
  return n;
}

const pg_module *pg_module_find_foreign_writer(const pg_module *m) {
  if (m->ops == &custom_ops && m->nparams > 0) return m;
  for (int i = 0; i < m->nchildren; i++) {
    const pg_module *f = pg_module_find_foreign_writer(m->children[i]);
    if (f) return f;
  }
  return NULL;
}
