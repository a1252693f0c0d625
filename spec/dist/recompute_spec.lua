-- worlds: 1 2 4
-- Activation recomputation (pg.parallelize{recompute = "full" | "selective"})
-- changes memory, never results: in every layout of this world size, three
-- AdamW steps give bit for bit the losses, the evaluation loss and the
-- weights of the same run without it (GPT-2, LLaMA: RoPE, grouped-query
-- attention, and GPT-2's blocks with ALiBi), and the activation peak is lower, also with one micro-batch
-- in flight: full keeps each block's output per micro-batch and one
-- micro-batch of one block's inside (the rank's blocks share it), selective
-- one micro-batch of one layer's attention probabilities.
local pg = require "pipegoose"

local W = pg.world_size()
local LAYOUTS = ({
  [1] = { { name = "serial" } },
  [2] = { { name = "T=2", tensor = 2 }, { name = "P=2 1f1b", pipeline = 2 },
          { name = "P=2 gpipe", pipeline = 2, schedule = "gpipe" }, { name = "D=2", data = 2 } },
  [4] = { { name = "T=2 x P=2", tensor = 2, pipeline = 2 }, { name = "P=2 x D=2", pipeline = 2, data = 2 } },
})[W]

-- GPT-2's blocks with ALiBi instead of position embeddings (BLOOM's attention)
local function alibi_model()
  local nn = pg.nn
  local list = { nn.Embedding{ vocab = 61, dim = 32, name = "embed" } }
  for i = 0, 1 do
    list[#list + 1] = nn.Sequential{
      nn.Residual(nn.Sequential{ nn.LayerNorm(32, { name = "ln1" }),
        nn.CausalSelfAttention{ dim = 32, heads = 4, seq_len = 16, alibi = true, name = "attn" } }),
      nn.Residual(nn.Sequential{ nn.LayerNorm(32, { name = "ln2" }), nn.MLP{ dim = 32, name = "mlp" } }),
      name = "blocks." .. i,
    }
  end
  list[#list + 1] = nn.LayerNorm(32, { name = "ln_f" })
  list[#list + 1] = nn.LMHead{ vocab = 61, dim = 32, tie = false, name = "head" }
  return nn.Sequential(list)
end

local MODELS = {
  alibi = alibi_model,
  gpt2 = function() return pg.nn.GPT.load_llmc("spec/fixtures/gpt2_tiny_model.bin") end,
  llama = function()
    return pg.nn.Llama{ vocab = 61, seq_len = 16, dim = 32, heads = 4, kv_heads = 2, hidden = 48, layers = 2 }
  end,
}

local B, T = 8, 16
local x, y = pg.zeros({ B, T }, { dtype = "int32" }), pg.zeros({ B, T }, { dtype = "int32" })
for b = 1, B do
  for s = 1, T do
    x:set(b, s, (b * 31 + s * 7) % 61)
    y:set(b, s, (b * 13 + s * 5 + b * s) % 61)
  end
end

local function run(layout, model, recompute)
  local ctx = pg.ParallelContext{ tensor = layout.tensor, pipeline = layout.pipeline, data = layout.data, seed = 5 }
  local D, d = ctx:world_size("data"), ctx:local_rank("data")
  local xs, ys = x:narrow(1, d * B // D + 1, B // D), y:narrow(1, d * B // D + 1, B // D)
  local e = pg.parallelize(MODELS[model](), ctx, { micro_batches = 4 // D, schedule = layout.schedule,
                                                  recompute = recompute })
  local opt = pg.optim.AdamW(e, { lr = 1e-2 })
  local losses = {}
  for i = 1, 3 do
    opt:zero_grad()
    losses[i] = e:forward_backward(xs, ys)
    opt:step()
  end
  losses[4] = e:loss(xs, ys)
  return { losses = losses, weights = (e:flat()):clone(), memory = e:memory() }
end

describe("activation recomputation (" .. W .. " ranks)", function()
  for _, layout in ipairs(LAYOUTS) do
    for _, model in ipairs{ "gpt2", "llama", "alibi" } do
      it(layout.name .. ", " .. model .. ": full and selective give the run without them bit for bit", function()
        local base = run(layout, model, "none")
        for _, how in ipairs{ "full", "selective" } do
          local r = run(layout, model, how)
          assert.same(base.losses, r.losses, how .. ": losses")
          assert.is_true(r.weights:equal(base.weights), how .. ": weights after 3 steps")
          local m, b = r.memory, base.memory
          -- lower with more than one micro-batch in flight, and also with one when the rank holds both
          -- layers (they share one buffer); a rank with one layer and one micro-batch at a time has
          -- nothing to save (full recomputation costs it a block output)
          if b.peak_in_flight > 1 or (layout.pipeline or 1) == 1 then
            assert.is_true(m.peak_activation_bytes < b.peak_activation_bytes,
              ("%s: peak activations %d, without %d"):format(how, m.peak_activation_bytes, b.peak_activation_bytes))
          end
          assert.is_true(m.fixed_activation_bytes > 0, how .. ": the one-micro-batch buffers are counted")
        end
      end)
    end
  end
end)
