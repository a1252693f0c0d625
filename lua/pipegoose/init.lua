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
pg.generate = require("pipegoose.generate").generate -- the key/value cache path (generate.lua)
pg.loss = require "pipegoose.loss"
pg.tokenizer = require "pipegoose.tokenizer" -- Hugging Face tokenizer.json BPE tokenizers (C, PCRE2, utf8proc)

-- Trainer, training and data modules, callbacks, LR schedules, checkpoints and
-- test fakes (plain Lua).
local callbacks = require "pipegoose.callbacks"
pg.Trainer = require "pipegoose.trainer"
pg.TrainingModule = require "pipegoose.training_module"
pg.DataModule = require "pipegoose.data_module"
pg.CallbackHandler = require "pipegoose.callback_handler"
pg.Callback, pg.callbacks, pg.rank_zero_only = callbacks.Callback, callbacks.builtins, callbacks.rank_zero_only
pg.lr = require "pipegoose.lr"
-- training across islands that sync every H steps (a Trainer callback; docs/TRAINER.md, "DiLoCo")
pg.DiLoCo = require "pipegoose.diloco"
pg.checkpoint = require "pipegoose.checkpoint"
pg.testing = require "pipegoose.testing"
-- the layout planner: pg.plan{model=, gpus=, ...} -> the best layout (docs/PLANNER.md)
pg.plan = require "pipegoose.plan"

return pg
