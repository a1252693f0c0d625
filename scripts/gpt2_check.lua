-- Checks pipegoose's GPT-2 against a PyTorch reference (files made by
-- scripts/make_reference.py, in llm.c's model and debug-state formats).
--
--   [mpirun -np N] pglua scripts/gpt2_check.lua MODEL STATE [--steps=K] [--lr=] [--beta1=] [--beta2=]
--       [--eps=] [--weight-decay=] [--clip=] [--tensor=T] [--pipeline=P] [--data=D]
--       [--micro-batches=M] [--schedule=gpipe|1f1b] [--virtual-stages=V] [--zero=0|1|2|3] [--device=cpu|cuda|cuda:N]
--       [--recompute=none|full|selective] [--precision=fp32|bf16] [--sequence-parallel]
--
-- Prints on rank 0: loss, logits_max_abs_diff, grad <tensor> <max_abs_diff> for
-- the 16 tensors, grads_max_abs_diff, then "step k loss v grad_norm n" for
-- k = 1..K (the loss before update k, same batch every step, and the global
-- gradient norm before clipping, which --clip=C clips to C). Exit 0 when the
-- loss matches to 1e-5 relative, logits to 1e-4 and gradients to 1e-4
-- absolute (--precision=bf16: 1e-4, 1e-2 and 2e-3), else 1.
local pg = require "pipegoose"
local llmc = require "pipegoose.llmc"

local argparse = require "argparse"
local p = argparse("gpt2_check.lua", "Check pipegoose's GPT-2 against a PyTorch reference (llm.c files).")
p:argument("model", "llm.c model file.")
p:argument("state", "llm.c debug state file.")
dofile((arg[0]:match("^(.*/)") or "./") .. "check_options.lua")(p)
local opt = p:parse()
local model_path, state_path = opt.model, opt.state

local ctx = pg.ParallelContext{ tensor = opt.tensor, pipeline = opt.pipeline, data = opt.data, expert = opt.expert, seed = 1 }
local rank, D, dp = ctx:rank(), ctx:world_size("data"), ctx:local_rank("data")
local model = pg.nn.GPT.load_llmc(model_path)
local cfg = model.config
local engine = pg.parallelize(model, ctx, { micro_batches = opt.micro_batches, schedule = opt.schedule,
  virtual_stages = opt.virtual_stages, device = opt.device, recompute = opt.recompute,
  precision = opt.precision, sequence_parallel = opt.sequence_parallel })

-- The debug state: header, x, y, logits [B, T, V], loss, gradients.
local h = pg.file.read(state_path, 0, 256, "int32"):totable()
if h[1] ~= 20240327 or h[2] ~= 2 then error(state_path .. ": not a debug state file (magic/version)") end
local B, T, V = h[3], h[4], cfg.vocab
if B % D ~= 0 then error(("batch %d is not divisible by data=%d"):format(B, D)) end
local off = 1024
local function read(count, dtype)
  local t = pg.file.read(state_path, off, count, dtype)
  off = off + 4 * count
  return t
end
local x = read(B * T, "int32"):reshape{ B, T }
local y = read(B * T, "int32"):reshape{ B, T }
local ref_logits = read(B * T * V):reshape{ B, T, V }
local ref_loss = read(1):item()
local ref_grads = {}
for _, e in ipairs(llmc.entries(cfg)) do ref_grads[#ref_grads + 1] = { entry = e, values = read(e.count) } end

-- This data rank's share of the batch.
local Bl = B // D
local xs, ys = x:narrow(1, dp * Bl + 1, Bl), y:narrow(1, dp * Bl + 1, Bl)

local function say(...) if rank == 0 then print(...) end end
local function global_max(v)
  local t = pg.tensor{ v }
  pg.dist.all_reduce(t, { ctx = ctx, op = "max" })
  return t:item()
end

engine:zero_grad()
local loss = engine:forward_backward(xs, ys)
local logits = engine:forward(xs)
local logit_diff = global_max(logits:max_abs_diff(ref_logits:narrow(1, dp * Bl + 1, Bl)))

-- Gradients, per llm.c tensor: the owner stage gathers its tensor group's shards.
local held = {}
for _, p in ipairs(engine:parameters()) do if not p.tied_copy then held[p.name] = true end end
local per_tensor, order = {}, {}
for _, g in ipairs(ref_grads) do
  local e = g.entry
  local d = 0
  if held[e.name] then
    local full = engine:gather_param(e.name, true)
    d = full:reshape{ full:numel() }:narrow(1, 1, e.count):max_abs_diff(g.values)
  end
  if not per_tensor[e.file_name] then per_tensor[e.file_name], order[#order + 1] = 0, e.file_name end
  per_tensor[e.file_name] = math.max(per_tensor[e.file_name], d)
end
local worst = 0
say(("loss %.9g"):format(loss))
say(("logits_max_abs_diff %.3g"):format(logit_diff))
for _, name in ipairs(order) do
  local d = global_max(per_tensor[name])
  worst = math.max(worst, d)
  say(("grad %s %.3g"):format(name, d))
end
say(("grads_max_abs_diff %.3g"):format(worst))

-- bf16 GEMM operands round every product's inputs to 8 significant bits (2^-9 relative): the tiny model's
-- logits then move by about 1e-3 and its gradients by 3e-4 from the float32 reference, its loss by 2e-6
-- relative; the bf16 tolerances are about 10 times those.
local tol = opt.precision == "bf16" and { loss = 1e-4, logits = 1e-2, grads = 2e-3 }
  or { loss = 1e-5, logits = 1e-4, grads = 1e-4 }
local ok = math.abs(loss - ref_loss) <= tol.loss * math.abs(ref_loss) and logit_diff <= tol.logits
  and worst <= tol.grads
if not ok then say(("reference loss %.9g"):format(ref_loss)) end

-- K AdamW steps on the same batch.
local K = opt.steps
if K > 0 then
  local optimizer = pg.optim.AdamW(engine, { lr = opt.lr, betas = { opt.beta1, opt.beta2 }, eps = opt.eps,
    weight_decay = opt.weight_decay, zero = opt.zero })
  local clip = opt.clip
  for k = 1, K do
    engine:zero_grad()
    local l = engine:forward_backward(xs, ys)
    local norm = clip > 0 and optimizer:clip_grad_norm(clip) or optimizer:grad_norm()
    optimizer:step()
    say(("step %d loss %.9g grad_norm %.9g"):format(k, l, norm))
  end
end
-- how rank 0's data-parallel reductions ran (shared buffers only within a node; over MPI overlapped with backward)
say(("shared_memory %s"):format(tostring(engine:stats().shared_memory)))
say(("overlap_grad_reduce %s"):format(tostring(engine:stats().overlap_grad_reduce)))
os.exit(ok and 0 or 1)
