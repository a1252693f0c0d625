--- pg.CallbackHandler: what connects callbacks to the Trainer (Lightning's
-- split: Trainer, CallbackHandler, Callbacks). It holds the callback list,
-- checks every callback once, dispatches each hook to the callbacks that
-- define it in list order, remembers which callback is running so an error
-- can name it, and collects and restores callback state for checkpoints.
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
  local self = setmetatable({ _list = {}, _hooks = {}, _keys = {}, _running = nil }, Handler)
  for _, h in ipairs(callbacks.HOOKS) do self._hooks[h] = {} end
  local keys, ckpt_owner = self._keys, nil
  for i, cb in ipairs(list) do
    local msg = callbacks.problem(cb)
    if msg then fail(level, "%s %s", callbacks.describe(cb, i), msg) end
    local entry = { cb = cb, index = i }
    self._list[i] = cb
    for _, h in ipairs(callbacks.HOOKS) do
      local fn = cb[h]
      if fn ~= nil then table.insert(self._hooks[h], setmetatable({ fn = fn, hook = h }, { __index = entry })) end
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
  return self
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

--- The callbacks that implement `hook`, in call order.
function Handler:callbacks_for(hook)
  if not callbacks.IS_HOOK[hook] then
    fail(2, "callbacks_for: '%s' is not a hook%s", tostring(hook), callbacks.suggestion(tostring(hook), callbacks.HOOKS))
  end
  local out = {}
  for i, e in ipairs(self._hooks[hook]) do out[i] = e.cb end
  return out
end

--- The checkpoint directory a callback asked for (ModelCheckpoint's dir), or nil.
function Handler:checkpoint_dir() return self._checkpoint_dir end

--- Calls `hook` as cb:hook(trainer, ...) on every callback that implements
-- it, in list order. The running callback is remembered (a stack: a hook may
-- call back into the trainer, as ModelCheckpoint saving from on_train_end
-- runs on_save_checkpoint) so that attribute() can name it.
function Handler:call(trainer, hook, ...)
  local list = self._hooks[hook]
  if list == nil then fail(2, "call: '%s' is not a hook%s", tostring(hook), callbacks.suggestion(tostring(hook), callbacks.HOOKS)) end
  if #list == 0 then return end
  local prev = self._running
  for i = 1, #list do
    local e = list[i]
    self._running = e
    e.fn(e.cb, trainer, ...)
  end
  self._running = prev
end

--- An error raised while a hook ran, prefixed with the hook and the callback
-- ("Trainer: on_train_batch_end of callback 2 (Logger) failed: ..."); other
-- errors unchanged. Forgets the running callback (the stack unwound).
function Handler:attribute(err)
  local at = self._running
  self._running = nil
  if at and type(err) == "string" then
    return ("Trainer: %s of %s failed: %s"):format(at.hook, callbacks.describe(at.cb, at.index), err)
  end
  return err
end

--- Calls `hook` on every callback while an error is being handled: each
-- callback runs even when an earlier one fails, and failures go to stderr
-- (they must not hide the error being handled).
function Handler:call_guarded(trainer, hook, ...)
  for _, e in ipairs(self._hooks[hook] or {}) do
    local ok, err = pcall(e.fn, e.cb, trainer, ...)
    if not ok then
      io.stderr:write(("Trainer: %s of %s failed while handling an error: %s\n"):format(hook,
        callbacks.describe(e.cb, e.index), tostring(err)))
    end
  end
end

--- Every stateful callback's state: { [state_key] = cb:state_dict() }.
function Handler:state_dict()
  local out = {}
  for key, i in pairs(self._keys) do
    local cb = self._list[i]
    if cb.state_dict then out[key] = cb:state_dict() end
  end
  return out
end

--- Gives each stateful callback its saved state (keys without a callback,
-- and callbacks without saved state, are left alone).
function Handler:load_state_dict(states)
  if type(states) ~= "table" then fail(2, "load_state_dict: expects a table {[state_key] = state}, got a %s", type(states)) end
  for key, i in pairs(self._keys) do
    local cb = self._list[i]
    if states[key] ~= nil and cb.load_state_dict then cb:load_state_dict(states[key]) end
  end
end

return Handler
