-- Part diloco: DiLoCo's quality and traffic on the default corpus (make run's
-- data/corpus; BENCH_CORPUS names another): examples/train_gpt.lua on 4 ranks
-- of 1 thread, the same model, steps, global batch and so the same tokens, as
-- data = 4 (data parallelism, gradients reduced every step) and as 4 islands
-- of one rank that sync every H in {10, 50} steps (pg.DiLoCo, outer lr 0.7,
-- Nesterov momentum 0.9), from scratch and warm-started (a quarter of the
-- steps as data = 4 first). Figures: the final validation loss (the same 16
-- validation batches for all, after the islands' last sync) and the bytes
-- rank 0 communicated per optimizer step (ctx:comm_stats(), every group).
-- Sized to finish in a few minutes on 2 loaded cores: a 2-layer GPT of width
-- 64, 16 x 64 tokens a step, 200 steps (BENCH_STEPS changes the steps).
local common = require "bench.common"

local run, check_run, emit = common.run, common.check_run, common.emit

return function(ctx)
  local corpus = os.getenv("BENCH_CORPUS") or "data/corpus"
  local f = io.open(corpus .. "/dataset.json")
  print()
  if not f then
    print(("== DiLoCo: skipped (no corpus at %s: make data/corpus/dataset.json, or BENCH_CORPUS=dir)"):format(corpus))
    return
  end
  f:close()
  local steps = ctx.steps(200)
  local base = { "--corpus=" .. corpus, "--model=gpt", "--dim=64", "--layers=2", "--seq-len=64", "--batch=16",
                 "--steps=" .. steps, "--warmup=20", "--eval-every=" .. steps, "--val-batches=16", "--sample=0",
                 "--log-every=" .. steps }
  -- warm start (the paper's): the first quarter of the steps as data = 4 (stopped there with a checkpoint, the
  -- schedule's horizon the whole run's), then 4 islands resumed from that checkpoint (every island from it)
  local warm = math.max(1, tonumber(steps) // 4)
  local configs = {
    { key = "ddp", label = "data = 4 (DDP)", args = { "--data=4" } },
    { key = "h10", label = "4 islands, H = 10", args = { "--islands=4", "--outer-every=10" } },
    { key = "h50", label = "4 islands, H = 50", args = { "--islands=4", "--outer-every=50" } },
    { key = "w10", label = ("warm %d, H = 10"):format(warm), warm = true, args = { "--islands=4", "--outer-every=10" } },
    { key = "w50", label = ("warm %d, H = 50"):format(warm), warm = true, args = { "--islands=4", "--outer-every=50" } },
  }
  local got = {}
  for _, c in ipairs(configs) do
    local out = common.shell_quote(os.tmpname() .. "-diloco-" .. c.key)
    local function train(extra)
      local args = {}
      for _, a in ipairs(base) do args[#args + 1] = common.shell_quote(a) end
      for _, a in ipairs(extra) do args[#args + 1] = a end
      args[#args + 1] = "--out=" .. out
      return ("OMP_NUM_THREADS=1 scripts/mpirun.sh -np 4 -x OMP_NUM_THREADS %s examples/train_gpt.lua %s")
        :format(common.PGLUA, table.concat(args, " "))
    end
    local cmd = train(c.args)
    if c.warm then
      local args = { "--resume=last" }
      for _, a in ipairs(c.args) do args[#args + 1] = a end
      cmd = train{ "--data=4", "--stop-after=" .. warm } .. " >/dev/null && " .. train(args)
    end
    local res, lines, rc = run(cmd)
    for _, l in ipairs(lines) do
      local v = l:match("^step %d+ | val_loss (%S+)")
      if v then res.val_loss = tonumber(v) end
      local b = l:match("^communicated bytes per step %(rank 0%): (%d+)")
      if b then res.bytes_per_step = tonumber(b) end
    end
    -- a warm run's second job counts only its own traffic: the data = 4 part's, at DDP's rate, is added
    if c.warm and res.bytes_per_step and got.ddp and got.ddp.bytes_per_step then
      res.bytes_per_step = res.bytes_per_step + got.ddp.bytes_per_step * warm / tonumber(steps)
    end
    if check_run("diloco " .. c.key, res, lines, rc, "val_loss") then got[c.key] = res end
  end
  print(("== DiLoCo on %s: a GPT of 2 x 64, %s steps of 16 x 64 tokens on 4 ranks x 1 thread"):format(corpus, steps))
  print(("  %-20s %9s %12s %14s %12s"):format("run", "val loss", "vs DDP", "bytes / step", "DDP / this"))
  local ddp = got.ddp
  for _, c in ipairs(configs) do
    local r = got[c.key]
    if r then
      emit("diloco_" .. c.key, "val_loss", r.val_loss, "%.4f")
      emit("diloco_" .. c.key, "bytes_per_step", r.bytes_per_step, "%.0f")
      print(("  %-20s %9.4f %11.2f%% %14.0f %12s"):format(c.label, r.val_loss,
        ddp and 100 * (r.val_loss / ddp.val_loss - 1) or 0, r.bytes_per_step or 0,
        (ddp and r.bytes_per_step and r.bytes_per_step > 0) and ("%.1fx"):format(ddp.bytes_per_step / r.bytes_per_step)
          or "-"))
    end
  end
end
