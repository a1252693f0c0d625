--- MetricsLogger{path = nil, format = nil, columns = nil, every_n_steps = nil}:
-- rank 0 writes one record per logged optimizer step, one per validation
-- run and one per test run, flushed at once.
--
-- path: default <out_dir>/metrics.jsonl (or .csv). format: "jsonl" or
-- "csv" (default from the path's extension, else jsonl). A training record
-- has step, epoch, tokens_seen, time (seconds of this run) and every metric
-- except val_*/test_* (loss, grad_norm, tokens_per_s, lr from
-- LearningRateMonitor, anything trainer:log added); a validation record has
-- step, epoch, tokens_seen, time and val_loss (test: test_loss). JSON lines
-- write NaN/inf as null. CSV writes `columns` (default below) with empty
-- cells for missing values. every_n_steps: log every n optimizer steps
-- (counter trainer.state.step); default: where trainer.control.should_log
-- is set. A resumed fit appends to an existing file, and so do
-- validate/test after a fit with the same logger; a fresh fit truncates.
local callbacks = require "pipegoose.callbacks"
local opt = require "pipegoose.options"

local MetricsLogger = callbacks.class("MetricsLogger")

MetricsLogger.DEFAULT_COLUMNS = { "kind", "step", "epoch", "tokens_seen", "time", "loss", "val_loss", "test_loss", "lr",
  "grad_norm", "tokens_per_s" }
local LEADING = { "kind", "step", "epoch", "tokens_seen", "time" }

local SCHEMA = {
  path = "any", format = opt.enum{ "jsonl", "csv" }, columns = "any",
  every_n_steps = opt.integer{ min = 1, max = math.maxinteger },
}

function MetricsLogger.new(opts)
  local o = opt.check("pg.callbacks.MetricsLogger", opts, SCHEMA, { required = true })
  local format = o.format -- default: from the path's extension
  if format == nil and type(o.path) == "string" and o.path:match("%.csv$") then format = "csv" end
  format = format or "jsonl"
  return setmetatable({
    path = o.path, format = format, columns = o.columns or MetricsLogger.DEFAULT_COLUMNS,
    every_n_steps = o.every_n_steps, file = nil,
  }, MetricsLogger)
end

local function json_value(v)
  local tv = type(v)
  if tv == "number" then
    if v ~= v or v == math.huge or v == -math.huge then return "null" end
    if math.type(v) == "integer" then return ("%d"):format(v) end
    return ("%.10g"):format(v)
  elseif tv == "boolean" then
    return tostring(v)
  end
  return (require("cjson").encode(tostring(v)))
end

local function csv_value(v)
  if v == nil then return "" end
  if type(v) == "number" then
    if v ~= v then return "nan" end
    if math.type(v) == "integer" then return ("%d"):format(v) end
    return ("%.10g"):format(v)
  end
  local s = tostring(v)
  if s:find('[,"\n]') then s = '"' .. s:gsub('"', '""') .. '"' end
  return s
end

--- Record -> one line of text (no newline).
function MetricsLogger:format_record(rec)
  if self.format == "csv" then
    local cells = {}
    for i, c in ipairs(self.columns) do cells[i] = csv_value(rec[c]) end
    return table.concat(cells, ",")
  end
  local keys, seen = {}, {}
  for _, k in ipairs(LEADING) do
    if rec[k] ~= nil then keys[#keys + 1] = k; seen[k] = true end
  end
  local rest = {}
  for k in pairs(rec) do if not seen[k] then rest[#rest + 1] = k end end
  table.sort(rest)
  for _, k in ipairs(rest) do keys[#keys + 1] = k end
  local parts = {}
  for i, k in ipairs(keys) do parts[i] = json_value(k) .. ":" .. json_value(rec[k]) end
  return "{" .. table.concat(parts, ",") .. "}"
end

-- Opened on the first record (after a resume has set state.resumed_from).
function MetricsLogger:_write(trainer, rec)
  if not trainer.state.is_global_zero then return end
  self:_open(trainer)
  self.file:write(self:format_record(rec), "\n")
  self.file:flush()
end

function MetricsLogger:_open(trainer)
  if self.file or not trainer.state.is_global_zero then return end
  local path = self.path or (trainer.out_dir .. "/metrics." .. self.format)
  self.path = path
  local fs = require("pipegoose.checkpoint").fs
  local dir = fs.dirname(path)
  if dir ~= "." then fs.mkdir_p(dir) end
  local existing = fs.read(path)
  -- append after a resume, or when this logger already wrote the file
  -- (validate/test after fit); a fresh run truncates
  local append = (trainer.state.resumed_from ~= nil or self.opened) and existing ~= nil and existing ~= ""
  self.opened = true
  local f, err = io.open(path, append and "a" or "w")
  if not f then error(("MetricsLogger: cannot open %s: %s"):format(path, tostring(err)), 0) end
  self.file = f
  if self.format == "csv" and not append then
    f:write(table.concat(self.columns, ","), "\n")
    f:flush()
  end
end

local function base_record(trainer, kind)
  local st = trainer.state
  return { kind = kind, step = st.step, epoch = st.epoch, tokens_seen = st.tokens_seen, time = st.elapsed }
end

function MetricsLogger:on_train_batch_end(trainer, outputs)
  if not outputs.step_end then return end
  local due
  if self.every_n_steps then due = trainer.state.step % self.every_n_steps == 0 else due = trainer.control.should_log end
  if not due then return end
  local rec = base_record(trainer, "train")
  for k, v in pairs(trainer.state.metrics) do
    if not (k:match("^val_") or k:match("^test_")) then rec[k] = v end
  end
  self:_write(trainer, rec)
end

function MetricsLogger:on_validation_end(trainer)
  local rec = base_record(trainer, "val")
  rec.val_loss = trainer.state.metrics.val_loss
  self:_write(trainer, rec)
end

function MetricsLogger:on_test_end(trainer)
  local rec = base_record(trainer, "test")
  rec.test_loss = trainer.state.metrics.test_loss
  self:_write(trainer, rec)
end

function MetricsLogger:teardown()
  if self.file then
    self.file:close()
    self.file = nil
  end
end

return MetricsLogger
