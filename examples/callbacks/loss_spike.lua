--- LossSpike: a custom callback, as a user would write one.
--
-- Compares the training loss of every optimizer step with an exponential
-- moving average of the previous ones. A step whose loss is more than
-- `factor` times the average is a spike: it is printed (rank 0) and logged
-- (control.should_log, so MetricsLogger records that step even between
-- log_every_n_steps); `max_spikes` spikes in a row stop training
-- (control.should_stop: the trainer stops every rank after that step).
-- Spikes do not move the average. The average and the counters are saved in
-- checkpoints (state_dict / load_state_dict under state_key "LossSpike").
--
--   local LossSpike = require "callbacks.loss_spike"
--   pg.Trainer{ ..., callbacks = { LossSpike{ factor = 2, max_spikes = 3 } } }
local pg = require "pipegoose"

local LossSpike = {}
LossSpike.__index = LossSpike

local function new(opts)
  opts = opts or {}
  local self = setmetatable({
    name = "LossSpike",
    state_key = "LossSpike",
    factor = opts.factor or 2,         -- a spike: loss > factor * average
    decay = opts.decay or 0.9,         -- weight of the old average
    warmup = opts.warmup or 3,         -- steps averaged before spikes are judged
    max_spikes = opts.max_spikes or 3, -- spikes in a row that stop training
    average = nil, seen = 0, streak = 0, spikes = 0,
  }, LossSpike)
  return pg.Callback(self) -- checks the hook names now
end

function LossSpike:is_spike(loss)
  return self.seen >= self.warmup and loss > self.factor * self.average
end

function LossSpike:on_train_batch_end(trainer, outputs)
  if not outputs.step_end then return end -- one check per optimizer step
  local loss = trainer.state.metrics.loss
  if self:is_spike(loss) then
    self.spikes, self.streak = self.spikes + 1, self.streak + 1
    trainer.control.should_log = true
    trainer:print(("LossSpike: loss %.4f at step %d is %.1fx its average %.4f (%d in a row)")
      :format(loss, trainer.state.step, loss / self.average, self.average, self.streak))
    if self.streak >= self.max_spikes then trainer.control.should_stop = true end
    return
  end
  self.streak = 0
  self.seen = self.seen + 1
  self.average = self.average and (self.decay * self.average + (1 - self.decay) * loss) or loss
end

function LossSpike:state_dict()
  return { average = self.average, seen = self.seen, streak = self.streak, spikes = self.spikes }
end

function LossSpike:load_state_dict(sd)
  self.average, self.seen, self.streak, self.spikes = sd.average, sd.seen, sd.streak, sd.spikes
end

return new
