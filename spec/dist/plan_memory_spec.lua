-- worlds: 2 4
-- The planner's CPU memory count (lua/pipegoose/plan/cpu.lua) against
-- engine:memory() on every rank of the layouts of this world size: each
-- rank's parameters, gradients, AdamW state and peak activations within 10%
-- of what its stage's closed form says (docs/PLANNER.md derives it), with
-- and without sequence parallelism.
local pg = require "pipegoose"
local plan = pg.plan
local cpu = require "pipegoose.plan.cpu"
local search = plan.search_module

local W = pg.world_size()
local LAYOUTS = ({
  [2] = { { name = "T=2", tensor = 2 }, { name = "P=2 1f1b", pipeline = 2, m = 4 },
          { name = "P=2 gpipe", pipeline = 2, m = 4, schedule = "gpipe" }, { name = "D=2", data = 2 },
          { name = "D=2 zero=1", data = 2, zero = 1 }, { name = "D=2 zero=2", data = 2, zero = 2 },
          { name = "T=2 sequence parallel", tensor = 2, sp = true },
          { name = "T=2 sequence parallel, full recomputation", tensor = 2, sp = true, recompute = "full" } },
  [4] = { { name = "T=2 x P=2", tensor = 2, pipeline = 2, m = 2 }, { name = "P=2 x D=2", pipeline = 2, data = 2, m = 2 },
          { name = "T=2 x D=2", tensor = 2, data = 2 }, { name = "P=4 1f1b", pipeline = 4, m = 4 },
          { name = "T=2 x D=2 sequence parallel", tensor = 2, data = 2, sp = true },
          { name = "T=2 x P=2 sequence parallel", tensor = 2, pipeline = 2, m = 2, sp = true },
          { name = "P=2 x D=2 zero=2", pipeline = 2, data = 2, m = 2, zero = 2 } },
})[W]

local MODELS = {
  gpt = { arch = "gpt", build = pg.nn.GPT, cfg = { vocab = 64, seq_len = 16, dim = 32, heads = 4, layers = 4 } },
  llama = { arch = "llama", build = pg.nn.Llama,
    cfg = { vocab = 64, seq_len = 16, dim = 32, heads = 4, kv_heads = 2, hidden = 48, layers = 4 } },
}

local function within(expected, actual, what)
  assert(math.abs(expected - actual) <= 0.10 * math.abs(actual),
    ("%s: model %.0f, engine %.0f"):format(what, expected, actual))
end

describe("plan/cpu.lua memory on " .. W .. " ranks", function()
  for _, layout in ipairs(LAYOUTS) do
    for _, name in ipairs{ "gpt", "llama" } do
      it(("%s, %s: every rank's memory parts match its stage's count"):format(layout.name, name), function()
        local mdl = MODELS[name]
        local T, P, D = layout.tensor or 1, layout.pipeline or 1, layout.data or 1
        local Mb, schedule = layout.m or 1, layout.schedule or "1f1b"
        local ctx = pg.ParallelContext{ tensor = T, pipeline = P, data = D, seed = 3 }
        local model = mdl.build(mdl.cfg)
        local engine = pg.parallelize(model, ctx, { micro_batches = Mb, schedule = schedule,
                                                    sequence_parallel = layout.sp, recompute = layout.recompute })
        local opt = pg.optim.AdamW(engine, { lr = 1e-3, zero = layout.zero or 0 })
        local B, S = 8 // D, mdl.cfg.seq_len
        local x = pg.zeros({ B, S }, { dtype = "int32" })
        engine:forward_backward(x, x)
        opt:step()
        local m = engine:memory()
        local c = model.config
        local s = plan.models.check{ arch = mdl.arch, layers = c.layers, hidden = c.dim, heads = c.heads,
          kv_heads = c.kv_heads or c.heads, ffn = mdl.arch == "llama" and c.hidden or 4 * c.dim,
          vocab = c.padded_vocab, seq_len = c.seq_len }
        local L = { t = T, p = P, d = D, m = Mb, b = B // Mb, seq = S, schedule = schedule, zero = layout.zero or 0,
          recompute = layout.recompute or "none", sp = layout.sp or false, precision = "fp32" }
        local i = ctx:local_rank("pipeline") + 1
        local part = search.partition(s, P)[i]
        local _, parts = cpu.stage_bytes(s, L, part, search.in_flight(schedule, P, Mb, i), plan.memory.stage_params)
        within(parts.weights, m.params_bytes, "parameters")
        within(parts.gradients, m.grads_bytes, "gradients")
        within(parts.optimizer, m.optimizer_bytes, "AdamW state")
        within(parts.activations, m.peak_activation_bytes, "activations")
      end)
    end
  end
end)
