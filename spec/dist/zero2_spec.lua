-- worlds: 2 4
-- device worlds: 2
-- ZeRO-2 (zero = 2): every rank keeps only its shard of the gradients plus
-- the staging buffers of the buckets being written or reduced; each bucket
-- is reduce-scattered after every micro-batch's backward and added into the
-- shard. Compared with ZeRO-1 (the reduction of the summed gradients) and
-- with one process on the whole batch, same seed and batch:
--   - one micro-batch: the same bits as ZeRO-1 (both reduce-scatter the
--     same buckets with MPI_Ireduce_scatter, and the shard starts at zero);
--   - otherwise the per-micro-batch reduction adds the terms in another
--     order (measured: 1.5e-8 at most, gradients up to 0.18): the shard's
--     gradients agree to
--     |got - want| <= 1e-5 |want| + 1e-6 max(1, max |want|), the losses of
--     three clipped AdamW steps to 1e-5 relative, the clipped norm to 1e-6
--     relative (later parameters go through Adam, which turns
--     rounding-level differences of near-zero gradients into updates of up
--     to lr, so they are not compared);
--   - micro_batches = 2, accumulation over two calls (sync = false first),
--     shared-memory and MPI data groups, on 4 ranks D = 4 and P = 2 x D = 2
--     with the tied embedding on both ends (also virtual_stages = 2);
--   - memory: grads_bytes is the shard plus the staging the layout asks
--     for, and bytes per parameter fall below ZeRO-1's.
--   - an optimizer made after a synced forward_backward keeps that call's
--     reduced gradients of its shard: its step is ZeRO-0's, bit for bit.
--   - with PG_TEST_DEVICE=cuda (the emulated device; D = 2): shard and
--     staging in device memory, a bucket per parameter (grads_bytes from the
--     layout, every bucket but the tied embedding's reduced during
--     backward), and accumulation over two calls with micro_batches = 2
--     against ZeRO-1 on the device within the tolerances above
--     (spec/dist/zero3_spec.lua compares the device's zero 1, 2 and 3 bit
--     for bit and with the serial model).
local pg = require "pipegoose"
local h = require "helpers"

local W = pg.world_size()
local DEVICE = os.getenv("PG_TEST_DEVICE") or "cpu"
local RTOL, ATOL = 1e-5, 1e-6
local CFG = { vocab = 61, padded_vocab = 64, seq_len = 8, dim = 16, heads = 2, layers = 4 }
local BUCKET_MB = 0.004 -- about 1000 floats: many buckets, a small staging pool
local B = 8

local function tokens(seed) return h.token_batch(seed, B, CFG.seq_len, CFG.vocab) end
local X, Y = tokens(1), tokens(2)

local function assert_close(got, want, what) h.assert_scaled_close(got, want, what, RTOL, ATOL, true) end
local function rel(a, b) return math.abs(a - b) / math.max(math.abs(b), 1e-30) end

-- Three clipped AdamW steps: the losses, the clipped norms, the first
-- step's gradients of this rank's shard, the engine. accumulate: each step
-- is two calls on half the rows (grad_scale 1/2), the first with sync = false.
local function train(ctx, opts, zero, xs, ys, accumulate)
  opts.bucket_mb = opts.bucket_mb or BUCKET_MB
  local e = pg.parallelize(pg.nn.GPT(CFG), ctx, opts)
  local opt = pg.optim.AdamW(e, { lr = 1e-2, weight_decay = 0.1, zero = zero })
  local r = { losses = {}, norms = {}, engine = e }
  for s = 1, 3 do
    e:zero_grad()
    if accumulate then
      local half = xs:shape()[1] // 2
      e:forward_backward(xs:narrow(1, 1, half), ys:narrow(1, 1, half), { grad_scale = 0.5, sync = false })
      r.losses[s] = e:forward_backward(xs:narrow(1, half + 1, half), ys:narrow(1, half + 1, half), { grad_scale = 0.5 })
    else
      r.losses[s] = e:forward_backward(xs, ys)
    end
    r.norms[s] = opt:clip_grad_norm(1.0)
    if s == 1 then r.first = opt:shard_state().grad:to("cpu"):clone() end -- a device shard is copied to the host
    opt:step()
  end
  r.memory = e:memory()
  return r
