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
    h.sh("rm -rf " .. prefix)
  end)
end)
