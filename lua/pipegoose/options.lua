--- pipegoose.options: the one checker of options tables.
--
-- Every public constructor and options table of pipegoose goes through it, so
-- that unknown keys, wrong types and out-of-range values fail the same way:
--
--   GPT: unknown option 'lyers' (did you mean 'layers'?)
--   GPT: padded_vocab must be a positive integer, got 65.5
--   GPT: vocab= is required (a positive integer)
--   parallelize: shared_memory must be a boolean, got 'yes'
--
-- A schema maps each known key to a validator:
--
--   local opt = require "pipegoose.options"
--   local SCHEMA = {
--     vocab = opt.integer{ min = 1, required = true },
--     eps = opt.number{ gt = 0, default = 1e-5 },
--     parallel = opt.enum{ "column", "row" },
--     betas = opt.list(opt.number{ min = 0, lt = 1 }, { len = 2 }),
--     path = opt.either(opt.string, opt.list(opt.string)),
--     ctx = opt.context,                        -- a pg.ParallelContext (opt.userdata(mt_name, what))
--     engine = opt.check_with("an engine", function(v) ... end),
--     clock = opt.callable{ what = "a function returning seconds" }, -- a function or a callable table
--     on_nan = opt.enum({ "error", "skip" }, { explain = { error = "stop with an error", skip = "skip the step" } }),
--     name = "string",                          -- shorthand: "string", "boolean", "table", "function", "callable", "any"
--   }
--   local o = opt.check("GPT", user_options, SCHEMA)
--
-- check returns a new table (the user's is not changed): every value checked,
-- integral floats turned into integers (8.0 -> 8), defaults filled in. Keys
-- are checked in sorted order, so every rank of a job reports the same first
-- problem (the error report agrees across ranks on the message).
--
-- Integers default to what a C int holds (below 2^31): sizes go to C ints, and
-- a larger value must be an error, not a silently cut number; give `max` for
-- wider integers (seeds: max = math.maxinteger). Numbers must be finite
-- unless `finite = false`.
--
-- The C bindings check their option keys with pg_lua_check_keys
-- (src/lua/lua_util.c), which asks this module for its message, so a suggestion
-- reads the same from C and from Lua. This module is plain Lua (no MPI, no C
-- core), so that code unit-tested without the runtime can use it too.
local M = {}

local INT_MAX = 2147483647

---------------------------------------------------------------- names

--- Levenshtein distance between two strings.
function M.distance(a, b)
  local prev = {}
  for j = 0, #b do prev[j] = j end
  for i = 1, #a do
    local cur = { [0] = i }
    local ca = a:byte(i)
    for j = 1, #b do
      local cost = (ca == b:byte(j)) and 0 or 1
      cur[j] = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
    end
    prev = cur
  end
  return prev[#b]
end

--- The name in `names` closest to `name`, and its distance (the first in list order on ties).
function M.closest(name, names)
  local best, bestd
  for _, n in ipairs(names) do
    local d = M.distance(name, n)
    if not bestd or d < bestd then best, bestd = n, d end
  end
  return best, bestd
end

--- " (did you mean 'x'?)" when a name is close enough to be a likely typo, else "".
-- Close enough: at most max(2, #name // 3) edits (a third of a long name).
function M.suggestion(name, names)
  local best, d = M.closest(name, names)
  if best and d <= math.max(2, #name // 3) then return (" (did you mean '%s'?)"):format(best) end
  return ""
end

-- error's level, counted from the function that called check or value: 0
-- stays 0 (no position: the check runs later than the user's line, say while
-- parallelize describes the model).
local function level_of(level)
  if level == 0 then return 0 end
  return (level or 2) + 1
end

--- How a value reads in a message: strings quoted, NaN without its sign, tables by kind.
function M.show(v)
  local t = type(v)
  if t == "string" then return ("'%s'"):format(v) end
  if t == "number" then
    if v ~= v then return "nan" end
    return tostring(v)
  end
  if t == "nil" or t == "boolean" then return tostring(v) end
  return "a " .. t
end

local function show_key(k)
  if type(k) == "string" then return "'" .. k .. "'" end
  return "[" .. M.show(k) .. "]"
end

--- The message for an unknown key: "where: unknown option 'k' (did you mean 'x'?)",
-- or the known names when none is close. `known`: a list of names; `prefix`
-- (optional) is put before every name shown (a nested table's "split.").
function M.unknown_message(where, key, known, prefix)
  prefix = prefix or ""
  local sorted = {}
  for i, k in ipairs(known) do sorted[i] = k end
  table.sort(sorted)
  local hint = ""
  if type(key) == "string" then
    local best, d = M.closest(key, sorted)
    if best and d <= math.max(2, #key // 3) then hint = (" (did you mean '%s%s'?)"):format(prefix, best) end
  end
  if hint == "" then
    local shown = {}
    for i, k in ipairs(sorted) do shown[i] = prefix .. k end
    hint = (" (known: %s)"):format(table.concat(shown, ", "))
  end
  local k = type(key) == "string" and ("'%s%s'"):format(prefix, key) or show_key(key)
  return ("%s: unknown option %s%s"):format(where, k, hint)
end

---------------------------------------------------------------- validators
-- A validator is a table {what = "what the value must be", test = function(v) ->
-- true, normalised value | false, what (a more precise expectation) [, got]},
-- with optional `required` and `default`.

local Validator = {}
Validator.__index = Validator

local function validator(what, test, spec)
  spec = spec or {}
  return setmetatable({ what = spec.what or what, test = test, required = spec.required, default = spec.default },
    Validator)
end
M.validator = validator

local function is_validator(x) return getmetatable(x) == Validator end

local function fmt_num(x)
  if x == INT_MAX + 1 then return "2^31" end
  return tostring(x)
end

--- Integers: opt.integer{min=, max= (default 2^31 - 1), required=, default=}.
-- Integral floats pass and become integers (8.0 -> 8); 65.5, "8", nan do not.
function M.integer(spec)
  spec = spec or {}
  local lo, hi = spec.min, spec.max or INT_MAX
  if lo == math.mininteger then lo = nil end
  local bounded = spec.max ~= nil and spec.max ~= math.maxinteger -- a bound of the option's own
  local what
  if lo == 1 or lo == 0 then what = lo == 1 and "a positive integer" or "a non-negative integer"
  elseif lo and bounded then what = ("an integer in [%s, %s]"):format(fmt_num(lo), fmt_num(hi))
  elseif lo then what = ("an integer >= %s"):format(fmt_num(lo))
  elseif bounded then what = ("an integer <= %s"):format(fmt_num(hi))
  else what = "an integer" end
  -- too large: say the bound where `what` does not
  local too_big = what
  if spec.what then what, too_big = spec.what, spec.what
  elseif spec.max == nil then too_big = what .. " below 2^31" -- the C int's bound
  elseif bounded and (lo == 0 or lo == 1) then too_big = ("%s <= %s"):format(what, fmt_num(hi)) end
  return validator(what, function(v)
    local i = type(v) == "number" and math.tointeger(v) or nil
    if i == nil then return false, what end
    if lo and i < lo then return false, what end
    if i > hi then return false, too_big end
    return true, i
  end, spec)
end

--- Numbers: opt.number{min= (>=), gt= (>), max= (<=), lt= (<), finite = true, required=, default=}.
-- finite = false with no bounds is a type check only (NaN and infinities pass: their values are checked elsewhere).
function M.number(spec)
  spec = spec or {}
  local finite = spec.finite ~= false
  local lo, lo_open = spec.gt or spec.min, spec.gt ~= nil
  local hi, hi_open = spec.lt or spec.max, spec.lt ~= nil
  local what = finite and "a finite number" or "a number"
  if lo and hi then
    what = ("%s in %s%s, %s%s"):format(what, lo_open and "(" or "[", fmt_num(lo), fmt_num(hi), hi_open and ")" or "]")
  elseif lo then what = ("%s %s %s"):format(what, lo_open and ">" or ">=", fmt_num(lo))
  elseif hi then what = ("%s %s %s"):format(what, hi_open and "<" or "<=", fmt_num(hi)) end
  what = spec.what or what
  return validator(what, function(v)
    if type(v) ~= "number" then return false, what end
    if v ~= v and (finite or lo or hi) then return false, what end
    if finite and (v == math.huge or v == -math.huge) then return false, what end
    if lo and (v < lo or (lo_open and v == lo)) then return false, what end
    if hi and (v > hi or (hi_open and v == hi)) then return false, what end
    return true, v
  end, spec)
end

local function of_type(t, what)
  return function(spec)
    local w = spec and spec.what or what
    return validator(w, function(v)
      if type(v) ~= t then return false, w end
      return true, v
    end, spec)
  end
end

M.boolean = of_type("boolean", "a boolean")
M.string = of_type("string", "a string")
M.table = of_type("table", "a table")
M.func = of_type("function", "a function")

--- A function or a value with a __call metamethod (pg.lr.cosine{...}, a callable
-- table): opt.callable{what = "a function returning seconds", ...}.
function M.callable(spec)
  local what = spec and spec.what or "a function or a callable table"
  return validator(what, function(v)
    if type(v) == "function" then return true, v end
    local mt = (type(v) == "table" or type(v) == "userdata") and getmetatable(v)
    if type(mt) == "table" and mt.__call ~= nil then return true, v end
    return false, what
  end, spec)
end

--- Any value (the key is known; its value is checked elsewhere).
function M.any(spec)
  return validator("anything", function(v) return true, v end, spec)
end

--- One of the given values, compared exactly (strings are case-sensitive):
-- opt.enum({ "column", "row" } [, {required=, default=, explain=}]). explain
-- maps a value to what it means, shown after it in the message:
--   opt.enum({ "error", "skip" }, { explain = { error = "stop with an error", skip = "skip the step" } })
--   -> on_nan must be 'error' (stop with an error) or 'skip' (skip the step), got 'ignore'
function M.enum(values, spec)
  local explain = spec and spec.explain or {}
  local shown = {}
  for i, v in ipairs(values) do
    shown[i] = M.show(v) .. (explain[v] and (" (%s)"):format(explain[v]) or "")
  end
  local what = #shown == 1 and shown[1]
    or (table.concat(shown, ", ", 1, #shown - 1) .. " or " .. shown[#shown])
  return validator(what, function(v)
    for _, x in ipairs(values) do if v == x then return true, v end end
    return false, what
  end, spec)
end

local SHORTHAND = { string = M.string, boolean = M.boolean, table = M.table, ["function"] = M.func, any = M.any,
                    integer = M.integer, number = M.number, callable = M.callable }
local CONSTRUCTORS = {}
for _, f in pairs(SHORTHAND) do CONSTRUCTORS[f] = true end

-- A schema entry: a validator, a type name ("string", ...) or a validator
-- constructor not called (opt.boolean for opt.boolean()).
local function as_validator(v)
  if is_validator(v) then return v end
  if type(v) == "string" and SHORTHAND[v] then return SHORTHAND[v]() end
  if CONSTRUCTORS[v] then return v() end
  error("options: a schema entry must be a validator or one of string, boolean, table, function, any, integer, "
    .. "number, callable, got " .. tostring(v), 3)
end
M.as_validator = as_validator

--- A list (a table with entries 1..n and nothing else) whose entries pass `elem`:
-- opt.list(elem [, {len=, min_len=, what=, required=, default=}]). A failing entry is named "key[i]".
function M.list(elem, spec)
  spec = spec or {}
  elem = as_validator(elem)
  local what = spec.what or (spec.len and ("a list of %d values"):format(spec.len)) or "a list"
  local v = validator(what, nil, spec)
  v.test = function(t, key)
    if type(t) ~= "table" then return false, what end
    local n = #t
    for k in pairs(t) do
      if math.type(k) ~= "integer" or k < 1 or k > n then return false, what end
    end
    if (spec.len and n ~= spec.len) or (spec.min_len and n < spec.min_len) then
      return false, what, ("a list of %d"):format(n)
    end
    local out = {}
    for i = 1, n do
      local ok, val = elem.test(t[i], ("%s[%d]"):format(key, i))
      if not ok then return false, val, M.show(t[i]), ("%s[%d]"):format(key, i) end
      out[i] = val
    end
    return true, out
  end
  return v
end

--- The first of several validators that accepts: opt.either(opt.string, opt.list(opt.string)).
function M.either(...)
  local vs = { ... }
  local whats = {}
  for i, x in ipairs(vs) do vs[i] = as_validator(x); whats[i] = vs[i].what end
  local what = table.concat(whats, " or ")
  return validator(what, function(v, key)
    local detail
    for _, x in ipairs(vs) do
      local ok, res, got, sub = x.test(v, key)
      if ok then return true, res end
      if sub then detail = { res, got, sub } end -- the value had this one's shape: its entry is what is wrong
    end
    if detail then return false, detail[1], detail[2], detail[3] end
    return false, what
  end)
end

--- A value accepted by a predicate: opt.check_with("a pg.ParallelContext", function(v) return ... end [, spec]).
function M.check_with(what, pred, spec)
  return validator(what, function(v)
    if pred(v) then return true, v end
    return false, what
  end, spec)
end

--- A userdata of the C module by its metatable's name: opt.userdata("pg.ParallelContext", "a pg.ParallelContext").
function M.userdata(mt_name, what, spec)
  return M.check_with(what, function(v)
    local mt = type(v) == "userdata" and getmetatable(v)
    return type(mt) == "table" and mt.__name == mt_name
  end, spec)
end

--- A ParallelContext (the validator every ctx= option uses).
M.context = M.userdata("pg.ParallelContext", "a pg.ParallelContext")

--- Returns a copy of a validator with `required = true` (or with a default).
function M.required(v)
  v = as_validator(v)
  local c = setmetatable({}, Validator)
  for k, x in pairs(v) do c[k] = x end
  c.required = true
  return c
end

---------------------------------------------------------------- checking

-- nil and the value (normalised, or the default), or the message without `where`.
local function problem(name, v, vd)
  if v == nil then
    if vd.required then return ("%s= is required (%s)"):format(name, vd.what) end
    return nil, vd.default
  end
  local ok, res, got, sub = vd.test(v, name)
  if not ok then return ("%s must be %s, got %s"):format(sub or name, res, got or M.show(v)) end
  return nil, res
end

--- Checks one value: returns it normalised (or the validator's default when nil),
-- or raises "where: name must be WHAT, got V". `level` as error's, counted from
-- the function that called value (default 2: its caller).
function M.value(where, name, v, vd, level)
  local msg, res = problem(name, v, as_validator(vd))
  if msg then error(where .. ": " .. msg, level_of(level)) end
  return res
end

--- Checks an options table against a schema {key = validator}; returns a new
-- table of the normalised values with defaults filled in.
--   how.level       error level as error's, counted from the function that called
--                   check (default 2: its caller, the user's line)
--   how.positional  integer keys 1..#o are positional arguments: copied unchecked
--   how.prefix      put before the keys in messages ("tensor_parallel." for a nested table)
--   how.required    the table itself is required: nil is an error (pg.Trainer() is not pg.Trainer{})
-- A nil `o` is an empty table, unless the schema has required keys or how.required.
function M.check(where, o, schema, how)
  how = how or {}
  local level, prefix = level_of(how.level), how.prefix or ""
  local known, required = {}, {}
  for k, v in pairs(schema) do
    known[#known + 1] = k
    schema[k] = as_validator(v) -- cached: schemas are the modules' constants
    if schema[k].required then required[#required + 1] = k end
  end
  table.sort(known)
  table.sort(required)
  if o == nil and #required == 0 and not how.required then o = {} end
  if type(o) ~= "table" then
    local need = #required > 0 and (" (%s=, ...)"):format(table.concat(required, "=, ")) or ""
    local what = prefix ~= "" and (prefix:gsub("%.$", "") .. " must be a table") or "expects a table of options"
    error(("%s: %s%s, got %s"):format(where, what, need, o == nil and "nothing" or M.show(o)), level)
  end
  local n = how.positional and #o or 0
  local unknown = {}
  for k in pairs(o) do
    local positional = math.type(k) == "integer" and k >= 1 and k <= n
    if not positional and schema[k] == nil then unknown[#unknown + 1] = k end
  end
  if #unknown > 0 then
    table.sort(unknown, function(a, b) return tostring(a) < tostring(b) end)
    error(M.unknown_message(where, unknown[1], known, prefix), level)
  end
  local out = {}
  for i = 1, n do out[i] = o[i] end
  for _, k in ipairs(known) do
    local msg, res = problem(prefix .. k, o[k], schema[k])
    if msg then error(where .. ": " .. msg, level) end
    out[k] = res
  end
  return out
end

return M
