/* Lua bindings for the kernels: pg.ops.*, on host or device tensors (the backend seam's kernels, below:
 * "where a call runs"), functional style (every call
 * returns new tensors; backward functions return fresh, zero-started
 * parameter gradients, or add into the buffers of an optional trailing
 * table such as {dw=, db=}, the kernels' += contract). Leading dimensions of activations flatten to rows,
 * so x may be [N, C] or [B, T, C]. Each argument is checked, and a mismatch
 * names the function, the argument, and both shapes. */
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <string.h>

#include "kernels.h"
#include "lua_util.h"
#include "pg_backend.h"
#include "pg_cpu_bf16_gemm.h"
#include "pg_size.h"

/* ---- where a call runs ----
 * A call runs where its lead tensor (the first one it checks) lives: host
 * tensors on the CPU backend, device tensors on theirs, through the backend
 * seam's kernels (kernels/kernel_list.h). The CPU backend's adapters call
 * the very kernels of kernels.h, so host results are what they always were,
 * bit for bit; a device call's equal the CPU's within the CUDA self-test's
 * tolerance of each kernel. Its outputs are made on the same backend, and
 * every other tensor of the call must be there too: a mixed call is refused
 * naming the argument and both devices (nothing is copied behind the
 * caller's back). A function with no device kernel takes host tensors only
 * and says so by name.
 *
 * `at` in the checks below: NULL, the function runs on host tensors only;
 * *at NULL, the tensor leads the call, *at becomes its backend; otherwise
 * the tensor must be on *at. */

static void check_place(lua_State *L, const pg_tensor *t, const char *fn, const char *name, const pg_backend **at) {
  char here[48], there[48];
  if (!at) {
    if (t->storage->device != PG_CPU)
      luaL_error(L, "%s: %s: expected a cpu tensor, got a %s:%d one (%s has no device kernel: copy it with :to(\"cpu\"))",
                 fn, name, pg_device_name(t->storage->device), t->storage->device_index, fn);
    return;
  }
  const pg_backend *b = pg_backend_of(t->storage);
  if (!b) luaL_error(L, "%s: %s: %s", fn, name, pg_error());
  if (!*at) *at = b;
  else if (b != *at)
    luaL_error(L, "%s: %s: a %s tensor in a call on %s: the tensors of one call share a device (copy with :to())", fn,
               name, pg_backend_place(b, here, sizeof here), pg_backend_place(*at, there, sizeof there));
}

/* A tensor of dtype `dtype` and exactly `shape` (entries < 0: any), placed as `at` says. */
static pg_tensor *expect_at(lua_State *L, int idx, const char *fn, const char *name, pg_dtype dtype, int ndim,
                            const int64_t *shape, const pg_backend **at) {
  char label[96];
  snprintf(label, sizeof label, "%s: %s", fn, name);
  pg_tensor *t = pg_lua_check_any_tensor_shape(L, idx, label, dtype, ndim, shape);
  check_place(L, t, fn, name, at);
  return t;
}

/* The same for a function that runs on host tensors only. */
static pg_tensor *expect(lua_State *L, int idx, const char *fn, const char *name, pg_dtype dtype, int ndim,
                         const int64_t *shape) {
  return expect_at(L, idx, fn, name, dtype, ndim, shape, NULL);
}

/* A float32 tensor of any shape, placed as `at` says. */
static pg_tensor *f32_arg(lua_State *L, int idx, const char *fn, const char *name, const pg_backend **at) {
  pg_tensor *t = pg_lua_check_any_tensor(L, idx);
  int64_t any[PG_MAX_DIMS];
  for (int i = 0; i < PG_MAX_DIMS; i++) any[i] = -1;
  return expect_at(L, idx, fn, name, PG_FLOAT32, t->ndim, any, at);
}

/* Rows of features: a float32 tensor with at least 2 dimensions and last
 * dimension `last` (< 0: any). *rows = the product of the leading ones. */
static pg_tensor *rows_arg_bf16(lua_State *L, int idx, const char *fn, const char *name, int64_t last, int64_t *rows,
                                int bf16_ok, const pg_backend **at) {
  pg_tensor *t = pg_lua_check_any_tensor(L, idx);
  int dtype_ok = t->dtype == PG_FLOAT32 || (bf16_ok && t->dtype == PG_BFLOAT16);
  if (!dtype_ok || t->ndim < 2 || (last >= 0 && t->shape[t->ndim - 1] != last)) {
    char got[128], want[48];
    if (last >= 0) snprintf(want, sizeof want, "%lld", (long long)last);
    else snprintf(want, sizeof want, "*");
    luaL_error(L, "%s: %s: expected a [..., %s] %s tensor (2 or more dimensions), got %s", fn, name, want,
               bf16_ok ? "float32 or bfloat16" : "float32", pg_tensor_describe(t, got, sizeof got));
  }
  check_place(L, t, fn, name, at);
  int64_t c = t->shape[t->ndim - 1], n = c ? t->numel / c : 0;
  if (n > INT_MAX || c > INT_MAX)
    luaL_error(L, "%s: %s: %I rows of %I exceed the kernels' int range", fn, name, (lua_Integer)n, (lua_Integer)c);
  if (rows) *rows = n;
  return t;
}
static pg_tensor *rows_at(lua_State *L, int idx, const char *fn, const char *name, int64_t last, int64_t *rows,
                          const pg_backend **at) {
  return rows_arg_bf16(L, idx, fn, name, last, rows, 0, at);
}
static pg_tensor *rows_arg(lua_State *L, int idx, const char *fn, const char *name, int64_t last, int64_t *rows) {
  return rows_at(L, idx, fn, name, last, rows, NULL);
}

/* An argument shaped like `like` with its last dimension replaced by `last`. */
static pg_tensor *like_arg(lua_State *L, int idx, const char *fn, const char *name, const pg_tensor *like,
                           int64_t last, pg_dtype dtype, const pg_backend **at) {
  int64_t shape[PG_MAX_DIMS];
  memcpy(shape, like->shape, sizeof shape);
  shape[like->ndim - 1] = last;
  return expect_at(L, idx, fn, name, dtype, like->ndim, shape, at);
}

/* An argument shaped like the leading dimensions of `like` (one value per row). */
static pg_tensor *lead_arg(lua_State *L, int idx, const char *fn, const char *name, const pg_tensor *like,
                           pg_dtype dtype, const pg_backend **at) {
  return expect_at(L, idx, fn, name, dtype, like->ndim - 1, like->shape, at);
}

/* New zeroed tensor in backend b's memory, pushed on the stack. */
static pg_tensor *new_on(lua_State *L, const pg_backend *b, pg_dtype dtype, int ndim, const int64_t *shape) {
  if (b->device == PG_CPU) return pg_lua_new_tensor(L, dtype, ndim, shape);
  pg_tensor t;
  if (pg_backend_tensor(b, &t, dtype, ndim, shape)) luaL_error(L, "%s", pg_error());
  return pg_lua_push_tensor(L, &t);
}

/* New zeroed float32 tensor on b: `like`'s shape with the last dimension `last`. */
static pg_tensor *new_like(lua_State *L, const pg_backend *b, const pg_tensor *like, int64_t last) {
  int64_t shape[PG_MAX_DIMS];
  memcpy(shape, like->shape, sizeof shape);
  shape[like->ndim - 1] = last;
  return new_on(L, b, PG_FLOAT32, like->ndim, shape);
}

/* New zeroed float32 tensor on b of `like`'s leading dimensions. */
static pg_tensor *new_lead(lua_State *L, const pg_backend *b, const pg_tensor *like) {
  return new_on(L, b, PG_FLOAT32, like->ndim - 1, like->shape);
}

/* A kernel of the seam on backend b; its error (a device fault, out of memory) raised naming fn. */
#define RUN(L, fn, b, kernel, ...) ran((L), (fn), (b)->ops->kernel((b), __VA_ARGS__))
static void ran(lua_State *L, const char *fn, int rc) {
  if (rc) luaL_error(L, "%s: %s", fn, pg_error());
}

/* dst = src (the same shape; both on one backend, any). */
static void copy_into(lua_State *L, const char *fn, pg_tensor *dst, const pg_tensor *src) {
  ran(L, fn, pg_backend_copy_tensor(dst, src));
}

/* An int32 tensor's values readable on the host (checks of ids and targets):
 * its own data, or a host copy pushed on the stack (collected with it). */
static const int32_t *host_i32(lua_State *L, const char *fn, const pg_tensor *t) {
  if (t->storage->device == PG_CPU) return pg_tensor_i32(t);
  pg_tensor *h = pg_lua_new_tensor(L, PG_INT32, t->ndim, t->shape);
  copy_into(L, fn, h, t);
  return pg_tensor_i32(h);
}

static int int_arg(lua_State *L, int idx, const char *fn, const char *name, lua_Integer lo, lua_Integer def,
                   int optional) {
  if (optional && lua_isnoneornil(L, idx)) return (int)def;
  int isint = 0;
  lua_Integer v = lua_tointegerx(L, idx, &isint);
  if (!isint) luaL_error(L, "%s: %s: expected an integer, got %s", fn, name, luaL_typename(L, idx));
  if (v < lo || v > INT_MAX) luaL_error(L, "%s: %s: expected an integer >= %I, got %I", fn, name, lo, v);
  return (int)v;
}

/* A number option: finite and in [lo, hi] (hi_open: [lo, hi)); absent: def, or an error when required. NaN
 * is named as NaN, never read as "absent". */
static double opt_number_range(lua_State *L, int idx, const char *fn, const char *key, double def, double lo,
                               double hi, int hi_open, int required) {
  int t = lua_getfield(L, idx, key);
  if (t == LUA_TNIL) {
    lua_pop(L, 1);
    if (required) luaL_error(L, "%s: option '%s' is required", fn, key);
    return def;
  }
  if (t != LUA_TNUMBER) luaL_error(L, "%s: %s: expected a number, got %s", fn, key, luaL_typename(L, -1));
  double v = lua_tonumber(L, -1);
  lua_pop(L, 1);
  if (!isfinite(v) || v < lo || v > hi || (hi_open && v == hi)) {
    char msg[200]; /* lua_pushfstring has no %g */
    if (!isfinite(v)) snprintf(msg, sizeof msg, "%s=%s is not a finite number", key, isnan(v) ? "nan" : v > 0 ? "inf" : "-inf");
    else snprintf(msg, sizeof msg, "%s=%g out of range [%g, %g%s", key, v, lo, hi, hi_open ? ")" : "]");
    luaL_error(L, "%s: %s", fn, msg);
  }
  return v;
}

static int opt_int_range(lua_State *L, int idx, const char *fn, const char *key, lua_Integer def, lua_Integer lo,
                         lua_Integer hi) {
  lua_Integer v = pg_lua_opt_int(L, idx, key, def);
  if (v < lo || v > hi) luaL_error(L, "%s: %s=%I out of range [%I, %I]", fn, key, v, lo, hi);
  return (int)v;
}

