-- Part memory: what each memory option saves, against the same step without
-- it in the same run. The small model (16 x 128 tokens, where activations
-- outweigh the weights) on one rank: the activation peak of a step
-- (engine:memory(), the largest over ranks) and the step time, with
-- recompute = "full" (each block keeps only its input; backward runs its
-- forward again) and "selective" (only attention's core is recomputed,
-- Korthikanti et al. 2022), each against no recomputation.
local common = require "bench.common"

local emit = common.emit

local OPTIONS = {
  { name = "none", args = {} },
  { name = "recompute_full", args = { "--recompute=full" } },
  { name = "recompute_selective", args = { "--recompute=selective" } },
}

return function(ctx)
  local rows = {}
  for _, o in ipairs(OPTIONS) do
    local args = { "--worker=step", "--model=small", "--steps=" .. ctx.steps(4) }
    for _, a in ipairs(o.args) do args[#args + 1] = a end
    local res, lines, rc = common.run(common.worker_cmd(1, ctx.ncores, args))
    if not common.check_run("memory " .. o.name, res, lines, rc, "peak_activation_bytes") then return end
    rows[#rows + 1] = { name = o.name, res = res }
  end
  local base = rows[1].res
  print()
  print("== memory options, the small model (16 x 128 tokens, 1 rank): activation peak and step time against none")
  print(("  %-20s %12s %9s %9s %9s"):format("option", "act peak MB", "vs none", "step ms", "vs none"))
  for _, r in ipairs(rows) do
    local act, ms = r.res.peak_activation_bytes, r.res.step_ms
    local k = "memory_" .. r.name
    emit(k, "peak_activation_bytes", act, "%d")
    emit(k, "activation_vs_none", act / base.peak_activation_bytes, "%.4f")
    emit(k, "step_ms", ms, "%.1f")
    emit(k, "step_time_vs_none", ms / base.step_ms, "%.4f")
    print(("  %-20s %12.1f %9.3f %9.1f %9.3f"):format(r.name, act / 2 ^ 20, act / base.peak_activation_bytes, ms,
      ms / base.step_ms))
  end
end
