-- Merges the per-rank JSON summaries written by spec/support/summary_handler.lua.
-- A test (file, world size, name) passes when it passed on every rank that ran
-- it; a run whose ranks did not all report counts as one failed test.
local cjson = require "cjson"
local parser = require("argparse")("test_summary.lua", "Merges the per-rank JSON summaries of a test run "
  .. "(scripts/run_tests.sh) and prints the totals; exit 1 when a test failed.")
parser:argument("dir", "The directory of the summaries.")
local dir = parser:parse().dir
-- a directory that is not there would read as a run of no tests: "0 passed, 0 failed", exit 0
if not os.rename(dir, dir) or not io.open(dir .. "/.", "r") then
  io.stderr:write(("test_summary.lua: %s is not a directory of summaries\n"):format(dir))
  os.exit(1)
end

local runs = {}
for file in io.popen('ls "' .. dir .. '"'):lines() do
  local run, rank = file:match("^(.-)%.(%d+)$")
  local crashed = file:match("^(.-)%.crashed$")
  if run then
    runs[run] = runs[run] or { ranks = {} }
    local f = assert(io.open(dir .. "/" .. file))
    runs[run].ranks[tonumber(rank)] = cjson.decode(f:read("a"))
    f:close()
  elseif crashed then
    runs[crashed] = runs[crashed] or { ranks = {} }
    local f = assert(io.open(dir .. "/" .. file))
    runs[crashed].crash = f:read("a")
    f:close()
  end
end

local passed, failed, skipped = 0, 0, 0
local names = {}
for run in pairs(runs) do names[#names + 1] = run end
table.sort(names)
for _, run in ipairs(names) do
  local r = runs[run]
  local order, merged = {}, {}
  for _, summary in pairs(r.ranks) do
    for _, t in ipairs(summary.results) do
      local m = merged[t.name]
      if not m then
        m = { status = t.status, messages = {} }
        merged[t.name] = m
        order[#order + 1] = t.name
      end
      if t.status == "failed" then
        m.status = "failed"
        m.messages[#m.messages + 1] = ("rank %d: %s"):format(summary.rank, t.message or "")
      elseif t.status == "skipped" and m.status == "passed" then
        m.status = "skipped"
      end
    end
  end
  for _, name in ipairs(order) do
    local m = merged[name]
    if m.status == "passed" then passed = passed + 1
    elseif m.status == "skipped" then skipped = skipped + 1
    else
      failed = failed + 1
      print(("FAILED  %s :: %s"):format(run, name))
      for _, msg in ipairs(m.messages) do print("        " .. msg:gsub("\n", "\n        ")) end
    end
  end
  if r.crash then
    failed = failed + 1
    print(("FAILED  %s :: the run did not finish on every rank\n        %s"):format(run, r.crash:gsub("\n", "\n        ")))
  end
end
print(("%d passed, %d failed, %d skipped"):format(passed, failed, skipped))
os.exit(failed == 0 and 0 or 1)
