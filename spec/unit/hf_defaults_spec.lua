-- config.json fields that are absent: lua/pipegoose/hf.lua must read each as
-- transformers does. spec/fixtures/hf_config_defaults.json (written by
-- scripts/hf_defaults.py with transformers, whose version it names) has, for
-- GPT2Config, LlamaConfig and MixtralConfig, the value of every field the
-- importer reads when config.json lacks it: a default, or a rule on the other
-- fields (num_key_value_heads: num_attention_heads, head_dim: hidden_size //
-- num_attention_heads, n_inner: 4 * n_embd). Each test imports its family's
-- fixture config with one field removed and compares the value pipegoose
-- uses with the table's; one more checks that the importer reads exactly the
-- table's fields (a new field needs its default here too).
--
-- And the export of a Mixtral: config.json's output_router_logits and
-- router_aux_loss_coef say the load-balancing loss the model computed (none
-- at aux_loss_coef = 0), so transformers adds the same loss or none.
local pg = require "pipegoose"
local h = require "helpers"
local cjson = require "cjson"
local hf = require "pipegoose.hf"

local function read_json(path)
  local f = assert(io.open(path))
  local v = cjson.decode(f:read("a"))
  f:close()
  return v
end

local TABLE = read_json("spec/fixtures/hf_config_defaults.json")

-- The base config of each family: its fixture's, with the fields the fixture
-- lacks spelt out (so each test removes a field that was there), and
-- Mixtral's 16 heads (the default 8 key/value heads must divide them, and
-- differ from them: num_attention_heads would be the LLaMA rule).
local BASE = {
  gpt2 = { fixture = "spec/fixtures/hf_gpt2_tiny", add = { tie_word_embeddings = false } },
  llama = { fixture = "spec/fixtures/hf_llama_tiny", add = {} },
  mixtral = { fixture = "spec/fixtures/hf_mixtral_tiny",
              add = { num_attention_heads = 16, head_dim = 8, attention_bias = false, mlp_bias = false,
                      rope_scaling = cjson.null } },
  bloom = { fixture = "spec/fixtures/hf_bloom_tiny", add = { seq_length = 16 } },
}

local function base_config(family)
  local b = BASE[family]
  local cfg = read_json(b.fixture .. "/config.json")
  for k, v in pairs(b.add) do cfg[k] = v end
  return cfg
end

-- What pipegoose uses for each field, from hf.read_config's options: an
-- option's name, a function of the options, or the one value pipegoose
-- computes (the importer refuses any other, so reading the config at all says it).
local function fixed(v) return function() return v end end
local LLAMA = {
  vocab_size = "vocab", max_position_embeddings = "seq_len", hidden_size = "dim", num_attention_heads = "heads",
  num_hidden_layers = "layers", intermediate_size = "hidden", num_key_value_heads = "kv_heads",
  head_dim = function(o) return o.head_dim or o.dim // o.heads end, -- as pg.nn.Llama and the layout take it
  rope_theta = "rope_theta", rms_norm_eps = "eps", tie_word_embeddings = "tie",
  hidden_act = fixed("silu"), attention_bias = fixed(false), mlp_bias = fixed(false), rope_scaling = fixed(nil),
}
local USES = {
  gpt2 = {
    vocab_size = "vocab", n_positions = "seq_len", n_embd = "dim", n_head = "heads", n_layer = "layers",
    n_inner = "hidden", tie_word_embeddings = "tie", activation_function = fixed("gelu_new"),
    layer_norm_epsilon = fixed(1e-5), scale_attn_weights = fixed(true), scale_attn_by_inverse_layer_idx = fixed(false),
    reorder_and_upcast_attn = fixed(false),
  },
  llama = LLAMA,
  mixtral = setmetatable({
    num_local_experts = "experts", num_experts_per_tok = "top_k",
    -- transformers adds router_aux_loss_coef x the load-balancing loss when output_router_logits is true
    output_router_logits = function(o) return o.aux_loss_coef > 0 end,
    router_aux_loss_coef = "aux_loss_coef", -- the base has output_router_logits = true
    router_jitter_noise = fixed(0), sliding_window = fixed(nil), -- the whole causal context
  }, { __index = LLAMA }),
  bloom = {
    vocab_size = "vocab", hidden_size = "dim", n_head = "heads", n_layer = "layers", tie_word_embeddings = "tie",
    layer_norm_epsilon = fixed(1e-5), apply_residual_connection_post_layernorm = fixed(false),
    -- no BloomConfig field: pipegoose's BLOOM length (models/bloom.lua's SEQ_LEN) unless config.json gives one
    seq_length = function(o) if o.seq_len ~= 2048 then return o.seq_len end end,
    n_embed = "dim", num_attention_heads = "heads", num_hidden_layers = "layers",
  },
}

