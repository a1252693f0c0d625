-- scripts/launch.sh: a job that loses a rank restarts itself from its latest
-- verified checkpoint (examples/train_gpt.lua --resume=auto), each restart
-- logged with its cause, and ends with the parameters of a run that was never
-- interrupted, bit for bit (same layout: tensor 2 x pipeline 2 x data 2).
local pg = require "pipegoose"
local h = require "helpers"

local root = h.tmpdir()
pg.fs.mkdir_p(root)
teardown(function() h.rm(root) end)

local STEPS = 8
local function train_args(out)
  return { h.pglua, "examples/train_gpt.lua", "--train=" .. root .. "/train.bin", "--val=" .. root .. "/val.bin",
    "--steps=" .. STEPS, "--batch=4", "--seq-len=8", "--dim=16", "--layers=2", "--heads=2", "--ckpt-every=1",
    "--eval-every=1000", "--sample=0", "--log-every=1", "--warmup=2", "--tensor=2", "--pipeline=2",
    "--micro-batches=2", "--out=" .. out, "--resume=auto" }
end

local function launch(env, launcher_args, out, np)
  local cmd = { "scripts/launch.sh" }
  for _, a in ipairs(launcher_args) do cmd[#cmd + 1] = a end
  cmd[#cmd + 1] = "-np"
  cmd[#cmd + 1] = tostring(np or 8)
  for _, a in ipairs(train_args(out)) do cmd[#cmd + 1] = a end
  local parts = {}
  for i, a in ipairs(cmd) do parts[i] = h.quote(a) end
  return h.sh(("env PG_ABORT_GRACE=1 PG_COLLECTIVE_TIMEOUT=20 %s timeout -k 5 %d %s"):format(env, h.limit(300),
    table.concat(parts, " ")))
end

-- name -> bytes of every tensor of the final checkpoint's parameter files
local function final_params(out)
  local dir = out .. "/checkpoints/step-" .. ("%08d"):format(STEPS)
  local t, n = {}, 0
  for _, name in ipairs(pg.fs.list(dir)) do
    if name:match("^params.*%.safetensors$") then
      for k, v in pairs(h.safetensors_tensors(dir .. "/" .. name)) do
        t[name .. ":" .. k] = v.bytes
        n = n + 1
      end
    end
  end
  assert(n > 0, "no parameter files in " .. dir)
  return t
end

describe("scripts/launch.sh", function()
  setup(function()
    local ids = {}
    for i = 1, 4000 do ids[i] = (i * 31 + i // 7) % 256 end
    pg.data.write_shard(root .. "/train.bin", ids, 1)
    pg.data.write_shard(root .. "/val.bin", ids, 1)
  end)

  it("restarts a 2x2x2 job after SIGKILLs of one rank at three random steps; the end is bitwise the "
    .. "uninterrupted run's", function()
    local rc, out = launch("", { "--max-restarts=0" }, root .. "/whole")
    assert.equal(0, rc, out)
    -- three distinct steps in [1, STEPS - 1], one per launch (the kill comes after that step's checkpoint
    -- may or may not be written: either way the relaunch resumes from the newest that verifies)
    math.randomseed(os.time())
    local steps = {}
    while #steps < 3 do
      local s = math.random(1, STEPS - 1)
      local fresh = true
      for _, t in ipairs(steps) do fresh = fresh and t ~= s end
      if fresh then steps[#steps + 1] = s end
    end
    table.sort(steps) -- a relaunch resumes at or after the previous kill's step: the next kill must be later
    local rank = math.random(0, 7)
    local where = ("(kills after steps %d, %d, %d of rank %d)"):format(steps[1], steps[2], steps[3], rank)
    rc, out = launch(("PG_TEST_KILL_AT_STEP=%d,%d,%d PG_TEST_KILL_RANK=%d"):format(steps[1], steps[2], steps[3],
      rank), { "--max-restarts=3" }, root .. "/killed")
    assert.equal(0, rc, where .. "\n" .. out)
    for k = 1, 3 do
      assert.truthy(out:find(("launch.sh: restart %d of 3 after a failure on 8 ranks (exit status "):format(k), 1, true),
        where .. "\n" .. out)
      assert.truthy(out:find(("PG_TEST_KILL_AT_STEP: rank %d kills itself after step %d"):format(rank, steps[k]), 1,
        true), where .. "\n" .. out)
    end
    assert.is_nil(out:find("restart 4", 1, true), out)
    assert.same(final_params(root .. "/whole"), final_params(root .. "/killed"), where)
  end)

  it("gives up after --max-restarts with the last cause", function()
    local rc, out = launch("PG_TEST_KILL_AT_STEP=1,1 PG_TEST_KILL_RANK=3", { "--max-restarts=1" }, root .. "/gives_up")
    assert.are_not.equal(0, rc, out)
    assert.truthy(out:find("launch.sh: restart 1 of 1 after a failure on 8 ranks", 1, true), out)
    assert.truthy(out:find("launch.sh: giving up after 1 restarts; last failure: exit status ", 1, true), out)
    assert.truthy(out:find("process rank 3", 1, true), out)
  end)

  it("shrinks the data dimension to the ranks that remain (--np-after-failure), resuming across layouts", function()
    local rc, out = launch("PG_TEST_KILL_AT_STEP=3 PG_TEST_KILL_RANK=5",
      { "--max-restarts=1", "--np-after-failure=6", "--model-parallel=4" }, root .. "/shrunk")
    assert.equal(0, rc, out)
    assert.truthy(out:find("launch.sh: restart 1 of 1 after a failure on 8 ranks", 1, true), out)
    assert.truthy(out:find("data 0/1", 1, true), out) -- the relaunch: 6 ranks rounded down to 4, data 1
    assert.truthy(pg.fs.exists(root .. "/shrunk/checkpoints/step-" .. ("%08d"):format(STEPS) .. "/manifest.json"), out)
  end)

  it("refuses bad launcher arguments by name", function()
    local rc, out = h.sh("scripts/launch.sh --max-restarts=x -np 2 true")
    assert.equal(2, rc, out)
    assert.truthy(out:find("--max-restarts: expected a non-negative integer, got 'x'", 1, true), out)
    rc, out = h.sh("scripts/launch.sh --max-restart=1 -np 2 true")
    assert.equal(2, rc, out)
    assert.truthy(out:find("unknown option '--max-restart=1'", 1, true), out)
    rc, out = h.sh("scripts/launch.sh --help")
    assert.equal(0, rc, out)
    assert.truthy(out:find("--max-restarts=N", 1, true), out)
  end)
end)
