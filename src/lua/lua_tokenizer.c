/* Lua bindings for tokenizers (pg_tokenizer.h), in the core module's
 * `tokenizer` table; lua/pipegoose/tokenizer.lua is the documented face
 * (it reads tokenizer.json and hands this a plain spec table):
 *   core.tokenizer.new(spec) -> userdata, spec = {
 *     model = {unk_token=, byte_fallback=, fuse_unk=, ignore_merges=},
 *     vocab = {[token] = id}, merges = {a1, b1, a2, b2, ...} (rank order),
 *     added = {{content=, id=, special=, lstrip=, rstrip=, single_word=, normalized=}},
 *     normalizers, pre_tokenizers, decoders = {{kind = "NFC" | "Prepend" | ..., fields}},
 *     template = {ids, -1 where the text goes} or nil }
 *   t:encode(text, add_special, as_tensor) -> table of ids or int32 tensor
 *   t:decode(ids (table or int32 tensor), skip_special) -> string
 *   t:vocab_size(), t:token_to_id(s) -> id or nil, t:id_to_token(id) -> string or nil,
 *   t:is_special(id), t:pre_tokenize(text) -> {pre-token strings} (added tokens left out) */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "lua_util.h"
#include "pg_tokenizer.h"

#define PG_TOKENIZER_MT "pg.Tokenizer"

typedef struct {
  pg_tokenizer *t;
  pg_tok_state *st;
} ltok;

static ltok *check_tok(lua_State *L) {
  ltok *u = luaL_checkudata(L, 1, PG_TOKENIZER_MT);
  if (!u->t) luaL_error(L, "tokenizer: freed");
  return u;
}

static int l_gc(lua_State *L) {
  ltok *u = luaL_checkudata(L, 1, PG_TOKENIZER_MT);
  pg_tok_state_free(u->st);
  pg_tokenizer_free(u->t);
  u->t = NULL, u->st = NULL;
  return 0;
}

/* A string field of the table at idx (NULL when absent). */
static const char *opt_lstring(lua_State *L, int idx, const char *key, size_t *n) {
  lua_getfield(L, idx, key);
  const char *s = NULL;
  if (lua_type(L, -1) == LUA_TSTRING) s = lua_tolstring(L, -1, n);
  else if (!lua_isnil(L, -1)) luaL_error(L, "tokenizer spec: %s must be a string", key);
  lua_pop(L, 1); /* the string stays alive: the spec table holds it */
  return s;
}

static int field_bool(lua_State *L, int idx, const char *key) {
  lua_getfield(L, idx, key);
  int b = lua_toboolean(L, -1);
  lua_pop(L, 1);
  return b;
}

static int field_int(lua_State *L, int idx, const char *key) {
  lua_getfield(L, idx, key);
  int isint;
  lua_Integer v = lua_tointegerx(L, -1, &isint);
  if (!lua_isnil(L, -1) && (!isint || v < INT_MIN || v > INT_MAX)) luaL_error(L, "tokenizer spec: %s must be an integer", key);
  lua_pop(L, 1);
  return (int)v;
}

static const struct {
  const char *name;
  pg_tok_kind kind;
} KINDS[] = {{"NFC", PG_TOK_NFC},         {"NFKC", PG_TOK_NFKC},       {"Prepend", PG_TOK_PREPEND},
             {"Replace", PG_TOK_REPLACE}, {"ByteLevel", PG_TOK_BYTELEVEL}, {"Split", PG_TOK_SPLIT},
             {"Metaspace", PG_TOK_METASPACE}, {"Digits", PG_TOK_DIGITS}, {"ByteFallback", PG_TOK_BYTEFALLBACK},
             {"Fuse", PG_TOK_FUSE},       {"Strip", PG_TOK_STRIP}};
