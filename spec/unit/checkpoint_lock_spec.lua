-- One job per output directory, with real processes: a pglua job holds its
-- out_dir's lock (<out_dir>/.pipegoose.lock) while it trains; a second job
-- with the same out_dir refuses to start, naming the first; the lock goes
-- when the first ends; the lock of a job killed with SIGKILL is taken over
-- with a warning. (Two jobs in one directory used to delete each other's
-- temporary checkpoint directories; spec/unit/checkpoint_spec.lua checks
-- that a save leaves a running process's temporary directory alone.)
local pg = require "pipegoose"
local ckpt = pg.checkpoint
local h = require "helpers"

-- A job: trains a fake engine for 3 steps with a checkpoint per step in
-- out_dir (arg[1]); before the first step it waits for the file arg[2] to
-- exist, so that the spec decides how long it runs (at most 120 s: a failed
-- spec never leaves a job behind).
local JOB = [[
local pg = require "pipegoose"
local out, go = arg[1], arg[2]
local engine = pg.testing.fake_engine{}
-- overwrite = true: the jobs share one out_dir on purpose (the lock is the subject, not the checkpoints)
local trainer = pg.Trainer{ engine = engine, optimizer = pg.testing.fake_optimizer(engine), max_steps = 3, out_dir = out,
  overwrite = true, callbacks = { pg.callbacks.ModelCheckpoint{ every_n_steps = 1 },
    { name = "Wait", on_train_start = function()
      io.stdout:write("waiting\n")
      io.stdout:flush()
      for _ = 1, 2400 do
        local f = io.open(go)
        if f then f:close() return end
        os.execute("sleep 0.05")
      end
      error("no go file after 120 s")
    end } } }
trainer:fit(pg.testing.fake_data{ batches = 10 })
print("done at step " .. trainer.state.step)
]]

local root = h.tmpdir()
os.execute("mkdir -p " .. h.quote(root))
local script = root .. "/job.lua"
do
  local f = assert(io.open(script, "w"))
  f:write(JOB)
  f:close()
end

local function read(path)
  local f = io.open(path, "rb")
  if not f then return "" end
  local s = f:read("a")
  f:close()
  return s
end

local spawned = {} -- pid -> its go file, until the spec has seen it end

-- Starts a job in the background (its output in log); returns its pid.
local function spawn(out_dir, go, log)
  local p = assert(io.popen(("%s > %s 2>&1 & echo $!"):format(h.pglua_cmd{ script, out_dir, go }, h.quote(log))))
  local pid = math.tointeger(tonumber(p:read("a")))
  p:close()
  spawned[pid] = go
  return pid
end

-- Runs a job to its end; a hang guard (not a timing assertion) kills it after 60 s.
local function run(out_dir, go)
  return h.sh("timeout -k 5 60 " .. h.pglua_cmd{ script, out_dir, go })
end

-- Polls until cond() holds, for at most `limit` seconds (a hang guard).
local function wait_for(cond, limit)
  for _ = 1, limit * 20 do
    if cond() then return true end
    os.execute("sleep 0.05")
  end
  return false
end

local function touch(path) io.open(path, "w"):close() end

-- after a failed test: the jobs it started are let go, and ended if they linger
after_each(function()
  for pid, go in pairs(spawned) do
    touch(go)
    if not wait_for(function() return ckpt.pid_running(pid) == false end, 10) then os.execute("kill -9 " .. pid) end
    spawned[pid] = nil
  end
end)

describe("two jobs with one out_dir", function()
  local out = root .. "/run"
  local lock = out .. "/.pipegoose.lock"

  it("the second refuses to start, naming the first; the first ends cleanly and releases the lock", function()
    local go, log = root .. "/go-a", root .. "/a.log"
    local pid = spawn(out, go, log)
    assert.is_true(wait_for(function() return read(log):find("waiting", 1, true) ~= nil end, 60), read(log))
    local held = ckpt.decode(read(lock))
    assert.equal(pid, held.pid)
    assert.matches("job.lua", held.command, 1, true)

    local rc, text = run(out, root .. "/go-never")
    assert.equal(1, rc, text)
    assert.matches(("Trainer: out_dir %s is in use by another job (pid %d on "):format(out, pid), text, 1, true)
    assert.matches("if that job is gone, remove " .. lock, text, 1, true)
    assert.equal(read(lock), ckpt.encode(held, "lock"), "the refused job left the lock alone")

    touch(go)
    assert.is_true(wait_for(function() return ckpt.pid_running(pid) == false end, 60), read(log))
    assert.matches("done at step 3", read(log), 1, true)
    assert.is_false(ckpt.fs.exists(lock))
    assert.same({ "latest", "step-00000001", "step-00000002", "step-00000003" }, ckpt.fs.list(out .. "/checkpoints"))
  end)

  it("a job killed with SIGKILL leaves a stale lock that the next job takes over with a warning", function()
    local go, log = root .. "/go-b", root .. "/b.log"
    local pid = spawn(out, go, log)
    assert.is_true(wait_for(function() return read(log):find("waiting", 1, true) ~= nil end, 60), read(log))
    assert.equal(pid, ckpt.decode(read(lock)).pid)
    os.execute("kill -9 " .. pid)
    assert.is_true(wait_for(function() return ckpt.pid_running(pid) == false end, 60))
    assert.is_true(ckpt.fs.exists(lock), "SIGKILL left the lock")

    touch(go .. "-now") -- the new job's go file: it runs through
    local rc, text = run(out, go .. "-now")
    assert.equal(0, rc, text)
    assert.matches(("Trainer: out_dir %s: took over the lock of a job that ended without releasing it (pid %d on ")
      :format(out, pid), text, 1, true)
    assert.matches("done at step 3", text, 1, true)
    assert.is_false(ckpt.fs.exists(lock))
  end)
end)

describe("locks in one process", function()
  it("are taken again by the process that holds them, and released when the last holder lets go", function()
    local dir = root .. "/same"
    local a = ckpt.lock(dir, "test")
    assert.equal(a, ckpt.lock(dir, "test"))
    ckpt.unlock(a)
    assert.is_true(ckpt.fs.exists(a))
    ckpt.unlock(a)
    assert.is_false(ckpt.fs.exists(a))
  end)

  it("refuse a lock held by a running process on this host, and take over one whose process ended", function()
    local dir = root .. "/other"
    os.execute("mkdir -p " .. h.quote(dir))
    local me = ckpt.lock_owner()
    local other = { pid = 1, host = me.host, boot = me.boot, time = 0, command = "init" }
    local f = assert(io.open(dir .. "/.pipegoose.lock", "w"))
    f:write(ckpt.encode(other, "lock"))
    f:close()
    local ok, err = pcall(ckpt.lock, dir, "X")
    assert.is_false(ok)
    assert.matches("^X " .. dir:gsub("%p", "%%%0") .. " is in use by another job %(pid 1 on ", err)
    -- pid 1 "started" at another time: that process ended and the pid was reused
    other.start = -1
    f = assert(io.open(dir .. "/.pipegoose.lock", "w"))
    f:write(ckpt.encode(other, "lock"))
    f:close()
    local path, warning = ckpt.lock(dir, "X")
    assert.matches("took over the lock of a job that ended without releasing it (pid 1 on", warning, 1, true)
    assert.equal(me.pid, ckpt.decode(read(path)).pid)
    ckpt.unlock(path)
    assert.is_false(ckpt.fs.exists(path))
  end)

  it("refuse a lock of another host (whose processes this one cannot see)", function()
    local dir = root .. "/remote"
    os.execute("mkdir -p " .. h.quote(dir))
    local f = assert(io.open(dir .. "/.pipegoose.lock", "w"))
    f:write(ckpt.encode({ pid = 4242, host = "elsewhere", time = 0 }, "lock"))
    f:close()
    local ok, err = pcall(ckpt.lock, dir, "X")
    assert.is_false(ok)
    assert.matches("is in use by another job (pid 4242 on elsewhere", err, 1, true)
  end)
end)

teardown(function() h.rm(root) end)
