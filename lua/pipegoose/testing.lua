--- pg.testing: plain-Lua stand-ins for the engine, optimizer and token data
-- (the interfaces of docs/DESIGN.md), so that the Trainer and callbacks run
-- under busted with no MPI and no model.
--
--   fake_engine{dim=4, vocab=256, seq_len=16, seed=1, ctx=, rank=, world_size=,
--               tensors=false, nan_at={...}, inf_at={...}, eval_loss=fn}
--   fake_optimizer(engine, {lr=0.5, momentum=0, weight_decay=0})
--   fake_data{batches=4, batch=2, seq_len=16, vocab=256, seed=0, ctx=,
--             tensors=false, unknown_length=false}
--
-- The engine's loss is a quadratic in its parameter vector w:
--   loss = 0.5 * mean_i (w_i - c_i)^2,  c_i = 0.5*sin(i) + offset(batch)
-- where offset depends on the batch's token ids (so batches differ, and a run
-- that sees other batches gives other losses), in [-0.1, 0.1). Gradient
-- descent on w lowers it; everything is deterministic.
--
-- With ctx= (a real pg.ParallelContext) the engine averages loss and
-- gradients over the data group with one all_reduce, like a data-parallel
-- engine, so the loss is the same on every rank; fake_data{ctx=} gives each
-- data rank its own rows of the global batch.
local M = {}

-- Unknown keys are errors naming the closest known one (pipegoose.options);
-- the fakes take any values, as the tests that use them decide.
local function check_options(what, opts, known)
  local schema = {}
  for k in pairs(known) do schema[k] = "any" end
  return require("pipegoose.options").check(what, opts, schema, { level = 3 })
end

local function set_of(list)
  local s = {}
  for _, v in ipairs(list or {}) do s[v] = true end
  return s
end

local function core()
  return require "pipegoose.core"
end

