--- Hugging Face `transformers` layout: import into an engine, export from one.
--
-- A model directory holds config.json and the weights, in model.safetensors or
-- sharded (model.safetensors.index.json: {"weight_map": {tensor: file}}).
-- The generic machinery is here (config.json's defaults, safetensors, the
-- sharded index, loading, writing); each family's file in
-- lua/pipegoose/models/ has its mapping (class, prefix, defaults, the
-- config.json reader, the tensor layout, the config.json writer), found by
-- model_type or the model config's arch (models/init.lua lists them:
-- GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM). The embedding
-- has `vocab_size` rows (pipegoose pads to a multiple of 64: padding rows
-- are zero and are not written).
--
--   hf.read_config(dir) -> the pg.nn options, model_type (hf.options(cfg, dir): of a decoded config.json)
--   hf.load_into(engine, dir)      each rank loads its shards
--   hf.save_from(engine, dir)      collective; rank 0 writes config.json and
--                                  model.safetensors (atomically)
local cjson = require("cjson").new()
local core = require "pipegoose.core"
local safetensors = require "pipegoose.safetensors"
local C = require "pipegoose.models.common"
local models = require "pipegoose.models"
local value, fail = C.value, C.fail

local M = {}

M.PAD_MULTIPLE = 64

local function read_json(path, dir)
  local f = io.open(path, "rb")
  if not f then fail(dir, "no %s (a Hugging Face model directory has config.json and model.safetensors)", path) end
  local text = f:read("a")
  f:close()
  local ok, v = pcall(cjson.decode, text)
  if not ok or type(v) ~= "table" then fail(dir, "%s is not a JSON object (%s)", path, tostring(v)) end
  return v
end

-- config.json as transformers reads it: a field that is absent has its config
-- class's default (the family's hf.defaults, transformers 4.45.2's; checked
-- against spec/fixtures/hf_config_defaults.json, which scripts/hf_defaults.py
-- writes from transformers). A JSON null is not absent: transformers passes
-- None, which it reads as num_attention_heads for num_key_value_heads,
-- hidden_size / num_attention_heads for head_dim, 4 x n_embd for n_inner, as
-- false or none for the flags, rope_scaling and sliding_window; a null where
-- a number or a name is needed is refused. The defaults that depend on other
-- fields (those three) are the options functions' rules, each in one place.
function M.with_defaults(cfg, defaults)
  return setmetatable({}, { __index = function(_, k)
    local v = cfg[k]
    if v == nil then v = defaults[k] end
    return v
  end })
end

