-- bfloat16: float32 -> bf16 rounding (nearest, ties to even, as torch) and
-- the bf16 GEMMs of both paths (oneDNN where the CPU has bf16 instructions,
-- the widen-and-sgemm fallback everywhere) against a double-precision
-- reference evaluated on the bf16-rounded inputs.
--
-- GEMM tolerance: each output is a sum of K products of bf16 values (exact
-- in float32) added in float32, so |got - ref| <= K * 2^-24 * sum_k |a_k b_k|
-- bounds the error whatever the order of the sums; RTOL below is that bound
-- for the largest K here (K <= 64: 64 * 6e-8 = 3.8e-6), doubled.
local pg = require "pipegoose"
local ops = pg.ops

local RTOL = 8e-6

local h = require "helpers"
local flat = h.flat

-- The value bf16 keeps of a float32 (bits of x's float32 as an integer, rounded at bit 16).
local function round_bits(x)
  local u = string.unpack("<I4", string.pack("<f", x))
  local keep = u >> 16
  local rest = u & 0xffff
  if rest > 0x8000 or (rest == 0x8000 and keep & 1 == 1) then keep = keep + 1 end
  return string.unpack("<f", string.pack("<I4", keep << 16))
end

describe("bf16 rounding", function()
  it("rounds to nearest with ties to even, as torch (halfway cases both ways, negative, tiny, huge)", function()
    local cases = {
      { 1 + 2 ^ -8, 1 },                                -- tie between 1 and 1 + 2^-7: even is 1
      { 1 + 3 * 2 ^ -8, 1 + 2 ^ -6 },                   -- tie: even is 1 + 2^-6 (truncation gives 1 + 2^-7)
      { 1 + 2 ^ -8 + 2 ^ -20, 1 + 2 ^ -7 },             -- just above the tie: up
      { 1 + 2 ^ -8 - 2 ^ -20, 1 },                      -- just below: down
      { -(1 + 3 * 2 ^ -8), -(1 + 2 ^ -6) },             -- the sign does not change the rounding
      { 3.0, 3.0 }, { 0.0, 0.0 }, { 2 ^ -130, 2 ^ -130 }, -- exact values (a subnormal too) stay
      { 1 / 3, 0x1.56p-2 },                             -- 0x3eaaaaab -> 0x3eab
    }
    local x = pg.tensor((function()
      local t = {}
      for i, c in ipairs(cases) do t[i] = c[1] end
      return t
    end)())
    local got = ops.bf16_round(x):totable()
    for i, c in ipairs(cases) do
      assert.are.equal(c[2], got[i], ("case %d: %.17g"):format(i, c[1]))
    end
  end)

  it("keeps inf and NaN, and rounds past the largest bf16 to inf", function()
    local big = 0x1.fffffep127 -- the largest float32: above bf16's largest finite 0x1.fep127 by more than half an ulp
    local got = ops.bf16_round(pg.tensor({ math.huge, -math.huge, 0 / 0, big, 0x1.fep127 })):totable()
    assert.are.equal(math.huge, got[1])
    assert.are.equal(-math.huge, got[2])
    assert.is_true(got[3] ~= got[3])
    assert.are.equal(math.huge, got[4])
    assert.are.equal(0x1.fep127, got[5])
  end)

  it("agrees with the bit-level rule on random floats, and to_bf16 stores the same values", function()
    local x = pg.randn({ 4096 }, { seed = 7, std = 3 })
    local want = {}
    for i, v in ipairs(flat(x)) do want[i] = round_bits(v) end
    local got, stored = flat(ops.bf16_round(x)), flat(ops.to_bf16(x))
    assert.are.equal("bfloat16", ops.to_bf16(x):dtype())
    for i = 1, #want do
      assert.are.equal(want[i], got[i])
      assert.are.equal(want[i], stored[i])
    end
  end)
end)

-- double reference of y[n,o] = sum_k x[n,k] w[o,k] (+ b[o]) on the rounded inputs; also sum_k |x w| per element
local function ref_forward(x, w, b, N, C, OC)
  local y, mag = {}, {}
  for n = 0, N - 1 do
    for o = 0, OC - 1 do
      local s, m = b and b[o + 1] or 0, 0
      for k = 0, C - 1 do
        local p = x[n * C + k + 1] * w[o * C + k + 1]
        s, m = s + p, m + math.abs(p)
      end
      y[n * OC + o + 1], mag[n * OC + o + 1] = s, m
    end
  end
  return y, mag
end

local function check(name, got, want, mag, base)
  assert.are.equal(#want, #got, name .. ": length")
  for i = 1, #want do
    local tol = RTOL * (mag[i] + math.abs(base and base[i] or 0)) + 1e-30
    if math.abs(got[i] - want[i]) > tol then
      error(("%s[%d]: got %.9g, want %.9g (tolerance %.3g)"):format(name, i, got[i], want[i], tol))
    end
  end
end

local function transpose(a, rows, cols)
  local t = {}
  for r = 0, rows - 1 do
    for c = 0, cols - 1 do t[c * rows + r + 1] = a[r * cols + c + 1] end
  end
  return t
end

-- Both paths wherever oneDNN can run (the automatic choice may still be the
-- fallback: it takes oneDNN only where bf16 outruns float32, see bf16.c).
-- The path this process runs (PG_BF16_GEMM pins it: scripts/run_tests.sh runs
-- the #bf16 tests under each), put back after each test that selects one.
local initial = ops.bf16_gemm_path()
local onednn_ok, onednn_why = pcall(ops.bf16_gemm_path, "onednn")
ops.bf16_gemm_path(initial)
local paths = { "fallback" }
if onednn_ok then paths[2] = "onednn" end

describe("bf16 GEMM", function()
  after_each(function() ops.bf16_gemm_path(initial) end)

  it("names its path and why; an unknown path is one clear error", function()
    local p, why = ops.bf16_gemm_path()
    assert.is_true(p == "onednn" or p == "fallback")
    assert.is_truthy(why:find("AVX512_BF16") or why:find("AMX"))
    assert.has_error(function() ops.bf16_gemm_path("mkl") end,
      "ops.bf16_gemm_path: unknown bf16 GEMM path 'mkl' (expected auto, onednn or fallback)")
  end)

  if not onednn_ok then pending("the onednn path cannot run here: " .. tostring(onednn_why)) end

  for _, path in ipairs(paths) do
    for _, shape in ipairs({ { 37, 53, 29 }, { 1, 64, 7 }, { 16, 8, 40 } }) do
      local N, C, OC = shape[1], shape[2], shape[3]
      it(("%s: forward and backward of [%d,%d] x [%d,%d]^T against double on the rounded inputs"):format(path, N, C,
        OC, C), function()
        assert.are.equal(path, (ops.bf16_gemm_path(path)))
        local x = pg.randn({ N, C }, { seed = 11 })
        local w = pg.randn({ OC, C }, { seed = 12, std = 0.5 })
        local b = pg.randn({ OC }, { seed = 13 })
        local dy = pg.randn({ N, OC }, { seed = 14 })
        local xr, wr, dyr = flat(ops.bf16_round(x)), flat(ops.bf16_round(w)), flat(ops.bf16_round(dy))
        -- forward, with and without bias
        local want, mag = ref_forward(xr, wr, flat(b), N, C, OC)
        check("y", flat(ops.linear_bf16(x, w, b)), want, mag, flat(b))
        want, mag = ref_forward(xr, wr, nil, N, C, OC)
        check("y (no bias)", flat(ops.linear_bf16(x, w)), want, mag)
        -- bfloat16 tensors are used as they are: the same values as rounding float32 ones
        assert.are.same(flat(ops.linear_bf16(x, w)), flat(ops.linear_bf16(ops.to_bf16(x), ops.to_bf16(w))))
        -- backward: dx = dy w, dw += dy^T x onto a start value, db += column sums of the float32 dy
        local dw0, db0 = pg.randn({ OC, C }, { seed = 15 }), pg.randn({ OC }, { seed = 16 })
        local dw0f, db0f = flat(dw0), flat(db0)
        local dx, dw, db = ops.linear_bf16_backward(dy, x, w, true, { dw = dw0, db = db0 })
        local wt = transpose(wr, OC, C)   -- [C, OC]
        want, mag = ref_forward(dyr, wt, nil, N, OC, C)
        check("dx", flat(dx), want, mag)
        local dyt, xt = transpose(dyr, N, OC), transpose(xr, N, C)
        want, mag = ref_forward(dyt, xt, nil, OC, N, C)
        for i = 1, #want do want[i] = want[i] + dw0f[i] end
        check("dw", flat(dw), want, mag, dw0f)
        local dyf, dbf = flat(dy), flat(db)
        for o = 1, OC do
          local s, m = db0f[o], math.abs(db0f[o])
          for n = 0, N - 1 do
            s, m = s + dyf[n * OC + o], m + math.abs(dyf[n * OC + o])
          end
          assert.is_true(math.abs(dbf[o] - s) <= 1e-6 * m, "db[" .. o .. "]")
        end
      end)
    end
  end

  -- Shapes past the fallback's blocks (K in blocks of 1024, then 2048 rows or
  -- columns of C), so that C accumulates over blocks of K and both its rows
  -- and its columns are tiled, in the forward product and in both backward
  -- ones (one of them with the transposed A). The reference is sgemm on the
  -- rounded inputs: the same products, summed in another order, so the bound
  -- is RTOL times the sum of the products' magnitudes.
  for _, path in ipairs(paths) do
    for _, shape in ipairs({ { 2050, 1025, 3 }, { 2, 1025, 2050 } }) do
      local N, C, OC = shape[1], shape[2], shape[3]
      it(("%s: blocked shapes [%d,%d] x [%d,%d]^T agree with sgemm on the rounded inputs"):format(path, N, C, OC, C),
        function()
          assert.are.equal(path, (ops.bf16_gemm_path(path)))
          local x = pg.randn({ N, C }, { seed = 31 })
          local w = pg.randn({ OC, C }, { seed = 32, std = 0.5 })
          local dy = pg.randn({ N, OC }, { seed = 33 })
          local xr, wr, dyr = ops.bf16_round(x), ops.bf16_round(w), ops.bf16_round(dy)
          local function within(name, got, want, mag)
            local d = got:sub(want):abs():sub(mag:scale(RTOL))
            local over = d:reshape({ d:numel() }):max(1):item()
            assert.is_true(over <= 0, name .. ": past the bound by " .. over)
          end
          within("y", ops.linear_bf16(x, w), ops.linear(xr, wr), ops.linear(xr:abs(), wr:abs()))
          local dx, dw = ops.linear_bf16_backward(dy, x, w, false)
          local wdx, wdw = ops.linear_backward(dyr, xr, wr, false)
          local mdx, mdw = ops.linear_backward(dyr:abs(), xr:abs(), wr:abs(), false)
          within("dx", dx, wdx, mdx)
          within("dw", dw, wdw, mdw)
        end)
    end
  end

  it("the products use the rounded inputs: the result differs from float32 sgemm by the rounding", function()
    local x = pg.randn({ 8, 64 }, { seed = 21 })
    local w = pg.randn({ 8, 64 }, { seed = 22 })
    local y16, y32 = flat(ops.linear_bf16(x, w)), flat(ops.linear(x, w))
    local yr = flat(ops.linear(ops.bf16_round(x), ops.bf16_round(w)))
    local far = 0
    for i = 1, #y16 do
      assert.is_true(math.abs(y16[i] - yr[i]) <= 1e-4, "bf16 GEMM against sgemm of the rounded inputs")
      if math.abs(y16[i] - y32[i]) > 1e-3 then far = far + 1 end
    end
    assert.is_true(far > #y16 / 2, "most outputs move by the inputs' rounding (~2^-9 relative)")
  end)
end)

-- A tiny GPT-2 and a batch for the engine-level checks below.
local function tiny() return pg.nn.GPT.load_llmc("spec/fixtures/gpt2_tiny_model.bin") end
local function batch(B, T)
  B, T = B or 4, T or 16
  local x, y = pg.zeros({ B, T }, { dtype = "int32" }), pg.zeros({ B, T }, { dtype = "int32" })
  for b = 1, B do
    for s = 1, T do
      x:set(b, s, (b * 31 + s * 7) % 61)
      y:set(b, s, (b * 13 + s * 5 + b * s) % 61)
    end
  end
  return x, y
end

describe("precision = bf16 in pg.parallelize #bf16", function()
  it("uses the weights of the last optimizer step: after a step, the loss is a fresh engine's on those weights",
    function()
      local x, y = batch()
      local a = pg.parallelize(tiny(), pg.ParallelContext{}, { precision = "bf16" })
      local opt = pg.optim.AdamW(a, { lr = 1e-2 })
      for _ = 1, 2 do
        a:zero_grad()
        a:forward_backward(x, y)
        opt:step()
      end
      local b = pg.parallelize(tiny(), pg.ParallelContext{}, { precision = "bf16" })
      for _, p in ipairs(a:parameters()) do b:parameter(p.name).tensor:copy_(p.tensor) end
      local la, lb = a:loss(x, y), b:loss(x, y)
      assert.are.equal(lb, la)
      -- and a write from Lua between calls is seen too
      for _, p in ipairs(b:parameters()) do a:parameter(p.name).tensor:copy_(pg.zeros(p.tensor:shape())) end
      assert.is_true(math.abs(a:loss(x, y) - math.log(61)) < 1e-6, "all-zero weights: uniform logits")
    end)

  it("differs from fp32 by bf16's rounding only, and memory() reports the working weights", function()
    local x, y = batch()
    local e32 = pg.parallelize(tiny(), pg.ParallelContext{})
    local e16 = pg.parallelize(tiny(), pg.ParallelContext{}, { precision = "bf16" })
    local l32, l16 = e32:loss(x, y), e16:loss(x, y)
    assert.is_true(l16 ~= l32 and math.abs(l16 - l32) < 1e-3 * l32, ("fp32 %.9g bf16 %.9g"):format(l32, l16))
    local m32, m16 = e32:memory(), e16:memory()
    assert.are.equal("fp32", m32.precision)
    assert.are.equal("bf16", m16.precision)
    assert.are.equal(0, m32.bf16_bytes)
    -- the linear layers' and the head's weights, 2 bytes each, at least (plus their operand scratch)
    local n = 0
    for _, p in ipairs(e16:parameters()) do
      if #p.shape == 2 and p.name ~= "wpe.weight" then
        n = n + p.shape[1] * p.shape[2]
      end
    end
    assert.is_true(m16.bf16_bytes >= 2 * n, ("bf16_bytes %d for %d weights"):format(m16.bf16_bytes, n))
    assert.are.equal(m32.params_bytes, m16.params_bytes) -- the masters stay float32
    assert.are.equal(m32.grads_bytes, m16.grads_bytes)
    -- the activations autocast makes bf16 take 2 bytes instead of 4: per layer and row, q|k|v, the attention
    -- core's output, its projection's, the MLP's two Linears' and GELU's; the rest (norms, residual stream, the
    -- attention's log-sum-exp) stays, and the attention core keeps its float32 output beside the bf16 one (the
    -- flash backward's delta reads it): 4 more bytes, so its C columns count -1 (+1 - 2)
    local per_row = 0
    for _, p in ipairs(e16:parameters()) do
      -- q|k|v; the core's output (-1) and its projection's (+1) cancel
      if p.name:match("qkv%.weight$") then per_row = per_row + p.shape[1] end
      if p.name:match("fc%.weight$") then per_row = per_row + 2 * p.shape[1] + p.shape[2] end
    end
    assert.is_true(per_row > 0)
    assert.are.equal(2 * 4 * 16 * per_row, m32.activation_bytes - m16.activation_bytes)
  end)

  it("with recomputation (full, selective) gives the run without it bit for bit: the working weights are not in "
    .. "the recomputed blocks' shared buffers (GPT-2, and Mixtral's experts with their own working weights)", function()
    local x, y = batch()
    local function mixtral()
      return pg.nn.Mixtral{ vocab = 61, dim = 16, layers = 2, heads = 2, kv_heads = 1, hidden = 24, seq_len = 16,
                            experts = 4, top_k = 2, aux_loss_coef = 0.02 }
    end
    local function run(recompute, model)
      local e = pg.parallelize(model(), pg.ParallelContext{ seed = 3 }, { precision = "bf16", recompute = recompute,
                                                                        micro_batches = 2 })
      local opt = pg.optim.AdamW(e, { lr = 1e-2 })
      local losses = {}
      for i = 1, 3 do
        e:zero_grad()
        losses[i] = e:forward_backward(x, y)
        opt:step()
      end
      losses[4] = e:loss(x, y)
      return losses, e:flat():clone()
    end
    for name, model in pairs{ gpt2 = tiny, mixtral = mixtral } do
      local want, w = run("none", model)
      for _, how in ipairs{ "full", "selective" } do
        local got, g = run(how, model)
        assert.are.same(want, got, name .. " " .. how)
        assert.is_true(g:equal(w), name .. " " .. how .. ": weights")
      end
    end
  end)

  it("refuses what it cannot run with one clear error", function()
    local ok, err = pcall(pg.parallelize, tiny(), pg.ParallelContext{}, { precision = "fp16" })
    assert.is_false(ok)
    assert.matches("parallelize: precision must be 'fp32' or 'bf16', got 'fp16'", err, 1, true)
  end)

  it("runs modules written in Lua in float32 among bf16 ones", function()
    -- examples/lua_llama.lua: attention and MLP in Lua (float32), the head's product bf16
    local L = dofile("examples/lua_llama.lua")
    local cfg = require("pipegoose.hf").read_config("spec/fixtures/hf_llama_tiny")
    local x, y = batch()
    local l32 = pg.parallelize(L.Llama(cfg), pg.ParallelContext{ seed = 3 }):loss(x, y)
    local l16 = pg.parallelize(L.Llama(cfg), pg.ParallelContext{ seed = 3 }, { precision = "bf16" }):loss(x, y)
    assert.is_true(l16 ~= l32 and math.abs(l16 - l32) < 1e-3 * l32, ("fp32 %.9g bf16 %.9g"):format(l32, l16))
  end)
end)

describe("bf16 exports (scripts/checkpoint.lua export-llmc / export-hf --bf16) #bf16", function()
  local st = require "pipegoose.safetensors"

  it("write llm.c's version 5 and BF16 safetensors of the float32 masters, rounded, and load back as those values",
    function()
      local ck, out = h.tmpdir(), h.tmpdir()
      local x, y = batch()
      local engine = pg.parallelize(tiny(), pg.ParallelContext{}, { precision = "bf16" })
      local opt = pg.optim.AdamW(engine, { lr = 1e-3 })
      engine:zero_grad()
      engine:forward_backward(x, y)
      opt:step()
      local t = pg.Trainer{ engine = engine, optimizer = opt, out = pg.testing.capture() }
      t:save_checkpoint(ck)
      -- the masters, rounded: what both files must hold
      local want = {}
      for _, p in ipairs(engine:parameters()) do want[p.name] = ops.bf16_round(p.tensor:clone()) end

      os.execute("mkdir -p " .. h.quote(out))
      local rc, text = h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", "export-llmc", ck, out .. "/m.bin", "--bf16" })
      assert.equal(0, rc, text)
      assert.matches("llm.c GPT-2 model (bfloat16)", text, 1, true)
      local f = assert(io.open(out .. "/m.bin", "rb"))
      local magic, version = string.unpack("<i4i4", f:read(8))
      f:close()
      assert.are.same({ 20240326, 5 }, { magic, version })
      local e = pg.parallelize(pg.nn.GPT.load_llmc(out .. "/m.bin"), pg.ParallelContext{})
      for _, p in ipairs(e:parameters()) do assert.is_true(p.tensor:equal(want[p.name]), p.name) end

      rc, text = h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", "export-hf", ck, out .. "/hf", "--bf16" })
      assert.equal(0, rc, text)
      local header = st.read_header(out .. "/hf/model.safetensors")
      for name, entry in pairs(header.entries) do assert.are.equal("bfloat16", entry.dtype, name) end
      local cf = assert(io.open(out .. "/hf/config.json"))
      assert.matches('"torch_dtype": "bfloat16"', cf:read("a"), 1, true)
      cf:close()
      e = pg.parallelize(pg.nn.from_hf(out .. "/hf"), pg.ParallelContext{})
      for _, p in ipairs(e:parameters()) do assert.is_true(p.tensor:equal(want[p.name]), p.name) end
      h.rm(ck)
      h.rm(out)
    end)

  it("refuses an unknown export dtype", function()
    local ok, err = pcall(require("pipegoose.checkpoint").export_llmc, "/nonexistent", "/tmp/x.bin", { dtype = "fp16" })
    assert.is_false(ok)
    assert.are.equal("checkpoint: the export dtype must be float32 or bfloat16, not fp16", err)
  end)
end)

-- torch.autocast's activation types, on a model where every kind meets them: column-parallel Linears feeding the
-- attention core, GELU and SwiGLU between float32 norms, row-parallel Linears whose bf16 output is added to the
-- float32 residual stream, the same for a plain Linear and GELU; and a Linear and GELU that stay float32
-- because a norm consumes them. The engine's loss and gradients against
-- the same composition of pg.ops kernels, rounding where autocast makes a tensor bf16. Tolerances: the same
-- kernels on the same values, so float32 noise only: 1e-6 of the loss and of each gradient's largest element;
-- float32 activations move the loss by ~1e-5 relative (printed).
describe("bf16 activations (torch.autocast's types) #bf16", function()
  local nn, V, C, H, HEADS = pg.nn, 61, 16, 48, 2
  local function net()
    local function col(o, name, blocks) return nn.Linear{ ["in"] = C, out = o, parallel = "column", name = name,
                                                          blocks = blocks } end
    local function row(i, name) return nn.Linear{ ["in"] = i, out = C, parallel = "row", name = name } end
    return nn.Sequential{
      nn.Embedding{ vocab = V, dim = C, positions = 8, name = "embed" },
      nn.Residual(nn.Sequential{ nn.LayerNorm(C), col(3 * C, "qkv", 3), nn.Attention{ dim = C, heads = HEADS,
                                 seq_len = 8 }, row(C, "o") }),
      nn.Residual(nn.Sequential{ nn.LayerNorm(C), col(H, "fc"), nn.GELU(), row(H, "proj") }),
      nn.Residual(nn.Sequential{ nn.LayerNorm(C), col(2 * H, "gate", 2), nn.GatedSiLU(), row(H, "down") }),
      nn.Residual(nn.Sequential{ nn.Linear{ ["in"] = C, out = C, name = "mix" }, nn.GELU() }),
      -- GELU before a norm: the Linear and GELU make float32 for their float32 consumer
      nn.Residual(nn.Sequential{ nn.Linear{ ["in"] = C, out = C, name = "mix" }, nn.GELU(), nn.LayerNorm(C) }),
      nn.LayerNorm(C, { name = "ln_f" }),
      nn.LMHead{ vocab = V, dim = C, tie = false, name = "head" },
    }
  end

  -- The reference: forward and backward with pg.ops; round(t) where autocast's tensor is bf16 (round = identity:
  -- float32 activations with the products on bf16 operands). A bf16 tensor's gradient is bf16.
  local function reference(e, x, y, round)
    local P = {}
    for _, p in ipairs(e:parameters()) do P[p.name] = p.tensor end
    local function w(name) return (assert(P[name], name)) end
    local N, T = x:shape()[1] * x:shape()[2], x:shape()[2]
    local function ln(block, h) return ops.layernorm(h, w(block .. ".1.weight"), w(block .. ".1.bias")) end
    local function ln_back(block, d, h, m, r) return (ops.layernorm_backward(d, h, w(block .. ".1.weight"), m, r)) end
    local function lin(a, name) return ops.linear_bf16(a, w(name .. ".weight"), w(name .. ".bias")) end
    local function lin_back(d, a, name) return ops.linear_bf16_backward(d, a, w(name .. ".weight")) end
    local h0 = ops.position(ops.embedding(x, w("embed.wte")), w("embed.wpe"), T)
    local a2, m2, r2 = ln(2, h0)
    local qkv = round(lin(a2, "2.qkv"))
    local att_out, lse = ops.attention(qkv, HEADS) -- the float32 output: the backward's delta reads it
    local o = round(att_out)
    local h1 = ops.residual(h0, round(lin(o, "2.o")))
    local a3, m3, r3 = ln(3, h1)
    local u = round(lin(a3, "3.fc"))
    local g = round(ops.gelu(u))
    local h2 = ops.residual(h1, round(lin(g, "3.proj")))
    local a4, m4, r4 = ln(4, h2)
    local gu = round(lin(a4, "4.gate"))
    local sw = round(ops.swiglu(gu))
    local h3 = ops.residual(h2, round(lin(sw, "4.down")))
    local p = round(lin(h3, "5.mix"))
    local h4 = ops.residual(h3, round(ops.gelu(p)))
    local p6 = lin(h4, "6.mix")
    local q6 = ops.gelu(p6)
    local n6, m6, r6 = ops.layernorm(q6, w("6.3.weight"), w("6.3.bias"))
    local h5 = ops.residual(h4, n6)
    local f, fm, fr = ops.layernorm(h5, w("ln_f.weight"), w("ln_f.bias"))
    local logits = ops.linear_bf16(f, w("head.weight"))
    local _, dlogits, total = ops.cross_entropy(logits, y, { valid = V, dloss = 1 / N })
    local dh5 = ops.layernorm_backward(ops.linear_bf16_backward(dlogits, f, w("head.weight"), false), h5,
                                       w("ln_f.weight"), fm, fr)
    local dq6 = ops.layernorm_backward(dh5, q6, w("6.3.weight"), m6, r6)
    local dx6, dmix6 = lin_back(ops.gelu_backward(dq6, p6), h4, "6.mix")
    local dh4 = ops.residual(dh5, dx6)
    local dp = round(ops.gelu_backward(round(dh4), p))
    local dh3 = ops.residual(dh4, (lin_back(dp, h3, "5.mix")))
    local dsw = round((lin_back(round(dh3), sw, "4.down")))
    local da4, dgate = lin_back(round(ops.swiglu_backward(dsw, gu)), a4, "4.gate")
    local dh2 = ops.residual(dh3, ln_back(4, da4, h2, m4, r4))
    local dg = round((lin_back(round(dh2), g, "3.proj")))
    local da3, dfc, dfcb = lin_back(round(ops.gelu_backward(dg, u)), a3, "3.fc")
    local dh1 = ops.residual(dh2, ln_back(3, da3, h1, m3, r3))
    local dout = round((lin_back(round(dh1), o, "2.o")))
    local _, dqkv, dqkvb = lin_back(round(ops.attention_backward(dout, qkv, att_out, lse, HEADS)), a2, "2.qkv")
    return total / N, { ["2.qkv.weight"] = dqkv, ["2.qkv.bias"] = dqkvb, ["3.fc.weight"] = dfc,
                        ["3.fc.bias"] = dfcb, ["4.gate.weight"] = dgate, ["6.mix.weight"] = dmix6 }
  end

  it("match a composition of the kernels that rounds where autocast's tensors are bf16", function()
    local x, y = batch(2, 8)
    local e = pg.parallelize(net(), pg.ParallelContext{ seed = 5 }, { precision = "bf16" })
    -- weights of unit scale (matrices 1/sqrt(fan-in), norms near 1), so that a rounding more or less shows
    local r = 0
    for _, prm in ipairs(e:parameters()) do
      local vals = flat(prm.tensor)
      for i = 1, #vals do
        r = (r * 1103515245 + 12345) % 2147483648
        local u = r / 2147483648 - 0.5
        vals[i] = #prm.shape == 2 and u * 2 / math.sqrt(prm.shape[2]) or 1 + u / 2
      end
      prm.tensor:copy_(pg.tensor(vals):view(prm.shape))
    end
    e:zero_grad()
    local loss = e:forward_backward(x, y)
    local want, grads = reference(e, x, y, ops.bf16_round)
    local float32_acts = reference(e, x, y, function(t) return t end)
    print(("bf16 activations: engine %.9g reference %.9g (float32 activations %.9g)"):format(loss, want,
      float32_acts))
    assert.is_true(math.abs(loss - want) <= 1e-6 * want, ("engine %.9g, reference %.9g"):format(loss, want))
    assert.is_true(math.abs(float32_acts - want) > 5e-6 * want, "the test cannot tell bf16 activations from float32")
    for name, g in pairs(grads) do
      local diff, scale = e:parameter(name).grad:max_abs_diff(g), g:max_abs_diff(pg.zeros(g:shape()))
      assert.is_true(scale > 0 and diff <= 1e-6 * scale,
        ("%s: max |engine - reference| %.3g, max |reference| %.3g"):format(name, diff, scale))
    end
  end)
end)
