--- GradientAccumulationScheduler{[step] = factor, ...}: from the point where
-- trainer.state.step (optimizer steps done) reaches `step`, every optimizer
-- step accumulates `factor` batches. Before the first key the trainer's
-- `accumulate` option applies. E.g. {[0] = 1, [1000] = 4}: steps 1..1000
-- take one batch each, steps 1001.. take four. Changes apply between steps
-- (trainer:set_accumulate), identically on every rank.
local callbacks = require "pipegoose.callbacks"

local GradientAccumulationScheduler = callbacks.class("GradientAccumulationScheduler")

function GradientAccumulationScheduler.new(schedule)
  if type(schedule) ~= "table" then
    error("pg.callbacks.GradientAccumulationScheduler: expects a table {[step] = factor}", 3)
  end
  local steps = {}
  for k, v in pairs(schedule) do
    local s, f = math.tointeger(k), math.tointeger(v)
    if s == nil or s < 0 then
      error(("pg.callbacks.GradientAccumulationScheduler: key %s must be a step number >= 0"):format(tostring(k)), 3)
    end
    if f == nil or f < 1 then
      error(("pg.callbacks.GradientAccumulationScheduler: factor %s at step %d must be a positive integer")
        :format(tostring(v), s), 3)
    end
    steps[#steps + 1] = { step = s, factor = f }
  end
  if #steps == 0 then error("pg.callbacks.GradientAccumulationScheduler: the schedule is empty", 3) end
  table.sort(steps, function(a, b) return a.step < b.step end)
  return setmetatable({ schedule = steps, initial = nil }, GradientAccumulationScheduler)
end

--- The factor for the step after `done` steps.
function GradientAccumulationScheduler:factor_at(done)
  local f = self.initial or 1
  for _, e in ipairs(self.schedule) do
    if done >= e.step then f = e.factor else break end
  end
  return f
end

function GradientAccumulationScheduler:_apply(trainer)
  local f = self:factor_at(trainer.state.step)
  if f ~= trainer.accumulate then trainer:set_accumulate(f) end
end

function GradientAccumulationScheduler:setup(trainer)
  -- the trainer's own option, before any checkpoint is restored
  if self.initial == nil then self.initial = trainer.accumulate end
end

function GradientAccumulationScheduler:on_train_start(trainer) self:_apply(trainer) end

function GradientAccumulationScheduler:on_train_batch_end(trainer, outputs)
  if outputs.step_end then self:_apply(trainer) end
end

return GradientAccumulationScheduler
