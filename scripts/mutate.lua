-- Mutation check: do the specs catch one-line bugs?
--
--   make mutate [MUTATE_ARGS="--only=name,name --baseline --stop"]
--   pglua scripts/mutate.lua [--only=...] [--baseline] [--stop] [--list] [--check] [--help]
--
-- Copies the working tree (tracked and untracked, not ignored files) to
-- build/mutate/tree, builds it there (CUDA=0, and the emulated device), and for each mutation of
-- scripts/mutations.lua: applies it, rebuilds, runs the specs it names
-- (through scripts/run_tests.sh, first failure wins), restores the file.
-- A mutation is caught when a spec fails (or hangs and is killed by the
-- dist timeout). Prints a table and "N of M caught"; exit 1 when any is not
-- caught, does not build, or its `from` text is not in the file exactly once.
-- --check only checks that every `from` text is in its file once (quick:
-- run it after a refactor). --baseline first runs every named spec on the unmutated copy (they must
-- pass, or "caught" would mean nothing). Not part of `make test`: it takes
-- minutes per mutation on a small machine.
-- Parsed before anything else: --help prints the usage and exits, and an
-- unknown or misspelt option is an error, never a full run that ignores it.
local argparse = require "argparse"
local parser = argparse("mutate.lua", "Mutation check: applies each one-line bug of scripts/mutations.lua to a copy "
  .. "of the tree (build/mutate/tree, or $MUTATE_DIR/tree), rebuilds it and runs the specs that must catch it. "
  .. "Takes minutes per mutation; not part of make test.")
parser:option("--only", "Comma-separated names of the mutations to apply (default: all; --list names them).")
parser:flag("--baseline", "First run every named spec on the unmutated copy (they must pass).")
parser:flag("--stop", "Stop at the first mutation that is not caught.")
parser:flag("--list", "List the mutations (name, file, why) and exit.")
parser:flag("--check", "Only check that every mutation's text occurs once in its file (quick), and exit.")
local opts = parser:parse()

local list = dofile("scripts/mutations.lua")

local function sh(cmd)
  local ok, how, code = os.execute(cmd)
  if ok then return 0 end
  return how == "exit" and code or 128 + (code or 0)
end

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

-- Occurrences of plain text in s.
local function count(s, text)
  local n, at = 0, 1
  while true do
    local i = s:find(text, at, true)
    if not i then return n end
    n, at = n + 1, i + 1
  end
end

