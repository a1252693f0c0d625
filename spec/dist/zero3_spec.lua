-- worlds: 2 4 8
-- device worlds: 2
-- ZeRO-3 (zero = 3): every rank keeps only its shard of the parameters, of
-- the gradients (as ZeRO-2) and of the AdamW state; every module that owns
-- parameters is all-gathered over the data group before its forward and its
-- backward and freed after (docs/DESIGN.md "ZeRO-3"). Compared, same seed
-- and batch:
--   - with one process on the whole batch (the serial model): the losses of
--     three clipped AdamW steps within 1e-5 relative, the first step's shard
--     gradients within |got - want| <= 1e-5 |want| + 1e-6 max(1, max |want|)
--     (the data group's average adds the rows' terms in another order:
--     rounding of float32 sums, 1e-7 relative measured), the parameters
--     after three steps within 1e-4 (Adam turns rounding-level gradient
--     differences into update differences of at most a few lr-scaled ulps);
--   - with ZeRO-2 at the same layout: the same bits (a gather copies the
--     values a replica holds; the gradients go through the same buckets),
--     at D = W, micro_batches = 2, reshard_after_forward = false,
--     prefetch = false (the same gathers, each started when its module runs),
--     recomputation, accumulation over calls, a shared-memory data group,
--     precision bf16 (the GEMM weights gathered in bf16: rounding a shard
--     before the gather gives the bits rounding after it gave), a mixture of
--     experts (expert = 1),
--     and on 4 ranks P = 2 x D = 2 (both schedules) and T = 2 x D = 2 with
--     sequence parallelism;
--   - refused by name: modules written in Lua that own parameters,
--     reshard_after_forward or prefetch without zero 3, another stage on a
--     zero-3 engine (expert parallelism on the CPU: spec/dist/expert_parallel_spec.lua);
--   - with PG_TEST_DEVICE=cuda (the emulated device; D = 2): the shards,
--     the gradient staging and the gather slots are device memory, each
--     bucket reduced onto its owners and each unit gathered by NCCL on the
--     data group's stream. Zero 2 with one micro-batch has zero 1's bits on
--     the device (NCCL's sum of the same two terms, added into a zero
--     shard), zero 3 zero 2's (also precision bf16, micro_batches = 2);
--     zero 2 at micro_batches = 2 against zero 1 and zero 3 against the
--     serial cpu model within the tolerances above (the emulated cuBLAS
--     sums in double, the cpu's OpenBLAS in float32: float32 rounding of
--     the same sums, spec/unit/device_spec.lua); expert parallelism still
--     refused by name; a zero-3 checkpoint saved on the device loads at zero 1
--     on the device and on the cpu bit for bit, and zero 1's back at zero 3;
--   - on 8 ranks T = 2 x P = 2 x D = 2 against the serial model;
--   - memory: params_bytes is the shard plus two gather slots of the largest
--     module and the tied embedding's own (a head reads it outside its
--     owner's hooks), optimizer_bytes 8 bytes x shard, so that params +
--     grads + optimizer = 16 bytes x flat_padded / D + the gathered modules +
--     the gradient staging, exactly; flat_padded is the parameters plus at
--     most 15 floats of padding each (the 64-byte alignment) and the data
--     group's rounding;
--   - precision bf16: a call's gathers move 2 bytes for each element of a
--     weight read only as bf16 and 4 for the others, without the flat
--     buffer's gaps (the float32 gathers: 4 x each unit's range), and the
--     modules' bf16 working weights are gone (bf16_bytes is ZeRO-2's less 2
--     bytes x those weights), exactly.
local pg = require "pipegoose"
local h = require "helpers"

local W = pg.world_size()
local DEVICE = os.getenv("PG_TEST_DEVICE") or "cpu"
local RTOL, ATOL = 1e-5, 1e-6
local CFG = { vocab = 61, padded_vocab = 64, seq_len = 8, dim = 16, heads = 2, layers = 2 }
local B = 16
local HALF = B // 2 -- rows per data rank at D = 2

local X, Y = h.token_batch(1, B, CFG.seq_len, CFG.vocab), h.token_batch(2, B, CFG.seq_len, CFG.vocab)
local function rel(a, b) return math.abs(a - b) / math.max(math.abs(b), 1e-30) end

-- Three clipped AdamW steps: the losses, the first step's shard gradients, the engine and optimizer.
local function train(ctx, opts, hp, xs, ys, cfg)
  local e = pg.parallelize(pg.nn.GPT(cfg or CFG), ctx, opts)
  local o = pg.optim.AdamW(e, { lr = 1e-2, weight_decay = 0.1, zero = hp.zero, -- nil: the engine's
                                reshard_after_forward = hp.reshard_after_forward, prefetch = hp.prefetch })
  local r = { losses = {}, engine = e, opt = o }
  for s = 1, 3 do
    e:zero_grad()
    r.losses[s] = e:forward_backward(xs, ys)
    o:clip_grad_norm(1.0)
    if s == 1 then r.first = o:shard_state().grad:to("cpu"):clone() end -- a device shard is copied to the host
    o:step()
  end
  r.memory = e:memory()
  r.eval = e:loss(xs, ys)
  return r
