-- Which fortunes file does a fortune come from? A small GPT with a
-- classification head of our own, trained with a TrainingModule whose
-- objective is written in Lua (cross-entropy on the last token's class
-- scores), in any layout:
--   ./pglua examples/classify.lua
--   mpirun -np 4 ./pglua examples/classify.lua --tensor=2 --data=2
-- The last line is `val_accuracy <v>` (chance: 1 / number of classes).
-- --init=CHECKPOINT starts from a checkpoint of examples/train_gpt.lua (its
-- body; the head starts fresh) instead of from scratch.
local pg = require "pipegoose"
local argparse = require "argparse"
local rng = require "pipegoose.rng"

local p = argparse("classify.lua", "Fine-tune a small GPT to tell which fortunes file a fortune comes from.")
local o = dofile((arg[0]:match("^(.*/)") or "./") .. "options.lua")(p)
local int, num = o.int, o.num
o.layout()
p:option("--files", "Fortunes files, one class each.", "riddles,love,computers")
p:option("--dir", "Where the fortunes files are.", "/usr/share/games/fortunes")
int("--per-class", 120, "Fortunes per class (the smallest file bounds it).")
int("--val-per-class", 20, "Of which held out for validation.")
int("--steps", 150, "Optimizer steps.", 1)
int("--batch", 16, "Global batch (fortunes).")
int("--seq-len", 64, "Bytes per fortune (its first bytes; shorter ones are padded at the front).")
int("--dim", 64, "Model width.")
int("--heads", 4, "Attention heads.")
int("--layers", 2, "Blocks.")
num("--lr", 2e-3, "Peak learning rate.")
int("--seed", 7, "Seed of the weights, the split and the data order.")
int("--eval-every", 50, "Validate every N steps.")
p:option("--init", "A checkpoint of examples/train_gpt.lua to start the body from.")
local opt = p:parse()

