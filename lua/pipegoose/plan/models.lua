--- pipegoose.plan.models: transformer shapes, by name or from a config.json.
--
-- A shape is all the planner knows about a model:
--   { name, arch = "gpt"|"llama", layers, hidden, heads, kv_heads, ffn, vocab,
--     seq_len, experts = 1, top_k = 1 }
-- arch "gpt": learned positions, LayerNorm with biases, GeLU MLP, biased
-- linears, dropout, tied input/output embeddings (GPT-2, GPT-3, Megatron's
-- GPT). arch "llama": RoPE, RMSNorm, SwiGLU MLP (three matrices), no biases,
-- no dropout, untied output head (Llama 2, Mistral, Mixtral).
-- experts > 1 is a mixture of experts in the MLP: FLOPs count top_k experts
-- per token (the active parameters), memory counts all of them.
local cjson = require("cjson").new()

local M = {}

local function shape(t)
  t.kv_heads = t.kv_heads or t.heads
  t.experts = t.experts or 1
  t.top_k = t.top_k or 1
  return t
end
M.shape = shape

-- Published configurations: GPT-2 (Radford et al. 2019, the released
-- checkpoints' config.json), GPT-3 175B (Brown et al. 2020, Table 2.1; vocab
-- 51200 as Megatron-LM pads it), Llama 2 (Touvron et al. 2023 and the
-- released config.json), Mixtral 8x7B (Jiang et al. 2024 and its config.json;
-- its context is 32768, the default here is a 4096-token training length).
M.BUILTIN = {
  ["gpt2-124m"] = { arch = "gpt", layers = 12, hidden = 768, heads = 12, ffn = 3072, vocab = 50257, seq_len = 1024 },
  ["gpt2-1.5b"] = { arch = "gpt", layers = 48, hidden = 1600, heads = 25, ffn = 6400, vocab = 50257, seq_len = 1024 },
  ["gpt3-175b"] = { arch = "gpt", layers = 96, hidden = 12288, heads = 96, ffn = 49152, vocab = 51200, seq_len = 2048 },
  ["llama2-7b"] = { arch = "llama", layers = 32, hidden = 4096, heads = 32, ffn = 11008, vocab = 32000, seq_len = 4096 },
  ["llama2-70b"] = { arch = "llama", layers = 80, hidden = 8192, heads = 64, kv_heads = 8, ffn = 28672, vocab = 32000,
    seq_len = 4096 },
  ["mixtral-8x7b"] = { arch = "llama", layers = 32, hidden = 4096, heads = 32, kv_heads = 8, ffn = 14336, vocab = 32000,
    seq_len = 4096, experts = 8, top_k = 2 },
}
M.NAMES = {}
for name, s in pairs(M.BUILTIN) do
  s.name = name
  shape(s)
  M.NAMES[#M.NAMES + 1] = name
end
table.sort(M.NAMES)

local FIELDS = { "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len", "experts", "top_k" }

--- Checks a shape table; returns a copy with defaults filled.
function M.check(t)
  local s = {}
  for k, v in pairs(t) do s[k] = v end
  shape(s)
  s.name = s.name or "custom"
  if s.arch ~= "gpt" and s.arch ~= "llama" then
    error(("plan: model %s: arch must be \"gpt\" or \"llama\", got %s"):format(s.name, tostring(s.arch)), 0)
  end
  for _, k in ipairs(FIELDS) do
    if math.type(s[k]) ~= "integer" or s[k] < 1 then
      error(("plan: model %s: %s must be a positive integer, got %s"):format(s.name, k, tostring(s[k])), 0)
    end
  end
  if s.hidden % s.heads ~= 0 then error(("plan: model %s: hidden %d is not a multiple of heads %d"):format(s.name, s.hidden, s.heads), 0) end
  if s.heads % s.kv_heads ~= 0 then error(("plan: model %s: heads %d is not a multiple of kv_heads %d"):format(s.name, s.heads, s.kv_heads), 0) end
  if s.top_k > s.experts then error(("plan: model %s: top_k %d exceeds experts %d"):format(s.name, s.top_k, s.experts), 0) end
  return s
end

--- A shape by name or table.
function M.get(spec)
  if type(spec) == "table" then return M.check(spec) end
  local s = M.BUILTIN[spec]
  if not s then
    error(("plan: unknown model '%s' (known: %s, or --hf=config.json)"):format(tostring(spec), table.concat(M.NAMES, ", ")), 0)
  end
  return M.check(s)
end

---------------------------------------------------------------- config.json

local function need(cfg, path, ...)
  for _, k in ipairs{ ... } do
    local v = cfg[k]
    if v ~= nil and v ~= cjson.null then
      if math.type(v) == "float" and v == math.floor(v) then v = math.tointeger(v) end
      return v
    end
  end
  error(("plan: %s: %s is missing"):format(path, table.concat({ ... }, " or ")), 0)
end

local function opt_field(cfg, k)
  local v = cfg[k]
  if v == nil or v == cjson.null then return nil end
  if math.type(v) == "float" and v == math.floor(v) then v = math.tointeger(v) end
  return v
end

--- A shape from a decoded transformers config.json.
function M.from_hf(cfg, path)
  path = path or "config.json"
  local mt = cfg.model_type
  local s
  if mt == "gpt2" then
    local h = need(cfg, path, "n_embd")
    s = { arch = "gpt", layers = need(cfg, path, "n_layer"), hidden = h, heads = need(cfg, path, "n_head"),
      ffn = opt_field(cfg, "n_inner") or 4 * h, vocab = need(cfg, path, "vocab_size"),
      seq_len = need(cfg, path, "n_positions", "n_ctx") }
  elseif mt == "llama" or mt == "mistral" or mt == "mixtral" then
    s = { arch = "llama", layers = need(cfg, path, "num_hidden_layers"), hidden = need(cfg, path, "hidden_size"),
      heads = need(cfg, path, "num_attention_heads"), kv_heads = opt_field(cfg, "num_key_value_heads"),
      ffn = need(cfg, path, "intermediate_size"), vocab = need(cfg, path, "vocab_size"),
      seq_len = need(cfg, path, "max_position_embeddings") }
    if mt == "mixtral" then
      s.experts = need(cfg, path, "num_local_experts")
      s.top_k = need(cfg, path, "num_experts_per_tok")
    end
  else
    error(("plan: %s: model_type %s is not one the planner knows (gpt2, llama, mistral, mixtral)"):format(
      path, cjson.encode(mt)), 0)
  end
  s.name = cfg._name_or_path and cfg._name_or_path ~= cjson.null and tostring(cfg._name_or_path) or path
  return M.check(s)
end

function M.load_hf(path)
  local f, err = io.open(path, "r")
  if not f then error(("plan: cannot read %s (%s)"):format(path, err), 0) end
  local text = f:read("a")
  f:close()
  local ok, v = pcall(cjson.decode, text)
  if not ok or type(v) ~= "table" then error(("plan: %s is not a JSON object"):format(path), 0) end
  return M.from_hf(v, path)
end

---------------------------------------------------------------- counts
--
-- Parameter counts, per part of the model. Tensor parallelism (Megatron's
-- column/row split) divides the matrices and the vocabulary by T; norms and
-- row-parallel biases stay whole on every rank, which the `replicated` parts
-- below keep apart.

local function head_dim(s) return s.hidden // s.heads end
local function kv_dim(s) return s.kv_heads * head_dim(s) end
M.head_dim, M.kv_dim = head_dim, kv_dim

--- Matrices of one layer (all experts): { attn = , mlp = , mlp_active = , router = }.
function M.layer_matrices(s)
  local h = s.hidden
  local attn = h * h + 2 * h * kv_dim(s) + h * h -- q, k, v, o
  local per_expert = (s.arch == "llama" and 3 or 2) * h * s.ffn
  return { attn = attn, mlp = s.experts * per_expert, mlp_active = s.top_k * per_expert,
    router = s.experts > 1 and h * s.experts or 0 }
end

--- Parameters of one layer: split (divided by T) and replicated.
function M.layer_params(s)
  local h = s.hidden
  local m = M.layer_matrices(s)
  local split = m.attn + m.mlp
  local replicated = m.router
  if s.arch == "gpt" then
    split = split + (h + 2 * kv_dim(s)) + s.ffn -- column-parallel biases (qkv, fc1)
    replicated = replicated + 2 * h + 4 * h -- row-parallel biases (o, fc2), two LayerNorms (weight, bias)
  else
    replicated = replicated + 2 * h -- two RMSNorms
  end
  return { split = split, replicated = replicated }
end

--- Embedding (first stage) and output head (last stage) parameters.
function M.edge_params(s)
  local h = s.hidden
  local embed = { split = s.vocab * h, replicated = s.arch == "gpt" and s.seq_len * h or 0 }
  local head
  if s.arch == "gpt" then
    -- tied: the last stage keeps its own copy of the word embedding when P > 1
    -- (Megatron and pipegoose both do, and all-reduce its gradient)
    head = { split = s.vocab * h, replicated = 2 * h, tied = true }
  else
    head = { split = s.vocab * h, replicated = h }
  end
  return embed, head
end

--- Total parameters (one copy of a tied embedding).
function M.num_params(s)
  local lp = M.layer_params(s)
  local e, hd = M.edge_params(s)
  local n = s.layers * (lp.split + lp.replicated) + e.split + e.replicated + hd.replicated
  if not hd.tied then n = n + hd.split end
  return n
end

--- Forward FLOPs per token of one layer (matrix products only, active
-- experts, attention scores and values over the full s x s square, as
-- Megatron-LM's formula counts them).
function M.layer_gemm_flops(s, seq)
  local m = M.layer_matrices(s)
  return 2 * (m.attn + m.mlp_active + m.router) + 4 * seq * s.hidden
end

--- Forward FLOPs per token of the output head (logits).
function M.head_flops(s) return 2 * s.hidden * s.vocab end

--- Model FLOPs of one training step (forward + backward = 3 x forward) for
-- `tokens` tokens, plus the forward FLOPs recomputation repeats.
function M.step_flops(s, seq, tokens, recompute)
  -- floats: a trillion-parameter step overflows 64-bit integers
  tokens = tokens + 0.0
  local layer = M.layer_gemm_flops(s, seq) + 0.0
  local f = s.layers * layer + M.head_flops(s)
  local re = 0
  if recompute == "full" then re = s.layers * layer
  elseif recompute == "selective" then re = s.layers * 4 * seq * s.hidden end
  return 3 * f * tokens, (3 * f + re) * tokens
end

return M