end

-- Every parameter's full tensor (collective over the tensor and, with zero = 3, the data group).
local function gathered(e)
  local out = {}
  for _, p in ipairs(e:parameters()) do out[p.name] = e:gather_param(p.name) end
  return out
end

local function same_bits(a, b, what)
  for s = 1, 3 do assert.are.equal(b.losses[s], a.losses[s], ("%s: loss %d"):format(what, s)) end
  assert.is_true(a.first:equal(b.first), what .. ": the first step's shard gradients")
  assert.are.equal(b.eval, a.eval, what .. ": the evaluation loss after the steps")
  local pa, pb = gathered(a.engine), gathered(b.engine)
  for name, t in pairs(pb) do
    assert.is_true(pa[name]:equal(t), ("%s: parameter %s after three steps (largest difference %g)"):format(what, name,
      pa[name]:max_abs_diff(t)))
  end
end

-- The gather units from the layout: the stage's top-level modules (the embedding, each block, the final norm:
-- the names' first part, a block's with its number); a unit spans its parameters' flat range. The embedding (the
-- tied head reads its weight) keeps its own buffer.
local function layout_units(e)
  local units, order = {}, {}
  for _, p in ipairs(e:parameters()) do
    local m = p.name:match("^blocks%.%d+") or p.name:match("^[^.]+")
    local n = 1
    for _, s in ipairs(p.shape) do n = n * s end
    if not units[m] then units[m] = { lo = p.offset, hi = 0 }; order[#order + 1] = m end
    local u = units[m]
    u.lo, u.hi = math.min(u.lo, p.offset), math.max(u.hi, p.offset + n)
  end
  local largest, resident = 0, 0
  for _, m in ipairs(order) do
    local n = units[m].hi - units[m].lo
    if m == "embed" then resident = resident + n elseif n > largest then largest = n end
  end
  return #order, largest, resident
end

local dp = pg.ParallelContext{ data = W, seed = 7 }
local D, d = W, dp:local_rank("data")
local rows = B // D
local x, y = X:narrow(1, d * rows + 1, rows), Y:narrow(1, d * rows + 1, rows)
local PRIVATE = function(o) o = o or {}; o.shared_memory = false; return o end

-- Checkpoint round trips: a directory every rank of dp names alike, a Trainer over `steps` AdamW steps at `zero`
-- (engine options `opts`), and the check that two trainers hold the same parameters, moments and step, bit for
-- bit (device tensors compared on the host).
local function checkpoint_dir(tag)
  local t = pg.tensor({ (pg.checkpoint.getpid() * 7919 + os.time()) % 1000000007 }, { dtype = "int32" })
  pg.dist.broadcast(t, { ctx = dp, src = 0 })
  return ("%s/pg-%s-%d"):format(os.getenv("TMPDIR") or "/tmp", tag, math.tointeger(t:item()))
end

local function checkpoint_trainer(dir, zero, steps, opts)
  local e = pg.parallelize(pg.nn.GPT(CFG), dp, opts)
  local o = pg.optim.AdamW(e, { lr = 1e-2, weight_decay = 0.1, zero = zero })
  for _ = 1, steps do
    e:zero_grad()
    e:forward_backward(x, y)
    o:step()
  end
  return pg.Trainer{ engine = e, optimizer = o, max_steps = 1, out = pg.testing.capture(), out_dir = dir }
end

local function same_state(a, b, what)
  local pa, pb = gathered(a.engine), gathered(b.engine)
  for name, want in pairs(pa) do assert.is_true(pb[name]:to("cpu"):equal(want:to("cpu")), what .. ": parameter " .. name) end
  local sa, sb = a.optimizer:shard_state(), b.optimizer:shard_state()
  assert.same({ sa.step, sa.lo, sa.hi }, { sb.step, sb.lo, sb.hi })
  assert.is_true(sa.m:to("cpu"):equal(sb.m:to("cpu")) and sa.v:to("cpu"):equal(sb.v:to("cpu")), what .. ": m and v")
end

if DEVICE ~= "cpu" then
  local DEV = function(o) o = PRIVATE(o); o.device = DEVICE; return o end
  -- ranks sharing a GPU (gpu_check.sh on one GPU) have no NCCL: their collectives are staged, zero 2 and 3 refused
  if pg.node().size > pg.cuda.device_count() then
    describe(("ZeRO-2 and ZeRO-3 on %d ranks sharing a GPU"):format(W), function()
      it("is refused by name", function()
        for _, z in ipairs{ 2, 3 } do
          local ok, err = pcall(pg.optim.AdamW, pg.parallelize(pg.nn.GPT(CFG), dp, DEV()), { zero = z })
          assert.is_false(ok)
          assert.matches(("zero = %d on the cuda backend reduces and gathers over the data group's NCCL stream"):format(z),
            err, 1, true)
        end
      end)
    end)
    return
  end
  describe(("ZeRO-2 and ZeRO-3 on %d ranks on %s"):format(W, DEVICE), function()
    local z1 = train(dp, DEV(), { zero = 1 }, x, y)
    local z2 = train(dp, DEV(), { zero = 2 }, x, y)
    local z3 = train(dp, DEV(), { zero = 3 }, x, y)

    it("gets zero 1's bits with zero 2 (one micro-batch) and zero 2's with zero 3", function()
      same_bits(z2, z1, "zero 2 against zero 1 on the device")
      same_bits(z3, z2, "zero 3 against zero 2 on the device")
    end)

    it("trains as the serial model on the cpu", function()
      local alone = train(pg.ParallelContext{ self = true, seed = 7 }, {}, { zero = 0 }, X, Y)
      for s = 1, 3 do
        assert.is_true(rel(z3.losses[s], alone.losses[s]) <= 1e-5,
          ("loss %d: %.9g, serial %.9g"):format(s, z3.losses[s], alone.losses[s]))
      end
      local st = z3.opt:shard_state()
      local n = math.min(st.hi, alone.first:numel()) - st.lo
      assert.is_true(n > 0)
      h.assert_scaled_close(z3.first:narrow(1, 1, n), alone.first:narrow(1, st.lo + 1, n), "the shard's gradients",
        RTOL, ATOL, true)
      for name, t in pairs(gathered(z3.engine)) do
        local want = alone.engine:gather_param(name)
        assert.is_true(t:max_abs_diff(want) <= 1e-4, ("%s after three steps: off by %g"):format(name, t:max_abs_diff(want)))
      end
      assert.is_true(rel(z3.eval, alone.eval) <= 1e-5, "the evaluation loss")
    end)

    it("reduces every bucket during backward and keeps device shards, staging and gather slots", function()
      local s2, s3 = z2.engine:stats(), z3.engine:stats()
      -- every bucket but the tied embedding's (resident: the head writes it before the embedding does)
      assert.are.equal(2, s2.grad_buckets)
      assert.are.equal(1, s2.grad_buckets_in_backward)
      assert.are.equal("cuda", z3.opt:shard_state().param:device():match("^%a+"))
      assert.are.equal("cuda", z2.opt:shard_state().grad:device():match("^%a+"))
      local nunits, largest, resident = layout_units(z3.engine)
      assert.are.equal(nunits, s3.gather_units)
      assert.are.equal(4 * (s3.flat_padded // D + 2 * largest + resident), z3.memory.params_bytes)
      -- the gradients: the shard and staging of the same layout on the cpu (zero2_spec checks those from the
      -- layout); memory() says before the first step what training holds
      local e = pg.parallelize(pg.nn.GPT(CFG), dp, PRIVATE())
      pg.optim.AdamW(e, { zero = 2 })
      assert.are.equal(e:memory().grads_bytes, z2.memory.grads_bytes)
      assert.are.equal(z2.memory.grads_bytes, z3.memory.grads_bytes)
      assert.are.equal(4 * s3.flat_padded, z1.memory.grads_bytes)
    end)

    it("gets zero 2's bits with zero 3 under precision bf16 (bf16 gathers), micro_batches = 2; zero 1's within "
      .. "the tolerances", function()
      local o = function() return DEV{ precision = "bf16", micro_batches = 2 } end
      local a1, a2, a3 = train(dp, o(), { zero = 1 }, x, y), train(dp, o(), { zero = 2 }, x, y),
        train(dp, o(), { zero = 3 }, x, y)
      same_bits(a3, a2, "bf16, micro_batches = 2")
      assert.is_true(a3.engine:stats().gather_bf16_elems > 0)
      h.assert_scaled_close(a2.first, a1.first, "zero 2 against zero 1: the first step's shard", RTOL, ATOL, true)
      for s = 1, 3 do
        assert.is_true(rel(a2.losses[s], a1.losses[s]) <= 1e-5,
          ("loss %d: zero 2 %.9g, zero 1 %.9g"):format(s, a2.losses[s], a1.losses[s]))
      end
    end)

    -- The device's checkpoint is the cpu's files: a zero-3 run on the device saves its device shards; zero 1 on
    -- the device and zero 1 on the cpu load them with the same parameters, moments and step, bit for bit (a
    -- save copies device memory to the host, a load back: no arithmetic), and zero 1's save loads back at zero 3.
    it("saves a checkpoint that zero 1 on the device and on the cpu load bit for bit, and back", function()
      local ckpt = pg.checkpoint
      local dir = checkpoint_dir("zero3-dev")
      local function trainer(zero, steps, opts) return checkpoint_trainer(dir, zero, steps, opts) end
      local z3t = trainer(3, 3, DEV())
      assert.are.equal("cuda", z3t.optimizer:shard_state().m:device():match("^%a+"))
      ckpt.save(z3t, dir .. "/from3")
      local z1d = trainer(1, 0, DEV())
      ckpt.load(z1d, dir .. "/from3")
      same_state(z3t, z1d, "zero 3 on the device -> zero 1 on the device")
      local z1c = trainer(1, 0, PRIVATE())
      ckpt.load(z1c, dir .. "/from3")
      same_state(z3t, z1c, "zero 3 on the device -> zero 1 on the cpu")
      ckpt.save(z1d, dir .. "/from1")
      local z3b = trainer(3, 0, DEV())
      ckpt.load(z3b, dir .. "/from1")
      same_state(z1d, z3b, "zero 1 on the device -> zero 3 on the device")
      dp:barrier()
      if dp:rank() == 0 then os.execute("rm -rf '" .. dir .. "'") end
    end)

    -- the experts' region of zero 2 and 3 is sharded in host memory only (its reduced terms divided by E there):
    -- refused on the device by name, at zero 2 through the optimizer and at zero 3 at construction
    it("still refuses expert parallelism by name", function()
      local moe = function() return pg.nn.Mixtral{ vocab = 61, padded_vocab = 64, seq_len = 8, dim = 16, heads = 2,
        kv_heads = 2, hidden = 24, layers = 1, experts = 2, top_k = 1 } end
      local ctx = pg.ParallelContext{ data = W, expert = 2, seed = 1 }
      local ok, err = pcall(pg.parallelize, moe(), ctx, DEV{ zero = 3 })
      assert.is_false(ok)
      assert.matches("zero = 3 with expert parallelism on the cuda backend is not supported yet", err, 1, true)
      ok, err = pcall(pg.optim.AdamW, pg.parallelize(moe(), ctx, DEV()), { zero = 2 })
      assert.is_false(ok)
      assert.matches("zero = 2 with expert parallelism on the cuda backend is not supported yet", err, 1, true)
    end)
  end)
  return
end

describe(("ZeRO-3 on %d ranks"):format(W), function()
  local z3 = train(dp, PRIVATE(), { zero = 3 }, x, y)
  local z2 = train(dp, PRIVATE(), { zero = 2 }, x, y)

  it("trains as the serial model on the whole batch", function()
    local alone = train(pg.ParallelContext{ self = true, seed = 7 }, {}, { zero = 0 }, X, Y)
    for s = 1, 3 do
      assert.is_true(rel(z3.losses[s], alone.losses[s]) <= 1e-5,
        ("loss %d: %.9g, serial %.9g"):format(s, z3.losses[s], alone.losses[s]))
    end
    -- the first step's gradients: this rank's shard against the serial model's flat buffer there
    local st = z3.opt:shard_state()
    local serial = alone.engine
    local e = pg.parallelize(pg.nn.GPT(CFG), pg.ParallelContext{ self = true, seed = 7 }, {})
    e:zero_grad()
    e:forward_backward(X, Y)
    local _, whole = e:flat()
    local n = math.min(st.hi, whole:numel()) - st.lo
    assert.is_true(n > 0)
    h.assert_scaled_close(z3.first:narrow(1, 1, n), whole:narrow(1, st.lo + 1, n), "the shard's gradients", RTOL, ATOL,
      true)
    -- the parameters after three steps: the shard and every gathered tensor
    local params = serial:flat()
    assert.is_true(st.param:narrow(1, 1, n):max_abs_diff(params:narrow(1, st.lo + 1, n)) <= 1e-4,
      "the shard's parameters after three steps")
    for name, t in pairs(gathered(z3.engine)) do
      local want = serial:gather_param(name)
      assert.is_true(t:max_abs_diff(want) <= 1e-4, ("%s after three steps: off by %g"):format(name, t:max_abs_diff(want)))
    end
    assert.is_true(rel(z3.eval, alone.eval) <= 1e-5, "the evaluation loss")
  end)

  it("gets ZeRO-2's bits: the gathers copy what a replica holds", function()
    same_bits(z3, z2, "zero 3 against zero 2")
  end)

  -- pg.parallelize{zero = 3}: the shards are made at construction, each parameter's initialised alone (a pure
  -- function of the seed, its name and the element's index), never the whole stage: the same values, bits and
  -- memory as the engine sharded by its optimizer
  it("shards at construction with pg.parallelize{zero = 3}, with the same bits and memory", function()
    local built = train(dp, PRIVATE{ zero = 3 }, {}, x, y)
    assert.are.equal(3, built.opt.zero)
    same_bits(built, z3, "sharded at construction")
    assert.same(z3.memory, built.memory)
    local ok, err = pcall(pg.parallelize, pg.nn.GPT(CFG), dp, { zero = 2 })
    assert.is_false(ok)
    assert.matches("3 (ZeRO-3 from construction; stages 1 and 2 are pg.optim.AdamW's zero)", err, 1, true)
    ok, err = pcall(pg.optim.AdamW, pg.parallelize(pg.nn.GPT(CFG), dp, PRIVATE{ zero = 3 }), { zero = 1 })
    assert.is_false(ok)
    assert.matches("zero=1: this engine keeps only its shard of the parameters", err, 1, true)
  end)

  -- six blocks: two gathered blocks and the embedding are less than the (D - 1) / D of the model a shard saves
  it("keeps the shard and the largest gathered modules only, and says so in memory()", function()
    local deep = { vocab = 61, padded_vocab = 64, seq_len = 8, dim = 16, heads = 2, layers = 6 }
    local z3, z2 = train(dp, PRIVATE(), { zero = 3 }, x, y, deep), train(dp, PRIVATE(), { zero = 2 }, x, y, deep)
    local info = z3.engine:stats()
    local nunits, largest, resident = layout_units(z3.engine)
    local padded = info.flat_padded
    assert.are.equal(nunits, info.gather_units)
    assert.are.equal(largest, info.gather_slot_elems)
    assert.are.equal(resident, info.gather_resident_elems)
    assert.are.equal(2, info.gather_slots) -- the unit computing and the one prefetched
    local m = z3.memory
    assert.are.equal(4 * (padded // D + 2 * largest + resident), m.params_bytes)
    assert.are.equal(8 * (padded // D), m.optimizer_bytes)
    -- the gradients: ZeRO-2's shard and staging
    assert.are.equal(z2.memory.grads_bytes, m.grads_bytes)
    local staging = m.grads_bytes - 4 * (padded // D)
    local total = m.params_bytes + m.grads_bytes + m.optimizer_bytes
    assert.are.equal(16 * (padded // D) + 4 * (2 * largest + resident) + staging, total)
    -- 16 bytes per parameter over D, up to the padding
    local nparams = #z3.engine:parameters()
    assert.is_true(padded >= m.local_parameters and padded - m.local_parameters <= 15 * nparams + 16 * D,
      ("flat_padded %d, parameters %d"):format(padded, m.local_parameters))
    assert.is_true(m.params_bytes < z2.memory.params_bytes)
    assert.is_true(m.bytes_per_parameter < z2.memory.bytes_per_parameter,
      ("bytes per parameter: zero 3 %.3f, zero 2 %.3f"):format(m.bytes_per_parameter, z2.memory.bytes_per_parameter))
    assert.is_true(m.activation_bytes > 0)
  end)

  it("gathers each module twice per micro-batch, or once per call with reshard_after_forward = false", function()
    local o = function() return PRIVATE{ micro_batches = 2 } end
    local a = train(dp, o(), { zero = 3 }, x, y)
    local b = train(dp, o(), { zero = 3, reshard_after_forward = false }, x, y)
    local c = train(dp, o(), { zero = 2 }, x, y)
    local ga, gb = a.engine:stats().unit_gathers, b.engine:stats().unit_gathers
    same_bits(a, c, "micro_batches = 2")
    same_bits(b, c, "micro_batches = 2, reshard_after_forward = false")
    local nunits = a.engine:stats().gather_units
    -- three steps (forward and backward of two micro-batches) and one evaluation (forward of two: a training
    -- micro-batch's rows each); the embedding is gathered once a call
    local per_step = 2 * 2 * (nunits - 1) + 1
    assert.are.equal(3 * per_step + 2 * (nunits - 1) + 1, ga)
    assert.are.equal(4 * nunits, gb)
    assert.is_false(b.engine:stats().reshard_after_forward)
    assert.is_true(a.engine:stats().prefetch)
    -- without prefetch: the same gathers and bits, each gather started when its module runs
    local d = train(dp, o(), { zero = 3, prefetch = false }, x, y)
    assert.are.equal(ga, d.engine:stats().unit_gathers) -- read before same_bits gathers parameters to compare
    same_bits(d, c, "micro_batches = 2, prefetch = false")
    assert.is_false(d.engine:stats().prefetch)
    assert.is_true(b.engine:stats().gather_slots >= nunits - 1, "every unit held to the end of the call")
  end)

  it("accumulates over calls (sync = false) and runs on a shared-memory data group, as zero 2", function()
    local function accumulated(zero, opts)
      local e = pg.parallelize(pg.nn.GPT(CFG), dp, opts)
      local o = pg.optim.AdamW(e, { lr = 1e-2, zero = zero })
      local r = { losses = {}, engine = e, opt = o }
      for s = 1, 3 do
        e:zero_grad()
        local half = rows // 2
        e:forward_backward(x:narrow(1, 1, half), y:narrow(1, 1, half), { grad_scale = 0.5, sync = false })
        r.losses[s] = e:forward_backward(x:narrow(1, half + 1, half), y:narrow(1, half + 1, half), { grad_scale = 0.5 })
        if s == 1 then r.first = o:shard_state().grad:clone() end
        o:step()
      end
      r.eval = e:loss(x, y)
      return r
    end
    same_bits(accumulated(3, PRIVATE()), accumulated(2, PRIVATE()), "accumulated")
    same_bits(accumulated(3, {}), accumulated(2, {}), "shared memory")
  end)

  -- precision bf16: the weights read only as bf16 gathered in bf16, which the modules' products read as the
  -- working weights they rounded themselves under zero 2
  it("gets ZeRO-2's bits under precision bf16, micro_batches = 2", function()
    local o = function() return PRIVATE{ precision = "bf16", micro_batches = 2 } end
    same_bits(train(dp, o(), { zero = 3 }, x, y), train(dp, o(), { zero = 2 }, x, y), "bf16")
  end)

  it("gathers in bf16 under precision bf16 and keeps no whole bf16 working copy", function()
    local function run(precision, zero)
      local e = pg.parallelize(pg.nn.GPT(CFG), dp, PRIVATE{ precision = precision })
      local hp = { lr = 1e-2, zero = zero }
      if zero == 3 then hp.reshard_after_forward = false end
      pg.optim.AdamW(e, hp)
      dp:reset_comm_stats()
      e:zero_grad()
      e:forward_backward(x, y) -- reshard_after_forward = false: each unit gathered once
      return { gathered = dp:comm_stats().data.all_gather.bytes, memory = e:memory(), info = e:stats(), engine = e }
    end
    local f32, b16, z2 = run("fp32", 3), run("bf16", 3), run("bf16", 2)
    local span, elems = 0, 0 -- the units' ranges, and their parameters' elements
    local units = {}
    for _, p in ipairs(b16.engine:parameters()) do
      local m = p.name:match("^blocks%.%d+") or p.name:match("^[^.]+")
      local n = 1
      for _, s in ipairs(p.shape) do n = n * s end
      elems = elems + n
      local u = units[m] or { lo = p.offset, hi = 0 }
      u.lo, u.hi, units[m] = math.min(u.lo, p.offset), math.max(u.hi, p.offset + n), u
    end
    for _, u in pairs(units) do span = span + u.hi - u.lo end
    local m = b16.info
    assert.is_true(m.gather_bf16_elems > 0)
    assert.are.equal(elems, m.gather_bf16_elems + m.gather_float_elems)
    assert.are.equal(4 * span, f32.gathered)
    assert.are.equal(2 * m.gather_bf16_elems + 4 * m.gather_float_elems, b16.gathered)
    assert.are.equal(z2.memory.bf16_bytes - 2 * m.gather_bf16_elems, b16.memory.bf16_bytes)
    assert.is_true(m.gather_slot_elems < f32.info.gather_slot_elems)
    assert.are.equal(4 * (m.flat_padded // D + m.gather_slots * m.gather_slot_elems + m.gather_resident_elems),
      b16.memory.params_bytes)
  end)

  -- a mixture of experts (its experts replicated over the data group: expert = 1) gathers its block as any other
  it("gets ZeRO-2's bits with a mixture of experts (expert = 1)", function()
    local function run(zero)
      local e = pg.parallelize(pg.nn.Mixtral{ vocab = 61, padded_vocab = 64, seq_len = 8, dim = 16, heads = 2,
        kv_heads = 2, hidden = 24, layers = 2, experts = 4, top_k = 2, aux_loss_coef = 0.02 }, dp, PRIVATE())
      local o = pg.optim.AdamW(e, { lr = 1e-2, zero = zero })
      local r = { losses = {}, engine = e, opt = o }
      for s = 1, 3 do
        e:zero_grad()
        r.losses[s] = e:forward_backward(x, y)
        if s == 1 then r.first = o:shard_state().grad:clone() end
        o:step()
      end
      r.eval = e:loss(x, y)
      return r
    end
    same_bits(run(3), run(2), "mixture of experts")
  end)

  it("finds a block's parameters gathered where recomputation reruns its forward inside its backward", function()
    local a = train(dp, PRIVATE{ recompute = "full" }, { zero = 3 }, x, y)
    local b = train(dp, PRIVATE{ recompute = "full" }, { zero = 2 }, x, y)
    local gathers = a.engine:stats().unit_gathers
    same_bits(a, b, "recompute = full")
    local nunits = a.engine:stats().gather_units
    -- a block is gathered for its forward and for its backward, which reruns its forward on those parameters
    assert.are.equal(3 * (2 * (nunits - 1) + 1) + nunits, gathers)
  end)

  it("refuses what it cannot serve, with one error each", function()
    local e = z3.engine
    assert.is_nil(e:parameters()[1].tensor)
    local ok, err = pcall(e.flat, e)
    assert.is_false(ok)
    assert.matches("engine:flat(): with zero = 3 this rank keeps only its shard", err, 1, true)
    ok, err = pcall(e.grads, e)
    assert.is_false(ok)
    assert.matches("engine:grads(): with zero = 3", err, 1, true)
    ok, err = pcall(pg.optim.AdamW, e, { zero = 1 })
    assert.is_false(ok)
    assert.matches("zero=1: this engine keeps only its shard of the parameters", err, 1, true)
    ok, err = pcall(pg.optim.AdamW, pg.parallelize(pg.nn.GPT(CFG), dp, PRIVATE()),
      { zero = 1, reshard_after_forward = false })
    assert.is_false(ok)
    assert.matches("reshard_after_forward is an option of zero = 3", err, 1, true)
    ok, err = pcall(pg.optim.AdamW, pg.parallelize(pg.nn.GPT(CFG), dp, PRIVATE()), { zero = 2, prefetch = false })
    assert.is_false(ok)
    assert.matches("prefetch is an option of zero = 3", err, 1, true)
    -- a module written in Lua writes its gradients through views of the whole buffers
    local m = { name = "custom", in_width = 16 }
    function m:parameters() return { { name = "w", shape = { 16 } } } end
    m.forward = function(_, _, xx) return xx end
    m.backward = function(_, _, dy) return dy end
    local lua_model = pg.nn.Sequential{ pg.nn.Embedding{ vocab = 61, dim = 16, name = "embed" }, m,
      pg.nn.LMHead{ vocab = 61, dim = 16, name = "head" } }
    ok, err = pcall(pg.optim.AdamW, pg.parallelize(lua_model, dp, PRIVATE()), { zero = 3 })
    assert.is_false(ok)
    assert.matches("zero = 3 keeps only a shard of the gradients, but module 'custom' (written in Lua)", err, 1, true)
    ok, err = pcall(pg.optim.AdamW, e, { zero = 4 })
    assert.is_false(ok)
    assert.matches("zero must be 0, 1, 2 or 3, got 4", err, 1, true)
  end)

  -- A checkpoint is the files of zero 1 and 2 (one optimizer file per data rank, the parameters written by data
  -- rank 0 after a gather of each): it loads at zero 1 with the same parameters, moments and step, bit for bit,
  -- zero 1's loads back at zero 3 the same way, and zero 3's resliced into one process (zero 0) too.
  it("saves a checkpoint that loads at zero 1 and back, bit for bit, and exports the model", function()
    local ckpt = pg.checkpoint
    local dir = checkpoint_dir("zero3")
    local function trainer(zero, steps) return checkpoint_trainer(dir, zero, steps, PRIVATE()) end
    local z3t = trainer(3, 3)
    ckpt.save(z3t, dir .. "/from3")
    local z1t = trainer(1, 0)
    ckpt.load(z1t, dir .. "/from3")
    same_state(z3t, z1t, "zero 3 -> zero 1")
    local z1b = trainer(1, 2)
    ckpt.save(z1b, dir .. "/from1")
    local z3b = trainer(3, 0)
    ckpt.load(z3b, dir .. "/from1")
    same_state(z1b, z3b, "zero 1 -> zero 3")
    -- resliced into one process (zero 0): the same parameters and moments
    local se = pg.parallelize(pg.nn.GPT(CFG), pg.ParallelContext{ self = true, seed = 7 }, {})
    local so = pg.optim.AdamW(se, { lr = 1e-2, weight_decay = 0.1 })
    local serial = pg.Trainer{ engine = se, optimizer = so, max_steps = 1, out = pg.testing.capture(), out_dir = dir }
    ckpt.load(serial, dir .. "/from3")
    for name, want in pairs(gathered(z3t.engine)) do
      assert.is_true(se:gather_param(name):equal(want), "zero 3 -> one process: parameter " .. name)
    end
    local s3, s0 = z3t.optimizer:shard_state(), so:shard_state()
    local n = math.min(s3.hi, s0.hi) - s3.lo
    assert.is_true(n > 0 and s3.m:narrow(1, 1, n):equal(s0.m:narrow(1, s3.lo + 1, n))
      and s3.v:narrow(1, 1, n):equal(s0.v:narrow(1, s3.lo + 1, n)), "zero 3 -> one process: this shard's m and v")
    -- whole-model files gather every parameter over the data group for rank 0: zero 1's bytes
    z3t.engine:save_llmc(dir .. "/z3.bin")
    z1t.engine:save_llmc(dir .. "/z1.bin")
    if dp:rank() == 0 then
      local a, b = io.open(dir .. "/z3.bin", "rb"), io.open(dir .. "/z1.bin", "rb")
      local ba, bb = a:read("a"), b:read("a")
      a:close()
      b:close()
      assert.is_true(#ba > 0 and ba == bb, "save_llmc at zero 3 and at zero 1 after loading its checkpoint")
    end
    dp:barrier()
    if dp:rank() == 0 then os.execute("rm -rf '" .. dir .. "'") end
  end)

  if W == 8 then
    it("trains as the serial model at T = 2 x P = 2 x D = 2, micro_batches = 2", function()
      local c = pg.ParallelContext{ tensor = 2, pipeline = 2, data = 2, seed = 7 }
      local dc = c:local_rank("data")
      local cfg = { vocab = 61, padded_vocab = 64, seq_len = 8, dim = 16, heads = 2, layers = 4 }
      local a = train(c, PRIVATE{ micro_batches = 2 }, { zero = 3 }, X:narrow(1, dc * HALF + 1, HALF),
        Y:narrow(1, dc * HALF + 1, HALF), cfg)
      local alone = train(pg.ParallelContext{ self = true, seed = 7 }, {}, { zero = 0 }, X, Y, cfg)
      for s = 1, 3 do
        assert.is_true(rel(a.losses[s], alone.losses[s]) <= 1e-5,
          ("loss %d: %.9g, serial %.9g"):format(s, a.losses[s], alone.losses[s]))
      end
      for name, t in pairs(gathered(a.engine)) do
        if alone.engine:parameter(name) then -- not the last stage's copy of the tied embedding
          local want = alone.engine:gather_param(name)
          assert.is_true(t:max_abs_diff(want) <= 1e-4, ("%s after three steps: off by %g"):format(name,
            t:max_abs_diff(want)))
        end
      end
    end)
  end

  if W == 4 then
    local pd = pg.ParallelContext{ pipeline = 2, data = 2, seed = 7 }
    local dd = pd:local_rank("data")
    local xs, ys = X:narrow(1, dd * HALF + 1, HALF), Y:narrow(1, dd * HALF + 1, HALF)
    for _, v in ipairs{ 1, 2 } do
      it(("gets ZeRO-2's bits at P = 2 x D = 2, tied embedding, micro_batches = 2, virtual_stages = %d"):format(v),
        function()
          local o = function() return PRIVATE{ micro_batches = 2, virtual_stages = v } end
          local cfg = { vocab = 61, padded_vocab = 64, seq_len = 8, dim = 16, heads = 2, layers = 4 }
          local a = train(pd, o(), { zero = 3 }, xs, ys, cfg)
          local b = train(pd, o(), { zero = 2 }, xs, ys, cfg)
          same_bits(a, b, "P = 2, V = " .. v)
          local alone = train(pg.ParallelContext{ self = true, seed = 7 }, {}, { zero = 0 }, X, Y, cfg)
          for s = 1, 3 do
            assert.is_true(rel(a.losses[s], alone.losses[s]) <= 1e-5,
              ("loss %d: %.9g, serial %.9g"):format(s, a.losses[s], alone.losses[s]))
          end
          local st = a.engine:stats()
          assert.are.equal(4 * (st.flat_padded // 2 + st.gather_slots * st.gather_slot_elems + st.gather_resident_elems),
            a.memory.params_bytes)
        end)
    end

    it("gets ZeRO-2's bits at T = 2 x D = 2 with sequence parallelism, micro_batches = 2", function()
      local td = pg.ParallelContext{ tensor = 2, data = 2, seed = 7 }
      local dt = td:local_rank("data")
      local o = function() return PRIVATE{ micro_batches = 2, sequence_parallel = true } end
      local xs2, ys2 = X:narrow(1, dt * HALF + 1, HALF), Y:narrow(1, dt * HALF + 1, HALF)
      local a = train(td, o(), { zero = 3 }, xs2, ys2)
      local b = train(td, o(), { zero = 2 }, xs2, ys2)
      same_bits(a, b, "T = 2 sequence parallel")
      local alone = train(pg.ParallelContext{ self = true, seed = 7 }, {}, { zero = 0 }, X, Y)
      for s = 1, 3 do
        assert.is_true(rel(a.losses[s], alone.losses[s]) <= 1e-5,
          ("loss %d: %.9g, serial %.9g"):format(s, a.losses[s], alone.losses[s]))
      end
    end)
  end
end)