local ctx = pg.ParallelContext{ tensor = opt.tensor, pipeline = opt.pipeline, data = opt.data, seed = opt.seed }
local files = {}
for f in opt.files:gmatch("[^,]+") do files[#files + 1] = f end
local CLASSES, T = #files, opt.seq_len

-- The fortunes of one file (entries between lines holding "%").
local function fortunes(name)
  local path = opt.dir .. "/" .. name
  local fh = io.open(path, "rb")
  if not fh then error(("classify.lua: cannot read %s (apt-get install fortunes, or --dir=)"):format(path), 0) end
  local text, list = fh:read("a"), {}
  fh:close()
  for entry in (text .. "\n%\n"):gmatch("(.-)\n%%\n") do
    if #entry > 0 then list[#list + 1] = entry end
  end
  return list
end

-- Every rank builds the same split: the same files, the same seeded shuffle.
local train_rows, val_rows = {}, {}
local next_u = rng.generator(opt.seed)
for class, name in ipairs(files) do
  local list = fortunes(name)
  if #list < opt.per_class then
    error(("classify.lua: %s has %d fortunes, fewer than --per-class=%d"):format(name, #list, opt.per_class), 0)
  end
  for i = #list, 2, -1 do -- Fisher-Yates
    local j = math.floor(next_u() * i) + 1
    list[i], list[j] = list[j], list[i]
  end
  for i = 1, opt.per_class do
    local row = { text = list[i], label = class - 1 }
    table.insert(i <= opt.val_per_class and val_rows or train_rows, row)
  end
end

-- Fortunes as [n, T] byte ids: the first T bytes, padded at the front with
-- the document separator so that the last position is always text.
local function tokens(rows)
  local ids = pg.zeros({ #rows, T }, { dtype = "int32" })
  for r, row in ipairs(rows) do
    local s = row.text:sub(1, T)
    for k = 1, #s do ids:set(r, T - #s + k, s:byte(k)) end
  end
  return ids
end

--- In-memory data in the Trainer's interface: each step's global batch is
-- `batch` rows of a seeded permutation; this data rank returns its share.
-- The targets carry the row's label at every position (the objective reads
-- the last).
local Rows = {}
Rows.__index = Rows
local function rows_data(rows, shuffle)
  local self = setmetatable({ rows = rows, inputs = tokens(rows), shuffle = shuffle, epoch_n = 0, at = 0 }, Rows)
  self.order = {}
  for i = 1, #rows do self.order[i] = i end
  return self
end
function Rows:batches_per_epoch() return #self.rows // opt.batch end
function Rows:tokens_per_batch() return opt.batch * T end
function Rows:reset()
  self.at = 0
  if self.shuffle then
    local u = rng.generator(rng.mix(opt.seed, self.epoch_n))
    for i = #self.order, 2, -1 do
      local j = math.floor(u() * i) + 1
      self.order[i], self.order[j] = self.order[j], self.order[i]
    end
  end
  self.epoch_n = self.epoch_n + 1
end
function Rows:next_batch()
  if self.epoch_n == 0 then self:reset() end
  if self.at + opt.batch > #self.rows then
    self:reset()
    return nil
  end
  local D, d = ctx:world_size("data"), ctx:local_rank("data")
  local share = opt.batch // D
  local x, y = pg.zeros({ share, T }, { dtype = "int32" }), pg.zeros({ share, T }, { dtype = "int32" })
  for r = 1, share do
    local i = self.order[self.at + d * share + r]
    x:narrow(1, r, 1):copy_(self.inputs:narrow(1, i, 1))
    y:narrow(1, r, 1):fill_(self.rows[i].label)
  end
  self.at = self.at + opt.batch
  return x, y
end

local Classifier = pg.TrainingModule:extend("Classifier")

function Classifier:configure_model(c)
  local model = pg.nn.GPT{ vocab = 256, seq_len = T, dim = opt.dim, heads = opt.heads, layers = opt.layers,
                           head = "none" }
  model:add(pg.nn.Linear(opt.dim, CLASSES, { name = "classifier" }))
  local engine = pg.parallelize(model, c, { micro_batches = opt.micro_batches, seed = opt.seed })
  if opt.init then engine:load_weights(opt.init) end
  return engine
end

function Classifier:configure_optimizers(engine)
  return pg.optim.AdamW(engine, { lr = opt.lr, weight_decay = 0.1 }),
         pg.lr.cosine{ warmup = 10, min_lr = opt.lr / 10 }
end

-- The loss of the class scores at each fortune's last position; during
-- evaluation it also counts the right answers.
function Classifier:objective(out, batch)
  local scores = pg.loss.last_tokens(out, batch)
  local labels = pg.loss.last_tokens(batch.targets:reshape{ out:size(1), 1 }, batch)
  local loss, d = pg.loss.cross_entropy(scores, labels)
  if not batch.want_grad then
    local _, best = scores:max(2)
    for b = 1, batch.batch do
      if best:get(b, 1) - 1 == labels:get(b, 1) then self.correct = self.correct + 1 end
    end
    self.counted = self.counted + batch.batch
  end
  return loss, pg.loss.last_tokens_backward(d, batch)
end

-- Validation: the loss and the accuracy of the batch. The objective ran on
-- the last pipeline stage of every data rank, the same on each tensor rank:
-- the counts of those with tensor rank 0 are summed over the whole job.
function Classifier:validation_step(batch)
  self.correct, self.counted = 0, 0
  local loss = self:loss(batch.inputs, batch.targets)
  local counts = pg.tensor{ 0, 0 }
  if self.engine.stage == self.engine.stages - 1 and ctx:local_rank("tensor") == 0 then
    counts = pg.tensor{ self.correct, self.counted }
  end
  pg.dist.all_reduce(counts, { ctx = ctx })
  return { loss = loss, accuracy = counts:get(1) / counts:get(2) }
end

local data = pg.DataModule.from_data{ train = rows_data(train_rows, true), val = rows_data(val_rows, false) }
local trainer = pg.Trainer{
  ctx = ctx, max_steps = opt.steps, val_every_n_steps = opt.eval_every, log_every_n_steps = 10, seed = opt.seed,
  clip_grad_norm = 1.0, out_dir = "runs/classify",
  callbacks = { pg.callbacks.ProgressBar{} },
}
local module = Classifier{}
trainer:fit(module, data)
local result = trainer:validate(module, data)
trainer:print(("%d classes (%s), %d training and %d validation fortunes; chance %.3f"):format(CLASSES,
  table.concat(files, ", "), #train_rows, #val_rows, 1 / CLASSES))
trainer:print(("val_accuracy %.4f"):format(result.val_accuracy))
