-- Part memory: what each memory option saves, against the same step without
-- it in the same run. The small model (16 x 128 tokens, where activations
-- outweigh the weights): the activation peak of a step (engine:memory(),
-- the largest over ranks) and the step time. On one rank (2 threads):
-- recompute = "full" (each block keeps only its input; backward runs its
-- forward again) and "selective" (only attention's core is recomputed,
-- Korthikanti et al. 2022), each against no recomputation. On tensor = 2 (2
-- ranks x 1 thread): sequence_parallel against the same layout without it.
-- ZeRO's bytes per parameter are the overlap part's.
local common = require "bench.common"

local emit = common.emit

-- each group: its baseline first, then the options measured against it
local GROUPS = {
  { title = "1 rank", ranks = 1, rows = {
    { name = "none", args = {} },
    { name = "recompute_full", args = { "--recompute=full" } },
    { name = "recompute_selective", args = { "--recompute=selective" } },
  } },
  { title = "tensor = 2", ranks = 2, rows = {
    { name = "tp2", args = { "--tensor=2" } },
    { name = "tp2_sequence_parallel", args = { "--tensor=2", "--sequence_parallel=1" } },
  } },
}

return function(ctx)
  local measured = {}
  for _, g in ipairs(GROUPS) do
    for _, o in ipairs(g.rows) do
      local args = { "--worker=step", "--model=small", "--steps=" .. ctx.steps(4) }
      for _, a in ipairs(o.args) do args[#args + 1] = a end
      local threads = g.ranks == 1 and ctx.ncores or 1
      local res, lines, rc = common.run(common.worker_cmd(g.ranks, threads, args))
      if not common.check_run("memory " .. o.name, res, lines, rc, "peak_activation_bytes") then return end
      measured[o.name] = res
    end
  end
  print()
  print("== memory options, the small model (16 x 128 tokens): activation peak (largest rank) and step time,")
  print("   each against the first row of its group, measured in the same run")
  print(("  %-24s %12s %9s %9s %9s"):format("option", "act peak MB", "vs base", "step ms", "vs base"))
  for _, g in ipairs(GROUPS) do
    print(("  -- %s"):format(g.title))
    local base = measured[g.rows[1].name]
    for _, o in ipairs(g.rows) do
      local r = measured[o.name]
      local act, ms = r.peak_activation_bytes, r.step_ms
      local k = "memory_" .. o.name
      emit(k, "peak_activation_bytes", act, "%d")
      emit(k, "activation_vs_base", act / base.peak_activation_bytes, "%.4f")
      emit(k, "step_ms", ms, "%.1f")
      emit(k, "step_time_vs_base", ms / base.step_ms, "%.4f")
      print(("  %-24s %12.1f %9.3f %9.1f %9.3f"):format(o.name, act / 2 ^ 20, act / base.peak_activation_bytes, ms,
        ms / base.step_ms))
    end
  end
end
