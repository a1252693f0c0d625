-- The best 3D layout for a model on a cluster, from a simulated step
-- (pg.plan; docs/PLANNER.md explains the model and its accuracy).
--
--   pglua scripts/plan.lua --model=gpt3-175b --gpus=1024 --gpu=a100-80gb \
--       --global-batch=1536 --seq-len=2048 [--precision=bf16] [--top=5]
--   pglua scripts/plan.lua --validate [--profile=FILE] [--quick] [--only=NAME]
--       (measured vs simulated steps and memory on this machine; the last
--       line is "validation median_error=<x> max_error=<y> ... n=<n>")
--
-- First line: best t=<T> p=<P> d=<D> context=<C> m=<micro-batches> b=<micro-batch size>
-- schedule=<s> zero=<z> recompute=<r> sp=<true|false> tflops_per_gpu=<x>
-- step_s=<s> mem_gb=<m> mfu=<f>, then the top K with their step-time breakdown
-- (cp_exp: the context ring's unhidden part; dp_exp includes ZeRO-3's
-- unhidden gathers and reduce-scatters). zero and context are what to pass
-- to pg.optim.AdamW{zero=} and pg.ParallelContext{context=}.
-- tflops_per_gpu counts the FLOPs the GPUs execute, recomputation included
-- (Megatron-LM's convention), to 4 significant digits (a small run on a CPU
-- profile is a fraction of one TFLOP/s); mfu counts the model's FLOPs only.
-- --precision defaults to bf16, or to what a cpu profile measured
-- (pg.plan.hardware.default_precision).
local pg = require "pipegoose"
local argparse = require "argparse"

local parser = argparse("plan.lua", "Rank the 3D layouts of a model on a cluster by simulated step time.")
parser:flag("--validate", "Run the layouts this machine can run and compare measured with simulated steps and memory (scripts/plan_validate.lua).")
parser:option("--profile", "--validate: the hardware profile to simulate with (default: a fresh scripts/calibrate.lua).")
parser:flag("--quick", "--validate: a quick calibration and two small configurations (checks the output, not the errors).")
parser:option("--only", "--validate: only the configurations whose name contains this.")
parser:option("--model", "Built-in model: " .. table.concat(pg.plan.models.NAMES, ", ") .. ".")
parser:option("--hf", "A transformers config.json (model_type gpt2, llama or mixtral).")
parser:option("--gpus", "Number of GPUs (required unless --validate)."):convert(math.tointeger)
parser:option("--gpus-per-node", "GPUs per node (default: the hardware's, 8 for the built-in GPUs)."):convert(math.tointeger)
parser:option("--gpu", "Hardware: " .. table.concat(pg.plan.hardware.NAMES, ", ") .. " or cpu-profile=FILE.", "a100-80gb")
parser:option("--global-batch", "Sequences per step (required unless --validate)."):convert(math.tointeger)
parser:option("--seq-len", "Tokens per sequence (default: the model's)."):convert(math.tointeger)
parser:option("--precision", "bf16, fp32 or tf32 (default: bf16, or the precision a cpu profile has figures for)."):choices{ "bf16", "fp32", "tf32" }
parser:option("--top", "How many layouts to list.", "5"):convert(math.tointeger)
parser:option("--gemm-efficiency", "Share of peak FLOP/s a large matrix product reaches (default 0.75)."):convert(tonumber)
parser:flag("--flash-attention", "Attention scores never go through memory (fused kernel).")
parser:flag("--dp-overlap", "Overlap the gradient reduction with the last backward.")
parser:option("--tensor", "Pin T."):convert(math.tointeger)
parser:option("--pipeline", "Pin P."):convert(math.tointeger)
parser:option("--context", "Pin the context-parallel size C (2C must divide the sequence)."):convert(math.tointeger)
parser:option("--micro-batch-size", "Pin b."):convert(math.tointeger)
parser:option("--schedule", "Pin the schedule."):choices(pg.core.schedules().offered)
parser:option("--zero", "Pin the ZeRO stage."):choices{ "0", "1", "2", "3" }
parser:option("--recompute", "Pin recomputation."):choices{ "none", "selective", "full" }
parser:option("--sp", "Pin sequence parallelism."):choices{ "true", "false" }
local args = parser:parse()