local function uses(family, field, o)
  local u = USES[family][field]
  assert(u, ("%s.%s: the spec does not know which option it sets"):format(family, field))
  if type(u) == "string" then return o[u] end
  return u(o)
end

-- A table entry's value for a config: its default, or its rule on the config's other fields.
local function expected(entry, cfg)
  if entry.derived == nil then return entry.default end
  local text = entry.derived:gsub("[%a_][%w_]*", function(name)
    local v = cfg[name]
    assert(type(v) == "number", ("rule %s: the base config has no number %s"):format(entry.derived, name))
    return ("%.17g"):format(v)
  end)
  return assert(load("return " .. text, "rule", "t", {}))()
end

-- Python's truth for flags (None, False and 0 are false), equality otherwise.
local function same(got, want)
  if want == cjson.null then want = nil end
  local function truth(v) return v ~= nil and v ~= false and v ~= 0 end
  if type(got) == "boolean" or got == nil or type(want) == "boolean" or want == nil then
    return truth(got) == truth(want)
  end
  return got == want
end

local function show(v)
  if v == nil or v == cjson.null then return "null" end
  if type(v) == "number" then return ("%.17g"):format(v) end
  return type(v) == "string" and ("%q"):format(v) or tostring(v)
end

local function import(cfg)
  local dir = h.tmpdir()
  os.execute("mkdir -p " .. h.quote(dir))
  local f = assert(io.open(dir .. "/config.json", "w"))
  f:write(cjson.encode(cfg))
  f:close()
  local ok, o = pcall(hf.read_config, dir)
  h.rm(dir)
  return ok, o
end

local function sorted_keys(t)
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = k end
  table.sort(keys)
  return keys
end

local VERSION = TABLE.transformers_version

