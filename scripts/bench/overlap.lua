-- Part overlap: data = 2 over MPI (2 ranks x 1 thread, private buffers), the
-- small model, zero = 1: step time, gradient reduction time and its exposed
-- part (what the step waited for after backward) with overlap_grad_reduce
-- off and on in the same run, and engine:memory()'s bytes per parameter for
-- zero = 0, 1 and 2. The measuring is the overlap worker's
-- (scripts/bench/workers.lua, which says how).
local common = require "bench.common"

local emit = common.emit
local BUCKET_MB = 1 -- the small model's 3.3 M parameters (13 MB) in about a dozen buckets

return function(ctx)
  local res, lines, rc = common.run(common.worker_cmd(2, 1, { "--worker=overlap", "--steps=" .. ctx.steps(4),
                                                             "--bucket_mb=" .. BUCKET_MB }))
  if not common.check_run("overlapped gradient reduction", res, lines, rc, "overlap_on.step_ms") then return end
  local cfg = common.MODELS.small
  print()
  print(("== overlapped gradient reduction, data = 2 over MPI, GPT %d x %d, %d x %d tokens per rank, zero = 1, "
    .. "bucket_mb = %g"):format(cfg.layers, cfg.dim, cfg.batch, cfg.seq_len, BUCKET_MB))
  print(("  %-8s %9s %9s %11s %9s"):format("overlap", "step ms", "sync ms", "exposed ms", "buckets"))
  for _, k in ipairs{ "off", "on", "zero2" } do
    local p = "overlap_" .. k
    print(("  %-8s %9.1f %9.1f %11.1f %5d/%-3d"):format(k == "zero2" and "on z=2" or k, res[p .. ".step_ms"],
      res[p .. ".grad_sync_ms"], res[p .. ".exposed_ms"], res[p .. ".in_backward"], res[p .. ".buckets"]))
    emit("dp2_overlap_" .. k, "step_ms", res[p .. ".step_ms"], "%.1f")
    emit("dp2_overlap_" .. k, "grad_sync_ms_per_step", res[p .. ".grad_sync_ms"], "%.2f")
    emit("dp2_overlap_" .. k, "exposed_comm_ms_per_step", res[p .. ".exposed_ms"], "%.2f")
  end
  print("  sync ms: from the first bucket's start to the last one's end (off: the reduction after backward);")
  print("  exposed ms: what the step waited for after its backward; buckets: started in backward / all")
  print("  on z=2: zero = 2, a reduce-scatter into the gradient shard per bucket and micro-batch")
  print(("  bytes per parameter after a step (engine:memory(): params + grads + AdamW state, %d parameters on a rank;"
    .. " zero=2's gradients: the shard and the staging of two buckets):")
    :format(res.local_parameters))
  for zero = 0, 2 do
    print(("    zero=%d %6.2f  (gradients %.1f MB)"):format(zero, res[("zero%d.bytes_per_parameter"):format(zero)],
      res[("zero%d.grads_bytes"):format(zero)] / 2 ^ 20))
    emit("dp2_zero" .. zero, "bytes_per_parameter", res[("zero%d.bytes_per_parameter"):format(zero)], "%.2f")
  end
end
