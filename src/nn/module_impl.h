/* module_impl.h: what the files of src/nn share. Private: the Makefile
 * installs the runtime folders' pg_*.h only, so this header (no pg_ prefix)
 * stays out of the installed ones.
 *
 * The module layer is a framework and one file per kind (or family of kinds):
 *   pg_module.c        modules and parameters, per-slot buffers, the walks over a tree
 *   module_registry.c  the registry: every kind's descriptor, found by name (pg_module_build)
 *   module_regions.c   the tensor- and sequence-parallel regions, pg_module_sequence_parallel
 *   module_bf16.c      precision bf16: the product helper (bf16_mm) and the tree's element types
 *   module_arena.c     recomputation's shared memory
 *   kind_*.c           the kinds: state, ops, constructor, builder from a description, descriptor
 * The framework never asks which kind a module is: it asks its descriptor
 * (m->kind), whose traits and hooks say what the kind does. */
#ifndef PG_NN_MODULE_IMPL_H
#define PG_NN_MODULE_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"
#include "pg_backend.h"
#include "pg_comm.h"
#include "pg_error.h"
#include "pg_module.h"

/* The shared internals have external linkage now that they span files; in a
 * static library they would clash with any program's own module_new or
 * check_rows, so their symbols carry a prefix while the code keeps its short
 * names. */
#define module_new pg_nn_module_new
#define param_make_blocks pg_nn_param_make_blocks
#define param_make pg_nn_param_make
#define add_param pg_nn_add_param
#define alloc_leaf_rows pg_nn_alloc_leaf_rows
#define alloc_leaf pg_nn_alloc_leaf
#define check_rows pg_nn_check_rows
#define alloc_ptrs pg_nn_alloc_ptrs
#define alloc_floats pg_nn_alloc_floats
#define arena_alloc_block pg_nn_arena_alloc_block
#define arena_buffer pg_nn_arena_buffer
#define home_backend pg_nn_home_backend
#define mm_free pg_nn_mm_free
#define mm_alloc pg_nn_mm_alloc
#define mm_forward pg_nn_mm_forward
#define mm_fwd pg_nn_mm_fwd
#define mm_bwd pg_nn_mm_bwd
#define mm_need pg_nn_mm_need
#define bf16_product_forward pg_nn_bf16_product_forward
#define bf16_product_backward pg_nn_bf16_product_backward
#define raise_wide pg_nn_raise_wide
#define desc_int pg_nn_desc_int

/* ---------------------------------------------------------------- the kind descriptor */

typedef pg_module *(*kind_builder)(pg_context *ctx, const char *name, const pg_desc *d, pg_module_env *env);

/* One per kind (kind_*.c), every one of them in the registry's table
 * (module_registry.c). traits are what callers may ask (pg_module.h); the
 * hooks answer for the traits that depend on a module's state, and are NULL
 * where the kind has no such part. */
struct pg_module_kind {
  pg_module_ops ops;     /* ops.kind: the module's kind in messages ("custom" for a module written in Lua) */
  pg_kind_traits traits; /* traits.name: the kind in descriptions ("lua" for that one) */
  kind_builder build;    /* PG_KIND_BUILT: the module from a description's fields */
  /* PG_KIND_LIST / PG_KIND_WRAPPER: the module around children built first (left to the caller on failure) */
  pg_module *(*assemble)(pg_context *ctx, const char *name, pg_module **children, int n);
  int (*mode)(const pg_module *m);                     /* traits.nmodes > 0: m's index into traits.modes */
  void (*bf16_on)(pg_module *m);                       /* precision bf16: its products take bf16 operands */
  int (*takes_bf16)(const pg_module *m);               /* a product's input: a bf16 one reaches it as it is */
  int (*makes_bf16)(const pg_module *m);               /* a product's output: it may be bf16 */
  void (*bf16_need)(const pg_module *m, pg_bf16_need *need); /* raises the engine's bf16 scratch to its need */
  size_t (*bf16_bytes)(const pg_module *m);            /* its bf16 working weights */
  void (*bf16_gathered)(pg_module *m);                 /* see pg_module_bf16_gathered */
  /* recomputes a part of itself in the rank's arena (selective: attention's
   * probabilities); *bytes: that part for one micro-batch */
  int (*selective)(const pg_module *m, size_t *bytes);
  pg_param *(*borrowed)(const pg_module *m);           /* a parameter it writes gradients to without owning it */
  pg_param *(*tie_weight)(pg_module *m);               /* the weight a head on the same stage can tie to */
  void (*release_cache)(pg_module *m);                 /* decoding: frees its key/value cache (pg_io.decode) */
};

