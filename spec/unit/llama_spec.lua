-- pg.nn.Llama against PyTorch: spec/fixtures/hf_llama_tiny is a random
-- LlamaForCausalLM (odd vocabulary 61, dim 32, 4 heads over 2 key/value heads,
-- SwiGLU 48, rotary embeddings, untied head, norm weights perturbed) and
-- hf_llama_tiny_t4 one with 8 heads over 4 key/value heads and a tied head,
-- written by scripts/make_llama_reference.py with the losses of 10 clipped
-- AdamW steps on one batch (scripts/llama_torch.py; transformers 4.45.2
-- gives the same numbers bit for bit: scripts/hf_reference.py llama-check).
-- scripts/model_check.lua trains the same directory in pipegoose, serially
-- and in parallel layouts (spec/support/hf_model_check.lua). Tolerance: 1e-5 relative on every loss and on the
-- first gradient norm, 1e-4 on the later gradient norms. Measured: the first
-- step's gradients agree with PyTorch's to 1.6e-7 (largest absolute
-- difference, every tensor) and the losses stay within 4e-6, but Adam's
-- first step moves each weight by about lr * sign(gradient), and in the T = 4
-- fixture one element of blocks.0.mlp.fc.weight has a gradient below 1e-7
-- whose sign differs between the two float32 computations: the later
-- gradient norms drift apart by up to 4e-5 (3e-7 in the smaller fixture).
local pg = require "pipegoose"
local h = require "helpers"

local TINY, T4 = "spec/fixtures/hf_llama_tiny", "spec/fixtures/hf_llama_tiny_t4"
-- 10 layers (13 top-level modules): enough pieces for P x V = 2 x 3 and 4 x 3
local DEEP = "spec/fixtures/hf_llama_tiny_deep"

local check = require "hf_model_check"
local expected, check_args, run_check, assert_losses, edited =
  check.expected, check.check_args, check.run_check, check.assert_losses, check.edited
local tensors_of = h.safetensors_tensors

