-- `make install PREFIX=...` gives a working interpreter, Lua files, the C
-- library with its headers, and a pkg-config file a C program can build with.
local h = require "helpers"

-- A sanitizer run builds elsewhere; installing is checked on the normal build.
local install_it = os.getenv("PG_SANITIZE") and pending or it

describe("make install", function()
  install_it("installs pglua, the Lua files, the libraries, headers and pipegoose.pc", function()
    local prefix = os.tmpname() .. ".d"
    local rc, out = h.sh(("make install PREFIX=%s"):format(prefix))
    assert.equal(0, rc, out)
    -- the installed interpreter finds its Lua files from anywhere
    rc, out = h.sh(("cd / && %s/bin/pglua -e 'local pg = require \"pipegoose\"; print(pg.version, pg.tensor{1, 2}:sum())'"):format(prefix))
    assert.equal(0, rc, out)
    assert.matches("^%d+%.%d+%.%d+\t3%.0\n$", out)
    -- a C program builds against the installed library with pkg-config
    local src = h.tmpfile([[
#include <pg_tensor.h>
#include <pg_error.h>
#include <stdio.h>
int main(void) {
  pg_tensor t;
  int64_t shape[2] = {2, 3};
  if (pg_tensor_init(&t, PG_FLOAT32, 2, shape) != PG_OK) return 1;
  pg_tensor_fill(&t, 1.5);
  printf("%g\n", pg_tensor_sum(&t));
  pg_tensor_release(&t);
  return 0;
}
]], ".c")
    local exe = os.tmpname()
    rc, out = h.sh(("PKG_CONFIG_PATH=%s/lib/pkgconfig mpicc -o %s %s $(PKG_CONFIG_PATH=%s/lib/pkgconfig pkg-config --cflags --libs pipegoose) -Wl,-rpath,%s/lib && %s")
      :format(prefix, exe, src, prefix, prefix, exe))
    assert.equal(0, rc, out)
    assert.equal("9\n", out)
    os.remove(src); os.remove(exe)
    -- a plain lua5.4 finds it through the prefix's paths (the defaults when PREFIX=/usr/local)
    rc, out = h.sh(("cd / && LUA_PATH='%s/share/lua/5.4/?.lua;%s/share/lua/5.4/?/init.lua;;' LUA_CPATH='%s/lib/lua/5.4/?.so;;' "
      .. "lua5.4 -e 'print(require(\"pipegoose\").tensor{1, 2}:sum())'"):format(prefix, prefix, prefix))
    assert.equal(0, rc, out)
    assert.matches("3%.0\n$", out)
    -- another project's specs run with busted under the installed pglua (README, "Testing your own code")
    local proj = os.tmpname() .. ".proj"
    h.sh(("mkdir -p %s/spec"):format(proj))
    local f = assert(io.open(proj .. "/spec/mine_spec.lua", "w"))
    f:write([[
local pg = require "pipegoose"
describe("a callback of my own", function()
  it("sees pipegoose", function() assert.equal(3, pg.tensor{ 1, 2 }:sum()) end)
end)
]])
    f:close()
    rc, out = h.sh(("cd %s && %s/bin/pglua /usr/bin/busted spec"):format(proj, prefix))
    assert.equal(0, rc, out)
    assert.matches("1 success / 0 failures", out, 1, true)
    h.sh("rm -rf " .. proj)
    h.sh("rm -rf " .. prefix)
  end)
end)
