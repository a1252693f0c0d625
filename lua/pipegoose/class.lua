--- Classes that users subclass (pg.TrainingModule, pg.DataModule), in the
-- style of middleclass and Lua Torch's torch.class:
--
--   local Classifier = pg.TrainingModule:extend("Classifier")
--   function Classifier:init(opts) self.classes = opts.classes end -- optional
--   function Classifier:training_step(batch, batch_idx) ... end
--   local m = Classifier{ classes = 10 }   -- Classifier(...) runs m:init(...)
--
-- A class is the metatable of its instances: a method is looked up on the
-- instance, then on its class, then up the parents. `Class.super` is the
-- parent, for explicit super calls: `Classifier.super.validation_step(self, batch, i)`.
-- Plain Lua, so that specs run without the C module.
local M = {}

local function instantiate(cls, ...)
  local obj = setmetatable({}, cls)
  obj:init(...)
  return obj
end

local function class_meta(name, parent)
  return { __index = parent, __call = instantiate, __name = name .. " class" }
end

--- A root class called `name`: instances from `Root(...)`, subclasses from
-- `Root:extend(name)`. Its init(fields) copies a table of fields onto the
-- new instance (`Root{ engine = e }`); a subclass may define its own init.
function M.root(name)
  local cls = { __name = name }
  cls.__index = cls

  function cls.extend(parent, sub_name)
    if type(sub_name) ~= "string" or sub_name == "" then
      error(("%s:extend: expects the new class's name (a string), got a %s"):format(name, type(sub_name)), 2)
    end
    local sub = {}
    -- metamethods are read from the metatable itself, not through __index
    for k, v in pairs(parent) do
      if type(k) == "string" and k:sub(1, 2) == "__" then sub[k] = v end
    end
    sub.__index, sub.__name, sub.super = sub, sub_name, parent
    return setmetatable(sub, class_meta(sub_name, parent))
  end

  function cls:init(fields)
    if fields == nil then return end
    if type(fields) ~= "table" then
      error(("%s{...}: expects a table of fields, got a %s"):format(self.__name, type(fields)), 3)
    end
    for k, v in pairs(fields) do self[k] = v end
  end

  return setmetatable(cls, class_meta(name, nil))
end

--- True when x is an instance of cls or of one of its subclasses.
function M.is_instance(x, cls)
  if type(x) ~= "table" then return false end
  local c = getmetatable(x)
  while type(c) == "table" do
    if c == cls then return true end
    c = rawget(c, "super")
  end
  return false
end

--- True when x is cls or one of its subclasses (a class, not an instance):
-- for the message when a class is passed where an instance belongs.
function M.is_class(x, cls)
  while type(x) == "table" do
    if x == cls then return true end
    x = rawget(x, "super")
  end
  return false
end

return M
