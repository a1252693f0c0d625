/* pg_module.c: the module framework: modules and their parameters, per-slot
 * buffers, and the walks over a tree (free, backend, recomputation's memory,
 * allocation, parameters, activation bytes, who writes which gradients).
 * What a walk does at a module is its descriptor's to say (module_impl.h). */
#include "module_impl.h"

#include <stdlib.h>
#include <string.h>

#include "pg_rng.h"
#include "pg_size.h"

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

/* ---------------------------------------------------------------- modules and parameters */

pg_module *module_new(const pg_module_kind *kind, pg_context *ctx, const char *name, int in_w, int out_w,
                      size_t state_size) {
  pg_module *m = calloc(1, sizeof *m);
  if (!m) return pg_fail_null("out of memory");
  m->kind = kind;
  m->ops = &kind->ops;
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
pg_param *param_make_blocks(const char *module_name, const char *suffix, int ndim, const int64_t *full_shape,
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

pg_param *param_make(const char *module_name, const char *suffix, int ndim, const int64_t *full_shape,
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

int add_param(pg_module *m, pg_param *p) {
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

/* ---------------------------------------------------------------- per-slot buffers */

int alloc_leaf_rows(pg_module *m, int nslots, int max_rows, int out_rows, int in_rows) {
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

int alloc_leaf(pg_module *m, int nslots, int max_rows) {
  int rows = mod_rows_max(m, max_rows);
  return alloc_leaf_rows(m, nslots, max_rows, rows, rows);
}

int check_rows(pg_module *m, int slot, const pg_io *io) {
  if (slot < 0 || slot >= m->nslots) return pg_fail("%s: slot %d out of range (%d slots)", m->name, slot, m->nslots);
  if ((int64_t)io->B * io->T > m->max_rows)
    return pg_fail("%s: %d x %d rows exceed the %d allocated", m->name, io->B, io->T, m->max_rows);
  return PG_OK;
}

int alloc_ptrs(const float ***arr, int nslots) {
  free(*arr);
  *arr = calloc((size_t)nslots, sizeof **arr);
  return *arr ? PG_OK : pg_fail("out of memory");
}

float *alloc_floats(pg_module *m, float **arr, size_t n) {
  pg_be_release(BE(m), *arr);
  *arr = n ? pg_be_floats(BE(m), n) : NULL;
  return *arr;
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

void pg_module_release_cache(pg_module *m) {
  if (!m) return;
  for (int i = 0; i < m->nchildren; i++) pg_module_release_cache(m->children[i]);
  if (m->kind->release_cache) m->kind->release_cache(m);
}

int pg_module_check_decode(const pg_module *m) {
  /* a Lua module may depend on positions the cache path cannot give it; sequence parallelism splits a
   * call's rows over the tensor group, which the per-sequence positions do not follow */
  if (kind_has(m, PG_KIND_WRITTEN_IN_LUA))
    return pg_fail("%s: a module written in Lua has no key/value cache path (generate with cache = false)", m->name);
  if (sp_active(m))
    return pg_fail("%s: sequence parallelism has no key/value cache path (generate with cache = false)", m->name);
  for (int i = 0; i < m->nchildren; i++)
    if (pg_module_check_decode(m->children[i])) return PG_ERR;
  return PG_OK;
}

int pg_module_use_recompute_arena(pg_module *m, pg_recompute_arena *a) {
  if (m->nslots) return pg_fail("%s: recomputation's memory must be chosen before the buffers are allocated", m->name);
  if (kind_has(m, PG_KIND_RECOMPUTES)) {
    m->arena = a;
    /* the block inside allocates from the arena; anything recomputing within it is already covered */
    return pg_module_set_backend(m->children[0], &a->be);
  }
  size_t part = 0;
  if (m->kind->selective && m->kind->selective(m, &part)) m->arena = a;
  for (int i = 0; i < m->nchildren; i++)
    if (pg_module_use_recompute_arena(m->children[i], a)) return PG_ERR;
  return PG_OK;
}

int pg_module_set_backend(pg_module *m, const pg_backend *be) {
  if (m->be != be && (m->out || m->dinp || m->nslots))
    return pg_fail("%s: the backend must be chosen before the buffers are allocated", m->name);
  /* kinds computed on the host (Lua callbacks) say why */
  if (m->kind->traits.host_only && be->device != PG_CPU)
    return pg_fail("%s: %s, not %s", m->name, m->kind->traits.host_only, be->name);
  m->be = be;
  for (int i = 0; i < m->nchildren; i++)
    if (pg_module_set_backend(m->children[i], be)) return PG_ERR;
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
  if (kind_has(m, PG_KIND_RECOMPUTES)) return b; /* the block inside keeps one micro-batch: pg_module_fixed_bytes */
  for (int i = 0; i < m->nchildren; i++) b += pg_module_saved_bytes(m->children[i]);
  return b;
}

size_t pg_module_fixed_bytes(const pg_module *m) {
  size_t part = 0;
  if (m->kind->selective && m->kind->selective(m, &part)) return part;
  if (kind_has(m, PG_KIND_RECOMPUTES)) return pg_module_saved_bytes(m->children[0]) + pg_module_fixed_bytes(m->children[0]);
  size_t b = 0;
  for (int i = 0; i < m->nchildren; i++) {
    size_t c = pg_module_fixed_bytes(m->children[i]);
    if (c > b) b = c;
  }
  return b;
}

/* ---------------------------------------------------------------- who writes which gradients */

pg_param *pg_embedding_weight(pg_module *m) {
  if (!m || !m->kind->tie_weight) return NULL;
  return m->kind->tie_weight(m);
}

int pg_module_borrowed_params(const pg_module *m, pg_param **out, int cap) {
  int n = 0;
  pg_param *p = m->kind->borrowed ? m->kind->borrowed(m) : NULL;
  if (p) {
    if (n < cap) out[n] = p;
    n++;
  }
  for (int i = 0; i < m->nchildren; i++)
    n += pg_module_borrowed_params(m->children[i], out ? out + (n < cap ? n : cap) : NULL, n < cap ? cap - n : 0);
  return n;
}

const pg_module *pg_module_find_foreign_writer(const pg_module *m) {
  if (kind_has(m, PG_KIND_WRITTEN_IN_LUA) && m->nparams > 0) return m;
  for (int i = 0; i < m->nchildren; i++) {
    const pg_module *f = pg_module_find_foreign_writer(m->children[i]);
    if (f) return f;
  }
  return NULL;
}
