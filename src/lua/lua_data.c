/* Lua bindings for token data: shard files, the loader userdata behind
 * pg.data.TokenShards (lua/pipegoose/data.lua), and the byte tokenizer.
 * Everything lives in the core module's `token_data` table; pg.data is the
 * documented face. */
#include <limits.h>
#include <string.h>

#include "lua_util.h"
#include "pg_data.h"

#define PG_LOADER_MT "pg.TokenLoader"

/* ---- shards ---- */

/* Tokens from an int32 tensor (its own memory) or a table of integers (copied
 * into a userdata pushed on the stack, so an error cannot leak it). */
static const int32_t *check_tokens(lua_State *L, int idx, int64_t *n) {
  pg_tensor *t = pg_lua_test_tensor(L, idx);
  if (t) {
    if (!t->storage) luaL_error(L, "bad argument #%d: the tensor was freed", idx);
    if (t->dtype != PG_INT32) luaL_error(L, "bad argument #%d: tokens must be an int32 tensor, got %s", idx, pg_dtype_name(t->dtype));
    *n = t->numel;
    return pg_tensor_i32(t);
  }
  if (!lua_istable(L, idx)) luaL_typeerror(L, idx, "int32 tensor or table of token ids");
  lua_Integer len = luaL_len(L, idx);
  int32_t *buf = lua_newuserdatauv(L, (size_t)(len > 0 ? len : 1) * sizeof *buf, 0);
  for (lua_Integer i = 1; i <= len; i++) {
    lua_geti(L, idx, i);
    int isint = 0;
    lua_Integer v = lua_tointegerx(L, -1, &isint);
    lua_pop(L, 1);
    if (!isint || v < INT32_MIN || v > INT32_MAX) luaL_error(L, "bad argument #%d: entry %I is not an int32 token id", idx, i);
    buf[i - 1] = (int32_t)v;
  }
  *n = len;
  return buf;
}

/* write_shard(path, tokens [, version]) */
static int l_write_shard(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  lua_Integer version = lua_isnoneornil(L, 3) ? 0 : pg_lua_check_int_in(L, 3, "version", INT_MIN, INT_MAX);
  int64_t n;
  const int32_t *tok = check_tokens(L, 2, &n);
  PG_LUA_CHECK(L, pg_shard_write(path, tok, n, (int)version));
  return 0;
}

static int l_read_shard(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  lua_Integer vocab = luaL_optinteger(L, 2, 0);
  pg_shard s;
  PG_LUA_CHECK(L, pg_shard_open(&s, path, vocab));
  int64_t n = s.ntokens;
  pg_tensor *t = lua_newuserdatauv(L, sizeof *t, 0);
  memset(t, 0, sizeof *t);
  luaL_setmetatable(L, PG_TENSOR_MT);
  int rc = pg_tensor_init(t, PG_INT32, 1, &n);
  if (rc == PG_OK) rc = pg_shard_read(&s, 0, n, pg_tensor_i32(t));
  pg_shard_close(&s);
  PG_LUA_CHECK(L, rc);
  return 1;
}

static int l_shard_info(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  int version;
  int64_t n;
  PG_LUA_CHECK(L, pg_shard_info(path, &version, &n));
  lua_createtable(L, 0, 2);
  lua_pushinteger(L, version);
  lua_setfield(L, -2, "version");
  lua_pushinteger(L, (lua_Integer)n);
  lua_setfield(L, -2, "tokens");
  return 1;
}

/* expand_paths(path | {paths...}) -> {files...}: each glob pattern expands to
 * its sorted matches; other paths stay as given (opening names a missing one). */
static void add_expanded(lua_State *L, int out, const char *p, lua_Integer *k) {
  if (!pg_data_is_glob(p)) {
    lua_pushstring(L, p);
    lua_rawseti(L, out, ++*k);
    return;
  }
  char **paths;
  int n;
  if (pg_data_glob(p, &paths, &n)) luaL_error(L, "%s", pg_error());
  for (int i = 0; i < n; i++) {
    lua_pushstring(L, paths[i]);
    lua_rawseti(L, out, ++*k);
  }
  pg_data_free_paths(paths, n);
}

static int l_expand_paths(lua_State *L) {
  lua_newtable(L);
  int out = lua_gettop(L);
  lua_Integer k = 0;
  if (lua_type(L, 1) == LUA_TSTRING) {
    add_expanded(L, out, lua_tostring(L, 1), &k);
  } else if (lua_istable(L, 1)) {
    lua_Integer len = luaL_len(L, 1);
    for (lua_Integer i = 1; i <= len; i++) {
      if (lua_geti(L, 1, i) != LUA_TSTRING) return luaL_error(L, "path entry %I is a %s, not a string", i, luaL_typename(L, -1));
      add_expanded(L, out, lua_tostring(L, -1), &k);
      lua_pop(L, 1);
    }
  } else {
    return luaL_typeerror(L, 1, "path string or table of paths");
  }
  if (k == 0) return luaL_error(L, "no token files given");
  return 1;
}

