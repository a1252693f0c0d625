-- Parts gpt2, small and llama: one model's training step, one rank on all
-- cores, against the sgemm peak (MFU; ctx.results.peak from part peak) and
-- the peers of scripts/bench/peers.lua. Each part appends its row to
-- ctx.results.steps; the table of them all follows the last of the three
-- that runs (M.table, their shared finish).
local pg = require "pipegoose"
local common = require "bench.common"
local peers = require "bench.peers"

local run, worker_cmd, check_run, emit = common.run, common.worker_cmd, common.check_run, common.emit

local M = {}

--- The run of a part: name is the config of its lines, model is a key of
--- common.MODELS, torch_args select the same model in scripts/bench_torch.py,
--- with_llmc adds llm.c's trainer (it has GPT-2 124M only) as a peer.
-- With PyTorch the order is ours, PyTorch, ours again, and ours is the mean
-- of the two: a change in the machine's load during the part then weighs
-- on both sides of the ratio.
function M.part(name, model, torch_args, with_llmc)
  return function(ctx)
    local ncores = ctx.ncores
    local function ours()
      local args = { "--worker=step", "--model=" .. model, "--steps=" .. ctx.steps(4) }
      local res, lines, rc = run(worker_cmd(1, ncores, args))
      return check_run(name, res, lines, rc, "tokens_per_s") and res or nil
    end
    local res = ours()
    if not res then return end
    local torch = peers.torch(ctx, ("--threads %d --warmup 1 --steps 3 %s"):format(ncores, torch_args))
    local llmc = with_llmc and peers.llmc(ctx) or nil
    if torch or llmc then
      local again = ours()
      if again then
        emit(name, "tokens_per_s_before_peers", res.tokens_per_s, "%.1f")
        emit(name, "tokens_per_s_after_peers", again.tokens_per_s, "%.1f")
        res.tokens_per_s = (res.tokens_per_s + again.tokens_per_s) / 2
        res.step_ms = (res.step_ms + again.step_ms) / 2
        res.peak_rss_mb = math.max(res.peak_rss_mb, again.peak_rss_mb)
      end
    end
    local fpt = common.flops_per_token(res)
    local mfu = res.tokens_per_s * fpt / (ctx.results.peak[ncores] * 1e9)
    emit(name, "tokens_per_s", res.tokens_per_s, "%.1f")
    emit(name, "step_ms", res.step_ms, "%.1f")
    emit(name, "model_gflops_per_s", res.tokens_per_s * fpt / 1e9, "%.2f")
    emit(name, "mfu", mfu, "%.3f")
    emit(name, "peak_rss_mb", res.peak_rss_mb, "%.0f")
    emit(name, "params", res.params, "%d")
    for _, peer in ipairs(peers.TORCH) do
      local t = torch and torch[peer.key]
      if t then
        emit(name, peer.key .. "_tokens_per_s", t.tokens_per_s, "%.1f")
        emit(name, "vs_" .. peer.key, res.tokens_per_s / t.tokens_per_s, "%.2f")
        emit(name, peer.key .. "_version", t.version)
        emit(name, peer.key .. "_blas", t.blas)
      else
        emit(name, peer.key .. "_tokens_per_s", "n/a")
      end
    end
    if llmc then
      emit(name, "llmc_tokens_per_s", llmc, "%.1f")
      emit(name, "vs_llmc", res.tokens_per_s / llmc, "%.2f")
    end
    local rows = ctx.results.steps or {}
    ctx.results.steps = rows
    rows[#rows + 1] = { name, res, mfu, torch, llmc }
  end
end

--- The table of the rows that the parts measured (none when all failed).
function M.table(ctx)
  local rows = ctx.results.steps or {}
  if #rows == 0 then return end
  print()
  print(("== training step, 1 rank x %d threads (fp32; MFU = (6N + 6LCT) x tokens/s / sgemm peak)"):format(ctx.ncores))
  print(("  %-10s %11s %9s %9s %6s %8s %11s %8s %11s %8s %11s %8s %10s %8s"):format("model", "params", "tokens/s",
    "step ms", "MFU", "peak MB", "pt1.13 t/s", "vs", "pt2 eager", "vs", "pt2 compile", "vs", "llm.c t/s", "vs llm.c"))
  local function ratio(x, peer) return peer and ("%.2fx"):format(x / peer) or "-" end
  local function tps(t) return t and ("%.1f"):format(t) or "n/a" end
  local seen = {}
  for _, r in ipairs(rows) do
    local name, res, mfu, torch, llmc = r[1], r[2], r[3], r[4] or {}, r[5]
    local cells = {}
    for _, peer in ipairs(peers.TORCH) do
      local t = torch[peer.key] and torch[peer.key].tokens_per_s
      if torch[peer.key] then seen[peer.key] = torch[peer.key] end
      cells[#cells + 1] = tps(t)
      cells[#cells + 1] = ratio(res.tokens_per_s, t)
    end
    print(("  %-10s %11d %9.1f %9.1f %6.3f %8.0f %11s %8s %11s %8s %11s %8s %10s %8s"):format(name, res.params,
      res.tokens_per_s, res.step_ms, mfu, res.peak_rss_mb, cells[1], cells[2], cells[3], cells[4], cells[5], cells[6],
      tps(llmc), ratio(res.tokens_per_s, llmc)))
  end
  for _, peer in ipairs(peers.TORCH) do
    local t = seen[peer.key]
    if t then
      print(("  %s: PyTorch %s, %s, BLAS %s"):format(peer.label, t.version, t.mode, t.blas))
    elseif not peers.have(peer) then
      print(("  %s: not here (%s has no torch%s)"):format(peer.label, peer.python,
        peer.python:find("build/peers", 1, true) and "; scripts/peers.sh makes it" or ""))
    end
  end
  print(("  pipegoose: OpenBLAS, %s kernels"):format(pg.machine().blas_core or "?"))
  if not peers.LLMC_DIR then print("  (llm.c: set LLMC_DIR to a checkout of karpathy/llm.c for its column)") end
  print("  targets (issue 19): GPT-2 124M MFU >= 0.8 (on gpt2_124m_b8x256, a training-size batch: 4 x 64 is bound by\n"
    .. "  AdamW and the other per-step passes over 124M parameters) and >= 1.3x PyTorch 2 compile; small >= 2x")
end

return M
