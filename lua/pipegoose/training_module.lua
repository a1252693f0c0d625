--- pg.TrainingModule: what the Trainer trains (Lightning's LightningModule):
-- how the engine is made, what one training batch does, what validation
-- and test measure, plus module-level hooks and state. docs/TRAINER.md
-- ("TrainingModule and DataModule") is the reference.
--
--   local Classifier = pg.TrainingModule:extend("Classifier")
--   function Classifier:configure_model(ctx) return pg.parallelize(model, ctx) end
--   function Classifier:validation_step(batch, i) return { loss = ..., accuracy = ... } end
--   trainer:fit(Classifier{}, data_module)
--
-- The base class is today's objective, next-token language modelling:
-- training_step runs the engine's forward and backward pass on the batch,
-- validation_step and test_step its loss. pg.Trainer{engine=} trains
-- TrainingModule.language_model(engine), so code written before modules
-- existed runs unchanged.
--
-- Hooks are not defined here: a module defines the ones it wants (the
-- Trainer's callback handler calls them after the callbacks').
local class = require "pipegoose.class"
local callbacks = require "pipegoose.callbacks"

local TrainingModule = class.root("TrainingModule")

--- The hooks a TrainingModule may define (callbacks.lua says who gets which).
TrainingModule.HOOKS = callbacks.TRAINING_MODULE.hooks

--- True when x is an instance of pg.TrainingModule (or of a subclass).
function TrainingModule.is_instance(x) return class.is_instance(x, TrainingModule) end

--- The default module: the language-model objective on `engine`.
function TrainingModule.language_model(engine)
  return TrainingModule{ name = "LanguageModel", engine = engine }
end

--- One training batch: returns its loss (a number). batch = {inputs=, targets=}.
function TrainingModule:training_step(batch, batch_idx) -- luacheck: ignore 212
  return self:forward_backward(batch.inputs, batch.targets)
end

--- One validation batch: returns the loss, or a table of named numbers
-- ({loss =, accuracy =}) that the trainer averages into val_<name>.
function TrainingModule:validation_step(batch, batch_idx) -- luacheck: ignore 212
  return { loss = self:loss(batch.inputs, batch.targets) }
end

--- One test batch (published as test_<name>): by default what validation measures.
function TrainingModule:test_step(batch, batch_idx)
  return self:validation_step(batch, batch_idx)
end

--- engine:forward_backward(inputs, targets, o): the forward and the backward
-- pass (gradients accumulate in the engine). o is the trainer's options for
-- the current batch (grad_scale, sync: trainer:forward_backward_options()),
-- plus objective = self.objective when the module has one, overridden by
-- `opts`. Returns the engine's loss.
function TrainingModule:forward_backward(inputs, targets, opts)
  if self.engine == nil then
    error(("%s:forward_backward: the module has no engine yet (configure_model makes it)"):format(self.__name), 2)
  end
  if opts ~= nil and type(opts) ~= "table" then
    error(("%s:forward_backward: opts must be a table, got a %s"):format(self.__name, type(opts)), 2)
  end
  local o = self.trainer and self.trainer:forward_backward_options() or {}
  -- the objective runs inside the engine (on the last pipeline stage)
  o.objective = self:bound_objective()
  for k, v in pairs(opts or {}) do o[k] = v end
  return self.engine:forward_backward(inputs, targets, o)
end

--- The module's objective method as the engine calls it: fn(out, batch) ->
-- self:objective(out, batch); nil when the module has none. (A module whose
-- model ends with an output rather than its loss defines
-- `function M:objective(out, batch) return loss, dout end`: README,
-- "Objectives written in Lua".)
function TrainingModule:bound_objective()
  if self.objective == nil then return nil end
  if self._bound_objective == nil then
    self._bound_objective = function(out, batch) return self:objective(out, batch) end
  end
  return self._bound_objective
end

--- engine:loss(inputs, targets) with the module's objective: the loss
-- without gradients (what validation_step reports by default).
function TrainingModule:loss(inputs, targets)
  local objective = self:bound_objective()
  if objective then return self.engine:loss(inputs, targets, { objective = objective }) end
  return self.engine:loss(inputs, targets)
end

--- Publishes a metric: trainer:log(name, value).
function TrainingModule:log(name, value)
  if self.trainer == nil then
    error(("%s:log: the module is not attached to a trainer (trainer:fit/validate/test attach it)"):format(self.__name), 2)
  end
  self.trainer:log(name, value)
end

return TrainingModule
