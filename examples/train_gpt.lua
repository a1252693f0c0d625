-- Train a small GPT on the default corpus (byte-level fortunes), on one rank
-- or many, with the Trainer:
--   ./pglua examples/train_gpt.lua [--steps=300] [--batch=16] ...
--   mpirun -np 4 ./pglua examples/train_gpt.lua --tensor=2 --pipeline=2 --micro-batches=4
-- --model=llama trains a LLaMA instead (examples/train_llama.lua says so),
-- --model=mixtral a mixture of experts (examples/train_moe.lua).
-- Options: ./pglua examples/train_gpt.lua --help (unknown options are errors).
-- --resume=last continues the newest checkpoint under --out; --stop-after=N ends
-- the run after step N with a checkpoint, as if preempted.
local pg = require "pipegoose"
local argparse = require "argparse"

local p = argparse("train_gpt.lua", "Train a small GPT (or --model=llama | mixtral) on the default corpus with the Trainer.")
local o = dofile((arg[0]:match("^(.*/)") or "./") .. "options.lua")(p)
local int, num = o.int, o.num
p:option("--model", "gpt, llama or mixtral.", "gpt"):choices{ "gpt", "llama", "mixtral" }
o.layout()
p:option("--schedule", "Pipeline schedule.", "1f1b"):choices{ "1f1b", "gpipe" }
p:option("--precision", "fp32, or bf16 (bf16 GEMM operands, float32 sums, masters and optimizer).", "fp32")
  :choices{ "fp32", "bf16" }
p:flag("--sequence-parallel", "Sequence parallelism: the norms and residuals hold 1/tensor of the rows (tensor > 1).")
int("--zero", 0, "ZeRO stage (0 or 1).")
int("--steps", 300, "Optimizer steps.")
int("--batch", 16, "Global batch (sequences).")
int("--seq-len", 128, "Tokens per sequence.")
int("--dim", 256, "Model width.")
int("--heads", nil, "Attention heads (default 4; llama 8).")
int("--layers", 4, "Blocks.")
int("--kv-heads", 2, "Key/value heads (llama).")
int("--hidden", 688, "SwiGLU width (llama; mixtral: each expert's).")
int("--experts", 4, "Experts per MoE layer (mixtral).")
int("--top-k", 2, "Experts per token (mixtral).")
int("--expert", 1, "Expert-parallel size (mixtral): experts spread over groups of this many data ranks; divides --data.")
num("--capacity-factor", nil, "Each expert takes at most ceil(c x seq_len x top_k / experts) choices per sequence "
  .. "(mixtral; default: none dropped).")
num("--jitter", 0, "Router input noise in [1 - j, 1 + j] during training (mixtral).")
num("--aux-loss-coef", 0.01, "Load-balancing loss coefficient (mixtral).")
num("--rope-theta", 10000, "Rotary base (llama).")
num("--lr", 1e-3, "Peak learning rate.")
int("--warmup", 30, "Warm-up steps.")
num("--clip", 1.0, "Gradient norm clip.")
int("--seed", 42, "Seed of the weights and the data order.")
int("--eval-every", 100, "Validate every N steps.")
int("--accumulate", 1, "Micro-steps per optimizer step.")
p:option("--train", "Training shards.", "data/fortunes_train.bin")
p:option("--val", "Validation shards.", "data/fortunes_val.bin")
int("--sample", 200, "Bytes to sample at the end.")
p:option("--prompt", "Prompt of the sample.", "Q: ")
p:option("--out", "Output directory (metrics.jsonl, checkpoints/); default runs/train_<model>.")
int("--ckpt-every", 0, "Checkpoint every N steps (0: none).")
int("--keep-last", 0, "Keep only the newest N checkpoints (0: all).")
p:option("--resume", "A checkpoint directory, or 'last' (the newest under --out).")
int("--stop-after", nil, "End this run after step N, saving a checkpoint, as if preempted.")
int("--log-every", 10, "Log every N steps.")
int("--val-batches", 8, "Validation batches.")
p:option("--save-hf", "At the end, write the model as a Hugging Face transformers directory.")
local opt = p:parse()

