--- Processes, and one job per output directory: M.lock takes
-- <dir>/.pipegoose.lock (created with O_EXCL, naming the process that
-- holds it), takes over one whose holder has ended on this machine (judged
-- from /proc: the pid, its start time, the boot), and refuses any other;
-- M.unlock releases it. M.pid_running serves checkpoint.lua's cleanup of
-- interrupted saves, M.canonical compares directories. A module of its own
-- because it is about processes, not about what a checkpoint holds; the
-- Trainer takes the locks (on rank 0) through pipegoose.checkpoint.
local fs = require "pipegoose.checkpoint.fs"
local json = require "pipegoose.checkpoint.json"
local core_module = fs.core_module

local M = {}

-- /proc/<pid>/stat: the process's state letter and start time (clock ticks
-- after boot), or nil when there is no such process.
local function proc_stat(pid)
  local f = io.open(("/proc/%d/stat"):format(pid), "r")
  if not f then return nil end
  local text = f:read("a") or ""
  f:close()
  -- field 2, the command, is in parentheses and may hold anything: the
  -- other fields resume after the last ')'
  local rest = text:match("^.*%)%s+(.*)$")
  if not rest then return nil end
  local fields = {}
  for w in rest:gmatch("%S+") do fields[#fields + 1] = w end
  return fields[1], math.tointeger(tonumber(fields[20]))
end

local function first_line(path)
  local text = fs.read(path)
  return text and text:match("^%s*(.-)%s*$") or nil
end

--- Whether process `pid` is running on this machine: true or false, or nil
-- when this system cannot tell (no /proc). A zombie has ended.
function M.pid_running(pid)
  local state = proc_stat(pid)
  if state then return state ~= "Z" and state ~= "X" end
  local f = io.open("/proc/self/stat", "r")
  if not f then return nil end
  f:close()
  return false
end

local function host_name()
  return first_line("/proc/sys/kernel/hostname") or os.getenv("HOSTNAME") or "unknown host"
end

--- This process as a lock holder: pid, host, its start time and the boot
-- (so that a pid reused by another process, or a reboot, shows), the time
-- and the command line (for the message another job prints).
function M.lock_owner()
  local pid = fs.getpid()
  local _, start = proc_stat(pid)
  local cmd = fs.read("/proc/self/cmdline")
  cmd = cmd and cmd:gsub("%z$", ""):gsub("%z", " "):sub(1, 200) or nil
  return { pid = pid, host = host_name(), start = start, boot = first_line("/proc/sys/kernel/random/boot_id"),
           time = os.time(), command = cmd }
end

-- Whether the holder `o` of a lock may still run: false only when this
-- machine can tell it ended (same host: the pid is gone, is another
-- process now, or the machine rebooted since).
local function holder_alive(o, me)
  if o.host ~= me.host then return true end
  if o.boot ~= nil and me.boot ~= nil and o.boot ~= me.boot then return false end
  if math.type(o.pid) ~= "integer" then return true end
  local state, start = proc_stat(o.pid)
  if state == nil then return M.pid_running(o.pid) ~= false end
  if state == "Z" or state == "X" then return false end
  return o.start == nil or start == nil or o.start == start
end

local function describe_holder(o)
  return ("pid %s on %s%s%s"):format(tostring(o.pid), tostring(o.host),
    math.type(o.time) == "integer" and (", since " .. os.date("%Y-%m-%d %H:%M:%S", o.time)) or "",
    type(o.command) == "string" and (": " .. o.command) or "")
end

M.LOCK = ".pipegoose.lock"
local held = {} -- lock path -> how many times this process took it

-- Busy wait (Lua has no sleep; this path runs only while another job is
-- in the middle of creating its lock file).
local function pause(seconds)
  local t = os.clock()
  while os.clock() - t < seconds do end
end

--- Locks directory `dir` (created when missing) for this process:
-- <dir>/.pipegoose.lock, created with O_EXCL, holds M.lock_owner() as JSON.
-- A lock this process holds is taken again (counted); one whose holder has
-- ended on this machine is taken over; any other is an error naming the
-- job that holds it. `label` starts the messages ("Trainer: out_dir").
-- Returns the lock's path and, after a takeover, a warning to print.
-- Rank-local: the Trainer takes locks on rank 0 and agrees on the outcome.
function M.lock(dir, label)
  fs.mkdir_p(dir)
  local path = dir .. "/" .. M.LOCK
  if held[path] then
    held[path] = held[path] + 1
    return path
  end
  local core = core_module()
  local me = M.lock_owner()
  local text = json.encode(me, "lock")
  local warning
  for attempt = 1, 20 do
    local created
    if core and core.file and core.file.create_exclusive then
      created = core.file.create_exclusive(path, text)
    else -- plain Lua has no O_EXCL: check, then write (racy, tests only)
      created = not fs.exists(path)
      if created then fs.write(path, text) end
    end
    if created then
      held[path] = 1
      return path, warning
    end
    local other_text = fs.read(path)
    local ok, other = pcall(json.decode, other_text or "", path)
    if not ok or type(other) ~= "table" then
      -- another job between creating its lock file and filling it: wait for it
      if attempt == 20 then
        error(("%s %s is locked by another job (%s is not readable: %s); remove it if no job uses %s"):format(label,
          dir, path, tostring(other), dir), 0)
      end
      pause(0.05)
    elseif other.pid == me.pid and other.host == me.host and other.start == me.start then
      held[path] = 1 -- this process's own lock, left by a Trainer that ended without releasing it
      return path, warning
    elseif holder_alive(other, me) then
      error(("%s %s is in use by another job (%s); two jobs writing one directory delete each other's "
        .. "checkpoints. Wait for it to end or choose another directory; if that job is gone, remove %s")
        :format(label, dir, describe_holder(other), path), 0)
    else
      -- Take over: move the stale lock aside and make sure what moved is
      -- what was judged stale; a job taking it over at the same moment may
      -- have replaced it, and gets it back (exclusively: never over a third).
      local aside = ("%s.stale-%d"):format(path, me.pid)
      if os.rename(path, aside) then
        local moved = fs.read(aside)
        if moved == other_text then
          warning = ("%s %s: took over the lock of a job that ended without releasing it (%s)"):format(label, dir,
            describe_holder(other))
        elseif moved and core and core.file and core.file.create_exclusive then
          core.file.create_exclusive(path, moved)
        end
        os.remove(aside)
      end
    end
  end
  error(("%s %s: could not take %s"):format(label, dir, path), 0)
end

--- Releases a lock M.lock returned (the file goes when this process has
-- released it as many times as it took it, and only if it still names this
-- process).
function M.unlock(path)
  local n = held[path]
  if n == nil then return end
  if n > 1 then
    held[path] = n - 1
    return
  end
  held[path] = nil
  local ok, rec = pcall(json.decode, fs.read(path) or "", path)
  if ok and type(rec) == "table" and rec.pid == fs.getpid() and rec.host == host_name() then os.remove(path) end
end

--- The path with every link resolved, also when its last parts do not
-- exist yet: locks and the directories they cover compare by it.
function M.canonical(path)
  path = path:gsub("/+$", "")
  if path == "" then return "/" end
  local core = core_module()
  local real = core and core.file and core.file.realpath and core.file.realpath(path)
  if real then return real end
  local parent, base = fs.dirname(path), fs.basename(path)
  if parent == path or base == "" or base == "." then return path end
  local p = M.canonical(parent)
  return (p == "/" and "" or p) .. "/" .. base
end

return M
