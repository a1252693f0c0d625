-- Bad tensor- and pipeline-parallel configurations, each run as a whole job
-- under mpirun: the job ends with exit status 1, and the error, the same on
-- every rank, is reported once for all of them ("[ranks 0-3] ..." from
-- pglua) with a message that names the numbers and no Lua traceback (it is
-- the user's error, not pipegoose's).
--
-- `timeout -k 2 20` is a hang guard, not a timing assertion: a job that hangs
-- is killed and then fails on its exit status (124 or 137 instead of 1).
local h = require "helpers"
local pg = require "pipegoose"

local function job(n, code)
  local rc, out = h.sh(("timeout -k 2 20 scripts/mpirun.sh -x PG_ABORT_GRACE -np %d %s"):format(
    n, h.pglua_cmd{ "-e", "local pg = require 'pipegoose'\n" .. code }))
  return rc, out
end

-- Exit 1, and one report "[ranks 0-(n-1)] ..." containing `message` (plain text), said once.
local function assert_fails_everywhere(n, code, message)
  local rc, out = job(n, code)
  assert.equal(1, rc, out)
  local reports = h.reports(out)
  assert.equal(1, #reports, "one report for the job:\n" .. out)
  for r = 0, n - 1 do assert.is_true(reports[1].ranks[r], ("rank %d is not in the report:\n%s"):format(r, out)) end
  assert.truthy(reports[1].text:find(message, 1, true), ("the report does not say %q:\n%s"):format(message, out))
  assert.equal(1, h.count(out, message), "said once:\n" .. out)
  assert.is_nil(out:find("stack traceback", 1, true), "a user error has no traceback:\n" .. out)
end

local GPT = "pg.nn.GPT{ vocab = 61, seq_len = 8, layers = 1, %s }"

describe("tensor parallelism rejects", function()
  it("heads not divisible by T", function()
    assert_fails_everywhere(2, ([[
      local ctx = pg.ParallelContext{ tensor = 2 }
      pg.parallelize(]] .. GPT .. [[, ctx)]]):format("dim = 12, heads = 3"),
      "CausalSelfAttention 'blocks.0.attn': tensor=2 does not divide heads=3")
  end)

  it("heads not divisible by T, named before the q|k|v Linear's width", function()
    -- 2 heads of 3 channels at T = 4: the q|k|v Linear that comes first cannot
    -- split its blocks either, but the message names the heads
    assert_fails_everywhere(4, ([[
      local ctx = pg.ParallelContext{ tensor = 4 }
      pg.parallelize(]] .. GPT .. [[, ctx)]]):format("dim = 6, heads = 2"),
      "CausalSelfAttention 'blocks.0.attn': tensor=4 does not divide heads=2")
  end)

  it("a fused Linear whose blocks are not divisible by T (a Linear of its own)", function()
    assert_fails_everywhere(4, [[
      local ctx = pg.ParallelContext{ tensor = 4 }
      pg.parallelize(pg.nn.Sequential{ pg.nn.Embedding{ vocab = 61, dim = 6, name = "embed" },
        pg.nn.Linear{ ["in"] = 6, out = 18, parallel = "column", blocks = 3, name = "qkv" } }, ctx)]],
      "Linear 'qkv': tensor=4 does not divide the output width 18 in 3 blocks of 6")
  end)

  it("an MLP width not divisible by T", function()
    assert_fails_everywhere(4, ([[
      local ctx = pg.ParallelContext{ tensor = 4 }
      pg.parallelize(]] .. GPT .. [[, ctx)]]):format("dim = 8, heads = 4, hidden = 10"),
      "Linear 'blocks.0.mlp.fc': tensor=4 does not divide the output width 10")
  end)

  it("T larger than the world", function()
    assert_fails_everywhere(2, "pg.ParallelContext{ tensor = 4, data = 1 }",
      "ParallelContext: tensor=4 x pipeline=1 x data=1 = 4 ranks, but the world has 2")
  end)

  it("a row-parallel Linear given an unsplit tensor of the wrong width (model check)", function()
    assert_fails_everywhere(2, [[
      local ctx = pg.ParallelContext{ tensor = 2 }
      pg.parallelize(pg.nn.Sequential{
        pg.nn.Embedding{ vocab = 61, dim = 12, name = "embed" },
        pg.nn.Linear{ ["in"] = 16, out = 12, parallel = "row", name = "proj" },
        pg.nn.LMHead{ vocab = 61, dim = 12, tie = false, name = "head" },
      }, ctx)]],
      "Linear 'proj': row-parallel with in=16 receives an unsplit tensor of width 12 (expected 16, or its split 16/2 = 8")
  end)

  it("a row-parallel Linear expecting its split share given the unsplit tensor (run time)", function()
    assert_fails_everywhere(2, [[
      local ctx = pg.ParallelContext{ tensor = 2 }
      local l = pg.nn.Layer(pg.nn.Linear{ ["in"] = 16, out = 8, parallel = "row", name = "proj" }, ctx,
        { input = { width = 16, split = true } })
      l:forward(pg.randn({ 2, 4, 16 }, { seed = 1 }))]],
      "proj: expects this rank's split input of width 8, got the unsplit width 16 = 8 x tensor=2")
  end)
end)

describe("pipeline parallelism rejects", function()
  it("P larger than the number of top-level modules", function()
    assert_fails_everywhere(4, [[
      local ctx = pg.ParallelContext{ pipeline = 4 }
      pg.parallelize(pg.nn.Sequential{
        pg.nn.Embedding{ vocab = 61, dim = 8, name = "embed" },
        pg.nn.LayerNorm(8, { name = "ln" }),
        pg.nn.LMHead{ vocab = 61, dim = 8, name = "head" },
      }, ctx)]],
      "pipeline=4 is larger than the model's 3 top-level modules")
  end)

  it("a batch not divisible by the micro-batches", function()
    assert_fails_everywhere(2, ([[
      local ctx = pg.ParallelContext{ pipeline = 2 }
      local e = pg.parallelize(]] .. GPT .. [[, ctx, { micro_batches = 4 })
      local x = pg.zeros({ 6, 8 }, { dtype = "int32" })
      e:forward_backward(x, x)]]):format("dim = 8, heads = 2"),
      "batch 6 is not divisible by micro_batches=4")
  end)

  it("an unknown schedule name", function()
    assert_fails_everywhere(2, ([[
      local ctx = pg.ParallelContext{ pipeline = 2 }
      pg.parallelize(]] .. GPT .. [[, ctx, { schedule = "zigzag" })]]):format("dim = 8, heads = 2"),
      "parallelize: schedule must be '1f1b' or 'gpipe', got 'zigzag'")
  end)
end)

describe("virtual stages (the interleaved schedule) reject", function()
  local cases = {
    { "more chunks than top-level modules", "{ virtual_stages = 3, micro_batches = 2 }",
      "pipeline x virtual_stages = 2 x 3 is larger than the model's 4 top-level modules" },
    { "micro-batches that are not a multiple of P", "{ virtual_stages = 2, micro_batches = 3 }",
      "interleaved with 2 chunks per stage needs micro-batches (3) to be a multiple of the pipeline size (2)" },
    { "the gpipe schedule", "{ virtual_stages = 2, micro_batches = 2, schedule = \"gpipe\" }",
      "virtual_stages = 2 runs the interleaved 1F1B schedule; schedule = \"gpipe\" has one chunk per stage" },
    { "explicit stages that do not list every chunk", "{ virtual_stages = 2, micro_batches = 2, stages = { 2, 2 } }",
      "stages lists 2 stages, but pipeline x virtual_stages = 2 x 2" },
  }
  for _, c in ipairs(cases) do
    it(c[1], function()
      assert_fails_everywhere(2, ([[
        local ctx = pg.ParallelContext{ pipeline = 2 }
        pg.parallelize(]] .. GPT .. [[, ctx, ]] .. c[2] .. [[)]]):format("dim = 8, heads = 2"), c[3])
    end)
  end

  it("one pipeline stage", function()
    local ok, err = pcall(pg.parallelize, pg.nn.GPT{ vocab = 61, seq_len = 8, layers = 1, dim = 8, heads = 2 }, nil,
      { virtual_stages = 2 })
    assert.is_false(ok)
    assert.matches("parallelize: virtual_stages = 2 needs pipeline > 1", err)
  end)
end)

describe("the overlapped gradient reduction rejects", function()
  it("ranks of a data group that disagree on overlap_grad_reduce, naming both calls", function()
    -- rank 0 starts its buckets in backward, rank 1 reduces at the end: the
    -- agreement on the bucket set meets rank 1's next call (the loss's all_reduce)
    assert_fails_everywhere(2, [[
      local ctx = pg.ParallelContext{ data = 2 }
      local e = pg.parallelize(pg.nn.GPT{ vocab = 61, seq_len = 8, dim = 16, heads = 2, layers = 1 }, ctx,
        { shared_memory = false, overlap_grad_reduce = ctx:local_rank("data") == 0, bucket_mb = 0.004 })
      local x = pg.zeros({ 2, 8 }, { dtype = "int32" })
      e:forward_backward(x, x)]],
      "all_reduce over the data group: rank 1 called all_reduce of 1 float64 values (op sum, in the runtime), "
      .. "rank 0 called all_reduce of")
  end)
end)
