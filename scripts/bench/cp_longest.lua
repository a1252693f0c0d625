-- Part cp_longest: the longest sequence a tiny GPT (vocab 256, width 64, 4 heads, 2 layers, one sequence per
-- step, fp32, AdamW) trains at context = 4 within 24 GiB, against context = 1 (issue 34 item 4).
--
-- The rule: the machine has 24 GiB in all and its ranks share it, so a layout of R ranks fits when R times its
-- largest rank's bytes is at most 24 GiB (context = 1: one rank, 24 GiB; context = 4: 6 GiB per rank). A rank's
-- bytes are engine:memory()'s params + grads + AdamW state + activation peak (the buffers the engine allocates:
-- the process's own overhead, MPI's and the interpreter's, is left out). They are a polynomial in T of degree
-- two at most (linear since the flash attention: neither the whole-sequence core nor the ring keeps [T, T]
-- probabilities; a quadratic term would show a kernel that does), so the part measures
-- them after one step at T = 256, 512 and 1024 on the layout itself, fits the quadratic through the three,
-- checks it against T = 2048 (the relative error is printed), and takes the longest T = 8 x 2^k whose predicted
-- bytes fit. The planner's model (plan/memory.lua's stage_bytes, the same shape and layout) gives its own
-- answer beside it.
--
-- Then it trains 2 steps at context = 4 (4 ranks x 1 thread over MPI) for real: at the memory-limited T when
-- the probe's step time at T = 2048 scaled by (T / 2048)^2 (an upper bound for a time a + bT + cT^2 with
-- nonnegative terms, T >= 2048) says 2 steps take at most BUDGET_S seconds, else at the longest T = 8 x 2^k that does (both reported): each step's time, its
-- loss (must be finite) and the bytes measured there against the fit's prediction. Prints the ratio of the
-- longest T at context = 4 to context = 1 and which CPU kernels ran.
local pg = require "pipegoose"
local common = require "bench.common"
local plan_memory = require "pipegoose.plan.memory"
local plan_models = require "pipegoose.plan.models"

local emit = common.emit
local M = {}

local TOTAL = 24 * 2 ^ 30
local MODEL = { vocab = 256, dim = 64, heads = 4, layers = 2 }
local PROBES = { 256, 512, 1024, 2048 } -- the first three fit, the fourth checks
local BUDGET_S = 150 -- the two trained steps' predicted time (about 3 minutes with the start and the build)
local CP = 4

local function allmax(x)
  local t = pg.tensor{ x }
  pg.dist.all_reduce(t, { op = "max" })
  return t:item()
end

local function build(C, T)
  local ctx = pg.ParallelContext{ context = C, seed = 1 }
  local engine = pg.parallelize(pg.nn.GPT{ vocab = MODEL.vocab, seq_len = T, dim = MODEL.dim, heads = MODEL.heads,
    layers = MODEL.layers }, ctx, { micro_batches = 1 })
  return ctx, engine, pg.optim.AdamW(engine, { lr = 1e-4 })
end

-- One sequence of T deterministic tokens (inputs and targets).
local function tokens(T)
  local xs, ys = {}, {}
  for i = 1, T do
    xs[i] = (i * 7919) % MODEL.vocab
    ys[i] = (i * 104729 + 17) % MODEL.vocab
  end
  return pg.tensor(xs, { dtype = "int32" }):reshape{ 1, T }, pg.tensor(ys, { dtype = "int32" }):reshape{ 1, T }
end

