--- The LLaMA family: pg.nn.LlamaBlock and pg.nn.Llama, LlamaForCausalLM's
-- Hugging Face mapping and the planner's shape. Mixtral
-- (lua/pipegoose/models/mixtral.lua) is this model with a mixture of experts
-- for each block's MLP and reuses this file's parts (F.decoder, F.hf.*).
-- The fields of a family are described in lua/pipegoose/models/init.lua.
local opt = require "pipegoose.options"
local common = require "pipegoose.models.common"

local F = { name = "llama", label = "Llama" }

local POS, NEED, NAME, HEAD, EPS, THETA = common.POS, common.NEED, common.NAME, common.HEAD, common.EPS, common.THETA
local value, positive_int, number, fail, entry = common.value, common.positive_int, common.number, common.fail, common.entry
local flag, name = common.flag, common.name

---------------------------------------------------------------- the builder

--- LLaMA: embed (no positions), blocks.0 .. blocks.L-1 (RMSNorm, grouped-query
-- attention with rotary embeddings, SwiGLU MLP, no biases), ln_f (RMSNorm),
-- head (untied unless tie = true). Options: vocab, dim, layers, heads,
-- kv_heads (default heads), hidden, seq_len, rope_theta (10000), eps (1e-5),
-- tie (false), padded_vocab, head_dim (dim / heads), rope_scaling (none;
-- transformers' table: {rope_type = "linear" | "dynamic" | "llama3", factor =,
-- ...}, models/common.lua's ROPE_TYPES). Init as transformers':
-- N(0, 0.02) for every matrix, norm weights 1.
F.schema = { vocab = NEED, padded_vocab = POS, seq_len = NEED, dim = NEED, heads = NEED, kv_heads = POS,
             head_dim = POS, layers = NEED, hidden = NEED, rope_theta = opt.number{ gt = 1, default = 10000 },
             rope_scaling = common.ROPE_SCALING,
             eps = EPS, tie = opt.boolean{ default = false }, arch = opt.enum{ F.name }, head = HEAD,
             hf_config = common.HF_CONFIG }

local nn -- pg.nn, given by F.install (nn.lua installs every family as it loads)

--- LLaMA and Mixtral: the same model but for the feed-forward of each block.
-- moe: the Mixtral family (its label, schema, block and config fields).
local function decoder(o, moe)
  local where = moe and moe.label or F.label
  o = opt.check(where, o, moe and moe.schema or F.schema)
  if moe then nn.parts.check_moe(where, o) end
  local kv, hd = common.attention(o, common.raiser(where, 2), nil, true)
  local theta = o.rope_theta
  local padded = nn.parts.padded_of(where, o)
  local eps, tie = o.eps, o.tie
  local model = nn.Sequential{ name = "" }
  model:add(nn.Embedding{ vocab = o.vocab, padded_vocab = padded, dim = o.dim, name = "embed" })
  for i = 0, o.layers - 1 do
    local b = { dim = o.dim, heads = o.heads, kv_heads = kv, head_dim = hd, hidden = o.hidden, seq_len = o.seq_len,
                rope_theta = theta, rope_scaling = o.rope_scaling, eps = eps, name = "blocks." .. i }
    if moe then
      for _, k in ipairs(moe.block_options) do b[k] = o[k] end
      model:add(moe.block(b))
    else
      model:add(nn.LlamaBlock(b))
    end
  end
  model:add(nn.RMSNorm{ dim = o.dim, eps = eps, name = "ln_f" })
  model.label = where
  model.config = { arch = moe and moe.name or F.name, vocab = o.vocab, padded_vocab = padded, seq_len = o.seq_len,
                   dim = o.dim, heads = o.heads, kv_heads = kv, head_dim = hd, layers = o.layers, hidden = o.hidden,
                   rope_theta = theta, rope_scaling = o.rope_scaling, eps = eps, tie = tie, hf_config = o.hf_config }
  if moe then
    for _, k in ipairs(moe.config_options) do model.config[k] = o[k] end
  end
  common.add_head(nn, model, o, padded, tie)
  return model
end
F.decoder = decoder

