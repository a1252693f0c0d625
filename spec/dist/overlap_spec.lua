-- worlds: 2 4 8
-- Overlapped, bucketed data-parallel gradient reduction (overlap_grad_reduce,
-- bucket_mb) and ZeRO-2, against the reduction at the end of the step (the
-- MPI ring, overlap_grad_reduce = false) on the same seed and batch:
--   - D = world, zero = 0, 1 and 2, private buffers (the MPI path);
--   - gradient accumulation (two calls, the first with sync = false);
--   - on 4 ranks, P = 2 x D = 2 with the tied embedding on both ends, with
--     and without the interleaved schedule (virtual_stages = 2); on 8 ranks
--     (only these) P = 4 x D = 2 (middle stages without a tied copy) and
--     P = 2 x D = 4 with virtual_stages = 2.
-- Tolerance: with two members both reductions add a + b and scale by 1/2,
-- so results are compared bit for bit; with four, MPI_Iallreduce /
-- MPI_Ireduce_scatter add the same four terms in another order than the
-- ring: the first step's averaged gradients agree to
-- |got - want| <= 1e-5 |want| + 1e-6 max(1, max |want|) (later steps go
-- through Adam, which turns rounding-level differences of near-zero
-- gradients into updates of up to lr). The averaged gradients are also
-- those of the whole batch on one process to that tolerance.
-- The buckets are made tiny (bucket_mb) so that the model has many and
-- most start while backward runs.
local pg = require "pipegoose"
local h = require "helpers"

local W = pg.world_size()
local RTOL, ATOL = 1e-5, 1e-6
local CFG = { vocab = 61, padded_vocab = 64, seq_len = 8, dim = 16, heads = 2, layers = 4 }
local BUCKET_MB = 0.004 -- about 1000 floats
local B = 8

local function tokens(seed) return h.token_batch(seed, B, CFG.seq_len, CFG.vocab) end
local X, Y = tokens(1), tokens(2)

local function assert_close(got, want, what) h.assert_scaled_close(got, want, what, RTOL, ATOL, true) end

local dp = pg.ParallelContext{ data = W, seed = 7 }
local D, d = W, dp:local_rank("data")
local rows = B // D
local x, y = X:narrow(1, d * rows + 1, rows), Y:narrow(1, d * rows + 1, rows)

