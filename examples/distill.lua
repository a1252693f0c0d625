-- Distillation: a smaller GPT learns from a larger one on the default corpus
-- (byte-level fortunes: `make run` or scripts/prepare_corpus.lua makes
-- data/fortunes_{train,val}.bin). The student's objective, written in Lua:
--   alpha * cross-entropy(targets) + (1 - alpha) * tau^2 * KL(teacher || student)
-- on logits split by vocabulary over the tensor group (pg.loss), in any layout:
--   ./pglua examples/distill.lua
--   mpirun -np 4 ./pglua examples/distill.lua --tensor=2 --pipeline=2 --micro-batches=2
-- The teacher is trained here first (--teacher-steps), or read from a
-- checkpoint of examples/train_gpt.lua (--teacher=DIR). The last lines give
-- the teacher's and the student's validation loss (cross-entropy).
local pg = require "pipegoose"
local argparse = require "argparse"

local p = argparse("distill.lua", "Distil a larger GPT into a smaller one with a Lua objective.")
local o = dofile((arg[0]:match("^(.*/)") or "./") .. "options.lua")(p)
local int, num = o.int, o.num
o.layout()
int("--batch", 16, "Global batch (sequences).")
int("--seq-len", 64, "Tokens per sequence.")
p:option("--teacher", "A checkpoint of examples/train_gpt.lua to use as the teacher.")
int("--teacher-steps", 300, "Steps to train the teacher here (without --teacher).")
int("--teacher-dim", 128, "The teacher's width (without --teacher).")
int("--teacher-layers", 4, "The teacher's blocks (without --teacher).")
int("--dim", 64, "The student's width.")
int("--layers", 2, "The student's blocks.")
int("--heads", 4, "Attention heads.")
int("--steps", 200, "Distillation steps.", 1)
num("--lr", 2e-3, "Peak learning rate.")
num("--alpha", 0.5, "Weight of the cross-entropy (the rest is KL).")
num("--temperature", 2, "Softmax temperature of the KL term.")
int("--val-batches", 8, "Validation batches.")
int("--seed", 3, "Seed of the weights and the data order.")
p:option("--train", "Training shards.", "data/fortunes_train.bin")
p:option("--val", "Validation shards.", "data/fortunes_val.bin")
local opt = p:parse()

for _, path in ipairs{ opt.train, opt.val } do
  if not pg.fs.exists(path) then
    error(("distill.lua: %s is missing: run ./pglua scripts/prepare_corpus.lua (or make run) first"):format(path), 0)
  end
end
local ctx = pg.ParallelContext{ tensor = opt.tensor, pipeline = opt.pipeline, data = opt.data, seed = opt.seed }
local function data(path, shuffle)
  return pg.data.TokenShards{ path = path, batch = opt.batch, seq_len = opt.seq_len, seed = opt.seed, ctx = ctx,
                              vocab = 256, shuffle = shuffle }
end
local function gpt(dim, layers, head)
  return pg.nn.GPT{ vocab = 256, seq_len = opt.seq_len, dim = dim, heads = opt.heads, layers = layers, head = head }
end
local layout = { micro_batches = opt.micro_batches, seed = opt.seed }

-- The teacher: from a checkpoint, or trained here with the built-in loss.
local teacher
if opt.teacher then
  local dir = pg.checkpoint.resolve(opt.teacher)
  teacher = pg.parallelize(pg.nn.from_config(pg.checkpoint.read_manifest(dir).model), ctx, layout)
  pg.checkpoint.load_weights(teacher, dir)
else
  teacher = pg.parallelize(gpt(opt.teacher_dim, opt.teacher_layers), ctx, layout)
  local trainer = pg.Trainer{ engine = teacher, optimizer = pg.optim.AdamW(teacher, { lr = opt.lr }),
    lr_schedule = pg.lr.cosine{ warmup = 10, min_lr = opt.lr / 10 }, max_steps = opt.teacher_steps,
    log_every_n_steps = 50, out_dir = "runs/distill/teacher", callbacks = { pg.callbacks.ProgressBar{} } }
  trainer:print(("teacher: %d parameters, %d steps"):format(teacher:num_parameters(), opt.teacher_steps))
  trainer:fit(data(opt.train, true))
end

local Student = pg.TrainingModule:extend("Student")

function Student:configure_model(c)
  return pg.parallelize(gpt(opt.dim, opt.layers, "logits"), c, layout)
end

function Student:configure_optimizers(engine)
  return pg.optim.AdamW(engine, { lr = opt.lr }), pg.lr.cosine{ warmup = 10, min_lr = opt.lr / 10 }
end

-- The teacher's logits of the batch ([rows, vocab], every rank; collective),
-- which the objective reads micro-batch by micro-batch.
function Student:training_step(batch)
  local x = batch.inputs
  self.teacher_logits = teacher:forward(x):reshape{ x:numel(), 256 }
  return self:forward_backward(x, batch.targets)
end

function Student:objective(out, batch)
  local rows = out:size(1)
  local targets = batch.targets:reshape{ rows }
  local ce, dce = pg.loss.cross_entropy(out, targets, { vocab = batch.vocab, ctx = batch.ctx })
  if not batch.want_grad then return ce, nil end -- validation reports the cross-entropy alone
  local t = self.teacher_logits:narrow(1, batch.first_row, rows)
  local kl, dkl = pg.loss.kl_div(out, t, { vocab = batch.vocab, ctx = batch.ctx, temperature = opt.temperature })
  local a = opt.alpha
  return a * ce + (1 - a) * kl, dce:scale(a):add(dkl:scale(1 - a))
end

local trainer = pg.Trainer{ ctx = ctx, max_steps = opt.steps, val_every_n_steps = opt.steps,
  val_batches = opt.val_batches, log_every_n_steps = 50, seed = opt.seed, out_dir = "runs/distill/student",
  callbacks = { pg.callbacks.ProgressBar{} } }
local student = Student{}
trainer:fit(student, pg.DataModule.from_data{ train = data(opt.train, true), val = data(opt.val, false) })
trainer:print(("student: %d parameters, %d steps"):format(student.engine:num_parameters(), opt.steps))

-- The teacher's validation loss on the same batches.
local val, sum = data(opt.val, false), 0
for _ = 1, opt.val_batches do
  local x, y = val:next_batch()
  sum = sum + teacher:loss(x, y)
end
trainer:print(("teacher_val_loss %.4f"):format(sum / opt.val_batches))
trainer:print(("student_val_loss %.4f"):format(trainer.state.metrics.val_loss))
