-- Kernel micro-benchmarks: ./pglua scripts/bench_kernels.lua [threads]
-- Prints sgemm GFLOP/s through ops.linear ([256,768] x [768,2304], the GPT-2
-- small qkv projection of 256 tokens), the linear backward, and the
-- flash attention's forward + backward time for C=768, NH=12 (GPT-2 small's
-- heads) at T = 64 .. 1024, B = max(1, 256 / T) sequences.
local pg = require "pipegoose"
local argparse = require "argparse"
local ops = pg.ops

local parser = argparse("bench_kernels.lua", "Kernel micro-benchmarks: sgemm through ops.linear, the linear backward "
  .. "and attention forward + backward.")
parser:argument("threads", "OpenMP threads (default: pipegoose's).")
  :args("?"):convert(function(s) return math.tointeger(tonumber(s)) end)
local threads = parser:parse().threads
if threads then ops.set_num_threads(threads) end

-- best of `reps` timings after one warm-up call
local function time(reps, f)
  f()
  local best = math.huge
  for _ = 1, reps do
    local t0 = pg.wtime()
    f()
    best = math.min(best, pg.wtime() - t0)
  end
  return best
end

print(("threads: %d"):format(ops.num_threads()))

local N, C, OC = 256, 768, 2304
local x, w, b = pg.randn({ N, C }, { seed = 1 }), pg.randn({ OC, C }, { seed = 2, std = 0.02 }), pg.zeros{ OC }
local s = time(20, function() ops.linear(x, w, b) end)
print(("linear forward  [%d,%d]x[%d,%d]: %8.3f ms  %7.1f GFLOP/s"):format(N, C, C, OC, s * 1e3, 2 * N * C * OC / s / 1e9))
local dy = pg.randn({ N, OC }, { seed = 3 })
s = time(10, function() ops.linear_backward(dy, x, w) end)
print(("linear backward (dx, dw, db):      %8.3f ms  %7.1f GFLOP/s"):format(s * 1e3, 4 * N * C * OC / s / 1e9))

local Ca, NH = 768, 12
for _, T in ipairs({ 64, 128, 256, 512, 1024 }) do
  local B = math.max(1, 256 // T)
  local qkv = pg.randn({ B, T, 3 * Ca }, { seed = 4 })
  local dout = pg.randn({ B, T, Ca }, { seed = 5 })
  local out, lse = ops.attention(qkv, NH)
  local reps = T >= 512 and 5 or 20
  local f = time(reps, function() ops.attention(qkv, NH) end)
  local bw = time(reps, function() ops.attention_backward(dout, qkv, out, lse, NH) end)
  print(("attention B=%d T=%d C=%d NH=%d: forward %.3f ms, backward %.3f ms, total %.3f ms"):format(B, T, Ca, NH,
    f * 1e3, bw * 1e3, (f + bw) * 1e3))
end

-- bf16 GEMMs (float32 sums) against sgemm on GPT-2 124M's linear shapes for
-- 256 tokens (batch 4 x 64), inputs already bf16 (as the model's working
-- weights are): forward and backward (dx, dw) of each.
local path, why = ops.bf16_gemm_path()
print(("bf16 GEMM path: %s (%s)"):format(path, why))
print("shape (tokens x in -> out)       sgemm fwd+bwd GFLOP/s   bf16 fwd+bwd GFLOP/s   ratio")
for _, s in ipairs({ { 256, 768, 2304 }, { 256, 768, 768 }, { 256, 768, 3072 }, { 256, 3072, 768 },
  { 256, 768, 50304 } }) do
  local n, c, oc = s[1], s[2], s[3]
  local xs, ws = pg.randn({ n, c }, { seed = 1 }), pg.randn({ oc, c }, { seed = 2, std = 0.02 })
  local dys = pg.randn({ n, oc }, { seed = 3 })
  local xh, wh = ops.to_bf16(xs), ops.to_bf16(ws)
  local reps = oc > 10000 and 3 or 10
  local t32 = time(reps, function()
    ops.linear(xs, ws)
    ops.linear_backward(dys, xs, ws, false)
  end)
  local t16 = time(reps, function()
    ops.linear_bf16(xh, wh)
    ops.linear_bf16_backward(dys, xh, wh, false)
  end)
  local flop = 6 * n * c * oc
  print(("%-32s %20.1f %22.1f %7.2fx"):format(("%d x %d -> %d"):format(n, c, oc), flop / t32 / 1e9,
    flop / t16 / 1e9, t32 / t16))
end
