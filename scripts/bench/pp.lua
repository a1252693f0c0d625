-- Part pp: pipeline = 2 (2 ranks x 1 thread), M = 1..16 micro-batches, GPipe
-- and 1F1B: the measured bubble against (P-1)/(M+P-1), and 1F1B's activation
-- peak against GPipe's; the interleaved 1F1B (V = 2 chunks per stage, M =
-- 2..16) against (P-1)/(V*M+P-1), the idle fraction of a bubble of
-- (P-1)/(V*M) of the ideal step, next to 1F1B's at the same M. The measuring is the pp worker's
-- (scripts/bench/workers.lua, which says how the bubble is measured).
local common = require "bench.common"

local emit = common.emit

return function(ctx)
  local res, lines, rc = common.run(common.worker_cmd(2, 1, { "--worker=pp", "--steps=" .. ctx.steps(7) }))
  if not common.check_run("pipeline bubbles", res, lines, rc, "pp_1f1b_m16.theory") then return end
  local cfg = common.MODELS.pp
  print()
  print(("== pipeline, P = 2 (1 thread per rank), GPT %d x %d, micro-batches of %d x %d tokens"):format(cfg.layers,
    cfg.dim, cfg.batch, cfg.seq_len))
  print("   idle = (step wall - the stage's own compute) / step wall, per stage (median over the steps);")
  print("   bubble = the idle fraction of each step's busiest stage (median): the schedule's fill and drain;")
  print("   the other stage idles that plus M x its per-micro-batch deficit (imbalance); recv = blocked receives")
  print(("  %-11s %3s %8s %7s %7s %7s %7s %6s %6s %11s %8s"):format("sched", "M", "step ms", "theory", "bubble",
    "idle0", "idle1", "recv0", "recv1", "act peak KB", "vs GPipe"))
  local worst, act_ok = 0, true
  for _, schedule in ipairs{ "gpipe", "1f1b", "interleaved" } do
    for _, M in ipairs(schedule == "interleaved" and { 2, 4, 8, 16 } or { 1, 2, 4, 8, 16 }) do
      local k = ("pp_%s_m%d"):format(schedule, M)
      local th, bub = res[k .. ".theory"], res[k .. ".bubble"]
      local i0, i1 = res[k .. ".idle_stage0"], res[k .. ".idle_stage1"]
      local act = math.max(res[k .. ".peak_activation_bytes_stage0"], res[k .. ".peak_activation_bytes_stage1"])
      local g = ("pp_gpipe_m%d"):format(M)
      local gact = math.max(res[g .. ".peak_activation_bytes_stage0"], res[g .. ".peak_activation_bytes_stage1"])
      worst = math.max(worst, math.abs(bub - th))
      if schedule == "1f1b" and act / gact > math.min(1, 2 / M) + 1e-9 then act_ok = false end
      emit(k, "step_ms", res[k .. ".step_ms"], "%.1f")
      emit(k, "bubble_theory", th, "%.4f")
      emit(k, "bubble", bub, "%.4f")
      emit(k, "idle_stage0", i0, "%.4f")
      emit(k, "idle_stage1", i1, "%.4f")
      emit(k, "recv_wait_fraction_stage0", res[k .. ".recv_wait_stage0"], "%.4f")
      emit(k, "recv_wait_fraction_stage1", res[k .. ".recv_wait_stage1"], "%.4f")
      emit(k, "peak_activation_bytes", act, "%d")
      emit(k, "activation_vs_gpipe", act / gact, "%.4f")
      emit(k, "activation_bound_p_over_m", math.min(1, 2 / M), "%.4f")
      print(("  %-11s %3d %8.1f %7.3f %7.3f %7.3f %7.3f %6.3f %6.3f %11.0f %8.3f"):format(schedule, M,
        res[k .. ".step_ms"], th, bub, i0, i1, res[k .. ".recv_wait_stage0"], res[k .. ".recv_wait_stage1"],
        act / 1024, act / gact))
    end
  end
  emit("pp", "bubble_worst_abs_error", worst, "%.4f")
  emit("pp", "activation_1f1b_within_p_over_m", act_ok and "yes" or "no")
  print(("  worst |bubble - theory| = %.1f points (target <= 5)"):format(worst * 100))
  print(("  1F1B activation peak <= P/M of GPipe's (P/M capped at 1): %s"):format(act_ok and "yes" or "NO"))
end
