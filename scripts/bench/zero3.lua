-- Part zero3: data = 2 over MPI (2 ranks x 1 thread, private buffers), the
-- small model, zero = 3 against zero = 1 (and zero = 2 between them) in the
-- same run, and zero = 3 without its prefetch (prefetch = false: each gather
-- starts when its module runs): the step (the slower rank's wall time,
-- median over the steps; each stage runs twice in the mirrored order 1, 2,
-- 3, 3 without prefetch, and back, and keeps its faster run: interference
-- only slows a run down), the bytes the data group
-- moved per step (ctx:comm_stats(), every collective's buffer: gathers,
-- reduce-scatters and the loss's all-reduce) against the theory in
-- parameter bytes (4 x flat buffer): zero 1 reduce-scatters the gradients
-- and all-gathers the parameters once (2x); zero 3 gathers every unit for
-- its forward and again for its backward, and reduce-scatters the
-- gradients (3x, less the tied embedding's second gather: it is kept for
-- the call), and the memory per rank (engine:memory()).
local pg = require "pipegoose"
local common = require "bench.common"

local emit, median = common.emit, common.median
local M = {}

local function allmax(x)
  local t = pg.tensor{ x }
  pg.dist.all_reduce(t, { op = "max" })
  return t:item()
end

local function data_bytes(ctx)
  local b = 0
  for _, k in pairs(ctx:comm_stats().data or {}) do b = b + k.bytes end
  return b
end

function M.worker(o)
  local cfg = common.MODELS.small
  local ctx = pg.ParallelContext{ data = pg.world_size(), seed = 1 }
  local spec = {}
  for k, v in pairs(cfg) do if k ~= "batch" then spec[k] = v end end
  local steps = tonumber(o.steps or 4)
  local xs, ys = {}, {}
  for i = 1, cfg.batch * cfg.seq_len do
    local k = i + ctx:local_rank("data") * cfg.batch * cfg.seq_len
    xs[i], ys[i] = (k * 7919) % cfg.vocab, (k * 104729 + 17) % cfg.vocab
  end
  local x = pg.tensor(xs, { dtype = "int32" }):reshape{ cfg.batch, cfg.seq_len }
  local y = pg.tensor(ys, { dtype = "int32" }):reshape{ cfg.batch, cfg.seq_len }
  local function measure(zero, prefetch)
    local e = pg.parallelize(pg.nn.from_config(spec), ctx, { shared_memory = false, bucket_mb = 1 })
    local opt = pg.optim.AdamW(e, { lr = 1e-4, zero = zero, prefetch = prefetch })
    local walls, bytes = {}, {}
    for s = 1, 1 + steps do
      ctx:barrier()
      ctx:reset_comm_stats()
      local t0 = pg.wtime()
      e:zero_grad()
      e:forward_backward(x, y)
      opt:step()
      local wall = allmax(pg.wtime() - t0)
      if s > 1 then
        walls[#walls + 1] = wall
        bytes[#bytes + 1] = data_bytes(ctx)
      end
    end
    local m, st = e:memory(), e:stats()
    return { step_ms = median(walls) * 1e3, bytes = median(bytes), flat_bytes = 4 * st.flat_padded,
             memory = m.params_bytes + m.grads_bytes + m.optimizer_bytes, params_bytes = m.params_bytes,
             units = st.gather_units or 0 }
  end
  -- stage 4 is zero = 3 without prefetch
  local best = {}
  for _, stage in ipairs{ 1, 2, 3, 4, 4, 3, 2, 1 } do
    local r = measure(math.min(stage, 3), stage ~= 4)
    if not best[stage] or r.step_ms < best[stage].step_ms then best[stage] = r end
    collectgarbage()
  end
  if ctx:rank() == 0 then
    for stage, r in pairs(best) do
      local key = stage == 4 and "zero3_noprefetch" or "zero" .. stage
      for name, v in pairs(r) do print(("result %s.%s %.8g"):format(key, name, v)) end
    end
  end
  ctx:barrier()
end

function M.part(ctx)
  local res, lines, rc = common.run(common.worker_cmd(2, 1, { "--worker=zero3", "--steps=" .. ctx.steps(4) }))
  if not common.check_run("zero 3", res, lines, rc, "zero3.step_ms") then return end
  local cfg = common.MODELS.small
  print()
  print(("== ZeRO-3 against ZeRO-1, data = 2 over MPI, GPT %d x %d, %d x %d tokens per rank, 1 thread per rank")
    :format(cfg.layers, cfg.dim, cfg.batch, cfg.seq_len))
  print(("  %-16s %9s %7s %14s %9s %8s %11s"):format("zero", "step ms", "ratio", "data MB/step", "x params",
    "theory", "memory MB"))
  local rows = { { "zero1", "1", 2 }, { "zero2", "2", 2 }, { "zero3", "3", 3 },
                  { "zero3_noprefetch", "3 (no prefetch)", 3 } }
  for _, row in ipairs(rows) do
    local key, label, theory = row[1], row[2], row[3]
    local r = res
    local k = key .. "."
    local moved = r[k .. "bytes"] / r[k .. "flat_bytes"]
    print(("  %-16s %9.1f %7.3f %14.2f %9.3f %8d %11.2f"):format(label, r[k .. "step_ms"],
      r[k .. "step_ms"] / r["zero1.step_ms"], r[k .. "bytes"] / 2 ^ 20, moved, theory, r[k .. "memory"] / 2 ^ 20))
    emit("dp2_" .. key, "step_ms", r[k .. "step_ms"], "%.1f")
    emit("dp2_" .. key, "step_ratio_to_zero1", r[k .. "step_ms"] / r["zero1.step_ms"], "%.3f")
    emit("dp2_" .. key, "data_bytes_per_param_byte", moved, "%.3f")
    emit("dp2_" .. key, "memory_bytes", r[k .. "memory"], "%d")
  end
  print("  data MB/step: every collective's buffer over the data group (ctx:comm_stats());")
  print("  x params: that over the parameter bytes (4 x the flat buffer); theory: 2 for zero 1 and 2 (reduce-scatter")
  print(("  and all-gather), 3 for zero 3 (a gather for forward and one for backward, %d units, and the"):format(
    res["zero3.units"]))
  print("  reduce-scatter; the tied embedding is gathered once a call); memory: params + grads + AdamW state per rank")
end

return M