end

local function agree(a, b, what)
  assert_close(a.first, b.first, what .. ": the first step's shard gradients")
  for s = 1, 3 do
    assert.is_true(rel(a.losses[s], b.losses[s]) <= 1e-5, ("%s: loss %d %.9g vs %.9g"):format(what, s, a.losses[s], b.losses[s]))
    assert.is_true(rel(a.norms[s], b.norms[s]) <= 1e-6 or s > 1 and rel(a.norms[s], b.norms[s]) <= 1e-4,
      ("%s: norm %d %.9g vs %.9g"):format(what, s, a.norms[s], b.norms[s]))
  end
end

local dp = pg.ParallelContext{ data = W, seed = 7 }
local D, d = W, dp:local_rank("data")
local rows = B // D
local x, y = X:narrow(1, d * rows + 1, rows), Y:narrow(1, d * rows + 1, rows)

-- grads_bytes from the layout: with bucket_mb this small every parameter is
-- a bucket of its own, from its offset to the next one's (the last to the
-- padded end); the tied embedding (a head on the same stage borrows it) keeps
-- its staging, the others share slots of the largest other bucket.
local function layout_grad_bytes(e, slots)
  local ps = e:parameters()
  local padded = e:stats().flat_padded
  local pool, resident = 0, 0
  for i, p in ipairs(ps) do
    local len = (ps[i + 1] and ps[i + 1].offset or padded) - p.offset
    if p.name == "embed.wte" then resident = resident + len
    elseif len > pool then pool = len end
  end
  return 4 * (padded // D + slots * pool + resident)
end

if DEVICE ~= "cpu" then
  local function dev(o) o.shared_memory, o.device = false, DEVICE; return o end
  if pg.node().size > pg.cuda.device_count() then -- ranks sharing a GPU: zero3_spec checks the refusal
    describe("ZeRO-2 on ranks sharing a GPU", function() pending("needs a GPU per rank (NCCL)") end)
    return
  end
  describe(("ZeRO-2 on %d ranks on %s"):format(W, DEVICE), function()
    it("keeps the shard and the staging in device memory and reduces a bucket per parameter in backward", function()
      local one = train(dp, dev{ bucket_mb = 1e-9 }, 2, x, y) -- a bucket per parameter
      local st = one.engine:stats()
      assert.is_true(st.grad_staging_slots >= 1 and st.grad_staging_slots <= 3, "slots: " .. st.grad_staging_slots)
      assert.are.equal(layout_grad_bytes(one.engine, st.grad_staging_slots), one.memory.grads_bytes)
      assert.are.equal(#one.engine:parameters(), st.grad_buckets)
      assert.are.equal(st.grad_buckets - 1, st.grad_buckets_in_backward) -- the tied embedding's is resident
    end)

    it("accumulates over two calls (sync = false) with micro_batches = 2 as zero 1 does, to float rounding", function()
      local o = function() return dev{ micro_batches = 2 } end
      agree(train(dp, o(), 2, x, y, true), train(dp, o(), 1, x, y, true), "accumulated, micro_batches = 2")
    end)
  end)
  return
end

describe(("ZeRO-2 on %d ranks"):format(W), function()
  local z1 = train(dp, { shared_memory = false }, 1, x, y)
  local z2 = train(dp, { shared_memory = false }, 2, x, y)

  it("keeps the shard and the staging only, and says so in memory()", function()
    local one = train(dp, { shared_memory = false, bucket_mb = 1e-9 }, 2, x, y) -- a bucket per parameter
    local st = one.engine:stats()
    -- one slot being written, one whose reduce-scatter is in flight; a third when a module's parameters span two
    assert.is_true(st.grad_staging_slots >= 1 and st.grad_staging_slots <= 3, "slots: " .. st.grad_staging_slots)
    assert.are.equal(layout_grad_bytes(one.engine, st.grad_staging_slots), one.memory.grads_bytes)
    assert.is_true(z2.memory.grads_bytes < z1.memory.grads_bytes)
    assert.is_true(z2.memory.bytes_per_parameter < z1.memory.bytes_per_parameter,
      ("bytes per parameter: zero 2 %.3f, zero 1 %.3f"):format(z2.memory.bytes_per_parameter,
        z1.memory.bytes_per_parameter))
    assert.are.equal(4 * st.flat_padded, z1.memory.grads_bytes)
  end)

  it("gets ZeRO-1's result with one micro-batch, bit for bit", function()
    assert.is_true(z2.first:equal(z1.first), "the first step's shard gradients")
    for s = 1, 3 do assert.are.equal(z1.losses[s], z2.losses[s]) end
  end)

  it("averages to the gradients of the whole batch on one process", function()
    local alone = pg.parallelize(pg.nn.GPT(CFG), pg.ParallelContext{ self = true, seed = 7 }, {})
    alone:zero_grad()
    alone:forward_backward(X, Y)
    local _, whole = alone:flat()
    local e = pg.parallelize(pg.nn.GPT(CFG), dp, { shared_memory = false, bucket_mb = BUCKET_MB })
    local opt = pg.optim.AdamW(e, { zero = 2 })
    e:zero_grad()
    e:forward_backward(x, y)
    local st = opt:shard_state()
    local n = math.min(st.hi, whole:numel()) - st.lo
    if n > 0 then
      assert_close(st.grad:narrow(1, 1, n), whole:narrow(1, st.lo + 1, n), "the shard against the whole batch")
    end
  end)

  -- An optimizer made after a synced forward_backward: the engine reduced
  -- that call as ZeRO-0 does (it had no optimizer yet), and the shard it
  -- keeps is its part [lo, hi) of the reduced buffer. ZeRO-0 on the same
  -- seed, batch and reduction then holds the same gradients and takes the
  -- same AdamW step element by element (the same float32 formula on the
  -- same inputs; the all-gather copies): compared bit for bit, on private
  -- and on shared-memory buffers. The second step reduces in ZeRO-2's buckets
  -- (another order of the same sums): its loss to 1e-5 relative as above.
  it("made after a synced forward_backward, takes its shard of those gradients and steps as ZeRO-0", function()
    for _, shm in ipairs{ false, true } do
      local function run(late)
        local e = pg.parallelize(pg.nn.GPT(CFG), dp, { shared_memory = shm, bucket_mb = BUCKET_MB })
        local hp = { lr = 1e-2, weight_decay = 0.1, zero = late and 2 or 0 }
        local opt = not late and pg.optim.AdamW(e, hp) or nil
        e:zero_grad()
        local r = { loss = e:forward_backward(x, y) }
        if late then opt = pg.optim.AdamW(e, hp) else r.grads = select(2, e:flat()):clone() end
        local st = opt:shard_state()
        r.lo, r.hi, r.grad = st.lo, st.hi, st.grad:clone()
        opt:step()
        r.params = (e:flat()):clone()
        e:zero_grad()
        r.second = e:forward_backward(x, y)
        return r
      end
      local want, got = run(false), run(true)
      local what = ("shared_memory = %s"):format(tostring(shm))
      assert.are.equal(want.loss, got.loss, what .. ": the loss")
      assert.are.equal(D > 1 and (want.hi - want.lo) // D or want.hi - want.lo, got.hi - got.lo, what .. ": shard size")
      assert.is_true(got.grad:equal(want.grads:narrow(1, got.lo + 1, got.hi - got.lo)),
        ("%s: the shard [%d, %d) against ZeRO-0's gradients there (largest difference %g)"):format(what, got.lo, got.hi,
          got.grad:max_abs_diff(want.grads:narrow(1, got.lo + 1, got.hi - got.lo))))
      assert.is_true(got.params:equal(want.params),
        ("%s: parameters after the step (largest difference %g)"):format(what, got.params:max_abs_diff(want.params)))
      assert.is_true(rel(got.second, want.second) <= 1e-5,
        ("%s: the next loss %.9g, ZeRO-0 %.9g"):format(what, got.second, want.second))
    end
  end)

  it("reduces every micro-batch and agrees with ZeRO-1 (micro_batches = 2)", function()
    local a = train(dp, { shared_memory = false, micro_batches = 2 }, 2, x, y)
    local b = train(dp, { shared_memory = false, micro_batches = 2 }, 1, x, y)
    agree(a, b, "micro_batches = 2")
  end)

  it("accumulates over calls (sync = false reduces anyway) and agrees with ZeRO-1", function()
    local a = train(dp, { shared_memory = false }, 2, x, y, true)
    local b = train(dp, { shared_memory = false }, 1, x, y, true)
    agree(a, b, "accumulated")
  end)

  it("works without overlap_grad_reduce and on a shared-memory data group, keeping the saving", function()
    local a = train(dp, { shared_memory = false, overlap_grad_reduce = false }, 2, x, y)
    assert.is_true(a.first:equal(z2.first), "without overlap: the same reductions, waited for at once")
    local s = train(dp, {}, 2, x, y)
    local z1s = train(dp, {}, 1, x, y)
    agree(s, z1s, "shared memory")
    assert.is_true(s.memory.grads_bytes < z1s.memory.grads_bytes)
  end)

  it("refuses what needs the whole gradient, with one error each", function()
    local e = z2.engine
    local _, g = e:flat()
    assert.is_nil(g)
    assert.is_nil(e:parameters()[1].grad)
    local ok, err = pcall(e.gather_param, e, "embed.wte", true)
    assert.is_false(ok)
    assert.matches("with zero = 2 this rank keeps only its shard of the gradients", err, 1, true)
    ok, err = pcall(e.grads, e)
    assert.is_false(ok)
    assert.matches("engine:grads(): with zero = 2", err, 1, true)
    ok, err = pcall(pg.optim.AdamW, e, { zero = 0 })
    assert.is_false(ok)
    assert.matches("zero=0: this engine keeps only its shard of the gradients", err, 1, true)
    -- a module written in Lua writes its gradients through views of the whole buffer
    local m = { name = "custom", in_width = 16 }
    function m:parameters() return { { name = "w", shape = { 16 } } } end
    m.forward = function(_, _, xx) return xx end
    m.backward = function(_, _, dy) return dy end
    local lua_model = pg.nn.Sequential{ pg.nn.Embedding{ vocab = 61, dim = 16, name = "embed" }, m,
      pg.nn.LMHead{ vocab = 61, dim = 16, name = "head" } }
    local el = pg.parallelize(lua_model, dp, { shared_memory = false })
    ok, err = pcall(pg.optim.AdamW, el, { zero = 2 })
    assert.is_false(ok)
    assert.matches("module 'custom' (written in Lua) writes its parameters' gradients", err, 1, true)
  end)

  if W == 4 then
    local pd = pg.ParallelContext{ pipeline = 2, data = 2, seed = 7 }
    local dd = pd:local_rank("data")
    local xs, ys = X:narrow(1, dd * 4 + 1, 4), Y:narrow(1, dd * 4 + 1, 4)
    for _, v in ipairs{ 1, 2 } do
      it(("agrees with ZeRO-1 at P = 2 x D = 2, tied embedding, micro_batches = 2, virtual_stages = %d"):format(v),
        function()
          local o = function() return { micro_batches = 2, virtual_stages = v, shared_memory = false } end
          local a = train(pd, o(), 2, xs, ys)
          local b = train(pd, o(), 1, xs, ys)
          agree(a, b, "P = 2, V = " .. v)
          assert.is_true(a.memory.bytes_per_parameter < b.memory.bytes_per_parameter)
        end)
    end

    -- sequence parallelism: the norms' gradients are partial sums over the tensor group, their buckets stay
    -- resident and are reduce-scattered after the tensor group's sum
    it("agrees with ZeRO-1 at T = 2 x D = 2 with sequence parallelism, micro_batches = 2", function()
      local td = pg.ParallelContext{ tensor = 2, data = 2, seed = 7 }
      local d = td:local_rank("data")
      local o = function() return { micro_batches = 2, sequence_parallel = true, shared_memory = false } end
      local a = train(td, o(), 2, X:narrow(1, d * 4 + 1, 4), Y:narrow(1, d * 4 + 1, 4))
      local b = train(td, o(), 1, X:narrow(1, d * 4 + 1, 4), Y:narrow(1, d * 4 + 1, 4))
      agree(a, b, "T = 2 sequence parallel")
    end)
  end
end)
