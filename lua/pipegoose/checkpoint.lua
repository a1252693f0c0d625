--- Checkpoints, first version: a directory per checkpoint, written atomically.
--
--   <dir>/manifest.json      format_version, step, epoch, trainer counters, lr
--                            schedule position, metrics, callback states by
--                            state_key, the training data's state_dict, and a
--                            descriptor of the tensor state
--   <dir>/rank-00000.json    this rank's engine and optimizer state_dict
--   <parent>/latest          the name of the newest complete checkpoint
--
-- save() writes everything into <dir>.tmp-<pid of rank 0>, renames it to
-- <dir> when complete, and updates `latest` last (through a rename too), so
-- a crash leaves either the old checkpoint or the new one, never half of
-- one. No fsync yet. All ranks must call save() at the same point (the
-- trainer's agreed saves); with more than one rank it uses a broadcast and
-- barriers, and assumes the directory is on a file system every rank sees.
--
-- Engine and optimizer state ("tensor state") goes through
-- M.save_tensor_state / M.load_tensor_state only: replace those two to write
-- sharded tensor files; the manifest keeps whatever descriptor they return.
--
-- JSON is lua-cjson, which prints numbers with 14 significant digits and
-- reads every number back as a float. To restore state exactly (a resumed
-- run must continue identically) values are packed first: numbers that would
-- not survive become tagged strings ("#f:<%.17g>" floats, "#i:<digits>"
-- large integers, "#f:nan"/"#f:inf"), integer-valued floats are tagged to
-- stay floats, strings starting with "#" get "#s:", non-string keys are
-- tagged the same way, and tensors become {"#tensor": {dtype, shape, data}}.
local cjson = require("cjson").new()

local M = {}
M.FORMAT_VERSION = 1
M.MANIFEST = "manifest.json"
M.LATEST = "latest"

------------------------------------------------------------------------------
-- Files

local fs = {}
M.fs = fs

local function quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

--- True when a file or directory exists at path.
function fs.exists(path)
  return os.rename(path, path) ~= nil
end

function fs.mkdir_p(path)
  if fs.exists(path) then return end
  local ok = os.execute("mkdir -p " .. quote(path))
  if not ok then error(("checkpoint: cannot create directory %s"):format(path), 0) end
end

function fs.rm_rf(path)
  if path == nil or path == "" or path == "/" then error("checkpoint: refusing to remove '" .. tostring(path) .. "'") end
  if fs.exists(path) then os.execute("rm -rf " .. quote(path)) end
end

function fs.read(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s = f:read("a")
  f:close()
  return s
end

function fs.write(path, text)
  local f, err = io.open(path, "wb")
  if not f then error(("checkpoint: cannot write %s: %s"):format(path, tostring(err)), 0) end
  f:write(text)
  f:close()
end

--- Writes through a temporary file and a rename: readers see old or new.
function fs.write_atomic(path, text, suffix)
  local tmp = path .. ".tmp-" .. (suffix or M.getpid())
  fs.write(tmp, text)
  local ok, err = os.rename(tmp, path)
  if not ok then error(("checkpoint: cannot rename %s to %s: %s"):format(tmp, path, tostring(err)), 0) end
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

--- This process's id (Lua has no getpid: /proc/self is the reading process).
function M.getpid()
  local f = io.open("/proc/self/stat", "r")
  if f then
    local pid = f:read("n")
    f:close()
    if pid then return math.tointeger(pid) end
  end
  return os.time() % 1000000
end

------------------------------------------------------------------------------
-- Exact JSON for plain Lua values (and tensors)

local function core_module()
  local core = package.loaded["pipegoose.core"]
  if core then return core end
  local ok, mod = pcall(require, "pipegoose.core")
  return ok and mod or nil
end

local function is_tensor(v)
  local core = core_module()
  return core ~= nil and core.is_tensor ~= nil and core.is_tensor(v)
end

local function pack_float(v)
  if v ~= v then return "#f:nan" end
  if v == math.huge then return "#f:inf" end
  if v == -math.huge then return "#f:-inf" end
  if v ~= math.floor(v) then
    local s = ("%.14g"):format(v)
    if tonumber(s) == v then return v end -- cjson prints it the same way
  end
  return "#f:" .. ("%.17g"):format(v)
end

local function pack_key(k, where)
  local tk = type(k)
  if tk == "string" then return k:sub(1, 1) == "#" and ("#s:" .. k) or k end
  if tk == "number" then
    if math.type(k) == "integer" then return "#i:" .. ("%d"):format(k) end
    return "#f:" .. ("%.17g"):format(k)
  end
  if tk == "boolean" then return "#b:" .. tostring(k) end
  error(("checkpoint: cannot store a table key of type %s at %s"):format(tk, where), 0)
end

local function pack(v, where, depth)
  if depth > 200 then error(("checkpoint: state nested too deeply (a cycle?) at %s"):format(where), 0) end
  local tv = type(v)
  if tv == "number" then
    if math.type(v) == "integer" then
      if v > -1e14 and v < 1e14 then return v end
      return "#i:" .. ("%d"):format(v)
    end
    return pack_float(v)
  elseif tv == "string" then
    return v:sub(1, 1) == "#" and ("#s:" .. v) or v
  elseif tv == "boolean" then
    return v
  elseif tv == "table" then
    -- a sequence 1..n (n > 0) becomes a JSON array, anything else an object
    local n, max, is_seq = 0, 0, true
    for k in pairs(v) do
      n = n + 1
      if math.type(k) ~= "integer" or k < 1 then is_seq = false elseif k > max then max = k end
    end
    if is_seq and n > 0 and max == n then
      local out = {}
      for i = 1, n do out[i] = pack(v[i], where .. "[" .. i .. "]", depth + 1) end
      return out
    end
    local out = {}
    for k, x in pairs(v) do
      local key = pack_key(k, where)
      out[key] = pack(x, where .. "." .. tostring(k), depth + 1)
    end
    return out
  elseif is_tensor(v) then
    local flat = v:reshape({ v:numel() }):totable()
    for i = 1, #flat do flat[i] = pack(flat[i], where, depth + 1) end
    return { ["#tensor"] = { dtype = v:dtype(), shape = v:shape(), data = flat } }
  end
  error(("checkpoint: cannot store a %s at %s (state must be plain tables, numbers, strings, booleans or tensors)")
    :format(tv, where), 0)
end

local function unpack_string(s)
  if s:sub(1, 1) ~= "#" then return s end
  local tag, rest = s:sub(1, 3), s:sub(4)
  if tag == "#s:" then return rest end
  if tag == "#i:" then return math.tointeger(tonumber(rest)) end
  if tag == "#b:" then return rest == "true" end
  if tag == "#f:" then
    if rest == "nan" then return 0 / 0 end
    if rest == "inf" then return math.huge end
    if rest == "-inf" then return -math.huge end
    local x = tonumber(rest)
    if math.type(x) == "integer" then x = x + 0.0 end
    return x
  end
  return s
end

local function unpack(v)
  local tv = type(v)
  if tv == "number" then return math.tointeger(v) or v end
  if tv == "string" then return unpack_string(v) end
  if tv == "table" then
    local t = v["#tensor"]
    if t ~= nil then
      local core = core_module()
      if not core then error("checkpoint: this checkpoint holds tensors; load it under pglua", 0) end
      local data = {}
      for i, x in ipairs(t.data) do data[i] = unpack(x) end
      local shape = {}
      for i, x in ipairs(t.shape) do shape[i] = unpack(x) end
      return core.tensor(data, { dtype = t.dtype }):reshape(shape)
    end
    local out = {}
    for k, x in pairs(v) do
      local key = type(k) == "string" and unpack_string(k) or k
      out[key] = unpack(x)
    end
    return out
  end
  if v == cjson.null then return nil end
  return v
end

--- Lua value -> JSON text, exactly restorable by M.decode.
function M.encode(value, what)
  return cjson.encode(pack(value, what or "state", 0))
end

--- JSON text from M.encode -> the Lua value.
function M.decode(text, what)
  local ok, v = pcall(cjson.decode, text)
  if not ok then error(("checkpoint: %s is not valid JSON: %s"):format(what or "input", tostring(v)), 0) end
  return unpack(v)
end

------------------------------------------------------------------------------
-- Tensor state: the two functions to replace for sharded tensor files.

--- Writes this rank's engine and optimizer state into `dir` (every rank
-- calls it); returns a descriptor kept in the manifest.
function M.save_tensor_state(trainer, dir)
  local rank = trainer.state.rank
  local engine, opt = trainer.engine, trainer.optimizer
  local body = {
    rank = rank,
    engine = engine.state_dict and engine:state_dict() or nil,
    optimizer = opt and opt.state_dict and opt:state_dict() or nil,
  }
  local pattern = "rank-%05d.json"
  fs.write(dir .. "/" .. pattern:format(rank), M.encode(body, ("rank %d state"):format(rank)))
  return { format = "json-per-rank", pattern = pattern, world_size = trainer.state.world_size }
end

--- Reads back what save_tensor_state wrote into the engine and optimizer.
function M.load_tensor_state(trainer, dir, desc)
  if desc == nil then return end
  if desc.format ~= "json-per-rank" then
    error(("checkpoint: %s has tensor state in format '%s', which this version cannot read")
      :format(dir, tostring(desc.format)), 0)
  end
  local file = dir .. "/" .. desc.pattern:format(trainer.state.rank)
  local text, err = fs.read(file)
  if not text then error(("checkpoint: cannot read %s: %s"):format(file, tostring(err)), 0) end
  local body = M.decode(text, file)
  local engine, opt = trainer.engine, trainer.optimizer
  if body.engine ~= nil then
    if not engine.load_state_dict then error("checkpoint: the engine has no load_state_dict()", 0) end
    engine:load_state_dict(body.engine)
  end
  if body.optimizer ~= nil and opt then
    if not opt.load_state_dict then error("checkpoint: the optimizer has no load_state_dict()", 0) end
    opt:load_state_dict(body.optimizer)
  end
end

------------------------------------------------------------------------------
-- save / load

local function multi_rank(trainer)
  -- pg.testing.fake_context has ranks but no communication
  return trainer.ctx ~= nil and not trainer.ctx.fake and trainer.state.world_size > 1
end

-- Rank 0's pid on every rank, so that all ranks write into the same
-- temporary directory.
local function agreed_pid(trainer)
  local pid = M.getpid()
  if not multi_rank(trainer) then return pid end
  local core = require "pipegoose.core"
  local t = core.tensor({ pid }, { dtype = "int32" })
  core.dist.broadcast(t, { ctx = trainer.ctx, src = 0 })
  return math.tointeger(t:get(1))
end

local function barrier(trainer)
  if multi_rank(trainer) then trainer.ctx:barrier() end
end

local function copy(t)
  local out = {}
  for k, v in pairs(t) do out[k] = v end
  return out
end

--- The manifest for the trainer's current state (callback states included).
function M.manifest(trainer)
  local st = trainer.state
  local cbs = {}
  for key, i in pairs(trainer._state_keys or {}) do
    local cb = trainer.callbacks[i]
    if cb.state_dict then cbs[key] = cb:state_dict() end
  end
  local data = trainer.train_data
  return {
    format_version = M.FORMAT_VERSION,
    step = st.step,
    epoch = st.epoch,
    counters = trainer:_counters(),
    lr = { base_lr = trainer._base_lr, last_lr = st.lr, schedule_step = st.step },
    metrics = copy(st.metrics),
    callbacks = cbs,
    data = data and data.state_dict and data:state_dict() or nil,
    world_size = st.world_size,
    saved_at = os.time(),
  }
end

--- Saves the trainer's state into directory `dir` (see the top of this file).
function M.save(trainer, dir)
  if type(dir) ~= "string" or dir == "" then error("checkpoint.save: needs a directory path", 2) end
  dir = dir:gsub("/+$", "")
  local rank = trainer.state.rank
  local pid = agreed_pid(trainer)
  local tmp = ("%s.tmp-%d"):format(dir, pid)
  if rank == 0 then
    fs.rm_rf(tmp)
    fs.mkdir_p(tmp)
  end
  barrier(trainer)
  local manifest = M.manifest(trainer)
  trainer:_call("on_save_checkpoint", manifest, dir)
  manifest.tensor_state = M.save_tensor_state(trainer, tmp)
  barrier(trainer) -- every rank's files are in tmp
  if rank == 0 then
    fs.write(tmp .. "/" .. M.MANIFEST, M.encode(manifest, "manifest"))
    if fs.exists(dir) then
      local old = ("%s.old-%d"):format(dir, pid)
      fs.rm_rf(old)
      assert(os.rename(dir, old))
      assert(os.rename(tmp, dir))
      fs.rm_rf(old)
    else
      local ok, err = os.rename(tmp, dir)
      if not ok then error(("checkpoint: cannot rename %s to %s: %s"):format(tmp, dir, tostring(err)), 0) end
    end
    fs.write_atomic(fs.dirname(dir) .. "/" .. M.LATEST, fs.basename(dir) .. "\n", pid)
  end
  barrier(trainer) -- nobody reads or deletes before the directory is complete
  return dir
end

--- The newest complete checkpoint under parent (from its `latest` file), or nil.
function M.latest(parent)
  local text = fs.read(parent .. "/" .. M.LATEST)
  if not text then return nil end
  local name = text:match("^%s*(.-)%s*$")
  if name == "" then return nil end
  return parent .. "/" .. name
end

--- Loads a checkpoint directory (or a parent with a `latest` file) into the
-- trainer: counters, lr position, metrics, data, engine and optimizer state,
-- then on_load_checkpoint(manifest) and each callback's load_state_dict.
-- Returns the manifest.
function M.load(trainer, path)
  if type(path) ~= "string" then error("checkpoint.load: needs a directory path", 2) end
  path = path:gsub("/+$", "")
  local dir = path
  if not fs.read(dir .. "/" .. M.MANIFEST) then
    local latest = M.latest(path)
    if latest and fs.read(latest .. "/" .. M.MANIFEST) then
      dir = latest
    else
      error(("checkpoint: %s is not a checkpoint (no %s%s)"):format(path, M.MANIFEST,
        latest and (", and its latest file names " .. latest .. " which has none") or ""), 0)
    end
  end
  local manifest = M.decode(assert(fs.read(dir .. "/" .. M.MANIFEST)), dir .. "/" .. M.MANIFEST)
  if manifest.format_version ~= M.FORMAT_VERSION then
    error(("checkpoint: %s has format_version %s; this version reads %d"):format(dir,
      tostring(manifest.format_version), M.FORMAT_VERSION), 0)
  end
  local st = trainer.state
  if manifest.world_size ~= st.world_size then
    error(("checkpoint: %s was saved by %s ranks; this job has %d"):format(dir, tostring(manifest.world_size),
      st.world_size), 0)
  end
  trainer:_restore_counters(manifest.counters or {})
  if manifest.lr then
    trainer._base_lr = manifest.lr.base_lr
    st.lr = manifest.lr.last_lr
  end
  st.metrics = manifest.metrics or {}
  local data = trainer.train_data
  if manifest.data ~= nil and data and data.load_state_dict then data:load_state_dict(manifest.data) end
  M.load_tensor_state(trainer, dir, manifest.tensor_state)
  trainer:_call("on_load_checkpoint", manifest)
  local states = manifest.callbacks or {}
  for key, i in pairs(trainer._state_keys or {}) do
    local cb = trainer.callbacks[i]
    if states[key] ~= nil and cb.load_state_dict then cb:load_state_dict(states[key]) end
  end
  return manifest, dir
end

return M
