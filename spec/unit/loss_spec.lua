-- pg.loss and objectives written in Lua, on one rank: gradients against
-- finite differences, an objective that restates the fused head's
-- cross-entropy gives its loss and gradients bit for bit, and every misuse is
-- a clear error. PyTorch agreement in every layout: spec/dist/objectives_spec.lua.
local pg = require "pipegoose"

-- Central differences in float64 arithmetic on a float32 function: the step
-- 1e-2 keeps rounding (~1e-7 / 1e-2) below the 2e-4 relative tolerance.
local function check_grad(f, x, grad, what)
  local h = 1e-2
  for i = 1, x:size(1) do
    for j = 1, x:size(2) do
      local v = x:get(i, j)
      x:set(i, j, v + h)
      local up = f(x)
      x:set(i, j, v - h)
      local down = f(x)
      x:set(i, j, v)
      local want, got = (up - down) / (2 * h), grad:get(i, j)
      assert.is_true(math.abs(got - want) <= 2e-4 * math.max(1, math.abs(want)),
        ("%s: d/dx[%d][%d] %.7g, finite difference %.7g"):format(what, i, j, got, want))
    end
  end
end

-- Each case: a function that must fail, and text its error must contain.
local function assert_errors(cases)
  for _, c in ipairs(cases) do
    local ok, err = pcall(c[1])
    assert.is_false(ok)
    assert.truthy(tostring(err):find(c[2], 1, true), tostring(err))
  end
end

describe("pg.loss", function()
  it("cross_entropy: label smoothing, z-loss and ignored rows have the gradient of their loss", function()
    local x = pg.randn({ 5, 7 }, { seed = 11 })
    local t = pg.tensor({ 1, 6, -100, 0, 3 }, { dtype = "int32" })
    local o = { label_smoothing = 0.1, z_loss = 0.01 }
    local loss, d, parts = pg.loss.cross_entropy(x, t, o)
    assert.equal(4, parts.tokens)
    assert.is_true(math.abs(loss - (0.9 * parts.nll + 0.01 * parts.z) ) > 1e-3) -- smoothing adds its own term
    for j = 1, 7 do assert.equal(0, d:get(3, j)) end -- an ignored row has no gradient
    check_grad(function(v) return (pg.loss.cross_entropy(v, t, o)) end, x, d, "cross_entropy")
    local sum = pg.loss.cross_entropy(x, t, { label_smoothing = 0.1, z_loss = 0.01, reduction = "sum" })
    assert.is_true(math.abs(sum - 4 * loss) <= 1e-12 * math.abs(sum))
  end)

  it("kl_div: tau^2 KL(teacher || student) per row has the gradient of its loss, and 0 for equal inputs", function()
    local s, t = pg.randn({ 4, 6 }, { seed = 12 }), pg.randn({ 4, 6 }, { seed = 13 })
    local loss, d = pg.loss.kl_div(s, t, { temperature = 2 })
    assert.is_true(loss > 0)
    check_grad(function(v) return (pg.loss.kl_div(v, t, { temperature = 2 })) end, s, d, "kl_div")
    assert.is_true(math.abs((pg.loss.kl_div(s, s:clone()))) < 1e-12)
  end)

  it("last_tokens picks each sequence's last row and its backward puts the gradient back there", function()
    local batch = { batch = 2, seq_len = 3 }
    local out = pg.arange(1, 13):reshape{ 6, 2 }
    assert.same({ { 5, 6 }, { 11, 12 } }, pg.loss.last_tokens(out, batch):totable())
    local back = pg.loss.last_tokens_backward(pg.tensor{ { 1, 2 }, { 3, 4 } }, batch)
    assert.same({ { 0, 0 }, { 0, 0 }, { 1, 2 }, { 0, 0 }, { 0, 0 }, { 3, 4 } }, back:totable())
  end)

  it("refuses bad arguments, naming them", function()
    local z, i2 = pg.zeros{ 2, 3 }, pg.zeros({ 2 }, { dtype = "int32" })
    local cases = {
      { function() pg.loss.cross_entropy(z, pg.zeros({ 3 }, { dtype = "int32" })) end,
        "loss.cross_entropy: targets must be 2 int32 values (one per row), got [3] int32" },
      { function() pg.loss.cross_entropy(z, i2, { smoothing = 0.1 }) end, "unknown option 'smoothing'" },
      { function() pg.loss.cross_entropy(z, i2, { label_smoothing = 2 }) end,
        "cross_entropy: label_smoothing must be in [0, 1], not 2" },
      { function() pg.loss.cross_entropy(z, pg.tensor({ 0, 3 }, { dtype = "int32" })) end,
        "cross_entropy: target 3 at row 2 is outside [0, 3) (and is not ignore_index -100)" },
      { function() pg.loss.cross_entropy(z, i2, { reduction = "none" }) end, "reduction must be 'mean' or 'sum'" },
      { function() pg.loss.kl_div(z, pg.zeros{ 2, 2 }) end,
        "loss.kl_div: the teacher has 2 columns: give this rank's 3 or the vocabulary's 3" },
      { function() pg.loss.kl_div(z, z, { temperature = 0 }) end, "temperature must be a finite number > 0, not 0" },
      { function() pg.loss.cross_entropy(z, i2, { vocab = { size = 3, first = 4, count = 3 } }) end,
        "a split vocabulary (vocab.first > 1) needs ctx=" },
    }
    assert_errors(cases)
  end)
end)

