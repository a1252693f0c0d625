/* Lua bindings for token data: shard files, the loader userdata behind
 * pg.data.TokenShards (lua/pipegoose/data.lua), and the byte tokenizer.
 * Everything lives in the core module's `token_data` table; pg.data is the
 * documented face. */
#include <limits.h>
#include <omp.h>
#include <stdio.h>
#include <string.h>

#include "lua_util.h"
#include "pg_data.h"

#define PG_LOADER_MT "pg.TokenLoader"
#define PG_WRITER_MT "pg.ShardWriter"

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

/* read_shard(path [, vocab [, raw_version]]): raw_version 1 / 7 reads a headerless file */
static int l_read_shard(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  lua_Integer vocab = luaL_optinteger(L, 2, 0);
  lua_Integer raw = luaL_optinteger(L, 3, 0);
  pg_shard s;
  PG_LUA_CHECK(L, raw ? pg_shard_open_raw(&s, path, (int)raw, vocab) : pg_shard_open(&s, path, vocab));
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

/* ---- the streaming shard writer ----
 *   w = shard_writer(path, version)   version 1 (uint16) or 7 (uint32)
 *   w:append(ids [, first, count])    ids: an integer id, an int32 tensor (its [first, first + count), 1-based)
 *                                     or a table of ids
 *   w:tokens()   ids appended so far
 *   w:close()    header count, fsync, rename onto path
 *   w:abort()    removes the temporary file (also what __gc does to a writer never closed) */

static pg_shard_writer *check_writer(lua_State *L) {
  pg_shard_writer *w = luaL_checkudata(L, 1, PG_WRITER_MT);
  if (w->fd < 0) luaL_error(L, "the shard writer is closed");
  return w;
}

static int l_shard_writer(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  lua_Integer version = pg_lua_check_int_in(L, 2, "version", INT_MIN, INT_MAX);
  pg_shard_writer *w = lua_newuserdatauv(L, sizeof *w, 0);
  memset(w, 0, sizeof *w);
  w->fd = -1;
  luaL_setmetatable(L, PG_WRITER_MT);
  PG_LUA_CHECK(L, pg_shard_writer_open(w, path, (int)version));
  return 1;
}

static int l_writer_append(lua_State *L) {
  pg_shard_writer *w = check_writer(L);
  if (lua_isinteger(L, 2)) {
    lua_Integer v = lua_tointeger(L, 2);
    if (v < INT32_MIN || v > INT32_MAX) return luaL_error(L, "%s: token %I is not an int32 token id", w->path, v);
    int32_t id = (int32_t)v;
    PG_LUA_CHECK(L, pg_shard_writer_append(w, &id, 1));
    return 0;
  }
  /* the range arguments first: check_tokens may push a userdata (a table's copy) above them */
  int ranged = !lua_isnoneornil(L, 3);
  lua_Integer first = ranged ? luaL_checkinteger(L, 3) : 1, count = ranged ? luaL_checkinteger(L, 4) : -1;
  int64_t n;
  const int32_t *ids = check_tokens(L, 2, &n);
  if (!ranged) count = n;
  if (first < 1 || first > n + 1) return luaL_error(L, "bad argument #3 (first): %I is not in [1, %I]", first, (lua_Integer)n + 1);
  if (count < 0 || count > n - first + 1)
    return luaL_error(L, "bad argument #4 (count): %I is not in [0, %I]", count, (lua_Integer)(n - first + 1));
  PG_LUA_CHECK(L, pg_shard_writer_append(w, ids + (first - 1), count));
  return 0;
}

/* w:append_documents(ids, counts, first, pos, doc_token, at_end, limit) -> next, next_pos | nothing
 * ids: an int32 tensor of documents' ids one after another, counts: a list of
 * each document's id count (tok:encode_batch's flat result). Document k is its
 * ids with doc_token before them (at_end false) or after (true). Appends from
 * position pos (counting from 0) of document `first` (1-based) on until the
 * shard holds `limit` tokens; returns where to go on in the next shard, or
 * nothing once every document is in. One call per batch of documents: the
 * rollover rule of scripts/prepare_corpus.lua without a Lua call per document. */
static int l_writer_append_documents(lua_State *L) {
  pg_shard_writer *w = check_writer(L);
  pg_tensor *t = pg_lua_test_tensor(L, 2);
  if (!t || !t->storage || t->dtype != PG_INT32) return luaL_error(L, "append_documents: ids must be an int32 tensor");
  luaL_checktype(L, 3, LUA_TTABLE);
  lua_Integer n = (lua_Integer)lua_rawlen(L, 3);
  lua_Integer k = luaL_checkinteger(L, 4), pos = luaL_checkinteger(L, 5);
  lua_Integer tokv = luaL_checkinteger(L, 6);
  int at_end = lua_toboolean(L, 7);
  lua_Integer limit = luaL_checkinteger(L, 8);
  if (tokv < 0 || tokv > INT32_MAX) return luaL_error(L, "append_documents: doc_token %I is not a token id", tokv);
  if (limit <= w->ntokens) return luaL_error(L, "append_documents: the shard is already full (%I tokens)", limit);
  if (k < 1) return luaL_error(L, "append_documents: first %I is not a document", k);
  int32_t tok = (int32_t)tokv;
  const int32_t *all = pg_tensor_i32(t);
  /* where document k's ids begin in the tensor: the counts before it */
  int64_t at = 0;
  for (lua_Integer i = 1; i < k && i <= n; i++) {
    lua_rawgeti(L, 3, i);
    at += (int64_t)lua_tointeger(L, -1);
    lua_pop(L, 1);
  }
  for (; k <= n; k++, pos = 0) {
    lua_rawgeti(L, 3, k);
    int isint = 0;
    lua_Integer cnt = lua_tointegerx(L, -1, &isint);
    lua_pop(L, 1);
    if (!isint || cnt < 0 || cnt > t->numel - at)
      return luaL_error(L, "append_documents: counts[%I] does not fit the %I ids", k, (lua_Integer)t->numel);
    const int32_t *ids = all + at;
    int64_t len = cnt + 1; /* with the document token */
    if (pos < 0 || pos >= len) return luaL_error(L, "append_documents: position %I is outside document %I", pos, k);
    while (pos < len) {
      int64_t room = limit - w->ntokens;
      if (room == 0) {
        lua_pushinteger(L, k);
        lua_pushinteger(L, pos);
        return 2;
      }
      /* the document's sequence: [tok] ids or ids [tok]; write the piece from pos that fits */
      int64_t ids_from = at_end ? pos : pos - 1; /* index into ids of sequence position pos (-1: the token) */
      int rc;
      int64_t wrote;
      if (ids_from < 0 || ids_from >= cnt) {
        rc = pg_shard_writer_append(w, &tok, 1), wrote = 1;
      } else {
        int64_t m = cnt - ids_from;
        if (m > room) m = room;
        rc = pg_shard_writer_append(w, ids + ids_from, m), wrote = m;
      }
      PG_LUA_CHECK(L, rc);
      pos += wrote;
    }
    at += cnt;
  }
  return 0;
}

static int l_writer_tokens(lua_State *L) {
  pg_shard_writer *w = luaL_checkudata(L, 1, PG_WRITER_MT);
  lua_pushinteger(L, (lua_Integer)w->ntokens);
  return 1;
}

static int l_writer_close(lua_State *L) {
  PG_LUA_CHECK(L, pg_shard_writer_close(check_writer(L)));
  return 0;
}

static int l_writer_abort(lua_State *L) {
  pg_shard_writer *w = luaL_checkudata(L, 1, PG_WRITER_MT);
  if (w->fd >= 0 || w->tmp) pg_shard_writer_abort(w);
  return 0;
}

static const luaL_Reg writer_methods[] = {{"append", l_writer_append}, {"append_documents", l_writer_append_documents},
                                          {"tokens", l_writer_tokens},
                                          {"close", l_writer_close}, {"abort", l_writer_abort}, {NULL, NULL}};

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
  cfg.raw_version = (int)pg_lua_opt_int(L, 1, "raw_version", 0);
  cfg.stride_llmc = pg_lua_opt_bool(L, 1, "stride_llmc", 0);
  if (cfg.vocab == -1) cfg.vocab = 0;
  else if (cfg.vocab < 1)
    return luaL_error(L, "TokenShards: vocab=%I must be a positive integer (or nil: no check)", (lua_Integer)cfg.vocab);
  cfg.dp_rank = 0;
  cfg.dp_size = 1;
  if (lua_getfield(L, 1, "ctx") != LUA_TNIL) {
    pg_context *c = pg_lua_check_context(L, -1);
    /* islands (DiLoCo) split the batch as data ranks do: island i's data ranks
     * read shards i D .. i D + D - 1 of islands x D (same tokens as data = islands x D) */
    cfg.dp_rank = c->island * c->data + c->dp_rank;
    cfg.dp_size = c->islands * c->data;
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

/* rows an epoch reads: windows, or with llm.c's stride spans x batch */
static int l_num_windows(lua_State *L) {
  pg_loader *ld = check_loader(L, 1);
  lua_pushinteger(L, (lua_Integer)(ld->cfg.stride_llmc ? ld->nwindows * ld->cfg.batch : ld->nwindows));
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
  lua_pushnumber(L, (lua_Number)pg_data_hash_unit(s, len, seed));
  return 1;
}

/* Whether s has a byte that is not ASCII white space (Lua's %S in the C locale). */
static int has_visible(const char *s, size_t n) {
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c != ' ' && (c < '\t' || c > '\r')) return 1;
  }
  return 0;
}

