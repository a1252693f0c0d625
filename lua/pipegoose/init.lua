--- pipegoose: 3D-parallel transformer training with a Lua frontend.
-- `local pg = require "pipegoose"` gives the whole API: tensors and
-- collectives from the C runtime, and the Lua layers (models, engine,
-- trainer, callbacks) built on them.
local core = require "pipegoose.core"

local pg = {}
for k, v in pairs(core) do pg[k] = v end
pg.core = core
pg.data = require("pipegoose.data")

pg.nn = require "pipegoose.nn"
local parallel = require "pipegoose.parallel"
pg.parallelize = parallel.parallelize
pg.optim = require "pipegoose.optim"
pg.sample = require "pipegoose.sample"

return pg
