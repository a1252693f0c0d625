-- Part bf16: the training step of GPT-2 124M and of the small model in
-- float32 and with precision = "bf16", one rank on all cores, in the same
-- run (fp32, bf16, then fp32 and bf16 again, each side the mean of its two
-- runs, so that a change of the machine's load weighs on both sides of the
-- ratio): tokens/s, their ratio, memory per rank (engine:memory()) and which
-- bf16 GEMM path ran and why (src/backend/cpu_bf16_gemm.c). bf16 also runs once on
-- the other path where that one can run here (PG_BF16_GEMM=fallback|onednn),
-- for comparison.
local pg = require "pipegoose"
local common = require "bench.common"

local run, worker_cmd, check_run, emit = common.run, common.worker_cmd, common.check_run, common.emit

local MODELS = { { key = "gpt2", label = "gpt2_124m" }, { key = "small", label = "small" } }

return function(ctx)
  local path, why = pg.ops.bf16_gemm_path()
  local other = path == "onednn" and "fallback" or (pcall(pg.ops.bf16_gemm_path, "onednn") and "onednn" or nil)
  pg.ops.bf16_gemm_path("auto")
  local function step(model, precision, env)
    local args = { "--worker=step", "--model=" .. model, "--steps=" .. ctx.steps(3), "--precision=" .. precision }
    local name = ("bf16_%s_%s%s"):format(model, precision, env and "_" .. other or "")
    local res, lines, rc = run((env and env .. " " or "") .. worker_cmd(1, ctx.ncores, args))
    return check_run(name, res, lines, rc, "tokens_per_s") and res or nil
  end
  local rows = {}
  for _, m in ipairs(MODELS) do
    local runs = { fp32 = {}, bf16 = {} }
    for _ = 1, 2 do
      for _, p in ipairs{ "fp32", "bf16" } do
        local r = step(m.key, p)
        if r then runs[p][#runs[p] + 1] = r end
      end
    end
    local other_run = other and step(m.key, "bf16", "PG_BF16_GEMM=" .. other) or nil
    local function mean(list, k)
      local s = 0
      for _, r in ipairs(list) do s = s + r[k] end
      return #list > 0 and s / #list or nil
    end
    local row = { label = m.label, other = other_run }
    for _, p in ipairs{ "fp32", "bf16" } do
      local r = runs[p][1]
      if r then
        row[p] = { tokens_per_s = mean(runs[p], "tokens_per_s"), step_ms = mean(runs[p], "step_ms"), r = r }
        emit(m.label .. "_" .. p, "tokens_per_s", row[p].tokens_per_s, "%.1f")
        emit(m.label .. "_" .. p, "rank_mb", r.rank_mb, "%.1f")
        emit(m.label .. "_" .. p, "activation_mb", r.activation_mb, "%.1f")
        emit(m.label .. "_" .. p, "bf16_mb", r.bf16_mb, "%.1f")
        emit(m.label .. "_" .. p, "peak_rss_mb", r.peak_rss_mb, "%.0f")
      end
    end
    if row.fp32 and row.bf16 then
      emit(m.label, "bf16_vs_fp32", row.bf16.tokens_per_s / row.fp32.tokens_per_s, "%.2f")
    end
    if other_run then emit(m.label .. "_bf16_" .. other, "tokens_per_s", other_run.tokens_per_s, "%.1f") end
    rows[#rows + 1] = row
  end
  print()
  print(("== precision: fp32 against bf16, 1 rank x %d threads (memory per rank in MiB: params + grads + AdamW + "
    .. "activations + bf16 working weights and operands = total; peak RSS)"):format(ctx.ncores))
  print(("  bf16 GEMM path: %s (%s)"):format(path, why))
  print(("  %-10s %-9s %9s %9s %7s %8s %8s %8s %8s %8s %8s %8s"):format("model", "precision", "tokens/s", "step ms",
    "vs fp32", "params", "grads", "adamw", "activ.", "bf16", "total", "RSS"))
  for _, row in ipairs(rows) do
    for _, p in ipairs{ "fp32", "bf16" } do
      local x = row[p]
      if x then
        local r = x.r
        print(("  %-10s %-9s %9.1f %9.1f %7s %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f %8.0f"):format(row.label, p,
          x.tokens_per_s, x.step_ms, row.fp32 and ("%.2fx"):format(x.tokens_per_s / row.fp32.tokens_per_s) or "-",
          r.params_mb, r.grads_mb, r.optimizer_mb, r.activation_mb, r.bf16_mb, r.rank_mb, r.peak_rss_mb))
      end
    end
    if row.other then
      print(("  %-10s %-9s %9.1f %9.1f %7s   (the other path: PG_BF16_GEMM=%s)"):format(row.label,
        other == "onednn" and "bf16 dnn" or "bf16 fb", row.other.tokens_per_s, row.other.step_ms,
        row.fp32 and ("%.2fx"):format(row.other.tokens_per_s / row.fp32.tokens_per_s) or "-", other))
    end
  end
  print("  targets (issue 16): bf16 >= 1.6x fp32 tokens/s with AVX512_BF16/AMX, no slower elsewhere")
end
