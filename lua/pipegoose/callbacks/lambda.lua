--- LambdaCallback{on_train_end = function(trainer) ... end, ...}: a callback
-- from loose functions. Each function is called as fn(trainer, ...) (no
-- self: they are closures). Every key must be a hook name, or name /
-- state_key; anything else is an error naming the closest hook.
local callbacks = require "pipegoose.callbacks"

local LambdaCallback = callbacks.class("LambdaCallback")

function LambdaCallback.new(fns)
  if type(fns) ~= "table" then
    error(("pg.callbacks.LambdaCallback: expects a table of hook functions, got a %s"):format(type(fns)), 2)
  end
  local self = setmetatable({ name = "LambdaCallback" }, LambdaCallback)
  for k, fn in pairs(fns) do
    if k == "name" then
      self.name = fn
    elseif callbacks.IS_HOOK[k] then
      if type(fn) ~= "function" then
        error(("pg.callbacks.LambdaCallback: %s must be a function, got a %s"):format(k, type(fn)), 2)
      end
      self[k] = function(_, trainer, ...) return fn(trainer, ...) end
    else
      error(("pg.callbacks.LambdaCallback: '%s' is not a hook%s"):format(tostring(k),
        type(k) == "string" and callbacks.suggestion(k, callbacks.HOOKS) or ""), 2)
    end
  end
  return self
end

return LambdaCallback
