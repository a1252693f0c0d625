--- LearningRateMonitor{name = "lr"}: publishes the learning rate of each
-- optimizer step as metric `name` (trainer:log), so MetricsLogger records it
-- and ProgressBar shows it, and keeps the (step, lr) history in `history`.
local callbacks = require "pipegoose.callbacks"
local opt = require "pipegoose.options"

local LearningRateMonitor = callbacks.class("LearningRateMonitor")

local SCHEMA = { name = "any", keep_history = "any" }

function LearningRateMonitor.new(opts)
  local o = opt.check("pg.callbacks.LearningRateMonitor", opts, SCHEMA, { required = true })
  return setmetatable({
    metric = o.name or "lr",
    keep_history = o.keep_history ~= false,
    history = {},
  }, LearningRateMonitor)
end

-- The trainer sets the lr before a step's first batch: publishing it at
-- batch start makes it visible to every logger's on_train_batch_end,
-- whatever the callbacks' order.
function LearningRateMonitor:on_train_batch_start(trainer)
  trainer:log(self.metric, trainer.state.lr)
end

function LearningRateMonitor:on_train_batch_end(trainer, outputs)
  if outputs.step_end and self.keep_history then
    self.history[#self.history + 1] = { step = trainer.state.step, lr = trainer.state.lr }
  end
end

return LearningRateMonitor
