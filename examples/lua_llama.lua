-- A LLaMA written with modules in Lua that shard like the built-in ones: the
-- attention (grouped-query, rotary embeddings) and the SwiGLU MLP are Lua
-- tables with forward/backward over pg.ops; RMSNorm, the embedding and the
-- head are built-in. Each Lua module declares how it meets tensor
-- parallelism, as Megatron's layers do:
--   tensor_parallel = {input = "copy", output = "reduce"}: it takes the full
--     activation and returns a partial sum; the runtime all-reduces the
--     output in forward and the input gradient in backward;
--   parameters split = {dim = 1, sizes = {q, kv, kv}} (column-parallel: this
--     rank holds its heads of q, of k and of v) or {dim = 2} (row-parallel).
-- So the same code runs serially and at any tensor size T that divides the
-- heads: each rank computes its heads and its slice of the MLP.
--
--   local L = dofile("examples/lua_llama.lua")
--   local model = L.Llama{vocab=, dim=, layers=, heads=, kv_heads=, hidden=, seq_len=, rope_theta=, eps=, tie=}
--   local engine = pg.parallelize(model, ctx)     -- parameter names as pg.nn.Llama's
--
-- spec/unit/lua_modules_spec.lua checks it against pg.nn.Llama serially and at T = 2.
-- Run by itself (pglua examples/lua_llama.lua --help) it says what it is and how it is used.
require "pipegoose.library_file"("local L = dofile(\"examples/lua_llama.lua\")\n"
  .. "       local engine = pg.parallelize(L.Llama{...}, ctx)",
  "lua_llama.lua is not a script: it is a LLaMA written with Lua modules that shard like the built-in ones, "
  .. "for a recipe to load (spec/unit/lua_modules_spec.lua checks it against pg.nn.Llama).")
local pg = require "pipegoose"
local ops = pg.ops

local L = {}

--- Attention: q|k|v (column-parallel, unequal blocks when kv_heads < heads),
-- RoPE on q and k, causal grouped-query attention, output projection
-- (row-parallel), no biases.
function L.Attention(o)
  local hd = o.dim // o.heads
  local q_w, kv_w = o.heads * hd, o.kv_heads * hd
  local theta = o.rope_theta or 10000
  local m = {
    name = o.name, in_width = o.dim, out_width = o.dim, saved = {},
    tensor_parallel = { input = "copy", output = "reduce" },
    -- forward FLOPs per token, for the pipeline's stage balancing
    flops = 2 * o.dim * (q_w + 2 * kv_w) + 2 * q_w * o.dim,
  }
  function m:parameters()
    return {
      { name = "qkv.weight", shape = { q_w + 2 * kv_w, o.dim }, split = { dim = 1, sizes = { q_w, kv_w, kv_w } } },
      { name = "proj.weight", shape = { o.dim, q_w }, split = { dim = 2 } },
    }
  end
  -- this rank's heads: its shard of q|k|v has (heads + 2 kv_heads) / T head widths
  local function local_heads(self)
    local T = (q_w + 2 * kv_w) // self.params["qkv.weight"]:shape()[1]
    return o.heads // T, o.kv_heads // T
  end
  function m:forward(slot, x, info)
    local B, T = info.batch, info.seq_len
    local h, kv = local_heads(self)
    local qkv = ops.linear(x, self.params["qkv.weight"]):reshape{ B, T, (h + 2 * kv) * hd }
    local rot = pg.cat({ ops.rope(qkv:narrow(3, 1, h * hd), h, theta),
                         ops.rope(qkv:narrow(3, h * hd + 1, kv * hd), kv, theta),
                         qkv:narrow(3, (h + kv) * hd + 1, kv * hd) }, 3)
    local att_out, lse = ops.attention(rot, h, kv) -- lse: each row's log-sum-exp, what the backward needs
    self.saved[slot] = { x = x, rot = rot, lse = lse, att_out = att_out }
    return ops.linear(att_out, self.params["proj.weight"]):reshape{ B * T, o.dim }
  end
  function m:backward(slot, dy, info)
    local s = self.saved[slot]
    self.saved[slot] = nil
    local B, T = info.batch, info.seq_len
    local h, kv = local_heads(self)
    -- parameter gradients accumulate into the engine's buffers (the += contract)
    local datt = ops.linear_backward(dy:reshape{ B, T, o.dim }, s.att_out, self.params["proj.weight"], false,
      { dw = self.grads["proj.weight"] })
    local drot = ops.attention_backward(datt, s.rot, s.att_out, s.lse, h, kv)
    local dqkv = pg.cat({ ops.rope_backward(drot:narrow(3, 1, h * hd), h, theta),
                          ops.rope_backward(drot:narrow(3, h * hd + 1, kv * hd), kv, theta),
                          drot:narrow(3, (h + kv) * hd + 1, kv * hd) }, 3)
    return (ops.linear_backward(dqkv:reshape{ B * T, (h + 2 * kv) * hd }, s.x, self.params["qkv.weight"], false,
      { dw = self.grads["qkv.weight"] }))
  end
  return m
