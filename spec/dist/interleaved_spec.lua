-- worlds: 2 4
-- device worlds: 2
-- The interleaved 1F1B schedule (virtual_stages = V chunks per pipeline
-- rank, P = world size) against the serial model on the same seed: the loss,
-- every gradient, evaluation (loss and logits) and a few training steps, for
-- V = 2 and 3 and several micro-batch counts; the engine runs exactly the
-- generated schedule, holds each chunk's micro-batches in its own slots, and
-- reports its chunks in the partition.
--
-- The model is a tiny GPT with 10 layers (13 top-level modules: enough for
-- P x V = 12 chunks) and its tied embedding: the first chunk of stage 0 and
-- the last chunk of stage P - 1 hold the two copies.
--
-- Tolerance: pipeline_spec's (micro-batching only regroups float32 sums):
-- |got - want| <= 1e-5 |want| + 1e-6 max(1, max |want|).
local pg = require "pipegoose"
local h = require "helpers"

local W = pg.world_size()
local P = W
local RTOL, ATOL = 1e-5, 1e-6
local CFG = { vocab = 61, seq_len = 8, dim = 16, heads = 2, layers = 10 }

local DEVICE = os.getenv("PG_TEST_DEVICE") or "cpu"
local function on_device(opts)
  opts.device = DEVICE
  return opts
end

local ser = pg.ParallelContext{ data = W, seed = 5 }
local pipe = pg.ParallelContext{ pipeline = P, seed = 5 }
local stage = pipe:local_rank("pipeline")

local function assert_close(got, want, what) h.assert_scaled_close(got, want, what, RTOL, ATOL, true) end

local function assert_loss(got, want, what)
  assert.is_true(math.abs(got - want) <= RTOL * math.abs(want), ("%s: loss %.9g vs serial %.9g"):format(what, got, want))
end

local B = 8
local function tokens(seed) return h.token_batch(seed, B, CFG.seq_len, CFG.vocab) end
local x, y = tokens(1), tokens(2)

local function model() return pg.nn.GPT(CFG) end

local serial = pg.parallelize(model(), ser, { micro_batches = 1 })
serial:zero_grad()
local serial_loss = serial:forward_backward(x, y)

local function check_grads(e, what)
  local held = 0
  for _, p in ipairs(e:parameters()) do
    -- gathered: on the host whatever the device (this rank's whole tensor, T = 1)
    local got, want = e:gather_param(p.name, true), serial:gather_param(p.name, true)
    if p.name == "embed.wte" then -- the padding rows are no token's (pipeline_spec does the same)
      got, want = got:narrow(1, 1, CFG.vocab), want:narrow(1, 1, CFG.vocab)
    end
    assert_close(got, want, ("%s: grad %s%s"):format(what, p.name, p.tied_copy and " (tied copy)" or ""))
    if not p.tied_copy then held = held + 1 end
  end
  local n = pg.tensor({ held }, { dtype = "int32" })
  pg.dist.all_reduce(n, { group = "pipeline", ctx = pipe })
  assert.equal(#serial:parameters(), n:item(), what .. ": every parameter on exactly one stage")
end

describe(("interleaved 1F1B, pipeline=%d"):format(P), function()
  for _, V in ipairs{ 2, 3 } do
    for _, M in ipairs{ P, 2 * P } do
      if B % M == 0 then
        it(("V=%d, %d micro-batches: the generated schedule, the serial loss and every gradient"):format(V, M), function()
          local e = pg.parallelize(model(), pipe, on_device({ micro_batches = M, virtual_stages = V }))
          assert.equal("interleaved", e.schedule)
          assert.same(pg.core.schedule("interleaved", P, M, stage, V), e:schedule_actions())
          e:zero_grad()
          assert_loss(e:forward_backward(x, y), serial_loss, ("V=%d M=%d"):format(V, M))
          check_grads(e, ("V=%d M=%d"):format(V, M))
          -- each chunk has slots for the micro-batches the schedule holds on it
          local mem, peak = e:memory(), 0
          for c = 1, V do
            local live, most = 0, 0
            for _, a in ipairs(e:schedule_actions()) do
              if a[3] == c and a[1] == "forward" then live = live + 1; most = math.max(most, live) end
              if a[3] == c and a[1] == "backward" then live = live - 1 end
            end
            peak = peak + most
          end
          assert.equal(peak, mem.slots)
          assert.equal(peak, mem.peak_in_flight)
          assert.equal(mem.activation_bytes, mem.peak_activation_bytes)
        end)
      end
    end

    it(("V=%d: evaluation (loss and logits) through the forward-only schedule"):format(V), function()
      local e = pg.parallelize(model(), pipe, on_device({ micro_batches = P, virtual_stages = V }))
      assert_loss(e:loss(x, y), serial:loss(x, y), "eval loss V=" .. V)
      assert_close(e:forward(x), serial:forward(x), "logits V=" .. V)
      -- before any training step too (a fresh engine sizes its buffers for evaluation)
      local f = pg.parallelize(model(), pipe, on_device({ micro_batches = P, virtual_stages = V }))
      assert_close(f:forward(tokens(3)), serial:forward(tokens(3)), "logits of a fresh engine V=" .. V)
    end)

    it(("V=%d: the partition lists P x V chunks in model order, round-robin over the stages"):format(V), function()
      local e = pg.parallelize(model(), pipe, on_device({ micro_batches = P, virtual_stages = V }))
      local part = e:partition()
      assert.equal(P * V, #part)
      local next_module = 1
      for g, piece in ipairs(part) do
        assert.equal((g - 1) % P, piece.stage)
        assert.equal((g - 1) // P + 1, piece.chunk)
        assert.equal(next_module, piece.first)
        next_module = piece.last + 1
      end
      assert.equal(CFG.layers + 3, next_module - 1)
      assert.same({ "embed" }, { part[1].modules[1] })
      assert.equal("head", part[P * V].modules[#part[P * V].modules])
    end)
  end

  it("V=2: three AdamW steps follow the serial run (the tied embedding stays one weight)", function()
    local function train(e)
      local o = pg.optim.AdamW(e, { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 })
      local losses = {}
      for k = 1, 3 do
        e:zero_grad()
        losses[k] = e:forward_backward(x, y)
        o:step()
      end
      return losses
    end
    local s = pg.parallelize(model(), ser, { micro_batches = 1 })
    local e = pg.parallelize(model(), pipe, on_device({ micro_batches = 2 * P, virtual_stages = 2 }))
    local want, got = train(s), train(e)
    for k = 1, 3 do assert_loss(got[k], want[k], "step " .. k) end
    local wte = e:parameter("embed.wte")
    if stage == 0 or stage == P - 1 then
      assert_close(e:gather_param("embed.wte"), s:gather_param("embed.wte"), "embed.wte after training")
    else
      assert.is_nil(wte)
    end
  end)
end)