static const char *const BEHAVIORS[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous", NULL};
static const char *const SCHEMES[] = {"always", "first", "never", NULL};

static int pick(const char *s, const char *const *names) {
  for (int i = 0; names[i]; i++)
    if (!strcmp(s, names[i])) return i;
  return -1;
}

static void add_steps(lua_State *L, pg_tokenizer *t, int spec, const char *key, pg_tok_stage stage) {
  lua_getfield(L, spec, key);
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    return;
  }
  luaL_checktype(L, -1, LUA_TTABLE);
  int list = lua_gettop(L);
  for (lua_Integer i = 1, n = luaL_len(L, list); i <= n; i++) {
    lua_geti(L, list, i);
    int s = lua_gettop(L);
    luaL_checktype(L, s, LUA_TTABLE);
    pg_tok_step st;
    memset(&st, 0, sizeof st);
    size_t kn;
    const char *kind = opt_lstring(L, s, "kind", &kn);
    if (!kind) luaL_error(L, "tokenizer spec: %s[%d] has no kind", key, (int)i);
    int found = 0;
    for (size_t k = 0; k < sizeof KINDS / sizeof KINDS[0]; k++)
      if (!strcmp(kind, KINDS[k].name)) st.kind = KINDS[k].kind, found = 1;
    if (!found) luaL_error(L, "tokenizer spec: %s[%d]: unknown kind '%s'", key, (int)i, kind);
    st.pattern = opt_lstring(L, s, "pattern", &st.pattern_len);
    st.content = opt_lstring(L, s, "content", &st.content_len);
    st.regex = field_bool(L, s, "regex");
    st.invert = field_bool(L, s, "invert");
    st.add_prefix_space = field_bool(L, s, "add_prefix_space");
    st.use_regex = field_bool(L, s, "use_regex");
    st.split = field_bool(L, s, "split");
    st.individual_digits = field_bool(L, s, "individual_digits");
    st.start = field_int(L, s, "start");
    st.stop = field_int(L, s, "stop");
    size_t bn;
    const char *b = opt_lstring(L, s, "behavior", &bn);
    st.behavior = b ? pick(b, BEHAVIORS) : PG_SPLIT_ISOLATED;
    if (st.behavior < 0) luaL_error(L, "tokenizer spec: unknown split behavior '%s'", b);
    const char *ps = opt_lstring(L, s, "prepend_scheme", &bn);
    st.prepend_scheme = ps ? pick(ps, SCHEMES) : PG_PREPEND_ALWAYS;
    if (st.prepend_scheme < 0) luaL_error(L, "tokenizer spec: unknown prepend_scheme '%s'", ps);
    if (pg_tokenizer_add_step(t, stage, &st)) luaL_error(L, "%s", pg_error());
    lua_settop(L, list);
  }
  lua_pop(L, 1);
}

static int32_t check_id_value(lua_State *L, int idx, const char *what) {
  int isint;
  lua_Integer v = lua_tointegerx(L, idx, &isint);
  if (!isint || v < 0 || v >= PG_TOK_MAX_ID) luaL_error(L, "tokenizer spec: %s is not an id in [0, 2^24)", what);
  return (int32_t)v;
}

