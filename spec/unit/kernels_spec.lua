-- The CPU kernels through pg.ops, against naive double-precision references
-- written here in plain Lua.
--
-- Forward: the float32 kernel against the double reference evaluated at the
-- same (float32) inputs.
-- Backward: L = sum(out * R) with R a fixed random tensor; the kernel's
-- analytic gradient (fed dout = R) against central finite differences of the
-- double reference's L (step H below). The reference is double, so the
-- numeric gradient is accurate to ~1e-8; the tolerances cover float32
-- rounding in the kernels. PG_SHOW_MARGIN=1 prints how close each check comes.
local pg = require "pipegoose"
local ops = pg.ops

-- sizes: B batches of T steps, C features, NH heads, V vocabulary
local B, T, C, NH, V = 2, 5, 8, 2, 11
local N = B * T

-- forward tolerance, elementwise |got - want| <= FWD_ATOL + FWD_RTOL |want|
local FWD_RTOL, FWD_ATOL = 1e-5, 1e-6
-- gradient tolerance (float32 kernels show ~1e-6 here), elementwise |analytic - numeric| <= GRAD_ATOL + GRAD_RTOL |numeric|
local GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-5
-- finite-difference step (central differences on the double reference)
local H = 1e-4

---- helpers ----

local h = require "helpers"
local flat = h.flat