/* ---- the loader ---- */

static pg_loader *check_loader(lua_State *L, int idx) {
  pg_loader *ld = luaL_checkudata(L, idx, PG_LOADER_MT);
  if (!ld->files) luaL_error(L, "the token loader is closed");
  return ld;
}

static lua_Integer req_int(lua_State *L, int idx, const char *key) {
  if (lua_getfield(L, idx, key) == LUA_TNIL) luaL_error(L, "TokenShards: %s= is required", key);
  int isint = 0;
  lua_Integer v = lua_tointegerx(L, -1, &isint);
  if (!isint) luaL_error(L, "TokenShards: %s= must be an integer, got %s", key, luaL_tolstring(L, -1, NULL));
  lua_pop(L, 1);
  return v;
}

/* loader{files = {...}, batch =, seq_len =, seed =, shuffle =, vocab =, ctx =} */
static int l_loader(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  pg_loader_config cfg = {0};
  cfg.batch = req_int(L, 1, "batch");
  cfg.seq_len = req_int(L, 1, "seq_len");
  cfg.seed = (uint64_t)pg_lua_opt_int(L, 1, "seed", 0);
  cfg.shuffle = pg_lua_opt_bool(L, 1, "shuffle", 1);
  cfg.vocab = pg_lua_opt_int(L, 1, "vocab", -1); /* absent: -1, then 0 (the runtime's "no check") */
  if (cfg.vocab == -1) cfg.vocab = 0;
  else if (cfg.vocab < 1)
    return luaL_error(L, "TokenShards: vocab=%I must be a positive integer (or nil: no check)", (lua_Integer)cfg.vocab);
  cfg.dp_rank = 0;
  cfg.dp_size = 1;
  if (lua_getfield(L, 1, "ctx") != LUA_TNIL) {
    pg_context *c = pg_lua_check_context(L, -1);
    cfg.dp_rank = c->dp_rank;
    cfg.dp_size = c->data;
  }
  lua_pop(L, 1);
  if (lua_getfield(L, 1, "files") != LUA_TTABLE) return luaL_error(L, "TokenShards: files= must be a table of paths");
  int nfiles = (int)luaL_len(L, -1);
  const char **paths = lua_newuserdatauv(L, sizeof *paths * (size_t)(nfiles > 0 ? nfiles : 1), 0);
  for (int i = 0; i < nfiles; i++) {
    if (lua_geti(L, -2, i + 1) != LUA_TSTRING) return luaL_error(L, "TokenShards: file entry %d is not a string", i + 1);
    paths[i] = lua_tostring(L, -1); /* kept alive by the files table */
    lua_pop(L, 1);
  }
  pg_loader *ld = lua_newuserdatauv(L, sizeof *ld, 0);
  memset(ld, 0, sizeof *ld);
  luaL_setmetatable(L, PG_LOADER_MT);
  if (pg_loader_init(ld, paths, nfiles, &cfg)) return luaL_error(L, "TokenShards: %s", pg_error());
  return 1;
}

/* next() -> inputs, targets (fresh int32 [batch/D, seq_len]) or nil at the end of an epoch. */
static int l_next(lua_State *L) {
  pg_loader *ld = check_loader(L, 1);
  int64_t shape[2] = {ld->cfg.batch / ld->cfg.dp_size, ld->cfg.seq_len};
  if (ld->index >= ld->batches_per_epoch) {
    PG_LUA_CHECK(L, pg_loader_next(ld, NULL, NULL) < 0 ? PG_ERR : PG_OK);
    lua_pushnil(L);
    return 1;
  }
  pg_tensor *in = pg_lua_new_tensor(L, PG_INT32, 2, shape);
  pg_tensor *tg = pg_lua_new_tensor(L, PG_INT32, 2, shape);
  int rc = pg_loader_next(ld, pg_tensor_i32(in), pg_tensor_i32(tg));
  PG_LUA_CHECK(L, rc < 0 ? PG_ERR : PG_OK);
  return 2;
}

static int l_reset(lua_State *L) {
  pg_loader_reset(check_loader(L, 1));
  return 0;
}

static int l_seek(lua_State *L) {
  pg_loader *ld = check_loader(L, 1);
  PG_LUA_CHECK(L, pg_loader_seek(ld, luaL_checkinteger(L, 2), luaL_checkinteger(L, 3)));
  return 0;
}

