/* Lua bindings for pg_fs (pg.fs): directories without a shell, and terminals.
 *   fs.exists(path), fs.is_dir(path) -> boolean
 *   fs.kind(path) -> "file" | "link" | "directory" | "other", or nil (nothing there; lstat)
 *   fs.mkdir_p(path), fs.remove_tree(path)           errors name the path
 *   fs.list(dir) -> sorted names (no . and ..)        an error when dir cannot be read
 *   fs.exchange(a, b) -> true, or nil and why        the two paths swapped in one step (renameat2)
 *   fs.isatty("stdout" | "stderr" | "stdin" | fd) -> boolean
 *   fs.parent_isatty("stdout" | ... | fd) -> boolean  the parent process's descriptor (mpirun's, under mpirun)
 *   fs.getpid() -> this process's id
 * Atomic writes are pg.file.write (src/lua/lua_file.c). */
#include <string.h>
#include <unistd.h>

#include "lua_util.h"
#include "pg_fs.h"

static int l_exists(lua_State *L) {
  lua_pushboolean(L, pg_fs_exists(luaL_checkstring(L, 1)));
  return 1;
}

static int l_is_dir(lua_State *L) {
  lua_pushboolean(L, pg_fs_is_dir(luaL_checkstring(L, 1)));
  return 1;
}

static int l_kind(lua_State *L) {
  switch (pg_fs_kind(luaL_checkstring(L, 1))) {
  case 'f': lua_pushliteral(L, "file"); break;
  case 'l': lua_pushliteral(L, "link"); break;
  case 'd': lua_pushliteral(L, "directory"); break;
  case 'o': lua_pushliteral(L, "other"); break;
  default: lua_pushnil(L);
  }
  return 1;
}

static int l_mkdir_p(lua_State *L) {
  PG_LUA_CHECK(L, pg_fs_mkdir_p(luaL_checkstring(L, 1)));
  return 0;
}

static int l_remove_tree(lua_State *L) {
  PG_LUA_CHECK(L, pg_fs_remove_tree(luaL_checkstring(L, 1)));
  return 0;
}

/* exchange(a, b) -> true, or nil and why (pg_fs_exchange: the two swapped in one step). */
static int l_exchange(lua_State *L) {
  if (pg_fs_exchange(luaL_checkstring(L, 1), luaL_checkstring(L, 2)) == PG_OK) {
    lua_pushboolean(L, 1);
    return 1;
  }
  lua_pushnil(L);
  lua_pushstring(L, pg_error());
  return 2;
}

static int l_list(lua_State *L) {
  char **names;
  int n;
  PG_LUA_CHECK(L, pg_fs_list(luaL_checkstring(L, 1), &names, &n));
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    lua_pushstring(L, names[i]);
    lua_rawseti(L, -2, i + 1);
  }
  pg_fs_free_list(names, n);
  return 1;
}

/* A descriptor by name ("stdin", "stdout", "stderr"; default stdout) or number. */
static int check_fd(lua_State *L, int arg) {
  if (lua_type(L, arg) == LUA_TNUMBER) return (int)luaL_checkinteger(L, arg);
  static const char *const names[] = {"stdin", "stdout", "stderr", NULL};
  return luaL_checkoption(L, arg, "stdout", names);
}

static int l_isatty(lua_State *L) {
  lua_pushboolean(L, pg_fs_isatty(check_fd(L, 1)));
  return 1;
}

static int l_parent_isatty(lua_State *L) {
  lua_pushboolean(L, pg_fs_parent_isatty(check_fd(L, 1)));
  return 1;
}

static int l_getpid(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)getpid());
  return 1;
}

static const luaL_Reg fns[] = {{"exists", l_exists}, {"is_dir", l_is_dir}, {"kind", l_kind}, {"mkdir_p", l_mkdir_p},
                               {"remove_tree", l_remove_tree}, {"exchange", l_exchange}, {"list", l_list}, {"isatty", l_isatty},
                               {"parent_isatty", l_parent_isatty}, {"getpid", l_getpid}, {NULL, NULL}};

void pg_lua_open_fs(lua_State *L) {
  luaL_newlib(L, fns);
  lua_setfield(L, -2, "fs");
}
