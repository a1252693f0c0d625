/* The Lua C module "pipegoose.core": every binding area in one table.
 * pglua preloads it; a plain lua5.4 loads it from build/lua/pipegoose/core.so
 * (or the install prefix), and MPI then starts lazily on first use. */
#define _GNU_SOURCE
#include <dlfcn.h>

#include <stdlib.h>
#include <string.h>

#include "lua_util.h"
#include "pg_env.h"
#include "pg_machine.h"

int luaopen_pipegoose_core(lua_State *L);

/* core.machine() -> {features = "avx2 fma ...", blas_core = OpenBLAS's kernels in use,
 *                   blas_core_chosen = true when pglua set OPENBLAS_CORETYPE (pg_machine.h)} */
static int l_machine(lua_State *L) {
  char features[128];
  pg_machine_features(features, sizeof features);
  lua_createtable(L, 0, 3);
  lua_pushstring(L, features);
  lua_setfield(L, -2, "features");
  lua_pushstring(L, pg_machine_blas_running());
  lua_setfield(L, -2, "blas_core");
  const char *chosen = getenv("PG_DEFAULT_BLAS_CORE"), *set = getenv("OPENBLAS_CORETYPE");
  lua_pushboolean(L, chosen && set && !strcmp(chosen, set));
  lua_setfield(L, -2, "blas_core_chosen");
  return 1;
}

/* env(name) -> the variable's value as pg_env.h parses it (a number, an integer, a boolean or the chosen
 * word; its default when unset), or an error naming the variable and the value */
static int l_env(lua_State *L) {
  const char *name = luaL_checkstring(L, 1);
  char type = 0;
  for (int i = 0; pg_env_name(i, &type); i++) {
    if (strcmp(pg_env_name(i, &type), name)) continue;
    double d;
    long l;
    int b;
    const char *c;
    switch (type) {
    case 'd': PG_LUA_CHECK(L, pg_env_double(name, &d)); lua_pushnumber(L, d); return 1;
    case 'l': PG_LUA_CHECK(L, pg_env_long(name, &l)); lua_pushinteger(L, l); return 1;
    case 'b': PG_LUA_CHECK(L, pg_env_bool(name, &b)); lua_pushboolean(L, b); return 1;
    case 'p': PG_LUA_CHECK(L, pg_env_path(name, &c)); c ? lua_pushstring(L, c) : lua_pushnil(L); return 1;
    default: PG_LUA_CHECK(L, pg_env_choice(name, &c)); lua_pushstring(L, c); return 1;
    }
  }
  return luaL_error(L, "%s is not an environment variable pipegoose reads", name);
}

int luaopen_pipegoose_core(lua_State *L) {
  /* pglua checked these at start-up; a plain lua loading the module gets the same refusal */
  PG_LUA_CHECK(L, pg_env_check_all());
  /* Lua loads C modules with RTLD_LOCAL; Open MPI's plugins need libmpi's
   * symbols globally visible, so promote the already-loaded library. */
  dlopen("libmpi.so.40", RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
  lua_newtable(L);
  pg_lua_open_tensor(L);
  pg_lua_open_context(L);
  pg_lua_open_dist(L);
  pg_lua_open_nn(L);
  pg_lua_open_optim(L);
  pg_lua_open_file(L);
  pg_lua_open_fs(L);
  pg_lua_open_ops(L);
  pg_lua_open_data(L);
  pg_lua_open_cuda(L);
  pg_lua_open_loss(L);
  pg_lua_open_tokenizer(L);
  lua_pushstring(L, PG_VERSION);
  lua_setfield(L, -2, "version");
  lua_pushcfunction(L, l_machine);
  lua_setfield(L, -2, "machine");
  lua_pushcfunction(L, l_env);
  lua_setfield(L, -2, "env");
  return 1;
}
