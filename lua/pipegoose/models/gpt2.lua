--- The GPT-2 family: pg.nn.TransformerBlock and pg.nn.GPT, GPT2LMHeadModel's
-- Hugging Face mapping, llm.c's model file mapping, and the planner's shape
-- (GPT-2, GPT-3 and Megatron's GPT are this family to the planner).
-- The fields of a family are described in lua/pipegoose/models/init.lua.
local opt = require "pipegoose.options"
local common = require "pipegoose.models.common"

local F = { name = "gpt2", label = "GPT", aliases = { "gpt" } }

local POS, NEED, NAME, HEAD = common.POS, common.NEED, common.NAME, common.HEAD
local value, positive_int, number, fail, entry = common.value, common.positive_int, common.number, common.fail, common.entry
local flag, name = common.flag, common.name

---------------------------------------------------------------- the builder

--- GPT-2: embed, blocks.0 .. blocks.L-1, ln_f, head (tied to embed.wte).
-- padded_vocab: rows of the embedding (>= vocab); tensor parallelism pads
-- further to a multiple of T. Init is GPT-2's: N(0, 0.02), residual
-- projections N(0, 0.02/sqrt(2*layers)), LayerNorm 1/0, biases 0.
-- arch: the model config's own field (a Llama's says "llama"), so that a
-- config passes back in (pg.nn.GPT(engine.config)).
-- head: "loss" (the LM head with the fused cross-entropy), "logits" (the
-- head's logits, for an objective written in Lua) or "none" (the model ends
-- with ln_f: add a head of your own, e.g. a classifier).
F.schema = { vocab = NEED, padded_vocab = POS, seq_len = NEED, dim = NEED, heads = NEED, layers = NEED, hidden = POS,
             tie = opt.boolean{ default = true }, arch = opt.enum{ F.name }, head = HEAD, hf_config = common.HF_CONFIG }

local nn -- pg.nn, given by F.install (nn.lua installs every family as it loads)

local function build(o)
  o = opt.check("GPT", o, F.schema)
  common.attention(o, common.raiser("GPT", 2))
  local padded = nn.parts.padded_of("GPT", o)
  -- GPT-2's residual projections: pg.nn's init std (common.INIT_STD, 0.02) scaled by 1/sqrt(2 layers)
  local proj_std = common.INIT_STD / math.sqrt(2 * o.layers)
  local model = nn.Sequential{ name = "" }
  model:add(nn.Embedding{ vocab = o.vocab, padded_vocab = padded, dim = o.dim, positions = o.seq_len, name = "embed" })
  for i = 0, o.layers - 1 do
    model:add(nn.TransformerBlock{ dim = o.dim, heads = o.heads, seq_len = o.seq_len, hidden = o.hidden,
      proj_std = proj_std, name = "blocks." .. i })
  end
  model:add(nn.LayerNorm(o.dim, { name = "ln_f" }))
  model.label = "GPT"
  model.config = { vocab = o.vocab, padded_vocab = padded, seq_len = o.seq_len, dim = o.dim, heads = o.heads,
                   layers = o.layers, hidden = o.hidden or 4 * o.dim, tie = o.tie, hf_config = o.hf_config }
  common.add_head(nn, model, o, padded, o.tie)
  return model
end

