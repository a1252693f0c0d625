-- worlds: 2 3 4 8
-- device worlds: 2
-- Sequence parallelism (pg.parallelize{sequence_parallel = true}) against the
-- serial model on the same seed, in every layout of this world size: T = 2
-- on 2 ranks, T = 3 on 3 (rows not divisible by T: uneven shares), T = 4,
-- T = 2 x P = 2 and T = 2 x D = 2 with ZeRO-1 on 4, and on 8 ranks all of it
-- at once (2 x 2 x 2, ZeRO-1, the interleaved schedule with virtual_stages =
-- 2, full and selective recomputation). For a GPT-2 and a LLaMA-style model
-- (RMSNorm, RoPE, grouped-query attention, SwiGLU): the loss, every gradient,
-- evaluation (loss and logits), three AdamW steps (losses and weights), the
-- norms' parameters marked and kept identical on every tensor rank, and the
-- activations smaller than the same layout without sequence parallelism. On
-- 2 ranks also: an odd row count (uneven T = 2 shares: on the emulated
-- device, the staged collectives), T = 1 (silently off, bit for bit the run
-- without), fewer rows than ranks (a rank holds none: generation's one-token
-- prompts), a mixture of experts and modules written in Lua
-- (between the transitions), a plain Linear and an objective written in Lua
-- at the end, and checkpoints that load with and without it. On 4 ranks
-- also at T = 4: rows that 4 does not divide and fewer rows than ranks (ranks
-- without rows between ranks with rows), where a split that is right at
-- T = 2 can still put a rank's rows in the wrong place.
--
-- The inputs are 7 tokens long, so the micro-batches' rows (7 x sequences)
-- split unevenly over T = 2 and 4 where the layout gives a micro-batch an
-- odd number of sequences, and over T = 3 always.
--
-- Tolerance: tensor_parallel_spec's, |got - want| <= 1e-5 |want| + 1e-6
-- max(1, max |want|): sequence parallelism only regroups float32 sums (the
-- reduce-scatter adds the tensor ranks' partial sums in ring order; a norm's
-- parameter gradient is the sum of the ranks' sums over their rows). After
-- AdamW steps data_parallel_spec's: losses to 1e-5 relative; per tensor the
-- RMS difference within 1e-5 of the tensor's RMS plus 1e-5, the largest
-- difference within lr (Adam's normalised update turns a rounding-level sign
-- change of a near-zero gradient into up to lr per step).
local pg = require "pipegoose"
local h = require "helpers"

local W = pg.world_size()
local RTOL, ATOL = 1e-5, 1e-6
local LR, PARAM_RTOL, PARAM_ATOL = 1e-3, 1e-5, 1e-5
local DEVICE = os.getenv("PG_TEST_DEVICE") or "cpu"
local ON_CPU = DEVICE == "cpu"

local LAYOUTS = ({
  [2] = { { name = "T=2", tensor = 2, m = 2 } },
  [3] = { { name = "T=3", tensor = 3, m = 2 } },
  [4] = { { name = "T=4", tensor = 4, m = 2 }, { name = "T=2 x P=2, 1f1b", tensor = 2, pipeline = 2, m = 4 },
          { name = "T=2 x D=2, zero=1", tensor = 2, data = 2, m = 2, zero = 1 } },
  [8] = { { name = "2x2x2, zero=1, virtual_stages=2, recompute=full", tensor = 2, pipeline = 2, data = 2, m = 2,
            zero = 1, virtual_stages = 2, recompute = "full" },
          { name = "2x2x2, zero=1, virtual_stages=2, recompute=selective", tensor = 2, pipeline = 2, data = 2, m = 2,
            zero = 1, virtual_stages = 2, recompute = "selective" } },
})[W]

-- heads divisible by 2, 3 and 4; LLaMA's key/value heads by this world's T (grouped: fewer than heads)
local KV = W == 3 and 6 or 4
local MODELS = {
  gpt = function() return pg.nn.GPT{ vocab = 61, seq_len = 8, dim = 24, heads = 12, layers = 2 } end,
  llama = function()
    return pg.nn.Llama{ vocab = 61, seq_len = 8, dim = 24, heads = 12, kv_heads = KV, hidden = 48, layers = 2 }
  end,
}

local B, S = 4, 7
local function tokens(seed, rows, len) return h.token_batch(seed, rows or B, len or S, 61) end
local X, Y = tokens(1), tokens(2)

local ser = pg.ParallelContext{ data = W, seed = 5 } -- a tensor group of one: the serial model on every rank

local function on_device(o)
  o.device = DEVICE
  return o
end

local function assert_close(got, want, what) h.assert_scaled_close(got, want, what, RTOL, ATOL) end

local function assert_loss(got, want, what)
  assert.is_true(math.abs(got - want) <= RTOL * math.abs(want), ("%s: loss %.9g, serial %.9g"):format(what, got, want))
end

local function rms(t) return math.sqrt(t:mul(t):sum() / t:numel()) end

-- The real vocabulary rows of a (padded) embedding or head tensor.
local function real(name, t, n)
  if t:size(1) ~= n:size(1) then return t:narrow(1, 1, n:size(1)) end
  return t
end

local function adamw(e, zero) return pg.optim.AdamW(e, { lr = LR, weight_decay = 0.1, zero = zero or 0 }) end

-- The serial run of a model: loss and gradients of the whole batch, its
-- evaluation, and three AdamW steps (losses and weights).
local serial_cache = {}
local function serial(name)
  if serial_cache[name] then return serial_cache[name] end
  local e = pg.parallelize(MODELS[name](), ser, { micro_batches = 1 })
  e:zero_grad()
  local r = { loss = e:forward_backward(X, Y), grads = {}, params = {} }
  for _, p in ipairs(e:parameters()) do r.grads[p.name] = e:gather_param(p.name, true) end
  r.eval, r.logits = e:loss(X, Y), e:forward(X)
  local o = adamw(e)
  r.losses = {}
  for k = 1, 3 do
    e:zero_grad()
    r.losses[k] = e:forward_backward(X, Y)
    o:step()
  end
  for _, p in ipairs(e:parameters()) do r.params[p.name] = e:gather_param(p.name) end
  serial_cache[name] = r
  return r
end

-- This data rank's rows of the batch.
local function mine(ctx, t)
  local D, d = ctx:world_size("data"), ctx:local_rank("data")
  local n = t:size(1) // D
  return t:narrow(1, d * n + 1, n)
end

local function norm_param(name) return name:find("^ln_f%.") ~= nil or name:find("%.ln%d%.") ~= nil end

-- Every replicated parameter is the same on every tensor rank.
local function assert_replicated_agree(e, ctx, what)
  for _, p in ipairs(e:parameters()) do
    if p.replicated then
      local t = p.tensor:to("cpu"):clone()
      local all = pg.dist.all_gather(t:reshape{ t:numel() }, { ctx = ctx, group = "tensor" })
      local n = t:numel()
      for r = 2, ctx:world_size("tensor") do
        assert.is_true(all:narrow(1, (r - 1) * n + 1, n):equal(all:narrow(1, 1, n)),
          ("%s: %s differs on tensor rank %d"):format(what, p.name, r - 1))
      end
    end
  end
end

local function layout_opts(layout, sp)
  return on_device{ micro_batches = layout.m, virtual_stages = layout.virtual_stages, recompute = layout.recompute,
                    sequence_parallel = sp }
end

describe(("sequence parallelism on %d ranks (%s)"):format(W, DEVICE), function()
  for _, layout in ipairs(LAYOUTS) do
    for _, name in ipairs{ "gpt", "llama" } do
      it(("%s, %s: loss, gradients, evaluation and 3 AdamW steps of the serial model; smaller activations")
        :format(layout.name, name), function()
        local want = serial(name)
        local ctx = pg.ParallelContext{ tensor = layout.tensor, pipeline = layout.pipeline, data = layout.data,
                                        seed = 5 }
        local x, y = mine(ctx, X), mine(ctx, Y)
        local e = pg.parallelize(MODELS[name](), ctx, layout_opts(layout, true))
        assert.is_true(e.sequence_parallel)
        assert.is_true(e:stats().sequence_parallel)
        -- the norms' parameters, and only they, sum their gradients over the tensor group
        for _, p in ipairs(e:parameters()) do
          assert.equal(norm_param(p.name), p.sequence_parallel, p.name .. ": marked sequence_parallel")
        end
        e:zero_grad()
        assert_loss(e:forward_backward(x, y), want.loss, layout.name)
        for _, p in ipairs(e:parameters()) do
          local g = e:gather_param(p.name, true)
          assert_close(real(p.name, g, want.grads[p.name]), want.grads[p.name], ("%s: grad %s%s"):format(layout.name,
            p.name, p.tied_copy and " (tied copy)" or ""))
        end
        assert_loss(e:loss(x, y), want.eval, layout.name .. " evaluation")
        assert_close(e:forward(x), mine(ctx, want.logits), layout.name .. ": logits")

        local o = adamw(e, layout.zero)
        for k = 1, 3 do
          e:zero_grad()
          local l = e:forward_backward(x, y)
          o:step()
          assert.is_true(math.abs(l - want.losses[k]) <= 1e-5 * want.losses[k],
            ("%s: step %d loss %.9g, serial %.9g"):format(layout.name, k, l, want.losses[k]))
        end
        for _, p in ipairs(e:parameters()) do
          if not p.tied_copy then
            local ref = want.params[p.name]
            local got = real(p.name, e:gather_param(p.name), ref)
            local d, m = rms(got:sub(ref)), got:max_abs_diff(ref)
            assert.is_true(d <= PARAM_RTOL * rms(ref) + PARAM_ATOL and m <= LR,
              ("%s: %s after 3 steps: RMS difference %g (tensor RMS %g), largest %g"):format(layout.name, p.name, d,
                rms(ref), m))
          end
        end
        assert_replicated_agree(e, ctx, layout.name .. " after 3 steps")

        -- the same layout without it holds more (the norms', residuals' and
        -- boundaries' rows are every rank's there)
        local f = pg.parallelize(MODELS[name](), ctx, layout_opts(layout, false))
        f:zero_grad()
        f:forward_backward(x, y)
        local with, without = e:memory(), f:memory()
        assert.is_true(with.activation_bytes < without.activation_bytes,
          ("activations %d with, %d without"):format(with.activation_bytes, without.activation_bytes))
        assert.is_true(with.peak_activation_bytes < without.peak_activation_bytes,
          ("peak activations %d with, %d without"):format(with.peak_activation_bytes, without.peak_activation_bytes))
      end)
    end
  end

  -- loss and every gradient of model() on (x, y) on the tensor group of tp
  -- (no other groups) with sequence parallelism against the serial model;
  -- returns the engine
  local function sp_against_serial(tp, model, x, y, opts, what)
    -- the same micro-batches (a mixture of experts' auxiliary losses are per micro-batch)
    local s = pg.parallelize(model(), ser, { micro_batches = opts.micro_batches, objective = opts.objective })
    s:zero_grad()
    local want = s:forward_backward(x, y)
    opts.sequence_parallel = true
    local e = pg.parallelize(model(), tp, opts)
    e:zero_grad()
    assert_loss(e:forward_backward(x, y), want, what)
    for _, p in ipairs(e:parameters()) do
      local sg = s:gather_param(p.name, true)
      assert_close(real(p.name, e:gather_param(p.name, true), sg), sg, what .. ": grad " .. p.name)
    end
    return e, s
  end

  -- Logits of 1 to n one-sequence prompts at T = tp's tensor size against the
  -- serial model (rank r holds rows [N r / T, N (r+1) / T): none when N < T),
  -- then the loss and every gradient of one row and of two.
  local function few_rows(tp, n)
    local s = pg.parallelize(MODELS.gpt(), ser, { micro_batches = 1 })
    local e = pg.parallelize(MODELS.gpt(), tp, on_device{ sequence_parallel = true })
    for len = 1, n do
      local x = tokens(5, 1, len)
      assert_close(e:forward(x), s:forward(x), ("logits of %d rows"):format(len))
    end
    for len = 1, 2 do
      local x, y = tokens(6, 1, len), tokens(7, 1, len)
      s:zero_grad()
      e:zero_grad()
      local what = ("%d row%s"):format(len, len > 1 and "s" or "")
      assert_loss(e:forward_backward(x, y), s:forward_backward(x, y), what)
      for _, p in ipairs(e:parameters()) do
        local sg = s:gather_param(p.name, true)
        assert_close(real(p.name, e:gather_param(p.name, true), sg), sg, what .. ": grad " .. p.name)
      end
    end
  end

  if W == 4 then
    local t4 = pg.ParallelContext{ tensor = 4, seed = 5 }

    it("T = 4: rows per micro-batch that 4 does not divide (shares of 14 rows: 3, 4, 3, 4; of 21: 5, 5, 5, 6)", function()
      for _, n in ipairs{ 2, 3 } do
        local x, y = tokens(3, n, 7), tokens(4, n, 7)
        for _, name in ipairs{ "gpt", "llama" } do
          sp_against_serial(t4, MODELS[name], x, y, on_device{ micro_batches = 1 },
            ("T = 4, %s with %d rows"):format(name, 7 * n))
        end
      end
    end)

    it("T = 4, fewer rows than tensor ranks: ranks without rows between ranks with rows (1 to 6 rows)", function()
      few_rows(t4, 6) -- 1 row: rank 3 only; 2: ranks 1 and 3; 3: ranks 1, 2, 3; 5: 1, 1, 1, 2
    end)
  end

  if W == 2 then
    local ctx = pg.ParallelContext{ tensor = 2, seed = 5 }

    local function against_serial(model, x, y, opts, what) return sp_against_serial(ctx, model, x, y, opts, what) end

    it("an odd number of rows per micro-batch (T = 2 shares of 10 and 11 rows)", function()
      local x, y = tokens(3, 3, 7), tokens(4, 3, 7)
      for _, name in ipairs{ "gpt", "llama" } do
        against_serial(MODELS[name], x, y, on_device{ micro_batches = 1 }, name .. " with 21 rows")
      end
    end)

    it("T = 1: sequence_parallel changes nothing (bit for bit the run without)", function()
      local dp = pg.ParallelContext{ data = 2, seed = 5 }
      local runs = {}
      for i, sp in ipairs{ true, false } do
        local e = pg.parallelize(MODELS.llama(), dp, on_device{ micro_batches = 2, sequence_parallel = sp })
        assert.is_false(e.sequence_parallel)
        for _, p in ipairs(e:parameters()) do assert.is_false(p.sequence_parallel, p.name) end
        e:zero_grad()
        runs[i] = { loss = e:forward_backward(X, Y), grads = select(2, e:flat()):to("cpu"):clone() }
      end
      assert.equal(runs[2].loss, runs[1].loss)
      assert.is_true(runs[1].grads:equal(runs[2].grads))
    end)

    it("fewer rows than tensor ranks (generation's one-token prompts): a rank may hold none", function()
      few_rows(ctx, 3) -- 1 row: rank 0 holds none; 2: one each; 3: one and two
    end)

    -- on the device too: their pg.ops calls run there (spec/unit/lua_modules_spec.lua)
    it("modules written in Lua (examples/lua_llama.lua) between the transitions", function()
      local L = dofile("examples/lua_llama.lua")
      local cfg = { vocab = 61, dim = 24, layers = 2, heads = 4, kv_heads = 2, hidden = 48, seq_len = 8 }
      against_serial(function() return L.Llama(cfg) end, X, Y, { micro_batches = 2 }, "Lua LLaMA")
    end)

    if ON_CPU then -- the cpu layouts only (the moe kind on a device: device_spec, expert_parallel_spec; an
      -- objective written in Lua runs on the cpu backend only)
      it("a mixture of experts between sp_gather and sp_scatter (auxiliary losses included)", function()
        local function mixtral()
          return pg.nn.Mixtral{ vocab = 61, seq_len = 8, dim = 24, heads = 4, kv_heads = 2, hidden = 32, layers = 2,
                                experts = 4, top_k = 2, aux_loss_coef = 0.02, z_loss_coef = 0.001 }
        end
        local e = against_serial(mixtral, X, Y, { micro_batches = 2 }, "mixtral")
        assert.is_true(e:losses().aux_loss > 0)
      end)

      it("a plain Linear on this rank's rows and an objective written in Lua that takes every row", function()
        local labels = pg.zeros({ B, S }, { dtype = "int32" })
        for b = 1, B do for s = 1, S do labels:set(b, s, (b * 3 + s) % 5) end end
        local function model()
          local m = pg.nn.GPT{ vocab = 61, seq_len = 8, dim = 24, heads = 12, layers = 2, head = "none" }
          m:add(pg.nn.Linear(24, 5, { name = "classifier" }))
          return m
        end
        local function objective(out, batch)
          local loss, d = pg.loss.cross_entropy(out, batch.targets:reshape{ out:size(1) })
          return loss, d
        end
        local e = against_serial(model, X, labels, { micro_batches = 2, objective = objective }, "classifier")
        assert.is_true(e:parameter("classifier.weight").sequence_parallel)
        assert.is_true(e:parameter("classifier.bias").sequence_parallel)
      end)

      it("a checkpoint saved with it loads without it, and the other way round", function()
        local t = pg.tensor({ (pg.checkpoint.getpid() * 7919 + os.time()) % 1000000007 }, { dtype = "int32" })
        pg.dist.broadcast(t, { ctx = ctx, src = 0 })
        local root = ("%s/pg-sp-ckpt-%d"):format(os.getenv("TMPDIR") or "/tmp", math.tointeger(t:item()))
        local function trainer(c, sp, steps)
          local e = pg.parallelize(MODELS.gpt(), c, { micro_batches = 2, sequence_parallel = sp })
          local o = adamw(e)
          for _ = 1, steps do
            e:zero_grad()
            e:forward_backward(mine(c, X), mine(c, Y))
            o:step()
          end
          return pg.Trainer{ engine = e, optimizer = o, out = pg.testing.capture(), out_dir = root }
        end
        local dp = pg.ParallelContext{ data = 2, seed = 5 }
        for i, case in ipairs{ { true, ctx, false }, { true, dp, false }, { false, ctx, true } } do
          local saved_sp, c, load_sp = case[1], case[2], case[3]
          local dir = ("%s/case-%d"):format(root, i)
          local a = trainer(ctx, saved_sp, 2)
          a:save_checkpoint(dir)
          local b = trainer(c, load_sp, 0)
          b:load_checkpoint(dir)
          for _, p in ipairs(a.engine:parameters()) do
            local got, want = b.engine:gather_param(p.name), a.engine:gather_param(p.name)
            if p.name == "embed.wte" then -- T = 1 pads the vocabulary less: the real rows
              got, want = got:narrow(1, 1, 61), want:narrow(1, 1, 61)
            end
            assert.is_true(got:equal(want), ("case %d: %s"):format(i, p.name))
          end
        end
        ctx:barrier()
        if ctx:rank() == 0 then h.rm(root) end
      end)
    end
  end
end)
