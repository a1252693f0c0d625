-- Hugging Face interop (lua/pipegoose/hf.lua) against transformers' own files
-- and numbers: spec/fixtures/hf_gpt2_tiny is a random GPT2LMHeadModel (odd
-- vocabulary 61, LayerNorms and biases perturbed) that transformers 4.45.2
-- saved, with its loss on a 4 x 17 batch (scripts/hf_reference.py make).
-- Tolerance: 1e-5 relative on the loss (measured: 1e-7). Written files are
-- compared bit for bit with transformers' file.
local pg = require "pipegoose"
local h = require "helpers"
local cjson = require "cjson"
local safetensors = require "pipegoose.safetensors"

local FIXTURE = "spec/fixtures/hf_gpt2_tiny"

local function expected()
  local f = assert(io.open(FIXTURE .. "/expected.json"))
  local e = cjson.decode(f:read("a"))
  f:close()
  return e
end

local function loss_of(dir)
  local e = expected()
  local engine = pg.parallelize(pg.nn.from_hf(dir), nil, { seed = 7 })
  local all = pg.tensor(e.tokens, { dtype = "int32" })
  local T = all:shape()[2] - 1
  return engine:loss(all:narrow(2, 1, T), all:narrow(2, 2, T)), engine
end

local tensors_of = h.safetensors_tensors

local function copy_file(from, to)
  local f = assert(io.open(from, "rb"))
  local data = f:read("a")
  f:close()
  f = assert(io.open(to, "wb"))
  f:write(data)
  f:close()
end

-- A model directory with config.json (edited by `edit`) and tensors written by `write(dir)`.
local function model_dir(edit, write)
  local dir = h.tmpdir()
  os.execute("mkdir -p " .. h.quote(dir))
  local f = assert(io.open(FIXTURE .. "/config.json"))
  local cfg = cjson.decode(f:read("a"))
  f:close()
  if edit then edit(cfg) end
  f = assert(io.open(dir .. "/config.json", "w"))
  f:write(cjson.encode(cfg))
  f:close()
  if write then write(dir) else copy_file(FIXTURE .. "/model.safetensors", dir .. "/model.safetensors") end
  return dir
end

