--- The sharded tensor files' names and what their entries hold: the file
-- names (params-tp{t}-pp{p}, optim-tp{t}-pp{p}[-dp{d}]), which engines and
-- optimizers have sharded state, the slice record of an entry, and the
-- parallel layout a manifest records. A module of its own because writing
-- and loading (shards.lua), validating (manifest.lua), the manifest
-- (checkpoint.lua) and the tools all name files and layouts this one way.
local safetensors = require "pipegoose.safetensors"

local M = {}

-- ep (expert parallelism, member ep > 0 of the first expert group): the
-- experts that member holds, in a file of their own ("-ep{e}").
function M.params_file(tp, pp, ep)
  if ep and ep > 0 then return ("params-tp%d-pp%d-ep%d.safetensors"):format(tp, pp, ep) end
  return ("params-tp%d-pp%d.safetensors"):format(tp, pp)
end

function M.optim_file(tp, pp, dp, ep)
  if dp then return ("optim-tp%d-pp%d-dp%d.safetensors"):format(tp, pp, dp) end
  if ep and ep > 0 then return ("optim-tp%d-pp%d-ep%d.safetensors"):format(tp, pp, ep) end
  return ("optim-tp%d-pp%d.safetensors"):format(tp, pp)
end

--- Whether each data rank holds its own slice of the optimizer state (ZeRO
-- stages 1, 2 and 3: the same state, one file per data rank) rather than data
-- rank 0 the whole of it (zero = 0). Loading reslices either way.
function M.sharded_optimizer(zero) return zero == 1 or zero == 2 or zero == 3 end

-- The flat ranges an optimizer's shard_state holds, each with where its
-- moments start in m and v: the dense region's, then the experts' (expert
-- parallelism; empty otherwise).
function M.shard_ranges(s)
  return { { lo = s.lo, hi = s.hi, at = 0 }, { lo = s.elo or 0, hi = s.ehi or 0, at = s.hi - s.lo } }
end

--- True for engines with flat buffers (what pg.parallelize returns).
function M.is_sharded_engine(engine)
  return type(engine) == "table" and engine.c ~= nil and type(engine.parameters) == "function" and engine.ctx ~= nil
    and not engine.ctx.fake
end

local function real_optimizer(opt)
  return type(opt) == "table" and opt.c ~= nil and opt.zero ~= nil and type(opt.c) == "userdata"
end

local function copy_list(t)
  local out = {}
  for i, v in ipairs(t) do out[i] = v end
  return out
end

-- A split with one part is no split (the runtime leaves the rank's index in it).
local function norm_split(s)
  if s == nil or (s.parts or 1) <= 1 then return { dim = 0, blocks = 1, parts = 1, index = 0 } end
  return { dim = s.dim, blocks = s.blocks, parts = s.parts, index = s.index, sizes = s.sizes and copy_list(s.sizes) }
end

-- What a file entry holds: local elements [lo, hi) (0-based, row-major) of
-- the shard of a tensor of full_shape that split describes (dim 1-based, 0:
-- not split; the dimension is seen as `blocks` blocks, equal or of `sizes`
-- rows, each cut into `parts` pieces, and the shard holds piece `index` of
-- every block).

local function slice_of(p, lo, hi)
  return {
    full_shape = copy_list(p.full_shape), shape = copy_list(p.shape), split = norm_split(p.split),
    lo = lo, hi = hi,
    valid_rows = (p.valid_rows and p.valid_rows >= 0) and p.valid_rows or nil,
    tied_copy = p.tied_copy or false, replicated = p.replicated or false,
  }
end

--- The parallel layout of the trainer's engine and optimizer.
function M.layout(trainer)
  local engine, opt, ctx = trainer.engine, trainer.optimizer, trainer.ctx
  local l = { tensor = 1, pipeline = 1, data = 1, expert = 1, zero = opt and opt.zero or 0,
              world_size = trainer.state.world_size, micro_batches = engine.micro_batches, schedule = engine.schedule,
              virtual_stages = engine.virtual_stages or 1 }
  if ctx and ctx.sizes then
    local s = ctx:sizes()
    l.tensor, l.pipeline, l.data, l.expert = s.tensor, s.pipeline, s.data, s.expert or 1
    if (s.context or 1) > 1 then l.context = s.context end -- only when used: plain manifests read as before
  elseif ctx then
    l.data = ctx:world_size("data")
  end
  if type(engine.partition) == "function" then
    l.stages = {}
    for i, s in ipairs(engine:partition()) do
      l.stages[i] = { first = s.first, last = s.last, modules = copy_list(s.modules) }
    end
  end
  return l
end

-- virtual_stages and expert only when they are used, so that messages about
-- plain layouts read as they always have.
local function describe_layout(l)
  local virtual = (l.virtual_stages or 1) > 1 and (" (virtual_stages=%d)"):format(l.virtual_stages) or ""
  local ep = (l.expert or 1) > 1 and (" expert=%d"):format(l.expert) or ""
  local cp = (l.context or 1) > 1 and (" context=%d"):format(l.context) or ""
  return ("tensor=%d%s pipeline=%d%s data=%d%s zero=%d"):format(l.tensor or 1, cp, l.pipeline or 1, virtual,
    l.data or 1, ep, l.zero or 0)
end

M.real_optimizer = real_optimizer
M.norm_split = norm_split
M.slice_of = slice_of
M.describe_layout = describe_layout

return M