extern const pg_module_kind pg_kind_linear, pg_kind_layernorm, pg_kind_rmsnorm, pg_kind_gelu, pg_kind_swiglu,
    pg_kind_attention, pg_kind_moe, pg_kind_embedding, pg_kind_lm_head, pg_kind_sequential, pg_kind_residual,
    pg_kind_recompute, pg_kind_sp_gather, pg_kind_sp_scatter, pg_kind_custom, pg_kind_objective, pg_kind_kv_heads;

/* m's role under sequence parallelism (its mode's, for a kind with modes). */
static inline pg_sp_role kind_sp_role(const pg_module *m) {
  const pg_kind_traits *t = &m->kind->traits;
  return t->nmodes ? t->sp_modes[m->kind->mode(m)] : t->sp;
}
static inline int kind_has(const pg_module *m, unsigned flag) { return (m->kind->traits.flags & flag) != 0; }

/* An int field of a description (module_registry.c): a value that does not
 * fit an int sets *bad (the first one's message kept). */
int desc_int(const pg_desc *d, const char *name, const char *key, int def, int *bad);
#define DESC_INT(d, key, def) desc_int((d), name, (key), (def), &bad)
/* A field whose default pg.nn's option schemas own (parameter init_std,
 * RMSNorm's eps, MoE's top_k: nn.lua, models/common.lua), which therefore
 * always give it: absent, it sets *bad with "name: key is required" (the
 * first message kept) instead of the runtime keeping a default of its own. */
double desc_number_required(const pg_desc *d, const char *name, const char *key, int *bad);
int desc_int_required(const pg_desc *d, const char *name, const char *key, int *bad);
#define DESC_NUMBER_REQ(d, key) desc_number_required((d), name, (key), &bad)
#define DESC_INT_REQ(d, key) desc_int_required((d), name, (key), &bad)

/* ---------------------------------------------------------------- helpers */

static inline int tp_size(const pg_context *ctx) { return ctx ? ctx->tensor : 1; }
static inline int tp_rank(const pg_context *ctx) { return ctx ? ctx->tp_rank : 0; }

/* The module's backend: every buffer, copy and kernel goes through it. */
#define BE(m) ((m)->be)
#define KERNEL(m, op, ...) ((m)->be->ops->op((m)->be, __VA_ARGS__))

pg_module *module_new(const pg_module_kind *kind, pg_context *ctx, const char *name, int in_w, int out_w,
                      size_t state_size);
pg_param *param_make_blocks(const char *module_name, const char *suffix, int ndim, const int64_t *full_shape,
                            int split_dim, int blocks, const int64_t *sizes, int parts, int index,
                            pg_init_kind init, float std);
pg_param *param_make(const char *module_name, const char *suffix, int ndim, const int64_t *full_shape,
                     int split_dim, int blocks, int parts, int index, pg_init_kind init, float std);
int add_param(pg_module *m, pg_param *p);

/* ---------------------------------------------------------------- sequence parallelism, rows */

static inline int sp_active(const pg_module *m) { return m->sp && tp_size(m->ctx) > 1; }

/* The rows a row-wise module works on: this rank's share of the micro-batch
 * with sequence parallelism (pg_sp_rows), else all of them. */
static inline int mod_rows(const pg_module *m, const pg_io *io) {
  int64_t N = (int64_t)io->B * io->T;
  return (int)(sp_active(m) ? pg_sp_rows(N, tp_size(m->ctx), tp_rank(m->ctx)) : N);
}

/* The most rows of that kind in a micro-batch of max_rows. */
static inline int mod_rows_max(const pg_module *m, int max_rows) {
  return (int)(sp_active(m) ? pg_sp_rows_max(max_rows, tp_size(m->ctx)) : max_rows);
}

/* This rank's first row of a micro-batch's N (0 without sequence parallelism). */
static inline int64_t sp_row0(const pg_module *m, int64_t N) {
  return sp_active(m) ? pg_sp_row0(N, tp_size(m->ctx), tp_rank(m->ctx)) : 0;
}

