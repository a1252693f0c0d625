-- A BLOOM fixture of scripts/make_bloom_reference.py (spec/fixtures/hf_bloom_tiny*)
-- composed from pg.nn specs by hand and trained as the script's transformers
-- run was: a check of the ALiBi attention against transformers' BloomForCausalLM
-- until pg.nn.from_hf reads BLOOM itself. The layout is the script's docstring:
-- word_embeddings, its LayerNorm, pre-LN blocks (GPT-2's, with ALiBi and no
-- position embeddings; the same tanh GELU), ln_f, the tied head;
-- query_key_value's rows per head (q_h, k_h, v_h) reordered into pipegoose's
-- [q heads | k heads | v heads].
local pg = require "pipegoose"
local cjson = require "cjson"
local safetensors = require "pipegoose.safetensors"

local M = {}

local function json(path)
  local f = assert(io.open(path))
  local t = cjson.decode(f:read("a"))
  f:close()
  return t
end

function M.expected(dir) return json(dir .. "/expected.json") end

local function model(cfg, seq_len)
  local nn = pg.nn
  local C, V = cfg.hidden_size, cfg.vocab_size
  local list = { nn.Embedding{ vocab = V, dim = C, name = "embed" }, nn.LayerNorm(C, { name = "embed_ln" }) }
  for i = 0, cfg.n_layer - 1 do
    list[#list + 1] = nn.Sequential{
      nn.Residual(nn.Sequential{ nn.LayerNorm(C, { name = "ln1" }),
        nn.CausalSelfAttention{ dim = C, heads = cfg.n_head, seq_len = seq_len, alibi = true, name = "attn" } }),
      nn.Residual(nn.Sequential{ nn.LayerNorm(C, { name = "ln2" }), nn.MLP{ dim = C, name = "mlp" } }),
      name = "blocks." .. i,
    }
  end
  list[#list + 1] = nn.LayerNorm(C, { name = "ln_f" })
  list[#list + 1] = nn.LMHead{ vocab = V, dim = C, name = "head" } -- tied to embed.wte
  return nn.Sequential(list)
end

-- pipegoose parameter name -> the fixture's tensor (without "transformer.")
local function names(cfg)
  local map = { ["embed.wte"] = "word_embeddings.weight", ["embed_ln.weight"] = "word_embeddings_layernorm.weight",
                ["embed_ln.bias"] = "word_embeddings_layernorm.bias", ["ln_f.weight"] = "ln_f.weight",
                ["ln_f.bias"] = "ln_f.bias" }
  for i = 0, cfg.n_layer - 1 do
    local p, q = "blocks." .. i .. ".", "h." .. i .. "."
    for _, wb in ipairs{ "weight", "bias" } do
      map[p .. "1.ln1." .. wb] = q .. "input_layernorm." .. wb
      map[p .. "1.attn.qkv." .. wb] = q .. "self_attention.query_key_value." .. wb
      map[p .. "1.attn.proj." .. wb] = q .. "self_attention.dense." .. wb
      map[p .. "2.ln2." .. wb] = q .. "post_attention_layernorm." .. wb
      map[p .. "2.mlp.fc." .. wb] = q .. "mlp.dense_h_to_4h." .. wb
      map[p .. "2.mlp.proj." .. wb] = q .. "mlp.dense_4h_to_h." .. wb
    end
  end
  return map
end

-- Rows [3 hd h + part hd, + hd) of BLOOM's query_key_value to part-major order.
local function qkv_blocks(t, H, hd)
  local pieces = {}
  for part = 0, 2 do
    for h = 0, H - 1 do pieces[#pieces + 1] = t:narrow(1, (3 * h + part) * hd + 1, hd) end
  end
  return pg.cat(pieces, 1)
end

-- Trains the fixture in DIR on ctx (nil: serial) as expected.json says;
-- returns {loss =, step_losses =, grad_norms =, final_loss =} (rank 0's).
function M.train(dir, ctx, opts)
  local cfg, e = json(dir .. "/config.json"), json(dir .. "/expected.json")
  local engine = pg.parallelize(model(cfg, e.seq_len), ctx, opts or {})
  local hdr = safetensors.read_header(dir .. "/model.safetensors")
  local map, hd = names(cfg), cfg.hidden_size // cfg.n_head
  for _, p in ipairs(engine:parameters()) do
    local src = assert(map[p.name], p.name .. ": no BLOOM tensor for it")
    local t = safetensors.read(hdr, "transformer." .. src)
    engine:load_param(p.name, p.name:find("%.qkv%.") and qkv_blocks(t, cfg.n_head, hd) or t)
  end
  local data = pg.data.TokenShards{ path = dir .. "/tokens.bin", batch = e.batch, seq_len = e.seq_len, shuffle = false,
                                    ctx = ctx, vocab = cfg.vocab_size }
  local x, y = data:next_batch()
  local out = { loss = engine:loss(x, y), step_losses = {}, grad_norms = {} }
  local opt = pg.optim.AdamW(engine, { lr = e.lr, betas = { e.beta1, e.beta2 }, eps = e.eps,
                                       weight_decay = e.weight_decay })
  for k = 1, e.steps do
    engine:zero_grad()
    out.step_losses[k] = engine:forward_backward(x, y)
    out.grad_norms[k] = opt:clip_grad_norm(e.clip)
    opt:step()
  end
  out.final_loss = engine:loss(x, y)
  return out
end

-- Every number of `got` within rtol (relative) of expected.json's.
function M.assert_agrees(got, e, rtol, what)
  local function near(a, b, name)
    assert(math.abs(a - b) <= rtol * math.abs(b),
      ("%s %s: pipegoose %.9g, transformers %.9g (rtol %g)"):format(what, name, a, b, rtol))
  end
  near(got.loss, e.loss, "loss")
  for k = 1, e.steps do
    near(got.step_losses[k], e.step_losses[k], "step " .. k .. " loss")
    near(got.grad_norms[k], e.grad_norms[k], "step " .. k .. " gradient norm")
  end
  near(got.final_loss, e.final_loss, "final loss")
end

return M
