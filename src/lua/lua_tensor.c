/* Lua bindings for pg_tensor: creation, inspection, elementwise arithmetic
 * and the comparison helpers used by the specs. Dimensions and element
 * indices are 1-based, as in Lua and Lua Torch. */
#include <math.h>
#include <string.h>

#include "lua_util.h"
#include "pg_backend.h"
#include "pg_rng.h"
#include "pg_size.h"

/* The options table {dtype=} of a constructor (fname names it in errors). */
static pg_dtype opt_dtype(lua_State *L, int idx, pg_dtype def, const char *fname) {
  static const char *const keys[] = {"dtype", "device", NULL};
  pg_lua_check_keys(L, idx, fname, keys);
  const char *name = pg_lua_opt_string(L, idx, "dtype", NULL);
  if (!name) return def;
  pg_dtype d;
  PG_LUA_CHECK(L, pg_dtype_from_name(name, &d));
  return d;
}

static int copy_to(lua_State *L, const pg_tensor *t, const pg_backend *b);

/* Where a factory's options at idx put its tensor (device = "cpu" | "cuda" | "cuda:N", as t:to): NULL
 * for the host. Read before the tensor is pushed (idx may be past the arguments). A module written in Lua
 * makes its tensors on its engine's device with {device = info.device}. */
static const pg_backend *opt_device(lua_State *L, int idx, const char *fname) {
  const char *name = pg_lua_opt_string(L, idx, "device", NULL);
  if (!name) return NULL;
  const pg_backend *b = pg_backend_named(name);
  if (!b) luaL_error(L, "%s: %s", fname, pg_error());
  return b->device == PG_CPU ? NULL : b;
}

/* The factory's result: t (on the stack's top, made and filled on the host), or its copy on dev. */
static int placed(lua_State *L, const pg_backend *dev, const pg_tensor *t) { return dev ? copy_to(L, t, dev) : 1; }

/* Shape from either a table {2, 3} at idx or integers idx, idx+1, ... up to
 * the first non-number. Returns ndim and sets *next to the next argument. */
static int read_shape(lua_State *L, int idx, int64_t *shape, int *next) {
  if (lua_istable(L, idx) && !pg_lua_test_tensor(L, idx)) {
    *next = idx + 1;
    return pg_lua_check_shape(L, idx, shape);
  }
  int n = 0;
  while (lua_type(L, idx + n) == LUA_TNUMBER) {
    if (n == PG_MAX_DIMS) luaL_error(L, "at most %d dimensions are supported", PG_MAX_DIMS);
    int isint = 0;
    lua_Integer v = lua_tointegerx(L, idx + n, &isint);
    if (!isint || v < 0) luaL_error(L, "bad argument #%d: sizes must be non-negative integers", idx + n);
    shape[n++] = v;
  }
  *next = idx + n;
  return n;
}

/* A number to store in a tensor of dtype d: an int32 element needs an integer
 * that fits (1e20 or 2.5 used to be cast, which C leaves undefined). */
static double check_value(lua_State *L, pg_dtype d, double v, const char *what) {
  if (pg_dtype_check_value(d, v)) luaL_error(L, "%s: %s", what, pg_error());
  return v;
}

/* ---- constructors ---- */

static void infer_shape(lua_State *L, int idx, int depth, int *ndim, int64_t *shape) {
  if (depth >= PG_MAX_DIMS) luaL_error(L, "pg.tensor: nested deeper than %d levels", PG_MAX_DIMS);
  int64_t n = (int64_t)luaL_len(L, idx);
  shape[depth] = n;
  *ndim = depth + 1;
  if (n > 0) {
    lua_geti(L, idx, 1);
    if (lua_istable(L, -1)) infer_shape(L, lua_gettop(L), depth + 1, ndim, shape);
    lua_pop(L, 1);
  }
}

static void fill_from_table(lua_State *L, int idx, int depth, int ndim, const int64_t *shape, pg_tensor *t,
                            int64_t *pos) {
  int64_t n = (int64_t)luaL_len(L, idx);
  if (n != shape[depth]) luaL_error(L, "pg.tensor: ragged table: %I entries where %I expected at depth %d", (lua_Integer)n,
                                    (lua_Integer)shape[depth], depth + 1);
  for (int64_t i = 1; i <= n; i++) {
    lua_geti(L, idx, i);
    if (depth + 1 < ndim) {
      if (!lua_istable(L, -1)) luaL_error(L, "pg.tensor: ragged table: a number where a table was expected at depth %d", depth + 2);
      fill_from_table(L, lua_gettop(L), depth + 1, ndim, shape, t, pos);
    } else {
      int isnum = 0;
      lua_Number v = lua_tonumberx(L, -1, &isnum);
      if (!isnum) luaL_error(L, "pg.tensor: entry %I at depth %d is a %s, not a number", (lua_Integer)i, depth + 1, luaL_typename(L, -1));
      pg_tensor_set_flat(t, (*pos)++, check_value(L, t->dtype, v, "pg.tensor"));
    }
    lua_pop(L, 1);
  }
}

