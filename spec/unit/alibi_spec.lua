-- ALiBi (BLOOM's attention biases, issue 32 item 6): the slopes against
-- transformers' build_alibi_tensor, the attention kernel's biases against a
-- plain Lua reference, and the attention module's alibi option.
local pg = require "pipegoose"
local h = require "helpers"
local ops = pg.ops
local flat = h.flat

-- transformers 4.45.2's slopes (float32, exact), from
-- `scripts/make_bloom_reference.py --slopes` (its slopes_exact lines, trailing
-- zero hex digits dropped): build_alibi_tensor at key position 1.
local TRANSFORMERS = {
  [1] = { 0x1p-8 },
  [2] = { 0x1p-4, 0x1p-8 },
  [4] = { 0x1p-2, 0x1p-4, 0x1p-6, 0x1p-8 },
  [6] = { 0x1p-2, 0x1p-4, 0x1p-6, 0x1p-8, 0x1p-1, 0x1p-3 },
  [8] = { 0x1p-1, 0x1p-2, 0x1p-3, 0x1p-4, 0x1p-5, 0x1p-6, 0x1p-7, 0x1p-8 },
  [12] = {
    0x1p-1, 0x1p-2, 0x1p-3, 0x1p-4, 0x1p-5, 0x1p-6, 0x1p-7, 0x1p-8, 0x1.6a09e6p-1, 0x1.6a09e6p-2, 0x1.6a09e4p-3,
    0x1.6a09e4p-4
  },
  [16] = {
    0x1.6a09e6p-1, 0x1.fffffep-2, 0x1.6a09e6p-2, 0x1.fffffep-3, 0x1.6a09e4p-3, 0x1.fffffcp-4, 0x1.6a09e4p-4,
    0x1.fffffcp-5, 0x1.6a09e2p-5, 0x1.fffffap-6, 0x1.6a09e2p-6, 0x1.fffffap-7, 0x1.6a09ep-7, 0x1.fffff8p-8,
    0x1.6a09ep-8, 0x1.fffff6p-9
  },
  [30] = {
    0x1.6a09e6p-1, 0x1.fffffep-2, 0x1.6a09e6p-2, 0x1.fffffep-3, 0x1.6a09e4p-3, 0x1.fffffcp-4, 0x1.6a09e4p-4,
    0x1.fffffcp-5, 0x1.6a09e2p-5, 0x1.fffffap-6, 0x1.6a09e2p-6, 0x1.fffffap-7, 0x1.6a09ep-7, 0x1.fffff8p-8,
    0x1.6a09ep-8, 0x1.fffff6p-9, 0x1.ae89fap-1, 0x1.306fe2p-1, 0x1.ae89fcp-2, 0x1.306fe2p-2, 0x1.ae89fep-3,
    0x1.306fe4p-3, 0x1.ae89fep-4, 0x1.306fe6p-4, 0x1.ae8ap-5, 0x1.306fe6p-5, 0x1.ae8a02p-6, 0x1.306fe8p-6,
    0x1.ae8a04p-7, 0x1.306fe8p-7
  },
}

-- Where torch.pow (1.13, CPU, AVX2: Sleef's vectorised pow, a 1-ulp bound)
-- is 1 ulp below the correctly rounded power that pg_alibi_slopes computes
-- (kernels/cpu/attention.c): 2^-0.5 to the 13th, slope 13 of 16 to 31 heads.
local TORCH_ULP_LOW = { [16] = { [13] = true }, [30] = { [13] = true } }

local function ulp(x) -- of a positive normal float32
  local _, e = math.frexp(x) -- x = m 2^e, 0.5 <= m < 1
  return 2.0 ^ (e - 24)
end

describe("ALiBi slopes", function()
  for _, n in ipairs{ 1, 2, 4, 6, 8, 12, 16, 30 } do
    it(("for %d heads are transformers' float32 values"):format(n), function()
      local got, want = flat(ops.alibi_slopes(n)), TRANSFORMERS[n]
      assert.equal(n, #got)
      for k = 1, n do
        if TORCH_ULP_LOW[n] and TORCH_ULP_LOW[n][k] then
          assert.equal(want[k] + ulp(want[k]), got[k], ("slope %d of %d: torch's value + 1 ulp"):format(k, n))
        else
          assert.equal(want[k], got[k], ("slope %d of %d heads"):format(k, n))
        end
      end
    end)
  end

  it("follow the rule for every head count up to 128 (powers of a float32 base, the others at odd powers)", function()
    for n = 1, 128 do
      local s = flat(ops.alibi_slopes(n))
      local p = 1
      while p * 2 <= n do p = p * 2 end
      for k = 1, n do
        assert(s[k] > 0 and s[k] < 1, ("slope %d of %d is %.9g"):format(k, n, s[k]))
        local e = k <= p and math.log(p, 2) or math.log(2 * p, 2)
        local pow = k <= p and k or 2 * (k - p) - 1
        local want = 2.0 ^ (-(2.0 ^ (-(e - 3))) * pow)
        -- the float32 base is off by up to 2^-24 relative, its pow-th power by pow times that, then one rounding
        assert(math.abs(s[k] - want) <= (pow + 2) * ulp(want), ("slope %d of %d: %.9g, the exact power %.9g"):format(
          k, n, s[k], want))
      end
      local prefix = flat(ops.alibi_slopes(p))
      for k = 1, p do assert.equal(prefix[k], s[k]) end -- the first p are p heads' slopes
    end
  end)

  it("refuse a head count below 1, naming it", function()
    assert.has_error(function() ops.alibi_slopes(0) end, "ops.alibi_slopes: heads: expected an integer >= 1, got 0")
  end)
end)

-- The reference in double at the kernel's float32 inputs, with transformers'
-- bias slope_h * j (the kernel adds slope_h * (j - i): the same softmax).
local function alibi_ref(qkv, B, T, NH, NKV, HS, slopes)
  local W, G = (NH + 2 * NKV) * HS, NH // NKV
  local out = {}
  for i = 1, B * T * NH * HS do out[i] = 0 end
  for b = 0, B - 1 do
    for hh = 0, NH - 1 do
      local kvh = hh // G
      local qc, kc, vc = hh * HS, (NH + kvh) * HS, (NH + NKV + kvh) * HS
      for t = 0, T - 1 do
        local s, mx = {}, -math.huge
        for j = 0, t do
          local d = 0
          for c = 1, HS do d = d + qkv[(b * T + t) * W + qc + c] * qkv[(b * T + j) * W + kc + c] end
          s[j] = d / math.sqrt(HS) + (slopes and slopes[hh + 1] * j or 0)
          mx = math.max(mx, s[j])
        end
        local z = 0
        for j = 0, t do
          s[j] = math.exp(s[j] - mx)
          z = z + s[j]
        end
        for c = 1, HS do
          local acc = 0
          for j = 0, t do acc = acc + s[j] / z * qkv[(b * T + j) * W + vc + c] end
          out[(b * T + t) * NH * HS + hh * HS + c] = acc
        end
      end
    end
  end
  return out
end

-- Bound: float32 against double at the same inputs. A score is HS products
-- and sums, the scale, and the bias (one product, one sum): HS + 3 roundings
-- of 2^-24 relative on terms of |q.k| <= ~HS (randn inputs) and |bias| <= 2;
-- exp and the normalisation add a few ulps, the P V sum T more. That is
-- ~2e-6 relative on the scores (an absolute ~1e-5 on the largest, which exp
-- turns into that relative error on a probability) and below 1e-6 after the
-- sum: |got - want| <= 1e-6 + 2e-5 |want| leaves a margin of 2 or more.
local RTOL, ATOL = 2e-5, 1e-6

local function assert_close(got, want, what)
  got = flat(got)
  assert.equal(#want, #got, what .. ": element count")
  for i = 1, #want do
    assert(math.abs(got[i] - want[i]) <= ATOL + RTOL * math.abs(want[i]),
      ("%s: element %d is %.9g, the reference %.9g"):format(what, i, got[i], want[i]))
  end
end

describe("attention with ALiBi", function()
  local B, T, HS = 2, 6, 4
  for _, c in ipairs{ { nh = 3, nkv = 3 }, { nh = 4, nkv = 2 }, { nh = 6, nkv = 1 } } do
    it(("matches the reference with heads=%d, kv_heads=%d and differs from no ALiBi"):format(c.nh, c.nkv), function()
      local qkv = pg.randn({ B, T, (c.nh + 2 * c.nkv) * HS }, { seed = 10 + c.nh })
      -- the heads' slopes times 4, so that every head's biases reach 0.1 or more at T = 6
      local s = flat(ops.alibi_slopes(c.nh))
      for k = 1, #s do s[k] = 4 * s[k] end
      local out = ops.attention(qkv, c.nh, c.nkv, pg.tensor(s))
      assert_close(out, alibi_ref(flat(qkv), B, T, c.nh, c.nkv, HS, s), "alibi out")
      local plain = ops.attention(qkv, c.nh, c.nkv)
      assert_close(plain, alibi_ref(flat(qkv), B, T, c.nh, c.nkv, HS, nil), "plain out")
      local a, p = flat(out), flat(plain)
      local moved = 0
      for i = 1, #a do moved = math.max(moved, math.abs(a[i] - p[i])) end
      assert(moved > 1e-2, ("ALiBi moved the outputs by only %g"):format(moved))
    end)
  end

  it("with zero slopes is the kernel without ALiBi, bit for bit", function()
    local qkv = pg.randn({ B, T, 3 * 3 * HS }, { seed = 30 })
    local o1, a1 = ops.attention(qkv, 3)
    local o2, a2 = ops.attention(qkv, 3, nil, pg.zeros{ 3 })
    assert.is_true(o1:equal(o2) and a1:equal(a2))
  end)

  it("trains through the saved log-sum-exp: backward (given the slopes) matches finite differences", function()
    local b, t, nh, hs = 1, 5, 2, 3
    local qkv = pg.randn({ b, t, 3 * nh * hs }, { seed = 31 })
    local s = flat(ops.alibi_slopes(nh)) -- 2^-4, 2^-8
    s[1], s[2] = 0.75, 0.3 -- larger, so that the biases matter
    local R = pg.randn({ b, t, nh * hs }, { seed = 32 })
    local r = flat(R)
    local out, lse = ops.attention(qkv, nh, nil, pg.tensor(s))
    local dq = flat(ops.attention_backward(R, qkv, out, lse, nh, nil, pg.tensor(s)))
    local v = flat(qkv)
    local function f(vals)
      local o, acc = alibi_ref(vals, b, t, nh, nh, hs, s), 0
      for i = 1, #o do acc = acc + o[i] * r[i] end
      return acc
    end
    local step = 1e-4
    for i = 1, #v do
      local old = v[i]
      v[i] = old + step
      local up = f(v)
      v[i] = old - step
      local down = f(v)
      v[i] = old
      local num = (up - down) / (2 * step)
      assert(math.abs(dq[i] - num) <= 1e-5 + 1e-5 * math.abs(num),
        ("dqkv[%d]: analytic %.9g, numeric %.9g"):format(i, dq[i], num))
    end
  end)

  it("refuses slopes of the wrong size, naming them", function()
    local qkv = pg.randn({ B, T, 9 * HS }, { seed = 33 })
    assert.has_error(function() ops.attention(qkv, 3, nil, pg.zeros{ 2 }) end,
      "ops.attention: slopes: expected a [3] float32 tensor, got [2] float32")
  end)
end)

describe("the attention module's alibi option", function()
  local B, S, NH, HS = 2, 6, 3, 4

  it("runs the kernel with its heads' slopes (serial: all of them), bit for bit", function()
    local spec = pg.nn.Attention{ heads = NH, head_dim = HS, seq_len = S, alibi = true, name = "core" }
    local qkv = pg.randn({ B, S, 3 * NH * HS }, { seed = 40 })
    local layer = pg.nn.Layer(spec, nil, { seed = 1 })
    local y = layer:forward(qkv)
    assert.is_true(y:equal((ops.attention(qkv, NH, nil, ops.alibi_slopes(NH)))))
    local plain = pg.nn.Layer(pg.nn.Attention{ heads = NH, head_dim = HS, seq_len = S, name = "core" }, nil, {})
    assert.is_false(plain:forward(qkv):equal(y))
  end)

  it("CausalSelfAttention passes alibi = true to its core", function()
    local spec = pg.nn.CausalSelfAttention{ dim = 12, heads = NH, seq_len = S, alibi = true, name = "attn" }
    local found
    for _, child in ipairs(spec.children or spec) do
      if type(child) == "table" and child.kind == "attention" then found = child end
    end
    assert(found, "no attention core in the CausalSelfAttention spec")
    assert.is_true(found.alibi)
    local x = pg.randn({ B, S, 12 }, { seed = 41 })
    local a = pg.nn.Layer(spec, nil, { seed = 2 })
    local b = pg.nn.Layer(pg.nn.CausalSelfAttention{ dim = 12, heads = NH, seq_len = S, name = "attn" }, nil,
      { seed = 2 })
    assert.is_false(a:forward(x):equal(b:forward(x)))
  end)

  it("refuses ALiBi together with rotary embeddings, naming both", function()
    assert.has_error(function()
      pg.nn.Attention{ heads = NH, head_dim = HS, seq_len = S, alibi = true, rope_theta = 10000 }
    end, "Attention: alibi = true and rope_theta=10000 exclude each other (ALiBi or rotary embeddings)")
    -- the runtime refuses the pair too (a description made by other means than nn.Attention)
    local spec = pg.nn.Attention{ heads = NH, head_dim = HS, seq_len = S, alibi = true, name = "core" }
    spec.rope_theta = 10000
    local err = h.err_of(pg.nn.Layer, spec, nil, {})
    assert.matches("core: ALiBi and rotary embeddings (rope_theta=10000) exclude each other: give one", err, 1, true)
  end)
end)

-- End to end against transformers: spec/unit/bloom_spec.lua (pg.nn.Bloom in every layout).