/* position() -> epoch, batch index (both counting from 0) */
static int l_position(lua_State *L) {
  pg_loader *ld = check_loader(L, 1);
  lua_pushinteger(L, (lua_Integer)ld->epoch);
  lua_pushinteger(L, (lua_Integer)ld->index);
  return 2;
}

static int l_batches_per_epoch(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)check_loader(L, 1)->batches_per_epoch);
  return 1;
}

static int l_num_windows(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)check_loader(L, 1)->nwindows);
  return 1;
}

static int l_file_tokens(lua_State *L) {
  pg_loader *ld = check_loader(L, 1);
  lua_createtable(L, ld->nfiles, 0);
  for (int i = 0; i < ld->nfiles; i++) {
    lua_pushinteger(L, (lua_Integer)ld->files[i].ntokens);
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

static int l_close(lua_State *L) {
  pg_loader *ld = luaL_checkudata(L, 1, PG_LOADER_MT);
  pg_loader_destroy(ld);
  return 0;
}

static const luaL_Reg loader_methods[] = {
    {"next", l_next}, {"reset", l_reset}, {"seek", l_seek}, {"position", l_position},
    {"batches_per_epoch", l_batches_per_epoch}, {"num_windows", l_num_windows}, {"file_tokens", l_file_tokens},
    {"close", l_close}, {NULL, NULL}};

/* ---- byte tokenizer: token id = byte value, vocabulary 256 ---- */

static int l_bytes_encode(lua_State *L) {
  size_t len;
  const unsigned char *s = (const unsigned char *)luaL_checklstring(L, 1, &len);
  int64_t n = (int64_t)len;
  pg_tensor *t = pg_lua_new_tensor(L, PG_INT32, 1, &n);
  int32_t *out = pg_tensor_i32(t);
  for (size_t i = 0; i < len; i++) out[i] = s[i];
  return 1;
}

/* Ids outside 0..255 cannot be bytes: they decode to U+FFFD (the Unicode
 * replacement character, 3 bytes of UTF-8), so decoding never fails. */
static void add_id(luaL_Buffer *b, lua_Integer id) {
  if (id >= 0 && id < 256) luaL_addchar(b, (char)id);
  else luaL_addlstring(b, "\xEF\xBF\xBD", 3);
}

static int l_bytes_decode(lua_State *L) {
  luaL_Buffer b;
  pg_tensor *t = pg_lua_test_tensor(L, 1);
  if (t) {
    if (!t->storage) return luaL_error(L, "bytes.decode: the tensor was freed");
    if (t->dtype != PG_INT32) return luaL_error(L, "bytes.decode: expected an int32 tensor, got %s", pg_dtype_name(t->dtype));
    const int32_t *x = pg_tensor_i32(t);
    luaL_buffinit(L, &b);
    for (int64_t i = 0; i < t->numel; i++) add_id(&b, x[i]);
  } else {
    if (!lua_istable(L, 1)) return luaL_typeerror(L, 1, "int32 tensor or table of token ids");
    lua_Integer len = luaL_len(L, 1);
    luaL_buffinit(L, &b);
    for (lua_Integer i = 1; i <= len; i++) {
      lua_geti(L, 1, i);
      int isint = 0;
      lua_Integer v = lua_tointegerx(L, -1, &isint);
      if (!isint) return luaL_error(L, "bytes.decode: entry %I is not an integer token id", i);
      lua_pop(L, 1);
      add_id(&b, v);
    }
  }
  luaL_pushresult(&b);
  return 1;
}

/* hash_unit(string, seed) -> a number in [0, 1), a pure function of both. */
static int l_hash_unit(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  uint64_t seed = (uint64_t)luaL_optinteger(L, 2, 0);
  uint64_t h = pg_data_hash(s, len, seed);
  lua_pushnumber(L, (lua_Number)(h >> 11) * (1.0 / 9007199254740992.0));
  return 1;
}

static const luaL_Reg data_functions[] = {
    {"write_shard", l_write_shard}, {"read_shard", l_read_shard}, {"shard_info", l_shard_info},
    {"expand_paths", l_expand_paths}, {"loader", l_loader}, {"bytes_encode", l_bytes_encode},
    {"bytes_decode", l_bytes_decode}, {"hash_unit", l_hash_unit}, {NULL, NULL}};

void pg_lua_open_data(lua_State *L) {
  if (luaL_newmetatable(L, PG_LOADER_MT)) {
    luaL_newlib(L, loader_methods);
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, l_close);
    lua_setfield(L, -2, "__gc");
    lua_pushstring(L, "pg.TokenLoader");
    lua_setfield(L, -2, "__name");
  }
  lua_pop(L, 1);
  luaL_newlib(L, data_functions);
  lua_setfield(L, -2, "token_data");
}