/* A parameter gradient to write, on the call's backend *at: acc[key] when
 * the optional table at idx holds it (the kernel then ACCUMULATES into it,
 * its += contract), else a new zeroed tensor. Either way the tensor is left
 * on the stack. */
static pg_tensor *grad_out(lua_State *L, int idx, const char *fn, const char *key, int ndim, const int64_t *shape,
                           const pg_backend **at) {
  if (!lua_isnoneornil(L, idx)) {
    if (lua_getfield(L, idx, key) != LUA_TNIL) return expect_at(L, lua_gettop(L), fn, key, PG_FLOAT32, ndim, shape, at);
    lua_pop(L, 1);
  }
  return new_on(L, *at, PG_FLOAT32, ndim, shape);
}

static void check_acc(lua_State *L, int idx, const char *fn, const char *const *keys) {
  if (lua_isnoneornil(L, idx)) return;
  if (!lua_istable(L, idx)) luaL_error(L, "%s: argument %d: expected a table of gradients to accumulate into, got %s", fn, idx,
                                       luaL_typename(L, idx));
  pg_lua_check_keys(L, idx, fn, keys);
}

/* ---- embeddings ---- */

/* Token ids against the table they index, as the engine checks a batch: without row_start the weight is the
 * whole table, so every id is one of its rows [0, rows); with row_start (one vocabulary shard: ids of other
 * shards give zeros, their shard adds them) an id must still be a vocabulary id, so not negative. */
static void check_ids(lua_State *L, const char *fn, const char *what, const pg_tensor *ids, int whole, int64_t rows) {
  const int32_t *t = host_i32(L, fn, ids);
  for (int64_t i = 0; i < ids->numel; i++)
    if (t[i] < 0 || (whole && t[i] >= rows)) {
      if (whole)
        luaL_error(L, "%s: %s: id %d at position %I is outside the vocabulary [0, %I) (the weight's rows)", fn, what,
                   t[i], (lua_Integer)(i + 1), (lua_Integer)rows);
      else
        luaL_error(L, "%s: %s: id %d at position %I is negative: not a vocabulary id", fn, what, t[i],
                   (lua_Integer)(i + 1));
    }
}

/* embedding(tokens_i32[...], weight[rows, C] [, row_start=0]) -> out[..., C] */
static int l_embedding(lua_State *L) {
  const char *fn = "ops.embedding";
  const pg_backend *b = NULL;
  pg_tensor *tok = pg_lua_check_any_tensor(L, 1);
  int64_t any[PG_MAX_DIMS];
  for (int i = 0; i < PG_MAX_DIMS; i++) any[i] = -1;
  expect_at(L, 1, fn, "tokens", PG_INT32, tok->ndim, any, &b);
  pg_tensor *w = expect_at(L, 2, fn, "weight", PG_FLOAT32, 2, any, &b);
  int row_start = int_arg(L, 3, fn, "row_start", 0, 0, 1);
  if (tok->ndim >= PG_MAX_DIMS) return luaL_error(L, "%s: tokens: too many dimensions", fn);
  if (tok->numel > INT_MAX || w->shape[0] > INT_MAX || w->shape[1] > INT_MAX)
    return luaL_error(L, "%s: sizes exceed the kernels' int range", fn);
  check_ids(L, fn, "tokens", tok, lua_isnoneornil(L, 3), w->shape[0]);
  int64_t shape[PG_MAX_DIMS];
  memcpy(shape, tok->shape, sizeof shape);
  shape[tok->ndim] = w->shape[1];
  pg_tensor *out = new_on(L, b, PG_FLOAT32, tok->ndim + 1, shape);
  RUN(L, fn, b, embedding_forward, pg_tensor_f32(out), pg_tensor_i32(tok), pg_tensor_f32(w), (int)tok->numel,
      (int)w->shape[1], row_start, (int)w->shape[0]);
  return 1;
}

/* embedding_backward(dout[..., C], tokens[...], rows [, row_start=0 [, {dweight=}]]) -> dweight[rows, C] */
static int l_embedding_backward(lua_State *L) {
  const char *fn = "ops.embedding_backward";
  lua_settop(L, 5); /* results are pushed above the (optional) gradient table */
  const pg_backend *b = NULL;
  int64_t C;
  pg_tensor *dout = rows_at(L, 1, fn, "dout", -1, NULL, &b);
  C = dout->shape[dout->ndim - 1];
  pg_tensor *tok = expect_at(L, 2, fn, "tokens", PG_INT32, dout->ndim - 1, dout->shape, &b);
  int rows = int_arg(L, 3, fn, "rows", 0, 0, 0);
  int row_start = int_arg(L, 4, fn, "row_start", 0, 0, 1);
  check_ids(L, fn, "tokens", tok, lua_isnoneornil(L, 4), rows);
  static const char *const keys[] = {"dweight", NULL};
  check_acc(L, 5, fn, keys);
  pg_tensor *dw = grad_out(L, 5, fn, "dweight", 2, (int64_t[]){rows, C}, &b);
  RUN(L, fn, b, embedding_backward, pg_tensor_f32(dw), pg_tensor_f32(dout), pg_tensor_i32(tok), (int)tok->numel,
      (int)C, row_start, rows);
  return 1;
}

/* T for position ops: x is [B, T, C] (T must match) or [N, C] (T must divide N). */
static int position_T(lua_State *L, int idx, const char *fn, const pg_tensor *x, int64_t N) {
  int T = int_arg(L, idx, fn, "T", 1, 0, 0);
  if (x->ndim == 3 && x->shape[1] != T)
    luaL_error(L, "%s: T=%d but the input is [B, T, C] with T=%I", fn, T, (lua_Integer)x->shape[1]);
  if (N % T) luaL_error(L, "%s: T=%d does not divide the %I rows of the input", fn, T, (lua_Integer)N);
  return T;
}

/* position(x[B,T,C] or [N,C], wpe[Tmax, C], T) -> x + wpe[t] on each row */
static int l_position(lua_State *L) {
  const char *fn = "ops.position";
  const pg_backend *b = NULL;
  int64_t N;
  pg_tensor *x = rows_at(L, 1, fn, "x", -1, &N, &b);
  int64_t C = x->shape[x->ndim - 1];
  pg_tensor *wpe = expect_at(L, 2, fn, "wpe", PG_FLOAT32, 2, (int64_t[]){-1, C}, &b);
  int T = position_T(L, 3, fn, x, N);
  if (T > wpe->shape[0]) return luaL_error(L, "%s: T=%d exceeds the %I positions of wpe", fn, T, (lua_Integer)wpe->shape[0]);
  pg_tensor *out = new_like(L, b, x, C);
  copy_into(L, fn, out, x);
  RUN(L, fn, b, position_forward, pg_tensor_f32(out), pg_tensor_f32(wpe), (int)N, T, (int)C);
  return 1;
}

/* position_backward(dout, T [, {dwpe=}]) -> dwpe[T, C] */
static int l_position_backward(lua_State *L) {
  const char *fn = "ops.position_backward";
  lua_settop(L, 3); /* results are pushed above the (optional) gradient table */
  const pg_backend *b = NULL;
  int64_t N;
  pg_tensor *dout = rows_at(L, 1, fn, "dout", -1, &N, &b);
  int64_t C = dout->shape[dout->ndim - 1];
  int T = position_T(L, 2, fn, dout, N);
  static const char *const keys[] = {"dwpe", NULL};
  check_acc(L, 3, fn, keys);
  pg_tensor *dw = grad_out(L, 3, fn, "dwpe", 2, (int64_t[]){T, C}, &b);
  RUN(L, fn, b, position_backward, pg_tensor_f32(dw), pg_tensor_f32(dout), (int)N, T, (int)C);
  return 1;
}

/* ---- layer norm ---- */

/* layernorm(x, w[C], b[C]) -> y, mean, rstd (mean and rstd: x's leading shape) */
static int l_layernorm(lua_State *L) {
  const char *fn = "ops.layernorm";
  const pg_backend *b = NULL;
  int64_t N;
  pg_tensor *x = rows_at(L, 1, fn, "x", -1, &N, &b);
  int64_t C = x->shape[x->ndim - 1];
  pg_tensor *w = expect_at(L, 2, fn, "w", PG_FLOAT32, 1, &C, &b);
  pg_tensor *bias = expect_at(L, 3, fn, "b", PG_FLOAT32, 1, &C, &b);
  pg_tensor *y = new_like(L, b, x, C), *mean = new_lead(L, b, x), *rstd = new_lead(L, b, x);
  RUN(L, fn, b, layernorm_forward, pg_tensor_f32(y), pg_tensor_f32(mean), pg_tensor_f32(rstd), pg_tensor_f32(x),
      pg_tensor_f32(w), pg_tensor_f32(bias), (int)N, (int)C);
  return 3;
}

/* layernorm_backward(dy, x, w, mean, rstd [, {dw=, db=}]) -> dx, dw, db */
static int l_layernorm_backward(lua_State *L) {
  const char *fn = "ops.layernorm_backward";
  lua_settop(L, 6); /* results are pushed above the (optional) gradient table */
  const pg_backend *b = NULL;
  int64_t N;
  pg_tensor *x = rows_at(L, 2, fn, "x", -1, &N, &b);
  int64_t C = x->shape[x->ndim - 1];
  pg_tensor *dy = like_arg(L, 1, fn, "dy", x, C, PG_FLOAT32, &b);
  pg_tensor *w = expect_at(L, 3, fn, "w", PG_FLOAT32, 1, &C, &b);
  pg_tensor *mean = lead_arg(L, 4, fn, "mean", x, PG_FLOAT32, &b);
  pg_tensor *rstd = lead_arg(L, 5, fn, "rstd", x, PG_FLOAT32, &b);
  pg_tensor *dx = new_like(L, b, x, C);
  static const char *const keys[] = {"dw", "db", NULL};
  check_acc(L, 6, fn, keys);
  pg_tensor *dw = grad_out(L, 6, fn, "dw", 1, &C, &b), *db = grad_out(L, 6, fn, "db", 1, &C, &b);
  RUN(L, fn, b, layernorm_backward, pg_tensor_f32(dx), pg_tensor_f32(dw), pg_tensor_f32(db), pg_tensor_f32(dy),
      pg_tensor_f32(x), pg_tensor_f32(w), pg_tensor_f32(mean), pg_tensor_f32(rstd), (int)N, (int)C);
  return 3;
}

/* ---- linear ---- */

/* linear(x[..., C], w[OC, C] [, b[OC]]) -> y[..., OC] */
static int l_linear(lua_State *L) {
  const char *fn = "ops.linear";
  const pg_backend *b = NULL;
  int64_t N;
  pg_tensor *x = rows_at(L, 1, fn, "x", -1, &N, &b);
  int64_t C = x->shape[x->ndim - 1];
  pg_tensor *w = expect_at(L, 2, fn, "w", PG_FLOAT32, 2, (int64_t[]){-1, C}, &b);
  int64_t OC = w->shape[0];
  if (OC > INT_MAX) return luaL_error(L, "%s: w: %I output features exceed the kernels' int range", fn, (lua_Integer)OC);
  pg_tensor *bias = lua_isnoneornil(L, 3) ? NULL : expect_at(L, 3, fn, "b", PG_FLOAT32, 1, &OC, &b);
  pg_tensor *y = new_like(L, b, x, OC);
  RUN(L, fn, b, matmul_forward, pg_tensor_f32(y), pg_tensor_f32(x), pg_tensor_f32(w), bias ? pg_tensor_f32(bias) : NULL,
      (int)N, (int)C, (int)OC);
  return 1;
}

