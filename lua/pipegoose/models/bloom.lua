--- The BLOOM family: pg.nn.BloomBlock and pg.nn.Bloom, BloomForCausalLM's
-- Hugging Face mapping and the planner's shape.
-- The fields of a family are described in lua/pipegoose/models/init.lua.
--
-- BLOOM (BigScience 2022) is GPT-2's pre-LayerNorm decoder with three
-- changes: no position table (ALiBi: a per-head linear bias on the attention
-- scores, nn.Attention{alibi = true}), a LayerNorm right after the word
-- embedding, and its fused query_key_value stored per head (rows q_h, k_h,
-- v_h for each head h in turn), where pipegoose's qkv is [q heads | k heads |
-- v heads] (the permutation hook below reorders it both ways).
local opt = require "pipegoose.options"
local common = require "pipegoose.models.common"

local F = { name = "bloom", label = "Bloom" }

local POS, NEED, NAME, HEAD = common.POS, common.NEED, common.NAME, common.HEAD
local value, positive_int, number, fail, entry = common.value, common.positive_int, common.number, common.fail, common.entry
local flag = common.flag

---------------------------------------------------------------- the builder

-- BLOOM's context length: config.json does not bound it (there is no
-- position table), pipegoose's seq_len only sizes the attention buffers.
-- 2048 is what BLOOM was trained with; a config.json seq_length says otherwise.
F.SEQ_LEN = 2048

--- Bloom: embed (no positions), embed_ln, blocks.0 .. blocks.L-1 (LayerNorm,
-- attention with ALiBi and biases, GELU MLP), ln_f, head (tied unless
-- tie = false). Options: vocab, dim, heads, layers, seq_len, hidden (4 x dim),
-- tie (true), padded_vocab, head. Init as transformers': N(0, 0.02) for every
-- matrix (residual projections included: BLOOM does not scale them), LayerNorm
-- 1/0, biases 0.
F.schema = { vocab = NEED, padded_vocab = POS, seq_len = NEED, dim = NEED, heads = NEED, layers = NEED, hidden = POS,
             tie = opt.boolean{ default = true }, arch = opt.enum{ F.name }, head = HEAD, hf_config = common.HF_CONFIG }

local nn -- pg.nn, given by F.install (nn.lua installs every family as it loads)

local function build(o)
  o = opt.check(F.label, o, F.schema)
  common.attention(o, common.raiser(F.label, 2))
  local padded = nn.parts.padded_of(F.label, o)
  local hidden = o.hidden or 4 * o.dim
  local model = nn.Sequential{ name = "" }
  model:add(nn.Embedding{ vocab = o.vocab, padded_vocab = padded, dim = o.dim, name = "embed" })
  model:add(nn.LayerNorm(o.dim, { name = "embed_ln" }))
  for i = 0, o.layers - 1 do
    model:add(nn.BloomBlock{ dim = o.dim, heads = o.heads, seq_len = o.seq_len, hidden = hidden, name = "blocks." .. i })
  end
  model:add(nn.LayerNorm(o.dim, { name = "ln_f" }))
  model.label = F.label
  model.config = { arch = F.name, vocab = o.vocab, padded_vocab = padded, seq_len = o.seq_len, dim = o.dim,
                   heads = o.heads, layers = o.layers, hidden = hidden, tie = o.tie, hf_config = o.hf_config }
  common.add_head(nn, model, o, padded, o.tie)
  return model
end

