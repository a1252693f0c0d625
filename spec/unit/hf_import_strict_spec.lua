-- pg.nn.from_hf is as strict as the checkpoint loader: config.json's fields
-- typed as transformers reads them (a flag is a JSON boolean, a size a JSON
-- integer, a number finite), every file where it should be (no directory in
-- its place), the sharded index confined to its directory, every tensor in
-- the files used by the model or named (but the buffers transformers drops),
-- and no weight that is not finite. Each refusal names the file and the field
-- or tensor; none is a raw Lua error.
local pg = require "pipegoose"
local h = require "helpers"
local cjson = require "cjson"
local safetensors = require "pipegoose.safetensors"

local FIX = "spec/fixtures/"

local function write(path, text)
  local f = assert(io.open(path, "wb"))
  f:write(text)
  f:close()
end

-- A copy of a fixture directory; edit(cfg) may change the decoded config.json.
local function copy(fixture, edit)
  local dir = h.tmpdir()
  assert(os.execute(("mkdir -p %s && cp %s/config.json %s/model.safetensors %s/"):format(h.quote(dir),
    h.quote(FIX .. fixture), h.quote(FIX .. fixture), h.quote(dir))))
  if edit then
    local cfg = cjson.decode(h.read(dir .. "/config.json"))
    edit(cfg)
    write(dir .. "/config.json", cjson.encode(cfg))
  end
  return dir
end

-- config.json's text with one field's value spelt as given (JSON text: NaN, Infinity ...).
local function with_raw(dir, key, json)
  local cfg = cjson.decode(h.read(dir .. "/config.json"))
  cfg[key] = "@@"
  write(dir .. "/config.json", (cjson.encode(cfg):gsub('"@@"', json)))
end

