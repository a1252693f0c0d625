--- The safetensors file layout (https://github.com/huggingface/safetensors):
--
--   8 bytes        N, the header's length, unsigned little-endian
--   N bytes        a JSON object: for every tensor
--                    "name": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}
--                  (dtypes read: F32, BF16, F16 -- float16 tensors, which
--                  ops.from_f16 widens exactly -- and I32)
--                  (offsets in bytes from the start of the data), and optionally
--                  "__metadata__": {string: string}; padded with spaces to a multiple of 8
--   the data       each tensor's raw little-endian bytes, row-major, in header order,
--                  with no gaps
--
--   safetensors.write(path, entries, metadata) -> crc32, bytes
--       entries: list of {name=, tensor=, shape= (default: the tensor's)}; the
--       tensor must be contiguous (parameter views and narrow(1, ...) are);
--       one on a device is copied to the host first.
--       metadata: table of string values. Written through pg.file.write: a
--       temporary name, fsync, rename, fsync of the directory.
--   safetensors.read_header(path) -> header
--       header.entries[name] = {dtype=, shape=, numel=, offset= (absolute byte
--       offset in the file), bytes=}, header.names (in data order),
--       header.metadata, header.data_start, header.size.
--       Errors name the file and the problem (missing, truncated, not JSON...).
--   safetensors.read(header, name [, first, count]) -> tensor: the whole entry
--       in its shape, or elements [first, first + count) (0-based) as a 1-d tensor.
local cjson = require("cjson").new()

local M = {}

local DTYPES = {
  F32 = { name = "float32", size = 4 }, I32 = { name = "int32", size = 4 }, BF16 = { name = "bfloat16", size = 2 },
  F16 = { name = "float16", size = 2 },
}
local CODES = { float32 = "F32", int32 = "I32", bfloat16 = "BF16", float16 = "F16" }
M.DTYPES = DTYPES

local MAX_HEADER = 100 * 1024 * 1024

local function core() return require "pipegoose.core" end

--- Elements in a tensor of this shape (a list of sizes); nil when the count
-- does not fit 2^53 (a header that lies: 2^32 x 2^32 would wrap to 0 in
-- integer arithmetic and pass for an empty tensor).
local function numel(shape)
  local n, approx = 1, 1.0
  for _, d in ipairs(shape) do
    n, approx = n * d, approx * d
  end
  if approx >= 2 ^ 53 then return nil end
  return n
end
M.numel = numel

local function fail(path, fmt, ...)
  error(("%s: " .. fmt):format(path, ...), 0)
end

--- The JSON header text (padded to a multiple of 8) for entries, and the data byte count.
function M.header_text(entries, metadata)
  local parts, off = {}, 0
  for _, e in ipairs(entries) do
    local code, shape, bytes
    local t = e.tensor
    local code = CODES[t:dtype()] or error(("safetensors: %s has dtype %s, which has no code"):format(e.name, t:dtype()))
    local shape = e.shape or t:shape()
    if (numel(shape) or -1) ~= t:numel() then
      error(("safetensors: %s: shape [%s] for a tensor of %d elements"):format(e.name, table.concat(shape, ", "), t:numel()))
    end
    local bytes = t:numel() * DTYPES[code].size
    local dims = {}
    for i, d in ipairs(shape) do dims[i] = ("%d"):format(d) end
    parts[#parts + 1] = ('%s:{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}'):format(cjson.encode(e.name), code,
      table.concat(dims, ","), off, off + bytes)
    off = off + bytes
  end
  if metadata and next(metadata) then
    local keys = {}
    for k in pairs(metadata) do keys[#keys + 1] = k end
    table.sort(keys)
    local kv = {}
    for i, k in ipairs(keys) do
      local v = metadata[k]
      if type(k) ~= "string" or type(v) ~= "string" then error("safetensors: __metadata__ keys and values must be strings") end
      kv[i] = cjson.encode(k) .. ":" .. cjson.encode(v)
    end
    table.insert(parts, 1, '"__metadata__":{' .. table.concat(kv, ",") .. "}")
  end
  local text = "{" .. table.concat(parts, ",") .. "}"
  text = text .. string.rep(" ", (-#text) % 8)
  return text, off
end

--- Writes a safetensors file atomically; returns its crc32 and size in bytes.
function M.write(path, entries, metadata)
  local text = M.header_text(entries, metadata)
  local parts = { string.pack("<I8", #text) .. text }
  -- a device tensor (engine:parameters() of a device engine) is copied to the host
  for _, e in ipairs(entries) do
    parts[#parts + 1] = e.tensor:device() == "cpu" and e.tensor or e.tensor:to("cpu")
  end
  return core().file.write(path, parts)
end

local function int_list(path, name, what, v)
  if type(v) ~= "table" then fail(path, "bad header: %s of '%s' is not a list", what, name) end
  local out = {}
  for i, x in ipairs(v) do
    local n = math.tointeger(x)
    if n == nil or n < 0 then fail(path, "bad header: %s of '%s' has %s", what, name, tostring(x)) end
    out[i] = n
  end
  return out
end

--- Reads and checks the header (see the top of this file).
function M.read_header(path)
  local has_core, c = pcall(core)
  if has_core and c.fs.is_dir(path) then fail(path, "is a directory, not a safetensors file") end
  local f, err = io.open(path, "rb")
  if not f then fail(path, "missing or unreadable (%s)", tostring(err)) end
  local size = f:seek("end")
  f:seek("set", 0)
  if size < 8 then
    f:close()
    fail(path, "truncated: %d bytes, too short for a safetensors header", size)
  end
  local n = string.unpack("<I8", f:read(8))
  if n < 2 or n > size - 8 or n > MAX_HEADER then
    f:close()
    fail(path, "%s: the header length is %d bytes but the file has %d bytes", n > size - 8 and "truncated" or "bad header",
      n, size)
  end
  local text = f:read(n)
  f:close()
  local ok, h = pcall(cjson.decode, text)
  if not ok or type(h) ~= "table" then fail(path, "bad header: not a JSON object (%s)", tostring(h)) end
  local header = { path = path, entries = {}, names = {}, metadata = {}, data_start = 8 + n, size = size }
  local data_bytes = size - 8 - n
  local spans = {}
  for name, e in pairs(h) do
    if name == "__metadata__" then
      if type(e) ~= "table" then fail(path, "bad header: __metadata__ is not an object") end
      for k, v in pairs(e) do header.metadata[k] = v end
    else
      if type(e) ~= "table" then fail(path, "bad header: entry '%s' is not an object", name) end
      local dt = DTYPES[e.dtype]
      if not dt then fail(path, "entry '%s' has dtype %s, which this reader does not know", name, tostring(e.dtype)) end
      local shape = int_list(path, name, "shape", e.shape)
      local offs = int_list(path, name, "data_offsets", e.data_offsets)
      local count = numel(shape)
      if not count then fail(path, "bad header: '%s' has shape [%s], too large to be real", name, table.concat(shape, ", ")) end
      if #offs ~= 2 or offs[2] - offs[1] ~= count * dt.size then
        fail(path, "bad header: '%s' has data_offsets that do not hold %d %s values", name, count, e.dtype)
      end
      if offs[2] > data_bytes then
        fail(path, "truncated: '%s' ends at data byte %d, but the file holds %d data bytes", name, offs[2], data_bytes)
      end
      header.entries[name] = { name = name, dtype = dt.name, shape = shape, numel = count,
                               offset = 8 + n + offs[1], bytes = offs[2] - offs[1] }
      spans[#spans + 1] = { offs[1], offs[2], name }
    end
  end
  table.sort(spans, function(a, b) return a[1] < b[1] end)
  local at = 0
  for _, s in ipairs(spans) do
    if s[1] ~= at then fail(path, "bad header: '%s' starts at data byte %d, expected %d (gap or overlap)", s[3], s[1], at) end
    at = s[2]
    header.names[#header.names + 1] = s[3]
  end
  if at ~= data_bytes then
    fail(path, "%s: the header describes %d data bytes, the file holds %d", at < data_bytes and "trailing bytes" or "truncated",
      at, data_bytes)
  end
  return header
end

--- One entry as a tensor (its shape), or elements [first, first + count) of it as a 1-d tensor.
function M.read(header, name, first, count)
  local e = header.entries[name]
  if not e then fail(header.path, "has no tensor '%s'", name) end
  first = first or 0
  count = count or (e.numel - first)
  if first < 0 or first + count > e.numel then
    fail(header.path, "'%s' has %d elements; asked for [%d, %d)", name, e.numel, first, first + count)
  end
  local size = DTYPES[CODES[e.dtype]].size
  local t = core().file.read(header.path, e.offset + first * size, count, e.dtype)
  if first == 0 and count == e.numel and #e.shape > 0 then return t:reshape(e.shape) end
  return t
end

return M