-- A step: its loss and wall seconds (the slowest rank's).
local function step(ctx, engine, opt, x, y)
  ctx:barrier()
  local t0 = pg.wtime()
  engine:zero_grad()
  local loss = engine:forward_backward(x, y)
  opt:step()
  return loss, allmax(pg.wtime() - t0)
end

local function rank_bytes(engine)
  local m = engine:memory()
  return allmax(m.params_bytes + m.grads_bytes + (m.optimizer_bytes or 0) + m.peak_activation_bytes)
end

--- The worker: --context=C and either --probe=1 (one step at each of PROBES: bytes_<T>, step_ms_<T>) or
--- --seq_len=T --steps=n (n steps at T: step_ms_<i>, loss_<i>, bytes).
function M.worker(o)
  local C = tonumber(o.context or 1)
  local ctx_rank0 = pg.ParallelContext{ context = C, seed = 1 }:rank() == 0
  local function say(k, v)
    if ctx_rank0 then
      print(math.type(v) == "integer" and ("result %s %d"):format(k, v) or ("result %s %.9g"):format(k, v))
    end
  end
  if o.probe then
    for _, T in ipairs(PROBES) do
      local ctx, engine, opt = build(C, T)
      local x, y = tokens(T)
      local _, dt = step(ctx, engine, opt, x, y)
      say("bytes_" .. T, rank_bytes(engine))
      say("step_ms_" .. T, dt * 1e3)
      engine, opt = nil, nil
      collectgarbage() -- the buffers of this length go before the next length's
    end
    return
  end
  local T, n = tonumber(o.seq_len), tonumber(o.steps or 2)
  local ctx, engine, opt = build(C, T)
  local x, y = tokens(T)
  for s = 1, n do
    local loss, dt = step(ctx, engine, opt, x, y)
    say("loss_" .. s, loss)
    say("step_ms_" .. s, dt * 1e3)
  end
  say("bytes", rank_bytes(engine))
  say("seq_len", T)
end

-- The quadratic through (x[i], y[i]), i = 1..3 (Lagrange), as a function.
local function quadratic(x, y)
  return function(t)
    local v = 0
    for i = 1, 3 do
      local l = 1
      for j = 1, 3 do
        if j ~= i then l = l * (t - x[j]) / (x[i] - x[j]) end
      end
      v = v + y[i] * l
    end
    return v
  end
end

-- The longest T = 8 x 2^k with bytes(T) <= limit (nil when not even 8), searched up to 2^40.
local function longest(bytes, limit)
  local best
  for k = 0, 37 do
    local T = 8 * 2 ^ k
    if bytes(T) > limit then break end
    best = math.tointeger(T)
  end
  return best
end

-- The planner's bytes of the one rank of a layout: the model's shape, tensor = pipeline = data = 1, context C.
local function planner_bytes(C)
  return function(T)
    local s = plan_models.check{ arch = "gpt", layers = MODEL.layers, hidden = MODEL.dim, heads = MODEL.heads,
      ffn = 4 * MODEL.dim, vocab = MODEL.vocab, seq_len = math.tointeger(T) or 8 }
    -- flash_attention: pipegoose's whole-sequence core and its ring keep no [T, T] (or [T/C, T]) scores
    local L = { t = 1, p = 1, d = 1, c = C, b = 1, seq = T, precision = "fp32", zero = 0, flash_attention = true }
    return (plan_memory.stage_bytes(s, L, { layers = MODEL.layers, first = true, last = true }, 1))
  end
end

function M.part(ctx)
  local function run(name, ranks, args, key)
    local res, lines, rc = common.run(common.worker_cmd(ranks, 1, args))
    if not common.check_run("cp_longest " .. name, res, lines, rc, key) then return nil end
    return res
  end
  local probe = {}
  for _, C in ipairs{ 1, CP } do
    probe[C] = run("probe_cp" .. C, C, { "--worker=cp_longest", "--context=" .. C, "--probe=1" },
      "bytes_" .. PROBES[4])
    if not probe[C] then return end
  end
  local machine = pg.machine()
  print()
  print(("== the longest sequence within 24 GiB in all: tiny GPT (vocab %d, width %d, %d heads, %d layers), one "
    .. "sequence, fp32, AdamW"):format(MODEL.vocab, MODEL.dim, MODEL.heads, MODEL.layers))
  print(("  CPU: %s; OpenBLAS core %s; attention: context = 1 the whole-sequence kernel (kernels/cpu/attention.c),"
    .. " context = %d the ring's block kernels (kernels/cpu/attention_block.c), sgemm tiles through OpenBLAS")
    :format(machine.features, machine.blas_core, CP))
  print("  rule: R ranks fit when R x (largest rank's engine:memory() bytes) <= 24 GiB (the ranks share the machine)")
  print(("  %-10s %8s %14s %14s %12s %16s %16s"):format("layout", "ranks", "GiB per rank", "fit error T=2048",
    "longest T", "planner's T", "bytes/token/rank"))
  local best = {}
  for _, C in ipairs{ 1, CP } do
    local r = probe[C]
    local xs, ys = {}, {}
    for i = 1, 3 do
      xs[i], ys[i] = PROBES[i], r["bytes_" .. PROBES[i]]
    end
    local fit = quadratic(xs, ys)
    local err = fit(PROBES[4]) / r["bytes_" .. PROBES[4]] - 1
    local limit = TOTAL / C
    local T = longest(fit, limit)
    local Tp = longest(planner_bytes(C), limit)
    best[C] = { T = T, fit = fit, err = err, probe = r }
    local per_token = (fit(PROBES[4]) - fit(PROBES[3])) / (PROBES[4] - PROBES[3])
    print(("  %-10s %8d %14.2f %15.2e%% %12s %16s %16.1f"):format("context=" .. C, C, limit / 2 ^ 30, err * 100,
      tostring(T), tostring(Tp), per_token))
    emit("cp_longest_cp" .. C, "longest_seq", T, "%d")
    emit("cp_longest_cp" .. C, "planner_longest_seq", Tp, "%d")
    emit("cp_longest_cp" .. C, "fit_error_t2048", err, "%.3g")
  end
  if not (best[1].T and best[CP].T) then
    common.failures[#common.failures + 1] = "cp_longest (no length fits)"
    return
  end
  local ratio = best[CP].T / best[1].T
  print(("  longest T at context = %d / at context = 1: %d / %d = %.3gx"):format(CP, best[CP].T, best[1].T, ratio))
  emit("cp_longest_cp" .. CP .. "_vs_cp1", "longest_seq_ratio", ratio, "%.4g")

  -- what trains here: the probes' step time scaled by (T / 2048)^2
  local t_probe = best[CP].probe["step_ms_" .. PROBES[4]] / 1e3
  local function predicted(T) return t_probe * (T / PROBES[4]) ^ 2 end
  local T_run = best[CP].T
  while T_run > PROBES[4] and 2 * predicted(T_run) > BUDGET_S do T_run = T_run // 2 end
  if T_run < best[CP].T then
    print(("  the memory-limited T = %d would take about %.3g s a step here (%d cores shared by %d ranks): "
      .. "training T = %d instead, the longest whose 2 steps take about %d s at most"):format(best[CP].T,
      predicted(best[CP].T), ctx.ncores, CP, T_run, BUDGET_S))
  end
  local res = run("train_cp" .. CP, CP, { "--worker=cp_longest", "--context=" .. CP, "--seq_len=" .. T_run,
    "--steps=2" }, "bytes")
  if not res then return end
  local finite = true
  for s = 1, 2 do
    local l = res["loss_" .. s]
    finite = finite and type(l) == "number" and l == l and math.abs(l) < math.huge
    print(("  context=%d, T = %d, step %d: %.1f ms, loss %.6g"):format(CP, T_run, s, res["step_ms_" .. s], l or 0 / 0))
    emit("cp_longest_train_cp" .. CP, "step_ms_" .. s, res["step_ms_" .. s], "%.1f")
  end
  if T_run < best[CP].T then -- the trained step's time scaled the same way (an upper bound again)
    local per = res.step_ms_2 / 1e3 * (best[CP].T / T_run) ^ 2
    print(("  from that step, T = %d would take at most about %.3g s (%.3g h) a step on these %d cores"):format(
      best[CP].T, per, per / 3600, ctx.ncores))
    emit("cp_longest_train_cp" .. CP, "memory_limited_step_s_bound", per, "%.4g")
  end
  local want = best[CP].fit(T_run)
  print(("  its bytes per rank: %d measured, %d predicted by the fit (%.2e relative)"):format(res.bytes,
    math.floor(want + 0.5), res.bytes / want - 1))
  emit("cp_longest_train_cp" .. CP, "seq_len", T_run, "%d")
  emit("cp_longest_train_cp" .. CP, "memory_limited_seq_len", best[CP].T, "%d")
  if not finite then
    print("  the loss is not finite")
    common.failures[#common.failures + 1] = "cp_longest (loss not finite)"
  end
end

return M
