#include "lua_util.h"

#include <limits.h>
#include <string.h>

#include "pg_comm.h"

pg_tensor *pg_lua_test_tensor(lua_State *L, int idx) { return luaL_testudata(L, idx, PG_TENSOR_MT); }

pg_tensor *pg_lua_check_any_tensor(lua_State *L, int idx) {
  pg_tensor *t = luaL_testudata(L, idx, PG_TENSOR_MT);
  if (!t) luaL_typeerror(L, idx, "pg tensor");
  if (!t->storage) luaL_error(L, "bad argument #%d: the tensor was freed", idx);
  return t;
}

pg_tensor *pg_lua_check_tensor(lua_State *L, int idx) {
  pg_tensor *t = pg_lua_check_any_tensor(L, idx);
  if (t->storage->device != PG_CPU)
    luaL_error(L, "bad argument #%d: the tensor is on %s:%d (device memory); copy it to the host with :to(\"cpu\")",
               idx, pg_device_name(t->storage->device), t->storage->device_index);
  return t;
}

/* Lua's collector sees only the small userdata, not the tensor memory behind
 * it: a loop making large tensors without :free() piled up gigabytes between
 * cycles (300 tensors of 16 MiB: 3.2 GB resident). A fresh storage of our
 * own therefore advances the collector as if Lua had allocated its bytes. */
static void account(lua_State *L, const pg_tensor *t) {
  const pg_storage *s = t->storage;
  if (s && s->refcount == 1 && s->owns_data && s->bytes >= ((size_t)64 << 10))
    lua_gc(L, LUA_GCSTEP, (int)(s->bytes < ((size_t)1 << 40) ? s->bytes >> 10 : (size_t)1 << 30));
}

pg_tensor *pg_lua_push_tensor(lua_State *L, const pg_tensor *t) {
  pg_tensor *u = lua_newuserdatauv(L, sizeof *u, 0);
  *u = *t;
  luaL_setmetatable(L, PG_TENSOR_MT);
  account(L, u);
  return u;
}

pg_tensor *pg_lua_new_tensor(lua_State *L, pg_dtype dtype, int ndim, const int64_t *shape) {
  pg_tensor *u = lua_newuserdatauv(L, sizeof *u, 0);
  memset(u, 0, sizeof *u);
  luaL_setmetatable(L, PG_TENSOR_MT);
  if (pg_tensor_init(u, dtype, ndim, shape)) luaL_error(L, "%s", pg_error());
  account(L, u);
  return u;
}

pg_tensor *pg_lua_check_tensor_shape(lua_State *L, int idx, const char *name, pg_dtype dtype, int ndim,
                                     const int64_t *shape) {
  pg_lua_check_tensor(L, idx);
  return pg_lua_check_any_tensor_shape(L, idx, name, dtype, ndim, shape);
}

pg_tensor *pg_lua_check_any_tensor_shape(lua_State *L, int idx, const char *name, pg_dtype dtype, int ndim,
                                         const int64_t *shape) {
  pg_tensor *t = pg_lua_check_any_tensor(L, idx);
  int ok = t->dtype == dtype && t->ndim == ndim;
  for (int i = 0; ok && i < ndim; i++) ok = shape[i] < 0 || t->shape[i] == shape[i];
  if (!ok) {
    char got[128], want[160];
    size_t k = 0;
    k += snprintf(want + k, sizeof want - k, "[");
    for (int i = 0; i < ndim; i++) {
      if (shape[i] < 0) k += snprintf(want + k, sizeof want - k, i ? ", *" : "*");
      else k += snprintf(want + k, sizeof want - k, i ? ", %lld" : "%lld", (long long)shape[i]);
    }
    snprintf(want + k, sizeof want - k, "] %s", pg_dtype_name(dtype));
    luaL_error(L, "%s: expected a %s tensor, got %s", name, want, pg_tensor_describe(t, got, sizeof got));
  }
  return t;
}