/* linear_backward(dy, x, w [, with_bias=true [, {dw=, db=}]]) -> dx, dw, db (or nil) */
static int l_linear_backward(lua_State *L) {
  const char *fn = "ops.linear_backward";
  lua_settop(L, 5); /* results are pushed above the (optional) gradient table */
  const pg_backend *b = NULL;
  int64_t N;
  pg_tensor *x = rows_at(L, 2, fn, "x", -1, &N, &b);
  int64_t C = x->shape[x->ndim - 1];
  pg_tensor *w = expect_at(L, 3, fn, "w", PG_FLOAT32, 2, (int64_t[]){-1, C}, &b);
  int64_t OC = w->shape[0];
  pg_tensor *dy = like_arg(L, 1, fn, "dy", x, OC, PG_FLOAT32, &b);
  int with_bias = lua_isnoneornil(L, 4) ? 1 : lua_toboolean(L, 4);
  static const char *const keys[] = {"dw", "db", NULL};
  check_acc(L, 5, fn, keys);
  pg_tensor *dx = new_like(L, b, x, C), *dw = grad_out(L, 5, fn, "dw", 2, (int64_t[]){OC, C}, &b);
  pg_tensor *db = NULL;
  if (with_bias) db = grad_out(L, 5, fn, "db", 1, &OC, &b);
  else lua_pushnil(L);
  RUN(L, fn, b, matmul_backward, pg_tensor_f32(dx), pg_tensor_f32(dw), db ? pg_tensor_f32(db) : NULL,
      pg_tensor_f32(dy), pg_tensor_f32(x), pg_tensor_f32(w), (int)N, (int)C, (int)OC);
  return 3;
}

/* ---- bfloat16 ---- */

/* bf16_round(x) -> float32 tensor of x's values rounded to bfloat16 (nearest, ties to even). */
static int l_bf16_round(lua_State *L) {
  pg_tensor *x = pg_lua_check_any_tensor(L, 1);
  check_place(L, x, "ops.bf16_round", "x", NULL);
  if (x->dtype != PG_FLOAT32) {
    char got[128];
    return luaL_error(L, "ops.bf16_round: x: expected a cpu float32 tensor, got %s", pg_tensor_describe(x, got, sizeof got));
  }
  pg_tensor *y = pg_lua_new_tensor(L, PG_FLOAT32, x->ndim, x->shape);
  const float *a = pg_tensor_f32(x);
  float *b = pg_tensor_f32(y);
  for (int64_t i = 0; i < x->numel; i++) b[i] = pg_bf16_value(pg_bf16_round(a[i]));
  return 1;
}

/* A tensor's values as bf16 on backend b: a bfloat16 tensor's own data, else (float32) a rounded copy
 * (the seam's bf16_from_f32) in a tensor pushed on the stack (collected with it). */
static const uint16_t *bf16_operand(lua_State *L, const char *fn, const pg_backend *b, const pg_tensor *t) {
  if (t->dtype == PG_BFLOAT16) return pg_tensor_data(t);
  pg_tensor *h = new_on(L, b, PG_BFLOAT16, t->ndim, t->shape);
  RUN(L, fn, b, bf16_from_f32, pg_tensor_data(h), pg_tensor_f32(t), t->numel);
  return pg_tensor_data(h);
}

/* A weight [rows, C] (rows < 0: any), float32 or bfloat16, on the call's backend. */
static pg_tensor *bf16_weight_arg(lua_State *L, int idx, const char *fn, int64_t C, const pg_backend **at) {
  pg_tensor *w = pg_lua_check_any_tensor(L, idx);
  return expect_at(L, idx, fn, "w", w->dtype == PG_BFLOAT16 ? PG_BFLOAT16 : PG_FLOAT32, 2, (int64_t[]){-1, C}, at);
}

/* to_bf16(x) -> a bfloat16 tensor of x's values (nearest, ties to even). */
static int l_to_bf16(lua_State *L) {
  const pg_backend *b = NULL;
  pg_tensor *x = f32_arg(L, 1, "ops.to_bf16", "x", &b);
  pg_tensor *y = new_on(L, b, PG_BFLOAT16, x->ndim, x->shape);
  RUN(L, "ops.to_bf16", b, bf16_from_f32, pg_tensor_data(y), pg_tensor_f32(x), x->numel);
  return 1;
}

/* to_f16(x [, name]) -> a float16 tensor of x's values (nearest, ties to even, kernels.h's pg_f16_round:
 * the one float16 rounding). A NaN, an infinity or a value that rounds past binary16's largest (65504:
 * |x| >= 65520) is refused, naming `name` (default "x") and the element: an export must not turn a weight
 * into inf. */
static int l_to_f16(lua_State *L) {
  pg_tensor *x = pg_lua_check_any_tensor(L, 1);
  const char *name = luaL_optstring(L, 2, "x");
  check_place(L, x, "ops.to_f16", name, NULL);
  if (x->dtype != PG_FLOAT32) {
    char got[128];
    return luaL_error(L, "ops.to_f16: %s: expected a cpu float32 tensor, got %s", name,
                      pg_tensor_describe(x, got, sizeof got));
  }
  const float *v = pg_tensor_f32(x);
  for (int64_t i = 0; i < x->numel; i++) {
    uint32_t bits;
    memcpy(&bits, &v[i], sizeof bits);
    if ((bits & 0x7fffffffu) >= 0x477ff000u) { /* 65520 and up, infinities and NaNs */
      /* no position: the message names the tensor, the caller's line is not what is wrong */
      lua_pushfstring(L, "%s: element %I is %f, which float16 cannot hold (largest 65504): export it as float32 or "
                      "bfloat16", name, (lua_Integer)i, (lua_Number)v[i]);
      return lua_error(L);
    }
  }
  pg_tensor *y = pg_lua_new_tensor(L, PG_FLOAT16, x->ndim, x->shape);
  uint16_t *h = pg_tensor_data(y);
  for (int64_t i = 0; i < x->numel; i++) h[i] = pg_f16_round(v[i]);
  return 1;
}

/* from_bf16(x) -> a float32 tensor of a bfloat16 tensor's values (exact). */
static int l_from_bf16(lua_State *L) {
  const pg_backend *b = NULL;
  pg_tensor *x = pg_lua_check_any_tensor(L, 1);
  int64_t any[PG_MAX_DIMS];
  for (int i = 0; i < PG_MAX_DIMS; i++) any[i] = -1;
  expect_at(L, 1, "ops.from_bf16", "x", PG_BFLOAT16, x->ndim, any, &b);
  pg_tensor *y = new_on(L, b, PG_FLOAT32, x->ndim, x->shape);
  RUN(L, "ops.from_bf16", b, bf16_to_f32, pg_tensor_f32(y), pg_tensor_data(x), x->numel);
  return 1;
}

/* from_f16(x) -> a float32 tensor of a float16 tensor's values (exact). */
static int l_from_f16(lua_State *L) {
  pg_tensor *x = pg_lua_check_any_tensor(L, 1);
  check_place(L, x, "ops.from_f16", "x", NULL);
  if (x->dtype != PG_FLOAT16) {
    char got[128];
    return luaL_error(L, "ops.from_f16: x: expected a cpu float16 tensor, got %s", pg_tensor_describe(x, got, sizeof got));
  }
  pg_tensor *y = pg_lua_new_tensor(L, PG_FLOAT32, x->ndim, x->shape);
  pg_f16_to_f32(pg_tensor_f32(y), pg_tensor_data(x), x->numel);
  return 1;
}

/* ---- int8 block quantisation (DiLoCo's quantised exchange): the coding is pg_int8_encode's (kernels.h);
 * decoded values come back within scale / 2 (plus one rounding of each product), the bound the specs use.
 * Words travel through collectives as int32. */

/* quantize_int8(x, block) -> int32 tensor [numel / block * (1 + block / 4)] */
static int l_quantize_int8(lua_State *L) {
  pg_tensor *x = pg_lua_check_any_tensor(L, 1);
  lua_Integer B = luaL_checkinteger(L, 2);
  check_place(L, x, "ops.quantize_int8", "x", NULL);
  if (x->dtype != PG_FLOAT32) {
    char got[128];
    return luaL_error(L, "ops.quantize_int8: x: expected a cpu float32 tensor, got %s",
                      pg_tensor_describe(x, got, sizeof got));
  }
  if (B < 4 || B % 4 || B > (1 << 20)) return luaL_error(L, "ops.quantize_int8: block=%I must be a multiple of 4 "
                                                         "from 4 to 2^20", B);
  if (x->numel % B) return luaL_error(L, "ops.quantize_int8: %I values are not whole blocks of %I",
                                      (lua_Integer)x->numel, B);
  int64_t nb = x->numel / B, words;
  if (pg_mul_overflows(nb, 1 + B / 4, &words)) return luaL_error(L, "ops.quantize_int8: too many values");
  pg_tensor *y = pg_lua_new_tensor(L, PG_INT32, 1, (int64_t[]){words});
  pg_int8_encode((uint32_t *)pg_tensor_data(y), pg_tensor_f32(x), nb, B);
  return 1;
}

/* dequantize_int8(words, block) -> float32 tensor of the values quantize_int8 coded */
static int l_dequantize_int8(lua_State *L) {
  pg_tensor *x = pg_lua_check_any_tensor(L, 1);
  lua_Integer B = luaL_checkinteger(L, 2);
  check_place(L, x, "ops.dequantize_int8", "words", NULL);
  if (x->dtype != PG_INT32) {
    char got[128];
    return luaL_error(L, "ops.dequantize_int8: words: expected a cpu int32 tensor, got %s",
                      pg_tensor_describe(x, got, sizeof got));
  }
  if (B < 4 || B % 4 || B > (1 << 20)) return luaL_error(L, "ops.dequantize_int8: block=%I must be a multiple of 4 "
                                                         "from 4 to 2^20", B);
  if (x->numel % (1 + B / 4)) return luaL_error(L, "ops.dequantize_int8: %I words are not whole blocks of %I values",
                                                (lua_Integer)x->numel, B);
  int64_t nb = x->numel / (1 + B / 4);
  pg_tensor *y = pg_lua_new_tensor(L, PG_FLOAT32, 1, (int64_t[]){nb * B});
  pg_int8_decode(pg_tensor_f32(y), (const uint32_t *)pg_tensor_data(x), nb, B);
  return 1;
}

/* bf16_gemm_path([name]) -> path, why. With name ("auto", "onednn", "fallback") selects the path first. */
static int l_bf16_gemm_path(lua_State *L) {
  const char *why;
  if (!lua_isnoneornil(L, 1) && pg_bf16_gemm_select(luaL_checkstring(L, 1), &why))
    return luaL_error(L, "ops.bf16_gemm_path: %s", why);
  lua_pushstring(L, pg_bf16_gemm_path(&why));
  lua_pushstring(L, why);
  return 2;
}

