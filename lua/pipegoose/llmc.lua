--- llm.c's GPT-2 model file: import into an engine, export from one.
-- Header of 256 int32: magic 20240326, version 3 (fp32) or 5 (bf16: every
-- value the upper half of a float32, llm.c's train_gpt2.cu format),
-- max_seq_len, vocab, layers, heads, channels, padded_vocab; then the 16
-- tensors below, each stacked over layers where it has a layer dimension.
local core = require "pipegoose.core"

local M = {}

M.MAGIC, M.VERSION, M.VERSION_BF16 = 20240326, 3, 5
-- a version's element dtype and size
local DTYPE = { [3] = { name = "float32", size = 4 }, [5] = { name = "bfloat16", size = 2 } }

-- The llm.c mapping of a model config's family (GPT-2's: lua/pipegoose/models/gpt2.lua's
-- llmc: its tensor order and the pipegoose names), or nil and why not.
local function mapping(cfg)
  local ok, f = pcall(require("pipegoose.models").of_config, cfg)
  if ok and f.llmc then return f.llmc end
  return nil, ("the model is %s; llm.c's format holds GPT-2 models only"):format(tostring(cfg.arch))
end

--- Why a model config cannot be written in llm.c's format, or nil when it can.
function M.refusal(cfg)
  local m, why = mapping(cfg)
  if not m then return why end
  return m.refusal(cfg)
end

local numel = require("pipegoose.safetensors").numel

--- Every (file tensor, layer, parameter name, byte offset, element count), in file order, for elements of
--- `size` bytes (default 4: float32; 2: bfloat16).
function M.entries(cfg, size)
  size = size or 4
  local out, off = {}, 1024
  for _, t in ipairs(assert(mapping(cfg)).layout(cfg)) do
    local n = numel(t[3])
    for l = 0, (t[4] or 1) - 1 do
      out[#out + 1] = { file_name = t[1], layer = t[4] and l or nil, name = t[2]:format(l), offset = off, count = n,
                        shape = t[3] }
      off = off + size * n
    end
  end
  return out, off
end

--- The file's header for a model config: 256 int32 (magic, version, the sizes).
-- The one writer of it (engine:save_llmc, scripts/checkpoint.lua export-llmc).
-- dtype: "float32" (default, version 3) or "bfloat16" (version 5).
function M.header(cfg, dtype)
  local version = (dtype == nil or dtype == "float32") and M.VERSION
    or dtype == "bfloat16" and M.VERSION_BF16
    or error(("llm.c model file: dtype must be float32 or bfloat16, not %s"):format(tostring(dtype)), 2)
  local header = {}
  for i = 1, 256 do header[i] = 0 end
  header[1], header[2], header[3], header[4] = M.MAGIC, version, cfg.seq_len, cfg.vocab
  header[5], header[6], header[7], header[8] = cfg.layers, cfg.heads, cfg.dim, cfg.padded_vocab
  return core.tensor(header, { dtype = "int32" })
end

--- Reads and checks the header; returns the model config and the values' dtype {name=, size=}.
function M.read_header(path)
  local ok, t = pcall(core.file.read, path, 0, 256, "int32") -- its message names the file, not this line
  if not ok then error(t, 0) end
  local h = t:totable()
  if h[1] ~= M.MAGIC then
    error(("%s: not an llm.c GPT-2 model file (magic %d, expected %d)"):format(path, h[1], M.MAGIC), 0)
  end
  local dtype = DTYPE[h[2]]
  if not dtype then
    error(("%s: llm.c model version %d is not supported (expected %d: fp32, or %d: bf16)"):format(path, h[2],
      M.VERSION, M.VERSION_BF16), 0)
  end
  local cfg = { seq_len = h[3], vocab = h[4], layers = h[5], heads = h[6], dim = h[7], padded_vocab = h[8] }
  for _, k in ipairs{ "seq_len", "vocab", "layers", "heads", "dim", "padded_vocab" } do
    if cfg[k] < 1 then error(("%s: the header's %s is %d, not a positive size"):format(path, k, cfg[k]), 0) end
  end
  if cfg.padded_vocab < cfg.vocab then
    error(("%s: the header's padded_vocab %d is below its vocab %d"):format(path, cfg.padded_vocab, cfg.vocab), 0)
  end
  require("pipegoose.models.common").attention(cfg, function(msg) error(path .. ": " .. msg, 0) end,
    { dim = "the header's channels", heads = "its heads", sep = " " })
  local actual = core.file.size(path)
  -- The size the header implies, in floating point first: sizes from a
  -- damaged header can overflow integers, and listing the entries of 2^30
  -- layers would take forever before the size check could fail.
  local V, T, C, L = cfg.padded_vocab, cfg.seq_len, cfg.dim, cfg.layers
  local approx = 1024 + dtype.size * ((V + T) * C + L * (12.0 * C * C + 13.0 * C) + 2.0 * C)
  if approx >= 2 ^ 53 then
    error(("%s: truncated: the header's model needs about %.3g bytes, the file has %d"):format(path, approx, actual), 0)
  end
  -- exact now (every term below 2^53): 12 C^2 + 13 C per layer, as M.entries lays them out
  local size = 1024 + dtype.size * ((V + T) * C + L * (12 * C * C + 13 * C) + 2 * C)
  if actual ~= size then
    error(("%s: %s: the header's model needs %d bytes, the file has %d"):format(path,
      actual < size and "truncated" or "trailing bytes", size, actual), 0)
  end
  return cfg, dtype
end

--- Loads the weights of an llm.c file into the engine (each rank its shards).
function M.load_into(engine, path)
  local cfg, dtype = M.read_header(path)
  local have = {}
  for _, p in ipairs(engine:parameters()) do have[p.name] = true end
  for _, e in ipairs(M.entries(cfg, dtype.size)) do
    if have[e.name] then
      local t = core.file.read(path, e.offset, e.count, dtype.name)
      engine:load_param(e.name, dtype.name == "bfloat16" and core.ops.from_bf16(t) or t)
    end
  end
end

--- Writes the model in llm.c's format (rank 0 writes; collective over all ranks).
function M.save_from(engine, path)
  if type(path) ~= "string" or path == "" then
    error(("save_llmc: needs a file path, got %s"):format(path == "" and "an empty string" or tostring(path)), 3)
  end
  local fs = require("pipegoose.checkpoint").fs
  local target = fs.absolute(path)
  local inside = target and fs.checkpoint_above(target)
  if inside then -- a file written there would replace or add one of that checkpoint's files
    error(("save_llmc: %s is inside the checkpoint %s: give a path outside it"):format(path, inside), 3)
  end
  if target and fs.is_dir(path) then error(("save_llmc: %s is a directory; give a file path"):format(path), 3) end
  local cfg = engine.config
  local why = M.refusal(cfg) -- the rule scripts/checkpoint.lua export-llmc applies too
  if why then error(("save_llmc: %s (engine:save_hf writes it)"):format(why), 3) end -- 3: engine:save_llmc's caller
  local ctx = engine.ctx
  local me = ctx:rank()
  local parts = { M.header(cfg) }
  for _, e in ipairs(M.entries(cfg)) do
    -- the file keeps the first rows (padding for T is not written)
    local buf = engine:gather_to_root(e.name, function(full)
      return full:reshape{ full:numel() }:narrow(1, 1, e.count):clone()
    end, { e.count })
    if me == 0 then parts[#parts + 1] = buf end
  end
  if me == 0 then core.file.write(path, parts) end
  ctx:barrier()
end

return M