describe("pg.nn.Llama (LlamaForCausalLM) against PyTorch", function()
  it("reads the config: grouped-query heads, rotary theta, eps, untied head, padded vocabulary", function()
    local m = pg.nn.from_hf(TINY)
    local c = m.config
    assert.same({ "llama", 61, 64, 16, 32, 4, 2, 8, 2, 48, 10000, false },
      { c.arch, c.vocab, c.padded_vocab, c.seq_len, c.dim, c.heads, c.kv_heads, c.head_dim, c.layers, c.hidden,
        c.rope_theta, c.tie })
    assert.near(1e-5, c.eps, 1e-12)
    assert.is_true(pg.nn.from_hf(T4).config.tie)
    -- parameters: embedding, head and per layer 2 norms, q|k|v, o, gate|up, down; no biases
    local want = 61 * 32 * 2 + 32 + 2 * (2 * 32 + (32 + 2 * 16) * 32 + 32 * 32 + 2 * 48 * 32 + 48 * 32)
    assert.equal(want, m:num_params())
    local engine = pg.parallelize(m, nil, {})
    assert.equal(want, engine:num_parameters())
  end)

  it("serially: the loss at the loaded weights and 10 clipped AdamW steps match PyTorch", function()
    assert_losses(run_check(TINY, 1), TINY, "serial")
  end)

  it("matches PyTorch with T = 2, P = 2 (both schedules), D = 2 (ZeRO-1) and 2 x 2 x 2", function()
    for _, c in ipairs{
      { 2, { "--tensor=2" } }, { 2, { "--pipeline=2", "--micro-batches=2" } },
      { 2, { "--pipeline=2", "--micro-batches=4", "--schedule=gpipe" } }, { 2, { "--data=2", "--zero=1" } },
      { 8, { "--tensor=2", "--pipeline=2", "--data=2", "--micro-batches=2", "--zero=1" } },
    } do
      assert_losses(run_check(TINY, c[1], c[2]), TINY, table.concat(c[2], " "))
    end
  end)

  it("matches PyTorch at T = 4 where the heads allow it (8 heads, 4 key/value heads, tied head)", function()
    assert_losses(run_check(T4, 4, { "--tensor=4" }), T4, "T = 4")
  end)

  it("matches PyTorch with sequence parallelism at T = 2 and at T = 4 (the tied head)", function()
    assert_losses(run_check(TINY, 2, { "--tensor=2", "--sequence-parallel" }), TINY, "T = 2 sequence parallel")
    assert_losses(run_check(T4, 4, { "--tensor=4", "--sequence-parallel" }), T4, "T = 4 sequence parallel")
  end)

  it("matches PyTorch with the interleaved schedule: P = 2 x V = 3 and P = 4 x V = 2, 3 (10 layers)", function()
    assert_losses(run_check(DEEP, 1), DEEP, "serial")
    assert_losses(run_check(DEEP, 2, { "--pipeline=2", "--virtual-stages=3", "--micro-batches=4" }), DEEP, "P = 2, V = 3")
    assert_losses(run_check(DEEP, 4, { "--pipeline=4", "--virtual-stages=2", "--micro-batches=4" }), DEEP, "P = 4, V = 2")
    assert_losses(run_check(DEEP, 4, { "--pipeline=4", "--virtual-stages=3", "--micro-batches=4" }), DEEP, "P = 4, V = 3")
  end)

  it("matches PyTorch at T = 4 with 2 key/value heads: each replicated over 2 ranks (kind_kv_heads.c)", function()
    for _, c in ipairs{
      { 4, { "--tensor=4" } }, { 4, { "--tensor=4", "--recompute=full" } },
      { 4, { "--tensor=4", "--recompute=selective", "--sequence-parallel" } },
      { 8, { "--tensor=4", "--pipeline=2", "--micro-batches=2" } },
    } do
      assert_losses(run_check(TINY, c[1], c[2]), TINY, "kv_heads = 2, " .. table.concat(c[2], " "))
    end
  end)

  it("refuses a split the heads do not allow, naming heads or kv_heads", function()
    local three = h.tmpfile([[
      local pg = require "pipegoose"
      local ctx = pg.ParallelContext{ tensor = 2 }
      pg.parallelize(pg.nn.Llama{ vocab = 50, dim = 48, layers = 1, heads = 6, kv_heads = 3, hidden = 64, seq_len = 8 }, ctx)
    ]])
    local rc, out = h.sh(h.mpirun_cmd(2, { three }, 60))
    os.remove(three)
    assert.is_not.equal(0, rc)
    assert.matches("LlamaAttention 'blocks.0.attn': tensor=2 neither divides kv_heads=3 nor is a multiple of it", out, 1,
      true)
    assert.equal(1, h.count(out, "neither divides kv_heads=3"), "said once for the whole job")
    assert.equal(1, h.count(out, "[ranks 0-1] "), "by one report for the two ranks")
    local six = h.tmpfile([[
      local pg = require "pipegoose"
      local ctx = pg.ParallelContext{ tensor = 4 }
      pg.parallelize(pg.nn.Llama{ vocab = 50, dim = 48, layers = 1, heads = 6, kv_heads = 6, hidden = 64, seq_len = 8 }, ctx)
    ]])
    rc, out = h.sh(h.mpirun_cmd(4, { six }, 60))
    os.remove(six)
    assert.is_not.equal(0, rc)
    assert.matches("LlamaAttention 'blocks.0.attn': tensor=4 does not divide heads=6", out, 1, true)
  end)

  it("writes transformers' tensors back bit for bit (untied and tied), from a T = 2 engine too", function()
    for _, dir in ipairs{ TINY, T4 } do
      local out = h.tmpdir()
      pg.parallelize(pg.nn.from_hf(dir), nil, {}):save_hf(out)
      local want, got = tensors_of(dir .. "/model.safetensors"), tensors_of(out .. "/model.safetensors")
      local n = 0
      for name, t in pairs(want) do
        assert.is_not_nil(got[name], dir .. ": missing " .. name)
        assert.equal(t.shape, got[name].shape, name)
        assert.is_true(t.bytes == got[name].bytes, dir .. ": " .. name .. " differs")
        n = n + 1
      end
      for name in pairs(got) do assert.is_not_nil(want[name], "extra tensor " .. name) end
      assert.equal(dir == TINY and 21 or 20, n)
      local hf = require "pipegoose.hf"
      assert.same(hf.read_config(dir), hf.read_config(out))
      h.rm(out)
    end
    -- a tensor-parallel engine gathers its shards (q|k|v with unequal blocks cut back into q, k, v)
    local out = h.tmpdir()
    local rc, text = h.sh(h.mpirun_cmd(2, check_args(TINY, { "--tensor=2", "--steps=0", "--save-hf=" .. out }), 120))
    assert.equal(0, rc, text)
    local want, got = tensors_of(TINY .. "/model.safetensors"), tensors_of(out .. "/model.safetensors")
    for name, t in pairs(want) do assert.is_true(t.bytes == got[name].bytes, "T = 2: " .. name .. " differs") end
    h.rm(out)
  end)

  it("a model trained at T = 2 exports with --save-hf and reloads with the same loss", function()
    -- the written directory, loaded serially, gives the final loss (and transformers
    -- gives it too: scripts/hf_reference.py loss DIR, checked when the fixture was made)
    check.assert_trained_export_reloads(TINY)
  end)

  it("exports a LLaMA checkpoint with scripts/checkpoint.lua export-hf; llm.c export refuses it", function()
    local ck, out = h.tmpdir(), h.tmpdir()
    local engine = pg.parallelize(pg.nn.from_hf(TINY), nil, {})
    local t = pg.Trainer{ engine = engine, optimizer = pg.optim.AdamW(engine, { lr = 1e-3 }), out = pg.testing.capture() }
    t:save_checkpoint(ck)
    local rc, text = h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", "export-hf", ck, out })
    assert.equal(0, rc, text)
    assert.matches("(LlamaForCausalLM)", text, 1, true)
    local want, got = tensors_of(TINY .. "/model.safetensors"), tensors_of(out .. "/model.safetensors")
    for name, x in pairs(want) do assert.is_true(x.bytes == got[name].bytes, name .. " differs") end
    rc, text = h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", "export-llmc", ck, out .. "/m.bin" })
    assert.equal(1, rc, text)
    assert.matches("the model is llama; llm.c's format holds GPT-2 models only", text, 1, true)
    h.rm(ck)
    h.rm(out)
  end)

  it("a checkpoint saved at T = 2 (q|k|v in unequal blocks) exports transformers' bits and resumes at T = 1", function()
    local ck, out = h.tmpdir(), h.tmpdir()
    local script = h.tmpfile(([[
      local pg = require "pipegoose"
      local ctx = pg.ParallelContext{ tensor = 2 }
      local engine = pg.parallelize(pg.nn.from_hf("%s"), ctx, {})
      local t = pg.Trainer{ engine = engine, optimizer = pg.optim.AdamW(engine, { lr = 1e-3 }), out = pg.testing.capture() }
      t:save_checkpoint("%s")
    ]]):format(TINY, ck))
    local rc, text = h.sh(h.mpirun_cmd(2, { script }, 120))
    os.remove(script)
    assert.equal(0, rc, text)
    rc, text = h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", "export-hf", ck, out })
    assert.equal(0, rc, text)
    local want, got = tensors_of(TINY .. "/model.safetensors"), tensors_of(out .. "/model.safetensors")
    for name, x in pairs(want) do assert.is_true(x.bytes == got[name].bytes, name .. " differs") end
    -- and a serial trainer loads the T = 2 checkpoint into the same weights
    local engine = pg.parallelize(pg.nn.Llama(require("pipegoose.hf").read_config(TINY)), nil, { seed = 3 })
    local t = pg.Trainer{ engine = engine, optimizer = pg.optim.AdamW(engine, { lr = 1e-3 }), out = pg.testing.capture() }
    t:load_checkpoint(ck)
    local ref = pg.parallelize(pg.nn.from_hf(TINY), nil, {})
    for _, p in ipairs(ref:parameters()) do
      assert.is_true(p.tensor:equal(engine:parameter(p.name).tensor), p.name .. " differs after the reload")
    end
    h.rm(ck)
    h.rm(out)
  end)

  it("refuses configs it does not compute, naming the field", function()
    for _, c in ipairs{
      { function(cfg) cfg.hidden_act = "gelu" end, "hidden_act gelu is not supported" },
      { function(cfg) cfg.attention_bias = true end, "attention_bias = true is not supported" },
      { function(cfg) cfg.rope_scaling = { type = "yarn", factor = 2 } end, "rope_scaling type yarn is not supported" },
      { function(cfg) cfg.num_key_value_heads = 3 end, "num_key_value_heads 3 does not divide num_attention_heads 4" },
      { function(cfg) cfg.model_type = "mistral" end, "model_type is mistral" },
    } do
      local dir = edited(TINY, c[1])
      local ok, err = pcall(pg.nn.from_hf, dir)
      h.rm(dir)
      assert.is_false(ok)
      assert.matches(c[2], err, 1, true)
    end
  end)

  it("pg.nn.Llama checks its options", function()
    local base = { vocab = 50, dim = 32, layers = 1, heads = 4, kv_heads = 2, hidden = 64, seq_len = 8 }
    local function with(k, v)
      local o = {}
      for a, b in pairs(base) do o[a] = b end
      o[k] = v
      return o
    end
    for _, c in ipairs{
      { "kv_heads", 3, "Llama: kv_heads=3 does not divide heads=4" },
      { "dim", 30, "Llama: dim=30 is not divisible by heads=4" },
      { "head_dim", 5, "Llama: rotary embeddings need an even head_dim, got 5" },
      { "rope_theta", 1, "Llama: rope_theta must be a finite number > 1, got 1" },
      { "hidden", 0, "Llama: hidden must be a positive integer, got 0" },
    } do
      local ok, err = pcall(pg.nn.Llama, with(c[1], c[2]))
      assert.is_false(ok)
      assert.matches(c[3], err, 1, true)
    end
  end)
end)