/* linear_bf16(x[..., C], w[OC, C] [, b[OC]]) -> y[..., OC] (float32): x and w (float32 ones rounded to bf16,
 * bfloat16 ones as they are) multiplied with float32 sums. */
static int l_linear_bf16(lua_State *L) {
  const char *fn = "ops.linear_bf16";
  lua_settop(L, 3);
  const pg_backend *b = NULL;
  int64_t N;
  pg_tensor *x = rows_arg_bf16(L, 1, fn, "x", -1, &N, 1, &b);
  int64_t C = x->shape[x->ndim - 1];
  pg_tensor *w = bf16_weight_arg(L, 2, fn, C, &b);
  int64_t OC = w->shape[0];
  if (OC > INT_MAX) return luaL_error(L, "%s: w: %I output features exceed the kernels' int range", fn, (lua_Integer)OC);
  pg_tensor *bias = lua_isnoneornil(L, 3) ? NULL : expect_at(L, 3, fn, "b", PG_FLOAT32, 1, &OC, &b);
  const uint16_t *xb = bf16_operand(L, fn, b, x), *wb = bf16_operand(L, fn, b, w);
  pg_tensor *y = new_like(L, b, x, OC);
  RUN(L, fn, b, matmul_bf16_forward, pg_tensor_f32(y), xb, wb, bias ? pg_tensor_f32(bias) : NULL, (int)N, (int)C,
      (int)OC);
  return 1;
}

/* linear_bf16_backward(dy, x, w [, with_bias=true [, {dw=, db=}]]) -> dx, dw, db (or nil), float32: dy (float32)
 * rounded to bf16, x and w as in linear_bf16, for the products (float32 sums); db sums the float32 dy. */
static int l_linear_bf16_backward(lua_State *L) {
  const char *fn = "ops.linear_bf16_backward";
  lua_settop(L, 5);
  const pg_backend *b = NULL;
  int64_t N;
  pg_tensor *x = rows_arg_bf16(L, 2, fn, "x", -1, &N, 1, &b);
  int64_t C = x->shape[x->ndim - 1];
  pg_tensor *w = bf16_weight_arg(L, 3, fn, C, &b);
  int64_t OC = w->shape[0];
  if (OC > INT_MAX) return luaL_error(L, "%s: w: %I output features exceed the kernels' int range", fn, (lua_Integer)OC);
  pg_tensor *dy = like_arg(L, 1, fn, "dy", x, OC, PG_FLOAT32, &b);
  int with_bias = lua_isnoneornil(L, 4) ? 1 : lua_toboolean(L, 4);
  static const char *const keys[] = {"dw", "db", NULL};
  check_acc(L, 5, fn, keys);
  const uint16_t *dyb = bf16_operand(L, fn, b, dy), *xb = bf16_operand(L, fn, b, x), *wb = bf16_operand(L, fn, b, w);
  pg_tensor *dx = new_like(L, b, x, C), *dw = grad_out(L, 5, fn, "dw", 2, (int64_t[]){OC, C}, &b);
  pg_tensor *db = NULL;
  if (with_bias) db = grad_out(L, 5, fn, "db", 1, &OC, &b);
  else lua_pushnil(L);
  RUN(L, fn, b, matmul_bf16_backward, pg_tensor_f32(dx), pg_tensor_f32(dw), db ? pg_tensor_f32(db) : NULL,
      pg_tensor_f32(dy), dyb, xb, wb, (int)N, (int)C, (int)OC);
  return 3;
}

/* ---- attention ---- */

/* qkv[B, T, (NH + 2 NKV) HS] of `dtype`, heads and optional kv_heads (default heads): fills B, T, NH, NKV, HS. */
static pg_tensor *qkv_arg_of(lua_State *L, int idx, int heads_idx, const char *fn, pg_dtype dtype, int *B, int *T,
                             int *NH, int *NKV, int *HS, const pg_backend **at) {
  pg_tensor *qkv = expect_at(L, idx, fn, "qkv", dtype, 3, (int64_t[]){-1, -1, -1}, at);
  *NH = int_arg(L, heads_idx, fn, "heads", 1, 0, 0);
  *NKV = int_arg(L, heads_idx + 1, fn, "kv_heads", 1, *NH, 1);
  if (*NH % *NKV) luaL_error(L, "%s: kv_heads=%d does not divide heads=%d", fn, *NKV, *NH);
  int64_t W = qkv->shape[2], parts = *NH + 2 * (int64_t)*NKV;
  if (W % parts)
    luaL_error(L, "%s: qkv: last dimension %I is not (heads + 2 kv_heads) = %I head widths", fn, (lua_Integer)W,
               (lua_Integer)parts);
  if (qkv->numel > INT_MAX) luaL_error(L, "%s: qkv: too large for the kernels' int range", fn);
  *B = (int)qkv->shape[0];
  *T = (int)qkv->shape[1];
  *HS = (int)(W / parts);
  return qkv;
}

static pg_tensor *qkv_arg(lua_State *L, int idx, int heads_idx, const char *fn, int *B, int *T, int *NH, int *NKV,
                          int *HS, const pg_backend **at) {
  return qkv_arg_of(L, idx, heads_idx, fn, PG_FLOAT32, B, T, NH, NKV, HS, at);
}

/* attention(qkv[B,T,(NH+2NKV)HS], heads [, kv_heads [, slopes[NH]]]) -> out[B,T,NH HS], lse[B,NH,T] (the flash
 * kernel's log-sum-exp of each row's scores); slopes: ALiBi's per-head slopes (nil: none) */
static int l_attention(lua_State *L) {
  const char *fn = "ops.attention";
  const pg_backend *b = NULL;
  int B, T, NH, NKV, HS;
  pg_tensor *qkv = qkv_arg(L, 1, 2, fn, &B, &T, &NH, &NKV, &HS, &b);
  const pg_tensor *slopes =
      lua_isnoneornil(L, 4) ? NULL : expect_at(L, 4, fn, "slopes", PG_FLOAT32, 1, (int64_t[]){NH}, &b);
  pg_tensor *out = new_on(L, b, PG_FLOAT32, 3, (int64_t[]){B, T, (int64_t)NH * HS});
  pg_tensor *lse = new_on(L, b, PG_FLOAT32, 3, (int64_t[]){B, NH, T});
  RUN(L, fn, b, attention_forward, pg_tensor_f32(out), pg_tensor_f32(lse), pg_tensor_f32(qkv),
      slopes ? pg_tensor_f32(slopes) : NULL, B, T, NH, NKV, HS);
  return 2;
}

/* alibi_slopes(heads) -> slopes[heads]: ALiBi's slopes (pg_alibi_slopes, transformers' BLOOM) */
static int l_alibi_slopes(lua_State *L) {
  int n = int_arg(L, 1, "ops.alibi_slopes", "heads", 1, 0, 0);
  int64_t len = n;
  pg_tensor *s = pg_lua_new_tensor(L, PG_FLOAT32, 1, &len);
  pg_alibi_slopes(pg_tensor_f32(s), n);
  return 1;
}

/* attention_backward(dout[B,T,NH HS], qkv, out[B,T,NH HS], lse[B,NH,T], heads [, kv_heads [, slopes[NH]]]) ->
 * dqkv: out and lse as ops.attention gave them (with the same slopes) */
static int l_attention_backward(lua_State *L) {
  const char *fn = "ops.attention_backward";
  const pg_backend *b = NULL;
  int B, T, NH, NKV, HS;
  pg_tensor *qkv = qkv_arg(L, 2, 5, fn, &B, &T, &NH, &NKV, &HS, &b);
  pg_tensor *dout = expect_at(L, 1, fn, "dout", PG_FLOAT32, 3, (int64_t[]){B, T, (int64_t)NH * HS}, &b);
  pg_tensor *out = expect_at(L, 3, fn, "out", PG_FLOAT32, 3, (int64_t[]){B, T, (int64_t)NH * HS}, &b);
  pg_tensor *lse = expect_at(L, 4, fn, "lse", PG_FLOAT32, 3, (int64_t[]){B, NH, T}, &b);
  const pg_tensor *slopes =
      lua_isnoneornil(L, 7) ? NULL : expect_at(L, 7, fn, "slopes", PG_FLOAT32, 1, (int64_t[]){NH}, &b);
  int64_t ns = b->ops->attention_scratch_floats(b, (int64_t)B * T, NH); /* delta: a float per row and head */
  pg_tensor *scratch = new_on(L, b, PG_FLOAT32, 1, &ns);
  pg_tensor *dqkv = new_on(L, b, PG_FLOAT32, 3, qkv->shape);
  RUN(L, fn, b, attention_backward, pg_tensor_f32(dqkv), pg_tensor_f32(scratch), pg_tensor_f32(dout),
      pg_tensor_f32(qkv), pg_tensor_f32(out), pg_tensor_f32(lse), slopes ? pg_tensor_f32(slopes) : NULL, B, T, NH,
      NKV, HS);
  return 1;
}

/* flash_bf16(qkv[B,T,(NH+2NKV)HS] bfloat16, heads [, kv_heads [, slopes[NH]]]) -> out[B,T,NH HS], lse[B,NH,T]
 * (float32): kernels.h's pg_flash_bf16_forward, on a device its tensor-core kernels (P rounded to bf16 for P V),
 * on the CPU its twin (the float32 block attention on the widened q|k|v). A shape the kernels do not take (head
 * size not 64 or 128, T not a multiple of 16) is refused, saying which: ops.attention takes any. */
static int l_flash_bf16(lua_State *L) {
  const char *fn = "ops.flash_bf16";
  const pg_backend *b = NULL;
  int B, T, NH, NKV, HS;
  pg_tensor *qkv = qkv_arg_of(L, 1, 2, fn, PG_BFLOAT16, &B, &T, &NH, &NKV, &HS, &b);
  const pg_tensor *slopes =
      lua_isnoneornil(L, 4) ? NULL : expect_at(L, 4, fn, "slopes", PG_FLOAT32, 1, (int64_t[]){NH}, &b);
  pg_tensor *out = new_on(L, b, PG_FLOAT32, 3, (int64_t[]){B, T, (int64_t)NH * HS});
  pg_tensor *lse = new_on(L, b, PG_FLOAT32, 3, (int64_t[]){B, NH, T});
  RUN(L, fn, b, flash_bf16_forward, pg_tensor_f32(out), NULL, pg_tensor_f32(lse), pg_tensor_data(qkv),
      slopes ? pg_tensor_f32(slopes) : NULL, B, T, NH, NKV, HS);
  return 2;
}

/* flash_bf16_backward(dout[B,T,NH HS] bfloat16, qkv bfloat16, out[B,T,NH HS], lse[B,NH,T], heads [, kv_heads
 * [, slopes[NH]]]) -> dqkv (float32): out and lse as ops.flash_bf16 (or ops.attention on the widened qkv) gave
 * them; on a device P and dS rounded to bf16 for their products, no atomics (the same bits on a rerun). */