static int l_tensor(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  pg_dtype dtype = opt_dtype(L, 2, PG_FLOAT32, "pg.tensor");
  const pg_backend *dev = opt_device(L, 2, "pg.tensor");
  int64_t shape[PG_MAX_DIMS];
  int ndim = 0;
  infer_shape(L, 1, 0, &ndim, shape);
  pg_tensor *t = pg_lua_new_tensor(L, dtype, ndim, shape);
  int64_t pos = 0;
  fill_from_table(L, 1, 0, ndim, shape, t, &pos);
  return placed(L, dev, t);
}

static int make_filled(lua_State *L, double value, int has_value_arg, const char *fname) {
  int64_t shape[PG_MAX_DIMS];
  int next;
  int ndim = read_shape(L, 1, shape, &next);
  if (has_value_arg) value = luaL_checknumber(L, next++);
  pg_dtype dtype = opt_dtype(L, next, PG_FLOAT32, fname);
  const pg_backend *dev = opt_device(L, next, fname);
  check_value(L, dtype, value, fname);
  pg_tensor *t = pg_lua_new_tensor(L, dtype, ndim, shape);
  if (value != 0) pg_tensor_fill(t, value);
  return placed(L, dev, t);
}

static int l_zeros(lua_State *L) { return make_filled(L, 0, 0, "pg.zeros"); }
static int l_ones(lua_State *L) { return make_filled(L, 1, 0, "pg.ones"); }
static int l_full(lua_State *L) { return make_filled(L, 0, 1, "pg.full"); }

static int l_randn(lua_State *L) {
  int64_t shape[PG_MAX_DIMS];
  int next;
  int ndim = read_shape(L, 1, shape, &next);
  static const char *const keys[] = {"seed", "mean", "std", "device", NULL};
  pg_lua_check_keys(L, next, "pg.randn", keys);
  uint64_t seed = (uint64_t)pg_lua_opt_int(L, next, "seed", 0);
  double mean = pg_lua_opt_number(L, next, "mean", 0), std = pg_lua_opt_number(L, next, "std", 1);
  if (!isfinite(mean) || !isfinite(std)) return luaL_error(L, "pg.randn: mean and std must be finite, got %f and %f", mean, std);
  const pg_backend *dev = opt_device(L, next, "pg.randn");
  pg_tensor *t = pg_lua_new_tensor(L, PG_FLOAT32, ndim, shape);
  uint64_t key = pg_rng_key(seed, "pg.randn");
  float *x = pg_tensor_f32(t);
  for (int64_t i = 0; i < t->numel; i++) x[i] = (float)(mean + std * pg_normal_at(key, (uint64_t)i));
  return placed(L, dev, t);
}

static int l_arange(lua_State *L) {
  int nargs = 0;
  while (lua_type(L, nargs + 1) == LUA_TNUMBER) nargs++;
  if (nargs < 1 || nargs > 3) return luaL_error(L, "pg.arange(stop) or pg.arange(start, stop[, step])");
  int all_int = 1;
  for (int i = 1; i <= nargs; i++) all_int &= lua_isinteger(L, i);
  double start = nargs == 1 ? 0 : lua_tonumber(L, 1);
  double stop = nargs == 1 ? lua_tonumber(L, 1) : lua_tonumber(L, 2);
  double step = nargs == 3 ? lua_tonumber(L, 3) : 1;
  if (step == 0) return luaL_error(L, "pg.arange: step must not be zero");
  pg_dtype dtype = opt_dtype(L, nargs + 1, all_int ? PG_INT32 : PG_FLOAT32, "pg.arange");
  const pg_backend *dev = opt_device(L, nargs + 1, "pg.arange");
  double count = ceil((stop - start) / step); /* NaN or past int64 when an end is inf or huge */
  if (count != count || count > (double)PG_MAX_NUMEL)
    return luaL_error(L, "pg.arange(%f, %f, %f): %f elements is not a tensor size", start, stop, step, count);
  int64_t n = count > 0 ? (int64_t)count : 0;
  if (n > 0) { /* the first and last values must fit the dtype (int32) */
    check_value(L, dtype, start, "pg.arange");
    check_value(L, dtype, start + (double)(n - 1) * step, "pg.arange");
  }
  pg_tensor *t = pg_lua_new_tensor(L, dtype, 1, &n);
  for (int64_t i = 0; i < n; i++) pg_tensor_set_flat(t, i, start + (double)i * step);
  return placed(L, dev, t);
}

