-- scripts/plan.lua --validate: the planner's CPU predictions against real
-- steps of pipegoose on this machine.
--
-- Required by scripts/plan.lua (the driver, M.run), and run by it under
-- scripts/mpirun.sh as a worker (`pglua scripts/plan_validate.lua --worker
-- --model=gpt --tensor=2 ...`): one configuration per process, as
-- scripts/bench/workers.lua measures a step: barrier, zero_grad,
-- forward_backward (with its gradient reduction), AdamW step, the slowest
-- rank's wall time; the median of the steps after the warm-up ones. Memory is
-- engine:memory() of every rank after the steps; the busiest rank's total is
-- compared.
--
-- For each configuration the driver simulates the same layout with the
-- profile (fresh from scripts/calibrate.lua unless --profile is given):
-- search.evaluate on the same shape, stages, micro-batches and schedule, and
-- the CPU engine's memory model. Nothing is fitted to these runs.
local pg = require "pipegoose"

local M = {}

-- The models: examples/train_gpt.lua's default GPT, and a tiny LLaMA
-- (grouped-query attention, SwiGLU, RoPE, untied head). Global batch 16.
M.MODELS = {
  gpt = { arch = "gpt2", vocab = 256, seq_len = 128, dim = 256, heads = 4, layers = 4, batch = 16 },
  llama = { arch = "llama", vocab = 256, seq_len = 64, dim = 128, heads = 4, kv_heads = 2, hidden = 344, layers = 4,
            batch = 16 },
}

-- name, model, tensor, pipeline, data, micro-batches, schedule
local function cfg(name, model, t, p, d, m, schedule)
  return { name = name, model = model, t = t, p = p, d = d, m = m or 1, schedule = schedule or "1f1b" }
end

M.CONFIGS = {
  cfg("gpt serial", "gpt", 1, 1, 1),
  cfg("gpt serial M=4", "gpt", 1, 1, 1, 4),
  cfg("gpt T=2", "gpt", 2, 1, 1),
  cfg("gpt P=2 M=4 gpipe", "gpt", 1, 2, 1, 4, "gpipe"),
  cfg("gpt P=2 M=4 1f1b", "gpt", 1, 2, 1, 4, "1f1b"),
  cfg("gpt D=2", "gpt", 1, 1, 2),
  cfg("gpt T=4", "gpt", 4, 1, 1),
  cfg("gpt D=4", "gpt", 1, 1, 4),
  cfg("gpt P=4 M=8 1f1b", "gpt", 1, 4, 1, 8, "1f1b"),
  cfg("gpt T=2xP=2 M=4", "gpt", 2, 2, 1, 4),
  cfg("gpt P=2xD=2 M=4 gpipe", "gpt", 1, 2, 2, 4, "gpipe"),
  cfg("gpt T=2xD=2", "gpt", 2, 1, 2),
  cfg("gpt 2x2x2 M=4 1f1b", "gpt", 2, 2, 2, 4, "1f1b"),
  cfg("gpt D=8", "gpt", 1, 1, 8),
  cfg("llama serial", "llama", 1, 1, 1),
  cfg("llama T=2", "llama", 2, 1, 1),
  cfg("llama P=2 M=4 1f1b", "llama", 1, 2, 1, 4, "1f1b"),
  cfg("llama D=2", "llama", 1, 1, 2),
  cfg("llama 2x2x2 M=4 gpipe", "llama", 2, 2, 2, 4, "gpipe"),
}

-- --quick (the specs): two small configurations, the output's format only
M.QUICK = {
  cfg("llama serial", "llama", 1, 1, 1),
  cfg("llama P=2 M=2 1f1b", "llama", 1, 2, 1, 2, "1f1b"),
}

