--- Timer{duration = seconds | "HH:MM:SS" | "DD:HH:MM:SS", clock = fn}: stops
-- training (control.should_stop) at the end of the first step at which the
-- training time reaches `duration`. Time spent before a resume counts (it is
-- in the callback's state). clock: a function returning seconds; default
-- the trainer's clock (see the Trainer's `clock` option).
local callbacks = require "pipegoose.callbacks"
local opt = require "pipegoose.options"

local Timer = callbacks.class("Timer")

local function parse_duration(d)
  if type(d) == "number" then
    if d ~= d or d <= 0 then return nil end
    return d
  end
  if type(d) ~= "string" then return nil end
  local parts = {}
  for p in d:gmatch("[^:]+") do
    local n = tonumber(p)
    if not n then return nil end
    parts[#parts + 1] = n
  end
  local mult, total = { 1, 60, 3600, 86400 }, 0
  if #parts == 0 or #parts > 4 then return nil end
  for i = #parts, 1, -1 do total = total + parts[i] * mult[#parts - i + 1] end
  return total > 0 and total or nil
end
Timer.parse_duration = parse_duration

local SCHEMA = {
  duration = opt.check_with('positive seconds or "HH:MM:SS"', function(d) return parse_duration(d) ~= nil end,
    { required = true }),
  clock = "any", state_key = "any",
}

function Timer.new(opts)
  local o = opt.check("pg.callbacks.Timer", opts, SCHEMA, { required = true })
  return setmetatable({
    duration = parse_duration(o.duration), clock = o.clock, state_key = o.state_key or "Timer",
    offset = 0, -- seconds trained before this run (restored from a checkpoint)
    start = nil, stopped_step = nil,
  }, Timer)
end

function Timer:setup(trainer)
  self._clock = self.clock or trainer.clock
end

--- Seconds of training so far (this run plus restored time).
function Timer:elapsed()
  if not self.start then return self.offset end
  return self.offset + self._clock() - self.start
end

function Timer:on_train_start()
  self.start = self._clock()
end

function Timer:on_train_batch_end(trainer, outputs)
  if not outputs.step_end or self.stopped_step then return end
  local elapsed = self:elapsed()
  if elapsed >= self.duration then
    trainer.control.should_stop = true
    self.stopped_step = trainer.state.step
    trainer:print(("Timer: %.0f s of training reached the duration %.0f s; stopping after step %d")
      :format(elapsed, self.duration, trainer.state.step))
  end
end

function Timer:state_dict()
  return { elapsed = self:elapsed() }
end

function Timer:load_state_dict(sd)
  self.offset = sd.elapsed or 0
  self.start = nil
end

return Timer
