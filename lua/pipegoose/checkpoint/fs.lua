--- Checkpoint files on disk: directories and whole-file writes (pg.fs and
-- pg.file when the C module is there, a shell fallback under plain Lua),
-- this process's id and CRC-32. A module of its own because every other
-- checkpoint module needs these and they need nothing else of pipegoose
-- (the C module only when it loads). Returns the `fs` table, which
-- pipegoose.checkpoint offers as M.fs; fs.getpid and fs.crc32_of are also
-- its M.getpid and M.crc32_of, and fs.core_module (the C module or nil) is
-- for the other files here.
local fs = {}

local function quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function core_module()
  local core = package.loaded["pipegoose.core"]
  if core then return core end
  local ok, mod = pcall(require, "pipegoose.core")
  return ok and mod or nil
end

-- Directories go through pg.fs (src/runtime/pg_fs.c: no shell, so a path with a
-- quote or a leading dash is just a path). Without the C module (callback
-- tests under a plain lua5.4 that cannot load it) a shell fallback remains.
local function cfs()
  local core = core_module()
  return core and core.fs
end

--- True when a file or directory exists at path.
function fs.exists(path)
  local c = cfs()
  if c then return c.exists(path) end
  return os.rename(path, path) ~= nil
end

function fs.is_dir(path)
  local c = cfs()
  if c then return c.is_dir(path) end
  local ok = os.rename(path .. "/.", path .. "/.")
  return ok ~= nil
end

function fs.mkdir_p(path)
  local c = cfs()
  if c then
    local ok, err = pcall(c.mkdir_p, path)
    if not ok then error(("checkpoint: cannot create directory %s (%s)"):format(path, tostring(err)), 0) end
    return
  end
  if fs.exists(path) then return end
  local ok = os.execute("mkdir -p " .. quote(path))
  if not ok then error(("checkpoint: cannot create directory %s"):format(path), 0) end
end

function fs.rm_rf(path)
  if path == nil or path == "" or path == "/" or path == "." then
    error("checkpoint: refusing to remove '" .. tostring(path) .. "'")
  end
  local c = cfs()
  if c then return c.remove_tree(path) end
  if fs.exists(path) then os.execute("rm -rf " .. quote(path)) end
end

function fs.read(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s = f:read("a")
  f:close()
  return s
end

--- Names in a directory (not . and ..), sorted; {} when it cannot be listed.
function fs.list(dir)
  local c = cfs()
  if c then
    local ok, names = pcall(c.list, dir)
    return ok and names or {}
  end
  local p = io.popen("ls -1A " .. quote(dir) .. " 2>/dev/null")
  if not p then return {} end
  local out = {}
  for line in p:lines() do out[#out + 1] = line end
  p:close()
  table.sort(out)
  return out
end

--- Writes a whole file: through pg.file.write (temporary name, fsync, rename,
-- fsync of the directory) when the C module is there; returns crc32, bytes.
function fs.write(path, text)
  local core = core_module()
  if core and core.file then return core.file.write(path, { text }) end
  local tmp = path .. ".tmp." .. fs.getpid()
  local f, err = io.open(tmp, "wb")
  if not f then error(("checkpoint: cannot write %s: %s"):format(path, tostring(err)), 0) end
  f:write(text)
  f:close()
  local ok, err2 = os.rename(tmp, path)
  if not ok then error(("checkpoint: cannot rename %s to %s: %s"):format(tmp, path, tostring(err2)), 0) end
  return nil, #text
end

--- Writes through a temporary file and a rename: readers see old or new.
function fs.write_atomic(path, text)
  return fs.write(path, text)
end

function fs.fsync_dir(dir)
  local core = core_module()
  if core and core.file and core.file.fsync_dir then core.file.fsync_dir(dir) end
end

function fs.dirname(path)
  local d = path:gsub("/+$", ""):match("^(.*)/[^/]*$")
  if d == nil then return "." end
  if d == "" then return "/" end
  return d
end

function fs.basename(path)
  return (path:gsub("/+$", ""):match("([^/]*)$"))
end

--- A path made absolute with its existing part's links resolved (what is
-- missing below it appended as written), to compare an output with the
-- inputs it must not replace; nil when no part of it resolves.
function fs.absolute(path)
  path = path:gsub("/+$", "")
  if path == "" then path = "/" end
  local core = core_module()
  local real = core and core.file.realpath(path)
  if real then return real end
  local parent = fs.dirname(path)
  if parent == path or not core then return nil end
  local rp = fs.absolute(parent)
  if not rp then return nil end
  return (rp == "/" and "" or rp) .. "/" .. fs.basename(path)
end

--- Whether absolute path a is b or inside it.
function fs.within(a, b) return a == b or a:sub(1, #b + 1) == (b == "/" and "/" or b .. "/") end

--- The checkpoint directory (one with a manifest.json) that absolute path
-- `abs` is strictly inside, or nil: a file written there would change it.
function fs.checkpoint_above(abs)
  local dir = fs.dirname(abs)
  while true do
    if fs.exists(dir .. "/manifest.json") then return dir end
    local up = fs.dirname(dir)
    if up == dir then return nil end
    dir = up
  end
end

--- This process's id (pg.fs.getpid; under plain Lua /proc/self/stat, whose reader is this process).
function fs.getpid()
  local c = cfs()
  if c then return c.getpid() end
  local f = io.open("/proc/self/stat", "r")
  if f then
    local pid = f:read("n")
    f:close()
    if pid then return math.tointeger(pid) end
  end
  return os.time() % 1000000
end

-- CRC-32 (zlib's) of a string: the C module's, or this table-driven one
-- under plain Lua (the fakes of pg.testing save and load without it).
local crc_table
local function lua_crc32(s)
  if not crc_table then
    crc_table = {}
    for i = 0, 255 do
      local c = i
      for _ = 1, 8 do c = (c & 1 ~= 0) and (0xEDB88320 ~ (c >> 1)) or (c >> 1) end
      crc_table[i] = c
    end
  end
  local c = 0xFFFFFFFF
  for i = 1, #s do c = crc_table[(c ~ s:byte(i)) & 0xFF] ~ (c >> 8) end
  return c ~ 0xFFFFFFFF
end

function fs.crc32_of(s)
  local core = core_module()
  if core and core.file and core.file.crc32_of then return core.file.crc32_of(s) end
  return lua_crc32(s)
end

fs.core_module = core_module

return fs
