/* Lua bindings for the optimizer: core.AdamW(engine, {lr=, beta1=, beta2=, eps=,
 * weight_decay=}, zero [, reshard_after_forward [, prefetch]]) -> optimizer userdata. lua/pipegoose/optim.lua wraps it. */
#include <float.h>
#include <math.h>

#include "lua_util.h"
#include "pg_optim.h"

#define PG_ADAMW_MT "pg.AdamW"

pg_engine *pg_lua_check_engine(lua_State *L, int idx);

typedef struct adamw_ud {
  pg_adamw *o;
} adamw_ud;

static pg_adamw *check_opt(lua_State *L, int idx) {
  adamw_ud *u = luaL_checkudata(L, idx, PG_ADAMW_MT);
  if (!u->o) luaL_error(L, "the optimizer was freed");
  return u->o;
}

/* A hyperparameter as float32: a finite value beyond float32's range is an
 * error here (converting it is undefined behaviour); the runtime checks ranges. */
static float hparam(lua_State *L, int idx, const char *key, float def) {
  lua_Number v = pg_lua_opt_number(L, idx, key, def);
  if (isfinite(v) && fabs(v) > FLT_MAX) luaL_error(L, "AdamW: %s=%f is beyond the range of float32", key, v);
  return (float)v;
}

/* Reads the hyperparameters given in the table at idx over *h; the runtime checks their values. */
static void read_hparams(lua_State *L, int idx, pg_adamw_hparams *h) {
  static const char *const keys[] = {"lr", "beta1", "beta2", "eps", "weight_decay", NULL};
  pg_lua_check_keys(L, idx, "AdamW", keys);
  h->lr = hparam(L, idx, "lr", h->lr);
  h->beta1 = hparam(L, idx, "beta1", h->beta1);
  h->beta2 = hparam(L, idx, "beta2", h->beta2);
  h->eps = hparam(L, idx, "eps", h->eps);
  h->weight_decay = hparam(L, idx, "weight_decay", h->weight_decay);
}

static int l_new(lua_State *L) {
  pg_engine *e = pg_lua_check_engine(L, 1);
  pg_adamw_hparams h = {1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f};
  read_hparams(L, 2, &h);
  int zero = lua_isnoneornil(L, 3) ? 0 : (int)pg_lua_check_int_in(L, 3, "zero", 0, 3);
  /* zero = 3: reshard_after_forward and prefetch (default true) */
  if (!lua_isnoneornil(L, 4)) PG_LUA_CHECK(L, pg_engine_set_reshard_after_forward(e, lua_toboolean(L, 4)));
  if (!lua_isnoneornil(L, 5)) PG_LUA_CHECK(L, pg_engine_set_prefetch(e, lua_toboolean(L, 5)));
  adamw_ud *u = lua_newuserdatauv(L, sizeof *u, 1);
  u->o = NULL;
  luaL_setmetatable(L, PG_ADAMW_MT);
  lua_pushvalue(L, 1);
  lua_setiuservalue(L, -2, 1); /* keep the engine alive */
  u->o = pg_adamw_new(e, &h, zero);
  if (!u->o) return luaL_error(L, "%s", pg_error());
  return 1;
}

static int l_step(lua_State *L) {
  PG_LUA_CHECK(L, pg_adamw_step(check_opt(L, 1)));
  return 0;
}

static int l_grad_norm(lua_State *L) {
  double n;
  PG_LUA_CHECK(L, pg_adamw_grad_norm(check_opt(L, 1), &n));
  lua_pushnumber(L, n);
  return 1;
}

static int l_clip(lua_State *L) {
  double n;
  PG_LUA_CHECK(L, pg_adamw_clip(check_opt(L, 1), luaL_checknumber(L, 2), &n));
  lua_pushnumber(L, n);
  return 1;
}

/* opt:hparams([table]) -> the current values (sets the given ones first) */
static int l_hparams(lua_State *L) {
  pg_adamw *o = check_opt(L, 1);
  if (!lua_isnoneornil(L, 2)) {
    pg_adamw_hparams h = o->h;
    read_hparams(L, 2, &h);
    PG_LUA_CHECK(L, pg_adamw_set_hparams(o, &h));
  }
  lua_createtable(L, 0, 5);
  lua_pushnumber(L, o->h.lr);
  lua_setfield(L, -2, "lr");
  lua_pushnumber(L, o->h.beta1);
  lua_setfield(L, -2, "beta1");
  lua_pushnumber(L, o->h.beta2);
  lua_setfield(L, -2, "beta2");
  lua_pushnumber(L, o->h.eps);
  lua_setfield(L, -2, "eps");
  lua_pushnumber(L, o->h.weight_decay);
  lua_setfield(L, -2, "weight_decay");
  return 1;
}

