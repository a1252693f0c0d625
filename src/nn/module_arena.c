/* module_arena.c: recomputation's shared memory (pg_recompute_arena, module_impl.h). */
#include "module_impl.h"

#include <stdint.h>
#include <stdlib.h>

/* ---------------------------------------------------------------- recomputation's shared memory */

/* The arena (struct pg_recompute_arena, module_impl.h) is a backend of its own for the modules inside a
 * recomputed block: alloc carves from the region, release does nothing. */

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
int arena_alloc_block(pg_recompute_arena *a, pg_module *inner, int max_rows) {
  arena_begin(a);
  if (pg_module_alloc(inner, 1, max_rows)) return PG_ERR;
  if (a->requested <= a->cap) return PG_OK;
  if (arena_grow(a)) return PG_ERR;
  arena_begin(a);
  return pg_module_alloc(inner, 1, max_rows);
}

/* Selective recomputation: the region as one buffer of `bytes` (the largest
 * asked for), claimed by whoever computes into it. */
float *arena_buffer(pg_recompute_arena *a, size_t bytes) {
  arena_begin(a);
  a->requested = bytes;
  if (arena_grow(a)) return NULL;
  return (float *)a->region;
}

/* A lasting buffer's backend: the home one, for a module inside the arena. */
const pg_backend *home_backend(const pg_backend *b) {
  return b->ops->alloc == arena_alloc ? ((const pg_recompute_arena *)b)->home : b;
}
