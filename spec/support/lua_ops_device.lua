-- pg.ops on device tensors against the same calls on host tensors (spec/unit/lua_modules_spec.lua runs it
-- with the emulated build): every binding with a device path, its arguments copied to the device, each
-- result on the device and within the CUDA self-test's tolerance of its kernels (src/backend/pg_cuda_selftest.c:
-- TOL_GEMM, TOL_REDUCE, TOL_POINT; 0 where the self-test wants the same bits). Prints "op NAME ok" or
-- "op NAME FAIL why" per case.
local pg = require "pipegoose"
local ops = pg.ops
local GEMM, REDUCE, POINT, EXACT = { 1e-4, 1e-5 }, { 1e-5, 1e-5 }, { 1e-5, 1e-6 }, { 0, 0 }
local seed = 0
local function rn(shape, std) seed = seed + 1 return pg.randn(shape, { seed = seed, std = std or 1 }) end
local B, T, C, OC, V = 2, 3, 8, 5, 11
local x, w, bias, g = rn{ B, T, C }, rn{ OC, C }, rn{ OC }, rn{ C }
local dy5, dy8, dy4 = rn{ B, T, OC }, rn{ B, T, C }, rn{ B, T, 4 }
local tok = pg.tensor({ { 1, 4, 10 }, { 4, 0, 7 } }, { dtype = "int32" })
local qkv = rn{ B, T, 16 }
local _, mean, rstd = ops.layernorm(x, g, g)
local _, rrstd = ops.rmsnorm(x, g)
local aout, alse = ops.attention(qkv, 2, 1)
local logits = rn{ B, T, V }
local rmax = ops.xent_row_max(logits)
local sumexp, tlogit = ops.xent_sumexp(logits, rmax, tok)
local function block(q, kv) -- one key block folded into a fresh online-softmax state, then finished
  local acc, mx, sm = pg.zeros{ B, T, 8 }, pg.full({ B, 2, T }, -math.huge), pg.zeros{ B, 2, T }
  if q:device() ~= "cpu" then acc, mx, sm = acc:to("cuda"), mx:to("cuda"), sm:to("cuda") end
  ops.attention_block_(acc, mx, sm, q, kv, 2, 1, 0, 0)
  return ops.attention_block_finish(acc, mx, sm)
end
local cases = {
  { "linear", GEMM, ops.linear, { x, w, bias } },
  { "linear_backward", GEMM, ops.linear_backward, { dy5, x, w, true, { dw = rn{ OC, C }, db = rn{ OC } } } },
  { "layernorm", REDUCE, ops.layernorm, { x, g, g } },
  { "layernorm_backward", REDUCE, ops.layernorm_backward, { dy8, x, g, mean, rstd } },
  { "rmsnorm", REDUCE, ops.rmsnorm, { x, g } },
  { "rmsnorm_backward", REDUCE, ops.rmsnorm_backward, { dy8, x, g, rrstd } },
  { "gelu", POINT, ops.gelu, { x } },
  { "gelu_backward", POINT, ops.gelu_backward, { dy8, x } },
  { "swiglu", POINT, ops.swiglu, { x } },
  { "swiglu_backward", POINT, ops.swiglu_backward, { dy4, x } },
  { "residual", EXACT, ops.residual, { x, dy8 } },
  { "residual_backward", EXACT, ops.residual_backward, { dy8, { da = rn{ B, T, C } } } },
  { "embedding", EXACT, ops.embedding, { tok, rn{ V, C } } },
  { "embedding_backward", EXACT, ops.embedding_backward, { dy8, tok, V } },
  { "position", EXACT, ops.position, { x, rn{ 4, C }, T } },
  { "position_backward", REDUCE, ops.position_backward, { dy8, T } },
  { "rope", EXACT, ops.rope, { x, 2, 10000 } },
  { "rope_backward", EXACT, ops.rope_backward, { dy8, 2, 10000 } },
  { "attention", GEMM, ops.attention, { qkv, 2, 1 } },
  { "attention_backward", GEMM, ops.attention_backward, { dy8, qkv, aout, alse, 2, 1 } },
  { "cross_entropy", REDUCE, ops.cross_entropy, { rn{ B, T, V }, tok } },
  { "xent_row_max", EXACT, ops.xent_row_max, { logits } },
  { "xent_sumexp", REDUCE, ops.xent_sumexp, { logits, rmax, tok } },
  { "xent_finish", REDUCE, ops.xent_finish, { logits, rmax, sumexp, tlogit, tok, { dloss = 0.5 } } },
  { "attention_block_ + finish", GEMM, block, { qkv, qkv } },
  { "adamw_", EXACT, ops.adamw_, { rn{ OC, C }, rn{ OC, C }, pg.zeros{ OC, C }, pg.zeros{ OC, C }, { lr = 1e-2, step = 1 } } },
  { "sum_squares", { 1e-12, 0 }, ops.sum_squares, { x } },
  { "to_bf16", EXACT, ops.to_bf16, { x } },
  { "linear_bf16", GEMM, ops.linear_bf16, { x, ops.to_bf16(w), bias } },
  { "linear_bf16_backward", GEMM, ops.linear_bf16_backward, { dy5, x, w, true, { dw = rn{ OC, C } } } },
  { "from_bf16", EXACT, ops.from_bf16, { ops.to_bf16(x) } },
  { "narrow", EXACT, function(t) return t:narrow(3, 3, 4) end, { x } },
  { "cat", EXACT, function(a, b) return pg.cat({ a, b }, 3), pg.cat({ a, b }, 1) end, { x, dy8 } },
}
-- every argument copied to the device (dev) or cloned on the host; tables of gradients alike
local function put(v, dev)
  if type(v) == "userdata" then return dev and v:to("cuda") or v:clone() end
  if type(v) == "table" then
    local r = {}
    for k, e in pairs(v) do r[k] = put(e, dev) end
    return r
  end
  return v
