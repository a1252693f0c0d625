--- ProgressBar{tty = nil, every_n_steps = nil}: one line per logged step on
-- rank 0: step/total, loss, lr, tokens/s, ETA; and a line per validation.
--
-- tty: rewrite one line in place with "\r" (true) or print plain lines
-- (false). Default: $PG_PROGRESS "plain" or "tty" when set; else, under
-- Open MPI's mpirun, which gives every rank's stdout a pseudo-terminal of its
-- own whether mpirun's own output is a terminal or a file (so isatty says
-- nothing about the user's screen, and a log file would get one long line),
-- whether mpirun's stdout is a terminal (pg.fs.parent_isatty: on one node
-- mpirun is the rank's parent; a remote rank's parent is Open MPI's daemon,
-- never a terminal: plain lines); else whether stdout is a terminal
-- (pg.fs.isatty); without the C module (plain Lua), $TERM set and not "dumb". every_n_steps: print every n
-- optimizer steps (counter trainer.state.step); default: the steps where
-- trainer.control.should_log is set (the trainer's log_every_n_steps).
--
-- tokens/s is the rate over the steps since the previous line (the first
-- line: since the fit started), counted in trainer.state.train_elapsed, so
-- the time spent in validation and checkpoint saves does not drag it down
-- the way the fit's average (metrics.tokens_per_s) is after each of them.
local callbacks = require "pipegoose.callbacks"
local opt = require "pipegoose.options"

local ProgressBar = callbacks.class("ProgressBar")

--- Whether the bar rewrites its line by default. getenv (default os.getenv),
-- isatty and parent_isatty (default pg.fs's; false: none, as in plain Lua) are
-- parameters for the specs.
function ProgressBar.default_tty(getenv, isatty, parent_isatty)
  local core = package.loaded["pipegoose.core"]
  -- PG_PROGRESS through pg_env's parser (auto, tty or plain; anything else refused), unless a spec gives getenv
  local forced = getenv and getenv("PG_PROGRESS") or (not getenv and core and core.env("PG_PROGRESS")) or nil
  getenv = getenv or os.getenv
  if forced == "plain" then return false end
  if forced == "tty" then return true end
  local fs = core and core.fs
  -- set in every rank Open MPI launches (not in a singleton ./pglua run)
  if getenv("OMPI_COMM_WORLD_SIZE") then
    if parent_isatty == nil then parent_isatty = fs and fs.parent_isatty end
    return parent_isatty and parent_isatty("stdout") or false
  end
  if isatty == nil then isatty = fs and fs.isatty end
  if isatty then return isatty("stdout") end
  local term = getenv("TERM")
  return term ~= nil and term ~= "" and term ~= "dumb"
end

local SCHEMA = { tty = "any", every_n_steps = opt.integer{ min = 1, max = math.maxinteger } }

function ProgressBar.new(opts)
  local o = opt.check("pg.callbacks.ProgressBar", opts, SCHEMA, { required = true })
  local every = o.every_n_steps
  local tty = o.tty
  if tty == nil then tty = ProgressBar.default_tty() end
  return setmetatable({ tty = tty, every_n_steps = every, width = 0, open_line = false }, ProgressBar)
end

--- 12345 -> "12.3k".
function ProgressBar.human(n)
  if n == nil then return "?" end
  local a = math.abs(n)
  if a >= 1e9 then return ("%.2fG"):format(n / 1e9) end
  if a >= 1e6 then return ("%.2fM"):format(n / 1e6) end
  if a >= 1e3 then return ("%.1fk"):format(n / 1e3) end
  return ("%.0f"):format(n)
end

--- 133 -> "2m13s".
function ProgressBar.duration(s)
  if s == nil or s ~= s or s == math.huge or s < 0 then return "?" end
  s = math.floor(s + 0.5)
  if s >= 3600 then return ("%dh%02dm"):format(s // 3600, (s % 3600) // 60) end
  if s >= 60 then return ("%dm%02ds"):format(s // 60, s % 60) end
  return ("%ds"):format(s)
end

local function num(x)
  if x == nil then return "?" end
  if x ~= x then return "nan" end
  return ("%.4f"):format(x)
end

--- Tokens per second of training over the steps since the previous line:
-- the difference in tokens_seen over the difference in train_elapsed. Without
-- a mark (line() called outside a fit) or training time, metrics.tokens_per_s.
function ProgressBar:recent_tokens_per_s(trainer)
  local st, mark = trainer.state, self.mark
  if mark and st.train_elapsed then
    local dt = st.train_elapsed - mark.time
    if dt > 0 then return (st.tokens_seen - mark.tokens) / dt end
  end
  return st.metrics.tokens_per_s
end

function ProgressBar:_set_mark(trainer)
  local st = trainer.state
  self.mark = { tokens = st.tokens_seen, time = st.train_elapsed or 0 }
end

--- The progress line for the trainer's current state.
function ProgressBar:line(trainer)
  local st = trainer.state
  local m = st.metrics
  local parts = {}
  parts[#parts + 1] = st.total_steps and ("step %d/%d"):format(st.step, st.total_steps) or ("step %d"):format(st.step)
  parts[#parts + 1] = "loss " .. num(m.loss)
  if st.lr then parts[#parts + 1] = ("lr %.2e"):format(st.lr) end
  local rate = self:recent_tokens_per_s(trainer)
  if rate then parts[#parts + 1] = ProgressBar.human(rate) .. " tok/s" end
  if st.total_steps then
    local done = st.step - (self.start_step or 0)
    local eta = done > 0 and st.elapsed / done * (st.total_steps - st.step) or nil
    parts[#parts + 1] = "ETA " .. ProgressBar.duration(eta)
  end
  return table.concat(parts, " | ")
end

function ProgressBar:_emit(trainer, line)
  if self.tty then
    local pad = self.width > #line and (" "):rep(self.width - #line) or ""
    trainer:write("\r" .. line .. pad)
    self.width = #line
    self.open_line = true
  else
    trainer:print(line)
  end
end

function ProgressBar:_close_line(trainer)
  if self.open_line then
    trainer:write("\n")
    self.open_line, self.width = false, 0
  end
end

function ProgressBar:on_train_start(trainer)
  self.start_step = trainer.state.step
  self:_set_mark(trainer)
end

function ProgressBar:on_train_batch_end(trainer, outputs)
  if not outputs.step_end then return end
  local due
  if self.every_n_steps then due = trainer.state.step % self.every_n_steps == 0 else due = trainer.control.should_log end
  if due then
    self:_emit(trainer, self:line(trainer))
    self:_set_mark(trainer)
  end
end

function ProgressBar:on_validation_end(trainer)
  self:_close_line(trainer)
  trainer:print(("step %d | val_loss %s"):format(trainer.state.step, num(trainer.state.metrics.val_loss)))
end

function ProgressBar:on_test_end(trainer)
  self:_close_line(trainer)
  trainer:print(("test_loss %s"):format(num(trainer.state.metrics.test_loss)))
end

function ProgressBar:on_train_end(trainer)
  self:_close_line(trainer)
end

function ProgressBar:on_exception(trainer)
  self:_close_line(trainer)
end

return ProgressBar