describe("objectives written in Lua", function()
  local ctx = pg.ParallelContext{}
  local cfg = { vocab = 61, seq_len = 8, layers = 2, heads = 2, dim = 16 }
  local function engine(head, opts)
    local c = { head = head }
    for k, v in pairs(cfg) do c[k] = v end
    return pg.parallelize(pg.nn.GPT(c), ctx, opts or { micro_batches = 2, seed = 7 })
  end
  local x = pg.tensor({ { 1, 2, 3, 4, 5, 6, 7, 8 }, { 9, 10, 11, 12, 13, 14, 15, 16 }, { 3, 3, 3, 3, 3, 3, 3, 3 },
                        { 60, 1, 60, 1, 0, 0, 5, 5 } }, { dtype = "int32" })
  local y = pg.tensor({ { 2, 3, 4, 5, 6, 7, 8, 9 }, { 10, 11, 12, 13, 14, 15, 16, 17 }, { 1, 2, 3, 4, 5, 6, 7, 8 },
                        { 1, 60, 1, 60, 0, 0, 5, 5 } }, { dtype = "int32" })
  -- the fused head's loss, restated: mean token cross-entropy of each micro-batch
  local function ce(out, batch)
    return pg.loss.cross_entropy(out, batch.targets:reshape{ out:size(1) }, { vocab = batch.vocab, ctx = batch.ctx })
  end

  it("restating the fused head's cross-entropy gives its loss and gradients, and the same evaluation loss", function()
    local fused, own = engine("loss"), engine("logits")
    local lf, lo = fused:forward_backward(x, y), own:forward_backward(x, y, { objective = ce })
    assert.is_true(math.abs(lf - lo) <= 1e-6 * lf, ("%.9g vs %.9g"):format(lf, lo))
    for _, p in ipairs(fused:parameters()) do
      local a, b = fused:gather_param(p.name, true), own:gather_param(p.name, true)
      assert.is_true(a:allclose(b, 1e-5, 1e-7), p.name .. ": " .. a:max_abs_diff(b))
    end
    local ef, eo = fused:loss(x, y), own:loss(x, y, { objective = ce })
    assert.is_true(math.abs(ef - eo) <= 1e-6 * ef)
  end)

  it("gets the micro-batch's rows, targets and position, and parallelize's objective by default", function()
    local seen = {}
    local e = engine("logits", { micro_batches = 2, seed = 7, objective = function(out, batch)
      seen[#seen + 1] = { rows = out:size(1), width = out:size(2), mb = batch.micro_batch, first = batch.first_row,
                          grad = batch.want_grad, t11 = batch.targets:get(1, 1), vocab = batch.vocab.size }
      return ce(out, batch)
    end })
    e:forward_backward(x, y)
    assert.same({ rows = 16, width = 61, mb = 1, first = 1, grad = true, t11 = 2, vocab = 61 }, seen[1])
    assert.same({ rows = 16, width = 61, mb = 2, first = 17, grad = true, t11 = 1, vocab = 61 }, seen[2])
  end)

  it("refuses what cannot work, naming it", function()
    local e = engine("logits")
    local cases = {
      { function() e:forward_backward(x, y) end, "the model ends without a loss" },
      { function() e:forward_backward(x, y, { objective = function() return "x" end }) end,
        "the objective returned string, expected the loss (a number) and its gradient" },
      { function() e:forward_backward(x, y, { objective = function() return 1, pg.zeros{ 3, 3 } end }) end,
        "the objective returned [3, 3] float32 as the gradient, expected 16 x 61 float32 values (the shape of out)" },
      { function() e:forward_backward(x, y, { objective = function() error("my bug", 0) end }) end, "my bug" },
      { function() e:forward_backward(x, y, { objective = 5 }) end, "forward_backward: objective must be a function" },
      { function() engine("loss", { objective = ce }) end, "parallelize: the model computes its own loss" },
      { function() engine("loss"):forward_backward(x, y, { objective = ce }) end,
        "forward_backward: objective= needs a model that ends with an output" },
      { function() pg.nn.GPT{ vocab = 61, seq_len = 8, layers = 1, heads = 2, dim = 16, head = "logit" } end,
        "GPT: head must be 'loss', 'logits' or 'none', got 'logit'" },
    }
    assert_errors(cases)
  end)
end)