/* Bytes of an activation element: bf16 or float32 (pg_module.in_bf16 / out_bf16). */
static inline size_t act_bytes(int bf16) { return bf16 ? sizeof(uint16_t) : sizeof(float); }

static inline pg_dtype act_dtype(int bf16) { return bf16 ? PG_BFLOAT16 : PG_FLOAT32; }

/* The bf16 elements behind an activation pointer of a bf16 edge (pg_module.in_bf16 / out_bf16). */
static inline uint16_t *bits(float *p) { return (uint16_t *)(void *)p; }
static inline const uint16_t *cbits(const float *p) { return (const uint16_t *)(const void *)p; }

/* ---------------------------------------------------------------- per-slot buffers (pg_module.c) */

/* Output per slot (out_rows each) and one input-gradient buffer (in_rows). */
int alloc_leaf_rows(pg_module *m, int nslots, int max_rows, int out_rows, int in_rows);
/* A row-wise module: its input and output rows are the same (this rank's with sequence parallelism). */
int alloc_leaf(pg_module *m, int nslots, int max_rows);

static inline float *slot_out(pg_module *m, int slot) {
  return (float *)(void *)((char *)m->out + (size_t)slot * m->slot_rows * m->out_width * act_bytes(m->out_bf16));
}

int check_rows(pg_module *m, int slot, const pg_io *io);
/* A saved pointer per slot: kept in a small array reallocated at alloc. */
int alloc_ptrs(const float ***arr, int nslots);
/* A working buffer of n floats on the module's backend (replacing *arr). */
float *alloc_floats(pg_module *m, float **arr, size_t n);

/* ---------------------------------------------------------------- recomputation's shared memory (module_arena.c) */

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

/* Allocates `inner` (one micro-batch) in the arena. */
int arena_alloc_block(pg_recompute_arena *a, pg_module *inner, int max_rows);
/* Selective recomputation: the region as one buffer of `bytes` (the largest asked for). */
float *arena_buffer(pg_recompute_arena *a, size_t bytes);
/* Where a module's lasting buffers go (tables filled once at alloc): never
 * the arena, whose region the next block's buffers reuse. */
const pg_backend *home_backend(const pg_backend *b);

/* ---------------------------------------------------------------- bf16 products (module_bf16.c) */

/* Precision "bf16" (pg_module_set_precision) for the modules whose products
 * are GEMMs with a weight (linear, lm_head): module_bf16.c says how. */
typedef struct bf16_mm {
  int on;
  uint16_t *w;    /* the working weight: numel bf16, in the backend's memory */
  size_t bytes;
  int64_t need[2]; /* scratch elements: [0] the input or output gradient, [1] the input */
  long refreshes;  /* working copies made so far */
  int gathered;    /* the working weight is the engine's ZeRO-3 gather (pg_param.data16): w stays NULL */
} bf16_mm;

void mm_free(pg_module *m, bf16_mm *mm);
/* pg_module_bf16_gathered for one product on weight w: the working weight freed, w gathered in bf16. */
void mm_gathered(pg_module *m, bf16_mm *mm, pg_param *w);
int mm_alloc(pg_module *m, bf16_mm *mm, int64_t wnumel, int rows, int64_t in, int64_t out);
/* Raises the engine's operand scratch to what mm needs (when on). */
void mm_need(const bf16_mm *mm, pg_bf16_need *need);
/* Raises the engine's float32 scratch to wide[] (elements). */
void raise_wide(pg_bf16_need *need, const int64_t wide[PG_WIDE_SCRATCH]);
int bf16_product_forward(pg_module *m, const pg_io *io, float *out, const float *x, const uint16_t *w16,
                         const float *bias, int N, int C, int OC);
int bf16_product_backward(pg_module *m, const pg_io *io, float *dinp, float *dw, float *dbias, const float *dy,
                          const float *x, const uint16_t *w16, int N, int C, int OC);
int mm_forward(pg_module *m, bf16_mm *mm, const pg_io *io, int refresh, const pg_param *w, float *out,
               const float *x, const float *bias, int N, int C, int OC);
int mm_fwd(pg_module *m, bf16_mm *mm, const pg_io *io, const pg_param *w, float *out, const float *x,
           const float *bias, int N, int C, int OC);
int mm_bwd(pg_module *m, bf16_mm *mm, const pg_io *io, float *dinp, const pg_param *w, float *dbias,
           const float *dy, const float *x, int N, int C, int OC);

#endif
