-- The flash attention keeps no [T, T] probabilities: what a layer keeps for its backward grows linearly with
-- the sequence. engine:memory()'s activation bytes of a small GPT at T = 256, 512 and 1024 (one sequence, so
-- T rows) on the CPU and on the emulated device (make emu: build-emu/pglua, device = "cuda") are affine in T,
-- exactly: a(1024) - a(512) = 2 (a(512) - a(256)). The old kernels' 4 heads T^2 bytes per layer would break
-- it by 2 x 2 layers x 4 heads x 4 bytes x 256^2 = 4 MiB; both backends keep the same buffers, so the same
-- bytes. The same with precision bf16 on the device's tensor cores. Byte counts: exact integers, no tolerance.
local h = require "helpers"

local EMU = os.getenv("PG_EMU_PGLUA") or "build-emu/pglua"
local LENGTHS = { 256, 512, 1024 }

-- What both binaries run: one step at each length; returns { [T] = activation bytes }.
local BODY = [[
local pg = require "pipegoose"
local a = {}
for _, T in ipairs{ 256, 512, 1024 } do
  local e = pg.parallelize(pg.nn.GPT{ vocab = 64, seq_len = T, dim = 32, heads = 4, layers = 2 }, nil,
    { device = DEVICE, seed = 3 })
  local x = pg.zeros({ 1, T }, { dtype = "int32" })
  e:forward_backward(x, x) -- the buffers are sized by the first step
  a[T] = e:memory().activation_bytes
end
return a
]]

local function assert_affine(a, what)
  for _, T in ipairs(LENGTHS) do assert(a[T] and a[T] > 0, ("%s: no activation bytes at T = %d"):format(what, T)) end
  local d1, d2 = a[512] - a[256], a[1024] - a[512]
  assert(d1 > 0 and d2 == 2 * d1, ("%s: activation bytes %d, %d, %d at T = 256, 512, 1024: not affine in T (steps "
    .. "%d, %d)"):format(what, a[256], a[512], a[1024], d1, d2))
end

describe("attention memory (flash: no [T, T] buffer)", function()
  local cpu
  it("engine:memory()'s activation bytes are affine in T on the CPU", function()
    cpu = assert(load((BODY:gsub("DEVICE", '"cpu"'))))()
    assert_affine(cpu, "cpu")
  end)

  it("and on the emulated device, the same bytes", function()
    assert.is_true(h.exists(EMU), EMU .. " is missing: run make emu")
    local path = h.tmpfile("local a = (function() " .. BODY:gsub("DEVICE", '"cuda"') .. " end)()\n"
      .. "for T, bytes in pairs(a) do print(('T %d activation_bytes %d'):format(T, bytes)) end\n")
    local rc, out = h.sh(("timeout -k 2 600 %s %s"):format(h.quote(EMU), h.quote(path)))
    os.remove(path)
    assert.equal(0, rc, out)
    local dev = {}
    for T, bytes in out:gmatch("T (%d+) activation_bytes (%d+)") do dev[tonumber(T)] = tonumber(bytes) end
    assert_affine(dev, "cuda")
    for _, T in ipairs(LENGTHS) do
      if cpu then assert.equal(cpu[T], dev[T], ("T = %d: device and CPU activation bytes"):format(T)) end
    end
  end)

  -- precision bf16 with head size 64 on the device: the tensor-core kernels (kind_attention.c's tensor_cores)
  -- keep the same lse and float32 output as the float32 core (PG_FLASH_BF16=0), so the same bytes, affine in T.
  it("and with precision bf16 on the emulated device's tensor cores (head size 64), the float32 core's bytes",
    function()
    local path = h.tmpfile([[
local pg = require "pipegoose"
for _, T in ipairs{ 256, 512, 1024 } do
  local e = pg.parallelize(pg.nn.GPT{ vocab = 64, seq_len = T, dim = 128, heads = 2, layers = 2 }, nil,
    { device = "cuda", seed = 3, precision = "bf16" })
  local x = pg.zeros({ 1, T }, { dtype = "int32" })
  e:forward_backward(x, x)
  print(("T %d activation_bytes %d"):format(T, e:memory().activation_bytes))
end
]])
    local runs = {}
    for _, env in ipairs{ "", "PG_FLASH_BF16=0 " } do
      local rc, out = h.sh(("%stimeout -k 2 600 %s %s"):format(env, h.quote(EMU), h.quote(path)))
      assert.equal(0, rc, out)
      local a = {}
      for T, bytes in out:gmatch("T (%d+) activation_bytes (%d+)") do a[tonumber(T)] = tonumber(bytes) end
      assert_affine(a, "cuda bf16 " .. env)
      runs[#runs + 1] = a
    end
    os.remove(path)
    for _, T in ipairs(LENGTHS) do assert.equal(runs[2][T], runs[1][T], ("T = %d: tensor cores' bytes"):format(T)) end
  end)
end)
