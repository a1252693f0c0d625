--- pg.CallbackHandler: what connects callbacks to the Trainer (Lightning's
-- split: Trainer, CallbackHandler, Callbacks). It holds the callback list,
-- checks every callback once, dispatches each hook to the callbacks that
-- define it in list order, remembers which callback is running so an error
-- can name it, and collects and restores callback state for checkpoints.
--
-- The TrainingModule and the DataModule being run take part the same way
-- (set_module, set_datamodule): in Lightning's order a hook goes to the
-- DataModule (setup and teardown only), then the callbacks, then the
-- TrainingModule; errors name them, and their state is saved beside the
-- callbacks' under the keys "TrainingModule" and "DataModule".
--
-- The Trainer owns one (trainer.callback_handler) and goes through it for
-- every hook. A handler needs nothing but plain Lua: a spec can build one
-- and drive it with any table as the trainer.
local callbacks = require "pipegoose.callbacks"

local Handler = {}
Handler.__index = Handler
Handler.__name = "CallbackHandler"

-- level: as error()'s, counted from fail's caller.
local function fail(level, fmt, ...)
  error("Trainer: " .. fmt:format(...), level > 0 and level + 1 or 0)
end

--- pg.CallbackHandler(list [, level]): checks the callbacks (every problem
-- is an error naming the callback), builds the per-hook call lists, the
-- state keys and the checkpoint directory a callback asks for. `level` is
-- where construction errors point (error()'s level, default the caller).
function Handler.new(list, level)
  level = (level or 1) + 1
  if type(list) ~= "table" then fail(level, "callbacks must be a list of callbacks, got a %s", type(list)) end
  local n = #list
  for k in pairs(list) do
    if math.type(k) ~= "integer" or k < 1 or k > n then
      fail(level, "callbacks must be a list (1..n), found key '%s'", tostring(k))
    end
  end
  local self = setmetatable({ _list = {}, _hooks = {}, _calls = {}, _keys = {}, _running = nil,
    _module = nil, _datamodule = nil }, Handler)
  for _, h in ipairs(callbacks.HOOKS) do self._hooks[h] = {} end
  local keys, ckpt_owner = self._keys, nil
  for i, cb in ipairs(list) do
    local msg = callbacks.problem(cb)
    if msg then fail(level, "%s %s", callbacks.describe(cb, i), msg) end
    self._list[i] = cb
    local who = callbacks.describe(cb, i)
    for _, h in ipairs(callbacks.HOOKS) do
      local fn = cb[h]
      if fn ~= nil then table.insert(self._hooks[h], { fn = fn, hook = h, obj = cb, who = who, with_trainer = true }) end
    end
    if cb.state_dict or cb.load_state_dict or cb.state_key ~= nil then
      local key = cb.state_key or callbacks.name_of(cb)
      if key == nil then
        fail(level, "%s has state_dict/load_state_dict but no state_key (or name) to save its state under",
          callbacks.describe(cb, i))
      end
      if keys[key] then
        local j = keys[key]
        fail(level, "%s and %s share state_key '%s'; give one of them a distinct state_key=",
          callbacks.describe(list[j], j), callbacks.describe(cb, i), key)
      end
      keys[key] = i
    end
    if type(cb.checkpoint_dir) == "string" then
      if self._checkpoint_dir and self._checkpoint_dir ~= cb.checkpoint_dir then
        fail(level, "%s and %s want checkpoints in different directories ('%s', '%s'); the trainer writes one",
          callbacks.describe(list[ckpt_owner], ckpt_owner), callbacks.describe(cb, i), self._checkpoint_dir,
          cb.checkpoint_dir)
      end
      self._checkpoint_dir, ckpt_owner = cb.checkpoint_dir, i
    end
  end
  self:_build_calls()
  return self
end

-- Each hook's call list: the DataModule's, the callbacks' in list order,
-- the TrainingModule's (a module's hook is called as module:hook(...), with
-- the arguments after the trainer: Lightning's signatures).
function Handler:_build_calls()
  for _, h in ipairs(callbacks.HOOKS) do
    local calls = {}
    local dm, m = self._datamodule, self._module
    if dm and dm.hooks[h] then calls[#calls + 1] = dm.hooks[h] end
    for _, e in ipairs(self._hooks[h]) do calls[#calls + 1] = e end
    if m and m.hooks[h] then calls[#calls + 1] = m.hooks[h] end
    self._calls[h] = calls
  end
end

-- A module's participant record: checked against the hooks of its kind,
-- its state key free of callbacks. nil for none.
function Handler:_participant(obj, of, level)
  if obj == nil then return nil end
  local who = callbacks.describe_module(obj, of)
  local msg = callbacks.problem(obj, of)
  if msg then fail(level + 1, "%s %s", who, msg) end
  local key = of.name
  if (obj.state_dict or obj.load_state_dict) and self._keys[key] then
    local i = self._keys[key]
    fail(level + 1, "%s has state_key '%s', the key %s's state is saved under; give it another state_key=",
      callbacks.describe(self._list[i], i), key, who)
  end
  local hooks = {}
  for _, h in ipairs(of.hooks) do
    local fn = obj[h]
    if fn ~= nil then hooks[h] = { fn = fn, hook = h, obj = obj, who = who, with_trainer = false } end
  end
  return { obj = obj, who = who, key = key, hooks = hooks }
end

--- Makes `module` (a pg.TrainingModule; nil: none) the participant called
-- after the callbacks at every hook it defines, as module:hook(...) with the
-- callbacks' arguments after the trainer, and whose state_dict goes into
-- checkpoints under "TrainingModule". It replaces the previous one. `level`
-- is where errors point (error()'s level, default the caller).
function Handler:set_module(module, level)
  self._module = self:_participant(module, callbacks.TRAINING_MODULE, (level or 1) + 1)
  self:_build_calls()
end

--- The same for a pg.DataModule (nil: none): called before the callbacks,
-- at setup and teardown only; its state goes under "DataModule".
function Handler:set_datamodule(datamodule, level)
  self._datamodule = self:_participant(datamodule, callbacks.DATA_MODULE, (level or 1) + 1)
  self:_build_calls()
end

setmetatable(Handler, {
  __call = function(_, list, level)
    local handler = Handler.new(list, (level or 1) + 1) -- not a tail call: the error level counts this frame
    return handler
  end,
})

--- The callbacks, in the order they were given (a copy).
function Handler:list()
  local out = {}
  for i, cb in ipairs(self._list) do out[i] = cb end
  return out
end

--- The callbacks that implement `hook`, in call order (modules not included).
function Handler:callbacks_for(hook)
  if not callbacks.IS_HOOK[hook] then
    fail(2, "callbacks_for: '%s' is not a hook%s", tostring(hook), callbacks.suggestion(tostring(hook), callbacks.HOOKS))
  end
  local out = {}
  for i, e in ipairs(self._hooks[hook]) do out[i] = e.obj end
  return out
end

--- The checkpoint directory a callback asked for (ModelCheckpoint's dir), or nil.
function Handler:checkpoint_dir() return self._checkpoint_dir end

-- The trainer as callbacks see it: the same trainer (its methods, control,
-- fields; == the trainer), but trainer.state is read-only: a callback that
-- writes a state field (state.step = 0) raises naming itself and the field,
-- as it would otherwise change the run behind the trainer's back. Nested
-- tables (state.metrics) are the trainer's own; trainer:log is how a metric
-- is added. Made once per trainer, on the first hook call.
function Handler:_view(trainer)
  if type(trainer) ~= "table" or type(trainer.state) ~= "table" then return trainer end
  self._views = self._views or setmetatable({}, { __mode = "k" })
  local view = self._views[trainer]
  if view then return view end
  local handler = self
  local state = setmetatable({}, {
    __index = function(_, k) return trainer.state[k] end,
    __newindex = function(_, k)
      local at = handler._running
      error(("Trainer: %s of %s wrote trainer.state.%s; the trainer's state is read-only to callbacks (set "
        .. "trainer.control.should_stop / should_save, or add a metric with trainer:log)"):format(
        at and at.hook or "a hook", at and at.who or "a callback", tostring(k)), 2)
    end,
    __pairs = function() return next, trainer.state, nil end,
    __len = function() return #trainer.state end,
  })
  local bound = {}
  view = setmetatable({}, {
    __trainer_view = true, -- pg.rank_zero_only knows it for a trainer (callbacks.lua's is_trainer)
    __index = function(_, k)
      if k == "state" then return state end
      local v = trainer[k]
      if type(v) ~= "function" then return v end
      -- view:method(...) runs as trainer:method(...): the trainer's own code writes its state
      bound[k] = bound[k] or function(first, ...)
        if rawequal(first, view) then first = trainer end
        return trainer[k](first, ...)
      end
      return bound[k]
    end,
    __newindex = function(_, k, v)
      if k == "state" then
        local at = handler._running
        error(("Trainer: %s of %s replaced trainer.state; the trainer's state is read-only to callbacks"):format(
          at and at.hook or "a hook", at and at.who or "a callback"), 2)
      end
      trainer[k] = v
    end,
    __eq = function(a, b) return rawequal(a, b) or (rawequal(a, view) and rawequal(b, trainer))
      or (rawequal(b, view) and rawequal(a, trainer)) end,
    __tostring = function() return tostring(trainer) end,
  })
  self._views[trainer] = view
  return view
end

--- Calls `hook` on every participant that implements it: the DataModule,
-- the callbacks in list order (cb:hook(trainer, ...)), the TrainingModule
-- (module:hook(...)). The running one is remembered (a stack: a hook may
-- call back into the trainer, as ModelCheckpoint saving from on_train_end
-- runs on_save_checkpoint) so that attribute() can name it.
function Handler:call(trainer, hook, ...)
  local list = self._calls[hook]
  if list == nil then fail(2, "call: '%s' is not a hook%s", tostring(hook), callbacks.suggestion(tostring(hook), callbacks.HOOKS)) end
  if #list == 0 then return end
  local prev = self._running
  local view = self:_view(trainer)
  for i = 1, #list do
    local e = list[i]
    self._running = e
    if e.with_trainer then e.fn(e.obj, view, ...) else e.fn(e.obj, ...) end
  end
  self._running = prev
end

--- An error raised while a hook ran, prefixed with the hook and who ran it
-- ("Trainer: on_train_batch_end of callback 2 (Logger) failed: ...", "...
-- of the TrainingModule (Classifier) failed: ..."); other errors unchanged.
-- Forgets the running participant (the stack unwound).
function Handler:attribute(err)
  local at = self._running
  self._running = nil
  if at and type(err) == "string" then
    return ("Trainer: %s of %s failed: %s"):format(at.hook, at.who, err)
  end
  return err
end

--- Calls `hook` on every participant while an error is being handled: each
-- runs even when an earlier one fails, and failures go to stderr (they must
-- not hide the error being handled).
function Handler:call_guarded(trainer, hook, ...)
  local view = self:_view(trainer)
  for _, e in ipairs(self._calls[hook] or {}) do
    local ok, err
    if e.with_trainer then ok, err = pcall(e.fn, e.obj, view, ...) else ok, err = pcall(e.fn, e.obj, ...) end
    if not ok then
      io.stderr:write(("Trainer: %s of %s failed while handling an error: %s\n"):format(hook, e.who, tostring(err)))
    end
  end
end

-- The modules taking part, in the order their state is restored (after the
-- callbacks): the TrainingModule, then the DataModule.
function Handler:_modules()
  local out = {}
  if self._module then out[#out + 1] = self._module end
  if self._datamodule then out[#out + 1] = self._datamodule end
  return out
end

--- Every stateful callback's state, { [state_key] = cb:state_dict() }, and
-- the modules': ["TrainingModule"] = module:state_dict(), ["DataModule"] = ...
function Handler:state_dict()
  local out = {}
  for key, i in pairs(self._keys) do
    local cb = self._list[i]
    if cb.state_dict then out[key] = cb:state_dict() end
  end
  for _, p in ipairs(self:_modules()) do
    if p.obj.state_dict then out[p.key] = p.obj:state_dict() end
  end
  return out
end

--- Gives each stateful callback, then the TrainingModule and the DataModule,
-- its saved state (keys nobody has, and participants without saved state,
-- are left alone).
function Handler:load_state_dict(states)
  if type(states) ~= "table" then fail(2, "load_state_dict: expects a table {[state_key] = state}, got a %s", type(states)) end
  for key, i in pairs(self._keys) do
    local cb = self._list[i]
    if states[key] ~= nil and cb.load_state_dict then cb:load_state_dict(states[key]) end
  end
  for _, p in ipairs(self:_modules()) do
    if states[p.key] ~= nil and p.obj.load_state_dict then p.obj:load_state_dict(states[p.key]) end
  end
end

--- Tensor files for checkpoints (state too large for the manifest's JSON,
-- different on every rank): each stateful callback with
-- save_checkpoint_files(trainer, dir) writes its files into dir (the
-- checkpoint's directory being written; every rank calls this at the same
-- point) and returns their records { {file=, bytes=, crc32=}, ... }.
-- Returns { [state_key] = records } (this rank's; the save gathers them).
function Handler:save_files(trainer, dir)
  local out = {}
  for key, i in pairs(self._keys) do
    local cb = self._list[i]
    if cb.save_checkpoint_files then out[key] = cb:save_checkpoint_files(trainer, dir) end
  end
  return out
end

--- The other way, after load_state_dict: each callback with
-- load_checkpoint_files(trainer, dir, records) gets its records from the
-- manifest (every rank's; an empty list when the checkpoint has none).
function Handler:load_files(trainer, dir, files)
  if type(files) ~= "table" then fail(2, "load_files: expects a table {[state_key] = records}, got a %s", type(files)) end
  for key, i in pairs(self._keys) do
    local cb = self._list[i]
    if cb.load_checkpoint_files then cb:load_checkpoint_files(trainer, dir, files[key] or {}) end
  end
end

return Handler
