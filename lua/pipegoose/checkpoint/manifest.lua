--- Validation: the one place that decides whether a checkpoint may be read.
--
-- M.read_manifest (the manifest's JSON, format, seal and every field, by
-- M.manifest_problem) and M.check_file (one file: confined to the
-- directory, size, crc32, its safetensors header against the manifest) are
-- all there is; M.validate runs both over every file. scripts/checkpoint.lua
-- verify, the tools and M.load call them and nothing else decides: a check
-- added here holds for all of them. Messages name the file and the field.
--
-- Also here: the format's names (format, version, the manifest's file
-- name, the tensor state formats, the seal's key), the seal (M.seal), and
-- finding a checkpoint (M.latest, M.resolve: the directory whose manifest
-- to read). A module of its own because it runs on one process and only
-- reads: loading, saving (which checks what it writes) and the tools use it.
local fs = require "pipegoose.checkpoint.fs"
local json = require "pipegoose.checkpoint.json"
local layout = require "pipegoose.checkpoint.layout"
local safetensors = require "pipegoose.safetensors"
local cjson, emit, unpack = json.cjson, json.emit, json.unpack
local core_module = fs.core_module

local M = {}
-- The format's names.
M.FORMAT = "pipegoose-checkpoint"
M.FORMAT_VERSION = 2
M.MANIFEST = "manifest.json"
M.LATEST = "latest"
M.SHARDED = "safetensors-sharded"
M.JSON_PER_RANK = "json-per-rank"
M.SEAL_KEY = "manifest_crc32"
-- Far beyond any tensor, and small enough that element and byte counts stay
-- exact integers: a checkpoint that claims more is corrupt.
local MAX_NUMEL = 1 << 48

-- A value as messages show it: strings quoted, lists of a few scalars
-- spelled out, nil as "missing".
local function show(v)
  local tv = type(v)
  if v == nil then return "missing" end
  if tv == "string" then return ("'%s'"):format(v) end
  if tv == "number" then
    if v ~= v then return "nan" end
    return math.type(v) == "integer" and ("%d"):format(v) or ("%.17g"):format(v)
  end
  if tv == "table" then
    local n, parts = 0, {}
    for _ in pairs(v) do n = n + 1 end
    if n == #v and n <= 8 then
      for i = 1, n do
        if type(v[i]) == "table" then return "a table" end
        parts[i] = show(v[i])
      end
      return "{" .. table.concat(parts, ", ") .. "}"
    end
    return "a table"
  end
  return tostring(v)
end
M.show = show

--- A file name the manifest may use: one name inside the checkpoint
-- directory, nothing that leaves it (no '/', no '..', not hidden).
function M.plain_name(name)
  return type(name) == "string" and #name <= 255 and name:match("^[%w_][%w_%.%-]*$") ~= nil and not name:find("..", 1, true)
end

-- Problems travel as a tagged table through error(), so that the checks
-- below read as a list of rules and the first failure ends them.
local Problem = {}
local function fail_check(fmt, ...) error(setmetatable({ msg = fmt:format(...) }, Problem), 0) end
local function must(ok, field, v, what)
  if not ok then fail_check("%s is %s; it must be %s", field, show(v), what) end
end

local function is_int(v) return math.type(v) == "integer" end
local function nonneg_int(field, v) must(is_int(v) and v >= 0, field, v, "a non-negative integer") end
local function pos_int(field, v) must(is_int(v) and v >= 1, field, v, "a positive integer") end
local function finite_number(field, v, what)
  must(type(v) == "number" and v == v and v ~= math.huge and v ~= -math.huge, field, v, what or "a finite number")
