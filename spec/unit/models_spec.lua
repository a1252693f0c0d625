-- The model families' registry (lua/pipegoose/models/init.lua) and the
-- contract of the Hugging Face layout's permutation hook
-- (lua/pipegoose/models/common.lua, C.entry), which no family uses yet: a
-- reversal of rows added to GPT-2's layout must load reversed and write the
-- file back bit for bit.
local pg = require "pipegoose"
local h = require "helpers"
local models = require "pipegoose.models"

local FIXTURE = "spec/fixtures/hf_gpt2_tiny"

describe("pipegoose.models", function()
  it("lists the families and finds them by name, alias, model config and model_type", function()
    assert.same({ "gpt2", "llama", "mixtral", "bloom" }, models.NAMES)
    for i, f in ipairs(models.list()) do
      assert.equal(models.NAMES[i], f.name)
      assert.equal(f, models.get(f.name))
      assert.equal(f, models.of_hf_model_type(f.hf.model_type))
      assert.equal(f, models.of_config{ arch = f.name })
      for _, k in ipairs{ "build", "install", "config_keys", "hf", "plan" } do
        assert.is_not_nil(f[k], f.name .. " has no " .. k)
      end
    end
    assert.equal(models.get("gpt2"), models.get("gpt"))
    assert.equal(models.get("gpt2"), models.of_config{})
    assert.is_nil(models.get("llama").llmc)
    assert.is_not_nil(models.get("gpt2").llmc)
  end)

  it("names the known families when asked for another", function()
    local ok, err = pcall(models.get, "bert", "somewhere")
    assert.is_false(ok)
    assert.equal("somewhere: unknown model family 'bert' (known: gpt2, llama, mixtral, bloom)", err)
    local f, known = models.of_hf_model_type("bert")
    assert.is_nil(f)
    assert.equal('GPT2LMHeadModel ("gpt2"), LlamaForCausalLM ("llama"), MixtralForCausalLM ("mixtral") and '
      .. 'BloomForCausalLM ("bloom")', known)
  end)

  it("builds the pg.nn models through the families (pg.nn.GPT is the gpt2 family's builder)", function()
    local o = { vocab = 13, dim = 8, layers = 1, heads = 2, kv_heads = 1, hidden = 6, seq_len = 4 }
    local a, b = pg.nn.Llama(o), models.get("llama").build(o)
    assert.same(a.config, b.config)
    assert.equal(a:num_params(), b:num_params())
    assert.equal("mixtral", pg.nn.from_config(pg.nn.Mixtral{ vocab = 13, dim = 8, layers = 1, heads = 2, hidden = 6,
      experts = 2, seq_len = 4 }.config).config.arch)
  end)

  it("gives the planner one reader of config.json: the importer's (Mixtral's absent num_key_value_heads is 8)",
    function()
    local cfg = { model_type = "mixtral", num_hidden_layers = 2, hidden_size = 64, num_attention_heads = 16,
      intermediate_size = 32, vocab_size = 100, max_position_embeddings = 64, num_local_experts = 4,
      num_experts_per_tok = 2 }
    local s = pg.plan.models.from_hf(cfg, "x.json")
    assert.equal(8, s.kv_heads)
    assert.equal(4, s.experts)
    assert.equal("rmsnorm", s.norm)
    assert.is_true(s.gated_mlp)
  end)
end)

describe("the permutation hook of a Hugging Face layout entry", function()
  local gpt2 = models.get("gpt2")
  local layout = gpt2.hf.layout

  local function reverse(t)
    local n = t:size(1)
    local idx = {}
    for i = 1, n do idx[i] = n + 1 - i end
    return t:index_select(1, pg.tensor(idx, { dtype = "int32" }))
  end
  local calls = { to_pg = 0, to_hf = 0 }
  local hook = {
    to_pg = function(t) calls.to_pg = calls.to_pg + 1 return reverse(t) end,
    to_hf = function(t) calls.to_hf = calls.to_hf + 1 return reverse(t) end,
  }
  local PERMUTED = { ["blocks.0.attn.qkv.bias"] = true, ["blocks.0.mlp.fc.weight"] = true, ["embed.wte"] = true }

  before_each(function()
    gpt2.hf.layout = function(o)
      local out = layout(o)
      for _, e in ipairs(out) do
        if PERMUTED[e.pg] then e.permute = hook end
      end
      return out
    end
  end)
  after_each(function() gpt2.hf.layout = layout end)

  it("loads the file's rows in the hook's order and writes them back bit for bit (a vector, a Conv1D, the embedding)",
    function()
    local plain = pg.parallelize(pg.nn.from_hf(FIXTURE), nil, {})
    gpt2.hf.layout = layout
    local ref = pg.parallelize(pg.nn.from_hf(FIXTURE), nil, {})
    for name in pairs(PERMUTED) do
      local got, want = plain:parameter(name).tensor, ref:parameter(name).tensor
      if name == "embed.wte" then -- the padding rows stay at the end, zero
        local V = ref.config.vocab
        want, got = reverse(want:narrow(1, 1, V)), got:narrow(1, 1, V)
      else
        want = reverse(want:reshape(got:shape()))
      end
      assert.is_true(got:equal(want), name .. " is not the file's rows reversed")
    end
    assert.is_true(plain:parameter("blocks.0.attn.proj.weight").tensor:equal(
      ref:parameter("blocks.0.attn.proj.weight").tensor), "an entry without the hook is loaded as it is")
    assert.equal(3, calls.to_pg)
    gpt2.hf.layout = function(o)
      local out = layout(o)
      for _, e in ipairs(out) do if PERMUTED[e.pg] then e.permute = hook end end
      return out
    end
    local out = h.tmpdir()
    plain:save_hf(out)
    assert.equal(3, calls.to_hf)
    local want, got = h.safetensors_tensors(FIXTURE .. "/model.safetensors"), h.safetensors_tensors(out .. "/model.safetensors")
    for name, t in pairs(want) do
      assert.is_true(t.bytes == got[name].bytes, name .. " differs")
    end
    h.rm(out)
  end)
end)