-- Rewrites a directory's model.safetensors with f(entries) (a list of {name=, tensor=}).
local function rewrite_weights(dir, f)
  local path = dir .. "/model.safetensors"
  local hd = safetensors.read_header(path)
  local entries = {}
  for _, name in ipairs(hd.names) do entries[#entries + 1] = { name = name, tensor = safetensors.read(hd, name) } end
  f(entries)
  safetensors.write(path, entries, { format = "pt" })
end

local function refusal(dir, opts)
  local ok, err = pcall(pg.nn.from_hf, dir, opts)
  assert.is_false(ok, "loaded " .. dir)
  err = tostring(err)
  assert.is_nil(err:find("attempt to", 1, true), err)
  return (err:gsub(dir:gsub("%p", "%%%0"), "D"))
end

local FLAGS = {
  hf_gpt2_tiny = { "tie_word_embeddings", "scale_attn_weights", "reorder_and_upcast_attn",
                   "scale_attn_by_inverse_layer_idx" },
  hf_llama_tiny = { "tie_word_embeddings", "attention_bias", "mlp_bias" },
  hf_mixtral_tiny = { "tie_word_embeddings", "output_router_logits" },
  hf_bloom_tiny = { "tie_word_embeddings", "apply_residual_connection_post_layernorm" },
}
local SIZES = {
  hf_gpt2_tiny = { "n_embd", "n_layer", "n_head", "vocab_size", "n_positions" },
  hf_llama_tiny = { "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "intermediate_size", "vocab_size", "max_position_embeddings" },
  hf_mixtral_tiny = { "num_local_experts", "num_experts_per_tok", "sliding_window" },
  hf_bloom_tiny = { "n_layer", "vocab_size" },
}
local NUMBERS = { hf_gpt2_tiny = { "layer_norm_epsilon" }, hf_llama_tiny = { "rms_norm_eps", "rope_theta" },
                  hf_mixtral_tiny = { "router_jitter_noise" }, hf_bloom_tiny = { "layer_norm_epsilon" } }

describe("config.json's fields, typed as transformers reads them", function()
  it("a flag must be a JSON boolean: \"true\", 0, 1 or a list refused by name", function()
    for fixture, keys in pairs(FLAGS) do
      for _, key in ipairs(keys) do
        for _, c in ipairs{ { '"true"', '"true"' }, { "0", "0" }, { "1", "1" }, { '"false"', '"false"' },
                            { "[true]", "[true]" } } do
          local dir = copy(fixture)
          with_raw(dir, key, c[1])
          assert.equal(("D: config.json: %s must be true or false (a JSON boolean), got %s"):format(key, c[2]),
            refusal(dir))
          h.rm(dir)
        end
      end
    end
  end)

  it("a size must be a JSON integer (not \"16\", 16.5, true or an object), a number finite", function()
    for fixture, keys in pairs(SIZES) do
      for _, key in ipairs(keys) do
        for _, v in ipairs{ '"16"', "16.5", "true", '{"a":1}' } do
          local dir = copy(fixture)
          with_raw(dir, key, v)
          assert.equal(("D: config.json: %s must be a positive integer, got %s"):format(key, v), refusal(dir))
          h.rm(dir)
        end
      end
    end
    for fixture, keys in pairs(NUMBERS) do
      for _, key in ipairs(keys) do
        for _, v in ipairs{ "NaN", "Infinity", "-Infinity", '"1e-5"', "null" } do
          local dir = copy(fixture)
          with_raw(dir, key, v)
          assert.equal(("D: config.json: %s must be a finite number, got %s"):format(key, v), refusal(dir))
          h.rm(dir)
        end
      end
    end
    for _, c in ipairs{ { "attn_pdrop", "NaN", "^D: config.json: attn_pdrop must be a finite number, got NaN$" },
                        { "activation_function", "[1]", "^D: config.json: activation_function must be a string, got %[1%]$" },
                        { "model_type", "5", "^D: config.json: model_type is 5; pipegoose reads GPT2LMHeadModel" } } do
      local dir = copy("hf_gpt2_tiny")
      with_raw(dir, c[1], c[2])
      assert.matches(c[3], refusal(dir))
      h.rm(dir)
    end
    local dir = copy("hf_llama_tiny", function(c) c.rms_norm_eps = -1 end)
    assert.equal("D: config.json: rms_norm_eps must be >= 0, got -1", refusal(dir))
    h.rm(dir)
  end)

  it("a config.json that is a list, a string, or a directory is refused by name", function()
    local dir = copy("hf_gpt2_tiny")
    write(dir .. "/config.json", "[1, 2]")
    assert.equal("D: D/config.json is not a JSON object (a JSON array)", refusal(dir))
    write(dir .. "/config.json", '"gpt2"')
    assert.equal("D: D/config.json is not a JSON object (a JSON string)", refusal(dir))
    os.remove(dir .. "/config.json")
    pg.fs.mkdir_p(dir .. "/config.json")
    assert.equal("D: D/config.json is a directory, not a JSON file", refusal(dir))
    h.rm(dir)
    dir = copy("hf_gpt2_tiny")
    os.remove(dir .. "/model.safetensors")
    pg.fs.mkdir_p(dir .. "/model.safetensors")
    assert.equal("D/model.safetensors: is a directory, not a safetensors file", refusal(dir))
    h.rm(dir)
  end)
end)

describe("the sharded index", function()
  -- the fixture's weights as one shard named by an index; map(names) -> the weight_map's JSON
  local function indexed(map, extra)
    local dir = copy("hf_gpt2_tiny")
    local names = safetensors.read_header(dir .. "/model.safetensors").names
    assert(os.rename(dir .. "/model.safetensors", dir .. "/model-00001-of-00001.safetensors"))
    if extra then extra(dir) end
    write(dir .. "/model.safetensors.index.json", '{"metadata": {}, "weight_map": ' .. map(names) .. "}")
    return dir
  end
  local function all_in(file)
    return function(names)
      local m = {}
      for _, n in ipairs(names) do m[n] = file end
      return cjson.encode(m)
    end
  end
  local function const(text) return function() return text end end

  it("loads when every entry is a file in the directory", function()
    local dir = indexed(all_in("model-00001-of-00001.safetensors"))
    assert.equal(61, pg.nn.from_hf(dir).config.vocab)
    h.rm(dir)
  end)

  it("refuses a weight_map of the wrong shape, naming the index file", function()
    for _, c in ipairs{ { "[1, 2]", "weight_map must be an object (tensor name -> file), got [1,2]" },
                        { "5", "weight_map must be an object (tensor name -> file), got 5" },
                        { '"x"', 'weight_map must be an object (tensor name -> file), got "x"' },
                        { "null", "weight_map must be an object (tensor name -> file), got null" },
                        { "{}", "weight_map is empty (it names no tensor)" } } do
      local dir = indexed(const(c[1]))
      assert.equal("D: D/model.safetensors.index.json: " .. c[2], refusal(dir))
      h.rm(dir)
    end
  end)

  it("confines entries to the directory: no path, no absolute name, no link out of it", function()
    local outside = copy("hf_gpt2_tiny")
    for _, file in ipairs{ "../x/model.safetensors", outside .. "/model.safetensors", "..", "." } do
      local dir = indexed(all_in(file))
      assert.matches("^D: D/model.safetensors.index.json: weight_map%[\"[^\"]+\"%] = \"" .. file:gsub("%p", "%%%0")
        .. "\" is not a file name in the directory$", refusal(dir))
      h.rm(dir)
    end
    local dir = indexed(all_in("evil.safetensors"), function(d)
      assert(os.execute(("ln -s %s %s"):format(h.quote(outside .. "/model.safetensors"), h.quote(d .. "/evil.safetensors"))))
    end)
    assert.matches("^D: D/model.safetensors.index.json: weight_map puts [^ ]+ in evil.safetensors, a link to .* "
      .. "outside the directory$", refusal(dir))
    h.rm(dir)
    dir = indexed(all_in("sub"), function(d) pg.fs.mkdir_p(d .. "/sub") end)
    assert.equal("D/sub: is a directory, not a safetensors file", refusal(dir))
    h.rm(dir)
    dir = indexed(all_in("model-00002-of-00002.safetensors"))
    assert.matches("^D: D/model.safetensors.index.json: weight_map puts [^ ]+ in model%-00002%-of%-00002.safetensors, "
      .. "which is missing$", refusal(dir))
    h.rm(dir)
    h.rm(outside)
  end)

  it("beside model.safetensors is not read (transformers loads the single file)", function()
    local dir = copy("hf_gpt2_tiny")
    write(dir .. "/model.safetensors.index.json", '{"weight_map": {"x": "../../etc/passwd"}}')
    local e = pg.parallelize(pg.nn.from_hf(dir), nil, {})
    local want = safetensors.read(safetensors.read_header(dir .. "/model.safetensors"), "transformer.ln_f.weight")
    assert.same(want:totable(), e:parameter("ln_f.weight").tensor:totable())
    h.rm(dir)
  end)
end)

describe("every tensor in the weights", function()
  it("is used by the model or named: a config with fewer layers than the weights is refused", function()
    local dir = copy("hf_gpt2_tiny", function(c) c.n_layer = 1 end)
    assert.equal("D: the weights hold 12 tensors the model does not use (transformer.h.1.attn.c_attn.bias, "
      .. "transformer.h.1.attn.c_attn.weight, transformer.h.1.attn.c_proj.bias, transformer.h.1.attn.c_proj.weight, "
      .. "transformer.h.1.ln_1.bias, transformer.h.1.ln_1.weight, ...): the config.json describes a smaller model "
      .. "than the weights, or another one; pg.nn.from_hf(dir, { unused = \"ignore\" }) loads it anyway", refusal(dir))
    -- unused = "ignore" loads the first layer
    local e = pg.parallelize(pg.nn.from_hf(dir, { unused = "ignore" }), nil, {})
    assert.equal(1, e.config.layers)
    assert.equal("from_hf: unused must be 'refuse' or 'ignore', got 'drop'",
      refusal(dir, { unused = "drop" }):gsub("^.-from_hf", "from_hf"))
    h.rm(dir)
    dir = copy("hf_llama_tiny")
    rewrite_weights(dir, function(en) en[#en + 1] = { name = "model.extra.weight", tensor = pg.zeros{ 3 } } end)
    assert.matches("the weights hold 1 tensor the model does not use %(model.extra.weight%)", refusal(dir))
    h.rm(dir)
  end)

  it("but for the buffers transformers drops: GPT-2's attention masks, rotary_emb.inv_freq", function()
    local dir = copy("hf_gpt2_tiny")
    rewrite_weights(dir, function(en)
      en[#en + 1] = { name = "transformer.h.0.attn.bias", tensor = pg.ones{ 1, 1, 16, 16 } }
      en[#en + 1] = { name = "h.1.attn.masked_bias", tensor = pg.full({ 1 }, -1e4) }
    end)
    assert.equal(2, pg.parallelize(pg.nn.from_hf(dir), nil, {}).config.layers)
    h.rm(dir)
    dir = copy("hf_llama_tiny")
    rewrite_weights(dir, function(en)
      en[#en + 1] = { name = "model.layers.0.self_attn.rotary_emb.inv_freq", tensor = pg.ones{ 4 } }
    end)
    pg.parallelize(pg.nn.from_hf(dir), nil, {})
    h.rm(dir)
  end)

  it("a tied head's lm_head.weight: used when it is the embedding, refused when it differs", function()
    local dir = copy("hf_gpt2_tiny") -- tied
    rewrite_weights(dir, function(en)
      for _, e in ipairs(en) do
        if e.name == "transformer.wte.weight" then en[#en + 1] = { name = "lm_head.weight", tensor = e.tensor:clone() } end
      end
    end)
    pg.parallelize(pg.nn.from_hf(dir), nil, {})
    rewrite_weights(dir, function(en)
      for _, e in ipairs(en) do if e.name == "lm_head.weight" then e.tensor = e.tensor:scale(2) end end
    end)
    assert.equal("D: config.json ties the head to the embedding (tie_word_embeddings = true), but the weights' "
      .. "lm_head.weight differs from transformer.wte.weight: set tie_word_embeddings to false to train both, or "
      .. "pg.nn.from_hf(dir, { unused = \"ignore\" }) to use transformer.wte.weight for both", refusal(dir))
    pg.parallelize(pg.nn.from_hf(dir, { unused = "ignore" }), nil, {})
    h.rm(dir)
  end)

  it("is finite: +inf or NaN in a weight is refused naming the tensor", function()
    for _, bad in ipairs{ math.huge, -math.huge, 0 / 0 } do
      local dir = copy("hf_llama_tiny")
      rewrite_weights(dir, function(en)
        for _, e in ipairs(en) do
          if e.name == "model.layers.1.mlp.up_proj.weight" then e.tensor = e.tensor:clone(); e.tensor:set(3, 2, bad) end
        end
      end)
      local model = pg.nn.from_hf(dir) -- the values are read when the engine is built
      local ok, err = pcall(pg.parallelize, model, nil, {})
      assert.is_false(ok)
      assert.equal(("%s: model.layers.1.mlp.up_proj.weight (in %s/model.safetensors) holds values that are not finite "
        .. "(inf or NaN); pipegoose loads finite weights only"):format(dir, dir), err)
      h.rm(dir)
    end
  end)
end)
