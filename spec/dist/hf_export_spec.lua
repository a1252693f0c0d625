-- worlds: 2
-- A tiny LLaMA trained from text with a tokenizer trained on it, at tensor = 2,
-- exported with engine:save_hf (the tokenizer included), re-imported with
-- pg.nn.from_hf in the same layout: the tokenizer comes back with it (the
-- same ids), the logits are the trained engine's bit for bit (float32: the
-- same weights through the same computation; the vocabulary padded as
-- from_hf pads it, so the shapes are the same) and so are the greedy tokens.
-- scripts/check_hf_export.py checks such an export against transformers
-- (outside CI): the same greedy ids, the tokenizer's ids, the pipeline running.
local pg = require "pipegoose"

local world = pg.world_size()
local ctx = pg.ParallelContext{ tensor = world, seed = 1 }
local me = ctx:rank()

-- A directory name every rank agrees on (rank 0's choice).
local function shared_dir()
  local t = pg.tensor({ (pg.checkpoint.getpid() * 7919 + os.time()) % 1000000007 }, { dtype = "int32" })
  pg.dist.broadcast(t, { ctx = ctx, src = 0 })
  return ("%s/pg-hf-export-dist-%d"):format(os.getenv("TMPDIR") or "/tmp", math.tointeger(t:item()))
end

local function list(v) return type(v) == "table" and v or v:totable() end

local function bits(t)
  local flat = t:reshape{ t:numel() }:totable()
  for i, x in ipairs(flat) do flat[i] = string.pack("<f", x) end
  return table.concat(flat)
end

describe("a LLaMA trained from text at T = 2, exported with its tokenizer and re-imported", function()
  it("the same tokenizer, logits bit for bit, the same greedy tokens", function()
    local lines = {}
    for i = 1, 80 do
      lines[i] = ("a small model %d reads the line %d and writes it back, line after line.\n"):format(i, i % 9)
    end
    local text = table.concat(lines)
    local text_path = os.tmpname()
    local f = assert(io.open(text_path, "w"))
    f:write(text)
    f:close()
    local tok = pg.tokenizer.train{ files = { text_path }, vocab_size = 300, special_tokens = { "<|endoftext|>" },
                                    progress = false }
    local ids = list(tok:encode_file(text_path))
    os.remove(text_path)
    local V, T, B = tok:vocab_size(), 16, 4
    local engine = pg.parallelize(pg.nn.Llama{ vocab = V, padded_vocab = (V + 63) // 64 * 64, dim = 32, heads = 4,
      kv_heads = 2, layers = 2, hidden = 64, seq_len = T }, ctx, { seed = 7 })
    local function batch(k)
      local xs, ys = {}, {}
      for b = 1, B do
        local s = ((k * B + b - 1) * T) % (#ids - T - 1)
        xs[b], ys[b] = table.move(ids, s + 1, s + T, 1, {}), table.move(ids, s + 2, s + T + 1, 1, {})
      end
      return pg.tensor(xs, { dtype = "int32" }), pg.tensor(ys, { dtype = "int32" })
    end
    local optim = pg.optim.AdamW(engine, { lr = 3e-3 })
    for k = 0, 4 do
      local x, y = batch(k)
      engine:zero_grad()
      engine:forward_backward(x, y)
      optim:step()
    end
    local dir = shared_dir()
    engine:save_hf(dir, { tokenizer = tok })
    local again = pg.parallelize(pg.nn.from_hf(dir), ctx, { seed = 99 }) -- another seed: every value from the files
    assert.is_not_nil(again.tokenizer)
    assert.same(list(tok:encode(text)), list(again.tokenizer:encode(text)))
    assert.equal(tok:eos_id(), again.tokenizer:eos_id())
    local x = batch(0)
    assert.is_true(bits(engine:forward(x)) == bits(again:forward(x)), "logits differ")
    local prompt = list(tok:encode("a small"))
    assert.same(pg.sample.generate(engine, prompt, 6), pg.sample.generate(again, prompt, 6))
    ctx:barrier()
    if me == 0 then pg.checkpoint.fs.rm_rf(dir) end
  end)
end)
