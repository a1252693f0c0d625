-- worlds: 4 8
-- DiLoCo (pg.DiLoCo over pg.ParallelContext{islands = k}): the outer step
-- against plain training, the islands' mean and a float64 reference, and an
-- island of a tensor-parallel layout against the same algorithm run serially.
local pg = require "pipegoose"

local world = pg.world_size()
local CFG = { vocab = 61, padded_vocab = 64, seq_len = 16, dim = 32, heads = 4, layers = 2 }
local GLOBAL_BATCH = 8
local EPS32 = 2 ^ -24

-- A fixed global batch of random ids, the same on every rank.
local function batch()
  local x, y = {}, {}
  local r = pg.randn({ GLOBAL_BATCH, CFG.seq_len + 1 }, { seed = 11 }):totable()
  for b = 1, GLOBAL_BATCH do
    x[b], y[b] = {}, {}
    for t = 1, CFG.seq_len do
      x[b][t] = math.floor(math.abs(r[b][t]) * 1000) % CFG.vocab
      y[b][t] = math.floor(math.abs(r[b][t + 1]) * 1000) % CFG.vocab
    end
  end
  return pg.tensor(x, { dtype = "int32" }), pg.tensor(y, { dtype = "int32" })
end
local X, Y = batch()

local function adamw(engine)
  return pg.optim.AdamW(engine, { lr = 1e-3, betas = { 0.9, 0.95 }, weight_decay = 0.1 })
end

-- The rows of the global batch that data rank d of island i reads (islands split the batch as data ranks do).
local function rows_of(ctx)
  local D = ctx:world_size("islands") * ctx:world_size("data")
  local d = ctx:local_rank("islands") * ctx:world_size("data") + ctx:local_rank("data")
  local rows = GLOBAL_BATCH // D
  return X:narrow(1, d * rows + 1, rows), Y:narrow(1, d * rows + 1, rows)
end

local function inner_step(engine, opt, x, y)
  engine:zero_grad()
  local loss = engine:forward_backward(x, y)
  opt:clip_grad_norm(1.0)
  opt:step()
  return loss
end

-- Every island's flat parameters, as float64 Lua arrays (islands group order).
local function islands_params(engine)
  local ctx = engine.ctx
  local params = engine:flat()
  local n, k = params:numel(), ctx:world_size("islands")
  local all = k > 1 and pg.dist.all_gather(params:clone(), { ctx = ctx, group = "islands" }) or params:clone()
  local t = all:totable()
  local out = {}
  for i = 1, k do
    local a = {}
    for j = 1, n do a[j] = t[(i - 1) * n + j] end
    out[i] = a
  end
  return out
end