--- The pg.nn spec of options o (checked; errors name the caller's line).
function F.build(o)
  if not nn then require "pipegoose.nn" end
  return build(o)
end

--- Adds the family's constructors to pg.nn: TransformerBlock, GPT (a
-- callable table: GPT.load_llmc, GPT.from_hf).
function F.install(pgnn)
  nn = pgnn
  local STD = nn.parts.STD

  --- Pre-LayerNorm block: x + attn(ln1(x)), then x + mlp(ln2(x)).
  function nn.TransformerBlock(o)
    o = opt.check("TransformerBlock", o, { dim = NEED, heads = NEED, seq_len = NEED, hidden = POS, proj_std = STD,
                                           name = NAME })
    local s = nn.Sequential{
      nn.PreNorm(nn.LayerNorm(o.dim, { name = "ln1" }),
        nn.CausalSelfAttention{ dim = o.dim, heads = o.heads, seq_len = o.seq_len, proj_std = o.proj_std, name = "attn" }),
      nn.PreNorm(nn.LayerNorm(o.dim, { name = "ln2" }),
        nn.MLP{ dim = o.dim, hidden = o.hidden, proj_std = o.proj_std, name = "mlp" }),
      name = o.name,
    }
    s.label = "TransformerBlock"
    return s
  end

  nn.GPT = setmetatable({}, { __call = function(_, o) return build(o) end })

  --- pg.nn.GPT.load_llmc(path): a GPT-2 spec with the config and weights of an
  -- llm.c model file (the weights are loaded by pg.parallelize, each rank its shards).
  function nn.GPT.load_llmc(path, opts)
    opt.value("GPT.load_llmc", "path", path, opt.required(opt.string))
    opts = opt.check("GPT.load_llmc", opts, { head = HEAD })
    local cfg = require("pipegoose.llmc").read_header(path)
    local m = nn.GPT{ vocab = cfg.vocab, padded_vocab = cfg.padded_vocab, seq_len = cfg.seq_len, dim = cfg.dim,
                      heads = cfg.heads, layers = cfg.layers, head = opts.head }
    m.weights = { format = "llmc", path = path }
    return m
  end
end

--- The integer fields a model config must have for the exports (hf.lua, llmc.lua).
F.config_keys = { "vocab", "seq_len", "dim", "heads", "layers" }

---------------------------------------------------------------- Hugging Face: GPT2LMHeadModel

