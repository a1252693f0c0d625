-- A short recipe with custom callbacks next to the built-in ones.
--
--   mpirun -np 2 ./pglua examples/callbacks_recipe.lua
--
-- The custom callbacks live in examples/callbacks/*.lua, so that
-- spec/examples/callbacks_spec.lua can unit-test them with busted against
-- pg.testing's fake engine, with no MPI and no model.
package.path = "examples/?.lua;" .. package.path

local pg = require "pipegoose"
-- no options: --help says what it runs, and an argument is an error
require("argparse")("callbacks_recipe.lua", "A short GPT recipe on data/fortunes_train.bin with custom callbacks "
  .. "(examples/callbacks/*.lua) next to the built-in ones; writes runs/callbacks_recipe.")
  :epilog("Run it as: mpirun -np 2 ./pglua examples/callbacks_recipe.lua"):parse()
local LossSpike = require "callbacks.loss_spike"
local RunSummary = require "callbacks.run_summary"

local ctx = pg.ParallelContext{ data = pg.world_size(), seed = 1234 }
local model = pg.nn.GPT{ vocab = 256, seq_len = 64, dim = 64, heads = 4, layers = 2 }
local engine = pg.parallelize(model, ctx, { micro_batches = 1 })
local optimizer = pg.optim.AdamW(engine, { lr = 1e-3, betas = { 0.9, 0.95 }, weight_decay = 0.1 })

local train = pg.data.TokenShards{ path = "data/fortunes_train.bin", batch = 8, seq_len = 64, ctx = ctx }
-- validation on the first 8 batches of the same corpus when no held-out file exists
local val_path = io.open("data/fortunes_val.bin") and "data/fortunes_val.bin" or "data/fortunes_train.bin"
local val = pg.data.TokenShards{ path = val_path, batch = 8, seq_len = 64, ctx = ctx, shuffle = false }

local out_dir = "runs/callbacks_recipe"
local trainer = pg.Trainer{
  engine = engine, optimizer = optimizer,
  lr_schedule = pg.lr.cosine{ warmup = 20, min_lr = 1e-4 },
  max_steps = 400, accumulate = 2, clip_grad_norm = 1.0,
  val_every_n_steps = 100, val_batches = 8, log_every_n_steps = 10,
  seed = 1234, out_dir = out_dir,
  callbacks = {
    LossSpike{ factor = 2, max_spikes = 3 },
    pg.callbacks.LearningRateMonitor{},
    pg.callbacks.ProgressBar{},
    pg.callbacks.MetricsLogger{ path = out_dir .. "/metrics.jsonl" },
    pg.callbacks.ModelCheckpoint{ monitor = "val_loss", keep_top_k = 2, save_last = true },
    pg.callbacks.EarlyStopping{ monitor = "val_loss", patience = 3 },
    pg.callbacks.TextSampler{ every_n_steps = 100, prompt = "The ", tokens = 48, temperature = 0.8 },
    RunSummary{},
    -- a one-off hook without a module: report memory once training starts
    pg.callbacks.LambdaCallback{ on_train_start = function(t)
      local m = t.engine:memory()
      t:print(("parameters: %d, %.1f MiB per rank"):format(t.engine:num_parameters(), m.params_bytes / 2 ^ 20))
    end },
  },
}

-- resume = "last" continues from the newest checkpoint when there is one
trainer:fit(train, val, { resume = "last" })
trainer:print(("done: %d steps, stopped by %s"):format(trainer.state.step, trainer.state.stop_reason))