describe("islands", function()
  it("cut the world island-major; every group is the island's, and islands joins the matching ranks", function()
    if world % 2 ~= 0 then pending("needs an even world") return end
    local per, me = world // 2, pg.world_rank()
    local ctx = pg.ParallelContext{ islands = 2, seed = 5 }
    assert.equal(2, ctx:world_size("islands"))
    assert.equal(me // per, ctx:local_rank("islands"))
    assert.equal(per, ctx:world_size())
    assert.equal(me % per, ctx:rank())
    assert.same({ me % per, me % per + per }, ctx:ranks("islands"))
    -- the island's ranks are numbered inside it (it is the context's world); islands lists world ranks
    local global = {}
    for r = 0, per - 1 do global[r + 1] = r end
    assert.same(global, ctx:ranks("global"))
    assert.same({ islands = 2, tensor = 1, pipeline = 1, data = per, expert = 1, context = 1, world = per }, ctx:sizes())
    assert.matches("island " .. me // per .. "/2", tostring(ctx), 1, true)
  end)

  it("split token data as data ranks do: islands = 2 of data = D read what data = 2 D reads", function()
    if world % 2 ~= 0 then pending("needs an even world") return end
    -- one name on every rank: rank 0's draw, broadcast
    local wctx = pg.ParallelContext{ seed = 5 }
    local tag = pg.tensor({ pg.world_rank() == 0 and math.random(1, 2 ^ 24) or 0 })
    pg.dist.broadcast(tag, { ctx = wctx, src = 0 })
    local path = ("/tmp/pg-diloco-spec-%d"):format(math.tointeger(tag:get(1)))
    if pg.world_rank() == 0 then
      local ids = {}
      for i = 1, 4000 do ids[i] = (i * 7919) % 250 end
      pg.data.write_shard(path .. ".bin", ids)
    end
    pg.dist.barrier({ ctx = wctx })
    local function rows(ctx)
      local d = pg.data.TokenShards{ path = path .. ".bin", batch = 2 * world, seq_len = 8, seed = 3, ctx = ctx }
      local x = d:next_batch()
      return x:totable()
    end
    local plain = rows(pg.ParallelContext{ seed = 5 })
    local islands = rows(pg.ParallelContext{ islands = 2, seed = 5 })
    pg.dist.barrier({ ctx = wctx })
    if pg.world_rank() == 0 then os.remove(path .. ".bin") end
    assert.equal(2, #islands)
    assert.same(plain, islands)
  end)
end)

describe("DiLoCo", function()
  it("k = 1, H = 1, outer lr 1 and momentum 0 is plain training, to the bit (Trainer callback)", function()
    local function train(with_diloco)
      local ctx = pg.ParallelContext{ self = true, seed = 5, islands = 1 }
      local engine = pg.parallelize(pg.nn.GPT(CFG), ctx)
      local data = pg.testing.fake_data{ batches = 6, batch = 4, seq_len = CFG.seq_len, vocab = CFG.vocab, seed = 3,
                                         tensors = true }
      local cbs = {}
      if with_diloco then cbs[1] = pg.DiLoCo{ outer_every = 1, outer_lr = 1, outer_momentum = 0 } end
      local trainer = pg.Trainer{ engine = engine, optimizer = adamw(engine), max_steps = 6, clip_grad_norm = 1.0,
                                  callbacks = cbs, out = { write = function() end, flush = function() end } }
      trainer:fit(data)
      return engine:flat():clone(), cbs[1]
    end
    local plain = train(false)
    local got, cb = train(true)
    assert.equal(6, cb.outer_steps)
    assert.is_true(got:equal(plain), "max difference " .. tostring(got:max_abs_diff(plain)))
  end)

  it("outer lr 1, momentum 0: every island continues from the mean of the islands' inner results", function()
    if world % 4 ~= 0 then pending("needs 4 ranks") return end
    local ctx = pg.ParallelContext{ islands = 4, seed = 5 }
    assert.equal(4, ctx:world_size("islands"))
    assert.equal(world // 4, ctx:world_size()) -- each island: data = world / 4
    local engine = pg.parallelize(pg.nn.GPT(CFG), ctx)
    local opt = adamw(engine)
    local dl = pg.DiLoCo{ islands = 4, outer_every = 3, outer_lr = 1, outer_momentum = 0 }
    dl:attach(engine)
    local x, y = rows_of(ctx)
    for outer = 1, 2 do
      for _ = 1, 3 do inner_step(engine, opt, x, y) end
      local before = islands_params(engine)
      -- the islands differ before the sync (they read different rows)
      assert.is_true(before[1][1] ~= before[2][1] or before[1][100] ~= before[2][100])
      dl:outer_step()
      local after = islands_params(engine)
      local worst = 0
      for j = 1, #before[1] do
        local sum, abs = 0, 0
        for i = 1, 4 do sum, abs = sum + before[i][j], abs + math.abs(before[i][j]) end
        -- float32 avg of 4 values: each partial sum and the scaling round once (<= 4 roundings of <= sum |p_i|)
        local tol = 4 * EPS32 * abs
        for i = 1, 4 do
          local err = math.abs(after[i][j] - sum / 4)
          assert(err <= tol, ("outer step %d, element %d, island %d: %.9g, mean %.9g"):format(outer, j, i,
            after[i][j], sum / 4))
          if err > worst then worst = err end
        end
        assert(after[1][j] == after[2][j] and after[1][j] == after[3][j] and after[1][j] == after[4][j],
          "islands hold different parameters after the sync")
      end
    end
  end)

  it("the pseudo-gradient and the Nesterov update match a float64 reference for 3 outer steps", function()
    if world % 4 ~= 0 then pending("needs 4 ranks") return end
    local ctx = pg.ParallelContext{ islands = 4, seed = 5 }
    local engine = pg.parallelize(pg.nn.GPT(CFG), ctx)
    local opt = adamw(engine)
    local lr, m = 0.7, 0.9
    local dl = pg.DiLoCo{ outer_every = 2, outer_lr = lr, outer_momentum = m, nesterov = true }
    dl:attach(engine)
    local n = engine:flat():numel()
    local anchor = engine:flat():totable() -- float64 reference state
    local buf = {}
    for j = 1, n do buf[j] = 0 end
    local x, y = rows_of(ctx)
    local st = dl:outer_state()
    for outer = 1, 3 do
      for _ = 1, 2 do inner_step(engine, opt, x, y) end
      local p = islands_params(engine)
      dl:outer_step()
      local got = engine:flat():totable()
      local mom = st.momentum:totable()
      local moved = 0
      for j = 1, n do
        local mean = (p[1][j] + p[2][j] + p[3][j] + p[4][j]) / 4
        local g = anchor[j] - mean
        buf[j] = m * buf[j] + g
        local new = anchor[j] - lr * (g + m * buf[j])
        -- float32 arithmetic against exact: the mean (4 roundings of sum |p_i| / 4: spread), each of the update's ~6
        -- operations one rounding of its operands, and the reference's anchor and buffer drifting from the
        -- float32 ones by that much per earlier outer step
        local spread = (math.abs(p[1][j]) + math.abs(p[2][j]) + math.abs(p[3][j]) + math.abs(p[4][j])) / 4
        local scale = math.abs(anchor[j]) + spread + math.abs(g) + math.abs(buf[j]) + math.abs(g + m * buf[j])
        local tol = 8 * outer * EPS32 * scale + 1e-30
        assert(math.abs(got[j] - new) <= tol, ("outer step %d, element %d: %.9g, float64 reference %.9g"):format(
          outer, j, got[j], new))
        if j > st.lo and j <= st.hi then
          local bj = mom[j - st.lo]
          assert(math.abs(bj - buf[j]) <= tol, ("outer step %d, momentum at %d: %.9g, reference %.9g"):format(
            outer, j, bj, buf[j]))
        end
        anchor[j] = new
        if math.abs(new - mean) > 1e-6 then moved = moved + 1 end
      end
      assert(moved > n // 4, "the outer step left the parameters at the mean") -- momentum and lr 0.7 act
    end
  end)

  it("an island of a tensor = 2 layout equals the same run of that island alone (serial)", function()
    if world ~= 4 then pending("needs 4 ranks") return end
    local H, OUTER, lr, m = 2, 2, 0.7, 0.9
    local ctx = pg.ParallelContext{ islands = 2, tensor = 2, seed = 5 }
    local engine = pg.parallelize(pg.nn.GPT(CFG), ctx)
    local opt = adamw(engine)
    local dl = pg.DiLoCo{ outer_every = H, outer_lr = lr, outer_momentum = m }
    dl:attach(engine)
    local x, y = rows_of(ctx)
    -- the serial reference: both islands on this process, the outer step in float64 on their flat buffers
    local serial = {}
    for i = 1, 2 do
      local sctx = pg.ParallelContext{ self = true, seed = 5 }
      local e = pg.parallelize(pg.nn.GPT(CFG), sctx)
      serial[i] = { engine = e, opt = adamw(e), x = X:narrow(1, (i - 1) * 4 + 1, 4), y = Y:narrow(1, (i - 1) * 4 + 1, 4) }
    end
    local n = serial[1].engine:flat():numel()
    local anchor, buf = serial[1].engine:flat():totable(), {}
    for j = 1, n do buf[j] = 0 end
    for _ = 1, OUTER do
      for _ = 1, H do
        inner_step(engine, opt, x, y)
        for i = 1, 2 do inner_step(serial[i].engine, serial[i].opt, serial[i].x, serial[i].y) end
      end
      dl:outer_step()
      local a, b = serial[1].engine:flat():totable(), serial[2].engine:flat():totable()
      for j = 1, n do
        local g = anchor[j] - (a[j] + b[j]) / 2
        buf[j] = m * buf[j] + g
        anchor[j] = anchor[j] - lr * (g + m * buf[j])
      end
      local t = pg.tensor(anchor)
      for i = 1, 2 do serial[i].engine:flat():copy_(t) end
    end
    -- the same tolerance as the tensor-parallel spec's: split sums round differently (~1e-7 relative per
    -- step), carried through 4 AdamW steps of lr 1e-3 and the outer steps; Adam can move an element whose
    -- gradient is near zero by up to lr per step, so the largest single difference is bounded by 4 lr
    for _, p in ipairs(serial[1].engine:parameters()) do
      local full = engine:gather_param(p.name)
      local want = p.tensor
      local d = full:sub(want)
      local rms = math.sqrt(d:mul(d):sum() / d:numel())
      local wrms = math.sqrt(want:mul(want):sum() / want:numel())
      assert(rms <= 1e-5 * wrms + 1e-5, ("%s: rms difference %.3g (rms %.3g)"):format(p.name, rms, wrms))
      assert(full:max_abs_diff(want) <= 4e-3, p.name .. ": largest difference " .. full:max_abs_diff(want))
    end
  end)

  it("fragments = 4, outer lr 1, momentum 0, delay 0: the fragment due takes the islands' mean, the others stay",
    function()
    if world % 4 ~= 0 then pending("needs 4 ranks") return end
    local ctx = pg.ParallelContext{ islands = 4, seed = 5 }
    local engine = pg.parallelize(pg.nn.GPT(CFG), ctx)
    local opt = adamw(engine)
    local H, F = 4, 4
    local dl = pg.DiLoCo{ outer_every = H, outer_lr = 1, outer_momentum = 0, fragments = F, delay = 0 }
    dl:attach(engine)
    local x, y = rows_of(ctx)
    local frags = dl:outer_state().fragments
    assert.equal(F, #frags)
    for step = 1, 2 * H do
      inner_step(engine, opt, x, y)
      local before = islands_params(engine)
      dl:after_step(step)
      local after = islands_params(engine)
      local due = 0
      for f, fr in ipairs(frags) do
        assert.equal((f - 1) * H // F, fr.offset)
        local synced = step % H == fr.offset
        if synced then due = due + 1 end
        local spread = false
        for j = fr.a + 1, fr.b do
          if synced then
            local sum, abs = 0, 0
            for i = 1, 4 do sum, abs = sum + before[i][j], abs + math.abs(before[i][j]) end
            for i = 1, 4 do
              assert(math.abs(after[i][j] - sum / 4) <= 4 * EPS32 * abs, ("step %d, fragment %d, element %d, "
                .. "island %d: %.9g, mean %.9g"):format(step, f, j, i, after[i][j], sum / 4))
            end
          else
            for i = 1, 4 do assert(after[i][j] == before[i][j], "a fragment not due changed") end
            if before[1][j] ~= before[2][j] then spread = true end
          end
        end
        if not synced and step > 1 then assert.is_true(spread, "the islands agree on a fragment not synced") end
      end
      assert.equal(1, due)
    end
    assert.equal(2 * F, dl.outer_steps)
  end)

  it("streaming with delay 1: the update of the mean at the start lands a step later, merged half and half "
    .. "(float64 reference)", function()
    if world % 4 ~= 0 then pending("needs 4 ranks") return end
    local ctx = pg.ParallelContext{ islands = 4, seed = 5 }
    local engine = pg.parallelize(pg.nn.GPT(CFG), ctx)
    local opt = adamw(engine)
    local H, F, lr, m, alpha = 4, 2, 0.7, 0.9, 0.5
    local dl = pg.DiLoCo{ outer_every = H, outer_lr = lr, outer_momentum = m, fragments = F }
    assert.equal(1, dl.delay)
    dl:attach(engine)
    local n = engine:flat():numel()
    local anchor, buf, started = engine:flat():totable(), {}, {}
    for j = 1, n do buf[j] = 0 end
    local x, y = rows_of(ctx)
    local frags = dl:outer_state().fragments
    local landed = 0
    for step = 1, 3 * H do
      inner_step(engine, opt, x, y)
      local local_p = islands_params(engine)
      dl:after_step(step)
      local got = islands_params(engine)
      for f, fr in ipairs(frags) do
        if started[f] and started[f].step + 1 == step then -- lands now
          landed = landed + 1
          local p0 = started[f].p
          for j = fr.a + 1, fr.b do
            local mean = (p0[1][j] + p0[2][j] + p0[3][j] + p0[4][j]) / 4
            local g = anchor[j] - mean
            buf[j] = m * buf[j] + g
            local new = anchor[j] - lr * (g + m * buf[j])
            local spread = (math.abs(p0[1][j]) + math.abs(p0[2][j]) + math.abs(p0[3][j]) + math.abs(p0[4][j])) / 4
            local scale = math.abs(anchor[j]) + spread + math.abs(g) + math.abs(buf[j]) + math.abs(g + m * buf[j])
            -- as the reference above, plus the merge's 3 roundings of |p| + |new|
            local tol = 8 * (landed // F + 1) * EPS32 * scale + 3 * EPS32 * (math.abs(new) + spread) + 1e-30
            for i = 1, 4 do
              local want = alpha * local_p[i][j] + (1 - alpha) * new
              assert(math.abs(got[i][j] - want) <= tol + 2 * EPS32 * math.abs(local_p[i][j]), ("step %d, fragment "
                .. "%d, element %d, island %d: %.9g, float64 reference %.9g"):format(step, f, j, i, got[i][j], want))
            end
            anchor[j] = new
          end
          started[f] = nil
        end
        if step % H == fr.offset then started[f] = { step = step, p = local_p } end
      end
    end
    assert.equal(F * 3 - 1, landed) -- fragment 1 started at step 12 is still in flight
    assert.is_true(frags[1].pending == false and dl:outer_state().fragments[1].pending)
  end)

  -- The quantised exchanges against a float64 reference of the float32 algorithm, one outer step (lr 0.7,
  -- momentum 0.9, so d = (1 + m) g): the error of element j is at most lr (1 + m) e_g + e_u, e_g the mean over
  -- islands of the code's error on island i's pseudo-gradient, e_u its error on the update; bf16: |x| 2^-8
  -- (nearest even, 8 significant bits); int8: scale / 2 with scale = absmax / 127 of the code block (of
  -- INT8_BLOCK values; the update's absmax taken from the reference, off by at most lr (1 + m) max e_g), plus
  -- float32 roundings of the operands. The bytes over the islands group: half of float32's (bf16), and
  -- (1 + B / 4) words per B values (int8).
  local function quantised_step(exchange)
    local ctx = pg.ParallelContext{ islands = 4, seed = 5 }
    local engine = pg.parallelize(pg.nn.GPT(CFG), ctx)
    local opt = adamw(engine)
    local dl = pg.DiLoCo{ outer_every = 2, outer_lr = 0.7, outer_momentum = 0.9, exchange = exchange }
    dl:attach(engine)
    local anchor = engine:flat():totable()
    local x, y = rows_of(ctx)
    for _ = 1, 2 do inner_step(engine, opt, x, y) end
    local p = islands_params(engine)
    local function bytes()
      local t = 0
      for _, v in pairs(ctx:comm_stats().islands) do t = t + v.bytes end
      return t
    end
    local b0 = bytes()
    dl:outer_step()
    return { dl = dl, engine = engine, anchor = anchor, p = p, bytes = bytes() - b0, got = islands_params(engine) }
  end

  for _, exchange in ipairs{ "bf16", "int8" } do
    it(("exchange = %s: within the code's error of the float32 exchange, with %s the bytes"):format(exchange,
      exchange == "bf16" and "half" or "about a quarter of"), function()
      if world % 4 ~= 0 then pending("needs 4 ranks") return end
      local r, f32 = quantised_step(exchange), quantised_step("float32")
      local lr, m, B = 0.7, 0.9, pg.DiLoCo.INT8_BLOCK
      local n = #r.anchor
      local function code_err(v, j0, j1) -- per element of v[j0..j1]: the code's error bound
        local out = {}
        if exchange == "bf16" then
          for j = j0, j1 do out[j] = math.abs(v[j]) * 2 ^ -8 end
        else
          for c = j0, j1, B do
            local amax = 0
            for j = c, math.min(c + B - 1, j1) do amax = math.max(amax, math.abs(v[j])) end
            for j = c, math.min(c + B - 1, j1) do out[j] = amax / 127 / 2 * (1 + 2 ^ -20) end
          end
        end
        return out
      end
      local eg = {}
      for j = 1, n do eg[j] = 0 end
      for i = 1, 4 do
        local delta = {}
        for j = 1, n do delta[j] = r.anchor[j] - r.p[i][j] end
        local e = code_err(delta, 1, n)
        for j = 1, n do eg[j] = eg[j] + e[j] / 4 end
      end
      local u, want = {}, {}
      for j = 1, n do
        local g = r.anchor[j] - (r.p[1][j] + r.p[2][j] + r.p[3][j] + r.p[4][j]) / 4
        u[j] = -lr * (1 + m) * g
        want[j] = r.anchor[j] + u[j]
      end
      local eu = code_err(u, 1, n)
      local worst, differs = 0, false
      for j = 1, n do
        local maxe = 0
        if exchange == "int8" then
          local c = (j - 1) // B * B + 1
          for jj = c, math.min(c + B - 1, n) do maxe = math.max(maxe, eg[jj]) end
        end
        local tol = lr * (1 + m) * eg[j] + eu[j] + lr * (1 + m) * maxe / 127
          + 16 * EPS32 * (math.abs(r.anchor[j]) + math.abs(r.p[1][j]) + math.abs(u[j])) + 1e-30
        for i = 1, 4 do
          local err = math.abs(r.got[i][j] - want[j])
          assert(err <= tol, ("%s, element %d, island %d: %.9g, float64 reference %.9g (bound %.3g)"):format(
            exchange, j, i, r.got[i][j], want[j], tol))
          assert(r.got[i][j] == r.got[1][j], "the islands hold different parameters after the sync")
        end
        worst = math.max(worst, math.abs(r.got[1][j] - want[j]))
        if r.got[1][j] ~= f32.got[1][j] then differs = true end
      end
      assert.is_true(differs, "the quantised exchange gave the float32 exchange's result: no code was used")
      -- bytes: reduce-scatter + all-gather of 4 blocks of float32 against all-to-all + all-gather of codes
      local block32 = (n + 3) // 4
      assert.equal(2 * 4 * block32 * 4, f32.bytes)
      if exchange == "bf16" then
        assert.equal(f32.bytes / 2, r.bytes)
      else
        local block8 = (block32 + B - 1) // B * B
        assert.equal(2 * 4 * (4 * block8 // B) * (1 + B // 4), r.bytes)
        assert.is_true(r.bytes < f32.bytes * (1 + 4 / B) / 4 * 1.04) -- a quarter, the scales, the padding
      end
    end)
  end

  it("pg.dist.iall_reduce and ireduce_scatter over the islands equal the blocking calls, counted in comm_stats",
    function()
    if world % 2 ~= 0 then pending("needs an even world") return end
    local ctx = pg.ParallelContext{ islands = 2, seed = 5 }
    local me = pg.world_rank()
    local v = {}
    for j = 1, 10 do v[j] = (me + 1) * j / 7 end
    local before = ctx:comm_stats().islands
    local a = pg.dist.iall_reduce(pg.tensor(v), { ctx = ctx, group = "islands", op = "avg" })
    local b = pg.dist.ireduce_scatter(pg.tensor(v), { ctx = ctx, group = "islands", op = "sum" })
    local ra = a:wait()
    while not b:test() do end
    local rb = b:wait()
    local after = ctx:comm_stats().islands
    local want_a = pg.dist.all_reduce(pg.tensor(v), { ctx = ctx, group = "islands", op = "avg" })
    local want_b = pg.dist.reduce_scatter(pg.tensor(v), { ctx = ctx, group = "islands", op = "sum" })
    local lo, hi = b:range()
    assert.equal(ctx:local_rank("islands") * 5, lo)
    assert.equal(lo + 5, hi)
    assert.is_true(ra:equal(want_a))
    assert.is_true(rb:narrow(1, lo + 1, hi - lo):equal(want_b))
    assert.equal(before.all_reduce.calls + 1, after.all_reduce.calls)
    assert.equal(before.reduce_scatter.calls + 1, after.reduce_scatter.calls)
    assert.is_true(after.all_reduce.bytes >= before.all_reduce.bytes + 40)
    assert.has_error(function() pg.dist.iall_reduce(pg.tensor({ 1, 2 }, { dtype = "int32" }), { ctx = ctx }) end,
      "iall_reduce: takes a float32 tensor, got int32")
  end)

  it("refuses islands that do not divide the world, and a DiLoCo whose islands differ from the context's", function()
    assert.has_error(function() pg.ParallelContext{ islands = 3 * world } end)
    local ctx = pg.ParallelContext{ self = true, seed = 5 }
    local engine = pg.parallelize(pg.nn.GPT(CFG), ctx)
    local dl = pg.DiLoCo{ islands = 2, outer_every = 2 }
    local ok, err = pcall(dl.attach, dl, engine)
    assert.is_false(ok)
    assert.matches("islands=2, but the context has 1", err, 1, true)
  end)
end)

-- Checkpoints of DiLoCo runs: a shared directory (rank 0's choice), trainers of 4 islands-or-fewer.
local function shared_dir(tag)
  local wctx = pg.ParallelContext{ seed = 5 }
  local t = pg.tensor({ pg.world_rank() == 0 and math.random(1, 2 ^ 24) or 0 })
  pg.dist.broadcast(t, { ctx = wctx, src = 0 })
  local dir = ("%s/pg-diloco-%s-%d"):format(os.getenv("TMPDIR") or "/tmp", tag, math.tointeger(t:get(1)))
  if pg.world_rank() == 0 then os.execute("rm -rf '" .. dir .. "' && mkdir -p '" .. dir .. "'") end
  pg.dist.barrier({ ctx = wctx })
  return dir, wctx
end

-- The whole outer state (p_sync and momentum, every block) and the parameters, as tensors.
local function whole_outer(dl)
  local st, ctx = dl:outer_state(), dl.engine.ctx
  local function whole(key)
    local out = pg.zeros({ dl.n })
    for _, fr in ipairs(st.fragments) do
      local t = fr[key]:clone()
      if ctx:world_size("islands") > 1 then t = pg.dist.all_gather(t, { ctx = ctx, group = "islands" }) end
      out:narrow(1, fr.a + 1, fr.b - fr.a):copy_(t:narrow(1, 1, fr.b - fr.a))
    end
    return out
  end
  return { anchor = whole("anchor"), momentum = whole("momentum"), params = dl.engine:flat():clone(),
           outer_steps = st.outer_steps, ctx = ctx }
end

-- A Trainer of k islands (H = 2, lr 0.7, momentum 0.9) for `steps` steps, each island reading its own
-- data, checkpointing into <dir>/island-<i> (save_last; every 2 steps), stopped (as preempted) after
-- stop_at, resumed from resume(island) when given. Returns the DiLoCo, its whole outer state at the start
-- of training (after any resume) and at the end.
local function run(o)
  local ctx = pg.ParallelContext{ islands = o.k, seed = 5 }
  local island = ctx:local_rank("islands")
  local engine = pg.parallelize(pg.nn.GPT(CFG), ctx)
  local data = pg.testing.fake_data{ batches = 16, batch = 4, seq_len = CFG.seq_len, vocab = CFG.vocab,
                                     seed = 3 + island % 2, tensors = true, ctx = ctx }
  local dl = pg.DiLoCo{ outer_every = o.H or 2, outer_lr = 0.7, outer_momentum = 0.9, fragments = o.fragments,
                        exchange = o.exchange }
  local start
  local cbs = { dl, { name = "Probe",
    on_train_start = function() start = whole_outer(dl) end,
    on_train_batch_end = function(_, t, out)
      if out.step_end and o.stop_at and t.state.step == o.stop_at then t.control.should_stop = true end
    end } }
  local out = ("%s/island-%d"):format(o.dir, island)
  cbs[3] = pg.callbacks.ModelCheckpoint{ dir = out, every_n_steps = 2, save_last = true, verbose = false }
  local trainer = pg.Trainer{ engine = engine, optimizer = adamw(engine), max_steps = o.steps, clip_grad_norm = 1.0,
    seed = 3, out = pg.testing.capture(), out_dir = out, callbacks = cbs }
  trainer:fit(data, nil, { resume = o.resume and o.resume(island) or nil })
  return dl, start, whole_outer(dl), trainer
end

local function same(a, b, what)
  assert.equal(a.outer_steps, b.outer_steps, what .. ": outer steps")
  for _, k in ipairs{ "params", "anchor", "momentum" } do
    assert.is_true(a[k]:equal(b[k]), ("%s: %s differ (largest difference %g)"):format(what, k,
      a[k]:max_abs_diff(b[k])))
  end
end

describe("DiLoCo checkpoints", function()
  if world ~= 4 then return end
  local base, wctx = shared_dir("ckpt")
  local _, _, straight = run{ k = 2, steps = 7, dir = base .. "/straight" }

  for _, stop in ipairs{ 4, 3 } do
    it(("resume after step %d (%s) equals the uninterrupted run bit for bit"):format(stop,
      stop % 2 == 0 and "just after an outer step" or "between two outer steps"), function()
      local dir = ("%s/stop-%d"):format(base, stop)
      local _, _, stopped = run{ k = 2, steps = 7, dir = dir, stop_at = stop }
      assert.equal(stop // 2, stopped.outer_steps)
      local _, start, got, trainer = run{ k = 2, steps = 7, dir = dir, resume = function() return "last" end }
      assert.is_not_nil(trainer.state.resumed_from)
      same(stopped, start, "the resumed state against the stopped run's")
      same(straight, got, "the resumed run's end against the uninterrupted run's")
      assert.equal(4, got.outer_steps) -- steps 2, 4, 6 and the final sync at 7
    end)
  end

  it("streaming (fragments = 2, H = 4, delay 1): resume with an exchange in flight (saved at step 4) is bitwise",
    function()
    local dir = base .. "/streaming"
    local o = { k = 2, steps = 9, H = 4, fragments = 2 }
    local _, _, want = run{ k = 2, steps = 9, H = 4, fragments = 2, dir = base .. "/streaming-straight" }
    o.dir, o.stop_at = dir, 4
    local dl, _, stopped = run(o)
    assert.is_true(dl:outer_state().fragments[1].pending, "fragment 1's exchange (started at step 4) in flight")
    o.stop_at, o.resume = nil, function() return "last" end
    local _, start, got = run(o)
    same(stopped, start, "the resumed state against the stopped run's")
    same(want, got, "the resumed run's end against the uninterrupted run's")
  end)

  it("int8 exchange, streaming: resume with an exchange in flight is bitwise", function()
    local o = { k = 2, steps = 9, H = 4, fragments = 2, exchange = "int8" }
    local _, _, want = run{ k = 2, steps = 9, H = 4, fragments = 2, exchange = "int8", dir = base .. "/int8-straight" }
    o.dir, o.stop_at = base .. "/int8", 4
    local _, _, stopped = run(o)
    o.stop_at, o.resume = nil, function() return "last" end
    local _, start, got = run(o)
    same(stopped, start, "the resumed state against the stopped run's")
    same(want, got, "the resumed run's end against the uninterrupted run's")
  end)

  -- k = 2 saved after step 3 (the islands apart) resumes at k' = 1 and 4: the whole outer state as saved,
  -- each new island i with old island i mod 2's parameters (and inner state); then it trains on
  for _, k in ipairs{ 1, 4 } do
    it(("a checkpoint of 2 islands resumes at %d (outer state resharded, island i from old island i mod 2)")
      :format(k), function()
      local dir = base .. "/reshard-" .. k
      local _, _, stopped = run{ k = 2, steps = 7, dir = dir, stop_at = 3 }
      -- every island's saved state, to compare with whichever island a new one starts from
      local params = pg.dist.all_gather(stopped.params, { ctx = stopped.ctx, group = "islands" })
      local n = stopped.params:numel()
      local dl, start = run{ k = k, steps = 5, dir = dir .. "/new",
        resume = function(i) return ("%s/island-%d"):format(dir, i % 2) end }
      local i = dl.engine.ctx:local_rank("islands")
      assert.equal(stopped.outer_steps, start.outer_steps)
      assert.is_true(start.anchor:equal(stopped.anchor), "the resharded p_sync differs from the saved one")
      assert.is_true(start.momentum:equal(stopped.momentum), "the resharded momentum differs from the saved one")
      assert.is_true(start.params:equal(params:narrow(1, (i % 2) * n + 1, n)),
        "island " .. i .. " did not start from old island " .. i % 2 .. "'s parameters")
      assert.is_true(dl.outer_steps >= 2) -- it went on: the outer step at 4 and the final sync at 5
    end)
  end

  it("a resume refuses a checkpoint whose outer file is damaged, on every rank, naming the file", function()
    local dir = base .. "/damaged"
    run{ k = 2, steps = 2, dir = dir }
    pg.dist.barrier({ ctx = wctx })
    -- one byte of each island's outer file changed (both: an island that loaded would wait for the other)
    if pg.world_rank() == 0 then
      for i = 0, 1 do
        local path = ("%s/island-%d/step-00000002/outer-tp0-pp0.safetensors"):format(dir, i)
        local f = assert(io.open(path, "r+b"))
        local size = f:seek("end")
        f:seek("set", size - 5)
        local b = f:read(1)
        f:seek("set", size - 5)
        f:write(string.char((b:byte() + 1) % 256))
        f:close()
      end
    end
    pg.dist.barrier({ ctx = wctx })
    local ok, err = pcall(run, { k = 2, steps = 4, dir = dir, resume = function() return "last" end })
    assert.is_false(ok)
    assert.matches("outer%-tp0%-pp0%.safetensors", tostring(err))
    assert.matches("checksum", tostring(err))
  end)

  it("leaves nothing behind", function()
    pg.dist.barrier({ ctx = wctx })
    if pg.world_rank() == 0 then os.execute("rm -rf '" .. base .. "'") end
    pg.dist.barrier({ ctx = wctx })
  end)
end)