/* opt:state() -> { step=, lo=, hi= (0-based flat range of the dense region), elo=, ehi= (of the experts'
 * region; empty without expert parallelism), m=, v= (tensor views: [hi - lo] then [ehi - elo]), grad= (the
 * gradients of both ranges, as m, read by the next step; where the engine keeps them apart, zero 1's whole buffer
 * with an experts' region not right after [lo, hi), those of [lo, hi) only and expert_grad= those of [elo, ehi)),
 * with zero = 3 param= (the parameters of both ranges) } */
static int l_state(lua_State *L) {
  pg_adamw *o = check_opt(L, 1);
  lua_createtable(L, 0, 7);
  lua_pushinteger(L, o->step);
  lua_setfield(L, -2, "step");
  lua_pushinteger(L, o->lo);
  lua_setfield(L, -2, "lo");
  lua_pushinteger(L, o->hi);
  lua_setfield(L, -2, "hi");
  lua_pushinteger(L, o->elo);
  lua_setfield(L, -2, "elo");
  lua_pushinteger(L, o->ehi);
  lua_setfield(L, -2, "ehi");
  int64_t n = o->hi - o->lo + o->ehi - o->elo;
  pg_tensor t;
  PG_LUA_CHECK(L, pg_tensor_init_view(&t, o->m, 0, PG_FLOAT32, 1, &n));
  pg_lua_push_tensor(L, &t);
  lua_setfield(L, -2, "m");
  PG_LUA_CHECK(L, pg_tensor_init_view(&t, o->v, 0, PG_FLOAT32, 1, &n));
  pg_lua_push_tensor(L, &t);
  lua_setfield(L, -2, "v");
  pg_engine *e = o->engine;
  size_t at = (size_t)(pg_engine_grad_at(e, o->lo) - (float *)e->grad_store->data);
  int64_t dn = o->hi - o->lo, en = o->ehi - o->elo;
  int apart = en > 0 && pg_engine_grad_at(e, o->elo) != pg_engine_grad_at(e, o->lo) + dn;
  PG_LUA_CHECK(L, pg_tensor_init_view(&t, e->grad_store, at, PG_FLOAT32, 1, apart ? &dn : &n));
  pg_lua_push_tensor(L, &t);
  lua_setfield(L, -2, "grad");
  if (apart) {
    at = (size_t)(pg_engine_grad_at(e, o->elo) - (float *)e->grad_store->data);
    PG_LUA_CHECK(L, pg_tensor_init_view(&t, e->grad_store, at, PG_FLOAT32, 1, &en));
    pg_lua_push_tensor(L, &t);
    lua_setfield(L, -2, "expert_grad");
  }
  if (e->params_sharded) { /* ZeRO-3: the parameters of [lo, hi), all this rank holds of them */
    at = (size_t)(pg_engine_param_at(e, o->lo) - (float *)e->param_store->data);
    PG_LUA_CHECK(L, pg_tensor_init_view(&t, e->param_store, at, PG_FLOAT32, 1, &n));
    pg_lua_push_tensor(L, &t);
    lua_setfield(L, -2, "param");
  }
  return 1;
}

static int l_set_step(lua_State *L) {
  pg_adamw *o = check_opt(L, 1);
  lua_Integer s = luaL_checkinteger(L, 2);
  if (s < 0) return luaL_error(L, "optimizer step must be >= 0, not %I", s);
  o->step = (long)s;
  return 0;
}

static int l_state_bytes(lua_State *L) {
  pg_adamw *o = check_opt(L, 1);
  lua_pushinteger(L, (lua_Integer)(o->m->bytes + o->v->bytes));
  return 1;
}

static int l_free(lua_State *L) {
  adamw_ud *u = luaL_checkudata(L, 1, PG_ADAMW_MT);
  pg_adamw_free(u->o);
  u->o = NULL;
  return 0;
}

static const luaL_Reg methods[] = {{"step", l_step}, {"grad_norm", l_grad_norm}, {"clip", l_clip},
                                   {"hparams", l_hparams}, {"state", l_state}, {"set_step", l_set_step},
                                   {"state_bytes", l_state_bytes}, {"free", l_free}, {NULL, NULL}};

void pg_lua_open_optim(lua_State *L) {
  if (luaL_newmetatable(L, PG_ADAMW_MT)) {
    luaL_newlib(L, methods);
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, l_free);
    lua_setfield(L, -2, "__gc");
  }
  lua_pop(L, 1);
  lua_pushcfunction(L, l_new);
  lua_setfield(L, -2, "AdamW");
}
