-- Training-step benchmarks: `make bench` (./pglua scripts/bench.lua).
--
-- Every figure is set against a peer measured in the same run: MFU against
-- the OpenBLAS sgemm peak measured first, tokens/s against PyTorch CPU on the
-- same step (when /usr/bin/python3 has torch) and llm.c's CPU trainer (when
-- LLMC_DIR is set), T = 2 and D = 2 against one
-- rank with one thread, measured pipeline bubbles against (P-1)/(M+P-1).
--
-- Parts (BENCH_ONLY=peak,gpt2,small,llama,torch,llmc,tp,dp,pp,comm,gpu picks some; default all):
--   peak   sgemm GFLOP/s through pg.ops.linear, all cores and one thread
--   gpt2   GPT-2 124M (padded vocab 50304, 12 x 768, seq 64), batch 4 x 64, fp32, all cores
--   small  the default model of examples/train_gpt.lua, batch 16 x 128, all cores
--   llama  a LLaMA of GPT-2 124M's shape (GQA 12/4 heads, RoPE, SwiGLU 2048, vocab 32000), batch 4 x 64
--   torch  the same two steps in PyTorch (scripts/bench_torch.py), skipped without torch
--   llmc   GPT-2 124M's step in llm.c's CPU trainer (train_gpt2.c, same B = 4, T = 64),
--          when LLMC_DIR names a checkout of github.com/karpathy/llm.c (built here
--          with its own `make train_gpt2` if needed; nothing of it is in this repository)
--   tp     GPT-2 124M: tensor = 2 (2 ranks x 1 thread) against 1 rank x 1 thread
--   dp     GPT-2 124M, 4 x 64 per rank: data = 2 (zero 0 and 1) against 1 rank x 1 thread
--   pp     pipeline = 2, M = 1..16 micro-batches: bubble and activation peak, GPipe and 1F1B
--   comm   scripts/bench_comm.lua (collectives against bare MPI)
--   gpu    scripts/bench_gpu.lua on this rank's GPU (GPT-2 124M tokens/s and MFU against
--          the cuBLAS FP32 sgemm rate measured in the same run), skipped without a GPU
-- BENCH_STEPS=n overrides the timed steps of each configuration.
--
-- Output: a readable table per part, and machine-readable lines
-- "<config> <metric> <value>" (e.g. "gpt2_124m mfu 0.55"), all from this one
-- process; each configuration runs in its own pglua (or mpirun) process so
-- that peak memory (VmHWM) is its own. Timings are medians of several steps
-- after a warm-up step. Peers are measured next to what they are compared
-- with (the one-rank and multi-rank runs twice each in mirrored order, ours
-- before and after PyTorch) so that a change in the machine's load lands on
-- both sides; still,
-- on a machine shared with other jobs single figures move by 10% and more
-- from run to run (multi-rank ones most). `chrt -f 10 make bench` (root)
-- keeps other work off the cores while it runs.
local pg = require "pipegoose"

---------------------------------------------------------------- helpers

