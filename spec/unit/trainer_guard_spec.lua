-- The Trainer's guards against a run that would lose what a user saved or
-- go on silently with something wrong: a fresh fit into a directory that
-- holds another run's checkpoints, a training_step that never runs backward,
-- a non-finite validation metric, a callback that writes trainer.state.
local pg = require "pipegoose"
local T = pg.testing
local h = require "helpers"

local function build(o)
  o = o or {}
  local engine = T.fake_engine(o.engine)
  local opt = T.fake_optimizer(engine, o.optimizer or { lr = 0.5 })
  local data = T.fake_data(o.data or { batches = 4 })
  local topts = { engine = engine, optimizer = opt, out = T.capture() }
  for k, v in pairs(o) do
    if k ~= "engine" and k ~= "optimizer" and k ~= "data" then topts[k] = v end
  end
  return pg.Trainer(topts), engine, opt, data
end

local function saving_run(dir, extra, fit_opts)
  local o = { max_steps = 2, out_dir = dir, callbacks = { pg.callbacks.ModelCheckpoint{ every_n_steps = 1 } } }
  for k, v in pairs(extra or {}) do o[k] = v end
  local trainer, _, _, data = build(o)
  return trainer:fit(data, nil, fit_opts)
end

describe("a fresh fit into a used checkpoint directory", function()
  local dir
  before_each(function() dir = h.tmpdir() end)
  after_each(function() h.rm(dir) end)

  it("refuses, naming the directory and how to go on; the old checkpoints are untouched", function()
    saving_run(dir)
    local ckdir = dir .. "/checkpoints"
    local before = pg.checkpoint.fs.read(ckdir .. "/step-00000002/manifest.json")
    local ok, err = pcall(saving_run, dir, { max_steps = 3 })
    assert.is_false(ok)
    assert.equal("Trainer: " .. ckdir .. " already holds checkpoints (step-00000001, step-00000002) of another run; "
      .. "a fresh fit would write over them: pass fit(..., { resume = \"last\" }) to continue that run, overwrite = "
      .. "true (pg.Trainer{ overwrite = true }) to write over it, or another out_dir", err)
    assert.equal(before, pg.checkpoint.fs.read(ckdir .. "/step-00000002/manifest.json"))
    assert.equal("step-00000002", (pg.checkpoint.fs.read(ckdir .. "/latest"):gsub("%s+$", "")))
    -- the refused fit released its locks: a resume in the same directory runs
    local st = saving_run(dir, { max_steps = 3 }, { resume = "last" })
    assert.equal(3, st.step)
  end)

  it("allows overwrite = true, and a directory with no checkpoint", function()
    saving_run(dir)
    assert.equal(2, saving_run(dir, { overwrite = true }).step)
    local fresh = dir .. "/other"
    pg.checkpoint.fs.mkdir_p(fresh .. "/checkpoints/notes")
    assert.equal(2, saving_run(fresh).step)
    assert.has_error(function() build{ overwrite = "yes" } end, "Trainer: overwrite must be a boolean, got 'yes'")
  end)

  it("checks a ModelCheckpoint's own directory too", function()
    local ck = dir .. "/mine"
    local function run(o)
      local trainer, _, _, data = build{ max_steps = 1, out_dir = dir .. "/o",
        callbacks = { pg.callbacks.ModelCheckpoint{ dir = ck, every_n_steps = 1 } }, overwrite = o }
      return trainer:fit(data)
    end
    run()
    assert.has_error(function() run() end, "Trainer: " .. ck .. " already holds checkpoints (step-00000001) of "
      .. "another run; a fresh fit would write over them: pass fit(..., { resume = \"last\" }) to continue that run, "
      .. "overwrite = true (pg.Trainer{ overwrite = true }) to write over it, or another out_dir")
    assert.equal(1, run(true).step)
  end)
end)

describe("a training_step that runs no backward pass", function()
  it("raises naming the module and the step, before the optimizer steps on zero gradients", function()
    local NoBackward = pg.TrainingModule:extend("NoBackward")
    local calls = 0
    function NoBackward:training_step(batch)
      calls = calls + 1
      if calls <= 2 then return self:forward_backward(batch.inputs, batch.targets) end
      return self.engine:loss(batch.inputs, batch.targets) -- a loss, but no gradients
    end
    local trainer, engine, opt, data = build{ max_steps = 5, accumulate = 1 }
    local m = NoBackward{}
    function m:configure_model() return engine end
    function m:configure_optimizers() return opt end
    local ok, err = pcall(trainer.fit, trainer, m, pg.DataModule.from_data{ train = data })
    assert.is_false(ok)
    assert.equal("Trainer: training_step of the TrainingModule (NoBackward) ran no backward pass at step 3 (batch 3): "
      .. "it must call self:forward_backward (or engine:forward_backward) so that the optimizer steps on this batch's "
      .. "gradients (engine:loss computes no gradients)", err)
    assert.equal(2, trainer.state.step)
  end)

  it("counts the real engine's passes too", function()
    local e = pg.parallelize(pg.nn.GPT{ vocab = 64, seq_len = 8, dim = 16, heads = 2, layers = 1 }, nil, { seed = 1 })
    assert.equal(0, e:backward_passes())
    local x = pg.tensor({ { 1, 2, 3, 4, 5, 6, 7, 8 } }, { dtype = "int32" })
    e:loss(x, x)
    assert.equal(0, e:backward_passes())
    e:forward_backward(x, x)
    assert.equal(1, e:backward_passes())
  end)
end)