/* ---- methods ---- */

static int l_shape(lua_State *L) {
  pg_tensor *t = pg_lua_check_any_tensor(L, 1);
  lua_createtable(L, t->ndim, 0);
  for (int i = 0; i < t->ndim; i++) {
    lua_pushinteger(L, t->shape[i]);
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

static int l_size(lua_State *L) {
  pg_tensor *t = pg_lua_check_any_tensor(L, 1);
  if (lua_isnoneornil(L, 2)) return l_shape(L);
  lua_Integer d = luaL_checkinteger(L, 2);
  if (d < 1 || d > t->ndim) return luaL_error(L, "size: dimension %I out of range for a %d-d tensor", d, t->ndim);
  lua_pushinteger(L, t->shape[d - 1]);
  return 1;
}

static int l_dim(lua_State *L) {
  lua_pushinteger(L, pg_lua_check_any_tensor(L, 1)->ndim);
  return 1;
}

static int l_numel(lua_State *L) {
  lua_pushinteger(L, pg_lua_check_any_tensor(L, 1)->numel);
  return 1;
}

static int l_dtype(lua_State *L) {
  lua_pushstring(L, pg_dtype_name(pg_lua_check_any_tensor(L, 1)->dtype));
  return 1;
}

/* "cpu" or "cuda:N": where the data is */
static void push_device(lua_State *L, const pg_storage *s) {
  if (s->device == PG_CPU) lua_pushstring(L, "cpu");
  else lua_pushfstring(L, "%s:%d", pg_device_name(s->device), s->device_index);
}

static int l_device(lua_State *L) {
  push_device(L, pg_lua_check_any_tensor(L, 1)->storage);
  return 1;
}

/* Pushes a copy of t in the memory of backend b; returns 1 (results pushed). */
static int copy_to(lua_State *L, const pg_tensor *t, const pg_backend *b) {
  pg_tensor out;
  PG_LUA_CHECK(L, pg_backend_tensor(b, &out, t->dtype, t->ndim, t->shape));
  PG_LUA_CHECK(L, pg_backend_copy_tensor(pg_lua_push_tensor(L, &out), t));
  return 1;
}

/* t:to(device) -> t itself when already there, else a copy there
 * ("cpu", "cuda" = this rank's device, "cuda:N"), as torch.Tensor.to. */
static int l_to(lua_State *L) {
  pg_tensor *t = pg_lua_check_any_tensor(L, 1);
  const pg_backend *b = pg_backend_named(luaL_checkstring(L, 2));
  if (!b) return luaL_error(L, "to: %s", pg_error());
  if (t->storage->device == b->device && (b->device == PG_CPU || t->storage->device_index == b->ordinal)) {
    lua_settop(L, 1);
    return 1;
  }
  return copy_to(L, t, b);
}

static void push_element(lua_State *L, const pg_tensor *t, int64_t i) {
  if (t->dtype == PG_INT32) lua_pushinteger(L, pg_tensor_i32(t)[i]);
  else lua_pushnumber(L, pg_tensor_get_flat(t, i));
}

static void totable_rec(lua_State *L, const pg_tensor *t, int depth, int64_t *pos) {
  lua_createtable(L, (int)t->shape[depth], 0);
  for (int64_t i = 0; i < t->shape[depth]; i++) {
    if (depth + 1 < t->ndim) totable_rec(L, t, depth + 1, pos);
    else push_element(L, t, (*pos)++);
    lua_rawseti(L, -2, i + 1);
  }
}

static int l_totable(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1);
  int64_t pos = 0;
  if (t->ndim == 0) push_element(L, t, 0);
  else totable_rec(L, t, 0, &pos);
  return 1;
}

static int l_clone(lua_State *L) {
  pg_tensor *t = pg_lua_check_any_tensor(L, 1), out;
  if (t->storage->device != PG_CPU) { /* a copy on the same device */
    const pg_backend *b = pg_backend_of(t->storage);
    if (!b) return luaL_error(L, "%s", pg_error());
    return copy_to(L, t, b);
  }
  PG_LUA_CHECK(L, pg_tensor_clone(&out, t));
  pg_lua_push_tensor(L, &out);
  return 1;
}

/* narrow(dim, start, len): 1-based dim and start. A view sharing memory when
 * the slice is contiguous (dim 1, or all earlier dims of size 1), else a copy. */
static int l_narrow(lua_State *L) {
  pg_tensor *t = pg_lua_check_any_tensor(L, 1), out;
  lua_Integer dim = luaL_checkinteger(L, 2), start = luaL_checkinteger(L, 3), len = luaL_checkinteger(L, 4);
  if (dim < 1 || dim > t->ndim)
    return luaL_error(L, "narrow: dimension %I out of range for a %d-d tensor", dim, t->ndim);
  if (start < 1) /* before start - 1, which wraps for math.mininteger */
    return luaL_error(L, "narrow: start %I out of range for dimension %I of size %I", start, dim,
                      (lua_Integer)t->shape[dim - 1]);
  int contiguous = 1;
  for (int i = 0; i < dim - 1; i++) contiguous &= t->shape[i] == 1;
  int rc = contiguous ? pg_tensor_narrow_view(&out, t, (int)dim - 1, start - 1, len)
                      : pg_backend_narrow_copy(&out, t, (int)dim - 1, start - 1, len); /* on t's device */
  PG_LUA_CHECK(L, rc);
  pg_lua_push_tensor(L, &out);
  return 1;
}

static int l_transpose(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1), out; /* the copy reads the data: host only */
  lua_Integer a = luaL_optinteger(L, 2, 1), b = luaL_optinteger(L, 3, 2);
  if (a < 1 || b < 1 || a > t->ndim || b > t->ndim)
    return luaL_error(L, "transpose: dimensions %I and %I out of range for a %d-d tensor", a, b, t->ndim);
  PG_LUA_CHECK(L, pg_tensor_transpose(&out, t, (int)a - 1, (int)b - 1));
  pg_lua_push_tensor(L, &out);
  return 1;
}

