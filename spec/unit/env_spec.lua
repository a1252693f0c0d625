-- Environment variables are parsed strictly, by one parser (src/runtime/pg_env.c):
-- a value that is not of the variable's type is refused at start-up, by name,
-- once, with exit status 1, on every rank alike; never read as something else.
local h = require "helpers"
local core = require "pipegoose.core"

local function run(env, code)
  return h.sh(("env %s %s"):format(env, h.pglua_cmd{ "-e", code or "print('BODY-EXECUTED')" }))
end

-- variable, bad value, what the message says it expects
local BAD = {
  { "PG_ABORT_GRACE", "soon", "a number of seconds from 0 to 3600" },
  { "PG_ABORT_GRACE", "-1", "a number of seconds from 0 to 3600" },
  { "PG_ABORT_GRACE", "1e999", "a number of seconds from 0 to 3600" },
  { "PG_COLLECTIVE_TIMEOUT", "1h", "a number of seconds (0: no limit)" },
  { "PG_COLLECTIVE_TIMEOUT", "nan", "a number of seconds (0: no limit)" },
  { "PG_COLLECTIVE_TIMEOUT", "0x10", "a number of seconds (0: no limit)" },
  { "PG_ABORT_GRACE", " 2", "a number of seconds from 0 to 3600" },
  { "PG_SHM", "maybe", "a boolean (1/0, true/false, yes/no, on/off)" },
  { "PG_DEBUG", "2", "a boolean (1/0, true/false, yes/no, on/off)" },
  { "PG_DEBUG", "TRUE ", "a boolean (1/0, true/false, yes/no, on/off)" },
  { "PG_BF16_GEMM", "turbo", "one of auto, onednn, fallback" },
  { "PG_PROGRESS", "fancy", "one of auto, tty, plain" },
  { "PG_RANKS_PER_NODE", "0", "a positive integer (ranks per emulated node)" },
  { "PG_RANKS_PER_NODE", "2x", "a positive integer (ranks per emulated node)" },
  { "OMP_NUM_THREADS", "-3", "a positive integer (or OpenMP's comma list of them)" },
  { "OMP_NUM_THREADS", "2,,1", "a positive integer (or OpenMP's comma list of them)" },
  { "PG_HOST_MAP_FILE", "/tmp/a\nb", "a file name (scripts/mpirun.sh sets it)" },
}

describe("environment variables", function()
  for _, case in ipairs(BAD) do
    local name, value, expects = case[1], case[2], case[3]
    it(("%s=%q is refused at start-up by name"):format(name, value), function()
      local rc, out = run(("%s=%s"):format(name, h.quote(value)))
      assert.equal(1, rc, out)
      assert.is_nil(out:find("BODY-EXECUTED", 1, true), out)
      local want = ("%s: expected %s, got '%s'"):format(name, expects, value)
      assert.equal(1, h.count(out, want), out)
    end)
  end

  -- variable, value, what pg.core.env reads
  local GOOD = {
    { "PG_SHM", "off", false }, { "PG_SHM", "0", false }, { "PG_SHM", "yes", true }, { "PG_SHM", "", true },
    { "PG_DEBUG", "on", true }, { "PG_DEBUG", "false", false },
    { "PG_ABORT_GRACE", "0.25", 0.25 }, { "PG_ABORT_GRACE", "", 1.0 },
    { "PG_COLLECTIVE_TIMEOUT", "0", 0.0 }, { "PG_BF16_GEMM", "fallback", "fallback" },
    { "PG_BF16_GEMM", "", "auto" }, { "PG_PROGRESS", "plain", "plain" },
    { "OMP_NUM_THREADS", "2,1", 2 }, { "PG_RANKS_PER_NODE", "3", 3 },
    { "PG_HOST_MAP_FILE", "/tmp/hosts map", "/tmp/hosts map" }, { "PG_HOST_MAP_FILE", "", nil },
  }
  for _, case in ipairs(GOOD) do
    local name, value, want = case[1], case[2], case[3]
    it(("%s=%q reads as %s"):format(name, value, tostring(want)), function()
      local rc, out = run(("%s=%s"):format(name, h.quote(value)),
        ("local v = require('pipegoose.core').env(%q); print('VALUE ' .. tostring(v) .. ' ' .. math.type(v) "
          .. ".. '')"):format(name):gsub("math.type%(v%) %.%. ''", "(math.type(v) or type(v))"))
      assert.equal(0, rc, out)
      local kind = type(want) == "number" and (math.type(want)) or type(want)
      assert.truthy(out:find(("VALUE %s %s"):format(tostring(want), kind), 1, true), out)
    end)
  end

  it("pg.core.env refuses a name pipegoose does not read", function()
    local ok, e = pcall(core.env, "PG_NOT_A_VARIABLE")
    assert.is_false(ok)
    assert.truthy(tostring(e):find("PG_NOT_A_VARIABLE is not an environment variable pipegoose reads", 1, true))
  end)

  it("under mpirun: said once, every rank ends with status 1, also when only one rank has the bad value", function()
    local rc, out = h.sh(("PG_BF16_GEMM=turbo %s"):format(h.mpirun_cmd(2, { "-e", "print('BODY-EXECUTED')" }, 60)
      :gsub("scripts/mpirun.sh", "scripts/mpirun.sh -x PG_BF16_GEMM")))
    assert.equal(1, rc, out)
    assert.is_nil(out:find("BODY-EXECUTED", 1, true), out)
    assert.equal(1, h.count(out, "PG_BF16_GEMM: expected one of auto, onednn, fallback, got 'turbo'"), out)
    -- rank 1 alone: rank 0 must not run on (it would wait for rank 1 in its first collective)
    local script = h.tmpfile("print('BODY-EXECUTED')\n", ".lua")
    rc, out = h.sh(("timeout -k 5 %d scripts/mpirun.sh -np 2 sh -c %s"):format(h.limit(60),
      h.quote(("[ \"$OMPI_COMM_WORLD_RANK\" = 1 ] && export PG_SHM=maybe; exec %s %s"):format(h.quote(h.pglua),
        h.quote(script)))))
    os.remove(script)
    assert.equal(1, rc, out)
    assert.is_nil(out:find("BODY-EXECUTED", 1, true), out)
    assert.equal(1, h.count(out, "PG_SHM: expected a boolean (1/0, true/false, yes/no, on/off), got 'maybe'"), out)
  end)
end)