-- Three AdamW steps: the parameters after them, the first step's averaged
-- gradients (this rank's shard with ZeRO) and the engine. accumulate: each
-- step is two calls on half the rows each (grad_scale 1/2), the first
-- without the reduction.
local function train(ctx, opts, zero, accumulate, xs, ys)
  xs, ys = xs or x, ys or y
  opts.bucket_mb = opts.bucket_mb or BUCKET_MB
  local e = pg.parallelize(pg.nn.GPT(CFG), ctx, opts)
  local opt = pg.optim.AdamW(e, { lr = 1e-2, weight_decay = 0.1, zero = zero })
  local first, loss
  for s = 1, 3 do
    e:zero_grad()
    if accumulate then
      local half = xs:shape()[1] // 2
      e:forward_backward(xs:narrow(1, 1, half), ys:narrow(1, 1, half), { grad_scale = 0.5, sync = false })
      loss = e:forward_backward(xs:narrow(1, half + 1, half), ys:narrow(1, half + 1, half), { grad_scale = 0.5 })
    else
      loss = e:forward_backward(xs, ys)
    end
    opt:clip_grad_norm(1.0)
    if s == 1 then first = opt:shard_state().grad:clone() end
    opt:step()
  end
  return { params = (e:flat()):clone(), first = first, engine = e, loss = loss }
end

local function same(a, b, what)
  if D == 2 then
    assert.is_true(a.params:equal(b.params), what .. ": parameters after 3 steps, bit for bit")
    assert.is_true(a.first:equal(b.first), what .. ": the first step's gradients, bit for bit")
  else
    assert_close(a.first, b.first, what .. ": the first step's gradients")
  end
end

describe(("overlapped gradient reduction on %d ranks"):format(W), function()
  -- on 8 ranks only the pipeline layouts below (D = 8 would leave one row per rank: no halves to accumulate)
  if W <= 4 then
    local on, off = {}, {}
    for zero = 0, 2 do
      on[zero] = train(dp, { shared_memory = false }, zero)
      off[zero] = train(dp, { shared_memory = false, overlap_grad_reduce = false }, zero)
    end

    it("overlaps over MPI, in many buckets, and says so in stats()", function()
      local s = on[1].engine:stats()
      assert.is_true(s.overlap_grad_reduce)
      assert.is_true(s.grad_buckets > 4, "buckets: " .. s.grad_buckets)
      -- one stage: no tied copy to wait for, so every bucket started while backward ran
      assert.are.equal(s.grad_buckets, s.grad_buckets_in_backward)
      assert.is_true(s.exposed_comm_seconds >= 0 and s.grad_sync_seconds > 0)
      local o = off[1].engine:stats()
      assert.is_false(o.overlap_grad_reduce)
      assert.are.equal(0, o.grad_buckets)
      -- without overlap every reduction happens after backward: all of it is exposed
      assert.are.equal(o.grad_sync_seconds, o.exposed_comm_seconds)
    end)

    it("cuts buckets of bucket_mb: one per parameter when each is larger, one for the model when it fits", function()
      local n = #pg.parallelize(pg.nn.GPT(CFG), dp, { shared_memory = false }):parameters()
      local tiny = pg.parallelize(pg.nn.GPT(CFG), dp, { shared_memory = false, bucket_mb = 1e-9 })
      assert.are.equal(n, tiny:stats().grad_buckets)
      local whole = pg.parallelize(pg.nn.GPT(CFG), dp, { shared_memory = false }) -- 25 MiB
      assert.are.equal(1, whole:stats().grad_buckets)
    end)

    it("keeps the one pass at the end on shared buffers", function()
      local e = pg.parallelize(pg.nn.GPT(CFG), dp, { bucket_mb = BUCKET_MB })
      assert.is_true(e:stats().shared_memory)
      assert.is_false(e:stats().overlap_grad_reduce)
    end)

    for zero = 0, 2 do
      it(("gives the reduction-at-the-end result, zero = %d"):format(zero), function()
        same(on[zero], off[zero], "zero = " .. zero)
        if D == 2 then assert.are.equal(off[zero].loss, on[zero].loss) end
      end)
    end

    it("gets the same bits with zero = 0, 1 and 2 where they share a shard", function()
      assert.is_true(on[1].params:equal(on[2].params), "zero = 1 and 2: parameters")
      assert.is_true(on[1].first:equal(on[2].first), "zero = 1 and 2: the shard's gradients")
      local st = on[1].engine.optimizer:shard_state()
      assert.is_true(on[0].first:narrow(1, st.lo + 1, st.hi - st.lo):equal(on[1].first), "zero = 0 and 1: the shard")
    end)

    it("averages to the gradients of the whole batch on one process", function()
      local alone = pg.parallelize(pg.nn.GPT(CFG), pg.ParallelContext{ self = true, seed = 7 }, {})
      alone:zero_grad()
      alone:forward_backward(X, Y)
      local _, whole = alone:flat()
      local e = pg.parallelize(pg.nn.GPT(CFG), dp, { shared_memory = false, bucket_mb = BUCKET_MB })
      e:zero_grad()
      e:forward_backward(x, y)
      assert.is_true(e:stats().overlap_grad_reduce)
      local _, avg = e:flat()
      -- the flat buffer is padded to a multiple of 16 D floats: the used part is the same length
      assert_close(avg:narrow(1, 1, whole:numel()), whole, "averaged gradients against the whole batch")
    end)

    for zero = 0, 2, 2 do
      it(("reduces accumulated gradients once, on the call that syncs (zero = %d)"):format(zero), function()
        local a = train(dp, { shared_memory = false }, zero, true)
        local b = train(dp, { shared_memory = false, overlap_grad_reduce = false }, zero, true)
        same(a, b, "accumulated, zero = " .. zero)
      end)
    end
  end

  -- P pipeline stages x DP replicas, the embedding tied across the two ends:
  -- a stage holding a tied copy starts that bucket after the embedding
  -- group's sum, at the end; every other bucket (all of a middle stage's)
  -- starts while backward runs. With two replicas the results are the
  -- reduction at the end's bit for bit, with four the first step's gradients
  -- agree to the tolerance in this file's first lines.
  local function pipeline_case(P, DP, v)
    local pd = pg.ParallelContext{ pipeline = P, data = DP, seed = 7 }
    local dd, n = pd:local_rank("data"), B // DP
    local xs, ys = X:narrow(1, dd * n + 1, n), Y:narrow(1, dd * n + 1, n)
    for zero = 0, 2 do
      local o = { micro_batches = 2, virtual_stages = v, shared_memory = false }
      local a = train(pd, o, zero, false, xs, ys)
      local b = train(pd, { micro_batches = 2, virtual_stages = v, shared_memory = false,
                            overlap_grad_reduce = false }, zero, false, xs, ys)
      local s = a.engine:stats()
      assert.is_true(s.overlap_grad_reduce)
      local tied = s.is_first or s.is_last
      assert.are.equal(s.grad_buckets - (tied and 1 or 0), s.grad_buckets_in_backward,
        ("zero = %d, stage %s: buckets started in backward"):format(zero, pd:local_rank("pipeline")))
      if DP == 2 then
        assert.is_true(a.params:equal(b.params), "zero = " .. zero .. ": parameters after 3 steps")
        assert.is_true(a.first:equal(b.first), "zero = " .. zero .. ": the first step's gradients")
        assert.are.equal(b.loss, a.loss)
      else
        assert_close(a.first, b.first, "zero = " .. zero .. ": the first step's gradients")
      end
    end
  end

  if W == 4 then
    for _, v in ipairs{ 1, 2 } do
      it(("gives the same bits with P = 2, D = 2, tied embedding, virtual_stages = %d"):format(v), function()
        pipeline_case(2, 2, v)
      end)
    end
  end

  if W == 8 then
    it("gives the same bits with P = 4, D = 2, tied embedding on stages 0 and 3 (none on the middle ones)", function()
      pipeline_case(4, 2, 1)
    end)
    it("agrees with P = 2, D = 4, tied embedding, virtual_stages = 2", function()
      pipeline_case(2, 4, 2)
    end)
  end
end)