/* cut_documents(buf, pattern, start, pos, keep_first) -> docs, offsets, start, pos
 * The documents of scripts/prepare_corpus.lua's text format that end in buf:
 * every match of pattern ("\n" .. separator .. "\n") at or after pos ends
 * the document that begins at start (through the match's first newline), and
 * the next one begins after it; the search goes on from the match's last
 * newline (it may begin the next separator). docs: those documents that have
 * a visible byte (the first one kept regardless with keep_first, when the
 * caller has its earlier bytes); offsets: where each begins in buf (1-based);
 * then where the unfinished document begins and where to search on. One call
 * per block: no Lua call per document. */
static int l_cut_documents(lua_State *L) {
  size_t n, plen;
  const char *buf = luaL_checklstring(L, 1, &n);
  const char *pat = luaL_checklstring(L, 2, &plen);
  lua_Integer start = luaL_checkinteger(L, 3), pos = luaL_checkinteger(L, 4);
  int keep_first = lua_toboolean(L, 5);
  if (plen < 2 || pat[0] != '\n') return luaL_error(L, "cut_documents: the pattern must begin with a newline");
  if (start < 1 || pos < 1 || (size_t)start > n + 1 || (size_t)pos > n + 1)
    return luaL_error(L, "cut_documents: start %I or pos %I is outside the buffer", start, pos);
  lua_newtable(L);
  lua_newtable(L);
  lua_Integer k = 0;
  size_t s0 = (size_t)start - 1, p = (size_t)pos - 1; /* 0-based */
  int first = 1;
  while (p + plen <= n) {
    const char *nl = memchr(buf + p, '\n', n - p - plen + 1);
    if (!nl) {
      p = n - plen + 1; /* no match can begin before here: the caller keeps only the tail */
      break;
    }
    size_t i = (size_t)(nl - buf);
    if (memcmp(nl, pat, plen) != 0) {
      p = i + 1;
      continue;
    }
    /* the document: [s0, i] (with the newline at i) */
    size_t len = i + 1 > s0 ? i + 1 - s0 : 0;
    if ((first && keep_first) || has_visible(buf + s0, len)) {
      lua_pushlstring(L, buf + s0, len);
      lua_rawseti(L, -3, ++k);
      lua_pushinteger(L, (lua_Integer)s0 + 1);
      lua_rawseti(L, -2, k);
    }
    first = 0;
    s0 = i + plen;     /* after the separator line's newline */
    p = i + plen - 1;  /* that newline may begin the next separator */
  }
  lua_pushinteger(L, (lua_Integer)s0 + 1);
  lua_pushinteger(L, (lua_Integer)p + 1);
  return 4;
}