static int l_reshape(lua_State *L) {
  pg_tensor *t = pg_lua_check_any_tensor(L, 1), out;
  int64_t shape[PG_MAX_DIMS];
  int next;
  int ndim = read_shape(L, 2, shape, &next);
  PG_LUA_CHECK(L, pg_tensor_reshape_view(&out, t, ndim, shape));
  pg_lua_push_tensor(L, &out);
  return 1;
}

/* Second operand: a tensor, or a number broadcast to the first's shape. */
static const pg_tensor *operand(lua_State *L, int idx, const pg_tensor *like, pg_tensor *tmp) {
  if (lua_type(L, idx) == LUA_TNUMBER) {
    double v = check_value(L, like->dtype, lua_tonumber(L, idx), "operand");
    if (pg_tensor_init(tmp, like->dtype, like->ndim, like->shape)) luaL_error(L, "%s", pg_error());
    pg_tensor_fill(tmp, v);
    return tmp;
  }
  return pg_lua_check_tensor(L, idx);
}

/* Both operands broadcast (numpy rules); an in-place op keeps the first's shape, as in torch. */
static int binop(lua_State *L, pg_binop op, int inplace) {
  pg_tensor *a = pg_lua_check_tensor(L, 1), tmp = {0}, wide = {0};
  const pg_tensor *b = operand(L, 2, a, &tmp);
  pg_tensor *out = a;
  int64_t shape[PG_MAX_DIMS];
  int ndim, rc = PG_OK;
  if (!inplace && lua_type(L, 2) != LUA_TNUMBER && !pg_shape_equal(a, b)) {
    rc = pg_tensor_broadcast_shape(a, b, &ndim, shape);
    if (!rc && (ndim != a->ndim || pg_shape_numel(ndim, shape) != a->numel)) {
      rc = pg_tensor_expand(&wide, a, ndim, shape); /* a is the smaller one: widen it first */
      if (!rc) a = &wide;
    }
  }
  if (!rc) {
    if (!inplace) out = pg_lua_new_tensor(L, a->dtype, a->ndim, a->shape);
    rc = pg_tensor_binop(out, a, b, op);
  }
  pg_tensor_release(&tmp);
  pg_tensor_release(&wide);
  if (rc) return luaL_error(L, "%s", pg_error());
  if (inplace) lua_settop(L, 1);
  return 1;
}