describe("a non-finite validation metric", function()
  -- an engine whose validation loss is values[n] at the n-th engine:loss call
  local function scripted(values)
    local engine = T.fake_engine{}
    local n = 0
    function engine.loss()
      n = n + 1
      return values[n] or 1
    end
    return engine
  end

  it("stops the fit with on_nan = 'error', naming the metric, the step and the batch", function()
    for _, bad in ipairs{ 0 / 0, math.huge, -math.huge } do
      local engine = scripted{ 1, 2, 3, bad, 5 }
      local trainer = pg.Trainer{ engine = engine, optimizer = T.fake_optimizer(engine), out = T.capture(), max_steps = 6,
        val_every_n_steps = 2, val_batches = 2 }
      local ok, err = pcall(trainer.fit, trainer, T.fake_data{ batches = 10 }, T.fake_data{ batches = 4 })
      assert.is_false(ok)
      local name = bad ~= bad and "nan" or bad > 0 and "inf" or "-inf"
      assert.equal(("Trainer: val_loss is %s after step 4 (validation batch 2 returned loss = %s); on_nan='skip' "
        .. "reports it and goes on"):format(name, name), err)
      assert.equal(4, trainer.state.step)
      assert.is_true(trainer.state.metrics.val_loss == 1.5) -- the last finite one: the bad one was not published
    end
  end)

  it("is published with a line saying so under on_nan = 'skip'; test metrics alike", function()
    local engine = scripted{ 0 / 0 }
    local out = T.capture()
    local trainer = pg.Trainer{ engine = engine, optimizer = T.fake_optimizer(engine), out = out, max_steps = 2,
      val_every_n_steps = 2, val_batches = 1, on_nan = "skip" }
    trainer:fit(T.fake_data{ batches = 10 }, T.fake_data{ batches = 4 })
    assert.is_true(trainer.state.metrics.val_loss ~= trainer.state.metrics.val_loss)
    assert.matches("Trainer: val_loss is nan after step 2 (validation batch 1 returned loss = nan) (on_nan='skip')",
      out:text(), 1, true)
    local strict = pg.Trainer{ engine = scripted{ math.huge }, optimizer = T.fake_optimizer(T.fake_engine{}),
      out = T.capture() }
    assert.has_error(function() strict:test(T.fake_data{ batches = 1 }) end,
      "Trainer: test_loss is inf after step 0 (test batch 1 returned loss = inf); on_nan='skip' reports it and goes on")
  end)
end)

describe("trainer.state, as callbacks see it", function()
  it("is read-only: a write raises naming the callback, the hook and the field; the run is unchanged", function()
    for _, field in ipairs{ "step", "epoch", "tokens_seen", "new_field" } do
      local wrote = false -- once: a write that took effect must not loop the run (step 0 again and again)
      local trainer, _, _, data = build{ max_steps = 3, callbacks = { pg.Callback{ name = "Meddler",
        on_train_batch_end = function(_, t)
          if t.state.step == 2 and not wrote then wrote = true; t.state[field] = 0 end
        end } } }
      local ok, err = pcall(trainer.fit, trainer, data)
      assert.is_false(ok)
      assert.equal(("Trainer: on_train_batch_end of callback 1 (Meddler) failed: Trainer: on_train_batch_end of "
        .. "callback 1 (Meddler) wrote trainer.state.%s; the trainer's state is read-only to callbacks (set "
        .. "trainer.control.should_stop / should_save, or add a metric with trainer:log)"):format(field),
        (err:gsub("spec/unit/trainer_guard_spec.lua:%d+: ", "")))
      assert.equal(2, trainer.state.step)
    end
  end)

  it("cannot be replaced either", function()
    local trainer, _, _, data = build{ max_steps = 3, callbacks = { pg.Callback{ name = "Replacer",
      on_train_end = function(_, t) t.state = { step = 0 } end } } }
    local ok, err = pcall(trainer.fit, trainer, data)
    assert.is_false(ok)
    assert.matches("Trainer: on_train_end of callback 1 (Replacer) replaced trainer.state; the trainer's state is "
      .. "read-only to callbacks", err, 1, true)
    assert.equal(3, trainer.state.step)
  end)

  it("reads as the trainer's, and the trainer's methods and control still work from a hook", function()
    local seen = {}
    local trainer, _, _, data = build{ max_steps = 4, callbacks = { pg.Callback{ name = "Reader",
      on_train_batch_end = function(_, t, o)
        seen[#seen + 1] = t.state.step
        local keys = 0
        for _ in pairs(t.state) do keys = keys + 1 end
        assert(keys > 5)
        t:log("mine", t.state.step * 2)
        t:set_accumulate(1)
        if t.state.step == 3 then t.control.should_stop = true end
      end } } }
    local st = trainer:fit(data)
    assert.same({ 1, 2, 3 }, seen)
    assert.equal(3, st.step)
    assert.equal(6, st.metrics.mine)
  end)
end)
