-- Part slowlink: two hosts on this machine (scripts/netns_hosts.sh: network
-- namespaces over a bridge, Open MPI over TCP between them) whose link is
-- limited to 10 Mbit/s each way (tc tbf), one rank on each: data = 2 across
-- the hosts (a gradient all-reduce every step) against 2 DiLoCo islands, one
-- a host, syncing every H = 50 steps (pg.DiLoCo, outer lr 0.7, Nesterov
-- momentum 0.9). Tokens/s (both ranks' tokens over the wall time of the
-- timed steps, the outer steps included) and bytes each rank sent or received
-- per step (comm_stats of the data and islands groups). Skipped, with the
-- reason, where network namespaces cannot be made (not root).
-- The worker (--worker=slowlink --mode=ddp|diloco --steps=N) runs on the hosts.
local pg = require "pipegoose"
local common = require "bench.common"

local emit = common.emit
local RATE, EVERY = "10mbit", 50
-- ~0.15 M parameters (0.6 MB of float32): at 10 Mbit/s a data-parallel step waits about a second
-- for its gradients, a few times its compute on one thread
local CFG = { vocab = 256, seq_len = 64, dim = 64, heads = 4, layers = 2 }
local BATCH = 4 -- sequences per rank
local ENV = "PG_NETNS_PREFIX=pgbench PG_NETNS_NET=10.231.9 "

local function bytes_per_step(ctx, mode, steps)
  local b = 0
  for _, k in pairs(ctx:comm_stats()[mode] or {}) do b = b + k.bytes end
  return b / steps
end

local function worker(o)
  local diloco = o.mode == "diloco"
  local steps = tonumber(o.steps) or error("slowlink worker: --steps=N")
  local ctx = diloco and pg.ParallelContext{ islands = 2, seed = 1 } or pg.ParallelContext{ data = 2, seed = 1 }
  local engine = pg.parallelize(pg.nn.GPT(CFG), ctx)
  local opt = pg.optim.AdamW(engine, { lr = 1e-3 })
  local dl
  if diloco then
    dl = pg.DiLoCo{ outer_every = EVERY, outer_lr = 0.7, outer_momentum = 0.9 }
    dl:attach(engine)
  end
  local xs, ys = {}, {}
  for i = 1, BATCH * CFG.seq_len do
    local k = i + 1000 * pg.world_rank()
    xs[i], ys[i] = (k * 7919) % CFG.vocab, (k * 104729 + 17) % CFG.vocab
  end
  local x = pg.tensor(xs, { dtype = "int32" }):reshape{ BATCH, CFG.seq_len }
  local y = pg.tensor(ys, { dtype = "int32" }):reshape{ BATCH, CFG.seq_len }
  local function step(s)
    engine:zero_grad()
    engine:forward_backward(x, y)
    opt:step()
    if dl and s % EVERY == 0 then dl:outer_step() end
  end
  step(1) -- connections made, buffers touched: not timed
  ctx:reset_comm_stats()
  pg.dist.barrier({ ctx = ctx, group = diloco and "islands" or "global" })
  local t0 = pg.wtime()
  for s = 2, steps + 1 do step(s) end
  pg.dist.barrier({ ctx = ctx, group = diloco and "islands" or "global" })
  local seconds = pg.wtime() - t0
  if pg.world_rank() == 0 then
    print(("result tokens_per_s %.1f"):format(2 * BATCH * CFG.seq_len * steps / seconds))
    print(("result step_ms %.2f"):format(1000 * seconds / steps))
    print(("result bytes_per_step %.0f"):format(bytes_per_step(ctx, diloco and "islands" or "data", steps)))
    print(("result params %d"):format(engine:num_parameters()))
    print(("result host %s"):format(pg.node().host))
  end
end

local function netns(args)
  local _, lines, rc = common.run(ENV .. "scripts/netns_hosts.sh " .. args)
  return rc, table.concat(lines, "\n")
end

local function run(ctx)
  print()
  local title = ("== slow link: 2 hosts (network namespaces, TCP) limited to %s, 1 rank x 1 thread each"):format(RATE)
  local rc, why = netns("check")
  if rc ~= 0 then
    print(title .. ": skipped (" .. why .. ")")
    return
  end
  rc, why = netns("up 2 " .. RATE)
  if rc ~= 0 then
    netns("down")
    print(title .. ": hosts not made (" .. why .. ")")
    common.failures[#common.failures + 1] = "slowlink"
    return
  end
  local _, args = netns("mpirun-args 1")
  local quoted = {}
  for a in args:gmatch("[^\n]+") do quoted[#quoted + 1] = common.shell_quote(a) end
  local function measure(mode, steps)
    local cmd = ("OMP_NUM_THREADS=1 timeout -k 5 900 scripts/mpirun.sh %s -x OMP_NUM_THREADS -np 2 %s %s "
      .. "--worker=slowlink --mode=%s --steps=%d"):format(table.concat(quoted, " "), common.PGLUA, common.SCRIPT,
      mode, steps)
    local res, lines, code = common.run(cmd)
    if not common.check_run("slow link " .. mode, res, lines, code, "tokens_per_s") then return nil end
    return res
  end
  local ddp = measure("ddp", ctx.steps(10))
  local dl = measure("diloco", 2 * EVERY) -- two outer steps in the timed window
  netns("down")
  if not (ddp and dl) then return end
  print(title)
  print(("  GPT %d x %d (%d parameters), %d x %d tokens per rank"):format(CFG.layers, CFG.dim, ddp.params, BATCH,
    CFG.seq_len))
  print(("  %-28s %12s %10s %16s"):format("", "tokens/s", "step ms", "bytes per step"))
  print(("  %-28s %12.1f %10.1f %16.0f"):format("data = 2 across the hosts", ddp.tokens_per_s, ddp.step_ms,
    ddp.bytes_per_step))
  print(("  %-28s %12.1f %10.1f %16.0f"):format(("DiLoCo, 2 islands, H = %d"):format(EVERY), dl.tokens_per_s,
    dl.step_ms, dl.bytes_per_step))
  print(("  DiLoCo / data parallel: %.1fx the tokens/s (target >= 5x), %.0fx fewer bytes per step"):format(
    dl.tokens_per_s / ddp.tokens_per_s, ddp.bytes_per_step / math.max(dl.bytes_per_step, 1)))
  emit("slowlink_ddp2", "tokens_per_s", ddp.tokens_per_s, "%.1f")
  emit("slowlink_diloco2_h" .. EVERY, "tokens_per_s", dl.tokens_per_s, "%.1f")
  emit("slowlink_ddp2", "bytes_per_step", ddp.bytes_per_step, "%.0f")
  emit("slowlink_diloco2_h" .. EVERY, "bytes_per_step", dl.bytes_per_step, "%.0f")
  emit("slowlink", "diloco_speedup", dl.tokens_per_s / ddp.tokens_per_s, "%.2f")
end

return { run = run, worker = worker }
