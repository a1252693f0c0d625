-- worlds: 2
-- device worlds: 2
-- The key/value cache under tensor parallelism (T = 2: each rank caches its
-- key/value heads, the row-parallel all-reduces as in forward) and pipeline
-- parallelism (P = 2: each stage caches its layers' heads, the activations
-- sent down as in evaluation), against the serial engine in the same process
-- ({data = world}: every rank computes the whole model).
--
-- Tolerance: as generate_spec's, FP32_TOL = 1e-5 of the row's largest
-- |logit|: T = 2 adds two partial sums of K/2 products where T = 1 adds one
-- of K (a reordering, ~K 2^-24 relative), P = 2 changes nothing of the sums.
-- Greedy ids: within the tolerance of the serial recompute maximum, as
-- generate_spec checks them.
local assert = require "luassert"
local pg = require "pipegoose"

local W = pg.world_size()
local FP32_TOL = 1e-5
local DEVICE = os.getenv("PG_TEST_DEVICE") == "cuda" and "cuda" or nil

local function row_close(got, want, what)
  local scale = 0
  for _, v in ipairs(want) do scale = math.max(scale, math.abs(v)) end
  assert(scale > 0, what .. ": an all-zero reference")
  for v = 1, #want do
    local d = math.abs(got[v] - want[v])
    assert(d <= FP32_TOL * scale, ("%s: logit %d differs by %.3g (max %.3g)"):format(what, v - 1, d, scale))
  end
end

local function ids_tensor(rows) return pg.tensor(rows, { dtype = "int32" }) end

for _, layout in ipairs{ "tensor", "pipeline" } do
  describe(("the key/value cache, %s = %d"):format(layout, W), function()
    for _, name in ipairs{ "gpt2", "llama", "bloom", "mixtral" } do
      it(name .. ": decoded logits and greedy ids are the serial engine's", function()
        local dir = "spec/fixtures/hf_" .. name .. "_tiny"
        local ser = pg.parallelize(pg.nn.from_hf(dir), pg.ParallelContext{ data = W, seed = 3 }, {})
        local par = pg.parallelize(pg.nn.from_hf(dir), pg.ParallelContext{ [layout] = W, seed = 3 },
          { device = DEVICE })
        local V = ser.config.vocab
        local prompts = { { 3, 1, 4, 1, 5 }, { 9, 2 } }
        local got, want = {}, {}
        for r, p in ipairs(prompts) do
          local a = par:decode(ids_tensor{ p }, { 0 }, r - 1, 2):to("cpu")
          local b = ser:decode(ids_tensor{ p }, { 0 }, r - 1, 2)
          row_close(a:narrow(2, #p, 1):reshape{ V }:totable(), b:narrow(2, #p, 1):reshape{ V }:totable(),
            name .. " prompt " .. r)
        end
        for step = 1, 4 do
          local toks, pos = { { 10 + step }, { 20 + step } }, { 4 + step, 1 + step }
          got = par:decode(ids_tensor(toks), pos, 0, 2):to("cpu"):totable()
          want = ser:decode(ids_tensor(toks), pos, 0, 2):totable()
          for r = 1, 2 do row_close(got[r][1], want[r][1], ("%s step %d row %d"):format(name, step, r)) end
        end
        par.c:release_cache()
        ser.c:release_cache()
        local _, ids = pg.generate(par, prompts, { max_new_tokens = 6 })
        for r, p in ipairs(prompts) do
          local prefix = table.move(p, 1, #p, 1, {})
          for i, id in ipairs(ids[r]) do
            local row = ser:forward(ids_tensor{ prefix }):narrow(2, #prefix, 1):reshape{ V }:totable()
            local best = -math.huge
            for _, v in ipairs(row) do best = math.max(best, v) end
            local scale = 0
            for _, v in ipairs(row) do scale = math.max(scale, math.abs(v)) end
            assert(row[id + 1] >= best - FP32_TOL * scale, ("%s row %d step %d"):format(name, r, i))
            prefix[#prefix + 1] = id
          end
        end
      end)
    end
  end)
end