end

--- SwiGLU MLP: gate|up (column-parallel, two blocks), silu(gate) * up, down (row-parallel).
function L.MLP(o)
  local m = {
    name = o.name, in_width = o.dim, out_width = o.dim, saved = {},
    tensor_parallel = { input = "copy", output = "reduce" },
    flops = 6 * o.dim * o.hidden,
  }
  function m:parameters()
    return {
      { name = "fc.weight", shape = { 2 * o.hidden, o.dim }, split = { dim = 1, blocks = 2 } },
      { name = "proj.weight", shape = { o.dim, o.hidden }, split = { dim = 2 } },
    }
  end
  function m:forward(slot, x)
    local gu = ops.linear(x, self.params["fc.weight"])
    local a = ops.swiglu(gu)
    self.saved[slot] = { x = x, gu = gu, a = a }
    return ops.linear(a, self.params["proj.weight"])
  end
  function m:backward(slot, dy)
    local s = self.saved[slot]
    self.saved[slot] = nil
    local da = ops.linear_backward(dy, s.a, self.params["proj.weight"], false, { dw = self.grads["proj.weight"] })
    local dgu = ops.swiglu_backward(da, s.gu)
    return (ops.linear_backward(dgu, s.x, self.params["fc.weight"], false, { dw = self.grads["fc.weight"] }))
  end
  return m
end

--- The whole model, named as pg.nn.Llama (so pg.nn.from_hf's weights load into it).
function L.Llama(o)
  local nn = pg.nn
  local kv = o.kv_heads or o.heads
  local model = nn.Sequential{ name = "" }
  model:add(nn.Embedding{ vocab = o.vocab, padded_vocab = o.padded_vocab, dim = o.dim, name = "embed" })
  for i = 0, o.layers - 1 do
    model:add(nn.Sequential{
      nn.PreNorm(nn.RMSNorm{ dim = o.dim, eps = o.eps, name = "ln1" },
        L.Attention{ dim = o.dim, heads = o.heads, kv_heads = kv, rope_theta = o.rope_theta, name = "attn" }),
      nn.PreNorm(nn.RMSNorm{ dim = o.dim, eps = o.eps, name = "ln2" }, L.MLP{ dim = o.dim, hidden = o.hidden, name = "mlp" }),
      name = "blocks." .. i,
    })
  end
  model:add(nn.RMSNorm{ dim = o.dim, eps = o.eps, name = "ln_f" })
  model:add(nn.LMHead{ vocab = o.vocab, padded_vocab = o.padded_vocab, dim = o.dim, tie = o.tie == true, name = "head" })
  model.config = nn.Llama(o).config -- the same config (Hugging Face export reads it)
  return model
end

return L
