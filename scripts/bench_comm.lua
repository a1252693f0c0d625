-- Collective bandwidth: pipegoose's all_reduce, all_gather and reduce_scatter
-- next to the bare MPI_Allreduce on the same buffers, in the same run.
--   make bench-comm      (scripts/mpirun.sh -np 2 ./pglua scripts/bench_comm.lua)
-- Bandwidths follow nccl-tests: algbw = bytes / time; busbw = algbw * 2(n-1)/n
-- for all_reduce and algbw * (n-1)/n for all_gather and reduce_scatter, where
-- bytes is the full (gathered / unscattered) buffer.
local pg = require "pipegoose"

-- no options: --help says what it measures, and an argument is an error
require("argparse")("bench_comm.lua", "Collective bandwidth (all_reduce, all_gather, reduce_scatter and the bare "
  .. "MPI_Allreduce) under mpirun: scripts/mpirun.sh -np 2 ./pglua scripts/bench_comm.lua."):parse()

local ctx = pg.ParallelContext{ data = pg.world_size() }
local n, me = ctx:world_size(), ctx:rank()
local sizes = { 64 * 1024, 1024 * 1024, 16 * 1024 * 1024, 64 * 1024 * 1024 }
local function fmt_size(b)
  if b >= 1024 * 1024 then return ("%d MiB"):format(b // (1024 * 1024)) end
  return ("%d KiB"):format(b // 1024)
end

-- Median over `reps` timed repetitions (each a batch of `inner` calls), the
-- slowest rank's time counted.
local function time_it(fn, bytes)
  local inner = math.max(1, math.floor(64 * 1024 * 1024 / bytes / 4))
  for _ = 1, 2 do fn() end
  local samples = {}
  for r = 1, 7 do
    ctx:barrier()
    local t0 = pg.wtime()
    for _ = 1, inner do fn() end
    local t = pg.tensor{ (pg.wtime() - t0) / inner }
    pg.dist.all_reduce(t, { op = "max" })
    samples[r] = t:item()
  end
  table.sort(samples)
  return samples[4]
end

local function row(name, bytes, t, factor)
  local alg = bytes / t / 1e9
  return ("%-16s %8s %10.1f %9.2f %9.2f"):format(name, fmt_size(bytes), t * 1e6, alg, alg * factor)
end

if me == 0 then
  print(("collectives on %d ranks (%s, %d threads per rank)"):format(n, tostring(ctx), pg.num_threads()))
  print(("%-16s %8s %10s %9s %9s"):format("op", "size", "time us", "algbw GB/s", "busbw GB/s"))
end
local worst = 0
for _, bytes in ipairs(sizes) do
  local count = bytes // 4
  local buf = pg.randn({ count }, { seed = me })
  local t_raw = time_it(function() pg.dist.mpi_allreduce(buf) end, bytes)
  local t_ours = time_it(function() pg.dist.all_reduce(buf) end, bytes)
  -- the gathered / scattered results are freed at once, as a loop that
  -- calls these should: the GC does not see the size of tensor memory
  local part = buf:narrow(1, 1, count // n)
  local t_gather = time_it(function() pg.dist.all_gather(part):free() end, bytes)
  local t_rs = time_it(function() pg.dist.reduce_scatter(buf):free() end, bytes)
  local ratio = t_ours / t_raw
  worst = math.max(worst, ratio)
  if me == 0 then
    print(row("MPI_Allreduce", bytes, t_raw, 2 * (n - 1) / n))
    print(row("all_reduce", bytes, t_ours, 2 * (n - 1) / n) .. ("   %.3fx raw MPI time"):format(ratio))
    print(row("all_gather", bytes, t_gather, (n - 1) / n))
    print(row("reduce_scatter", bytes, t_rs, (n - 1) / n))
  end
end
if me == 0 then
  print(("all_reduce_vs_mpi_worst_ratio %.3f (target <= 1.05)"):format(worst))
end
