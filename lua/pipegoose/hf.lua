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
--   hf.read_config(dir) -> the pg.nn options, model_type, config.json's text and table
--                                  (hf.options(cfg, dir): of a decoded config.json)
--   hf.dropout_refusal(cfg, dir)   why a config's dropout cannot be trained, or nil
--   hf.load_into(engine, dir)      each rank loads its shards
--   hf.save_from(engine, dir, opts) collective; rank 0 writes the whole
--                                  directory (config.json, generation_config.json,
--                                  the weights, the tokenizer's files) into a
--                                  sibling and swaps it in
--   hf.write_checkpoint(cfg, dir, full, what, opts, src)  the same from a checkpoint
local cjson = require("cjson").new()

-- Whether a decoded JSON value is a non-empty array (this cjson reads [] and {} alike).
local function is_array(v)
  if type(v) ~= "table" or #v == 0 then return false end
  for k in pairs(v) do if math.type(k) ~= "integer" then return false end end
  return true
end
local core = require "pipegoose.core"
local opt = require "pipegoose.options"
local safetensors = require "pipegoose.safetensors"
local C = require "pipegoose.models.common"
local models = require "pipegoose.models"
local value, fail = C.value, C.fail
local function fs() return require("pipegoose.checkpoint").fs end -- directories and file lists

local M = {}

M.PAD_MULTIPLE = 64

-- A JSON file's text and its decoded object.
local function read_json(path, dir)
  if core.fs.is_dir(path) then fail(dir, "%s is a directory, not a JSON file", path) end
  local f = io.open(path, "rb")
  if not f then fail(dir, "no %s (a Hugging Face model directory has config.json and model.safetensors)", path) end
  local text = f:read("a")
  f:close()
  if text == nil then fail(dir, "%s cannot be read", path) end
  local ok, v = pcall(cjson.decode, text)
  if not ok or type(v) ~= "table" or is_array(v) then
    fail(dir, "%s is not a JSON object (%s)", path, ok and ("a JSON " .. (type(v) == "table" and "array" or type(v)))
      or tostring(v))
  end
  return v, text
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
-- of a directory; refuses what pipegoose does not compute, naming the config
-- field. Also returns config.json's text and its decoded table (pg.nn.from_hf
-- keeps the text with the model config: the export writes back what it does not compute).
function M.read_config(dir)
  local cfg, text = read_json(dir .. "/config.json", dir)
  local o, model_type = M.options(cfg, dir)
  return o, model_type, text, cfg
end