if args.validate then
  -- scripts/plan_validate.lua, found next to this script
  package.path = (arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
  local ok, err = pcall(require("plan_validate").run, { profile = args.profile, quick = args.quick,
    only = args.only, pglua = arg[-1] or "./pglua" })
  if not ok then
    io.stderr:write("plan.lua: ", tostring(err), "\n")
    os.exit(1)
  end
  os.exit(0)
end
if not args.gpus then parser:error("option '--gpus' must be used 1 time") end
if not args.global_batch then parser:error("option '--global-batch' must be used 1 time") end

local pin_sp = nil -- --sp=true|false, or free
if args.sp == "true" then pin_sp = true elseif args.sp == "false" then pin_sp = false end

local function run()
  local t0 = os.clock()
  local best, summary = pg.plan.search{
    model = args.model, hf = args.hf, gpus = args.gpus, gpus_per_node = args.gpus_per_node, gpu = args.gpu,
    global_batch = args.global_batch, seq_len = args.seq_len, precision = args.precision, top = args.top,
    gemm_efficiency = args.gemm_efficiency, flash_attention = args.flash_attention or nil,
    dp_overlap = args.dp_overlap or nil, tensor = args.tensor, pipeline = args.pipeline, context = args.context,
    micro_batch_size = args.micro_batch_size, schedule = args.schedule,
    zero = args.zero and math.tointeger(tonumber(args.zero)), recompute = args.recompute,
    sequence_parallel = pin_sp,
  }
  local q = summary.query
  if #best == 0 then error(pg.plan.no_fit_message(summary), 0) end
  local b = best[1]
  print(("best t=%d p=%d d=%d context=%d m=%d b=%d schedule=%s zero=%d recompute=%s sp=%s tflops_per_gpu=%.4g "
    .. "step_s=%.4g mem_gb=%.2f mfu=%.3f"):format(b.t, b.p, b.d, b.c, b.m, b.b, b.schedule, b.zero, b.recompute,
      tostring(b.sp), b.tflops_per_gpu, b.step_s, b.mem_gb, b.mfu))
  print(("%s on %d x %s (%d per node), global batch %d x %d tokens, %s; %d layouts, %d over memory, %d simulated, %.1f s")
    :format(q.model.name, q.gpus, q.hw.name, q.gpus_per_node, q.global_batch, q.seq_len, q.precision,
      summary.enumerated, summary.over_memory, summary.simulated, os.clock() - t0))
  local head = ("%3s %3s %3s %4s %3s %5s %3s %-6s %4s %-9s %-5s %9s %7s %5s %7s | %9s %9s %9s %9s %9s %9s")
  print(head:format("#", "t", "p", "d", "c", "m", "b", "sched", "zero", "recompute", "sp", "step_s", "tflops", "mfu",
    "mem_gb", "compute", "tp_comm", "cp_exp", "bubble", "dp_exp", "optim"))
  for i, L in ipairs(best) do
    local k = L.breakdown
    local row = "%3d %3d %3d %4d %3d %5d %3d %-6s %4d %-9s %-5s %9.4g %7.4g %5.3f %7.2f | %9.4g %9.4g %9.4g %9.4g %9.4g %9.4g"
    print(row:format(i, L.t, L.p, L.d, L.c, L.m, L.b, L.schedule, L.zero, L.recompute, tostring(L.sp), L.step_s,
        L.tflops_per_gpu, L.mfu, L.mem_gb, k.compute, k.tp_comm, k.cp_comm, k.bubble, k.dp_comm_exposed, k.optimizer))
  end
  local idle = {}
  for i, v in ipairs(b.stage_idle) do idle[i] = ("%.3g"):format(v) end
  print(("best: layers per stage %s; idle per stage (s) %s; critical stage %d")
    :format(table.concat(b.stages, ","), table.concat(idle, ","), b.critical_stage - 1))
end

local ok, err = pcall(run)
if not ok then
  io.stderr:write("plan.lua: ", tostring(err), "\n")
  os.exit(1)
end
