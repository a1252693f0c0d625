-- Parts tp and dp: GPT-2 124M on 2 ranks x 1 thread (tensor = 2; data = 2
-- with zero 0 and 1) against one rank x 1 thread, MFU against the one-thread
-- sgemm peak (ctx.results.peak[1] from part peak).
--
-- Every configuration (the 1 rank x 1 thread baseline included) runs
-- twice, in the order base, T=2, D=2 zero 0, zero 1 and then the reverse,
-- and each keeps its faster run: interference from other work on the
-- machine only ever slows a run down, and the mirrored order spreads a
-- drift of the machine's speed evenly over the configurations. So the runs
-- of the parts only enlist their configurations (in ctx.results.scaling);
-- M.finish, shared by both and called after the last of them that runs,
-- measures them all (the baseline once for both) and prints the tables.
local common = require "bench.common"

local run, worker_cmd, check_run, emit = common.run, common.worker_cmd, common.check_run, common.emit
local flops_per_token = common.flops_per_token

local M = {}

--- One run of an enlisted configuration: its result lines, or nil when it failed.
local function measure(ctx, config)
  local args = { "--worker=step", "--model=gpt2", "--steps=" .. ctx.steps(3) }
  if not config.args then
    local res, lines, rc = run(worker_cmd(1, 1, args))
    return check_run("gpt2_124m 1 rank x 1 thread", res, lines, rc, "tokens_per_s") and res or nil
  end
  for _, x in ipairs(config.args) do args[#args + 1] = x end
  local res, lines, rc = run(worker_cmd(2, 1, args))
  return check_run(config.label, res, lines, rc, "tokens_per_s") and res or nil
end

--- The configurations enlisted so far, the baseline (1 rank, no args) first.
local function enlisted(ctx)
  ctx.results.scaling = ctx.results.scaling or { { key = "base" } }
  return ctx.results.scaling
end

function M.tp(ctx)
  local c = enlisted(ctx)
  c[#c + 1] = { key = "tp", label = "gpt2_124m tensor=2", args = { "--tensor=2" } }
end

function M.dp(ctx)
  local c = enlisted(ctx)
  for _, zero in ipairs{ 0, 1 } do
    c[#c + 1] = { key = "dp" .. zero, label = "gpt2_124m data=2 zero=" .. zero,
                  args = { "--data=2", "--zero=" .. zero } }
  end
end

function M.finish(ctx)
  local configs = enlisted(ctx)
  local peak = ctx.results.peak
  local runs = {}
  for round = 1, 2 do
    for i = 1, #configs do
      local c = configs[round == 1 and i or #configs + 1 - i]
      runs[c.key] = runs[c.key] or {}
      local r = measure(ctx, c)
      if r then table.insert(runs[c.key], r) end
    end
  end
  local function best(key)
    local list, b = runs[key] or {}, nil
    for _, r in ipairs(list) do if not b or r.tokens_per_s > b.tokens_per_s then b = r end end
    return b
  end
  local function both(key)
    local t = {}
    for _, r in ipairs(runs[key] or {}) do t[#t + 1] = ("%.2f"):format(r.tokens_per_s) end
    return table.concat(t, " / ")
  end
  local b, tp, dp = best("base"), best("tp"), { [0] = best("dp0"), [1] = best("dp1") }
  if b then
    local tps = b.tokens_per_s
    emit("gpt2_1x1", "tokens_per_s", tps, "%.2f")
    emit("gpt2_1x1", "step_ms", b.step_ms, "%.1f")
    emit("gpt2_1x1", "mfu_1thread", tps * flops_per_token(b) / (peak[1] * 1e9), "%.3f")
    emit("gpt2_1x1", "peak_rss_mb", b.peak_rss_mb, "%.0f")
    local drift = ("  (tokens/s of the two runs, the faster kept: 1 rank %s"):format(both("base"))
    for _, k in ipairs{ "tp", "dp0", "dp1" } do
      if runs[k] then drift = drift .. ("; %s %s"):format(k == "tp" and "T=2" or ("D=2 zero=" .. k:sub(3)), both(k)) end
    end
    drift = drift .. ")"
    local function row_line(label, r, speed, comm_ms, extra)
      print(("  %-22s %9.2f %9.1f %8s %10.1f %8.0f %s"):format(label, r.tokens_per_s, r.step_ms,
        speed and ("%.2fx"):format(speed) or "1.00x", comm_ms or 0, r.peak_rss_mb, extra or ""))
    end
    if tp then
      local sp = tp.tokens_per_s / tps
      emit("gpt2_tp2", "tokens_per_s", tp.tokens_per_s, "%.2f")
      emit("gpt2_tp2", "step_ms", tp.step_ms, "%.1f")
      emit("gpt2_tp2", "speedup", sp, "%.3f")
      emit("gpt2_tp2", "comm_ms_per_step", tp.comm_ms_tensor or 0, "%.1f")
      emit("gpt2_tp2", "comm_fraction", (tp.comm_ms_tensor or 0) / tp.step_ms, "%.3f")
      emit("gpt2_tp2", "peak_rss_mb_per_rank", tp.peak_rss_mb, "%.0f")
      print()
      print("== tensor parallel, GPT-2 124M, batch 4 x 64, 1 thread per rank (target: speedup >= 1.6)")
      print(("  %-22s %9s %9s %8s %10s %8s"):format("layout", "tokens/s", "step ms", "speedup", "comm ms", "peak MB"))
      row_line("T=1 (1 rank)", b)
      row_line("T=2 (2 ranks)", tp, sp, tp.comm_ms_tensor)
      print(drift)
    end
    if dp[0] or dp[1] then
      print()
      print("== data parallel, GPT-2 124M, 4 x 64 per rank, 1 thread per rank (target: scaling >= 1.8)")
      print(("  %-22s %9s %9s %8s %10s %8s %8s"):format("layout", "tokens/s", "step ms", "scaling", "sync ms", "peak MB",
        "PSS MB"))
      row_line("D=1 (1 rank)", b)
      for _, zero in ipairs{ 0, 1 } do
        local r = dp[zero]
        if r then
          local key = "gpt2_dp2_zero" .. zero
          local sp = r.tokens_per_s / tps
          emit(key, "tokens_per_s", r.tokens_per_s, "%.2f")
          emit(key, "step_ms", r.step_ms, "%.1f")
          emit(key, "scaling", sp, "%.3f")
          emit(key, "grad_sync_ms_per_step", r.grad_sync_ms, "%.1f")
          emit(key, "data_comm_ms_per_step", r.comm_ms_data or 0, "%.1f")
          emit(key, "grad_sync_fraction", r.grad_sync_ms / r.step_ms, "%.3f")
          emit(key, "peak_rss_mb_per_rank", r.peak_rss_mb, "%.0f")
          emit(key, "pss_mb_per_rank", r.pss_mb, "%.0f")
          row_line(("D=2 zero=%d"):format(zero), r, sp, r.grad_sync_ms, ("%8.0f %s"):format(r.pss_mb,
            zero == 1 and ("(+ %.1f ms parameter all-gather)"):format((r.comm_ms_data or 0) - r.grad_sync_ms) or ""))
        end
      end
      print(drift)
      print("  sync ms: the gradient reduction per step (engine:stats().grad_sync_seconds). Peak RSS (VmHWM)")
      print("  counts the pages of the other replica's shared buffers that this rank touched; PSS (at the end)")
      print("  counts shared pages once, split between the ranks that map them.")
    end
  end
end

return M