local seed = opt.seed
local ctx = pg.ParallelContext{ tensor = opt.tensor, pipeline = opt.pipeline, data = opt.data, expert = opt.expert,
                                seed = seed }
local seq_len, batch = opt.seq_len, opt.batch
local arch = opt.model
local model
if arch == "gpt" then
  model = pg.nn.GPT{ vocab = 256, seq_len = seq_len, dim = opt.dim, heads = opt.heads or 4, layers = opt.layers }
else
  local o = { vocab = 256, seq_len = seq_len, dim = opt.dim, heads = opt.heads or 8, kv_heads = opt.kv_heads,
              hidden = opt.hidden, layers = opt.layers, rope_theta = opt.rope_theta }
  if arch == "mixtral" then
    o.experts, o.top_k, o.aux_loss_coef = opt.experts, opt.top_k, opt.aux_loss_coef
    o.capacity_factor, o.jitter = opt.capacity_factor, opt.jitter
    model = pg.nn.Mixtral(o)
  else
    model = pg.nn.Llama(o)
  end
end
local engine = pg.parallelize(model, ctx, { micro_batches = opt.micro_batches, schedule = opt.schedule,
  precision = opt.precision, sequence_parallel = opt.sequence_parallel })
local optimizer = pg.optim.AdamW(engine, { lr = opt.lr, betas = { 0.9, 0.95 }, weight_decay = 0.1, zero = opt.zero })
local train = pg.data.TokenShards{ path = opt.train, batch = batch, seq_len = seq_len, seed = seed, ctx = ctx, vocab = 256 }
local val = pg.data.TokenShards{ path = opt.val, batch = batch, seq_len = seq_len, shuffle = false, ctx = ctx, vocab = 256 }

local out = opt.out or ("runs/train_" .. arch)
local steps, ckpt_every, keep_last = opt.steps, opt.ckpt_every, opt.keep_last
local stop_after = opt.stop_after
local callbacks = {
  pg.callbacks.ProgressBar{},
  pg.callbacks.LearningRateMonitor{},
  pg.callbacks.MetricsLogger{ path = out .. "/metrics.jsonl" },
}
if ckpt_every > 0 or stop_after then
  callbacks[#callbacks + 1] = pg.callbacks.ModelCheckpoint{ every_n_steps = ckpt_every > 0 and ckpt_every or nil,
    save_last = true, keep_last = keep_last > 0 and keep_last or nil }
end
if arch == "mixtral" then -- the objective's parts and how the router spreads the tokens
  callbacks[#callbacks + 1] = pg.callbacks.LambdaCallback{ name = "Routing", on_train_batch_end = function(t)
    local parts = engine:losses()
    t:log("ce_loss", parts.ce_loss)
    t:log("aux_loss", parts.aux_loss)
    for e, n in ipairs(parts.expert_tokens) do t:log(("expert_tokens_%d"):format(e - 1), n) end
  end }
end
if stop_after then
  callbacks[#callbacks + 1] = pg.callbacks.LambdaCallback{ name = "StopAfter", on_train_batch_end = function(t, o)
    if o.step_end and t.state.step >= stop_after then t.control.should_stop = true end
  end }
end

local trainer = pg.Trainer{
  engine = engine, optimizer = optimizer, max_steps = steps, accumulate = opt.accumulate,
  lr_schedule = pg.lr.cosine{ warmup = opt.warmup, min_lr = opt.lr / 10 },
  clip_grad_norm = opt.clip, val_every_n_steps = opt.eval_every, val_batches = opt.val_batches,
  log_every_n_steps = opt.log_every, seed = seed, out_dir = out, callbacks = callbacks,
}
trainer:print(("pipegoose: %d parameters, %s, %d threads per rank"):format(engine:num_parameters(), tostring(ctx),
  pg.num_threads()))
trainer:fit(train, val, { resume = opt.resume })

local prompt = opt.prompt
local sample = pg.sample.generate(engine, pg.data.bytes.encode(prompt), opt.sample, { temperature = 0.8, seed = 1 })
trainer:print("sample:\n" .. prompt .. pg.data.bytes.decode(sample))

if opt.save_hf then
  engine:save_hf(opt.save_hf)
  trainer:print("wrote " .. opt.save_hf .. " (transformers' from_pretrained loads it)")
end
