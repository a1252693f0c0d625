-- Collective agreement and the watchdog (issue 18, item 2), each case a small
-- job under mpirun: ranks that call different things get an error on every
-- rank naming both sides; a rank that never arrives ends the job within
-- PG_COLLECTIVE_TIMEOUT (3 s here) with a message naming it, instead of a hang.
--
-- h.mpirun_cmd's timeout is a hang guard, not a timing assertion: a job that
-- hangs is killed and fails on its exit status (124 or 137 instead of 1).
local h = require "helpers"

-- Runs `code` (after `local pg = require "pipegoose"`, `me` = the world rank)
-- on n ranks; returns the exit status, the output and the script's path (the
-- call sites in messages name it).
local function job(n, code, env)
  local path = h.tmpfile("local pg = require 'pipegoose'\nlocal me = pg.world_rank()\n" .. code)
  local vars = "env PG_COLLECTIVE_TIMEOUT=3 PG_ABORT_GRACE=1 " .. (env or "") .. " "
  local rc, out = h.sh(vars .. h.mpirun_cmd(n, { path }, 40))
  os.remove(path)
  return rc, out, path
end

-- Rank r's error report ("[rank r] ..." or "[ranks 0-1] ..." for ranks that
-- failed alike, pglua's one report per job) contains every string of `parts`.
local function printed(out, r, parts)
  for _, rep in ipairs(h.reports(out)) do
    if rep.ranks[r] then
      local all = true
      for _, p in ipairs(parts) do all = all and rep.text:find(p, 1, true) ~= nil end
      if all then return true end
    end
  end
  return false
end

-- Exit 1, and every rank in `ranks` printed a line with all of `parts` (":N" parts are call sites in the script).
local function assert_fails(n, ranks, code, parts, env)
  local rc, out, path = job(n, code, env)
  assert.equal(1, rc, out)
  local want = {}
  for i, p in ipairs(parts) do want[i] = p:gsub("^:(%d+)$", function(l) return path .. ":" .. l end) end
  for _, r in ipairs(ranks) do
    assert.is_true(printed(out, r, want), ("rank %d did not print %s:\n%s"):format(r, table.concat(want, " | "), out))
  end
end

local CTX = "local ctx = pg.ParallelContext{ data = pg.world_size() }\n"

