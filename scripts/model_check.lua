-- Trains a Hugging Face model directory for a few steps on one fixed batch,
-- in any parallel layout, printing the losses to compare with a PyTorch or
-- transformers run (the general form of scripts/gpt2_check.lua).
--
--   [mpirun -np N] pglua scripts/model_check.lua --hf=DIR --tokens=SHARD [--batch=B] [--seq-len=T]
--       [--steps=N] [--lr=] [--beta1=] [--beta2=] [--eps=] [--weight-decay=] [--clip=]
--       [--tensor=T] [--pipeline=P] [--data=D] [--expert=E] [--micro-batches=M] [--schedule=gpipe|1f1b]
--       [--virtual-stages=V] [--zero=0|1|2] [--device=cpu|cuda|cuda:N] [--recompute=none|full|selective]
--       [--precision=fp32|bf16] [--sequence-parallel] [--save-hf=DIR]
--
-- The model is pg.nn.from_hf(DIR) (GPT2LMHeadModel, LlamaForCausalLM or MixtralForCausalLM). The
-- batch is the first B windows of T + 1 tokens of the llm.c shard SHARD
-- (inputs the first T, targets the last T), the same batch at every step.
-- AdamW has torch semantics (decay on tensors of 2 or more dimensions;
-- --clip=C clips the global gradient norm to C first). Prints on rank 0:
--   loss <v>              the token loss at the loaded weights (evaluation: no auxiliary losses)
--   step <k> loss <v>     the objective before the k-th update, k = 1..N
--   step <k> ce_loss <v> aux_loss <v>
--                         a mixture of experts: the token loss and the auxiliary
--                         losses (coefficients applied) that make up that objective
--   grad_norm <k> <v>     the global gradient norm of that step, before clipping
--   final loss <v>        with --save-hf: the objective after the N updates,
--                         whose weights are written to that directory
-- Defaults: B = 4, T = the model's positions, N = 10, lr 1e-3, betas 0.9 / 0.95,
-- eps 1e-8, weight decay 0.1, no clipping.
local pg = require "pipegoose"
local argparse = require "argparse"

local p = argparse("model_check.lua", "Train a Hugging Face model directory on one fixed batch; print the losses.")
local to_int = dofile((arg[0]:match("^(.*/)") or "./") .. "check_options.lua")(p, { steps = "10" })
p:option("--hf", "A transformers model directory."):count(1)
p:option("--tokens", "An llm.c token shard."):count(1)
p:option("--batch", "B windows of T + 1 tokens.", "4"):convert(to_int)
p:option("--seq-len", "T (default: the model's positions)."):convert(to_int)
p:option("--save-hf", "Write the trained model there and print its final loss.")
local opt = p:parse()

local ctx = pg.ParallelContext{ tensor = opt.tensor, pipeline = opt.pipeline, data = opt.data, expert = opt.expert, seed = 1 }
local model = pg.nn.from_hf(opt.hf)
local cfg = model.config
local B, T = opt.batch, opt.seq_len or cfg.seq_len
local engine = pg.parallelize(model, ctx, { micro_batches = opt.micro_batches, schedule = opt.schedule,
  virtual_stages = opt.virtual_stages, device = opt.device, recompute = opt.recompute,
  precision = opt.precision, sequence_parallel = opt.sequence_parallel })
local data = pg.data.TokenShards{ path = opt.tokens, batch = B, seq_len = T, shuffle = false, ctx = ctx, vocab = cfg.vocab }
local x, y = data:next_batch()
if not x then error(opt.tokens .. ": fewer than " .. B .. " windows of " .. (T + 1) .. " tokens", 0) end

local function say(...) if ctx:rank() == 0 then print(...) end end

say(("loss %.9g"):format(engine:loss(x, y)))
local optimizer = pg.optim.AdamW(engine, { lr = opt.lr, betas = { opt.beta1, opt.beta2 }, eps = opt.eps,
  weight_decay = opt.weight_decay, zero = opt.zero })
local clip = opt.clip
for k = 1, opt.steps do
  engine:zero_grad()
  local l = engine:forward_backward(x, y)
  local norm = clip > 0 and optimizer:clip_grad_norm(clip) or optimizer:grad_norm()
  optimizer:step()
  say(("step %d loss %.9g"):format(k, l))
  if cfg.experts then -- a mixture of experts: the objective's two parts
    local parts = engine:losses()
    say(("step %d ce_loss %.9g aux_loss %.9g"):format(k, parts.ce_loss, parts.aux_loss))
  end
  say(("grad_norm %d %.9g"):format(k, norm))
end
if opt.save_hf then
  say(("final loss %.9g"):format(engine:loss(x, y)))
  engine:save_hf(opt.save_hf)
end
