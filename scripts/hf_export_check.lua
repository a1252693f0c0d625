-- Trains a tiny model from text with a tokenizer trained on that text, exports
-- it with engine:save_hf (the tokenizer included) and writes what transformers
-- must reproduce; with --reimport also checks pipegoose's own round trip.
--
--   pglua scripts/hf_export_check.lua --text=FILE --out=DIR [--family=llama] [--steps=20] [--dtype=float32]
--         [--expect=FILE] [--reimport] [--max-shard-size=SIZE]
--   scripts/mpirun.sh -np 2 pglua scripts/hf_export_check.lua ... --tensor=2
--
-- --expect: a JSON file for scripts/check_hf_export.py: the prompt's text and
-- ids, the greedy ids pg.sample.generate gives after it (--new tokens, no
-- stop at EOS), a sample text and pipegoose's ids of it, the dtype written.
-- --reimport: pg.nn.from_hf(out) in the same layout: its tokenizer's ids of
-- the text equal the trained one's, its logits equal the trained engine's
-- bit for bit (float32: the same weights through the same computation), its
-- greedy ids the same; prints "reimport: logits bitwise equal, greedy equal".
local pg = require "pipegoose"
local cjson = require "cjson"
local argparse = require "argparse"

local p = argparse("hf_export_check.lua", "Train a tiny model from text, export it for transformers.")
local function to_int(s) return math.tointeger(tonumber(s)) end
p:option("--text", "The training text (the tokenizer is trained on it too).")
p:option("--out", "The export directory.")
p:option("--family", "llama, gpt2, bloom or mixtral.", "llama")
p:option("--steps", "AdamW steps.", "20"):convert(to_int)
p:option("--vocab", "The tokenizer's vocabulary size.", "300"):convert(to_int)
p:option("--dtype", "The export's dtype.", "float32")
p:option("--max-shard-size", "save_hf's max_shard_size.")
p:option("--new", "Greedy tokens generated.", "12"):convert(to_int)
p:option("--tensor", "Tensor-parallel size.", "1"):convert(to_int)
p:option("--expect", "Write the expectations there.")
p:flag("--reimport", "Re-import the export and compare.")
local o = p:parse()
assert(o.text and o.out, "--text and --out are needed")

local ctx = pg.ParallelContext{ tensor = o.tensor, seed = 1 }
local rank0 = ctx:rank() == 0
local tok = pg.tokenizer.train{ files = { o.text }, vocab_size = o.vocab, special_tokens = { "<|endoftext|>" },
                                progress = false }
local function list(v) return type(v) == "table" and v or v:totable() end -- encode's ids, or a tensor's
local ids = list(tok:encode_file(o.text))
-- the vocabulary padded as from_hf pads it (a multiple of 64), so that the re-imported engine has the same
-- shapes and computes the same way: bit for bit
local V, T, B = tok:vocab_size(), 32, 4
local PV = (V + 63) // 64 * 64
local common = { vocab = V, padded_vocab = PV, dim = 64, heads = 4, layers = 2, seq_len = T }
local function with(extra)
  local spec = {}
  for k, v in pairs(common) do spec[k] = v end
  for k, v in pairs(extra) do spec[k] = v end
  return spec
end
local shapes = {
  llama = function() return pg.nn.Llama(with{ kv_heads = 2, hidden = 128 }) end,
  mixtral = function() return pg.nn.Mixtral(with{ kv_heads = 2, hidden = 64, experts = 4, top_k = 2 }) end,
  gpt2 = function() return pg.nn.GPT(with{}) end,
  bloom = function() return pg.nn.Bloom(with{}) end,
}
local engine = pg.parallelize(assert(shapes[o.family], "unknown --family")(), ctx, { seed = 7 })

-- batch k: B windows of T + 1 tokens, consecutive, wrapping around the text
local function batch(k)
  local xs, ys = {}, {}
  for b = 1, B do
    local start = ((k * B + b - 1) * T) % (#ids - T - 1)
    xs[b], ys[b] = table.move(ids, start + 1, start + T, 1, {}), table.move(ids, start + 2, start + T + 1, 1, {})
  end
  return pg.tensor(xs, { dtype = "int32" }), pg.tensor(ys, { dtype = "int32" })
end

local optim = pg.optim.AdamW(engine, { lr = 3e-3, weight_decay = 0 })
for step = 0, o.steps - 1 do
  local x, y = batch(step)
  engine:zero_grad()
  local loss = engine:forward_backward(x, y)
  optim:step()
  if rank0 and (step == 0 or step == o.steps - 1) then print(("step %d loss %.6f"):format(step, loss)) end
end
engine:save_hf(o.out, { tokenizer = tok, dtype = o.dtype,
  max_shard_size = o.max_shard_size and (to_int(o.max_shard_size) or o.max_shard_size) or nil })

local prompt_text = "The "
local prompt = list(tok:encode(prompt_text))
local new = pg.sample.generate(engine, prompt, o.new)
local sample = "Some text, to compare the tokenizers: 1234 and more.\nA second line."
if rank0 and o.expect then
  local f = assert(io.open(o.expect, "w"))
  f:write(cjson.encode{ prompt = prompt_text, prompt_ids = prompt, new_ids = new, sample_text = sample,
                        sample_ids = list(tok:encode(sample)), dtype = o.dtype, family = o.family })
  f:close()
end
if rank0 then print("greedy " .. table.concat(new, " ")) end

if o.reimport then
  local model = pg.nn.from_hf(o.out)
  local again = pg.parallelize(model, ctx, { seed = 99 }) -- another seed: every value must come from the files
  assert(again.tokenizer, "the re-imported engine has no tokenizer")
  local a, b = list(tok:encode(sample)), list(again.tokenizer:encode(sample))
  assert(table.concat(a, " ") == table.concat(b, " "), "the re-imported tokenizer's ids differ")
  assert(again.tokenizer:eos_id() == tok:eos_id(), "the re-imported tokenizer's eos differs")
  local x = batch(0)
  local l1, l2 = engine:forward(x), again:forward(x)
  local d1, d2 = l1:reshape{ l1:numel() }:totable(), l2:reshape{ l2:numel() }:totable()
  local bitwise = #d1 == #d2
  for i = 1, #d1 do
    if string.pack("<f", d1[i]) ~= string.pack("<f", d2[i]) then bitwise = false; break end
  end
  local new2 = pg.sample.generate(again, prompt, o.new)
  local greedy = table.concat(new, " ") == table.concat(new2, " ")
  if rank0 then
    print(("reimport: logits %s, greedy %s"):format(bitwise and "bitwise equal" or "DIFFER",
      greedy and "equal" or "DIFFER"))
  end
  os.exit((bitwise and greedy) and 0 or 1)
end
