--- pg.optim: AdamW over the engine's flat buffers (torch.optim.AdamW
-- semantics: decoupled weight decay, bias correction; decay only on tensors of
-- two or more dimensions), replicated (zero = 0), ZeRO-1 sharded over the
-- data group (zero = 1), or ZeRO-2 (zero = 2: the engine then keeps only this
-- rank's shard of the gradients, reduced after every micro-batch's backward,
-- also on calls with sync = false; engine:flat() gives no gradients and
-- engine:grads() refuses: shard_state().grad is the shard), or ZeRO-3
-- (zero = 3: the parameters too; every module's parameters are all-gathered
-- over the data group before its forward and backward and freed after,
-- reshard_after_forward = false keeps them from the first forward to the end
-- of the call, prefetch = false starts a module's gather only when it runs
-- (no transfer overlaps compute); engine:parameters() then has no tensors, gather_param gathers
-- one, shard_state().param is the shard; docs/DESIGN.md "ZeRO-3").
local core = require "pipegoose.core"
local opt = require "pipegoose.options"

local optim = {}

local AdamW = {}
AdamW.__index = AdamW

-- Types here; the runtime checks the values' ranges (pg_adamw_check_hparams),
-- for construction, set_lr and load_state_dict alike.
local NUMBER = opt.number{ finite = false }
local ADAMW = {
  lr = opt.number{ finite = false, default = 1e-3 }, betas = opt.list(NUMBER, { len = 2, default = { 0.9, 0.999 } }),
  eps = opt.number{ finite = false, default = 1e-8 }, weight_decay = opt.number{ finite = false, default = 0.01 },
  zero = opt.integer{ default = 0 },
  reshard_after_forward = opt.boolean{ default = true }, -- zero = 3 only
  prefetch = opt.boolean{ default = true }, -- zero = 3 only
}
local ENGINE = opt.required(opt.check_with("an engine made by pg.parallelize",
  function(e) return type(e) == "table" and type(e.c) == "userdata" end))

function optim.AdamW(engine, o)
  opt.value("AdamW", "engine", engine, ENGINE)
  -- an engine made with zero = 3 (pg.parallelize) holds shards only: its optimizer's stage unless told otherwise
  local built_sharded = engine.zero == 3 and (o == nil or o.zero == nil)
  o = opt.check("AdamW", o, ADAMW)
  if built_sharded then o.zero = 3 end
  local zero = o.zero
  if zero ~= 0 and zero ~= 1 and zero ~= 2 and zero ~= 3 then
    error(("AdamW: zero must be 0, 1, 2 or 3, got %s"):format(opt.show(zero)), 2)
  end
  for _, name in ipairs{ "prefetch", "reshard_after_forward" } do
    if o[name] == false and zero ~= 3 then
      error(("AdamW: %s is an option of zero = 3 (the parameters gathered per module), not of zero = %d")
        :format(name, zero), 2)
    end
  end
  local ok, c = pcall(core.AdamW, engine.c, { lr = o.lr, beta1 = o.betas[1], beta2 = o.betas[2], eps = o.eps,
                                              weight_decay = o.weight_decay }, zero, o.reshard_after_forward,
                                              o.prefetch)
  if not ok then error(c, 2) end
  local self = setmetatable({ c = c, engine = engine, zero = zero }, AdamW)
  engine.optimizer = self
  return self
end

-- Collective (every rank of the context): step, grad_norm, clip_grad_norm
-- (they run pending gradient reductions and sum the norm over the groups).
-- Local: the constructor, zero_grad, set_lr, get_lr, hparams, state_dict,
-- load_state_dict, memory.
function AdamW:step() self.c:step() end
function AdamW:zero_grad() self.engine:zero_grad() end
function AdamW:grad_norm() return self.c:grad_norm() end

--- Global gradient norm before clipping; the next step scales gradients by
-- max_norm / (norm + 1e-6) when the norm exceeds max_norm (torch's rule).
function AdamW:clip_grad_norm(max_norm)
  opt.value("AdamW:clip_grad_norm", "max_norm", max_norm, opt.required(NUMBER))
  local ok, norm = pcall(self.c.clip, self.c, max_norm)
  if not ok then error(norm, 2) end
  return norm
end

function AdamW:set_lr(lr)
  opt.value("AdamW:set_lr", "lr", lr, opt.required(NUMBER)) -- the runtime says which values
  local ok, err = pcall(self.c.hparams, self.c, { lr = lr })
  if not ok then error(err, 2) end
end
function AdamW:get_lr() return self.c:hparams().lr end
function AdamW:hparams() return self.c:hparams() end

--- Sets hyperparameters (any of lr, beta1, beta2, eps, weight_decay).
function AdamW:set_hparams(h)
  local ok, err = pcall(self.c.hparams, self.c, h)
  if not ok then error(err, 2) end
end

--- Sets the step count (bias correction continues from it).
local STEP = opt.required(opt.integer{ min = 0, max = math.maxinteger })
function AdamW:set_step(step)
  opt.value("AdamW:set_step", "step", step, STEP)
  local ok, err = pcall(self.c.set_step, self.c, step)
  if not ok then error(err, 2) end
end

--- This rank's shard as it lives in the optimizer: { lo, hi (0-based flat
-- slice [lo, hi)), elo, ehi (the experts' region under expert parallelism,
-- empty otherwise), step, m, v (both ranges' moments, one after the other),
-- grad } with m, v and grad views of the live moments and of the ranges'
-- gradients (writing them changes the optimizer; state_dict() gives copies).
-- Where the engine keeps the two ranges' gradients apart (zero 1's whole
-- buffer under expert parallelism) grad is [lo, hi)'s and expert_grad
-- [elo, ehi)'s.
function AdamW:shard_state()
  return self.c:state()
end

--- State of this rank's shard: which slice of the flat buffer it holds
-- (0-based [lo, hi)), the step count, hyperparameters, and copies of m and v.
function AdamW:state_dict()
  local s = self.c:state()
  local ctx = self.engine.ctx
  return {
    step = s.step, zero = self.zero, lo = s.lo, hi = s.hi, elo = s.elo, ehi = s.ehi, hparams = self.c:hparams(),
    data_rank = ctx:local_rank("data"), data = ctx:world_size("data"),
    m = s.m:clone(), v = s.v:clone(),
  }
end

function AdamW:load_state_dict(sd)
  local s = self.c:state()
  if sd.lo ~= s.lo or sd.hi ~= s.hi then
    error(("AdamW:load_state_dict: the state holds flat slice [%d, %d), this rank owns [%d, %d)"):format(
      sd.lo, sd.hi, s.lo, s.hi), 2)
  end
  -- expert parallelism: the experts' region too (absent in states saved without it: empty)
  local elo, ehi = sd.elo or s.elo, sd.ehi or s.elo
  if elo ~= s.elo or ehi ~= s.ehi then
    error(("AdamW:load_state_dict: the state holds experts' slice [%d, %d), this rank owns [%d, %d)"):format(
      elo, ehi, s.elo, s.ehi), 2)
  end
  s.m:copy_(sd.m)
  s.v:copy_(sd.v)
  self.c:set_step(sd.step)
  if sd.hparams then self.c:hparams(sd.hparams) end
end

--- Bytes of optimizer state on this rank (m and v), measured from the buffers.
function AdamW:memory()
  return { state_bytes = self.c:state_bytes() }
end

return optim
