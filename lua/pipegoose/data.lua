--- pg.data: token data for training.
--
-- Files are llm.c token shards: a header of 256 little-endian int32
-- ([1] magic 20240520, [2] version: 1 = uint16 tokens, 7 = uint32 tokens,
-- [3] token count), then the tokens.
--
--   pg.data.write_shard(path, tokens [, version])  tokens: int32 tensor or table of ids;
--                                                    version 1 or 7 forced, else 1 when every id < 65536
--   pg.data.read_shard(path [, vocab]) -> int32 tensor of all tokens
--   pg.data.shard_info(path) -> { version =, tokens = }
--   pg.data.TokenShards{ path =, batch =, seq_len =, seed = 0, shuffle = true, ctx = nil, vocab = nil }
--   pg.data.bytes.encode(string) -> int32 tensor;  pg.data.bytes.decode(ids) -> string
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
--   * state_dict() = { epoch, batch_index, seed, batch, seq_len, shuffle, files,
--     file_tokens } (plain values). load_state_dict refuses a state whose order would
--     differ: another seed, batch, seq_len, shuffle, number of files, file names
--     (compared by base name, so a moved data directory still resumes) or token
--     counts. The data-parallel size is not part of it: a state saved with D = 4
--     resumes with D = 2.
local core = require "pipegoose.core"
local opt = require "pipegoose.options"
local C = core.token_data

local M = {}

M.write_shard = C.write_shard
M.read_shard = C.read_shard
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

local TokenShards = {}
TokenShards.__index = TokenShards

local TOKEN_SHARDS = {
  path = opt.required(opt.either(opt.string, opt.list(opt.string, { what = "a list of paths" }))),
  batch = opt.integer{ min = 1, required = true }, seq_len = opt.integer{ min = 1, required = true },
  seed = opt.integer{ min = math.mininteger, max = math.maxinteger, default = 0 },
  shuffle = opt.boolean{ default = true }, ctx = opt.context,
  vocab = opt.integer{ min = 1 }, -- nil: token ids are not checked
}

function M.TokenShards(opts)
  opts = opt.check("TokenShards", opts, TOKEN_SHARDS)
  local shuffle, seed = opts.shuffle, opts.seed
  -- called through pcall so that an error (no file matches, a short file) names the user's line, not this one
  local ok, files = pcall(C.expand_paths, opts.path)
  if not ok then error(files, 2) end
  local loader
  ok, loader = pcall(C.loader, { files = files, batch = opts.batch, seq_len = opts.seq_len, seed = seed,
                                 shuffle = shuffle, vocab = opts.vocab, ctx = opts.ctx })
  if not ok then error(loader, 2) end
  local D, d = 1, 0
  if opts.ctx then D, d = opts.ctx:world_size("data"), opts.ctx:local_rank("data") end
  local batch, seq_len = opts.batch, opts.seq_len
  return setmetatable({
    loader = loader,
    files = files,
    batch = batch,
    seq_len = seq_len,
    local_batch = batch // D,
    seed = seed,
    shuffle = shuffle,
    data_size = D,
    data_rank = d,
    ctx = opts.ctx,
  }, TokenShards)
end

--- inputs, targets: int32 [batch/D, seq_len], fresh tensors; nil at the end of an epoch.
function TokenShards:next_batch()
  return self.loader:next()
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
    self.shuffle and ("shuffled, seed " .. self.seed) or "in file order")
end

return M
