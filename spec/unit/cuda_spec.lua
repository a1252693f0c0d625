-- pg.cuda: the GPU entry points answer on every build and machine; the
-- CUDA kernels' self-test passes on a device (skipped without one, as here
-- and in CI); the kernels are compiled in whenever nvcc exists; and the same
-- self-test passes on the CPU emulator (scripts/cuda_emu_test.sh), so the
-- kernels' logic is checked on machines without a GPU too.
local pg = require "pipegoose"
local h = require "helpers"

-- nvcc as the Makefile finds it: on the PATH, else under CUDA_HOME (default /usr/local/cuda).
local function find_nvcc()
  local rc, out = h.sh("command -v nvcc")
  if rc == 0 and out:match("%S") then return (out:gsub("%s+$", "")) end
  local path = (os.getenv("CUDA_HOME") or "/usr/local/cuda") .. "/bin/nvcc"
  local f = io.open(path, "r")
  if f then f:close(); return path end
  return nil
end

describe("pg.cuda", function()
  it("available() answers on any build and machine, with a reason when false", function()
    assert.is_boolean(pg.cuda.built)
    local ok, reason = pg.cuda.available()
    assert.is_boolean(ok)
    local n, why = pg.cuda.device_count()
    assert.is_true(math.type(n) == "integer" and n >= 0)
    if ok then
      assert.is_nil(reason)
      assert.is_true(pg.cuda.built)
      assert.is_true(n >= 1)
    else
      assert.is_string(reason)
      assert.is_true(#reason > 0)
      assert.equal(0, n)
      if pg.cuda.built then
        assert.matches("CUDA", reason) -- what the runtime said: no driver, no device
      else
        assert.matches("built without CUDA", reason)
        assert.matches("built without CUDA", why)
      end
      -- the self-test refuses with the same reason instead of crashing
      local pass, report = pg.cuda.selftest()
      assert.is_false(pass)
      assert.equal(reason, (report:gsub("\n$", "")))
    end
  end)

  it("versions() names the linked CUDA libraries (no device needed), or says CUDA is not built", function()
    local v, why = pg.cuda.versions()
    if pg.cuda.built then
      assert.is_table(v)
      assert.is_true(v.runtime >= 11000, "CUDA runtime " .. tostring(v.runtime))
      assert.is_true(v.cublas > 0, "cuBLAS " .. tostring(v.cublas))
      assert.is_true(v.nccl > 0, "NCCL " .. tostring(v.nccl))
      assert.is_true(v.driver >= 0)
    else
      assert.is_nil(v)
      assert.matches("built without CUDA", why)
    end
  end)

  it("selftest() passes on a CUDA device", function()
    local ok, reason = pg.cuda.available()
    if not ok then
      pending("no CUDA device: " .. reason)
      return
    end
    local pass, report = pg.cuda.selftest()
    assert(pass, report)
    assert.matches("\n(%d+) checks, 0 failed\n$", report)
  end)

  -- Checks the build under test rather than compiling again (nvcc takes a
  -- minute here): `make` compiles kernels/cuda/*.cu whenever it finds nvcc,
  -- and `make test CUDA=0` passes PG_CUDA=0 for a build that must not.
  it("the build under test has the CUDA kernels exactly when nvcc exists (PG_CUDA=0: never)", function()
    local nvcc, mode = find_nvcc(), os.getenv("PG_CUDA") or "auto"
    if mode == "0" then
      assert.is_false(pg.cuda.built, "PG_CUDA=0 but this pglua has the CUDA kernels")
    elseif nvcc then
      assert.is_true(pg.cuda.built, "nvcc at " .. nvcc .. " but " .. h.pglua .. " was built without CUDA")
    else
      assert.is_false(pg.cuda.built, "no nvcc, yet the CUDA kernels are compiled in")
    end
  end)

  it("the CUDA kernels pass the self-test on the CPU emulator", function()
    if h.sh("command -v g++ && pkg-config --exists openblas") ~= 0 then
      pending("no g++ or OpenBLAS for the emulator build")
      return
    end
    local dir = os.tmpname() .. ".d"
    local rc, out = h.sh(("scripts/cuda_emu_test.sh %s"):format(h.quote(dir)))
    h.sh("rm -rf " .. h.quote(dir))
    assert.equal(0, rc, out)
    local checks = tonumber(out:match("\n(%d+) checks, 0 failed\n$"))
    -- 72 checks: every kernel of kernels/kernel_list.h, grouped-query attention, ALiBi and RoPE included
    assert(checks and checks >= 72, out)
    assert.not_matches("FAIL", out)
    -- every row of the list was checked (a report line "ok  <name>...") or says why not ("none  <name>")
    local f = assert(io.open("kernels/kernel_list.h"))
    local rows = 0
    for name in f:read("a"):gmatch("\nPG_KERNEL%(([%w_]+),") do
      rows = rows + 1
      local line = out:match("\n  ok    " .. name .. "[ .]") or out:match("\n  none  " .. name .. " ")
      assert(line, "kernel_list.h's " .. name .. " has no line in the self-test's report:\n" .. out)
    end
    f:close()
    assert(rows >= 33, "kernel_list.h: " .. rows .. " rows")
  end)
end)
