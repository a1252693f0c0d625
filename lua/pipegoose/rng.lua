--- pipegoose.rng: the one splitmix64 of the Lua side (the C side's is
-- src/runtime/pg_rng.c, for parameter init and data order). Pure Lua, so that callback
-- tests without MPI or the C module can use it; 64-bit integer arithmetic
-- wraps in Lua 5.4, as splitmix64 wants.
local M = {}

local GOLDEN = 0x9E3779B97F4A7C15

--- splitmix64's finaliser of z.
local function finalise(z)
  z = (z ~ (z >> 30)) * 0xBF58476D1CE4E5B9
  z = (z ~ (z >> 27)) * 0x94D049BB133111EB
  return z ~ (z >> 31)
end

--- One step of the generator: the next state and a 64-bit value.
function M.step(state)
  state = state + GOLDEN
  return state, finalise(state)
end

--- The next state and a uniform number in [0, 1) (53 random bits).
function M.uniform(state)
  local z
  state, z = M.step(state)
  return state, (z >> 11) * (1.0 / 9007199254740992.0)
end

--- A generator closure: each call returns the next uniform number in [0, 1).
function M.generator(seed)
  local state = seed or 0
  return function()
    local u
    state, u = M.uniform(state)
    return u
  end
end

--- A 64-bit hash of integers (splitmix64 steps over each), for keys derived from several numbers.
function M.mix(...)
  local h = GOLDEN
  for i = 1, select("#", ...) do h = finalise(h ~ select(i, ...)) end
  return h
end

return M
