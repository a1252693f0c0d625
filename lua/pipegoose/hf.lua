--- Hugging Face `transformers` layout: import into an engine, export from one.
--
-- A model directory holds config.json and the weights, in model.safetensors or
-- sharded (model.safetensors.index.json: {"weight_map": {tensor: file}}).
-- Supported: GPT2LMHeadModel (model_type "gpt2"), LlamaForCausalLM ("llama"),
-- MixtralForCausalLM ("mixtral"). Conventions as
-- `transformers` has them: GPT-2's linear layers are Conv1D, weights stored
-- [in, out] (pipegoose's are [out, in]: transposed both ways); c_attn's
-- columns are q | k | v, heads in order (pipegoose's qkv rows); the tied
-- lm_head is not stored; the embedding has `vocab_size` rows (pipegoose pads
-- to a multiple of 64: padding rows are zero and are not written). Names may
-- carry the "transformer." prefix or not (the hub's gpt2 files have none);
-- the attention-mask buffers ("attn.bias", "attn.masked_bias") are ignored.
--
--   hf.read_config(dir) -> the pg.nn.GPT options (hf.options(cfg, dir): of a decoded config.json)
--   hf.load_into(engine, dir)      each rank loads its shards
--   hf.save_from(engine, dir)      collective; rank 0 writes config.json and
--                                  model.safetensors (atomically)
local cjson = require("cjson").new()
local core = require "pipegoose.core"
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

local function number(dir, cfg, key)
  local v = value(cfg[key])
  if type(v) ~= "number" then fail(dir, "config.json: %s must be a number, got %s", key, tostring(v)) end
  return v
end

-- config.json as transformers reads it: a field that is absent has its config
-- class's default (ARCH.<model_type>.defaults, transformers 4.45.2's; checked
-- against spec/fixtures/hf_config_defaults.json, which scripts/hf_defaults.py
-- writes from transformers). A JSON null is not absent: transformers passes
-- None, which it reads as num_attention_heads for num_key_value_heads,
-- hidden_size / num_attention_heads for head_dim, 4 x n_embd for n_inner, as
-- false or none for the flags, rope_scaling and sliding_window; a null where
-- a number or a name is needed is refused. The defaults that depend on other
-- fields (those three) are the options functions' rules, each in one place.
local function with_defaults(cfg, defaults)
  return setmetatable({}, { __index = function(_, k)
    local v = cfg[k]
    if v == nil then v = defaults[k] end
    return v
  end })
end

-- One entry per architecture: what config.json must say, how its fields map
-- to pg.nn options, the tensors (layout) and the config.json written back.
-- A layout entry: {pg = pipegoose name, parts = {{hf =, shape =}, ...} (the
-- file tensors whose rows, concatenated, make the parameter: LLaMA's q|k|v
-- and gate|up are fused in pipegoose), conv1d = stored transposed (GPT-2),
-- top = outside the model prefix (lm_head)}.
local ARCH = {}

ARCH.gpt2 = { class = "GPT2LMHeadModel", prefix = "transformer." }

-- GPT2Config's defaults of the fields options() reads (n_inner: 4 x n_embd)
ARCH.gpt2.defaults = {
  vocab_size = 50257, n_positions = 1024, n_embd = 768, n_layer = 12, n_head = 12,
  activation_function = "gelu_new", layer_norm_epsilon = 1e-5, tie_word_embeddings = true,
  scale_attn_weights = true, scale_attn_by_inverse_layer_idx = false, reorder_and_upcast_attn = false,
}

--- The pg.nn.GPT options of a GPT2LMHeadModel config; refuses what pipegoose's GPT does not compute.
function ARCH.gpt2.options(dir, cfg)
  local act = value(cfg.activation_function)
  if act ~= "gelu_new" and act ~= "gelu_pytorch_tanh" then
    fail(dir, "config.json: activation_function %s is not supported (pipegoose's GPT uses gelu_new)", tostring(act))
  end
  local eps = number(dir, cfg, "layer_norm_epsilon")
  if math.abs(eps - 1e-5) > 1e-12 then
    fail(dir, "config.json: layer_norm_epsilon %g is not supported (pipegoose's GPT uses 1e-5)", eps)
  end
  for _, k in ipairs{ "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn" } do
    if value(cfg[k]) then fail(dir, "config.json: %s = true is not supported", k) end
  end
  if not value(cfg.scale_attn_weights) then
    fail(dir, "config.json: scale_attn_weights = %s is not supported", tostring(value(cfg.scale_attn_weights)))
  end
  local o = {
    vocab = positive_int(dir, cfg, "vocab_size"), seq_len = positive_int(dir, cfg, "n_positions"),
    dim = positive_int(dir, cfg, "n_embd"), heads = positive_int(dir, cfg, "n_head"),
    layers = positive_int(dir, cfg, "n_layer"), tie = value(cfg.tie_word_embeddings) == true,
  }
  o.hidden = value(cfg.n_inner) and positive_int(dir, cfg, "n_inner") or 4 * o.dim
  return o
end

local function entry(pg, parts, conv1d)
  local e = { pg = pg, parts = {}, conv1d = conv1d }
  for i, p in ipairs(parts) do e.parts[i] = { hf = p[1], shape = p[2] } end
  e.shape = #parts == 1 and parts[1][2] or nil
  return e
end

function ARCH.gpt2.layout(o)
  local V, T, C, H = o.vocab, o.seq_len, o.dim, o.hidden or 4 * o.dim
  local function p(pg, hf, shape, conv1d) return entry(pg, { { hf, shape } }, conv1d) end
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
      e.pg, e.parts[1].hf = b .. e.pg, h .. e.parts[1].hf
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

function ARCH.gpt2.config(cfg)
  -- the keys transformers' GPT2Config writes, with pipegoose's fixed choices
  return {
    architectures = { "GPT2LMHeadModel" }, model_type = "gpt2", vocab_size = cfg.vocab, n_positions = cfg.seq_len,
    n_embd = cfg.dim, n_head = cfg.heads, n_layer = cfg.layers, n_inner = cfg.hidden,
    activation_function = "gelu_new", layer_norm_epsilon = 1e-5, initializer_range = 0.02,
    resid_pdrop = 0.0, embd_pdrop = 0.0, attn_pdrop = 0.0, scale_attn_weights = true, use_cache = true,
    tie_word_embeddings = cfg.tie ~= false, torch_dtype = "float32", bos_token_id = cfg.vocab - 1,
    eos_token_id = cfg.vocab - 1,
  }
end

ARCH.llama = { class = "LlamaForCausalLM", prefix = "model." }

-- LlamaConfig's defaults of the fields options() reads (num_key_value_heads:
-- num_attention_heads; head_dim: hidden_size / num_attention_heads; rope_scaling: none)
ARCH.llama.defaults = {
  vocab_size = 32000, max_position_embeddings = 2048, hidden_size = 4096, intermediate_size = 11008,
  num_hidden_layers = 32, num_attention_heads = 32, hidden_act = "silu", rms_norm_eps = 1e-6,
  rope_theta = 10000, tie_word_embeddings = false, attention_bias = false, mlp_bias = false,
}

--- The pg.nn.Llama options of a LlamaForCausalLM config; refuses what pipegoose's Llama does not compute.
function ARCH.llama.options(dir, cfg)
  local act = value(cfg.hidden_act)
  if act ~= "silu" then fail(dir, "config.json: hidden_act %s is not supported (pipegoose's Llama uses silu)", tostring(act)) end
  for _, k in ipairs{ "attention_bias", "mlp_bias" } do
    if value(cfg[k]) then fail(dir, "config.json: %s = true is not supported (pipegoose's Llama has no biases)", k) end
  end
  if value(cfg.rope_scaling) ~= nil then
    fail(dir, "config.json: rope_scaling is not supported (pipegoose applies plain rotary embeddings)")
  end
  local o = {
    vocab = positive_int(dir, cfg, "vocab_size"), seq_len = positive_int(dir, cfg, "max_position_embeddings"),
    dim = positive_int(dir, cfg, "hidden_size"), heads = positive_int(dir, cfg, "num_attention_heads"),
    layers = positive_int(dir, cfg, "num_hidden_layers"), hidden = positive_int(dir, cfg, "intermediate_size"),
    rope_theta = number(dir, cfg, "rope_theta"), eps = number(dir, cfg, "rms_norm_eps"),
    tie = value(cfg.tie_word_embeddings) == true,
  }
  o.kv_heads = value(cfg.num_key_value_heads) and positive_int(dir, cfg, "num_key_value_heads") or o.heads
  if value(cfg.head_dim) ~= nil then o.head_dim = positive_int(dir, cfg, "head_dim")
  elseif o.dim % o.heads ~= 0 then
    fail(dir, "config.json: hidden_size %d is not divisible by num_attention_heads %d", o.dim, o.heads)
  end
  if o.heads % o.kv_heads ~= 0 then
    fail(dir, "config.json: num_key_value_heads %d does not divide num_attention_heads %d", o.kv_heads, o.heads)
  end
  return o
end

function ARCH.llama.layout(o)
  local V, C, I = o.vocab, o.dim, o.hidden
  local hd = o.head_dim or C // o.heads
  local Q, K = o.heads * hd, (o.kv_heads or o.heads) * hd
  local out = { entry("embed.wte", { { "embed_tokens.weight", { V, C } } }) }
  for l = 0, o.layers - 1 do
    local b, h = "blocks." .. l .. ".", "layers." .. l .. "."
    out[#out + 1] = entry(b .. "ln1.weight", { { h .. "input_layernorm.weight", { C } } })
    out[#out + 1] = entry(b .. "attn.qkv.weight", { { h .. "self_attn.q_proj.weight", { Q, C } },
      { h .. "self_attn.k_proj.weight", { K, C } }, { h .. "self_attn.v_proj.weight", { K, C } } })
    out[#out + 1] = entry(b .. "attn.proj.weight", { { h .. "self_attn.o_proj.weight", { C, Q } } })
    out[#out + 1] = entry(b .. "ln2.weight", { { h .. "post_attention_layernorm.weight", { C } } })
    out[#out + 1] = entry(b .. "mlp.fc.weight", { { h .. "mlp.gate_proj.weight", { I, C } },
      { h .. "mlp.up_proj.weight", { I, C } } })
    out[#out + 1] = entry(b .. "mlp.proj.weight", { { h .. "mlp.down_proj.weight", { C, I } } })
  end
  out[#out + 1] = entry("ln_f.weight", { { "norm.weight", { C } } })
  if not o.tie then
    local head = entry("head.weight", { { "lm_head.weight", { V, C } } })
    head.top = true
    out[#out + 1] = head
  end
  return out
end

function ARCH.llama.config(cfg)
  -- the keys transformers' LlamaConfig writes, with pipegoose's fixed choices
  return {
    architectures = { "LlamaForCausalLM" }, model_type = "llama", vocab_size = cfg.vocab,
    max_position_embeddings = cfg.seq_len, hidden_size = cfg.dim, intermediate_size = cfg.hidden,
    num_hidden_layers = cfg.layers, num_attention_heads = cfg.heads, num_key_value_heads = cfg.kv_heads,
    head_dim = cfg.head_dim, hidden_act = "silu", rms_norm_eps = cfg.eps, rope_theta = cfg.rope_theta,
    rope_scaling = cjson.null, attention_bias = false, attention_dropout = 0.0, mlp_bias = false,
    initializer_range = 0.02, pretraining_tp = 1, use_cache = true, tie_word_embeddings = cfg.tie == true,
    torch_dtype = "float32", bos_token_id = cfg.vocab - 1, eos_token_id = cfg.vocab - 1,
  }
end

-- Mixtral: LLaMA's attention, norms and embeddings, and a sparse mixture of
-- experts for each block's MLP (block_sparse_moe.gate, block_sparse_moe.experts.<e>.w1|w2|w3).
ARCH.mixtral = { class = "MixtralForCausalLM", prefix = "model." }

-- MixtralConfig's defaults: LLaMA's fields with Mixtral's values, and the
-- experts'. An absent num_key_value_heads is 8 (null: num_attention_heads);
-- MixtralConfig has no attention_bias, mlp_bias, rope_scaling nor head_dim
-- (hidden_size / num_attention_heads), nor a sliding_window by default.
ARCH.mixtral.defaults = {
  vocab_size = 32000, max_position_embeddings = 4096 * 32, hidden_size = 4096, intermediate_size = 14336,
  num_hidden_layers = 32, num_attention_heads = 32, num_key_value_heads = 8, hidden_act = "silu",
  rms_norm_eps = 1e-5, rope_theta = 1e6, tie_word_embeddings = false,
  num_local_experts = 8, num_experts_per_tok = 2, router_jitter_noise = 0,
  output_router_logits = false, router_aux_loss_coef = 0.001,
}

--- The pg.nn.Mixtral options of a MixtralForCausalLM config. transformers adds
-- the load-balancing loss to the training loss only when output_router_logits
-- is true: aux_loss_coef is router_aux_loss_coef then, else 0.
function ARCH.mixtral.options(dir, cfg)
  local o = ARCH.llama.options(dir, cfg)
  local window = value(cfg.sliding_window)
  if window ~= nil and window < o.seq_len then
    fail(dir, "config.json: sliding_window %s is not supported (pipegoose attends to the whole causal context)",
      tostring(window))
  end
  local jitter = number(dir, cfg, "router_jitter_noise")
  if jitter ~= 0 then fail(dir, "config.json: router_jitter_noise %g is not supported yet (only 0)", jitter) end
  o.experts = positive_int(dir, cfg, "num_local_experts")
  o.top_k = positive_int(dir, cfg, "num_experts_per_tok")
  if o.top_k > o.experts then
    fail(dir, "config.json: num_experts_per_tok %d exceeds num_local_experts %d", o.top_k, o.experts)
  end
  o.aux_loss_coef = value(cfg.output_router_logits) == true and number(dir, cfg, "router_aux_loss_coef") or 0
  return o
end

function ARCH.mixtral.layout(o)
  local out = {}
  for _, e in ipairs(ARCH.llama.layout(o)) do
    if not e.pg:find("%.mlp%.") then out[#out + 1] = e end
  end
  local C, I, E = o.dim, o.hidden, o.experts
  -- each block's experts after its attention (the order does not matter to the readers; kept per block)
  local with_moe = {}
  for _, e in ipairs(out) do
    with_moe[#with_moe + 1] = e
    local l = e.pg:match("^blocks%.(%d+)%.ln2%.weight$")
    if l then
      local b, h = "blocks." .. l .. ".moe.", "layers." .. l .. ".block_sparse_moe."
      with_moe[#with_moe + 1] = entry(b .. "gate.weight", { { h .. "gate.weight", { E, C } } })
      for x = 0, E - 1 do
        local pe, he = b .. "experts." .. x .. ".", h .. "experts." .. x .. "."
        with_moe[#with_moe + 1] = entry(pe .. "w1.weight", { { he .. "w1.weight", { I, C } } })
        with_moe[#with_moe + 1] = entry(pe .. "w2.weight", { { he .. "w2.weight", { C, I } } })
        with_moe[#with_moe + 1] = entry(pe .. "w3.weight", { { he .. "w3.weight", { I, C } } })
      end
    end
  end
  return with_moe
end

function ARCH.mixtral.config(cfg)
  local c = ARCH.llama.config(cfg)
  c.architectures, c.model_type = { "MixtralForCausalLM" }, "mixtral"
  c.head_dim, c.pretraining_tp, c.mlp_bias, c.attention_bias = nil, nil, nil, nil
  c.num_local_experts, c.num_experts_per_tok = cfg.experts, cfg.top_k
  -- the load-balancing loss: transformers computes it when output_router_logits is set
  -- (and adds router_aux_loss_coef x it): both say the model's coefficient, 0 when it had none
  local coef = cfg.aux_loss_coef or 0.001
  c.output_router_logits = coef > 0
  c.router_aux_loss_coef = coef
  c.router_jitter_noise = 0.0
  c.sliding_window = cjson.null
  return c
end

M.ARCHITECTURES = ARCH

-- The architecture of a model config (pg.nn's model.config; GPT-2's has no arch).
local function arch_of(cfg, what)
  local a = ARCH[cfg.arch or "gpt2"]
  if not a then error(("%s: no Hugging Face layout for architecture %s"):format(what, tostring(cfg.arch)), 0) end
  local keys = cfg.arch == "llama" and { "vocab", "seq_len", "dim", "heads", "kv_heads", "layers", "hidden" }
    or cfg.arch == "mixtral" and { "vocab", "seq_len", "dim", "heads", "kv_heads", "layers", "hidden", "experts", "top_k" }
    or { "vocab", "seq_len", "dim", "heads", "layers" }
  for _, k in ipairs(keys) do
    if math.tointeger(cfg[k]) == nil then
      error(("%s: the model config has no %s; the Hugging Face export writes pg.nn.GPT, pg.nn.Llama and pg.nn.Mixtral models")
        :format(what, k), 0)
    end
  end
  return a
end

--- The architecture ("gpt2" | "llama" | "mixtral") and pg.nn options of a directory;
-- refuses what pipegoose does not compute, naming the config field.
function M.read_config(dir)
  return M.options(read_json(dir .. "/config.json", dir), dir)
end

--- The same from a decoded config.json (`dir` names it in errors).
function M.options(cfg, dir)
  local model_type = cfg.model_type
  local arch = type(model_type) == "string" and ARCH[model_type]
  if not arch then
    fail(dir, "config.json: model_type is %s; pipegoose reads GPT2LMHeadModel (\"gpt2\"), LlamaForCausalLM (\"llama\") and MixtralForCausalLM (\"mixtral\")",
      tostring(value(model_type)))
  end
  local o = arch.options(dir, with_defaults(cfg, arch.defaults))
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


--- Loads a model directory's weights into the engine (each rank its shards).
function M.load_into(engine, dir)
  local o, model_type = M.read_config(dir)
  local arch = ARCH[model_type]
  local where = open_weights(dir)
  local have = {}
  for _, p in ipairs(engine:parameters()) do have[p.name] = true end
  for _, e in ipairs(arch.layout(o)) do
    if have[e.pg] then
      local pieces = {}
      for i, part in ipairs(e.parts) do
        local stored = (not e.top and where[arch.prefix .. part.hf]) and arch.prefix .. part.hf or part.hf
        local h = where[stored]
        if not h then fail(dir, "the weights have no tensor %s (nor %s%s)", part.hf, arch.prefix, part.hf) end
        local info = h.entries[stored]
        if info.dtype ~= "float32" and info.dtype ~= "bfloat16" then
          fail(dir, "%s is %s; pipegoose reads float32 or bfloat16 weights (save the model with torch_dtype=float32)",
            stored, info.dtype)
        end
        if shape_text(info.shape) ~= shape_text(part.shape) then
          fail(dir, "%s has shape %s; the config needs %s", stored, shape_text(info.shape), shape_text(part.shape))
        end
        local t = safetensors.read(h, stored)
        if info.dtype == "bfloat16" then t = core.ops.from_bf16(t) end -- exact: the masters are float32
        pieces[i] = e.conv1d and t:transpose(1, 2) or t
      end
      engine:load_param(e.pg, #pieces == 1 and pieces[1] or core.cat(pieces, 1))
    end
  end
end

local function config_json(arch, cfg, dtype)
  local c = arch.config(cfg)
  c.torch_dtype = dtype or c.torch_dtype
  local keys = {}
  for k in pairs(c) do keys[#keys + 1] = k end
  table.sort(keys)
  local lines = {}
  for _, k in ipairs(keys) do lines[#lines + 1] = ("  %s: %s"):format(cjson.encode(k), cjson.encode(c[k])) end
  return "{\n" .. table.concat(lines, ",\n") .. "\n}\n"
end

-- A full pipegoose parameter as transformers stores it, one tensor per part:
-- the vocabulary's padding rows dropped, Conv1D weights transposed, fused
-- tensors cut back into their parts.
local function to_hf(cfg, e, full)
  if e.pg == "embed.wte" or e.pg == "head.weight" then
    full = full:reshape{ full:numel() // cfg.dim, cfg.dim }:narrow(1, 1, cfg.vocab)
  end
  if e.conv1d then
    local s = e.parts[1].shape
    return { full:reshape{ s[2], s[1] }:transpose(1, 2) }
  end
  local out, row = {}, 1
  local cols = #e.parts[1].shape == 2 and e.parts[1].shape[2] or nil
  if cols then full = full:reshape{ full:numel() // cols, cols } end
  for i, part in ipairs(e.parts) do
    out[i] = (cols and full:narrow(1, row, part.shape[1]) or full):reshape(part.shape):clone()
    row = row + part.shape[1]
  end
  return out
end

local function file_name(arch, e, part) return e.top and part.hf or arch.prefix .. part.hf end

-- Writes config.json and model.safetensors (each atomically); `tensors(e)`
-- gives an entry's tensors as transformers stores them (one per part).
-- dtype: "float32" (default), or "bfloat16" (each value rounded to nearest
-- even; config.json's torch_dtype says which).
local function write_dir(arch, cfg, dir, tensors, dtype)
  local entries = {}
  for _, e in ipairs(arch.layout(cfg)) do
    local ts = tensors(e)
    for i, part in ipairs(e.parts) do
      local t = ts[i]
      if dtype == "bfloat16" then t = core.ops.to_bf16(t) end
      entries[#entries + 1] = { name = file_name(arch, e, part), tensor = t }
    end
  end
  local fs = require("pipegoose.checkpoint").fs
  fs.mkdir_p(dir)
  safetensors.write(dir .. "/model.safetensors", entries, { format = "pt" })
  fs.write_atomic(dir .. "/config.json", config_json(arch, cfg, dtype))
end

--- Writes the engine's model as a Hugging Face directory (collective; rank 0 writes).
function M.save_from(engine, dir)
  local cfg = engine.config or {}
  local arch = arch_of(cfg, "save_hf")
  local converted = {}
  for _, e in ipairs(arch.layout(cfg)) do
    -- one tensor crosses to rank 0: the parts concatenated (as pipegoose holds them), cut there
    local rows = 0
    for _, part in ipairs(e.parts) do rows = rows + part.shape[1] end
    local shape = #e.parts == 1 and e.parts[1].shape or { rows, e.parts[1].shape[2] }
    local full = engine:gather_to_root(e.pg, function(t)
      local parts = to_hf(cfg, e, t)
      return #parts == 1 and parts[1] or core.cat(parts, 1)
    end, shape)
    if full then converted[e.pg] = #e.parts == 1 and { full } or to_hf(cfg, e, full) end
  end
  if engine.ctx:rank() == 0 then write_dir(arch, cfg, dir, function(e) return converted[e.pg] end) end
  engine.ctx:barrier()
end

--- Writes a checkpoint's weights as a Hugging Face directory; `full(name)`
-- reads a parameter's full tensor from the checkpoint (checkpoint.lua).
function M.write_checkpoint(cfg, dir, full, what, dtype)
  local arch = arch_of(cfg, what)
  write_dir(arch, cfg, dir, function(e) return to_hf(cfg, e, full(e.pg)) end, dtype)
  return arch.class
end

return M
