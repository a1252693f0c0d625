--- pg.plan: the best 3D layout for a model on a cluster, predicted before
-- anyone rents the GPUs (docs/PLANNER.md says what is modelled and how well
-- it matches published runs).
--
--   local layout = pg.plan{ model = "gpt3-175b", gpus = 1024, gpu = "a100-80gb",
--                           global_batch = 1536, seq_len = 2048 }
--   local ctx = pg.ParallelContext(layout.context)      -- { tensor, pipeline, data[, context] }
--   local engine = pg.parallelize(model, ctx, layout.parallelize) -- { micro_batches, schedule, sequence_parallel }
--   local opt = pg.optim.AdamW(engine, { lr = ..., zero = layout.zero })
--
-- The layout also carries the same values flat (tensor, pipeline, data,
-- context_size, micro_batches, schedule) and everything else the planner
-- decided or predicted (micro_batch_size, zero, recompute, sequence_parallel,
-- step_s, tflops_per_gpu, mfu, mem_gb, breakdown, ...). layout.context names
-- `context = C` only when C > 1, so that a C = 1 plan is what an engine
-- without the context dimension accepts; zero = 3 and C > 1 are planned from
-- the formulas in memory.lua and cost.lua whether or not the engine at hand
-- serves that combination yet (docs/PLANNER.md, "ZeRO-3 and context").
--
--   pg.plan.search{...} -> the top `top` layouts and a summary of the search
--   pg.plan.hardware, .models, .memory, .cost, .simulate: the parts
local opt = require "pipegoose.options"
local core = require "pipegoose.core"
local hardware = require "pipegoose.plan.hardware"
local models = require "pipegoose.plan.models"
local search = require "pipegoose.plan.search"
local common = require "pipegoose.models.common"

local M = {
  hardware = hardware,
  models = models,
  memory = require "pipegoose.plan.memory",
  cost = require "pipegoose.plan.cost",
  simulate = require "pipegoose.plan.simulate",
  search_module = search,
}

local model_spec = opt.check_with("a model name or a shape table", function(v)
  return type(v) == "string" or type(v) == "table"
end)
local gpu_spec = opt.check_with("a gpu name, \"cpu-profile=FILE\" or a hardware table", function(v)
  return type(v) == "string" or type(v) == "table"
end)

