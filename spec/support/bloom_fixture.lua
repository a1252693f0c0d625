-- A BLOOM fixture of scripts/make_bloom_reference.py (spec/fixtures/hf_bloom_tiny*)
-- read by pg.nn.from_hf (lua/pipegoose/models/bloom.lua) and trained in
-- process as the script's transformers run was, on any context: the dist
-- specs' check of ALiBi under tensor parallelism (spec/unit/bloom_spec.lua
-- runs the same fixtures through scripts/model_check.lua in every layout).
local pg = require "pipegoose"
local cjson = require "cjson"

local M = {}

local function json(path)
  local f = assert(io.open(path))
  local t = cjson.decode(f:read("a"))
  f:close()
  return t
end

function M.expected(dir) return json(dir .. "/expected.json") end

-- Trains the fixture in DIR on ctx (nil: serial) as expected.json says;
-- returns {loss =, step_losses =, grad_norms =, final_loss =} (rank 0's).
function M.train(dir, ctx, opts)
  local cfg, e = json(dir .. "/config.json"), json(dir .. "/expected.json")
  local engine = pg.parallelize(pg.nn.from_hf(dir), ctx, opts or {})
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
