-- The Hugging Face import (pg.nn.from_hf) of what real checkpoints hold:
-- float16 and bfloat16 weights, and LLaMA's rope_scaling. The fixtures
-- (spec/fixtures/hf_llama_{f16,bf16,rope_*}) are tiny LlamaForCausalLM
-- directories that transformers 4.45.2 saved, with its float32 logits and
-- RoPE inverse frequencies (scripts/make_hf_import_fixtures.py says how).
--
-- Logits tolerance: 1e-5 relative to the largest |logit| (the llama spec's
-- 1e-5 on losses). Both sides are float32 forwards of the same float32
-- weights (the half-precision ones widened exactly, transformers' and
-- pipegoose's alike), differing in summation order and in cos/sin (torch's
-- vectorised float32 ones, pipegoose's from double): a few float32 ulps per
-- step through one block. The inverse frequencies are compared bit for bit.
local pg = require "pipegoose"
local h = require "helpers"
local safetensors = require "pipegoose.safetensors"

local F = "spec/fixtures/"

local function expected(dir)
  local hd = safetensors.read_header(dir .. "/expected.safetensors")
  return { tokens = safetensors.read(hd, "tokens"), logits = safetensors.read(hd, "logits"),
           inv_freq = safetensors.read(hd, "inv_freq") }
end

-- pipegoose's float32 logits of a directory on the fixture's tokens, against transformers'
local function assert_logits(dir)
  local e = expected(dir)
  local engine = pg.parallelize(pg.nn.from_hf(dir), nil, {})
  local got = engine:forward(e.tokens)
  h.assert_scaled_close(got, e.logits, dir .. " logits", 0, 1e-5)
  return got, e
end

describe("pg.nn.from_hf of half-precision weights", function()
  it("reads F16 weights (widened exactly): the logits are transformers' float32 logits of the rounded weights", function()
    local hd = safetensors.read_header(F .. "hf_llama_f16/model.safetensors")
    assert.equal("float16", hd.entries["model.embed_tokens.weight"].dtype)
    assert_logits(F .. "hf_llama_f16")
  end)

  it("reads BF16 weights the same way", function()
    assert.equal("bfloat16", safetensors.read_header(F .. "hf_llama_bf16/model.safetensors")
      .entries["model.embed_tokens.weight"].dtype)
    assert_logits(F .. "hf_llama_bf16")
  end)

  it("widens every float16 bit pattern exactly (subnormals, infinities, NaN) and rounds to nearest even back", function()
    -- all 65536 patterns, through the storage tensor's values and ops.from_f16
    local path = os.tmpname()
    local bytes = {}
    for b = 0, 65535 do bytes[#bytes + 1] = string.pack("<I2", b) end
    local f = assert(io.open(path, "wb"))
    f:write(table.concat(bytes))
    f:close()
    local half = pg.core.file.read(path, 0, 65536, "float16")
    os.remove(path)
    assert.equal("float16", half:dtype())
    local wide = pg.ops.from_f16(half)
    local v = wide:totable()
    local function at(b) return v[b + 1] end
    assert.equal(0, at(0))
    assert.equal(1 / 0, 1 / at(0x8000) * -1) -- -0
    assert.equal(2 ^ -24, at(0x0001))         -- the smallest subnormal
    assert.equal(1023 * 2 ^ -24, at(0x03ff))  -- the largest
    assert.equal(2 ^ -14, at(0x0400))         -- the smallest normal
    assert.equal(1, at(0x3c00))
    assert.equal(1 + 2 ^ -10, at(0x3c01))
    assert.equal(-2, at(0xc000))
    assert.equal(65504, at(0x7bff))
    assert.equal(1 / 0, at(0x7c00))
    assert.equal(-1 / 0, at(0xfc00))
    assert.is_true(at(0x7e00) ~= at(0x7e00))
    -- every finite pattern: sign * 2^(e-15) * (1 + m/1024), or m * 2^-24 when e = 0
    for b = 0, 65535 do
      local e, m = (b >> 10) & 31, b & 1023
      if e < 31 then
        local want = (e == 0 and m * 2 ^ -24 or 2 ^ (e - 15) * (1 + m / 1024)) * ((b & 0x8000) ~= 0 and -1 or 1)
        if at(b) ~= want then error(("0x%04x widened to %.9g, want %.9g"):format(b, at(b), want)) end
      end
    end
    -- back: a float16 tensor's set rounds to nearest, ties to even (torch's .to(torch.float16))
    local t = pg.zeros({ 6 }, { dtype = "float16" })
    for i, x in ipairs{ 1 + 2 ^ -11, 1 + 3 * 2 ^ -11, 65519, 65520, 2 ^ -25, 3 * 2 ^ -25 } do t:set(i, x) end
    assert.same({ 1, 1 + 2 ^ -9, 65504, 1 / 0, 0, 2 ^ -23 }, pg.ops.from_f16(t):totable())
  end)

  it("refuses a weight of a dtype it does not read, naming the tensor", function()
    local dir = h.tmpdir()
    os.execute(("mkdir -p %s && cp %s/config.json %s/"):format(dir, F .. "hf_llama_f16", dir))
    local src = safetensors.read_header(F .. "hf_llama_f16/model.safetensors")
    local entries = {}
    for _, name in ipairs(src.names) do
      local t = pg.ops.from_f16(safetensors.read(src, name))
      if name == "model.norm.weight" then t = pg.zeros(t:shape(), { dtype = "int32" }) end
      entries[#entries + 1] = { name = name, tensor = t }
    end
    safetensors.write(dir .. "/model.safetensors", entries)
    local ok, err = pcall(function() pg.parallelize(pg.nn.from_hf(dir), nil, {}) end)
    h.rm(dir)
    assert.is_false(ok)
    assert.matches("model.norm.weight is int32; pipegoose reads float32, bfloat16 or float16 weights", err, 1, true)
  end)
end)

describe("pg.nn.from_hf of LLaMA's rope_scaling", function()
  local common = require "pipegoose.models.common"
  local hf = require "pipegoose.hf"

  -- the attention's frequencies (pg.ops.rope_inv_freq of the descriptor's fields, what kind_attention.c's
  -- tables are made of) against transformers' model.rotary_emb.inv_freq, bit for bit
  local function assert_inv_freq(dir)
    local c = pg.nn.from_hf(dir).config
    local got = pg.ops.rope_inv_freq(c.head_dim, c.rope_theta, common.rope_fields(c.rope_scaling))
    local want = expected(dir).inv_freq
    assert.is_true(got:equal(want), dir .. ": inv_freq " .. tostring(got) .. ", transformers " .. tostring(want))
    return got
  end

  for _, case in ipairs{
    { "linear", { factor = 4.0, rope_type = "linear", type = "linear" } },
    { "dynamic", { factor = 2.0, rope_type = "dynamic" } },
    { "llama3", { factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, original_max_position_embeddings = 32,
                  rope_type = "llama3" } },
  } do
    local kind, table_read = case[1], case[2]
    local dir = F .. "hf_llama_rope_" .. kind
    it(kind .. ": the inverse frequencies bit for bit, the logits within 1e-5, written back as read", function()
      assert.same(table_read, pg.nn.from_hf(dir).config.rope_scaling)
      local inv = assert_inv_freq(dir)
      local plain = pg.ops.rope_inv_freq(32, 100)
      if kind == "dynamic" then
        -- transformers rescales only sequences past max_position_embeddings (64), which pipegoose refuses
        assert.is_true(inv:equal(plain), "dynamic up to max_position_embeddings: the plain frequencies")
      else
        assert.is_false(inv:equal(plain), "the scaling changes the frequencies")
      end
      assert_logits(dir)
      local out = h.tmpdir()
      pg.parallelize(pg.nn.from_hf(dir), nil, {}):save_hf(out)
      assert.same(hf.read_config(dir), hf.read_config(out))
      local f = assert(io.open(out .. "/config.json"))
      local written = require("cjson").decode(f:read("a"))
      f:close()
      h.rm(out)
      assert.same(table_read, written.rope_scaling)
    end)
  end

  it("the scaled models' logits differ from the plain model's by far more than the tolerance", function()
    -- the same weights with rope_scaling removed: the scaling is what the logits check sees
    for _, kind in ipairs{ "linear", "llama3" } do
      local dir = F .. "hf_llama_rope_" .. kind
      local e, c = expected(dir), pg.nn.from_hf(dir).config
      c.rope_scaling = nil
      local plain = pg.parallelize(pg.nn.Llama(c), nil, {})
      hf.load_into(plain, dir)
      local d = plain:forward(e.tokens):max_abs_diff(e.logits)
      assert.is_true(d > 1e-2, ("%s: plain RoPE's logits differ by only %g"):format(kind, d))
    end
  end)

  it("nn.Llama{rope_scaling = ...} checks the table, naming what is wrong", function()
    local base = { vocab = 61, dim = 32, layers = 1, heads = 2, head_dim = 32, kv_heads = 1, hidden = 32, seq_len = 64,
                   rope_theta = 100 }
    local function with(rs)
      local o = {}
      for k, v in pairs(base) do o[k] = v end
      o.rope_scaling = rs
      return o
    end
    local m = pg.nn.Llama(with{ rope_type = "llama3", factor = 8, low_freq_factor = 1, high_freq_factor = 4,
                                original_max_position_embeddings = 32 })
    assert.equal("llama3", m.config.rope_scaling.rope_type)
    for _, bad in ipairs{
      { { rope_type = "yarn", factor = 4 }, "type yarn is not supported (pipegoose computes default, dynamic, linear and llama3)" },
      { { factor = 4 }, "type nil is not supported" },
      { { rope_type = "linear" }, "linear needs factor" },
      { { rope_type = "linear", factor = -1 }, "linear: factor must be a positive number, got -1" },
      { { rope_type = "linear", factor = 2, beta_fast = 32 }, "linear: beta_fast is not a field of this type" },
      { { rope_type = "linear", type = "dynamic", factor = 2 }, "has rope_type linear and type dynamic" },
      { { rope_type = "llama3", factor = 8, low_freq_factor = 4, high_freq_factor = 1, original_max_position_embeddings = 32 },
        "llama3: high_freq_factor (1) must exceed low_freq_factor (4)" },
      { { rope_type = "llama3", factor = 8, low_freq_factor = 1, high_freq_factor = 4 }, "llama3 needs original_max_position_embeddings" },
      { "linear", "must be a table" },
    } do
      local ok, err = pcall(pg.nn.Llama, with(bad[1]))
      assert.is_false(ok)
      assert.matches("rope_scaling must be a rope_scaling table", err, 1, true)
      assert.matches(bad[2], err, 1, true)
    end
  end)

  it("config.json: an unknown type is refused naming it; Mixtral's rope_scaling is refused", function()
    local cjson = require "cjson"
    local f = assert(io.open(F .. "hf_llama_rope_linear/config.json"))
    local cfg = cjson.decode(f:read("a"))
    f:close()
    cfg.rope_scaling = { rope_type = "longrope", factor = 4.0, short_factor = { 1 }, long_factor = { 1 } }
    local ok, err = pcall(hf.options, cfg, "DIR")
    assert.is_false(ok)
    assert.matches("DIR: config.json: rope_scaling type longrope is not supported", err, 1, true)
    cfg.model_type, cfg.num_local_experts, cfg.num_experts_per_tok = "mixtral", 2, 1
    cfg.rope_scaling = { rope_type = "linear", factor = 4.0 }
    ok, err = pcall(hf.options, cfg, "DIR")
    assert.is_false(ok)
    assert.matches("rope_scaling is not supported for MixtralForCausalLM", err, 1, true)
  end)
end)

describe("nn.Attention{rope_scaling = ...}", function()
  it("needs rope_theta; pg.ops.rope_inv_freq of the descriptor fields divides by a linear factor", function()
    local rs = { rope_type = "linear", factor = 4 }
    local ok, err = pcall(pg.nn.Attention, { heads = 2, seq_len = 8, head_dim = 8, rope_scaling = rs })
    assert.is_false(ok)
    assert.matches("Attention: rope_scaling scales rotary embeddings: give rope_theta= too", err, 1, true)
    -- linear: every frequency divided by the factor (4, a power of two: exact)
    local plain = pg.ops.rope_inv_freq(8, 10000):totable()
    local scaled = pg.ops.rope_inv_freq(8, 10000, require("pipegoose.models.common").rope_fields(rs)):totable()
    for i = 1, 4 do assert.equal(plain[i] / 4, scaled[i]) end
  end)
end)
