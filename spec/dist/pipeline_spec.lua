-- worlds: 2 4
-- device worlds: 2 4
-- Pipeline parallelism, P = world size (and P = 2 x T = 2 on 4 ranks): both
-- schedules and several micro-batch counts give the serial model's loss and
-- gradients; training matches the serial run; the tied embedding's two
-- copies stay identical; memory, partition and explicit stages.
--
-- The serial reference runs in the same process on a context with pipeline
-- and tensor size 1 ({data = world}: every rank computes the whole model on
-- the whole batch, and the data-parallel average of W equal gradients is
-- exact, W being a power of two).
--
-- Tolerance: as in tensor_parallel_spec: |got - want| <= 1e-5 |want| + atol,
-- atol = 1e-6 * max(1, max |want|). Micro-batching only regroups sums: the
-- loss sums M partial token-loss sums, and every parameter gradient adds M
-- per-micro-batch contributions instead of one matmul over the batch; each
-- regrouping of a float32 sum of K terms moves it by ~K * 6e-8 of the
-- terms' magnitude (K <= 128 here).
local pg = require "pipegoose"
local h = require "helpers"
local llmc = require "pipegoose.llmc"

local W = pg.world_size()
local P = W
local RTOL, ATOL = 1e-5, 1e-6
local MODEL = "spec/fixtures/gpt2_tiny_model.bin"
local cfg = llmc.read_header(MODEL)

-- PG_TEST_DEVICE=cuda (make test, on the emulated device): the pipelined
-- engines run on the device, the serial reference stays on the CPU.
local DEVICE = os.getenv("PG_TEST_DEVICE") or "cpu"
local function on_device(opts)
  opts.device = DEVICE
  return opts
end

local ser = pg.ParallelContext{ data = W, seed = 3 }
local pipe = pg.ParallelContext{ pipeline = P, seed = 3 }

local function assert_close(got, want, what) h.assert_scaled_close(got, want, what, RTOL, ATOL) end

local function assert_loss(got, want, what)
  assert.is_true(math.abs(got - want) <= RTOL * math.abs(want), ("%s: loss %.9g vs serial %.9g"):format(what, got, want))
end

-- A batch of 8 sequences (8 micro-batches of one row at most), ids in [0, vocab).
local B, S = 8, cfg.seq_len
local function tokens(seed) return h.token_batch(seed, B, S, cfg.vocab) end
local x, y = tokens(1), tokens(2)

local function model() return pg.nn.GPT.load_llmc(MODEL) end

