-- pg.ops checks ids and options as the engine does: an out-of-range id is an
-- error naming the id and the vocabulary (never a row of zeros), and a NaN
-- option is named as NaN (never read as "absent" or used).
local pg = require "pipegoose"
local ops = pg.ops

local function i32(t) return pg.tensor(t, { dtype = "int32" }) end

local function fails_with(want, f, ...)
  local ok, e = pcall(f, ...)
  assert.is_false(ok, "expected an error: " .. want)
  assert(tostring(e):find(want, 1, true), ("expected %q in: %s"):format(want, tostring(e)))
end

describe("pg.ops ids", function()
  local w = pg.randn{ 8, 4 }
  it("embedding: an id outside the weight's rows names the id and the vocabulary", function()
    fails_with("ops.embedding: tokens: id 8 at position 2 is outside the vocabulary [0, 8) (the weight's rows)",
      ops.embedding, i32{ { 1, 8 } }, w)
    fails_with("ops.embedding: tokens: id -1 at position 3 is outside the vocabulary [0, 8)",
      ops.embedding, i32{ { 1, 2, -1 } }, w)
    fails_with("ops.embedding_backward: tokens: id 9 at position 2 is outside the vocabulary [0, 8)",
      ops.embedding_backward, pg.zeros{ 1, 2, 4 }, i32{ { 1, 9 } }, 8)
  end)

  it("embedding of one vocabulary shard (row_start given): other shards' ids are zeros, negative ids refused", function()
    -- the shard holds ids [4, 12): id 5 is its row 2 (1-based), id 100 another shard's
    local out = ops.embedding(i32{ { 5, 100 } }, w, 4):totable()
    assert.same(w:totable()[2], out[1][1])
    assert.same({ 0, 0, 0, 0 }, out[1][2])
    fails_with("ops.embedding: tokens: id -3 at position 1 is negative: not a vocabulary id",
      ops.embedding, i32{ { -3, 5 } }, w, 4)
  end)

  it("in range: the weight's rows", function()
    local out = ops.embedding(i32{ { 0, 7 } }, w):totable()
    local rows = w:totable()
    assert.same(rows[1], out[1][1])
    assert.same(rows[8], out[1][2])
  end)

  it("vocabulary-parallel cross-entropy pieces refuse negative targets", function()
    fails_with("ops.xent_sumexp: targets: id -5 at position 1 is negative: not a vocabulary id",
      ops.xent_sumexp, pg.zeros{ 2, 11 }, pg.zeros{ 2 }, i32{ -5, 1 })
    fails_with("ops.xent_finish: targets: id -5 at position 1 is negative",
      ops.xent_finish, pg.zeros{ 2, 11 }, pg.zeros{ 2 }, pg.ones{ 2 }, pg.zeros{ 2 }, i32{ -5, 1 })
  end)
end)

describe("pg.ops number options", function()
  local p = pg.zeros{ 4 }
  local function adamw(o) return ops.adamw_(p, p:clone(), p:clone(), p:clone(), o) end
  it("adamw_: lr = NaN is named as NaN, not as missing", function()
    fails_with("ops.adamw_: lr=nan is not a finite number", adamw, { lr = 0 / 0, step = 1 })
    fails_with("ops.adamw_: option 'lr' is required", adamw, { step = 1 })
    fails_with("ops.adamw_: lr=-1 out of range [0, inf]", adamw, { lr = -1, step = 1 })
    fails_with("ops.adamw_: beta1=1 out of range [0, 1)", adamw, { lr = 1, beta1 = 1, step = 1 })
    fails_with("ops.adamw_: beta2=inf is not a finite number", adamw, { lr = 1, beta2 = math.huge, step = 1 })
    fails_with("ops.adamw_: eps: expected a number, got string", adamw, { lr = 1, eps = "x", step = 1 })
    fails_with("ops.adamw_: weight_decay=nan is not a finite number", adamw, { lr = 1, weight_decay = 0 / 0, step = 1 })
    fails_with("ops.adamw_: grad_scale=0 out of range", adamw, { lr = 1, grad_scale = 0, step = 1 })
  end)

  it("cross_entropy: dloss = NaN refused", function()
    fails_with("ops.cross_entropy: dloss=nan is not a finite number",
      ops.cross_entropy, pg.zeros{ 2, 11 }, i32{ 1, 1 }, { dloss = 0 / 0 })
  end)
end)
