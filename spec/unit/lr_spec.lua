-- Learning-rate schedules at chosen steps. Steps are 1-based (the step about
-- to be taken). Values are compared with an absolute tolerance of 1e-12.
local pg = require "pipegoose"

local TOL = 1e-12
local info = { base_lr = 1.0, total_steps = 110 }

describe("pg.lr", function()
  it("constant gives the base lr, used bare or configured", function()
    assert.equal(1.0, pg.lr.constant(1, info))
    assert.equal(1.0, pg.lr.constant(500, info))
    assert.equal(0.3, pg.lr.constant{ lr = 0.3 }(7, info))
  end)

  it("linear warms up linearly then decays linearly to min_lr at total", function()
    local s = pg.lr.linear{ warmup = 10, min_lr = 0.1 }
    assert.near(0.1, s(1, info), TOL)   -- first step: base / warmup
    assert.near(0.5, s(5, info), TOL)
    assert.near(1.0, s(10, info), TOL)  -- end of warmup: the base lr
    assert.near(0.55, s(60, info), TOL) -- halfway through the decay
    assert.near(0.1, s(110, info), TOL) -- total: min_lr
    assert.near(0.1, s(200, info), TOL) -- and held after
    -- without a horizon it stays at the base lr after warmup
    assert.near(1.0, s(300, { base_lr = 1.0 }), TOL)
    -- total= overrides the trainer's total_steps
    assert.near(0.0, pg.lr.linear{ total = 20 }(20, info), TOL)
  end)

  it("cosine warms up then follows half a cosine to min_lr at total", function()
    local s = pg.lr.cosine{ warmup = 10, min_lr = 0.1 }
    assert.near(0.1, s(1, info), TOL)
    assert.near(1.0, s(10, info), TOL)
    -- a quarter into the decay: min + (base - min) * (1 + cos(pi/4)) / 2
    assert.near(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), s(35, info), TOL)
    assert.near(0.55, s(60, info), TOL) -- halfway: the mean of base and min
    assert.near(0.1, s(110, info), TOL) -- the end is min_lr exactly
    assert.equal(0.1, s(110, info))
    assert.equal(0.1, s(1000, info))
    -- no warmup: the first step is already on the cosine
    local c = pg.lr.cosine{ total = 100, lr = 2.0 }
    assert.near(2.0 * 0.5 * (1 + math.cos(math.pi / 100)), c(1, {}), TOL)
  end)

  it("is monotone through warmup and decay", function()
    local s = pg.lr.cosine{ warmup = 5, min_lr = 0.01 }
    for step = 2, 5 do assert.is_true(s(step, info) > s(step - 1, info), "warmup step " .. step) end
    for step = 6, 110 do assert.is_true(s(step, info) < s(step - 1, info), "decay step " .. step) end
  end)

  it("rejects bad options and a missing horizon with messages", function()
    assert.has_error(function() pg.lr.cosine{ warmup = 1.5 } end,
      "pg.lr.cosine: warmup must be a whole number of steps >= 0, got 1.5")
    assert.has_error(function() pg.lr.linear{ warmpu = 3 } end,
      "pg.lr.linear: unknown option 'warmpu' (did you mean 'warmup'?)")
    assert.has_error(function() pg.lr.cosine{ min_lr = -1 } end,
      "pg.lr.cosine: min_lr must be a finite number >= 0, got -1")
    assert.has_error(function() pg.lr.cosine{ lr = math.huge } end,
      "pg.lr.cosine: lr must be a finite number >= 0, got inf")
    assert.has_error(function() pg.lr.linear{ lr = 0 / 0 } end, "pg.lr.linear: lr must be a finite number >= 0, got nan")
    assert.has_error(function() pg.lr.linear{ total = "10" } end,
      "pg.lr.linear: total must be a whole number of steps >= 1, got '10'")
    assert.has_error(function() pg.lr.constant{ warmup = 3 } end, "pg.lr.constant: unknown option 'warmup' (known: lr)")
    assert.has_error(function() pg.lr.cosine("fast") end, "pg.lr.cosine: expects a table of options, got 'fast'")
    assert.equal(0.25, pg.lr.linear{ warmup = 4.0 }(1, info)) -- 4.0 steps are 4 steps
    assert.has_error(function() pg.lr.cosine{ warmup = 10, total = 5 } end,
      "pg.lr.cosine: total=5 must be greater than warmup=10")
    assert.has_error(function() pg.lr.cosine{}(3, { base_lr = 1 }) end,
      "pg.lr.cosine: needs a horizon: give total= or the trainer's max_steps")
    assert.has_error(function() pg.lr.constant(1, {}) end,
      "pg.lr.constant: no base learning rate (give lr=, or an optimizer whose get_lr() gives one)")
  end)

  it("drives the trainer with the optimizer's lr as base and max_steps as horizon", function()
    local engine = pg.testing.fake_engine{}
    local opt = pg.testing.fake_optimizer(engine, { lr = 0.2 })
    pg.Trainer{ engine = engine, optimizer = opt, max_steps = 4, out = pg.testing.capture(),
      lr_schedule = pg.lr.cosine{ warmup = 2, min_lr = 0.02 } }:fit(pg.testing.fake_data{})
    assert.near(0.1, opt.lrs[1], TOL)
    assert.near(0.2, opt.lrs[2], TOL)
    assert.near(0.02 + 0.18 * 0.5 * (1 + math.cos(math.pi / 2)), opt.lrs[3], TOL)
    assert.near(0.02, opt.lrs[4], TOL)
  end)
end)
