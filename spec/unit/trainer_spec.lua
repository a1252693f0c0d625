-- pg.Trainer against pg.testing's fakes: options, counters, accumulation,
-- clipping, schedules, NaN handling, control flags, errors and resume.
-- Floating-point comparisons state their tolerance; losses of a resumed run
-- must match bit for bit (the checkpoint stores numbers exactly).
local pg = require "pipegoose"
local T = pg.testing

local h = require "helpers"
local tmpdir = h.tmpdir
local rm = h.rm

-- A trainer over fresh fakes; o.engine / o.optimizer / o.data are their
-- options, the rest are Trainer options.
local function build(o)
  o = o or {}
  local engine = T.fake_engine(o.engine)
  local opt = T.fake_optimizer(engine, o.optimizer or { lr = 0.5 })
  local data = T.fake_data(o.data or { batches = 4 })
  local out = T.capture()
  local topts = { engine = engine, optimizer = opt, out = out }
  for k, v in pairs(o) do
    if k ~= "engine" and k ~= "optimizer" and k ~= "data" then topts[k] = v end
  end
  return pg.Trainer(topts), engine, opt, data, out
end

-- A callback that records trainer.state.metrics.loss at every step end.
local function loss_recorder(list)
  return { name = "LossRecorder", on_train_batch_end = function(_, t, outputs)
    if outputs.step_end then list[t.state.step] = t.state.metrics.loss end
  end }
end

