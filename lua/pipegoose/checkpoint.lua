--- Checkpoints: a directory per checkpoint, written atomically, with the
-- engine's parameters and the optimizer's state in sharded safetensors files
-- that load into the same parallel layout bit for bit, or into another one
-- (resliced by parameter name). docs/FORMATS.md ("Checkpoints") describes the
-- files exactly; docs/TRAINER.md how the Trainer uses them.
--
--   <dir>/manifest.json                         written last, by rank 0
--   <dir>/params-tp{t}-pp{p}.safetensors        by data rank 0 of each (tensor, pipeline) rank
--   <dir>/optim-tp{t}-pp{p}.safetensors         zero = 0: by data rank 0
--   <dir>/optim-tp{t}-pp{p}-dp{d}.safetensors   zero = 1: by every rank (each holds its own flat slice)
--   <parent>/latest                             the name of the newest complete checkpoint
--
-- Engines without flat buffers (pg.testing's fakes, anything written in Lua)
-- keep their state_dict in <dir>/rank-{r}.json instead (exact JSON below).
--
-- Saving (every rank calls save() at the same point): all files go into
-- <dir>.tmp-<pid of rank 0>, each written by pg.file.write (temporary name,
-- fsync, rename, fsync of the directory); the ranks' file records (size,
-- crc32, which slice of which tensor each entry holds) and data positions are
-- gathered to rank 0, which writes the manifest last, renames the directory
-- into place, and updates `latest` (atomically). A crash at any point leaves
-- the previous checkpoint and `latest` as they were; leftover temporary
-- directories are ignored and removed by the next successful save.
--
-- Loading checks the manifest (format version, model config), verifies the
-- size and crc32 of every file a rank reads, agrees on any problem across
-- ranks (every rank raises the same error, naming the file and the problem),
-- and only then copies.
local cjson = require("cjson").new()
if cjson.encode_escape_forward_slash then cjson.encode_escape_forward_slash(false) end
local safetensors = require "pipegoose.safetensors"

local M = {}
M.FORMAT = "pipegoose-checkpoint"
M.FORMAT_VERSION = 2
M.MANIFEST = "manifest.json"
M.LATEST = "latest"
M.SHARDED = "safetensors-sharded"
M.JSON_PER_RANK = "json-per-rank"

------------------------------------------------------------------------------
-- Files

local fs = {}
M.fs = fs

local function quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function core_module()
  local core = package.loaded["pipegoose.core"]
  if core then return core end
  local ok, mod = pcall(require, "pipegoose.core")
  return ok and mod or nil
end

--- True when a file or directory exists at path.
function fs.exists(path)
  return os.rename(path, path) ~= nil
end

function fs.is_dir(path)
  local ok = os.rename(path .. "/.", path .. "/.")
  return ok ~= nil
end

function fs.mkdir_p(path)
  if fs.exists(path) then return end
  local ok = os.execute("mkdir -p " .. quote(path))
  if not ok then error(("checkpoint: cannot create directory %s"):format(path), 0) end
end

