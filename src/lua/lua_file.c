/* Lua bindings for binary files: arrays at offsets, atomic writes, checksums.
 *   core.file.read(path, byte_offset, count, dtype) -> tensor [count]
 *   core.file.size(path) -> bytes
 *   core.file.write(path, parts) : parts is a list of strings and tensors,
 *       written in order to path atomically; returns crc32, bytes
 *   core.file.crc32(path) -> crc32, bytes
 *   core.file.create_exclusive(path, text) -> true (created), false (it existed)
 *   core.file.realpath(path) -> absolute path, or nil, message */
#include <limits.h>

#include "lua_util.h"
#include "pg_file.h"
#include "pg_size.h"

static int l_read(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  lua_Integer off = luaL_checkinteger(L, 2), n = luaL_checkinteger(L, 3);
  pg_dtype dt = PG_FLOAT32;
  if (!lua_isnoneornil(L, 4)) PG_LUA_CHECK(L, pg_dtype_from_name(luaL_checkstring(L, 4), &dt));
  if (off < 0 || n < 0) return luaL_error(L, "file.read: offset and count must be >= 0");
  /* The range must lie in the file before a tensor of n elements is made: a
   * count from a corrupt header would otherwise allocate (and zero) it first. */
  int64_t bytes, end, size;
  if (pg_mul_overflows(n, (int64_t)pg_dtype_size(dt), &bytes) || pg_add_overflows(off, bytes, &end))
    return luaL_error(L, "file.read: %s: %I %s values at offset %I run past 2^63 bytes", path, n, pg_dtype_name(dt),
                      off);
  PG_LUA_CHECK(L, pg_file_size(path, &size));
  if (end > size)
    return luaL_error(L, "%s: truncated: needs %I bytes at offset %I, but the file has %I bytes", path,
                      (lua_Integer)bytes, off, (lua_Integer)size);
  int64_t shape[1] = {n};
  pg_tensor *t = pg_lua_new_tensor(L, dt, 1, shape);
  PG_LUA_CHECK(L, pg_file_read_at(path, off, pg_tensor_data(t), (size_t)n * pg_dtype_size(dt)));
  return 1;
}

static int l_size(lua_State *L) {
  int64_t s;
  PG_LUA_CHECK(L, pg_file_size(luaL_checkstring(L, 1), &s));
  lua_pushinteger(L, s);
  return 1;
}

static int l_write(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  int n = (int)luaL_len(L, 2);
  pg_file_writer w;
  PG_LUA_CHECK(L, pg_file_writer_open(&w, path));
  for (int i = 1; i <= n; i++) {
    lua_geti(L, 2, i);
    int rc;
    if (lua_type(L, -1) == LUA_TSTRING) {
      size_t len;
      const char *s = lua_tolstring(L, -1, &len);
      rc = pg_file_writer_write(&w, s, len);
    } else {
      pg_tensor *t = pg_lua_test_tensor(L, -1);
      if (!t || !t->storage) {
        pg_file_writer_abort(&w);
        return luaL_error(L, "file.write: part %d is a %s, not a string or tensor", i, luaL_typename(L, -1));
      }
      rc = pg_file_writer_write(&w, pg_tensor_data(t), (size_t)t->numel * pg_dtype_size(t->dtype));
    }
    lua_pop(L, 1);
    if (rc) {
      pg_file_writer_abort(&w);
      return luaL_error(L, "%s", pg_error());
    }
  }
  uint32_t crc = w.crc;
  int64_t bytes = w.bytes;
  PG_LUA_CHECK(L, pg_file_writer_commit(&w));
  lua_pushinteger(L, crc);
  lua_pushinteger(L, bytes);
  return 2;
}

static int l_crc32(lua_State *L) {
  uint32_t crc;
  int64_t bytes;
  PG_LUA_CHECK(L, pg_file_crc32(luaL_checkstring(L, 1), &crc, &bytes));
  lua_pushinteger(L, crc);
  lua_pushinteger(L, bytes);
  return 2;
}

/* crc32 of a string or tensor's bytes */
static int l_crc32_of(lua_State *L) {
  uint32_t crc;
  if (lua_type(L, 1) == LUA_TSTRING) {
    size_t len;
    const char *s = lua_tolstring(L, 1, &len);
    crc = pg_crc32(0, s, len);
  } else {
    pg_tensor *t = pg_lua_check_tensor(L, 1);
    crc = pg_crc32(0, pg_tensor_data(t), (size_t)t->numel * pg_dtype_size(t->dtype));
  }
  lua_pushinteger(L, crc);
  return 1;
}

static int l_fsync_dir(lua_State *L) {
  PG_LUA_CHECK(L, pg_fsync_dir(luaL_checkstring(L, 1)));
  return 0;
}

/* Lock files (lua/pipegoose/checkpoint.lua): O_EXCL, which Lua's io cannot ask for. */
static int l_create_exclusive(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  size_t len;
  const char *text = luaL_checklstring(L, 2, &len);
  int exists;
  PG_LUA_CHECK(L, pg_file_create_exclusive(path, text, len, &exists));
  lua_pushboolean(L, !exists);
  return 1;
}

/* nil + message (not an error) for a path that does not resolve: callers
 * report a missing file in their own words. */
static int l_realpath(lua_State *L) {
  char out[PATH_MAX];
  if (pg_file_realpath(luaL_checkstring(L, 1), out) != PG_OK) {
    lua_pushnil(L);
    lua_pushstring(L, pg_error());
    return 2;
  }
  lua_pushstring(L, out);
  return 1;
}

static const luaL_Reg fns[] = {{"read", l_read}, {"size", l_size}, {"write", l_write}, {"crc32", l_crc32},
                               {"crc32_of", l_crc32_of}, {"fsync_dir", l_fsync_dir},
                               {"create_exclusive", l_create_exclusive}, {"realpath", l_realpath}, {NULL, NULL}};

void pg_lua_open_file(lua_State *L) {
  luaL_newlib(L, fns);
  lua_setfield(L, -2, "file");
}
