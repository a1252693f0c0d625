-- The mixture-of-experts block (pg.nn.MoE, the runtime's moe kind) against a
-- double-precision Lua reference on small inputs: Mixtral's routing (softmax,
-- top k with ties to the lower index, weights renormalised over the k
-- chosen), the experts' SwiGLU, the load-balancing loss and the router
-- z-loss with their gradients (finite differences), with capacity_factor
-- (each expert's choices per sequence capped) and jitter (router input
-- noise); the options it refuses;
-- pg.nn.Mixtral and its Hugging Face round trip. The PyTorch fixture
-- (spec/fixtures/hf_mixtral_tiny, transformers' MixtralForCausalLM) in
-- mixtral_spec.lua.
local pg = require "pipegoose"

local B, T, D, H, E = 2, 3, 4, 6, 4
local N = B * T
-- forward against double precision: float32 rounding of a few products
local FWD_RTOL, FWD_ATOL = 1e-5, 1e-6
-- finite differences (central, step 1e-3 on the double reference) against the float32 backward
local GRAD_RTOL, GRAD_ATOL, STEP = 1e-3, 2e-5, 1e-3

local h = require "helpers"
local flat = h.flat

-- y, aux (load balancing, before its coefficient), z of the block alone (one MoE layer).
-- w: {gate = [E*D], w1 = {[H*D] per expert}, w2 = {[D*H]}, w3 = {[H*D]}}, x [N*D], flat and 1-based.
-- cap: each expert's capacity per sequence (T tokens): first choices before
-- second ones, earlier tokens first; the choices beyond add nothing.
local function moe_ref(x, w, k, cap)
  local y, counts, psum, z = {}, {}, {}, 0
  for e = 1, E do counts[e], psum[e] = 0, 0 end
  local route = {}
  for t = 0, N - 1 do
    local logit, mx = {}, -math.huge
    for e = 1, E do
      local s = 0
      for d = 1, D do s = s + x[t * D + d] * w.gate[(e - 1) * D + d] end
      logit[e], mx = s, math.max(mx, s)
    end
    local sum = 0
    for e = 1, E do sum = sum + math.exp(logit[e] - mx) end
    local p = {}
    for e = 1, E do p[e] = math.exp(logit[e] - mx) / sum; psum[e] = psum[e] + p[e] end
    z = z + (mx + math.log(sum)) ^ 2
    local taken, chosen, total = {}, {}, 0
    for j = 1, k do
      local best
      for e = 1, E do if not taken[e] and (best == nil or p[e] > p[best]) then best = e end end
      taken[best], chosen[j], total = true, best, total + p[best]
      counts[best] = counts[best] + 1
    end
    route[t] = { p = p, chosen = chosen, total = total, kept = {} }
    for j = 1, k do route[t].kept[j] = true end
  end
  if cap then
    for t0 = 0, N - 1, T do
      local fill = {}
      for j = 1, k do
        for t = t0, t0 + T - 1 do
          local e = route[t].chosen[j]
          fill[e] = (fill[e] or 0) + 1
          if fill[e] > cap then route[t].kept[j] = false end
        end
      end
    end
  end
  for t = 0, N - 1 do
    local p, chosen, total = route[t].p, route[t].chosen, route[t].total
    for d = 1, D do y[t * D + d] = 0 end
    for j = 1, k do
      local e, a = chosen[j], {}
      for i = 1, H do
        local g, u = 0, 0
        for d = 1, D do
          g = g + w.w1[e][(i - 1) * D + d] * x[t * D + d]
          u = u + w.w3[e][(i - 1) * D + d] * x[t * D + d]
        end
        a[i] = g / (1 + math.exp(-g)) * u
      end
      for d = 1, D do
        local o = 0
        for i = 1, H do o = o + w.w2[e][(d - 1) * H + i] * a[i] end
        if route[t].kept[j] then y[t * D + d] = y[t * D + d] + p[e] / total * o end
      end
    end
  end
  local aux = 0
  for e = 1, E do aux = aux + counts[e] * psum[e] end
  return y, E * aux / (N * N), z / N
end

-- A standalone MoE layer with its weights read back into a reference table.
local function layer_of(o)
  local spec = pg.nn.MoE{ dim = D, hidden = H, experts = E, top_k = o.top_k, aux_loss_coef = o.aux or 0,
                          z_loss_coef = o.z or 0, init_std = 0.5, capacity_factor = o.capacity,
                          jitter = o.jitter }
  local layer = pg.nn.Layer(spec, nil, { seed = o.seed or 7 })
  local w, by = { w1 = {}, w2 = {}, w3 = {} }, {}
  for _, p in ipairs(layer:params()) do
    by[p.name] = p
    local e, which = p.name:match("^experts%.(%d+)%.(w%d)%.weight$")
    if e then w[which][tonumber(e) + 1] = flat(p.tensor) else w.gate = flat(p.tensor) end
  end
  return layer, w, by
end

local function assert_close(got, want, rtol, atol, what)
  got, want = flat(got), flat(want)
  assert.equal(#want, #got, what .. ": sizes")
  for i = 1, #want do
    assert(math.abs(got[i] - want[i]) <= atol + rtol * math.abs(want[i]),
      ("%s: element %d: got %.9g, want %.9g"):format(what, i, got[i], want[i]))
  end
end

-- Central differences of f at vals[i] for each i (perturbed in place, restored).
local function numgrad(f, vals)
  local g = {}
  for i = 1, #vals do
    local v = vals[i]
    vals[i] = v + STEP
    local up = f()
    vals[i] = v - STEP
    local down = f()
    vals[i] = v
    g[i] = (up - down) / (2 * STEP)
  end
  return g
end

describe("pg.nn.MoE against a Lua reference", function()
  -- capacity_factor 0.5 with T = 3 tokens and top_k 2 over 4 experts: each
  -- expert takes ceil(0.5 x 3 x 2 / 4) = 1 choice per sequence
  for _, c in ipairs{ { k = 1 }, { k = 2 }, { k = 2, capacity = 0.5, cap = 1 } } do
    local k = c.k
    it(("top_k = %d%s: output, auxiliary losses and every gradient"):format(k,
      c.capacity and ", capacity_factor " .. c.capacity or ""), function()
      local aux_coef, z_coef = 0.3, 0.05
      local layer, w = layer_of{ top_k = k, aux = aux_coef, z = z_coef, capacity = c.capacity }
      local x = pg.randn({ B, T, D }, { seed = 11 })
      local xs = flat(x)
      local y, aux = layer:forward(x)
      local ry, raux, rz = moe_ref(xs, w, k, c.cap)
      assert_close(y, ry, FWD_RTOL, FWD_ATOL, "y")
      if c.cap then -- choices were dropped: not the output without the capacity
        local full = moe_ref(xs, w, k)
        local diff = 0
        for i, v in ipairs(full) do diff = math.max(diff, math.abs(v - ry[i])) end
        assert.is_true(diff > 1e-2, "the capacity drops choices")
      end
      assert.near(aux_coef * raux + z_coef * rz, aux, 1e-6)
      local R = pg.randn({ B, T, D }, { seed = 12 })
      local r = flat(R)
      -- what the layer's backward differentiates: y . R + the auxiliary losses (d/d aux = rows x dloss = 1 here)
      local function f()
        local yy, a, z = moe_ref(xs, w, k, c.cap)
        local s = aux_coef * a + z_coef * z
        for i = 1, #yy do s = s + yy[i] * r[i] end
        return s
      end
      layer:zero_grad()
      local dx = layer:backward(R)
      assert_close(dx, numgrad(f, xs), GRAD_RTOL, GRAD_ATOL, "dx")
      local grads = {}
      for _, p in ipairs(layer:params()) do grads[p.name] = p.grad end
      assert_close(grads["gate.weight"], numgrad(f, w.gate), GRAD_RTOL, GRAD_ATOL, "gate")
      for e = 1, E do
        for _, which in ipairs{ "w1", "w2", "w3" } do
          local name = ("experts.%d.%s.weight"):format(e - 1, which)
          assert_close(grads[name], numgrad(f, w[which][e]), GRAD_RTOL, GRAD_ATOL, name)
        end
      end
    end)
  end

  -- jitter multiplies the router's input by noise the layer draws again in
  -- backward; no double reference can draw it, so the float32 layer is its own
  -- reference: central differences (step 1e-2) of its forward y . R + aux
  -- against its backward, to 1e-2 relative + 2e-3 absolute (float32 rounding
  -- of f ~ 10 over 2e-2 is ~1e-4; routing stays put for so small a step)
  it("jitter: the router sees noisy input (a different output), and dx is the gradient of what forward computed",
    function()
      local plain = layer_of{ top_k = 2, aux = 0.3 }
      local layer = layer_of{ top_k = 2, aux = 0.3, jitter = 0.5 }
      local x = pg.randn({ B, T, D }, { seed = 11 })
      local y0 = flat(plain:forward(x))
      local y1 = flat(layer:forward(x))
      local diff = 0
      for i, v in ipairs(y0) do diff = math.max(diff, math.abs(v - y1[i])) end
      assert.is_true(diff > 1e-3, "the noise changes the routing weights")
      local R = pg.randn({ B, T, D }, { seed = 12 })
      local r = flat(R)
      local function f()
        local y, aux = layer:forward(x)
        local s = aux
        for i, v in ipairs(flat(y)) do s = s + v * r[i] end
        return s
      end
      f()
      layer:zero_grad()
      local dx = flat(layer:backward(R))
      for i = 1, B * T * D do
        local b, rest = (i - 1) // (T * D) + 1, (i - 1) % (T * D)
        local t, d = rest // D + 1, rest % D + 1
        local v = x:get(b, t, d)
        x:set(b, t, d, v + 1e-2)
        local up = f()
        x:set(b, t, d, v - 1e-2)
        local down = f()
        x:set(b, t, d, v)
        local g = (up - down) / 2e-2
        assert(math.abs(dx[i] - g) <= 2e-3 + 1e-2 * math.abs(g), ("dx[%d] %.6g, differences %.6g"):format(i, dx[i], g))
      end
    end)

  it("the router's gradient: with k = 1 only the auxiliary losses reach it (the one weight is 1)", function()
    local layer = layer_of{ top_k = 1 }
    layer:forward(pg.randn({ B, T, D }, { seed = 3 }))
    layer:zero_grad()
    layer:backward(pg.randn({ B, T, D }, { seed = 4 }))
    for _, p in ipairs(layer:params()) do
      if p.name == "gate.weight" then assert.equal(0, p.grad:abs():sum()) end
    end
  end)

  it("ties go to the lower expert, as torch.topk orders them", function()
    for _, k in ipairs{ 1, 2 } do
      local layer, w, by = layer_of{ top_k = k, seed = 5 }
      -- experts 1 and 2 (0-based) share a router row that makes them the first choices of
      -- every token (positive inputs): their probabilities tie everywhere
      local g = by["gate.weight"].tensor
      for d = 1, D do
        g:set(2, d, 2)
        g:set(3, d, 2)
      end
      w.gate = flat(g)
      local x = pg.randn({ B, T, D }, { seed = 6 }):abs()
      local y = layer:forward(x)
      local ry = moe_ref(flat(x), w, k)
      assert_close(y, ry, FWD_RTOL, FWD_ATOL, "y with ties, k = " .. k)
      if k == 1 then -- and not the higher one: the reference choosing expert 2 differs
        local swap = function(l) return { l[1], l[3], l[2], l[4] } end
        local other = moe_ref(flat(x), { gate = w.gate, w1 = swap(w.w1), w2 = swap(w.w2), w3 = swap(w.w3) }, k)
        local diff = 0
        for i, v in ipairs(flat(y)) do diff = math.max(diff, math.abs(v - other[i])) end
        assert.is_true(diff > 1e-3, "the tie must decide something")
      end
    end
  end)

  it("refuses bad options, naming them", function()
    local function refuses(msg, o)
      local ok, err = pcall(pg.nn.MoE, o)
      assert.is_false(ok)
      assert.matches(msg, tostring(err), 1, true)
    end
    refuses("MoE: top_k=5 exceeds experts=4", { dim = 4, hidden = 6, experts = 4, top_k = 5 })
    refuses("MoE: experts", { dim = 4, hidden = 6, experts = 0 })
    refuses("MoE: top_k", { dim = 4, hidden = 6, experts = 4, top_k = 0 })
    refuses("MoE: capacity_factor must be a finite number > 0, got 0", { dim = 4, hidden = 6, experts = 4,
      capacity_factor = 0 })
    refuses("MoE: jitter=1 must be below 1", { dim = 4, hidden = 6, experts = 4, jitter = 1 })
    local m = pg.nn.MoE{ dim = 4, hidden = 6, experts = 4 }
    local ok, err = pcall(m.describe, m, "", { width = 4, split = false }, 4)
    assert.is_false(ok)
    assert.matches("tensor=4 does not divide the experts' hidden width 6", err, 1, true)
    ok, err = pcall(pg.nn.Mixtral, { vocab = 10, dim = 8, layers = 1, heads = 2, hidden = 8, experts = 2, top_k = 3,
                                     seq_len = 4 })
    assert.is_false(ok)
    assert.matches("Mixtral: top_k=3 exceeds experts=2", err, 1, true)
  end)

  it("defaults: top_k 2, aux_loss_coef 0.001 (transformers' Mixtral), z_loss_coef 0", function()
    local m = pg.nn.MoE{ dim = 4, hidden = 6, experts = 4 }
    assert.same({ 2, 0.001, 0 }, { m.top_k, m.aux_loss_coef, m.z_loss_coef })
    assert.equal(4 * (4 + 3 * 4 * 6), m:num_params())
  end)
end)

describe("pg.nn.Mixtral", function()
  local O = { vocab = 13, dim = 8, layers = 2, heads = 2, kv_heads = 1, hidden = 6, experts = 3, top_k = 2, seq_len = 4,
              aux_loss_coef = 0.01, z_loss_coef = 0.001 }

  it("names every expert's parameters, counts them, and round-trips its config", function()
    local m = pg.nn.Mixtral(O)
    local e = pg.parallelize(m, nil, {})
    local names = {}
    for _, p in ipairs(e:parameters()) do names[p.name] = true end
    for _, n in ipairs{ "blocks.1.moe.gate.weight", "blocks.1.moe.experts.2.w1.weight", "blocks.0.moe.experts.0.w2.weight",
                        "blocks.0.moe.experts.1.w3.weight", "blocks.0.attn.qkv.weight", "head.weight" } do
      assert.is_true(names[n], n)
    end
    assert.equal(m:num_params(), e:num_parameters())
    local again = pg.nn.from_config(e.config)
    assert.same(m.config, again.config)
    assert.equal("mixtral", e.config.arch)
  end)

  it("reports the auxiliary losses apart (their sum is the loss) and each expert's tokens, the same with recomputation", function()
    local e = pg.parallelize(pg.nn.Mixtral(O), nil, {})
    local x = pg.tensor({ { 1, 2, 3, 4 }, { 5, 6, 7, 8 } }, { dtype = "int32" })
    local y = pg.tensor({ { 2, 3, 4, 5 }, { 6, 7, 8, 9 } }, { dtype = "int32" })
    local loss = e:forward_backward(x, y)
    local parts = e:losses()
    assert.is_true(parts.aux_loss > 0)
    assert.near(parts.ce_loss + parts.aux_loss, loss, 1e-12)
    assert.near(parts.ce_loss, e:loss(x, y), 1e-6)
    -- every token chose top_k = 2 experts in each of the 2 layers
    local total = 0
    for _, n in ipairs(parts.expert_tokens) do total = total + n end
    assert.same({ 3, 2 * 2 * 8 }, { #parts.expert_tokens, total })
    -- recomputation gives the same step (the recomputed forward adds nothing to the routing totals)
    local r = pg.parallelize(pg.nn.Mixtral(O), nil, { recompute = "full" })
    assert.equal(loss, r:forward_backward(x, y))
    assert.equal(parts.aux_loss, r:losses().aux_loss)
  end)

  it("writes transformers' layout and reads it back (from_hf / save_hf)", function()
    local e = pg.parallelize(pg.nn.Mixtral(O), nil, {})
    local dir = h.tmpdir()
    e:save_hf(dir)
    local cjson = require "cjson"
    local f = assert(io.open(dir .. "/config.json"))
    local cfg = cjson.decode(f:read("a"))
    f:close()
    assert.same({ "MixtralForCausalLM", "mixtral", 3, 2, true, 0.01 }, { cfg.architectures[1], cfg.model_type,
      cfg.num_local_experts, cfg.num_experts_per_tok, cfg.output_router_logits, cfg.router_aux_loss_coef })
    local t = h.safetensors_tensors(dir .. "/model.safetensors")
    assert.is_not_nil(t["model.layers.1.block_sparse_moe.experts.2.w1.weight"])
    assert.is_not_nil(t["model.layers.0.block_sparse_moe.gate.weight"])
    local back = pg.parallelize(pg.nn.from_hf(dir), nil, {})
    for _, p in ipairs(e:parameters()) do -- the reloaded vocabulary is padded to 64 rows: the real ones
      local a, b = e:gather_param(p.name), back:gather_param(p.name)
      local rows = math.min(a:shape()[1], b:shape()[1])
      assert.is_true(a:narrow(1, 1, rows):equal(b:narrow(1, 1, rows)), p.name)
    end
    -- z_loss_coef has no transformers field: the reloaded model has the default 0
    assert.same({ 3, 2, 0.01, 0 }, { back.config.experts, back.config.top_k, back.config.aux_loss_coef,
      back.config.z_loss_coef })
  end)
end)