/* split_documents(docs, seed, val_fraction, threads [, any_bytes]) -> train, val, train_bytes, val_bytes, bad
 * scripts/prepare_corpus.lua's per-document work besides tokenizing, on
 * threads (OpenMP) and without a Lua call per document: a document that is
 * not UTF-8 goes to bad (bad[i] = the offset of its first bad byte, counting
 * from 0; i its index in docs), every other one to val when its hash_unit
 * under seed is below val_fraction, else to train, in order; the byte counts
 * are of the documents each list holds. any_bytes: no UTF-8 check (the
 * byte-level shards take any bytes). */
static int l_split_documents(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  uint64_t seed = (uint64_t)luaL_checkinteger(L, 2);
  double fraction = luaL_checknumber(L, 3);
  lua_Integer threads = luaL_optinteger(L, 4, 0);
  int any_bytes = lua_toboolean(L, 5);
  size_t n = (size_t)lua_rawlen(L, 1);
  if (n > SIZE_MAX / (sizeof(const char *) + 2 * sizeof(size_t) + sizeof(double)))
    return luaL_error(L, "split_documents: %zu documents", n);
  const char **texts = lua_newuserdatauv(L, (n ? n : 1) * sizeof *texts, 0);
  size_t *lens = lua_newuserdatauv(L, (n ? n : 1) * sizeof *lens, 0);
  size_t *bad = lua_newuserdatauv(L, (n ? n : 1) * sizeof *bad, 0);
  double *units = lua_newuserdatauv(L, (n ? n : 1) * sizeof *units, 0);
  for (size_t i = 0; i < n; i++) {
    if (lua_rawgeti(L, 1, (lua_Integer)i + 1) != LUA_TSTRING)
      return luaL_error(L, "split_documents: docs[%d] is not a string", (int)i + 1);
    texts[i] = lua_tolstring(L, -1, &lens[i]); /* kept alive by the table */
    lua_pop(L, 1);
  }
  int nt = threads > 0 && threads <= 1024 ? (int)threads : omp_get_max_threads();
#pragma omp parallel for num_threads(nt) schedule(dynamic, 64) if (nt > 1 && n > 64)
  for (size_t i = 0; i < n; i++) {
    units[i] = pg_data_hash_unit(texts[i], lens[i], seed);
    bad[i] = any_bytes ? lens[i] : pg_data_utf8_invalid_at(texts[i], lens[i]);
  }
  lua_newtable(L); /* train */
  lua_newtable(L); /* val */
  lua_newtable(L); /* bad */
  int t_train = lua_gettop(L) - 2, t_val = t_train + 1, t_bad = t_train + 2;
  lua_Integer ktrain = 0, kval = 0, btrain = 0, bval = 0;
  for (size_t i = 0; i < n; i++) {
    if (bad[i] < lens[i]) {
      lua_pushinteger(L, (lua_Integer)bad[i]);
      lua_rawseti(L, t_bad, (lua_Integer)i + 1);
      continue;
    }
    int to_val = units[i] < fraction;
    lua_rawgeti(L, 1, (lua_Integer)i + 1);
    lua_rawseti(L, to_val ? t_val : t_train, to_val ? ++kval : ++ktrain);
    if (to_val) bval += (lua_Integer)lens[i];
    else btrain += (lua_Integer)lens[i];
  }
  lua_pushvalue(L, t_train);
  lua_pushvalue(L, t_val);
  lua_pushinteger(L, btrain);
  lua_pushinteger(L, bval);
  lua_pushvalue(L, t_bad);
  return 5;
}