describe("pg.dist calls that disagree", function()
  it("different counts: an error on every rank naming both sides (an MPI error on one rank, or a hang)", function()
    assert_fails(2, { 0, 1 }, CTX .. "pg.dist.all_reduce(pg.ones{ me == 0 and 8 or 12 })", {
      "all_reduce over the global group: rank 1 called all_reduce of 12 float32 values (op sum, ", ":4",
      "rank 0 called all_reduce of 8 float32 values" })
  end)

  it("float32 against int32 (each rank got its own answer, and exit 0)", function()
    assert_fails(2, { 0, 1 }, CTX .. "pg.dist.all_reduce(me == 0 and pg.ones{ 4 } or pg.ones({ 4 }, { dtype = 'int32' }))",
      { "rank 1 called all_reduce of 4 int32 values", "rank 0 called all_reduce of 4 float32 values" })
  end)

  it("sum against max", function()
    assert_fails(2, { 0, 1 }, CTX .. "pg.dist.all_reduce(pg.ones{ 4 }, { op = me == 0 and 'sum' or 'max' })",
      { "rank 1 called all_reduce of 4 float32 values (op max", "rank 0 called all_reduce of 4 float32 values (op sum" })
  end)

  it("broadcasts from different roots", function()
    assert_fails(2, { 0, 1 }, CTX .. "pg.dist.broadcast(pg.ones{ 4 }, { src = me })",
      { "rank 1 called broadcast of 4 float32 values from rank 1", "rank 0 called broadcast of 4 float32 values from rank 0" })
  end)

  it("all_gather of one count in different shapes (each rank cut the blocks its own way)", function()
    assert_fails(2, { 0, 1 }, CTX .. "pg.dist.all_gather(me == 0 and pg.ones{ 2, 3 } or pg.ones{ 3, 2 }, { dim = 2 })",
      { "rank 1 called all_gather of 6 float32 values per rank ([3, 2] along dimension 2, ",
        "rank 0 called all_gather of 6 float32 values per rank ([2, 3] along dimension 2, " })
  end)

  it("all_to_all counts that disagree: each rank sends what its peer does not expect (a hang or garbage)", function()
    -- each sends the other 1 row of 2 values, and each expects 2 rows: the first disagreement in rank order
    assert_fails(2, { 0, 1 }, CTX .. "pg.dist.all_to_all(pg.ones{ 3, 2 }, { send = me == 0 and { 2, 1 } or { 1, 2 }, "
      .. "recv = { 2, 2 } })", { "all_to_all over the global group: rank 1 sends 2 values to rank 0, which expects 4" })
  end)

  it("all_to_all of float32 against int32", function()
    assert_fails(2, { 0, 1 }, CTX .. "pg.dist.all_to_all(me == 0 and pg.ones{ 2 } or pg.ones({ 2 }, { dtype = 'int32' }))",
      { "rank 1 called all_to_all of int32 values", "rank 0 called all_to_all of float32 values" })
  end)

  it("the same call from different lines", function()
    assert_fails(2, { 0, 1 }, CTX .. [[
if me == 0 then
  pg.dist.all_reduce(pg.ones{ 4 })
else
  pg.dist.all_reduce(pg.ones{ 4 })
end]], { "rank 1 called all_reduce of 4 float32 values (op sum, ", ":7", "rank 0 called all_reduce", ":5" })
  end)

  it("a send met by a send (two eager sends used to pass unnoticed)", function()
    assert_fails(2, { 0, 1 }, CTX .. "pg.dist.send(pg.ones{ 4 }, { dst = 1 - me })",
      { "called send of 4 float32 values to rank", "but rank", "called send of 4 float32 values to rank" })
  end)

  it("a send of 4 values met by a recv of 3, on both ranks", function()
    assert_fails(2, { 0, 1 }, CTX .. [[
if me == 0 then pg.dist.send(pg.ones{ 4 }, { dst = 1, tag = 2 })
else pg.dist.recv(pg.ones{ 3 }, { src = 0, tag = 2 }) end]],
      { "send over the global group: rank 0 called send of 4 float32 values to rank 1 (tag 2, ", ":4",
        "but rank 1 called recv of 3 float32 values from rank 0 (tag 2, " })
  end)

  it("a send met by a collective", function()
    assert_fails(2, { 0, 1 }, CTX .. [[
if me == 0 then pg.dist.send(pg.ones{ 4 }, { dst = 1 })
else pg.dist.all_reduce(pg.ones{ 4 }) end]], { "called send of 4 float32 values to rank 1", "called all_reduce of 4 float32 values" })
  end)

  it("leave the context unusable, with the first message", function()
    assert_fails(2, { 0, 1 }, CTX .. [[
pcall(pg.dist.all_reduce, pg.ones{ me + 1 })
pg.dist.all_reduce(pg.ones{ 1 })]], { "the parallel context failed earlier and cannot be used: all_reduce over the global group" })
  end)
end)

describe("the watchdog", function()
  it("names a rank that skipped a collective (it hung)", function()
    -- rank 1 stays busy rather than finishing: an abort while the other rank is inside MPI_Finalize sometimes
    -- kills mpirun itself (exit 137; see the next test)
    assert_fails(2, { 0 }, CTX .. "if me == 0 then pg.dist.all_reduce(pg.ones{ 4 }) else os.execute('sleep 20') end",
      { "all_reduce of 4 float32 values (op sum, ", ":4",
        ") over the global group: waited 3 s (PG_COLLECTIVE_TIMEOUT) but rank 1 never arrived" })
  end)

  it("names the one rank of three that never came, on both that did", function()
    -- rank 2 is busy rather than finished: Open MPI 4.1's mpirun sometimes dies (exit 137 or 139, before this
    -- change too) when two ranks abort while a third is inside MPI_Finalize
    assert_fails(3, { 0, 1 }, CTX .. "if me < 2 then pg.dist.all_reduce(pg.ones{ 4 }) else os.execute('sleep 20') end",
      { "waited 3 s (PG_COLLECTIVE_TIMEOUT) but rank 2 never arrived" })
  end)

  it("ends a recv with no matching send", function()
    assert_fails(2, { 0 }, CTX .. "if me == 0 then pg.dist.recv(pg.ones{ 4 }, { src = 1 }) end",
      { "recv of 4 float32 values from rank 1 (tag 0, ", "waited 3 s (PG_COLLECTIVE_TIMEOUT) but rank 1 never arrived" })
  end)

  it("ends a pipeline stage waiting for activations that never come", function()
    assert_fails(2, { 1 }, [[
local ctx = pg.ParallelContext{ pipeline = 2 }
local e = pg.parallelize(pg.nn.GPT{ vocab = 61, seq_len = 8, dim = 8, heads = 2, layers = 2 }, ctx)
local x = pg.zeros({ 2, 8 }, { dtype = 'int32' })
if me == 1 then e:forward_backward(x, x) end]], {
      "recv of 128 float32 values from rank 0 (tag 0, in the runtime) over the pipeline group: waited 3 s",
      "rank 0 never sent it" })
  end)

  it("ends the runtime's collectives too", function()
    assert_fails(2, { 1 }, [[
local ctx = pg.ParallelContext{ data = 2 }
local e = pg.parallelize(pg.nn.GPT{ vocab = 61, seq_len = 8, dim = 8, heads = 2, layers = 2 }, ctx)
local x = pg.zeros({ 2, 8 }, { dtype = 'int32' })
if me == 1 then e:forward_backward(x, x) end]], { "(op sum, in the runtime) over the data group: waited 3 s", "rank 0 never arrived" })
  end)

  it("refuses a PG_COLLECTIVE_TIMEOUT that is not a number of seconds, at start-up, once", function()
    -- pg_env.c's parser: before any collective runs (spec/unit/env_spec.lua has every variable)
    local rc, out = job(2, CTX .. "pg.dist.all_reduce(pg.ones{ 4 })", "PG_COLLECTIVE_TIMEOUT=soon ")
    assert.equal(1, rc, out)
    assert.equal(1, h.count(out, "PG_COLLECTIVE_TIMEOUT: expected a number of seconds (0: no limit), got 'soon'"), out)
  end)
