-- Modules written in Lua as first-class citizens: examples/lua_llama.lua
-- builds a LLaMA whose attention and MLP are Lua tables over pg.ops that
-- declare their tensor-parallel regions and parameter splits. It must train
-- as pg.nn.Llama does on the same weights (spec/fixtures/hf_llama_tiny),
-- serially and at T = 2, where each rank computes its own heads. Tolerance:
-- 1e-6 relative on every loss (measured: the same bits; both run the same
-- kernels in the same order).
local pg = require "pipegoose"
local h = require "helpers"

local TINY = "spec/fixtures/hf_llama_tiny"

-- Trains the built-in and the Lua model for 3 clipped AdamW steps; prints "k builtin lua".
local SCRIPT = [[
local pg = require "pipegoose"
local L = dofile("examples/lua_llama.lua")
local D = "spec/fixtures/hf_llama_tiny"
local ctx = pg.ParallelContext{ tensor = tonumber(arg[1]), pipeline = tonumber(arg[2]) }
local o = require("pipegoose.hf").read_config(D)
local function run(model)
  model.weights = { format = "hf", path = D }
  local e = pg.parallelize(model, ctx, { micro_batches = 2 })
  local data = pg.data.TokenShards{ path = D .. "/tokens.bin", batch = 4, seq_len = 16, shuffle = false, ctx = ctx }
  local x, y = data:next_batch()
  local opt = pg.optim.AdamW(e, { lr = 1e-3, betas = { 0.9, 0.95 }, weight_decay = 0.1 })
  local out = {}
  for k = 1, 3 do
    e:zero_grad()
    out[k] = e:forward_backward(x, y)
    opt:clip_grad_norm(1.8)
    opt:step()
  end
  return out, e
end
local a = run(pg.nn.Llama(o))
local b, e = run(L.Llama(o))
-- the Lua model's shards are the built-in's names and shapes
local shapes = {}
for _, p in ipairs(e:parameters()) do shapes[#shapes + 1] = p.name .. "=" .. table.concat(p.shape, "x") end
if ctx:rank() == 0 then
  for k = 1, 3 do print(("step %d %.17g %.17g"):format(k, a[k], b[k])) end
  print("params " .. table.concat(shapes, " "))
end
]]

local function run(ranks, T, P)
  local path = h.tmpfile(SCRIPT)
  local args = { path, tostring(T), tostring(P) }
  local rc, out = h.sh(ranks > 1 and h.mpirun_cmd(ranks, args, 120) or h.pglua_cmd(args))
  os.remove(path)
  assert.equal(0, rc, out)
  local n = 0
  for k, a, b in out:gmatch("step (%d) (%S+) (%S+)") do
    a, b = tonumber(a), tonumber(b)
    assert(math.abs(a - b) <= 1e-6 * a, ("T=%d P=%d step %s: built-in %.9g, Lua %.9g"):format(T, P, k, a, b))
    n = n + 1
  end
  assert.equal(3, n, out)
  return out
end

describe("modules written in Lua", function()
  it("a LLaMA with Lua attention and MLP trains as pg.nn.Llama, serially", function()
    run(1, 1, 1)
  end)

  it("shards at T = 2 (its own heads, column and row splits) and matches the built-in; also with P = 2", function()
    local out = run(2, 2, 1)
    -- rank 0's shards: half the query and key/value heads, half the MLP
    assert.matches("blocks.0.attn.qkv.weight=32x32 ", out, 1, true)
    assert.matches("blocks.0.attn.proj.weight=32x16 ", out, 1, true)
    assert.matches("blocks.1.mlp.fc.weight=48x32 ", out, 1, true)
    run(2, 1, 2)
  end)

  it("see the batch and sequence length of their rows", function()
    local seen = {}
    local m = { in_width = 8, out_width = 8 }
    function m:forward(_, x, info)
      seen[#seen + 1] = { info.batch, info.seq_len, x:shape()[1] }
      return x
    end
    function m:backward(_, dy) return dy end
    local model = pg.nn.Sequential{ pg.nn.Embedding{ vocab = 16, dim = 8, name = "embed" }, m,
      pg.nn.LMHead{ vocab = 16, dim = 8, tie = false, name = "head" } }
    local e = pg.parallelize(model, nil, {})
    local x = pg.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, { dtype = "int32" })
    e:loss(x, x)
    assert.same({ 2, 3, 6 }, seen[#seen])
  end)

  it("honour name=, and refuse one table at two positions", function()
    local function ident(name)
      local m = { name = name, in_width = 8 }
      function m:parameters() return { { name = "scale", shape = { 8 }, init = "ones" } } end
      function m:forward(_, x) return x end
      function m:backward(_, dy) return dy end
      return m
    end
    local function model(a, b)
      return pg.nn.Sequential{ pg.nn.Embedding{ vocab = 16, dim = 8, name = "embed" }, a, b,
        pg.nn.LMHead{ vocab = 16, dim = 8, name = "head" } }
    end
    local names = {}
    for _, p in ipairs(pg.parallelize(model(ident("first"), ident("second"))):parameters()) do names[p.name] = true end
    assert.is_true(names["first.scale"] and names["second.scale"])
    local one = ident(nil)
    local ok, err = pcall(pg.parallelize, model(one, one))
    assert.is_false(ok)
    assert.matches("one Lua module table is used at '2' and at '3'; give each position its own table", err, 1, true)
  end)

  it("check their declarations: regions, split dimensions and divisibility, with the module's name", function()
    local function mod(fields)
      local m = { name = "custom", in_width = 8 }
      for k, v in pairs(fields) do m[k] = v end
      m.forward = function(_, _, x) return x end
      m.backward = function(_, _, dy) return dy end
      return m
    end
    local function fails(m, T, msg)
      local s = pg.nn.Sequential{ pg.nn.Embedding{ vocab = 16, dim = 8, name = "embed" }, m }
      local ok, err = pcall(s.describe, s, "", { width = 0, split = false }, T)
      assert.is_false(ok)
      assert.matches(msg, err, 1, true)
    end
    fails(mod{ tensor_parallel = { input = "scatter" } }, 1,
      "Lua module 'custom': tensor_parallel.input must be 'replicated', 'copy' or 'split', got 'scatter'")
    fails(mod{ tensor_parallel = { output = "copy" } }, 1,
      "tensor_parallel.output must be 'replicated', 'reduce' or 'split', got 'copy'")
    fails(mod{ tensor_parallel = { inputs = "split" } }, 1,
      "Lua module 'custom': unknown option 'tensor_parallel.inputs' (did you mean 'tensor_parallel.input'?)")
    fails(mod{ parameters = function() return { { name = "w", shape = { 8 }, stdev = 1 } } end }, 1,
      "Lua module 'custom': parameter 1: unknown option 'stdev' (did you mean 'std'?)")
    fails(mod{ parameters = function() return { { name = "w", shape = { 8, 0 } } } end }, 1,
      "Lua module 'custom': parameter 1: shape[2] must be a positive integer, got 0")
    fails(mod{ parameters = function() return { { name = "w", shape = { 6, 8 }, split = { dims = 1 } } } end }, 1,
      "Lua module 'custom': parameter w: unknown option 'split.dims' (did you mean 'split.dim'?)")
    fails(mod{ tensor_parallel = { input = "split" } }, 2,
      "takes a split input (tensor_parallel.input = \"split\") but receives the full activation")
    fails(mod{ parameters = function() return { { name = "w", shape = { 6, 8 }, split = { dim = 1, blocks = 2 } } } end },
      2, "parameter w: tensor=2 does not divide block 1 (3 rows) of dimension 1")
    fails(mod{ parameters = function() return { { name = "w", shape = { 6, 8 }, split = { dim = 3 } } } end }, 2,
      "parameter w: split.dim must be one of its 2 dimensions, got 3")
    fails(mod{ parameters = function() return { { name = "w", shape = { 6, 8 }, split = { dim = 1, sizes = { 2, 2 } } } } end },
      1, "parameter w: its blocks add up to 4, not the 6 of dimension 1")
  end)

  it("name their parameters' init exactly: 'zero' is an error, not the normal init", function()
    local function model(init)
      local m = { name = "custom", in_width = 8 }
      function m:parameters() return { { name = "w", shape = { 8 }, init = init } } end
      m.forward = function(_, _, x) return x end
      m.backward = function(_, _, dy) return dy end
      return pg.nn.Sequential{ pg.nn.Embedding{ vocab = 16, dim = 8, name = "embed" }, m,
        pg.nn.LMHead{ vocab = 16, dim = 8, name = "head" } }
    end
    for init, want in pairs{ zeros = 0, ones = 1 } do
      local w = pg.parallelize(model(init)):parameter("custom.w").tensor
      assert.equal(want, w:get(1))
      assert.equal(want, w:get(8))
    end
    for _, bad in ipairs{ "zero", "Normal", "" } do
      local ok, err = pcall(pg.parallelize, model(bad))
      assert.is_false(ok)
      assert.matches(("parameter 'custom.w': init must be 'normal', 'zeros' or 'ones', got '%s'"):format(bad), err, 1,
        true)
    end
    local ok, err = pcall(pg.parallelize, model(7))
    assert.is_false(ok)
    assert.matches("Lua module 'custom': parameter 1: init must be a string, got 7", err, 1, true)
  end)

  it("tell the pipeline partitioner their FLOPs", function()
    local function heavy(flops)
      local m = { in_width = 8, flops = flops }
      m.forward = function(_, _, x) return x end
      m.backward = function(_, _, dy) return dy end
      return m
    end
    local spec = pg.nn.Sequential{ heavy(1e6) }
    assert.equal(1e6, spec:flops(16))
    assert.equal(80, pg.nn.Sequential{ heavy(nil) }:flops(16)) -- default: 10 per input feature
    assert.equal(7 * 16, pg.nn.Sequential{ heavy(function(T) return 7 * T end) }:flops(16))
  end)
end)

-- On the emulated device (make emu: build-emu/pglua; spec/unit/device_spec.lua says what it emulates).
-- Tolerances, device against CPU in one process: pg.ops results within the CUDA self-test's tolerance of
-- each kernel (spec/support/lua_ops_device.lua; the same bits where the self-test wants them). Training:
-- the emulated cuBLAS sums each product in double and rounds once, OpenBLAS sums in float32, so a step's
-- gradients differ by float32 rounding of sums of up to 64 terms: per tensor max |cuda - cpu| <= 1e-5
-- max |cpu| (measured <= 1.1e-6), losses 1e-6 relative (measured 4e-9); after 3 AdamW steps (lr 1e-3,
-- each a normalised step whose direction moves by about the gradients' relative difference) weights
-- within 1e-6 (measured 1.1e-7: a few float32 roundings at |w| < 0.4).
describe("modules written in Lua on the emulated device", function()
  local EMU = os.getenv("PG_EMU_PGLUA") or "build-emu/pglua"

  local function emu(code)
    local path = h.tmpfile(code)
    local rc, out = h.sh(("timeout -k 2 300 %s %s"):format(h.quote(EMU), h.quote(path)))
    os.remove(path)
    return rc, out
  end

  it("run pg.ops on device tensors with the CPU's results", function()
    assert.is_true(h.exists(EMU), EMU .. " is missing: run make emu")
    local rc, out = h.sh(("timeout -k 2 300 %s spec/support/lua_ops_device.lua"):format(h.quote(EMU)))
    assert.equal(0, rc, out)
    assert.is_nil(out:match("op [^\n]* FAIL[^\n]*"), out)
    local n = 0
    for _ in out:gmatch("op [^\n]* ok") do n = n + 1 end
    assert.equal(36, n, out)
  end)

  it("a LLaMA with Lua attention and MLP trains on the device as on the CPU (losses, gradients, weights)", function()
    local rc, out = emu([[
local pg = require "pipegoose"
local L = dofile("examples/lua_llama.lua")
local D = "spec/fixtures/hf_llama_tiny"
local o = require("pipegoose.hf").read_config(D)
local function run(device)
  local model = L.Llama(o)
  model.weights = { format = "hf", path = D }
  local e = pg.parallelize(model, nil, { micro_batches = 2, device = device })
  local data = pg.data.TokenShards{ path = D .. "/tokens.bin", batch = 4, seq_len = 16, shuffle = false }
  local x, y = data:next_batch()
  local opt = pg.optim.AdamW(e, { lr = 1e-3, betas = { 0.9, 0.95 }, weight_decay = 0.1 })
  local losses = {}
  for k = 1, 3 do
    e:zero_grad()
    losses[k] = e:forward_backward(x, y)
    opt:clip_grad_norm(1.8)
    opt:step()
  end
  local w, g = {}, {}
  for _, p in ipairs(e:parameters()) do
    assert(p.tensor:device() == (device == "cpu" and "cpu" or "cuda:0"), p.name)
    w[p.name] = p.tensor:to("cpu")
  end
  for _, p in ipairs(e:grads()) do g[p.name] = p.tensor:to("cpu") end
  return losses, w, g
end
local la, wa, ga = run("cpu")
local lb, wb, gb = run("cuda")
for k = 1, 3 do print(("step %d %.17g %.17g"):format(k, la[k], lb[k])) end
local n = 0
for name, w in pairs(wa) do
  local gmax = ga[name]:max_abs_diff(pg.zeros(ga[name]:shape()))
  print(("param %s %.9g %.9g %.9g"):format(name, wb[name]:max_abs_diff(w), gb[name]:max_abs_diff(ga[name]), gmax))
  n = n + 1
end
print("params " .. n)
]])
    assert.equal(0, rc, out)
    local steps = 0
    for k, a, b in out:gmatch("step (%d) (%S+) (%S+)") do
      a, b = tonumber(a), tonumber(b)
      assert(math.abs(a - b) <= 1e-6 * a, ("step %s: cpu %.9g, cuda %.9g"):format(k, a, b))
      steps = steps + 1
    end
    assert.equal(3, steps, out)
    local params = 0
    for name, dw, dg, gmax in out:gmatch("param (%S+) (%S+) (%S+) (%S+)") do
      dw, dg, gmax = tonumber(dw), tonumber(dg), tonumber(gmax)
      assert(dg <= 1e-5 * gmax, ("%s: gradients differ by %.3g (max |g| %.3g)"):format(name, dg, gmax))
      assert(dw <= 1e-6, ("%s: weights differ by %.3g"):format(name, dw))
      params = params + 1
    end
    assert.equal(15, params, out) -- 2 blocks of ln1, attn (qkv, proj), ln2, mlp (fc, proj); embed, ln_f, head
  end)

  it("refuse mixed-device calls and device tensors where there is no device kernel, by name", function()
    local rc, out = emu([[
local pg = require "pipegoose"
local ops = pg.ops
local x, w = pg.randn({ 4, 8 }, { seed = 1 }), pg.randn({ 3, 8 }, { seed = 2 })
local dx = x:to("cuda")
local function try(f, ...) local ok, err = pcall(f, ...) print(ok, err) end
try(ops.linear, dx, w)
try(ops.linear_backward, pg.zeros{ 4, 3 }:to("cuda"), dx, w:to("cuda"), false, { dw = pg.zeros{ 3, 8 } })
try(ops.residual, x, dx)
try(ops.moe_route, dx, 1)
try(ops.bf16_round, dx)
try(ops.quantize_int8, dx:reshape{ 32 }, 8)
try(pg.cat, { dx, x }, 1)
]])
    assert.equal(0, rc, out)
    assert.is_nil(out:match("true"), out)
    for _, want in ipairs{
      "ops.linear: w: a cpu tensor in a call on cuda:0: the tensors of one call share a device",
      "ops.linear_backward: dw: a cpu tensor in a call on cuda:0",
      "ops.residual: b: a cuda:0 tensor in a call on cpu",
      "ops.moe_route: logits: expected a cpu tensor, got a cuda:0 one (ops.moe_route has no device kernel",
      "ops.bf16_round: x: expected a cpu tensor, got a cuda:0 one (ops.bf16_round has no device kernel",
      "ops.quantize_int8: x: expected a cpu tensor, got a cuda:0 one (ops.quantize_int8 has no device kernel",
      "cat: tensor 2 is on another device than tensor 1 (cuda:0)",
    } do
      assert.matches(want, out, 1, true)
    end
  end)

  it("see their device in info.device and make tensors there; an objective written in Lua stays on the cpu", function()
    local rc, out = emu([[
local pg = require "pipegoose"
local m = { in_width = 8, out_width = 8 }
function m:forward(_, x, info)
  local z = pg.zeros({ x:shape()[1], 8 }, { device = info.device })
  local y = pg.ops.residual(x, z)
  print("device " .. info.device .. " " .. x:device() .. " " .. z:device() .. " " .. y:device())
  return y
end
function m:backward(_, dy) return dy end
local model = pg.nn.Sequential{ pg.nn.Embedding{ vocab = 16, dim = 8, name = "embed" }, m,
  pg.nn.LMHead{ vocab = 16, dim = 8, tie = false, name = "head" } }
local e = pg.parallelize(model, nil, { device = "cuda" })
local x = pg.tensor({ { 1, 2, 3 } }, { dtype = "int32" })
e:loss(x, x)
-- every factory takes device=, with the host tensor's values
local made = { pg.tensor({ 1, 2 }, { device = "cuda" }), pg.ones({ 2 }, { device = "cuda:0" }),
  pg.full({ 2 }, 2, { device = "cuda" }), pg.randn({ 2 }, { seed = 3, device = "cuda" }),
  pg.arange(2, { device = "cuda" }) }
local host = { pg.tensor{ 1, 2 }, pg.ones{ 2 }, pg.full({ 2 }, 2), pg.randn({ 2 }, { seed = 3 }), pg.arange(2) }
for i, t in ipairs(made) do assert(t:device() == "cuda:0" and t:to("cpu"):equal(host[i]), i) end
print("factories on the device")
local obj = pg.nn.Sequential{ pg.nn.Embedding{ vocab = 16, dim = 8, name = "embed" } }
local ok, err = pcall(pg.parallelize, obj, nil, { device = "cuda", objective = function() return 0 end })
print(ok, err)
]])
    assert.equal(0, rc, out)
    assert.matches("device cuda:0 cuda:0 cuda:0 cuda:0", out, 1, true)
    assert.matches("factories on the device", out, 1, true)
    assert.matches("objective written in Lua runs on the cpu backend only, not cuda", out, 1, true)
  end)
end)