-- A 64-bit mix of integers (pipegoose.rng's splitmix64).
local mix = require("pipegoose.rng").mix
M.mix = mix

--- Token ids of inputs as nested Lua tables (inputs: tensor or tables).
local function ids_of(inputs)
  if type(inputs) == "table" then return inputs end
  return inputs:totable()
end

local function sum_ids(inputs)
  if type(inputs) ~= "table" then return math.tointeger(inputs:sum()) or math.floor(inputs:sum()) end
  local s = 0
  for _, row in ipairs(inputs) do
    if type(row) == "table" then
      for _, v in ipairs(row) do s = s + v end
    else
      s = s + row
    end
  end
  return s
end

------------------------------------------------------------------------------
-- A fake parallel context (rank bookkeeping only, no communication) for
-- tests of rank-dependent behaviour without MPI: the trainer and checkpoints
-- skip collectives for it (`fake = true`); simulate other ranks' flags with
-- the trainer's `combine` option.

function M.fake_context(opts)
  opts = check_options("pg.testing.fake_context", opts, { rank = true, world_size = true })
  local rank, world = opts.rank or 0, opts.world_size or 1
  return {
    fake = true,
    rank = function() return rank end,
    world_size = function(_, mode) return (mode == nil or mode == "global" or mode == "data") and world or 1 end,
    local_rank = function(_, mode) return (mode == nil or mode == "global" or mode == "data") and rank or 0 end,
  }
end

------------------------------------------------------------------------------
-- Engine

local Engine = {}
Engine.__index = Engine
Engine.__name = "FakeEngine"

function M.fake_engine(opts)
  opts = check_options("pg.testing.fake_engine", opts, {
    dim = true, vocab = true, seq_len = true, seed = true, ctx = true, rank = true, world_size = true,
    tensors = true, nan_at = true, inf_at = true, eval_loss = true, micro_batches = true,
  })
  local dim = opts.dim or 4
  local seed = opts.seed or 1
  local self = setmetatable({}, Engine)
  self.ctx = opts.ctx
  if self.ctx == nil and (opts.rank or opts.world_size) then
    self.ctx = M.fake_context{ rank = opts.rank, world_size = opts.world_size }
  end
  self.config = { vocab = opts.vocab or 256, seq_len = opts.seq_len or 16, dim = dim }
  self.micro_batches = opts.micro_batches or 1
  self.tensors = opts.tensors or false
  self.nan_at, self.inf_at = set_of(opts.nan_at), set_of(opts.inf_at)
  self.eval_loss = opts.eval_loss
  self.w, self.g, self.target = {}, {}, {}
  for i = 1, dim do
    self.w[i] = 1 + 0.5 * i + 0.1 * (seed % 5)
    self.g[i] = 0.0
    self.target[i] = 0.5 * math.sin(i)
  end
  -- calls made, by method (state_dict keeps them: nan_at counts forward_backward calls)
  self.calls = { forward_backward = 0, loss = 0, forward = 0, zero_grad = 0 }
  self.grad_scales = {} -- grad_scale of every forward_backward call, in order
  self.syncs = {}       -- and its sync flag (true when not given)
  return self
end

-- The data group's all_reduce (avg) of a list of numbers, when there is a real context.
function Engine:_average(values)
  local ctx = self.ctx
  if not ctx or ctx.fake or ctx:world_size("data") <= 1 then return values end
  local t = core().tensor(values)
  core().dist.all_reduce(t, { ctx = ctx, group = "data", op = "avg" })
  return t:totable()
end

function Engine:_offset(inputs)
  return ((sum_ids(inputs) % 101) / 101 - 0.5) * 0.2
end

-- loss and gradient for one batch (this rank's rows), before averaging.
function Engine:_loss_grad(inputs)
  local off = self:_offset(inputs)
  local dim = #self.w
  local loss, grad = 0, {}
  for i = 1, dim do
    local d = self.w[i] - (self.target[i] + off)
    loss = loss + 0.5 * d * d / dim
    grad[i] = d / dim
  end
  return loss, grad
end

local FB_KEYS = { grad_scale = true, sync = true } -- sync: the real engine defers cross-rank reductions

function Engine:forward_backward(inputs, targets, opts)
  if inputs == nil or targets == nil then error("fake_engine:forward_backward: needs inputs and targets", 2) end
  local scale = 1
  if opts ~= nil then
    check_options("fake_engine:forward_backward", opts, FB_KEYS)
    scale = opts.grad_scale or 1
  end
  self.calls.forward_backward = self.calls.forward_backward + 1
  self.grad_scales[#self.grad_scales + 1] = scale
  self.syncs[#self.syncs + 1] = not (opts and opts.sync == false)
  local n = self.calls.forward_backward
  local loss, grad = self:_loss_grad(inputs)
  local values = { loss }
  for i = 1, #grad do values[i + 1] = grad[i] end
  values = self:_average(values)
  loss = values[1]
  local bad = self.nan_at[n] and (0 / 0) or (self.inf_at[n] and math.huge) or nil
  if bad then loss = bad end
  for i = 1, #self.g do self.g[i] = self.g[i] + scale * (bad or values[i + 1]) end
  return loss
end

-- as the real engine's: how many forward_backward passes ran
function Engine:backward_passes() return self.calls.forward_backward end

function Engine:loss(inputs, targets)
  if inputs == nil or targets == nil then error("fake_engine:loss: needs inputs and targets", 2) end
  self.calls.loss = self.calls.loss + 1
  if self.eval_loss then return self.eval_loss(self, inputs, targets, self.calls.loss) end
  local loss = self:_loss_grad(inputs)
  return self:_average({ loss })[1]
end

--- Logits [B, T, vocab]: a fixed "next byte" model that strongly prefers
-- (id + 1) % vocab after each id (logit 10, others 0), so greedy decoding of
-- "abc" continues "defg...". Nested tables, or a float32 tensor with tensors=true.
function Engine:forward(inputs)
  self.calls.forward = self.calls.forward + 1
  local ids = ids_of(inputs)
  local V = self.config.vocab
  local out = {}
  for b, row in ipairs(ids) do
    out[b] = {}
    for t, id in ipairs(row) do
      local l = {}
      for v = 1, V do l[v] = 0.0 end
      l[(math.tointeger(id) + 1) % V + 1] = 10.0
      out[b][t] = l
    end
  end
  if self.tensors then return core().tensor(out) end
  return out
end

function Engine:zero_grad()
  self.calls.zero_grad = self.calls.zero_grad + 1
  for i = 1, #self.g do self.g[i] = 0.0 end
end

function Engine:parameters() return { { name = "w", shape = { #self.w }, tensor = self.w } } end
function Engine:grads() return { { name = "w", shape = { #self.g }, tensor = self.g } } end
function Engine:num_parameters() return #self.w end

function Engine:memory()
  return { params_bytes = 4 * #self.w, grads_bytes = 4 * #self.g, activation_bytes = 0, peak_activation_bytes = 0 }
end

function Engine:state_dict()
  local w = {}
  for i, v in ipairs(self.w) do w[i] = v end
  return { w = w, forward_backward_calls = self.calls.forward_backward }
end

function Engine:load_state_dict(sd)
  if type(sd) ~= "table" or type(sd.w) ~= "table" then error("fake_engine:load_state_dict: expected {w = {...}}", 2) end
  if #sd.w ~= #self.w then
    error(("fake_engine:load_state_dict: state has %d parameters, this engine %d"):format(#sd.w, #self.w), 2)
  end
  for i, v in ipairs(sd.w) do self.w[i] = v end
  self.calls.forward_backward = sd.forward_backward_calls or 0
end

------------------------------------------------------------------------------
-- Optimizer: SGD with optional momentum and decoupled weight decay on the
-- fake engine's w.

local Optimizer = {}
Optimizer.__index = Optimizer
Optimizer.__name = "FakeOptimizer"

function M.fake_optimizer(engine, opts)
  if type(engine) ~= "table" or type(engine.w) ~= "table" then
    error("pg.testing.fake_optimizer: expects a pg.testing.fake_engine", 2)
  end
  opts = check_options("pg.testing.fake_optimizer", opts, { lr = true, momentum = true, weight_decay = true })
  local self = setmetatable({}, Optimizer)
  self.engine = engine
  self.lr = opts.lr or 0.5
  self.momentum = opts.momentum or 0
  self.weight_decay = opts.weight_decay or 0
  self.m = {}
  for i = 1, #engine.w do self.m[i] = 0.0 end
  self.steps = 0
  self.calls = { step = 0, zero_grad = 0, clip_grad_norm = 0, grad_norm = 0, set_lr = 0 }
  self.lrs = {} -- every set_lr value, in order
  return self
end

function Optimizer:step()
  self.calls.step = self.calls.step + 1
  local w, g = self.engine.w, self.engine.g
  for i = 1, #w do
    self.m[i] = self.momentum * self.m[i] + g[i]
    w[i] = w[i] - self.lr * (self.m[i] + self.weight_decay * w[i])
  end
  self.steps = self.steps + 1
end

function Optimizer:zero_grad()
  self.calls.zero_grad = self.calls.zero_grad + 1
  self.engine:zero_grad()
end

function Optimizer:_norm()
  local s = 0
  for _, v in ipairs(self.engine.g) do s = s + v * v end
  return math.sqrt(s)
end

function Optimizer:grad_norm()
  self.calls.grad_norm = self.calls.grad_norm + 1
  return self:_norm()
end

function Optimizer:clip_grad_norm(max)
  self.calls.clip_grad_norm = self.calls.clip_grad_norm + 1
  local norm = self:_norm()
  if norm > max then
    local s = max / norm
    local g = self.engine.g
    for i = 1, #g do g[i] = g[i] * s end
  end
  return norm
end

function Optimizer:set_lr(lr)
  self.calls.set_lr = self.calls.set_lr + 1
  self.lr = lr
  self.lrs[#self.lrs + 1] = lr
end

function Optimizer:get_lr() return self.lr end

function Optimizer:state_dict()
  local m = {}
  for i, v in ipairs(self.m) do m[i] = v end
  return { lr = self.lr, steps = self.steps, m = m }
end

function Optimizer:load_state_dict(sd)
  if type(sd) ~= "table" or type(sd.m) ~= "table" then error("fake_optimizer:load_state_dict: expected {m = {...}}", 2) end
  self.lr, self.steps = sd.lr, sd.steps
  for i, v in ipairs(sd.m) do self.m[i] = v end
end

function Optimizer:memory() return { state_bytes = 4 * #self.m } end

------------------------------------------------------------------------------
-- Data

local Data = {}
Data.__index = Data
Data.__name = "FakeData"

function M.fake_data(opts)
  opts = check_options("pg.testing.fake_data", opts, {
    batches = true, batch = true, seq_len = true, vocab = true, seed = true, ctx = true, tensors = true,
    unknown_length = true,
  })
  local self = setmetatable({}, Data)
  self.batches = opts.batches or 4
  self.batch = opts.batch or 2
  self.seq_len = opts.seq_len or 16
  self.vocab = opts.vocab or 256
  self.seed = opts.seed or 0
  self.ctx = opts.ctx
  self.tensors = opts.tensors or false
  local D = self.ctx and self.ctx:world_size("data") or 1
  if self.batch % D ~= 0 then
    error(("pg.testing.fake_data: batch=%d is not divisible by the %d data ranks"):format(self.batch, D), 2)
  end
  self.rows = self.batch // D
  self.first_row = (self.ctx and self.ctx:local_rank("data") or 0) * self.rows
  self.epoch_ = 0 -- 0-based epoch
  self.pos = 0    -- batches taken in this epoch
  if opts.unknown_length then
    -- a data source that cannot tell its length: hide the method
    self.batches_per_epoch = false
  end
  return self
end

function Data:_make(epoch, index)
  local inputs, targets = {}, {}
  for r = 1, self.rows do
    local row = self.first_row + r
    local ids = {}
    for c = 1, self.seq_len + 1 do
      ids[c] = (mix(self.seed, epoch, index, row, c) >> 8) % self.vocab
    end
    inputs[r], targets[r] = {}, {}
    for c = 1, self.seq_len do
      inputs[r][c] = ids[c]
      targets[r][c] = ids[c + 1]
    end
  end
  if self.tensors then
    local C = core()
    return C.tensor(inputs, { dtype = "int32" }), C.tensor(targets, { dtype = "int32" })
  end
  return inputs, targets
end

function Data:next_batch()
  if self.pos >= self.batches then
    self.epoch_ = self.epoch_ + 1
    self.pos = 0
    return nil
  end
  self.pos = self.pos + 1
  return self:_make(self.epoch_, self.pos)
end

function Data:reset() self.pos = 0 end
function Data:batches_per_epoch() return self.batches end
function Data:epoch() return self.epoch_ end
function Data:tokens_per_batch() return self.batch * self.seq_len end
function Data:state_dict() return { epoch = self.epoch_, pos = self.pos } end

function Data:load_state_dict(sd)
  if type(sd) ~= "table" then error("fake_data:load_state_dict: expected a table", 2) end
  self.epoch_, self.pos = sd.epoch, sd.pos
end

------------------------------------------------------------------------------
-- Test helpers

--- An `out` for pg.Trainer{out=} that keeps what was written.
function M.capture()
  local buf = {}
  return {
    write = function(self, ...)
      for i = 1, select("#", ...) do buf[#buf + 1] = tostring((select(i, ...))) end
      return self
    end,
    flush = function() end,
    text = function() return table.concat(buf) end,
    lines = function()
      local out = {}
      for line in (table.concat(buf) .. "\n"):gmatch("(.-)\n") do out[#out + 1] = line end
      if out[#out] == "" then out[#out] = nil end
      return out
    end,
  }
end

--- A clock for pg.Trainer{clock=} / Timer{clock=}: returns `t` and advances
-- it by `dt` per call (or set c.t yourself).
function M.manual_clock(t, dt)
  local c = { t = t or 0, dt = dt or 0 }
  setmetatable(c, { __call = function(self)
    local now = self.t
    self.t = self.t + self.dt
    return now
  end })
  return c
end

return M
