-- The block-attention kernels of context parallelism's ring (kernels/cpu/attention_block.c, through pg.ops):
-- a causal sequence of T positions cut into 2C chunks as the context dimension cuts it (rank r holds chunks r
-- and 2C-1-r), every rank's query chunks folded over the key chunks in ring order (rank r sees the chunks of
-- ranks r, r-1, ..., r+1 in turn), finished, and compared with pg_attention_forward over the whole sequence;
-- the backward summed over the same blocks against pg_attention_backward.
--
-- Tolerance: both sides compute the same scores (the same sgemm scale (q . k), the same ALiBi terms), then
-- differ in the order of the float32 sums and in the online rescaling: each output is a convex combination of
-- up to T = 16..320 value rows, every term and every rescaling factor exp(m_old - m_new) a few ulps (float32
-- epsilon 6e-8) off, so the errors grow like sqrt(T) ulps of the magnitudes involved (values ~1-4). Measured
-- here: below 5e-7 (1 + |want|). The bound, |got - want| <= 1e-5 (1 + |want|) (~170 ulps), leaves room for
-- other BLAS kernels' summation orders; the gradients sum up to T such products again: 5e-5 relative to the
-- largest gradient plus the per-element term.
local pg = require "pipegoose"
local ops = pg.ops

local OUT_TOL, GRAD_TOL = 1e-5, 5e-5

-- Chunk c (0-based) of L rows of a [B, T, W] tensor (a copy).
local function chunk(x, c, L) return x:narrow(2, c * L + 1, L) end

