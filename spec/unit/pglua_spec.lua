-- The pglua command line behaves like lua and ends the job on errors.
local h = require "helpers"

describe("pglua", function()
  it("prints its version with -v and usage with --help", function()
    local rc, out = h.sh(h.pglua_cmd{ "-v" })
    assert.equal(0, rc)
    assert.matches("pipegoose %d+%.%d+%.%d+ on Lua 5%.4", out)
    rc, out = h.sh(h.pglua_cmd{ "--help" })
    assert.equal(0, rc)
    assert.matches("usage: .* %[options%] %[script %[args%]%]", out)
  end)

  it("refuses a PG_RANKS_PER_NODE that is not a positive integer, naming it", function()
    for _, v in ipairs{ "x", "0", "-2", "3.5" } do
      local rc, out = h.sh("PG_RANKS_PER_NODE=" .. v .. " " .. h.pglua_cmd{ "-e", "print(1)" })
      assert.equal(1, rc, out)
      assert.truthy(out:find("PG_RANKS_PER_NODE: expected a positive integer (ranks per emulated node), got '" .. v
        .. "'", 1, true), out)
    end
  end)

  it("runs -e code, scripts with arg, and stdin", function()
    local rc, out = h.sh(h.pglua_cmd{ "-e", "print(1 + 1)" })
    assert.equal(0, rc)
    assert.equal("2\n", out)
    local script = h.tmpfile("print(arg[0] ~= nil, #arg, arg[-1] ~= nil, ...)")
    rc, out = h.sh(h.pglua_cmd{ script, "a", "b" })
    assert.equal(0, rc)
    assert.equal("true\t2\ttrue\ta\tb\n", out)
    rc, out = h.sh("echo 'print(\"from stdin\", ...)' | " .. h.pglua_cmd{ "-", "x" })
    assert.equal(0, rc)
    assert.equal("from stdin\tx\n", out)
    os.remove(script)
  end)

  it("loads pipegoose with no setup and requires modules with -l", function()
    local rc, out = h.sh(h.pglua_cmd{ "-l", "pg=pipegoose", "-e", "print(pg.version, pg.tensor{1}:numel())" })
    assert.equal(0, rc)
    assert.matches("^%d+%.%d+%.%d+\t1\n$", out)
  end)

  it("reports an error raised on purpose with the rank and no traceback, exit status 1", function()
    local script = h.tmpfile("local function inner() error('something broke') end\ninner()\n")
    local rc, out = h.sh(h.pglua_cmd{ script })
    assert.equal(1, rc)
    assert.matches("^%[rank 0%] [^\n]-:1: something broke\n$", out)
    -- the same error under PG_DEBUG=1: with the traceback
    rc, out = h.sh("PG_DEBUG=1 " .. h.pglua_cmd{ script })
    assert.equal(1, rc)
    assert.matches("%[rank 0%] .-something broke\nstack traceback:", out)
    assert.matches("in local 'inner'", out)
    os.remove(script)
  end)

  it("reports an internal error (one Lua raises itself) with its traceback", function()
    local script = h.tmpfile("local function inner(t) return t.field end\ninner(nil)\n")
    local rc, out = h.sh(h.pglua_cmd{ script })
    assert.equal(1, rc)
    assert.matches("%[rank 0%] .-attempt to index a nil value %(local 't'%)\nstack traceback:", out)
    assert.matches("in local 'inner'", out)
    -- re-raised by a handler, it is still internal; a built-in's argument error too
    rc, out = h.sh(h.pglua_cmd{ "-e", "local ok, e = pcall(function() return nil + 1 end); error('wrapped: ' .. e, 0)" })
    assert.equal(1, rc)
    assert.matches("wrapped: .-attempt to perform arithmetic on a nil value\nstack traceback:", out)
    rc, out = h.sh(h.pglua_cmd{ "-e", "string.rep()" })
    assert.equal(1, rc)
    assert.matches("bad argument #1 to 'rep'.-\nstack traceback:", out)
    -- a pipegoose argument check, a missing file and a syntax error are the user's: no traceback
    for _, args in ipairs{ { "-e", "require('pipegoose').nn.GPT()" }, { "/nonexistent/script.lua" }, { "-e", "x = = 1" } } do
      rc, out = h.sh(h.pglua_cmd(args))
      assert.equal(1, rc, out)
      assert.matches("^%[rank 0%] [^\n]*\n$", out)
    end
    os.remove(script)
  end)

  it("passes os.exit codes through", function()
    local rc = h.sh(h.pglua_cmd{ "-e", "os.exit(3)" })
    assert.equal(3, rc)
    rc = h.sh(h.pglua_cmd{ "-e", "os.exit(true)" })
    assert.equal(0, rc)
  end)

  it("rejects unknown options", function()
    local rc, out = h.sh(h.pglua_cmd{ "-Q" })
    assert.equal(1, rc)
    assert.matches("unrecognized option '%-Q'", out)
  end)

  -- A sanitizer build's module cannot load into an uninstrumented lua5.4.
  local plain_it = os.getenv("PG_SANITIZE") and pending or it
  plain_it("leaves the C module usable from a plain lua5.4", function()
    local rc, out = h.sh("lua5.4 -e 'package.cpath=\"" .. h.build .. "/lua/?.so;\"..package.cpath; package.path=\"lua/?.lua;lua/?/init.lua;\"..package.path' "
      .. "-e 'local pg=require\"pipegoose\"; print(pg.tensor{1,2}:sum(), pg.ParallelContext{}:world_size())'")
    assert.equal(0, rc, out)
    assert.matches("3%.0\t1", out)
  end)
end)
