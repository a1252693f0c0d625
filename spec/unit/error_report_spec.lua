-- How a failing job reports (src/lua/pglua.c): ranks that fail with one message
-- are reported once ("[ranks 0-3] ..."), ranks that fail differently each say
-- theirs, a rank that fails alone still reports within seconds and ends the
-- job, and tracebacks come with internal errors and under PG_DEBUG=1 only.
--
-- `timeout -k 2 20` is a hang guard, not a timing assertion: a job that hangs
-- is killed and then fails on its exit status (124 or 137 instead of 1).
local h = require "helpers"

local function job(n, code, env)
  local rc, out = h.sh(("%stimeout -k 2 20 scripts/mpirun.sh -x PG_ABORT_GRACE -x PG_DEBUG -np %d %s"):format(
    env or "", n, h.pglua_cmd{ "-e", "local pg = require 'pipegoose'\nlocal me = pg.world_rank()\n" .. code }))
  return rc, out
end

-- The reports as "ranks: text" strings, sorted: {"0,2: even", "1,3: odd"}.
local function summary(out)
  local list = {}
  for _, rep in ipairs(h.reports(out)) do
    local ranks = {}
    for r in pairs(rep.ranks) do ranks[#ranks + 1] = r end
    table.sort(ranks)
    list[#list + 1] = table.concat(ranks, ",") .. ": " .. rep.text:gsub("^[^:]*pglua: ", "")
  end
  table.sort(list)
  return list
end

describe("a failing job", function()
  it("reports an error every rank raised alike once, for all of them, without a traceback", function()
    local rc, out = job(4, "error('the same everywhere', 0)")
    assert.equal(1, rc, out)
    assert.same({ "0,1,2,3: the same everywhere" }, summary(out))
    assert.matches("[ranks 0-3] ", out, 1, true)
    assert.equal(1, h.count(out, "the same everywhere"), out)
    assert.is_nil(out:find("stack traceback", 1, true), out)
  end)

  it("reports each rank's own message when they differ, and groups those that agree", function()
    local rc, out = job(4, "error('rank ' .. me .. ' differs', 0)")
    assert.equal(1, rc, out)
    assert.same({ "0: rank 0 differs", "1: rank 1 differs", "2: rank 2 differs", "3: rank 3 differs" }, summary(out))
    rc, out = job(4, "error(me % 2 == 0 and 'even' or 'odd', 0)")
    assert.equal(1, rc, out)
    assert.same({ "0,2: even", "1,3: odd" }, summary(out))
    assert.matches("[ranks 0,2] ", out, 1, true)
  end)

  it("reports a rank that fails alone within seconds while the others wait in a collective, and ends the job",
    function()
    local t0 = os.time()
    local rc, out = job(4, "pg.ParallelContext{ data = 4 }\nif me == 1 then error('one rank gives up', 0) end\n"
      .. "pg.dist.all_reduce(pg.ones{ 4 })\nprint('unreachable')")
    assert.equal(1, rc, out)
    assert.same({ "1: one rank gives up" }, summary(out))
    assert.is_true(os.time() - t0 < 15, "ended in seconds")
    assert.is_nil(out:find("unreachable", 1, true))
    -- three alike, one blocked: no agreement is possible; each of the three says it
    rc, out = job(4, "pg.ParallelContext{ data = 4 }\nif me ~= 3 then error('three give up', 0) end\n"
      .. "pg.dist.all_reduce(pg.ones{ 4 })")
    assert.equal(1, rc, out)
    assert.equal(3, #h.reports(out), out)
    for r = 0, 2 do assert.is_true(h.reported_by(out, r, "three give up"), out) end
  end)

  it("lets a rank that fails a moment after another report before the job ends (two fail, one is busy)", function()
    -- rank 0 fails at once, rank 1 a second later, rank 2 never: before the linger, rank 0's grace (3 s) ran
    -- out, it reported alone and aborted at 3 s, a second before rank 1's own grace ended and it could report
    -- (what a loaded machine does to two ranks whose watchdogs fire together)
    local rc, out = job(3, "if me == 1 then os.execute('sleep 1') end\n"
      .. "if me == 2 then os.execute('sleep 15') else error('rank ' .. me .. ' gives up', 0) end", "PG_ABORT_GRACE=3 ")
    assert.equal(1, rc, out)
    assert.same({ "0: rank 0 gives up", "1: rank 1 gives up" }, summary(out))
  end)

  it("ends under scripts/mpirun.sh with the first rank's error as the last line, once, without Open MPI's notice",
    function()
    -- rank 0 fails; 1 and 2, left waiting in a collective, fail on the watchdog 1 s later, within rank 0's
    -- grace: their report (together or each alone) is a consequence, printed first; Open MPI's MPI_ABORT box
    -- is dropped
    local rc, out = job(3, "pg.ParallelContext{ data = 3 }\nif me == 0 then error('the root cause', 0) end\n"
      .. "pg.dist.all_reduce(pg.ones{ 4 })", "PG_ABORT_GRACE=3 PG_COLLECTIVE_TIMEOUT=1 ")
    assert.equal(1, rc, out)
    local lines = {}
    for line in out:gmatch("[^\n]+") do lines[#lines + 1] = line end
    assert.equal("[rank 0] " .. h.pglua .. ": the root cause", lines[#lines], out)
    assert.equal(1, h.count(out, "the root cause"), out)
    for r = 1, 2 do assert.is_true(h.reported_by(out, r, "but rank 0 never arrived"), out) end
    assert.is_nil(out:find("MPI_ABORT was invoked", 1, true), out)
  end)

  it("under timeout -k, scripts/mpirun.sh takes a mpirun stuck in its shutdown down with it (no orphan)", function()
    -- Open MPI 4.1's mpirun can hang after an abort on a loaded machine; timeout -k's KILL comes only while
    -- its child (this script) lives: a script that died of the TERM first left mpirun orphaned, holding the
    -- spec's output pipe open (the suite hung). A stand-in mpirun that ignores TERM, found first on PATH:
    local dir = h.tmpdir()
    assert.equal(0, (h.sh("mkdir " .. h.quote(dir))))
    local marker = "pg-stuck-mpirun-" .. tostring(os.time()) .. "-" .. tostring(math.random(1e9))
    local f = assert(io.open(dir .. "/mpirun", "w"))
    f:write("#!/bin/sh\ntrap '' TERM INT\nexec sh -c 'sleep 60' " .. marker .. "\n") -- the marker names it for pgrep
    f:close()
    assert.equal(0, (h.sh("chmod +x " .. h.quote(dir .. "/mpirun"))))
    local rc = h.sh(("PATH=%s:$PATH timeout -k 1 1 scripts/mpirun.sh -np 1 true > /dev/null 2>&1"):format(h.quote(dir)))
    assert.equal(137, rc)
    -- "[p]g-stuck-...": the regex matches the stand-in, not the shell running pgrep with it on its command line
    local pattern = "[p]" .. marker:sub(2)
    local _, left = h.sh("pgrep -f '" .. pattern .. "' || true")
    h.sh("pkill -f '" .. pattern .. "' || true")
    h.sh("rm -rf " .. h.quote(dir))
    assert.equal("", left, "the stuck mpirun outlived the script")
  end)

  it("adds the traceback to an internal error (once), and to any error under PG_DEBUG=1", function()
    local rc, out = job(2, "local function f(t) return t.x end\nf(nil)")
    assert.equal(1, rc, out)
    assert.same({ "0,1: (command line):3: attempt to index a nil value (local 't')" }, summary(out))
    assert.equal(1, h.count(out, "stack traceback:"), out)
    assert.matches("in local 'f'", out)
    rc, out = job(2, "pg.nn.GPT{ vocab = 8, seq_len = 4, dim = 8, heads = 2, layers = 1, lyers = 2 }", "PG_DEBUG=1 ")
    assert.equal(1, rc, out)
    assert.same({ "0,1: (command line):3: GPT: unknown option 'lyers' (did you mean 'layers'?)" }, summary(out))
    assert.equal(1, h.count(out, "stack traceback:"), out)
    rc, out = job(2, "pg.nn.GPT{ vocab = 8, seq_len = 4, dim = 8, heads = 2, layers = 1, lyers = 2 }")
    assert.equal(1, rc, out)
    assert.is_nil(out:find("stack traceback", 1, true), out)
  end)
end)