end)

describe("the runtime's own calls", function()
  it("disagree on every rank when the data-parallel replicas differ", function()
    assert_fails(2, { 0, 1 }, [[
local ctx = pg.ParallelContext{ data = 2 }
local e = pg.parallelize(pg.nn.GPT{ vocab = 61, seq_len = 8, dim = 8, heads = 2, layers = me + 1 }, ctx)
local x = pg.zeros({ 2, 8 }, { dtype = 'int32' })
e:forward_backward(x, x)]], { "over the data group: rank 1 called all_reduce of 2464 float32 values (op avg, in the runtime), rank 0 called all_reduce of 1536" })
  end)

  it("check pipeline transfers under PG_DEBUG=1", function()
    assert_fails(2, { 1 }, [[
local ctx = pg.ParallelContext{ pipeline = 2 }
local m = pg.nn.GPT{ vocab = 61, seq_len = 8, dim = 8 * (me + 1), heads = 2, layers = 2, tie = false }
local e = pg.parallelize(m, ctx)
local x = pg.zeros({ 2, 8 }, { dtype = 'int32' })
e:forward_backward(x, x)]], { "send over the pipeline group: rank 0 called send of 128 float32 values to rank 1 (tag 0, in the runtime), but rank 1 called recv of 256 float32 values from rank 0" },
      "PG_DEBUG=1")
  end)
end)

describe("calls that agree", function()
  it("still compute, and engine:num_parameters() on one rank alone is no collective (the next step crashed)", function()
    local rc, out = job(2, [[
local ctx = pg.ParallelContext{ tensor = 2 }
local t = pg.ones{ 3 }
pg.dist.all_reduce(t)
if me == 0 then pg.dist.send(pg.tensor{ 5, 6 }, { dst = 1 }) else
  local r = pg.zeros{ 2 }; pg.dist.recv(r, { src = 0 }); print("got", r:get(2)) end
local e = pg.parallelize(pg.nn.GPT{ vocab = 61, seq_len = 8, dim = 8, heads = 2, layers = 2 }, ctx)
if me == 0 then print("parameters", e:num_parameters()) end
local x = pg.zeros({ 2, 8 }, { dtype = 'int32' })
-- one write per rank (print writes its arguments one by one: the ranks' lines could interleave)
io.write(("loss\t%d\t%.17g\t%.1f\n"):format(me, e:forward_backward(x, x), t:get(1)))]])
    assert.equal(0, rc, out)
    assert.is_truthy(out:find("got\t6.0", 1, true), out)
    assert.is_truthy(out:find("parameters\t2312", 1, true), out)
    assert.is_truthy(out:find("loss\t0\t%d[^\n]*\t2%.0"), out)
    assert.is_truthy(out:find("loss\t1\t%d[^\n]*\t2%.0"), out)
  end)
end)
