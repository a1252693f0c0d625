--- Learning-rate schedules: pg.lr.constant, pg.lr.linear{...}, pg.lr.cosine{...}.
--
-- A schedule is any function `schedule(step, info) -> lr`. The Trainer calls
-- it once per optimizer step, before the step's first batch, with
--   step  the 1-based number of the step about to be taken (= trainer.state.step + 1;
--         after the step completes, state.step equals it), and
--   info  { base_lr = the optimizer's lr when fit started (kept in checkpoints),
--           total_steps = max_steps, or an estimate from max_epochs (may be nil) }.
-- Plain user functions `function(step) return ... end` may ignore `info`.
--
-- Warmup is linear: step n <= warmup gets base_lr * n / warmup, so the first
-- step uses base_lr / warmup and step `warmup` uses base_lr exactly.
local M = {}

local opt = require "pipegoose.options"

-- The options of every schedule; each schedule knows a subset (`known`).
local OPTIONS = {
  lr = opt.number{ min = 0 }, min_lr = opt.number{ min = 0 },
  warmup = opt.integer{ min = 0, what = "a whole number of steps >= 0" },
  total = opt.integer{ min = 1, what = "a whole number of steps >= 1" },
}

-- Errors name the user's line that called pg.lr.<name>{...} (check_options <- __call <- the user).
local function check_options(name, opts, known)
  local schema = {}
  for k in pairs(known) do schema[k] = OPTIONS[k] end
  local o = opt.check("pg.lr." .. name, opts, schema, { level = 3 })
  if o.total and o.total <= (o.warmup or 0) then
    error(("pg.lr.%s: total=%s must be greater than warmup=%s"):format(name, tostring(o.total),
      tostring(o.warmup or 0)), 3)
  end
  return o
end

local function base_of(name, cfg, info)
  local base = cfg.lr or (info and info.base_lr)
  if type(base) ~= "number" then
    error(("pg.lr.%s: no base learning rate (give lr=, or an optimizer whose get_lr() gives one)"):format(name), 3)
  end
  return base
end

-- Each schedule is a callable table: `pg.lr.cosine{...}` configures one, and
-- `pg.lr.constant` (not called) can be passed as a schedule directly.
local function schedule(name, known, build)
  return setmetatable({}, {
    __name = "pg.lr." .. name,
    __tostring = function() return "pg.lr." .. name end,
    __call = function(_, a, b)
      if type(a) == "number" then return build({})(a, b) end
      return build(check_options(name, a, known))
    end,
  })
end

--- The optimizer's lr (or lr=) at every step.
M.constant = schedule("constant", { lr = true }, function(cfg)
  return function(_, info) return base_of("constant", cfg, info) end
end)

-- Linear warmup over cfg.warmup steps; then, from base_lr down to min_lr,
-- `decay(base, min_lr, progress)` with progress 0 → 1 between the end of
-- warmup and step `total` (cfg.total, else the trainer's total_steps);
-- min_lr held after. With no total known: `no_total(base)`.
local function warmup_then(name, cfg, decay, no_total)
  local warmup, min_lr = cfg.warmup or 0, cfg.min_lr or 0
  return function(step, info)
    local base = base_of(name, cfg, info)
    if step <= warmup then return base * step / warmup end
    local total = cfg.total or (info and info.total_steps)
    if not total then return no_total(base) end
    if step >= total or total <= warmup then return min_lr end
    return decay(base, min_lr, (step - warmup) / (total - warmup))
  end
end

--- Linear warmup over `warmup` steps, then linear decay to `min_lr` (default
-- 0) reached at step `total` (default: the trainer's total_steps) and held
-- after. With no total known, the rate stays at base_lr after warmup.
M.linear = schedule("linear", { lr = true, warmup = true, min_lr = true, total = true }, function(cfg)
  return warmup_then("linear", cfg, function(base, min_lr, p) return base + (min_lr - base) * p end,
    function(base) return base end)
end)

--- Linear warmup over `warmup` steps, then half a cosine from base_lr down to
-- `min_lr` (default 0), reached exactly at step `total` (default: the
-- trainer's total_steps) and held after.
M.cosine = schedule("cosine", { lr = true, warmup = true, min_lr = true, total = true }, function(cfg)
  return warmup_then("cosine", cfg,
    function(base, min_lr, p) return min_lr + (base - min_lr) * 0.5 * (1 + math.cos(math.pi * p)) end,
    function() error("pg.lr.cosine: needs a horizon: give total= or the trainer's max_steps", 3) end)
end)

return M