-- The fixture's tensors, renamed by rename(name) (nil drops one), as safetensors entries.
local function entries(rename)
  local hd = safetensors.read_header(FIXTURE .. "/model.safetensors")
  local out = {}
  for _, name in ipairs(hd.names) do
    local new = rename(name)
    if new then out[#out + 1] = { name = new, tensor = safetensors.read(hd, name) } end
  end
  return out
end

describe("pg.nn.from_hf / engine:save_hf (GPT2LMHeadModel)", function()
  it("reads transformers' config into the GPT options, vocabulary padded to a multiple of 64", function()
    local o = require("pipegoose.hf").read_config(FIXTURE)
    assert.same({ vocab = 61, padded_vocab = 64, seq_len = 16, dim = 32, heads = 4, layers = 2, hidden = 128,
                  tie = true }, o)
  end)

  it("computes transformers' loss from transformers' file", function()
    local loss = loss_of(FIXTURE)
    local want = expected().loss
    assert.is_true(math.abs(loss - want) <= 1e-5 * want, ("loss %.9g, transformers %.9g"):format(loss, want))
  end)

  it("writes back transformers' tensors bit for bit, and a config that reads back the same", function()
    local _, engine = loss_of(FIXTURE)
    local out = h.tmpdir()
    engine:save_hf(out)
    local want, got = tensors_of(FIXTURE .. "/model.safetensors"), tensors_of(out .. "/model.safetensors")
    local n = 0
    for name, t in pairs(want) do
      n = n + 1
      assert.is_not_nil(got[name], "missing " .. name)
      assert.equal(t.shape, got[name].shape, name)
      assert.is_true(t.bytes == got[name].bytes, name .. " differs")
    end
    for name in pairs(got) do assert.is_not_nil(want[name], "extra tensor " .. name) end
    assert.equal(28, n)
    local hf = require "pipegoose.hf"
    assert.same(hf.read_config(FIXTURE), hf.read_config(out))
    h.rm(out)
  end)

  it("loads and saves transformers' bits in every layout (T = 2, P = 2, D = 2), and trains there as serially", function()
    local function final_loss(out) return tonumber(out:match("final loss (%S+)")) end
    local serial_dir = h.tmpdir()
    local rc, out = h.sh(h.pglua_cmd{ "scripts/hf_check.lua", FIXTURE, "--steps=2", "--save-hf=" .. serial_dir })
    assert.equal(0, rc, out)
    local serial = final_loss(out)
    h.rm(serial_dir)
    local want = tensors_of(FIXTURE .. "/model.safetensors")
    for _, layout in ipairs{ "--tensor=2", "--pipeline=2", "--data=2" } do
      local dir = h.tmpdir()
      rc, out = h.sh(h.mpirun_cmd(2, { "scripts/hf_check.lua", FIXTURE, layout, "--save-hf=" .. dir }, 120))
      assert.equal(0, rc, out)
      local got = tensors_of(dir .. "/model.safetensors")
      for name, t in pairs(want) do assert.is_true(t.bytes == got[name].bytes, layout .. ": " .. name .. " differs") end
      h.rm(dir)
      -- two AdamW steps: the final loss as the serial run's, to 1e-5 relative
      rc, out = h.sh(h.mpirun_cmd(2, { "scripts/hf_check.lua", FIXTURE, layout, "--steps=2", "--save-hf=" .. dir }, 120))
      assert.equal(0, rc, out)
      local loss = final_loss(out)
      assert.is_true(math.abs(loss - serial) <= 1e-5 * serial, ("%s: final loss %.9g, serial %.9g"):format(layout, loss,
        serial))
      h.rm(dir)
    end
  end)

  it("reads names without the transformer. prefix (the hub's gpt2) and the sharded index form", function()
    local bare = model_dir(nil, function(dir)
      safetensors.write(dir .. "/model.safetensors", entries(function(n) return (n:gsub("^transformer%.", "")) end))
    end)
    local sharded = model_dir(nil, function(dir)
      local first, second, map = {}, {}, {}
      for _, e in ipairs(entries(function(n) return n end)) do
        local part = e.name:find("%.h%.1%.") and second or first
        part[#part + 1] = e
        map[e.name] = part == first and "model-00001-of-00002.safetensors" or "model-00002-of-00002.safetensors"
      end
      safetensors.write(dir .. "/model-00001-of-00002.safetensors", first)
      safetensors.write(dir .. "/model-00002-of-00002.safetensors", second)
      local f = assert(io.open(dir .. "/model.safetensors.index.json", "w"))
      f:write(cjson.encode({ metadata = {}, weight_map = map }))
      f:close()
    end)
    local want = loss_of(FIXTURE)
    assert.equal(want, (loss_of(bare)))
    assert.equal(want, (loss_of(sharded)))
    h.rm(bare)
    h.rm(sharded)
  end)

  it("exports a checkpoint as transformers' file (scripts/checkpoint.lua export-hf), bit for bit", function()
    local ck, out = h.tmpdir(), h.tmpdir()
    local engine = pg.parallelize(pg.nn.from_hf(FIXTURE), nil, {})
    local t = pg.Trainer{ engine = engine, optimizer = pg.optim.AdamW(engine, { lr = 1e-3 }), out = pg.testing.capture() }
    t:save_checkpoint(ck)
    local rc, text = h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", "export-hf", ck, out })
    assert.equal(0, rc, text)
    assert.matches("wrote " .. out .. ": a Hugging Face directory (GPT2LMHeadModel)", text, 1, true)
    local want, got = tensors_of(FIXTURE .. "/model.safetensors"), tensors_of(out .. "/model.safetensors")
    for name, x in pairs(want) do assert.is_true(x.bytes == got[name].bytes, name .. " differs") end
    h.rm(ck)
    h.rm(out)
  end)

  it("reads an untied head (lm_head.weight) and writes it back", function()
    local dir = model_dir(function(cfg) cfg.tie_word_embeddings = false end, function(d)
      local list = entries(function(n) return n end)
      local wte
      for _, e in ipairs(list) do if e.name == "transformer.wte.weight" then wte = e.tensor end end
      list[#list + 1] = { name = "lm_head.weight", tensor = wte:scale(0.5) }
      safetensors.write(d .. "/model.safetensors", list)
    end)
    local _, engine = loss_of(dir)
    local head = engine:parameter("head.weight")
    assert.is_not_nil(head, "an untied head is its own parameter")
    local out = h.tmpdir()
    engine:save_hf(out)
    local a, b = tensors_of(dir .. "/model.safetensors"), tensors_of(out .. "/model.safetensors")
    assert.is_true(a["lm_head.weight"].bytes == b["lm_head.weight"].bytes)
    h.rm(out)
    h.rm(dir)
  end)

  local function refused(edit, write, pattern)
    local dir = model_dir(edit, write)
    local ok, err = pcall(pg.nn.from_hf, dir)
    if ok then
      ok, err = pcall(pg.parallelize, err, nil, {})
    end
    h.rm(dir)
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find(pattern, 1, true), tostring(err))
  end

  it("refuses what it does not compute, naming the file and the field", function()
    refused(function(c) c.model_type = "bert" end, nil, "model_type is bert; pipegoose reads GPT2LMHeadModel")
    refused(function(c) c.activation_function = "relu" end, nil, "activation_function relu is not supported")
    refused(function(c) c.layer_norm_epsilon = 1e-6 end, nil, "layer_norm_epsilon 1e-06 is not supported")
    refused(function(c) c.n_head = 0 end, nil, "n_head must be a positive integer")
    refused(function(c) c.scale_attn_by_inverse_layer_idx = true end, nil, "scale_attn_by_inverse_layer_idx")
    local ok, err = pcall(pg.nn.from_hf, "/nonexistent/model")
    assert.is_false(ok)
    assert.is_truthy(err:find("no /nonexistent/model/config.json", 1, true), err)
  end)

  it("refuses weights that do not fit the config: a missing tensor, a wrong shape, bfloat16 of a wrong shape", function()
    refused(nil, function(dir)
      safetensors.write(dir .. "/model.safetensors", entries(function(n) return n ~= "transformer.ln_f.bias" and n or nil end))
    end, "the weights have no tensor ln_f.bias")
    refused(function(c) c.n_positions = 32 end, nil, "transformer.wpe.weight has shape [16, 32]; the config needs [32, 32]")
    refused(nil, function(dir)
      -- the same bytes, declared as bfloat16 of twice the columns (bfloat16 weights are read: the shape is wrong)
      local f = assert(io.open(FIXTURE .. "/model.safetensors", "rb"))
      local data = f:read("a")
      f:close()
      local n = string.unpack("<I8", data)
      local header = cjson.decode(data:sub(9, 8 + n))
      header["transformer.wpe.weight"].dtype, header["transformer.wpe.weight"].shape = "BF16", { 16, 64 }
      local text = cjson.encode(header)
      text = text .. string.rep(" ", (8 - #text % 8) % 8)
      f = assert(io.open(dir .. "/model.safetensors", "wb"))
      f:write(string.pack("<I8", #text), text, data:sub(9 + n))
      f:close()
    end, "transformer.wpe.weight has shape [16, 64]; the config needs [16, 32]") -- bfloat16 itself is read (bf16_spec)
  end)
end)