local function median(t)
  local s = {}
  for i, v in ipairs(t) do s[i] = v end
  table.sort(s)
  local n = #s
  if n == 0 then return 0 / 0 end
  if n % 2 == 1 then return s[(n + 1) // 2] end
  return (s[n // 2] + s[n // 2 + 1]) / 2
end

local function parse_args(list)
  local o = {}
  for _, a in ipairs(list) do
    local k, v = a:match("^%-%-([%w_-]+)=(.*)$")
    if not k then error("bench.lua: unknown argument " .. a) end
    o[k] = v
  end
  return o
end

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

local MODELS = {
  -- GPT-2 124M: llm.c's padded vocabulary; only 64 of its positions are used.
  gpt2 = { vocab = 50257, padded_vocab = 50304, seq_len = 64, dim = 768, heads = 12, layers = 12, batch = 4 },
  -- examples/train_gpt.lua's defaults.
  small = { vocab = 256, seq_len = 128, dim = 256, heads = 4, layers = 4, batch = 16 },
  -- a LLaMA of GPT-2 124M's width and depth: grouped-query attention (12 heads over 4 key/value heads),
  -- rotary embeddings, SwiGLU 2048, RMSNorm, untied head, LLaMA-2's vocabulary of 32000
  llama = { arch = "llama", vocab = 32000, seq_len = 64, dim = 768, heads = 12, kv_heads = 4, hidden = 2048,
            layers = 12, batch = 4 },
  -- pipeline part: small enough that 16 micro-batches take seconds
  pp = { vocab = 256, seq_len = 128, dim = 256, heads = 4, layers = 8, batch = 2 },
}

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

---------------------------------------------------------------- workers (one configuration per process)

-- A training step: zero_grad, forward_backward (with the gradient reductions),
-- AdamW step. Prints "result <key> <value>" lines on rank 0.
local function worker_step(o)
  local cfg = MODELS[o.model] or error("bench.lua: unknown model " .. tostring(o.model))
  local tensor, data = tonumber(o.tensor or 1), tonumber(o.data or 1)
  local ctx = pg.ParallelContext{ tensor = tensor, data = data, pipeline = 1, seed = 1 }
  local spec = {}
  for k, v in pairs(cfg) do if k ~= "batch" then spec[k] = v end end
  local engine = pg.parallelize(pg.nn.from_config(spec), ctx, { micro_batches = 1 })
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
  if ctx:rank() == 0 then
    local step = median(times)
    local r = {
      params = nparams, ranks = pg.world_size(), threads = pg.num_threads(), tokens_per_step = B * T * data,
      step_ms = step * 1e3, step_ms_min = math.min(table.unpack(times)) * 1e3,
      tokens_per_s = B * T * data / step, compute_ms = median(computes) * 1e3, grad_sync_ms = median(syncs) * 1e3,
      peak_rss_mb = hwm / 2 ^ 20, pss_mb = pss_bytes / 2 ^ 20, loss = loss,
      layers = cfg.layers, dim = cfg.dim, seq_len = T,
    }
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
local function worker_pp(o)
  local cfg = MODELS.pp
  local P = pg.world_size()
  local ctx = pg.ParallelContext{ pipeline = P, seed = 1 }
  local me = ctx:local_rank("pipeline")
  local spec = {}
  for k, v in pairs(cfg) do if k ~= "batch" then spec[k] = v end end
  local steps = tonumber(o.steps or 5)
  for _, schedule in ipairs{ "gpipe", "1f1b" } do
    for _, M in ipairs{ 1, 2, 4, 8, 16 } do
      local engine = pg.parallelize(pg.nn.GPT(spec), ctx, { micro_batches = M, schedule = schedule })
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
        print(("result %s.theory %.8g"):format(key, (P - 1) / (M + P - 1)))
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

---------------------------------------------------------------- the driver

local function shell_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

--- Runs a command; returns its "result k v" pairs, its output lines, and its exit status.
local function run(cmd)
  local f = assert(io.popen(cmd .. " 2>&1"))
  local res, lines = {}, {}
  for line in f:lines() do
    lines[#lines + 1] = line
    local k, v = line:match("^result (%S+) (%S+)$")
    if not k then k, v = line:match("^(torch_[%w_]+) (%S+)$") end -- scripts/bench_torch.py
    if k then res[k] = tonumber(v) or v end
  end
  local ok, _, code = f:close()
  return res, lines, ok and 0 or (code or 1)
end

local function cores()
  local f = io.popen("env -u OMP_NUM_THREADS nproc 2>/dev/null")
  local n = f and tonumber(f:read("l") or "") or nil
  if f then f:close() end
  return n or pg.num_threads()
end

local PGLUA = arg[-1] or "./pglua"
local SCRIPT = arg[0] or "scripts/bench.lua"

local function worker_cmd(ranks, threads, args)
  local base = ("OMP_NUM_THREADS=%d"):format(threads)
  local cmd = { PGLUA, SCRIPT }
  for _, a in ipairs(args) do cmd[#cmd + 1] = shell_quote(a) end
  if ranks > 1 then
    return ("%s scripts/mpirun.sh -np %d -x OMP_NUM_THREADS %s"):format(base, ranks, table.concat(cmd, " "))
  end
  return base .. " " .. table.concat(cmd, " ")
end

local failures = {}
local function check_run(name, res, lines, rc, key)
  if rc ~= 0 or (key and res[key] == nil) then
    failures[#failures + 1] = name
    print(("%s failed (exit %s); its output:"):format(name, tostring(rc)))
    for i = math.max(1, #lines - 30), #lines do print("  | " .. lines[i]) end
    return false
  end
  return true
end

local function emit(config, metric, value, fmt)
  if value == nil then return end
  if type(value) == "number" then print(("%s %s " .. (fmt or "%.6g")):format(config, metric, value))
  else print(("%s %s %s"):format(config, metric, tostring(value))) end
end

local function flops_per_token(r)
  -- 6 N for the parameter matmuls (forward 2, backward 4) plus 6 L C T for attention's scores and mixing.
  return 6 * r.params + 6 * r.layers * r.dim * r.seq_len
end

local function driver()
  local only = {}
  local sel = os.getenv("BENCH_ONLY")
  for p in (sel or ""):gmatch("[^,%s]+") do only[p] = true end
  local function want(p) return sel == nil or sel == "" or only[p] end
  local steps_override = os.getenv("BENCH_STEPS")
  local function steps(n) return tostring(steps_override or n) end
  local ncores = cores()
  local t_start = pg.wtime()
  local machine = pg.machine()
  print(("pipegoose bench: %d cores, OpenBLAS sgemm + OpenMP, %s"):format(ncores, os.date("!%Y-%m-%d %H:%M UTC")))
  -- which kernels ran: OpenBLAS's core (pglua forces one from the CPU's features when OpenBLAS
  -- fell back to its generic kernels, src/pg_machine.h; the PyTorch peer gets the same setting)
  print(("  CPU features: %s; OpenBLAS core: %s%s"):format(machine.features, machine.blas_core,
    machine.blas_core_chosen and " (chosen by pglua from the features: OpenBLAS's own detection fell back to generic)" or ""))
  emit("machine", "blas_core", machine.blas_core)

  ------------------------------------------------ sgemm peak
  local peak = {}
  if want("peak") or want("gpt2") or want("small") or want("llama") or want("tp") or want("dp") then
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
    peak[ncores] = best_gflops(ncores)
    if ncores ~= 1 then peak[1] = best_gflops(1) end
    pg.ops.set_num_threads(pg.num_threads())
    print()
    print("== sgemm peak (best of large sgemms through pg.ops.linear)")
    print(("  %d threads: %7.1f GFLOP/s"):format(ncores, peak[ncores]))
    print(("  1 thread : %7.1f GFLOP/s"):format(peak[1]))
    emit("sgemm", "peak_gflops", peak[ncores])
    emit("sgemm", "threads", ncores)
    emit("sgemm", "peak_gflops_1thread", peak[1])
  end

  local have_torch = os.execute("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == true
  local function torch_run(args)
    if not have_torch or not want("torch") then return nil end
    -- PyTorch runs with the environment it was given: pglua's own OpenMP
    -- wait-policy default (see src/pglua.c) is not passed on to it. The
    -- OpenBLAS core pglua chose is (PyTorch's products go through the same
    -- OpenBLAS here): both sides then run the same sgemm kernels.
    local env = os.getenv("PG_DEFAULT_WAIT_POLICY") and "env -u OMP_WAIT_POLICY -u PG_DEFAULT_WAIT_POLICY " or ""
    local res, lines, rc = run(env .. "/usr/bin/python3 scripts/bench_torch.py " .. args)
    if not check_run("PyTorch " .. args, res, lines, rc, "torch_tokens_per_s") then return nil end
    return res.torch_tokens_per_s
  end

  -- llm.c's CPU trainer as a peer: its train_gpt2 reads gpt2_124M.bin and the
  -- tinyshakespeare shards from its working directory, trains at B = 4,
  -- T = 64 and prints "step n: train loss x (took t ms)". We give it our
  -- GPT-2 124M (exported in its format) and the fortunes shards, read steps
  -- 1..5 (step 0 warms up) and stop it.
  local LLMC_DIR = os.getenv("LLMC_DIR")
  local function llmc_run()
    if not LLMC_DIR or LLMC_DIR == "" or not want("llmc") then return nil end
    local bin = LLMC_DIR .. "/train_gpt2"
    if not io.open(bin) then
      local _, lines, rc = run("make -C " .. shell_quote(LLMC_DIR) .. " train_gpt2")
      if not check_run("llm.c build (make -C $LLMC_DIR train_gpt2)", {}, lines, rc) then return nil end
    end
    local dir = "build/llmc-bench"
    os.execute("mkdir -p " .. dir .. "/dev/data/tinyshakespeare")
    if not io.open(dir .. "/gpt2_124M.bin") then
      local res, lines, rc = run(worker_cmd(1, ncores, { "--worker=llmc-model", "--out=" .. dir .. "/gpt2_124M.bin" }))
      if not check_run("llm.c model file", res, lines, rc, "written") then return nil end
    end
    if not io.open("data/fortunes_train.bin") or not io.open("data/fortunes_val.bin") then
      local _, lines, rc = run(PGLUA .. " scripts/prepare_corpus.lua")
      if not check_run("scripts/prepare_corpus.lua", {}, lines, rc) then return nil end
    end
    local here = os.getenv("PWD") or "."
    for _, split in ipairs{ "train", "val" } do
      os.execute(("ln -sf %s %s"):format(shell_quote(here .. "/data/fortunes_" .. split .. ".bin"),
        shell_quote(dir .. "/dev/data/tinyshakespeare/tiny_shakespeare_" .. split .. ".bin")))
    end
    -- as for PyTorch, llm.c gets the OpenMP environment the user gave us
    local env = os.getenv("PG_DEFAULT_WAIT_POLICY") and "env -u OMP_WAIT_POLICY -u PG_DEFAULT_WAIT_POLICY " or ""
    local abs = LLMC_DIR:sub(1, 1) == "/" and LLMC_DIR or (here .. "/" .. LLMC_DIR)
    -- sed ends the pipe after step 5 (-u: it reads no further ahead than
    -- that line); train_gpt2 then dies of SIGPIPE at its next line
    local _, lines, rc = run(("cd %s && %sOMP_NUM_THREADS=%d stdbuf -oL %s | sed -u '/^step 5:/q'")
      :format(shell_quote(dir), env, ncores, shell_quote(abs .. "/train_gpt2")))
    local ms = {}
    for _, l in ipairs(lines) do
      local n, t = l:match("^step (%d+): train loss %S+ %(took (%S+) ms%)")
      if n and tonumber(n) >= 1 then ms[#ms + 1] = tonumber(t) end
    end
    if #ms == 0 then
      check_run("llm.c train_gpt2", {}, lines, rc ~= 0 and rc or 1)
      return nil
    end
    return 4 * 64 / (median(ms) / 1000)
  end

  ------------------------------------------------ single-process steps, all cores
  local rows = {}
  -- With PyTorch the order is ours, PyTorch, ours again, and ours is the mean
  -- of the two: a change in the machine's load during the part then weighs
  -- on both sides of the ratio.
  local function step_part(name, model, torch_args, with_llmc)
    local function ours()
      local res, lines, rc = run(worker_cmd(1, ncores, { "--worker=step", "--model=" .. model, "--steps=" .. steps(4) }))
      return check_run(name, res, lines, rc, "tokens_per_s") and res or nil
    end
    local res = ours()
    if not res then return end
    local torch = torch_run(("--threads %d --warmup 1 --steps 3 %s"):format(ncores, torch_args))
    local llmc = with_llmc and llmc_run() or nil
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
    local fpt = flops_per_token(res)
    local mfu = res.tokens_per_s * fpt / (peak[ncores] * 1e9)
    emit(name, "tokens_per_s", res.tokens_per_s, "%.1f")
    emit(name, "step_ms", res.step_ms, "%.1f")
    emit(name, "model_gflops_per_s", res.tokens_per_s * fpt / 1e9, "%.2f")
    emit(name, "mfu", mfu, "%.3f")
    emit(name, "peak_rss_mb", res.peak_rss_mb, "%.0f")
    emit(name, "params", res.params, "%d")
    if torch then
      emit(name, "torch_tokens_per_s", torch, "%.1f")
      emit(name, "vs_torch", res.tokens_per_s / torch, "%.2f")
    else
      emit(name, "torch_tokens_per_s", "n/a")
    end
    if llmc then
      emit(name, "llmc_tokens_per_s", llmc, "%.1f")
      emit(name, "vs_llmc", res.tokens_per_s / llmc, "%.2f")
    end
    rows[#rows + 1] = { name, res, mfu, torch, llmc }
  end
  if want("gpt2") then step_part("gpt2_124m", "gpt2", "", true) end
  if want("small") then step_part("small", "small", "--small") end
  if want("llama") then step_part("llama_124m", "llama", "--llama") end
  if #rows > 0 then
    print()
    print(("== training step, 1 rank x %d threads (fp32; MFU = (6N + 6LCT) x tokens/s / sgemm peak)"):format(ncores))
    print(("  %-10s %11s %9s %9s %6s %8s %11s %8s %10s %8s"):format("model", "params", "tokens/s", "step ms", "MFU",
      "peak MB", "torch tok/s", "vs torch", "llm.c t/s", "vs llm.c"))
    local function ratio(x, peer) return peer and ("%.2fx"):format(x / peer) or "-" end
    for _, r in ipairs(rows) do
      local name, res, mfu, torch, llmc = r[1], r[2], r[3], r[4], r[5]
      print(("  %-10s %11d %9.1f %9.1f %6.3f %8.0f %11s %8s %10s %8s"):format(name, res.params, res.tokens_per_s,
        res.step_ms, mfu, res.peak_rss_mb, torch and ("%.1f"):format(torch) or "n/a", ratio(res.tokens_per_s, torch),
        llmc and ("%.1f"):format(llmc) or "n/a", ratio(res.tokens_per_s, llmc)))
    end
    if not have_torch then print("  (PyTorch: /usr/bin/python3 has no torch here; the torch column is skipped)") end
    if not LLMC_DIR then print("  (llm.c: set LLMC_DIR to a checkout of karpathy/llm.c for its column)") end
    print("  targets (issue 3): gpt2_124m MFU >= 0.5, >= 1.5x PyTorch")
  end

  ------------------------------------------------ tensor and data parallel, 1 thread per rank
  -- Every configuration (the 1 rank x 1 thread baseline included) runs
  -- twice, in the order base, T=2, D=2 zero 0, zero 1 and then the reverse,
  -- and each keeps its faster run: interference from other work on the
  -- machine only ever slows a run down, and the mirrored order spreads a
  -- drift of the machine's speed evenly over the configurations.
  if want("tp") or want("dp") then
    local function one_rank()
      local res, lines, rc = run(worker_cmd(1, 1, { "--worker=step", "--model=gpt2", "--steps=" .. steps(3) }))
      return check_run("gpt2_124m 1 rank x 1 thread", res, lines, rc, "tokens_per_s") and res or nil
    end
    local function multi(label, args)
      local a = { "--worker=step", "--model=gpt2", "--steps=" .. steps(3) }
      for _, x in ipairs(args) do a[#a + 1] = x end
      local res, lines, rc = run(worker_cmd(2, 1, a))
      return check_run(label, res, lines, rc, "tokens_per_s") and res or nil
    end
    local configs = { { key = "base", fn = one_rank } }
    if want("tp") then
      configs[#configs + 1] = { key = "tp", fn = function() return multi("gpt2_124m tensor=2", { "--tensor=2" }) end }
    end
    if want("dp") then
      for _, zero in ipairs{ 0, 1 } do
        configs[#configs + 1] = { key = "dp" .. zero, fn = function()
          return multi("gpt2_124m data=2 zero=" .. zero, { "--data=2", "--zero=" .. zero })
        end }
      end
    end
    local runs = {}
    for round = 1, 2 do
      for i = 1, #configs do
        local c = configs[round == 1 and i or #configs + 1 - i]
        runs[c.key] = runs[c.key] or {}
        local r = c.fn()
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

  ------------------------------------------------ pipeline bubbles
  if want("pp") then
    local res, lines, rc = run(worker_cmd(2, 1, { "--worker=pp", "--steps=" .. steps(7) }))
    if check_run("pipeline bubbles", res, lines, rc, "pp_1f1b_m16.theory") then
      local cfg = MODELS.pp
      print()
      print(("== pipeline, P = 2 (1 thread per rank), GPT %d x %d, micro-batches of %d x %d tokens"):format(cfg.layers,
        cfg.dim, cfg.batch, cfg.seq_len))
      print("   idle = (step wall - the stage's own compute) / step wall, per stage (median over the steps);")
      print("   bubble = the idle fraction of each step's busiest stage (median): the schedule's fill and drain;")
      print("   the other stage idles that plus M x its per-micro-batch deficit (imbalance); recv = blocked receives")
      print(("  %-6s %3s %8s %7s %7s %7s %7s %6s %6s %11s %8s"):format("sched", "M", "step ms", "theory", "bubble",
        "idle0", "idle1", "recv0", "recv1", "act peak KB", "vs GPipe"))
      local worst, act_ok = 0, true
      for _, schedule in ipairs{ "gpipe", "1f1b" } do
        for _, M in ipairs{ 1, 2, 4, 8, 16 } do
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
          print(("  %-6s %3d %8.1f %7.3f %7.3f %7.3f %7.3f %6.3f %6.3f %11.0f %8.3f"):format(schedule, M,
            res[k .. ".step_ms"], th, bub, i0, i1, res[k .. ".recv_wait_stage0"], res[k .. ".recv_wait_stage1"],
            act / 1024, act / gact))
        end
      end
      emit("pp", "bubble_worst_abs_error", worst, "%.4f")
      emit("pp", "activation_1f1b_within_p_over_m", act_ok and "yes" or "no")
      print(("  worst |bubble - theory| = %.1f points (target <= 5)"):format(worst * 100))
      print(("  1F1B activation peak <= P/M of GPipe's (P/M capped at 1): %s"):format(act_ok and "yes" or "NO"))
    end
  end

  ------------------------------------------------ collectives
  if want("comm") then
    local _, lines, rc = run(("OMP_NUM_THREADS=1 scripts/mpirun.sh -np 2 -x OMP_NUM_THREADS %s scripts/bench_comm.lua"):format(
      PGLUA))
    print()
    print("== collectives (scripts/bench_comm.lua, 2 ranks)")
    for _, l in ipairs(lines) do print("  " .. l) end
    if rc ~= 0 then failures[#failures + 1] = "comm" end
  end

  ------------------------------------------------ GPU
  if want("gpu") then
    print()
    local ok, why = pg.cuda.available()
    if not ok then
      print("== GPU: skipped (" .. tostring(why) .. ")")
    else
      local _, lines, rc = run(("%s scripts/bench_gpu.lua"):format(PGLUA))
      print("== GPU (scripts/bench_gpu.lua)")
      for _, l in ipairs(lines) do print("  " .. l) end
      if rc ~= 0 then failures[#failures + 1] = "gpu" end
    end
  end

  print()
  print(("bench finished in %.0f s%s"):format(pg.wtime() - t_start,
    #failures > 0 and (", FAILED: " .. table.concat(failures, ", ")) or ""))
  if #failures > 0 then os.exit(1) end
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

local o = parse_args(arg)
if o.worker == "step" then worker_step(o)
elseif o.worker == "llmc-model" then worker_llmc_model(o)
elseif o.worker == "pp" then worker_pp(o)
elseif o.worker then error("bench.lua: unknown worker " .. o.worker)
else driver() end