end
local function object(field, v) must(type(v) == "table", field, v, "a JSON object") end
local function optional(check, field, v) if v ~= nil then check(field, v) end end
local function list(field, v)
  object(field, v)
  local n = 0
  for _ in pairs(v) do n = n + 1 end
  must(n == #v, field, v, "a list")
end

-- A list of positive integer sizes; returns their product (checked
-- against MAX_NUMEL as it grows, so that it cannot overflow).
local function shape(field, v)
  list(field, v)
  must(#v >= 1, field, v, "a list of at least one size")
  local n = 1
  for i, d in ipairs(v) do
    pos_int(("%s[%d]"):format(field, i), d)
    must(d <= MAX_NUMEL // n, field, v, ("a shape of at most 2^48 elements"))
    n = n * d
  end
  return n
end

local function same_list(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

local function sorted_keys(t)
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  return keys
end

local COUNTERS = { "step", "epoch", "batch_in_epoch", "micro_batches", "tokens_seen", "skipped_steps" }

-- One slice record (FORMATS.md, "Tensor files"): the shard within its full
-- tensor, the split table, the entry's elements within the shard.
local function check_slice(field, s, kind)
  object(field, s)
  shape(field .. ".full_shape", s.full_shape)
  local n = shape(field .. ".shape", s.shape)
  local full, sh = s.full_shape, s.shape
  must(#sh == #full, field .. ".shape", sh, ("a shape of as many dimensions as full_shape (%d)"):format(#full))
  local sp = s.split
  object(field .. ".split", sp)
  local f = field .. ".split"
  must(is_int(sp.dim) and sp.dim >= 0 and sp.dim <= #full, f .. ".dim", sp.dim,
    ("an integer from 0 (not split) to %d (the dimensions of full_shape)"):format(#full))
  must(is_int(sp.parts) and sp.parts >= 1, f .. ".parts", sp.parts, "an integer >= 1")
  must(is_int(sp.blocks) and sp.blocks >= 1, f .. ".blocks", sp.blocks, "an integer >= 1")
  must(is_int(sp.index) and sp.index >= 0 and sp.index < sp.parts, f .. ".index", sp.index,
    ("an integer from 0 to parts - 1 = %d"):format(sp.parts - 1))
  must(sp.dim >= 1 or sp.parts == 1, f .. ".parts", sp.parts, "1 when dim is 0 (not split)")
  local d = sp.dim
  if sp.sizes ~= nil then
    list(f .. ".sizes", sp.sizes)
    must(d >= 1, f .. ".dim", d, "a dimension (>= 1) when sizes are given")
    must(#sp.sizes == sp.blocks, f .. ".sizes", sp.sizes, ("a list of blocks = %d sizes"):format(sp.blocks))
    local sum = 0
    for i, b in ipairs(sp.sizes) do
      pos_int(("%s.sizes[%d]"):format(f, i), b)
      must(b % sp.parts == 0, ("%s.sizes[%d]"):format(f, i), b, ("divisible by parts = %d"):format(sp.parts))
      sum = sum + b
    end
    must(sum == full[d], f .. ".sizes", sp.sizes, ("sizes that add up to full_shape[%d] = %d"):format(d, full[d]))
  elseif d >= 1 and sp.parts > 1 then
    must(full[d] % (sp.blocks * sp.parts) == 0, field .. ".full_shape", full,
      ("divisible along dimension %d into blocks x parts = %d pieces"):format(d, sp.blocks * sp.parts))
  end
  for i = 1, #full do
    local want = (i == d and sp.parts > 1) and full[i] // sp.parts or full[i]
    must(sh[i] == want, ("%s.shape[%d]"):format(field, i), sh[i],
      ("%d (full_shape[%d]%s)"):format(want, i, want ~= full[i] and (" / parts = %d / %d"):format(full[i], sp.parts) or ""))
  end
  must(is_int(s.lo) and s.lo >= 0 and s.lo < n, field .. ".lo", s.lo,
    ("an element of the shard: an integer from 0 to %d"):format(n - 1))
  must(is_int(s.hi) and s.hi > s.lo and s.hi <= n, field .. ".hi", s.hi,
    ("an integer from lo + 1 = %d to the shard's %d elements"):format(s.lo + 1, n))
  if kind == "params" then
    must(s.lo == 0 and s.hi == n, field .. ".hi", s.hi, ("%d with lo = 0: a params file holds whole shards"):format(n))
  end
  optional(function(k, v) must(is_int(v) and v >= 1 and v <= full[1], k, v,
    ("an integer from 1 to full_shape[1] = %d"):format(full[1])) end, field .. ".valid_rows", s.valid_rows)
  for _, k in ipairs{ "tied_copy", "replicated" } do
    must(s[k] == nil or type(s[k]) == "boolean", field .. "." .. k, s[k], "true or false")
  end
end

-- Every element of every shard of each tensor comes from some file: the
-- pieces of (kind, name, shard index) cover [0, numel) without a gap.
local function check_coverage(pieces)
  for _, key in ipairs(sorted_keys(pieces)) do
    local t = pieces[key]
    for index = 0, t.parts - 1 do
      local spans = t.spans[index] or {}
      table.sort(spans, function(a, b) return a[1] < b[1] end)
      local at = 0
      for _, sp in ipairs(spans) do
        if sp[1] > at then break end
        if sp[2] > at then at = sp[2] end
      end
      if at < t.numel then
        local shard = t.parts > 1 and (" (shard %d of %d)"):format(index, t.parts) or ""
        fail_check("tensor_state: no %s file holds elements [%d, %d) of '%s'%s", t.kind, at, t.numel, t.name, shard)
      end
    end
  end
end

local function check_records(m)
  local ts = m.tensor_state
  object("tensor_state", ts)
  local sharded = ts.format == M.SHARDED
  must(sharded or ts.format == M.JSON_PER_RANK, "tensor_state.format", ts.format,
    ("'%s' or '%s'"):format(M.SHARDED, M.JSON_PER_RANK))
  list("tensor_state.files", ts.files)
  must(#ts.files >= 1, "tensor_state.files", ts.files, "a list of at least one file")
  local l = m.layout
  if sharded then
    object("model", m.model)
    local C = is_int(l.context) and l.context or 1
    must(l.tensor * C * l.pipeline * l.data == m.world_size, "world_size", m.world_size,
      C > 1 and ("layout.tensor x context x pipeline x data = %d"):format(l.tensor * C * l.pipeline * l.data)
        or ("layout.tensor x pipeline x data = %d"):format(l.tensor * l.pipeline * l.data))
  end
  local seen, ranks, pieces, optim_names, has_optim = {}, {}, {}, {}, false
  for i, r in ipairs(ts.files) do
    local field = ("tensor_state.files[%d]"):format(i)
    object(field, r)
    must(M.plain_name(r.file), field .. ".file", r.file,
      "the name of a file in the checkpoint directory (letters, digits, '_', '.', '-'; no '/', no '..')")
    if seen[r.file] then fail_check("%s.file '%s' is listed twice (also tensor_state.files[%d])", field, r.file, seen[r.file]) end
    seen[r.file] = i
    field = ("%s (%s)"):format(field, r.file)
    -- every file pipegoose writes has content (and an empty "file" could
    -- be a FIFO, which opening would wait on forever)
    pos_int(field .. ": bytes", r.bytes)
    must(is_int(r.crc32) and r.crc32 >= 0 and r.crc32 <= 0xFFFFFFFF, field .. ": crc32", r.crc32,
      "a crc32 (an integer from 0 to 0xffffffff)")
    if sharded then
      must(r.kind == "params" or r.kind == "optim", field .. ": kind", r.kind, "'params' or 'optim'")
      for _, k in ipairs{ { "tp", "tensor" }, { "pp", "pipeline" }, { "dp", "data" } } do
        -- with context parallelism dp is the place in data x context (the replicas of a tp, pp)
        local v, size = r[k[1]], l[k[2]] * (k[1] == "dp" and (l.context or 1) or 1)
        local what = k[1] == "dp" and (l.context or 1) > 1 and "data x layout.context" or k[2]
        must(is_int(v) and v >= 0 and v < size, field .. ": " .. k[1], v,
          ("an integer from 0 to layout.%s - 1 = %d"):format(what, size - 1))
      end
      -- expert parallelism: members 1 .. E - 1 of the first expert group write their experts apart (ep)
      local E = l.expert or 1
      must(r.ep == nil or (is_int(r.ep) and r.ep >= 1 and r.ep < E and r.dp == r.ep), field .. ": ep", r.ep,
        ("an integer from 1 to layout.expert - 1 = %d, equal to its dp"):format(E - 1))
      local ep = not (r.kind == "optim" and layout.sharded_optimizer(l.zero)) and r.ep or nil
      local want = r.kind == "params" and layout.params_file(r.tp, r.pp, ep)
        or layout.optim_file(r.tp, r.pp, layout.sharded_optimizer(l.zero) and r.dp or nil, ep)
      must(r.file == want, field .. ".file", r.file, ("'%s' (its kind, tp, pp%s%s)"):format(want,
        r.kind == "optim" and layout.sharded_optimizer(l.zero) and ", dp" or "", ep and ", ep" or ""))
      object(field .. ": slices", r.slices)
      if r.kind == "optim" then has_optim = true end
      for _, name in ipairs(sorted_keys(r.slices)) do
        local f = ("%s: slices[%s]"):format(field, show(name))
        if type(name) ~= "string" or name == "" then
          fail_check("%s: slices has the key %s; its keys are parameter names", field, show(name))
        end
        local s = r.slices[name]
        check_slice(f, s, r.kind)
        local key = r.kind .. "\0" .. name
        local t = pieces[key]
        if not t then
          t = { kind = r.kind, name = name, full = s.full_shape, split = s.split, parts = s.split.parts,
                numel = safetensors.numel(s.shape), spans = {}, field = f }
          pieces[key] = t
        else
          must(same_list(s.full_shape, t.full), f .. ".full_shape", s.full_shape,
            ("%s, as in %s"):format(show(t.full), t.field))
          local a, b = s.split, t.split
          must(a.dim == b.dim and a.parts == b.parts and a.blocks == b.blocks
            and table.concat(a.sizes or {}, ",") == table.concat(b.sizes or {}, ","), f .. ".split", a,
            ("the split of %s (all but index)"):format(t.field))
        end
        t.spans[s.split.index] = t.spans[s.split.index] or {}
        table.insert(t.spans[s.split.index], { s.lo, s.hi })
        if r.kind == "optim" then optim_names[name] = true end
      end
    else
      must(r.kind == "rank", field .. ": kind", r.kind, "'rank'")
      must(is_int(r.rank) and r.rank >= 0 and r.rank < m.world_size, field .. ": rank", r.rank,
        ("an integer from 0 to world_size - 1 = %d"):format(m.world_size - 1))
      must(r.file == ("rank-%05d.json"):format(r.rank), field .. ".file", r.file,
        ("'rank-%05d.json' (its rank)"):format(r.rank))
      ranks[r.rank] = true
    end
  end
  if sharded then
    check_coverage(pieces)
    if has_optim then
      for _, key in ipairs(sorted_keys(pieces)) do
        local t = pieces[key]
        if t.kind == "params" and not optim_names[t.name] then
          fail_check("tensor_state: no optim file holds the state of '%s'", t.name)
        end
      end
    end
  else
    for r = 0, m.world_size - 1 do
      if not ranks[r] then fail_check("tensor_state.files has no file for rank %d (world_size %d)", r, m.world_size) end
    end
  end
end

-- callback_files: { [state key] = { {file=, bytes=, crc32=}, ... } }: the tensor files a callback writes
-- beside the engine's (Handler:save_files); named like them, never one of theirs or listed twice.
local function check_callback_files(m)
  if m.callback_files == nil then return end
  object("callback_files", m.callback_files)
  local seen = {}
  for _, r in ipairs(m.tensor_state.files) do seen[r.file] = "tensor_state.files" end
  for _, key in ipairs(sorted_keys(m.callback_files)) do
    local field = ("callback_files[%s]"):format(show(key))
    must(type(key) == "string" and key ~= "", field, key, "a callback's state key")
    list(field, m.callback_files[key])
    for i, r in ipairs(m.callback_files[key]) do
      local f = ("%s[%d]"):format(field, i)
      object(f, r)
      must(M.plain_name(r.file), f .. ".file", r.file,
        "the name of a file in the checkpoint directory (letters, digits, '_', '.', '-'; no '/', no '..')")
      if seen[r.file] then fail_check("%s.file '%s' is listed twice (also in %s)", f, r.file, seen[r.file]) end
      seen[r.file] = f
      pos_int(f .. ": bytes", r.bytes)
      must(is_int(r.crc32) and r.crc32 >= 0 and r.crc32 <= 0xFFFFFFFF, f .. ": crc32", r.crc32,
        "a crc32 (an integer from 0 to 0xffffffff)")
    end
  end
end

local function check_manifest(m)
  nonneg_int("step", m.step)
  nonneg_int("epoch", m.epoch)
  pos_int("world_size", m.world_size)
  optional(nonneg_int, "saved_at", m.saved_at)
  local c = m.counters
  object("counters", c)
  for _, k in ipairs(COUNTERS) do nonneg_int("counters." .. k, c[k]) end
  pos_int("counters.accumulate", c.accumulate)
  must(c.step == m.step, "counters.step", c.step, ("step = %d"):format(m.step))
  must(c.epoch == m.epoch, "counters.epoch", c.epoch, ("epoch = %d"):format(m.epoch))
  must(c.skipped_steps <= c.step, "counters.skipped_steps", c.skipped_steps, ("at most counters.step = %d"):format(c.step))
  local lr = m.lr
  object("lr", lr)
  local function rate(k, v) finite_number(k, v); must(v >= 0, k, v, "a learning rate >= 0") end
  optional(rate, "lr.base_lr", lr.base_lr)
  optional(rate, "lr.last_lr", lr.last_lr)
  optional(nonneg_int, "lr.schedule_step", lr.schedule_step)
  optional(nonneg_int, "lr.total_steps", lr.total_steps)
  object("metrics", m.metrics)
  object("callbacks", m.callbacks)
  optional(object, "data", m.data)
  if m.data_ranks ~= nil then
    list("data_ranks", m.data_ranks)
    for i, d in ipairs(m.data_ranks) do object(("data_ranks[%d]"):format(i), d) end
  end
  optional(object, "model", m.model)
  if m.rng ~= nil then
    object("rng", m.rng)
    for _, k in ipairs{ "trainer_seed", "context_seed" } do
      must(m.rng[k] == nil or is_int(m.rng[k]), "rng." .. k, m.rng[k], "an integer")
    end
  end
  local l = m.layout
  object("layout", l)
  for _, k in ipairs{ "tensor", "pipeline", "data", "world_size" } do pos_int("layout." .. k, l[k]) end
  must(l.zero == 0 or l.zero == 1 or l.zero == 2 or l.zero == 3, "layout.zero", l.zero, "0, 1, 2 or 3")
  optional(pos_int, "layout.expert", l.expert)
  optional(pos_int, "layout.context", l.context)
  must(l.expert == nil or l.data % l.expert == 0, "layout.expert", l.expert,
    ("a divisor of layout.data = %s"):format(show(l.data)))
  must(l.world_size == m.world_size, "layout.world_size", l.world_size, ("world_size = %d"):format(m.world_size))
  optional(pos_int, "layout.micro_batches", l.micro_batches)
  optional(pos_int, "layout.virtual_stages", l.virtual_stages) -- absent before interleaved pipelines: 1
  local o = m.optimizer
  if o ~= nil then
    object("optimizer", o)
    must(type(o.type) == "string", "optimizer.type", o.type, "a string ('AdamW' or 'lua')")
    if o.type == "AdamW" then
      nonneg_int("optimizer.step", o.step)
      must(o.zero == l.zero, "optimizer.zero", o.zero, ("layout.zero = %s"):format(show(l.zero)))
      local h = o.hparams
      object("optimizer.hparams", h)
      local function range(k, lo, hi, what)
        local v = h[k]
        finite_number("optimizer.hparams." .. k, v, what)
        must(v >= lo and v < hi, "optimizer.hparams." .. k, v, what)
      end
      range("lr", 0, math.huge, "a learning rate >= 0")
      range("beta1", 0, 1, "in [0, 1)")
      range("beta2", 0, 1, "in [0, 1)")
      range("eps", 0, math.huge, "a finite number >= 0")
      range("weight_decay", 0, math.huge, "a finite number >= 0")
    end
  end
  check_records(m)
  check_callback_files(m)
end

--- The first problem of a decoded manifest (every field FORMATS.md
-- describes, the file records and their slices), as a message naming the
-- manifest and the field; nil when it is sound.
function M.manifest_problem(dir, manifest)
  local ok, err = pcall(check_manifest, manifest)
  if ok then return nil end
  if getmetatable(err) == Problem then return ("checkpoint: %s/%s: %s"):format(dir, M.MANIFEST, err.msg) end
  error(err, 0) -- a bug in the checks themselves, not a bad manifest
end

-- emit() is json.lua's (M.encode writes with it); the seal is the crc32 of
-- the text it makes for the manifest without the seal key.
local function seal_crc(raw)
  local saved = raw[M.SEAL_KEY]
  raw[M.SEAL_KEY] = nil
  local ok, out = pcall(function()
    local parts = {}
    emit(raw, parts, 0)
    return table.concat(parts)
  end)
  raw[M.SEAL_KEY] = saved
  if not ok then return nil end
  return fs.crc32_of(out)
end

--- The text to write for a manifest: its JSON with manifest_crc32, the
-- crc32 of the JSON of everything else (keys sorted, as M.encode writes).
-- Returns the text and the crc32.
function M.seal(manifest)
  local body = {}
  for k, v in pairs(manifest) do if k ~= M.SEAL_KEY then body[k] = v end end
  local crc = fs.crc32_of(json.encode(body, "manifest"))
  body[M.SEAL_KEY] = crc
  return json.encode(body, "manifest"), crc
end

--- Reads and validates a checkpoint's manifest: JSON, format and version,
-- the seal, then every field (M.manifest_problem). Raises the first problem.
-- opts.unsealed accepts a manifest without a seal, opts.reseal one whose
-- seal does not match (scripts/checkpoint.lua seal); the manifest's own
-- seal is returned second (nil when it has none), and whether it matched.
function M.read_manifest(dir, opts)
  opts = opts or {}
  local path = dir .. "/" .. M.MANIFEST
  local text = fs.read(path)
  if not text then error(("checkpoint: %s: missing (not a complete checkpoint)"):format(path), 0) end
  local ok, raw = pcall(cjson.decode, text)
  if not ok then error(("checkpoint: %s: not valid JSON (%s)"):format(path, tostring(raw)), 0) end
  if type(raw) ~= "table" or (next(raw) ~= nil and #raw > 0) then
    error(("checkpoint: %s: not a manifest (a JSON object)"):format(path), 0)
  end
  -- the version first: another version may seal its manifests otherwise
  if raw.format_version ~= M.FORMAT_VERSION then
    error(("checkpoint: %s: format_version %s is not supported (this version reads %d)"):format(path,
      show(raw.format_version), M.FORMAT_VERSION), 0)
  end
  if raw.format ~= M.FORMAT then
    error(("checkpoint: %s: format %s is not '%s'"):format(path, show(raw.format), M.FORMAT), 0)
  end
  local sealed, matched = raw[M.SEAL_KEY], false
  if sealed == nil then
    if not opts.unsealed then
      error(("checkpoint: %s: has no %s, so its contents cannot be checked (saved before pipegoose sealed "
        .. "manifests, or written by hand); `pglua scripts/checkpoint.lua seal %s` validates the checkpoint and seals it")
        :format(path, M.SEAL_KEY, dir), 0)
    end
  else
    local n = math.tointeger(sealed)
    if n == nil or n < 0 or n > 0xFFFFFFFF then
      error(("checkpoint: %s: %s is %s, not a crc32"):format(path, M.SEAL_KEY, show(sealed)), 0)
    end
    local crc = seal_crc(raw)
    matched = crc == n
    if not matched and not opts.reseal then
      error(("checkpoint: %s: checksum mismatch: the contents have crc32 %08x, %s says %08x (the manifest is "
        .. "corrupt or was edited; `pglua scripts/checkpoint.lua seal --force %s` re-seals a deliberate edit)")
        :format(path, crc or 0, M.SEAL_KEY, n, dir), 0)
    end
    sealed = n
  end
  raw[M.SEAL_KEY] = nil
  local ok2, manifest = pcall(unpack, raw)
  if not ok2 then error(("checkpoint: %s: %s"):format(path, tostring(manifest):gsub("^checkpoint: ", "")), 0) end
  local problem = M.manifest_problem(dir, manifest)
  if problem then error(problem, 0) end
  return manifest, sealed, matched
end

-- A safetensors file's header against the manifest's slices: every entry
-- there, float32, shaped as the slice says, and nothing else in the file.
local function header_problem(path, rec)
  local ok, h = pcall(safetensors.read_header, path)
  if not ok then return "checkpoint: " .. tostring(h) end
  local listed = {}
  for _, name in ipairs(sorted_keys(rec.slices)) do
    local s = rec.slices[name]
    local whole = s.lo == 0 and s.hi == safetensors.numel(s.shape)
    local want = whole and s.shape or { s.hi - s.lo }
    for _, e in ipairs(rec.kind == "optim" and { "m/" .. name, "v/" .. name } or { name }) do
      listed[e] = true
      local got = h.entries[e]
      if not got then return ("checkpoint: %s: has no tensor '%s' (the manifest lists it)"):format(path, e) end
      if got.dtype ~= "float32" then
        return ("checkpoint: %s: '%s' is %s; checkpoints hold float32 (F32) tensors"):format(path, e, got.dtype)
      end
      if not same_list(got.shape, want) then
        return ("checkpoint: %s: '%s' has shape %s, the manifest says %s"):format(path, e, show(got.shape), show(want))
      end
    end
  end
  for _, e in ipairs(h.names) do
    if not listed[e] then return ("checkpoint: %s: holds '%s', which the manifest does not list"):format(path, e) end
  end
  return nil
end

--- One file the manifest lists (rec, from a manifest read_manifest passed):
-- inside the checkpoint directory once links are resolved, its size and
-- crc32, and for safetensors files the header against the manifest's
-- slices. nil when good, else a message naming the file and the problem.
function M.check_file(dir, rec)
  local path = dir .. "/" .. rec.file
  local core = core_module()
  if core and core.file and core.file.realpath then
    local real, home = core.file.realpath(path), core.file.realpath(dir)
    if real and home and real:sub(1, #home + 1) ~= home .. "/" then
      return ("checkpoint: %s: is a link to %s, outside the checkpoint directory %s"):format(path, real, home)
    end
  end
  -- the size from stat(2) before anything opens the file: a FIFO or a
  -- device in its place shows as a wrong size instead of blocking a read
  local size
  if core and core.file and core.file.size then
    local ok, n = pcall(core.file.size, path)
    if not ok then return ("checkpoint: %s: missing (the manifest lists it with %d bytes)"):format(path, rec.bytes) end
    size = n
  else
    local f = io.open(path, "rb")
    if not f then return ("checkpoint: %s: missing (the manifest lists it with %d bytes)"):format(path, rec.bytes) end
    size = f:seek("end")
    f:close()
    if size == nil then return ("checkpoint: %s: not a regular file"):format(path) end
  end
  if size ~= rec.bytes then
    return ("checkpoint: %s: %s: %d bytes on disk, the manifest says %d"):format(path,
      size < rec.bytes and "truncated" or "wrong size", size, rec.bytes)
  end
  local crc = core and core.file and core.file.crc32(path) or fs.crc32_of(fs.read(path) or "")
  if crc ~= rec.crc32 then
    return ("checkpoint: %s: checksum mismatch: crc32 %08x on disk, %08x in the manifest (the file is corrupt)")
      :format(path, crc, rec.crc32)
  end
  if rec.kind == "params" or rec.kind == "optim" then return header_problem(path, rec) end
  return nil
end

--- Validates a checkpoint directory: the manifest (M.read_manifest) and the
-- files it lists (M.check_file; opts.files: a set of names to check, else
-- all). Returns the problems (a list of messages, empty when good; a bad
-- manifest is the only one) and the manifest.
function M.validate(dir, opts)
  opts = opts or {}
  dir = dir:gsub("/+$", "")
  local ok, manifest = pcall(M.read_manifest, dir, opts)
  if not ok then return { tostring(manifest) } end
  local problems = {}
  local recs = {}
  for _, rec in ipairs(manifest.tensor_state.files) do recs[#recs + 1] = rec end
  for _, key in ipairs(sorted_keys(manifest.callback_files or {})) do
    for _, rec in ipairs(manifest.callback_files[key]) do recs[#recs + 1] = rec end
  end
  for _, rec in ipairs(recs) do
    if opts.files == nil or opts.files[rec.file] then
      problems[#problems + 1] = M.check_file(dir, rec)
    end
  end
  return problems, manifest
end

------------------------------------------------------------------------------
-- Finding a checkpoint

--- The newest complete checkpoint under parent (from its `latest` file), or nil.
function M.latest(parent)
  local text = fs.read(parent .. "/" .. M.LATEST)
  if not text then return nil end
  local name = text:match("^%s*(.-)%s*$")
  if name == "" then return nil end
  if not M.plain_name(name) then
    error(("checkpoint: %s/%s names %s, which is not a checkpoint directory inside %s"):format(parent, M.LATEST,
      show(name), parent), 0)
  end
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

return M
