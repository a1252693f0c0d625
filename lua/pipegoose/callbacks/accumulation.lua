--- GradientAccumulationScheduler{[step] = factor, ...}: from the point where
-- trainer.state.step (optimizer steps done) reaches `step`, every optimizer
-- step accumulates `factor` batches. Before the first key the trainer's
-- `accumulate` option applies. E.g. {[0] = 1, [1000] = 4}: steps 1..1000
-- take one batch each, steps 1001.. take four. Changes apply between steps
-- (trainer:set_accumulate), identically on every rank.
local callbacks = require "pipegoose.callbacks"
local opt = require "pipegoose.options"

local GradientAccumulationScheduler = callbacks.class("GradientAccumulationScheduler")

local W = "pg.callbacks.GradientAccumulationScheduler"
local STEP = opt.integer{ min = 0, max = math.maxinteger, what = "a step number >= 0" }
local FACTOR = opt.integer{ min = 1, max = math.maxinteger }

function GradientAccumulationScheduler.new(schedule)
  if type(schedule) ~= "table" then error(W .. ": expects a table {[step] = factor}", 2) end
  -- keys in order (numbers first), so that every rank reports the same first problem
  local keys = {}
  for k in pairs(schedule) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b)
    local na, nb = type(a) == "number", type(b) == "number"
    if na ~= nb then return na end
    if na then return a < b end
    return tostring(a) < tostring(b)
  end)
  local steps = {}
  for _, k in ipairs(keys) do
    local s = opt.value(W, "a key", k, STEP)
    local f = opt.value(W, ("the factor at step %d"):format(s), schedule[k], FACTOR)
    steps[#steps + 1] = { step = s, factor = f }
  end
  if #steps == 0 then error(W .. ": the schedule is empty", 2) end
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
