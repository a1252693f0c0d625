--- Callbacks for pg.Trainer: the hook list, `pg.Callback{...}`, the checks the
-- Trainer runs on every callback, `pg.rank_zero_only`, and the built-in
-- callbacks (`pg.callbacks.ProgressBar`, ...), each loaded on first use from
-- lua/pipegoose/callbacks/<name>.lua.
--
-- This module needs nothing but plain Lua: callbacks are unit-tested under
-- busted against pg.testing's fake engine, with no MPI.
local M = {}

--- Every hook, in the order the trainer reaches them in a fit (docs/TRAINER.md).
M.HOOKS = {
  "setup", "on_fit_start", "on_train_start", "on_train_epoch_start",
  "on_train_batch_start", "on_before_backward", "on_after_backward",
  "on_before_optimizer_step", "on_before_zero_grad", "on_train_batch_end",
  "on_validation_start", "on_validation_batch_start", "on_validation_batch_end", "on_validation_end",
  "on_train_epoch_end", "on_save_checkpoint", "on_checkpoint_saved", "on_load_checkpoint",
  "on_train_end", "on_fit_end",
  "on_test_start", "on_test_batch_start", "on_test_batch_end", "on_test_end",
  "on_exception", "teardown",
}
M.IS_HOOK = {}
for _, h in ipairs(M.HOOKS) do M.IS_HOOK[h] = true end

-- Function-valued fields that are part of the callback protocol but not hooks.
M.MEMBERS = { state_dict = true, load_state_dict = true }

--- Who gets which hooks, as in Lightning: a callback every hook; a
-- TrainingModule every hook but on_exception and on_checkpoint_saved (hooks
-- of callbacks only); a DataModule setup and teardown. `name` labels the
-- kind in messages and is the key its state is saved under in checkpoints.
local function kind(name, hooks)
  local is_hook = {}
  for _, h in ipairs(hooks) do is_hook[h] = true end
  return { name = name, hooks = hooks, is_hook = is_hook }