--- The pg.nn spec of options o (checked; errors name the caller's line).
function F.build(o)
  if not nn then require "pipegoose.nn" end
  return decoder(o)
end

--- Adds the family's constructors to pg.nn: LlamaBlock, Llama.
function F.install(pgnn)
  nn = pgnn

  --- Pre-RMSNorm LLaMA block: x + attn(ln1(x)), then x + mlp(ln2(x)).
  local LLAMA_BLOCK = { dim = NEED, heads = NEED, kv_heads = POS, head_dim = POS, seq_len = NEED, hidden = NEED,
                        rope_theta = THETA, rope_scaling = common.ROPE_SCALING, eps = EPS, name = NAME }

  function nn.LlamaBlock(o)
    o = opt.check("LlamaBlock", o, LLAMA_BLOCK)
    local s = nn.Sequential{
      nn.PreNorm(nn.RMSNorm{ dim = o.dim, eps = o.eps, name = "ln1" },
        nn.LlamaAttention{ dim = o.dim, heads = o.heads, kv_heads = o.kv_heads, head_dim = o.head_dim,
                           seq_len = o.seq_len, rope_theta = o.rope_theta, rope_scaling = o.rope_scaling,
                           name = "attn" }),
      nn.PreNorm(nn.RMSNorm{ dim = o.dim, eps = o.eps, name = "ln2" }, nn.SwiGLU{ dim = o.dim, hidden = o.hidden, name = "mlp" }),
      name = o.name,
    }
    s.label = "LlamaBlock"
    return s
  end

  nn.Llama = setmetatable({}, { __call = function(_, o) return decoder(o) end })
end

--- The integer fields a model config must have for the exports (hf.lua).
F.config_keys = { "vocab", "seq_len", "dim", "heads", "kv_heads", "layers", "hidden" }

---------------------------------------------------------------- Hugging Face: LlamaForCausalLM

-- q_proj, k_proj, v_proj are fused into pipegoose's q|k|v (rows in that
-- order: transformers keeps q and k in the layout its rotate_half RoPE
-- expects, and so does pipegoose's RoPE kernel: nothing is permuted) and
-- gate_proj, up_proj into its gate|up; export cuts them back apart.
F.hf = { class = "LlamaForCausalLM", model_type = "llama", prefix = "model." }
-- The buffer older LLaMA files hold and transformers drops on load (the rotary frequencies; hf.check_weights)
F.hf.ignored = { "rotary_emb%.inv_freq$" }

-- The fields that give the model's size, which the planner wants spelt out
-- (plan/models.lua: "... is missing"), in the order it asks for them.
F.hf.size_fields = { "num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                     "max_position_embeddings" }

-- LlamaConfig's defaults of the fields options() reads (num_key_value_heads:
-- num_attention_heads; head_dim: hidden_size / num_attention_heads; rope_scaling: none, read by options())
F.hf.defaults = {
  vocab_size = 32000, max_position_embeddings = 2048, hidden_size = 4096, intermediate_size = 11008,
  num_hidden_layers = 32, num_attention_heads = 32, hidden_act = "silu", rms_norm_eps = 1e-6,
  rope_theta = 10000, tie_word_embeddings = false, attention_bias = false, mlp_bias = false,
}

--- The pg.nn.Llama options of a LlamaForCausalLM config (absent fields
-- already read as their defaults); refuses what pipegoose's Llama does not compute.
function F.hf.options(dir, cfg)
  local act = name(dir, cfg, "hidden_act")
  if act ~= "silu" then fail(dir, "config.json: hidden_act %s is not supported (pipegoose's Llama uses silu)", tostring(act)) end
  for _, k in ipairs{ "attention_bias", "mlp_bias" } do
    if flag(dir, cfg, k) then fail(dir, "config.json: %s = true is not supported (pipegoose's Llama has no biases)", k) end
  end
  local o = F.hf.sizes(dir, cfg)
  if value(cfg.rope_scaling) ~= nil then
    local msg, rs = common.rope_scaling_problem(cfg.rope_scaling)
    if msg then fail(dir, "config.json: rope_scaling %s", msg) end
    o.rope_scaling = rs
  end
  return o
end

--- The sizes of a LLaMA-shaped config (Mixtral's too): the options but for
-- the refusals of F.hf.options. A null num_key_value_heads is
-- num_attention_heads (common.attention's rule), a null head_dim hidden_size /
-- num_attention_heads.
function F.hf.sizes(dir, cfg)
  local o = {
    vocab = positive_int(dir, cfg, "vocab_size"), seq_len = positive_int(dir, cfg, "max_position_embeddings"),
    dim = positive_int(dir, cfg, "hidden_size"), heads = positive_int(dir, cfg, "num_attention_heads"),
    layers = positive_int(dir, cfg, "num_hidden_layers"), hidden = positive_int(dir, cfg, "intermediate_size"),
    rope_theta = number(dir, cfg, "rope_theta"), eps = number(dir, cfg, "rms_norm_eps"),
    tie = flag(dir, cfg, "tie_word_embeddings"),
  }
  o.kv_heads = value(cfg.num_key_value_heads) and positive_int(dir, cfg, "num_key_value_heads") or nil
  if value(cfg.head_dim) ~= nil then o.head_dim = positive_int(dir, cfg, "head_dim") end
  -- pg.nn.Llama's own bounds, said with config.json's names
  if o.eps < 0 then fail(dir, "config.json: rms_norm_eps must be >= 0, got %s", common.show(o.eps)) end
  if o.rope_theta <= 1 then fail(dir, "config.json: rope_theta must be > 1, got %s", common.show(o.rope_theta)) end
  o.kv_heads = common.attention(o, function(msg) fail(dir, "config.json: %s", msg) end, common.HF_ATTENTION_NAMES)
  return o
end

function F.hf.layout(o)
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
  common.add_untied_head(out, o, V, C)
  return out
end

--- config.json's fields: those pipegoose computes (always written) and the
-- defaults of a model built in pipegoose (an imported file's values win).
function F.hf.config(cfg)
  local computed = {
    architectures = { F.hf.class }, model_type = F.hf.model_type, vocab_size = cfg.vocab,
    max_position_embeddings = cfg.seq_len, hidden_size = cfg.dim, intermediate_size = cfg.hidden,
    num_hidden_layers = cfg.layers, num_attention_heads = cfg.heads, num_key_value_heads = cfg.kv_heads,
    head_dim = cfg.head_dim, hidden_act = "silu", rms_norm_eps = cfg.eps, rope_theta = cfg.rope_theta,
    rope_scaling = cfg.rope_scaling or common.null, attention_bias = false, mlp_bias = false, tie_word_embeddings = cfg.tie == true,
  }
  local fresh = { attention_dropout = 0.0, initializer_range = common.INIT_STD, pretraining_tp = 1, use_cache = true }
  return computed, fresh
end

-- LlamaConfig's dropout fields and their defaults (transformers 4.45.2).
F.hf.dropout = { attention_dropout = 0.0 }

---------------------------------------------------------------- the planner's shape

-- RoPE, RMSNorm, SwiGLU MLP (three matrices), no biases, no dropout, untied
-- output head (Llama 2, Mistral; Mixtral adds experts).
F.plan = {
  features = { norm = "rmsnorm", gated_mlp = true, activation = "swiglu", learned_positions = false, rope = true,
               dropout = false, biases = false, tied = false },
}

--- The planner's sizes of pg.nn.Llama options (or a model config).
function F.plan.shape(o)
  return { arch = F.name, layers = o.layers, hidden = o.dim, heads = o.heads, kv_heads = o.kv_heads, ffn = o.hidden,
           vocab = o.padded_vocab or o.vocab, seq_len = o.seq_len, tied = o.tie == true }
end

-- Llama 2 (Touvron et al. 2023 and the released config.json).
F.plan.presets = {
  ["llama2-7b"] = { layers = 32, hidden = 4096, heads = 32, ffn = 11008, vocab = 32000, seq_len = 4096 },
  ["llama2-70b"] = { layers = 80, hidden = 8192, heads = 64, kv_heads = 8, ffn = 28672, vocab = 32000,
    seq_len = 4096 },
}

return F
