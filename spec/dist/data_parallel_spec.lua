-- worlds: 2 4 8
-- device worlds: 2 8
-- Data parallelism and ZeRO-1 against the serial model on the whole batch,
-- and all three dimensions together on 8 ranks. With PG_TEST_DEVICE=cuda
-- (make test runs it so on the emulated device) the parallel engines run on
-- the device and are compared with the same serial run on the CPU.
local pg = require "pipegoose"

local world = pg.world_size()
local CFG = { vocab = 61, padded_vocab = 64, seq_len = 16, dim = 32, heads = 4, layers = 2 }
local GLOBAL_BATCH, STEPS = 8, 20
local DEVICE = os.getenv("PG_TEST_DEVICE") or "cpu"

-- A fixed global batch of random ids, the same on every rank.
local function batch()
  local x, y = {}, {}
  local r = pg.randn({ GLOBAL_BATCH, CFG.seq_len + 1 }, { seed = 11 }):totable()
  for b = 1, GLOBAL_BATCH do
    x[b], y[b] = {}, {}
    for t = 1, CFG.seq_len do
      x[b][t] = math.floor(math.abs(r[b][t]) * 1000) % CFG.vocab
      y[b][t] = math.floor(math.abs(r[b][t + 1]) * 1000) % CFG.vocab
    end
  end
  return pg.tensor(x, { dtype = "int32" }), pg.tensor(y, { dtype = "int32" })
end
local X, Y = batch()

local function adamw(engine, zero)
  return pg.optim.AdamW(engine, { lr = 1e-3, betas = { 0.9, 0.95 }, weight_decay = 0.1, zero = zero })
end

-- Serial reference on this process alone: the whole batch, one rank.
local function serial_run()
  local ctx = pg.ParallelContext{ self = true, seed = 5 }
  local engine = pg.parallelize(pg.nn.GPT(CFG), ctx)
  local opt = adamw(engine, 0)
  local losses = {}
  for s = 1, STEPS do
    engine:zero_grad()
    losses[s] = engine:forward_backward(X, Y)
    opt:clip_grad_norm(1.0)
    opt:step()
  end
  local params = {}
  for _, p in ipairs(engine:parameters()) do params[p.name] = p.tensor:clone() end
  return losses, params
end
local serial_losses, serial_params = serial_run()

local function run(ctx, opts, zero)
  opts.device = DEVICE
  local engine = pg.parallelize(pg.nn.GPT(CFG), ctx, opts)
  local opt = adamw(engine, zero)
  local D, d = ctx:world_size("data"), ctx:local_rank("data")
  local rows = GLOBAL_BATCH // D
  local x, y = X:narrow(1, d * rows + 1, rows), Y:narrow(1, d * rows + 1, rows)
  local losses = {}
  for s = 1, STEPS do
    engine:zero_grad()
    losses[s] = engine:forward_backward(x, y)
    opt:clip_grad_norm(1.0)
    opt:step()
  end
  return engine, opt, losses
end

-- Tolerances: D ranks average D partial means where the serial run takes one
-- mean (and T ranks split sums), so gradients differ by float rounding (~1e-7
-- relative); 20 AdamW steps carry that into losses at ~1e-6 relative. Adam
-- normalises each element's update, so an element whose gradient is near zero
-- can move differently by up to lr per step (a rounding-level sign change; the
-- key bias, whose true gradient is exactly zero, is all such elements): per
-- tensor, the RMS difference must be within 1e-5 of the tensor's RMS plus an
-- absolute 1e-5 (1% of lr), and the largest single difference within lr = 1e-3.
local LOSS_RTOL, PARAM_RTOL, PARAM_ATOL, PARAM_MAX = 1e-5, 1e-5, 1e-5, 1e-3

local function rms(t) return math.sqrt(t:mul(t):sum() / t:numel()) end

local function assert_matches_serial(engine, losses, ctx)
  for s = 1, STEPS do assert.near(serial_losses[s], losses[s], LOSS_RTOL * serial_losses[s], "step " .. s) end
  for _, p in ipairs(engine:parameters()) do
    if not p.tied_copy then
      local full = engine:gather_param(p.name)
      local ref = serial_params[p.name]
      if ref:numel() ~= full:numel() then -- padded rows for T: compare the real ones
        full = full:narrow(1, 1, ref:size(1))
      end
      local d, m = rms(full:sub(ref)), full:max_abs_diff(ref)
      assert.is_true(d <= PARAM_RTOL * rms(ref) + PARAM_ATOL and m <= PARAM_MAX,
        ("%s differs: RMS %g (tensor RMS %g), largest %g"):format(p.name, d, rms(ref), m))
    end
  end
