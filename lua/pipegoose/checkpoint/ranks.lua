--- Ranks and collectives for saving and loading: whether a trainer runs on
-- several communicating ranks, a barrier, rank 0's pid on every rank, every
-- rank's string, and agreement on a problem (every rank raises the same
-- one). A module of its own because saving (checkpoint.lua) and loading
-- (shards.lua, checkpoint.lua) both need it, and the files that run on one
-- process (manifest.lua, tools.lua) do not.
local fs = require "pipegoose.checkpoint.fs"

local M = {}

local function multi_rank(trainer)
  -- pg.testing.fake_context has ranks but no communication
  return trainer.ctx ~= nil and not trainer.ctx.fake and trainer.state.world_size > 1
end

local function barrier(trainer)
  if multi_rank(trainer) then trainer.ctx:barrier() end
end

-- Rank 0's pid on every rank, so that all ranks write into the same
-- temporary directory.
local function agreed_pid(trainer)
  local pid = fs.getpid()
  if not multi_rank(trainer) then return pid end
  local core = require "pipegoose.core"
  local t = core.tensor({ pid }, { dtype = "int32" })
  core.dist.broadcast(t, { ctx = trainer.ctx, src = 0 })
  return math.tointeger(t:get(1))
end

--- Every rank's string, in global rank order (collective over the global group).
function M.all_gather_strings(ctx, s)
  local core = require "pipegoose.core"
  local lens = core.dist.all_gather(core.tensor({ #s }, { dtype = "int32" }), { ctx = ctx }):totable()
  local longest = 0
  for i, n in ipairs(lens) do
    lens[i] = math.tointeger(n)
    if lens[i] > longest then longest = lens[i] end
  end
  local words = (longest + 3) // 4
  local out = {}
  if words == 0 then
    for i = 1, #lens do out[i] = "" end
    return out
  end
  local padded = s .. string.rep("\0", words * 4 - #s)
  local ints = {}
  for i = 1, words do ints[i] = string.unpack("<i4", padded, 4 * i - 3) end
  local all = core.dist.all_gather(core.tensor(ints, { dtype = "int32" }), { ctx = ctx }):totable()
  for r = 1, #lens do
    local buf = {}
    for i = 1, words do buf[i] = string.pack("<i4", math.tointeger(all[(r - 1) * words + i])) end
    out[r] = table.concat(buf):sub(1, lens[r])
  end
  return out
end

--- When any rank has a problem (a message), every rank raises the first
-- one (by rank), so that no rank goes on into a collective the others left.
local function agree_error(trainer, err)
  if multi_rank(trainer) then
    for _, e in ipairs(M.all_gather_strings(trainer.ctx, err or "")) do
      if e ~= "" then error(e, 0) end
    end
  elseif err then
    error(err, 0)
  end
end
M.agree_error = agree_error

M.multi_rank = multi_rank
M.barrier = barrier
M.agreed_pid = agreed_pid

return M
