/* The fuzz targets (fuzz.h). The Lua readers are run as users run them,
 * through require "pipegoose"; the token shard reader is C. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>

#include "fuzz.h"
#include "pg_data.h"
#include "pg_fs.h"

int luaopen_pipegoose_core(lua_State *L);

#ifndef PG_FUZZ_ROOT
#define PG_FUZZ_ROOT "."
#endif

static char scratch_dir[PATH_MAX];

static void remove_scratch(void) { (void)pg_fs_remove_tree(scratch_dir); }

const char *fuzz_file(const uint8_t *data, size_t size, const char *name) {
  static char path[PATH_MAX + 64];
  if (!scratch_dir[0]) {
    snprintf(scratch_dir, sizeof scratch_dir, "%s/pg-fuzz-%ld", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp",
             (long)getpid());
    if (mkdir(scratch_dir, 0700) != 0 && errno != EEXIST) abort();
    atexit(remove_scratch);
  }
  snprintf(path, sizeof path, "%s/%s", scratch_dir, name);
  FILE *f = fopen(path, "wb");
  if (!f || (size && fwrite(data, 1, size, f) != size) || fclose(f) != 0) abort();
  return path;
}

void fuzz_lua(const char *chunk, const char *path) {
  static lua_State *L;
  if (!L) {
    L = luaL_newstate();
    luaL_openlibs(L);
    luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_PRELOAD_TABLE);
    lua_pushcfunction(L, luaopen_pipegoose_core);
    lua_setfield(L, -2, "pipegoose.core");
    lua_pop(L, 1);
    lua_getglobal(L, "package");
    lua_pushstring(L, PG_FUZZ_ROOT "/lua/?.lua;" PG_FUZZ_ROOT "/lua/?/init.lua;" LUA_PATH_DEFAULT);
    lua_setfield(L, -2, "path");
    lua_pop(L, 1);
  }
  int top = lua_gettop(L);
  if (luaL_loadstring(L, chunk) != LUA_OK) abort(); /* the chunk is ours: a syntax error is a bug here */
  lua_pushstring(L, path);
  (void)lua_pcall(L, 1, 0, 0); /* an error is the reader refusing the file: fine */
  lua_settop(L, top);
  lua_gc(L, LUA_GCCOLLECT); /* tensors the reader made go now, not at the end of the run */
}

/* safetensors: the header and every entry it lists. */
int fuzz_safetensors(const uint8_t *data, size_t size) {
  fuzz_lua("local st = require 'pipegoose.safetensors'\n"
           "local h = st.read_header(...)\n"
           "for _, name in ipairs(h.names) do st.read(h, name) end\n",
           fuzz_file(data, size, "model.safetensors"));
  return 0;
}

/* A checkpoint directory holding only this manifest: verify it, and describe it. */
int fuzz_manifest(const uint8_t *data, size_t size) {
  const char *path = fuzz_file(data, size, "manifest.json");
  fuzz_lua("local ck = require 'pipegoose.checkpoint'\n"
           "local dir = (...):gsub('/manifest.json$', '')\n"
           "pcall(ck.verify, dir)\n"
           "pcall(ck.info, dir)\n",
           path);
  return 0;
}

/* llm.c model files: the header and the sizes it implies. */
int fuzz_llmc(const uint8_t *data, size_t size) {
  fuzz_lua("local llmc = require 'pipegoose.llmc'\n"
           "local cfg = llmc.read_header(...)\n"
           "for _, e in ipairs(llmc.entries(cfg)) do end\n",
           fuzz_file(data, size, "model.bin"));
  return 0;
}

/* tokenizer.json: load it, encode a fixed text with every kind of piece in it
 * (spaces, digits, contractions, accents, CJK, emoji, special-token strings,
 * invalid UTF-8), decode, save and load the saved file again. */
int fuzz_tokenizer(const uint8_t *data, size_t size) {
  fuzz_lua("local T = require 'pipegoose.tokenizer'\n"
           "local tok = T.load(...)\n"
           "local text = \"Hello  world\\n\\t\\t12345 I'm caf\\xc3\\xa9 e\\xcc\\x81 \\xe4\\xb8\\xad\\xf0\\x9f\\x8d\\x95 \"\n"
           "  .. \"<s></s><unk><|endoftext|><|begin_of_text|> \\xff\\xe4\\xb8 \\xed\\xa0\\x80   \"\n"
           "local ids = tok:encode(text)\n"
           "tok:encode(text, { add_special = false, tensor = true })\n"
           "tok:decode(ids)\n"
           "tok:decode(ids, { skip_special = true })\n"
           "pcall(tok.decode, tok, { 0, 1, 2, 255, 256, 4095, -1 })\n"
           "tok:pre_tokenize(text)\n"
           "T.load(tok:save((...) .. '.saved'))\n",
           fuzz_file(data, size, "tokenizer.json"));
  return 0;
}

/* Encoding: the bytes are the text, for the fixture tokenizers of every layout
 * (spec/fixtures/tokenizers, loaded once); decoding what comes out must work. */
int fuzz_tokenizer_encode(const uint8_t *data, size_t size) {
  fuzz_lua("local T = require 'pipegoose.tokenizer'\n"
           "if not FUZZ_TOKS then\n"
           "  FUZZ_TOKS = {}\n"
           "  for _, n in ipairs({ 'gpt2_prefix', 'llama3', 'sp_llama2', 'sp_meta' }) do\n"
           "    FUZZ_TOKS[#FUZZ_TOKS + 1] = T.load('" PG_FUZZ_ROOT "/spec/fixtures/tokenizers/' .. n)\n"
           "  end\n"
           "end\n"
           "local f = assert(io.open(..., 'rb'))\n"
           "local text = f:read('a')\n"
           "f:close()\n"
           "for _, tok in ipairs(FUZZ_TOKS) do\n"
           "  local ids = tok:encode(text)\n"
           "  tok:decode(ids)\n"
           "  tok:decode(tok:encode(text, { add_special = false, tensor = true }), { skip_special = true })\n"
           "end\n",
           fuzz_file(data, size, "text.txt"));
  return 0;
}

/* llm.c token shards: open (with and without a vocabulary check, and as
 * headerless uint16 / uint32 ids) and read every window. */
int fuzz_shard(const uint8_t *data, size_t size) {
  const char *path = fuzz_file(data, size, "tokens.bin");
  for (int pass = 0; pass < 6; pass++) {
    pg_shard s;
    int64_t vocab = pass % 2 ? 256 : 0;
    int rc = pass < 2 ? pg_shard_open(&s, path, vocab) : pg_shard_open_raw(&s, path, pass < 4 ? 1 : 7, vocab);
    if (rc != 0) continue;
    int32_t window[65];
    for (int64_t start = 0; start + 65 <= s.ntokens && start < 4096; start += 65)
      if (pg_shard_read(&s, start, 65, window) != 0) break;
    if (s.ntokens > 0) (void)pg_shard_read(&s, s.ntokens - 1, 1, window);
    pg_shard_close(&s);
  }
  int version;
  int64_t n;
  (void)pg_shard_info(path, &version, &n);
  return 0;
}