-- The family of a model config (pg.nn's model.config; GPT-2's has no arch),
-- with the fields its export needs.
local function family_of(cfg, what)
  local ok, f = pcall(models.of_config, cfg)
  if not ok or not f.hf then
    error(("%s: no Hugging Face layout for architecture %s"):format(what, tostring(cfg.arch)), 0)
  end
  for _, k in ipairs(f.config_keys) do
    if math.tointeger(cfg[k]) == nil then
      local labels = {}
      for i, fam in ipairs(models.list()) do labels[i] = "pg.nn." .. fam.label end
      error(("%s: the model config has no %s; the Hugging Face export writes %s models")
        :format(what, k, table.concat(labels, ", ", 1, #labels - 1) .. " and " .. labels[#labels]), 0)
    end
  end
  return f.hf
end

--- The pg.nn options and the model_type (a family's, lua/pipegoose/models/)
-- of a directory; refuses what pipegoose does not compute, naming the config field.
function M.read_config(dir)
  return M.options(read_json(dir .. "/config.json", dir), dir)
end

--- The same from a decoded config.json (`dir` names it in errors).
function M.options(cfg, dir)
  local model_type = cfg.model_type
  local family, known = models.of_hf_model_type(model_type)
  if not family then
    fail(dir, "config.json: model_type is %s; pipegoose reads %s", tostring(value(model_type)), known)
  end
  local o = family.hf.options(dir, M.with_defaults(cfg, family.hf.defaults))
  o.padded_vocab = (o.vocab + M.PAD_MULTIPLE - 1) // M.PAD_MULTIPLE * M.PAD_MULTIPLE
  return o, model_type
end

-- name -> safetensors header of the file that holds it, for a directory.
local function open_weights(dir)
  local index = dir .. "/model.safetensors.index.json"
  local f = io.open(index, "rb")
  local where = {}
  if f then
    f:close()
    local map = read_json(index, dir).weight_map
    if type(map) ~= "table" then fail(dir, "%s has no weight_map", index) end
    local headers = {}
    for name, file in pairs(map) do
      headers[file] = headers[file] or safetensors.read_header(dir .. "/" .. file)
      where[name] = headers[file]
    end
  else
    local h = safetensors.read_header(dir .. "/model.safetensors")
    for name in pairs(h.entries) do where[name] = h end
  end
  return where
end

local function shape_text(s) return "[" .. table.concat(s, ", ") .. "]" end


-- The stored dtypes load_into reads, each with its (exact) widening to float32.
local WIDEN = { float32 = function(t) return t end, bfloat16 = core.ops.from_bf16, float16 = core.ops.from_f16 }

--- Loads a model directory's weights into the engine (each rank its shards).
function M.load_into(engine, dir)
  local o, model_type = M.read_config(dir)
  local fam = models.of_hf_model_type(model_type).hf
  local where = open_weights(dir)
  local have = {}
  for _, p in ipairs(engine:parameters()) do have[p.name] = true end
  for _, e in ipairs(fam.layout(o)) do
    if have[e.pg] then
      local pieces = {}
      for i, part in ipairs(e.parts) do
        local stored = (not e.top and where[fam.prefix .. part.hf]) and fam.prefix .. part.hf or part.hf
        local h = where[stored]
        if not h then fail(dir, "the weights have no tensor %s (nor %s%s)", part.hf, fam.prefix, part.hf) end
        local info = h.entries[stored]
        local widen = WIDEN[info.dtype]
        if not widen then
          fail(dir, "%s is %s; pipegoose reads float32, bfloat16 or float16 weights (save the model with torch_dtype=float32)",
            stored, info.dtype)
        end
        if shape_text(info.shape) ~= shape_text(part.shape) then
          fail(dir, "%s has shape %s; the config needs %s", stored, shape_text(info.shape), shape_text(part.shape))
        end
        local t = safetensors.read(h, stored)
        t = widen(t) -- exact: the masters are float32, and every bf16 and f16 value is a float32
        pieces[i] = e.conv1d and t:transpose(1, 2) or t
      end
      local full = #pieces == 1 and pieces[1] or core.cat(pieces, 1)
      if e.permute then full = e.permute.to_pg(full, o) end -- the file's row order -> pipegoose's
      engine:load_param(e.pg, full)
    end
  end
end

local function config_json(fam, cfg, dtype)
  local c = fam.config(cfg)
  c.torch_dtype = dtype or c.torch_dtype
  local keys = {}
  for k in pairs(c) do keys[#keys + 1] = k end
  table.sort(keys)
  local lines = {}
  for _, k in ipairs(keys) do lines[#lines + 1] = ("  %s: %s"):format(cjson.encode(k), cjson.encode(c[k])) end
  return "{\n" .. table.concat(lines, ",\n") .. "\n}\n"
end

-- A full pipegoose parameter with the file's rows, in pipegoose's
-- orientation: the vocabulary's padding rows dropped, [rows, cols] (Conv1D's
-- [out, in]) or a vector, the permutation hook's to_hf applied.
local function file_rows(cfg, e, full)
  if e.pg == "embed.wte" or e.pg == "head.weight" then
    full = full:reshape{ full:numel() // cfg.dim, cfg.dim }:narrow(1, 1, cfg.vocab)
  end
  local s = e.parts[1].shape
  if e.conv1d then
    full = full:reshape{ s[2], s[1] }
  elseif #s == 2 then
    full = full:reshape{ full:numel() // s[2], s[2] }
  end
  if e.permute then full = e.permute.to_hf(full, cfg) end -- pipegoose's row order -> the file's
  return full
end

-- file_rows's tensor as transformers stores it, one tensor per part: Conv1D
-- weights transposed, fused tensors cut back into their parts.
local function cut(e, full)
  if e.conv1d then return { full:transpose(1, 2) } end
  local out, row = {}, 1
  local cols = #e.parts[1].shape == 2 and e.parts[1].shape[2] or nil
  for i, part in ipairs(e.parts) do
    out[i] = (cols and full:narrow(1, row, part.shape[1]) or full):reshape(part.shape):clone()
    row = row + part.shape[1]
  end
  return out
end

local function to_hf(cfg, e, full) return cut(e, file_rows(cfg, e, full)) end

local function file_name(fam, e, part) return e.top and part.hf or fam.prefix .. part.hf end

-- Writes config.json and model.safetensors (each atomically); `tensors(e)`
-- gives an entry's tensors as transformers stores them (one per part).
-- dtype: "float32" (default), or "bfloat16" (each value rounded to nearest
-- even; config.json's torch_dtype says which).
local function write_dir(fam, cfg, dir, tensors, dtype)
  local entries = {}
  for _, e in ipairs(fam.layout(cfg)) do
    local ts = tensors(e)
    for i, part in ipairs(e.parts) do
      local t = ts[i]
      if dtype == "bfloat16" then t = core.ops.to_bf16(t) end
      entries[#entries + 1] = { name = file_name(fam, e, part), tensor = t }
    end
  end
  local fs = require("pipegoose.checkpoint").fs
  fs.mkdir_p(dir)
  safetensors.write(dir .. "/model.safetensors", entries, { format = "pt" })
  fs.write_atomic(dir .. "/config.json", config_json(fam, cfg, dtype))
end

--- Writes the engine's model as a Hugging Face directory (collective; rank 0 writes).
function M.save_from(engine, dir)
  local cfg = engine.config or {}
  local fam = family_of(cfg, "save_hf")
  local converted = {}
  for _, e in ipairs(fam.layout(cfg)) do
    -- one tensor crosses to rank 0: the parts concatenated (in the file's row order), cut there
    local rows = 0
    for _, part in ipairs(e.parts) do rows = rows + part.shape[1] end
    local shape = #e.parts == 1 and e.parts[1].shape or { rows, e.parts[1].shape[2] }
    local full = engine:gather_to_root(e.pg, function(t)
      if #e.parts == 1 then return to_hf(cfg, e, t)[1] end
      return file_rows(cfg, e, t):clone()
    end, shape)
    if full then converted[e.pg] = #e.parts == 1 and { full } or cut(e, full) end
  end
  if engine.ctx:rank() == 0 then write_dir(fam, cfg, dir, function(e) return converted[e.pg] end) end
  engine.ctx:barrier()
end

--- Writes a checkpoint's weights as a Hugging Face directory; `full(name)`
-- reads a parameter's full tensor from the checkpoint (checkpoint.lua).
function M.write_checkpoint(cfg, dir, full, what, dtype)
  local fam = family_of(cfg, what)
  write_dir(fam, cfg, dir, function(e) return to_hf(cfg, e, full(e.pg)) end, dtype)
  return fam.class
end

return M
