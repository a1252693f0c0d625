-- engine:save_hf writes a directory transformers' pipeline runs as it is
-- (scripts/check_hf_export.py checks that with transformers, outside CI; here
-- the files and fields it relies on): config.json with the imported fields
-- kept, real special ids, generation_config.json, the tokenizer's files,
-- bfloat16 / float16 weights, transformers' sharding, the whole directory
-- replaced at once; pg.nn.from_hf's side of it (the index, dropout, the
-- tokenizer it carries); save_llmc's refusals (export-llmc's rule).
local pg = require "pipegoose"
local h = require "helpers"
local cjson = require "cjson"
local hf = require "pipegoose.hf"

local FIX = "spec/fixtures/"

local function read_json(path) return cjson.decode(h.read(path)) end

local function write(path, text)
  local f = assert(io.open(path, "wb"))
  f:write(text)
  f:close()
end

local function mkdir(path) assert(os.execute("mkdir -p " .. h.quote(path))) end

local function files(dir)
  local out = pg.fs.list(dir)
  table.sort(out)
  return out
end

-- A copy of a fixture directory with config.json's fields edited (nil removes one: use cjson.null for null).
local function variant(fixture, edits, removed)
  local dir = h.tmpdir()
  mkdir(dir)
  assert(os.execute(("cp %s/model.safetensors %s/"):format(h.quote(fixture), h.quote(dir))))
  local cfg = read_json(fixture .. "/config.json")
  for k, v in pairs(edits or {}) do cfg[k] = v end
  for _, k in ipairs(removed or {}) do cfg[k] = nil end
  write(dir .. "/config.json", cjson.encode(cfg))
  return dir
end