static int l_add(lua_State *L) { return binop(L, PG_OP_ADD, 0); }
static int l_sub(lua_State *L) { return binop(L, PG_OP_SUB, 0); }
static int l_mul(lua_State *L) { return binop(L, PG_OP_MUL, 0); }
static int l_div(lua_State *L) { return binop(L, PG_OP_DIV, 0); }
static int l_add_(lua_State *L) { return binop(L, PG_OP_ADD, 1); }
static int l_sub_(lua_State *L) { return binop(L, PG_OP_SUB, 1); }
static int l_mul_(lua_State *L) { return binop(L, PG_OP_MUL, 1); }
static int l_div_(lua_State *L) { return binop(L, PG_OP_DIV, 1); }

static int l_scale(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1), out;
  double s = luaL_checknumber(L, 2);
  PG_LUA_CHECK(L, pg_tensor_clone(&out, t));
  pg_tensor *u = pg_lua_push_tensor(L, &out);
  PG_LUA_CHECK(L, pg_tensor_scale(u, s));
  return 1;
}

static int l_scale_(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1);
  PG_LUA_CHECK(L, pg_tensor_scale(t, luaL_checknumber(L, 2)));
  lua_settop(L, 1);
  return 1;
}

static int l_fill_(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1);
  pg_tensor_fill(t, check_value(L, t->dtype, luaL_checknumber(L, 2), "fill_"));
  lua_settop(L, 1);
  return 1;
}

static int l_copy_(lua_State *L) {
  pg_tensor *t = pg_lua_check_any_tensor(L, 1), *src = pg_lua_check_any_tensor(L, 2);
  PG_LUA_CHECK(L, pg_backend_copy_tensor(t, src));
  lua_settop(L, 1);
  return 1;
}

static int dim_arg(lua_State *L, int idx, const pg_tensor *t);

static int reduce_dim(lua_State *L, int mean) {
  pg_tensor *t = pg_lua_check_tensor(L, 1), out;
  PG_LUA_CHECK(L, pg_tensor_reduce_dim(&out, t, dim_arg(L, 2, t), mean));
  pg_lua_push_tensor(L, &out);
  return 1;
}

/* sum() -> number; sum(dim) -> tensor with that dimension reduced to size 1 (dim -1: the last) */
static int l_sum(lua_State *L) {
  if (!lua_isnoneornil(L, 2)) return reduce_dim(L, 0);
  pg_tensor *t = pg_lua_check_tensor(L, 1);
  double s = pg_tensor_sum(t);
  if (t->dtype == PG_INT32) lua_pushinteger(L, (lua_Integer)s);
  else lua_pushnumber(L, s);
  return 1;
}

static int l_mean(lua_State *L) {
  if (!lua_isnoneornil(L, 2)) return reduce_dim(L, 1);
  pg_tensor *t = pg_lua_check_tensor(L, 1);
  lua_pushnumber(L, t->numel ? pg_tensor_sum(t) / (double)t->numel : 0);
  return 1;
}

static int unary(lua_State *L, pg_unop op) {
  pg_tensor *t = pg_lua_check_tensor(L, 1), out;
  double arg = op == PG_UN_POW ? luaL_checknumber(L, 2) : 0;
  PG_LUA_CHECK(L, pg_tensor_unary(&out, t, op, arg));
  pg_lua_push_tensor(L, &out);
  return 1;
}

static int l_sqrt(lua_State *L) { return unary(L, PG_UN_SQRT); }
static int l_rsqrt(lua_State *L) { return unary(L, PG_UN_RSQRT); }
static int l_exp(lua_State *L) { return unary(L, PG_UN_EXP); }
static int l_log(lua_State *L) { return unary(L, PG_UN_LOG); }
static int l_tanh(lua_State *L) { return unary(L, PG_UN_TANH); }
static int l_neg(lua_State *L) { return unary(L, PG_UN_NEG); }
static int l_abs(lua_State *L) { return unary(L, PG_UN_ABS); }
static int l_pow(lua_State *L) { return unary(L, PG_UN_POW); }
static int l_sigmoid(lua_State *L) { return unary(L, PG_UN_SIGMOID); }
static int l_silu(lua_State *L) { return unary(L, PG_UN_SILU); }

/* A 1-based dimension argument (-1: the last) as 0-based. The runtime names a
 * dimension out of range with its operation; one far out of range is refused
 * here, before the cast to int would cut it (2^32 + 1 became dimension 1). */
