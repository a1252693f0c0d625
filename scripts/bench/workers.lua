-- The workers of scripts/bench.lua: each measures one configuration in a
-- process of its own (pglua, or mpirun of pglua for several ranks), started
-- by the driver as `pglua scripts/bench.lua --worker=<name> --k=v ...`
-- (common.worker_cmd), and prints "result <key> <value>" lines on rank 0.
local pg = require "pipegoose"
local common = require "bench.common"

local median, MODELS = common.median, common.MODELS

--- Peak resident set of this process in bytes (VmHWM), or 0 where /proc is missing.
local function vm_hwm()
  local f = io.open("/proc/self/status")
  if not f then return 0 end
  for line in f:lines() do
    local kb = line:match("^VmHWM:%s+(%d+)")
    if kb then
      f:close()
      return tonumber(kb) * 1024
    end
  end
  f:close()
  return 0
end

--- Proportional set size in bytes (smaps_rollup): pages shared with other
-- processes count for their share only. 0 where it is missing.
local function pss()
  local f = io.open("/proc/self/smaps_rollup")
  if not f then return 0 end
  local total = 0
  for line in f:lines() do
    local kb = line:match("^Pss:%s+(%d+)")
    if kb then total = tonumber(kb) * 1024 end
  end
  f:close()
  return total
end

--- Deterministic token batches [B, T] (a fixed pattern: timing does not depend on the ids).
local function batch_tensors(B, T, vocab, offset)
  local xs, ys = {}, {}
  for i = 1, B * T do
    local k = i + (offset or 0) * B * T
    xs[i] = (k * 7919) % vocab
    ys[i] = (k * 104729 + 17) % vocab
  end
  return pg.tensor(xs, { dtype = "int32" }):reshape{ B, T }, pg.tensor(ys, { dtype = "int32" }):reshape{ B, T }
end

--- Seconds per group (tensor, data, pipeline, embedding) summed over every kind of call.
local function comm_seconds(ctx)
  local out = {}
  for mode, kinds in pairs(ctx:comm_stats()) do
    local s = 0
    for _, k in pairs(kinds) do s = s + k.seconds end
    out[mode] = s
  end
  return out
end

local function allmax(x)
  local t = pg.tensor{ x }
  pg.dist.all_reduce(t, { op = "max" })
  return t:item()
end

