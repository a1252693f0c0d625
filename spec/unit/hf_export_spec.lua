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
      out[name] = { dtype = e.dtype, shape = table.concat(h.ints(e.shape), "x"),
                    bytes = data:sub(9 + n + a, 8 + n + b) }
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
    -- a Mixtral whose head_dim transformers would not use (it takes hidden_size / heads)
    local odd = pg.parallelize(pg.nn.Mixtral{ vocab = 64, dim = 16, heads = 2, kv_heads = 1, head_dim = 4, layers = 1,
      hidden = 16, experts = 2, top_k = 1, seq_len = 8 }, nil, {})
    assert.matches("the Mixtral's head_dim 4 is not hidden_size / heads = 16 / 2", h.err_of(odd.save_hf, odd,
      h.tmpdir()), 1, true)
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
    rc, text = h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", "export-hf", ck, out, "--f16", "--max-shard-size=9000" })
    assert.equal(0, rc, text)
    assert.equal("float16", read_json(out .. "/config.json").torch_dtype)
    assert.is_not_nil(read_json(out .. "/model.safetensors.index.json").weight_map["model.norm.weight"])
    rc, text = h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", "export-hf", ck, out, "--bf16" })
    assert.equal(0, rc, text)
    assert.same({ "config.json", "generation_config.json", "model.safetensors" }, files(out)) -- no shard left
    local c = read_json(out .. "/config.json")
    assert.equal(0.05, c.initializer_range)
    assert.equal("kept", c.my_field)
    assert.equal("bfloat16", c.torch_dtype)
    -- where the model came from is not what it computes: a resume with a model built by hand is not refused
    assert.is_nil(pg.checkpoint.config_difference({ hf_config = "{}", dim = 8 }, { dim = 8 }))
    assert.is_not_nil(pg.checkpoint.config_difference({ dim = 8 }, { dim = 16 }))
    rc, text = h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", "info", ck })
    assert.equal(0, rc, text)
    assert.matches("hf_config=<config.json, %d+ bytes>", text)
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
  it("the default: bfloat16 for an engine of precision bf16, float32 else", function()
    local e = pg.parallelize(BUILT.llama(), nil, { seed = 5, precision = "bf16" })
    local dir = h.tmpdir()
    e:save_hf(dir)
    assert.equal("bfloat16", read_json(dir .. "/config.json").torch_dtype)
    assert.equal("BF16", raw_tensors(dir .. "/model.safetensors")["model.norm.weight"].dtype)
    h.rm(dir)
  end)

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
    local file = h.tmpfile("", ".safetensors")
    require("pipegoose.safetensors").write(file, { { name = "x", tensor = pg.ops.to_f16(pg.tensor(edge)) } })
    local bytes = h.safetensors_tensors(file).x.bytes
    os.remove(file)
    for i, x in ipairs(edge) do
      assert.equal(want[i], string.unpack("<I2", bytes, 2 * i - 1), ("%.17g"):format(x))
      assert.equal(want[i], f16_reference(f32(x)), "reference " .. x)
    end
    for _, bad in ipairs{ 65520, -1e6, math.huge, 0 / 0 } do
      -- elements counted from 0, as the file's
      assert.matches("w: element 1 is", h.err_of(pg.ops.to_f16, pg.tensor({ 0, bad }), "w"), 1, true)
    end
    local big = {}
    for i = 1, 16 do big[i] = i == 1 and 70000 or 1 end
    e:load_param("ln_f.weight", pg.tensor(big))
    local err = h.err_of(e.save_hf, e, h.tmpdir(), { dtype = "float16" })
    assert.matches("^model.norm.weight: element 0 is 70000.0, which float16 cannot hold", err)
    h.rm(a); h.rm(b)
  end)
end)

-- the file set and every file's bytes of a directory
local function snapshot(dir)
  local out = {}
  for _, f in ipairs(files(dir)) do out[f] = h.read(dir .. "/" .. f) end
  return out
end

-- every parameter's values; the vocabulary's rows only (from_hf pads them to a multiple of 64, pg.nn.Llama{} not)
local function params_of(e)
  local out = {}
  for _, p in ipairs(e:parameters()) do
    local t = p.tensor
    if p.name == "embed.wte" or p.name == "head.weight" then t = t:narrow(1, 1, e.config.vocab):clone() end
    out[p.name] = t:reshape{ t:numel() }:totable() -- compared with ==: the same floats
  end
  return out
end