-- the benchmark's helpers, next to this file (it is also run alone, under mpirun)
package.path = (debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "?.lua;" .. package.path
local median = require("bench.common").median

-- a validation model's pg.nn options (its arch names the family: pg.nn.from_config)
local function options(model_cfg)
  local spec = {}
  for k, v in pairs(model_cfg) do if k ~= "batch" then spec[k] = v end end
  return spec
end

local function build(model_cfg) return pg.nn.from_config(options(model_cfg)) end

---------------------------------------------------------------- worker

local function worker(o)
  local mc = M.MODELS[o.model] or error("plan_validate: unknown model " .. tostring(o.model))
  local T, P, D, Mb = tonumber(o.tensor), tonumber(o.pipeline), tonumber(o.data), tonumber(o["micro-batches"])
  local ctx = pg.ParallelContext{ tensor = T, pipeline = P, data = D, seed = 1 }
  local engine = pg.parallelize(build(mc), ctx, { micro_batches = Mb, schedule = o.schedule })
  local opt = pg.optim.AdamW(engine, { lr = 1e-4, betas = { 0.9, 0.95 }, weight_decay = 0.1 })
  local B, S = mc.batch // D, mc.seq_len
  local xs, ys = {}, {}
  local off = ctx:local_rank("data") * B * S
  for i = 1, B * S do
    xs[i] = ((i + off) * 7919) % mc.vocab
    ys[i] = ((i + off) * 104729 + 17) % mc.vocab
  end
  local x = pg.tensor(xs, { dtype = "int32" }):reshape{ B, S }
  local y = pg.tensor(ys, { dtype = "int32" }):reshape{ B, S }
  local warmup, steps = tonumber(o.warmup), tonumber(o.steps)
  local times = {}
  for s = 1, warmup + steps do
    ctx:barrier()
    local t0 = pg.wtime()
    engine:zero_grad()
    engine:forward_backward(x, y)
    opt:step()
    local t = pg.tensor{ pg.wtime() - t0 }
    pg.dist.all_reduce(t, { op = "max" })
    if s > warmup then times[#times + 1] = t:item() end
  end
  local m = engine:memory()
  local mine = pg.tensor{ m.params_bytes, m.grads_bytes, m.optimizer_bytes, m.peak_activation_bytes }
  local all = pg.dist.all_gather(mine):totable()
  if ctx:rank() == 0 then
    -- the busiest rank
    local best, at = -1, 1
    for r = 0, #all // 4 - 1 do
      local total = all[4 * r + 1] + all[4 * r + 2] + all[4 * r + 3] + all[4 * r + 4]
      if total > best then best, at = total, r end
    end
    local b = 4 * at
    print(("result step_s %.9g"):format(median(times)))
    print(("result threads %d"):format(pg.num_threads()))
    print(("result params_bytes %.0f"):format(all[b + 1]))
    print(("result grads_bytes %.0f"):format(all[b + 2]))
    print(("result optimizer_bytes %.0f"):format(all[b + 3]))
    print(("result activation_bytes %.0f"):format(all[b + 4]))
    print(("result total_bytes %.0f"):format(best))
    print(("result padded_vocab %d"):format(engine.config and engine.config.padded_vocab or mc.vocab))
  end
  ctx:barrier()
end

---------------------------------------------------------------- driver

local function shell_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function run_worker(c, o)
  local ranks = c.t * c.p * c.d
  local cmd = {}
  if ranks > 1 then cmd[#cmd + 1] = ("scripts/mpirun.sh -np %d"):format(ranks) end
  cmd[#cmd + 1] = shell_quote(o.pglua)
  cmd[#cmd + 1] = "scripts/plan_validate.lua --worker"
  for k, v in pairs{ model = c.model, tensor = c.t, pipeline = c.p, data = c.d, ["micro-batches"] = c.m,
    schedule = c.schedule, steps = o.steps, warmup = o.warmup } do
    cmd[#cmd + 1] = ("--%s=%s"):format(k, shell_quote(v))
  end
  local f = assert(io.popen(table.concat(cmd, " ") .. " 2>&1"))
  local res, lines = {}, {}
  for l in f:lines() do
    lines[#lines + 1] = l
    local k, v = l:match("^result (%S+) (%S+)$")
    if k then res[k] = tonumber(v) end
  end
  local ok = f:close()
  if not ok or not res.step_s then
    error(("plan.lua --validate: %s failed:\n%s"):format(c.name, table.concat(lines, "\n")), 0)
  end
  return res
end

--- The planner's shape of a validation model (vocabulary: the engine's padded rows).
function M.shape(mc, padded_vocab)
  local o = options(mc)
  o.padded_vocab = padded_vocab
  local s = pg.plan.models.of_config(o)
  s.name = mc.arch
  return s
end

--- The simulated step and the busiest rank's memory of configuration c on hardware hw.
function M.simulate(c, hw, padded_vocab)
  local plan = pg.plan
  local search = plan.search_module
  local mc = M.MODELS[c.model]
  local s = M.shape(mc, padded_vocab)
  local L = { t = c.t, p = c.p, d = c.d, m = c.m, b = mc.batch // (c.d * c.m), schedule = c.schedule, zero = 0,
    recompute = "none", sp = false, seq = mc.seq_len, precision = "fp32", flash_attention = false }
  local parts = search.partition(s, c.p)
  local o = {}
  for k, v in pairs(plan.cost.DEFAULTS) do o[k] = v end
  local r = search.evaluate(s, L, hw, o, parts)
  local mem, _, detail = search.layout_memory(s, L, parts, hw)
  return r.step_s, mem, detail, r
end

--- Runs the validation; prints a row per configuration and the last line.
-- o: { profile = path, quick = bool, pglua = path, steps, warmup, only = pattern }
function M.run(o)
  o.steps = o.steps or (o.quick and 2 or 5)
  o.warmup = o.warmup or (o.quick and 1 or 2)
  local path = o.profile
  if not path then
    path = o.quick and "build/profile-quick.json" or "build/profile.json"
    local cmd = ("%s scripts/calibrate.lua --out=%s%s"):format(shell_quote(o.pglua), shell_quote(path),
      o.quick and " --quick --ranks=2" or "")
    print("calibrating: " .. cmd)
    local ok = os.execute(cmd .. (o.quick and " >/dev/null" or ""))
    if not ok then error("plan.lua --validate: calibration failed", 0) end
  end
  local hw = pg.plan.hardware.load_profile(path)
  local configs = o.quick and M.QUICK or M.CONFIGS
  print(("validation on %s (profile %s), fp32, global batch 16, %d timed steps after %d warm-up"):format(
    hw.name, path, o.steps, o.warmup))
  local head = "%-26s %5s %7s %10s %10s %8s %10s %10s %8s"
  print(head:format("config", "ranks", "threads", "meas_ms", "sim_ms", "err", "meas_MiB", "sim_MiB", "mem_err"))
  local errs, mem_errs = {}, {}
  for _, c in ipairs(configs) do
    if not o.only or c.name:find(o.only, 1, true) then
      local res = run_worker(c, o)
      local sim_s, sim_mem = M.simulate(c, hw, math.tointeger(res.padded_vocab))
      local err = (sim_s - res.step_s) / res.step_s
      local merr = (sim_mem - res.total_bytes) / res.total_bytes
      errs[#errs + 1], mem_errs[#mem_errs + 1] = math.abs(err), math.abs(merr)
      print(("%-26s %5d %7d %10.1f %10.1f %+7.1f%% %10.2f %10.2f %+7.1f%%"):format(c.name, c.t * c.p * c.d,
        math.tointeger(res.threads), res.step_s * 1e3, sim_s * 1e3, err * 100, res.total_bytes / 2 ^ 20,
        sim_mem / 2 ^ 20, merr * 100))
      io.stdout:flush()
    end
  end
  local function max(t)
    local m = 0
    for _, v in ipairs(t) do m = math.max(m, v) end
    return m
  end
  print(("validation median_error=%.4f max_error=%.4f memory_max_error=%.4f n=%d"):format(
    #errs > 0 and median(errs) or 0, max(errs), max(mem_errs), #errs))
end

-- Run by itself only as a worker; --help says so (the driver is scripts/plan.lua --validate).
local main = (arg and arg[0] or ""):match("plan_validate%.lua$")
if main and arg[1] ~= "--worker" then
  local help = arg[1] == "-h" or arg[1] == "--help"
  local text = "Usage: plan_validate.lua --worker --model=gpt|llama --tensor=T --pipeline=P --data=D "
    .. "--micro-batches=M --schedule=1f1b|gpipe --steps=N --warmup=W\n\n"
    .. "plan_validate.lua measures one layout's step time and memory for the planner's validation: "
    .. "scripts/plan.lua --validate runs it under mpirun as a worker, one configuration per job. "
    .. "Run pglua scripts/plan.lua --validate [--quick] instead.\n"
  if help then
    io.stdout:write(text)
    os.exit(0)
  end
  io.stderr:write(text:match("^[^\n]*\n"), "\n", ("Error: %s: plan_validate.lua runs only as the worker of "
    .. "scripts/plan.lua --validate (--worker first)\n"):format(arg[1] and ("unknown argument '" .. arg[1] .. "'")
    or "no arguments"))
  os.exit(1)
end

-- run as a worker: pglua scripts/plan_validate.lua --worker --k=v ...
if main and arg[1] == "--worker" then
  local o = {}
  for i = 2, #arg do
    local k, v = arg[i]:match("^%-%-([%w_-]+)=(.*)$")
    if not k then error("plan_validate: unknown argument " .. arg[i]) end
    o[k] = v
  end
  worker(o)
end

return M
