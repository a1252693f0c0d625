--- ModelCheckpoint{dir = nil, every_n_steps = nil, monitor = nil, mode = "min",
-- keep_top_k = nil, keep_last = nil, save_last = false}: asks for checkpoints
-- and keeps the best k of them and/or the newest ones.
--
-- When: at the end of every n-th optimizer step with every_n_steps (counter
-- trainer.state.step), else after every validation run during fit. The
-- request is control.should_save; the trainer combines it across ranks and
-- saves <dir>/step-<step> on every rank (dir: this option, else
-- <out_dir>/checkpoints).
--
-- Which to keep: with `monitor` (a metric name), a checkpoint is requested
-- only when its value would enter the best keep_top_k (default 1) by `mode`;
-- without it the newest keep_top_k are kept (default: all). keep_top_k = -1
-- keeps all, 0 none. After a new checkpoint is complete, the ones that fell
-- out of the top k are deleted (rank 0). save_last = true additionally keeps
-- the newest checkpoint whatever its score, requests one at every check, and
-- saves the final state in on_train_end if that step has none yet.
-- keep_last = n additionally keeps the newest n checkpoints whatever their
-- score and requests one at every check (save_last means at least 1); without
-- a monitor and without keep_top_k it is the whole retention rule: the newest
-- n are kept, older ones deleted once a new one is complete.
-- Checkpoints this callback did not request are never deleted by it.
local callbacks = require "pipegoose.callbacks"
local opt = require "pipegoose.options"

local ModelCheckpoint = callbacks.class("ModelCheckpoint")

local function finite(x) return type(x) == "number" and x == x and x ~= math.huge and x ~= -math.huge end

local SCHEMA = {
  dir = opt.string{ what = "a string path" },
  every_n_steps = opt.integer{ min = 1, max = math.maxinteger },
  monitor = "any", mode = opt.enum({ "min", "max" }, { default = "min" }),
  keep_top_k = opt.integer{ min = -1, max = math.maxinteger }, -- -1: all
  keep_last = opt.integer{ min = 0, max = math.maxinteger },
  save_last = "any", state_key = "any", verbose = "any",
}

function ModelCheckpoint.new(opts)
  local o = opt.check("pg.callbacks.ModelCheckpoint", opts, SCHEMA, { required = true })
  local mode, every, k = o.mode, o.every_n_steps, o.keep_top_k
  local keep_last = o.keep_last or 0
  if o.save_last and keep_last < 1 then keep_last = 1 end
  if k == nil then
    if o.monitor then k = 1 elseif (o.keep_last or 0) > 0 then k = 0 else k = -1 end
  end
  local self = setmetatable({
    checkpoint_dir = o.dir and (o.dir:gsub("/+$", "")) or nil,
    every_n_steps = every, monitor = o.monitor, mode = mode, keep_top_k = k,
    save_last = o.save_last or false, keep_last = keep_last, verbose = o.verbose ~= false,
    state_key = o.state_key or ("ModelCheckpoint{monitor=%s,mode=%s,every_n_steps=%s}")
      :format(tostring(o.monitor), mode, tostring(every)),
    best = {},      -- kept checkpoints, best first: {path=, step=, score=}
    recent = {},    -- the newest keep_last checkpoints, newest first: {path=, step=}
    last = nil,     -- {path=, step=}: the newest (recent[1])
    pending = nil,  -- {step=, score=}: what this callback asked for
    warned = false,
  }, ModelCheckpoint)
  return self
end

-- a better than b (without a monitor the score is the step: newer is better)
function ModelCheckpoint:_better(a, b)
  if not finite(a) then return false end
  if not finite(b) then return true end
  if self.mode == "min" and self.monitor ~= nil then return a < b end
  return a > b
end