-- A training step: zero_grad, forward_backward (with the gradient reductions),
-- AdamW step. Prints "result <key> <value>" lines on rank 0.
local function worker_step(o)
  local cfg = MODELS[o.model] or error("bench.lua: unknown model " .. tostring(o.model))
  local tensor, data = tonumber(o.tensor or 1), tonumber(o.data or 1)
  local ctx = pg.ParallelContext{ tensor = tensor, data = data, expert = tonumber(o.expert or 1), pipeline = 1, seed = 1 }
  local spec = {}
  for k, v in pairs(cfg) do if k ~= "batch" then spec[k] = v end end
  local engine = pg.parallelize(pg.nn.from_config(spec), ctx, { micro_batches = 1, precision = o.precision,
    recompute = o.recompute ~= "none" and o.recompute or nil, sequence_parallel = o.sequence_parallel == "1" })
  local opt = pg.optim.AdamW(engine, { lr = 1e-4, betas = { 0.9, 0.95 }, weight_decay = 0.1,
                                       zero = tonumber(o.zero or 0) })
  local B, T = cfg.batch, cfg.seq_len
  local x, y = batch_tensors(B, T, cfg.vocab, ctx:local_rank("data"))
  local warmup, steps = tonumber(o.warmup or 1), tonumber(o.steps or 4)
  local times, computes, syncs, comms = {}, {}, {}, {}
  local loss
  for s = 1, warmup + steps do
    ctx:barrier()
    local st0, c0 = engine:stats(), comm_seconds(ctx)
    local t0 = pg.wtime()
    engine:zero_grad()
    loss = engine:forward_backward(x, y)
    opt:step()
    local dt = allmax(pg.wtime() - t0)
    local st1, c1 = engine:stats(), comm_seconds(ctx)
    if s > warmup then
      times[#times + 1] = dt
      computes[#computes + 1] = st1.compute_seconds - st0.compute_seconds
      syncs[#syncs + 1] = st1.grad_sync_seconds - st0.grad_sync_seconds
      for mode, v in pairs(c1) do
        comms[mode] = comms[mode] or {}
        table.insert(comms[mode], v - (c0[mode] or 0))
      end
    end
  end
  local hwm, pss_bytes = allmax(vm_hwm()), allmax(pss())
  local nparams = engine:num_parameters()
  local mem = engine:memory()
  local activation_bytes = allmax(mem.peak_activation_bytes)
  if ctx:rank() == 0 then
    local step = median(times)
    local r = {
      params = nparams, ranks = pg.world_size(), threads = pg.num_threads(), tokens_per_step = B * T * data,
      step_ms = step * 1e3, step_ms_min = math.min(table.unpack(times)) * 1e3,
      tokens_per_s = B * T * data / step, compute_ms = median(computes) * 1e3, grad_sync_ms = median(syncs) * 1e3,
      peak_rss_mb = hwm / 2 ^ 20, pss_mb = pss_bytes / 2 ^ 20, loss = loss,
      layers = cfg.layers, dim = cfg.dim, seq_len = T,
      peak_activation_bytes = activation_bytes, bytes_per_parameter = mem.bytes_per_parameter,
    }
    -- what this rank holds (engine:memory()): float32 masters, gradients and AdamW state, the activations of
    -- the micro-batches in flight, and (bf16) the working weights and rounded GEMM operands
    r.params_mb, r.grads_mb, r.optimizer_mb = mem.params_bytes / 2 ^ 20, mem.grads_bytes / 2 ^ 20,
      opt:memory().state_bytes / 2 ^ 20
    r.activation_mb, r.bf16_mb = mem.peak_activation_bytes / 2 ^ 20, mem.bf16_bytes / 2 ^ 20
    r.rank_mb = r.params_mb + r.grads_mb + r.optimizer_mb + r.activation_mb + r.bf16_mb
    for mode, v in pairs(comms) do
      if mode ~= "global" then r["comm_ms_" .. mode] = median(v) * 1e3 end
    end
    for k, v in pairs(r) do
      print(math.type(v) == "integer" and ("result %s %d"):format(k, v) or ("result %s %.8g"):format(k, v))
    end
  end
  ctx:barrier()
end

-- Pipeline bubbles: P = 2, for each schedule and M, a few steps of
-- forward_backward with M micro-batches of a fixed size. The idle time of a
-- stage is the step's wall time (barrier to barrier, the slowest rank's) minus
-- the stage's own forward/backward compute: blocked receives, send waits and
-- the wait at the end of the step. (P-1)/(M+P-1) is the idle fraction of
-- stages that take equal time per micro-batch. When they do not (the last
-- stage also runs the head; other work on the machine slows one rank or the
-- other), the stage with the most compute still idles (P-1)/(M+P-1) of the
-- step: the fill and drain of the pipeline, the schedule's bubble. The others
-- idle that much plus M times their per-micro-batch deficit: imbalance, not
-- schedule. So each step's bubble is the idle fraction of that step's busiest
-- stage; reported: its median over the steps, and the per-stage idle
-- fractions (median), and recv-wait alone (engine:stats()).
-- "interleaved" is 1F1B over V = 2 chunks per stage (M a multiple of P): its
-- fill and drain are V times shorter, (P-1)/(V*M) of the ideal step, an idle
-- fraction of (P-1)/(V*M + P-1).
local function worker_pp(o)
  local cfg = MODELS.pp
  local P = pg.world_size()
  local ctx = pg.ParallelContext{ pipeline = P, seed = 1 }
  local me = ctx:local_rank("pipeline")
  local spec = {}
  for k, v in pairs(cfg) do if k ~= "batch" then spec[k] = v end end
  local steps = tonumber(o.steps or 5)
  for _, schedule in ipairs{ "gpipe", "1f1b", "interleaved" } do
    local V = schedule == "interleaved" and 2 or 1
    for _, M in ipairs(V > 1 and { 2, 4, 8, 16 } or { 1, 2, 4, 8, 16 }) do
      local engine = pg.parallelize(pg.nn.GPT(spec), ctx, { micro_batches = M, virtual_stages = V,
        schedule = V > 1 and "1f1b" or schedule })
      local x, y = batch_tensors(cfg.batch * M, cfg.seq_len, cfg.vocab)
      local walls, idles, recvs, bubbles = {}, {}, {}, {}
      -- at least `steps` timed steps, more (up to 15) for short steps: about 3 s of them
      local total = 1 + steps
      local s = 0
      while s < total do
        s = s + 1
        ctx:barrier()
        local st0 = engine:stats()
        local t0 = pg.wtime()
        engine:forward_backward(x, y)
        local wall = allmax(pg.wtime() - t0)
        local st1 = engine:stats()
        local compute = st1.compute_seconds - st0.compute_seconds
        -- every stage's compute this step: the busiest one's idle fraction is the step's bubble
        local c = pg.dist.all_gather(pg.tensor{ compute }, { group = "pipeline" }):totable()
        local busiest = 1
        for i = 2, #c do if c[i] > c[busiest] then busiest = i end end
        if s == 1 then total = 1 + math.max(steps, math.min(15, math.floor(3 / wall))) end
        if s > 1 then
          walls[#walls + 1] = wall
          idles[#idles + 1] = (wall - compute) / wall
          recvs[#recvs + 1] = (st1.recv_wait_seconds - st0.recv_wait_seconds) / wall
          bubbles[#bubbles + 1] = (wall - c[busiest]) / wall
        end
      end
      local mem = engine:memory()
      -- every stage's figures to rank 0
      local mine = pg.tensor{ median(idles), median(recvs), mem.peak_activation_bytes }
      local all = pg.dist.all_gather(mine, { group = "pipeline" })
      if me == 0 then
        local v = all:totable()
        local key = ("pp_%s_m%d"):format(schedule, M)
        print(("result %s.step_ms %.8g"):format(key, median(walls) * 1e3))
        print(("result %s.theory %.8g"):format(key, (P - 1) / (V * M + P - 1)))
        print(("result %s.bubble %.8g"):format(key, median(bubbles)))
        for st = 0, P - 1 do
          local b = st * 3
          print(("result %s.idle_stage%d %.8g"):format(key, st, v[b + 1]))
          print(("result %s.recv_wait_stage%d %.8g"):format(key, st, v[b + 2]))
          print(("result %s.peak_activation_bytes_stage%d %d"):format(key, st, math.tointeger(v[b + 3])))
        end
      end
      engine = nil
      collectgarbage()
      collectgarbage()
    end
  end
  ctx:barrier()
end

-- Overlapped gradient reduction: data = 2 over MPI (private buffers), the
-- small model, zero = 1, with overlap_grad_reduce off and on in the same
-- run. Each configuration runs twice in the mirrored order off, on, on, off
-- and keeps its faster run (the scaling part's reasoning: interference only
-- slows a run down). Per configuration: the step (the slower rank's wall
-- time, median), grad_sync_seconds and exposed_comm_seconds per step
-- (median over the steps, the slower rank's), the buckets and how many
-- started in backward; the same for zero = 2 with overlap on (its
-- reduce-scatter runs after every micro-batch's backward). Then
-- engine:memory()'s bytes per parameter (params + grads + AdamW state over
-- this rank's parameters) for zero = 0, 1 and 2, after a step (zero = 2's
-- gradients: the shard plus the staging buffers).
local function worker_overlap(o)
  local cfg = MODELS.small
  local ctx = pg.ParallelContext{ data = pg.world_size(), seed = 1 }
  local spec = {}
  for k, v in pairs(cfg) do if k ~= "batch" then spec[k] = v end end
  local bucket_mb, steps = tonumber(o.bucket_mb or 1), tonumber(o.steps or 4)
  local x, y = batch_tensors(cfg.batch, cfg.seq_len, cfg.vocab, ctx:local_rank("data"))
  local function engine_of(overlap, zero)
    local e = pg.parallelize(pg.nn.from_config(spec), ctx, { shared_memory = false, overlap_grad_reduce = overlap,
                                                              bucket_mb = bucket_mb })
    return e, pg.optim.AdamW(e, { lr = 1e-4, zero = zero })
  end
  local function measure(overlap, zero)
    local engine, opt = engine_of(overlap, zero or 1)
    local walls, syncs, exposed = {}, {}, {}
    for s = 1, 1 + steps do
      ctx:barrier()
      local st0, t0 = engine:stats(), pg.wtime()
      engine:zero_grad()
      engine:forward_backward(x, y)
      opt:step()
      local wall = allmax(pg.wtime() - t0)
      local st1 = engine:stats()
      if s > 1 then
        walls[#walls + 1] = wall
        syncs[#syncs + 1] = allmax(st1.grad_sync_seconds - st0.grad_sync_seconds)
        exposed[#exposed + 1] = allmax(st1.exposed_comm_seconds - st0.exposed_comm_seconds)
      end
    end
    local st = engine:stats()
    return { step_ms = median(walls) * 1e3, grad_sync_ms = median(syncs) * 1e3, exposed_ms = median(exposed) * 1e3,
             buckets = st.grad_buckets, in_backward = st.grad_buckets_in_backward }
  end
  local best = {}
  for _, overlap in ipairs{ false, true, true, false } do
    local r = measure(overlap)
    local k = overlap and "on" or "off"
    if not best[k] or r.step_ms < best[k].step_ms then best[k] = r end
    collectgarbage()
  end
  best.zero2 = measure(true, 2)
  collectgarbage()
  local bpp = {}
  for zero = 0, 2 do
    local e, opt = engine_of(true, zero)
    e:zero_grad()
    e:forward_backward(x, y)
    opt:step()
    local m = e:memory()
    bpp[zero] = { bpp = m.bytes_per_parameter, grads = m.grads_bytes, params = m.local_parameters }
    collectgarbage()
  end
  if ctx:rank() == 0 then
    for k, r in pairs(best) do
      for name, v in pairs(r) do print(("result overlap_%s.%s %.8g"):format(k, name, v)) end
    end
    for zero = 0, 2 do
      print(("result zero%d.bytes_per_parameter %.8g"):format(zero, bpp[zero].bpp))
      print(("result zero%d.grads_bytes %d"):format(zero, bpp[zero].grads))
    end
    print(("result local_parameters %d"):format(bpp[0].params))
  end
  ctx:barrier()
end

--- Writes a GPT-2 124M of our initialisation in llm.c's model format (the
--- input of llm.c's train_gpt2: 1024 positions, padded vocabulary 50304).
local function worker_llmc_model(o)
  local cfg = MODELS.gpt2
  local engine = pg.parallelize(pg.nn.GPT{ vocab = cfg.vocab, padded_vocab = cfg.padded_vocab, seq_len = 1024,
    dim = cfg.dim, heads = cfg.heads, layers = cfg.layers }, pg.ParallelContext{ seed = 1 })
  engine:save_llmc(o.out)
  print("result written 1")
end

-- All-to-all bandwidth: pg.dist.all_to_all (agreement, the count exchange,
-- MPI_Alltoallv) next to the bare MPI_Alltoall on the same buffers, in the
-- same run, over the world (the expert group of part moe). Each rank sends
-- `bytes` in all, an equal block to each rank. algbw = bytes / time.
local function worker_a2a(o)
  local ctx = pg.ParallelContext{ data = pg.world_size(), seed = 1 }
  local n, me = ctx:world_size(), ctx:rank()
  local function time_it(fn, bytes)
    local inner = math.max(1, math.floor(32 * 1024 * 1024 / bytes))
    for _ = 1, 2 do fn() end
    local samples = {}
    for r = 1, 7 do
      ctx:barrier()
      local t0 = pg.wtime()
      for _ = 1, inner do fn() end
      samples[r] = allmax((pg.wtime() - t0) / inner)
    end
    return median(samples)
  end
  for _, kib in ipairs{ 64, 1024, 16384 } do
    local bytes = kib * 1024
    local buf = pg.randn({ n, bytes // 4 // n }, { seed = me })
    local t_raw = time_it(function() pg.dist.mpi_alltoall(buf, { ctx = ctx }):free() end, bytes)
    local t_ours = time_it(function() pg.dist.all_to_all(buf, { ctx = ctx }):free() end, bytes)
    if me == 0 then
      print(("result a2a_%d_raw_gbs %.6g"):format(kib, bytes / t_raw / 1e9))
      print(("result a2a_%d_gbs %.6g"):format(kib, bytes / t_ours / 1e9))
      print(("result a2a_%d_ratio %.6g"):format(kib, t_ours / t_raw))
    end
  end
  ctx:barrier()
end

-- Context parallelism: a tiny GPT (width 64, 4 heads, 2 layers: attention is most of a step at long
-- sequences) on one sequence of --seq_len tokens at --context = C (the world's ranks), a few training steps.
-- Prints the step time (median, slowest rank), the attention's share of it is not separated: at width 64
-- and T = 4096 the T^2 attention terms are ~98% of the FLOPs. Activation bytes: engine:memory()'s peak
-- (largest rank); bytes per rank: params + gradients + AdamW state + that peak; and the peak RSS.
local function worker_context(o)
  local C, T = tonumber(o.context or 1), tonumber(o.seq_len or 1024)
  local ctx = pg.ParallelContext{ context = C, seed = 1 }
  local engine = pg.parallelize(pg.nn.GPT{ vocab = 256, seq_len = T, dim = 64, heads = 4, layers = 2 }, ctx,
    { micro_batches = 1 })
  local opt = pg.optim.AdamW(engine, { lr = 1e-4 })
  local x, y = batch_tensors(1, T, 256, 0)
  local warmup, steps = tonumber(o.warmup or 1), tonumber(o.steps or 3)
  local times = {}
  for s = 1, warmup + steps do
    ctx:barrier()
    local t0 = pg.wtime()
    engine:zero_grad()
    engine:forward_backward(x, y)
    opt:step()
    local dt = allmax(pg.wtime() - t0)
    if s > warmup then times[#times + 1] = dt end
  end
  local mem = engine:memory()
  local act = allmax(mem.peak_activation_bytes)
  local rank_bytes = allmax(mem.params_bytes + mem.grads_bytes + (mem.optimizer_bytes or 0) + mem.peak_activation_bytes)
  local hwm = allmax(vm_hwm())
  if ctx:rank() == 0 then
    local r = { context = C, seq_len = T, ranks = pg.world_size(), threads = pg.num_threads(),
                step_ms = median(times) * 1e3, peak_activation_bytes = act, rank_bytes = rank_bytes,
                peak_rss_bytes = hwm }
    for k, v in pairs(r) do
      print(math.type(v) == "integer" and ("result %s %d"):format(k, v) or ("result %s %.8g"):format(k, v))
    end
  end
  ctx:barrier()
end

-- by the name --worker=<name> gives
return {
  step = worker_step,
  context = worker_context,
  pp = worker_pp,
  overlap = worker_overlap,
  a2a = worker_a2a,
  ["llmc-model"] = worker_llmc_model,
  slowlink = require("bench.slowlink").worker, -- scripts/bench/slowlink.lua: the part and its worker together
  zero3 = require("bench.zero3").worker,
  cp_longest = require("bench.cp_longest").worker,
}