static int dim_arg(lua_State *L, int idx, const pg_tensor *t) {
  lua_Integer d = luaL_checkinteger(L, idx);
  if (d < -PG_MAX_DIMS - 1 || d > PG_MAX_DIMS + 1)
    luaL_error(L, "dimension %I out of range for a %d-d tensor", d, t->ndim);
  if (d < 0) d = t->ndim + 1 + d;
  return (int)d - 1;
}

/* t:softmax(dim) */
static int l_softmax(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1), out;
  PG_LUA_CHECK(L, pg_tensor_softmax(&out, t, dim_arg(L, 2, t)));
  pg_lua_push_tensor(L, &out);
  return 1;
}

/* t:max(dim) -> values, indices (1-based int32), the dimension kept with size 1 as in sum(dim) */
static int l_max(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1), values, indices;
  PG_LUA_CHECK(L, pg_tensor_max_dim(&values, &indices, t, dim_arg(L, 2, t)));
  int32_t *ix = pg_tensor_i32(&indices);
  for (int64_t i = 0; i < indices.numel; i++) ix[i] += 1;
  pg_lua_push_tensor(L, &values);
  pg_lua_push_tensor(L, &indices);
  return 2;
}

/* t:argmax(dim) -> the indices of max(dim) */
static int l_argmax(lua_State *L) {
  l_max(L);
  return 1;
}

/* a:matmul(b) */
static int l_matmul(lua_State *L) {
  pg_tensor *a = pg_lua_check_tensor(L, 1), *b = pg_lua_check_tensor(L, 2), out;
  PG_LUA_CHECK(L, pg_tensor_matmul(&out, a, b));
  pg_lua_push_tensor(L, &out);
  return 1;
}

/* Indices given to Lua are 1-based: a 0-based int32 copy of an int32 tensor argument. */
static void zero_based(lua_State *L, int idx, pg_tensor *out, const char *what) {
  pg_tensor *t = pg_lua_check_tensor(L, idx);
  if (t->dtype != PG_INT32) luaL_error(L, "%s: indices must be an int32 tensor, not %s", what, pg_dtype_name(t->dtype));
  if (pg_tensor_clone(out, t)) luaL_error(L, "%s", pg_error());
  for (int64_t i = 0; i < out->numel; i++) pg_tensor_i32(out)[i] -= 1;
}

/* t:permute(d1, d2, ...) */
static int l_permute(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1), out;
  if (lua_gettop(L) - 1 != t->ndim) return luaL_error(L, "permute: %d dimensions given for a %d-d tensor", lua_gettop(L) - 1, t->ndim);
  int perm[PG_MAX_DIMS];
  for (int i = 0; i < t->ndim; i++) perm[i] = dim_arg(L, i + 2, t);
  PG_LUA_CHECK(L, pg_tensor_permute(&out, t, perm));
  pg_lua_push_tensor(L, &out);
  return 1;
}

/* t:index_select(dim, idx) and t:gather(dim, idx): idx an int32 tensor of 1-based indices */
static int select_or_gather(lua_State *L, int gather) {
  pg_tensor *t = pg_lua_check_tensor(L, 1), idx, out;
  int dim = dim_arg(L, 2, t);
  zero_based(L, 3, &idx, gather ? "gather" : "index_select");
  int rc = gather ? pg_tensor_gather(&out, t, dim, &idx) : pg_tensor_index_select(&out, t, dim, &idx);
  pg_tensor_release(&idx);
  PG_LUA_CHECK(L, rc);
  pg_lua_push_tensor(L, &out);
  return 1;
}
static int l_index_select(lua_State *L) { return select_or_gather(L, 0); }
static int l_gather(lua_State *L) { return select_or_gather(L, 1); }

/* t:topk(k [, dim = -1]) -> values, indices (1-based int32), largest first */
static int l_topk(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1), values, indices;
  lua_Integer k = luaL_checkinteger(L, 2);
  int dim = lua_isnoneornil(L, 3) ? t->ndim - 1 : dim_arg(L, 3, t);
  if (k < 0 || k > INT32_MAX) return luaL_error(L, "topk: k = %I is out of range", k);
  PG_LUA_CHECK(L, pg_tensor_topk(&values, &indices, t, (int)k, dim));
  for (int64_t i = 0; i < indices.numel; i++) pg_tensor_i32(&indices)[i] += 1;
  pg_lua_push_tensor(L, &values);
  pg_lua_push_tensor(L, &indices);
  return 2;
}