describe("pg.Trainer construction", function()
  local engine = T.fake_engine{}

  it("rejects unknown options with the closest name", function()
    assert.has_error(function() pg.Trainer{ engine = engine, max_step = 3 } end,
      "Trainer: unknown option 'max_step' (did you mean 'max_steps'?)")
    -- without engine= a Trainer runs TrainingModules (fit(module, datamodule)); data alone needs an engine
    assert.has_error(function() pg.Trainer{}:fit(T.fake_data{}) end,
      "Trainer: fit(data) needs engine= (what pg.parallelize returns, or pg.testing.fake_engine{}) to train a "
        .. "language model on, or a TrainingModule: fit(module, datamodule)")
    assert.has_error(function() pg.Trainer{ engine = engine, accumulate = 0 } end,
      "Trainer: accumulate must be a positive integer, got 0")
    assert.has_error(function() pg.Trainer{ engine = engine, on_nan = "ignore" } end,
      "Trainer: on_nan must be 'error' (stop with an error) or 'skip' (skip the step), got 'ignore'")
    assert.has_error(function() pg.Trainer{ engine = engine, max_time = -1 } end,
      "Trainer: max_time must be a number > 0, got -1")
  end)

  it("checks every option's value (pipegoose.options), in key order, at the user's line", function()
    for _, c in ipairs{
      { { seed = 1.5 }, "Trainer: seed must be an integer, got 1.5" },
      { { out_dir = 5 }, "Trainer: out_dir must be a string path, got 5" },
      { { clock = 5 }, "Trainer: clock must be a function returning seconds, got 5" },
      { { combine = {} }, "Trainer: combine must be a function(values, trainer) -> values, got a table" },
      { { lr_schedule = "cosine" }, "Trainer: lr_schedule must be a function step -> lr (or pg.lr.*), got 'cosine'" },
      { { val_batches = 2.5 }, "Trainer: val_batches must be a positive integer, got 2.5" },
      { { clip_grad_norm = 0 / 0 }, "Trainer: clip_grad_norm must be a number > 0, got nan" },
      { { max_steps = 0, accumulate = 0 }, "Trainer: accumulate must be a positive integer, got 0" }, -- a before m
    } do
      c[1].engine = engine
      assert.has_error(function() pg.Trainer(c[1]) end, c[2])
    end
    assert.has_error(function() pg.Trainer() end, "Trainer: expects a table of options, got nothing")
    assert.has_error(function() pg.Trainer{ engine = engine }:fit(T.fake_data{}, nil, 5) end,
      "Trainer: fit: expects a table of options, got 5")
    assert.has_error(function() pg.Trainer{ engine = engine }:fit(T.fake_data{}, nil, { resume = true }) end,
      "Trainer: fit: resume must be a checkpoint directory or \"last\", got true")
    -- integral floats are integers; a callable table is a clock; math.huge is no limit
    local t = pg.Trainer{ engine = engine, accumulate = 2.0, max_time = math.huge,
                          clock = setmetatable({}, { __call = function() return 0 end }) }
    assert.equal("integer", math.type(t.accumulate))
    assert.equal(math.huge, t.max_time)
    local line
    local ok, e = pcall(function()
      line = debug.getinfo(1, "l").currentline + 1
      local r = pg.Trainer{ engine = engine, accumulate = 0 } -- not a tail call
      return r
    end)
    assert.is_false(ok)
    assert.matches("^spec/unit/trainer_spec%.lua:" .. line .. ": Trainer: accumulate must be", e)
  end)

  it("names the closest known option, or lists them all when none is close (the Trainer's and the built-ins')", function()
    assert.has_error(function() pg.Trainer{ engine = engine, lr_horizn = "checkpoint" } end,
      "Trainer: unknown option 'lr_horizn' (did you mean 'lr_horizon'?)")
    assert.has_error(function() pg.Trainer{ engine = engine, zzzz = 1 } end,
      "Trainer: unknown option 'zzzz' (known: accumulate, callbacks, clip_grad_norm, clock, combine, ctx, engine, "
        .. "log_every_n_steps, lr_horizon, lr_schedule, max_epochs, max_steps, max_time, on_nan, optimizer, out, "
        .. "out_dir, overwrite, seed, track_grad_norm, val_batches, val_every_n_steps)")
    assert.has_error(function() pg.Trainer{ engine = engine, [1] = true } end,
      "Trainer: unknown option [1] (known: accumulate, callbacks, clip_grad_norm, clock, combine, ctx, engine, "
        .. "log_every_n_steps, lr_horizon, lr_schedule, max_epochs, max_steps, max_time, on_nan, optimizer, out, "
        .. "out_dir, overwrite, seed, track_grad_norm, val_batches, val_every_n_steps)")
    assert.has_error(function() pg.Trainer{ engine = engine, lr_horizon = "forever" } end,
      "Trainer: lr_horizon must be 'checkpoint' (a resumed schedule keeps the horizon it was saved with) "
        .. "or 'max_steps' (it is stretched to this fit's total steps), got 'forever'")
    assert.has_error(function() pg.callbacks.ModelCheckpoint{ every_n_step = 5 } end,
      "pg.callbacks.ModelCheckpoint: unknown option 'every_n_step' (did you mean 'every_n_steps'?)")
    assert.has_error(function() pg.callbacks.ProgressBar{ colour = true } end,
      "pg.callbacks.ProgressBar: unknown option 'colour' (known: every_n_steps, tty)")
  end)

  it("rejects an unknown hook, naming the callback, the key and the closest hook", function()
    local es = pg.callbacks.EarlyStopping{}
    es.on_train_batch_ended = function() end
    assert.has_error(function()
      pg.Trainer{ engine = engine, callbacks = { {}, pg.callbacks.Timer{ duration = 5 }, es } }
    end, "Trainer: callback 3 (EarlyStopping) has unknown hook 'on_train_batch_ended' (did you mean 'on_train_batch_end'?)")
    assert.has_error(function()
      pg.Trainer{ engine = engine, callbacks = { { set_up = function() end } } }
    end, "Trainer: callback 1 has unknown hook 'set_up' (did you mean 'setup'?)")
    assert.has_error(function()
      pg.Trainer{ engine = engine, callbacks = { { name = "Mine", on_train_end = true } } }
    end, "Trainer: callback 1 (Mine) has hook 'on_train_end' set to a boolean, not a function")
    assert.has_error(function() pg.Trainer{ engine = engine, callbacks = { 42 } } end,
      "Trainer: callback 1 is a number, not a table of hooks")
  end)

  it("allows helper methods and data fields that are not hook-like", function()
    local cb = { name = "Helpers", threshold = 3, compute = function() return 1 end, on_fit_start = function() end }
    local trainer = pg.Trainer{ engine = engine, callbacks = { cb } }
    assert.same({ cb }, trainer:callbacks_for("on_fit_start"))
  end)

  it("rejects a duplicate state_key, naming both callbacks", function()
    assert.has_error(function()
      pg.Trainer{ engine = engine, callbacks = { pg.callbacks.Timer{ duration = 5 }, {}, pg.callbacks.Timer{ duration = 9 } } }
    end, "Trainer: callback 1 (Timer) and callback 3 (Timer) share state_key 'Timer'; give one of them a distinct state_key=")
    assert.has_error(function()
      pg.Trainer{ engine = engine, callbacks = { { state_dict = function() return {} end } } }
    end, "Trainer: callback 1 has state_dict/load_state_dict but no state_key (or name) to save its state under")
    -- distinct keys are fine
    pg.Trainer{ engine = engine, callbacks = { pg.callbacks.Timer{ duration = 5 },
      pg.callbacks.Timer{ duration = 9, state_key = "Timer2" } } }
  end)

  it("calls per hook only the callbacks that implement it, in the given order", function()
    local a = { name = "A", on_fit_start = function() end, on_train_end = function() end }
    local b = { name = "B", on_train_end = function() end }
    local trainer = pg.Trainer{ engine = engine, callbacks = { a, b } }
    assert.same({ a }, trainer:callbacks_for("on_fit_start"))
    assert.same({ a, b }, trainer:callbacks_for("on_train_end"))
    assert.same({}, trainer:callbacks_for("on_validation_end"))
    assert.has_error(function() trainer:callbacks_for("on_train_ending") end,
      "Trainer: callbacks_for: 'on_train_ending' is not a hook (did you mean 'on_train_end'?)")
  end)
end)

