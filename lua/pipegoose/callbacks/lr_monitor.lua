--- LearningRateMonitor{name = "lr"}: publishes the learning rate of each
-- optimizer step as metric `name` (trainer:log), so MetricsLogger records it
-- and ProgressBar shows it, and keeps the (step, lr) history in `history`.
local callbacks = require "pipegoose.callbacks"

local LearningRateMonitor = callbacks.class("LearningRateMonitor")

function LearningRateMonitor.new(opts)
  callbacks.check_options("LearningRateMonitor", opts, { name = true, keep_history = true })
  return setmetatable({
    metric = opts.name or "lr",
    keep_history = opts.keep_history ~= false,
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