static int l_flash_bf16_backward(lua_State *L) {
  const char *fn = "ops.flash_bf16_backward";
  const pg_backend *b = NULL;
  int B, T, NH, NKV, HS;
  pg_tensor *qkv = qkv_arg_of(L, 2, 5, fn, PG_BFLOAT16, &B, &T, &NH, &NKV, &HS, &b);
  pg_tensor *dout = expect_at(L, 1, fn, "dout", PG_BFLOAT16, 3, (int64_t[]){B, T, (int64_t)NH * HS}, &b);
  pg_tensor *out = expect_at(L, 3, fn, "out", PG_FLOAT32, 3, (int64_t[]){B, T, (int64_t)NH * HS}, &b);
  pg_tensor *lse = expect_at(L, 4, fn, "lse", PG_FLOAT32, 3, (int64_t[]){B, NH, T}, &b);
  const pg_tensor *slopes =
      lua_isnoneornil(L, 7) ? NULL : expect_at(L, 7, fn, "slopes", PG_FLOAT32, 1, (int64_t[]){NH}, &b);
  int64_t nd = (int64_t)B * NH * T; /* delta: a float per row and head */
  pg_tensor *delta = new_on(L, b, PG_FLOAT32, 1, &nd);
  pg_tensor *dqkv = new_on(L, b, PG_FLOAT32, 3, qkv->shape);
  RUN(L, fn, b, flash_bf16_backward, pg_tensor_f32(dqkv), NULL, pg_tensor_f32(delta), pg_tensor_data(dout),
      pg_tensor_f32(out), pg_tensor_data(qkv), pg_tensor_f32(lse), slopes ? pg_tensor_f32(slopes) : NULL, B, T, NH,
      NKV, HS);
  return 1;
}

/* ---- block attention (context parallelism's ring; kernels.h's pg_attention_block_*) ----
 * Queries and keys come as rows of the fused layout [B, T, (NH + 2 NKV) HS] (a chunk of a sequence's qkv):
 * the query heads of qkv_q's rows, the key and value heads of qkv_kv's, at positions q_pos0.. and k_pos0.. */

/* A position (>= 0) argument. */
static int64_t pos_arg(lua_State *L, int idx, const char *fn, const char *name) {
  int isint = 0;
  lua_Integer v = lua_tointegerx(L, idx, &isint);
  if (!isint || v < 0) luaL_error(L, "%s: %s: expected an integer >= 0, got %s", fn, name, luaL_tolstring(L, idx, NULL));
  return (int64_t)v;
}

/* attention_block_(acc[B,Tq,NH HS], mx[B,NH,Tq], sm[B,NH,Tq], qkv_q[B,Tq,W], qkv_kv[B,Tk,W], heads, kv_heads,
 * q_pos0, k_pos0 [, slopes[NH]]) -> acc: folds the key block into the online-softmax state (in place; start
 * acc 0, mx -inf, sm 0) */
static int l_attention_block_(lua_State *L) {
  const char *fn = "ops.attention_block_";
  const pg_backend *b = NULL;
  int B, Tq, NH, NKV, HS;
  pg_tensor *qq = qkv_arg(L, 4, 6, fn, &B, &Tq, &NH, &NKV, &HS, &b);
  pg_tensor *qkv = expect_at(L, 5, fn, "qkv_kv", PG_FLOAT32, 3, (int64_t[]){B, -1, qq->shape[2]}, &b);
  if (qkv->numel > INT_MAX) return luaL_error(L, "%s: qkv_kv: too large for the kernels' int range", fn);
  int Tk = (int)qkv->shape[1];
  pg_tensor *acc = expect_at(L, 1, fn, "acc", PG_FLOAT32, 3, (int64_t[]){B, Tq, (int64_t)NH * HS}, &b);
  pg_tensor *mx = expect_at(L, 2, fn, "mx", PG_FLOAT32, 3, (int64_t[]){B, NH, Tq}, &b);
  pg_tensor *sm = expect_at(L, 3, fn, "sm", PG_FLOAT32, 3, (int64_t[]){B, NH, Tq}, &b);
  int64_t q_pos0 = pos_arg(L, 8, fn, "q_pos0"), k_pos0 = pos_arg(L, 9, fn, "k_pos0");
  const pg_tensor *slopes =
      lua_isnoneornil(L, 10) ? NULL : expect_at(L, 10, fn, "slopes", PG_FLOAT32, 1, (int64_t[]){NH}, &b);
  const int64_t W = qq->shape[2];
  const float *kv = pg_tensor_f32(qkv);
  if (Tk > 0)
    RUN(L, fn, b, attention_block_forward, pg_tensor_f32(acc), pg_tensor_f32(mx), pg_tensor_f32(sm), pg_tensor_f32(qq),
        W, kv + (int64_t)NH * HS, kv + (int64_t)(NH + NKV) * HS, W, slopes ? pg_tensor_f32(slopes) : NULL, B, Tq, Tk,
        NH, NKV, HS, q_pos0, k_pos0);
  lua_settop(L, 1);
  return 1;
}

/* attention_block_finish(acc[B,Tq,NH HS], mx[B,NH,Tq], sm[B,NH,Tq]) -> out[B,Tq,NH HS], lse[B,NH,Tq] */
static int l_attention_block_finish(lua_State *L) {
  const char *fn = "ops.attention_block_finish";
  const pg_backend *b = NULL;
  pg_tensor *mx = expect_at(L, 2, fn, "mx", PG_FLOAT32, 3, (int64_t[]){-1, -1, -1}, &b);
  int64_t B = mx->shape[0], NH = mx->shape[1], Tq = mx->shape[2];
  pg_tensor *acc = expect_at(L, 1, fn, "acc", PG_FLOAT32, 3, (int64_t[]){B, Tq, -1}, &b);
  pg_tensor *sm = expect_at(L, 3, fn, "sm", PG_FLOAT32, 3, mx->shape, &b);
  if (NH == 0 || acc->shape[2] % NH)
    return luaL_error(L, "%s: acc: width %I is not a multiple of mx's %I heads", fn, (lua_Integer)acc->shape[2],
                      (lua_Integer)NH);
  if (acc->numel > INT_MAX) return luaL_error(L, "%s: acc: too large for the kernels' int range", fn);
  pg_tensor *out = new_on(L, b, PG_FLOAT32, 3, acc->shape);
  pg_tensor *lse = new_on(L, b, PG_FLOAT32, 3, mx->shape);
  RUN(L, fn, b, attention_block_finish, pg_tensor_f32(out), acc->shape[2], pg_tensor_f32(lse), pg_tensor_f32(acc),
      pg_tensor_f32(mx), pg_tensor_f32(sm), (int)B, (int)Tq, (int)NH, (int)(acc->shape[2] / NH));
  return 2;
}

/* attention_block_delta(dout[B,Tq,NH HS], out[B,Tq,NH HS], heads) -> delta[B,NH,Tq] */
static int l_attention_block_delta(lua_State *L) {
  const char *fn = "ops.attention_block_delta";
  const pg_backend *b = NULL;
  pg_tensor *out = expect_at(L, 2, fn, "out", PG_FLOAT32, 3, (int64_t[]){-1, -1, -1}, &b);
  pg_tensor *dout = expect_at(L, 1, fn, "dout", PG_FLOAT32, 3, out->shape, &b);
  int NH = int_arg(L, 3, fn, "heads", 1, 0, 0);
  if (out->shape[2] % NH)
    return luaL_error(L, "%s: out: width %I is not a multiple of heads=%d", fn, (lua_Integer)out->shape[2], NH);
  if (out->numel > INT_MAX) return luaL_error(L, "%s: out: too large for the kernels' int range", fn);
  int64_t B = out->shape[0], Tq = out->shape[1];
  pg_tensor *delta = new_on(L, b, PG_FLOAT32, 3, (int64_t[]){B, NH, Tq});
  RUN(L, fn, b, attention_block_delta, pg_tensor_f32(delta), pg_tensor_f32(dout), out->shape[2], pg_tensor_f32(out),
      out->shape[2], (int)B, (int)Tq, NH, (int)(out->shape[2] / NH));
  return 1;
}

/* attention_block_backward_(dqkv_q[B,Tq,W], dqkv_kv[B,Tk,W], qkv_q, qkv_kv, dout[B,Tq,NH HS], lse[B,NH,Tq],
 * delta[B,NH,Tq], heads, kv_heads, q_pos0, k_pos0 [, slopes]) -> dqkv_q: ADDS the block's query gradients to
 * dqkv_q's query columns and its key and value gradients to dqkv_kv's key and value columns (the same tensor
 * for a diagonal block) */
static int l_attention_block_backward_(lua_State *L) {
  const char *fn = "ops.attention_block_backward_";
  const pg_backend *b = NULL;
  int B, Tq, NH, NKV, HS;
  pg_tensor *qq = qkv_arg(L, 3, 8, fn, &B, &Tq, &NH, &NKV, &HS, &b);
  const int64_t W = qq->shape[2];
  pg_tensor *qkv = expect_at(L, 4, fn, "qkv_kv", PG_FLOAT32, 3, (int64_t[]){B, -1, W}, &b);
  if (qkv->numel > INT_MAX) return luaL_error(L, "%s: qkv_kv: too large for the kernels' int range", fn);
  int Tk = (int)qkv->shape[1];
  pg_tensor *dq = expect_at(L, 1, fn, "dqkv_q", PG_FLOAT32, 3, qq->shape, &b);
  pg_tensor *dkv = expect_at(L, 2, fn, "dqkv_kv", PG_FLOAT32, 3, qkv->shape, &b);
  pg_tensor *dout = expect_at(L, 5, fn, "dout", PG_FLOAT32, 3, (int64_t[]){B, Tq, (int64_t)NH * HS}, &b);
  pg_tensor *lse = expect_at(L, 6, fn, "lse", PG_FLOAT32, 3, (int64_t[]){B, NH, Tq}, &b);
  pg_tensor *delta = expect_at(L, 7, fn, "delta", PG_FLOAT32, 3, (int64_t[]){B, NH, Tq}, &b);
  int64_t q_pos0 = pos_arg(L, 10, fn, "q_pos0"), k_pos0 = pos_arg(L, 11, fn, "k_pos0");
  const pg_tensor *slopes =
      lua_isnoneornil(L, 12) ? NULL : expect_at(L, 12, fn, "slopes", PG_FLOAT32, 1, (int64_t[]){NH}, &b);
  const float *kv = pg_tensor_f32(qkv);
  float *dkvp = pg_tensor_f32(dkv);
  if (Tk > 0)
    RUN(L, fn, b, attention_block_backward, pg_tensor_f32(dq), W, dkvp + (int64_t)NH * HS,
        dkvp + (int64_t)(NH + NKV) * HS, W, pg_tensor_f32(qq), W, kv + (int64_t)NH * HS, kv + (int64_t)(NH + NKV) * HS,
        W, pg_tensor_f32(dout), (int64_t)NH * HS, pg_tensor_f32(lse), pg_tensor_f32(delta),
        slopes ? pg_tensor_f32(slopes) : NULL, B, Tq, Tk, NH, NKV, HS, q_pos0, k_pos0);
  lua_settop(L, 1);
  return 1;
}