end

local function assert_replicas_identical(engine, ctx)
  local flat = engine:flat():to("cpu")
  local all = pg.dist.all_gather(flat, { ctx = ctx, group = "data" })
  local n = flat:numel()
  for r = 2, ctx:world_size("data") do
    assert.is_true(all:narrow(1, (r - 1) * n + 1, n):equal(all:narrow(1, 1, n)), "replica " .. r .. " differs")
  end
end

-- zero = 2 and 3 on the device: spec/dist/zero2_spec.lua and zero3_spec.lua (their device worlds)

if world <= 4 then
  for _, zero in ipairs{ 0, 1 } do
    describe(("data=%d, zero=%d"):format(world, zero), function()
      local ctx = pg.ParallelContext{ data = world, seed = 5 }
      local engine, opt, losses = run(ctx, {}, zero)

      it("gives the serial run's losses and parameters after 20 AdamW steps", function()
        assert_matches_serial(engine, losses, ctx)
      end)

      it("leaves every data replica with bitwise identical parameters", function()
        assert_replicas_identical(engine, ctx)
      end)

      it("keeps optimizer state and memory per rank as the layout says", function()
        local mem = engine:memory()
        local state = opt:memory().state_bytes
        local full_state = 8 * engine:stats().flat_padded -- m and v over the whole flat buffer
        if zero == 1 then
          assert.equal(full_state // world, state) -- measured from the buffers: 1/D of replicated
          -- 4 (param) + 4 (grad) + 8/D (m, v) bytes per parameter; alignment padding adds < 1%
          assert.near(8 + 8 / world, mem.bytes_per_parameter, 0.01 * (8 + 8 / world))
        else
          assert.equal(full_state, state)
          assert.near(16, mem.bytes_per_parameter, 0.16)
        end
        local sd = opt:state_dict()
        assert.equal(zero == 1 and world or 1, (sd.hi - sd.lo) > 0 and (engine:stats().flat_padded // (sd.hi - sd.lo)) or 0)
        assert.equal(ctx:local_rank("data"), sd.data_rank)
      end)
    end)
  end

  describe("bad input under data parallelism", function()
    local ctx = pg.ParallelContext{ data = world }
    local engine = pg.parallelize(pg.nn.GPT(CFG), ctx, { micro_batches = 2, device = DEVICE })
    it("names the global batch, data and micro_batches when they do not divide", function()
      local x = X:narrow(1, 1, 1)
      assert.has_error(function() engine:forward_backward(x, x) end,
        ("batch 1 per data rank (global batch %d over data=%d) is not divisible by micro_batches=2: the global batch must be a multiple of data x micro_batches = %d"):format(
          world, world, 2 * world))
    end)
    it("refuses ZeRO stages that are not built", function()
      assert.has_error(function() pg.optim.AdamW(engine, { zero = 4 }) end, "AdamW: zero must be 0, 1, 2 or 3, got 4")
    end)
    it("refuses a data file too short for one global batch", function()
      local path = os.tmpname()
      pg.data.write_shard(path, pg.arange(40):totable())
      assert.has_error(function()
        pg.data.TokenShards{ path = path, batch = 4 * world, seq_len = 16, ctx = ctx }
      end)
      local ok, err = pcall(pg.data.TokenShards, { path = path, batch = 4 * world, seq_len = 16, ctx = ctx })
      assert.is_false(ok)
      assert.matches("40 tokens", err)
      os.remove(path)
    end)
  end)
else
  describe("tensor=2 x pipeline=2 x data=2 on 8 ranks", function()
    for _, zero in ipairs{ 0, 1 } do
      it(("equals the serial run (zero=%d)"):format(zero), function()
        local ctx = pg.ParallelContext{ tensor = 2, pipeline = 2, data = 2, seed = 5 }
        local engine, _, losses = run(ctx, { micro_batches = 2, schedule = "1f1b" }, zero)
        assert_matches_serial(engine, losses, ctx)
        assert_replicas_identical(engine, ctx)
      end)
    end
  end)
end
