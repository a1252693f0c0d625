-- Text from a checkpoint, without rebuilding the model by hand: the model is
-- rebuilt from the checkpoint's own record (pg.nn.from_config), its weights
-- loaded (pg.checkpoint.load_weights, after the checkpoint is verified), and
-- pg.sample.generate continues the prompt.
--
--   pglua scripts/generate.lua --checkpoint=DIR --prompt=TEXT [--tokens=N] [--temperature=T]
--       [--top-k=K] [--seed=S]
--
-- DIR is a checkpoint directory or the output directory of a run (its newest
-- checkpoint). Byte-level models (vocabulary 256, the default corpus) take the
-- prompt as text and print text; other models take --prompt as token ids
-- ("17,4,99") and print ids. Greedy unless --temperature > 0.
local pg = require "pipegoose"
local argparse = require "argparse"

local parser = argparse("generate.lua", "Continue a prompt with a checkpoint's model.")
parser:option("--checkpoint", "Checkpoint directory, or a run's output directory (its newest checkpoint)."):count(1)
parser:option("--prompt", "Text (byte-level models) or comma-separated token ids."):count(1)
parser:option("--tokens", "How many tokens to generate.", "200"):convert(math.tointeger)
parser:option("--temperature", "0 is greedy.", "0"):convert(tonumber)
parser:option("--top-k", "Sample among the k likeliest tokens."):convert(math.tointeger)
parser:option("--seed", "Sampling seed.", "0"):convert(math.tointeger)
local args = parser:parse()

-- The checkpoint --checkpoint names: a checkpoint directory (or one with a
-- `latest` file), else a run's output directory, whose newest checkpoint is
-- where the Trainer's resume = "last" finds it: the latest file of
-- Trainer:get_checkpoint_dir() (asked of a Trainer with that out_dir, so the
-- layout is the Trainer's own and not a copy of it here).
local function find_checkpoint(path)
  local ckpt = pg.checkpoint
  path = path:gsub("(.)/+$", "%1")
  local fs = pg.fs
  if not fs.exists(path) and not pcall(ckpt.resolve, path) then -- (resolve also finds one moved aside mid-save)
    error(("generate: --checkpoint=%s: no such directory"):format(path), 0)
  end
  if not fs.is_dir(path) or fs.exists(path .. "/" .. ckpt.MANIFEST) or fs.exists(path .. "/" .. ckpt.LATEST) then
    return ckpt.resolve(path) -- a checkpoint, or resolve's own message for what is wrong with it
  end
  local run_checkpoints = pg.Trainer{ out_dir = path }:get_checkpoint_dir()
  if ckpt.latest(run_checkpoints) then return ckpt.resolve(run_checkpoints) end
  error(("generate: %s holds no checkpoint: it is not one (no %s) and, as a run's output directory, has none in %s "
    .. "(a run saves them with pg.callbacks.ModelCheckpoint; examples/train_gpt.lua keeps its final one)")
    :format(path, ckpt.MANIFEST, run_checkpoints), 0)
end

local dir = find_checkpoint(args.checkpoint)
local manifest = pg.checkpoint.read_manifest(dir)
local ok, model = pcall(pg.nn.from_config, manifest.model)
if not ok then error(dir .. ": cannot rebuild the model from its record: " .. tostring(model), 0) end
local engine = pg.parallelize(model, nil, {})
pg.checkpoint.load_weights(engine, dir)

local bytes = engine.config.vocab == 256
local prompt
if bytes then
  prompt = pg.data.bytes.encode(args.prompt)
else
  prompt = {}
  for id in args.prompt:gmatch("[^,%s]+") do
    prompt[#prompt + 1] = math.tointeger(tonumber(id)) or error(("--prompt: '%s' is not a token id"):format(id), 0)
  end
end
local out = pg.sample.generate(engine, prompt, args.tokens,
  { temperature = args.temperature, top_k = args.top_k, seed = args.seed })
if bytes then
  io.write(args.prompt, pg.data.bytes.decode(out), "\n")
else
  io.write(table.concat(out, ","), "\n")
end
