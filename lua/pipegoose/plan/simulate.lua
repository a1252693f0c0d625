--- pipegoose.plan.simulate: one pipeline step as a discrete-event simulation
-- of the real schedule action lists (pg.core.schedule, src/engine/pg_schedule.c).
--
-- Each stage runs its actions in order on its own clock:
--   forward / backward   the clock advances by the action's cost (busy time)
--   send_act / send_grad non-blocking, as in the engine: the message arrives
--                        at max(now, the link's previous arrival) + transfer;
--                        one link per direction per stage, so back-to-back
--                        sends queue instead of overlapping
--   recv_act / recv_grad blocks until the matching message has arrived
-- A stage's clock only ever depends on its own earlier actions and on
-- arrivals, so running each stage as far as it can, round-robin, until every
-- list is done gives exact event times without a global event queue. If a
-- round makes no progress the schedule deadlocks (an error; the C validator
-- rules that out for the built-in schedules).
--
-- Actions are { name, micro-batch[, chunk] }. The chunk (a model chunk of an
-- interleaved schedule) is carried into the message key and handed to the
-- cost and transfer functions, so an interleaved generator can plug in: its
-- transfer function names the destination stage of each chunk's messages.
local M = {}

local KIND = { forward = "compute", backward = "compute", send_act = "send", send_grad = "send",
  recv_act = "recv", recv_grad = "recv" }
local MSG = { send_act = 0, recv_act = 0, send_grad = 1, recv_grad = 1 }

--- Action lists of all P stages (index 1..P) of a built-in schedule.
function M.schedule_actions(name, P, Mb)
  local core = require "pipegoose.core"
  local stages = {}
  for p = 0, P - 1 do stages[p + 1] = core.schedule(name, P, Mb, p) end
  return stages
end

-- Default routing for one chunk per stage: activations go down the pipeline,
-- gradients up.
local function default_dest(stage, action)
  if action[1] == "send_act" then return stage + 1 end
  return stage - 1
end

--- Runs the simulation.
--   stages[i]       action list of stage i (1-based)
--   cost(i, a)      seconds stage i is busy running compute action a
--   transfer(i, a)  seconds send action a of stage i takes on the wire, and
--                   optionally the destination stage (default: i+1 for
--                   activations, i-1 for gradients)
-- Returns { makespan = , stages = { { finish, busy, idle, in_flight }, ... } }
-- where idle = makespan - busy (a stage waiting for others, or done early).
function M.run(stages, cost, transfer)
  local P = #stages
  local ptr, clock, busy, live, most = {}, {}, {}, {}, {}
  local link = {} -- [stage][0 | 1]: when the stage's last message on that link arrives
  for i = 1, P do
    ptr[i], clock[i], busy[i], live[i], most[i] = 1, 0, 0, 0, 0
    link[i] = { [0] = 0, [1] = 0 }
  end
  local arrival = {} -- message key -> arrival time
  local function key(kind, dest, a) return ("%d:%d:%d:%d"):format(kind, dest, a[2], a[3] or 0) end

  local remaining = 0
  for i = 1, P do remaining = remaining + #stages[i] end
  while remaining > 0 do
    local progressed = false
    for i = 1, P do
      local list = stages[i]
      while ptr[i] <= #list do
        local a = list[ptr[i]]
        local name = a[1]
        local kind = KIND[name]
        if kind == "compute" then
          local dt = cost(i, a)
          clock[i] = clock[i] + dt
          busy[i] = busy[i] + dt
          if name == "forward" then
            live[i] = live[i] + 1
            if live[i] > most[i] then most[i] = live[i] end
          else
            live[i] = live[i] - 1
          end
        elseif kind == "send" then
          local m = MSG[name]
          local dt, dest = transfer(i, a)
          dest = dest or default_dest(i, a)
          local t = math.max(clock[i], link[i][m]) + dt
          link[i][m] = t
          arrival[key(m, dest, a)] = t
        elseif kind == "recv" then
          local t = arrival[key(MSG[name], i, a)]
          if not t then break end -- blocked: the sender has not got there yet
          if t > clock[i] then clock[i] = t end
        else
          error(("simulate: stage %d action %d: unknown action '%s'"):format(i, ptr[i], tostring(name)), 0)
        end
        ptr[i] = ptr[i] + 1
        remaining = remaining - 1
        progressed = true
      end
    end
    if not progressed then
      local waiting = {}
      for i = 1, P do
        local a = stages[i][ptr[i]]
        if a then waiting[#waiting + 1] = ("stage %d at %s %d"):format(i - 1, a[1], a[2]) end
      end
      error("simulate: the schedule deadlocks (" .. table.concat(waiting, ", ") .. ")", 0)
    end
  end
  local makespan = 0
  for i = 1, P do if clock[i] > makespan then makespan = clock[i] end end
  local out = { makespan = makespan, stages = {} }
  for i = 1, P do
    out.stages[i] = { finish = clock[i], busy = busy[i], idle = makespan - busy[i], in_flight = most[i] }
  end
  return out
end

--- Idle fraction of a stage in a result: idle / makespan.
function M.idle_fraction(result, i)
  return result.stages[i].idle / result.makespan
end

return M