describe("engine:save_hf's shards and the directory replaced whole", function()
  it("max_shard_size: transformers' shard names, an index with total_size and every tensor; from_hf reloads it",
    function()
    local e = llama()
    local dir = h.tmpdir()
    -- the largest tensors (embed_tokens, lm_head: 300 x 16 floats = 19200 bytes) fit; several shards
    e:save_hf(dir, { max_shard_size = 20000, tokenizer = tok })
    local names = files(dir)
    local shards = {}
    for _, f in ipairs(names) do if f:match("^model%-") then shards[#shards + 1] = f end end
    assert.is_true(#shards >= 3, table.concat(names, " "))
    for i, f in ipairs(shards) do assert.equal(("model-%05d-of-%05d.safetensors"):format(i, #shards), f) end
    assert.is_nil(pg.fs.exists(dir .. "/model.safetensors") and true or nil)
    local index = read_json(dir .. "/model.safetensors.index.json")
    local total, mapped = 0, 0
    for _, f in ipairs(shards) do
      assert.is_true(#h.read(dir .. "/" .. f) <= 20000 + 4096, f) -- the data under the limit, plus its header
      for name, t in pairs(raw_tensors(dir .. "/" .. f)) do
        total = total + #t.bytes
        assert.equal(f, index.weight_map[name], name)
        mapped = mapped + 1
      end
    end
    local n = 0
    for _ in pairs(index.weight_map) do n = n + 1 end
    assert.equal(n, mapped)
    assert.equal(total, index.metadata.total_size)
    local again = pg.parallelize(pg.nn.from_hf(dir), nil, { seed = 77 })
    assert.same(params_of(e), params_of(again))
    assert.is_not_nil(again.tokenizer)
    assert.same(ids_of(tok, TEXT), ids_of(again.tokenizer, TEXT))
    -- a max_shard_size below one tensor: refused naming it (transformers would write a larger shard than asked)
    local err = h.err_of(e.save_hf, e, h.tmpdir(), { max_shard_size = "10KB" })
    assert.matches("model.embed_tokens.weight is 19200 bytes, more than max_shard_size (10000 bytes)", err, 1, true)
    assert.matches("max_shard_size must be", h.err_of(e.save_hf, e, dir, { max_shard_size = "5 parsecs" }), 1, true)
    assert.equal(5 * 10 ^ 9, hf.shard_bytes("5GB"))
    assert.equal(2 * 2 ^ 30, hf.shard_bytes("2GiB"))
    h.rm(dir)
  end)

  it("re-saving over a sharded export leaves exactly the new files; from_hf reads the new weights", function()
    local e = llama()
    local parent = h.tmpdir()
    mkdir(parent)
    local dir = parent .. "/export"
    e:save_hf(dir, { max_shard_size = 20000 })
    -- new weights, one file
    local w = {}
    for i = 1, 16 do w[i] = i / 8 end
    e:load_param("ln_f.weight", pg.tensor(w))
    e:save_hf(dir, { tokenizer = tok })
    assert.same(HF_SET, files(dir))
    assert.same({ "export" }, files(parent)) -- nothing left beside it
    local again = pg.parallelize(pg.nn.from_hf(dir), nil, { seed = 77 })
    assert.same(params_of(e), params_of(again))
    assert.same(w, again:parameter("ln_f.weight").tensor:totable())
    h.rm(parent)
  end)

  it("a failure while writing leaves the old directory whole, and nothing beside it", function()
    local e = llama()
    local parent = h.tmpdir()
    mkdir(parent)
    local dir = parent .. "/export"
    e:save_hf(dir, { max_shard_size = 20000, tokenizer = tok })
    local before = snapshot(dir)
    local big = {}
    for i = 1, 16 do big[i] = i == 16 and 1e6 or 1 end
    e:load_param("ln_f.weight", pg.tensor(big))
    -- float16 cannot hold 1e6: the tensors are converted before any file is written
    assert.matches("model.norm.weight: element 15 is", h.err_of(e.save_hf, e, dir, { dtype = "float16" }), 1, true)
    assert.same(before, snapshot(dir))
    assert.same({ "export" }, files(parent))
    -- a shard limit below a tensor: refused before the swap too
    h.err_of(e.save_hf, e, dir, { max_shard_size = 1000 })
    assert.same(before, snapshot(dir))
    -- a tokenizer that cannot be written (its save fails inside the new directory): the old one stays
    local broken = setmetatable({ save_pretrained = function() error("disk full (injected)", 0) end },
      { __index = tok })
    assert.matches("disk full (injected)", h.err_of(e.save_hf, e, dir, { tokenizer = broken }), 1, true)
    assert.same(before, snapshot(dir))
    assert.same({ "export" }, files(parent))
    h.rm(parent)
  end)

  it("pg.fs.exchange swaps two directories in one step (the swap save_hf makes); a missing one is named", function()
    local a, b = h.tmpdir(), h.tmpdir()
    mkdir(a); mkdir(b)
    write(a .. "/A", "a")
    write(b .. "/B", "b")
    assert.is_true(pg.fs.exchange(a, b))
    assert.same({ "B" }, files(a))
    assert.same({ "A" }, files(b))
    local ok, why = pg.fs.exchange(a, a .. "-missing")
    assert.is_nil(ok)
    assert.matches(a .. "-missing: No such file or directory", why, 1, true)
    h.rm(a); h.rm(b)
  end)

  it("refuses a directory that is not a Hugging Face one unless overwrite; never the source's parent", function()
    local e = llama()
    local dir = h.tmpdir()
    mkdir(dir)
    write(dir .. "/notes.txt", "mine")
    local err = h.err_of(e.save_hf, e, dir)
    assert.matches("is not empty nor a Hugging Face model directory (it holds notes.txt)", err, 1, true)
    assert.matches("overwrite = true", err, 1, true)
    assert.equal("mine", h.read(dir .. "/notes.txt"))
    e:save_hf(dir, { overwrite = true })
    assert.same({ "config.json", "generation_config.json", "model.safetensors" }, files(dir))
    local deep = h.tmpdir()
    e:save_hf(deep .. "/a/b") -- missing parents are made
    assert.same({ "config.json", "generation_config.json", "model.safetensors" }, files(deep .. "/a/b"))
    h.rm(deep)
    local file = h.tmpdir()
    write(file, "x")
    assert.matches("exists and is not a directory", h.err_of(e.save_hf, e, file), 1, true)
    -- the directory a model was imported from: over itself is fine (its tensors were read when the engine was
    -- built; the new directory is whole before the swap), a directory above it is not, even with overwrite
    local parent = h.tmpdir()
    mkdir(parent)
    local src = parent .. "/src"
    llama():save_hf(src, { tokenizer = tok })
    local imported = pg.parallelize(pg.nn.from_hf(src), nil, {})
    assert.matches("would remove the model's source " .. src,
      h.err_of(imported.save_hf, imported, parent, { overwrite = true }), 1, true)
    imported:save_hf(src, { dtype = "bfloat16" })
    assert.equal("bfloat16", read_json(src .. "/config.json").torch_dtype)
    assert.same(HF_SET, files(src)) -- the tokenizer it carried written again without being told
    h.rm(dir); h.rm(file); h.rm(parent)
  end)
end)

describe("pg.nn.from_hf: what transformers' from_pretrained reads", function()
  it("model.safetensors beside an index: the single file, as transformers", function()
    local e = llama()
    local dir = h.tmpdir()
    e:save_hf(dir, { max_shard_size = 20000 })
    local other = llama{ rope_theta = 10000 }
    local w = {}
    for i = 1, 16 do w[i] = -i end
    other:load_param("ln_f.weight", pg.tensor(w))
    local single = h.tmpdir()
    other:save_hf(single)
    assert(os.execute(("cp %s/model.safetensors %s/"):format(h.quote(single), h.quote(dir))))
    local got = pg.parallelize(pg.nn.from_hf(dir), nil, {})
    assert.same(w, got:parameter("ln_f.weight").tensor:totable())
    h.rm(dir); h.rm(single)
  end)

  it("an index's weight_map: not an object, a path outside the directory, a missing shard: refused by name",
    function()
    local e = llama()
    local dir = h.tmpdir()
    e:save_hf(dir, { max_shard_size = 20000 })
    local path = dir .. "/model.safetensors.index.json"
    local index = read_json(path)
    local function with(map)
      write(path, cjson.encode{ metadata = index.metadata, weight_map = map })
      return h.err_of(function() pg.parallelize(pg.nn.from_hf(dir), nil, {}) end)
    end
    assert.matches('weight_map must be an object (tensor name -> file), got "model-00001-of-00002.safetensors"',
      with("model-00001-of-00002.safetensors"), 1, true)
    assert.matches('weight_map must be an object (tensor name -> file), got ["a","b"]', with({ "a", "b" }), 1, true)
    for _, bad in ipairs{ "../x.safetensors", "/etc/passwd", "sub/x.safetensors", ".." } do
      local map = {}
      for k, v in pairs(index.weight_map) do map[k] = v end
      map["model.norm.weight"] = bad
      assert.matches(('weight_map["model.norm.weight"] = "%s" is not a file name in the directory'):format(bad),
        with(map), 1, true)
    end
    local map = {}
    for k, v in pairs(index.weight_map) do map[k] = v end
    map["model.norm.weight"] = "model-00009-of-00009.safetensors"
    assert.matches("weight_map puts model.norm.weight in model-00009-of-00009.safetensors, which is missing",
      with(map), 1, true)
    h.rm(dir)
  end)

  it("dropout: refused by name, with how to train without it; ignored, the export writes it back as read", function()
    local cases = {
      { FIX .. "hf_gpt2_tiny", { resid_pdrop = 0.1 }, {}, "resid_pdrop = 0.1" },
      -- absent: GPT2Config's default, 0.1
      { FIX .. "hf_gpt2_tiny", {}, { "attn_pdrop" }, "attn_pdrop = 0.1" },
      { FIX .. "hf_llama_tiny", { attention_dropout = 0.05 }, {}, "attention_dropout = 0.05" },
      { FIX .. "hf_mixtral_tiny", { attention_dropout = 0.2 }, {}, "attention_dropout = 0.2" },
      { FIX .. "hf_bloom_tiny", { hidden_dropout = 0.1, attention_dropout = 0.1 }, {},
        "attention_dropout = 0.1, hidden_dropout = 0.1" },
    }
    for _, c in ipairs(cases) do
      local src = variant(c[1], c[2], c[3])
      local err = h.err_of(pg.nn.from_hf, src)
      assert.matches("config.json: " .. c[4] .. ": pipegoose has no dropout", err, 1, true)
      assert.matches('pg.nn.from_hf(dir, { dropout = "ignore" })', err, 1, true)
      local e = pg.parallelize(pg.nn.from_hf(src, { dropout = "ignore" }), nil, {})
      local dir = h.tmpdir()
      e:save_hf(dir)
      local got, want = read_json(dir .. "/config.json"), read_json(src .. "/config.json")
      for k, v in pairs(c[2]) do assert.equal(v, got[k], k) end
      for _, k in ipairs(c[3]) do assert.is_nil(got[k], k) end -- absent stays absent (transformers' default: 0.1)
      assert.equal(want.vocab_size, got.vocab_size)
      h.rm(dir); h.rm(src)
    end
    assert.matches("dropout must be", h.err_of(pg.nn.from_hf, FIX .. "hf_gpt2_tiny", { dropout = "drop" }), 1, true)
  end)
end)

describe("engine:save_llmc refuses what scripts/checkpoint.lua export-llmc refuses (llmc.refusal)", function()
  local llmc = require "pipegoose.llmc"
  for _, c in ipairs{
    { "an MLP not 4 x dim", function() return pg.nn.GPT{ vocab = 64, dim = 16, heads = 2, layers = 1, seq_len = 8,
                                                         hidden = 48 } end, "the MLP is 48 wide" },
    { "an untied head", function() return pg.nn.GPT{ vocab = 64, dim = 16, heads = 2, layers = 1, seq_len = 8,
                                                     tie = false } end, "the head is not tied" },
    { "a LLaMA", BUILT.llama, "llm.c's format holds GPT-2 models only" },
  } do
    it(c[1], function()
      local e = pg.parallelize(c[2](), nil, {})
      local why = llmc.refusal(e.config)
      assert.matches(c[3], why, 1, true)
      local path = h.tmpdir()
      assert.matches("save_llmc: " .. why, h.err_of(e.save_llmc, e, path), 1, true)
      assert.is_false(pg.fs.exists(path))
      -- export-llmc of a checkpoint of the same model: the same reason
      local ck = h.tmpdir()
      pg.Trainer{ engine = e, optimizer = pg.optim.AdamW(e, { lr = 1e-3 }), out = pg.testing.capture() }
        :save_checkpoint(ck)
      local rc, text = h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", "export-llmc", ck, path })
      assert.equal(1, rc, text)
      assert.matches(why, text, 1, true)
      h.rm(ck)
    end)
  end
end)

describe("fine-tuning an imported model on text with its own tokenizer", function()
  it("each step's loss is the original model's, bit for bit (the same weights, the same computation)", function()
    -- the vocabulary padded as from_hf pads it: the same shapes, so the same computation
    local original = llama{ padded_vocab = 320 }
    local dir = h.tmpdir()
    original:save_hf(dir, { tokenizer = tok })
    local imported = pg.parallelize(pg.nn.from_hf(dir), nil, { seed = 123 })
    local ids = ids_of(imported.tokenizer, TEXT)
    assert.same(ids_of(tok, TEXT), ids)
    local function batch(k)
      local xs, ys = {}, {}
      for b = 1, 2 do
        local s = (k * 2 + b - 1) * 8
        xs[b], ys[b] = table.move(ids, s + 1, s + 8, 1, {}), table.move(ids, s + 2, s + 9, 1, {})
      end
      return pg.tensor(xs, { dtype = "int32" }), pg.tensor(ys, { dtype = "int32" })
    end
    local oa = pg.optim.AdamW(original, { lr = 1e-2 })
    local ob = pg.optim.AdamW(imported, { lr = 1e-2 })
    local first
    for k = 0, 3 do
      local x, y = batch(k)
      original:zero_grad()
      imported:zero_grad()
      local la, lb = original:forward_backward(x, y), imported:forward_backward(x, y)
      assert.equal(string.pack("<d", la), string.pack("<d", lb), "step " .. k)
      first = first or la
      oa:step()
      ob:step()
    end
    local x, y = batch(0)
    assert.is_true(imported:loss(x, y) < first) -- and it learnt
    h.rm(dir)
  end)
end)