end
local function flat(t) return t:reshape{ t:numel() }:totable() end
local function worst(got, want, tol) -- the largest |got - want| - (atol + rtol |want|)
  local a, b, m = flat(got), flat(want), -math.huge
  for i = 1, #b do m = math.max(m, math.abs(a[i] - b[i]) - (tol[2] + tol[1] * math.abs(b[i]))) end
  return m
end
for _, c in ipairs(cases) do
  local name, tol, fn, args = c[1], c[2], c[3], c[4]
  local want = table.pack(fn(table.unpack(put(args, false), 1, #args)))
  local got = table.pack(fn(table.unpack(put(args, true), 1, #args)))
  local bad = {}
  for i = 1, want.n do
    if type(want[i]) == "number" then
      if math.abs(got[i] - want[i]) > tol[1] * math.abs(want[i]) + tol[2] then bad[#bad + 1] = ("result %d %.17g vs %.17g"):format(i, got[i], want[i]) end
    elseif want[i] ~= nil then
      if got[i]:device() ~= "cuda:0" then bad[#bad + 1] = ("result %d on %s"):format(i, got[i]:device()) end
      local e = worst(got[i]:to("cpu"), want[i], tol)
      if e > 0 then bad[#bad + 1] = ("result %d beyond tolerance by %.3g"):format(i, e) end
    end
  end
  print(("op %s %s"):format(name, #bad == 0 and "ok" or ("FAIL " .. table.concat(bad, "; "))))
end

-- the tensor-core attention (ops.flash_bf16, head size 64, T 32, GQA 2:1, ALiBi) against its CPU twin, to the
-- CUDA self-test's bounds (test_flash_bf16): scores differ by ds = 2 gamma_HS HS X^2 scale (float32 sums of HS
-- exact products in other orders, X the largest |q|k|v|), out by (2^-9 + 6 ds) X elementwise (P rounded to bf16),
-- lse by ds + 1e-5, dqkv by 2^-7 of its largest value (P and dS rounded, norm-wise)
do
  local FB, FT, FNH, FNKV, HS = 2, 32, 2, 1, 64
  local q16, do16 = ops.to_bf16(rn({ FB, FT, (FNH + 2 * FNKV) * HS }, 0.5)), ops.to_bf16(rn({ FB, FT, FNH * HS }, 0.5))
  local slopes = ops.alibi_slopes(FNH)
  local function amax(t) local m = 0 for _, v in ipairs(flat(t)) do m = math.max(m, math.abs(v)) end return m end
  local X = amax(ops.from_bf16(q16))
  local u = 2 ^ -24
  local ds = 2 * (HS * u / (1 - HS * u)) * HS * X * X / math.sqrt(HS) + 2 * u * (HS * X * X + amax(slopes) * FT)
  local out, lse = ops.flash_bf16(q16, FNH, FNKV, slopes)
  local dq = ops.flash_bf16_backward(do16, q16, out, lse, FNH, FNKV, slopes)
  local function dev(t) return t:to("cuda") end
  local gout, glse = ops.flash_bf16(dev(q16), FNH, FNKV, dev(slopes))
  local gdq = ops.flash_bf16_backward(dev(do16), dev(q16), dev(out), dev(lse), FNH, FNKV, dev(slopes))
  local function report(name, pairs_)
    local bad = {}
    for i, p in ipairs(pairs_) do
      local got, want, atol = p[1], p[2], p[3]
      if got:device() ~= "cuda:0" then bad[#bad + 1] = ("result %d on %s"):format(i, got:device()) end
      local e = worst(got:to("cpu"), want, { 0, atol })
      if e > 0 then bad[#bad + 1] = ("result %d beyond tolerance by %.3g"):format(i, e) end
    end
    print(("op %s %s"):format(name, #bad == 0 and "ok" or ("FAIL " .. table.concat(bad, "; "))))
  end
  report("flash_bf16", { { gout, out, (2 ^ -9 + 6 * ds) * X }, { glse, lse, ds + 1e-5 } })
  report("flash_bf16_backward", { { gdq, dq, 2 ^ -7 * amax(dq) } })
end

-- a device view at an offset of 8 bf16 values (16 bytes) is refused by name, not run misaligned
do
  local q = ops.to_bf16(pg.zeros{ 2 * 32 * 256 + 8 }):to("cuda")
  local ok, err = pcall(ops.flash_bf16, q:narrow(1, 9, 2 * 32 * 256):view{ 2, 32, 256 }, 2, 1)
  local want = "ops.flash_bf16: flash_bf16_forward: qkv is not 32-byte aligned"
  print(("op flash_bf16 (misaligned view) %s"):format(not ok and tostring(err):find(want, 1, true) and "ok"
    or ("FAIL " .. tostring(err))))
end