int pg_lua_check_shape(lua_State *L, int idx, int64_t *shape) {
  luaL_checktype(L, idx, LUA_TTABLE);
  int n = (int)luaL_len(L, idx);
  if (n > PG_MAX_DIMS) luaL_error(L, "shape has %d dimensions; at most %d are supported", n, PG_MAX_DIMS);
  for (int i = 0; i < n; i++) {
    lua_geti(L, idx, i + 1);
    int isint = 0;
    lua_Integer v = lua_tointegerx(L, -1, &isint);
    if (!isint || v < 0) luaL_error(L, "shape entry %d must be a non-negative integer, got %s", i + 1, luaL_tolstring(L, -1, NULL));
    shape[i] = v;
    lua_pop(L, 1);
  }
  return n;
}

/* luaL_where's "file:line" without its string formatting (a small
 * all_reduce's agreement step is a few microseconds; formatting was a good
 * part of it). */
void pg_lua_from_caller(lua_State *L, pg_context *c) {
  lua_Debug ar;
  char site[PG_SITE_MAX] = "";
  if (lua_getstack(L, 1, &ar) && lua_getinfo(L, "Sl", &ar) && ar.currentline > 0) {
    char line[24], *p = line + sizeof line;
    *--p = 0;
    for (int v = ar.currentline; v > 0; v /= 10) *--p = (char)('0' + v % 10);
    size_t a = strnlen(ar.short_src, sizeof site - 1), b = strlen(p);
    if (a + 1 + b >= sizeof site) a = sizeof site - 2 - b;
    memcpy(site, ar.short_src, a);
    site[a] = ':';
    memcpy(site + a + 1, p, b + 1);
  }
  pg_comm_call_site(c, site);
}

void pg_lua_comm_done(lua_State *L, pg_context *c, int rc) {
  pg_comm_call_site(c, NULL);
  if (rc != PG_OK) luaL_error(L, "%s", pg_error());
}

static int opt_field(lua_State *L, int idx, const char *key) {
  if (lua_isnoneornil(L, idx)) return 0;
  luaL_checktype(L, idx, LUA_TTABLE);
  if (lua_getfield(L, idx, key) == LUA_TNIL) {
    lua_pop(L, 1);
    return 0;
  }
  return 1;
}

lua_Integer pg_lua_opt_int(lua_State *L, int idx, const char *key, lua_Integer def) {
  idx = lua_absindex(L, idx);
  if (!opt_field(L, idx, key)) return def;
  int isint = 0;
  lua_Integer v = lua_tointegerx(L, -1, &isint);
  if (!isint) luaL_error(L, "option '%s' must be an integer, got %s", key, luaL_tolstring(L, -1, NULL));
  lua_pop(L, 1);
  return v;
}

lua_Integer pg_lua_opt_int_in(lua_State *L, int idx, const char *key, lua_Integer def, lua_Integer lo, lua_Integer hi) {
  lua_Integer v = pg_lua_opt_int(L, idx, key, def);
  if (v < lo || v > hi) luaL_error(L, "option '%s' must be an integer from %I to %I, got %I", key, lo, hi, v);
  return v;
}

int pg_lua_opt_cint(lua_State *L, int idx, const char *key, int def) {
  return (int)pg_lua_opt_int_in(L, idx, key, def, INT_MIN, INT_MAX);
}

int pg_lua_int_list(lua_State *L, int idx, const char *what, int64_t *out, int max) {
  idx = lua_absindex(L, idx);
  lua_Integer n = luaL_len(L, idx);
  if (n < 0 || n > INT_MAX) luaL_error(L, "%s: a list of %I entries", what, n);
  for (int i = 0; i < n && i < max; i++) {
    lua_geti(L, idx, i + 1);
    int isint = 0;
    lua_Integer v = lua_tointegerx(L, -1, &isint);
    if (!isint) luaL_error(L, "%s: entry %d must be an integer, got %s", what, i + 1, luaL_tolstring(L, -1, NULL));
    out[i] = (int64_t)v;
    lua_pop(L, 1);
  }
  return (int)n;
}

lua_Integer pg_lua_check_int_in(lua_State *L, int arg, const char *what, lua_Integer lo, lua_Integer hi) {
  int isint = 0;
  lua_Integer v = lua_tointegerx(L, arg, &isint);
  if (!isint)
    luaL_error(L, "bad argument #%d (%s): an integer expected, got %s", arg, what, luaL_tolstring(L, arg, NULL));
  if (v < lo || v > hi)
    luaL_error(L, "bad argument #%d (%s): an integer from %I to %I expected, got %I", arg, what, lo, hi, v);
  return v;
}

