-- pg.nn.Bloom against transformers' BloomForCausalLM: spec/fixtures/hf_bloom_tiny
-- is a random BLOOM (odd vocabulary 61, dim 32, 4 heads, 2 layers, ALiBi, the
-- embedding LayerNorm, tied head, LayerNorm weights and biases perturbed) and
-- hf_bloom_tiny_h8 the same weights read with 8 heads (so that T = 4 divides
-- them), written by scripts/make_bloom_reference.py with the losses of 10
-- clipped AdamW steps computed by transformers 4.45.2 itself, in float32.
-- scripts/model_check.lua imports the directory with pg.nn.from_hf
-- (lua/pipegoose/models/bloom.lua: query_key_value's per-head rows reordered by
-- the permutation hook) and trains it serially and in parallel layouts.
-- Tolerance: 1e-5 relative on every loss and the first gradient norm, 1e-4 on
-- the later norms, as for LLaMA (spec/unit/llama_spec.lua says why); measured:
-- every number within 1.5e-7 of transformers'.
local pg = require "pipegoose"
local h = require "helpers"
local check = require "hf_model_check"

local TINY, H8 = "spec/fixtures/hf_bloom_tiny", "spec/fixtures/hf_bloom_tiny_h8"

describe("pg.nn.Bloom (BloomForCausalLM) against transformers", function()
  it("reads the config: ALiBi heads, tied head, padded vocabulary, the 4 x dim MLP, BLOOM's length", function()
    local c = pg.nn.from_hf(TINY).config
    assert.same({ "bloom", 61, 64, 2048, 32, 4, 2, 128, true },
      { c.arch, c.vocab, c.padded_vocab, c.seq_len, c.dim, c.heads, c.layers, c.hidden, c.tie })
    assert.equal(8, pg.nn.from_hf(H8).config.heads)
    -- BloomConfig's other spellings (bigscience's files say n_embed), and seq_length
    local dir = check.edited(TINY, function(cfg)
      cfg.hidden_size, cfg.n_embed = nil, 32
      cfg.n_layer, cfg.num_hidden_layers = 7, 2
      cfg.seq_length = 24
    end)
    c = pg.nn.from_hf(dir).config
    h.rm(dir)
    assert.same({ 32, 2, 24 }, { c.dim, c.layers, c.seq_len })
    -- parameters: embedding, its LayerNorm, per layer 2 LayerNorms, q|k|v, dense, fc, proj with biases, ln_f
    local engine = pg.parallelize(pg.nn.from_hf(TINY), nil, {})
    assert.equal(3 + 12 * 2 + 2, #engine:parameters())
    assert.is_nil(engine:parameter("embed.wpe"))
  end)

  it("serially: the loss at the loaded weights and 10 clipped AdamW steps match transformers", function()
    check.assert_losses(check.run_check(TINY, 1), TINY, "serial")
    check.assert_losses(check.run_check(H8, 1), H8, "serial, 8 heads")
  end)

  it("matches transformers with T = 2, P = 2 (both schedules), D = 2 (ZeRO-1) and 2 x 2 x 2", function()
    for _, c in ipairs{
      { 2, { "--tensor=2" } }, { 2, { "--pipeline=2", "--micro-batches=2" } },
      { 2, { "--pipeline=2", "--micro-batches=4", "--schedule=gpipe" } }, { 2, { "--data=2", "--zero=1" } },
      { 8, { "--tensor=2", "--pipeline=2", "--data=2", "--micro-batches=2", "--zero=1" } },
    } do
      check.assert_losses(check.run_check(TINY, c[1], c[2]), TINY, table.concat(c[2], " "))
    end
  end)

  it("matches transformers at T = 4 (8 heads: each rank its two heads' ALiBi slopes)", function()
    check.assert_losses(check.run_check(H8, 4, { "--tensor=4" }), H8, "T = 4")
  end)

  it("writes transformers' tensors back bit for bit (q|k|v per head again), from a T = 2 engine too", function()
    local out = h.tmpdir()
    pg.parallelize(pg.nn.from_hf(TINY), nil, {}):save_hf(out)
    assert.equal(3 + 12 * 2 + 2, check.assert_same_tensors(TINY .. "/model.safetensors", out .. "/model.safetensors",
      "serial"))
    local hf = require "pipegoose.hf"
    local want, got = hf.read_config(TINY), hf.read_config(out)
    assert.same(want, got)
    h.rm(out)
    out = h.tmpdir()
    local rc, text = h.sh(h.mpirun_cmd(2, check.check_args(TINY, { "--tensor=2", "--steps=0", "--save-hf=" .. out }),
      120))
    assert.equal(0, rc, text)
    check.assert_same_tensors(TINY .. "/model.safetensors", out .. "/model.safetensors", "T = 2")
    h.rm(out)
  end)

  it("a model trained at T = 2 exports with --save-hf and reloads with the same loss", function()
    check.assert_trained_export_reloads(TINY)
  end)

  it("a checkpoint saved at T = 2 exports transformers' bits with export-hf and resumes serially; llm.c refuses it",
    function()
      local ck, out = h.tmpdir(), h.tmpdir()
      local script = h.tmpfile(([[
        local pg = require "pipegoose"
        local engine = pg.parallelize(pg.nn.from_hf("%s"), pg.ParallelContext{ tensor = 2 }, {})
        local t = pg.Trainer{ engine = engine, optimizer = pg.optim.AdamW(engine, { lr = 1e-3 }), out = pg.testing.capture() }
        t:save_checkpoint("%s")
      ]]):format(TINY, ck))
      local rc, text = h.sh(h.mpirun_cmd(2, { script }, 120))
      os.remove(script)
      assert.equal(0, rc, text)
      rc, text = h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", "export-hf", ck, out })
      assert.equal(0, rc, text)
      assert.matches("(BloomForCausalLM)", text, 1, true)
      check.assert_same_tensors(TINY .. "/model.safetensors", out .. "/model.safetensors", "export-hf")
      rc, text = h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", "export-llmc", ck, out .. "/m.bin" })
      assert.equal(1, rc, text)
      assert.matches("the model is bloom; llm.c's format holds GPT-2 models only", text, 1, true)
      -- the checkpoint's model record rebuilds the model: a serial trainer loads the T = 2 shards
      local engine = pg.parallelize(pg.nn.Bloom(require("pipegoose.hf").read_config(TINY)), nil, { seed = 3 })
      local t = pg.Trainer{ engine = engine, optimizer = pg.optim.AdamW(engine, { lr = 1e-3 }), out = pg.testing.capture() }
      t:load_checkpoint(ck)
      local ref = pg.parallelize(pg.nn.from_hf(TINY), nil, {})
      for _, p in ipairs(ref:parameters()) do
        assert.is_true(p.tensor:equal(engine:parameter(p.name).tensor), p.name .. " differs after the reload")
      end
      assert.equal("Bloom", pg.nn.from_config(engine.config).label)
      h.rm(ck)
      h.rm(out)
    end)

  it("refuses configs it does not compute, naming the field", function()
    for _, c in ipairs{
      { function(cfg) cfg.apply_residual_connection_post_layernorm = true end,
        "apply_residual_connection_post_layernorm = true is not supported" },
      { function(cfg) cfg.layer_norm_epsilon = 1e-6 end, "layer_norm_epsilon 1e-06 is not supported" },
      { function(cfg) cfg.n_head = 5 end, "hidden_size 32 is not divisible by n_head 5" },
      { function(cfg) cfg.vocab_size = 0 end, "vocab_size must be a positive integer, got 0" },
    } do
      local dir = check.edited(TINY, c[1])
      local ok, err = pcall(pg.nn.from_hf, dir)
      h.rm(dir)
      assert.is_false(ok)
      assert.matches(c[2], err, 1, true)
    end
  end)

  it("refuses a split the heads do not allow, naming heads", function()
    local rc, out = h.sh(h.mpirun_cmd(8, check.check_args(TINY, { "--tensor=8" }), 60))
    assert.is_not.equal(0, rc)
    assert.matches("tensor=8 does not divide heads=4", out, 1, true)
  end)

  it("the planner reads it: parameters counted as the engine holds them, BLOOM-560M's published count", function()
    local plan = require "pipegoose.plan.models"
    local s = plan.load_hf(TINY .. "/config.json")
    assert.equal("bloom", s.arch)
    assert.is_true(s.embed_norm and not s.learned_positions and not s.rope)
    local engine = pg.parallelize(pg.nn.from_hf(TINY), nil, {})
    local n = 0
    for _, p in ipairs(engine:parameters()) do n = n + p.tensor:numel() end
    -- the vocabulary's 61 rows; the engine's embedding also holds 3 rows of padding (64)
    assert.equal(engine:num_parameters(), plan.num_params(s))
    assert.equal(n, plan.num_params(s) + (64 - 61) * 32)
    -- bigscience/bloom-560m: 559,214,592 parameters (its model card)
    assert.equal(559214592, plan.num_params(plan.get("bloom-560m")))
  end)
end)