--- Whether a checkpoint with this score would be kept.
function ModelCheckpoint:qualifies(score)
  local k = self.keep_top_k
  if k < 0 then return true end
  if k == 0 then return false end
  if #self.best < k then return self.monitor == nil or finite(score) end
  return self:_better(score, self.best[#self.best].score)
end

-- The score of the current state: the monitored metric, or the step (newest
-- is best) without a monitor.
function ModelCheckpoint:_score(trainer)
  if self.monitor == nil then return trainer.state.step end
  return trainer.state.metrics[self.monitor]
end

--- One save point: request a checkpoint when it would be kept.
function ModelCheckpoint:consider(trainer)
  local st = trainer.state
  if st.stage ~= "fit" then return end
  local score = self:_score(trainer)
  if score == nil and not self.warned then
    self.warned = true
    local names = {}
    for k in pairs(st.metrics) do names[#names + 1] = k end
    table.sort(names)
    trainer:print(("ModelCheckpoint: metric '%s' is not available at step %d (metrics: %s); not ranking this save point")
      :format(self.monitor, st.step, table.concat(names, ", ")))
  end
  local keep = score ~= nil and self:qualifies(score)
  if keep or self.keep_last > 0 then
    trainer.control.should_save = true
    self.pending = { step = st.step, score = keep and score or nil }
  end
end

function ModelCheckpoint:on_train_batch_end(trainer, outputs)
  if self.every_n_steps and outputs.step_end and trainer.state.step % self.every_n_steps == 0 then
    self:consider(trainer)
  end
end

function ModelCheckpoint:on_validation_end(trainer)
  if not self.every_n_steps then self:consider(trainer) end
end

local function remove(trainer, path)
  if trainer.state.is_global_zero then require("pipegoose.checkpoint").fs.rm_rf(path) end
end

local function copy_list(list)
  local out = {}
  for i, e in ipairs(list) do out[i] = { path = e.path, step = e.step, score = e.score } end
  return out
end

-- The bookkeeping for a completed save of `path` at `step`: returns the new
-- best list, the new last, and the paths to delete. Pure, so that
-- on_save_checkpoint can store the state as it will be once the save is
-- complete (a resumed run must know about the checkpoint it resumed from).
function ModelCheckpoint:_after_save(path, step)
  local p = self.pending
  local best, recent, evicted = copy_list(self.best), copy_list(self.recent), {}
  local function in_list(list, x)
    for _, e in ipairs(list) do if e.path == x then return true end end
    return false
  end
  if p and p.step == step and p.score ~= nil then
    for i = #best, 1, -1 do -- a re-save of the same path replaces its entry
      if best[i].path == path then table.remove(best, i) end
    end
    best[#best + 1] = { path = path, step = step, score = p.score }
    table.sort(best, function(a, b)
      if a.score == b.score then return a.step > b.step end
      return self:_better(a.score, b.score)
    end)
    while self.keep_top_k >= 0 and #best > self.keep_top_k do
      evicted[#evicted + 1] = table.remove(best).path
    end
  end
  if self.keep_last > 0 then
    for i = #recent, 1, -1 do
      if recent[i].path == path then table.remove(recent, i) end
    end
    table.insert(recent, 1, { path = path, step = step })
    while #recent > self.keep_last do evicted[#evicted + 1] = table.remove(recent).path end
  end
  local delete = {}
  for _, old in ipairs(evicted) do
    if old ~= path and not in_list(best, old) and not in_list(recent, old) then delete[#delete + 1] = old end
  end
  return best, recent, delete
end

function ModelCheckpoint:on_save_checkpoint(trainer, checkpoint, path)
  local best, recent = self:_after_save(path, trainer.state.step)
  checkpoint.callbacks[self.state_key] = { best = best, last = recent[1], recent = recent }
end

-- After a complete save (every rank): update the top k and the newest, and
-- delete (rank 0) what is no longer kept. Only now, so that a crash
-- mid-save never leaves fewer than k good checkpoints.
function ModelCheckpoint:on_checkpoint_saved(trainer, path)
  local p = self.pending
  local best, recent, delete = self:_after_save(path, trainer.state.step)
  self.best, self.recent, self.last, self.pending = best, recent, recent[1], nil
  for _, old in ipairs(delete) do remove(trainer, old) end
  if self.verbose and (p or self.keep_last > 0) then
    local score = p and p.score
    trainer:print(("ModelCheckpoint: saved %s%s"):format(path,
      score ~= nil and self.monitor and ((" (%s %.6g)"):format(self.monitor, score)) or ""))
  end
end

function ModelCheckpoint:on_train_end(trainer)
  local st = trainer.state
  if not self.save_last or st.stage ~= "fit" then return end
  if self.last and self.last.step == st.step then return end
  -- on_train_end runs on every rank after the agreed end, so every rank
  -- reaches this same save.
  local score = self:_score(trainer)
  self.pending = { step = st.step, score = (score ~= nil and self:qualifies(score)) and score or nil }
  trainer:save_checkpoint()
end

--- The best checkpoint's path (nil before the first save).
function ModelCheckpoint:best_path()
  return self.best[1] and self.best[1].path or nil
end

function ModelCheckpoint:state_dict()
  return { best = self.best, last = self.last, recent = self.recent }
end

function ModelCheckpoint:load_state_dict(sd)
  self.best = sd.best or {}
  self.recent = sd.recent or (sd.last and { sd.last } or {})
  self.last = self.recent[1]
end

return ModelCheckpoint
