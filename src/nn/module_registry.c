/* module_registry.c: the registry of module kinds: every kind's descriptor
 * (module_impl.h) in one table, found by name. The only place that lists the
 * kinds; everyone else asks a descriptor's traits. */
#include "module_impl.h"

#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* In the order the Lua side lists them (core.module_kinds() is keyed by name, so the order is for reading). */
static const pg_module_kind *const kinds[] = {
    &pg_kind_sequential, &pg_kind_residual,   &pg_kind_recompute, &pg_kind_linear,    &pg_kind_layernorm,
    &pg_kind_rmsnorm,    &pg_kind_gelu,       &pg_kind_swiglu,    &pg_kind_attention, &pg_kind_embedding,
    &pg_kind_lm_head,    &pg_kind_moe,        &pg_kind_sp_gather, &pg_kind_sp_scatter, &pg_kind_custom,
    &pg_kind_objective,  &pg_kind_kv_heads,
};
#define NKINDS ((int)(sizeof kinds / sizeof kinds[0]))

static const pg_module_kind *kind_named(const char *name) {
  for (int i = 0; name && i < NKINDS; i++)
    if (!strcmp(kinds[i]->traits.name, name)) return kinds[i];
  return NULL;
}

int pg_module_kind_count(void) { return NKINDS; }

const pg_kind_traits *pg_module_kind_at(int i) { return i >= 0 && i < NKINDS ? &kinds[i]->traits : NULL; }

const pg_kind_traits *pg_module_kind_named(const char *name) {
  const pg_module_kind *k = kind_named(name);
  return k ? &k->traits : NULL;
}

/* An int field of a description. A value that does not fit an int is an
 * error naming the module, the key and the value (a vocab of 2^32 + 64 was
 * cast to 64 and built 64 rows); the first one is kept and *bad set, so that
 * a builder reads all its fields and then returns NULL once. */
int desc_int(const pg_desc *d, const char *name, const char *key, int def, int *bad) {
  int64_t v = d->ops->integer(d, key, def);
  if (v >= INT_MIN && v <= INT_MAX) return (int)v;
  if (!*bad)
    pg_fail("%s: %s = %lld does not fit a C int (at most %d)", *name ? name : "module", key, (long long)v, INT_MAX);
  *bad = 1;
  return 0;
}

static void desc_missing(const char *name, const char *key, int *bad) {
  if (!*bad) pg_fail("%s: %s is required (pg.nn's option schemas give it)", *name ? name : "module", key);
  *bad = 1;
}

double desc_number_required(const pg_desc *d, const char *name, const char *key, int *bad) {
  double v = d->ops->number(d, key, NAN);
  if (isnan(v)) desc_missing(name, key, bad);
  return v;
}

int desc_int_required(const pg_desc *d, const char *name, const char *key, int *bad) {
  if (d->ops->integer(d, key, INT64_MIN) == INT64_MIN) {
    desc_missing(name, key, bad);
    return 0;
  }
  return desc_int(d, name, key, 0, bad);
}

/* Only the kinds built from their fields: a container or a module written in
 * Lua named here is as unknown as a misspelt kind (its caller assembles it). */
pg_module *pg_module_build(pg_context *ctx, const char *kind, const char *name, const pg_desc *d, pg_module_env *env) {
  const pg_module_kind *k = kind_named(kind);
  if (k && k->build) return k->build(ctx, name, d, env);
  return pg_fail_null("%s: unknown module kind '%s'", name, kind);
}

pg_module *pg_module_assemble(pg_context *ctx, const char *kind, const char *name, pg_module **children, int n) {
  const pg_module_kind *k = kind_named(kind);
  if (k && k->assemble) return k->assemble(ctx, name, children, n);
  return pg_fail_null("%s: '%s' is no kind of container", name, kind);
}
