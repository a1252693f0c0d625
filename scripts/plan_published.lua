-- The planner against published runs (lua/pipegoose/plan/published.lua):
-- each row's layout pinned to the paper's (T, P, no SP, no ZeRO, full
-- recomputation, 1F1B), the micro-batch size the planner's choice unless the
-- paper prints it; prints a Markdown table (docs/PLANNER.md) and the error
-- statistics.
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