-- The chunks of a C-way context split, with the order in which rank r folds the key chunks: the ring brings
-- the kv of rank r - s at step s (each rank's two chunks, the earlier one first).
local function ring_order(C, r)
  local order = {}
  for s = 0, C - 1 do
    local src = (r - s) % C
    order[#order + 1] = src
    order[#order + 1] = 2 * C - 1 - src
  end
  return order
end

local function max_abs(t)
  local m = 0
  for _, v in ipairs(require("helpers").flat(t)) do m = math.max(m, math.abs(v)) end
  return m
end

-- |got - want| <= tol (scale + |want|) elementwise
local function assert_close(got, want, tol, scale, what)
  local g, w = require("helpers").flat(got), require("helpers").flat(want)
  assert.equal(#w, #g, what .. ": element count")
  for i = 1, #w do
    assert(math.abs(g[i] - w[i]) <= tol * (scale + math.abs(w[i])),
      ("%s: element %d is %.9g, the whole-sequence kernel's %.9g"):format(what, i, g[i], w[i]))
  end
end

-- Runs the ring over qkv [B, T, W] and returns out [B, T, NH HS] and dqkv [B, T, W] (dout given) assembled
-- from the chunks, plus the per-chunk lse.
local function ring(qkv, dout, c)
  local B, T = qkv:size(1), qkv:size(2)
  local W, NH, NKV, HS = qkv:size(3), c.nh, c.nkv, c.hs
  local L = T // (2 * c.C)
  local qc, dc, gc = {}, {}, {}
  for k = 0, 2 * c.C - 1 do
    qc[k] = chunk(qkv, k, L)
    dc[k] = chunk(dout, k, L)
    gc[k] = pg.zeros{ B, L, W }
  end
  local outs, lses = {}, {}
  for r = 0, c.C - 1 do
    for _, mine in ipairs{ r, 2 * c.C - 1 - r } do
      local acc, mx, sm = pg.zeros{ B, L, NH * HS }, pg.full({ B, NH, L }, -math.huge), pg.zeros{ B, NH, L }
      local order = c.order and c.order(c.C, r) or ring_order(c.C, r)
      for _, k in ipairs(order) do ops.attention_block_(acc, mx, sm, qc[mine], qc[k], NH, NKV, mine * L, k * L, c.slopes) end
      local out, lse = ops.attention_block_finish(acc, mx, sm)
      outs[mine], lses[mine] = out, lse
      local delta = ops.attention_block_delta(dc[mine], out, NH)
      for _, k in ipairs(order) do
        ops.attention_block_backward_(gc[mine], gc[k], qc[mine], qc[k], dc[mine], lse, delta, NH, NKV, mine * L,
          k * L, c.slopes)
      end
    end
  end
  local ol, gl = {}, {}
  for k = 0, 2 * c.C - 1 do
    ol[k + 1], gl[k + 1] = outs[k], gc[k]
  end
  return pg.cat(ol, 2), pg.cat(gl, 2), lses
end

local function with_slopes(nh)
  -- the heads' slopes times 4, so that the biases move the softmax at these lengths
  local s = require("helpers").flat(ops.alibi_slopes(nh))
  for i = 1, #s do s[i] = 4 * s[i] end
  return pg.tensor(s)
end

describe("block attention (context parallelism's ring)", function()
  local cases = {
    { B = 2, T = 16, C = 2, nh = 4, nkv = 2, hs = 8, alibi = true },
    { B = 1, T = 64, C = 4, nh = 2, nkv = 1, hs = 16 },
    { B = 2, T = 24, C = 4, nh = 3, nkv = 3, hs = 8, alibi = true },
    { B = 3, T = 32, C = 2, nh = 4, nkv = 4, hs = 16 },
    { B = 2, T = 48, C = 2, nh = 4, nkv = 1, hs = 16, alibi = true },
    -- chunks of 80 rows: more than one 64-row tile of queries and of keys per block
    { B = 1, T = 320, C = 2, nh = 2, nkv = 1, hs = 8, alibi = true },
  }
  for n, c in ipairs(cases) do
    local name = ("B=%d T=%d C=%d heads %d/%d hs %d%s"):format(c.B, c.T, c.C, c.nh, c.nkv, c.hs,
      c.alibi and " alibi" or "")
    it("folded in ring order equals the whole-sequence attention, forward and backward: " .. name, function()
      c.slopes = c.alibi and with_slopes(c.nh) or nil
      local W = (c.nh + 2 * c.nkv) * c.hs
      local qkv = pg.randn({ c.B, c.T, W }, { seed = 100 + n })
      local dout = pg.randn({ c.B, c.T, c.nh * c.hs }, { seed = 200 + n })
      local want, lse = ops.attention(qkv, c.nh, c.nkv, c.slopes)
      local want_d = ops.attention_backward(dout, qkv, want, lse, c.nh, c.nkv, c.slopes)
      local out, dqkv = ring(qkv, dout, c)
      assert_close(out, want, OUT_TOL, 1, "out")
      assert_close(dqkv, want_d, GRAD_TOL, max_abs(want_d), "dqkv")
      -- not a lucky zero: the gradients are there and ALiBi moved the outputs
      assert(max_abs(want_d) > 0.1)
      if c.slopes then assert(out:max_abs_diff((ops.attention(qkv, c.nh, c.nkv))) > 1e-2) end
    end)
  end

  it("any fold order gives the same result within the rounding, and a repeat the same bits", function()
    local c = { B = 2, T = 32, C = 4, nh = 4, nkv = 2, hs = 8 }
    c.slopes = with_slopes(c.nh)
    local qkv = pg.randn({ c.B, c.T, (c.nh + 2 * c.nkv) * c.hs }, { seed = 7 })
    local dout = pg.randn({ c.B, c.T, c.nh * c.hs }, { seed = 8 })
    local out1, d1 = ring(qkv, dout, c)
    local out2, d2 = ring(qkv, dout, c)
    assert.is_true(out1:equal(out2) and d1:equal(d2))
    c.order = function(C) -- the chunks last to first
      local o = {}
      for k = 2 * C - 1, 0, -1 do o[#o + 1] = k end
      return o
    end
    local out3, d3 = ring(qkv, dout, c)
    assert_close(out3, out1, OUT_TOL, 1, "out (reversed order)")
    assert_close(d3, d1, GRAD_TOL, max_abs(d1), "dqkv (reversed order)")
  end)

  -- The CPU backward runs in one pass over (batch row, kv head) when there are at least as many pairs as
  -- threads, else in two (dq over query tiles, dk and dv over key tiles): both must sum in the same order.
  it("gives the same bits with 1, 3 and 16 threads (one pass and two passes)", function()
    local h = require "helpers"
    local script = os.tmpname()
    local f = assert(io.open(script, "w"))
    f:write([[
local pg = require "pipegoose"
local ops = pg.ops
local B, L, NH, NKV, HS = 2, 150, 4, 2, 16
local W = (NH + 2 * NKV) * HS
local q, kv = pg.randn({ B, L, W }, { seed = 1 }), pg.randn({ B, 2 * L, W }, { seed = 2 })
local acc, mx, sm = pg.zeros{ B, L, NH * HS }, pg.full({ B, NH, L }, -math.huge), pg.zeros{ B, NH, L }
local s = ops.alibi_slopes(NH)
ops.attention_block_(acc, mx, sm, q, kv, NH, NKV, 2 * L - 40, 0, s)
local out, lse = ops.attention_block_finish(acc, mx, sm)
local dout = pg.randn({ B, L, NH * HS }, { seed = 3 })
local delta = ops.attention_block_delta(dout, out, NH)
local g1, g2 = pg.randn({ B, L, W }, { seed = 4 }), pg.randn({ B, 2 * L, W }, { seed = 5 })
ops.attention_block_backward_(g1, g2, q, kv, dout, lse, delta, NH, NKV, 2 * L - 40, 0, s)
local parts = {}
for _, t in ipairs{ out, lse, g1, g2 } do
  local x = t:totable()
  local function rec(v) if type(v) == "table" then for _, y in ipairs(v) do rec(y) end else parts[#parts + 1] = ("%a"):format(v) end end
  rec(x)
end
print(#parts, table.concat(parts, ","))
]])
    f:close()
    local results = {}
    for _, n in ipairs{ 1, 3, 16 } do
      local rc, text = h.sh(("OMP_NUM_THREADS=%d timeout -k 2 120 %s"):format(n, h.pglua_cmd{ script }))
      assert.equal(0, rc, text)
      results[#results + 1] = text
    end
    os.remove(script)
    assert(#results[1] > 1000, results[1]:sub(1, 200))
    assert.equal(results[1], results[2])
    assert.equal(results[1], results[3])
  end)

  it("a block above the diagonal leaves the state and the gradients unchanged, bit for bit", function()
    local B, L, NH, NKV, HS = 2, 5, 2, 1, 8
    local W = (NH + 2 * NKV) * HS
    local q, kv = pg.randn({ B, L, W }, { seed = 1 }), pg.randn({ B, L, W }, { seed = 2 })
    local acc, mx, sm = pg.randn({ B, L, NH * HS }, { seed = 3 }), pg.randn({ B, NH, L }, { seed = 4 }),
      pg.randn({ B, NH, L }, { seed = 5 }):abs()
    local a0, m0, s0 = acc:clone(), mx:clone(), sm:clone()
    ops.attention_block_(acc, mx, sm, q, kv, NH, NKV, 0, L) -- queries 0..4, keys 5..9: none visible
    assert.is_true(acc:equal(a0) and mx:equal(m0) and sm:equal(s0))
    local g1, g2 = pg.randn({ B, L, W }, { seed = 6 }), pg.randn({ B, L, W }, { seed = 7 })
    local c1, c2 = g1:clone(), g2:clone()
    local dout, lse, delta = pg.randn({ B, L, NH * HS }, { seed = 8 }), pg.zeros{ B, NH, L }, pg.zeros{ B, NH, L }
    ops.attention_block_backward_(g1, g2, q, kv, dout, lse, delta, NH, NKV, 0, L)
    assert.is_true(g1:equal(c1) and g2:equal(c2))
    -- one position lower, the last query sees the first key: the state moves
    ops.attention_block_(acc, mx, sm, q, kv, NH, NKV, 1, L)
    assert.is_false(acc:equal(a0))
  end)

  it("finish: a row that saw no key is 0 with lse -inf", function()
    local out, lse = ops.attention_block_finish(pg.zeros{ 1, 2, 4 }, pg.full({ 1, 1, 2 }, -math.huge),
      pg.zeros{ 1, 1, 2 })
    assert.is_true(out:equal(pg.zeros{ 1, 2, 4 }))
    assert.equal(-math.huge, lse:totable()[1][1][2])
  end)

  it("refuses arguments of the wrong shape by name", function()
    local q = pg.randn({ 1, 4, 3 * 8 }, { seed = 1 })
    assert.has_error(function()
      ops.attention_block_(pg.zeros{ 1, 4, 8 }, pg.zeros{ 1, 1, 3 }, pg.zeros{ 1, 1, 4 }, q, q, 1, 1, 0, 0)
    end, "ops.attention_block_: mx: expected a [1, 1, 4] float32 tensor, got [1, 1, 3] float32")
    assert.has_error(function()
      ops.attention_block_(pg.zeros{ 1, 4, 8 }, pg.zeros{ 1, 1, 4 }, pg.zeros{ 1, 1, 4 }, q, q, 1, 1, -1, 0)
    end, "ops.attention_block_: q_pos0: expected an integer >= 0, got -1")
  end)
end)
