-- worlds: 2 4
-- Tensor parallelism, T = world size: every parallel layer against the serial
-- layer, a whole GPT against T = 1, the collectives of a block, and the
-- replicated parameters staying identical while training. Not run on one
-- rank, where T = 1 would compare a layout with itself.
--
-- The serial reference runs in the same process on a context whose tensor
-- group has size 1 ({data = world}); parameter init is a pure function of
-- (seed, name, index in the full tensor), so both start from the same model.
--
-- Tolerance. Both sides compute in float32 and differ only in summation
-- order: a row-parallel matmul adds T partial sums of in/T products each, the
-- vocab-parallel softmax adds T partial sums of exp, and the column-parallel
-- input gradient adds T partial sums. Each reordering of a sum of K float32
-- terms moves it by at most ~K * 2^-24 * sum|terms| (1e-6 relative for the
-- K <= 64 here), so every comparison is |got - want| <= 1e-5 * |want| + atol
-- with atol = 1e-6 * (largest |want| in the tensor, at least 1): the relative
-- term covers ordinary values, the absolute term the entries that cancel to
-- near zero (a bias gradient summing dy of both signs), where a relative error
-- is meaningless but the absolute rounding error is still ~1e-7 of the terms.
local pg = require "pipegoose"
local h = require "helpers"
local llmc = require "pipegoose.llmc"

local W = pg.world_size()
local T = W
local RTOL, ATOL = 1e-5, 1e-6

local ser = pg.ParallelContext{ data = W, seed = 11 }  -- tensor group of size 1
local par = pg.ParallelContext{ tensor = W, seed = 11 } -- tensor group of size T
local r = par:local_rank("tensor")

-- got ≈ want under the stated tolerance; also refuses an all-zero reference
-- (a comparison of zeros with zeros would prove nothing) unless zero_ok.
local function assert_close(got, want, what, zero_ok) h.assert_scaled_close(got, want, what, RTOL, ATOL, zero_ok) end

