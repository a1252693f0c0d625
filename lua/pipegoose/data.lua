--- pg.data: token data for training.
--
-- Files are llm.c token shards: a header of 256 little-endian int32
-- ([1] magic 20240520, [2] version: 1 = uint16 tokens, 7 = uint32 tokens,
-- [3] token count), then the tokens.
--
--   pg.data.write_shard(path, tokens [, version])  tokens: int32 tensor or table of ids;
--                                                    version 1 or 7 forced, else 1 when every id < 65536
--   pg.data.read_shard(path [, vocab [, dtype]]) -> int32 tensor of all tokens (dtype: headerless, below)
--   pg.data.shard_info(path) -> { version =, tokens = }
--   pg.data.TokenShards{ path =, batch =, seq_len =, seed = 0, shuffle = true, ctx = nil, vocab = nil,
--                        dtype = nil, stride = "window" }
--   pg.data.TokenShards{ corpus = dir or pg.data.corpus(dir), split = "train"|"val", batch =, ...,
--                        tokenizer = nil }  (tokenizer: refused unless it is the corpus's)
--   pg.data.corpus(dir) -> a prepared corpus (scripts/prepare_corpus.lua; below)
--   pg.data.ShardWriter(path, dtype) -> a streaming shard writer (below)
--   pg.data.bytes.encode(string) -> int32 tensor;  pg.data.bytes.decode(ids) -> string
--
-- A prepared corpus is a directory: tokenizer.json (+ tokenizer_config.json,
-- special_tokens_map.json), shards train_000000.bin ... and val_000000.bin ...,
-- and dataset.json, written last (a directory without it is unfinished):
--   { format = "pipegoose-corpus", version = 1, dtype = "uint16"|"uint32",
--     tokenizer = { file, hash (pg.data.hash_hex of tokenizer.json's bytes), vocab_size, bos_id, eos_id,
--                   document_token, document_token_at = "start"|"end" },
--     train = { shards, shard_tokens, tokens, documents, bytes }, val = { ... }, inputs, input_format, field, separator,
--     val_fraction, seed, skipped, created_by }
-- (bytes: the documents' UTF-8 bytes, so bits per byte = loss * tokens / (bytes * ln 2) compares
-- tokenizers; shard_tokens: each shard's token count, so that a shard changed or replaced after the
-- corpus was made is refused at open — a corpus written before it existed is checked by the total only).
-- pg.data.corpus checks every field and the tokenizer's hash and returns
-- { dir, tokenizer, vocab_size, dtype, hash, train = { paths (absolute), shard_tokens, tokens, documents,
-- bytes }, val }; TokenShards{corpus=} checks the files it opened against shard_tokens again.
--
-- dtype = "uint16" | "uint32": the files are headerless raw little-endian ids
-- (nanoGPT's train.bin is uint16); without it a file must have llm.c's header,
-- and one without the magic is refused with a hint to give dtype.
--
-- stride = "window" (the default) is described next; "llmc" reads as llm.c's
-- DataLoader: global batch u of a file is the B*T + 1 tokens from u*B*T
-- (B = batch, T = seq_len), inputs its first B*T, targets the same shifted by
-- one; consecutive batches share one token, a file has (tokens - 1) // (B*T)
-- of them, and data rank d of D reads the (B/D)*T + 1 tokens from d*(B/D)*T in
-- it (llm.c's process_rank offset). An epoch visits those batches in file
-- order or, shuffled, in a seeded order as below.
--
-- TokenShards (the contract in docs/DESIGN.md):
--   * path: a file, a glob ("data/train_*.bin", expanded sorted), or a list of either.
--   * Each file is cut into non-overlapping windows of seq_len + 1 tokens (windows
--     never cross files; a file's tail shorter than a window is unused). A window
--     is one row: inputs = its first seq_len tokens, targets = the next token of each.
--   * An epoch visits every window once: in file order (shuffle = false), or in a
--     seeded Fisher-Yates order that is a pure function of (seed, epoch).
--   * Global batch b of an epoch is windows [b*batch, (b+1)*batch) of that order; a
--     last partial batch is dropped. With ctx, data rank d of D gets rows
--     [d*batch/D, (d+1)*batch/D): every D sees the same global batches, and ranks of
--     one tensor/pipeline group (same data rank) get the same rows.
--   * The seed is the seed= option only (default 0), not the context's, so that a
--     loader without ctx reproduces the global batch of any data-parallel run.
--   * :epoch() counts from 0. :next_batch() returns nil once per epoch, after its last
--     batch; that call moves to the next epoch.
--   * state_dict() = { epoch, batch_index, seed, batch, seq_len, shuffle, stride, files,
--     file_tokens } (plain values). load_state_dict refuses a state whose order would
--     differ: another seed, batch, seq_len, shuffle, stride (a state without one is
--     "window"'s), number of files, file names
--     (compared by base name, so a moved data directory still resumes) or token
--     counts. The data-parallel size is not part of it: a state saved with D = 4
--     resumes with D = 2.
local core = require "pipegoose.core"
local opt = require "pipegoose.options"
local cjson = require("cjson").new()
local C = core.token_data

local M = {}

M.write_shard = C.write_shard
M.shard_info = C.shard_info

--- The byte-level tokenizer: token id = byte value, vocabulary 256. Any string
-- (UTF-8 or not) round-trips. decode maps ids outside 0..255 to U+FFFD, the
-- Unicode replacement character, so decoding a model's samples never fails.
M.bytes = {
  vocab_size = 256,
  -- The document separator of scripts/prepare_corpus.lua: byte 0 (NUL) comes
  -- before every document; it never occurs in text.
  eot = 0,
  encode = C.bytes_encode,
  decode = C.bytes_decode,
}

--- A number in [0, 1) that is a pure function of (string, seed): for
-- deterministic splits (scripts/prepare_corpus.lua).
M.hash_unit = C.hash_unit

--- 16 hex digits, a pure function of the string's bytes: a corpus's tokenizer.json digest.
M.hash_hex = C.hash_hex

-- The dtype names of shard ids and their llm.c header versions.
local VERSION_OF = { uint16 = 1, uint32 = 7 }

--- The dtype a tokenizer of vocab_size ids needs: uint16 while every id fits.
function M.dtype_for(vocab_size) return vocab_size <= 65536 and "uint16" or "uint32" end

--- pg.data.read_shard(path [, vocab [, dtype]]) -> int32 tensor of all tokens; dtype
-- "uint16" | "uint32": a headerless file of raw ids (as TokenShards' dtype=).
function M.read_shard(path, vocab, dtype)
  local raw = nil
  if dtype ~= nil then
    raw = VERSION_OF[dtype]
    if not raw then error(("read_shard: dtype must be \"uint16\" or \"uint32\", not %s"):format(tostring(dtype)), 2) end
  end
  local ok, t = pcall(C.read_shard, path, vocab, raw)
  if not ok then error(t, 2) end
  return t
end

--- pg.data.ShardWriter(path, dtype): a shard written as it grows
-- (src/runtime/pg_data.h: a temporary file renamed onto path by close, so path
-- is only ever a whole shard). w:append(id | int32 tensor | table [, first, count]),
-- w:append_documents(tensors, first, pos, doc_token, at_end, limit) (a batch of documents
-- with their document token, up to a shard of `limit` ids: src/lua/lua_data.c),
-- w:tokens(), w:close(), w:abort() (also what collecting a writer never closed does).
function M.ShardWriter(path, dtype)
  local v = VERSION_OF[dtype]
  if not v then error(("ShardWriter: dtype must be \"uint16\" or \"uint32\", not %s"):format(tostring(dtype)), 2) end
  return C.shard_writer(path, v)
end

-- ---- prepared corpora ----

local function read_all(p)
  local f = io.open(p, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

local NULL = cjson.null

--- pg.data.corpus(dir): the prepared corpus in dir (see the header), checked.
function M.corpus(dir)
  if type(dir) ~= "string" then error("pg.data.corpus: dir must be a string", 2) end
  dir = dir:gsub("/+$", "")
  if dir == "" then dir = "/" end
  local meta = dir .. "/dataset.json"
  local function bad(fmt, ...) error(("%s: " .. fmt):format(meta, ...), 3) end
  if not core.fs.is_dir(dir) then error(("pg.data.corpus: %s is not a directory"):format(dir), 2) end
  local text = read_all(meta)
  if not text then
    error(("pg.data.corpus: %s has no dataset.json: not a prepared corpus, or an unfinished one (prepare it "
      .. "with scripts/prepare_corpus.lua)"):format(dir), 2)
  end
  local ok, j = pcall(cjson.decode, text)
  if not ok or type(j) ~= "table" then bad("not a JSON object (%s)", tostring(j)) end
  if j.format ~= "pipegoose-corpus" then bad("format is %s, not \"pipegoose-corpus\"", tostring(j.format)) end
  if j.version ~= 1 then bad("version %s is not one this pipegoose reads (1)", tostring(j.version)) end
  local function count(v, what)
    if math.type(v) ~= "integer" and not (type(v) == "number" and v == math.floor(v)) or v < 0 then
      bad("%s must be a non-negative integer, not %s", what, tostring(v))
    end
    return math.tointeger(v)
  end
  local function id_or_null(v, what, vocab)
    if v == nil or v == NULL then return nil end
    local i = count(v, what)
    if i >= vocab then bad("%s %d is not below tokenizer.vocab_size %d", what, i, vocab) end
    return i
  end
  local t = j.tokenizer
  if type(t) ~= "table" then bad("tokenizer must be an object") end
  if type(t.file) ~= "string" or t.file == "" or t.file:find("/", 1, true) then
    bad("tokenizer.file must be a file name in the corpus directory, not %s", tostring(t.file))
  end
  if type(t.hash) ~= "string" or not t.hash:match("^%x+$") then bad("tokenizer.hash must be a hex digest") end
  local vocab = count(t.vocab_size, "tokenizer.vocab_size")
  if vocab < 1 then bad("tokenizer.vocab_size must be positive") end
  id_or_null(t.bos_id, "tokenizer.bos_id", vocab)
  id_or_null(t.eos_id, "tokenizer.eos_id", vocab)
  id_or_null(t.document_token, "tokenizer.document_token", vocab)
  if t.document_token_at ~= "start" and t.document_token_at ~= "end" then
    bad("tokenizer.document_token_at must be \"start\" or \"end\", not %s", tostring(t.document_token_at))
  end
  local dtype = j.dtype
  if not VERSION_OF[dtype] then bad("dtype must be \"uint16\" or \"uint32\", not %s", tostring(dtype)) end
  if dtype == "uint16" and vocab > 65536 then
    bad("dtype is uint16 but tokenizer.vocab_size %d needs uint32 (ids above 65535 cannot be stored)", vocab)
  end
  local tpath = dir .. "/" .. t.file
  local ttext = read_all(tpath)
  if not ttext then bad("tokenizer.file %s is missing", tpath) end
  local hash = M.hash_hex(ttext)
  if hash ~= t.hash then
    bad("%s has hash %s but the corpus was made with a tokenizer of hash %s: it is not the tokenizer of these "
      .. "shards", tpath, hash, t.hash)
  end
  local tok = require("pipegoose.tokenizer").load(dir)
  if tok:vocab_size() > vocab then
    bad("tokenizer.vocab_size %d but %s has %d ids", vocab, tpath, tok:vocab_size())
  end
  -- absolute paths, so that the table still names the shards after a chdir (PWD: the shell's working directory)
  local absdir = dir:sub(1, 1) == "/" and dir or ((os.getenv("PWD") or ".") .. "/" .. dir)
  local out = { dir = absdir, tokenizer = tok, vocab_size = vocab, dtype = dtype, hash = hash,
    document_token = id_or_null(t.document_token, "tokenizer.document_token", vocab),
    document_token_at = t.document_token_at }
  for _, split in ipairs{ "train", "val" } do
    local sp = j[split]
    if type(sp) ~= "table" then bad("%s must be an object", split) end
    if type(sp.shards) ~= "table" then bad("%s.shards must be a list of file names", split) end
    local recorded = sp.shard_tokens
    if recorded ~= nil then
      if type(recorded) ~= "table" then bad("%s.shard_tokens must be a list of token counts, one per shard", split) end
      for i = 1, #recorded do count(recorded[i], ("%s.shard_tokens[%d]"):format(split, i)) end
    end
    local paths, total, counts = {}, 0, {}
    for i, name in ipairs(sp.shards) do
      if type(name) ~= "string" or name:find("/", 1, true) then bad("%s.shards[%d] must be a file name", split, i) end
      local p = dir .. "/" .. name
      local ok2, info = pcall(C.shard_info, p)
      if not ok2 then bad("%s.shards[%d]: %s", split, i, tostring(info)) end
      if info.version ~= VERSION_OF[dtype] then
        bad("%s.shards[%d] %s holds %s ids but dtype is %s", split, i, name, info.version == 1 and "uint16" or "uint32", dtype)
      end
      if recorded and #recorded ~= #sp.shards then
        bad("%s.shard_tokens has %d counts for %d shards", split, #recorded, #sp.shards)
      end
      if recorded and info.tokens ~= recorded[i] then
        bad("%s.shards[%d] %s has %d tokens but the corpus recorded %d (%s.shard_tokens[%d]): the shard was changed "
          .. "or replaced after the corpus was prepared", split, i, name, info.tokens, math.tointeger(recorded[i]),
          split, i)
      end
      total = total + info.tokens
      counts[i] = info.tokens
      paths[i] = absdir .. "/" .. name
    end
    local tokens = count(sp.tokens, split .. ".tokens")
    if tokens ~= total then bad("%s.tokens is %d but its shards hold %d tokens", split, tokens, total) end
    out[split] = { paths = paths, shard_tokens = counts, tokens = tokens, documents = count(sp.documents, split .. ".documents"),
      bytes = count(sp.bytes, split .. ".bytes") }
  end
  return out
end

local TokenShards = {}
TokenShards.__index = TokenShards

local TOKEN_SHARDS = {
  path = opt.either(opt.string, opt.list(opt.string, { what = "a list of paths" })),
  corpus = opt.either(opt.string, opt.table), split = opt.enum{ "train", "val" },
  dtype = opt.enum{ "uint16", "uint32" }, stride = opt.enum({ "window", "llmc" }, { default = "window" }),
  batch = opt.integer{ min = 1, required = true }, seq_len = opt.integer{ min = 1, required = true },
  seed = opt.integer{ min = math.mininteger, max = math.maxinteger, default = 0 },
  shuffle = opt.boolean{ default = true }, ctx = opt.context,
  vocab = opt.integer{ min = 1 }, -- nil: token ids are not checked
  tokenizer = opt.check_with("a pg.tokenizer", function(v) return type(v) == "table" and type(v.to_json) == "function" end),
}

function M.TokenShards(opts)
  opts = opt.check("TokenShards", opts, TOKEN_SHARDS)
  local shuffle, seed = opts.shuffle, opts.seed
  local ok, files, corpus_counts
  local vocab, raw = opts.vocab, opts.dtype and VERSION_OF[opts.dtype] or nil
  if opts.corpus ~= nil then
    if opts.path ~= nil or opts.dtype ~= nil then
      error("TokenShards: give corpus= or path= (with dtype=), not both: a corpus names its own shards", 2)
    end
    if not opts.split then error("TokenShards: corpus= needs split = \"train\" or \"val\"", 2) end
    local corpus = opts.corpus
    if type(corpus) == "string" then
      ok, corpus = pcall(M.corpus, corpus)
      if not ok then error(corpus, 2) end
    elseif type(corpus.vocab_size) ~= "number" or type(corpus[opts.split]) ~= "table" then
      error("TokenShards: corpus= must be a directory or the table pg.data.corpus returns", 2)
    end
    if vocab and vocab < corpus.vocab_size then
      error(("TokenShards: the corpus's tokenizer has %d ids; the model's vocabulary is %d (vocab=)")
        :format(corpus.vocab_size, vocab), 2)
    end
    -- the model's tokenizer (an imported model's, engine.tokenizer) must be the one the shards were made with:
    -- compared as the tokenizer.json each would save, so formatting of the files does not matter
    if opts.tokenizer and opts.tokenizer:to_json() ~= corpus.tokenizer:to_json() then
      error(("TokenShards: the corpus %s was made with another tokenizer than the one given (tokenizer=): its ids "
        .. "would mean other tokens"):format(tostring(corpus.dir)), 2)
    end
    vocab = vocab or corpus.vocab_size
    corpus_counts = corpus[opts.split].shard_tokens
    files = {}
    for i, p in ipairs(corpus[opts.split].paths) do files[i] = p end
    if #files == 0 then
      error(("TokenShards: the corpus %s has no %s shards (%s.tokens = 0)"):format(tostring(corpus.dir), opts.split,
        opts.split), 2)
    end
  else
    if opts.path == nil then error("TokenShards: path= (or corpus= and split=) is required", 2) end
    if opts.split ~= nil then error("TokenShards: split= goes with corpus=", 2) end
    if opts.path == "" then error("TokenShards: path= is an empty string (a shard file, a glob or a list of them)", 2) end
    for i, p in ipairs(type(opts.path) == "table" and opts.path or {}) do
      if p == "" then error(("TokenShards: path[%d] is an empty string"):format(i), 2) end
    end
    -- called through pcall so that an error (no file matches, a short file) names the user's line, not this one
    ok, files = pcall(C.expand_paths, opts.path)
    if not ok then error("TokenShards: " .. tostring(files):gsub("^TokenShards: ", ""), 2) end
  end
  local loader
  ok, loader = pcall(C.loader, { files = files, batch = opts.batch, seq_len = opts.seq_len, seed = seed,
                                 shuffle = shuffle, vocab = vocab, ctx = opts.ctx, raw_version = raw,
                                 stride_llmc = opts.stride == "llmc" })
  if not ok then error(loader, 2) end
  if opts.corpus ~= nil then
    -- the shards as opened against the corpus's counts: a shard replaced since pg.data.corpus read it
    local recorded, opened = corpus_counts, loader:file_tokens()
    for i, n in ipairs(opened) do
      if recorded and recorded[i] ~= nil and recorded[i] ~= n then
        loader:close()
        error(("TokenShards: %s has %d tokens but its corpus recorded %d: the shard changed after the corpus was "
          .. "read"):format(files[i], n, recorded[i]), 2)
      end
    end
  end
  local D, d = 1, 0
  if opts.ctx then -- islands (DiLoCo) split the batch as data ranks do, island-major (as the loader)
    local ctx = opts.ctx
    D = ctx:world_size("islands") * ctx:world_size("data")
    d = ctx:local_rank("islands") * ctx:world_size("data") + ctx:local_rank("data")
  end
  local batch, seq_len = opts.batch, opts.seq_len
  return setmetatable({
    loader = loader,
    files = files,
    batch = batch,
    seq_len = seq_len,
    local_batch = batch // D,
    seed = seed,
    shuffle = shuffle,
    stride = opts.stride,
    data_size = D,
    data_rank = d,
    ctx = opts.ctx,
  }, TokenShards)
end

--- inputs, targets: int32 [batch/D, seq_len], fresh tensors; nil at the end of an epoch.
function TokenShards:next_batch()
  -- a read error (a shard that changed while open) names the caller's line, not this one
  local ok, x, y = pcall(self.loader.next, self.loader)
  if not ok then error(x, 2) end
  return x, y
end

--- Back to the first batch of the current epoch.
function TokenShards:reset()
  self.loader:reset()
end

function TokenShards:batches_per_epoch() return self.loader:batches_per_epoch() end

--- The current epoch, counting from 0.
function TokenShards:epoch()
  local e = self.loader:position()
  return e
end

--- epoch, index of the next batch in it (both counting from 0).
function TokenShards:position() return self.loader:position() end

--- Tokens of one global batch (targets predicted per step, all data ranks).
function TokenShards:tokens_per_batch() return self.batch * self.seq_len end

--- Windows (rows) per epoch, before dropping the last partial batch.
function TokenShards:num_windows() return self.loader:num_windows() end

--- Token counts of the files, in order.
function TokenShards:file_tokens() return self.loader:file_tokens() end

--- Unmaps the files; the loader cannot be used afterwards.
function TokenShards:close() self.loader:close() end

function TokenShards:state_dict()
  local epoch, index = self.loader:position()
  local files = {}
  for i, f in ipairs(self.files) do files[i] = f end
  return {
    epoch = epoch,
    batch_index = index,
    seed = self.seed,
    batch = self.batch,
    seq_len = self.seq_len,
    shuffle = self.shuffle,
    stride = self.stride,
    files = files,
    file_tokens = self.loader:file_tokens(),
  }
end

local function basename(p) return (tostring(p):match("([^/]*)$")) end

function TokenShards:load_state_dict(sd)
  if type(sd) ~= "table" then error("TokenShards:load_state_dict: expected a table from state_dict()", 2) end
  local mine = self:state_dict()
  local diffs = {}
  local function differ(what, theirs, ours)
    diffs[#diffs + 1] = ("%s %s in the state but %s here"):format(what, tostring(theirs), tostring(ours))
  end
  for _, k in ipairs{ "seed", "batch", "seq_len", "shuffle" } do
    if sd[k] ~= mine[k] then differ(k, sd[k], mine[k]) end
  end
  if (sd.stride or "window") ~= mine.stride then differ("stride", sd.stride or "window", mine.stride) end
  local theirs_files, theirs_tokens = sd.files or {}, sd.file_tokens or {}
  if #theirs_files ~= #mine.files then
    differ("files:", #theirs_files, #mine.files)
  else
    for i, f in ipairs(mine.files) do
      if basename(theirs_files[i]) ~= basename(f) then
        differ(("file %d is"):format(i), theirs_files[i], f)
      elseif theirs_tokens[i] ~= mine.file_tokens[i] then
        differ(("file %d (%s) has"):format(i, basename(f)), tostring(theirs_tokens[i]) .. " tokens",
          tostring(mine.file_tokens[i]) .. " tokens")
      end
    end
  end
  if #diffs > 0 then
    error("TokenShards:load_state_dict: the state is from a different data configuration: " ..
      table.concat(diffs, "; "), 2)
  end
  local epoch, index = math.tointeger(sd.epoch), math.tointeger(sd.batch_index)
  if not epoch or not index then
    error("TokenShards:load_state_dict: epoch and batch_index must be integers", 2)
  end
  self.loader:seek(epoch, index)
end

function TokenShards:__tostring()
  return ("TokenShards(%d files, batch %d (%d on this data rank of %d), seq_len %d, %d batches per epoch, %s)"):format(
    #self.files, self.batch, self.local_batch, self.data_size, self.seq_len, self:batches_per_epoch(),
    self.shuffle and ("shuffled, seed " .. self.seed) or "in file order") ..
    (self.stride == "llmc" and " (llm.c's stride)" or "")
end

return M
