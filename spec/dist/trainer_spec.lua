-- worlds: 2 4
-- The Trainer across ranks: control flags are combined with one all_reduce
-- per step (plus one after each validation), so a stop or a save requested on
-- any rank happens on every rank after the same step; checkpoints written by
-- all ranks resume identically. Engine, optimizer and data are pg.testing's
-- fakes on a real data-parallel context (the fake engine averages loss and
-- gradients over the data group, so the loss is the same on every rank).
local pg = require "pipegoose"
local T = pg.testing

local world = pg.world_size()
local ctx = pg.ParallelContext{ data = world, seed = 3 }
local me = ctx:rank()
local last = world - 1

-- Every rank's value of an integer, in rank order.
local function gather(v)
  return pg.dist.all_gather(pg.tensor({ v }, { dtype = "int32" }), { ctx = ctx }):totable()
end

local function all_equal_to(v, list)
  for _, x in ipairs(list) do if x ~= v then return false end end
  return true
end

-- A directory name every rank agrees on (rank 0's choice).
local function shared_dir()
  local t = pg.tensor({ (pg.checkpoint.getpid() * 7919 + os.time()) % 1000000007 }, { dtype = "int32" })
  pg.dist.broadcast(t, { ctx = ctx, src = 0 })
  return ("%s/pg-trainer-dist-%d"):format(os.getenv("TMPDIR") or "/tmp", math.tointeger(t:item()))
end

local function build(o)
  local engine = T.fake_engine{ ctx = ctx }
  local topts = { engine = engine, optimizer = T.fake_optimizer(engine, { momentum = 0.9 }), out = T.capture() }
  for k, v in pairs(o) do topts[k] = v end
  return pg.Trainer(topts)
end

local function data(n) return T.fake_data{ batches = n or 50, batch = 4, ctx = ctx } end

describe(("Trainer on %d ranks"):format(world), function()
  it("stops every rank after the step in which one rank set should_stop", function()
    local trainer = build{ max_steps = 20, accumulate = 2, callbacks = { { name = "StopOnLast",
      on_after_backward = function(_, t, _, i)
        -- the first micro-batch of step 3 (batch 5) on the last rank only
        if me == last and i == 5 then t.control.should_stop = true end
      end } } }
    ctx:reset_comm_stats()
    local st = trainer:fit(data())
    local calls = ctx:comm_stats().global.all_reduce.calls
    assert.same({ 3, "should_stop" }, { st.step, st.stop_reason })
    assert.is_true(all_equal_to(3, gather(st.step)), "every rank stopped after step 3")
    assert.is_true(all_equal_to(6, gather(st.micro_batches)))
    -- one combination per step, nothing else on the global group
    assert.equal(3, calls)
    assert.equal(3, trainer.combines)
  end)

  it("stops at the earliest request when ranks ask at different steps", function()
    local trainer = build{ max_steps = 20, callbacks = { { on_train_batch_end = function(_, t, o)
      if o.step_end and t.state.step == (me == 0 and 4 or 2 + me) then t.control.should_stop = true end
    end } } }
    local st = trainer:fit(data())
    -- rank 0 asks at step 4, rank r > 0 at step 2 + r: rank 1 (step 3) is first
    assert.is_true(all_equal_to(3, gather(st.step)))
  end)

  it("combines once more after each validation; losses agree on every rank", function()
    local vals = {}
    local trainer = build{ max_steps = 4, val_every_n_steps = 2, val_batches = 2,
      callbacks = { { on_validation_end = function(_, t) vals[#vals + 1] = t.state.metrics.val_loss end } } }
    ctx:reset_comm_stats()
    local st = trainer:fit(data(), data(3))
    assert.equal(4 + 2, ctx:comm_stats().global.all_reduce.calls)
    assert.equal(2, #vals)
    -- the same numbers everywhere: max and min over ranks agree (float32 transport)
    local t = pg.tensor{ st.metrics.loss, vals[2] }
    local mx, mn = t:clone(), t:clone()
    pg.dist.all_reduce(mx, { ctx = ctx, op = "max" })
    pg.dist.all_reduce(mn, { ctx = ctx, op = "min" })
    assert.same(mx:totable(), mn:totable())
  end)

  it("validates on every rank after the step in which one rank set should_validate", function()
    local validated, after = 0, nil
    local trainer = build{ max_steps = 4, val_batches = 2, callbacks = { {
      on_train_batch_end = function(_, t, o)
        if o.step_end and me == last and t.state.step == 2 then t.control.should_validate = true end
      end,
      on_validation_end = function(_, t) validated, after = validated + 1, t.state.step end,
    } } }
    ctx:reset_comm_stats()
    trainer:fit(data(), data(3))
    -- no val_every_n_steps: the last rank's request alone, agreed by the combination
    assert.is_true(all_equal_to(1, gather(validated)), "one validation on every rank")
    assert.is_true(all_equal_to(2, gather(after or -1)), "after step 2")
    assert.equal(4 + 1, ctx:comm_stats().global.all_reduce.calls, "a combination per step, one after the validation")
  end)

  it("agrees on should_log when one rank sets it", function()
    local seen_before = {}
    local trainer = build{ max_steps = 3, log_every_n_steps = 1000, callbacks = { {
      on_train_batch_end = function(_, t, o)
        if not o.step_end then return end
        if me == last and t.state.step == 3 then t.control.should_log = true end
        seen_before[t.state.step] = t.control.should_log
      end,
    } } }
    trainer:fit(data())
    -- before the combination the flag is rank-local; after it (the fit ends
    -- with the last step's combination) the same on every rank
    assert.equal(me == last, seen_before[3])
    assert.is_true(all_equal_to(1, gather(trainer.control.should_log and 1 or 0)), "should_log set on every rank")
  end)

  it("saves on every rank when one rank asks, and every rank resumes from it identically", function()
    local dir = shared_dir()
    local function run(max_steps, resume, ask_at)
      local losses, saved = {}, {}
      local trainer = build{ max_steps = max_steps, accumulate = 2, out_dir = dir,
        lr_schedule = pg.lr.cosine{ warmup = 1, total = 8 },
        callbacks = { { name = "Watcher",
          on_train_batch_end = function(_, t, o)
            if not o.step_end then return end
            losses[t.state.step] = t.state.metrics.loss
            if me == last and t.state.step == ask_at then t.control.should_save = true end
          end,
          on_checkpoint_saved = function(_, t, path) saved[#saved + 1] = { t.state.step, path } end,
        } } }
      trainer:fit(data(5), nil, resume and { resume = "last" } or nil)
      return trainer, losses, saved
    end
    local straight, want = run(8)
    local first, _, saved = run(8, nil, 3)
    local path = dir .. "/checkpoints/step-00000003"
    assert.same({ { 3, path } }, saved, "the last rank's request was carried out here too")
    assert.equal(8, first.state.step, "a save does not stop training")
    for r = 0, world - 1 do
      local f = io.open(("%s/rank-%05d.json"):format(path, r))
      assert.not_nil(f, "rank " .. r .. " wrote its state")
      f:close()
    end
    local resumed, got = run(8, true)
    assert.equal(path, resumed.state.resumed_from)
    for step = 4, 8 do assert.equal(want[step], got[step], "loss at step " .. step) end
    assert.same(straight.engine.w, resumed.engine.w)
    ctx:barrier()
    if me == 0 then os.execute("rm -rf '" .. dir .. "'") end
  end)
end)