-- Rank r's share of the last dimension: seen as `blocks` blocks (3 for a
-- fused q|k|v), each cut into T pieces; piece r of every block.
local function my_cols(t, blocks)
  blocks = blocks or 1
  local s = t:shape()
  local rows, width = t:numel() // s[#s], s[#s]
  local w = width // (blocks * T)
  local piece = t:reshape{ rows, blocks, T, w }:narrow(3, r + 1, 1)
  local out = {}
  for i = 1, #s - 1 do out[i] = s[i] end
  out[#s] = blocks * w
  return piece:reshape(out)
end

local function ids(B, S, vocab, seed)
  -- every vocabulary slice gets hits, including the last real id
  local rows = {}
  for b = 1, B do
    rows[b] = {}
    for s = 1, S do rows[b][s] = (seed * 7919 + b * 131 + s * 31 + b * s * 17) % vocab end
  end
  rows[1][1], rows[B][S] = 0, vocab - 1
  return pg.tensor(rows, { dtype = "int32" })
end

local B, S = 2, 8

-- Runs a spec serially and in parallel on the same input and output gradient.
-- x: the full input; x_par: what this rank feeds the parallel layer (its
-- share, or x itself). Returns both layers and their outputs and input gradients.
local function run_pair(spec, x, x_par, opts)
  opts = opts or {}
  local a = pg.nn.Layer(spec, ser, { seed = 5, input = opts.input_ser })
  local b = pg.nn.Layer(spec, par, { seed = 5, input = opts.input_par })
  local ya, yb = a:forward(x), b:forward(x_par)
  local dy = pg.randn(ya:shape(), { seed = 77 })
  local dxa, dxb = a:backward(dy), b:backward(opts.dy_par and opts.dy_par(dy) or dy)
  return a, b, ya, yb, dxa, dxb
end

-- Every parameter: same full value (init), gathered gradient equal to the serial one.
local function assert_params(a, b, what)
  local names = {}
  for _, p in ipairs(a:params()) do names[#names + 1] = p.name end
  local nb = 0
  for _, p in ipairs(b:params()) do nb = nb + 1 end
  assert.equal(#names, nb, what .. ": same parameters")
  for _, name in ipairs(names) do
    local va, vb = a:gather_param(name), b:gather_param(name)
    assert.is_true(va:equal(vb), what .. " " .. name .. ": the shards are slices of the serial tensor")
    assert_close(b:gather_param(name, true), a:gather_param(name, true), what .. " grad " .. name)
  end
end

describe(("tensor parallel layers, T=%d"):format(T), function()
  local x8 = pg.randn({ B, S, 8 }, { seed = 1 })

  for _, blocks in ipairs{ 1, 3 } do
    it(("column-parallel Linear, blocks=%d, output left split"):format(blocks), function()
      local spec = pg.nn.Linear{ ["in"] = 8, out = 12, parallel = "column", blocks = blocks, name = "fc" }
      local a, b, ya, yb, dxa, dxb = run_pair(spec, x8, x8, { dy_par = function(dy) return my_cols(dy, blocks) end })
      assert.equal(12 // T, yb:shape()[3])
      assert_close(yb, my_cols(ya, blocks), "output")
      assert_close(dxb, dxa, "input gradient")
      assert_params(a, b, "column")
      local w = b:params()[1]
      assert.same({ 12 // T, 8 }, w.shape)
      assert.same({ 12, 8 }, w.full_shape)
    end)

    it(("column-parallel Linear, blocks=%d, gather_output"):format(blocks), function()
      local spec = pg.nn.Linear{ ["in"] = 8, out = 12, parallel = "column", blocks = blocks, gather_output = true, name = "fc" }
      local a, b, ya, yb, dxa, dxb = run_pair(spec, x8, x8)
      assert.equal(12, yb:shape()[3])
      assert_close(yb, ya, "output")
      assert_close(dxb, dxa, "input gradient")
      assert_params(a, b, "column gathered")
    end)
  end

  it("row-parallel Linear, input split here", function()
    local spec = pg.nn.Linear{ ["in"] = 8, out = 12, parallel = "row", name = "proj" }
    local full = { width = 8, split = false }
    local a, b, ya, yb, dxa, dxb = run_pair(spec, x8, x8, { input_ser = full, input_par = full })
    assert_close(yb, ya, "output")
    assert.equal(8, dxb:shape()[3])
    assert_close(dxb, dxa, "input gradient (gathered back to full width)")
    assert_params(a, b, "row")
    local ps = b:params()
    assert.same({ 12, 8 // T }, ps[1].shape)
    assert.same({ 12 }, ps[2].shape) -- the bias is added once after the reduce: replicated
    assert.is_true(ps[2].replicated)
  end)

  it("row-parallel Linear, input already split", function()
    local spec = pg.nn.Linear{ ["in"] = 8, out = 12, parallel = "row", name = "proj" }
    local a, b, ya, yb, dxa, dxb = run_pair(spec, x8, my_cols(x8), {
      input_ser = { width = 8, split = false }, input_par = { width = 8, split = true } })
    assert_close(yb, ya, "output")
    assert.equal(8 // T, dxb:shape()[3])
    assert_close(dxb, my_cols(dxa), "input gradient (this rank's columns)")
    assert_params(a, b, "row split")
  end)

  it("Attention core, heads split over the group", function()
    local spec = pg.nn.Attention{ dim = 16, heads = 4, seq_len = S, name = "core" }
    local qkv = pg.randn({ B, S, 48 }, { seed = 2 })
    local a, b, ya, yb, dxa, dxb = run_pair(spec, qkv, my_cols(qkv, 3), {
      input_ser = { width = 48, split = false }, dy_par = function(dy) return my_cols(dy) end })
    assert_close(yb, my_cols(ya), "output (this rank's heads)")
    assert_close(dxb, my_cols(dxa, 3), "input gradient (this rank's q|k|v columns)")
  end)

  -- ALiBi: rank r holds heads [r H/T, (r + 1) H/T) and their slopes (8 heads, so that at T = 4 too each rank's
  -- slopes differ from every other's: 2^-1 .. 2^-8)
  it("Attention core with ALiBi: each rank its heads' slopes", function()
    local spec = pg.nn.Attention{ dim = 16, heads = 8, seq_len = S, alibi = true, name = "core" }
    local qkv = pg.randn({ B, S, 48 }, { seed = 4 })
    local a, b, ya, yb, dxa, dxb = run_pair(spec, qkv, my_cols(qkv, 3), {
      input_ser = { width = 48, split = false }, dy_par = function(dy) return my_cols(dy) end })
    assert_close(yb, my_cols(ya), "output (this rank's heads)")
    assert_close(dxb, my_cols(dxa, 3), "input gradient (this rank's q|k|v columns)")
    local plain = pg.nn.Layer(pg.nn.Attention{ dim = 16, heads = 8, seq_len = S, name = "core" }, ser, { seed = 5 })
    assert.is_false(plain:forward(qkv):equal(ya), "ALiBi changes the serial output")
  end)

  -- the BLOOM fixtures (4 and 8 heads) against transformers' numbers at T = W (spec/support/bloom_fixture.lua)
  for _, dir in ipairs{ "spec/fixtures/hf_bloom_tiny", "spec/fixtures/hf_bloom_tiny_h8" } do
    it(dir .. ": ALiBi's slopes sliced by heads train as transformers' BLOOM", function()
      local bloom = require "bloom_fixture"
      bloom.assert_agrees(bloom.train(dir, par), bloom.expected(dir), 1e-5, dir .. " T=" .. T)
    end)
  end

  local composites = {
    { "CausalSelfAttention", function() return pg.nn.CausalSelfAttention{ dim = 16, heads = 4, seq_len = S, name = "attn" } end },
    { "CausalSelfAttention (ALiBi)", function()
      return pg.nn.CausalSelfAttention{ dim = 16, heads = 4, seq_len = S, alibi = true, name = "attn" }
    end },
    { "MLP", function() return pg.nn.MLP{ dim = 16, name = "mlp" } end },
    { "TransformerBlock", function() return pg.nn.TransformerBlock{ dim = 16, heads = 4, seq_len = S, name = "blocks.0" } end },
    { "LayerNorm (replicated)", function() return pg.nn.LayerNorm(16, { name = "ln" }) end },
  }
  for _, c in ipairs(composites) do
    it(c[1] .. ": output, input gradient and every parameter gradient", function()
      local x16 = pg.randn({ B, S, 16 }, { seed = 3 })
      local a, b, ya, yb, dxa, dxb = run_pair(c[2](), x16, x16)
      assert_close(yb, ya, "output")
      assert_close(dxb, dxa, "input gradient")
      assert_params(a, b, c[1])
    end)
  end

  -- 61 is prime: T = 2 and 4 pad the vocabulary to 62 and 64 rows.
  local V = 61

  it(("vocab-parallel Embedding, vocabulary %d (padded to %d)"):format(V, pg.nn.round_up(V, T)), function()
    local spec = pg.nn.Embedding{ vocab = V, dim = 16, positions = S, name = "embed" }
    local x = ids(B, S, V, 1)
    local Vp = pg.nn.round_up(V, T)
    for k = 0, T - 1 do -- every rank's vocabulary slice is looked up at least once
      local lo, hi, hits = k * Vp // T, math.min((k + 1) * Vp // T, V), 0
      for _, row in ipairs(x:totable()) do
        for _, id in ipairs(row) do if id >= lo and id < hi then hits = hits + 1 end end
      end
      assert.is_true(hits > 0, "no id in slice " .. k)
    end
    local a = pg.nn.Layer(spec, ser, { seed = 5 })
    local b = pg.nn.Layer(spec, par, { seed = 5 })
    local ya, yb = a:forward(x), b:forward(x)
    assert_close(yb, ya, "output")
    local dy = pg.randn(ya:shape(), { seed = 78 })
    assert.is_nil(a:backward(dy))
    assert.is_nil(b:backward(dy))
    local wte = b:params()[1]
    assert.same({ Vp // T, 16 }, wte.shape)
    assert.same({ Vp, 16 }, wte.full_shape)
    for _, grad in ipairs{ false, true } do
      local full = b:gather_param("embed.wte", grad)
      local want = a:gather_param("embed.wte", grad)
      assert_close(full:narrow(1, 1, V), want:narrow(1, 1, V), "wte rows 1.." .. V .. (grad and " grad" or ""))
      if Vp > V then
        assert.equal(0, full:narrow(1, V + 1, Vp - V):abs():sum(), "padding rows stay 0")
      end
    end
    assert_close(b:gather_param("embed.wpe", true), a:gather_param("embed.wpe", true), "wpe grad")
  end)

  it(("LMHead with the fused vocab-parallel cross-entropy, vocabulary %d"):format(V), function()
    local spec = pg.nn.LMHead{ vocab = V, dim = 16, tie = false, name = "head" }
    local x = pg.randn({ B, S, 16 }, { seed = 4 }):scale(10) -- logits of size ~1: a real softmax, not a flat one
    local y = ids(B, S, V, 2)
    local a = pg.nn.Layer(spec, ser, { seed = 5 })
    local b = pg.nn.Layer(spec, par, { seed = 5 })
    local la, lb = a:forward(x, y), b:forward(x, y)
    assert.is_true(math.abs(lb - la) <= RTOL * math.abs(la), ("loss %.9g vs serial %.9g"):format(lb, la))
    local dxa, dxb = a:backward(), b:backward()
    assert_close(dxb, dxa, "input gradient")
    local Vp = pg.nn.round_up(V, T)
    local g = b:gather_param("head.weight", true)
    assert_close(g:narrow(1, 1, V), a:gather_param("head.weight", true):narrow(1, 1, V), "weight grad")
    if Vp > V then
      assert.equal(0, g:narrow(1, V + 1, Vp - V):abs():sum(), "padding rows get no gradient")
      assert.equal(0, b:gather_param("head.weight"):narrow(1, V + 1, Vp - V):abs():sum(), "padding rows are 0")
    end
  end)

  it("one TransformerBlock: 2 tensor all-reduces forward, 2 backward, nothing else", function()
    local spec = pg.nn.TransformerBlock{ dim = 16, heads = 4, seq_len = S, name = "blocks.0" }
    local b = pg.nn.Layer(spec, par, { seed = 5 })
    local x = pg.randn({ B, S, 16 }, { seed = 3 })
    local function calls()
      local st, n, ar = par:comm_stats(), 0, 0
      for mode, kinds in pairs(st) do
        for kind, c in pairs(kinds) do
          n = n + c.calls
          if mode == "tensor" and kind == "all_reduce" then ar = ar + c.calls end
        end
      end
      return n, ar
    end
    b:forward(x) -- buffers allocated: count a second step
    b:backward(pg.randn({ B, S, 16 }, { seed = 9 }))
    par:reset_comm_stats()
    local y = b:forward(x)
    local nf, arf = calls()
    par:reset_comm_stats()
    b:backward(pg.randn(y:shape(), { seed = 9 }))
    local nb, arb = calls()
    local want = 2 -- forward: attn.proj and mlp.proj (row); backward: qkv and fc (column) input grads
    assert.equal(want, arf, "forward tensor all-reduces")
    assert.equal(want, nf, "forward: no other collective on any group")
    assert.equal(want, arb, "backward tensor all-reduces")
    assert.equal(want, nb, "backward: no other collective on any group")
  end)
end)

describe(("a whole GPT, T=%d against T=1"):format(T), function()
  local model_path, state_path = "spec/fixtures/gpt2_tiny_model.bin", "spec/fixtures/gpt2_tiny_state.bin"
  local cfg = llmc.read_header(model_path)
  local h = pg.file.read(state_path, 0, 256, "int32"):totable()
  local Bf, Sf = h[3], h[4]
  local x = pg.file.read(state_path, 1024, Bf * Sf, "int32"):reshape{ Bf, Sf }
  local y = pg.file.read(state_path, 1024 + 4 * Bf * Sf, Bf * Sf, "int32"):reshape{ Bf, Sf }

  local es = pg.parallelize(pg.nn.GPT.load_llmc(model_path), ser)
  local ep = pg.parallelize(pg.nn.GPT.load_llmc(model_path), par)

  it("gives the same loss and every gradient", function()
    es:zero_grad()
    ep:zero_grad()
    local ls, lp = es:forward_backward(x, y), ep:forward_backward(x, y)
    assert.is_true(math.abs(lp - ls) <= RTOL * math.abs(ls), ("loss %.9g vs %.9g"):format(lp, ls))
    local n = 0
    for _, p in ipairs(es:parameters()) do
      local gs = es:gather_param(p.name, true)
      local gp = ep:gather_param(p.name, true)
      local rows = math.min(gs:shape()[1], gp:shape()[1])
      if p.name == "embed.wte" then rows = cfg.vocab end -- padding rows: 0 in both
      assert_close(gp:narrow(1, 1, rows), gs:narrow(1, 1, rows), "grad " .. p.name)
      n = n + 1
    end
    assert.equal(#es:parameters(), #ep:parameters())
    assert.equal(2 + cfg.layers * 12 + 2, n) -- wte, wpe, 12 per block, ln_f: all compared
    assert.equal(es:num_parameters(), ep:num_parameters())
  end)

  it("with a vocabulary of 61 that T does not divide: same loss, logits and gradients", function()
    -- a fresh GPT (initialised, not loaded): padded_vocab = vocab = 61, so the
    -- engine pads the embedding to 62 (T = 2) or 64 (T = 4) rows of zeros
    local function gpt() return pg.nn.GPT{ vocab = 61, seq_len = Sf, dim = 16, heads = 4, layers = 1 } end
    local a, b = pg.parallelize(gpt(), ser), pg.parallelize(gpt(), par)
    assert.same({ pg.nn.round_up(61, T) // T, 16 }, b:parameter("embed.wte").shape)
    a:zero_grad()
    b:zero_grad()
    local la, lb = a:forward_backward(x, y), b:forward_backward(x, y)
    assert.is_true(math.abs(lb - la) <= RTOL * math.abs(la), ("loss %.9g vs %.9g"):format(lb, la))
    assert_close(b:forward(x), a:forward(x), "logits [B, S, 61]")
    for _, p in ipairs(a:parameters()) do
      local ga, gb = a:gather_param(p.name, true), b:gather_param(p.name, true)
      if p.name == "embed.wte" then
        if gb:shape()[1] > 61 then
          assert.equal(0, gb:narrow(1, 62, gb:shape()[1] - 61):abs():sum(), "padding rows get no gradient")
          assert.equal(0, b:gather_param(p.name):narrow(1, 62, gb:shape()[1] - 61):abs():sum(), "padding rows are 0")
        end
        gb = gb:narrow(1, 1, 61)
      end
      assert_close(gb, ga, "grad " .. p.name)
    end
  end)

  it("trains 20 AdamW steps to the same losses; replicated parameters stay bitwise identical", function()
    -- 1e-5 relative per step: the per-step rounding differences above (~1e-7)
    -- feed back through 20 updates of lr 1e-3; the measured drift is ~1e-8.
    local hp = { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 }
    local os_, op = pg.optim.AdamW(es, hp), pg.optim.AdamW(ep, hp)
    for k = 1, 20 do
      es:zero_grad()
      ep:zero_grad()
      local ls, lp = es:forward_backward(x, y), ep:forward_backward(x, y)
      assert.is_true(math.abs(lp - ls) <= RTOL * math.abs(ls), ("step %d: loss %.9g vs %.9g"):format(k, lp, ls))
      os_:step()
      op:step()
    end
    -- Replicated: LayerNorms, row-parallel biases (added after the reduce), wpe.
    local function is_replicated_name(n)
      return n == "embed.wpe" or n:match("%.ln[12f]?%.") or n:match("^ln_f%.") or n:match("proj%.bias$")
    end
    local replicated, sharded = 0, 0
    for _, p in ipairs(ep:parameters()) do
      if is_replicated_name(p.name) then
        replicated = replicated + 1
        assert.is_true(p.replicated, p.name .. " is marked replicated")
        assert.equal(1, p.split.parts, p.name .. " is not split")
        local all = pg.dist.all_gather(p.tensor:reshape{ 1, p.tensor:numel() }, { group = "tensor", ctx = par })
        for k = 1, T do
          assert.is_true(all:narrow(1, k, 1):reshape(p.shape):equal(p.tensor),
            ("%s differs between tensor rank %d and rank %d"):format(p.name, k - 1, r))
        end
      else
        sharded = sharded + 1
        assert.equal(T, p.split.parts, p.name .. " is split over the tensor group")
      end
    end
    -- wpe, ln_f (2), and per block ln1 (2), ln2 (2), attn.proj.bias, mlp.proj.bias
    assert.equal(1 + 2 + 6 * cfg.layers, replicated)
    -- wte, and per block qkv (2), attn.proj.weight, fc (2), mlp.proj.weight
    assert.equal(1 + 6 * cfg.layers, sharded)
  end)
end)
