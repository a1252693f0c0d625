-- Trains a Hugging Face model directory for a few steps on one fixed batch,
-- in any parallel layout, printing the losses to compare with a PyTorch or
-- transformers run (the general form of scripts/gpt2_check.lua).
--
--   [mpirun -np N] pglua scripts/model_check.lua --hf=DIR --tokens=SHARD [--batch=B] [--seq-len=T]
--       [--steps=N] [--lr=] [--beta1=] [--beta2=] [--eps=] [--weight-decay=] [--clip=]
--       [--tensor=T] [--pipeline=P] [--data=D] [--micro-batches=M] [--schedule=gpipe|1f1b] [--zero=0|1]
--       [--device=cpu|cuda|cuda:N] [--save-hf=DIR]
--
-- The model is pg.nn.from_hf(DIR) (GPT2LMHeadModel or LlamaForCausalLM). The
-- batch is the first B windows of T + 1 tokens of the llm.c shard SHARD
-- (inputs the first T, targets the last T), the same batch at every step.
-- AdamW has torch semantics (decay on tensors of 2 or more dimensions;
-- --clip=C clips the global gradient norm to C first). Prints on rank 0:
--   loss <v>              the objective at the loaded weights
--   step <k> loss <v>     the objective before the k-th update, k = 1..N
--   grad_norm <k> <v>     the global gradient norm of that step, before clipping
--   final loss <v>        with --save-hf: the objective after the N updates,
--                         whose weights are written to that directory
-- Defaults: B = 4, T = the model's positions, N = 10, lr 1e-3, betas 0.9 / 0.95,
-- eps 1e-8, weight decay 0.1, no clipping.
local pg = require "pipegoose"

local opt = {}
for _, a in ipairs(arg) do
  local k, v = a:match("^%-%-([%w-]+)=(.*)$")
  if not k then
    io.stderr:write("model_check.lua: unexpected argument '" .. a .. "' (options are --name=value)\n")
    os.exit(2)
  end
  opt[k] = v
end
local known = { hf = 1, tokens = 1, batch = 1, ["seq-len"] = 1, steps = 1, lr = 1, beta1 = 1, beta2 = 1, eps = 1,
  ["weight-decay"] = 1, clip = 1, tensor = 1, pipeline = 1, data = 1, ["micro-batches"] = 1, schedule = 1, zero = 1,
  device = 1, ["save-hf"] = 1 }
for k in pairs(opt) do
  if not known[k] then
    io.stderr:write("model_check.lua: unknown option --" .. k .. "\n")
    os.exit(2)
  end
end
if not opt.hf or not opt.tokens then
  io.stderr:write("usage: model_check.lua --hf=DIR --tokens=SHARD [--batch=B] [--seq-len=T] [--steps=N] ...\n")
  os.exit(2)
end
local function num(k, d)
  if opt[k] == nil then return d end
  return tonumber(opt[k]) or error("--" .. k .. " needs a number, got " .. opt[k], 0)
end
local function int(k, d)
  local v = num(k, d)
  return math.tointeger(v) or error("--" .. k .. " needs an integer, got " .. tostring(opt[k]), 0)
end

local ctx = pg.ParallelContext{ tensor = int("tensor", 1), pipeline = int("pipeline", 1), data = int("data", 1), seed = 1 }
local model = pg.nn.from_hf(opt.hf)
local cfg = model.config
local B, T = int("batch", 4), int("seq-len", cfg.seq_len)
local engine = pg.parallelize(model, ctx, { micro_batches = int("micro-batches", 1), schedule = opt.schedule or "1f1b",
  device = opt.device or "cpu" })
local data = pg.data.TokenShards{ path = opt.tokens, batch = B, seq_len = T, shuffle = false, ctx = ctx, vocab = cfg.vocab }
local x, y = data:next_batch()
if not x then error(opt.tokens .. ": fewer than " .. B .. " windows of " .. (T + 1) .. " tokens", 0) end

local function say(...) if ctx:rank() == 0 then print(...) end end

say(("loss %.9g"):format(engine:loss(x, y)))
local optimizer = pg.optim.AdamW(engine, { lr = num("lr", 1e-3), betas = { num("beta1", 0.9), num("beta2", 0.95) },
  eps = num("eps", 1e-8), weight_decay = num("weight-decay", 0.1), zero = int("zero", 0) })
local clip = num("clip", 0)
for k = 1, int("steps", 10) do
  engine:zero_grad()
  local l = engine:forward_backward(x, y)
  local norm = clip > 0 and optimizer:clip_grad_norm(clip) or optimizer:grad_norm()
  optimizer:step()
  say(("step %d loss %.9g"):format(k, l))
  say(("grad_norm %d %.9g"):format(k, norm))
end
if opt["save-hf"] then
  say(("final loss %.9g"):format(engine:loss(x, y)))
  engine:save_hf(opt["save-hf"])
end
