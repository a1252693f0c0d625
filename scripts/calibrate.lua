-- Measures this machine with pipegoose's own operations and writes the
-- hardware profile that the planner reads (--gpu=cpu-profile=FILE; the format
-- is in lua/pipegoose/plan/hardware.lua and docs/PLANNER.md).
--
--   pglua scripts/calibrate.lua [--out=build/profile.json] [--quick] [--ranks=2,4,8]
--
-- In this process (one rank, at all cores and at one thread): pg.ops.linear
-- by shape, the attention core forward and backward, memory-bound kernels
-- (gelu, layernorm, residual; their median is the elementwise bandwidth),
-- AdamW, the cost of one tiny operation and the fixed cost of an engine step.
-- Then, for each group size, the script runs itself under scripts/mpirun.sh
-- (--worker=comm) to time pg.dist's all_reduce, all_gather and
-- reduce_scatter by size, the engine's shared-memory gradient reduction and,
-- on 2 ranks, send/recv. Every figure is the median of repeats; a
-- collective's latency and bandwidth are the line through its smallest and
-- largest sizes. --quick measures fewer shapes and sizes with fewer repeats
-- (for specs; its figures are rougher).
local pg = require "pipegoose"
local argparse = require "argparse"
local cjson = require("cjson").new()

local parser = argparse("calibrate.lua", "Measure this machine into a planner hardware profile (JSON).")
parser:option("--out", "Profile to write.", "build/profile.json")
parser:flag("--quick", "Fewer shapes, sizes and repeats (seconds instead of a minute or two).")
parser:option("--ranks", "Group sizes of the multi-rank measurements (comma-separated).", "2,4,8")
parser:option("--worker", "Internal: the multi-rank part (comm), run under mpirun."):hidden(true)
local args = parser:parse()

local quick = args.quick
local REPEATS = quick and 3 or 7