--- Why a decoded config.json's dropout cannot be trained by pipegoose (which
-- has none), or nil: each family's hf.dropout lists its fields with
-- transformers' defaults (an absent field is its default: GPT2Config's are 0.1).
function M.dropout_refusal(cfg, dir)
  local family = models.of_hf_model_type(cfg.model_type)
  local set = {}
  for k, default in pairs(family and family.hf.dropout or {}) do
    local v = value(cfg[k]) == nil and default or C.number(dir, cfg, k)
    if v ~= 0 then set[#set + 1] = ("%s = %g"):format(k, v) end
  end
  if #set == 0 then return nil end
  table.sort(set)
  return ("%s: config.json: %s: pipegoose has no dropout; pg.nn.from_hf(dir, { dropout = \"ignore\" }) trains "
    .. "without it (the export writes these fields back as they are)"):format(dir, table.concat(set, ", "))
end

--- The same from a decoded config.json (`dir` names it in errors).
function M.options(cfg, dir)
  local model_type = cfg.model_type
  local family, known = models.of_hf_model_type(model_type)
  if not family then
    fail(dir, "config.json: model_type is %s; pipegoose reads %s",
      type(model_type) == "string" and model_type or C.show(model_type), known)
  end
  local o = family.hf.options(dir, M.with_defaults(cfg, family.hf.defaults))
  o.padded_vocab = (o.vocab + M.PAD_MULTIPLE - 1) // M.PAD_MULTIPLE * M.PAD_MULTIPLE
  return o, model_type
end

local function shape_text(s) return "[" .. table.concat(s, ", ") .. "]" end
local WIDEN_NAMES = { float32 = true, bfloat16 = true, float16 = true } -- the dtypes load_into widens

-- name -> safetensors header of the file that holds it, for a directory,
-- and the headers of the files used (in a fixed order).
-- As transformers' from_pretrained: model.safetensors when it is there (an
-- index beside it is not read), else model.safetensors.index.json, whose
-- weight_map must be an object of tensor name -> a file name in the
-- directory: no path, and no link that leads out of it (real paths compared).
local function open_weights(dir)
  local single = dir .. "/model.safetensors"
  local where = {}
  if core.fs.exists(single) then
    local h = safetensors.read_header(single)
    for name in pairs(h.entries) do where[name] = h end
    return where, { h }
  end
  local index = dir .. "/model.safetensors.index.json"
  if not core.fs.exists(index) then
    fail(dir, "has neither model.safetensors nor model.safetensors.index.json")
  end
  local map = read_json(index, dir).weight_map
  if type(map) ~= "table" or is_array(map) then
    fail(dir, "%s: weight_map must be an object (tensor name -> file), got %s", index, C.show(map))
  end
  if next(map) == nil then fail(dir, "%s: weight_map is empty (it names no tensor)", index) end
  local real_dir = fs().absolute(dir)
  local names = {}
  for name, file in pairs(map) do
    if type(name) ~= "string" then fail(dir, "%s: weight_map is not an object (tensor name -> file)", index) end
    if type(file) ~= "string" or file == "" or file:find("/", 1, true) or file:find("\\", 1, true)
        or file == "." or file == ".." then
      fail(dir, "%s: weight_map[%s] = %s is not a file name in the directory", index, cjson.encode(name), C.show(file))
    end
    names[#names + 1] = name
  end
  table.sort(names) -- the first missing file named is the same on every run
  local headers, files = {}, {}
  for _, name in ipairs(names) do
    local file = map[name]
    if not headers[file] then
      local path = dir .. "/" .. file
      if not core.fs.exists(path) then
        fail(dir, "%s: weight_map puts %s in %s, which is missing", index, name, file)
      end
      local real = fs().absolute(path)
      if not (real and real_dir and fs().within(real, real_dir) and real ~= real_dir) then
        fail(dir, "%s: weight_map puts %s in %s, a link to %s outside the directory", index, name, file, tostring(real))
      end
      headers[file] = safetensors.read_header(path)
      files[#files + 1] = headers[file]
    end
    if not headers[file].entries[name] then
      fail(dir, "%s: weight_map puts %s in %s, which does not hold it", index, name, file)
    end
    where[name] = headers[file]
  end
  return where, files
end

-- The file name of a layout part in `where` (with the model prefix or without: both spellings are read).
local function stored_name(fam, e, part, where)
  if not e.top and where[fam.prefix .. part.hf] then return fam.prefix .. part.hf end
  return part.hf
end

--- Checks a directory's weights against the model its config describes,
-- before anything is read: every tensor the model needs is there with its
-- shape and a dtype pipegoose reads, and every tensor in the files used is
-- one the model loads -- except the buffers transformers itself drops on
-- load (the family's hf.ignored: GPT-2's attn.bias / attn.masked_bias,
-- rotary_emb.inv_freq) and, with a tied head, lm_head.weight (transformers
-- ties it to the embedding after loading). unused = "ignore" loads anyway
-- (transformers warns and drops them); the default refuses, listing them:
-- a config with fewer layers than the weights would drop tensors silently.
function M.check_weights(dir, o, model_type, unused)
  local fam = models.of_hf_model_type(model_type).hf
  local where, files = open_weights(dir)
  local used, embed = {}, nil
  for _, e in ipairs(fam.layout(o)) do
    for _, part in ipairs(e.parts) do
      local stored = stored_name(fam, e, part, where)
      if e.pg == "embed.wte" then embed = stored end
      local h = where[stored]
      if not h then fail(dir, "the weights have no tensor %s (nor %s%s)", part.hf, fam.prefix, part.hf) end
      local info = h.entries[stored]
      if not WIDEN_NAMES[info.dtype] then
        fail(dir, "%s is %s; pipegoose reads float32, bfloat16 or float16 weights (save the model with "
          .. "torch_dtype=float32)", stored, info.dtype)
      end
      if shape_text(info.shape) ~= shape_text(part.shape) then
        fail(dir, "%s has shape %s; the config needs %s", stored, shape_text(info.shape), shape_text(part.shape))
      end
      used[stored] = true
    end
  end
  -- a tied head's lm_head.weight in the file must be the embedding: transformers would use one for both
  local head = where["lm_head.weight"] and "lm_head.weight" or where[fam.prefix .. "lm_head.weight"]
    and fam.prefix .. "lm_head.weight" or nil
  if o.tie and head and embed and unused ~= "ignore" then
    local a, b = where[head].entries[head], where[embed].entries[embed]
    if shape_text(a.shape) ~= shape_text(b.shape) or a.dtype ~= b.dtype
        or not safetensors.read(where[head], head):equal(safetensors.read(where[embed], embed)) then
      fail(dir, "config.json ties the head to the embedding (tie_word_embeddings = true), but the weights' %s differs "
        .. "from %s: set tie_word_embeddings to false to train both, or pg.nn.from_hf(dir, { unused = \"ignore\" }) "
        .. "to use %s for both", head, embed, embed)
    end
  end
  if unused == "ignore" then return end
  local left = {}
  for _, h in ipairs(files) do
    for name in pairs(h.entries) do
      local bare = name:sub(1, #fam.prefix) == fam.prefix and name:sub(#fam.prefix + 1) or name
      local dropped = o.tie and bare == "lm_head.weight"
      for _, pat in ipairs(fam.ignored or {}) do dropped = dropped or bare:find(pat) ~= nil end
      if not used[name] and not dropped then left[#left + 1] = name end
    end
  end
  if #left > 0 then
    table.sort(left)
    fail(dir, "the weights hold %d tensor%s the model does not use (%s%s): the config.json describes a smaller "
      .. "model than the weights, or another one; pg.nn.from_hf(dir, { unused = \"ignore\" }) loads it anyway",
      #left, #left == 1 and "" or "s", table.concat(left, ", ", 1, math.min(#left, 6)), #left > 6 and ", ..." or "")
  end
end



-- The stored dtypes load_into reads, each with its (exact) widening to float32.
local WIDEN = { float32 = function(t) return t end, bfloat16 = core.ops.from_bf16, float16 = core.ops.from_f16 }

--- Loads a model directory's weights into the engine (each rank its shards).
-- M.check_weights has run (pg.nn.from_hf); a weight that is not finite
-- (+-inf, NaN) is refused naming the tensor: it could only train to NaN.
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
        local stored = stored_name(fam, e, part, where)
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
        local sum = t:sum() -- in double: finite exactly when every value is (no float32 sum overflows it)
        if sum ~= sum or sum == math.huge or sum == -math.huge then
          fail(dir, "%s (in %s) holds values that are not finite (inf or NaN); pipegoose loads finite weights only",
            stored, h.path)
        end
        pieces[i] = e.conv1d and t:transpose(1, 2) or t
      end
      local full = #pieces == 1 and pieces[1] or core.cat(pieces, 1)
      if e.permute then full = e.permute.to_pg(full, o) end -- the file's row order -> pipegoose's
      engine:load_param(e.pg, full)
    end
  end
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

---------------------------------------------------------------- writing a directory

-- config.json as transformers writes it (json.dumps, indent 2, sorted keys):
-- a float in the fewest digits that read back the same value, an integral
-- number as an integer (cjson reads every number as a float), JSON null as null.
local function json_text(v, indent)
  indent = indent or ""
  local tv = type(v)
  if v == nil or v == cjson.null then return "null" end
  if tv == "boolean" then return tostring(v) end
  if tv == "string" then return cjson.encode(v) end
  if tv == "number" then
    if v ~= v or v == math.huge or v == -math.huge then error("save_hf: a config value is not finite", 0) end
    if math.type(v) == "integer" then return ("%d"):format(v) end
    if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return ("%d"):format(math.tointeger(v)) end
    for digits = 15, 17 do
      local s = ("%." .. digits .. "g"):format(v)
      if tonumber(s) == v then return s end
    end
  end
  if tv ~= "table" then error(("save_hf: cannot write a %s in config.json"):format(tv), 0) end
  local inner = indent .. "  "
  local n = #v
  local keys = {}
  for k in pairs(v) do keys[#keys + 1] = k end
  if n > 0 and #keys == n then -- a list
    local items = {}
    for i = 1, n do items[i] = inner .. json_text(v[i], inner) end
    return "[\n" .. table.concat(items, ",\n") .. "\n" .. indent .. "]"
  end
  if #keys == 0 then return "{}" end -- cjson reads [] and {} alike: an empty list comes back as {}
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  local items = {}
  for i, k in ipairs(keys) do items[i] = inner .. cjson.encode(tostring(k)) .. ": " .. json_text(v[k], inner) end
  return "{\n" .. table.concat(items, ",\n") .. "\n" .. indent .. "}"
end
M.json_text = json_text

-- The imported config.json a model config carries (pg.nn.from_hf keeps its
-- text as hf_config), decoded; {} for a model built in pipegoose.
local function imported_config(cfg, fam, what)
  if cfg.hf_config == nil then return {} end
  local ok, v = pcall(cjson.decode, cfg.hf_config)
  if not ok or type(v) ~= "table" then
    error(("%s: the model config's hf_config is not a JSON object (%s)"):format(what, tostring(v)), 0)
  end
  if v.model_type ~= fam.model_type then
    error(("%s: the model config's hf_config is a %s config.json; the model is %s (\"%s\")"):format(what,
      tostring(value(v.model_type)), fam.class, fam.model_type), 0)
  end
  return v
end

-- A special token id for config.json: an integer in [0, vocab), or nil.
local function token_id(what, key, v, vocab)
  v = value(v)
  if v == nil then return nil end
  local id = math.tointeger(v)
  if id == nil or id < 0 or id >= vocab then
    error(("%s: %s = %s is not a token id of the model's vocabulary (0 .. %d)"):format(what, key, tostring(v),
      vocab - 1), 0)
  end
  return id
end

-- bos / eos / pad: the tokenizer's role (when it has one) and an option that
-- names another id is a conflict; else the option, else the imported
-- config's, else none. Never made up: a model without them has null.
local function special_ids(what, o, tok, imported, vocab)
  local out = {}
  for _, role in ipairs{ "bos", "eos", "pad" } do
    local key = role .. "_token_id"
    local asked = token_id(what, key, o[key], vocab)
    local from_tok = tok and tok[role .. "_id"](tok) or nil
    if from_tok ~= nil then from_tok = token_id(what, "the tokenizer's " .. role .. " id", from_tok, vocab) end
    if asked ~= nil and from_tok ~= nil and asked ~= from_tok then
      error(("%s: %s = %d, but the tokenizer's %s token is id %d"):format(what, key, asked, role, from_tok), 0)
    end
    local id = from_tok or asked
    if id == nil and imported[key] ~= nil and imported[key] ~= cjson.null then
      id = math.tointeger(imported[key]) or imported[key] -- written back as read (a list of eos ids too)
    end
    out[key] = id
  end
  return out
end

-- config.json: the imported file's fields (unknown ones too; an absent one
-- stays absent: transformers reads it as its default, as the import did) or,
-- for a model built in pipegoose, the family's defaults; then what pipegoose computes.
local function config_of(fam, cfg, imported, dtype, ids)
  local computed, fresh = fam.config(cfg)
  local c = {}
  if next(imported) == nil then
    for k, v in pairs(fresh or {}) do c[k] = v end
  end
  for k, v in pairs(imported) do c[k] = v end
  for k, v in pairs(computed) do c[k] = v end
  c.torch_dtype = dtype
  for k, v in pairs(ids) do c[k] = v end
  for _, k in ipairs{ "bos_token_id", "eos_token_id", "pad_token_id" } do
    if c[k] == nil then c[k] = cjson.null end
  end
  if c.pad_token_id == cjson.null and imported.pad_token_id == nil then c.pad_token_id = nil end
  c.transformers_version = value(imported.transformers_version) or M.TRANSFORMERS_VERSION
  return c
end

-- The transformers version a config written for a model built in pipegoose
-- names (the one the fixtures and scripts/check_hf_export.py are checked with).
M.TRANSFORMERS_VERSION = "4.45.2"

local GENERATION_KEYS = { do_sample = "boolean", temperature = "number", top_k = "number", top_p = "number",
  max_new_tokens = "number", max_length = "number", min_new_tokens = "number", repetition_penalty = "number",
  num_beams = "number" }

-- generation_config.json: the special ids, then the generation options given.
-- _from_model_config (transformers' GenerationConfig.from_model_config) is
-- true when nothing was given: transformers may then rebuild it from
-- config.json's legacy generation fields, which an explicit one must not be.
local function generation_of(what, c, generation)
  local g = { bos_token_id = c.bos_token_id, eos_token_id = c.eos_token_id, _from_model_config = generation == nil,
              transformers_version = c.transformers_version }
  if c.pad_token_id ~= nil and c.pad_token_id ~= cjson.null then g.pad_token_id = c.pad_token_id end
  for k, v in pairs(generation or {}) do
    local want = GENERATION_KEYS[k]
    if not want then
      local known = {}
      for name in pairs(GENERATION_KEYS) do known[#known + 1] = name end
      table.sort(known)
      error(("%s: generation.%s is not a field written (%s)"):format(what, tostring(k), table.concat(known, ", ")), 0)
    end
    if type(v) ~= want then error(("%s: generation.%s must be a %s, got %s"):format(what, k, want, tostring(v)), 0) end
    g[k] = v
  end
  return g
end

--- Bytes of a max_shard_size: an integer, or "5GB" / "500MB" / "2GiB" (as
-- transformers reads them: KB, MB, GB, TB are powers of 1000, KiB ... TiB of 1024).
function M.shard_bytes(v, what)
  what = what or "save_hf"
  if math.tointeger(v) and v >= 1 then return math.tointeger(v) end
  local units = { B = 1, KB = 10 ^ 3, MB = 10 ^ 6, GB = 10 ^ 9, TB = 10 ^ 12, KIB = 2 ^ 10, MIB = 2 ^ 20, GIB = 2 ^ 30,
                  TIB = 2 ^ 40 }
  local num, unit = tostring(v):match("^%s*(%d+%.?%d*)%s*(%a+)%s*$")
  local scale = unit and units[unit:upper()]
  if type(v) ~= "string" or not scale or (unit:sub(-1) ~= "B") then
    error(("%s: max_shard_size must be a number of bytes or a size such as \"5GB\", \"500MB\" or \"2GiB\", got %s")
      :format(what, tostring(v)), 0)
  end
  local bytes = math.floor(tonumber(num) * scale)
  if bytes < 1 then error(("%s: max_shard_size %s is under one byte"):format(what, v), 0) end
  return math.tointeger(bytes)
end

local DTYPE_BYTES = { float32 = 4, bfloat16 = 2, float16 = 2 }

-- A file tensor in the dtype asked: float32 as it is, bfloat16 or float16
-- rounded to nearest even (core.ops.to_bf16, core.ops.to_f16; a value beyond
-- float16's range is refused naming the tensor).
local function in_dtype(name, t, dtype)
  if t:device() ~= "cpu" then t = t:to("cpu") end -- the conversions are the host's
  if dtype == "bfloat16" then return { name = name, tensor = core.ops.to_bf16(t) } end
  if dtype == "float16" then return { name = name, tensor = core.ops.to_f16(t, name) } end
  return { name = name, tensor = t }
end

--- The shards of a list of {name =, bytes =} in order, as transformers'
-- save_pretrained cuts them: a new shard when the next tensor would take the
-- current one past max_bytes. A tensor larger than max_bytes alone is refused
-- (transformers gives it a shard of its own, larger than asked: a size limit
-- that is not one would surprise whoever set it for a file system or an upload).
function M.plan_shards(tensors, max_bytes, what)
  local shards, cur = {}, nil
  for _, t in ipairs(tensors) do
    if t.bytes > max_bytes then
      error(("%s: %s is %d bytes, more than max_shard_size (%d bytes): give a larger max_shard_size"):format(what,
        t.name, t.bytes, max_bytes), 0)
    end
    if not cur or cur.bytes + t.bytes > max_bytes then
      cur = { names = {}, bytes = 0 }
      shards[#shards + 1] = cur
    end
    cur.names[#cur.names + 1] = t.name
    cur.bytes = cur.bytes + t.bytes
  end
  return shards
end

-- The files a Hugging Face model directory (what save_hf writes, what transformers' save_pretrained writes) holds.
local HF_FILES = { ["config.json"] = true, ["generation_config.json"] = true, ["model.safetensors"] = true,
  ["model.safetensors.index.json"] = true, ["tokenizer.json"] = true, ["tokenizer_config.json"] = true,
  ["special_tokens_map.json"] = true }
local function hf_file(name) return HF_FILES[name] or name:match("^model%-%d+%-of%-%d+%.safetensors$") ~= nil end

local function absolute(path) return fs().absolute(path) end
local function within(a, b) return fs().within(a, b) end

--- Checks that dir may be replaced by an export: absent, empty or a Hugging
-- Face model directory (only the files HF_FILES names) unless overwrite; never
-- a directory that holds (or is) one of `keep` ({path =, what =}: the
-- checkpoint being exported, the directory a model was imported from).
function M.check_target(dir, what, overwrite, keep)
  if dir == "" then error(("%s: needs a directory path, got an empty string"):format(what), 0) end
  local target = absolute(dir)
  if not target then error(("%s: %s: not a path that can be resolved"):format(what, dir), 0) end
  local inside = fs().checkpoint_above(target)
  if inside then
    error(("%s: %s is inside the checkpoint %s (writing it would change that checkpoint): give a directory outside "
      .. "it"):format(what, dir, inside), 0)
  end
  for _, k in ipairs(keep or {}) do
    local src = k.path and absolute(k.path)
    if src and within(src, target) and (src ~= target or not k.same_ok) then
      error(("%s: writing %s would remove %s %s"):format(what, dir, k.what, k.path), 0)
    end
    if src and not k.same_ok and within(target, src) then
      error(("%s: %s is inside %s %s"):format(what, dir, k.what, k.path), 0)
    end
  end
  if not core.fs.exists(dir) then return target end
  if not core.fs.is_dir(dir) then error(("%s: %s exists and is not a directory"):format(what, dir), 0) end
  if overwrite then return target end
  local unrelated = {}
  for _, name in ipairs(fs().list(dir)) do
    if not hf_file(name) or core.fs.is_dir(dir .. "/" .. name) then unrelated[#unrelated + 1] = name end
  end
  if #unrelated > 0 then
    error(("%s: %s is not empty nor a Hugging Face model directory (it holds %s); the export replaces the whole "
      .. "directory: give overwrite = true to replace it anyway, or another directory"):format(what, dir,
      table.concat(unrelated, ", ", 1, math.min(#unrelated, 5)) .. (#unrelated > 5 and ", ..." or "")), 0)
  end
  return target
end

-- Writes a complete directory into a fresh sibling (.<name>.new-<pid>), then
-- swaps it in: in one step where the file system can (renameat2's exchange,
-- core.fs.exchange: a crash leaves the old directory or the new one at dir,
-- never neither), else by renaming the old aside (.<name>.old-<pid>) and the
-- new into place (a crash between the two leaves both whole under those
-- names). Then the old one is removed and the parent fsynced. A failure
-- before the swap removes the new one and leaves the old whole.
local function replace_dir(dir, write)
  dir = dir:gsub("/+$", "")
  local parent, base = fs().dirname(dir), fs().basename(dir)
  local tag = ("%s/.%s.%%s-%d"):format(parent, base, fs().getpid())
  local new, old = tag:format("new"), tag:format("old")
  fs().mkdir_p(parent) -- runs/llama_hf: runs/ made as needed
  if core.fs.exists(new) then fs().rm_rf(new) end
  fs().mkdir_p(new)
  local ok, err = pcall(write, new)
  if not ok then
    fs().rm_rf(new)
    error(err, 0)
  end
  if not core.fs.exists(dir) then
    local r, why = os.rename(new, dir)
    if not r then
      fs().rm_rf(new)
      error(("save_hf: cannot move the new directory into %s (%s)"):format(dir, tostring(why)), 0)
    end
  elseif core.fs.exchange(new, dir) then
    fs().fsync_dir(parent)
    fs().rm_rf(new) -- the old directory, now
  else
    if core.fs.exists(old) then fs().rm_rf(old) end
    local r, why = os.rename(dir, old)
    if not r then
      fs().rm_rf(new)
      error(("save_hf: cannot move %s aside (%s)"):format(dir, tostring(why)), 0)
    end
    r, why = os.rename(new, dir)
    if not r then
      os.rename(old, dir)
      fs().rm_rf(new)
      error(("save_hf: cannot move the new directory into %s (%s)"):format(dir, tostring(why)), 0)
    end
    fs().fsync_dir(parent)
    fs().rm_rf(old)
  end
  fs().fsync_dir(parent)
end

-- Writes the directory's files into tmp: the shards (or model.safetensors),
-- the index, config.json, generation_config.json and the tokenizer's files.
local function write_files(tmp, fam, cfg, entries, c, o, tok)
  local max = M.shard_bytes(o.max_shard_size, o.what)
  local sizes, by_name, total = {}, {}, 0
  for i, e in ipairs(entries) do
    local bytes = e.tensor:numel() * DTYPE_BYTES[o.dtype]
    sizes[i] = { name = e.name, bytes = bytes }
    by_name[e.name] = e
    total = total + bytes
  end
  local shards = M.plan_shards(sizes, max, o.what)
  local meta = { format = "pt" }
  if #shards == 1 then
    safetensors.write(tmp .. "/model.safetensors", entries, meta)
  else
    local map = {}
    for i, s in ipairs(shards) do
      local file = ("model-%05d-of-%05d.safetensors"):format(i, #shards)
      local list = {}
      for j, name in ipairs(s.names) do
        list[j] = by_name[name]
        map[name] = file
      end
      safetensors.write(tmp .. "/" .. file, list, meta)
    end
    core.file.write(tmp .. "/model.safetensors.index.json",
      { json_text({ metadata = { total_size = total }, weight_map = map }) .. "\n" })
  end
  core.file.write(tmp .. "/config.json", { json_text(c) .. "\n" })
  core.file.write(tmp .. "/generation_config.json", { json_text(generation_of(o.what, c, o.generation)) .. "\n" })
  if tok then tok:save_pretrained(tmp, { model_max_length = cfg.seq_len }) end
end

local SAVE_OPTIONS = {
  tokenizer = opt.any(), dtype = opt.enum{ "float32", "bfloat16", "float16" }, max_shard_size = opt.any(),
  generation = opt.table(), bos_token_id = opt.integer{ min = 0 }, eos_token_id = opt.integer{ min = 0 },
  pad_token_id = opt.integer{ min = 0 }, overwrite = opt.boolean{ default = false },
}

-- The tokenizer of an option: a pg.tokenizer, or a path pg.tokenizer.load reads.
local function tokenizer_of(v, what)
  if v == nil then return nil end
  if type(v) == "string" then return require("pipegoose.tokenizer").load(v) end
  if type(v) == "table" and type(v.save_pretrained) == "function" and type(v.bos_id) == "function" then return v end
  error(("%s: tokenizer must be a pg.tokenizer or the path of one, got %s"):format(what, opt.show(v)), 0)
end

-- The checked options of an export; `where` names it in errors.
local function export_options(opts, what, default_dtype, carried_tokenizer)
  local o = opt.check(what, opts, SAVE_OPTIONS, { level = 4 })
  o.what = what
  o.dtype = o.dtype or default_dtype or "float32"
  o.max_shard_size = o.max_shard_size or "5GB"
  M.shard_bytes(o.max_shard_size, what) -- refused before any tensor crosses
  o.tok = tokenizer_of(o.tokenizer, what) or carried_tokenizer
  return o
end

-- Everything rank 0 writes, given `tensors(e)` (an entry's tensors as
-- transformers stores them, one per part).
local function write_export(fam, cfg, dir, tensors, o, keep)
  local what = o.what
  M.check_target(dir, what, o.overwrite, keep)
  local imported = imported_config(cfg, fam, what)
  if o.tok and o.tok:vocab_size() > cfg.vocab then
    error(("%s: the tokenizer has %d ids; the model's vocabulary is %d"):format(what, o.tok:vocab_size(), cfg.vocab), 0)
  end
  local ids = special_ids(what, o, o.tok, imported, cfg.vocab)
  local c = config_of(fam, cfg, imported, o.dtype, ids)
  local entries = {}
  for _, e in ipairs(fam.layout(cfg)) do
    local ts = tensors(e)
    for i, part in ipairs(e.parts) do entries[#entries + 1] = in_dtype(file_name(fam, e, part), ts[i], o.dtype) end
  end
  replace_dir(dir, function(tmp) write_files(tmp, fam, cfg, entries, c, o, o.tok) end)
end

-- Rank 0's error (or nil) on every rank (collective), so that no rank returns while another raises.
local function agree(ctx, err)
  if ctx:world_size() == 1 then return err end
  local all = require("pipegoose.checkpoint.ranks").all_gather_strings(ctx, err or "")
  return all[1] ~= "" and all[1] or nil
end

--- Writes the engine's model as a Hugging Face directory (collective; rank 0
-- writes). opts: tokenizer (a pg.tokenizer or a path; default the one the
-- engine carries, engine.tokenizer), dtype ("float32", "bfloat16" or
-- "float16"; default bfloat16 under precision bf16, else float32),
-- max_shard_size (bytes or "5GB"), generation (generation_config.json's
-- fields), bos_token_id / eos_token_id / pad_token_id, overwrite.
function M.save_from(engine, dir, opts)
  local what = "save_hf"
  opt.value(what, "dir", dir, opt.required(opt.string), 3)
  local o = export_options(opts, what, engine.precision == "bf16" and "bfloat16" or "float32", engine.tokenizer)
  local cfg = engine.config or {}
  local fam = family_of(cfg, what)
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
  local err
  if engine.ctx:rank() == 0 then
    -- the directory the model was imported from may be written over: its tensors were read when the
    -- engine was built and the new directory is complete before the swap; a directory above it may not
    local source = engine.model and engine.model.weights and engine.model.weights.format == "hf"
      and engine.model.weights.path or nil
    local ok, e = pcall(write_export, fam, cfg, dir, function(x) return converted[x.pg] end, o,
      { { path = source, what = "the model's source", same_ok = true } })
    if not ok then err = tostring(e) end
  end
  err = agree(engine.ctx, err)
  if err then error(err, 0) end
end

--- Writes a checkpoint's weights as a Hugging Face directory; `full(name)`
-- reads a parameter's full tensor from the checkpoint (checkpoint/tools.lua);
-- src is the checkpoint directory (the export may not replace it nor a
-- directory above it). opts as save_from's. Returns the class written.
function M.write_checkpoint(cfg, dir, full, what, opts, src)
  local fam = family_of(cfg, what)
  local o = export_options(opts, what, "float32", nil)
  write_export(fam, cfg, dir, function(e) return to_hf(cfg, e, full(e.pg)) end, o,
    { { path = src, what = "the checkpoint" } })
  return fam.class
end

return M
