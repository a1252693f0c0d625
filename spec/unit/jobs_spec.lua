-- Whole jobs under mpirun: bad configurations and errors end every rank with
-- a message and exit status 1 instead of hanging, and compute threads are
-- shared out between the ranks of a node.
local h = require "helpers"

-- `timeout 10` is the requirement ("within 10 s"), not a speed assertion: a
-- hung job is killed by it and then fails on the exit status (124).
describe("jobs under mpirun", function()
  it("reject a layout that does not match the world, on every rank, exit 1", function()
    local rc, out = h.sh(("timeout -k 2 10 scripts/mpirun.sh -np 4 %s"):format(
      h.pglua_cmd{ "-e", "require'pipegoose'.ParallelContext{ tensor = 2, pipeline = 3, data = 1 }" }))
    assert.equal(1, rc, out)
    assert.matches("tensor=2 x pipeline=3 x data=1 = 6 ranks, but the world has 4", out)
    for r = 0, 3 do
      assert.is_true(h.reported_by(out, r, "but the world has 4"), ("rank %d reports the error:\n%s"):format(r, out))
    end
    assert.equal(1, h.count(out, "but the world has 4"), "once for the job:\n" .. out)
  end)

  it("reject sizes that are not positive integers, naming them and the world size", function()
    local rc, out = h.sh(("timeout -k 2 10 scripts/mpirun.sh -np 2 %s"):format(
      h.pglua_cmd{ "-e", "require'pipegoose'.ParallelContext{ tensor = 0, data = 2 }" }))
    assert.equal(1, rc, out)
    assert.matches("tensor=0 must be a positive integer %(world size 2%)", out)
    rc, out = h.sh(h.pglua_cmd{ "-e", "require'pipegoose'.ParallelContext{ data = 1.5 }" })
    assert.equal(1, rc, out)
    assert.matches("data=1.5 must be a positive integer %(world size 1%)", out)
    rc, out = h.sh(h.pglua_cmd{ "-e", "require'pipegoose'.ParallelContext{ tensors = 2 }" })
    assert.equal(1, rc, out)
    assert.matches("unknown option 'tensors' (did you mean 'tensor'?)", out, 1, true)
  end)

  it("end within 10 s when one rank fails while the others wait in a collective", function()
    local script = h.tmpfile([[
      local pg = require "pipegoose"
      local ctx = pg.ParallelContext{ data = 4 }
      if ctx:rank() == 2 then error("rank two gives up") end
      pg.dist.all_reduce(pg.ones{ 4 })   -- ranks 0, 1, 3 block here
      print("unreachable")
    ]])
    local rc, out = h.sh(("timeout -k 2 10 scripts/mpirun.sh -np 4 %s"):format(h.pglua_cmd{ script }))
    os.remove(script)
    assert.equal(1, rc, out)
    assert.matches("%[rank 2%] .-rank two gives up", out)
    assert.is_nil(out:find("stack traceback", 1, true), "error() on purpose: no traceback\n" .. out)
    assert.is_nil(out:find("unreachable", 1, true))
  end)

  it("give each of 8 ranks on this node its share of the cores, at least one thread", function()
    local rc, out = h.sh(("timeout -k 2 60 env -u OMP_NUM_THREADS scripts/mpirun.sh -np 8 %s"):format(
      h.pglua_cmd{ "-e", "print('threads', require'pipegoose'.num_threads())" }))
    assert.equal(0, rc, out)
    local handle = io.popen("nproc --all")
    local cores = tonumber(handle:read("a"))
    handle:close()
    local expected = math.max(1, cores // 8)
    assert.equal(8, h.count(out, "threads\t" .. expected .. "\n"), out)
  end)

  it("respect OMP_NUM_THREADS when the user sets it", function()
    local rc, out = h.sh("OMP_NUM_THREADS=3 " .. h.pglua_cmd{ "-e", "print(require'pipegoose'.num_threads())" })
    assert.equal(0, rc)
    assert.equal("3\n", out)
  end)
end)