/* pg.cat({t1, t2, ...}, dim) */
static int l_cat(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  lua_Integer n = luaL_len(L, 1);
  if (n < 1 || n > 4096) return luaL_error(L, "cat: a list of 1 to 4096 tensors, got %I", n);
  const pg_tensor *ts[4096];
  for (lua_Integer i = 1; i <= n; i++) {
    lua_geti(L, 1, i);
    ts[i - 1] = pg_lua_check_any_tensor(L, -1);
    lua_pop(L, 1); /* the list keeps it alive */
  }
  pg_tensor out;
  PG_LUA_CHECK(L, pg_backend_cat(&out, ts, (int)n, dim_arg(L, 2, ts[0]))); /* on their device, all one */
  pg_lua_push_tensor(L, &out);
  return 1;
}

static int l_max_abs_diff(lua_State *L) {
  pg_tensor *a = pg_lua_check_tensor(L, 1), *b = pg_lua_check_tensor(L, 2);
  double d;
  PG_LUA_CHECK(L, pg_tensor_max_abs_diff(a, b, &d));
  lua_pushnumber(L, d);
  return 1;
}

/* max |a-b| / max(|b|, tiny), elementwise; the worst relative error. */
static int l_max_rel_diff(lua_State *L) {
  pg_tensor *a = pg_lua_check_tensor(L, 1), *b = pg_lua_check_tensor(L, 2);
  double d;
  PG_LUA_CHECK(L, pg_tensor_max_abs_diff(a, b, &d)); /* checks shapes */
  double m = 0;
  for (int64_t i = 0; i < a->numel; i++) {
    double x = pg_tensor_get_flat(a, i), y = pg_tensor_get_flat(b, i), den = fabs(y) > 1e-30 ? fabs(y) : 1e-30;
    double r = fabs(x - y) / den;
    if (x == y) r = 0;
    if (r > m || r != r) m = r;
  }
  lua_pushnumber(L, m);
  return 1;
}

/* allclose(other, rtol=1e-5, atol=1e-8): |a-b| <= atol + rtol*|b| everywhere. */
static int l_allclose(lua_State *L) {
  pg_tensor *a = pg_lua_check_tensor(L, 1), *b = pg_lua_check_tensor(L, 2);
  double rtol = luaL_optnumber(L, 3, 1e-5), atol = luaL_optnumber(L, 4, 1e-8), d;
  PG_LUA_CHECK(L, pg_tensor_max_abs_diff(a, b, &d));
  int ok = 1;
  for (int64_t i = 0; i < a->numel && ok; i++) {
    double x = pg_tensor_get_flat(a, i), y = pg_tensor_get_flat(b, i);
    ok = fabs(x - y) <= atol + rtol * fabs(y);
  }
  lua_pushboolean(L, ok);
  return 1;
}

/* equal(other): same shape, dtype and bytes (bitwise). */
static int l_equal(lua_State *L) {
  pg_tensor *a = pg_lua_check_tensor(L, 1), *b = pg_lua_check_tensor(L, 2);
  int ok = pg_shape_equal(a, b) && a->dtype == b->dtype &&
           !memcmp(pg_tensor_data(a), pg_tensor_data(b), (size_t)a->numel * pg_dtype_size(a->dtype));
  lua_pushboolean(L, ok);
  return 1;
}

static int64_t flat_index(lua_State *L, pg_tensor *t, int first, int count) {
  if (count != t->ndim && !(count == 1 && t->ndim == 0))
    luaL_error(L, "index: %d indices given for a %d-d tensor", count, t->ndim);
  int64_t flat = 0;
  for (int i = 0; i < t->ndim; i++) {
    lua_Integer k = luaL_checkinteger(L, first + i);
    if (k < 1 || k > t->shape[i])
      luaL_error(L, "index %I out of range for dimension %d of size %I", (lua_Integer)k, i + 1, (lua_Integer)t->shape[i]);
    flat = flat * t->shape[i] + (k - 1);
  }
  return flat;
}

static int l_get(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1);
  push_element(L, t, flat_index(L, t, 2, lua_gettop(L) - 1));
  return 1;
}

/* set(i, j, ..., value) */
static int l_set(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1);
  int top = lua_gettop(L);
  double v = check_value(L, t->dtype, luaL_checknumber(L, top), "set");
  pg_tensor_set_flat(t, flat_index(L, t, 2, top - 2), v);
  lua_settop(L, 1);
  return 1;
}

static int l_item(lua_State *L) {
  pg_tensor *t = pg_lua_check_tensor(L, 1);
  if (t->numel != 1) return luaL_error(L, "item: tensor has %I elements, not 1", (lua_Integer)t->numel);
  push_element(L, t, 0);
  return 1;
}