end
M.CALLBACK = kind("callback", M.HOOKS)
local CALLBACK_ONLY = { on_exception = true, on_checkpoint_saved = true }
local module_hooks = {}
for _, h in ipairs(M.HOOKS) do
  if not CALLBACK_ONLY[h] then module_hooks[#module_hooks + 1] = h end
end
M.TRAINING_MODULE = kind("TrainingModule", module_hooks)
M.DATA_MODULE = kind("DataModule", { "setup", "teardown" })

-- "Did you mean": pipegoose.options' (one place for the wording), re-exported
-- for the hook and flag names checked here and by the trainer. The built-ins'
-- options tables go through pipegoose.options' check themselves.
local options = require "pipegoose.options"
M.distance, M.closest, M.suggestion = options.distance, options.closest, options.suggestion

--- A readable name for a callback: its `name` field, else its class name.
function M.name_of(cb)
  if type(cb) ~= "table" then return nil end
  local name = cb.name
  if type(name) == "string" then return name end
  local mt = getmetatable(cb)
  if type(mt) == "table" and type(mt.__name) == "string" then return mt.__name end
  return nil
end

-- All string keys of a callback: its own fields and those of its classes
-- (tables reached through __index), nearest first.
local function each_field(cb, fn)
  local seen, t, depth = {}, cb, 0
  while type(t) == "table" and depth < 16 do
    for k, v in pairs(t) do
      if type(k) == "string" and not seen[k] then
        seen[k] = true
        fn(k, cb[k] ~= nil and cb[k] or v)
      end
    end
    local mt = getmetatable(t)
    t = type(mt) == "table" and rawget(mt, "__index") or nil
    depth = depth + 1
  end
end

-- A function field that looks like an attempt at a hook: it starts with
-- "on_", or it is a near miss of a hook name (setup/teardown typos). Other
-- function fields are helper methods and are allowed.
-- Remembered per name: a module's class methods are checked at every fit.
local hook_like_seen = {}
local function hook_like(k)
  if k:sub(1, 3) == "on_" then return true end
  local known = hook_like_seen[k]
  if known ~= nil then return known end
  local near = false
  for _, h in ipairs(M.HOOKS) do
    -- the distance is at least the difference in length: most hooks need no distance computed
    if math.abs(#h - #k) <= 2 and M.distance(k, h) <= 2 then near = true break end
  end
  hook_like_seen[k] = near
  return near
end

--- Checks one callback (or, with `of` = M.TRAINING_MODULE / M.DATA_MODULE,
-- one module: only the hooks of its kind are allowed); returns nil or an
-- error message (without prefix).
function M.problem(cb, of)
  of = of or M.CALLBACK
  if type(cb) ~= "table" then
    return ("is a %s, not a table of hooks"):format(type(cb))
  end
  local msg
  each_field(cb, function(k, v)
    if msg or k:sub(1, 1) == "_" then return end
    if of.is_hook[k] or M.MEMBERS[k] then
      if type(v) ~= "function" and not (type(v) == "table" and getmetatable(v) and getmetatable(v).__call) then
        msg = ("has hook '%s' set to a %s, not a function"):format(k, type(v))
      end
    elseif type(v) == "function" and M.IS_HOOK[k] then
      msg = ("has '%s', a hook that a %s does not get (%s); put it in a callback"):format(k, of.name,
        of == M.DATA_MODULE and "its hooks are setup and teardown" or "callbacks only")
    elseif type(v) == "function" and hook_like(k) then
      msg = ("has unknown hook '%s'%s"):format(k, M.suggestion(k, of.hooks))
    end
  end)
  if msg then return msg end
  if cb.state_key ~= nil and type(cb.state_key) ~= "string" then
    return ("has state_key of type %s (expected a string)"):format(type(cb.state_key))
  end
  return nil
end

--- Describes callback `i` for messages: "callback 3 (EarlyStopping)".
function M.describe(cb, i)
  local name = M.name_of(cb)
  return name and ("callback %d (%s)"):format(i, name) or ("callback %d"):format(i)
end

--- Describes a module of kind `of` for messages: "the TrainingModule (Classifier)".
function M.describe_module(obj, of)
  local name = M.name_of(obj)
  if name == nil or name == of.name then return "the " .. of.name end
  return ("the %s (%s)"):format(of.name, name)
end

------------------------------------------------------------------------------
-- pg.Callback{...}: a plain table of hooks, checked now rather than later.

local instance_mt = {
  __name = "Callback",
  __tostring = function(cb) return "Callback(" .. (M.name_of(cb) or "?") .. ")" end,
}

M.Callback = setmetatable({ HOOKS = M.HOOKS, IS_HOOK = M.IS_HOOK }, {
  __call = function(_, fields)
    if type(fields) ~= "table" then
      error(("pg.Callback: expects a table of hooks, got a %s"):format(type(fields)), 2)
    end
    local msg = M.problem(fields)
    if msg then error("pg.Callback: callback " .. (M.name_of(fields) and ("(" .. M.name_of(fields) .. ") ") or "") .. msg, 2) end
    if getmetatable(fields) == nil then setmetatable(fields, instance_mt) end
    return fields
  end,
})

--- A class for built-in (or user) callbacks: `local C = callbacks.class("C")`,
-- methods on C, instances from `C{opts}` via C.new.
function M.class(name)
  local cls = {}
  cls.__index = cls
  cls.__name = name
  cls.__tostring = function(self) return name .. "(" .. (self.state_key or "") .. ")" end
  return setmetatable(cls, {
    __call = function(c, opts) return c.new(opts or {}) end,
    __name = name .. " class",
  })
end

------------------------------------------------------------------------------
-- Rank 0 side effects.

--- This process's global rank: from the C module when it is loaded (pglua),
-- else from the launcher's environment, else 0 (plain lua).
function M.process_rank()
  local core = package.loaded["pipegoose.core"]
  if type(core) == "table" and core.world_rank then
    local ok, r = pcall(core.world_rank)
    if ok and r then return r end
  end
  return tonumber(os.getenv("OMPI_COMM_WORLD_RANK") or os.getenv("PMIX_RANK") or os.getenv("PMI_RANK") or "0") or 0
end

local function is_trainer(x)
  if type(x) ~= "table" then return false end
  local mt = getmetatable(x)
  local view = type(mt) == "table" and rawget(mt, "__trainer_view") -- the trainer as a callback's hook sees it
  return (view or type(rawget(x, "state")) == "table") and x.state.is_global_zero ~= nil
end

--- Wraps fn so that it runs only on global rank 0. Used on a hook
-- (`on_train_end = pg.rank_zero_only(function(self, trainer) ... end)`) it
-- asks the trainer (so fake multi-rank trainers behave), also on a
-- TrainingModule's hook (its self.trainer); elsewhere it asks the process.
-- Returns fn's results on rank 0, nothing elsewhere.
function M.rank_zero_only(fn)
  if type(fn) ~= "function" then
    error(("pg.rank_zero_only: expects a function, got a %s"):format(type(fn)), 2)
  end
  return function(...)
    local a, b = ...
    local owner = type(a) == "table" and rawget(a, "trainer") or nil
    local t = (is_trainer(b) and b) or (is_trainer(a) and a) or (is_trainer(owner) and owner) or nil
    local zero
    if t then zero = t.state.is_global_zero else zero = M.process_rank() == 0 end
    if zero then return fn(...) end
  end
end

------------------------------------------------------------------------------
-- Built-ins, loaded on first use.

local BUILTINS = {
  ProgressBar = "pipegoose.callbacks.progress_bar",
  MetricsLogger = "pipegoose.callbacks.metrics_logger",
  ModelCheckpoint = "pipegoose.callbacks.model_checkpoint",
  EarlyStopping = "pipegoose.callbacks.early_stopping",
  LearningRateMonitor = "pipegoose.callbacks.lr_monitor",
  Timer = "pipegoose.callbacks.timer",
  GradientAccumulationScheduler = "pipegoose.callbacks.accumulation",
  TextSampler = "pipegoose.callbacks.text_sampler",
  LambdaCallback = "pipegoose.callbacks.lambda",
}
M.BUILTIN_NAMES = {}
for k in pairs(BUILTINS) do M.BUILTIN_NAMES[#M.BUILTIN_NAMES + 1] = k end
table.sort(M.BUILTIN_NAMES)

M.builtins = setmetatable({}, {
  __index = function(t, k)
    local mod = BUILTINS[k]
    if not mod then
      error(("pg.callbacks has no '%s'%s (built-ins: %s)"):format(tostring(k),
        type(k) == "string" and M.suggestion(k, M.BUILTIN_NAMES) or "", table.concat(M.BUILTIN_NAMES, ", ")), 2)
    end
    local v = require(mod)
    rawset(t, k, v)
    return v
  end,
})

return M
