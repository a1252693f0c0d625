-- Part context: context parallelism (pg.ParallelContext{context = C}, the ring attention) in the same run.
-- 1. A tiny GPT (width 64, 4 heads, 2 layers) on one sequence of T = 4096 tokens: context = 2 (2 ranks x 1
--    thread) against context = 1 (1 rank x 2 threads, the same cores): the step time and the activation bytes
--    per rank (engine:memory()'s peak, the largest rank). The ring keeps no [T, T] probabilities, so the ratio
--    is well under 1/2: at context = 1 the attention keeps them for backward.
-- The longest sequence it trains within 24 GiB is part cp_longest (scripts/bench/cp_longest.lua).
local common = require "bench.common"

local emit = common.emit

return function(ctx)
  local function run(name, ranks, threads, C, T)
    local args = { "--worker=context", "--context=" .. C, "--seq_len=" .. T, "--steps=" .. ctx.steps(3) }
    local res, lines, rc = common.run(common.worker_cmd(ranks, threads, args))
    if not common.check_run("context " .. name, res, lines, rc, "step_ms") then return nil end
    return res
  end
  local one = run("cp1_t4096", 1, ctx.ncores, 1, 4096)
  local two = one and run("cp2_t4096", 2, math.max(1, ctx.ncores // 2), 2, 4096)
  if not two then return end
  print()
  print("== context parallelism: tiny GPT (64 wide, 4 heads, 2 layers), one sequence of 4096 tokens, same cores")
  print(("  %-12s %10s %9s %16s %9s"):format("layout", "step ms", "vs cp1", "act peak MB/rank", "vs cp1"))
  for _, r in ipairs{ { "context=1", one }, { "context=2", two } } do
    local name, m = r[1], r[2]
    emit("context_" .. name:gsub("=", ""), "step_ms", m.step_ms, "%.1f")
    emit("context_" .. name:gsub("=", ""), "peak_activation_bytes", m.peak_activation_bytes, "%d")
    print(("  %-12s %10.1f %9.3f %16.1f %9.3f"):format(name, m.step_ms, m.step_ms / one.step_ms,
      m.peak_activation_bytes / 2 ^ 20, m.peak_activation_bytes / one.peak_activation_bytes))
  end
  emit("context_cp2_vs_cp1", "step_time", two.step_ms / one.step_ms, "%.4f")
  emit("context_cp2_vs_cp1", "activation_bytes", two.peak_activation_bytes / one.peak_activation_bytes, "%.4f")
end