lua_Number pg_lua_opt_number(lua_State *L, int idx, const char *key, lua_Number def) {
  idx = lua_absindex(L, idx);
  if (!opt_field(L, idx, key)) return def;
  int isnum = 0;
  lua_Number v = lua_tonumberx(L, -1, &isnum);
  if (!isnum) luaL_error(L, "option '%s' must be a number, got %s", key, luaL_tolstring(L, -1, NULL));
  lua_pop(L, 1);
  return v;
}

const char *pg_lua_opt_string(lua_State *L, int idx, const char *key, const char *def) {
  idx = lua_absindex(L, idx);
  if (!opt_field(L, idx, key)) return def;
  if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "option '%s' must be a string, got %s", key, luaL_typename(L, -1));
  const char *s = lua_tostring(L, -1);
  lua_pop(L, 1); /* the string stays alive: it is still referenced by the options table */
  return s;
}

int pg_lua_opt_bool(lua_State *L, int idx, const char *key, int def) {
  idx = lua_absindex(L, idx);
  if (!opt_field(L, idx, key)) return def;
  if (!lua_isboolean(L, -1)) luaL_error(L, "option '%s' must be a boolean, got %s", key, luaL_typename(L, -1));
  int v = lua_toboolean(L, -1);
  lua_pop(L, 1);
  return v;
}

/* The message for an unknown key comes from pipegoose.options (Lua), the one
 * place that words it and finds the closest known name, so a suggestion reads
 * the same from C and Lua. Without the Lua files (the C module alone) the
 * known names are listed. Leaves the message on the stack. */
static void push_unknown_message(lua_State *L, const char *fname, int key, const char *const *allowed) {
  int top = lua_gettop(L);
  lua_getglobal(L, "require");
  lua_pushliteral(L, "pipegoose.options");
  if (lua_isfunction(L, -2) && lua_pcall(L, 1, 1, 0) == LUA_OK && lua_istable(L, -1) &&
      lua_getfield(L, -1, "unknown_message") == LUA_TFUNCTION) {
    lua_pushstring(L, fname);
    lua_pushvalue(L, key);
    lua_newtable(L);
    for (int i = 0; allowed[i]; i++) {
      lua_pushstring(L, allowed[i]);
      lua_rawseti(L, -2, i + 1);
    }
    if (lua_pcall(L, 3, 1, 0) == LUA_OK && lua_type(L, -1) == LUA_TSTRING) {
      lua_replace(L, top + 1);
      lua_settop(L, top + 1);
      return;
    }
  }
  lua_settop(L, top);
  const char *k = luaL_tolstring(L, key, NULL);
  lua_pushfstring(L, "%s: unknown option '%s' (known: ", fname, k);
  int n = 1;
  for (const char *const *a = allowed; *a; a++, n++) lua_pushfstring(L, "%s%s", a == allowed ? "" : ", ", *a);
  lua_pushliteral(L, ")");
  lua_concat(L, n + 1);
  lua_replace(L, top + 1); /* over the tolstring copy */
}

void pg_lua_check_keys(lua_State *L, int idx, const char *fname, const char *const *allowed) {
  if (lua_isnoneornil(L, idx)) return;
  idx = lua_absindex(L, idx);
  if (!lua_istable(L, idx)) luaL_error(L, "%s: expects a table of options, got %s", fname, luaL_typename(L, idx));
  lua_pushnil(L);
  while (lua_next(L, idx)) {
    lua_pop(L, 1);
    int ok = 0;
    if (lua_type(L, -1) == LUA_TSTRING) {
      const char *k = lua_tostring(L, -1);
      for (const char *const *a = allowed; *a && !ok; a++) ok = !strcmp(*a, k);
    }
    if (!ok) {
      push_unknown_message(L, fname, lua_gettop(L), allowed);
      luaL_where(L, 1); /* the Lua line that called, as luaL_error says it */
      lua_insert(L, -2);
      lua_concat(L, 2);
      lua_error(L);
    }
  }
}