-- Conventions as transformers has them: the linear layers are Conv1D,
-- weights stored [in, out] (pipegoose's are [out, in]: transposed both
-- ways); c_attn's columns are q | k | v, heads in order (pipegoose's qkv
-- rows); the tied lm_head is not stored. Names may carry the
-- "transformer." prefix or not (the hub's gpt2 files have none); the
-- attention-mask buffers ("attn.bias", "attn.masked_bias") are ignored.
F.hf = { class = "GPT2LMHeadModel", model_type = "gpt2", prefix = "transformer." }
-- The buffers older GPT-2 files hold and transformers drops on load (the attention masks; hf.check_weights)
F.hf.ignored = { "^h%.%d+%.attn%.bias$", "^h%.%d+%.attn%.masked_bias$" }

-- The fields that give the model's size, which the planner wants spelt out
-- (plan/models.lua: "... is missing"), in the order it asks for them.
F.hf.size_fields = { "n_embd", "n_layer", "n_head", "vocab_size", "n_positions" }

-- GPT2Config's defaults of the fields options() reads (n_inner: 4 x n_embd)
F.hf.defaults = {
  vocab_size = 50257, n_positions = 1024, n_embd = 768, n_layer = 12, n_head = 12,
  activation_function = "gelu_new", layer_norm_epsilon = 1e-5, tie_word_embeddings = true,
  scale_attn_weights = true, scale_attn_by_inverse_layer_idx = false, reorder_and_upcast_attn = false,
}

--- The pg.nn.GPT options of a GPT2LMHeadModel config (absent fields already
-- read as their defaults); refuses what pipegoose's GPT does not compute.
function F.hf.options(dir, cfg)
  local act = name(dir, cfg, "activation_function")
  if act ~= "gelu_new" and act ~= "gelu_pytorch_tanh" then
    fail(dir, "config.json: activation_function %s is not supported (pipegoose's GPT uses gelu_new)", tostring(act))
  end
  local eps = number(dir, cfg, "layer_norm_epsilon")
  if math.abs(eps - common.LAYERNORM_EPS) > 1e-12 then
    fail(dir, "config.json: layer_norm_epsilon %g is not supported (pipegoose's GPT uses 1e-5)", eps)
  end
  for _, k in ipairs{ "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn" } do
    if flag(dir, cfg, k) then fail(dir, "config.json: %s = true is not supported", k) end
  end
  if not flag(dir, cfg, "scale_attn_weights") then
    fail(dir, "config.json: scale_attn_weights = false is not supported")
  end
  local o = {
    vocab = positive_int(dir, cfg, "vocab_size"), seq_len = positive_int(dir, cfg, "n_positions"),
    dim = positive_int(dir, cfg, "n_embd"), heads = positive_int(dir, cfg, "n_head"),
    layers = positive_int(dir, cfg, "n_layer"), tie = flag(dir, cfg, "tie_word_embeddings"),
  }
  o.hidden = value(cfg.n_inner) and positive_int(dir, cfg, "n_inner") or 4 * o.dim
  return o -- pg.nn.GPT checks that heads divides dim
end

function F.hf.layout(o)
  local V, T, C, H = o.vocab, o.seq_len, o.dim, o.hidden or 4 * o.dim
  local function p(pg, hf, shape, conv1d) return entry(pg, { { hf, shape } }, conv1d) end
  local out = { p("embed.wte", "wte.weight", { V, C }), p("embed.wpe", "wpe.weight", { T, C }) }
  for l = 0, o.layers - 1 do
    local b, h = "blocks." .. l .. ".", "h." .. l .. "."
    common.add_layer(out, b, h, {
      p("ln1.weight", "ln_1.weight", { C }), p("ln1.bias", "ln_1.bias", { C }),
      p("attn.qkv.weight", "attn.c_attn.weight", { C, 3 * C }, true), p("attn.qkv.bias", "attn.c_attn.bias", { 3 * C }),
      p("attn.proj.weight", "attn.c_proj.weight", { C, C }, true), p("attn.proj.bias", "attn.c_proj.bias", { C }),
      p("ln2.weight", "ln_2.weight", { C }), p("ln2.bias", "ln_2.bias", { C }),
      p("mlp.fc.weight", "mlp.c_fc.weight", { C, H }, true), p("mlp.fc.bias", "mlp.c_fc.bias", { H }),
      p("mlp.proj.weight", "mlp.c_proj.weight", { H, C }, true), p("mlp.proj.bias", "mlp.c_proj.bias", { C }),
    })
  end
  out[#out + 1] = p("ln_f.weight", "ln_f.weight", { C })
  out[#out + 1] = p("ln_f.bias", "ln_f.bias", { C })
  common.add_untied_head(out, o, V, C)
  return out
end

--- config.json's fields: those pipegoose computes (always written, over an
-- imported file's) and the defaults of a model built in pipegoose (an
-- imported file's values win: initializer_range, dropout, use_cache ...).
function F.hf.config(cfg)
  local computed = {
    architectures = { F.hf.class }, model_type = F.hf.model_type, vocab_size = cfg.vocab, n_positions = cfg.seq_len,
    n_embd = cfg.dim, n_head = cfg.heads, n_layer = cfg.layers, n_inner = cfg.hidden,
    activation_function = "gelu_new", layer_norm_epsilon = common.LAYERNORM_EPS, scale_attn_weights = true,
    scale_attn_by_inverse_layer_idx = false, reorder_and_upcast_attn = false, tie_word_embeddings = cfg.tie ~= false,
  }
  local fresh = { initializer_range = common.INIT_STD, resid_pdrop = 0.0, embd_pdrop = 0.0, attn_pdrop = 0.0,
                  use_cache = true }
  return computed, fresh
end

-- GPT2Config's dropout fields and their defaults (transformers 4.45.2): an absent one is 0.1.
F.hf.dropout = { resid_pdrop = 0.1, embd_pdrop = 0.1, attn_pdrop = 0.1 }

---------------------------------------------------------------- llm.c's model file

F.llmc = {}

--- Why a model config cannot be written in llm.c's format (nil when it can):
-- llm.c's GPT-2 has a 4 x dim MLP and a tied head.
function F.llmc.refusal(cfg)
  for _, k in ipairs{ "vocab", "padded_vocab", "seq_len", "dim", "heads", "layers" } do
    if math.tointeger(cfg[k]) == nil then
      return ("the model config has no %s; llm.c's format holds GPT-2 models only"):format(k)
    end
  end
  if cfg.hidden and cfg.hidden ~= 4 * cfg.dim then
    return ("the MLP is %d wide; llm.c's format needs 4 x dim = %d"):format(cfg.hidden, 4 * cfg.dim)
  end
  if cfg.tie == false then return "the head is not tied to the embedding, which llm.c's format needs" end
end

--- llm.c's tensor order, the matching pipegoose parameter name (%d = layer)
-- and the shape of one layer's slice, and the number of layers it is stacked over.
function F.llmc.layout(cfg)
  local V, T, C, L = cfg.padded_vocab, cfg.seq_len, cfg.dim, cfg.layers
  local H = cfg.hidden or 4 * C
  return {
    { "wte", "embed.wte", { V, C } },
    { "wpe", "embed.wpe", { T, C } },
    { "ln1w", "blocks.%d.ln1.weight", { C }, L },
    { "ln1b", "blocks.%d.ln1.bias", { C }, L },
    { "qkvw", "blocks.%d.attn.qkv.weight", { 3 * C, C }, L },
    { "qkvb", "blocks.%d.attn.qkv.bias", { 3 * C }, L },
    { "attprojw", "blocks.%d.attn.proj.weight", { C, C }, L },
    { "attprojb", "blocks.%d.attn.proj.bias", { C }, L },
    { "ln2w", "blocks.%d.ln2.weight", { C }, L },
    { "ln2b", "blocks.%d.ln2.bias", { C }, L },
    { "fcw", "blocks.%d.mlp.fc.weight", { H, C }, L },
    { "fcb", "blocks.%d.mlp.fc.bias", { H }, L },
    { "fcprojw", "blocks.%d.mlp.proj.weight", { C, H }, L },
    { "fcprojb", "blocks.%d.mlp.proj.bias", { C }, L },
    { "lnfw", "ln_f.weight", { C } },
    { "lnfb", "ln_f.bias", { C } },
  }
end

---------------------------------------------------------------- the planner's shape

-- Learned positions, LayerNorm with biases, GeLU MLP, biased linears,
-- dropout, tied input/output embeddings (GPT-2, GPT-3, Megatron's GPT).
F.plan = {
  features = { norm = "layernorm", gated_mlp = false, activation = "gelu", learned_positions = true, rope = false,
               dropout = true, biases = true, tied = true },
}

--- The planner's sizes of pg.nn.GPT options (or a model config).
function F.plan.shape(o)
  return { arch = F.name, layers = o.layers, hidden = o.dim, heads = o.heads, ffn = o.hidden or 4 * o.dim,
           vocab = o.padded_vocab or o.vocab, seq_len = o.seq_len, tied = o.tie ~= false }
end

-- Published configurations: GPT-2 (Radford et al. 2019, the released
-- checkpoints' config.json), GPT-3 175B (Brown et al. 2020, Table 2.1; vocab
-- 51200 as Megatron-LM pads it).
F.plan.presets = {
  ["gpt2-124m"] = { layers = 12, hidden = 768, heads = 12, ffn = 3072, vocab = 50257, seq_len = 1024 },
  ["gpt2-1.5b"] = { layers = 48, hidden = 1600, heads = 25, ffn = 6400, vocab = 50257, seq_len = 1024 },
  ["gpt3-175b"] = { layers = 96, hidden = 12288, heads = 96, ffn = 49152, vocab = 51200, seq_len = 2048 },
}

return F
