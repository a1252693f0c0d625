-- Part peak: the sgemm rate that MFU is measured against, all cores and one
-- thread, in this (the driver's) process. The parts that report MFU need it
-- (needs = { "peak" } in scripts/bench/parts.lua) and read
-- ctx.results.peak[threads] in GFLOP/s.
local pg = require "pipegoose"
local common = require "bench.common"

local emit = common.emit

-- deep products (large C): ops.linear allocates and clears its output on
-- every call, which must stay small next to the arithmetic
local shapes = { { 1024, 4096, 1024 }, { 2048, 2048, 2048 }, { 1536, 3072, 1536 } }

local function best_gflops(threads)
  pg.ops.set_num_threads(threads)
  local best = 0
  for _, s in ipairs(shapes) do
    local N, C, OC = s[1], s[2], s[3]
    local x, w = pg.randn({ N, C }, { seed = 1 }), pg.randn({ OC, C }, { seed = 2, std = 0.02 })
    pg.ops.linear(x, w) -- warm-up (buffers, pages)
    for _ = 1, 4 do
      local t0 = pg.wtime()
      pg.ops.linear(x, w)
      best = math.max(best, 2 * N * C * OC / (pg.wtime() - t0) / 1e9)
    end
  end
  return best
end

return function(ctx)
  local ncores = ctx.ncores
  local peak = {}
  peak[ncores] = best_gflops(ncores)
  if ncores ~= 1 then peak[1] = best_gflops(1) end
  pg.ops.set_num_threads(pg.num_threads())
  ctx.results.peak = peak
  print()
  print("== sgemm peak (best of large sgemms through pg.ops.linear)")
  print(("  %d threads: %7.1f GFLOP/s"):format(ncores, peak[ncores]))
  print(("  1 thread : %7.1f GFLOP/s"):format(peak[1]))
  emit("sgemm", "peak_gflops", peak[ncores])
  emit("sgemm", "threads", ncores)
  emit("sgemm", "peak_gflops_1thread", peak[1])
end