/* hash_hex(string) -> 16 hex digits of pg_data_hash(string, 0): a content digest (of a corpus's tokenizer.json) */
static int l_hash_hex(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  char hex[17];
  snprintf(hex, sizeof hex, "%016llx", (unsigned long long)pg_data_hash(s, len, 0));
  lua_pushstring(L, hex);
  return 1;
}

static const luaL_Reg data_functions[] = {
    {"shard_writer", l_shard_writer}, {"hash_hex", l_hash_hex}, {"split_documents", l_split_documents},
    {"cut_documents", l_cut_documents},
    {"write_shard", l_write_shard}, {"read_shard", l_read_shard}, {"shard_info", l_shard_info},
    {"expand_paths", l_expand_paths}, {"loader", l_loader}, {"bytes_encode", l_bytes_encode},
    {"bytes_decode", l_bytes_decode}, {"hash_unit", l_hash_unit}, {NULL, NULL}};

void pg_lua_open_data(lua_State *L) {
  if (luaL_newmetatable(L, PG_WRITER_MT)) {
    luaL_newlib(L, writer_methods);
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, l_writer_abort);
    lua_setfield(L, -2, "__gc");
    lua_pushstring(L, "pg.ShardWriter");
    lua_setfield(L, -2, "__name");
  }
  lua_pop(L, 1);
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
