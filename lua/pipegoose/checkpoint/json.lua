--- Exact JSON for plain Lua values (and tensors): M.encode and M.decode
-- (pipegoose.checkpoint.encode, .decode), the text of manifests, of the
-- json-per-rank state, of the file records the ranks gather and of lock
-- files. A module of its own because it is a format of its own
-- (docs/FORMATS.md: integers, floats, keys and tensors tagged "#i:", "#f:",
-- "#s:", "#b:", "#tensor"), which knows nothing of manifests or shards.
-- M.emit, M.unpack and M.cjson (strict: no NaN, Infinity or hex numbers)
-- are for manifest.lua: the seal is the crc32 of emit's text, and a
-- manifest is decoded raw, its seal checked, and only then unpacked.
local cjson = require("cjson").new()
if cjson.encode_escape_forward_slash then cjson.encode_escape_forward_slash(false) end
-- strict JSON: NaN, Infinity and hex numbers in a manifest are corruption
-- (pipegoose writes them as "#f:nan" strings), not values
if cjson.decode_invalid_numbers then cjson.decode_invalid_numbers(false) end
local core_module = require("pipegoose.checkpoint.fs").core_module

local M = {}

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

M.emit = emit
M.unpack = unpack
M.cjson = cjson

return M
