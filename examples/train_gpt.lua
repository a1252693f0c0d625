-- Train a small GPT on the default corpus (byte-level fortunes), on one rank
-- or many, with the Trainer:
--   ./pglua examples/train_gpt.lua [--steps=300] [--batch=16] ...
--   mpirun -np 4 ./pglua examples/train_gpt.lua --tensor=2 --pipeline=2 --micro-batches=4
-- --model=llama trains a LLaMA instead (examples/train_llama.lua says so).
-- Options (defaults in brackets): --model=gpt|llama --tensor=1 --pipeline=1 --data=1
-- --micro-batches=1 --schedule=1f1b --zero=0 --steps=300 --batch=16 --seq-len=128 --dim=256
-- --heads=4 (llama: 8) --layers=4; llama only: --kv-heads=2 --hidden=688 --rope-theta=10000;
-- --lr=1e-3 --warmup=30 --clip=1.0 --seed=42 --eval-every=100 --accumulate=1
-- --train=data/fortunes_train.bin --val=data/fortunes_val.bin --sample=200 --prompt="Q: "
-- --out=runs/train_<model> (metrics.jsonl and checkpoints/ go there) --ckpt-every=0 (steps; 0: none)
-- --keep-last=0 (keep only the newest N checkpoints; 0: all) --resume=DIR|last (a checkpoint
-- directory, or the newest one under --out) --stop-after=N (end this run after step N, saving
-- a checkpoint, as if preempted: continue with --resume=last) --log-every=10 --val-batches=8
-- --save-hf=DIR (at the end, the model as a transformers directory: from_pretrained loads it)
local pg = require "pipegoose"

local opt = {}
for _, a in ipairs(arg) do
  local k, v = a:match("^%-%-([%w-]+)=(.*)$")
  if not k then error("unknown argument " .. a .. " (options look like --steps=100)") end
  opt[k] = v
end
local function num(k, d)
  if opt[k] == nil then return d end
  return tonumber(opt[k]) or error(("--%s=%s is not a number"):format(k, opt[k]))
end
local function int(k, d)
  local v = num(k, d)
  return math.tointeger(v) or error(("--%s=%s is not an integer"):format(k, tostring(v)))
end

local seed = int("seed", 42)
local ctx = pg.ParallelContext{ tensor = int("tensor", 1), pipeline = int("pipeline", 1), data = int("data", 1),
                                seed = seed }
local seq_len, batch = int("seq-len", 128), int("batch", 16)
local arch = opt.model or "gpt"
local model
if arch == "gpt" then
  model = pg.nn.GPT{ vocab = 256, seq_len = seq_len, dim = int("dim", 256), heads = int("heads", 4),
                     layers = int("layers", 4) }
elseif arch == "llama" then
  model = pg.nn.Llama{ vocab = 256, seq_len = seq_len, dim = int("dim", 256), heads = int("heads", 8),
                       kv_heads = int("kv-heads", 2), hidden = int("hidden", 688), layers = int("layers", 4),
                       rope_theta = num("rope-theta", 10000) }
else
  error(("--model=%s: expected gpt or llama"):format(arch))
end
local engine = pg.parallelize(model, ctx, { micro_batches = int("micro-batches", 1), schedule = opt.schedule or "1f1b" })
local optimizer = pg.optim.AdamW(engine, { lr = num("lr", 1e-3), betas = { 0.9, 0.95 }, weight_decay = 0.1,
                                           zero = int("zero", 0) })
local train = pg.data.TokenShards{ path = opt.train or "data/fortunes_train.bin", batch = batch, seq_len = seq_len,
                                   seed = seed, ctx = ctx, vocab = 256 }
local val = pg.data.TokenShards{ path = opt.val or "data/fortunes_val.bin", batch = batch, seq_len = seq_len,
                                 shuffle = false, ctx = ctx, vocab = 256 }

local out = opt.out or ("runs/train_" .. arch)
local steps, ckpt_every, keep_last = int("steps", 300), int("ckpt-every", 0), int("keep-last", 0)
local stop_after = opt["stop-after"] and int("stop-after")
local callbacks = {
  pg.callbacks.ProgressBar{},
  pg.callbacks.MetricsLogger{ path = out .. "/metrics.jsonl" },
}
if ckpt_every > 0 or stop_after then
  callbacks[#callbacks + 1] = pg.callbacks.ModelCheckpoint{ every_n_steps = ckpt_every > 0 and ckpt_every or nil,
    save_last = true, keep_last = keep_last > 0 and keep_last or nil }
end
if stop_after then
  callbacks[#callbacks + 1] = pg.callbacks.LambdaCallback{ name = "StopAfter", on_train_batch_end = function(t, o)
    if o.step_end and t.state.step >= stop_after then t.control.should_stop = true end
  end }
end

local trainer = pg.Trainer{
  engine = engine, optimizer = optimizer, max_steps = steps, accumulate = int("accumulate", 1),
  lr_schedule = pg.lr.cosine{ warmup = int("warmup", 30), min_lr = num("lr", 1e-3) / 10 },
  clip_grad_norm = num("clip", 1.0), val_every_n_steps = int("eval-every", 100), val_batches = int("val-batches", 8),
  log_every_n_steps = int("log-every", 10), seed = seed, out_dir = out, callbacks = callbacks,
}
trainer:print(("pipegoose: %d parameters, %s, %d threads per rank"):format(engine:num_parameters(), tostring(ctx),
  pg.num_threads()))
trainer:fit(train, val, { resume = opt.resume })

local prompt = opt.prompt or "Q: "
local sample = pg.sample.generate(engine, pg.data.bytes.encode(prompt):totable(), int("sample", 200),
                                  { temperature = 0.8, seed = 1 })
trainer:print("sample:\n" .. prompt .. pg.data.bytes.decode(sample))

if opt["save-hf"] then
  engine:save_hf(opt["save-hf"])
  trainer:print("wrote " .. opt["save-hf"] .. " (transformers' from_pretrained loads it)")
end
