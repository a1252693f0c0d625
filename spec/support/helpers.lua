-- Shared helpers for the specs: running commands (pglua, mpirun) and
-- capturing their output and exit status.
local M = {}

M.root = os.getenv("PG_ROOT") or "."
M.pglua = os.getenv("PGLUA") or "./pglua"
M.build = M.pglua:match("^(.*)/pglua$") or "build"
if M.build == "." then M.build = "build" end

local function quote(s)
  return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end
M.quote = quote

--- Runs a shell command; returns exit status, stdout+stderr text.
function M.sh(cmd)
  local f = assert(io.popen("( " .. cmd .. " ) 2>&1; echo \"__rc=$?\""))
  local out = f:read("a")
  f:close()
  local rc = tonumber(out:match("__rc=(%d+)%s*$"))
  return rc, (out:gsub("__rc=%d+%s*$", ""))
end

--- pglua with arguments (a list of strings).
function M.pglua_cmd(args)
  local parts = { quote(M.pglua) }
  for _, a in ipairs(args) do parts[#parts + 1] = quote(a) end
  return table.concat(parts, " ")
end

--- mpirun -np n pglua args... ; a hang guard (not a timing assertion) kills it after `limit` seconds.
--- A hang guard's seconds: `seconds` (default 60), times 4 under the
-- sanitizers (make asan: PG_SANITIZE=1), which slow every rank several-fold.
-- Not a timing assertion: a job past it is stuck or starved, and the guard
-- only keeps a hang from stopping the suite.
function M.limit(seconds)
  return (seconds or 60) * (os.getenv("PG_SANITIZE") and 4 or 1)
end

function M.mpirun_cmd(n, args, limit)
  return ("timeout -k 5 %d scripts/mpirun.sh -x PG_ABORT_GRACE -np %d %s"):format(M.limit(limit), n, M.pglua_cmd(args))
end

--- Whether tensor `got` is `want` to the tolerance the layout specs state:
-- |got - want| <= rtol |want| + atol * max(1, max |want|) element-wise, with
-- equal shapes and (unless zero_ok) a reference that is not all zeros.
-- Returns true, or false and what differs (for the spec's assert).
function M.scaled_close(got, want, rtol, atol, zero_ok)
  local gs, ws = table.concat(got:shape(), "x"), table.concat(want:shape(), "x")
  if gs ~= ws then return false, ("shape %s, want %s"):format(gs, ws) end
  local scale = 0
  for _, v in ipairs(want:reshape{ want:numel() }:totable()) do scale = math.max(scale, math.abs(v)) end
  if scale == 0 and not zero_ok then return false, "the reference is all zeros" end
  local tol = atol * math.max(1, scale)
  if got:allclose(want, rtol, tol) then return true end
  return false, ("max |diff| %.3g (max |want| %.3g, rtol %g, atol %.3g)"):format(got:max_abs_diff(want), scale, rtol, tol)
end

--- Asserts scaled_close(got, want, rtol, atol, zero_ok), naming `what` and the difference when it fails.
function M.assert_scaled_close(got, want, what, rtol, atol, zero_ok)
  local ok, why = M.scaled_close(got, want, rtol, atol, zero_ok)
  assert(ok, what .. ": " .. tostring(why))
end

--- The values of a tensor (or of a nested table, or a number) in row-major order, as one flat list.
function M.flat(t)
  if type(t) == "userdata" then t = t:totable() end
  local out = {}
  local function rec(x)
    if type(x) == "table" then
      for _, v in ipairs(x) do rec(v) end
    else
      out[#out + 1] = x
    end
  end
  rec(t)
  return out
end

--- Writes text to a fresh temporary file and returns its path.
--- A [rows, len] int32 batch of token ids below vocab, a fixed function of
-- seed (every rank builds the same): the distributed specs' inputs.
function M.token_batch(seed, rows, len, vocab)
  local t = {}
  for b = 1, rows do
    t[b] = {}
    for s = 1, len do t[b][s] = (seed * 7919 + b * 2713 + s * 337 + b * s * 41) % vocab end
  end
  return require("pipegoose").tensor(t, { dtype = "int32" })
end

function M.tmpfile(text, suffix)
  local path = os.tmpname() .. (suffix or ".lua")
  local f = assert(io.open(path, "w"))
  f:write(text)
  f:close()
  return path
end

--- Counts non-overlapping occurrences of a plain substring.
function M.count(haystack, needle)
  local n, i = 0, 1
  while true do
    local s, e = haystack:find(needle, i, true)
    if not s then return n end
    n, i = n + 1, e + 1
  end
end

--- The error reports of pglua in a job's output: { {ranks = {[r] = true, ...}, text = "..."}, ... } for
-- each line "[rank 2] ..." or "[ranks 0-3,5] ..." (one report for several ranks that failed alike).
function M.reports(out)
  local list = {}
  for line in out:gmatch("[^\n]+") do
    local spec, text = line:match("^%[ranks? ([%d,%-]+)%] (.*)$")
    if spec then
      local ranks = {}
      for part in spec:gmatch("[^,]+") do
        local a, b = part:match("^(%d+)%-(%d+)$")
        a, b = tonumber(a or part), tonumber(b or part)
        for r = a, b do ranks[r] = true end
      end
      list[#list + 1] = { ranks = ranks, text = text }
    end
  end
  return list
end

--- Whether rank r's error report in `out` contains `text` (plain), alone or in a report for several ranks.
function M.reported_by(out, r, text)
  for _, rep in ipairs(M.reports(out)) do
    if rep.ranks[r] and rep.text:find(text, 1, true) then return true end
  end
  return false
end

--- A fresh path under the system's temporary directory (not created).
function M.tmpdir()
  local p = os.tmpname()
  os.remove(p)
  return p
end

--- name -> {shape = "AxB", bytes = raw data} of every tensor in a safetensors file.
function M.safetensors_tensors(path)
  local hd = require("pipegoose.safetensors").read_header(path)
  local f = assert(io.open(path, "rb"))
  local out = {}
  for name, e in pairs(hd.entries) do
    f:seek("set", e.offset)
    out[name] = { shape = table.concat(e.shape, "x"), bytes = f:read(e.bytes) }
  end
  f:close()
  return out
end

--- Removes a directory tree.
--- The whole of a file (an error when it cannot be read).
function M.read(path)
  local f = assert(io.open(path, "rb"))
  local text = f:read("a")
  f:close()
  return text
end

--- The message of f(...)'s error; fails the test when f succeeds.
function M.err_of(f, ...)
  local ok, e = pcall(f, ...)
  assert(not ok, "expected an error, the call succeeded")
  return tostring(e)
end

--- The list's numbers as integers (JSON decodes ids as floats).
function M.ints(t)
  local out = {}
  for i, v in ipairs(t) do out[i] = math.tointeger(v) end
  return out
end

function M.rm(dir) os.execute("rm -rf " .. quote(dir)) end

--- Whether a file or directory exists.
function M.exists(path) return os.rename(path, path) ~= nil end

return M
