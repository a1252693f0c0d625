-- The planner against published runs (lua/pipegoose/plan/published.lua):
-- each Megatron-LM row's layout pinned to the paper's (T, P, no SP, no ZeRO,
-- full recomputation, 1F1B), the micro-batch size the planner's choice unless
-- the paper prints it; prints a Markdown table (docs/PLANNER.md) and the error
-- statistics; then torchtitan's FSDP row (zero 3, D = 64) with its MFU.
--   pglua scripts/plan_published.lua [--gemm-efficiency=X]
local pg = require "pipegoose"
local argparse = require "argparse"
local published = require "pipegoose.plan.published"
-- scripts/bench/*.lua as require "bench.<name>", found next to this script
package.path = (arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local common = require "bench.common"

local parser = argparse("plan_published.lua", "Planner predictions next to Megatron-LM's published throughputs.")
parser:option("--gemm-efficiency", "Override the planner's GEMM efficiency constant."):convert(tonumber)
local args = parser:parse()

print(("| source | params (B) | GPUs | T | P | D | batch | b | published TFLOP/s | predicted TFLOP/s | error | mem GiB |"))
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
local errs = {}
for _, row in ipairs(published.ROWS) do
  local ok, L = pcall(pg.plan, published.query(row, { gemm_efficiency = args.gemm_efficiency }))
  if ok then
    local err = (L.tflops_per_gpu - row.tflops) / row.tflops
    errs[#errs + 1] = math.abs(err)
    print(("| %s%s | %.1f | %d | %d | %d | %d | %d | %d | %d | %.0f | %+.0f%% | %.1f |"):format(row.id,
      row.layout_from and (" (layout: " .. row.layout_from .. ")") or "", row.params_b, row.gpus, L.t, L.p, L.d,
      row.batch, L.b, row.tflops, L.tflops_per_gpu, 100 * err, L.mem_gb))
  else
    print(("| %s | %.1f | %d | %d | %d | | %d | | %d | %s | | |"):format(row.id, row.params_b, row.gpus, row.t, row.p,
      row.batch, row.tflops, tostring(L)))
  end
end
table.sort(errs)
local n = #errs
print(("\npublished_comparison median_abs_error=%.3f max_abs_error=%.3f n=%d"):format(common.median(errs), errs[n], n))

-- fully sharded data parallelism (zero 3): published.FSDP_ROWS, MFU in torchtitan's convention
print(("\n%s\n"):format(published.FSDP_SOURCE))
print("| model | GPUs | layout | seq | recompute | published tokens/s/GPU | predicted | published MFU | predicted MFU "
  .. "(torchtitan's count) | planner mfu | error | mem GiB |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for _, row in ipairs(published.FSDP_ROWS) do
  local ok, L = pcall(pg.plan, published.fsdp_query(row, { gemm_efficiency = args.gemm_efficiency }))
  if ok then
    local mfu = published.torchtitan_mfu(L, row, pg.plan.hardware.get("a100-80gb").peak_flops.bf16)
    print(("| %s | %d | t=%d p=%d context=%d d=%d zero=%d | %d | %s every %d | %d | %.0f | %.1f%% | %.1f%% | %.1f%% | "
      .. "%+.0f%% | %.1f |"):format(row.model.name, row.gpus, L.t, L.p, L.c, L.d, L.zero, row.seq_len, row.recompute,
      row.recompute_every, row.wps, L.tokens_per_s / row.gpus, 100 * row.mfu, 100 * mfu, 100 * L.mfu,
      100 * (mfu - row.mfu) / row.mfu, L.mem_gb))
  else
    print(("| %s | %d | | %d | | %d | %s | | | | | |"):format(row.model.name, row.gpus, row.seq_len, row.wps,
      tostring(L)))
  end
end
