--- The Mixtral family: LLaMA (lua/pipegoose/models/llama.lua, whose parts it
-- reuses) with every block's MLP a sparse mixture of experts:
-- pg.nn.MixtralBlock and pg.nn.Mixtral, MixtralForCausalLM's Hugging Face
-- mapping and the planner's shape.
-- The fields of a family are described in lua/pipegoose/models/init.lua.
local opt = require "pipegoose.options"
local common = require "pipegoose.models.common"
local llama = require "pipegoose.models.llama"

local F = { name = "mixtral", label = "Mixtral" }

local POS, NEED, NAME, EPS, THETA = common.POS, common.NEED, common.NAME, common.EPS, common.THETA
local value, positive_int, number, fail, entry = common.value, common.positive_int, common.number, common.fail, common.entry
local flag = common.flag

---------------------------------------------------------------- the builder

-- The MoE's options a Mixtral passes to its blocks, and those its config records.
F.block_options = { "experts", "top_k", "aux_loss_coef", "z_loss_coef", "capacity_factor", "jitter" }
F.config_options = { "experts", "top_k", "aux_loss_coef", "z_loss_coef" }

local nn -- pg.nn, given by F.install (nn.lua installs every family as it loads)

--- The pg.nn spec of options o (checked; errors name the caller's line).
function F.build(o)
  if not nn then require "pipegoose.nn" end
  return llama.decoder(o, F)
end

--- Adds the family's constructors to pg.nn: MixtralBlock, Mixtral. The
-- option schemas take the MoE's from pg.nn.MoE's (nn.parts.MOE).
function F.install(pgnn)
  nn = pgnn
  local MOE = nn.parts.MOE

  -- Mixtral: LLaMA's options and the MoE's (hidden is each expert's).
  F.schema = common.copy(llama.schema)
  F.schema.arch = opt.enum{ F.name }
  F.schema.rope_scaling = nil -- MixtralForCausalLM's rotary embeddings are plain (transformers 4.45.2)
  for _, k in ipairs(F.block_options) do F.schema[k] = MOE[k] end

  --- Mixtral's block: LLaMA's attention, then the sparse MoE feed-forward:
  -- x + attn(ln1(x)), then x + moe(ln2(x)).
  local MIXTRAL_BLOCK = { dim = NEED, heads = NEED, kv_heads = POS, head_dim = POS, seq_len = NEED, hidden = NEED,
                          rope_theta = THETA, eps = EPS, name = NAME }
  for _, k in ipairs(F.block_options) do MIXTRAL_BLOCK[k] = MOE[k] end
  MIXTRAL_BLOCK.experts = NEED

  function nn.MixtralBlock(o)
    o = opt.check("MixtralBlock", o, MIXTRAL_BLOCK)
    local s = nn.Sequential{
      nn.PreNorm(nn.RMSNorm{ dim = o.dim, eps = o.eps, name = "ln1" },
        nn.LlamaAttention{ dim = o.dim, heads = o.heads, kv_heads = o.kv_heads, head_dim = o.head_dim,
                           seq_len = o.seq_len, rope_theta = o.rope_theta, name = "attn" }),
      nn.PreNorm(nn.RMSNorm{ dim = o.dim, eps = o.eps, name = "ln2" },
        nn.MoE{ dim = o.dim, hidden = o.hidden, experts = o.experts, top_k = o.top_k, aux_loss_coef = o.aux_loss_coef,
                z_loss_coef = o.z_loss_coef, capacity_factor = o.capacity_factor, jitter = o.jitter, name = "moe" }),
      name = o.name,
    }
    s.label = "MixtralBlock"
    return s
  end
  F.block = nn.MixtralBlock

  --- Mixtral: LLaMA with every block's MLP a sparse mixture of experts
  -- (nn.MixtralBlock): blocks.<i>.moe.gate.weight, blocks.<i>.moe.experts.<e>.w1|w2|w3.weight.
  -- Options: LLaMA's (hidden is each expert's width), and experts, top_k (2),
  -- aux_loss_coef (0.001), z_loss_coef (0), capacity_factor, jitter, as nn.MoE's.
  nn.Mixtral = setmetatable({}, { __call = function(_, o) return llama.decoder(o, F) end })
end

--- The integer fields a model config must have for the exports (hf.lua).
F.config_keys = { "vocab", "seq_len", "dim", "heads", "kv_heads", "layers", "hidden", "experts", "top_k" }

---------------------------------------------------------------- Hugging Face: MixtralForCausalLM

-- LLaMA's attention, norms and embeddings, and a sparse mixture of experts
-- for each block's MLP (block_sparse_moe.gate, block_sparse_moe.experts.<e>.w1|w2|w3).
F.hf = { class = "MixtralForCausalLM", model_type = "mixtral", prefix = "model." }
F.hf.ignored = { "rotary_emb%.inv_freq$" } -- as LLaMA's (hf.check_weights)

-- The sizes the planner wants spelt out: LLaMA's and the experts'.
F.hf.size_fields = { table.unpack(llama.hf.size_fields) }
F.hf.size_fields[#F.hf.size_fields + 1] = "num_local_experts"
F.hf.size_fields[#F.hf.size_fields + 1] = "num_experts_per_tok"

-- MixtralConfig's defaults: LLaMA's fields with Mixtral's values, and the
-- experts'. An absent num_key_value_heads is 8 (null: num_attention_heads);
-- MixtralConfig has no attention_bias, mlp_bias, rope_scaling nor head_dim
-- (hidden_size / num_attention_heads), nor a sliding_window by default.
F.hf.defaults = {
  vocab_size = 32000, max_position_embeddings = 4096 * 32, hidden_size = 4096, intermediate_size = 14336,
  num_hidden_layers = 32, num_attention_heads = 32, num_key_value_heads = 8, hidden_act = "silu",
  rms_norm_eps = 1e-5, rope_theta = 1e6, tie_word_embeddings = false,
  num_local_experts = 8, num_experts_per_tok = 2, router_jitter_noise = 0,
  output_router_logits = false, router_aux_loss_coef = 0.001,
}

--- The pg.nn.Mixtral options of a MixtralForCausalLM config. transformers adds
-- the load-balancing loss to the training loss only when output_router_logits
-- is true: aux_loss_coef is router_aux_loss_coef then, else 0.
function F.hf.options(dir, cfg)
  if value(cfg.rope_scaling) ~= nil then -- transformers' Mixtral ignores it: its rotary embeddings are plain
    fail(dir, "config.json: rope_scaling is not supported for MixtralForCausalLM (transformers applies plain rotary "
      .. "embeddings to it)")
  end
  local o = llama.hf.options(dir, cfg)
  local window = value(cfg.sliding_window) ~= nil and positive_int(dir, cfg, "sliding_window") or nil
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
  o.aux_loss_coef = flag(dir, cfg, "output_router_logits") and number(dir, cfg, "router_aux_loss_coef") or 0
  return o
end

function F.hf.layout(o)
  local out = {}
  for _, e in ipairs(llama.hf.layout(o)) do
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

--- config.json's fields (LLaMA's but for the experts'): those pipegoose
-- computes and the defaults of a model built in pipegoose.
function F.hf.config(cfg)
  local c, fresh = llama.hf.config(cfg)
  c.architectures, c.model_type = { F.hf.class }, F.hf.model_type
  c.head_dim, c.mlp_bias, c.attention_bias = nil, nil, nil
  -- transformers' MixtralAttention (4.45.2) takes hidden_size / num_attention_heads, whatever config.json says
  if cfg.head_dim ~= nil and cfg.head_dim * cfg.heads ~= cfg.dim then
    error(("save_hf: the Mixtral's head_dim %d is not hidden_size / heads = %d / %d, which transformers' "
      .. "MixtralForCausalLM uses"):format(cfg.head_dim, cfg.dim, cfg.heads), 0)
  end
  fresh.pretraining_tp = nil
  c.num_local_experts, c.num_experts_per_tok = cfg.experts, cfg.top_k
  -- the load-balancing loss: transformers computes it when output_router_logits is set (and adds
  -- router_aux_loss_coef x it). A model without it (coefficient 0) says so with output_router_logits
  -- false and keeps an imported router_aux_loss_coef (transformers does not use it then)
  local coef = cfg.aux_loss_coef or 0.001
  c.output_router_logits = coef > 0
  if coef > 0 then c.router_aux_loss_coef = coef else fresh.router_aux_loss_coef = coef end
  c.router_jitter_noise = 0.0
  c.sliding_window = common.null
  return c, fresh
end

F.hf.dropout = { attention_dropout = 0.0 } -- MixtralConfig's

---------------------------------------------------------------- the planner's shape

-- LLaMA's features; experts > 1 is a mixture of experts in the MLP (the
-- planner counts top_k experts' FLOPs per token, all experts' memory).
F.plan = { features = llama.plan.features }

--- The planner's sizes of pg.nn.Mixtral options (or a model config).
function F.plan.shape(o)
  local s = llama.plan.shape(o)
  if not nn then require "pipegoose.nn" end
  s.arch, s.experts, s.top_k = F.name, o.experts, o.top_k or nn.parts.MOE.top_k.default -- pg.nn.MoE's default
  return s
end

-- Mixtral 8x7B (Jiang et al. 2024 and its config.json; its context is
-- 32768, the default here is a 4096-token training length).
F.plan.presets = {
  ["mixtral-8x7b"] = { layers = 32, hidden = 4096, heads = 32, kv_heads = 8, ffn = 14336, vocab = 32000,
    seq_len = 4096, experts = 8, top_k = 2 },
}

return F