/* ---- rotary position embeddings ---- */

/* rope(x[B, T, heads*HS], heads, theta) -> x with every head rotated (rope_backward: by the opposite angle) */
static int rope_call(lua_State *L, const char *fn, int backward) {
  const pg_backend *b = NULL;
  pg_tensor *x = expect_at(L, 1, fn, "x", PG_FLOAT32, 3, (int64_t[]){-1, -1, -1}, &b);
  int heads = int_arg(L, 2, fn, "heads", 1, 0, 0);
  lua_Number theta = luaL_checknumber(L, 3);
  if (!(theta > 1)) return luaL_error(L, "%s: theta must be > 1, got %f", fn, (double)theta);
  int64_t W = x->shape[2];
  if (W % heads || (W / heads) % 2)
    return luaL_error(L, "%s: x: width %I is not heads=%d heads of an even size", fn, (lua_Integer)W, heads);
  if (x->numel > INT_MAX) return luaL_error(L, "%s: x: too large for the kernels' int range", fn);
  int B = (int)x->shape[0], T = (int)x->shape[1], HS = (int)(W / heads);
  int64_t table = (int64_t)T * (HS / 2);
  /* the tables are computed on the host (pg_rope_table, as the attention module does) and copied to x's device */
  pg_tensor *cos_t = pg_lua_new_tensor(L, PG_FLOAT32, 1, &table), *sin_t = pg_lua_new_tensor(L, PG_FLOAT32, 1, &table);
  pg_rope_table(pg_tensor_f32(cos_t), pg_tensor_f32(sin_t), T, HS, (double)theta, NULL);
  if (b->device != PG_CPU) {
    pg_tensor *dc = new_on(L, b, PG_FLOAT32, 1, &table), *ds = new_on(L, b, PG_FLOAT32, 1, &table);
    copy_into(L, fn, dc, cos_t);
    copy_into(L, fn, ds, sin_t);
    cos_t = dc;
    sin_t = ds;
  }
  pg_tensor *y = new_on(L, b, PG_FLOAT32, 3, x->shape);
  copy_into(L, fn, y, x);
  if (backward)
    RUN(L, fn, b, rope_backward, pg_tensor_f32(y), pg_tensor_f32(cos_t), pg_tensor_f32(sin_t), B * T, T, heads, HS, (int)W);
  else RUN(L, fn, b, rope_forward, pg_tensor_f32(y), pg_tensor_f32(cos_t), pg_tensor_f32(sin_t), B * T, T, heads, HS, (int)W);
  return 1;
}

/* rope_inv_freq(head_dim, theta [, {rope_type=, rope_factor=, rope_low_freq_factor=, rope_high_freq_factor=,
 * rope_original_max=}]) -> float32 [head_dim / 2]: the frequencies of the attention's tables (pg_rope_inv_freq),
 * the scaling given as the attention descriptor's fields (models/common.lua's rope_fields) */