-- scripts/bench/*.lua as require "bench.<name>", found next to this script
package.path = (arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local median = require("bench.common").median

--- Median seconds of f() over `n` runs after one warm-up run.
local function timed(f, n)
  f()
  local ts = {}
  for i = 1, n or REPEATS do
    local t0 = pg.wtime()
    f()
    ts[i] = pg.wtime() - t0
  end
  return median(ts)
end

local function cores()
  local f = io.popen("env -u OMP_NUM_THREADS nproc 2>/dev/null")
  local n = f and tonumber(f:read("l") or "") or nil
  if f then f:close() end
  return n or pg.num_threads()
end

---------------------------------------------------------------- one rank

-- Shapes around those of the small models pipegoose trains on a CPU: rows
-- m = b*s from a few sequences to a large batch, widths from a split head to
-- a 4h MLP. The planner interpolates between them (plan/cpu.lua).
local function gemm_table(threads)
  local ms = quick and { 256, 2048 } or { 128, 512, 2048 }
  local ks = quick and { 128, 1024 } or { 64, 256, 1024 }
  local rows = {}
  pg.ops.set_num_threads(threads)
  for _, m in ipairs(ms) do
    for _, k in ipairs(ks) do
      for _, n in ipairs(ks) do
        local x, w = pg.randn({ m, k }, { seed = 1 }), pg.randn({ n, k }, { seed = 2, std = 0.02 })
        local s = timed(function() pg.ops.linear(x, w):free() end)
        rows[#rows + 1] = { m = m, k = k, n = n, threads = threads, flops = 2 * m * k * n / s }
        x:free()
        w:free()
      end
    end
  end
  return rows
end

local function attention_table(threads)
  local shapes = quick and { { 4, 64, 4, 32 } } or { { 2, 64, 2, 32 }, { 8, 128, 4, 64 }, { 4, 128, 2, 64 },
    { 4, 64, 6, 64 } }
  pg.ops.set_num_threads(threads)
  local rows = {}
  for _, sh in ipairs(shapes) do
    local B, T, H, hd = sh[1], sh[2], sh[3], sh[4]
    local C = H * hd
    local qkv = pg.randn({ B, T, 3 * C }, { seed = 3 })
    local dy = pg.randn({ B, T, C }, { seed = 4 })
    local flops = 4 * B * T * T * C
    local out, lse = pg.ops.attention(qkv, H)
    local f = timed(function()
      local o, l = pg.ops.attention(qkv, H)
      o:free()
      l:free()
    end)
    local b = timed(function() pg.ops.attention_backward(dy, qkv, out, lse, H):free() end)
    rows[#rows + 1] = { batch = B, seq = T, heads = H, head_dim = hd, threads = threads, flops = flops / f,
      backward_flops = flops / b }
  end
  return rows
end

-- Memory-bound kernels by size (from cache-resident to far larger than the
-- caches) and op: the bytes a forward reads and writes over its median time,
-- and the same bytes over the backward's time. gelu is bound by its tanh more
-- than by memory, and small buffers stay in cache, so no one bandwidth fits
-- them all. Every output is freed at once (see the re-launch at the end:
-- glibc then reuses the pages, as the engine reuses its buffers).
local ELEMENTWISE = { "gelu", "layernorm", "rmsnorm", "residual", "swiglu", "rope" }

local function elementwise_rows(threads)
  pg.ops.set_num_threads(threads)
  local C = 256
  local rows = {}
  local function run(f)
    return timed(function()
      local a, b = f()
      a:free()
      if type(b) == "userdata" and b.free then b:free() end
    end)
  end
  for _, N in ipairs(quick and { 1024, 16384 } or { 256, 1024, 4096, 16384, 65536 }) do
    local n = N * C
    local x, y = pg.randn({ N, C }, { seed = 5 }), pg.randn({ N, C }, { seed = 6 })
    local x2 = pg.randn({ N, 2 * C }, { seed = 7 })
    local x3, y3 = x:reshape{ N // 64, 64, C }, y:reshape{ N // 64, 64, C } -- rope: [B, T, C]
    local w, b = pg.ones{ C }, pg.zeros{ C }
    local _, mean, rstd = pg.ops.layernorm(x, w, b)
    local _, rrstd = pg.ops.rmsnorm(x, w)
    local kinds = {
      gelu = { 2 * n, function() return pg.ops.gelu(x) end, function() return pg.ops.gelu_backward(y, x) end },
      layernorm = { 2 * n, function() return pg.ops.layernorm(x, w, b) end,
        function() return pg.ops.layernorm_backward(y, x, w, mean, rstd) end },
      rmsnorm = { 2 * n, function() return pg.ops.rmsnorm(x, w) end,
        function() return pg.ops.rmsnorm_backward(y, x, w, rrstd) end },
      residual = { 3 * n, function() return pg.ops.residual(x, y) end, function() return pg.ops.residual_backward(y) end },
      swiglu = { 3 * n, function() return pg.ops.swiglu(x2) end, function() return pg.ops.swiglu_backward(y, x2) end },
      rope = { 2 * n, function() return pg.ops.rope(x3, 4, 10000) end,
        function() return pg.ops.rope_backward(y3, 4, 10000) end },
    }
    for _, op in ipairs(ELEMENTWISE) do
      local k = kinds[op]
      local bytes = k[1] * 4
      rows[op] = rows[op] or {}
      table.insert(rows[op], { bytes = bytes, threads = threads, bandwidth = bytes / run(k[2]),
        backward_bandwidth = bytes / run(k[3]) })
    end
    for _, t in ipairs{ x, y, x2, mean, rstd, rrstd } do t:free() end
  end
  local n = quick and (1 << 20) or (1 << 22)
  local p, g, m, v = pg.randn({ n }, { seed = 7 }), pg.randn({ n }, { seed = 8 }), pg.zeros{ n }, pg.zeros{ n }
  local o = { lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1, step = 1 }
  -- AdamW (in place) reads p, g, m, v and writes p, m, v: 28 bytes a parameter
  local adamw = 28 * n / timed(function() pg.ops.adamw_(p, g, m, v, o) end)
  for _, t in ipairs{ p, g, m, v } do t:free() end
  return rows, adamw
end

-- One operation on one element: what dispatching an op costs (Lua call,
-- tensor allocation, OpenMP region), the floor under every kernel.
local function op_overhead()
  local x = pg.randn({ 1, 8 }, { seed = 9 })
  return timed(function()
    for _ = 1, 100 do pg.ops.gelu(x) end
  end) / 100
end

-- The fixed cost of a step of the engine (forward_backward, zero_grad,
-- AdamW, the step's barrier): a model so small that its arithmetic is nothing.
local function step_overhead()
  local ctx = pg.ParallelContext{ seed = 1 }
  local engine = pg.parallelize(pg.nn.GPT{ vocab = 16, seq_len = 4, dim = 8, heads = 1, layers = 1 }, ctx)
  local opt = pg.optim.AdamW(engine, { lr = 1e-3 })
  local x = pg.zeros({ 1, 4 }, { dtype = "int32" })
  return timed(function()
    ctx:barrier()
    engine:zero_grad()
    engine:forward_backward(x, x)
    opt:step()
  end, quick and 10 or 30)
end

---------------------------------------------------------------- several ranks

-- Collectives: more repeats than the kernels, since one descheduled rank
-- (2 cores, ranks and other work sharing them) delays the whole group.
local COMM_REPEATS = quick and 5 or 15

local function comm_worker()
  local ctx = pg.ParallelContext{ data = pg.world_size(), seed = 1 }
  local g = pg.world_size()
  local sizes = quick and { 1024, 262144 } or { 1024, 65536, 1048576 } -- floats
  local function line(k, v) if ctx:rank() == 0 then print(("result %s %.9g"):format(k, v)) end end
  local function worst(s) -- the slowest rank's time: a collective ends when its last member does
    local t = pg.tensor{ s }
    pg.dist.all_reduce(t, { op = "max" })
    return t:item()
  end
  local function measure(name, f)
    for _, n in ipairs(sizes) do
      f(n) -- warm-up
      local ts = {}
      for i = 1, COMM_REPEATS do
        ctx:barrier()
        local t0 = pg.wtime()
        f(n)
        ts[i] = worst(pg.wtime() - t0)
      end
      line(("%s.%d"):format(name, n * 4), median(ts))
    end
  end
  local bufs = {}
  for _, n in ipairs(sizes) do bufs[n] = pg.randn({ n }, { seed = 10 }) end
  measure("all_reduce", function(n) pg.dist.all_reduce(bufs[n]) end)
  measure("all_gather", function(n) pg.dist.all_gather(bufs[n]:narrow(1, 1, n // g)) end)
  measure("reduce_scatter", function(n) pg.dist.reduce_scatter(bufs[n]) end)
  -- the engine's data-parallel gradient reduction (shared memory on one node)
  for _, dim in ipairs(quick and { 8, 256 } or { 8, 256, 512 }) do
    -- the reduction alone after backward (overlapped, grad_sync_seconds would span part of backward)
    local engine = pg.parallelize(pg.nn.GPT{ vocab = 64, seq_len = 8, dim = dim, heads = 1, layers = 2 }, ctx,
      { overlap_grad_reduce = false })
    local bytes = engine:stats().flat_padded * 4
    local x = pg.zeros({ 1, 8 }, { dtype = "int32" })
    local ts = {}
    engine:forward_backward(x, x)
    engine:forward_backward(x, x)
    for i = 1, COMM_REPEATS do
      -- forward_backward ends with the reduction (engine:sync_grads() alone
      -- does nothing without new gradients); its counter times the reduction.
      -- The least over the ranks: the others also wait there for the last
      -- one to arrive, which is imbalance, not reduction.
      local s0 = engine:stats().grad_sync_seconds
      ctx:barrier()
      engine:forward_backward(x, x)
      local t = pg.tensor{ engine:stats().grad_sync_seconds - s0 }
      pg.dist.all_reduce(t, { op = "min" })
      ts[i] = t:item()
    end
    line(("shm_all_reduce.%d"):format(bytes), median(ts))
    engine = nil
    collectgarbage()
  end
  if g == 2 then -- ping-pong: half a round trip
    for _, n in ipairs(sizes) do
      local buf = bufs[n]
      local ts = {}
      for i = 1, COMM_REPEATS + 1 do
        ctx:barrier()
        local t0 = pg.wtime()
        if ctx:rank() == 0 then
          pg.dist.send(buf, { dst = 1 })
          pg.dist.recv(buf, { src = 1 })
        else
          pg.dist.recv(buf, { src = 0 })
          pg.dist.send(buf, { dst = 0 })
        end
        ts[i] = (pg.wtime() - t0) / 2
      end
      table.remove(ts, 1)
      line(("p2p.%d"):format(n * 4), median(ts))
    end
  end
  ctx:barrier()
end

if args.worker then
  if args.worker ~= "comm" then error("calibrate.lua: unknown worker " .. args.worker) end
  comm_worker()
  os.exit(0)
end

-- latency and bandwidth of time = latency + bytes / bandwidth: the least-
-- squares line through the measured sizes (floors keep both positive when
-- noise makes the line fall or cross zero)
local function fit(points)
  local n, sx, sy, sxx, sxy = #points, 0, 0, 0, 0
  for _, p in ipairs(points) do
    sx, sy, sxx, sxy = sx + p[1], sy + p[2], sxx + p[1] * p[1], sxy + p[1] * p[2]
  end
  local slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
  table.sort(points, function(a, b) return a[1] < b[1] end)
  local hi = points[#points]
  if not (slope > 0) then slope = hi[2] / hi[1] end
  local latency = math.max((sy - slope * sx) / n, 1e-7)
  return { latency = latency, bandwidth = 1 / slope }
end

local function run_comm(g)
  local self = arg[0] or "scripts/calibrate.lua"
  local cmd = ("scripts/mpirun.sh -np %d %s %s --worker=comm%s 2>&1"):format(g, arg[-1] or "./pglua", self,
    quick and " --quick" or "")
  local f = assert(io.popen(cmd))
  local res, lines = {}, {}
  for l in f:lines() do
    lines[#lines + 1] = l
    local name, bytes, v = l:match("^result ([%w_]+)%.(%d+) (%S+)$")
    if name then
      res[name] = res[name] or {}
      table.insert(res[name], { tonumber(bytes), tonumber(v) })
    end
  end
  local ok = f:close()
  if not ok or not res.all_reduce then
    io.stderr:write(table.concat(lines, "\n"), "\n")
    error(("calibrate.lua: the %d-rank measurements failed"):format(g), 0)
  end
  return res
end

local function main()
  local t_start = pg.wtime()
  local ncores = cores()
  local thread_counts = ncores > 1 and { ncores, 1 } or { 1 }
  print(("calibrate: %d cores, %s%s"):format(ncores, pg.machine().features, quick and " (quick)" or ""))

  local gemm, attention = {}, {}
  local elementwise, adamw = {}, {}
  for _, t in ipairs(thread_counts) do
    for _, r in ipairs(gemm_table(t)) do gemm[#gemm + 1] = r end
    for _, r in ipairs(attention_table(t)) do attention[#attention + 1] = r end
    local rows, a = elementwise_rows(t)
    adamw[tostring(t)] = a
    for _, op in ipairs(ELEMENTWISE) do
      elementwise[op] = elementwise[op] or {}
      local txt = {}
      for _, r in ipairs(rows[op]) do
        table.insert(elementwise[op], r)
        txt[#txt + 1] = ("%s %.1f/%.1f"):format(r.bytes >= 2 ^ 20 and ("%dM"):format(r.bytes // 2 ^ 20)
          or ("%dK"):format(r.bytes // 1024), r.bandwidth / 1e9, r.backward_bandwidth / 1e9)
      end
      print(("  %d thread(s): %-9s GB/s fwd/bwd by bytes: %s"):format(t, op, table.concat(txt, ", ")))
    end
    print(("  %d thread(s): adamw %.1f GB/s"):format(t, a / 1e9))
  end
  pg.ops.set_num_threads(ncores)
  for _, t in ipairs(thread_counts) do
    local best, worst = 0, math.huge
    for _, r in ipairs(gemm) do
      if r.threads == t then best, worst = math.max(best, r.flops), math.min(worst, r.flops) end
    end
    print(("  %d thread(s): linear %.1f-%.1f GFLOP/s over %d shapes"):format(t, worst / 1e9, best / 1e9, #gemm // #thread_counts))
    for _, r in ipairs(attention) do
      if r.threads == t then
        print(("  %d thread(s): attention b=%d s=%d heads=%d head_dim=%d: %.1f GFLOP/s forward, %.1f backward")
          :format(t, r.batch, r.seq, r.heads, r.head_dim, r.flops / 1e9, r.backward_flops / 1e9))
      end
    end
  end
  local op = op_overhead()
  local step = step_overhead()
  print(("  one tiny op: %.1f us; a tiny engine step: %.2f ms"):format(op * 1e6, step * 1e3))

  local colls = { all_reduce = {}, all_gather = {}, reduce_scatter = {}, shm_all_reduce = {} }
  local p2p
  for g in args.ranks:gmatch("%d+") do
    local n = tonumber(g)
    local res = run_comm(n)
    for name in pairs(colls) do
      local l = fit(res[name])
      colls[name][tostring(n)] = l
      print(("  %d ranks: %-14s latency %8.1f us, bandwidth %6.2f GB/s"):format(n, name, l.latency * 1e6,
        l.bandwidth / 1e9))
    end
    if res.p2p then
      p2p = fit(res.p2p)
      print(("  2 ranks: send/recv      latency %8.1f us, bandwidth %6.2f GB/s"):format(p2p.latency * 1e6,
        p2p.bandwidth / 1e9))
    end
  end
  if not p2p then error("calibrate.lua: --ranks must include 2 (send/recv is measured on 2 ranks)", 0) end

  local best_all = 0
  for _, r in ipairs(gemm) do
    if r.threads == ncores then best_all = math.max(best_all, r.flops) end
  end
  local mem = 0
  local f = io.open("/proc/meminfo")
  if f then
    for l in f:lines() do
      local kb = l:match("^MemTotal:%s+(%d+)")
      if kb then mem = tonumber(kb) * 1024 end
    end
    f:close()
  end
  local max_ranks = 1
  for g in args.ranks:gmatch("%d+") do max_ranks = math.max(max_ranks, tonumber(g)) end
  local shm = colls.shm_all_reduce[tostring(math.min(max_ranks, 2))] or colls.all_reduce["2"]
  local profile = {
    format = "pipegoose-hardware-profile",
    version = 1,
    name = ("cpu-%dcores"):format(ncores),
    notes = ("scripts/calibrate.lua%s, %s, features %s"):format(quick and " --quick" or "",
      os.date("!%Y-%m-%d %H:%M UTC"), pg.machine().features),
    gemm_flops = { fp32 = best_all },
    -- the datasheet-style figure: residual adds on the largest buffers
    memory_bandwidth = (function()
      local best = 0
      for _, r in ipairs(elementwise.residual) do
        if r.threads == ncores and r.bytes >= best then best = r.bytes end
      end
      for _, r in ipairs(elementwise.residual) do
        if r.threads == ncores and r.bytes == best then return r.bandwidth end
      end
    end)(),
    memory_bytes = mem > 0 and mem or 1e9,
    -- one node holds every rank of these measurements
    gpus_per_node = max_ranks,
    intra = { bandwidth = colls.all_reduce["2"] and colls.all_reduce["2"].bandwidth or shm.bandwidth,
              latency = colls.all_reduce["2"] and colls.all_reduce["2"].latency or shm.latency },
    -- no second node was measured: a node boundary is priced as this node's point-to-point link
    inter = { bandwidth = p2p.bandwidth, latency = p2p.latency },
    kernel_overhead = op,
    cpu = {
      cores = ncores, gemm = gemm, attention = attention,
      elementwise = elementwise, adamw = adamw,
      step_overhead = step, collectives = colls, p2p = p2p,
    },
  }
  -- the loader's own check: what is written is what the planner accepts
  pg.plan.hardware.from_profile(cjson.decode(cjson.encode(profile)), args.out)
  local dir = args.out:match("^(.*)/[^/]*$")
  if dir then os.execute("mkdir -p '" .. dir:gsub("'", "'\\''") .. "'") end
  local out = assert(io.open(args.out, "w"))
  out:write(cjson.encode(profile), "\n")
  out:close()
  print(("wrote %s (%.0f s)"):format(args.out, pg.wtime() - t_start))
end

-- pg.ops allocates every output and the engine does not (its buffers are
-- made once): without this, glibc hands large freed blocks back to the
-- kernel and every call would pay fresh page faults that no engine step
-- pays. Run the measurements with thresholds that keep freed memory for reuse.
if not os.getenv("PG_CALIBRATE_MALLOC") then
  local cmd = { "PG_CALIBRATE_MALLOC=1 MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=17179869184",
    arg[-1] or "./pglua", arg[0] }
  for i = 1, #arg do cmd[#cmd + 1] = "'" .. arg[i]:gsub("'", "'\\''") .. "'" end
  local ok, _, code = os.execute(table.concat(cmd, " "))
  os.exit(ok and 0 or (code or 1))
end

local ok, err = pcall(main)
if not ok then
  io.stderr:write("calibrate.lua: ", tostring(err), "\n")
  os.exit(1)
end
