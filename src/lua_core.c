/* The Lua C module "pipegoose.core": every binding area in one table.
 * pglua preloads it; a plain lua5.4 loads it from build/lua/pipegoose/core.so
 * (or the install prefix), and MPI then starts lazily on first use. */
#define _GNU_SOURCE
#include <dlfcn.h>

#include "lua_util.h"

int luaopen_pipegoose_core(lua_State *L);

int luaopen_pipegoose_core(lua_State *L) {
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
  lua_pushstring(L, PG_VERSION);
  lua_setfield(L, -2, "version");
  return 1;
}