local SCHEMA = {
  model = model_spec,          -- built-in name or shape table (models.lua)
  hf = opt.string,             -- or a transformers config.json
  gpus = opt.integer{ min = 1, max = 1 << 24, required = true },
  gpus_per_node = opt.integer{ min = 1 },
  gpu = gpu_spec,
  global_batch = opt.integer{ min = 1, max = 1 << 30, required = true },
  seq_len = opt.integer{ min = 1 },
  precision = opt.enum{ "bf16", "fp32", "tf32" }, -- default: hardware.default_precision (bf16 on a datasheet GPU)
  top = opt.integer{ min = 1, default = 1 },
  gemm_efficiency = opt.number{ gt = 0, max = 1 },
  flash_attention = opt.boolean,
  dp_overlap = opt.boolean,
  -- pin a dimension (the published comparison pins the paper's T and P)
  tensor = opt.integer{ min = 1 },
  pipeline = opt.integer{ min = 1 },
  context = opt.integer{ min = 1 },
  micro_batch_size = opt.integer{ min = 1 },
  schedule = opt.enum(core.schedules().offered), -- the runtime's one-chunk schedules (pg_schedule_offered)
  zero = opt.integer{ min = 0, max = 3 },
  recompute = opt.enum{ "none", "selective", "full" },
  -- with recompute = "full": only every k-th layer (torchtitan's selective layer checkpointing; planner only)
  recompute_every = opt.integer{ min = 1 },
  sequence_parallel = opt.boolean,
}

local function query(o)
  o = opt.check("plan", o, SCHEMA)
  if (o.model == nil) == (o.hf == nil) then error("plan: give exactly one of model= and hf=", 0) end
  local s = o.hf and models.load_hf(o.hf) or models.get(o.model)
  local hw = hardware.get(o.gpu or "a100-80gb")
  local G = o.gpus_per_node or hw.gpus_per_node
  local precision = o.precision or hardware.default_precision(hw)
  if not hw.peak_flops[precision] then
    error(("plan: %s has no %s FLOP/s (it has: %s)"):format(hw.name, precision,
      table.concat((function()
        local t = {}
        for k in pairs(hw.peak_flops) do t[#t + 1] = k end
        table.sort(t)
        return t
      end)(), ", ")), 0)
  end
  if o.gpus > G and o.gpus % G ~= 0 then
    error(("plan: gpus=%d is not a whole number of nodes of %d"):format(o.gpus, G), 0)
  end
  -- a pinned size that cannot be a layout of these GPUs, said as that (not as "no layout fits")
  local function refuse(fmt, ...) error("plan: " .. fmt:format(...), 0) end
  local N = o.gpus
  if o.tensor then
    if N % o.tensor ~= 0 then refuse("tensor=%d does not divide gpus=%d", o.tensor, N) end
    if math.min(G, N) % o.tensor ~= 0 then
      refuse("tensor=%d does not divide the %d GPUs of a node (tensor parallelism stays inside a node)", o.tensor,
        math.min(G, N))
    end
    local bad = common.tensor_heads(o.tensor, s.heads, s.kv_heads)
    if bad then refuse("%s", bad) end
    if s.ffn % o.tensor ~= 0 then refuse("tensor=%d does not divide the MLP width %d", o.tensor, s.ffn) end
  end
  local TP = (o.tensor or 1) * (o.pipeline or 1) * (o.context or 1)
  if N % TP ~= 0 then
    refuse("tensor=%d x pipeline=%d x context=%d = %d does not divide gpus=%d", o.tensor or 1, o.pipeline or 1,
      o.context or 1, TP, N)
  end
  if o.pipeline and o.pipeline > s.layers then
    refuse("pipeline=%d exceeds the model's %d layers", o.pipeline, s.layers)
  end
  local seq = o.seq_len or s.seq_len
  if o.context and seq % (2 * o.context) ~= 0 then
    refuse("context=%d: 2 x %d chunks do not divide seq_len=%d", o.context, o.context, seq)
  end
  if hw.cpu and ((o.context or 1) > 1 or o.zero == 3) then
    refuse("a cpu profile prices pipegoose's CPU engine as measured, without context parallelism or zero = 3")
  end
  if o.recompute_every and o.recompute ~= "full" then
    refuse("recompute_every=%d needs recompute = \"full\" (it says which layers recompute)", o.recompute_every)
  end
  local options = {}
  for k, v in pairs(M.cost.DEFAULTS) do options[k] = v end
  if o.gemm_efficiency ~= nil then options.gemm_efficiency = o.gemm_efficiency end
  if o.flash_attention ~= nil then options.flash_attention = o.flash_attention end
  if o.dp_overlap ~= nil then options.dp_overlap = o.dp_overlap end
  return {
    model = s, hw = hw, gpus = o.gpus, gpus_per_node = math.min(G, o.gpus), global_batch = o.global_batch,
    seq_len = o.seq_len or s.seq_len, precision = precision, top = o.top, options = options,
    fix = { t = o.tensor, p = o.pipeline, c = o.context, b = o.micro_batch_size, schedule = o.schedule, zero = o.zero,
      recompute = o.recompute, recompute_every = o.recompute_every, sp = o.sequence_parallel },
  }
end

local function layout(L)
  L.tensor, L.pipeline, L.data, L.context_size = L.t, L.p, L.d, L.c
  L.micro_batches, L.micro_batch_size, L.sequence_parallel = L.m, L.b, L.sp
  L.context = { tensor = L.t, pipeline = L.p, data = L.d, context = L.c > 1 and L.c or nil }
  L.parallelize = { micro_batches = L.m, schedule = L.schedule, sequence_parallel = L.sp }
  L.stages = {}
  for i, part in ipairs(L.parts) do L.stages[i] = part.layers end
  L.parts = nil
  return L
end

--- The top layouts, best first, and the search summary (plus the resolved query).
function M.search(o)
  local q = query(o)
  local best, summary = search.run(q)
  for i, L in ipairs(best) do best[i] = layout(L) end
  summary.query = q
  return best, summary
end

--- Why a search found no layout (summary: M.search's): the counts, and when
-- layouts were over memory what the smallest of them needs per rank against
-- what a rank has (memory.USABLE_FRACTION of it).
function M.no_fit_message(summary)
  local q, small = summary.query, summary.smallest
  local need = ""
  if small then
    need = (": the smallest (t=%d p=%d context=%d d=%d b=%d zero=%d recompute=%s sp=%s) needs %.4g GiB per rank, "
      .. "and a rank has %.4g GiB usable (%d%% of %.4g GiB)"):format(small.t, small.p, small.c, small.d, small.b,
      small.zero, small.recompute, tostring(small.sp), small.mem_bytes / 1024 ^ 3, summary.usable_bytes / 1024 ^ 3,
      math.floor(M.memory.USABLE_FRACTION * 100 + 0.5), q.hw.memory_bytes / 1024 ^ 3)
  end
  return ("no layout of %s fits on %d x %s%s; %d enumerated, %d over memory, %d with a data-parallel size that does "
    .. "not divide global_batch=%d"):format(q.model.name, q.gpus, q.hw.name, need, summary.enumerated,
    summary.over_memory, summary.batch_mismatch, q.global_batch)
end

--- The best layout (see the top of this file); an error when none fits.
function M.best(o)
  local best, summary = M.search(o)
  if #best == 0 then error("plan: " .. M.no_fit_message(summary), 0) end
  return best[1], summary
end

return setmetatable(M, { __call = function(_, o) return M.best(o) end })
