--- pipegoose.plan.models: transformer shapes, by name or from a config.json.
--
-- A shape is all the planner knows about a model:
--   { name, arch, layers, hidden, heads, kv_heads, ffn, vocab, seq_len,
--     experts = 1, top_k = 1, and the family's features: norm =
--     "layernorm"|"rmsnorm", gated_mlp (three matrices: SwiGLU), activation
--     (the elementwise kernel: "gelu"|"swiglu"), learned_positions, rope,
--     dropout, biases, tied (the output head shares the embedding),
--     embed_norm (a norm right after the embedding: BLOOM) }
-- arch names a model family (lua/pipegoose/models/, or an alias of one:
-- GPT-2's is gpt); the features a shape leaves out are its family's
-- (models/<family>.lua's plan.features), and the counts below read the
-- features, never the family's name. experts > 1 is a mixture of experts in
-- the MLP: FLOPs count top_k experts per token (the active parameters),
-- memory counts all of them.
local cjson = require("cjson").new()
local families = require "pipegoose.models"
local common = require "pipegoose.models.common"

local M = {}

local FIELDS = { "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len", "experts", "top_k" }

--- Checks a shape table; returns a copy with defaults filled (the family's features).
function M.check(t)
  local s = {}
  for k, v in pairs(t) do s[k] = v end
  s.name = s.name or "custom"
  local family = families.get(s.arch, ("plan: model %s: arch"):format(s.name))
  for k, v in pairs(family.plan.features) do
    if s[k] == nil then s[k] = v end
  end
  s.experts = s.experts or 1
  s.top_k = s.top_k or 1
  for _, k in ipairs(FIELDS) do
    local v = s[k]
    if (v ~= nil or k ~= "kv_heads") and (math.type(v) ~= "integer" or v < 1) then
      error(("plan: model %s: %s must be a positive integer, got %s"):format(s.name, k, tostring(v)), 0)
    end
  end
  -- kv_heads: heads when not given
  s.kv_heads = common.attention({ dim = s.hidden, heads = s.heads, kv_heads = s.kv_heads },
    common.raiser("plan: model " .. s.name), { dim = "hidden" }, s.rope)
  if s.top_k > s.experts then error(("plan: model %s: top_k %d exceeds experts %d"):format(s.name, s.top_k, s.experts), 0) end
  return s
end

-- The published configurations: each family's presets (models/<family>.lua's plan.presets).
M.BUILTIN = {}
M.NAMES = {}
for _, family in ipairs(families.list()) do
  for name, sizes in pairs(family.plan.presets or {}) do
    local s = common.copy(sizes)
    s.name, s.arch = name, family.name
    M.BUILTIN[name] = M.check(s)
    M.NAMES[#M.NAMES + 1] = name
  end
end
table.sort(M.NAMES)

--- A shape by name or table.
function M.get(spec)
  if type(spec) == "table" then return M.check(spec) end
  local s = M.BUILTIN[spec]
  if not s then
    error(("plan: unknown model '%s' (known: %s, or --hf=config.json)"):format(tostring(spec), table.concat(M.NAMES, ", ")), 0)
  end
  return M.check(s)
end

--- The shape of a pg.nn model config (an engine's `config`, pg.nn options with arch).
function M.of_config(cfg)
  local family = families.of_config(cfg, "plan")
  return M.check(family.plan.shape(cfg))
end

---------------------------------------------------------------- config.json

--- A shape from a decoded transformers config.json: read by its family's
-- reader (the importer's, lua/pipegoose/models/<family>.lua's hf.options,
-- with transformers' defaults for absent fields), except that the planner
-- wants the sizes spelt out: a config without one of the family's
-- hf.defaults fields that are sizes is refused ("... is missing").
function M.from_hf(cfg, path)
  path = path or "config.json"
  local mt = cfg.model_type
  local family = families.of_hf_model_type(mt)
  if not family then
    local names = {}
    for i, f in ipairs(families.list()) do names[i] = f.hf.model_type end
    error(("plan: %s: model_type %s is not one the planner knows (%s)"):format(
      path, cjson.encode(mt), table.concat(names, ", ")), 0)
  end
  local where = "plan: " .. path
  -- the sizes: the integer fields of the family's defaults, which the planner needs given
  for _, k in ipairs(family.hf.size_fields) do
    local v = cfg[k]
    if v == nil or v == cjson.null then error(("%s: %s is missing"):format(where, k), 0) end
  end
  local hf = require "pipegoose.hf"
  local ok, o = pcall(family.hf.options, where, hf.with_defaults(cfg, family.hf.defaults))
  if not ok then error(o, 0) end
  local s = family.plan.shape(o)
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

--- Parameters of one norm of width h (LayerNorm: weight and bias; RMSNorm: weight).
function M.norm_params(s, h) return s.norm == "layernorm" and 2 * h or h end

--- Statistics a norm keeps per row for its backward (LayerNorm: mean and 1/std; RMSNorm: 1/rms).
function M.norm_stats(s) return s.norm == "layernorm" and 2 or 1 end

--- Matrices of one layer (all experts): { attn = , mlp = , mlp_active = , router = }.
function M.layer_matrices(s)
  local h = s.hidden
  local attn = h * h + 2 * h * kv_dim(s) + h * h -- q, k, v, o
  local per_expert = (s.gated_mlp and 3 or 2) * h * s.ffn -- gate, up, down or fc, proj
  return { attn = attn, mlp = s.experts * per_expert, mlp_active = s.top_k * per_expert,
    router = s.experts > 1 and h * s.experts or 0 }
end

--- Parameters of one layer: split (divided by T) and replicated.
function M.layer_params(s)
  local h = s.hidden
  local m = M.layer_matrices(s)
  local split = m.attn + m.mlp
  local replicated = m.router
  if s.biases then
    split = split + (h + 2 * kv_dim(s)) + (s.gated_mlp and 2 or 1) * s.ffn -- column-parallel biases (qkv, fc1)
    replicated = replicated + 2 * h -- row-parallel biases (o, fc2)
  end
  replicated = replicated + 2 * M.norm_params(s, h) -- two norms
  return { split = split, replicated = replicated }
end

--- Embedding (first stage) and output head (last stage) parameters.
function M.edge_params(s)
  local h = s.hidden
  -- the position table (learned positions) and the embedding's own norm (embed_norm: BLOOM's)
  local embed = { split = s.vocab * h, replicated = (s.learned_positions and s.seq_len * h or 0)
                    + (s.embed_norm and M.norm_params(s, h) or 0) }
  -- the final norm, and the head's matrix; tied: the last stage keeps its own
  -- copy of the word embedding when P > 1 (Megatron and pipegoose both do, and
  -- all-reduce its gradient)
  local head = { split = s.vocab * h, replicated = M.norm_params(s, h), tied = s.tied or nil }
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
-- (every: under full recomputation, only every k-th layer is recomputed.)
function M.step_flops(s, seq, tokens, recompute, every)
  -- floats: a trillion-parameter step overflows 64-bit integers
  tokens = tokens + 0.0
  local layer = M.layer_gemm_flops(s, seq) + 0.0
  local f = s.layers * layer + M.head_flops(s)
  local re = 0
  if recompute == "full" then re = s.layers // (every or 1) * layer
  elseif recompute == "selective" then re = s.layers * 4 * seq * s.hidden end
  return 3 * f * tokens, (3 * f + re) * tokens
end

return M