describe("hf.read_config: an absent config.json field is read as transformers " .. VERSION .. " reads it", function()
  it("the table names transformers' version and the four config classes", function()
    assert.is_truthy(VERSION:match("^%d+%.%d+"), tostring(VERSION))
    assert.same({ "bloom", "gpt2", "llama", "mixtral" }, sorted_keys(TABLE.families))
    assert.same({ "GPT2Config", "LlamaConfig", "MixtralConfig", "BloomConfig" },
      { TABLE.families.gpt2.class, TABLE.families.llama.class, TABLE.families.mixtral.class,
        TABLE.families.bloom.class })
  end)

  for _, family in ipairs(sorted_keys(TABLE.families)) do
    local fam = TABLE.families[family]

    it(family .. ": the importer reads exactly the table's fields (and the base config reads)", function()
      local cfg, read = base_config(family), {}
      local proxy = setmetatable({}, { __index = function(_, k)
        read[k] = true
        return cfg[k]
      end })
      hf.options(proxy, family)
      read.model_type = nil -- it picks the family
      local extra, unread = {}, {}
      for k in pairs(read) do if not fam.fields[k] then extra[#extra + 1] = k end end
      for k in pairs(fam.fields) do if not read[k] then unread[#unread + 1] = k end end
      table.sort(extra)
      table.sort(unread)
      assert(#extra == 0, ("%s: hf.lua reads %s, which spec/fixtures/hf_config_defaults.json has no default for "
        .. "(add it to scripts/hf_defaults.py)"):format(family, table.concat(extra, ", ")))
      assert(#unread == 0, ("%s: hf.lua no longer reads %s"):format(family, table.concat(unread, ", ")))
    end)

    for _, field in ipairs(sorted_keys(fam.fields)) do
      local alias_of = fam.fields[field].alias_of
      if alias_of then
        -- another spelling of a field: given with it, it wins (the base config has the field, not the alias)
        it(("%s: %s given with %s wins, as in transformers"):format(family, field, alias_of), function()
          local cfg = base_config(family)
          cfg[field] = 2 * cfg[alias_of]
          local ok, o = import(cfg)
          assert(ok, tostring(o))
          assert.equal(cfg[field], uses(family, field, o))
        end)
        goto next_field
      end
      it(("%s without %s: transformers' value"):format(family, field), function()
        local cfg = base_config(family)
        assert(cfg[field] ~= nil, ("%s: the base config has no %s to remove"):format(family, field))
        cfg[field] = nil
        local entry = fam.fields[field]
        local want = expected(entry, cfg)
        local what = entry.derived and (entry.derived .. " = " .. show(want)) or show(want)
        local ok, o = import(cfg)
        assert(ok, ("%s: config.json without %s is refused (%s); transformers %s's %s reads it as %s")
          :format(family, field, tostring(o), VERSION, fam.class, what))
        local got = uses(family, field, o)
        assert(same(got, want), ("%s: config.json without %s: pipegoose uses %s; transformers %s's %s has %s")
          :format(family, field, show(got), VERSION, fam.class, what))
      end)
      ::next_field::
    end
  end

  it("a JSON null is not absent: Mixtral's num_key_value_heads = null is num_attention_heads (absent: 8)", function()
    local cfg = base_config("mixtral")
    cfg.num_key_value_heads = cjson.null
    local ok, o = import(cfg)
    assert(ok, tostring(o))
    assert.equal(16, o.kv_heads)
    cfg.num_key_value_heads, cfg.num_attention_heads = cjson.null, 4
    ok, o = import(cfg)
    assert(ok, tostring(o))
    assert.equal(4, o.kv_heads)
  end)
end)

describe("engine:save_hf of a Mixtral: output_router_logits and router_aux_loss_coef say the model's loss", function()
  local x = pg.tensor({ { 1, 2, 3, 4 }, { 5, 6, 7, 8 } }, { dtype = "int32" })
  local y = pg.tensor({ { 2, 3, 4, 5 }, { 6, 7, 8, 9 } }, { dtype = "int32" })

  for _, case in ipairs{ { coef = 0, logits = false }, { coef = 0.05, logits = true }, { coef = 0.001, logits = true } } do
    it(("aux_loss_coef = %g: output_router_logits %s, router_aux_loss_coef %g, and reads back so"):format(case.coef,
      tostring(case.logits), case.coef), function()
      local e = pg.parallelize(pg.nn.Mixtral{ vocab = 13, dim = 8, layers = 2, heads = 2, kv_heads = 1, hidden = 6,
        experts = 3, top_k = 2, seq_len = 4, aux_loss_coef = case.coef }, nil, {})
      e:forward_backward(x, y)
      local aux = e:losses().aux_loss
      assert.is_true(case.logits and aux > 0 or aux == 0, ("the model's aux_loss %g at coefficient %g"):format(aux, case.coef))
      local dir = h.tmpdir()
      e:save_hf(dir)
      local cfg = read_json(dir .. "/config.json")
      assert.equal(case.logits, cfg.output_router_logits, "output_router_logits")
      assert.equal(case.coef, cfg.router_aux_loss_coef, "router_aux_loss_coef")
      assert.equal(case.coef, hf.read_config(dir).aux_loss_coef, "read back")
      h.rm(dir)
    end)
  end
end)
