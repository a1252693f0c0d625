--- pg.DataModule: where a fit, validate or test gets its data (Lightning's
-- LightningDataModule). A subclass defines setup(stage) (optional: called
-- before the callbacks' setup, with "fit", "validate" or "test"),
-- train_dataloader(), val_dataloader(), test_dataloader() (each returns a
-- data object with next_batch(), see docs/DESIGN.md), and optionally
-- teardown(stage) and state_dict()/load_state_dict(state) for checkpoints.
--
--   local Shards = pg.DataModule:extend("Shards")
--   function Shards:setup(stage) self.train = pg.data.TokenShards{...} end
--   function Shards:train_dataloader() return self.train end
--
-- DataModule.from_data{train=, val=, test=} wraps data objects made already.
local class = require "pipegoose.class"
local callbacks = require "pipegoose.callbacks"
local options = require "pipegoose.options"

local DataModule = class.root("DataModule")

--- The hooks a DataModule may define: setup and teardown.
DataModule.HOOKS = callbacks.DATA_MODULE.hooks

--- True when x is an instance of pg.DataModule (or of a subclass).
function DataModule.is_instance(x) return class.is_instance(x, DataModule) end

local GivenData = DataModule:extend("GivenData")
function GivenData:train_dataloader() return self.train end
function GivenData:val_dataloader() return self.val end
function GivenData:test_dataloader() return self.test end

local DATA = options.check_with("a data object with next_batch()", function(v)
  return (type(v) == "table" or type(v) == "userdata") and v.next_batch ~= nil
end)

--- A DataModule over data objects that exist already: {train=, val=, test=}
-- (each optional; the stage that needs a missing one says so).
function DataModule.from_data(sources)
  return GivenData(options.check("DataModule.from_data", sources, { train = DATA, val = DATA, test = DATA }))
end

return DataModule