local selected = {}
if opts.only and opts.only ~= "" then
  local want = {}
  for name in opts.only:gmatch("[^,]+") do want[name] = true end
  for _, m in ipairs(list) do if want[m.name] then selected[#selected + 1] = m; want[m.name] = nil end end
  for name in pairs(want) do error("mutate.lua: no mutation named " .. name, 0) end
else
  selected = list
end

if opts.list then
  for _, m in ipairs(selected) do print(("%-34s %-38s %s"):format(m.name, m.file, m.why)) end
  os.exit(0)
end

local DIR = os.getenv("MUTATE_DIR") or "build/mutate"
local TREE = DIR .. "/tree"
local LOG = DIR .. "/log"
local q = function(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

-- The list is checked against the source before anything runs.
local bad = 0
for _, m in ipairs(selected) do
  local n = count(read(m.file), m.from)
  if n ~= 1 then
    print(("%s: the text to mutate occurs %d times in %s (must be once): update scripts/mutations.lua"):format(
      m.name, n, m.file))
    bad = bad + 1
  end
end
if bad > 0 then os.exit(1) end
if opts.check then
  print(("%d mutations, each text found once"):format(#selected))
  os.exit(0)
end

assert(sh(("rm -rf %s && mkdir -p %s %s/build"):format(q(TREE), q(TREE), q(TREE))) == 0)
assert(sh(("git ls-files -z -co --exclude-standard | xargs -0 tar cf - | tar xf - -C %s"):format(q(TREE))) == 0,
  "copying the tree failed")
-- the dependencies were installed for this tree's build (make mutate depends on all)
sh(("cp -p build/.deps-ok %s/build/ 2>/dev/null"):format(q(TREE)))

local function build()
  -- emu: the device specs run build-emu/pglua of the copy
  return sh(("make -C %s -j2 CUDA=0 all emu > %s 2>&1"):format(q(TREE), q(LOG))) == 0
end

-- Runs one spec ("unit/NAME[#filter]" or "dist/NAME[#filter]") in the copy.
-- Returns passed (bool) and the number of tests that ran.
local function run_spec(spec)
  local kind, name, filter = spec:match("^(%a+)/([%w_]+)#?(.*)$")
  assert(kind == "unit" or kind == "dist", "bad spec " .. spec)
  local env = { "PGLUA=build/pglua", "PG_EMU_PGLUA=build-emu/pglua", "PG_TEST_ONLY=" .. kind, "PG_DIST_TIMEOUT=150" }
  if kind == "unit" then
    env[#env + 1] = "PG_TEST_UNIT=spec/unit/" .. name .. "_spec.lua"
  else
    env[#env + 1] = "PG_TEST_FILTER=/" .. name .. "_spec"
  end
  if filter ~= "" then env[#env + 1] = "PG_TEST_BUSTED_FILTER=" .. q(filter) end
  local out = DIR .. "/spec.out"
  local rc = sh(("cd %s && %s timeout -k 10 1200 scripts/run_tests.sh > %s 2>&1"):format(q(TREE),
    table.concat(env, " "), q("../spec.out")))
  local text = read(out)
  local passed, failed = text:match("(%d+) passed, (%d+) failed[^\n]*\n?$")
  local ran = (tonumber(passed) or 0) + (tonumber(failed) or 0)
  return rc == 0, ran
end

local function now() return os.time() end

io.write("building the copy in ", TREE, " ... ")
io.flush()
if not build() then
  print("failed (" .. LOG .. ")")
  os.exit(1)
end
print("ok")

if opts.baseline then
  local seen = {}
  for _, m in ipairs(selected) do
    for _, s in ipairs(m.specs) do
      if not seen[s] then
        seen[s] = true
        local ok, ran = run_spec(s)
        print(("baseline %-32s %s (%d tests)"):format(s, ok and "passes" or "FAILS", ran))
        if not ok or ran == 0 then bad = bad + 1 end
      end
    end
  end
  if bad > 0 then
    print("the unmutated specs must pass first")
    os.exit(1)
  end
end

local rows, caught = {}, 0
for i, m in ipairs(selected) do
  local path = TREE .. "/" .. m.file
  local original = read(path)
  local t0 = now()
  local s = original:find(m.from, 1, true)
  write(path, original:sub(1, s - 1) .. m.to .. original:sub(s + #m.from))
  local result, by = "NOT CAUGHT", "-"
  if not build() then
    result = "DOES NOT BUILD"
  else
    local ran_any = false
    for _, spec in ipairs(m.specs) do
      local ok, ran = run_spec(spec)
      ran_any = ran_any or ran > 0
      if not ok then
        result, by = "caught", spec
        break
      end
    end
    if result ~= "caught" and not ran_any then result = "NO TESTS RAN" end
  end
  write(path, original)
  if result == "caught" then caught = caught + 1 end
  rows[#rows + 1] = { m.name, m.file, result, by, now() - t0 }
  io.stderr:write(("[%d/%d] %s: %s%s (%d s)\n"):format(i, #selected, m.name, result,
    by ~= "-" and " by " .. by or "", now() - t0))
  if opts.stop and result ~= "caught" then break end
end
build() -- leave the copy built unmutated

print(("%-34s %-36s %-14s %-26s %s"):format("mutation", "file", "result", "caught by", "s"))
for _, r in ipairs(rows) do print(("%-34s %-36s %-14s %-26s %d"):format(table.unpack(r))) end
print(("%d of %d caught"):format(caught, #rows))
os.exit(caught == #rows and 0 or 1)
