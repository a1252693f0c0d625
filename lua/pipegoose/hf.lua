--- Hugging Face `transformers` layout: import into an engine, export from one.
--
-- A model directory holds config.json and the weights, in model.safetensors or
-- sharded (model.safetensors.index.json: {"weight_map": {tensor: file}}).
-- Supported: GPT2LMHeadModel (model_type "gpt2"). Conventions as
-- `transformers` has them: GPT-2's linear layers are Conv1D, weights stored
-- [in, out] (pipegoose's are [out, in]: transposed both ways); c_attn's
-- columns are q | k | v, heads in order (pipegoose's qkv rows); the tied
-- lm_head is not stored; the embedding has `vocab_size` rows (pipegoose pads
-- to a multiple of 64: padding rows are zero and are not written). Names may
-- carry the "transformer." prefix or not (the hub's gpt2 files have none);
-- the attention-mask buffers ("attn.bias", "attn.masked_bias") are ignored.
--
--   hf.read_config(dir) -> the pg.nn.GPT options
--   hf.load_into(engine, dir)      each rank loads its shards
--   hf.save_from(engine, dir)      collective; rank 0 writes config.json and
--                                  model.safetensors (atomically)
local cjson = require("cjson").new()
local safetensors = require "pipegoose.safetensors"

local M = {}

M.PAD_MULTIPLE = 64

local function fail(dir, fmt, ...) error(("%s: " .. fmt):format(dir, ...), 0) end

local function read_json(path, dir)
  local f = io.open(path, "rb")
  if not f then fail(dir, "no %s (a Hugging Face model directory has config.json and model.safetensors)", path) end
  local text = f:read("a")
  f:close()
  local ok, v = pcall(cjson.decode, text)
  if not ok or type(v) ~= "table" then fail(dir, "%s is not a JSON object (%s)", path, tostring(v)) end
  return v
end

local function value(v) if v == cjson.null then return nil end return v end

local function positive_int(dir, cfg, key)
  local v = math.tointeger(value(cfg[key])) -- cjson reads every number as a float
  if not v or v < 1 then
    fail(dir, "config.json: %s must be a positive integer, got %s", key, tostring(value(cfg[key])))
  end
  return v
end

--- The pg.nn.GPT options of a GPT2LMHeadModel directory; refuses what pipegoose's GPT does not compute.
function M.read_config(dir)
  local cfg = read_json(dir .. "/config.json", dir)
  if cfg.model_type ~= "gpt2" then
    fail(dir, "config.json: model_type is %s; pipegoose reads GPT2LMHeadModel (\"gpt2\")", tostring(value(cfg.model_type)))
  end
  local act = value(cfg.activation_function) or "gelu_new"
  if act ~= "gelu_new" and act ~= "gelu_pytorch_tanh" then
    fail(dir, "config.json: activation_function %s is not supported (pipegoose's GPT uses gelu_new)", tostring(act))
  end
  local eps = value(cfg.layer_norm_epsilon) or 1e-5
  if math.abs(eps - 1e-5) > 1e-12 then
    fail(dir, "config.json: layer_norm_epsilon %g is not supported (pipegoose's GPT uses 1e-5)", eps)
  end
  for _, k in ipairs{ "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn" } do
    if value(cfg[k]) then fail(dir, "config.json: %s = true is not supported", k) end
  end
  if value(cfg.scale_attn_weights) == false then fail(dir, "config.json: scale_attn_weights = false is not supported") end
  local o = {
    vocab = positive_int(dir, cfg, "vocab_size"), seq_len = positive_int(dir, cfg, "n_positions"),
    dim = positive_int(dir, cfg, "n_embd"), heads = positive_int(dir, cfg, "n_head"),
    layers = positive_int(dir, cfg, "n_layer"), tie = value(cfg.tie_word_embeddings) ~= false,
  }
  o.hidden = value(cfg.n_inner) and positive_int(dir, cfg, "n_inner") or 4 * o.dim
  o.padded_vocab = (o.vocab + M.PAD_MULTIPLE - 1) // M.PAD_MULTIPLE * M.PAD_MULTIPLE
  return o
end

-- Every parameter: {pg = pipegoose name, hf = transformers name without
-- "transformer.", shape = its shape in the file, conv1d = stored transposed,
-- top = outside "transformer." (lm_head)}.
local function layout(o)
  local V, T, C, H = o.vocab, o.seq_len, o.dim, o.hidden or 4 * o.dim
  local function p(pg, hf, shape, conv1d) return { pg = pg, hf = hf, shape = shape, conv1d = conv1d } end
  local out = { p("embed.wte", "wte.weight", { V, C }), p("embed.wpe", "wpe.weight", { T, C }) }
  for l = 0, o.layers - 1 do
    local b, h = "blocks." .. l .. ".", "h." .. l .. "."
    for _, e in ipairs{
      p("ln1.weight", "ln_1.weight", { C }), p("ln1.bias", "ln_1.bias", { C }),
      p("attn.qkv.weight", "attn.c_attn.weight", { C, 3 * C }, true), p("attn.qkv.bias", "attn.c_attn.bias", { 3 * C }),
      p("attn.proj.weight", "attn.c_proj.weight", { C, C }, true), p("attn.proj.bias", "attn.c_proj.bias", { C }),
      p("ln2.weight", "ln_2.weight", { C }), p("ln2.bias", "ln_2.bias", { C }),
      p("mlp.fc.weight", "mlp.c_fc.weight", { C, H }, true), p("mlp.fc.bias", "mlp.c_fc.bias", { H }),
      p("mlp.proj.weight", "mlp.c_proj.weight", { H, C }, true), p("mlp.proj.bias", "mlp.c_proj.bias", { C }),
    } do
      e.pg, e.hf = b .. e.pg, h .. e.hf
      out[#out + 1] = e
    end
  end
  out[#out + 1] = p("ln_f.weight", "ln_f.weight", { C })
  out[#out + 1] = p("ln_f.bias", "ln_f.bias", { C })
  if not o.tie then
    local head = p("head.weight", "lm_head.weight", { V, C })
    head.top = true
    out[#out + 1] = head
  end
  return out
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

--- Loads a GPT2LMHeadModel directory's weights into the engine (each rank its shards).
function M.load_into(engine, dir)
  local o = M.read_config(dir)
  local where = open_weights(dir)
  local have = {}
  for _, p in ipairs(engine:parameters()) do have[p.name] = true end
  for _, e in ipairs(layout(o)) do
    local stored = (not e.top and where["transformer." .. e.hf]) and "transformer." .. e.hf or e.hf
    local h = where[stored]
    if not h then fail(dir, "the weights have no tensor %s (nor transformer.%s)", e.hf, e.hf) end
    if have[e.pg] then
      local entry = h.entries[stored]
      if entry.dtype ~= "float32" then
        fail(dir, "%s is %s; pipegoose reads float32 weights (save the model with torch_dtype=float32)", stored,
          entry.dtype)
      end
      if shape_text(entry.shape) ~= shape_text(e.shape) then
        fail(dir, "%s has shape %s; the config needs %s", stored, shape_text(entry.shape), shape_text(e.shape))
      end
      local t = safetensors.read(h, stored)
      engine.c:load_param(e.pg, e.conv1d and t:transpose(1, 2) or t)
    end
  end
end

local function config_json(cfg)
  -- the keys transformers' GPT2Config writes, with pipegoose's fixed choices
  local c = {
    architectures = { "GPT2LMHeadModel" }, model_type = "gpt2", vocab_size = cfg.vocab, n_positions = cfg.seq_len,
    n_embd = cfg.dim, n_head = cfg.heads, n_layer = cfg.layers, n_inner = cfg.hidden,
    activation_function = "gelu_new", layer_norm_epsilon = 1e-5, initializer_range = 0.02,
    resid_pdrop = 0.0, embd_pdrop = 0.0, attn_pdrop = 0.0, scale_attn_weights = true, use_cache = true,
    tie_word_embeddings = cfg.tie ~= false, torch_dtype = "float32", bos_token_id = cfg.vocab - 1,
    eos_token_id = cfg.vocab - 1,
  }
  local keys = {}
  for k in pairs(c) do keys[#keys + 1] = k end
  table.sort(keys)
  local lines = {}
  for _, k in ipairs(keys) do lines[#lines + 1] = ("  %s: %s"):format(cjson.encode(k), cjson.encode(c[k])) end
  return "{\n" .. table.concat(lines, ",\n") .. "\n}\n"
end

-- A full pipegoose parameter as transformers stores it: the vocabulary's
-- padding rows dropped, Conv1D weights transposed.
local function to_hf(cfg, e, full)
  if e.pg == "embed.wte" or e.pg == "head.weight" then
    full = full:reshape{ full:numel() // cfg.dim, cfg.dim }:narrow(1, 1, cfg.vocab)
  end
  if e.conv1d then return full:reshape{ e.shape[2], e.shape[1] }:transpose(1, 2) end
  return full:reshape(e.shape):clone()
end

local function file_name(e) return e.top and e.hf or "transformer." .. e.hf end

-- Writes config.json and model.safetensors (each atomically); `tensor(e)` gives an entry's tensor as transformers stores it.
local function write_dir(cfg, dir, tensor)
  local entries = {}
  for _, e in ipairs(layout(cfg)) do entries[#entries + 1] = { name = file_name(e), tensor = tensor(e) } end
  local fs = require("pipegoose.checkpoint").fs
  fs.mkdir_p(dir)
  safetensors.write(dir .. "/model.safetensors", entries, { format = "pt" })
  fs.write_atomic(dir .. "/config.json", config_json(cfg))
end

local function check_gpt(cfg, what)
  for _, k in ipairs{ "vocab", "seq_len", "dim", "heads", "layers" } do
    if math.tointeger(cfg[k]) == nil then error(("%s: the model config has no %s; the Hugging Face export writes "
      .. "GPT-2 models (pg.nn.GPT)"):format(what, k), 0) end
  end
end

--- Writes the engine's model as a GPT2LMHeadModel directory (collective; rank 0 writes).
function M.save_from(engine, dir)
  local cfg = engine.config
  check_gpt(cfg or {}, "save_hf")
  local converted = {}
  for _, e in ipairs(layout(cfg)) do
    converted[file_name(e)] = engine:gather_to_root(e.pg, function(full) return to_hf(cfg, e, full) end, e.shape)
  end
  if engine.ctx:rank() == 0 then write_dir(cfg, dir, function(e) return converted[file_name(e)] end) end
  engine.ctx:barrier()
end

--- Writes a checkpoint's GPT-2 weights as a GPT2LMHeadModel directory;
-- `full(name)` reads a parameter's full tensor from the checkpoint (checkpoint.lua).
function M.write_checkpoint(cfg, dir, full, what)
  check_gpt(cfg, what)
  write_dir(cfg, dir, function(e) return to_hf(cfg, e, full(e.pg)) end)
end

return M
