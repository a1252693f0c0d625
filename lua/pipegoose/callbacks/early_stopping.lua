--- EarlyStopping{monitor = "val_loss", patience = 3, min_delta = 0, mode = "min",
-- every_n_steps = nil, check_finite = true}: stops training when the
-- monitored metric has not improved for `patience` checks in a row.
--
-- A check happens after each validation run during fit, or, with
-- every_n_steps, at the end of every n-th optimizer step (counter
-- trainer.state.step; for monitoring the training `loss`). Improvement means
-- value < best - min_delta (mode "min") or value > best + min_delta ("max").
-- A NaN or infinite value stops at once when check_finite is true. The
-- decision is a control flag: the trainer combines it across ranks, so every
-- rank stops after the same step.
local callbacks = require "pipegoose.callbacks"
local opt = require "pipegoose.options"

local EarlyStopping = callbacks.class("EarlyStopping")

local function finite(x) return x == x and x ~= math.huge and x ~= -math.huge end

local SCHEMA = {
  monitor = "any", mode = opt.enum({ "min", "max" }, { default = "min" }),
  patience = opt.integer{ min = 1, max = math.maxinteger, default = 3 },
  min_delta = opt.number{ min = 0, finite = false, default = 0 },
  every_n_steps = opt.integer{ min = 1, max = math.maxinteger },
  check_finite = "any", state_key = "any",
}

function EarlyStopping.new(opts)
  local o = opt.check("pg.callbacks.EarlyStopping", opts, SCHEMA, { required = true })
  local mode, patience, min_delta, every = o.mode, o.patience, o.min_delta, o.every_n_steps
  local monitor = o.monitor or "val_loss"
  return setmetatable({
    monitor = monitor, patience = patience, min_delta = min_delta, mode = mode, every_n_steps = every,
    check_finite = o.check_finite ~= false,
    state_key = o.state_key or ("EarlyStopping{monitor=%s,mode=%s}"):format(monitor, mode),
    best = nil, best_step = nil, wait = 0, stopped_step = nil,
  }, EarlyStopping)
end

function EarlyStopping:_improved(value)
  if self.best == nil then return true end
  if self.mode == "min" then return value < self.best - self.min_delta end
  return value > self.best + self.min_delta
end

local function available(metrics)
  local names = {}
  for k in pairs(metrics) do names[#names + 1] = k end
  table.sort(names)
  return #names > 0 and table.concat(names, ", ") or "none"
end

--- One check of the monitored value; sets control.should_stop when done.
function EarlyStopping:check(trainer, value)
  local st = trainer.state
  if self.stopped_step then return end
  if self.check_finite and not finite(value) then
    self.stopped_step = st.step
    trainer.control.should_stop = true
    trainer:print(("EarlyStopping: %s is %s at step %d; stopping"):format(self.monitor, tostring(value), st.step))
    return
  end
  if self:_improved(value) then
    self.best, self.best_step, self.wait = value, st.step, 0
    return
  end
  self.wait = self.wait + 1
  if self.wait >= self.patience then
    self.stopped_step = st.step
    trainer.control.should_stop = true
    trainer:print(("EarlyStopping: %s has not improved for %d checks (best %.6g at step %d); stopping after step %d")
      :format(self.monitor, self.wait, self.best, self.best_step, st.step))
  end
end

function EarlyStopping:on_validation_end(trainer)
  if self.every_n_steps or trainer.state.stage ~= "fit" then return end
  local value = trainer.state.metrics[self.monitor]
  if value == nil then
    error(("EarlyStopping: metric '%s' is not available after validation (metrics: %s)")
      :format(self.monitor, available(trainer.state.metrics)), 0)
  end
  self:check(trainer, value)
end

function EarlyStopping:on_train_batch_end(trainer, outputs)
  if not (self.every_n_steps and outputs.step_end) then return end
  if trainer.state.step % self.every_n_steps ~= 0 then return end
  local value = trainer.state.metrics[self.monitor]
  if value ~= nil then self:check(trainer, value) end -- e.g. val_loss before the first validation
end

function EarlyStopping:state_dict()
  return { best = self.best, best_step = self.best_step, wait = self.wait, stopped_step = self.stopped_step }
end

function EarlyStopping:load_state_dict(sd)
  self.best, self.best_step, self.wait, self.stopped_step = sd.best, sd.best_step, sd.wait or 0, sd.stopped_step
end

return EarlyStopping
