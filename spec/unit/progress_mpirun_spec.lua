-- ProgressBar under a real mpirun whose output goes to a file: Open MPI gives
-- the rank's stdout a pseudo-terminal, yet the log must get plain lines.
local h = require "helpers"

-- a five-step fit that logs every step
local FIT = [[
  local pg = require "pipegoose"
  local engine = pg.testing.fake_engine{}
  local t = pg.Trainer{ engine = engine, optimizer = pg.testing.fake_optimizer(engine), max_steps = 5,
    log_every_n_steps = 1, callbacks = { pg.callbacks.ProgressBar{} } }
  t:fit(pg.testing.fake_data{ batches = 10 })
]]

describe("ProgressBar under mpirun", function()
  it("prints one plain line per logged step into a file, and rewrites its line with PG_PROGRESS=tty", function()
    local script = h.tmpfile(FIT)
    local log = os.tmpname()
    local function run(env)
      local rc, out = h.sh(env .. h.mpirun_cmd(1, { script }) .. " > " .. h.quote(log))
      assert.equal(0, rc, out)
      local f = assert(io.open(log, "rb"))
      local text = f:read("a")
      f:close()
      return text
    end
    local text = run("")
    assert.is_nil(text:find("\r", 1, true), "no carriage return in the log: " .. text)
    local steps = {}
    for n in text:gmatch("step (%d)/5 |[^\n]*\n") do steps[#steps + 1] = tonumber(n) end
    assert.same({ 1, 2, 3, 4, 5 }, steps)
    text = run("PG_PROGRESS=tty ")
    assert.equal(5, h.count(text, "\rstep "), "PG_PROGRESS=tty forces the one-line display: " .. text)
    os.remove(script)
    os.remove(log)
  end)

  it("rewrites its line when mpirun itself writes to a terminal (script(1) gives it one)", function()
    local script = h.tmpfile(FIT)
    -- script -q -e -c CMD /dev/null: CMD (mpirun) runs on a new pseudo-terminal; what it prints comes back here
    local rc, out = h.sh("script -q -e -c " .. h.quote(h.mpirun_cmd(1, { script })) .. " /dev/null < /dev/null")
    assert.equal(0, rc, out)
    assert.equal(5, h.count(out, "\rstep "), "mpirun on a terminal: the one-line display\n" .. out)
    os.remove(script)
  end)
end)
