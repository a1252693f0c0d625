-- What the examples' command lines share (lua-argparse): integer and number
-- options, and the parallel layout every example takes. An example loads it
-- from its own directory:
--   local o = dofile((arg[0]:match("^(.*/)") or "./") .. "options.lua")(parser)
--   o.int("--steps", 300, "Optimizer steps.")
--   o.layout()   -- --tensor, --pipeline, --data, --micro-batches
--   o.resume_path(resume, checkpoints) -- --resume=auto|last|DIR as fit's resume= (nil: a fresh start)
--   o.test_kill(pg) -- PG_TEST_KILL_AT_STEP's callback, or nil (scripts/launch.sh's spec)
--   o.test_gate(pg) -- PG_TEST_GATE's callback, or nil (the two-host spec's crashes)
-- Run by itself (pglua examples/options.lua --help) it says what it is and how it is used.
require "pipegoose.library_file"("local o = dofile(here .. \"options.lua\")(parser)",
  "options.lua is not a script: the examples load it to add the options they share (integers, numbers, "
  .. "the parallel layout) to their lua-argparse parser.")
return function(p)
  local o = {}
  function o.to_int(s) return math.tointeger(tonumber(s)) end
  -- min: the least value the option takes (its error names the option, not a later consumer of the number)
  function o.int(name, default, help, min)
    p:option(name, help, default and tostring(default)):convert(function(s)
      local v = o.to_int(s)
      if v == nil then return nil, ("%s must be an integer, got '%s'"):format(name, s) end
      if min and v < min then return nil, ("%s must be at least %d, got %d"):format(name, min, v) end
      return v
    end)
  end
  function o.num(name, default, help) p:option(name, help, default and tostring(default)):convert(tonumber) end
  function o.layout()
    o.int("--tensor", 1, "Tensor-parallel size.")
    o.int("--pipeline", 1, "Pipeline stages.")
    o.int("--data", nil, "Data-parallel size (default: world size / (tensor x pipeline)).")
    o.int("--micro-batches", 1, "Micro-batches per step.")
  end
  --- fit's resume= for --resume: "auto" is the newest checkpoint under `checkpoints` that verifies
  -- (pipegoose.checkpoint's validate: every file as loading checks it), nil when there is none (a fresh
  -- start: what scripts/launch.sh relaunches with); anything else is passed on as given.
  function o.resume_path(resume, checkpoints)
    if resume ~= "auto" then return resume end
    local ckpt = require "pipegoose.checkpoint"
    local names = {}
    for _, name in ipairs(ckpt.fs.is_dir(checkpoints) and ckpt.fs.list(checkpoints) or {}) do
      if name:match("^step%-%d+$") then names[#names + 1] = name end
    end
    table.sort(names, function(a, b) return a > b end) -- step-%08d: the newest first
    for _, name in ipairs(names) do
      local dir = checkpoints .. "/" .. name
      local problems = ckpt.validate(dir)
      if #problems == 0 then return dir end
      io.stderr:write(("--resume=auto: %s does not verify (%s); trying an older one\n"):format(dir, problems[1]))
    end
    return nil
  end

  --- Test hook of scripts/launch.sh's spec: PG_TEST_KILL_AT_STEP=S1,S2,... with PG_TEST_KILL_RANK=R makes
  -- world rank R SIGKILL itself after step S<k + 1> of the k-th relaunch (PG_LAUNCH_RESTART, set by
  -- launch.sh; 0 at first), once its checkpoint of that step is written, as a host that dies would.
  function o.test_kill(pg)
    local spec = os.getenv("PG_TEST_KILL_AT_STEP")
    if not spec or spec == "" then return nil end
    local steps = {}
    for s in (spec .. ","):gmatch("([^,]*),") do
      steps[#steps + 1] = math.tointeger(tonumber(s)) or error(("PG_TEST_KILL_AT_STEP: expected steps "
        .. "separated by commas, got '%s'"):format(spec), 0)
    end
    local rank = math.tointeger(tonumber(os.getenv("PG_TEST_KILL_RANK") or "0"))
    local attempt = math.tointeger(tonumber(os.getenv("PG_LAUNCH_RESTART") or "0"))
    if not rank or not attempt then error("PG_TEST_KILL_RANK and PG_LAUNCH_RESTART must be integers", 0) end
    local at = steps[attempt + 1]
    if not at or pg.world_rank() ~= rank then return nil end
    return pg.callbacks.LambdaCallback{ name = "TestKill", on_train_batch_end = function(t, out)
      if out.step_end and t.state.step == at then
        io.stderr:write(("PG_TEST_KILL_AT_STEP: rank %d kills itself after step %d\n"):format(rank, at))
        io.stderr:flush()
        os.execute("kill -9 " .. require("pipegoose.checkpoint").getpid())
      end
    end }
  end
  --- Test hook of the two-host spec (spec/unit/two_hosts_spec.lua): PG_TEST_GATE=S:FILE makes every rank wait
  -- after step S, once its checkpoint of that step is written, until FILE exists, so that the spec takes a host
  -- away at a known step however fast or slow the steps are (no race between a poll and the training).
  function o.test_gate(pg)
    local spec = os.getenv("PG_TEST_GATE")
    if not spec or spec == "" then return nil end
    local s, file = spec:match("^(%d+):(.+)$")
    local at = math.tointeger(tonumber(s))
    if not at then error(("PG_TEST_GATE: expected STEP:FILE, got '%s'"):format(spec), 0) end
    local fs = require("pipegoose.checkpoint").fs
    -- at the next step's start: the trainer saves a step's checkpoint after its on_train_batch_end
    return pg.callbacks.LambdaCallback{ name = "TestGate", on_train_batch_start = function(t)
      if t.state.step == at then
        while not fs.exists(file) do os.execute("sleep 0.05") end
      end
    end }
  end
  return o
end