static int l_new(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  ltok *u = lua_newuserdatauv(L, sizeof *u, 0);
  u->t = NULL, u->st = NULL;
  luaL_setmetatable(L, PG_TOKENIZER_MT);
  int ud = lua_gettop(L);
  pg_tok_model m;
  memset(&m, 0, sizeof m);
  lua_getfield(L, 1, "model");
  if (lua_istable(L, -1)) {
    int mi = lua_gettop(L);
    m.unk_token = opt_lstring(L, mi, "unk_token", &m.unk_len);
    m.byte_fallback = field_bool(L, mi, "byte_fallback");
    m.fuse_unk = field_bool(L, mi, "fuse_unk");
    m.ignore_merges = field_bool(L, mi, "ignore_merges");
  }
  lua_pop(L, 1);
  if (!(u->t = pg_tokenizer_new(&m))) return luaL_error(L, "%s", pg_error());
  pg_tokenizer *t = u->t;
  lua_getfield(L, 1, "vocab");
  luaL_checktype(L, -1, LUA_TTABLE);
  lua_pushnil(L);
  while (lua_next(L, -2)) {
    if (lua_type(L, -2) != LUA_TSTRING) return luaL_error(L, "tokenizer spec: a vocab key is not a string");
    size_t n;
    const char *s = lua_tolstring(L, -2, &n);
    if (pg_tokenizer_add_token(t, s, n, check_id_value(L, -1, "a vocab id"))) return luaL_error(L, "%s", pg_error());
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  lua_getfield(L, 1, "merges");
  if (!lua_isnil(L, -1)) {
    luaL_checktype(L, -1, LUA_TTABLE);
    int mt = lua_gettop(L);
    lua_Integer n = luaL_len(L, mt);
    if (n % 2) return luaL_error(L, "tokenizer spec: merges must hold pairs (an even count)");
    for (lua_Integer i = 1; i < n; i += 2) {
      lua_geti(L, mt, i);
      lua_geti(L, mt, i + 1);
      size_t an, bn;
      const char *a = lua_tolstring(L, -2, &an), *b = lua_tolstring(L, -1, &bn);
      if (!a || !b) return luaL_error(L, "tokenizer spec: merge %d is not two strings", (int)(i / 2));
      if (pg_tokenizer_add_merge(t, a, an, b, bn)) return luaL_error(L, "%s", pg_error());
      lua_pop(L, 2);
    }
  }
  lua_pop(L, 1);
  lua_getfield(L, 1, "added");
  if (!lua_isnil(L, -1)) {
    luaL_checktype(L, -1, LUA_TTABLE);
    int at = lua_gettop(L);
    for (lua_Integer i = 1, n = luaL_len(L, at); i <= n; i++) {
      lua_geti(L, at, i);
      int a = lua_gettop(L);
      luaL_checktype(L, a, LUA_TTABLE);
      size_t cn;
      const char *c = opt_lstring(L, a, "content", &cn);
      if (!c) return luaL_error(L, "tokenizer spec: added token %d has no content", (int)i);
      lua_getfield(L, a, "id");
      int32_t id = check_id_value(L, -1, "an added token's id");
      lua_pop(L, 1);
      unsigned f = (field_bool(L, a, "special") ? PG_TOK_SPECIAL : 0) | (field_bool(L, a, "lstrip") ? PG_TOK_LSTRIP : 0) |
                   (field_bool(L, a, "rstrip") ? PG_TOK_RSTRIP : 0) |
                   (field_bool(L, a, "single_word") ? PG_TOK_SINGLE_WORD : 0) |
                   (field_bool(L, a, "normalized") ? PG_TOK_NORMALIZED : 0);
      if (pg_tokenizer_add_added(t, c, cn, id, f)) return luaL_error(L, "%s", pg_error());
      lua_pop(L, 1);
    }
  }
  lua_pop(L, 1);
  add_steps(L, t, 1, "normalizers", PG_TOK_NORMALIZER);
  add_steps(L, t, 1, "pre_tokenizers", PG_TOK_PRE_TOKENIZER);
  add_steps(L, t, 1, "decoders", PG_TOK_DECODER);
  lua_getfield(L, 1, "template");
  if (!lua_isnil(L, -1)) {
    luaL_checktype(L, -1, LUA_TTABLE);
    lua_Integer n = luaL_len(L, -1);
    if (n < 0 || n > 4096) return luaL_error(L, "tokenizer spec: a template of %d items", (int)n);
    int32_t items[4096];
    for (lua_Integer i = 1; i <= n; i++) {
      lua_geti(L, -1, i);
      int isint;
      lua_Integer v = lua_tointegerx(L, -1, &isint);
      if (!isint || v < -1 || v >= PG_TOK_MAX_ID) return luaL_error(L, "tokenizer spec: template item %d is not an id", (int)i);
      items[i - 1] = (int32_t)v;
      lua_pop(L, 1);
    }
    if (pg_tokenizer_set_template(t, items, (size_t)n)) return luaL_error(L, "%s", pg_error());
  }
  lua_pop(L, 1);
  if (pg_tokenizer_finish(t) || !(u->st = pg_tok_state_new(t))) return luaL_error(L, "%s", pg_error());
  lua_settop(L, ud);
  return 1;
}

static int l_encode(lua_State *L) {
  ltok *u = check_tok(L);
  size_t n;
  const char *s = luaL_checklstring(L, 2, &n);
  int add_special = lua_toboolean(L, 3), as_tensor = lua_toboolean(L, 4);
  int32_t *ids;
  size_t k;
  if (pg_tokenizer_encode(u->t, u->st, s, n, add_special, &ids, &k)) return luaL_error(L, "%s", pg_error());
  if (as_tensor) {
    int64_t shape[1] = {(int64_t)k};
    /* made by hand (not pg_lua_new_tensor, which raises) so that ids is freed on every path */
    pg_tensor *tt = lua_newuserdatauv(L, sizeof *tt, 0);
    memset(tt, 0, sizeof *tt);
    luaL_setmetatable(L, PG_TENSOR_MT);
    if (pg_tensor_init(tt, PG_INT32, 1, shape)) {
      free(ids);
      return luaL_error(L, "%s", pg_error());
    }
    if (k) memcpy(pg_tensor_i32(tt), ids, k * sizeof *ids);
    free(ids);
    return 1;
  }
  if (k > INT_MAX) {
    free(ids);
    return luaL_error(L, "encode: %zu ids do not fit a table (ask for a tensor)", k);
  }
  lua_createtable(L, (int)k, 0);
  for (size_t i = 0; i < k; i++) {
    lua_pushinteger(L, ids[i]);
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
  free(ids);
  return 1;
}

static int l_decode(lua_State *L) {
  ltok *u = check_tok(L);
  int skip = lua_toboolean(L, 3);
  const int32_t *ids;
  size_t n;
  pg_tensor *tt = pg_lua_test_tensor(L, 2);
  if (tt) {
    if (!tt->storage) return luaL_error(L, "decode: the tensor was freed");
    if (tt->dtype != PG_INT32) return luaL_error(L, "decode: ids must be an int32 tensor, got %s", pg_dtype_name(tt->dtype));
    ids = pg_tensor_i32(tt);
    n = (size_t)tt->numel;
  } else {
    if (!lua_istable(L, 2)) return luaL_typeerror(L, 2, "int32 tensor or table of token ids");
    lua_Integer len = luaL_len(L, 2);
    if (len < 0) len = 0;
    int32_t *buf = lua_newuserdatauv(L, (size_t)(len > 0 ? len : 1) * sizeof *buf, 0);
    for (lua_Integer i = 1; i <= len; i++) {
      lua_geti(L, 2, i);
      int isint = 0;
      lua_Integer v = lua_tointegerx(L, -1, &isint);
      lua_pop(L, 1);
      if (!isint || v < INT32_MIN || v > INT32_MAX)
        return luaL_error(L, "decode: entry %d is not an integer token id", (int)i);
      buf[i - 1] = (int32_t)v;
    }
    ids = buf;
    n = (size_t)len;
  }
  char *out;
  size_t len;
  if (pg_tokenizer_decode(u->t, ids, n, skip, &out, &len)) return luaL_error(L, "%s", pg_error());
  lua_pushlstring(L, out, len);
  free(out);
  return 1;
}

static int l_vocab_size(lua_State *L) {
  lua_pushinteger(L, pg_tokenizer_vocab_size(check_tok(L)->t));
  return 1;
}

static int l_token_to_id(lua_State *L) {
  ltok *u = check_tok(L);
  size_t n;
  const char *s = luaL_checklstring(L, 2, &n);
  int32_t id = pg_tokenizer_token_to_id(u->t, s, n);
  if (id < 0) lua_pushnil(L);
  else lua_pushinteger(L, id);
  return 1;
}

static int l_id_to_token(lua_State *L) {
  ltok *u = check_tok(L);
  lua_Integer id = luaL_checkinteger(L, 2);
  size_t n;
  const char *s = id >= 0 && id < PG_TOK_MAX_ID ? pg_tokenizer_id_to_token(u->t, (int32_t)id, &n) : NULL;
  if (s) lua_pushlstring(L, s, n);
  else lua_pushnil(L);
  return 1;
}

static int l_is_special(lua_State *L) {
  ltok *u = check_tok(L);
  lua_Integer id = luaL_checkinteger(L, 2);
  lua_pushboolean(L, id >= 0 && id < PG_TOK_MAX_ID && pg_tokenizer_is_special(u->t, (int32_t)id));
  return 1;
}

typedef struct {
  lua_State *L;
  lua_Integer k;
} piece_ud;

static int push_piece(void *p, const char *s, size_t n, int32_t added) {
  piece_ud *pu = p;
  if (added >= 0) return 0;
  lua_pushlstring(pu->L, s, n);
  lua_rawseti(pu->L, -2, ++pu->k);
  return 0;
}

static int l_pre_tokenize(lua_State *L) {
  ltok *u = check_tok(L);
  size_t n;
  const char *s = luaL_checklstring(L, 2, &n);
  lua_newtable(L);
  piece_ud pu = {L, 0};
  if (pg_tokenizer_pre_tokenize(u->t, u->st, s, n, push_piece, &pu)) return luaL_error(L, "%s", pg_error());
  return 1;
}

/* ---- multi-threaded encoding (pg_tokenizer_encode_batch, _chunked, _file) ----
 *   t:encode_batch(texts, add_special, threads, as_tensor [, flat]) -> {ids per text} (tables or int32 tensors)
 *                                      flat: ids (one int32 tensor, every text's in order), {id count per text}
 *   t:encode_chunked(text, add_special, threads, chunk_bytes) -> int32 tensor
 *   t:encode_file(path, add_special, threads, chunk_bytes) -> int32 tensor
 *   t:regex_engine() -> "PCRE2 10.42, JIT ..." (what the pre-tokenizer regexes run on)
 * threads nil: pg.num_threads(); chunk_bytes nil or 0: PG_TOK_CHUNK_BYTES. */

#define PG_TOKIDS_MT "pg.TokenizerIds"

/* The ids a C call handed over: a Lua error while the result is built (out
 * of memory) would leak them, so a userdata holds them and __gc frees them. */
typedef struct {
  int32_t *ids;
} ids_guard;

static int l_ids_gc(lua_State *L) {
  ids_guard *g = luaL_checkudata(L, 1, PG_TOKIDS_MT);
  free(g->ids);
  g->ids = NULL;
  return 0;
}

static ids_guard *push_ids_guard(lua_State *L) {
  ids_guard *g = lua_newuserdatauv(L, sizeof *g, 0);
  g->ids = NULL;
  if (luaL_newmetatable(L, PG_TOKIDS_MT)) {
    lua_pushcfunction(L, l_ids_gc);
    lua_setfield(L, -2, "__gc");
  }
  lua_setmetatable(L, -2);
  return g;
}

static void push_ids(lua_State *L, const int32_t *ids, size_t n, int as_tensor) {
  if (as_tensor) {
    int64_t shape[1] = {(int64_t)n};
    pg_tensor *tt = lua_newuserdatauv(L, sizeof *tt, 0);
    memset(tt, 0, sizeof *tt);
    luaL_setmetatable(L, PG_TENSOR_MT);
    if (pg_tensor_init(tt, PG_INT32, 1, shape)) luaL_error(L, "%s", pg_error());
    if (n) memcpy(pg_tensor_i32(tt), ids, n * sizeof *ids);
    return;
  }
  if (n > INT_MAX) luaL_error(L, "encode: %zu ids do not fit a table (ask for a tensor)", n);
  lua_createtable(L, (int)n, 0);
  for (size_t i = 0; i < n; i++) {
    lua_pushinteger(L, ids[i]);
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
}

static int threads_arg(lua_State *L, int idx, const char *fn) {
  if (lua_isnoneornil(L, idx)) return 0;
  if (!lua_isinteger(L, idx) || lua_tointeger(L, idx) < 1 || lua_tointeger(L, idx) > 1024)
    luaL_error(L, "%s: threads must be an integer in [1, 1024]", fn);
  return (int)lua_tointeger(L, idx);
}

static size_t chunk_arg(lua_State *L, int idx, const char *fn) {
  if (lua_isnoneornil(L, idx)) return 0;
  if (!lua_isinteger(L, idx) || lua_tointeger(L, idx) < 1) luaL_error(L, "%s: chunk_bytes must be an integer >= 1", fn);
  return (size_t)lua_tointeger(L, idx);
}

static int l_encode_batch(lua_State *L) {
  ltok *u = check_tok(L);
  luaL_checktype(L, 2, LUA_TTABLE);
  int add_special = lua_toboolean(L, 3), threads = threads_arg(L, 4, "encode_batch"), as_tensor = lua_toboolean(L, 5);
  int flat = lua_toboolean(L, 6);
  size_t n = (size_t)lua_rawlen(L, 2);
  if (n > SIZE_MAX / sizeof(size_t) - 1) return luaL_error(L, "encode_batch: %zu texts", n);
  const char **texts = lua_newuserdatauv(L, (n ? n : 1) * sizeof *texts, 0);
  size_t *lens = lua_newuserdatauv(L, (n ? n : 1) * sizeof *lens, 0);
  size_t *off = lua_newuserdatauv(L, (n + 1) * sizeof *off, 0);
  for (size_t i = 0; i < n; i++) {
    /* raw: the string then lives in the table (no __index made it), which the stack holds through the call */
    if (lua_rawgeti(L, 2, (lua_Integer)i + 1) != LUA_TSTRING)
      return luaL_error(L, "encode_batch: texts[%d] is a %s, not a string", (int)i + 1, luaL_typename(L, -1));
    texts[i] = lua_tolstring(L, -1, &lens[i]);
    lua_pop(L, 1);
  }
  ids_guard *g = push_ids_guard(L);
  if (pg_tokenizer_encode_batch(u->t, texts, lens, n, add_special, threads, &g->ids, off))
    return luaL_error(L, "encode_batch: %s", pg_error());
  if (n > INT_MAX) return luaL_error(L, "encode_batch: %zu texts do not fit a table", n);
  if (flat) { /* one int32 tensor of every text's ids in order, and a table of each text's id count */
    push_ids(L, g->ids, off[n], 1);
    lua_createtable(L, (int)n, 0);
    for (size_t i = 0; i < n; i++) {
      lua_pushinteger(L, (lua_Integer)(off[i + 1] - off[i]));
      lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
    free(g->ids);
    g->ids = NULL;
    return 2;
  }
  lua_createtable(L, (int)n, 0);
  for (size_t i = 0; i < n; i++) {
    push_ids(L, g->ids + off[i], off[i + 1] - off[i], as_tensor);
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
  free(g->ids);
  g->ids = NULL;
  return 1;
}

static int l_encode_chunked(lua_State *L) {
  ltok *u = check_tok(L);
  size_t n;
  const char *s = luaL_checklstring(L, 2, &n);
  int add_special = lua_toboolean(L, 3), threads = threads_arg(L, 4, "encode_chunked");
  size_t chunk = chunk_arg(L, 5, "encode_chunked");
  ids_guard *g = push_ids_guard(L);
  size_t k;
  if (pg_tokenizer_encode_chunked(u->t, s, n, chunk, add_special, threads, &g->ids, &k))
    return luaL_error(L, "encode_chunked: %s", pg_error());
  push_ids(L, g->ids, k, 1);
  free(g->ids);
  g->ids = NULL;
  return 1;
}

static int l_encode_file(lua_State *L) {
  ltok *u = check_tok(L);
  const char *path = luaL_checkstring(L, 2);
  int add_special = lua_toboolean(L, 3), threads = threads_arg(L, 4, "encode_file");
  size_t chunk = chunk_arg(L, 5, "encode_file");
  ids_guard *g = push_ids_guard(L);
  size_t k;
  if (pg_tokenizer_encode_file(u->t, path, chunk, add_special, threads, &g->ids, &k)) return luaL_error(L, "%s", pg_error());
  push_ids(L, g->ids, k, 1);
  free(g->ids);
  g->ids = NULL;
  return 1;
}

static int l_regex_engine(lua_State *L) {
  char buf[256];
  pg_tokenizer_regex_engine(buf, sizeof buf);
  lua_pushstring(L, buf);
  return 1;
}

static const luaL_Reg methods[] = {{"encode", l_encode},           {"decode", l_decode},
                                   {"vocab_size", l_vocab_size},   {"token_to_id", l_token_to_id},
                                   {"id_to_token", l_id_to_token}, {"is_special", l_is_special},
                                   {"pre_tokenize", l_pre_tokenize},
                                   {"encode_batch", l_encode_batch}, {"encode_chunked", l_encode_chunked},
                                   {"encode_file", l_encode_file}, {"regex_engine", l_regex_engine},
                                   {NULL, NULL}};

/* core.tokenizer.train(o) -> vocab {[token] = id}, merges {{a, b}, ...} (rank order), stats;
 * o = {files = {paths}, vocab_size =, special_tokens = {strings}, pattern = regex or nil,
 * min_frequency =, threads =, progress =, chunk_bytes =}, checked by lua/pipegoose/tokenizer.lua (pg_tokenizer.h:
 * pg_tokenizer_train). */
static const char **train_strings(lua_State *L, int o, const char *key, size_t **lens, size_t *n) {
  lua_getfield(L, o, key);
  int t = lua_gettop(L);
  lua_Integer k = lua_istable(L, t) ? luaL_len(L, t) : 0;
  if (k < 0 || (lua_Unsigned)k > SIZE_MAX / sizeof(char *) / 2) luaL_error(L, "tokenizer.train: %s is too long", key);
  /* userdata, so that an error below frees them; the strings stay alive in o */
  const char **v = lua_newuserdatauv(L, (size_t)(k ? k : 1) * sizeof *v, 0);
  *lens = lua_newuserdatauv(L, (size_t)(k ? k : 1) * sizeof **lens, 0);
  for (lua_Integer i = 1; i <= k; i++) {
    lua_geti(L, t, i);
    if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "tokenizer.train: %s[%d] must be a string", key, (int)i);
    v[i - 1] = lua_tolstring(L, -1, &(*lens)[i - 1]);
    lua_pop(L, 1);
  }
  lua_remove(L, t); /* the list stays reachable from o; the two userdata stay on the stack */
  *n = (size_t)k;
  return v;
}

static int l_train(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  pg_tok_train_opts o;
  memset(&o, 0, sizeof o);
  size_t *flens, *slens;
  o.files = train_strings(L, 1, "files", &flens, &o.nfiles);
  o.specials = train_strings(L, 1, "special_tokens", &slens, &o.nspecials);
  o.special_lens = slens;
  o.pattern = opt_lstring(L, 1, "pattern", &o.pattern_len);
  o.vocab_size = field_int(L, 1, "vocab_size");
  o.threads = field_int(L, 1, "threads");
  o.progress = field_bool(L, 1, "progress");
  int piece = field_int(L, 1, "chunk_bytes");
  o.piece_bytes = piece > 0 ? (size_t)piece : 0;
  lua_getfield(L, 1, "min_frequency");
  lua_Integer mf = lua_tointeger(L, -1);
  lua_pop(L, 1);
  o.min_frequency = mf > 0 ? (uint64_t)mf : 0;
  pg_tok_trained r;
  if (pg_tokenizer_train(&o, &r)) return luaL_error(L, "%s", pg_error());
  lua_createtable(L, 0, r.ntokens > 0 ? r.ntokens : 0);
  for (int32_t i = 0; i < r.ntokens; i++) {
    lua_pushlstring(L, r.text + r.off[i], r.len[i]);
    lua_pushinteger(L, i);
    lua_rawset(L, -3);
  }
  lua_createtable(L, r.nmerges < INT_MAX ? (int)r.nmerges : 0, 0);
  for (size_t i = 0; i < r.nmerges; i++) {
    lua_createtable(L, 2, 0);
    for (int k = 0; k < 2; k++) {
      int32_t id = r.merges[i][k];
      lua_pushlstring(L, r.text + r.off[id], r.len[id]);
      lua_rawseti(L, -2, k + 1);
    }
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
  lua_createtable(L, 0, 8);
  lua_pushinteger(L, (lua_Integer)r.nwords);
  lua_setfield(L, -2, "words");
  lua_pushinteger(L, (lua_Integer)r.npretokens);
  lua_setfield(L, -2, "pre_tokens");
  lua_pushinteger(L, (lua_Integer)r.nbytes);
  lua_setfield(L, -2, "bytes");
  lua_pushinteger(L, (lua_Integer)r.nmerges_made);
  lua_setfield(L, -2, "merges_made");
  lua_pushnumber(L, r.count_s);
  lua_setfield(L, -2, "count_seconds");
  lua_pushnumber(L, r.merge_s);
  lua_setfield(L, -2, "merge_seconds");
  pg_tok_trained_free(&r);
  return 3;
}

void pg_lua_open_tokenizer(lua_State *L) {
  if (luaL_newmetatable(L, PG_TOKENIZER_MT)) {
    lua_pushcfunction(L, l_gc);
    lua_setfield(L, -2, "__gc");
    luaL_newlib(L, methods);
    lua_setfield(L, -2, "__index");
  }
  lua_pop(L, 1);
  lua_newtable(L);
  lua_pushcfunction(L, l_new);
  lua_setfield(L, -2, "new");
  lua_pushcfunction(L, l_train);
  lua_setfield(L, -2, "train");
  lua_setfield(L, -2, "tokenizer");
}