function fs.rm_rf(path)
  if path == nil or path == "" or path == "/" or path == "." then
    error("checkpoint: refusing to remove '" .. tostring(path) .. "'")
  end
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
  local tmp = path .. ".tmp." .. M.getpid()
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
--
-- Keys are written sorted, so the same state gives the same text; the
-- top-level keys of an object each start a line (manifests stay readable).
local function emit(v, out, depth)
  if type(v) ~= "table" then
    out[#out + 1] = math.type(v) == "integer" and ("%d"):format(v) or cjson.encode(v)
    return
  end
  local n = #v
  if n > 0 then -- after pack, a table with integer keys is a list 1..n
    out[#out + 1] = "["
    for i = 1, n do
      if i > 1 then out[#out + 1] = "," end
      emit(v[i], out, depth + 1)
    end
    out[#out + 1] = "]"
    return
  end
  local keys = {}
  for k in pairs(v) do keys[#keys + 1] = k end
  table.sort(keys)
  out[#out + 1] = "{"
  for i, k in ipairs(keys) do
    if i > 1 then out[#out + 1] = "," end
    if depth == 0 then out[#out + 1] = "\n" end
    out[#out + 1] = cjson.encode(k) .. ":"
    emit(v[k], out, depth + 1)
  end
  out[#out + 1] = depth == 0 and #keys > 0 and "\n}" or "}"
end

function M.encode(value, what)
  local out = {}
  emit(pack(value, what or "state", 0), out, 0)
  return table.concat(out)
end

--- JSON text from M.encode -> the Lua value.
function M.decode(text, what)
  local ok, v = pcall(cjson.decode, text)
  if not ok then error(("checkpoint: %s is not valid JSON: %s"):format(what or "input", tostring(v)), 0) end
  return unpack(v)
end

------------------------------------------------------------------------------
-- Ranks and collectives

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
  local pid = M.getpid()
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

------------------------------------------------------------------------------
-- Sharded tensor files

function M.params_file(tp, pp) return ("params-tp%d-pp%d.safetensors"):format(tp, pp) end

function M.optim_file(tp, pp, dp)
  if dp then return ("optim-tp%d-pp%d-dp%d.safetensors"):format(tp, pp, dp) end
  return ("optim-tp%d-pp%d.safetensors"):format(tp, pp)
end

--- True for engines with flat buffers (what pg.parallelize returns).
function M.is_sharded_engine(engine)
  return type(engine) == "table" and engine.c ~= nil and type(engine.parameters) == "function" and engine.ctx ~= nil
    and not engine.ctx.fake
end

local function real_optimizer(opt)
  return type(opt) == "table" and opt.c ~= nil and opt.zero ~= nil and type(opt.c) == "userdata"
end

local numel = safetensors.numel

local function copy_list(t)
  local out = {}
  for i, v in ipairs(t) do out[i] = v end
  return out
end

local function copy(t)
  local out = {}
  for k, v in pairs(t) do out[k] = type(v) == "table" and copy(v) or v end
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
  local l = { tensor = 1, pipeline = 1, data = 1, zero = opt and opt.zero or 0, world_size = trainer.state.world_size,
              micro_batches = engine.micro_batches, schedule = engine.schedule }
  if ctx and ctx.sizes then
    local s = ctx:sizes()
    l.tensor, l.pipeline, l.data = s.tensor, s.pipeline, s.data
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

local function describe_layout(l)
  return ("tensor=%d pipeline=%d data=%d zero=%d"):format(l.tensor or 1, l.pipeline or 1, l.data or 1, l.zero or 0)
end

-- This rank's engine and optimizer state as safetensors files in dir;
-- returns the records of the files it wrote.
local function write_sharded(trainer, dir)
  local engine, opt, ctx = trainer.engine, trainer.optimizer, trainer.engine.ctx
  local tp, pp, dp = ctx:local_rank("tensor"), ctx:local_rank("pipeline"), ctx:local_rank("data")
  local l = M.layout(trainer)
  local records = {}
  local function write(file, kind, entries, slices, extra)
    local meta = { format = "pipegoose-shard", kind = kind, tp = tp, pp = pp, dp = dp, step = trainer.state.step,
                   tensor = l.tensor, pipeline = l.pipeline, data = l.data, zero = l.zero, slices = slices }
    for k, v in pairs(extra or {}) do meta[k] = v end
    local crc, bytes = safetensors.write(dir .. "/" .. file, entries, { pipegoose = M.encode(meta, file) })
    records[#records + 1] = { file = file, kind = kind, tp = tp, pp = pp, dp = dp, bytes = bytes, crc32 = crc,
                              slices = slices }
  end
  local params = engine:parameters()
  if dp == 0 then
    local entries, slices = {}, {}
    for _, p in ipairs(params) do
      entries[#entries + 1] = { name = p.name, tensor = p.tensor }
      slices[p.name] = slice_of(p, 0, numel(p.shape))
    end
    write(M.params_file(tp, pp), "params", entries, slices)
  end
  if real_optimizer(opt) and (opt.zero == 1 or dp == 0) then
    local s = opt.c:state()
    local entries, slices = {}, {}
    for _, p in ipairs(params) do
      local n = numel(p.shape)
      local a, b = math.max(p.offset, s.lo), math.min(p.offset + n, s.hi)
      if a < b then
        local shape = (b - a == n) and p.shape or { b - a }
        entries[#entries + 1] = { name = "m/" .. p.name, tensor = s.m:narrow(1, a - s.lo + 1, b - a), shape = shape }
        entries[#entries + 1] = { name = "v/" .. p.name, tensor = s.v:narrow(1, a - s.lo + 1, b - a), shape = shape }
        slices[p.name] = slice_of(p, a - p.offset, b - p.offset)
      end
    end
    write(opt.zero == 1 and M.optim_file(tp, pp, dp) or M.optim_file(tp, pp), "optim", entries, slices,
      { optimizer_step = s.step, flat_lo = s.lo, flat_hi = s.hi })
  end
  return records
end

--- The size and crc32 check of one file the manifest lists: nil when good,
-- else a message naming the file and the problem.
function M.check_file(dir, rec)
  local path = dir .. "/" .. rec.file
  local f = io.open(path, "rb")
  if not f then return ("checkpoint: %s: missing (the manifest lists it with %d bytes)"):format(path, rec.bytes or -1) end
  local size = f:seek("end")
  f:close()
  if rec.bytes and size ~= rec.bytes then
    return ("checkpoint: %s: %s: %d bytes on disk, the manifest says %d"):format(path,
      size < rec.bytes and "truncated" or "wrong size", size, rec.bytes)
  end
  local core = core_module()
  if rec.crc32 ~= nil and core and core.file then
    local crc = core.file.crc32(path)
    if crc ~= rec.crc32 then
      return ("checkpoint: %s: checksum mismatch: crc32 %08x on disk, %08x in the manifest (the file is corrupt)")
        :format(path, crc, rec.crc32)
    end
  end
  return nil
end

-- Every saved piece of tensor `name` in files of `kind`: { {rec=, slice=}, ... }.
local function pieces_of(files, kind, name)
  local out = {}
  for _, rec in ipairs(files) do
    if rec.kind == kind and rec.slices and rec.slices[name] then out[#out + 1] = { rec = rec, slice = rec.slices[name] } end
  end
  return out
end

-- The pieces to assemble a full tensor from, each element once: not the
-- second copies of a tied weight (unless there is nothing else), and of the
-- tensor ranks that hold the same shard (replicated tensors: all of them)
-- only the lowest one's pieces (its data ranks' ZeRO ranges cover the shard).
local function originals(list)
  local kept = {}
  for _, pc in ipairs(list) do if not pc.slice.tied_copy then kept[#kept + 1] = pc end end
  if #kept == 0 then kept = list end
  local owner = {} -- shard (parts, index) -> the lowest (pp, tp) holding it
  local function key(pc) return pc.slice.split.parts .. ":" .. pc.slice.split.index end
  local function rank_of(pc) return (pc.rec.pp or 0) * 65536 + (pc.rec.tp or 0) end
  for _, pc in ipairs(kept) do
    local k = key(pc)
    if owner[k] == nil or rank_of(pc) < owner[k] then owner[k] = rank_of(pc) end
  end
  local out = {}
  for _, pc in ipairs(kept) do
    if rank_of(pc) == owner[key(pc)] then out[#out + 1] = pc end
  end
  return out
end

local function same_shard(s, p)
  if #s.full_shape ~= #p.full_shape then return false end
  for i, d in ipairs(p.full_shape) do if s.full_shape[i] ~= d then return false end end
  local a, b = norm_split(s.split), norm_split(p.split)
  local sa, sb = table.concat(a.sizes or {}, ","), table.concat(b.sizes or {}, ",")
  return a.dim == b.dim and a.parts == b.parts and a.index == b.index and a.blocks == b.blocks and sa == sb
end

-- A saved piece of the very shard p holds that covers its local elements [lo, hi).
local function find_direct(list, p, lo, hi)
  local any
  for _, pc in ipairs(list) do
    local s = pc.slice
    if same_shard(s, p) and s.lo <= lo and s.hi >= hi then
      if (s.tied_copy or false) == (p.tied_copy or false) then return pc end
      any = any or pc
    end
  end
  return any
end

local function header_reader(dir)
  local headers = {}
  return function(rec)
    local h = headers[rec.file]
    if not h then
      local ok, res = pcall(safetensors.read_header, dir .. "/" .. rec.file)
      if not ok then error("checkpoint: " .. tostring(res), 0) end
      h = res
      headers[rec.file] = h
    end
    return h
  end
end

local function read_piece(header_of, pc, entry, first, count)
  local ok, t = pcall(safetensors.read, header_of(pc.rec), entry, first, count)
  if not ok then error("checkpoint: " .. tostring(t), 0) end
  return t
end

-- The full tensor (its saved full shape) of `prefix .. name` from pieces.
local function assemble(dir, list, prefix, name, header_of)
  local core = require "pipegoose.core"
  local shape = list[1].slice.full_shape
  local full = core.zeros(shape)
  local covered = 0
  for _, pc in ipairs(list) do
    local s = pc.slice
    for i, d in ipairs(shape) do
      if s.full_shape[i] ~= d then
        error(("checkpoint: %s: the pieces of %s disagree on its full shape"):format(dir, name), 0)
      end
    end
    local t = read_piece(header_of, pc, prefix .. name, 0, s.hi - s.lo)
    core.shard_copy(full, t, { full_shape = s.full_shape, split = s.split, lo = s.lo }, "to_full")
    covered = covered + (s.hi - s.lo)
  end
  if covered ~= numel(shape) then
    error(("checkpoint: %s: the saved pieces of %s%s cover %d of its %d elements"):format(dir, prefix, name, covered,
      numel(shape)), 0)
  end
  return full
end
M._assemble = assemble

local function first_rows(full, rows)
  if rows < full:size(1) then return full:narrow(1, 1, rows) end
  return full
end

-- Loads the sharded files into this rank's engine and optimizer: pieces of
-- the same shard are copied as they are, anything else is assembled into the
-- full tensor and cut for this layout. Returns nil, or why only the weights
-- were loaded.
local function load_sharded(trainer, dir, manifest)
  local core = require "pipegoose.core"
  local engine, opt = trainer.engine, trainer.optimizer
  if not M.is_sharded_engine(engine) then
    error(("checkpoint: %s holds sharded tensor files, which only an engine made by pg.parallelize can load"):format(dir), 0)
  end
  local files = manifest.tensor_state.files or {}
  local plan, need, problem = {}, {}, nil
  local function note(msg) problem = problem or msg end
  local function want(list) for _, pc in ipairs(list) do need[pc.rec.file] = pc.rec end end
  local params = engine:parameters()
  for _, p in ipairs(params) do
    local list = pieces_of(files, "params", p.name)
    if #list == 0 then
      note(("checkpoint: %s/%s: holds no parameter '%s' (the checkpoint's model lacks it)"):format(dir, M.MANIFEST, p.name))
    else
      local d = find_direct(list, p, 0, numel(p.shape))
      local step = { what = "param", p = p, direct = d, pieces = not d and originals(list) or nil }
      want(d and { d } or step.pieces)
      plan[#plan + 1] = step
    end
  end
  local weights_only
  local has_optim = false
  for _, rec in ipairs(files) do if rec.kind == "optim" then has_optim = true end end
  if not real_optimizer(opt) then
    weights_only = opt == nil and "there is no optimizer" or "the optimizer is not pg.optim.AdamW"
  elseif not has_optim or not manifest.optimizer or manifest.optimizer.type ~= "AdamW" then
    weights_only = "the checkpoint holds no AdamW state"
  else
    local s = opt.c:state()
    for _, p in ipairs(params) do
      local n = numel(p.shape)
      local a, b = math.max(p.offset, s.lo), math.min(p.offset + n, s.hi)
      if a < b then
        local list = pieces_of(files, "optim", p.name)
        if #list == 0 then
          note(("checkpoint: %s/%s: holds no optimizer state for '%s'"):format(dir, M.MANIFEST, p.name))
        else
          local lo, hi = a - p.offset, b - p.offset
          local d = find_direct(list, p, lo, hi)
          local step = { what = "optim", p = p, lo = lo, hi = hi, at = a - s.lo, direct = d,
                         pieces = not d and originals(list) or nil }
          want(d and { d } or step.pieces)
          plan[#plan + 1] = step
        end
      end
    end
  end
  -- verify every file this rank reads, then agree: every rank stops alike
  local names = {}
  for f in pairs(need) do names[#names + 1] = f end
  table.sort(names)
  for _, f in ipairs(names) do
    if problem then break end
    problem = M.check_file(dir, need[f])
  end
  agree_error(trainer, problem)

  local header_of = header_reader(dir)
  local function full_of(prefix, step) return assemble(dir, step.pieces, prefix, step.p.name, header_of) end
  local s = real_optimizer(opt) and opt.c:state() or nil
  local resliced = false
  for _, step in ipairs(plan) do
    local p = step.p
    if step.what == "param" then
      if step.direct then
        p.tensor:copy_(read_piece(header_of, step.direct, p.name, 0, numel(p.shape)))
      else
        resliced = true
        local full = full_of("", step)
        engine.c:load_param(p.name, first_rows(full, math.min(full:size(1), p.full_shape[1])))
        full:free() -- full tensors can be large: do not wait for the collector
      end
    else
      local count = step.hi - step.lo
      for _, which in ipairs{ "m", "v" } do
        local dst = s[which]:narrow(1, step.at + 1, count)
        if step.direct then
          dst:copy_(read_piece(header_of, step.direct, which .. "/" .. p.name, step.lo - step.direct.slice.lo, count))
        else
          resliced = true
          local full = full_of(which .. "/", step)
          core.shard_copy(first_rows(full, math.min(full:size(1), p.full_shape[1])), dst,
            { full_shape = p.full_shape, split = norm_split(p.split), lo = step.lo }, "from_full")
          full:free()
        end
      end
    end
  end
  if not weights_only then
    opt.c:set_step(manifest.optimizer.step)
    opt.c:hparams(manifest.optimizer.hparams)
  end
  return weights_only, resliced
end

------------------------------------------------------------------------------
-- Tensor state: sharded safetensors files for real engines, exact JSON per
-- rank for engines written in Lua (pg.testing's fakes).

--- Writes this rank's engine and optimizer state into `dir` (every rank
-- calls it); returns {format=, files = the records of the files this rank wrote}.
function M.save_tensor_state(trainer, dir)
  if M.is_sharded_engine(trainer.engine) then
    return { format = M.SHARDED, files = write_sharded(trainer, dir) }
  end
  local rank = trainer.state.rank
  local engine, opt = trainer.engine, trainer.optimizer
  local body = {
    rank = rank,
    engine = engine.state_dict and engine:state_dict() or nil,
    optimizer = opt and opt.state_dict and opt:state_dict() or nil,
  }
  local file = ("rank-%05d.json"):format(rank)
  local crc, bytes = fs.write(dir .. "/" .. file, M.encode(body, ("rank %d state"):format(rank)))
  return { format = M.JSON_PER_RANK, files = { { file = file, kind = "rank", rank = rank, bytes = bytes, crc32 = crc } } }
end

--- Reads back what save_tensor_state wrote into the engine and optimizer.
-- Returns nil, or why only the weights were loaded (sharded files).
function M.load_tensor_state(trainer, dir, manifest)
  local desc = manifest.tensor_state
  if desc == nil then return end
  if desc.format == M.SHARDED then
    local weights_only, resliced = load_sharded(trainer, dir, manifest)
    local saved, now = manifest.layout or {}, M.layout(trainer)
    if resliced then
      trainer:print(("checkpoint: %s was saved at %s; resliced into %s"):format(dir, describe_layout(saved),
        describe_layout(now)))
    end
    if weights_only then
      trainer:print(("checkpoint: loaded only the weights from %s (%s); the optimizer state starts fresh")
        :format(dir, weights_only))
    end
    return weights_only
  end
  if desc.format ~= M.JSON_PER_RANK then
    error(("checkpoint: %s/%s: tensor state in format '%s', which this version cannot read"):format(dir, M.MANIFEST,
      tostring(desc.format)), 0)
  end
  local rank = trainer.state.rank
  local rec
  for _, r in ipairs(desc.files or {}) do if r.rank == rank then rec = r end end
  if not rec then error(("checkpoint: %s/%s: lists no state file for rank %d"):format(dir, M.MANIFEST, rank), 0) end
  agree_error(trainer, M.check_file(dir, rec))
  local file = dir .. "/" .. rec.file
  local body = M.decode(assert(fs.read(file)), file)
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
-- save

local function optimizer_info(opt)
  if real_optimizer(opt) then
    local s = opt.c:state()
    return { type = "AdamW", step = s.step, zero = opt.zero, hparams = opt.c:hparams() }
  end
  if opt ~= nil then return { type = "lua" } end
  return nil
end

--- The manifest for the trainer's current state (callback states included;
-- tensor_state and data_ranks are added by save()).
function M.manifest(trainer)
  local st = trainer.state
  local cbs = {}
  for key, i in pairs(trainer._state_keys or {}) do
    local cb = trainer.callbacks[i]
    if cb.state_dict then cbs[key] = cb:state_dict() end
  end
  local data = trainer.train_data
  local ctx = trainer.ctx
  return {
    format = M.FORMAT,
    format_version = M.FORMAT_VERSION,
    step = st.step,
    epoch = st.epoch,
    counters = trainer:_counters(),
    lr = { base_lr = trainer._base_lr, last_lr = st.lr, schedule_step = st.step },
    metrics = copy(st.metrics),
    callbacks = cbs,
    data = data and data.state_dict and data:state_dict() or nil,
    model = type(trainer.engine.config) == "table" and copy(trainer.engine.config) or nil,
    layout = M.layout(trainer),
    optimizer = optimizer_info(trainer.optimizer),
    -- The C runtime keeps no random state (initialisation is a pure function
    -- of seed, name and index; data order of its own seed and the epoch);
    -- the trainer reseeds math.random from its seed when fit starts.
    rng = { trainer_seed = trainer.seed, context_seed = (ctx and ctx.seed) and ctx:seed() or nil },
    world_size = st.world_size,
    saved_at = os.time(),
  }
end

-- Test-only: PG_CHECKPOINT_TEST_KILL=STEP:RANK makes that rank SIGKILL itself
-- in the save at that step, after writing its files and before the manifest.
local function test_kill_point(trainer)
  local spec = os.getenv("PG_CHECKPOINT_TEST_KILL")
  if not spec then return end
  local step, rank = spec:match("^(%d+):(%d+)$")
  if tonumber(step) == trainer.state.step and tonumber(rank) == trainer.state.rank then
    io.stderr:write(("checkpoint: PG_CHECKPOINT_TEST_KILL: rank %d kills itself in the save at step %d\n")
      :format(trainer.state.rank, trainer.state.step))
    io.stderr:flush()
    os.execute("kill -9 " .. M.getpid())
  end
end

--- Removes what interrupted saves left in a checkpoint directory's parent:
-- <name>.tmp-<pid> and <name>.old-<pid> directories and latest.tmp.<pid> files.
function M.cleanup(parent)
  local removed = {}
  for _, name in ipairs(fs.list(parent)) do
    if name:match("^.+%.tmp%-%d+$") or name:match("^.+%.old%-%d+$") or name:match("^" .. M.LATEST .. "%.tmp%.%d+$") then
      fs.rm_rf(parent .. "/" .. name)
      removed[#removed + 1] = name
    end
  end
  return removed
end

--- Saves the trainer's state into directory `dir` (see the top of this file).
function M.save(trainer, dir)
  if type(dir) ~= "string" or dir == "" then error("checkpoint.save: needs a directory path", 2) end
  dir = dir:gsub("/+$", "")
  local rank = trainer.state.rank
  local parent = fs.dirname(dir)
  local pid = agreed_pid(trainer)
  local tmp = ("%s.tmp-%d"):format(dir, pid)
  if rank == 0 then
    fs.rm_rf(tmp)
    fs.mkdir_p(tmp)
  end
  barrier(trainer)
  local manifest = M.manifest(trainer)
  trainer:_call("on_save_checkpoint", manifest, dir)
  local desc = M.save_tensor_state(trainer, tmp)
  test_kill_point(trainer)
  -- every rank's file records and data position to rank 0 (pg.file.write
  -- synced each file before returning, so after this gather every file is
  -- durable)
  local ctx = trainer.ctx
  local mine = { rank = rank, files = desc.files, data = manifest.data, tp = 0, pp = 0, dp = 0 }
  if ctx and not ctx.fake then
    mine.tp, mine.pp, mine.dp = ctx:local_rank("tensor"), ctx:local_rank("pipeline"), ctx:local_rank("data")
  end
  local all = { mine }
  if multi_rank(trainer) then
    all = {}
    for i, text in ipairs(M.all_gather_strings(ctx, M.encode(mine, "file records"))) do
      all[i] = M.decode(text, "file records")
    end
  end
  if rank == 0 then
    local files, data_ranks = {}, {}
    for _, r in ipairs(all) do
      for _, f in ipairs(r.files or {}) do files[#files + 1] = f end
      if r.tp == 0 and r.pp == 0 and r.data ~= nil then data_ranks[r.dp + 1] = r.data end
    end
    table.sort(files, function(a, b) return a.file < b.file end)
    manifest.tensor_state = { format = desc.format, files = files }
    manifest.data_ranks = data_ranks
    fs.write(tmp .. "/" .. M.MANIFEST, M.encode(manifest, "manifest"))
    if fs.exists(dir) then
      local old = ("%s.old-%d"):format(dir, pid)
      fs.rm_rf(old)
      local ok, err = os.rename(dir, old)
      if not ok then error(("checkpoint: cannot move %s aside: %s"):format(dir, tostring(err)), 0) end
      ok, err = os.rename(tmp, dir)
      if not ok then error(("checkpoint: cannot rename %s to %s: %s"):format(tmp, dir, tostring(err)), 0) end
      fs.rm_rf(old)
    else
      local ok, err = os.rename(tmp, dir)
      if not ok then error(("checkpoint: cannot rename %s to %s: %s"):format(tmp, dir, tostring(err)), 0) end
    end
    fs.fsync_dir(parent)
    fs.write(parent .. "/" .. M.LATEST, fs.basename(dir) .. "\n")
    M.cleanup(parent)
  end
  barrier(trainer) -- nobody reads or deletes before the directory is complete
  return dir
end

------------------------------------------------------------------------------
-- load

--- The newest complete checkpoint under parent (from its `latest` file), or nil.
function M.latest(parent)
  local text = fs.read(parent .. "/" .. M.LATEST)
  if not text then return nil end
  local name = text:match("^%s*(.-)%s*$")
  if name == "" then return nil end
  return parent .. "/" .. name
end

--- The checkpoint directory for a path: the path itself when it has a
-- manifest, else the one its `latest` file names.
-- A save that replaces a checkpoint of the same name moves the old one to
-- <dir>.old-<pid> for a moment; a crash right then leaves only that.
local function moved_aside(dir)
  local base = fs.basename(dir)
  for _, name in ipairs(fs.list(fs.dirname(dir))) do
    if name:sub(1, #base + 5) == base .. ".old-" and name:sub(#base + 6):match("^%d+$") then
      local p = fs.dirname(dir) .. "/" .. name
      if fs.exists(p .. "/" .. M.MANIFEST) then return p end
    end
  end
end

function M.resolve(path)
  if type(path) ~= "string" then error("checkpoint: needs a directory path", 2) end
  path = path:gsub("/+$", "")
  if fs.exists(path .. "/" .. M.MANIFEST) then return path end
  local latest = M.latest(path)
  if latest and fs.exists(latest .. "/" .. M.MANIFEST) then return latest end
  local aside = moved_aside(latest or path)
  if aside then return aside end
  error(("checkpoint: %s is not a checkpoint (no %s%s)"):format(path, M.MANIFEST,
    latest and (", and its latest file names " .. latest .. " which has none") or ""), 0)
end

--- Reads and checks a checkpoint's manifest (format and version).
function M.read_manifest(dir)
  local path = dir .. "/" .. M.MANIFEST
  local text = fs.read(path)
  if not text then error(("checkpoint: %s: missing (not a complete checkpoint)"):format(path), 0) end
  local ok, manifest = pcall(M.decode, text, path)
  if not ok then error(("checkpoint: %s: not valid JSON (%s)"):format(path, tostring(manifest)), 0) end
  if type(manifest) ~= "table" then error(("checkpoint: %s: not a manifest"):format(path), 0) end
  if manifest.format_version ~= M.FORMAT_VERSION then
    error(("checkpoint: %s: format_version %s is not supported (this version reads %d)"):format(path,
      tostring(manifest.format_version), M.FORMAT_VERSION), 0)
  end
  if manifest.format ~= M.FORMAT then
    error(("checkpoint: %s: format '%s' is not '%s'"):format(path, tostring(manifest.format), M.FORMAT), 0)
  end
  return manifest
end

--- Differences between a saved model config and this one, as a message, or nil.
function M.config_difference(saved, mine)
  if type(saved) ~= "table" or type(mine) ~= "table" then return nil end
  local keys, seen = {}, {}
  for k in pairs(saved) do if not seen[k] then seen[k] = true; keys[#keys + 1] = k end end
  for k in pairs(mine) do if not seen[k] then seen[k] = true; keys[#keys + 1] = k end end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  local diffs = {}
  for _, k in ipairs(keys) do
    local a, b = saved[k], mine[k]
    if type(a) ~= "table" and type(b) ~= "table" and a ~= b then
      diffs[#diffs + 1] = ("%s is %s in the checkpoint, %s here"):format(tostring(k), tostring(a), tostring(b))
    end
  end
  if #diffs == 0 then return nil end
  return table.concat(diffs, "; ")
end

--- Loads a checkpoint directory (or a parent with a `latest` file) into the
-- trainer: engine and optimizer state, counters, lr position, metrics, data,
-- then on_load_checkpoint(manifest) and each callback's load_state_dict.
-- Returns the manifest and the directory.
function M.load(trainer, path)
  if type(path) ~= "string" then error("checkpoint.load: needs a directory path", 2) end
  local dir = M.resolve(path)
  local manifest = M.read_manifest(dir)
  local st = trainer.state
  local diff = M.config_difference(manifest.model, trainer.engine.config)
  if diff then
    error(("checkpoint: %s/%s: the model differs from the one being trained: %s"):format(dir, M.MANIFEST, diff), 0)
  end
  local ts = manifest.tensor_state or {}
  if ts.format == M.JSON_PER_RANK and manifest.world_size ~= st.world_size then
    error(("checkpoint: %s was saved by %s ranks; this job has %d"):format(dir, tostring(manifest.world_size),
      st.world_size), 0)
  end
  M.load_tensor_state(trainer, dir, manifest)
  trainer:_restore_counters(manifest.counters or {})
  if manifest.lr then
    trainer._base_lr = manifest.lr.base_lr
    st.lr = manifest.lr.last_lr
  end
  st.metrics = manifest.metrics or {}
  local data = trainer.train_data
  local dstate = manifest.data
  local ranks, ctx = manifest.data_ranks, trainer.ctx
  if type(ranks) == "table" and ctx and not ctx.fake and #ranks == ctx:world_size("data") then
    dstate = ranks[ctx:local_rank("data") + 1] or dstate
  end
  if dstate ~= nil and data and data.load_state_dict then data:load_state_dict(dstate) end
  local rng = manifest.rng or {}
  if trainer.seed ~= nil and rng.trainer_seed ~= nil and rng.trainer_seed ~= trainer.seed then
    trainer:print(("checkpoint: %s was saved with seed=%s; this trainer has seed=%s"):format(dir,
      tostring(rng.trainer_seed), tostring(trainer.seed)))
  end
  trainer:_call("on_load_checkpoint", manifest)
  local states = manifest.callbacks or {}
  for key, i in pairs(trainer._state_keys or {}) do
    local cb = trainer.callbacks[i]
    if states[key] ~= nil and cb.load_state_dict then cb:load_state_dict(states[key]) end
  end
  return manifest, dir
end

------------------------------------------------------------------------------
-- Tools on one process (scripts/checkpoint.lua): verify, info, consolidate,
-- export to llm.c. They read the files, never a running job.

--- Checks a checkpoint directory: the manifest, and every file it lists
-- (present, size, crc32, a readable safetensors header holding the entries
-- the manifest describes). Returns the list of problems (empty: good) and
-- the manifest.
function M.verify(dir)
  dir = dir:gsub("/+$", "")
  local ok, manifest = pcall(M.read_manifest, dir)
  if not ok then return { tostring(manifest) } end
  local problems = {}
  local ts = manifest.tensor_state
  if type(ts) ~= "table" or type(ts.files) ~= "table" then
    return { ("checkpoint: %s/%s: lists no tensor files"):format(dir, M.MANIFEST) }, manifest
  end
  for _, rec in ipairs(ts.files) do
    local err = M.check_file(dir, rec)
    if not err and rec.file:match("%.safetensors$") then
      local ok2, h = pcall(safetensors.read_header, dir .. "/" .. rec.file)
      if not ok2 then
        err = "checkpoint: " .. tostring(h)
      else
        for name, s in pairs(rec.slices or {}) do
          local entries = rec.kind == "optim" and { "m/" .. name, "v/" .. name } or { name }
          for _, e in ipairs(entries) do
            local got = h.entries[e]
            if not got then
              err = err or ("checkpoint: %s/%s: has no tensor '%s'"):format(dir, rec.file, e)
            elseif got.numel ~= s.hi - s.lo then
              err = err or ("checkpoint: %s/%s: '%s' has %d elements, the manifest says %d"):format(dir, rec.file, e,
                got.numel, s.hi - s.lo)
            end
          end
        end
      end
    end
    if err then problems[#problems + 1] = err end
  end
  return problems, manifest
end

local function verified(dir)
  dir = dir:gsub("/+$", "")
  local problems, manifest = M.verify(dir)
  if #problems > 0 then error(problems[1], 0) end
  if manifest.tensor_state.format ~= M.SHARDED then
    error(("checkpoint: %s holds %s state (an engine written in Lua), not sharded tensor files"):format(dir,
      tostring(manifest.tensor_state.format)), 0)
  end
  return dir, manifest
end

local function human(bytes)
  if bytes >= 1 << 30 then return ("%.2f GiB"):format(bytes / (1 << 30)) end
  if bytes >= 1 << 20 then return ("%.2f MiB"):format(bytes / (1 << 20)) end
  if bytes >= 1 << 10 then return ("%.1f KiB"):format(bytes / (1 << 10)) end
  return ("%d B"):format(bytes)
end

local function kv(t)
  local keys = {}
  for k in pairs(t or {}) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  local parts = {}
  for _, k in ipairs(keys) do
    local v = t[k]
    if type(v) ~= "table" then parts[#parts + 1] = ("%s=%s"):format(tostring(k), tostring(v)) end
  end
  return table.concat(parts, " ")
end

--- A summary of a checkpoint's manifest, as lines of text.
function M.info(dir)
  dir = M.resolve(dir)
  local m = M.read_manifest(dir)
  local lines = {}
  local function add(fmt, ...) lines[#lines + 1] = fmt:format(...) end
  add("checkpoint %s", dir)
  add("format %s version %d, saved %s", m.format, m.format_version, m.saved_at and os.date("!%Y-%m-%d %H:%M:%S UTC", m.saved_at) or "?")
  add("step %d, epoch %d", m.step or 0, m.epoch or 0)
  if m.counters then add("counters: %s", kv(m.counters)) end
  if m.model then add("model: %s", kv(m.model)) end
  if m.layout then
    add("layout: %s (%d ranks), micro_batches=%s schedule=%s", describe_layout(m.layout), m.world_size or 0,
      tostring(m.layout.micro_batches), tostring(m.layout.schedule))
  end
  if m.optimizer then
    add("optimizer: %s step %s %s", tostring(m.optimizer.type), tostring(m.optimizer.step), kv(m.optimizer.hparams))
  end
  if m.lr then add("lr: base %s, last %s", tostring(m.lr.base_lr), tostring(m.lr.last_lr)) end
  if m.metrics then add("metrics: %s", kv(m.metrics)) end
  if m.data_ranks then
    for d, s in pairs(m.data_ranks) do
      add("data rank %d: epoch %s, batch %s", d - 1, tostring(s.epoch), tostring(s.batch_index or s.pos))
    end
  end
  if m.rng then add("rng: %s", kv(m.rng)) end
  local cbs = {}
  for k in pairs(m.callbacks or {}) do cbs[#cbs + 1] = k end
  table.sort(cbs)
  if #cbs > 0 then add("callback states: %s", table.concat(cbs, ", ")) end
  local ts = m.tensor_state or {}
  local total = 0
  for _, f in ipairs(ts.files or {}) do total = total + (f.bytes or 0) end
  add("tensor state: %s, %d files, %s", tostring(ts.format), #(ts.files or {}), human(total))
  for _, f in ipairs(ts.files or {}) do
    local n = 0
    for _ in pairs(f.slices or {}) do n = n + 1 end
    add("  %-36s %10s  crc32 %08x  %d tensors", f.file, human(f.bytes or 0), f.crc32 or 0, f.kind == "optim" and 2 * n or n)
  end
  return lines, m
end

-- Parameter names in model order: by pipeline stage, then each file's order.
local function param_names(dir, files)
  local recs = {}
  for _, r in ipairs(files) do if r.kind == "params" then recs[#recs + 1] = r end end
  table.sort(recs, function(a, b) if a.pp ~= b.pp then return a.pp < b.pp end return a.tp < b.tp end)
  local names, seen = {}, {}
  local header_of = header_reader(dir)
  for _, r in ipairs(recs) do
    for _, n in ipairs(header_of(r).names) do
      if not seen[n] then seen[n] = true; names[#names + 1] = n end
    end
  end
  return names, header_of
end

-- The model's rows of a full tensor: tensor parallelism pads the vocabulary
-- rows further than the model's padded_vocab; those rows are dropped.
local function model_rows(slice, cfg)
  if slice.valid_rows and cfg and cfg.padded_vocab and cfg.padded_vocab <= slice.full_shape[1] then
    return cfg.padded_vocab
  end
  return slice.full_shape[1]
end

local function full_tensor(dir, manifest, header_of, kind, prefix, name)
  local list = pieces_of(manifest.tensor_state.files, kind, name)
  if #list == 0 then error(("checkpoint: %s holds no %s%s"):format(dir, prefix, name), 0) end
  list = originals(list)
  local full = assemble(dir, list, prefix, name, header_of)
  return first_rows(full, model_rows(list[1].slice, manifest.model))
end

--- Merges every shard into one safetensors file of full tensors (the model's
-- shapes), named as the parameters; with opts.optimizer also "m/<name>" and
-- "v/<name>". Returns the number of tensors, the crc32 and the size.
function M.consolidate(dir, out, opts)
  opts = opts or {}
  local manifest
  dir, manifest = verified(M.resolve(dir))
  local names, header_of = param_names(dir, manifest.tensor_state.files)
  local entries = {}
  for _, name in ipairs(names) do
    entries[#entries + 1] = { name = name, tensor = full_tensor(dir, manifest, header_of, "params", "", name) }
  end
  if opts.optimizer then
    for _, which in ipairs{ "m", "v" } do
      for _, name in ipairs(names) do
        entries[#entries + 1] = { name = which .. "/" .. name,
                                  tensor = full_tensor(dir, manifest, header_of, "optim", which .. "/", name) }
      end
    end
  end
  local meta = { format = "pipegoose-consolidated", step = tostring(manifest.step),
                 model = M.encode(manifest.model or {}, "model") }
  if opts.optimizer and manifest.optimizer then meta.optimizer = M.encode(manifest.optimizer, "optimizer") end
  local crc, bytes = safetensors.write(out, entries, meta)
  return #entries, crc, bytes
end

--- Writes the checkpoint's GPT-2 weights as an llm.c model file (the layout
-- of lua/pipegoose/llmc.lua). Returns the crc32 and the size.
function M.export_llmc(dir, out)
  local manifest
  dir, manifest = verified(M.resolve(dir))
  local cfg = manifest.model or {}
  if cfg.arch ~= nil and cfg.arch ~= "gpt2" then
    error(("checkpoint: %s: the model is %s; llm.c's format holds GPT-2 models only"):format(dir, tostring(cfg.arch)), 0)
  end
  for _, k in ipairs{ "vocab", "padded_vocab", "seq_len", "dim", "heads", "layers" } do
    if math.tointeger(cfg[k]) == nil then
      error(("checkpoint: %s: the model config has no %s; llm.c's format holds GPT-2 models only"):format(dir, k), 0)
    end
  end
  if cfg.hidden and cfg.hidden ~= 4 * cfg.dim then
    error(("checkpoint: %s: the MLP is %d wide; llm.c's format needs 4 x dim = %d"):format(dir, cfg.hidden, 4 * cfg.dim), 0)
  end
  if cfg.tie == false then
    error(("checkpoint: %s: the head is not tied to the embedding, which llm.c's format needs"):format(dir), 0)
  end
  local core = require "pipegoose.core"
  local llmc = require "pipegoose.llmc"
  local header = {}
  for i = 1, 256 do header[i] = 0 end
  header[1], header[2], header[3], header[4] = llmc.MAGIC, llmc.VERSION, cfg.seq_len, cfg.vocab
  header[5], header[6], header[7], header[8] = cfg.layers, cfg.heads, cfg.dim, cfg.padded_vocab
  local parts = { core.tensor(header, { dtype = "int32" }) }
  local header_of = header_reader(dir)
  local cache = {}
  for _, e in ipairs(llmc.entries(cfg)) do
    local full = cache[e.name]
    if not full then
      full = full_tensor(dir, manifest, header_of, "params", "", e.name)
      cache[e.name] = full
    end
    if full:numel() < e.count then
      error(("checkpoint: %s: %s has %d values, llm.c's %s needs %d"):format(dir, e.name, full:numel(), e.file_name,
        e.count), 0)
    end
    parts[#parts + 1] = full:reshape{ full:numel() }:narrow(1, 1, e.count)
  end
  return core.file.write(out, parts)
end

--- Writes the checkpoint's weights as a Hugging Face directory
-- (config.json + model.safetensors, lua/pipegoose/hf.lua): GPT2LMHeadModel
-- or LlamaForCausalLM. Returns the class written.
function M.export_hf(dir, out)
  local manifest
  dir, manifest = verified(M.resolve(dir))
  local header_of = header_reader(dir)
  return require("pipegoose.hf").write_checkpoint(manifest.model or {}, out, function(name)
    return full_tensor(dir, manifest, header_of, "params", "", name)
  end, "checkpoint: " .. dir)
end

--- Loads a checkpoint's parameters (not the optimizer or the counters) into
-- an engine of any layout: each rank cuts its shards out of the full tensors.
-- The checkpoint is verified first. Returns the manifest.
function M.load_weights(engine, path)
  local dir, manifest = verified(M.resolve(path))
  local header_of = header_reader(dir)
  -- a tied head's copy (last stage) takes the original's values, as the loaders of llmc.lua and hf.lua do
  for _, p in ipairs(engine:parameters()) do
    engine.c:load_param(p.name, full_tensor(dir, manifest, header_of, "params", "", p.name))
  end
  return manifest
end

return M
