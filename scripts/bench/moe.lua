-- Part moe: a mixture of experts with its experts spread over 2 ranks
-- (data = 2, expert = 2: each rank holds 2 of the 4 experts, tokens travel by
-- all-to-all) against the dense LLaMA with the same active parameters per
-- token (common.MODELS.moe_dense: SwiGLU 2 x 688, the two experts a token
-- runs) in the same layout, 1 thread per rank; then the all-to-all's
-- bandwidth against the bare MPI_Alltoall on the same buffers (workers.a2a).
-- Both step configurations run twice in mirrored order (MoE, dense, dense,
-- MoE) and keep their faster run, as part dp's do.
local common = require "bench.common"

local run, worker_cmd, check_run, emit = common.run, common.worker_cmd, common.check_run, common.emit

return function(ctx)
  local configs = {
    { key = "moe", label = "moe data=2 expert=2", args = { "--model=moe", "--data=2", "--expert=2" } },
    { key = "dense", label = "moe_dense data=2", args = { "--model=moe_dense", "--data=2" } },
  }
  local best = {}
  for round = 1, 2 do
    for i = 1, #configs do
      local c = configs[round == 1 and i or #configs + 1 - i]
      local args = { "--worker=step", "--steps=" .. ctx.steps(3) }
      for _, a in ipairs(c.args) do args[#args + 1] = a end
      local res, lines, rc = run(worker_cmd(2, 1, args))
      if check_run(c.label, res, lines, rc, "tokens_per_s") and
        (not best[c.key] or res.tokens_per_s > best[c.key].tokens_per_s) then
        best[c.key] = res
      end
    end
  end
  print()
  print("== mixture of experts, 4 experts top-2 (SwiGLU 688) over data = 2, expert = 2, against the dense model")
  print("   with the same active parameters (SwiGLU 1376), batch 8 x 128 per rank, 1 thread per rank")
  print(("  %-26s %9s %9s %10s %8s"):format("model", "tokens/s", "step ms", "expert ms", "peak MB"))
  for _, k in ipairs{ "moe", "dense" } do
    local r = best[k]
    if r then
      emit("moe_" .. k, "tokens_per_s", r.tokens_per_s, "%.2f")
      emit("moe_" .. k, "step_ms", r.step_ms, "%.1f")
      print(("  %-26s %9.2f %9.1f %10.1f %8.0f"):format(k == "moe" and "MoE (expert = 2)" or "dense, same active",
        r.tokens_per_s, r.step_ms, r.comm_ms_expert or 0, r.peak_rss_mb))
    end
  end
  if best.moe and best.dense then
    local ratio = best.moe.tokens_per_s / best.dense.tokens_per_s
    emit("moe_vs_dense", "tokens_per_s_ratio", ratio, "%.3f")
    print(("  MoE / dense tokens/s: %.2f (expert ms: the all-to-alls of the expert group per step)"):format(ratio))
  end
  local res, lines, rc = run(worker_cmd(2, 1, { "--worker=a2a" }))
  if check_run("a2a", res, lines, rc, "a2a_64_ratio") then
    print()
    print("== all_to_all against MPI_Alltoall, 2 ranks (bytes sent per rank; algbw = bytes / time)")
    print(("  %-10s %14s %16s %12s"):format("size", "MPI GB/s", "all_to_all GB/s", "time ratio"))
    for _, kib in ipairs{ 64, 1024, 16384 } do
      local k = "a2a_" .. kib
      emit(k, "gbs", res[k .. "_gbs"], "%.3f")
      emit(k, "mpi_gbs", res[k .. "_raw_gbs"], "%.3f")
      emit(k, "time_ratio", res[k .. "_ratio"], "%.3f")
      print(("  %-10s %14.3f %16.3f %11.2fx"):format(kib >= 1024 and (kib // 1024) .. " MiB" or kib .. " KiB",
        res[k .. "_raw_gbs"], res[k .. "_gbs"], res[k .. "_ratio"]))
    end
  end
end