static int l_free(lua_State *L) {
  pg_tensor *t = luaL_checkudata(L, 1, PG_TENSOR_MT);
  pg_tensor_release(t);
  return 0;
}

static int l_tostring(lua_State *L) {
  pg_tensor *t = luaL_checkudata(L, 1, PG_TENSOR_MT);
  if (!t->storage) {
    lua_pushstring(L, "pg.Tensor(freed)");
    return 1;
  }
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  char d[160];
  lua_pushfstring(L, "pg.Tensor(%s", pg_tensor_describe(t, d, sizeof d));
  luaL_addvalue(&b);
  if (t->storage->device != PG_CPU) { /* values stay where they are: printing does not copy */
    luaL_addstring(&b, ", ");
    push_device(L, t->storage);
    luaL_addvalue(&b);
  } else if (t->numel <= 16) {
    luaL_addstring(&b, ": ");
    for (int64_t i = 0; i < t->numel; i++) {
      char num[40];
      if (t->dtype == PG_INT32) snprintf(num, sizeof num, "%s%d", i ? " " : "", pg_tensor_i32(t)[i]);
      else snprintf(num, sizeof num, "%s%.6g", i ? " " : "", pg_tensor_get_flat(t, i));
      luaL_addstring(&b, num);
    }
  }
  luaL_addstring(&b, ")");
  luaL_pushresult(&b);
  return 1;
}

static int l_len(lua_State *L) {
  pg_tensor *t = pg_lua_check_any_tensor(L, 1);
  lua_pushinteger(L, t->ndim ? t->shape[0] : 1);
  return 1;
}

static const luaL_Reg tensor_methods[] = {
    {"shape", l_shape}, {"size", l_size}, {"dim", l_dim}, {"numel", l_numel}, {"dtype", l_dtype},
    {"device", l_device}, {"to", l_to}, {"totable", l_totable}, {"clone", l_clone}, {"narrow", l_narrow},
    {"reshape", l_reshape}, {"view", l_reshape}, {"transpose", l_transpose}, {"add", l_add}, {"sub", l_sub}, {"mul", l_mul},
    {"div", l_div}, {"add_", l_add_}, {"sub_", l_sub_}, {"mul_", l_mul_}, {"div_", l_div_},
    {"scale", l_scale}, {"scale_", l_scale_}, {"mean", l_mean}, {"sqrt", l_sqrt}, {"rsqrt", l_rsqrt},
    {"exp", l_exp}, {"log", l_log}, {"tanh", l_tanh}, {"neg", l_neg}, {"abs", l_abs}, {"pow", l_pow},
    {"sigmoid", l_sigmoid}, {"silu", l_silu}, {"softmax", l_softmax}, {"max", l_max}, {"argmax", l_argmax},
    {"matmul", l_matmul}, {"bmm", l_matmul}, {"permute", l_permute}, {"index_select", l_index_select},
    {"gather", l_gather}, {"topk", l_topk}, {"fill_", l_fill_}, {"copy_", l_copy_}, {"sum", l_sum},
    {"max_abs_diff", l_max_abs_diff}, {"max_rel_diff", l_max_rel_diff}, {"allclose", l_allclose},
    {"equal", l_equal}, {"get", l_get}, {"set", l_set}, {"item", l_item}, {"free", l_free},
    {NULL, NULL}};

static int l_gc(lua_State *L) {
  pg_tensor *t = luaL_checkudata(L, 1, PG_TENSOR_MT);
  pg_tensor_release(t);
  return 0;
}

static int l_is_tensor(lua_State *L) {
  lua_pushboolean(L, pg_lua_test_tensor(L, 1) != NULL);
  return 1;
}

static const luaL_Reg tensor_functions[] = {{"tensor", l_tensor}, {"zeros", l_zeros}, {"ones", l_ones},
                                            {"full", l_full}, {"randn", l_randn}, {"arange", l_arange},
                                            {"is_tensor", l_is_tensor}, {"cat", l_cat}, {NULL, NULL}};

void pg_lua_open_tensor(lua_State *L) {
  if (luaL_newmetatable(L, PG_TENSOR_MT)) {
    luaL_newlib(L, tensor_methods);
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, l_gc);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, l_tostring);
    lua_setfield(L, -2, "__tostring");
    lua_pushcfunction(L, l_len);
    lua_setfield(L, -2, "__len");
    lua_pushstring(L, "pg.Tensor");
    lua_setfield(L, -2, "__name");
  }
  lua_pop(L, 1);
  luaL_setfuncs(L, tensor_functions, 0);
}
