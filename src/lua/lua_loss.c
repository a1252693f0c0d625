/* Lua bindings of pg_loss (core.loss, pg.loss): the losses an objective
 * written in Lua takes of the engine's output (objective(out, batch) gets
 * batch.vocab and batch.ctx: pass them on as the options below).
 *
 *   loss.cross_entropy(logits [N, W], targets (N int32, any shape) [, opts]) -> loss, dlogits, parts
 *   loss.kl_div(student [N, W], teacher [N, W or vocab] [, opts]) -> loss, dstudent
 *
 * opts: vocab = {size=, first= (1-based), count=} (a vocabulary split over
 * the tensor group; default: the W columns are the whole, real vocabulary),
 * ctx = the context whose tensor group holds the other columns,
 * cross_entropy: label_smoothing (0), z_loss (0), ignore_index (-100),
 * reduction ("mean" | "sum"); kl_div: temperature (1). parts = {nll=, z=, tokens=}. */
#include <string.h>

#include "lua_util.h"
#include "pg_loss.h"

static const float *float_rows(lua_State *L, int idx, const char *fn, const char *what, int64_t *N, int64_t *W) {
  pg_tensor *t = pg_lua_check_tensor(L, idx);
  char d[128];
  if (t->dtype != PG_FLOAT32 || t->ndim != 2)
    luaL_error(L, "%s: %s must be a float32 tensor [rows, columns], got %s", fn, what, pg_tensor_describe(t, d, sizeof d));
  *N = t->shape[0];
  *W = t->shape[1];
  return pg_tensor_f32(t);
}

/* The columns and the context from opts (at idx); W: the tensor's columns. */
static pg_context *read_columns(lua_State *L, int idx, const char *fn, int64_t W, pg_loss_columns *c) {
  c->size = W, c->first = 0, c->count = (int)W;
  pg_context *ctx = NULL;
  if (lua_getfield(L, idx, "ctx") != LUA_TNIL) ctx = pg_lua_check_context(L, lua_gettop(L));
  lua_pop(L, 1);
  int t = lua_getfield(L, idx, "vocab");
  if (t == LUA_TTABLE) {
    int v = lua_gettop(L);
    static const char *const keys[] = {"size", "first", "count", "padded", NULL};
    pg_lua_check_keys(L, v, fn, keys);
    c->size = pg_lua_opt_int_in(L, v, "size", W, 1, INT32_MAX);
    c->first = pg_lua_opt_int_in(L, v, "first", 1, 1, INT32_MAX) - 1;
    c->count = (int)pg_lua_opt_int_in(L, v, "count", W, 1, INT32_MAX);
    if (c->count != W)
      luaL_error(L, "%s: vocab.count=%d but the logits have %d columns", fn, c->count, (int)W);
  } else if (t != LUA_TNIL) {
    luaL_error(L, "%s: vocab must be the table objective(out, batch) gets as batch.vocab, got a %s", fn,
               luaL_typename(L, -1));
  }
  lua_pop(L, 1);
  if (c->first > 0 && !ctx) luaL_error(L, "%s: a split vocabulary (vocab.first > 1) needs ctx= (batch.ctx)", fn);
  return ctx;
}

