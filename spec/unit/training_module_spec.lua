-- pg.TrainingModule and pg.DataModule against pg.testing's fakes: the
-- default module is the Trainer's old objective (same losses, same state),
-- custom steps and their metrics, module hooks after the callbacks' (an
-- exact trace), configure_model / configure_optimizers, the objective passed
-- to forward_backward, module state through a checkpoint, and the errors.
local pg = require "pipegoose"
local T = pg.testing

local h = require "helpers"

local function copy(t)
  local out = {}
  for k, v in pairs(t or {}) do out[k] = v end
  return out
end

local function keys(t)
  local out = {}
  for k in pairs(t) do out[#out + 1] = k end
  table.sort(out)
  return out
end

-- A fake engine that records the options of every forward_backward call and
-- accepts an objective (the fake itself knows only grad_scale and sync).
local function recording_engine(opts)
  local e = T.fake_engine(opts)
  e.seen = {}
  local forward_backward = e.forward_backward
  function e:forward_backward(inputs, targets, o)
    self.seen[#self.seen + 1] = copy(o)
    local rest = copy(o)
    rest.objective = nil
    return forward_backward(self, inputs, targets, rest)
  end
  return e
end

-- Records trainer.state.metrics.loss at every step end.
local function loss_recorder(list)
  return { name = "LossRecorder", on_train_batch_end = function(_, t, outputs)
    if outputs.step_end then list[#list + 1] = t.state.metrics.loss end
  end }
end

local function data_module(o)
  o = o or {}
  return pg.DataModule.from_data{ train = T.fake_data{ batches = o.batches or 5 },
    val = T.fake_data{ batches = o.val_batches or 2, seed = 3 }, test = T.fake_data{ batches = 3, seed = 4 } }
end

-- Trainer options shared by the runs that must agree; extra ones on top.
local function trainer_options(extra)
  local o = { out = T.capture(), accumulate = 2, max_epochs = 2, val_every_n_steps = 1,
              clock = T.manual_clock(0, 1) }
  for k, v in pairs(extra or {}) do o[k] = v end
  return o
end

describe("pg.TrainingModule, the default module", function()
  -- The same fit three ways: the old API, the base module with an engine,
  -- and a module that makes its engine and optimizer.
  local function old_api()
    local engine, losses = T.fake_engine{}, {}
    local t = pg.Trainer(trainer_options{ engine = engine, optimizer = T.fake_optimizer(engine),
      callbacks = { loss_recorder(losses) } })
    t:fit(T.fake_data{ batches = 5 }, T.fake_data{ batches = 2, seed = 3 })
    return t, engine, losses
  end

  local function base_module()
    local engine, losses = T.fake_engine{}, {}
    local t = pg.Trainer(trainer_options{ optimizer = T.fake_optimizer(engine), callbacks = { loss_recorder(losses) } })
    t:fit(pg.TrainingModule{ engine = engine }, data_module())
    return t, engine, losses
  end

  local Configured = pg.TrainingModule:extend("Configured")
  function Configured:configure_model() return T.fake_engine{} end
  function Configured:configure_optimizers(engine) return T.fake_optimizer(engine) end

  local function configured_module()
    local losses = {}
    local t = pg.Trainer(trainer_options{ callbacks = { loss_recorder(losses) } })
    t:fit(Configured{}, data_module())
    return t, t.engine, losses
  end

  it("trains as the Trainer did before modules: same losses, counters, metrics, weights and engine calls", function()
    local t1, e1, l1 = old_api()
    assert.equal("LanguageModel", t1.module.name)
    assert.is_true(pg.TrainingModule.is_instance(t1.module))
    assert.equal(e1, t1.module.engine)
    for _, run in ipairs{ base_module, configured_module } do
      local t2, e2, l2 = run()
      assert.equal(6, #l2) -- 2 epochs of 5 batches, 2 per step: 3 steps each
      assert.same(l1, l2)
      assert.same(t1:counters(), t2:counters())
      assert.same(t1.state.metrics, t2.state.metrics)
      assert.same(e1.w, e2.w)
      assert.same(e1.grad_scales, e2.grad_scales)
      assert.same(e1.syncs, e2.syncs)
      assert.same(e1.calls, e2.calls)
      assert.same(t1.optimizer.lrs, t2.optimizer.lrs)
      assert.equal("max_epochs", t2.state.stop_reason)
    end
  end)

  it("validates and tests as before: {val_loss =}, {test_loss =}", function()
    local t1, e1 = old_api()
    local t2 = base_module()
    local v1 = t1:validate(T.fake_data{ batches = 2, seed = 3 })
    local v2 = t2:validate(t2.module, data_module())
    assert.same(v1, v2)
    assert.same({ "val_loss" }, keys(v2))
    assert.same(t1:test(T.fake_data{ batches = 3, seed = 4 }), t2:test(t2.module, data_module()))
    assert.equal(e1.calls.loss, t2.engine.calls.loss)
  end)
end)

describe("pg.TrainingModule subclasses", function()
  it("are made with extend; Class{fields} copies fields, a custom init gets the arguments, super reaches the parent", function()
    local Base = pg.TrainingModule:extend("Base")
    function Base:validation_step(batch, i) return { loss = 1, seen = i } end
    local Child = Base:extend("Child")
    function Child:init(classes, extra) self.classes, self.extra = classes, extra end
    function Child:validation_step(batch, i)
      local out = Child.super.validation_step(self, batch, i)
      out.classes = self.classes
      return out
    end
    local c = Child(10, "x")
    assert.same({ 10, "x" }, { c.classes, c.extra })
    assert.same({ loss = 1, seen = 2, classes = 10 }, c:validation_step({}, 2))
    assert.equal(Base, Child.super)
    assert.equal(pg.TrainingModule, Base.super)
    assert.is_true(pg.TrainingModule.is_instance(c))
    assert.is_false(pg.TrainingModule.is_instance(Child)) -- a class is not an instance
    assert.is_false(pg.DataModule.is_instance(c))
    assert.equal(7, Base{ lr = 7 }.lr)
    assert.matches("^Child: ", tostring(c))
    assert.has_error(function() pg.TrainingModule:extend() end,
      "TrainingModule:extend: expects the new class's name (a string), got a nil")
    assert.has_error(function() Base(5) end, "Base{...}: expects a table of fields, got a number")
  end)

  it("define training_step and validation_step: named numbers become val_<name> / test_<name>, averaged", function()
    local Classifier = pg.TrainingModule:extend("Classifier")
    function Classifier:training_step(batch, i)
      self.steps = (self.steps or 0) + 1
      self:log("train_calls", self.steps)
      return self:forward_backward(batch.inputs, batch.targets) * 2
    end
    function Classifier:validation_step(batch, i)
      return { loss = self.engine:loss(batch.inputs, batch.targets), accuracy = i / 10 }
    end
    local engine = T.fake_engine{}
    local module = Classifier{ engine = engine }
    local seen, losses = {}, {}
    local t = pg.Trainer{ optimizer = T.fake_optimizer(engine), out = T.capture(), max_steps = 2,
      val_every_n_steps = 2, callbacks = { loss_recorder(losses), { name = "Outputs",
        on_validation_batch_end = function(_, _, out, i) seen[i] = copy(out) end } } }
    t:fit(module, data_module{ val_batches = 3 })
    assert.equal(2, module.steps)
    assert.equal(2, t.state.metrics.train_calls)
    assert.near(0.2, t.state.metrics.val_accuracy, 1e-15) -- (0.1 + 0.2 + 0.3) / 3
    assert.is_number(t.state.metrics.val_loss)
    assert.same({ 1, 2, 3 }, { seen[1].accuracy * 10, seen[2].accuracy * 10, seen[3].accuracy * 10 })
    -- the loss the trainer steps on is training_step's: twice the engine's here
    local plain_engine, plain = T.fake_engine{}, {}
    pg.Trainer{ engine = plain_engine, optimizer = T.fake_optimizer(plain_engine), out = T.capture(), max_steps = 2,
      callbacks = { loss_recorder(plain) } }:fit(T.fake_data{ batches = 5 })
    assert.same({ 2 * plain[1], 2 * plain[2] }, losses)
    -- validate / test return what they publish; test_step defaults to validation_step
    local v = t:validate(module, data_module{ val_batches = 2 })
    assert.same({ "val_accuracy", "val_loss" }, keys(v))
    assert.near(0.15, v.val_accuracy, 1e-15)
    local r = t:test(module, data_module())
    assert.near(0.2, r.test_accuracy, 1e-15)
    assert.equal(r.test_accuracy, t.state.metrics.test_accuracy)
    -- data passed alone runs on the module attached last
    assert.near(0.1, t:validate(T.fake_data{ batches = 1 }).val_accuracy, 1e-15)
  end)

  it("are given the trainer's accumulation options, their objective and their own options in forward_backward", function()
    local engine = recording_engine{}
    local calls = {}
    local WithObjective = pg.TrainingModule:extend("WithObjective")
    function WithObjective:objective(out, batch) calls[#calls + 1] = { self, out, batch } return 1, out end
    local m = WithObjective{ engine = engine }
    local t = pg.Trainer{ optimizer = T.fake_optimizer(engine), out = T.capture(), max_steps = 1, accumulate = 2 }
    t:fit(m, data_module())
    local objective = m:bound_objective()
    assert.same({ { grad_scale = 0.5, sync = false, objective = objective },
                  { grad_scale = 0.5, sync = true, objective = objective } }, engine.seen)
    -- the engine calls fn(out, batch): the method gets its module as self
    objective("out", "batch")
    assert.same({ { m, "out", "batch" } }, calls)
    assert.is_nil(t:forward_backward_options()) -- outside a training step
    -- a module without an objective passes none; opts override; outside a step only opts
    local plain = pg.TrainingModule{ engine = recording_engine{} }
    plain:forward_backward({ { 1 } }, { { 2 } }, { grad_scale = 3 })
    assert.same({ { grad_scale = 3 } }, plain.engine.seen)
    local e3 = recording_engine{}
    local Scaled = pg.TrainingModule:extend("Scaled")
    function Scaled:training_step(batch) return self:forward_backward(batch.inputs, batch.targets, { grad_scale = 1 }) end
    pg.Trainer{ optimizer = T.fake_optimizer(e3), out = T.capture(), max_steps = 1, accumulate = 2 }
      :fit(Scaled{ engine = e3 }, data_module())
    assert.same({ { grad_scale = 1, sync = false }, { grad_scale = 1, sync = true } }, e3.seen)
  end)

  it("give each forward_backward call of a step exactly its own options: none leaks into the next call", function()
    -- two calls per batch: the first overrides sync and grad_scale, the second only grad_scale, the third nothing
    local TwoCalls = pg.TrainingModule:extend("TwoCalls")
    function TwoCalls:training_step(batch)
      self:forward_backward(batch.inputs, batch.targets, { sync = false, grad_scale = 0.25 })
      self:forward_backward(batch.inputs, batch.targets, { grad_scale = 0.75 })
      return self:forward_backward(batch.inputs, batch.targets)
    end
    for _, k in ipairs{ 1, 2 } do
      local engine = recording_engine{}
      local t = pg.Trainer{ optimizer = T.fake_optimizer(engine), out = T.capture(), max_steps = 2, accumulate = k }
      t:fit(TwoCalls{ engine = engine }, data_module())
      -- the trainer's options for batch i of a step of k: grad_scale 1/k, sync on the last batch only
      local want = {}
      for _ = 1, 2 do
        for i = 1, k do
          local sync = i == k
          want[#want + 1] = { sync = false, grad_scale = 0.25 }
          want[#want + 1] = { sync = sync, grad_scale = 0.75 }
          want[#want + 1] = { sync = sync, grad_scale = 1 / k }
        end
      end
      assert.same(want, engine.seen, "accumulate = " .. k)
      assert.is_nil(t:forward_backward_options())
    end
  end)
end)

describe("configure_model and configure_optimizers", function()
  local Made = pg.TrainingModule:extend("Made")
  function Made:configure_model(ctx)
    self.calls = self.calls or {}
    self.calls[#self.calls + 1] = "configure_model"
    self.ctx_seen = ctx
    return T.fake_engine{}
  end
  function Made:configure_optimizers(engine)
    self.calls[#self.calls + 1] = "configure_optimizers"
    assert(engine == self.engine)
    return T.fake_optimizer(engine, { lr = 0.25 }), function(step) return 0.1 * step end
  end
  function Made:setup(stage) self.calls = self.calls or {}; self.calls[#self.calls + 1] = "setup " .. stage end

  it("are called after setup when the module has no engine / the Trainer no optimizer, once", function()
    local ctx = T.fake_context{}
    local m = Made{}
    local t = pg.Trainer{ ctx = ctx, out = T.capture(), max_steps = 2 }
    t:fit(m, data_module())
    assert.same({ "setup fit", "configure_model", "configure_optimizers" }, m.calls)
    assert.equal(ctx, m.ctx_seen)
    assert.equal(m.engine, t.engine)
    assert.equal(m.engine, t.optimizer.engine)
    assert.same({ 0.1, 0.2 }, t.optimizer.lrs) -- the schedule configure_optimizers returned
    t:fit(m, data_module(), {}) -- the engine and the optimizer exist now
    assert.same({ "setup fit", "configure_model", "configure_optimizers", "setup fit" }, m.calls)
    -- validate / test make the engine too, never an optimizer
    local fresh = Made{}
    pg.Trainer{ out = T.capture() }:validate(fresh, data_module())
    assert.same({ "setup validate", "configure_model" }, fresh.calls)
  end)

  it("are not called when the Trainer has an optimizer or the module an engine", function()
    local engine = T.fake_engine{}
    local m = Made{ engine = engine }
    m.calls = {}
    pg.Trainer{ optimizer = T.fake_optimizer(engine), out = T.capture(), max_steps = 1 }:fit(m, data_module())
    assert.same({ "setup fit" }, m.calls)
  end)

  it("report what they return that cannot be used", function()
    local Bad = pg.TrainingModule:extend("Bad")
    function Bad:configure_model() return nil end
    assert.has_error(function() pg.Trainer{ out = T.capture() }:validate(Bad{}, data_module()) end,
      "Trainer: configure_model of the TrainingModule (Bad) returned a nil; expected an engine (what pg.parallelize returns)")
    local NoStep = pg.TrainingModule:extend("NoStep")
    function NoStep:configure_optimizers() return { step = function() end } end
    local e = T.fake_engine{}
    assert.has_error(function() pg.Trainer{ out = T.capture() }:fit(NoStep{ engine = e }, data_module()) end,
      "Trainer: the optimizer has no zero_grad() method")
    local Both = pg.TrainingModule:extend("Both")
    function Both:configure_optimizers(engine) return T.fake_optimizer(engine), pg.lr.constant end
    assert.has_error(function()
      pg.Trainer{ out = T.capture(), lr_schedule = pg.lr.constant }:fit(Both{ engine = e }, data_module())
    end, "Trainer: configure_optimizers of the TrainingModule (Both) returned an lr schedule, and the Trainer has "
      .. "lr_schedule=; keep one")
    local BadSchedule = pg.TrainingModule:extend("BadSchedule")
    function BadSchedule:configure_optimizers(engine) return T.fake_optimizer(engine), "cosine" end
    assert.has_error(function() pg.Trainer{ out = T.capture() }:fit(BadSchedule{ engine = e }, data_module()) end,
      "Trainer: the lr schedule configure_optimizers of the TrainingModule (BadSchedule) returned must be a function "
        .. "step -> lr (or pg.lr.*), got 'cosine'")
  end)

  it("take the engine's context as the Trainer's, except one of several ranks that comes after the hooks", function()
    local Two = pg.TrainingModule:extend("Two")
    function Two:configure_model() return T.fake_engine{ rank = 1, world_size = 2 } end
    function Two:configure_optimizers(engine) return T.fake_optimizer(engine) end
    assert.has_error(function() pg.Trainer{ out = T.capture(), max_steps = 1 }:fit(Two{}, data_module()) end,
      "Trainer: configure_model of the TrainingModule (Two) made an engine on 2 ranks, but the Trainer has no ctx=: "
        .. "give pg.Trainer{ctx = ctx} the context configure_model gets, so that every rank knows its rank before "
        .. "fit runs a hook")
    -- an engine the module already has brings its context before anything runs
    local e = T.fake_engine{ rank = 1, world_size = 2 }
    local t = pg.Trainer{ optimizer = T.fake_optimizer(e), out = T.capture(), max_steps = 1 }
    t:fit(pg.TrainingModule{ engine = e }, data_module())
    assert.same({ 1, 2, false }, { t.state.rank, t.state.world_size, t.state.is_global_zero })
    assert.has_error(function()
      pg.Trainer{ ctx = T.fake_context{}, optimizer = T.fake_optimizer(e), out = T.capture() }
        :fit(pg.TrainingModule{ engine = e }, data_module())
    end, "Trainer: the engine of the TrainingModule runs on another context than the Trainer's (ctx=, or the engine it "
      .. "was built with)")
  end)
end)

describe("module hooks", function()
  -- What identifies a hook call in the trace: the stage, or the batch index.
  local function args_of(hook, ...)
    local a, b = ...
    if hook == "setup" or hook == "teardown" then return " " .. a end
    if hook:match("_batch_") or hook == "on_after_backward" then return " " .. b end
    if hook == "on_before_backward" then return " " .. a end
    return ""
  end

  local function callback_recorder(trace)
    local cb = { name = "Recorder" }
    for _, hook in ipairs(pg.Callback.HOOKS) do
      cb[hook] = function(_, trainer, ...)
        assert(trainer.state)
        trace[#trace + 1] = "callback " .. hook .. args_of(hook, ...)
      end
    end
    return cb
  end

  local Traced = pg.TrainingModule:extend("Traced")
  for _, hook in ipairs(pg.TrainingModule.HOOKS) do
    Traced[hook] = function(self, ...)
      assert(pg.TrainingModule.is_instance(self)) -- module hooks get no trainer: self.trainer is there
      self.trace[#self.trace + 1] = "module " .. hook .. args_of(hook, ...)
    end
  end
  function Traced:training_step(batch, i)
    self.trace[#self.trace + 1] = "module training_step " .. i
    return pg.TrainingModule.training_step(self, batch, i)
  end
  function Traced:validation_step(batch, i)
    self.trace[#self.trace + 1] = "module validation_step " .. i
    return pg.TrainingModule.validation_step(self, batch, i)
  end

  local TracedData = pg.DataModule:extend("TracedData")
  function TracedData:setup(stage) self.trace[#self.trace + 1] = "datamodule setup " .. stage end
  function TracedData:teardown(stage) self.trace[#self.trace + 1] = "datamodule teardown " .. stage end
  function TracedData:train_dataloader() return T.fake_data{ batches = 2 } end
  function TracedData:val_dataloader() return T.fake_data{ batches = 1, seed = 3 } end

  it("run right after the callbacks' of the same name, with their arguments; the DataModule's setup and teardown first", function()
    local trace = {}
    local engine = T.fake_engine{}
    local t = pg.Trainer{ optimizer = T.fake_optimizer(engine), out = T.capture(), accumulate = 2,
      callbacks = { callback_recorder(trace) } }
    t:fit(Traced{ engine = engine, trace = trace }, TracedData{ trace = trace })
    assert.same({
      "datamodule setup fit",
      "callback setup fit",
      "module setup fit",
      "callback on_fit_start", "module on_fit_start",
      "callback on_train_start", "module on_train_start",
      "callback on_train_epoch_start", "module on_train_epoch_start",
      "callback on_train_batch_start 1", "module on_train_batch_start 1",
      "callback on_before_backward 1", "module on_before_backward 1",
      "module training_step 1",
      "callback on_after_backward 1", "module on_after_backward 1",
      "callback on_train_batch_end 1", "module on_train_batch_end 1",
      "callback on_train_batch_start 2", "module on_train_batch_start 2",
      "callback on_before_backward 2", "module on_before_backward 2",
      "module training_step 2",
      "callback on_after_backward 2", "module on_after_backward 2",
      "callback on_before_optimizer_step", "module on_before_optimizer_step",
      "callback on_before_zero_grad", "module on_before_zero_grad",
      "callback on_train_batch_end 2", "module on_train_batch_end 2",
      "callback on_validation_start", "module on_validation_start",
      "callback on_validation_batch_start 1", "module on_validation_batch_start 1",
      "module validation_step 1",
      "callback on_validation_batch_end 1", "module on_validation_batch_end 1",
      "callback on_validation_end", "module on_validation_end",
      "callback on_train_epoch_end", "module on_train_epoch_end",
      "callback on_train_end", "module on_train_end",
      "callback on_fit_end", "module on_fit_end",
      "datamodule teardown fit",
      "callback teardown fit",
      "module teardown fit",
    }, trace)
  end)

  it("get the callbacks' arguments after the trainer, and rank_zero_only asks the module's trainer", function()
    local got = {}
    local M = pg.TrainingModule:extend("Args")
    function M:on_train_batch_start(batch, i) got.batch, got.i = batch, i end
    function M:on_before_optimizer_step(opt) got.opt = opt end
    M.on_fit_start = pg.rank_zero_only(function() got.fit_start = true end)
    local engine = T.fake_engine{}
    local seen_batch
    local t = pg.Trainer{ optimizer = T.fake_optimizer(engine), out = T.capture(), max_steps = 1,
      ctx = T.fake_context{ rank = 1, world_size = 2 },
      callbacks = { { name = "B", on_train_batch_start = function(_, _, batch) seen_batch = batch end } } }
    t:fit(M{ engine = engine }, data_module())
    assert.equal(seen_batch, got.batch) -- the same batch table
    assert.same({ 1, t.optimizer }, { got.i, got.opt })
    assert.is_nil(got.fit_start) -- rank 1
  end)

  it("are checked like callbacks' and named in errors, as is the DataModule", function()
    local e = T.fake_engine{}
    local function fit(module, dm)
      return pg.Trainer{ optimizer = T.fake_optimizer(e), out = T.capture(), max_steps = 1 }:fit(module, dm or data_module())
    end
    local Typo = pg.TrainingModule:extend("Typo")
    function Typo:on_train_epoch_ends() end
    assert.has_error(function() fit(Typo{ engine = e }) end,
      "Trainer: the TrainingModule (Typo) has unknown hook 'on_train_epoch_ends' (did you mean 'on_train_epoch_end'?)")
    local Exc = pg.TrainingModule:extend("Exc")
    function Exc:on_exception() end
    assert.has_error(function() fit(Exc{ engine = e }) end,
      "Trainer: the TrainingModule (Exc) has 'on_exception', a hook that a TrainingModule does not get (callbacks only); "
        .. "put it in a callback")
    local Busy = pg.DataModule:extend("Busy")
    function Busy:on_train_start() end
    assert.has_error(function() fit(pg.TrainingModule{ engine = e }, Busy{}) end,
      "Trainer: the DataModule (Busy) has 'on_train_start', a hook that a DataModule does not get (its hooks are setup "
        .. "and teardown); put it in a callback")

    local Boom = pg.TrainingModule:extend("Boom")
    function Boom:on_train_epoch_start() error("boom", 0) end
    local calls = {}
    local t = pg.Trainer{ optimizer = T.fake_optimizer(e), out = T.capture(), max_steps = 1, callbacks = { {
      on_exception = function(_, _, err) calls[#calls + 1] = "on_exception: " .. err end,
      teardown = function(_, _, stage) calls[#calls + 1] = "teardown " .. stage end } } }
    local module = Boom{ engine = e }
    function module:teardown(stage) calls[#calls + 1] = "module teardown " .. stage end
    local ok, err = pcall(t.fit, t, module, data_module())
    assert.is_false(ok)
    assert.equal("Trainer: on_train_epoch_start of the TrainingModule (Boom) failed: boom", err)
    assert.same({ "on_exception: " .. err, "teardown fit", "module teardown fit" }, calls)

    local Broken = pg.DataModule:extend("Broken")
    function Broken:setup() error("no shards", 0) end
    ok, err = pcall(fit, pg.TrainingModule{ engine = e }, Broken{})
    assert.equal("Trainer: setup of the DataModule (Broken) failed: no shards", err)
  end)
end)

describe("module and DataModule state in checkpoints", function()
  local dir
  before_each(function() dir = h.tmpdir() end)
  after_each(function() h.rm(dir) end)

  local Counting = pg.TrainingModule:extend("Counting")
  function Counting:training_step(batch, i)
    self.batches = (self.batches or 0) + 1
    return self:forward_backward(batch.inputs, batch.targets)
  end
  function Counting:state_dict() return { batches = self.batches } end
  function Counting:load_state_dict(s) self.batches = s.batches end
  function Counting:on_load_checkpoint(m) self.loaded_step = m.step end

  local Shards = pg.DataModule:extend("Shards")
  function Shards:setup() self.data = self.data or T.fake_data{ batches = 4 } end
  function Shards:train_dataloader() return self.data end
  function Shards:state_dict() return { shard = self.shard } end
  function Shards:load_state_dict(s) self.shard = s.shard end

  local function run(steps, module, dm, resume)
    local engine = T.fake_engine{}
    module.engine = engine
    local t = pg.Trainer{ optimizer = T.fake_optimizer(engine, { momentum = 0.5 }), out = T.capture(), out_dir = dir,
      max_steps = steps }
    t:fit(module, dm, { resume = resume })
    return t, engine
  end

  it("survive a save and a resume, which continues as the run that was not interrupted", function()
    local _, whole = run(3, Counting{}, Shards{ shard = "a" })
    local t = run(2, Counting{}, Shards{ shard = "b" })
    local path = t:save_checkpoint()
    local m = pg.checkpoint.read_manifest(path)
    assert.same({ batches = 2 }, m.callbacks.TrainingModule)
    assert.same({ shard = "b" }, m.callbacks.DataModule)
    local module, dm = Counting{}, Shards{ shard = "fresh" }
    local resumed, engine = run(3, module, dm, path)
    assert.same({ 2, "b" }, { module.loaded_step, dm.shard })
    assert.equal(3, module.batches) -- 2 restored, 1 trained
    assert.equal(3, resumed.state.step)
    assert.same(whole.w, engine.w)
  end)

  it("uses the keys TrainingModule and DataModule, which a callback's state may not take", function()
    local cb = { name = "TrainingModule", state_dict = function() return {} end }
    local e = T.fake_engine{}
    assert.has_error(function()
      pg.Trainer{ optimizer = T.fake_optimizer(e), out = T.capture(), callbacks = { cb } }
        :fit(Counting{ engine = e }, data_module())
    end, "Trainer: callback 1 (TrainingModule) has state_key 'TrainingModule', the key the TrainingModule (Counting)'s "
      .. "state is saved under; give it another state_key=")
  end)
end)

describe("fit / validate / test arguments", function()
  local e = T.fake_engine{}
  local M = pg.TrainingModule:extend("Classifier")
  local D = pg.DataModule:extend("Shards")
  local function trainer(o)
    o = o or {}
    o.out = T.capture()
    return pg.Trainer(o)
  end

  it("refuse mixed or misplaced modules, naming what is wrong", function()
    local t = trainer{ optimizer = T.fake_optimizer(e) }
    local m, dm, data = M{ engine = e }, data_module(), T.fake_data{}
    assert.has_error(function() t:fit(m) end,
      "Trainer: fit(module, datamodule): after the TrainingModule (Classifier) comes a pg.DataModule, got nothing")
    assert.has_error(function() t:fit(m, data) end,
      "Trainer: fit(module, datamodule): after the TrainingModule (Classifier) comes a pg.DataModule, got a data "
        .. "object (wrap data objects: pg.DataModule.from_data{train = ..., val = ...})")
    assert.has_error(function() t:fit(dm, m) end,
      "Trainer: fit(module, datamodule): got the DataModule (GivenData) and the TrainingModule (Classifier); the "
        .. "TrainingModule comes first, then the DataModule")
    assert.has_error(function() t:fit(data, dm) end,
      "Trainer: fit(module, datamodule): got a data object and the DataModule (GivenData); the TrainingModule comes "
        .. "first, then the DataModule")
    assert.has_error(function() t:fit(M, dm) end,
      "Trainer: fit: argument 1 is the class Classifier, not an instance; make one with Classifier{...}")
    assert.has_error(function() t:test(m, D) end,
      "Trainer: test: argument 2 is the class Shards, not an instance; make one with Shards{...}")
    assert.has_error(function() t:fit(m, dm, { resum = "last" }) end,
      "Trainer: fit: unknown option 'resum' (did you mean 'resume'?)")
    assert.has_error(function() t:validate(m) end,
      "Trainer: validate(module, datamodule): after the TrainingModule (Classifier) comes a pg.DataModule, got nothing")
    assert.has_error(function() t:validate(data, data) end,
      "Trainer: validate(data) takes one data object; the second argument is a table")
    assert.has_error(function() trainer():fit(data) end,
      "Trainer: fit(data) needs engine= (what pg.parallelize returns, or pg.testing.fake_engine{}) to train a "
        .. "language model on, or a TrainingModule: fit(module, datamodule)")
    assert.has_error(function() trainer():test(data) end,
      "Trainer: test(data) needs engine= (what pg.parallelize returns, or pg.testing.fake_engine{}) to train a "
        .. "language model on, or a TrainingModule: test(module, datamodule)")
  end)

  it("need an engine and an optimizer, or the methods that make them", function()
    assert.has_error(function() trainer{ optimizer = T.fake_optimizer(e) }:fit(M{}, data_module()) end,
      "Trainer: the TrainingModule (Classifier) has no engine: define configure_model(ctx) returning one, or set "
        .. "module.engine")
    assert.has_error(function() trainer():fit(M{ engine = e }, data_module()) end,
      "Trainer: fit needs optimizer= (e.g. pg.optim.AdamW(engine, {lr = 3e-4})), or configure_optimizers(engine) on "
        .. "the TrainingModule (Classifier)")
    assert.has_error(function() trainer{ engine = 5 } end,
      "Trainer: engine must be an engine (what pg.parallelize returns, or pg.testing.fake_engine{}), got 5")
    assert.has_error(function() trainer{ ctx = "all" } end,
      "Trainer: ctx must be a pg.ParallelContext (or pg.testing.fake_context{}), got 'all'")
    assert.has_error(function() trainer{ engine = T.fake_engine{ rank = 0, world_size = 2 }, ctx = T.fake_context{} } end,
      "Trainer: ctx= is not the engine's context (engine.ctx); give one of them")
  end)

  it("report steps and DataModules that return what cannot be used", function()
    local t = trainer{ optimizer = T.fake_optimizer(e), max_steps = 1 }
    local NoLoss = pg.TrainingModule:extend("NoLoss")
    function NoLoss:training_step() end
    assert.has_error(function() t:fit(NoLoss{ engine = e }, data_module()) end,
      "Trainer: training_step of the TrainingModule (NoLoss) returned a nil at step 1, expected the loss (a number)")
    local Words = pg.TrainingModule:extend("Words")
    function Words:validation_step() return { loss = "low" } end
    assert.has_error(function() t:validate(Words{ engine = e }, data_module()) end,
      "Trainer: validation_step of the TrainingModule (Words) returned loss = 'low' at batch 1; expected a table of "
        .. "named numbers")
    local Empty = pg.TrainingModule:extend("Empty")
    function Empty:test_step() return {} end
    assert.has_error(function() t:test(Empty{ engine = e }, data_module()) end,
      "Trainer: test_step of the TrainingModule (Empty) returned an empty table at batch 1; expected the loss (a "
        .. "number) or a table of named numbers ({loss = ..., accuracy = ...})")
    local Changing = pg.TrainingModule:extend("Changing")
    function Changing:validation_step(_, i) return i == 1 and { loss = 1 } or { loss = 1, accuracy = 1 } end
    assert.has_error(function() t:validate(Changing{ engine = e }, data_module()) end,
      "Trainer: validation_step of the TrainingModule (Changing) returned {accuracy, loss} at batch 2 but {loss} "
        .. "before; every batch must return the same names")
    local Empty2 = D{}
    assert.has_error(function() t:fit(pg.TrainingModule{ engine = e }, Empty2) end,
      "Trainer: the DataModule (Shards) has no train_dataloader()")
    assert.has_error(function() t:validate(pg.TrainingModule{ engine = e }, pg.DataModule.from_data{}) end,
      "Trainer: val_dataloader() of the DataModule (GivenData) returned nil; expected a data object with next_batch()")
    -- without val_dataloader data, fit trains without validation
    local state = t:fit(pg.TrainingModule{ engine = e }, pg.DataModule.from_data{ train = T.fake_data{} })
    assert.is_nil(state.metrics.val_loss)
  end)

  it("DataModule.from_data checks its data objects", function()
    assert.has_error(function() pg.DataModule.from_data{ train = 5 } end,
      "DataModule.from_data: train must be a data object with next_batch(), got 5")
    assert.has_error(function() pg.DataModule.from_data{ trian = T.fake_data{} } end,
      "DataModule.from_data: unknown option 'trian' (did you mean 'train'?)")
  end)
end)
