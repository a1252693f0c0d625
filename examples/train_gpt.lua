-- Train a small GPT on the default corpus (byte-level fortunes), on one rank
-- or many:
--   ./pglua examples/train_gpt.lua [--steps=300] [--batch=16] ...
--   mpirun -np 4 ./pglua examples/train_gpt.lua --tensor=2 --pipeline=2 --micro-batches=4
-- Options (defaults in brackets): --tensor=1 --pipeline=1 --data=1 --micro-batches=1
-- --schedule=1f1b --zero=0 --steps=300 --batch=16 --seq-len=128 --dim=256 --heads=4
-- --layers=4 --lr=1e-3 --warmup=30 --clip=1.0 --seed=42 --eval-every=100
-- --train=data/fortunes_train.bin --val=data/fortunes_val.bin --sample=200 --prompt="Q: "
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

local ctx = pg.ParallelContext{ tensor = int("tensor", 1), pipeline = int("pipeline", 1), data = int("data", 1),
                                seed = int("seed", 42) }
local rank0 = ctx:rank() == 0
local function say(...) if rank0 then print(...) io.stdout:flush() end end

local seq_len = int("seq-len", 128)
local model = pg.nn.GPT{ vocab = 256, seq_len = seq_len, dim = int("dim", 256), heads = int("heads", 4),
                         layers = int("layers", 4) }
local engine = pg.parallelize(model, ctx, { micro_batches = int("micro-batches", 1), schedule = opt.schedule or "1f1b" })
local optimizer = pg.optim.AdamW(engine, { lr = num("lr", 1e-3), betas = { 0.9, 0.95 }, weight_decay = 0.1,
                                           zero = int("zero", 0) })
local batch = int("batch", 16)
local train = pg.data.TokenShards{ path = opt.train or "data/fortunes_train.bin", batch = batch, seq_len = seq_len,
                                   seed = int("seed", 42), ctx = ctx, vocab = 256 }
local val = pg.data.TokenShards{ path = opt.val or "data/fortunes_val.bin", batch = batch, seq_len = seq_len,
                                 shuffle = false, ctx = ctx, vocab = 256 }

say(("pipegoose: %d parameters, %s, %d threads per rank"):format(engine:num_parameters(), tostring(ctx),
  pg.num_threads()))

local steps, warmup, lr = int("steps", 300), int("warmup", 30), num("lr", 1e-3)
local clip, eval_every = num("clip", 1.0), int("eval-every", 100)
local function lr_at(step) -- linear warm-up, then cosine to a tenth
  if step < warmup then return lr * (step + 1) / warmup end
  local p = (step - warmup) / math.max(1, steps - warmup)
  return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
end

local function validate(n)
  val:reset()
  local total, count = 0, 0
  for _ = 1, n do
    local x, y = val:next_batch()
    if not x then break end
    total, count = total + engine:loss(x, y), count + 1
  end
  return total / math.max(count, 1)
end

local start = os.time()
for step = 0, steps - 1 do
  local x, y = train:next_batch()
  if not x then x, y = train:next_batch() end -- a new epoch
  optimizer:set_lr(lr_at(step))
  engine:zero_grad()
  local loss = engine:forward_backward(x, y)
  local norm = optimizer:clip_grad_norm(clip)
  optimizer:step()
  if step % 10 == 0 or step == steps - 1 then
    say(("step %4d  loss %.4f  grad norm %.3f  lr %.2e"):format(step + 1, loss, norm, lr_at(step)))
  end
  if eval_every > 0 and ((step + 1) % eval_every == 0 or step == steps - 1) then
    say(("step %4d  val loss %.4f"):format(step + 1, validate(8)))
  end
end
local elapsed = os.time() - start
say(("trained %d steps in about %d s (%.0f tokens/s)"):format(steps, elapsed,
  steps * batch * seq_len / math.max(elapsed, 1)))

local prompt = opt.prompt or "Q: "
local ids = pg.data.bytes.encode(prompt):totable()
local out = pg.sample.generate(engine, ids, int("sample", 200), { temperature = 0.8, seed = 1 })
say("sample:\n" .. prompt .. pg.data.bytes.decode(out))
