-- Train a small GPT on a prepared corpus (--corpus=DIR, scripts/prepare_corpus.lua;
-- make run's is data/corpus) or, without one, on the byte-level fortunes
-- (data/fortunes_*.bin, or --train/--val), on one rank or many, with the Trainer:
--   ./pglua examples/train_gpt.lua [--corpus=data/corpus] [--steps=1000] [--batch=16] ...
--   mpirun -np 4 ./pglua examples/train_gpt.lua --tensor=2 --pipeline=2 --micro-batches=4
-- --model=llama trains a LLaMA instead (examples/train_llama.lua says so),
-- --model=mixtral a mixture of experts (examples/train_moe.lua).
-- Options: ./pglua examples/train_gpt.lua --help (unknown options are errors).
-- --islands=K --outer-every=H trains K islands of world / K ranks (each its own --tensor x --pipeline x
-- --data layout) that sync every H steps by DiLoCo's outer step (pg.DiLoCo; --outer-lr, --outer-momentum);
-- --batch is then the batch of all the islands together (the tokens of data = K x --data).
-- --resume=last continues the newest checkpoint under --out (with islands, at any --islands: see resume_of);
-- --stop-after=N ends
-- the run after step N with a checkpoint, as if preempted. Every run keeps its
-- final checkpoint (under --out/checkpoints) and ends with the command that
-- samples it again (scripts/generate.lua --checkpoint=<--out>).
--
-- A wrapper runs this file with a table: loadfile(here .. "train_gpt.lua"){ name = "train_llama.lua",
-- model = "llama", description = "..." } (its name in the usage and the messages, and --model's default);
-- run as a script, its arguments are the command line's strings instead.
local pg = require "pipegoose"
local argparse = require "argparse"

local how = type((...)) == "table" and (...) or {}
local name = how.name or "train_gpt.lua"
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
-- The byte-level shards of the fortunes (make's data/fortunes_*.bin rule), the data without --corpus.
local BYTE_SHARDS = { train = "data/fortunes_train.bin", val = "data/fortunes_val.bin" }
local p = argparse(name, how.description
  or "Train a small GPT (or --model=llama | mixtral) on the default corpus with the Trainer.")
local o = dofile(here .. "options.lua")(p)
local int, num = o.int, o.num
p:option("--model", "gpt, llama or mixtral.", how.model or "gpt"):choices{ "gpt", "llama", "mixtral" }
o.layout()
local schedules = pg.core.schedules() -- the runtime's (src/engine/pg_schedule.c)
p:option("--schedule", "Pipeline schedule.", schedules.default):choices(schedules.offered)
p:option("--precision", "fp32, or bf16 (bf16 GEMM operands, float32 sums, masters and optimizer).", "fp32")
  :choices{ "fp32", "bf16" }
int("--context", 1, "Context-parallel size: each sequence split over this many ranks (ring attention).")
p:flag("--sequence-parallel", "Sequence parallelism: the norms and residuals hold 1/tensor of the rows (tensor > 1).")
-- the stages pg.optim.AdamW takes (zero = 0, 1, 2, 3)
p:option("--zero", "ZeRO stage: 0 (none), 1 (the optimizer state sharded over --data), 2 (the gradients too) or 3 "
  .. "(the parameters too, each module's gathered when it runs).", "0")
  :choices{ "0", "1", "2", "3" }:convert(o.to_int)
-- The defaults: make run's recipe (examples/train_llama.lua --corpus=data/corpus,
-- the fortunes and the King James Bible with a 4096-id BPE, 3.4 bytes a token):
-- 1000 steps of 16 x 128 tokens (2.0M tokens, about one epoch) of a 1.74M-parameter
-- LLaMA, fp32, to a val loss of 4.174 nats/token = 1.815 bits per byte (seed 42,
-- 2 threads), 97% of its sample's words in the dictionary. On the shared 2-core
-- Xeon (AVX512_BF16, load 3.6-4.9) make run took 316 s of wall time and 281 s
-- of CPU; its quietest stretch ran 13.4k tokens/s, so about 2.5 minutes on the 2 cores
-- alone. Measured on the way (1000 steps each): lr 3e-3 reached
-- 1.813 bits per byte against 1.805 at 6e-3; a vocabulary of 8192 reached 1.790
-- but cost 48% more CPU (the head is most of a step at width 128); widths 192
-- and 256 ran 0.7x and 0.36x the tokens/s of 128, too slow for the epoch;
-- bf16 is 30% faster here but its fallback for CPUs without AVX512_BF16 is 7%
-- slower than fp32. Without --corpus the same defaults train on the byte-level
-- fortunes.
int("--steps", 1000, "Optimizer steps.", 1)
int("--batch", 16, "Global batch (sequences).")
int("--seq-len", 128, "Tokens per sequence.")
int("--dim", 128, "Model width.")
int("--heads", nil, "Attention heads (default 4; llama 8).")
int("--layers", 4, "Blocks.")
int("--kv-heads", 2, "Key/value heads (llama).")
int("--hidden", 344, "SwiGLU width (llama; mixtral: each expert's).")
int("--experts", 4, "Experts per MoE layer (mixtral).")
int("--top-k", 2, "Experts per token (mixtral).")
int("--expert", 1, "Expert-parallel size (mixtral): experts spread over groups of this many data ranks; divides --data.")
num("--capacity-factor", nil, "Each expert takes at most ceil(c x seq_len x top_k / experts) choices per sequence "
  .. "(mixtral; default: none dropped).")
num("--jitter", 0, "Router input noise in [1 - j, 1 + j] during training (mixtral).")
num("--aux-loss-coef", 0.01, "Load-balancing loss coefficient (mixtral).")
num("--rope-theta", 10000, "Rotary base (llama).")
num("--lr", 6e-3, "Peak learning rate.")
int("--warmup", 50, "Warm-up steps.")
num("--clip", 1.0, "Gradient norm clip.")
int("--seed", 42, "Seed of the weights and the data order.")
int("--eval-every", 500, "Validate every N steps.")
int("--accumulate", 1, "Micro-steps per optimizer step.")
int("--islands", 1, "DiLoCo islands: the world cut into this many blocks of ranks that sync every --outer-every steps.")
int("--outer-every", nil, "DiLoCo: inner steps between outer steps (required with --islands > 1).")
num("--outer-lr", 0.7, "DiLoCo: the outer SGD's learning rate.")
num("--outer-momentum", 0.9, "DiLoCo: the outer SGD's Nesterov momentum.")
int("--fragments", 1, "DiLoCo: parameter fragments that sync at staggered steps (streaming DiLoCo; must divide "
  .. "--outer-every); with more than 1 each fragment's exchange overlaps the next inner step.")
p:option("--exchange", "DiLoCo: how pseudo-gradients travel: float32, or quantised to bf16 or int8 (blocks of 256 "
  .. "with an absmax scale).", "float32"):choices{ "float32", "bf16", "int8" }
p:option("--corpus", "A prepared corpus directory (scripts/prepare_corpus.lua): its tokenizer sizes the model's "
  .. "vocabulary and encodes the prompt; its train and val splits are the data.")
p:option("--train", "Byte-level training shards, without --corpus (default " .. BYTE_SHARDS.train .. ").")
p:option("--val", "Byte-level validation shards, without --corpus (default " .. BYTE_SHARDS.val .. ").")
int("--sample", 200, "Tokens to sample at the end (0: no sample).")
p:option("--prompt", "Prompt of the sample (default 'Q: '; with --corpus 'The').")
p:option("--out", "Output directory (metrics.jsonl, checkpoints/); default runs/train_<model>.")
int("--ckpt-every", 0, "Also checkpoint every N steps (0: only the final checkpoint, which every run keeps).")
int("--keep-last", 0, "Keep only the newest N checkpoints (0: all).")
p:option("--resume", "A checkpoint directory, 'last' (the newest under --out), or 'auto' (the newest under --out "
  .. "that verifies, or a fresh start without one: scripts/launch.sh's relaunches).")
p:flag("--overwrite", "Write over the checkpoints an earlier run left in --out (a fresh run into a used --out refuses).")
int("--stop-after", nil, "End this run after step N, saving a checkpoint, as if preempted.")
int("--log-every", 10, "Log every N steps.")
int("--val-batches", 0, "Validation batches (0: the whole validation set).")
p:option("--save-hf", "At the end, write the model as a Hugging Face transformers directory.")
local opt = p:parse()
if opt.corpus and (opt.train or opt.val) then
  p:error("--corpus gives the training and validation data; --train and --val are for byte-level shards without it")
end
if opt.sample < 0 then p:error(("--sample must be 0 or more tokens, got %d"):format(opt.sample)) end
if opt.val_batches < 0 then p:error(("--val-batches must be 0 (all) or more, got %d"):format(opt.val_batches)) end
if opt.islands < 1 then p:error(("--islands must be 1 or more, got %d"):format(opt.islands)) end
if opt.islands > 1 and not opt.outer_every then p:error("--islands > 1 needs --outer-every=H (inner steps between syncs)") end
local diloco = opt.islands > 1 or opt.outer_every ~= nil

-- What follows up to fit builds what the options describe, and an error there
-- is in the options (Llama: kv_heads=3 does not divide heads=8): it is
-- reported as argparse reports a bad flag, under the script's name, without
-- this file's line that only passed the value on (under train_llama.lua not
-- even the file the user ran). Errors with a position elsewhere keep it.
local function from_options(f)
  local ok, err = pcall(f)
  if ok then return end
  if type(err) == "string" then
    local src = debug.getinfo(1, "S").short_src
    local rest = err:sub(1, #src + 1) == src .. ":" and err:sub(#src + 2):match("^%d+: (.*)$")
    if rest then err = name .. ": " .. rest end
  end
  error(err, 0)
end

-- The token ids and text of the data: a prepared corpus's tokenizer, else bytes.
local corpus, vocab, encode, decode
if opt.corpus then
  from_options(function() corpus = pg.data.corpus(opt.corpus) end) -- (a bad --corpus is the option's error)
  vocab = corpus.vocab_size
  local tok = corpus.tokenizer
  encode = function(text) return tok:encode(text) end
  decode = function(ids) return tok:decode(ids) end
else
  vocab, encode, decode = pg.data.bytes.vocab_size, pg.data.bytes.encode, pg.data.bytes.decode
end

local seed, ctx, engine, train, val, trainer, out
from_options(function()
  seed = opt.seed
  ctx = pg.ParallelContext{ tensor = opt.tensor, pipeline = opt.pipeline, data = opt.data, expert = opt.expert,
                            context = opt.context, seed = seed, islands = opt.islands }
  local seq_len, batch = opt.seq_len, opt.batch
  local arch = opt.model
  local model
  if arch == "gpt" then
    model = pg.nn.GPT{ vocab = vocab, seq_len = seq_len, dim = opt.dim, heads = opt.heads or 4, layers = opt.layers }
  else
    local o = { vocab = vocab, seq_len = seq_len, dim = opt.dim, heads = opt.heads or 8, kv_heads = opt.kv_heads,
                hidden = opt.hidden, layers = opt.layers, rope_theta = opt.rope_theta }
    if arch == "mixtral" then
      o.experts, o.top_k, o.aux_loss_coef = opt.experts, opt.top_k, opt.aux_loss_coef
      o.capacity_factor, o.jitter = opt.capacity_factor, opt.jitter
      model = pg.nn.Mixtral(o)
    else
      model = pg.nn.Llama(o)
    end
  end
  engine = pg.parallelize(model, ctx, { micro_batches = opt.micro_batches, schedule = opt.schedule,
    precision = opt.precision, sequence_parallel = opt.sequence_parallel })
  local optimizer = pg.optim.AdamW(engine, { lr = opt.lr, betas = { 0.9, 0.95 }, weight_decay = 0.1, zero = opt.zero })
  local function split(which)
    if corpus then return { corpus = corpus, split = which } end
    return { path = opt[which] or BYTE_SHARDS[which] }
  end
  local function shards(which, o)
    for k, v in pairs(split(which)) do o[k] = v end
    return pg.data.TokenShards(o)
  end
  train = shards("train", { batch = batch, seq_len = seq_len, seed = seed, ctx = ctx, vocab = vocab })
  val = shards("val", { batch = batch, seq_len = seq_len, shuffle = false, ctx = ctx, vocab = vocab })

  out = opt.out or ("runs/train_" .. arch)
  -- islands train alone, each with its own trainer: island 0 writes --out and prints, island i its own
  -- directory (metrics, checkpoints) under it, silently
  local island = ctx:local_rank("islands")
  local island_out = island == 0 and out or ("%s/island-%d"):format(out, island)
  local steps, ckpt_every, keep_last = opt.steps, opt.ckpt_every, opt.keep_last
  local stop_after = opt.stop_after
  local callbacks = {}
  -- first, so that a run ending between syncs has synced before the final checkpoint
  if diloco then
    callbacks[1] = pg.DiLoCo{ islands = opt.islands, outer_every = opt.outer_every, outer_lr = opt.outer_lr,
                              outer_momentum = opt.outer_momentum, fragments = opt.fragments,
                              exchange = opt.exchange }
  end
  if island == 0 then callbacks[#callbacks + 1] = pg.callbacks.ProgressBar{} end
  callbacks[#callbacks + 1] = pg.callbacks.LearningRateMonitor{}
  callbacks[#callbacks + 1] = pg.callbacks.MetricsLogger{ path = island_out .. "/metrics.jsonl" }
  -- Every run keeps its final checkpoint (save_last, also when --stop-after ends
  -- it early), so that its model can be sampled again or resumed. Without
  -- --ckpt-every, every_n_steps = --steps asks for none before the end
  -- (without every_n_steps ModelCheckpoint would save at every validation).
  callbacks[#callbacks + 1] = pg.callbacks.ModelCheckpoint{ every_n_steps = ckpt_every > 0 and ckpt_every or steps,
    save_last = true, keep_last = keep_last > 0 and keep_last or nil }
  if arch == "mixtral" then -- the objective's parts and how the router spreads the tokens
    callbacks[#callbacks + 1] = pg.callbacks.LambdaCallback{ name = "Routing", on_train_batch_end = function(t)
      local parts = engine:losses()
      t:log("ce_loss", parts.ce_loss)
      t:log("aux_loss", parts.aux_loss)
      for e, n in ipairs(parts.expert_tokens) do t:log(("expert_tokens_%d"):format(e - 1), n) end
    end }
  end
  callbacks[#callbacks + 1] = o.test_kill(pg)
  callbacks[#callbacks + 1] = o.test_gate(pg)
  if stop_after then
    callbacks[#callbacks + 1] = pg.callbacks.LambdaCallback{ name = "StopAfter", on_train_batch_end = function(t, o)
      if o.step_end and t.state.step >= stop_after then t.control.should_stop = true end
    end }
  end

  trainer = pg.Trainer{
    engine = engine, optimizer = optimizer, max_steps = steps, accumulate = opt.accumulate,
    lr_schedule = pg.lr.cosine{ warmup = opt.warmup, min_lr = opt.lr / 10 },
    clip_grad_norm = opt.clip, val_every_n_steps = opt.eval_every,
    val_batches = opt.val_batches > 0 and opt.val_batches or nil, -- nil: the whole validation set
    log_every_n_steps = opt.log_every, seed = seed, out_dir = island_out, callbacks = callbacks, overwrite = opt.overwrite,
    out = island ~= 0 and { write = function() end, flush = function() end } or nil,
  }
end)
trainer:print(("pipegoose: %d parameters, %s, %d threads per rank"):format(engine:num_parameters(), tostring(ctx),
  pg.num_threads()))
-- With islands, --resume names island 0's checkpoint ('last': the newest under --out/checkpoints); island i
-- resumes from the checkpoint of the same name of the saved run's island i mod k (k: the islands it was saved
-- with, 1 for a run without DiLoCo: every island then starts from that model), under --out/island-<i mod k>.
-- 'auto' (scripts/launch.sh's relaunches) is the newest checkpoint that verifies (island 0's), or a fresh start.
local function resume_of(island)
  local spec = o.resume_path(opt.resume, diloco and (out .. "/checkpoints") or trainer:get_checkpoint_dir())
  if not spec or not diloco then return spec end
  local ckpt = require "pipegoose.checkpoint"
  local first = spec == "last" and ckpt.latest(out .. "/checkpoints") or spec
  if not first then return spec end -- nothing saved yet: every island starts fresh (the trainer says so)
  first = ckpt.resolve(first)
  local saved = (ckpt.read_manifest(first).callbacks or {}).DiLoCo
  local from = island % (saved and saved.islands or 1)
  if from == 0 then return first end
  return ("%s/island-%d/checkpoints/%s"):format(out, from, ckpt.fs.basename(first))
end
trainer:fit(train, val, { resume = resume_of(ctx:local_rank("islands")) })

-- What this rank sent and received over each group, per optimizer step (pg_comm's counters): data
-- parallelism's gradient reductions against DiLoCo's outer steps over the islands group.
do
  local stats, total, parts = ctx:comm_stats(), 0, {}
  local modes = {}
  for mode in pairs(stats) do modes[#modes + 1] = mode end
  table.sort(modes)
  for _, mode in ipairs(modes) do
    local b = 0
    for _, kind in pairs(stats[mode]) do b = b + kind.bytes end
    if b > 0 then parts[#parts + 1] = ("%s %.0f"):format(mode, b / math.max(trainer.state.step, 1)) end
    total = total + b
  end
  trainer:print(("communicated bytes per step (rank 0): %.0f%s"):format(total / math.max(trainer.state.step, 1),
    #parts > 0 and (" (" .. table.concat(parts, ", ") .. ")") or ""))
end

local measures = dofile(here .. "measures.lua")
local val_loss = trainer.state.metrics.val_loss
if corpus and val_loss then
  trainer:print(("bits per byte: %.4f (val loss %.4f nats/token x %d tokens / (%d bytes x ln 2))")
    :format(measures.bits_per_byte(val_loss, corpus.val), val_loss, corpus.val.tokens, corpus.val.bytes))
end

-- With a corpus the prompt is a plain English opening, "The", not the byte-level
-- "Q: ": a BPE joins a space to the word after it, so "Q: " ends in a token the
-- model seldom saw, and "Q:" leads into the fortunes' attributions and names
-- (make run's model at seeds 1-4: 78-89% dictionary words after "Q:", 97%
-- after "The", which leads into the Bible's prose).
local prompt, temperature, sample_seed = opt.prompt or (corpus and "The" or "Q: "), 0.8, 1
local prompt_ids = encode(prompt)
if opt.sample > 0 and opt.context > 1 then
  -- decoding's key/value cache holds whole sequences; the checkpoint samples at any layout (the command below)
  trainer:print(("sample: none at --context=%d (decoding runs at context 1: sample the checkpoint)"):format(opt.context))
elseif opt.sample > 0 then
  local sample = decode(pg.sample.generate(engine, prompt_ids, opt.sample,
    { temperature = temperature, seed = sample_seed }))
  trainer:print("sample:\n" .. prompt .. sample)
  local dict, why = measures.load_dictionary()
  if dict then
    local share, found, total = measures.dictionary_share(corpus and measures.without_special(sample, corpus.tokenizer)
      or sample, dict)
    if share then
      trainer:print(("dictionary words: %.1f%% (%d of the sample's %d words are in %s)")
        :format(100 * share, found, total, measures.DICTIONARY))
    end
  else
    trainer:print("dictionary words: not measured, " .. why)
  end
end

if opt.save_hf then
  engine:save_hf(opt.save_hf, { tokenizer = corpus and corpus.tokenizer or nil })
  trainer:print("exported to " .. opt.save_hf .. " (transformers' from_pretrained and pipeline() load it)")
end

-- The command that samples the final checkpoint as above (the same tokens,
-- temperature and seed; the same text from a serial float32 run), one
-- process, from the run's directory (generate.lua finds its newest checkpoint).
local function word(s) -- one shell word
  if s:match("^[%w%%+,./:=@_-]+$") then return s end
  return "'" .. s:gsub("'", "'\\''") .. "'"
end
local scripts = (here:match("^(.-)examples/$") or (here == "./" and "../") or (here .. "../")) .. "scripts/"
local cmd = { word(arg[-1] or "./pglua"), word(scripts .. "generate.lua"), "--checkpoint=" .. word(out) }
-- (generate.lua takes the text of byte-level models' prompts; a corpus's model's through the corpus's tokenizer)
if corpus then cmd[#cmd + 1] = "--tokenizer=" .. word(opt.corpus) end
cmd[#cmd + 1] = "--prompt=" .. word(prompt)
if opt.sample > 0 then
  cmd[#cmd + 1] = ("--tokens=%d --temperature=%g --seed=%d"):format(opt.sample, temperature, sample_seed)
end
trainer:print((opt.sample > 0 and "sample it again: " or "sample it: ") .. table.concat(cmd, " "))