static int l_cross_entropy(lua_State *L) {
  const char *fn = "loss.cross_entropy";
  int64_t N, W;
  const float *x = float_rows(L, 1, fn, "logits", &N, &W);
  pg_tensor *tg = pg_lua_check_tensor(L, 2);
  char d[128];
  if (tg->dtype != PG_INT32 || tg->numel != N)
    luaL_error(L, "%s: targets must be %I int32 values (one per row), got %s", fn, (lua_Integer)N,
               pg_tensor_describe(tg, d, sizeof d));
  if (lua_isnoneornil(L, 3)) {
    lua_settop(L, 2);
    lua_newtable(L);
  }
  luaL_checktype(L, 3, LUA_TTABLE);
  static const char *const keys[] = {"vocab", "ctx", "label_smoothing", "z_loss", "ignore_index", "reduction", NULL};
  pg_lua_check_keys(L, 3, fn, keys);
  pg_loss_columns cols;
  pg_context *ctx = read_columns(L, 3, fn, W, &cols);
  pg_ce_opts o = {.label_smoothing = pg_lua_opt_number(L, 3, "label_smoothing", 0),
                  .z_loss = pg_lua_opt_number(L, 3, "z_loss", 0),
                  .ignore_index = (int32_t)pg_lua_opt_int_in(L, 3, "ignore_index", -100, INT32_MIN, INT32_MAX)};
  const char *red = pg_lua_opt_string(L, 3, "reduction", "mean");
  if (strcmp(red, "mean") && strcmp(red, "sum"))
    return luaL_error(L, "%s: reduction must be 'mean' or 'sum', not '%s'", fn, red);
  o.sum = !strcmp(red, "sum");
  int64_t shape[2] = {N, W};
  pg_tensor *g = pg_lua_new_tensor(L, PG_FLOAT32, 2, shape);
  pg_ce_result r;
  if (ctx) pg_lua_from_caller(L, ctx);
  int rc = pg_loss_cross_entropy(ctx, x, pg_tensor_i32(tg), N, &cols, &o, pg_tensor_f32(g), &r);
  if (ctx) pg_lua_comm_done(L, ctx, rc);
  else PG_LUA_CHECK(L, rc);
  lua_pushnumber(L, r.loss);
  lua_insert(L, -2);
  lua_createtable(L, 0, 3);
  lua_pushnumber(L, r.nll);
  lua_setfield(L, -2, "nll");
  lua_pushnumber(L, r.z);
  lua_setfield(L, -2, "z");
  lua_pushinteger(L, (lua_Integer)r.count);
  lua_setfield(L, -2, "tokens");
  return 3;
}

static int l_kl_div(lua_State *L) {
  const char *fn = "loss.kl_div";
  int64_t N, W, tN, tW;
  const float *s = float_rows(L, 1, fn, "student", &N, &W);
  const float *t = float_rows(L, 2, fn, "teacher", &tN, &tW);
  if (tN != N) return luaL_error(L, "%s: the teacher has %I rows, the student %I", fn, (lua_Integer)tN, (lua_Integer)N);
  if (lua_isnoneornil(L, 3)) {
    lua_settop(L, 2);
    lua_newtable(L);
  }
  luaL_checktype(L, 3, LUA_TTABLE);
  static const char *const keys[] = {"vocab", "ctx", "temperature", NULL};
  pg_lua_check_keys(L, 3, fn, keys);
  pg_loss_columns cols;
  pg_context *ctx = read_columns(L, 3, fn, W, &cols);
  double tau = pg_lua_opt_number(L, 3, "temperature", 1);
  /* the teacher holds this rank's slice (same width) or the whole vocabulary */
  int64_t teacher_first = tW == W ? cols.first : 0;
  if (tW != W && tW < cols.size)
    return luaL_error(L, "%s: the teacher has %I columns: give this rank's %I or the vocabulary's %I", fn,
                      (lua_Integer)tW, (lua_Integer)W, (lua_Integer)cols.size);
  int64_t shape[2] = {N, W};
  pg_tensor *g = pg_lua_new_tensor(L, PG_FLOAT32, 2, shape);
  double loss = 0;
  if (ctx) pg_lua_from_caller(L, ctx);
  int rc = pg_loss_kl_div(ctx, s, t, tW, teacher_first, N, &cols, tau, pg_tensor_f32(g), &loss);
  if (ctx) pg_lua_comm_done(L, ctx, rc);
  else PG_LUA_CHECK(L, rc);
  lua_pushnumber(L, loss);
  lua_insert(L, -2);
  return 2;
}

static const luaL_Reg loss_functions[] = {{"cross_entropy", l_cross_entropy}, {"kl_div", l_kl_div}, {NULL, NULL}};

void pg_lua_open_loss(lua_State *L) {
  luaL_newlib(L, loss_functions);
  lua_setfield(L, -2, "loss");
}