static int l_rope_inv_freq(lua_State *L) {
  const char *fn = "ops.rope_inv_freq";
  int HS = int_arg(L, 1, fn, "head_dim", 2, 0, 0);
  lua_Number theta = luaL_checknumber(L, 2);
  if (HS % 2) return luaL_error(L, "%s: head_dim must be even, got %d", fn, HS);
  if (!(theta > 1)) return luaL_error(L, "%s: theta must be > 1, got %f", fn, (double)theta);
  pg_rope_scaling sc = {.type = PG_ROPE_PLAIN};
  if (!lua_isnoneornil(L, 3)) {
    luaL_checktype(L, 3, LUA_TTABLE);
    const char *type = (lua_getfield(L, 3, "rope_type"), luaL_optstring(L, -1, "default"));
    int k = pg_rope_type_of(type);
    if (k < 0) return luaL_error(L, "%s: unknown rope_scaling type '%s'", fn, type);
    sc.type = (pg_rope_type)k;
    static const char *const keys[] = {"rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                                       "rope_original_max"};
    double *fields[] = {&sc.factor, &sc.low_freq_factor, &sc.high_freq_factor, &sc.original_max};
    for (int i = 0; i < 4; i++) *fields[i] = (lua_getfield(L, 3, keys[i]), luaL_optnumber(L, -1, 0));
  }
  int64_t half = HS / 2;
  pg_tensor *out = pg_lua_new_tensor(L, PG_FLOAT32, 1, &half);
  pg_rope_inv_freq(pg_tensor_f32(out), HS, (double)theta, &sc);
  return 1;
}

static int l_rope(lua_State *L) { return rope_call(L, "ops.rope", 0); }
static int l_rope_backward(lua_State *L) { return rope_call(L, "ops.rope_backward", 1); }

/* ---- RMS norm ---- */

/* rmsnorm(x, w[C] [, eps=1e-5]) -> y, rstd (x's leading shape) */
static int l_rmsnorm(lua_State *L) {
  const char *fn = "ops.rmsnorm";
  const pg_backend *b = NULL;
  int64_t N;
  pg_tensor *x = rows_at(L, 1, fn, "x", -1, &N, &b);
  int64_t C = x->shape[x->ndim - 1];
  pg_tensor *w = expect_at(L, 2, fn, "w", PG_FLOAT32, 1, &C, &b);
  lua_Number eps = luaL_optnumber(L, 3, 1e-5);
  if (!(eps >= 0)) return luaL_error(L, "%s: eps must be >= 0, got %f", fn, (double)eps);
  pg_tensor *y = new_like(L, b, x, C), *rstd = new_lead(L, b, x);
  RUN(L, fn, b, rmsnorm_forward, pg_tensor_f32(y), pg_tensor_f32(rstd), pg_tensor_f32(x), pg_tensor_f32(w), (int)N,
      (int)C, (float)eps);
  return 2;
}

/* rmsnorm_backward(dy, x, w, rstd [, {dw=}]) -> dx, dw */
static int l_rmsnorm_backward(lua_State *L) {
  const char *fn = "ops.rmsnorm_backward";
  lua_settop(L, 5); /* results are pushed above the (optional) gradient table */
  const pg_backend *b = NULL;
  int64_t N;
  pg_tensor *x = rows_at(L, 2, fn, "x", -1, &N, &b);
  int64_t C = x->shape[x->ndim - 1];
  pg_tensor *dy = like_arg(L, 1, fn, "dy", x, C, PG_FLOAT32, &b);
  pg_tensor *w = expect_at(L, 3, fn, "w", PG_FLOAT32, 1, &C, &b);
  pg_tensor *rstd = lead_arg(L, 4, fn, "rstd", x, PG_FLOAT32, &b);
  static const char *const keys[] = {"dw", NULL};
  check_acc(L, 5, fn, keys);
  pg_tensor *dx = new_like(L, b, x, C);
  pg_tensor *dw = grad_out(L, 5, fn, "dw", 1, &C, &b);
  RUN(L, fn, b, rmsnorm_backward, pg_tensor_f32(dx), pg_tensor_f32(dw), pg_tensor_f32(dy), pg_tensor_f32(x),
      pg_tensor_f32(w), pg_tensor_f32(rstd), (int)N, (int)C);
  return 2;
}

/* ---- pointwise ---- */

static int l_gelu(lua_State *L) {
  const pg_backend *b = NULL;
  pg_tensor *x = f32_arg(L, 1, "ops.gelu", "x", &b);
  pg_tensor *y = new_on(L, b, PG_FLOAT32, x->ndim, x->shape);
  RUN(L, "ops.gelu", b, gelu_forward, pg_tensor_f32(y), pg_tensor_f32(x), x->numel);
  return 1;
}

/* gelu_backward(dy, x) -> dx */
static int l_gelu_backward(lua_State *L) {
  const char *fn = "ops.gelu_backward";
  const pg_backend *b = NULL;
  pg_tensor *x = f32_arg(L, 2, fn, "x", &b);
  pg_tensor *dy = expect_at(L, 1, fn, "dy", PG_FLOAT32, x->ndim, x->shape, &b);
  pg_tensor *dx = new_on(L, b, PG_FLOAT32, x->ndim, x->shape);
  RUN(L, fn, b, gelu_backward, pg_tensor_f32(dx), pg_tensor_f32(x), pg_tensor_f32(dy), x->numel);
  return 1;
}

/* swiglu(x[..., 2H]) -> silu(x[..., :H]) * x[..., H:] */
static int l_swiglu(lua_State *L) {
  const char *fn = "ops.swiglu";
  const pg_backend *b = NULL;
  int64_t N;
  pg_tensor *x = rows_at(L, 1, fn, "x", -1, &N, &b);
  int64_t W = x->shape[x->ndim - 1];
  if (W % 2) return luaL_error(L, "%s: x: last dimension %I is not even (gate | up)", fn, (lua_Integer)W);
  pg_tensor *y = new_like(L, b, x, W / 2);
  RUN(L, fn, b, swiglu_forward, pg_tensor_f32(y), pg_tensor_f32(x), (int)N, (int)(W / 2));
  return 1;
}

/* swiglu_backward(dy[..., H], x[..., 2H]) -> dx */
static int l_swiglu_backward(lua_State *L) {
  const char *fn = "ops.swiglu_backward";
  const pg_backend *b = NULL;
  int64_t N;
  pg_tensor *x = rows_at(L, 2, fn, "x", -1, &N, &b);
  int64_t W = x->shape[x->ndim - 1];
  if (W % 2) return luaL_error(L, "%s: x: last dimension %I is not even (gate | up)", fn, (lua_Integer)W);
  pg_tensor *dy = like_arg(L, 1, fn, "dy", x, W / 2, PG_FLOAT32, &b);
  pg_tensor *dx = new_like(L, b, x, W);
  RUN(L, fn, b, swiglu_backward, pg_tensor_f32(dx), pg_tensor_f32(x), pg_tensor_f32(dy), (int)N, (int)(W / 2));
  return 1;
}

static int l_residual(lua_State *L) {
  const pg_backend *b = NULL;
  pg_tensor *a = f32_arg(L, 1, "ops.residual", "a", &b);
  pg_tensor *x = expect_at(L, 2, "ops.residual", "b", PG_FLOAT32, a->ndim, a->shape, &b);
  pg_tensor *out = new_on(L, b, PG_FLOAT32, a->ndim, a->shape);
  RUN(L, "ops.residual", b, residual_forward, pg_tensor_f32(out), pg_tensor_f32(a), pg_tensor_f32(x), a->numel);
  return 1;
}

/* residual_backward(dout [, {da=, db=}]) -> da, db (both dout, or added to the given ones) */
static int l_residual_backward(lua_State *L) {
  const char *fn = "ops.residual_backward";
  lua_settop(L, 2); /* results are pushed above the (optional) gradient table */
  const pg_backend *b = NULL;
  pg_tensor *dout = f32_arg(L, 1, fn, "dout", &b);
  static const char *const keys[] = {"da", "db", NULL};
  check_acc(L, 2, fn, keys);
  pg_tensor *da = grad_out(L, 2, fn, "da", dout->ndim, dout->shape, &b);
  pg_tensor *db = grad_out(L, 2, fn, "db", dout->ndim, dout->shape, &b);
  RUN(L, fn, b, residual_backward, pg_tensor_f32(da), pg_tensor_f32(db), pg_tensor_f32(dout), dout->numel);
  return 2;
}

/* ---- mixture-of-experts router ---- */

/* moe_route(logits[..., E], k) -> probs[..., E], lse[...], expert_i32[..., k] (0-based), weight[..., k] */
static int l_moe_route(lua_State *L) {
  const char *fn = "ops.moe_route";
  int64_t N;
  pg_tensor *logits = rows_arg(L, 1, fn, "logits", -1, &N);
  int E = (int)logits->shape[logits->ndim - 1];
  int K = int_arg(L, 2, fn, "k", 1, 0, 0);
  if (K > E) return luaL_error(L, "%s: k=%d exceeds the %d experts", fn, K, E);
  pg_tensor *probs = new_like(L, pg_backend_cpu(), logits, E);
  pg_tensor *lse = new_lead(L, pg_backend_cpu(), logits);
  int64_t shape[PG_MAX_DIMS];
  memcpy(shape, logits->shape, sizeof shape);
  shape[logits->ndim - 1] = K;
  pg_tensor *expert = pg_lua_new_tensor(L, PG_INT32, logits->ndim, shape);
  pg_tensor *weight = new_like(L, pg_backend_cpu(), logits, K);
  pg_moe_route_forward(pg_tensor_f32(probs), pg_tensor_f32(lse), pg_tensor_i32(expert), pg_tensor_f32(weight),
                       pg_tensor_f32(logits), (int)N, E, K);
  return 4;
}

/* moe_route_backward(dweight[..., k], probs[..., E], lse[...], expert[..., k], weight[..., k]
 *                    [, {dprob = [E], zscale = 0}]) -> dlogits[..., E] */
static int l_moe_route_backward(lua_State *L) {
  const char *fn = "ops.moe_route_backward";
  int64_t N;
  pg_tensor *probs = rows_arg(L, 2, fn, "probs", -1, &N);
  int E = (int)probs->shape[probs->ndim - 1];
  pg_tensor *dweight = rows_arg(L, 1, fn, "dweight", -1, NULL);
  int K = (int)dweight->shape[dweight->ndim - 1];
  if (K < 1 || K > E) return luaL_error(L, "%s: k=%d must be from 1 to the %d experts", fn, K, E);
  like_arg(L, 1, fn, "dweight", probs, K, PG_FLOAT32, NULL);
  pg_tensor *lse = lead_arg(L, 3, fn, "lse", probs, PG_FLOAT32, NULL);
  pg_tensor *expert = like_arg(L, 4, fn, "expert", probs, K, PG_INT32, NULL);
  pg_tensor *weight = like_arg(L, 5, fn, "weight", probs, K, PG_FLOAT32, NULL);
  for (int64_t i = 0; i < expert->numel; i++)
    if (pg_tensor_i32(expert)[i] < 0 || pg_tensor_i32(expert)[i] >= E)
      return luaL_error(L, "%s: expert %d at %I is not one of the %d experts", fn, pg_tensor_i32(expert)[i],
                        (lua_Integer)i + 1, E);
  const float *dprob = NULL;
  float zscale = 0;
  if (!lua_isnoneornil(L, 6)) {
    static const char *const keys[] = {"dprob", "zscale", NULL};
    luaL_checktype(L, 6, LUA_TTABLE);
    pg_lua_check_keys(L, 6, fn, keys);
    if (lua_getfield(L, 6, "dprob") != LUA_TNIL) {
      int64_t shape[1] = {E};
      dprob = pg_tensor_f32(expect(L, lua_gettop(L), fn, "dprob", PG_FLOAT32, 1, shape));
    }
    lua_pop(L, 1);
    zscale = (float)pg_lua_opt_number(L, 6, "zscale", 0);
  }
  pg_tensor *dlogits = new_like(L, pg_backend_cpu(), probs, E);
  pg_moe_route_backward(pg_tensor_f32(dlogits), pg_tensor_f32(dweight), dprob, zscale, pg_tensor_f32(probs),
                        pg_tensor_f32(lse), pg_tensor_i32(expert), pg_tensor_f32(weight), (int)N, E, K);
  return 1;
}

/* ---- cross-entropy ---- */

typedef struct {
  int valid, vocab_start, inplace;
  float dloss;
} xent_opts;

/* `inplace` is known to xent_finish only. */
static xent_opts read_xent_opts(lua_State *L, int idx, const char *fn, int V, int allow_inplace) {
  static const char *const keys[] = {"valid", "vocab_start", "dloss", NULL};
  static const char *const keys_inplace[] = {"valid", "vocab_start", "dloss", "inplace", NULL};
  pg_lua_check_keys(L, idx, fn, allow_inplace ? keys_inplace : keys);
  xent_opts o;
  o.valid = opt_int_range(L, idx, fn, "valid", V, 0, V);
  o.vocab_start = opt_int_range(L, idx, fn, "vocab_start", 0, 0, INT_MAX);
  o.dloss = lua_isnoneornil(L, idx) ? 1.0f : (float)opt_number_range(L, idx, fn, "dloss", 1.0, -HUGE_VAL, HUGE_VAL, 0, 0);
  o.inplace = pg_lua_opt_bool(L, idx, "inplace", 0);
  return o;
}

/* cross_entropy(logits[..., V], targets_i32[...] [, {valid=V, vocab_start=0, dloss=1}])
 *   -> losses[...], dlogits[..., V], loss_sum */
static int l_cross_entropy(lua_State *L) {
  const char *fn = "ops.cross_entropy";
  const pg_backend *b = NULL;
  int64_t N;
  pg_tensor *logits = rows_at(L, 1, fn, "logits", -1, &N, &b);
  int V = (int)logits->shape[logits->ndim - 1];
  pg_tensor *tg = lead_arg(L, 2, fn, "targets", logits, PG_INT32, &b);
  xent_opts o = read_xent_opts(L, 3, fn, V, 0);
  const int32_t *t = host_i32(L, fn, tg);
  /* one slice holds the whole vocabulary: every target must be one of its real columns */
  for (int64_t n = 0; n < N; n++)
    if (t[n] < o.vocab_start || (int64_t)t[n] >= (int64_t)o.vocab_start + o.valid)
      return luaL_error(L, "%s: targets: id %d at row %I is outside the vocabulary [%d, %d)", fn, t[n],
                        (lua_Integer)(n + 1), o.vocab_start, o.vocab_start + o.valid);
  pg_tensor *losses = new_lead(L, b, logits), *dlogits = new_like(L, b, logits, V);
  int64_t three_n = 3 * N;
  pg_tensor *stats = new_on(L, b, PG_FLOAT32, 1, &three_n); /* row_max, sumexp, target_logit */
  float *rmax = pg_tensor_f32(stats), *sumexp = rmax + N, *tl = rmax + 2 * N;
  const float *x = pg_tensor_f32(logits);
  const int32_t *dt = pg_tensor_i32(tg);
  double total = 0;
  RUN(L, fn, b, xent_row_max, rmax, x, (int)N, V, o.valid);
  RUN(L, fn, b, xent_sumexp, sumexp, tl, x, rmax, dt, (int)N, V, o.valid, o.vocab_start);
  RUN(L, fn, b, xent_finish, pg_tensor_f32(losses), pg_tensor_f32(dlogits), x, rmax, sumexp, tl, dt, (int)N, V,
      o.valid, o.vocab_start, o.dloss, &total);
  lua_pop(L, 1); /* stats */
  lua_pushnumber(L, total);
  return 3;
}

/* xent_row_max(logits[..., V] [, {valid=V}]) -> row_max[...] */
static int l_xent_row_max(lua_State *L) {
  const char *fn = "ops.xent_row_max";
  const pg_backend *b = NULL;
  int64_t N;
  pg_tensor *logits = rows_at(L, 1, fn, "logits", -1, &N, &b);
  int V = (int)logits->shape[logits->ndim - 1];
  xent_opts o = read_xent_opts(L, 2, fn, V, 0);
  pg_tensor *rmax = new_lead(L, b, logits);
  RUN(L, fn, b, xent_row_max, pg_tensor_f32(rmax), pg_tensor_f32(logits), (int)N, V, o.valid);
  return 1;
}

/* xent_sumexp(logits, row_max, targets [, {valid=, vocab_start=}]) -> sumexp, target_logit */
static int l_xent_sumexp(lua_State *L) {
  const char *fn = "ops.xent_sumexp";
  const pg_backend *b = NULL;
  int64_t N;
  pg_tensor *logits = rows_at(L, 1, fn, "logits", -1, &N, &b);
  int V = (int)logits->shape[logits->ndim - 1];
  pg_tensor *rmax = lead_arg(L, 2, fn, "row_max", logits, PG_FLOAT32, &b);
  pg_tensor *tg = lead_arg(L, 3, fn, "targets", logits, PG_INT32, &b);
  xent_opts o = read_xent_opts(L, 4, fn, V, 0);
  check_ids(L, fn, "targets", tg, 0, 0); /* a slice: targets of other slices are theirs, but never negative */
  pg_tensor *sumexp = new_lead(L, b, logits), *tl = new_lead(L, b, logits);
  RUN(L, fn, b, xent_sumexp, pg_tensor_f32(sumexp), pg_tensor_f32(tl), pg_tensor_f32(logits), pg_tensor_f32(rmax),
      pg_tensor_i32(tg), (int)N, V, o.valid, o.vocab_start);
  return 2;
}

/* xent_finish(logits, row_max, sumexp, target_logit, targets [, {valid=, vocab_start=, dloss=, inplace=false}])
 *   -> losses, dlogits, loss_sum. inplace=true writes dlogits over logits (the
 *   kernel's aliasing case, as the engine uses it) and returns logits. */
static int l_xent_finish(lua_State *L) {
  const char *fn = "ops.xent_finish";
  const pg_backend *b = NULL;
  int64_t N;
  pg_tensor *logits = rows_at(L, 1, fn, "logits", -1, &N, &b);
  int V = (int)logits->shape[logits->ndim - 1];
  pg_tensor *rmax = lead_arg(L, 2, fn, "row_max", logits, PG_FLOAT32, &b);
  pg_tensor *sumexp = lead_arg(L, 3, fn, "sumexp", logits, PG_FLOAT32, &b);
  pg_tensor *tl = lead_arg(L, 4, fn, "target_logit", logits, PG_FLOAT32, &b);
  pg_tensor *tg = lead_arg(L, 5, fn, "targets", logits, PG_INT32, &b);
  xent_opts o = read_xent_opts(L, 6, fn, V, 1);
  check_ids(L, fn, "targets", tg, 0, 0);
  pg_tensor *losses = new_lead(L, b, logits), *dlogits = logits;
  if (o.inplace) lua_pushvalue(L, 1);
  else dlogits = new_like(L, b, logits, V);
  double total = 0;
  RUN(L, fn, b, xent_finish, pg_tensor_f32(losses), pg_tensor_f32(dlogits), pg_tensor_f32(logits), pg_tensor_f32(rmax),
      pg_tensor_f32(sumexp), pg_tensor_f32(tl), pg_tensor_i32(tg), (int)N, V, o.valid, o.vocab_start, o.dloss, &total);
  lua_pushnumber(L, total);
  return 3;
}

/* ---- optimizer ---- */

/* adamw_(param, grad, m, v, {lr=, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=, grad_scale=1})
 * updates param, m and v in place; returns param. */
static int l_adamw_(lua_State *L) {
  const char *fn = "ops.adamw_";
  static const char *const keys[] = {"lr", "beta1", "beta2", "eps", "weight_decay", "step", "grad_scale", NULL};
  const pg_backend *b = NULL;
  pg_tensor *p = f32_arg(L, 1, fn, "param", &b);
  pg_tensor *g = expect_at(L, 2, fn, "grad", PG_FLOAT32, p->ndim, p->shape, &b);
  pg_tensor *m = expect_at(L, 3, fn, "m", PG_FLOAT32, p->ndim, p->shape, &b);
  pg_tensor *v = expect_at(L, 4, fn, "v", PG_FLOAT32, p->ndim, p->shape, &b);
  luaL_checktype(L, 5, LUA_TTABLE);
  pg_lua_check_keys(L, 5, fn, keys);
  /* the ranges torch.optim.AdamW checks; grad_scale divides the gradient, so it is positive */
  double lr = opt_number_range(L, 5, fn, "lr", 0, 0, HUGE_VAL, 0, 1);
  double beta1 = opt_number_range(L, 5, fn, "beta1", 0.9, 0, 1, 1, 0);
  double beta2 = opt_number_range(L, 5, fn, "beta2", 0.999, 0, 1, 1, 0);
  double eps = opt_number_range(L, 5, fn, "eps", 1e-8, 0, HUGE_VAL, 0, 0);
  double wd = opt_number_range(L, 5, fn, "weight_decay", 0.01, 0, HUGE_VAL, 0, 0);
  double scale = opt_number_range(L, 5, fn, "grad_scale", 1.0, 0x1p-126, HUGE_VAL, 0, 0);
  int step = opt_int_range(L, 5, fn, "step", 0, 1, INT_MAX);
  RUN(L, fn, b, adamw_update, pg_tensor_f32(p), pg_tensor_f32(g), pg_tensor_f32(m), pg_tensor_f32(v), p->numel,
      (float)lr, (float)beta1, (float)beta2, (float)eps, (float)wd, step, (float)scale);
  lua_settop(L, 1);
  return 1;
}

static int l_sum_squares(lua_State *L) {
  const pg_backend *b = NULL;
  pg_tensor *x = f32_arg(L, 1, "ops.sum_squares", "x", &b);
  double sum = 0;
  RUN(L, "ops.sum_squares", b, sum_squares, pg_tensor_f32(x), x->numel, &sum);
  lua_pushnumber(L, sum);
  return 1;
}

/* num_threads() -> the OpenMP team size the kernels (and OpenBLAS) use next. */
static int l_num_threads(lua_State *L) {
  lua_pushinteger(L, omp_get_max_threads());
  return 1;
}

/* set_num_threads(n): for the specs' thread-count checks and for benchmarks. */
static int l_set_num_threads(lua_State *L) {
  omp_set_num_threads(int_arg(L, 1, "ops.set_num_threads", "n", 1, 0, 0));
  return 0;
}

static const luaL_Reg ops_functions[] = {
    {"num_threads", l_num_threads},
    {"set_num_threads", l_set_num_threads},
    {"embedding", l_embedding},
    {"embedding_backward", l_embedding_backward},
    {"position", l_position},
    {"position_backward", l_position_backward},
    {"layernorm", l_layernorm},
    {"layernorm_backward", l_layernorm_backward},
    {"linear", l_linear},
    {"linear_backward", l_linear_backward},
    {"linear_bf16", l_linear_bf16},
    {"linear_bf16_backward", l_linear_bf16_backward},
    {"bf16_round", l_bf16_round},
    {"to_bf16", l_to_bf16},
    {"from_bf16", l_from_bf16},
    {"from_f16", l_from_f16},
    {"to_f16", l_to_f16},
    {"bf16_gemm_path", l_bf16_gemm_path},
    {"quantize_int8", l_quantize_int8},
    {"dequantize_int8", l_dequantize_int8},
    {"attention", l_attention},
    {"attention_backward", l_attention_backward},
    {"flash_bf16", l_flash_bf16},
    {"flash_bf16_backward", l_flash_bf16_backward},
    {"alibi_slopes", l_alibi_slopes},
    {"attention_block_", l_attention_block_},
    {"attention_block_finish", l_attention_block_finish},
    {"attention_block_delta", l_attention_block_delta},
    {"attention_block_backward_", l_attention_block_backward_},
    {"rope", l_rope},
    {"rope_backward", l_rope_backward},
    {"rope_inv_freq", l_rope_inv_freq},
    {"rmsnorm", l_rmsnorm},
    {"rmsnorm_backward", l_rmsnorm_backward},
    {"swiglu", l_swiglu},
    {"swiglu_backward", l_swiglu_backward},
    {"gelu", l_gelu},
    {"gelu_backward", l_gelu_backward},
    {"residual", l_residual},
    {"residual_backward", l_residual_backward},
    {"moe_route", l_moe_route},
    {"moe_route_backward", l_moe_route_backward},
    {"cross_entropy", l_cross_entropy},
    {"xent_row_max", l_xent_row_max},
    {"xent_sumexp", l_xent_sumexp},
    {"xent_finish", l_xent_finish},
    {"adamw_", l_adamw_},
    {"sum_squares", l_sum_squares},
    {NULL, NULL}};

/* ---- the seam's kernels (kernels/kernel_list.h) and their bindings ----
 * Every row of the list says here which pg.ops function runs its CPU kernel
 * (OPS_<name>), or OPS_NONE with why there is none: a kernel added to the
 * list without a line here does not compile (OPS_<name> is undeclared), and a
 * binding named here but missing from ops_functions fails pg_lua_open_ops. */
#define OPS_NONE(why) NULL
#define OPS_embedding_forward l_embedding
#define OPS_embedding_backward l_embedding_backward
#define OPS_position_forward l_position
#define OPS_position_backward l_position_backward
#define OPS_layernorm_forward l_layernorm
#define OPS_layernorm_backward l_layernorm_backward
#define OPS_matmul_forward l_linear
#define OPS_matmul_backward l_linear_backward
#define OPS_attention_forward l_attention
#define OPS_attention_backward l_attention_backward
#define OPS_attention_cached OPS_NONE("checked through the engine: generate_spec compares the cache path with engine:forward")
#define OPS_attention_block_forward l_attention_block_
#define OPS_attention_block_finish l_attention_block_finish
#define OPS_attention_block_delta l_attention_block_delta
#define OPS_attention_block_backward l_attention_block_backward_
#define OPS_rope_forward l_rope
#define OPS_rope_backward l_rope_backward
#define OPS_rope_bf16_forward OPS_NONE("checked through the attention module and the CUDA self-test")
#define OPS_rmsnorm_forward l_rmsnorm
#define OPS_rmsnorm_backward l_rmsnorm_backward
#define OPS_swiglu_forward l_swiglu
#define OPS_swiglu_backward l_swiglu_backward
#define OPS_gelu_forward l_gelu
#define OPS_gelu_backward l_gelu_backward
#define OPS_residual_forward l_residual
#define OPS_residual_backward l_residual_backward
#define OPS_xent_row_max l_xent_row_max
#define OPS_xent_sumexp l_xent_sumexp
#define OPS_xent_finish l_xent_finish
#define OPS_adamw_update l_adamw_
#define OPS_sum_squares l_sum_squares
#define OPS_adamw_update_pieces OPS_NONE("the fused step is adamw_update per piece: checked through the optimizer")
#define OPS_bf16_from_f32 l_to_bf16
#define OPS_matmul_bf16_forward l_linear_bf16
#define OPS_matmul_bf16_backward l_linear_bf16_backward
#define OPS_matmul_bf16_forward_rounded OPS_NONE("linear_bf16 then to_bf16: checked through the bf16 modules and the CUDA self-test")
#define OPS_bf16_to_f32 l_from_bf16
/* bf16_spec checks the bf16 modules against the float32 bindings' results rounded (ops.gelu, ops.swiglu,
 * ops.residual), and the CUDA self-test checks these kernels against each other */
#define OPS_BF16_ACTIVATION OPS_NONE("the bf16 activations are checked through the bf16 modules")
#define OPS_gelu_bf16_forward OPS_BF16_ACTIVATION
#define OPS_gelu_bf16_backward OPS_BF16_ACTIVATION
#define OPS_swiglu_bf16_forward OPS_BF16_ACTIVATION
#define OPS_swiglu_bf16_backward OPS_BF16_ACTIVATION
#define OPS_residual_bf16_forward OPS_BF16_ACTIVATION
/* the tensor-core attention (the CUDA self-test checks it against its CPU twin; pg.cuda.flash_bf16_seconds times it) */
#define OPS_flash_bf16_forward l_flash_bf16
#define OPS_flash_bf16_backward l_flash_bf16_backward
/* mixture of experts: the router has bindings (moe_spec); the rest is checked through the moe kind (moe_spec,
 * the device spec against the cpu backend) and the CUDA self-test */
#define OPS_moe_route_forward l_moe_route
#define OPS_moe_route_backward l_moe_route_backward
#define OPS_MOE_KIND OPS_NONE("checked through the moe kind and the CUDA self-test")
#define OPS_moe_route_stats OPS_MOE_KIND
#define OPS_moe_drop OPS_MOE_KIND
#define OPS_moe_group OPS_MOE_KIND
#define OPS_moe_gather OPS_MOE_KIND
#define OPS_moe_combine OPS_MOE_KIND
#define OPS_moe_combine_backward OPS_MOE_KIND

static const struct {
  const char *kernel;
  lua_CFunction binding; /* NULL: none (OPS_NONE) */
} kernel_bindings[] = {
#define PG_KERNEL(name, params, args, cpu, cuda, selftest) {#name, OPS_##name},
#include "kernel_list.h"
};

void pg_lua_open_ops(lua_State *L) {
  for (size_t k = 0; k < sizeof kernel_bindings / sizeof kernel_bindings[0]; k++) {
    const luaL_Reg *r = ops_functions;
    while (r->name && r->func != kernel_bindings[k].binding) r++;
    if (kernel_bindings[k].binding && !r->name)
      luaL_error(L, "pg.ops: the binding of kernel %s (src/lua/lua_ops.c) is not in ops_functions",
                 kernel_bindings[k].kernel);
  }
  luaL_newlib(L, ops_functions);
  lua_setfield(L, -2, "ops");
}