--- The pg.nn spec of options o (checked; errors name the caller's line).
function F.build(o)
  if not nn then require "pipegoose.nn" end
  return build(o)
end

--- Adds pg.nn.BloomBlock and pg.nn.Bloom.
function F.install(pgnn)
  nn = pgnn

  --- BLOOM's block: x + attn(ln1(x)) with ALiBi, then x + mlp(ln2(x)).
  function nn.BloomBlock(o)
    o = opt.check("BloomBlock", o, { dim = NEED, heads = NEED, seq_len = NEED, hidden = POS, name = NAME })
    local s = nn.Sequential{
      nn.PreNorm(nn.LayerNorm(o.dim, { name = "ln1" }),
        nn.CausalSelfAttention{ dim = o.dim, heads = o.heads, seq_len = o.seq_len, alibi = true, name = "attn" }),
      nn.PreNorm(nn.LayerNorm(o.dim, { name = "ln2" }), nn.MLP{ dim = o.dim, hidden = o.hidden, name = "mlp" }),
      name = o.name,
    }
    s.label = "BloomBlock"
    return s
  end

  nn.Bloom = setmetatable({}, { __call = function(_, o) return build(o) end })
end

--- The integer fields a model config must have for the exports (hf.lua).
F.config_keys = { "vocab", "seq_len", "dim", "heads", "layers" }

---------------------------------------------------------------- Hugging Face: BloomForCausalLM

-- Names carry the "transformer." prefix or not (bigscience's own files have
-- none); linear layers are nn.Linear ([out, in], as pipegoose's); the tied
-- lm_head is not stored.
F.hf = { class = "BloomForCausalLM", model_type = "bloom", prefix = "transformer." }

-- The fields that give the model's size, which the planner wants spelt out.
F.hf.size_fields = { "n_layer", "n_head", "vocab_size" }

-- BloomConfig's defaults (transformers 4.45.2) of the fields options() reads;
-- tie_word_embeddings is PretrainedConfig's.
F.hf.defaults = {
  vocab_size = 250880, hidden_size = 64, n_layer = 2, n_head = 8, layer_norm_epsilon = 1e-5,
  apply_residual_connection_post_layernorm = false, tie_word_embeddings = true,
}

-- BloomConfig's other spellings: n_embed (bigscience's files) for hidden_size,
-- and the attribute_map's num_hidden_layers / num_attention_heads, which win
-- over n_layer / n_head when both are given (transformers sets them last).
local function field(cfg, names)
  local found
  for _, k in ipairs(names) do
    local v = value(cfg[k]) -- every spelling read (spec/unit/hf_defaults_spec.lua counts the reads)
    if found == nil and v ~= nil then found = k end
  end
  return found or names[#names]
end

--- The pg.nn.Bloom options of a BloomForCausalLM config (absent fields read
-- as their defaults); refuses what pipegoose's Bloom does not compute.
function F.hf.options(dir, cfg)
  if flag(dir, cfg, "apply_residual_connection_post_layernorm") then
    fail(dir, "config.json: apply_residual_connection_post_layernorm = true is not supported "
      .. "(pipegoose's Bloom adds the block's input, not its normalised input)")
  end
  local eps = number(dir, cfg, "layer_norm_epsilon")
  if math.abs(eps - common.LAYERNORM_EPS) > 1e-12 then
    fail(dir, "config.json: layer_norm_epsilon %g is not supported (pipegoose's LayerNorm uses 1e-5)", eps)
  end
  local o = {
    vocab = positive_int(dir, cfg, "vocab_size"),
    dim = positive_int(dir, cfg, field(cfg, { "n_embed", "hidden_size" })),
    heads = positive_int(dir, cfg, field(cfg, { "num_attention_heads", "n_head" })),
    layers = positive_int(dir, cfg, field(cfg, { "num_hidden_layers", "n_layer" })),
    tie = flag(dir, cfg, "tie_word_embeddings"),
  }
  o.seq_len = value(cfg.seq_length) ~= nil and positive_int(dir, cfg, "seq_length") or F.SEQ_LEN
  o.hidden = 4 * o.dim
  if o.dim % o.heads ~= 0 then
    fail(dir, "config.json: hidden_size %d is not divisible by n_head %d", o.dim, o.heads)
  end
  return o
end

-- query_key_value's rows: BLOOM's per head (q_h, k_h, v_h), pipegoose's per
-- part ([q_0 .. q_H-1 | k_0 .. | v_0 ..]); the same moves for the weight
-- [3C, C] and the bias [3C].
local function regroup(t, heads, hd, to_pg)
  local pieces = {}
  for i = 0, 3 * heads - 1 do -- the result's i-th block of hd rows
    local from
    if to_pg then from = 3 * (i % heads) + i // heads -- part i // heads of head i % heads
    else from = (i % 3) * heads + i // 3 end           -- head i // 3's part i % 3
    pieces[#pieces + 1] = t:narrow(1, from * hd + 1, hd)
  end
  return require("pipegoose.core").cat(pieces, 1)
end

local QKV = {
  to_pg = function(t, o) return regroup(t, o.heads, o.dim // o.heads, true) end,
  to_hf = function(t, o) return regroup(t, o.heads, o.dim // o.heads, false) end,
}

function F.hf.layout(o)
  local V, C, H = o.vocab, o.dim, o.hidden or 4 * o.dim
  local function p(pg, hf, shape, permute) return entry(pg, { { hf, shape } }, nil, permute) end
  local out = {
    p("embed.wte", "word_embeddings.weight", { V, C }),
    p("embed_ln.weight", "word_embeddings_layernorm.weight", { C }),
    p("embed_ln.bias", "word_embeddings_layernorm.bias", { C }),
  }
  for l = 0, o.layers - 1 do
    local b, h = "blocks." .. l .. ".", "h." .. l .. "."
    common.add_layer(out, b, h, {
      p("ln1.weight", "input_layernorm.weight", { C }), p("ln1.bias", "input_layernorm.bias", { C }),
      p("attn.qkv.weight", "self_attention.query_key_value.weight", { 3 * C, C }, QKV),
      p("attn.qkv.bias", "self_attention.query_key_value.bias", { 3 * C }, QKV),
      p("attn.proj.weight", "self_attention.dense.weight", { C, C }), p("attn.proj.bias", "self_attention.dense.bias", { C }),
      p("ln2.weight", "post_attention_layernorm.weight", { C }), p("ln2.bias", "post_attention_layernorm.bias", { C }),
      p("mlp.fc.weight", "mlp.dense_h_to_4h.weight", { H, C }), p("mlp.fc.bias", "mlp.dense_h_to_4h.bias", { H }),
      p("mlp.proj.weight", "mlp.dense_4h_to_h.weight", { C, H }), p("mlp.proj.bias", "mlp.dense_4h_to_h.bias", { C }),
    })
  end
  out[#out + 1] = p("ln_f.weight", "ln_f.weight", { C })
  out[#out + 1] = p("ln_f.bias", "ln_f.bias", { C })
  common.add_untied_head(out, o, V, C)
  return out
end

--- config.json's fields: those pipegoose computes (seq_length, not a
-- BloomConfig field, kept as an attribute, gives the length back to
-- pipegoose) and the defaults of a model built in pipegoose (an imported file's values win).
function F.hf.config(cfg)
  local computed = {
    architectures = { F.hf.class }, model_type = F.hf.model_type, vocab_size = cfg.vocab, hidden_size = cfg.dim,
    n_layer = cfg.layers, n_head = cfg.heads, layer_norm_epsilon = common.LAYERNORM_EPS,
    apply_residual_connection_post_layernorm = false, tie_word_embeddings = cfg.tie ~= false, seq_length = cfg.seq_len,
  }
  local fresh = { initializer_range = common.INIT_STD, hidden_dropout = 0.0, attention_dropout = 0.0,
                  pretraining_tp = 1, slow_but_exact = false, use_cache = true }
  return computed, fresh
end

-- BloomConfig's dropout fields and their defaults (transformers 4.45.2).
F.hf.dropout = { hidden_dropout = 0.0, attention_dropout = 0.0 }

---------------------------------------------------------------- the planner's shape

-- No position table (ALiBi), a LayerNorm after the embedding, LayerNorm with
-- biases, GeLU MLP, biased linears, no dropout (BLOOM's are 0), tied embeddings.
F.plan = {
  features = { norm = "layernorm", gated_mlp = false, activation = "gelu", learned_positions = false, rope = false,
               dropout = false, biases = true, tied = true, embed_norm = true },
}

--- The planner's sizes of pg.nn.Bloom options (or a model config).
function F.plan.shape(o)
  return { arch = F.name, layers = o.layers, hidden = o.dim, heads = o.heads, ffn = o.hidden or 4 * o.dim,
           vocab = o.padded_vocab or o.vocab, seq_len = o.seq_len, tied = o.tie ~= false }
end

-- Published configurations (BigScience's config.json files; BLOOM-176B in
-- Le Scao et al. 2022, Table 3): vocab 250880, trained at 2048 tokens.
F.plan.presets = {
  ["bloom-560m"] = { layers = 24, hidden = 1024, heads = 16, ffn = 4096, vocab = 250880, seq_len = 2048 },
  ["bloom-7b1"] = { layers = 30, hidden = 4096, heads = 32, ffn = 16384, vocab = 250880, seq_len = 2048 },
  ["bloom-176b"] = { layers = 70, hidden = 14336, heads = 112, ffn = 57344, vocab = 250880, seq_len = 2048 },
}

return F
