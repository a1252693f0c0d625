-- The custom callbacks of examples/callbacks_recipe.lua, tested the way a
-- user would: busted, pg.testing's fake engine, no MPI, no model.
package.path = "examples/?.lua;" .. package.path

local pg = require "pipegoose"
local cjson = require "cjson"
local LossSpike = require "callbacks.loss_spike"
local RunSummary = require "callbacks.run_summary"

-- A fake engine whose training loss is multiplied by 10 on the given
-- forward_backward calls: the spikes to catch.
local function spiky_engine(spike_calls)
  local engine = pg.testing.fake_engine{}
  local forward_backward = engine.forward_backward
  function engine:forward_backward(inputs, targets, opts)
    local loss = forward_backward(self, inputs, targets, opts)
    if spike_calls[self.calls.forward_backward] then return loss * 10 end
    return loss
  end
  return engine
end

local function trainer_for(engine, callbacks, extra)
  local opts = { engine = engine, optimizer = pg.testing.fake_optimizer(engine, { lr = 0.1 }),
    max_steps = 20, log_every_n_steps = 100, out = pg.testing.capture(), callbacks = callbacks }
  for k, v in pairs(extra or {}) do opts[k] = v end
  return pg.Trainer(opts)
end

describe("LossSpike", function()
  it("reports a spike and forces a log record for that step", function()
    local logged = {}
    local spike = LossSpike{ factor = 3 }
    local trainer = trainer_for(spiky_engine{ [6] = true }, { spike,
      pg.callbacks.LambdaCallback{ on_train_batch_end = function(t, outputs)
        if outputs.step_end and t.control.should_log then logged[#logged + 1] = t.state.step end
      end } })
    local st = trainer:fit(pg.testing.fake_data{ batches = 50 })
    assert.equal(20, st.step, "one spike does not stop training")
    assert.same({ 6 }, logged)
    assert.equal(1, spike.spikes)
    assert.matches("^LossSpike: loss [%d.]+ at step 6 is %d+%.%dx its average [%d.]+ %(1 in a row%)\n$", trainer.out:text())
  end)

  it("stops training after max_spikes spikes in a row", function()
    local spike = LossSpike{ factor = 3, max_spikes = 3 }
    local st = trainer_for(spiky_engine{ [6] = true, [7] = true, [8] = true, [9] = true }, { spike })
      :fit(pg.testing.fake_data{ batches = 50 })
    assert.same({ 8, "should_stop", 3 }, { st.step, st.stop_reason, spike.streak })
  end)

  it("does not judge the first steps, and a normal step resets the streak", function()
    local spike = LossSpike{ factor = 3, warmup = 3, max_spikes = 2 }
    -- call 2 is in the warmup; calls 6 and 8 are spikes but not in a row
    local st = trainer_for(spiky_engine{ [2] = true, [6] = true, [8] = true }, { spike })
      :fit(pg.testing.fake_data{ batches = 50 })
    assert.same({ 20, 2, 0 }, { st.step, spike.spikes, spike.streak })
  end)

  it("keeps its state through a checkpoint", function()
    local spike = LossSpike{}
    trainer_for(spiky_engine{}, { spike }, { max_steps = 5 }):fit(pg.testing.fake_data{})
    local copy = LossSpike{}
    copy:load_state_dict(pg.checkpoint.decode(pg.checkpoint.encode(spike:state_dict())))
    assert.same(spike:state_dict(), copy:state_dict())
    assert.equal(5, copy.seen)
  end)
end)

describe("RunSummary", function()
  local dir
  before_each(function()
    dir = os.tmpname()
    os.remove(dir)
  end)
  after_each(function() os.execute("rm -rf '" .. dir .. "'") end)

  it("writes the summary with the best validation loss on rank 0 only", function()
    for rank = 0, 1 do
      local engine = pg.testing.fake_engine{ rank = rank, world_size = 2,
        eval_loss = function(_, _, _, n) return ({ 3, 2, 2.5 })[n] end }
      local summary = RunSummary{ path = dir .. "/rank" .. rank .. "/summary.json" }
      trainer_for(engine, { summary }, { max_steps = 3, val_every_n_steps = 1, val_batches = 1 })
        :fit(pg.testing.fake_data{}, pg.testing.fake_data{ batches = 1 })
      assert.same({ best = 2, best_step = 2 }, summary:state_dict(), "tracked on every rank")
      local f = io.open(dir .. "/rank" .. rank .. "/summary.json")
      if rank == 0 then
        local s = cjson.decode(f:read("a"))
        f:close()
        assert.same({ 3, 2, 2, "max_steps" }, { s.steps, s.best_val_loss, s.best_val_step, s.stop_reason })
      else
        assert.is_nil(f, "rank 1 writes nothing")
      end
    end
  end)
end)