-- The serial model's loss and full gradients, once.
local serial = pg.parallelize(model(), ser, { micro_batches = 1 })
serial:zero_grad()
local serial_loss = serial:forward_backward(x, y)
local serial_grads, serial_names = {}, {}
for _, p in ipairs(serial:parameters()) do
  serial_grads[p.name] = serial:gather_param(p.name, true)
  serial_names[#serial_names + 1] = p.name
end

-- Compares every gradient this rank holds with the serial one; checks that
-- the pipeline group together holds each parameter exactly once (tied copies aside).
local function check_grads(e, ctx, what)
  local held = 0
  for _, p in ipairs(e:parameters()) do
    local want = serial_grads[p.name]
    assert.truthy(want, what .. ": unknown parameter " .. p.name)
    local got = e:gather_param(p.name, true)
    local rows = math.min(got:shape()[1], want:shape()[1])
    if p.name == "embed.wte" then rows = cfg.vocab end
    -- a tied copy's gradient is the sum of both uses: the serial gradient
    assert_close(got:narrow(1, 1, rows), want:narrow(1, 1, rows),
      ("%s: grad %s%s"):format(what, p.name, p.tied_copy and " (tied copy)" or ""))
    if not p.tied_copy then held = held + 1 end
  end
  local n = pg.tensor({ held }, { dtype = "int32" })
  pg.dist.all_reduce(n, { group = "pipeline", ctx = ctx })
  assert.equal(#serial_names, n:item(), what .. ": every parameter on exactly one stage")
end

local function schedules(Ms)
  local out = {}
  for _, name in ipairs{ "gpipe", "1f1b" } do
    for _, M in ipairs(Ms) do out[#out + 1] = { name, M } end
  end
  return out
end

describe(("pipeline=%d"):format(P), function()
  local stage = pipe:local_rank("pipeline")
  local Ms = { 1, 2, 4, 8 } -- the batch has 8 rows

  for _, c in ipairs(schedules(Ms)) do
    local name, M = c[1], c[2]
    it(("%s, %d micro-batches: the serial loss and every gradient; in flight within the bound"):format(name, M), function()
      local e = pg.parallelize(model(), pipe, on_device({ micro_batches = M, schedule = name }))
      assert.same(pg.core.schedule(name, P, M, stage), e:schedule_actions())
      e:zero_grad()
      assert_loss(e:forward_backward(x, y), serial_loss, name .. " M=" .. M)
      check_grads(e, pipe, name .. " M=" .. M)
      local mem = e:memory()
      local bound = name == "gpipe" and M or math.min(P - stage, M)
      assert.equal(bound, mem.peak_in_flight, "micro-batches held on stage " .. stage)
      if name == "1f1b" then assert.is_true(mem.peak_in_flight <= P) end
      assert.equal(mem.slots, mem.peak_in_flight) -- buffers for exactly that many
      assert.equal(mem.slot_bytes * mem.peak_in_flight, mem.peak_activation_bytes)
      assert.is_true(mem.slot_bytes > 0)
    end)
  end

  it("1F1B holds fewer activations than GPipe on the first stage (M = 4)", function()
    local g = pg.parallelize(model(), pipe, on_device({ micro_batches = 4, schedule = "gpipe" }))
    local f = pg.parallelize(model(), pipe, on_device({ micro_batches = 4, schedule = "1f1b" }))
    g:forward_backward(x, y)
    f:forward_backward(x, y)
    local mg, mf = g:memory(), f:memory()
    assert.equal(mg.slot_bytes, mf.slot_bytes)
    if stage == 0 then
      assert.equal(4 * mg.slot_bytes, mg.peak_activation_bytes)
      assert.equal(math.min(P, 4) * mf.slot_bytes, mf.peak_activation_bytes)
    end
    assert.is_true(mf.peak_activation_bytes <= mg.peak_activation_bytes)
  end)

  it("trains 20 AdamW steps to the serial losses; the tied embedding's copies stay identical", function()
    -- 1e-5 relative per step, as for one step: AdamW's updates are bounded by
    -- lr, so the ~1e-7 rounding differences do not grow into 1e-5 in 20 steps.
    local hp = { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 }
    local es = pg.parallelize(model(), ser, { micro_batches = 1 })
    local ep = pg.parallelize(model(), pipe, on_device({ micro_batches = 4, schedule = "1f1b" }))
    local os_, op = pg.optim.AdamW(es, hp), pg.optim.AdamW(ep, hp)
    local first_loss, last_loss
    for k = 1, 20 do
      es:zero_grad()
      ep:zero_grad()
      local ls, lp = es:forward_backward(x, y), ep:forward_backward(x, y)
      assert_loss(lp, ls, "step " .. k)
      first_loss, last_loss = first_loss or ls, ls
      os_:step()
      op:step()
    end
    assert.is_true(last_loss < first_loss - 0.1, "the model trained")
    -- The first stage holds embed.wte, the last stage its tied copy.
    local wte = ep:parameter("embed.wte")
    local is_first, is_last = stage == 0, stage == P - 1
    assert.equal(is_first or is_last, wte ~= nil)
    if is_first then assert.is_false(wte.tied_copy) end
    if is_last then assert.is_true(wte.tied_copy) end
    if is_first or is_last then
      assert.equal(2, pipe:world_size("embedding"))
      local both = pg.dist.all_gather(wte.tensor:to("cpu"):reshape{ 1, wte.tensor:numel() }, { group = "embedding", ctx = pipe })
      assert.is_true(both:narrow(1, 1, 1):equal(both:narrow(1, 2, 1)), "the two copies of embed.wte are bitwise equal")
      -- and both equal the serial model's trained embedding
      assert_close(wte.tensor:to("cpu"):narrow(1, 1, cfg.vocab), es:parameter("embed.wte").tensor:narrow(1, 1, cfg.vocab),
        "trained wte")
    end
  end)

  it("reports every top-level module once, with parameter counts summing to the model's", function()
    local m = model()
    local e = pg.parallelize(m, pipe, on_device({ micro_batches = 2 }))
    local part = e:partition()
    assert.equal(P, #part)
    local order, total = {}, 0
    for p = 1, P do
      assert.is_true(#part[p].modules >= 1, "stage " .. p - 1 .. " is not empty")
      for _, name in ipairs(part[p].modules) do order[#order + 1] = name end
      total = total + part[p].params
    end
    local want = { "embed" }
    for l = 0, cfg.layers - 1 do want[#want + 1] = "blocks." .. l end
    want[#want + 1] = "ln_f"
    want[#want + 1] = "head"
    assert.same(want, order)
    assert.equal(m:num_params(), total)
    assert.equal(serial:num_parameters(), total)
    assert.equal(serial:num_parameters(), e:num_parameters())
    -- what this rank holds is exactly its stage's modules (plus the tied copy on the last)
    local mine = {}
    for _, name in ipairs(part[stage + 1].modules) do mine[name] = true end
    for _, p in ipairs(e:parameters()) do
      local owner = p.name:match("^(blocks%.%d+)%.") or p.name:match("^([%w_]+)%.")
      assert.is_true(mine[owner] or (p.tied_copy and mine.head) or false,
        ("%s on stage %d, which holds %s"):format(p.name, stage, table.concat(part[stage + 1].modules, ", ")))
    end
  end)

  it("obeys an explicit stages = {...}", function()
    local stages = P == 2 and { 1, 4 } or { 2, 1, 1, 1 }
    local e = pg.parallelize(model(), pipe, on_device({ micro_batches = 2, stages = stages, schedule = "gpipe" }))
    local part = e:partition()
    local first = 1
    for p = 1, P do
      assert.equal(stages[p], #part[p].modules, "stage " .. p - 1)
      assert.equal(first, part[p].first)
      assert.equal(first + stages[p] - 1, part[p].last)
      first = first + stages[p]
    end
    if P == 2 then assert.same({ "embed" }, part[1].modules) end
    if P == 4 then assert.same({ "embed", "blocks.0" }, part[1].modules) end
    -- the default balance differs, so the option really changed the cut
    local d = pg.parallelize(model(), pipe, on_device({ micro_batches = 2 })):partition()
    assert.are_not.same(#d[1].modules, #part[1].modules)
    e:zero_grad()
    assert_loss(e:forward_backward(x, y), serial_loss, "explicit stages")
    check_grads(e, pipe, "explicit stages")
  end)
end)

if W == 4 then
  describe("pipeline=2 x tensor=2", function()
    local ctx = pg.ParallelContext{ pipeline = 2, tensor = 2, seed = 3 }
    for _, name in ipairs{ "gpipe", "1f1b" } do
      it(name .. ", 4 micro-batches: the serial loss and every gradient (gathered)", function()
        local e = pg.parallelize(model(), ctx, on_device({ micro_batches = 4, schedule = name }))
        e:zero_grad()
        assert_loss(e:forward_backward(x, y), serial_loss, name)
        check_grads(e, ctx, name)
      end)
    end

    it("trains 20 AdamW steps to the serial losses; tied copies identical", function()
      local hp = { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 }
      local es = pg.parallelize(model(), ser, { micro_batches = 1 })
      local ep = pg.parallelize(model(), ctx, on_device({ micro_batches = 2, schedule = "1f1b" }))
      local os_, op = pg.optim.AdamW(es, hp), pg.optim.AdamW(ep, hp)
      for k = 1, 20 do
        es:zero_grad()
        ep:zero_grad()
        assert_loss(ep:forward_backward(x, y), es:forward_backward(x, y), "step " .. k)
        os_:step()
        op:step()
      end
      local wte = ep:parameter("embed.wte")
      assert.truthy(wte, "both stages hold a copy")
      local both = pg.dist.all_gather(wte.tensor:to("cpu"):reshape{ 1, wte.tensor:numel() }, { group = "embedding", ctx = ctx })
      assert.is_true(both:narrow(1, 1, 1):equal(both:narrow(1, 2, 1)), "this tensor rank's shard of both copies")
    end)
  end)
end