local function from_flat(vals, shape, dtype)
  local pos = 0
  local function build(d)
    local t = {}
    for i = 1, shape[d] do
      if d == #shape then
        pos = pos + 1
        t[i] = vals[pos]
      else
        t[i] = build(d + 1)
      end
    end
    return t
  end
  local t = pg.tensor(build(1), dtype and { dtype = dtype } or nil)
  assert(pos == #vals, "from_flat: " .. #vals .. " values for " .. pos .. " elements")
  return t
end

local function randn(shape, seed, std)
  return pg.randn(shape, { seed = seed, std = std or 1 })
end

-- Elementwise |got - want| <= atol + rtol |want|; names the worst element.
local function assert_close(got, want, rtol, atol, what)
  got, want = flat(got), flat(want)
  assert.equal(#want, #got, what .. ": element count")
  local worst, wi = -math.huge, 1
  for i = 1, #want do
    assert(got[i] == got[i], what .. ": NaN at element " .. i)
    local excess = math.abs(got[i] - want[i]) - (atol + rtol * math.abs(want[i]))
    if excess > worst then worst, wi = excess, i end
  end
  if os.getenv("PG_SHOW_MARGIN") then io.stderr:write(string.format("%-40s worst excess %.3g (atol %g)\n", what, worst, atol)) end
  assert(worst <= 0, string.format("%s: element %d: got %.9g, want %.9g (rtol %g, atol %g)", what, wi,
    got[wi] or 0 / 0, want[wi] or 0 / 0, rtol, atol))
end

local function max_abs(vals)
  local m = 0
  for _, v in ipairs(flat(vals)) do m = math.max(m, math.abs(v)) end
  return m
end

local function dot(a, b)
  local s = 0
  for i = 1, #a do s = s + a[i] * b[i] end
  return s
end

-- Central differences of the scalar f at vals (perturbed in place, restored).
local function numgrad(f, vals)
  local g = {}
  for i = 1, #vals do
    local v = vals[i]
    vals[i] = v + H
    local up = f(vals)
    vals[i] = v - H
    local down = f(vals)
    vals[i] = v
    g[i] = (up - down) / (2 * H)
  end
  return g
end

-- Analytic vs numeric, refusing a vacuous check (an all-zero gradient).
local function assert_grad(analytic, numeric, what)
  assert(max_abs(numeric) > 1e-2, what .. ": numeric gradient is (nearly) zero; the check would be vacuous")
  assert_close(analytic, numeric, GRAD_RTOL, GRAD_ATOL, what)
end

---- double-precision references (flat, 1-based arrays; 0-based row/col loops) ----

local function embedding_ref(tokens, w, n_rows, c, row_start, rows)
  local out = {}
  for n = 0, n_rows - 1 do
    local r = tokens[n + 1] - row_start
    for j = 1, c do out[n * c + j] = (r >= 0 and r < rows) and w[r * c + j] or 0 end
  end
  return out
end

local function position_ref(x, wpe, n_rows, t_len, c)
  local out = {}
  for n = 0, n_rows - 1 do
    local t = n % t_len
    for j = 1, c do out[n * c + j] = x[n * c + j] + wpe[t * c + j] end
  end
  return out
end

local function layernorm_ref(x, w, b, n_rows, c)
  local y, mean, rstd = {}, {}, {}
  for n = 0, n_rows - 1 do
    local s = 0
    for j = 1, c do s = s + x[n * c + j] end
    local m = s / c
    local v = 0
    for j = 1, c do v = v + (x[n * c + j] - m) ^ 2 end
    local r = 1 / math.sqrt(v / c + 1e-5)
    for j = 1, c do y[n * c + j] = (x[n * c + j] - m) * r * w[j] + b[j] end
    mean[n + 1], rstd[n + 1] = m, r
  end
  return y, mean, rstd
end

local function linear_ref(x, w, b, n_rows, c, oc)
  local y = {}
  for n = 0, n_rows - 1 do
    for o = 0, oc - 1 do
      local s = b and b[o + 1] or 0
      for j = 1, c do s = s + x[n * c + j] * w[o * c + j] end
      y[n * oc + o + 1] = s
    end
  end
  return y
end

local function attention_ref(qkv, b_len, t_len, c, nh)
  local hs = c // nh
  local scale = 1 / math.sqrt(hs)
  local out, att, lse = {}, {}, {}
  for b = 0, b_len - 1 do
    for h = 0, nh - 1 do
      for t = 0, t_len - 1 do
        local q = (b * t_len + t) * 3 * c + h * hs
        local p, mx = {}, -math.huge
        for j = 0, t do
          local k = (b * t_len + j) * 3 * c + c + h * hs
          local s = 0
          for d = 1, hs do s = s + qkv[q + d] * qkv[k + d] end
          p[j] = s * scale
          mx = math.max(mx, p[j])
        end
        local sum = 0
        for j = 0, t do
          p[j] = math.exp(p[j] - mx)
          sum = sum + p[j]
        end
        local a = ((b * nh + h) * t_len + t) * t_len
        lse[(b * nh + h) * t_len + t + 1] = mx + math.log(sum)
        for j = 0, t_len - 1 do att[a + j + 1] = j <= t and p[j] / sum or 0 end
        for d = 1, hs do
          local o = 0
          for j = 0, t do o = o + att[a + j + 1] * qkv[(b * t_len + j) * 3 * c + 2 * c + h * hs + d] end
          out[(b * t_len + t) * c + h * hs + d] = o
        end
      end
    end
  end
  return out, lse
end

-- 0.5 x (1 + tanh u), u = sqrt(2/pi) (x + 0.044715 x^3), written with the
-- identity 0.5 (1 + tanh u) = 1 / (1 + e^(-2u)): computing 1 + tanh u near
-- tanh u = -1 would cancel even in double (GELU(-7) ~ -2.3e-15).
local function gelu_ref(x)
  local y = {}
  for i, v in ipairs(x) do
    local u = math.sqrt(2 / math.pi) * (v + 0.044715 * v ^ 3)
    y[i] = v / (1 + math.exp(-2 * u))
  end
  return y
end

-- losses over the first `valid` columns of each row; targets are global ids
local function xent_ref(logits, targets, n_rows, v, valid, vocab_start)
  local losses = {}
  for n = 0, n_rows - 1 do
    local mx = -math.huge
    for j = 1, valid do mx = math.max(mx, logits[n * v + j]) end
    local s = 0
    for j = 1, valid do s = s + math.exp(logits[n * v + j] - mx) end
    losses[n + 1] = math.log(s) + mx - logits[n * v + targets[n + 1] - vocab_start + 1]
  end
  return losses
end

-- Grouped-query attention on qkv rows [nh*hs | nkv*hs | nkv*hs]: query head h
-- uses key/value head h // (nh / nkv). Written separately from attention_ref
-- (which is the multi-head layout as the kernel first had it).
local function gqa_ref(qkv, b_len, t_len, nh, nkv, hs)
  local w, scale, group = (nh + 2 * nkv) * hs, 1 / math.sqrt(hs), nh // nkv
  local out = {}
  for b = 0, b_len - 1 do
    for h = 0, nh - 1 do
      local kh = h // group
      for t = 0, t_len - 1 do
        local q = (b * t_len + t) * w + h * hs
        local p, mx = {}, -math.huge
        for j = 0, t do
          local k = (b * t_len + j) * w + (nh + kh) * hs
          local sc = 0
          for d = 1, hs do sc = sc + qkv[q + d] * qkv[k + d] end
          p[j] = sc * scale
          mx = math.max(mx, p[j])
        end
        local sum = 0
        for j = 0, t do p[j] = math.exp(p[j] - mx); sum = sum + p[j] end
        for d = 1, hs do
          local o = 0
          for j = 0, t do o = o + p[j] / sum * qkv[(b * t_len + j) * w + (nh + nkv + kh) * hs + d] end
          out[(b * t_len + t) * nh * hs + h * hs + d] = o
        end
      end
    end
  end
  return out
end

-- transformers' rotary embedding of every head of x [B*T rows, heads*hs]:
-- rotate_half pairs (i, i + hs/2) by t / theta^(2i/hs), t = row % T.
local function rope_ref(x, n_rows, t_len, heads, hs, theta, sign)
  local y, half = {}, hs // 2
  for n = 0, n_rows - 1 do
    local t = n % t_len
    for h = 0, heads - 1 do
      local base = n * heads * hs + h * hs
      for i = 1, half do
        local a = t / theta ^ (2 * (i - 1) / hs)
        local c, sn = math.cos(a), (sign or 1) * math.sin(a)
        local x1, x2 = x[base + i], x[base + i + half]
        y[base + i] = x1 * c - x2 * sn
        y[base + i + half] = x2 * c + x1 * sn
      end
    end
  end
  return y
end

local function rmsnorm_ref(x, w, n_rows, c, eps)
  local y = {}
  for n = 0, n_rows - 1 do
    local ss = 0
    for j = 1, c do ss = ss + x[n * c + j] ^ 2 end
    local r = 1 / math.sqrt(ss / c + eps)
    for j = 1, c do y[n * c + j] = x[n * c + j] * r * w[j] end
  end
  return y
end

local function swiglu_ref(x, n_rows, hid)
  local y = {}
  for n = 0, n_rows - 1 do
    for i = 1, hid do
      local g, u = x[n * 2 * hid + i], x[n * 2 * hid + hid + i]
      y[n * hid + i] = g / (1 + math.exp(-g)) * u
    end
  end
  return y
end

-- The MoE router in double precision: softmax, the top k (ties to the lower
-- index), renormalised weights; returns probs, lse, experts (0-based), weights.
local function moe_route_ref(logits, n_rows, e_count, k)
  local probs, lse, ex, w = {}, {}, {}, {}
  for n = 0, n_rows - 1 do
    local mx = -math.huge
    for e = 1, e_count do mx = math.max(mx, logits[n * e_count + e]) end
    local sum = 0
    for e = 1, e_count do sum = sum + math.exp(logits[n * e_count + e] - mx) end
    lse[n + 1] = mx + math.log(sum)
    for e = 1, e_count do probs[n * e_count + e] = math.exp(logits[n * e_count + e] - mx) / sum end
    local taken, chosen = {}, 0
    for j = 1, k do
      local best
      for e = 1, e_count do
        if not taken[e] and (best == nil or probs[n * e_count + e] > probs[n * e_count + best]) then best = e end
      end
      taken[best] = true
      ex[n * k + j], w[n * k + j] = best - 1, probs[n * e_count + best]
      chosen = chosen + probs[n * e_count + best]
    end
    for j = 1, k do w[n * k + j] = w[n * k + j] / chosen end
  end
  return probs, lse, ex, w
end

-- token ids with repeats (rows of the same token accumulate in backward)
local TOKENS = { 3, 0, 7, 3, 10, 1, 7, 7, 2, 9 }

describe("pg.ops kernels", function()
  describe("embedding", function()
    it("gathers rows (exact) and its backward matches finite differences", function()
      local tok = from_flat(TOKENS, { B, T }, "int32")
      local w = randn({ V, C }, 1)
      local out = ops.embedding(tok, w)
      assert.same({ B, T, C }, out:shape())
      -- a gather copies floats: exact equality (tolerance 0)
      assert_close(out, embedding_ref(TOKENS, flat(w), N, C, 0, V), 0, 0, "embedding forward")

      local R = randn({ B, T, C }, 2)
      local r = flat(R)
      local dw = ops.embedding_backward(R, tok, V)
      assert.same({ V, C }, dw:shape())
      local num = numgrad(function(wv) return dot(embedding_ref(TOKENS, wv, N, C, 0, V), r) end, flat(w))
      assert_grad(dw, num, "embedding dweight")
    end)

    it("masks ids outside the shard [row_start, row_start + rows) to zero, in both directions", function()
      local tok = from_flat(TOKENS, { N }, "int32")
      local full = randn({ V, C }, 3)
      local row_start, rows = 3, 4 -- this shard holds ids 3..6
      local shard = full:narrow(1, row_start + 1, rows):clone()
      local out, fo = flat(ops.embedding(tok, shard, row_start)), flat(ops.embedding(tok, full))
      local in_shard, zero_rows = 0, 0
      for n = 0, N - 1 do
        local id = TOKENS[n + 1]
        for j = 1, C do
          if id >= row_start and id < row_start + rows then
            assert.equal(fo[n * C + j], out[n * C + j]) -- a copy: exact
          else
            assert.equal(0, out[n * C + j])
          end
        end
        if id >= row_start and id < row_start + rows then in_shard = in_shard + 1 else zero_rows = zero_rows + 1 end
      end
      assert.is_true(in_shard > 0 and zero_rows > 0, "the ids must exercise both cases")

      -- backward: the shard's gradient is exactly the full gradient's rows 3..6
      -- (same additions in the same order), and other ids are dropped
      local R = randn({ N, C }, 4)
      local dfull = ops.embedding_backward(R, tok, V)
      local dshard = ops.embedding_backward(R, tok, rows, row_start)
      assert.same({ rows, C }, dshard:shape())
      assert.is_true(dshard:equal(dfull:narrow(1, row_start + 1, rows):clone()))
    end)
  end)

  describe("position", function()
    it("adds wpe per time step, for [B,T,C] and [N,C], and its backward matches finite differences", function()
      local x, wpe = randn({ B, T, C }, 5), randn({ T + 2, C }, 6) -- wpe holds more positions than used
      local want = position_ref(flat(x), flat(wpe), N, T, C)
      -- one float addition: within FWD tolerance of the double sum
      assert_close(ops.position(x, wpe, T), want, FWD_RTOL, FWD_ATOL, "position forward [B,T,C]")
      assert.is_true(ops.position(x:reshape{ N, C }, wpe, T):equal(ops.position(x, wpe, T):reshape{ N, C }))

      local R = randn({ B, T, C }, 7)
      local r = flat(R)
      local dwpe = ops.position_backward(R, T)
      assert.same({ T, C }, dwpe:shape())
      local wv = flat(wpe:narrow(1, 1, T))
      local num = numgrad(function(w) return dot(position_ref(flat(x), w, N, T, C), r) end, wv)
      assert_grad(dwpe, num, "position dwpe")
    end)
  end)

  describe("layernorm", function()
    it("matches the double reference forward, mean and rstd", function()
      -- an offset mean exercises the centred variance
      local x, w, b = randn({ B, T, C }, 8, 2):add(3), randn({ C }, 9), randn({ C }, 10)
      local y, mean, rstd = ops.layernorm(x, w, b)
      local ry, rm, rr = layernorm_ref(flat(x), flat(w), flat(b), N, C)
      assert.same({ B, T }, mean:shape())
      assert_close(y, ry, FWD_RTOL, FWD_ATOL, "layernorm y")
      assert_close(mean, rm, FWD_RTOL, FWD_ATOL, "layernorm mean")
      assert_close(rstd, rr, FWD_RTOL, FWD_ATOL, "layernorm rstd")
    end)

    it("backward (dx, dw, db) matches finite differences", function()
      local x, w, b = randn({ B, T, C }, 11), randn({ C }, 12), randn({ C }, 13)
      local xv, wv, bv = flat(x), flat(w), flat(b)
      local R = randn({ B, T, C }, 14)
      local r = flat(R)
      local _, mean, rstd = ops.layernorm(x, w, b)
      local dx, dw, db = ops.layernorm_backward(R, x, w, mean, rstd)
      assert_grad(dx, numgrad(function(v) return dot((layernorm_ref(v, wv, bv, N, C)), r) end, xv), "layernorm dx")
      assert_grad(dw, numgrad(function(v) return dot((layernorm_ref(xv, v, bv, N, C)), r) end, wv), "layernorm dw")
      assert_grad(db, numgrad(function(v) return dot((layernorm_ref(xv, wv, v, N, C)), r) end, bv), "layernorm db")
    end)
  end)

  describe("linear", function()
    local OC = 6

    it("matches the double reference with and without bias", function()
      local x, w, b = randn({ B, T, C }, 15), randn({ OC, C }, 16), randn({ OC }, 17)
      local y = ops.linear(x, w, b)
      assert.same({ B, T, OC }, y:shape())
      assert_close(y, linear_ref(flat(x), flat(w), flat(b), N, C, OC), FWD_RTOL, FWD_ATOL, "linear with bias")
      assert_close(ops.linear(x:reshape{ N, C }, w), linear_ref(flat(x), flat(w), nil, N, C, OC), FWD_RTOL, FWD_ATOL,
        "linear without bias")
    end)

    it("backward (dx, dw, db) matches finite differences; db is nil without bias", function()
      local x, w, b = randn({ B, T, C }, 18), randn({ OC, C }, 19), randn({ OC }, 20)
      local xv, wv, bv = flat(x), flat(w), flat(b)
      local R = randn({ B, T, OC }, 21)
      local r = flat(R)
      local dx, dw, db = ops.linear_backward(R, x, w)
      assert.same({ B, T, C }, dx:shape())
      assert_grad(dx, numgrad(function(v) return dot(linear_ref(v, wv, bv, N, C, OC), r) end, xv), "linear dx")
      assert_grad(dw, numgrad(function(v) return dot(linear_ref(xv, v, bv, N, C, OC), r) end, wv), "linear dw")
      assert_grad(db, numgrad(function(v) return dot(linear_ref(xv, wv, v, N, C, OC), r) end, bv), "linear db")
      local dx2, dw2, db2 = ops.linear_backward(R, x, w, false)
      assert.is_nil(db2)
      assert.is_true(dx2:equal(dx) and dw2:equal(dw), "the bias flag changes only db")
    end)
  end)

  describe("attention", function()
    it("matches the double reference, out and the rows' log-sum-exp (lse)", function()
      local qkv = randn({ B, T, 3 * C }, 22)
      local out, lse = ops.attention(qkv, NH)
      assert.same({ B, T, C }, out:shape())
      assert.same({ B, NH, T }, lse:shape())
      local rout, rlse = attention_ref(flat(qkv), B, T, C, NH)
      assert_close(out, rout, FWD_RTOL, FWD_ATOL, "attention out")
      assert_close(lse, rlse, FWD_RTOL, FWD_ATOL, "attention lse")
    end)

    -- T = 200: four of the kernel's 64-row query and key tiles, the last one partial
    it("over several tiles matches the double reference and gives the same bits on 1 thread and on several", function()
      local b, t, nh, nkv, hs = 2, 200, 4, 2, 8
      local qkv = randn({ b, t, (nh + 2 * nkv) * hs }, 28)
      local saved = ops.num_threads()
      ops.set_num_threads(1)
      local o1, l1 = ops.attention(qkv, nh, nkv)
      local R = randn({ b, t, nh * hs }, 29)
      local d1 = ops.attention_backward(R, qkv, o1, l1, nh, nkv)
      ops.set_num_threads(8) -- more threads than the 4 (batch row, kv head) pairs: the backward's two passes
      local o2, l2 = ops.attention(qkv, nh, nkv)
      local d2 = ops.attention_backward(R, qkv, o2, l2, nh, nkv)
      ops.set_num_threads(saved)
      assert.is_true(o1:equal(o2) and l1:equal(l2) and d1:equal(d2), "the same bits for any thread count")
      assert_close(o1, gqa_ref(flat(qkv), b, t, nh, nkv, hs), FWD_RTOL, FWD_ATOL, "attention out, T=200")
    end)

    it("is causal: changing step t leaves the outputs of earlier steps bit for bit", function()
      local qkv = randn({ B, T, 3 * C }, 23)
      local out = ops.attention(qkv, NH):totable()
      local t0 = 3 -- perturb step 3 (1-based) of batch 2: queries, keys and values
      local q2 = qkv:totable()
      for j = 1, 3 * C do q2[2][t0][j] = q2[2][t0][j] + 0.5 end
      local out2 = ops.attention(pg.tensor(q2), NH):totable()
      local changed = false
      for b = 1, B do
        for t = 1, T do
          for j = 1, C do
            if b == 1 or t < t0 then
              assert.equal(out[b][t][j], out2[b][t][j])
            elseif out[b][t][j] ~= out2[b][t][j] then
              changed = true
            end
          end
        end
      end
      assert.is_true(changed, "the perturbed step must change its own and later outputs")
    end)

    it("backward matches finite differences", function()
      local qkv = randn({ B, T, 3 * C }, 24)
      local R = randn({ B, T, C }, 25)
      local r = flat(R)
      local out, lse = ops.attention(qkv, NH)
      local dqkv = ops.attention_backward(R, qkv, out, lse, NH)
      assert.same({ B, T, 3 * C }, dqkv:shape())
      local num = numgrad(function(v) return dot((attention_ref(v, B, T, C, NH)), r) end, flat(qkv))
      assert_grad(dqkv, num, "attention dqkv")
    end)

    it("handles sequences longer than one 64-row block (T = 70) against the reference", function()
      local b, t, c, nh = 1, 70, 8, 2
      local qkv = randn({ b, t, 3 * c }, 26)
      local out, lse = ops.attention(qkv, nh)
      local rout = attention_ref(flat(qkv), b, t, c, nh)
      assert_close(out, rout, FWD_RTOL, FWD_ATOL, "attention out, T=70")
      -- backward: compare with finite differences on a few entries of each of
      -- q, k, v at early and late steps (the blocks' boundaries), not all 1680
      local R = randn({ b, t, c }, 27)
      local r = flat(R)
      local dq = flat(ops.attention_backward(R, qkv, out, lse, nh))
      local v = flat(qkv)
      local f = function(vals) return dot((attention_ref(vals, b, t, c, nh)), r) end
      local checked = 0
      for _, step in ipairs({ 1, 63, 64, 65, 70 }) do
        for _, col in ipairs({ 1, c + 2, 2 * c + 7 }) do
          local i = (step - 1) * 3 * c + col
          local old = v[i]
          v[i] = old + H
          local up = f(v)
          v[i] = old - H
          local down = f(v)
          v[i] = old
          local num = (up - down) / (2 * H)
          assert(math.abs(dq[i] - num) <= GRAD_ATOL + GRAD_RTOL * math.abs(num),
            ("dqkv step %d col %d: analytic %.9g numeric %.9g"):format(step, col, dq[i], num))
          checked = checked + 1
        end
      end
      assert.equal(15, checked)
    end)
  end)

  describe("grouped-query attention", function()
    for _, c in ipairs({ { nh = 4, nkv = 2 }, { nh = 4, nkv = 1 }, { nh = 2, nkv = 2 } }) do
      it(("matches the reference and finite differences with heads=%d, kv_heads=%d"):format(c.nh, c.nkv), function()
        local hs = 4
        local w = (c.nh + 2 * c.nkv) * hs
        local qkv = randn({ B, T, w }, 40 + c.nkv)
        local out, lse = ops.attention(qkv, c.nh, c.nkv)
        assert.same({ B, T, c.nh * hs }, out:shape())
        assert_close(out, gqa_ref(flat(qkv), B, T, c.nh, c.nkv, hs), FWD_RTOL, FWD_ATOL, "gqa out")
        local R = randn({ B, T, c.nh * hs }, 50 + c.nkv)
        local r = flat(R)
        local dqkv = ops.attention_backward(R, qkv, out, lse, c.nh, c.nkv)
        local num = numgrad(function(v) return dot(gqa_ref(v, B, T, c.nh, c.nkv, hs), r) end, flat(qkv))
        assert_grad(dqkv, num, "gqa dqkv")
      end)
    end

    it("with kv_heads = heads is the multi-head kernel, bit for bit", function()
      local qkv = randn({ B, T, 3 * C }, 60)
      local o1, l1 = ops.attention(qkv, NH)
      local o2, l2 = ops.attention(qkv, NH, NH)
      assert.is_true(o1:equal(o2) and l1:equal(l2))
      local R = randn({ B, T, C }, 61)
      assert.is_true(ops.attention_backward(R, qkv, o1, l1, NH):equal(ops.attention_backward(R, qkv, o1, l1, NH, NH)))
    end)
  end)

  -- ops.flash_bf16 (the tensor-core attention's contract; on the CPU its twin): bf16 q|k|v and dout, float32
  -- out, lse and dqkv. The CPU twin widens them (exact) and runs the float32 block attention, which is what
  -- ops.attention runs on the widened tensors: the same bits (T = 32 and 528: one block of queries and several).
  -- The device's tensor-core kernels against it: spec/support/lua_ops_device.lua and the CUDA self-test.
  describe("flash_bf16", function()
    for _, c in ipairs({ { B = 2, T = 32, nh = 2, nkv = 1, hs = 64, alibi = true }, { B = 1, T = 528, nh = 2, nkv = 2, hs = 128 } }) do
      it(("is ops.attention on the widened q|k|v on the CPU, bit for bit (T %d, %d/%d heads, head size %d%s)")
        :format(c.T, c.nh, c.nkv, c.hs, c.alibi and ", ALiBi" or ""), function()
        local q16 = ops.to_bf16(randn({ c.B, c.T, (c.nh + 2 * c.nkv) * c.hs }, 70, 0.5))
        local d16 = ops.to_bf16(randn({ c.B, c.T, c.nh * c.hs }, 71, 0.5))
        local s = c.alibi and ops.alibi_slopes(c.nh) or nil
        local o1, l1 = ops.flash_bf16(q16, c.nh, c.nkv, s)
        local q = ops.from_bf16(q16)
        local o2, l2 = ops.attention(q, c.nh, c.nkv, s)
        assert.is_true(o1:equal(o2) and l1:equal(l2), "out and lse")
        local g1 = ops.flash_bf16_backward(d16, q16, o1, l1, c.nh, c.nkv, s)
        assert.is_true(g1:equal(ops.attention_backward(ops.from_bf16(d16), q, o2, l2, c.nh, c.nkv, s)), "dqkv")
      end)
    end

    it("refuses by name a shape the tensor-core kernels do not take, and float32 q|k|v", function()
      assert.matches("ops.flash_bf16: flash_bf16_forward: the head size is not 64 or 128 %(B 1, T 32, NH 2, NKV 2, HS 96%)",
        h.err_of(ops.flash_bf16, ops.to_bf16(pg.zeros{ 1, 32, 6 * 96 }), 2))
      assert.matches("ops.flash_bf16: flash_bf16_forward: T is not a positive multiple of 16",
        h.err_of(ops.flash_bf16, ops.to_bf16(pg.zeros{ 1, 24, 6 * 64 }), 2))
      assert.matches("ops.flash_bf16: qkv: expected a %[%*, %*, %*%] bfloat16 tensor, got %[1, 32, 384%] float32",
        h.err_of(ops.flash_bf16, pg.zeros{ 1, 32, 6 * 64 }, 2))
    end)
  end)

  describe("rotary embeddings, RMSNorm, SwiGLU", function()
    it("rope rotates pairs (i, i + hs/2) by t / theta^(2i/hs); backward is the transpose (finite differences)", function()
      local heads, hs, theta = 2, 6, 10000
      local x = randn({ B, T, heads * hs }, 70)
      local y = ops.rope(x, heads, theta)
      assert_close(y, rope_ref(flat(x), N, T, heads, hs, theta), FWD_RTOL, FWD_ATOL, "rope forward")
      -- position 0 is the identity, bit for bit
      local xt, yt = x:totable(), y:totable()
      for b = 1, B do assert.same(xt[b][1], yt[b][1]) end
      local R = randn({ B, T, heads * hs }, 71)
      local r = flat(R)
      local num = numgrad(function(v) return dot(rope_ref(v, N, T, heads, hs, theta), r) end, flat(x))
      assert_grad(ops.rope_backward(R, heads, theta), num, "rope backward")
      -- a large theta on a long sequence still matches (angles up to 69 radians)
      local xl = randn({ 1, 70, 8 }, 72)
      assert_close(ops.rope(xl, 1, 500000), rope_ref(flat(xl), 70, 70, 1, 8, 500000), 1e-5, 2e-5, "rope T = 70")
    end)

    it("rmsnorm matches x / sqrt(mean(x^2) + eps) * w and its backward (dx, dw) matches finite differences", function()
      local x, w, eps = randn({ B, T, C }, 80), randn({ C }, 81), 1e-5
      local y, rstd = ops.rmsnorm(x, w, eps)
      assert.same({ B, T }, rstd:shape())
      local xs, ws = flat(x), flat(w)
      assert_close(y, rmsnorm_ref(xs, ws, N, C, eps), FWD_RTOL, FWD_ATOL, "rmsnorm forward")
      local R = randn({ B, T, C }, 82)
      local r = flat(R)
      local dx, dw = ops.rmsnorm_backward(R, x, w, rstd)
      assert_grad(dx, numgrad(function(v) return dot(rmsnorm_ref(v, ws, N, C, eps), r) end, xs), "rmsnorm dx")
      assert_grad(dw, numgrad(function(v) return dot(rmsnorm_ref(xs, v, N, C, eps), r) end, ws), "rmsnorm dw")
      -- dw accumulates (+=) into a given buffer
      local acc = dw:clone()
      ops.rmsnorm_backward(R, x, w, rstd, { dw = acc })
      assert_close(acc, dw:add(dw), 1e-6, 0, "rmsnorm dw accumulates")
    end)

    it("swiglu is silu(gate) * up and its backward matches finite differences", function()
      local hid = 5
      local x = randn({ B, T, 2 * hid }, 90, 2)
      local y = ops.swiglu(x)
      assert.same({ B, T, hid }, y:shape())
      assert_close(y, swiglu_ref(flat(x), N, hid), FWD_RTOL, FWD_ATOL, "swiglu forward")
      local R = randn({ B, T, hid }, 91)
      local r = flat(R)
      assert_grad(ops.swiglu_backward(R, x), numgrad(function(v) return dot(swiglu_ref(v, N, hid), r) end, flat(x)),
        "swiglu backward")
    end)
  end)

  describe("moe router", function()
    local E = 5
    it("softmax, top k with ties to the lower index, weights renormalised (k = 1, 2, 3)", function()
      -- row 1: experts 1 and 3 tie for first, 0 and 4 for third: torch.topk's order is 1, 3, then 0
      local vals = { 0.5, 2.0, -1.0, 2.0, 0.5 }
      for i = 6, N * E do vals[i] = ((i * 37) % 11) / 5 - 1 end
      local logits = from_flat(vals, { B, T, E })
      for _, k in ipairs{ 1, 2, 3 } do
        local probs, lse, ex, w = ops.moe_route(logits, k)
        local rp, rl, re, rw = moe_route_ref(vals, N, E, k)
        assert.same({ B, T, k }, ex:shape())
        assert.same(re, flat(ex), "k = " .. k .. " experts")
        assert_close(probs, rp, FWD_RTOL, FWD_ATOL, "probs")
        assert_close(lse, rl, FWD_RTOL, FWD_ATOL, "lse")
        assert_close(w, rw, FWD_RTOL, FWD_ATOL, "weights")
      end
      local _, _, ex = ops.moe_route(logits, 3)
      assert.same({ 1, 3, 0 }, { flat(ex)[1], flat(ex)[2], flat(ex)[3] })
    end)

    it("its backward (weights, load balancing, z-loss) matches finite differences", function()
      local logits = randn({ B, T, E }, 120, 1)
      local vals = flat(logits)
      local dprob = { 0.3, -0.2, 0.5, 0.1, -0.4 }
      local zscale = 0.7
      for _, k in ipairs{ 1, 2 } do
        local R = flat(randn({ B, T, k }, 121))
        local probs, lse, ex, w = ops.moe_route(logits, k)
        local function f(v) -- the top k stay the same under the small steps (no near ties here)
          local p, l, _, ww = moe_route_ref(v, N, E, k)
          local s = dot(ww, R)
          for n = 0, N - 1 do
            for e = 1, E do s = s + dprob[e] * p[n * E + e] end
            s = s + zscale * l[n + 1] ^ 2
          end
          return s
        end
        local dl = ops.moe_route_backward(from_flat(R, { B, T, k }), probs, lse, ex, w,
          { dprob = pg.tensor(dprob), zscale = zscale })
        assert_grad(dl, numgrad(f, vals), "moe_route backward k = " .. k)
      end
    end)

    it("refuses k beyond the experts and experts out of range", function()
      local logits = randn({ 2, E }, 3)
      assert.has_error(function() ops.moe_route(logits, E + 1) end, "ops.moe_route: k=6 exceeds the 5 experts")
      local probs, lse, ex, w = ops.moe_route(logits, 2)
      local bad = pg.tensor({ { 0, 5 }, { 1, 2 } }, { dtype = "int32" })
      assert.has_error(function() ops.moe_route_backward(w, probs, lse, bad, w) end,
        "ops.moe_route_backward: expert 5 at 2 is not one of the 5 experts")
      assert.is_not_nil(ex)
    end)
  end)

  describe("gelu and residual", function()
    it("gelu matches the tanh formula and its backward matches finite differences", function()
      local x = randn({ B, T, C }, 28, 2)
      assert_close(ops.gelu(x), gelu_ref(flat(x)), FWD_RTOL, FWD_ATOL, "gelu forward")
      local R = randn({ B, T, C }, 29)
      local r = flat(R)
      local dx = ops.gelu_backward(R, x)
      assert_grad(dx, numgrad(function(v) return dot(gelu_ref(v), r) end, flat(x)), "gelu dx")
    end)

    it("gelu stays accurate in the tails, relative to tiny values", function()
      -- the kernel's exp-based form must not cancel where tanh u is near -1
      local xs = { -9, -7, -5, -3, -1, -0.1, 0, 0.1, 1, 3, 5, 7, 9 }
      local x = pg.tensor(xs)
      local want = gelu_ref(flat(x))
      -- 1e-5 relative, and an absolute floor far below the smallest value (GELU(-9) ~ -4e-33)
      assert_close(ops.gelu(x), want, FWD_RTOL, 1e-40, "gelu tails")
      assert.is_true(math.abs(want[1]) > 0 and math.abs(flat(ops.gelu(x))[1]) > 0, "the tail value must be nonzero")
      local num = numgrad(function(v) return dot(gelu_ref(v), flat(pg.ones{ #xs })) end, flat(x))
      -- derivative: 1e-5 relative, 1e-9 absolute (finite differences resolve ~1e-12 here)
      assert_close(ops.gelu_backward(pg.ones{ #xs }, x), num, 1e-5, 1e-9, "gelu' tails")
    end)

    it("residual adds exactly", function()
      local a, b = randn({ B, T, C }, 30), randn({ B, T, C }, 31)
      -- float32 a + b is one rounding of the double sum: exact against tensor add
      assert.is_true(ops.residual(a, b):equal(a:add(b)))
      assert_close(ops.residual(a, b), (function()
        local av, bv, s = flat(a), flat(b), {}
        for i = 1, #av do s[i] = av[i] + bv[i] end
        return s
      end)(), FWD_RTOL, FWD_ATOL, "residual vs double sum")
    end)

    it("residual backward passes dout to both inputs, matching finite differences", function()
      local a, b = randn({ B, T, C }, 37), randn({ B, T, C }, 38)
      local R = randn({ B, T, C }, 39)
      local r, av, bv = flat(R), flat(a), flat(b)
      local da, db = ops.residual_backward(R)
      local function sum_ref(x, y)
        local s = {}
        for i = 1, #x do s[i] = x[i] + y[i] end
        return s
      end
      assert_grad(da, numgrad(function(v) return dot(sum_ref(v, bv), r) end, av), "residual da")
      assert_grad(db, numgrad(function(v) return dot(sum_ref(av, v), r) end, bv), "residual db")
      assert.is_true(da:equal(R) and db:equal(R)) -- a copy of dout: exact
    end)
  end)

  describe("cross-entropy", function()
    local TARGETS = { 0, 10, 5, 6, 3, 9, 1, 7, 4, 8 } -- both halves of a 6 + 5 split

    it("matches the reference losses, and dlogits matches finite differences of dloss * sum(losses)", function()
      local logits = randn({ B, T, V }, 32, 2)
      local tg = from_flat(TARGETS, { B, T }, "int32")
      local dloss = 0.37
      local losses, dlogits, total = ops.cross_entropy(logits, tg, { dloss = dloss })
      assert.same({ B, T }, losses:shape())
      local ref = xent_ref(flat(logits), TARGETS, N, V, V, 0)
      assert_close(losses, ref, FWD_RTOL, FWD_ATOL, "xent losses")
      local rs = 0
      for _, l in ipairs(ref) do rs = rs + l end
      assert.near(rs, total, 1e-5 * math.abs(rs)) -- sum of float losses: 1e-5 relative
      local num = numgrad(function(v)
        local s = 0
        for _, l in ipairs(xent_ref(v, TARGETS, N, V, V, 0)) do s = s + l end
        return dloss * s
      end, flat(logits))
      assert_grad(dlogits, num, "xent dlogits")
    end)

    it("ignores padded columns: zero gradient there, and the same loss as without them", function()
      local valid = V
      local real = randn({ N, V }, 33)
      -- three padding columns holding large values that would dominate a softmax
      local padded = {}
      local rv = real:totable()
      for n = 1, N do
        padded[n] = {}
        for j = 1, V do padded[n][j] = rv[n][j] end
        for j = V + 1, V + 3 do padded[n][j] = 50 end
      end
      padded = pg.tensor(padded)
      local tg = from_flat(TARGETS, { N }, "int32")
      local l1, d1, s1 = ops.cross_entropy(real, tg)
      local l2, d2, s2 = ops.cross_entropy(padded, tg, { valid = valid })
      -- the kernels read only the valid columns: bitwise the same results
      assert.is_true(l1:equal(l2))
      assert.equal(s1, s2)
      assert.is_true(d2:narrow(2, 1, V):equal(d1))
      assert.same(flat(pg.zeros{ N, 3 }), flat(d2:narrow(2, V + 1, 3)))
      assert_close(l2, xent_ref(flat(real), TARGETS, N, V, V, 0), FWD_RTOL, FWD_ATOL, "padded xent losses")
    end)

    it("a vocabulary split in two slices, combined by hand, equals the one-slice result", function()
      local logits = randn({ N, V }, 34, 3)
      local tg = from_flat(TARGETS, { N }, "int32")
      local lv = logits:totable()
      -- slice A: ids 0..5 (6 columns); slice B: ids 6..10 plus one padding column
      local A, Bs = {}, {}
      for n = 1, N do
        A[n], Bs[n] = {}, {}
        for j = 1, 6 do A[n][j] = lv[n][j] end
        for j = 1, 5 do Bs[n][j] = lv[n][6 + j] end
        Bs[n][6] = 1e3 -- padding: must never count
      end
      A, Bs = pg.tensor(A), pg.tensor(Bs)
      local oa, ob = { vocab_start = 0 }, { valid = 5, vocab_start = 6 }
      local ma, mb = flat(ops.xent_row_max(A, oa)), flat(ops.xent_row_max(Bs, ob))
      local sa, ta = ops.xent_sumexp(A, from_flat(ma, { N }), tg, oa)
      local sb, tb = ops.xent_sumexp(Bs, from_flat(mb, { N }), tg, ob)
      sa, ta, sb, tb = flat(sa), flat(ta), flat(sb), flat(tb)
      -- the cross-rank reductions, by hand: max of maxes, sums rescaled to it, target logits summed
      local g, s, tl = {}, {}, {}
      for n = 1, N do
        g[n] = math.max(ma[n], mb[n])
        s[n] = sa[n] * math.exp(ma[n] - g[n]) + sb[n] * math.exp(mb[n] - g[n])
        tl[n] = ta[n] + tb[n]
        -- the target is in exactly one slice; the other reports 0
        assert.is_true((ta[n] == 0) ~= (tb[n] == 0) or lv[n][TARGETS[n] + 1] == 0)
      end
      local G, S, TL = from_flat(g, { N }), from_flat(s, { N }), from_flat(tl, { N })
      local la, da, suma = ops.xent_finish(A, G, S, TL, tg, oa)
      local lb, db, sumb = ops.xent_finish(Bs, G, S, TL, tg, ob)
      assert.is_true(la:equal(lb), "both slices compute the same losses from the same statistics")
      assert.equal(suma, sumb)

      local l1, d1, s1 = ops.cross_entropy(logits, tg)
      -- the rescaled sums differ from the one-slice sums by float rounding only: 1e-6 relative
      assert_close(la, l1, 1e-6, 1e-6, "split losses")
      assert.near(s1, suma, 1e-6 * math.abs(s1))
      local joined, dav, dbv = {}, da:totable(), db:totable()
      for n = 1, N do
        joined[n] = {}
        for j = 1, 6 do joined[n][j] = dav[n][j] end
        for j = 1, 5 do joined[n][6 + j] = dbv[n][j] end
        assert.equal(0, dbv[n][6]) -- padding: exactly zero
      end
      assert_close(joined, d1, 1e-6, 1e-7, "split dlogits")

      -- in place (dlogits aliasing logits, as the engine runs it): the same bits
      local Bc = Bs:clone()
      local lc, dc = ops.xent_finish(Bc, G, S, TL, tg, { valid = 5, vocab_start = 6, inplace = true })
      assert.equal(Bc, dc)
      assert.is_true(Bc:equal(db) and lc:equal(lb))
    end)
  end)

  describe("optimizer", function()
    it("adamw_ over 3 steps equals a transcription of torch.optim.AdamW", function()
      local n = 64
      local o = { lr = 1e-2, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1, grad_scale = 0.5 }
      local p, m, v = randn({ n }, 35), pg.zeros{ n }, pg.zeros{ n }
      local rp, rm, rv = flat(p), {}, {}
      for i = 1, n do rm[i], rv[i] = 0, 0 end
      for step = 1, 3 do
        local grad = randn({ n }, 40 + step)
        local gv = flat(grad)
        o.step = step
        assert.equal(p, ops.adamw_(p, grad, m, v, o))
        -- torch: p *= 1 - lr wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
        -- denom = sqrt(v) / sqrt(1 - b2^t) + eps; p -= lr / (1 - b1^t) * m / denom
        for i = 1, n do
          local g = gv[i] * o.grad_scale
          rp[i] = rp[i] * (1 - o.lr * o.weight_decay)
          rm[i] = o.beta1 * rm[i] + (1 - o.beta1) * g
          rv[i] = o.beta2 * rv[i] + (1 - o.beta2) * g * g
          local denom = math.sqrt(rv[i]) / math.sqrt(1 - o.beta2 ^ step) + o.eps
          rp[i] = rp[i] - (o.lr / (1 - o.beta1 ^ step)) * rm[i] / denom
        end
      end
      -- float32 state against double: 1e-6 relative / 1e-7 absolute on p and m,
      -- 1e-5 relative on v (squares of small gradients)
      assert_close(p, rp, 1e-6, 1e-7, "adamw param")
      assert_close(m, rm, 1e-6, 1e-7, "adamw m")
      assert_close(v, rv, 1e-5, 1e-10, "adamw v")
      -- the update moved every parameter (not a vacuous comparison)
      local moved = flat(p:sub(randn({ n }, 35)))
      for i = 1, n do assert.is_true(math.abs(moved[i]) > 1e-4) end
    end)

    it("sum_squares equals the double sum, deterministically", function()
      local x = randn({ 1003 }, 36) -- not a multiple of the 64 chunks or 8 lanes
      local s = 0
      for _, v in ipairs(flat(x)) do s = s + v * v end
      -- double accumulation in another order: 1e-12 relative
      assert.near(s, ops.sum_squares(x), 1e-12 * s)
      assert.equal(ops.sum_squares(x), ops.sum_squares(x:clone()))
      assert.equal(0, ops.sum_squares(pg.zeros{ 0 }))
    end)
  end)

  describe("gradient accumulation", function()
    -- Parameter gradients are ADDED to what the buffer holds (micro-batches
    -- add up); the bindings take the buffers in a trailing table. Expected:
    -- the first call's result plus the second's, within float rounding of one
    -- addition (1e-6 relative, 1e-6 absolute). The input gradients (dx) are
    -- overwritten: the same bits as a fresh call.
    local function check_acc(first, second, sum_of, what)
      local f, g, acc = flat(first), flat(second), flat(sum_of)
      local want = {}
      for i = 1, #f do want[i] = f[i] + g[i] end
      assert(max_abs(g) > 1e-2, what .. ": vacuous (zero gradient)")
      assert_close(acc, want, 1e-6, 1e-6, what)
    end

    it("linear, layernorm, embedding, position and residual add into the given buffers", function()
      local OC = 6
      local x, w = randn({ B, T, C }, 60), randn({ OC, C }, 61)
      local dy1, dy2 = randn({ B, T, OC }, 62), randn({ B, T, OC }, 63)
      local _, w1, b1 = ops.linear_backward(dy1, x, w)
      local dx2, w2, b2 = ops.linear_backward(dy2, x, w)
      local gw, gb = w1:clone(), b1:clone()
      local dx, rw, rb = ops.linear_backward(dy2, x, w, true, { dw = gw, db = gb })
      assert.equal(gw, rw)
      assert.equal(gb, rb)
      assert.is_true(dx:equal(dx2), "dx is overwritten, not accumulated")
      check_acc(w1, w2, gw, "linear dw +=")
      check_acc(b1, b2, gb, "linear db +=")

      local lw, lb = randn({ C }, 64), randn({ C }, 65)
      local _, mean, rstd = ops.layernorm(x, lw, lb)
      local e1, e2 = randn({ B, T, C }, 66), randn({ B, T, C }, 67)
      local _, lw1, lb1 = ops.layernorm_backward(e1, x, lw, mean, rstd)
      local _, lw2, lb2 = ops.layernorm_backward(e2, x, lw, mean, rstd)
      local gw2, gb2 = lw1:clone(), lb1:clone()
      ops.layernorm_backward(e2, x, lw, mean, rstd, { dw = gw2, db = gb2 })
      check_acc(lw1, lw2, gw2, "layernorm dw +=")
      check_acc(lb1, lb2, gb2, "layernorm db +=")

      local tok = from_flat(TOKENS, { B, T }, "int32")
      local m1, m2 = ops.embedding_backward(e1, tok, V), ops.embedding_backward(e2, tok, V)
      local gm = m1:clone()
      assert.equal(gm, ops.embedding_backward(e2, tok, V, 0, { dweight = gm }))
      check_acc(m1, m2, gm, "embedding dweight +=")

      local p1, p2 = ops.position_backward(e1, T), ops.position_backward(e2, T)
      local gp = p1:clone()
      ops.position_backward(e2, T, { dwpe = gp })
      check_acc(p1, p2, gp, "position dwpe +=")

      local ga, gb3 = e1:clone(), e1:clone()
      ops.residual_backward(e2, { da = ga, db = gb3 })
      check_acc(e1, e2, ga, "residual da +=")
      check_acc(e1, e2, gb3, "residual db +=")

      assert.has_error(function() ops.linear_backward(dy1, x, w, true, { dw = pg.zeros{ C, OC } }) end,
        "ops.linear_backward: dw: expected a [6, 8] float32 tensor, got [8, 6] float32")
      assert.has_error(function() ops.layernorm_backward(e1, x, lw, mean, rstd, { dweight = gw2 }) end,
        "ops.layernorm_backward: unknown option 'dweight' (known: db, dw)")
    end)
  end)

  describe("determinism", function()
    -- The row reductions split by columns and the per-head attention are
    -- independent of the thread count; sizes here exceed the threshold under
    -- which the kernels run on one thread.
    it("gives the same bits on 1 thread and on several", function()
      local saved = ops.num_threads()
      local function run()
        local x, w, b = randn({ 128, 512 }, 50), randn({ 512 }, 51), randn({ 512 }, 52)
        local dy = randn({ 128, 512 }, 53)
        local _, mean, rstd = ops.layernorm(x, w, b)
        local dx, dw, db = ops.layernorm_backward(dy, x, w, mean, rstd)
        local tok = pg.arange(0, 128):reshape{ 128 }
        local demb = ops.embedding_backward(dy, pg.tensor(flat(tok), { dtype = "int32" }), 64, 0) -- row_start: one shard, ids 64.. are another's
        local dpos = ops.position_backward(dy, 16)
        local qkv = randn({ 2, 48, 96 }, 54)
        local out, att = ops.attention(qkv, 4) -- att: the rows' log-sum-exp
        local dqkv = ops.attention_backward(randn({ 2, 48, 32 }, 55), qkv, out, att, 4)
        local big = randn({ 100000 }, 56)
        local logits = randn({ 64, 600 }, 57)
        local tg = pg.tensor(flat(pg.arange(0, 64)), { dtype = "int32" })
        local l, dl, ls = ops.cross_entropy(logits, tg)
        return { dx, dw, db, demb, dpos, out, att, dqkv, dl, l }, { ops.sum_squares(big), ls }
      end
      ops.set_num_threads(1)
      local ok1, one, one_s = pcall(run)
      ops.set_num_threads(math.max(2, saved))
      local ok2, many, many_s = pcall(run)
      ops.set_num_threads(saved)
      assert(ok1, one)
      assert(ok2, many)
      for i = 1, #one do assert.is_true(one[i]:equal(many[i]), "result " .. i .. " differs") end
      assert.same(one_s, many_s)
    end)
  end)

  describe("argument checks", function()
    local x = pg.zeros{ B, T, C }
    it("name the function, the argument and both shapes", function()
      assert.has_error(function() ops.linear(x, pg.zeros{ 6, 7 }) end,
        "ops.linear: w: expected a [*, 8] float32 tensor, got [6, 7] float32")
      assert.has_error(function() ops.linear(pg.zeros{ C }, pg.zeros{ 6, C }) end,
        "ops.linear: x: expected a [..., *] float32 tensor (2 or more dimensions), got [8] float32")
      assert.has_error(function() ops.linear(x, pg.zeros{ 6, C }, pg.zeros{ 5 }) end,
        "ops.linear: b: expected a [6] float32 tensor, got [5] float32")
      assert.has_error(function() ops.linear_backward(x, x, pg.zeros{ 6, C }) end,
        "ops.linear_backward: dy: expected a [2, 5, 6] float32 tensor, got [2, 5, 8] float32")
      assert.has_error(function() ops.layernorm(x, pg.zeros{ 7 }, pg.zeros{ C }) end,
        "ops.layernorm: w: expected a [8] float32 tensor, got [7] float32")
      assert.has_error(function() ops.layernorm_backward(x, x, pg.zeros{ C }, pg.zeros{ N }, pg.zeros{ B, T }) end,
        "ops.layernorm_backward: mean: expected a [2, 5] float32 tensor, got [10] float32")
      assert.has_error(function() ops.embedding(pg.zeros{ B, T }, pg.zeros{ V, C }) end,
        "ops.embedding: tokens: expected a [*, *] int32 tensor, got [2, 5] float32")
      assert.has_error(function() ops.position(x, pg.zeros{ 3, C }, T) end,
        "ops.position: T=5 exceeds the 3 positions of wpe")
      assert.has_error(function() ops.position(x, pg.zeros{ T, C }, 4) end,
        "ops.position: T=4 but the input is [B, T, C] with T=5")
      local qkv = pg.zeros{ B, T, 3 * C }
      assert.has_error(function() ops.attention(qkv, 3) end,
        "ops.attention: qkv: last dimension 24 is not (heads + 2 kv_heads) = 9 head widths")
      assert.has_error(function() ops.attention(pg.zeros{ B, T, 10 }, 2) end,
        "ops.attention: qkv: last dimension 10 is not (heads + 2 kv_heads) = 6 head widths")
      assert.has_error(function() ops.attention(qkv, 4, 3) end, "ops.attention: kv_heads=3 does not divide heads=4")
      local out, lse = ops.attention(qkv, NH)
      assert.has_error(function() ops.attention_backward(pg.zeros{ B, 4, C }, qkv, out, lse, NH) end,
        "ops.attention_backward: dout: expected a [2, 5, 8] float32 tensor, got [2, 4, 8] float32")
      assert.has_error(function() ops.attention_backward(x, qkv, pg.zeros{ B, 4, C }, lse, NH) end,
        "ops.attention_backward: out: expected a [2, 5, 8] float32 tensor, got [2, 4, 8] float32")
      assert.has_error(function() ops.attention_backward(x, qkv, out, pg.zeros{ B, NH, 4 }, NH) end,
        "ops.attention_backward: lse: expected a [2, 2, 5] float32 tensor, got [2, 2, 4] float32")
      assert.has_error(function() ops.attention_backward(x, qkv, out, lse, NH, nil, pg.zeros{ 3 }) end,
        "ops.attention_backward: slopes: expected a [2] float32 tensor, got [3] float32")
      assert.has_error(function() ops.gelu_backward(pg.zeros{ 3 }, x) end,
        "ops.gelu_backward: dy: expected a [2, 5, 8] float32 tensor, got [3] float32")
      assert.has_error(function() ops.residual(x, pg.zeros{ N, C }) end,
        "ops.residual: b: expected a [2, 5, 8] float32 tensor, got [10, 8] float32")
      local logits = pg.zeros{ B, T, V }
      assert.has_error(function() ops.cross_entropy(logits, pg.zeros({ N }, { dtype = "int32" })) end,
        "ops.cross_entropy: targets: expected a [2, 5] int32 tensor, got [10] int32")
      assert.has_error(function() ops.cross_entropy(logits, pg.full({ B, T }, 11, { dtype = "int32" })) end,
        "ops.cross_entropy: targets: id 11 at row 1 is outside the vocabulary [0, 11)")
      assert.has_error(function() ops.cross_entropy(logits, pg.zeros({ B, T }, { dtype = "int32" }), { valid = 12 }) end,
        "ops.cross_entropy: valid=12 out of range [0, 11]")
      assert.has_error(function() ops.xent_sumexp(logits, pg.zeros{ B, T }, pg.zeros({ B, T }, { dtype = "int32" }),
        { inplace = true }) end, "ops.xent_sumexp: unknown option 'inplace' (known: dloss, valid, vocab_start)")
      local p = pg.zeros{ 4 }
      assert.has_error(function() ops.adamw_(p, pg.zeros{ 5 }, p:clone(), p:clone(), { lr = 1, step = 1 }) end,
        "ops.adamw_: grad: expected a [4] float32 tensor, got [5] float32")
      assert.has_error(function() ops.adamw_(p, p:clone(), p:clone(), p:clone(), { step = 1 }) end,
        "ops.adamw_: option 'lr' is required")
      assert.has_error(function() ops.adamw_(p, p:clone(), p:clone(), p:clone(), { lr = 1, step = 0 }) end,
        "ops.adamw_: step=0 out of range [1, 2147483647]")
    end)
  end)
end)