-- name -> {dtype =, shape =, bytes = raw data} of a safetensors file, read
-- here (pipegoose's reader is not what is being checked, and it has no F16).
local function raw_tensors(path)
  local data = h.read(path)
  local n = string.unpack("<I8", data)
  local header = cjson.decode(data:sub(9, 8 + n))
  local out = {}
  for name, e in pairs(header) do
    if name ~= "__metadata__" then
      local a, b = math.tointeger(e.data_offsets[1]), math.tointeger(e.data_offsets[2])
      out[name] = { dtype = e.dtype, shape = table.concat(h.ints(e.shape), "x"), bytes = data:sub(9 + n + a, 8 + n + b) }
    end
  end
  return out
end

-- Every tensor of an export (single file or shards).
local function export_tensors(dir)
  local out = {}
  for _, f in ipairs(files(dir)) do
    if f:match("%.safetensors$") then
      for k, v in pairs(raw_tensors(dir .. "/" .. f)) do out[k] = v end
    end
  end
  return out
end

local function same_tensors(a, b, what)
  local n = 0
  for name, t in pairs(a) do
    n = n + 1
    assert(b[name], ("%s: %s missing"):format(what, name))
    assert(t.shape == b[name].shape and t.dtype == b[name].dtype and t.bytes == b[name].bytes,
      ("%s: %s differs"):format(what, name))
  end
  for name in pairs(b) do assert(a[name], ("%s: extra %s"):format(what, name)) end
  return n
end

-- A small text and a byte-level BPE tokenizer trained on it (<|endoftext|> is bos and eos).
local TEXT = {}
for i = 1, 60 do
  TEXT[#TEXT + 1] = ("the quick brown fox %d jumps over the lazy dog, and the dog sleeps %d times.\n"):format(i, i % 7)
end
TEXT = table.concat(TEXT)
local text_path = h.tmpdir()
write(text_path, TEXT)
local tok = pg.tokenizer.train{ files = { text_path }, vocab_size = 300, special_tokens = { "<|endoftext|>" },
                                progress = false }

local function ids_of(t, s)
  local v = t:encode(s)
  return type(v) == "table" and v or v:totable()
end

local function llama(o)
  local spec = { vocab = 300, dim = 16, heads = 2, kv_heads = 1, layers = 1, hidden = 32, seq_len = 8 }
  for k, v in pairs(o or {}) do spec[k] = v end
  return pg.parallelize(pg.nn.Llama(spec), nil, { seed = 5 })
end

local BUILT = {
  gpt2 = function() return pg.nn.GPT{ vocab = 300, dim = 16, heads = 2, layers = 1, seq_len = 8 } end,
  llama = function() return pg.nn.Llama{ vocab = 300, dim = 16, heads = 2, kv_heads = 1, layers = 1, hidden = 32,
                                         seq_len = 8 } end,
  mixtral = function() return pg.nn.Mixtral{ vocab = 300, dim = 16, heads = 2, kv_heads = 1, layers = 1, hidden = 16,
                                             experts = 2, top_k = 1, seq_len = 8 } end,
  bloom = function() return pg.nn.Bloom{ vocab = 300, dim = 16, heads = 2, layers = 1, seq_len = 8 } end,
}

local HF_SET = { "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
                 "tokenizer.json", "tokenizer_config.json" }

describe("engine:save_hf: the directory transformers' pipeline loads", function()
  for _, family in ipairs{ "gpt2", "llama", "mixtral", "bloom" } do
    it(family .. ": config.json, generation_config.json, the weights and the tokenizer's files", function()
      local e = pg.parallelize(BUILT[family](), nil, { seed = 3 })
      local dir = h.tmpdir()
      e:save_hf(dir, { tokenizer = tok })
      assert.same(HF_SET, files(dir))
      local c = read_json(dir .. "/config.json")
      local eos = tok:eos_id()
      assert.equal(0, eos) -- the only special token: id 0
      assert.equal(eos, c.bos_token_id) -- the tokenizer's, not vocab - 1
      assert.equal(eos, c.eos_token_id)
      assert.is_nil(c.pad_token_id) -- none known: not written
      assert.equal("float32", c.torch_dtype)
      assert.equal(300, c.vocab_size)
      assert.equal(0.02, c.initializer_range) -- pg.nn's init, for a model built here
      assert.equal(hf.TRANSFORMERS_VERSION, c.transformers_version)
      local g = read_json(dir .. "/generation_config.json")
      assert.same({ _from_model_config = true, bos_token_id = 0, eos_token_id = 0,
                    transformers_version = hf.TRANSFORMERS_VERSION }, g)
      local back = pg.tokenizer.load(dir)
      assert.same(ids_of(tok, TEXT), ids_of(back, TEXT))
      assert.equal(eos, back:eos_id())
      assert.equal(8, read_json(dir .. "/tokenizer_config.json").model_max_length)
      h.rm(dir)
    end)
  end

  it("the tokenizer as a path; bos/eos/pad options; a conflict with the tokenizer and a tokenizer too large refused",
    function()
    local tdir = h.tmpdir()
    mkdir(tdir)
    tok:save_pretrained(tdir)
    local e = llama()
    local dir = h.tmpdir()
    e:save_hf(dir, { tokenizer = tdir, pad_token_id = 7, generation = { do_sample = true, temperature = 0.7 } })
    local c, g = read_json(dir .. "/config.json"), read_json(dir .. "/generation_config.json")
    assert.equal(7, c.pad_token_id)
    assert.same({ _from_model_config = false, bos_token_id = 0, eos_token_id = 0, pad_token_id = 7, do_sample = true,
                  temperature = 0.7, transformers_version = hf.TRANSFORMERS_VERSION }, g)
    assert.matches("eos_token_id = 5, but the tokenizer's eos token is id 0",
      h.err_of(e.save_hf, e, dir, { tokenizer = tok, eos_token_id = 5 }), 1, true)
    local small = llama{ vocab = 100 }
    assert.matches("the tokenizer has 300 ids; the model's vocabulary is 100",
      h.err_of(small.save_hf, small, h.tmpdir(), { tokenizer = tok }), 1, true)
    -- no tokenizer, no ids: null, never vocab - 1
    local d2 = h.tmpdir()
    llama():save_hf(d2)
    c = read_json(d2 .. "/config.json")
    assert.equal(cjson.null, c.bos_token_id)
    assert.equal(cjson.null, c.eos_token_id)
    assert.same({ "config.json", "generation_config.json", "model.safetensors" }, files(d2))
    h.rm(dir); h.rm(d2); h.rm(tdir)
  end)

  it("keeps every imported field (unknown ones, non-default values) and overwrites only what pipegoose computes",
    function()
    local src = variant(FIX .. "hf_mixtral_tiny", { output_router_logits = false, router_aux_loss_coef = 0.02,
      initializer_range = 0.0123, my_field = { nested = { 1, 2, 3 }, s = "x" }, use_cache = false,
      transformers_version = "4.40.0" })
    local e = pg.parallelize(pg.nn.from_hf(src), nil, {})
    assert.equal(0, e.config.aux_loss_coef) -- transformers adds no load-balancing loss: neither does pipegoose
    local dir = h.tmpdir()
    e:save_hf(dir)
    local c = read_json(dir .. "/config.json")
    assert.equal(false, c.output_router_logits)
    assert.equal(0.02, c.router_aux_loss_coef)
    assert.equal(0.0123, c.initializer_range)
    assert.same({ nested = { 1, 2, 3 }, s = "x" }, c.my_field)
    assert.equal(false, c.use_cache)
    assert.equal("4.40.0", c.transformers_version)
    assert.equal(1, c.bos_token_id) -- the imported config's
    assert.equal(2, c.eos_token_id)
    assert.equal(61, c.vocab_size)
    assert.equal("4.40.0", read_json(dir .. "/generation_config.json").transformers_version)
    assert.same(hf.read_config(src), hf.read_config(dir))
    h.rm(dir); h.rm(src)
  end)

  it("the imported fields survive a checkpoint: scripts/checkpoint.lua export-hf writes them (and a tokenizer)",
    function()
    local src = variant(FIX .. "hf_llama_tiny", { initializer_range = 0.05, my_field = "kept" })
    local e = pg.parallelize(pg.nn.from_hf(src), nil, {})
    local ck, out = h.tmpdir(), h.tmpdir()
    local t = pg.Trainer{ engine = e, optimizer = pg.optim.AdamW(e, { lr = 1e-3 }), out = pg.testing.capture() }
    t:save_checkpoint(ck)
    local tdir = h.tmpdir()
    mkdir(tdir)
    pg.tokenizer.train{ files = { text_path }, vocab_size = 257, special_tokens = {}, progress = false }:save(tdir
      .. "/tokenizer.json")
    -- the fixture's vocabulary is 61: a 257-id tokenizer is refused by name
    local rc, text = h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", "export-hf", ck, out, "--tokenizer=" .. tdir })
    assert.equal(1, rc, text)
    assert.matches("the tokenizer has 257 ids; the model's vocabulary is 61", text, 1, true)
    rc, text = h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", "export-hf", ck, out, "--bf16" })
    assert.equal(0, rc, text)
    local c = read_json(out .. "/config.json")
    assert.equal(0.05, c.initializer_range)
    assert.equal("kept", c.my_field)
    assert.equal("bfloat16", c.torch_dtype)
    -- neither the checkpoint nor a directory inside it
    for _, target in ipairs{ ck, ck .. "/inside" } do
      rc, text = h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", "export-hf", ck, target, "--overwrite" })
      assert.equal(1, rc, text)
      assert.matches("the checkpoint", text, 1, true)
    end
    h.rm(ck); h.rm(out); h.rm(src); h.rm(tdir)
  end)
end)

-- float16 of a float32, by an algorithm of its own (not the C one): the
-- value's exponent, its mantissa in units of the float16 step there (exact:
-- a power of two), rounded half to even.
local function f16_reference(x)
  local sign = (x < 0 or 1 / x < 0) and 0x8000 or 0
  local a = math.abs(x)
  if a == 0 then return sign end
  local e = math.max(math.floor(math.log(a, 2)), -14)
  if 2.0 ^ e > a then e = e - 1 end -- log's rounding
  if 2.0 ^ (e + 1) <= a then e = e + 1 end
  e = math.max(e, -14)
  local q = a / 2.0 ^ (e - 10) -- in [1024, 2048) for a normal, below 1024 for a subnormal
  local r = math.floor(q)
  local frac = q - r
  if frac > 0.5 or (frac == 0.5 and r % 2 == 1) then r = r + 1 end
  if r == 2048 then r, e = 1024, e + 1 end
  if r < 1024 then return sign | math.tointeger(r) end -- subnormal (e = -14)
  return sign | ((e + 15) << 10) | (math.tointeger(r) - 1024)
end

local function f32(x) return string.unpack("<f", string.pack("<f", x)) end

describe("engine:save_hf's dtypes: bfloat16 and float16 weights are the masters rounded to nearest even", function()
  it("bfloat16: each value's bits are to_bf16's of the float32 export's; torch_dtype says it", function()
    local e = llama()
    local a, b = h.tmpdir(), h.tmpdir()
    e:save_hf(a)
    e:save_hf(b, { dtype = "bfloat16" })
    assert.equal("bfloat16", read_json(b .. "/config.json").torch_dtype)
    local full, half = export_tensors(a), export_tensors(b)
    local n = 0
    for name, t in pairs(full) do
      assert.equal("BF16", half[name].dtype)
      local vals = {}
      for i = 1, #t.bytes // 4 do vals[i] = string.unpack("<f", t.bytes, 4 * i - 3) end
      local want = pg.ops.to_bf16(pg.tensor(vals))
      -- bfloat16 is the upper half of float32: rounding to nearest even checked on the bits
      for i = 1, #vals do
        local bits = string.unpack("<I4", t.bytes, 4 * i - 3)
        local lower, upper = bits & 0xffff, bits >> 16
        if lower > 0x8000 or (lower == 0x8000 and upper & 1 == 1) then upper = upper + 1 end
        assert.equal(upper, string.unpack("<I2", half[name].bytes, 2 * i - 1), name)
      end
      assert.equal(#vals, want:numel())
      n = n + 1
    end
    assert.is_true(n > 0)
    h.rm(a); h.rm(b)
  end)

  it("float16: each value's bits are the reference rounding's; values past 65504 refused naming the tensor", function()
    local e = llama()
    local a, b = h.tmpdir(), h.tmpdir()
    e:save_hf(a)
    e:save_hf(b, { dtype = "float16" })
    assert.equal("float16", read_json(b .. "/config.json").torch_dtype)
    local full, half = export_tensors(a), export_tensors(b)
    for name, t in pairs(full) do
      assert.equal("F16", half[name].dtype)
      for i = 1, #t.bytes // 4 do
        local x = string.unpack("<f", t.bytes, 4 * i - 3)
        assert.equal(f16_reference(x), string.unpack("<I2", half[name].bytes, 2 * i - 1), name)
      end
    end
    -- the edges: largest, smallest subnormal, ties to even (2^-25 -> 0, 3 x 2^-25 -> 2 x 2^-24), 65519 stays finite
    local edge = { 1, -2, 65504, 65519, 2 ^ -24, 2 ^ -25, 3 * 2 ^ -25, 2 ^ -14, 1 / 3, 1 + 2 ^ -11, 1 + 3 * 2 ^ -11,
                   -0.0, 6e-8 }
    local want = { 0x3C00, 0xC000, 0x7BFF, 0x7BFF, 0x0001, 0x0000, 0x0002, 0x0400, 0x3555, 0x3C00, 0x3C02, 0x8000,
                   0x0001 }
    local bytes = pg.ops.to_f16_bytes(pg.tensor(edge))
    for i, x in ipairs(edge) do
      assert.equal(want[i], string.unpack("<I2", bytes, 2 * i - 1), ("%.17g"):format(x))
      assert.equal(want[i], f16_reference(f32(x)), "reference " .. x)
    end
    for _, bad in ipairs{ 65520, -1e6, math.huge, 0 / 0 } do
      -- elements counted from 0, as the file's
      assert.matches("w: element 1 is", h.err_of(pg.ops.to_f16_bytes, pg.tensor({ 0, bad }), "w"), 1, true)
    end
    local big = {}
    for i = 1, 16 do big[i] = i == 1 and 70000 or 1 end
    e:load_param("ln_f.weight", pg.tensor(big))
    local err = h.err_of(e.save_hf, e, h.tmpdir(), { dtype = "float16" })
    assert.matches("^model.norm.weight: element 0 is 70000.0, which float16 cannot hold", err)
    h.rm(a); h.rm(b)
  end)
end)
