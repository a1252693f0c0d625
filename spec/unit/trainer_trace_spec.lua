-- Golden call traces: the exact hook sequence of docs/TRAINER.md ("Hook
-- order"), written out by hand. If one of these changes, the documented order
-- changed: update docs/TRAINER.md in the same commit.
local pg = require "pipegoose"
local T = pg.testing

local h = require "helpers"
local tmpdir = h.tmpdir

-- Records every hook with the arguments that identify the call.
local function recorder(trace, opts)
  opts = opts or {}
  local r = { name = "Recorder" }
  local function add(s) trace[#trace + 1] = s end
  function r.setup(_, _, stage) add("setup " .. stage) end
  function r.teardown(_, _, stage) add("teardown " .. stage) end
  function r.on_fit_start() add("on_fit_start") end
  function r.on_fit_end() add("on_fit_end") end
  function r.on_train_start() add("on_train_start") end
  function r.on_train_end() add("on_train_end") end
  function r.on_train_epoch_start(_, t) add("on_train_epoch_start epoch=" .. t.state.epoch) end
  function r.on_train_epoch_end(_, t) add("on_train_epoch_end epoch=" .. t.state.epoch) end
  function r.on_train_batch_start(_, t, batch, i)
    assert(batch.inputs and batch.targets)
    add("on_train_batch_start " .. i)
    if opts.fail_at_batch == i then error("boom") end
  end
  function r.on_before_backward(_, _, i) add("on_before_backward " .. i) end
  function r.on_after_backward(_, _, loss, i)
    assert(type(loss) == "number")
    add("on_after_backward " .. i)
  end
  function r.on_before_optimizer_step(_, t, opt)
    assert(opt == t.optimizer)
    add("on_before_optimizer_step step=" .. t.state.step)
  end
  function r.on_before_zero_grad(_, t) add("on_before_zero_grad step=" .. t.state.step) end
  function r.on_train_batch_end(_, t, outputs, i)
    add("on_train_batch_end " .. i .. (outputs.step_end and " end" or ""))
    if outputs.step_end and opts.save_at == t.state.step then t.control.should_save = true end
  end
  function r.on_validation_start() add("on_validation_start") end
  function r.on_validation_batch_start(_, _, _, i) add("on_validation_batch_start " .. i) end
  function r.on_validation_batch_end(_, _, outputs, i)
    assert(type(outputs.loss) == "number")
    add("on_validation_batch_end " .. i)
  end
  function r.on_validation_end() add("on_validation_end") end
  function r.on_test_start() add("on_test_start") end
  function r.on_test_batch_start(_, _, _, i) add("on_test_batch_start " .. i) end
  function r.on_test_batch_end(_, _, _, i) add("on_test_batch_end " .. i) end
  function r.on_test_end() add("on_test_end") end
  function r.on_save_checkpoint(_, t, ckpt, path)
    assert(ckpt.step == t.state.step and type(path) == "string")
    add("on_save_checkpoint step=" .. t.state.step)
  end
  function r.on_checkpoint_saved(_, _, path) add("on_checkpoint_saved " .. path:match("[^/]+$")) end
  function r.on_load_checkpoint(_, _, ckpt) add("on_load_checkpoint step=" .. ckpt.step) end
  function r.on_exception(_, _, err) add("on_exception " .. tostring(err):match("boom") ) end
  return r
end

local function make(trace, rec_opts, dir, extra)
  local engine = T.fake_engine{}
  local opts = {
    engine = engine, optimizer = T.fake_optimizer(engine), out = T.capture(),
    accumulate = 2, max_epochs = 1, val_every_n_steps = 2, val_batches = 2, out_dir = dir,
    callbacks = { recorder(trace, rec_opts) },
  }
  for k, v in pairs(extra or {}) do opts[k] = v end
  return pg.Trainer(opts)
end

describe("the hook order", function()
  local dir
  before_each(function() dir = tmpdir() end)
  after_each(function() os.execute("rm -rf '" .. dir .. "'") end)

  it("of a fit with accumulation, a checkpoint and validation is exactly the documented one", function()
    -- 4 batches, accumulate = 2: two optimizer steps; a save requested at
    -- step 1; validation after step 2 (val_every_n_steps = 2) over 2 batches.
    local trace = {}
    local trainer = make(trace, { save_at = 1 }, dir)
    trainer:fit(T.fake_data{ batches = 4 }, T.fake_data{ batches = 3, seed = 5 })
    assert.same({
      "setup fit",
      "on_fit_start",
      "on_train_start",
      "on_train_epoch_start epoch=0",
      "on_train_batch_start 1",
      "on_before_backward 1",
      "on_after_backward 1",
      "on_train_batch_end 1",
      "on_train_batch_start 2",
      "on_before_backward 2",
      "on_after_backward 2",
      "on_before_optimizer_step step=0",
      "on_before_zero_grad step=1",
      "on_train_batch_end 2 end",
      "on_save_checkpoint step=1",
      "on_checkpoint_saved step-00000001",
      "on_train_batch_start 3",
      "on_before_backward 3",
      "on_after_backward 3",
      "on_train_batch_end 3",
      "on_train_batch_start 4",
      "on_before_backward 4",
      "on_after_backward 4",
      "on_before_optimizer_step step=1",
      "on_before_zero_grad step=2",
      "on_train_batch_end 4 end",
      "on_validation_start",
      "on_validation_batch_start 1",
      "on_validation_batch_end 1",
      "on_validation_batch_start 2",
      "on_validation_batch_end 2",
      "on_validation_end",
      "on_train_epoch_end epoch=0",
      "on_train_end",
      "on_fit_end",
      "teardown fit",
    }, trace)
    assert.equal(2, trainer.state.step)
    assert.equal(1, trainer.state.epoch)
  end)

  it("of a resumed fit restores before on_fit_start and continues mid-epoch", function()
    make({}, { save_at = 1 }, dir):fit(T.fake_data{ batches = 4 }, T.fake_data{ batches = 3, seed = 5 })
    local trace = {}
    local trainer = make(trace, {}, dir)
    trainer:fit(T.fake_data{ batches = 4 }, T.fake_data{ batches = 3, seed = 5 },
      { resume = dir .. "/checkpoints/step-00000001" })
    assert.same({
      "setup fit",
      "on_load_checkpoint step=1",
      "on_fit_start",
      "on_train_start",
      "on_train_epoch_start epoch=0",
      "on_train_batch_start 3",
      "on_before_backward 3",
      "on_after_backward 3",
      "on_train_batch_end 3",
      "on_train_batch_start 4",
      "on_before_backward 4",
      "on_after_backward 4",
      "on_before_optimizer_step step=1",
      "on_before_zero_grad step=2",
      "on_train_batch_end 4 end",
      "on_validation_start",
      "on_validation_batch_start 1",
      "on_validation_batch_end 1",
      "on_validation_batch_start 2",
      "on_validation_batch_end 2",
      "on_validation_end",
      "on_train_epoch_end epoch=0",
      "on_train_end",
      "on_fit_end",
      "teardown fit",
    }, trace)
  end)

  it("of validate and test", function()
    local trace = {}
    local trainer = make(trace, {}, dir)
    trainer:validate(T.fake_data{ batches = 3 })
    trainer:test(T.fake_data{ batches = 2 })
    assert.same({
      "setup validate",
      "on_validation_start",
      "on_validation_batch_start 1",
      "on_validation_batch_end 1",
      "on_validation_batch_start 2", -- val_batches = 2 of the 3
      "on_validation_batch_end 2",
      "on_validation_end",
      "teardown validate",
      "setup test",
      "on_test_start",
      "on_test_batch_start 1",
      "on_test_batch_end 1",
      "on_test_batch_start 2",
      "on_test_batch_end 2",
      "on_test_end",
      "teardown test",
    }, trace)
  end)

  it("on an error: on_exception, then teardown, then the error propagates", function()
    local trace = {}
    local trainer = make(trace, { fail_at_batch = 3 }, dir)
    local ok, err = pcall(trainer.fit, trainer, T.fake_data{ batches = 4 })
    assert.is_false(ok)
    assert.matches("on_train_batch_start of callback 1 %(Recorder%) failed: .*boom", err)
    assert.same({
      "setup fit",
      "on_fit_start",
      "on_train_start",
      "on_train_epoch_start epoch=0",
      "on_train_batch_start 1",
      "on_before_backward 1",
      "on_after_backward 1",
      "on_train_batch_end 1",
      "on_train_batch_start 2",
      "on_before_backward 2",
      "on_after_backward 2",
      "on_before_optimizer_step step=0",
      "on_before_zero_grad step=1",
      "on_train_batch_end 2 end",
      "on_train_batch_start 3",
      "on_exception boom",
      "teardown fit",
    }, trace)
  end)
end)