describe("pg.Trainer:fit", function()
  it("counts steps, epochs, batches, micro-batches and tokens as documented", function()
    -- 5 batches per epoch, accumulate 2: steps of 2, 2 and 1 batches per epoch
    local seen = {}
    local trainer, engine, _, data = build{ data = { batches = 5, batch = 2, seq_len = 8 }, accumulate = 2,
      max_epochs = 2, callbacks = { { on_train_batch_end = function(_, t, outputs, i)
        local st = t.state
        seen[#seen + 1] = { i, st.batch_in_epoch, st.step, st.epoch, st.micro_batches, outputs.step_end }
      end } } }
    local st = trainer:fit(data)
    assert.same({
      { 1, 1, 0, 0, 1, false }, { 2, 2, 1, 0, 2, true }, { 3, 3, 1, 0, 3, false }, { 4, 4, 2, 0, 4, true },
      { 5, 5, 3, 0, 5, true },
      { 1, 1, 3, 1, 6, false }, { 2, 2, 4, 1, 7, true }, { 3, 3, 4, 1, 8, false }, { 4, 4, 5, 1, 9, true },
      { 5, 5, 6, 1, 10, true },
    }, seen)
    assert.equal(6, st.step)
    assert.equal(2, st.epoch)
    assert.equal(0, st.batch_in_epoch)
    assert.equal(10, st.micro_batches)
    assert.equal(10 * 2 * 8, st.tokens_seen)
    assert.equal("max_epochs", st.stop_reason)
    -- the last step of an epoch averages over the one batch it has
    assert.same({ 0.5, 0.5, 0.5, 0.5, 1, 0.5, 0.5, 0.5, 0.5, 1 }, engine.grad_scales)
    -- cross-rank gradient reductions wait for the last batch of each step
    assert.same({ false, true, false, true, true, false, true, false, true, true }, engine.syncs)
  end)

  it("scales by 1/accumulate when the data cannot tell its length", function()
    local trainer, engine, _, data = build{ data = { batches = 3, unknown_length = true }, accumulate = 2 }
    local st = trainer:fit(data)
    assert.equal(2, st.step)
    assert.same({ 0.5, 0.5, 0.5 }, engine.grad_scales)
  end)

  it("uses the shape of the inputs for tokens_seen when the data has no tokens_per_batch", function()
    local trainer, _, _, data = build{ data = { batches = 2, batch = 4, seq_len = 3, tensors = true }, max_steps = 2 }
    data.tokens_per_batch = nil
    local st = trainer:fit(data)
    assert.equal(2 * 4 * 3, st.tokens_seen)
  end)

  it("decreases the fake engine's loss and records it per step", function()
    local losses = {}
    local trainer, _, _, data = build{ max_steps = 10, data = { batches = 3 }, callbacks = { loss_recorder(losses) } }
    trainer:fit(data)
    assert.equal(10, #losses)
    assert.is_true(losses[10] < losses[1] / 2, ("loss %g -> %g"):format(losses[1], losses[10]))
  end)

  it("stops at max_steps, max_epochs (default 1) and max_time", function()
    local st = build{ max_steps = 3 }:fit(T.fake_data{ batches = 2 })
    assert.same({ 3, "max_steps" }, { st.step, st.stop_reason })
    st = build{}:fit(T.fake_data{ batches = 5 })
    assert.same({ 5, 1, "max_epochs" }, { st.step, st.epoch, st.stop_reason })
    -- the clock advances 1 s per reading: fit start reads 0, step n's end reads n
    st = build{ max_time = 4, clock = T.manual_clock(0, 1) }:fit(T.fake_data{ batches = 100 })
    assert.same({ 4, "max_time" }, { st.step, st.stop_reason })
  end)

  it("sets the learning rate of every step from the schedule", function()
    local seen = {}
    local trainer, _, opt, data = build{ max_steps = 6, lr_schedule = pg.lr.linear{ warmup = 2 },
      optimizer = { lr = 0.4 },
      callbacks = { { on_before_optimizer_step = function(_, t) seen[#seen + 1] = t.state.lr end } } }
    trainer:fit(data)
    -- warmup 0.2, 0.4, then linear decay to 0 at step 6 (total_steps = max_steps)
    local want = { 0.2, 0.4, 0.3, 0.2, 0.1, 0.0 }
    assert.equal(6, #opt.lrs)
    for i = 1, 6 do
      assert.near(want[i], opt.lrs[i], 1e-12, "step " .. i)
      assert.equal(opt.lrs[i], seen[i])
    end
    -- a plain function step -> lr
    local t2, _, opt2, d2 = build{ max_steps = 3, lr_schedule = function(step) return 0.1 * step end }
    t2:fit(d2)
    for i = 1, 3 do assert.near(0.1 * i, opt2.lrs[i], 1e-12) end
  end)

  it("reports an lr_schedule that returns something other than a finite number", function()
    local trainer, _, _, data = build{ max_steps = 3, lr_schedule = function(step) return step == 2 and 0 / 0 or 0.1 end }
    assert.has_error(function() trainer:fit(data) end,
      "Trainer: lr_schedule returned " .. tostring(0 / 0) .. " for step 2 (expected a finite number)")
  end)

  it("clips by global norm after on_before_optimizer_step, which sees unclipped gradients", function()
    local seen = {}
    local function norm(g)
      local s = 0
      for _, v in ipairs(g) do s = s + v * v end
      return math.sqrt(s)
    end
    local trainer, _, opt, data = build{ max_steps = 3, clip_grad_norm = 0.1, callbacks = { {
      on_before_optimizer_step = function(_, t) seen[#seen + 1] = { before = norm(t.engine.g) } end,
      on_before_zero_grad = function(_, t)
        local s = seen[#seen]
        s.reported, s.after = t.state.grad_norm, norm(t.engine.g)
      end,
    } } }
    trainer:fit(data)
    assert.equal(3, #seen)
    for i, s in ipairs(seen) do
      assert.is_true(s.before > 0.1, "the fake's gradients start above the threshold")
      assert.near(s.before, s.reported, 1e-12, "state.grad_norm is the norm before clipping, step " .. i)
      assert.near(0.1, s.after, 1e-12, "clipped to the threshold, step " .. i)
    end
    assert.equal(3, opt.calls.clip_grad_norm)
    assert.equal(0, opt.calls.grad_norm)
  end)

  it("reports grad_norm without clipping, unless track_grad_norm = false", function()
    local trainer, _, opt, data = build{ max_steps = 2 }
    local st = trainer:fit(data)
    assert.equal(2, opt.calls.grad_norm)
    assert.is_true(st.grad_norm > 0)
    assert.equal(st.grad_norm, st.metrics.grad_norm)
    trainer, _, opt, data = build{ max_steps = 2, track_grad_norm = false }
    st = trainer:fit(data)
    assert.equal(0, opt.calls.grad_norm)
    assert.is_nil(st.grad_norm)
  end)

  it("computes tokens_per_s from the clock", function()
    -- 10 s per clock reading: fit start 0, end of step 1 at 10 s, step 2 at 20 s
    local trainer, _, _, data = build{ max_steps = 2, data = { batches = 4, batch = 2, seq_len = 16 },
      clock = T.manual_clock(0, 10) }
    local st = trainer:fit(data)
    assert.equal(20, st.elapsed)
    assert.near(2 * 2 * 16 / 20, st.metrics.tokens_per_s, 1e-12)
  end)
end)

describe("pg.Trainer NaN / inf losses", function()
  it("stop by default with an error naming the step, after on_exception and teardown", function()
    local calls = {}
    local trainer, _, _, data = build{ engine = { nan_at = { 3 } }, accumulate = 2, callbacks = { {
      on_exception = function(_, _, err) calls[#calls + 1] = "on_exception: " .. err end,
      teardown = function(_, _, stage) calls[#calls + 1] = "teardown " .. stage end,
    } } }
    local msg = "Trainer: loss is nan at step 2 (epoch 0, batch 3); on_nan='skip' skips such steps"
    assert.has_error(function() trainer:fit(data) end, msg)
    assert.same({ "on_exception: " .. msg, "teardown fit" }, calls)
    trainer, _, _, data = build{ engine = { inf_at = { 1 } } }
    assert.has_error(function() trainer:fit(data) end,
      "Trainer: loss is inf at step 1 (epoch 0, batch 1); on_nan='skip' skips such steps")
  end)

  it("skip the step with on_nan = 'skip': no optimizer step, gradients zeroed, the step still counts", function()
    local w_before, w_after
    local trainer, engine, opt, data, out = build{ engine = { nan_at = { 3 } }, on_nan = "skip", max_steps = 5,
      callbacks = { {
        on_train_batch_start = function(_, t) if t.state.step == 2 then w_before = { table.unpack(t.engine.w) } end end,
        on_train_batch_end = function(_, t, o)
          if t.state.step == 3 then
            w_after = { table.unpack(t.engine.w) }
            assert.is_true(o.skipped)
          end
        end,
      } } }
    local st = trainer:fit(data)
    assert.equal(5, st.step)
    assert.equal(1, st.skipped_steps)
    assert.equal(4, opt.calls.step)
    assert.equal(5, opt.calls.zero_grad)
    assert.same(w_before, w_after)
    for _, g in ipairs(engine.g) do assert.equal(0, g) end
    assert.matches("loss is nan at step 3; skipping the step", out:text(), 1, true)
    assert.is_true(st.metrics.loss == st.metrics.loss, "later steps have finite losses")
  end)
end)

describe("trainer.control", function()
  it("accepts only known flags; false does not clear a flag (OR within a rank)", function()
    local trainer = build{}
    assert.has_error(function() trainer.control.should_stopp = true end,
      "trainer.control has no flag 'should_stopp' (did you mean 'should_stop'?) (flags: should_stop, should_save, should_validate, should_log)")
    assert.has_error(function() return trainer.control.stop end)
    trainer.control.should_save = true
    trainer.control.should_save = false
    assert.is_true(trainer.control.should_save)
  end)

  it("should_stop set mid-step ends training after that step", function()
    local trainer, _, _, data = build{ accumulate = 2, data = { batches = 20 }, max_epochs = 3, callbacks = { {
      on_after_backward = function(_, t, _, i) if i == 5 then t.control.should_stop = true end end,
    } } }
    local st = trainer:fit(data)
    assert.equal(3, st.step) -- batch 5 is the first of step 3; the step completes
    assert.equal(6, st.micro_batches)
    assert.equal("should_stop", st.stop_reason)
  end)

  it("presets should_log and should_validate from the every_n options and resets flags each step", function()
    local seen = {}
    local trainer, _, _, data = build{ log_every_n_steps = 2, val_every_n_steps = 3, max_steps = 6, callbacks = { {
      on_train_batch_start = function(_, t)
        local c = t.control
        seen[#seen + 1] = { t.state.step + 1, c.should_log, c.should_validate, c.should_save }
        if t.state.step + 1 == 2 then c.should_save = true end
      end,
    } } }
    trainer.out_dir = tmpdir()
    trainer:fit(data, T.fake_data{ batches = 2 })
    rm(trainer.out_dir)
    assert.same({
      { 1, false, false, false }, { 2, true, false, false }, { 3, false, true, false },
      { 4, true, false, false }, { 5, false, false, false }, { 6, true, true, false },
    }, seen)
  end)

  it("are combined once per step and once more after each validation", function()
    local calls = {}
    local trainer, _, _, data = build{ max_steps = 6, val_every_n_steps = 2, combine = function(values, t)
      calls[#calls + 1] = t.state.step
      return values
    end }
    trainer:fit(data, T.fake_data{ batches = 1 })
    assert.same({ 1, 2, 2, 3, 4, 4, 5, 6, 6 }, calls)
    assert.equal(9, trainer.combines)
  end)

  it("a stop requested by another rank (simulated by combine) stops this one at that step", function()
    local trainer, _, _, data = build{ max_steps = 10, combine = function(values, t)
      if t.state.step == 4 then values[1] = 1 end
      return values
    end }
    local st = trainer:fit(data)
    assert.same({ 4, "should_stop" }, { st.step, st.stop_reason })
  end)

  it("a save requested by another rank is performed here too", function()
    local dir = tmpdir()
    local trainer, _, _, data = build{ max_steps = 3, out_dir = dir, combine = function(values, t)
      if t.state.step == 2 then values[2] = 1 end
      return values
    end }
    trainer:fit(data)
    local f = io.open(dir .. "/checkpoints/step-00000002/manifest.json")
    assert.not_nil(f, "step 2 was saved")
    f:close()
    assert.equal(dir .. "/checkpoints/step-00000002", pg.checkpoint.latest(dir .. "/checkpoints"))
    rm(dir)
  end)
end)

describe("pg.Trainer validate and test", function()
  it("return the mean loss, honour val_batches, and evaluate the same batches every time", function()
    local trainer = build{ val_batches = 2, engine = { eval_loss = function(_, inputs) return inputs[1][1] end } }
    local data = T.fake_data{ batches = 5 }
    local b1, b2 = data:_make(0, 1), data:_make(0, 2)
    local want = (b1[1][1] + b2[1][1]) / 2
    assert.equal(want, trainer:validate(data).val_loss)
    assert.equal(want, trainer:validate(data).val_loss, "reset() before each run")
    assert.equal(want, trainer.state.metrics.val_loss)
    local all = 0
    for i = 1, 5 do all = all + data:_make(0, i)[1][1] end
    local test_data = T.fake_data{ batches = 5 }
    assert.equal(all / 5, trainer:test(test_data).test_loss)
  end)

  it("validates at each epoch end when val_every_n_steps is not set", function()
    local vals = 0
    local trainer, _, _, data = build{ max_epochs = 3, data = { batches = 2 },
      callbacks = { { on_validation_end = function() vals = vals + 1 end } } }
    trainer:fit(data, T.fake_data{ batches = 1 })
    assert.equal(3, vals)
  end)

  it("reject data that yields no batches", function()
    local trainer = build{}
    assert.has_error(function() trainer:validate(T.fake_data{ batches = 0 }) end,
      "Trainer: the validation data produced no batches")
    assert.has_error(function() trainer:fit(T.fake_data{ batches = 0 }) end,
      "Trainer: the training data produced no batches in epoch 0")
  end)
end)

describe("pg.Trainer errors", function()
  it("name the hook and the callback, run on_exception then teardown, and keep the original error", function()
    local order = {}
    local trainer, _, _, data = build{ callbacks = {
      { name = "Bad", on_train_batch_end = function(_, t) if t.state.step == 2 then error("bad things") end end },
      { name = "Witness",
        on_exception = function(_, _, err) order[#order + 1] = "exception: " .. err end,
        teardown = function() order[#order + 1] = "teardown" end },
      { name = "BrokenHandler", on_exception = function() error("handler broke") end },
    } }
    local stderr = io.stderr
    io.stderr = T.capture() -- the broken handler is reported on stderr
    local ok, err = pcall(trainer.fit, trainer, data)
    local reported = io.stderr:text()
    io.stderr = stderr
    assert.is_false(ok)
    assert.matches("^Trainer: on_train_batch_end of callback 1 %(Bad%) failed: .-bad things$", err)
    assert.same({ "exception: " .. err, "teardown" }, order)
    assert.matches("^Trainer: on_exception of callback 3 %(BrokenHandler%) failed while handling an error: .-handler broke\n$",
      reported)
  end)

  it("reports what fit is missing", function()
    local engine = T.fake_engine{}
    assert.has_error(function() pg.Trainer{ engine = engine }:fit(T.fake_data{}) end,
      "Trainer: fit needs optimizer= (e.g. pg.optim.AdamW(engine, {lr = 3e-4}))")
    assert.has_error(function() build{}:fit(T.fake_data{}, nil, { resum = "last" }) end,
      "Trainer: fit: unknown option 'resum' (did you mean 'resume'?)")
  end)
end)

describe("pg.Trainer lr schedule horizon on resume", function()
  local dir
  before_each(function() dir = tmpdir() end)
  after_each(function() rm(dir) end)

  -- A cosine schedule whose horizon is the trainer's (no total=); o.stop_at
  -- saves a checkpoint and stops there. Returns the trainer and the lr of
  -- every step it took (in order).
  local function run(max_steps, o)
    o = o or {}
    local cbs = { pg.callbacks.ModelCheckpoint{ every_n_steps = o.stop_at or 1000 } }
    if o.stop_at then
      cbs[2] = { name = "Stop", on_train_batch_end = function(_, t, out)
        if out.step_end and t.state.step == o.stop_at then t.control.should_stop = true end
      end }
    end
    local trainer, _, opt, data = build{ max_steps = max_steps, data = { batches = 100 }, optimizer = { lr = 1.0 },
      lr_schedule = pg.lr.cosine{ warmup = 2, min_lr = 0.1 }, out_dir = dir, lr_horizon = o.horizon, callbacks = cbs }
    trainer:fit(data, nil, o.resume and { resume = o.resume } or nil)
    return trainer, opt.lrs
  end

  it("keeps the horizon the checkpoint was saved with when max_steps grows (lr_horizon = 'checkpoint', the default)", function()
    local _, want = run(10)
    run(10, { stop_at = 6 })
    local resumed, got = run(20, { resume = "last" })
    assert.equal(14, #got)
    for step = 7, 10 do assert.equal(want[step], got[step - 6], "lr at step " .. step) end
    for step = 11, 20 do assert.equal(0.1, got[step - 6], "min_lr held after the horizon, step " .. step) end
    assert.same({ 20, 10 }, { resumed.state.total_steps, resumed.state.lr_total_steps })
    assert.matches("Trainer: the lr schedule keeps the horizon of 10 steps it was saved with (this fit's total is 20; "
      .. "lr_horizon='max_steps' stretches it to that)", resumed.out:text(), 1, true)
    -- and the checkpoints of the resumed run keep it too
    local m = pg.checkpoint.read_manifest(resumed:save_checkpoint())
    assert.equal(10, m.lr.total_steps)
  end)

  it("stretches the schedule to the new max_steps with lr_horizon = 'max_steps'", function()
    run(10, { stop_at = 6 })
    local resumed, got = run(20, { resume = "last", horizon = "max_steps" })
    local cosine = pg.lr.cosine{ warmup = 2, min_lr = 0.1 }
    for step = 7, 20 do
      assert.equal(cosine(step, { base_lr = 1.0, total_steps = 20 }), got[step - 6], "lr at step " .. step)
    end
    assert.same({ 20, 20 }, { resumed.state.total_steps, resumed.state.lr_total_steps })
    assert.is_nil(resumed.out:text():find("keeps the horizon", 1, true))
  end)
end)

describe("pg.Trainer printing", function()
  it("prints on global rank 0 only; rank_zero_only follows the trainer's rank", function()
    local ran = {}
    for rank = 0, 1 do
      local engine = T.fake_engine{ rank = rank, world_size = 2 }
      local out = T.capture()
      local trainer = pg.Trainer{ engine = engine, optimizer = T.fake_optimizer(engine), out = out, max_steps = 1,
        callbacks = { { on_train_end = pg.rank_zero_only(function(_, t)
          ran[#ran + 1] = t.state.rank
          t:print("done", t.state.step)
        end) } } }
      assert.equal(rank, trainer.state.rank)
      assert.equal(2, trainer.state.world_size)
      assert.equal(rank == 0, trainer.state.is_global_zero)
      trainer:fit(T.fake_data{})
      trainer:print("hello")
      assert.equal(rank == 0 and "done\t1\nhello\n" or "", out:text())
    end
    assert.same({ 0 }, ran)
  end)
end)

describe("pg.Trainer resume", function()
  local dir
  before_each(function() dir = tmpdir() end)
  after_each(function() rm(dir) end)

  -- accumulate 2 over 3 batches per epoch (steps of 2 and 1 batches),
  -- momentum, a cosine schedule, EarlyStopping on the training loss.
  local function run(max_steps, resume, save_at)
    local losses = {}
    local es = pg.callbacks.EarlyStopping{ monitor = "loss", every_n_steps = 1, patience = 100 }
    local cbs = { loss_recorder(losses), es, pg.callbacks.ModelCheckpoint{ dir = dir, every_n_steps = save_at or 1000 } }
    local trainer, engine, opt, data = build{
      max_steps = max_steps, accumulate = 2, data = { batches = 3 }, optimizer = { lr = 0.3, momentum = 0.9 },
      lr_schedule = pg.lr.cosine{ warmup = 2, min_lr = 0.01, total = 10 }, callbacks = cbs, out_dir = dir,
    }
    trainer:fit(data, nil, resume and { resume = resume } or nil)
    return trainer, losses, es, engine, opt, data
  end

  it("restores counters, data, optimizer, engine and callback state: the run continues identically", function()
    local straight, want, es_straight, engine_straight = run(10)
    local first = run(4, nil, 4)
    assert.equal(4, first.state.step)
    local resumed, got, es_resumed, engine_resumed = run(10, "last")
    assert.equal(dir .. "/step-00000004", resumed.state.resumed_from)
    for step = 5, 10 do
      assert.equal(want[step], got[step], "loss at step " .. step)
    end
    assert.is_nil(got[4])
    for _, k in ipairs{ "step", "epoch", "batch_in_epoch", "micro_batches", "tokens_seen" } do
      assert.equal(straight.state[k], resumed.state[k], k)
    end
    assert.same(engine_straight.w, engine_resumed.w)
    assert.same(es_straight:state_dict(), es_resumed:state_dict())
  end)

  it("starts from scratch with resume = 'last' when there is no checkpoint yet", function()
    local trainer = run(2, "last")
    assert.equal(2, trainer.state.step)
    assert.is_nil(trainer.state.resumed_from)
    assert.matches("no checkpoint in .* yet; starting from step 0", trainer.out:text())
  end)

  it("rejects a path that is not a checkpoint", function()
    assert.has_error(function() run(2, dir .. "/nothing") end,
      "checkpoint: " .. dir .. "/nothing is not a checkpoint (no manifest.json)")
  end)
end)
