-- Block attention (context parallelism's ring) against the whole-sequence attention on the CPU: one sequence,
-- forward (pg_attention_forward vs one block over all keys + finish) and backward (pg_attention_backward vs
-- delta + the block backward), CPU seconds, best of a few runs. A measurement, not a test.
--   build/pglua scripts/bench_attention_block.lua [T ...]   (default 1024 2048 4096)
local argparse = require "argparse"
local parser = argparse("bench_attention_block.lua", "Block attention (the context-parallel ring's kernels) against "
  .. "the whole-sequence attention on the CPU, in CPU seconds (best of 3). A measurement, not a test.")
parser:argument("T", "Sequence lengths (default 1024 2048 4096)."):args("*"):convert(function(v)
  local n = math.tointeger(tonumber(v))
  if not n or n < 1 then return nil, ("a sequence length must be a positive integer, got '%s'"):format(v) end
  return n
end)
local opt = parser:parse()
local pg = require "pipegoose"
local ops = pg.ops

local NH, NKV, HS, REPS = 8, 8, 64, 3
local lengths = #opt.T > 0 and opt.T or { 1024, 2048, 4096 }

-- CPU seconds (all threads; steadier than the wall clock on a loaded machine), best of REPS
local function best(f)
  local t = math.huge
  for _ = 1, REPS do
    local t0 = os.clock()
    f()
    t = math.min(t, os.clock() - t0)
  end
  return t
end

print(("heads %d/%d, head size %d, %d threads; CPU seconds of all threads, best of %d"):format(NH, NKV, HS, ops.num_threads(), REPS))
print(("%6s  %10s %10s %6s  %10s %10s %6s"):format("T", "fwd", "block fwd", "ratio", "bwd", "block bwd", "ratio"))
for _, a in ipairs(lengths) do
  local T = a
  local W = (NH + 2 * NKV) * HS
  local qkv = pg.randn({ 1, T, W }, { seed = 1 })
  local dout = pg.randn({ 1, T, NH * HS }, { seed = 2 })
  local out, wlse, bout, lse
  local tf = best(function() out, wlse = ops.attention(qkv, NH, NKV) end)
  local tb = best(function()
    local acc, mx, sm = pg.zeros{ 1, T, NH * HS }, pg.full({ 1, NH, T }, -math.huge), pg.zeros{ 1, NH, T }
    ops.attention_block_(acc, mx, sm, qkv, qkv, NH, NKV, 0, 0)
    bout, lse = ops.attention_block_finish(acc, mx, sm)
  end)
  local diff = bout:max_abs_diff(out)
  local tg = best(function() ops.attention_backward(dout, qkv, out, wlse, NH, NKV) end)
  collectgarbage()
  local tbg = best(function()
    local delta = ops.attention_block_delta(dout, bout, NH)
    ops.attention_block_backward_(pg.zeros{ 1, T, W }, pg.zeros{ 1, T, W }, qkv, qkv, dout, lse, delta, NH, NKV, 0, 0)
  end)
  print(("%6d  %10.4f %10.4f %6.2f  %10.4f %10.4f %6.2f   (max |out diff| %.2g)"):format(T, tf, tb, tb / tf, tg, tbg,
    tbg / tg, diff))
  collectgarbage()
end
