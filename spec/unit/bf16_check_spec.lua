-- precision = "bf16" on the tiny GPT-2 of the PyTorch fixtures
-- (scripts/gpt2_check.lua --precision=bf16), serially, at T = 2, at D = 2
-- with ZeRO-1, at T = 2 x P = 2 (2 micro-batches) and at T = 2 with sequence parallelism:
--   * 10 AdamW steps' losses against the float64 PyTorch reference
--     (spec/fixtures/gpt2_tiny_fp64_steps.json, scripts/make_fp64_reference.py)
--     to 1e-3 relative. The issue asks for 1e-2; measured (bf16 activations,
--     bf16 tensor-parallel sums): <= 4e-5 in every layout (serial 1.6e-5).
--     bf16 operands carry 2^-9 relative rounding, so a wrong rounding mode or
--     a stale working weight moves the losses by far more than 4e-5, while
--     1e-3 still leaves 25 times the measured margin.
--   * every layout against the serial bf16 run to 1e-4 relative (measured
--     <= 4.2e-5 at T = 2, whose row-parallel outputs are rounded per rank and
--     summed in bf16; D = 2 2.3e-5: the layouts sum in other orders, which
--     moves an activation's rounding by one bf16 step now and then);
--   * the script's own bf16 tolerances on the first step's logits and
--     gradients (exit 0), and the logits far enough from float32 (more than
--     1e-4; float32 is within 1e-5) that the bf16 products did run.
-- The same on the emulated CUDA device (make emu: build-emu/pglua, the
-- device's rounding kernel and cublasGemmEx stand-in), serially, at T = 2,
-- at D = 2 with ZeRO-1 and at T = 2 with sequence parallelism: the fixture to the same 1e-3, and every run
-- against the CPU's serial bf16 run to 1e-4 relative (the emulated GemmEx
-- sums in float32 in order of k, the CPU's widen-and-sgemm or oneDNN in
-- their own orders: the same rounding of the operands, other orders of the
-- float32 sums; at T = 2 the emulated NCCL's bf16 sums, the CPU's ring's
-- order on the host). Measured: <= 5.1e-5 from the fixture and <= 5.7e-5
-- from the CPU's bf16 run (serial 2.7e-5, T = 2 5.7e-5, D = 2 2.7e-5).
local h = require "helpers"
local cjson = require "cjson"

local MODEL, STATE = "spec/fixtures/gpt2_tiny_model.bin", "spec/fixtures/gpt2_tiny_state.bin"
local f = assert(io.open("spec/fixtures/gpt2_tiny_fp64_steps.json"))
local REF = cjson.decode(f:read("a"))
f:close()
local STEPS = #REF.losses

local EMU = os.getenv("PG_EMU_PGLUA") or "build-emu/pglua"

-- gpt2_check.lua on n ranks with `bin` (nil: the host pglua; EMU: the emulated device, --device=cuda).
local function run(n, flags, bin)
  local o = REF.optimizer
  local args = { "scripts/gpt2_check.lua", MODEL, STATE, "--steps=" .. STEPS, "--precision=bf16", "--lr=" .. o.lr,
                 "--beta1=" .. o.betas[1], "--beta2=" .. o.betas[2], "--eps=" .. o.eps,
                 "--weight-decay=" .. o.weight_decay }
  for _, a in ipairs(flags) do args[#args + 1] = a end
  local cmd
  if bin then
    args[#args + 1] = "--device=cuda"
    local quoted = {}
    for i, a in ipairs(args) do quoted[i] = h.quote(a) end
    -- hang guard, not a timing assertion (the emulator is slow)
    cmd = n == 1 and ("timeout -k 2 300 %s %s"):format(h.quote(bin), table.concat(quoted, " "))
      or ("timeout -k 5 300 scripts/mpirun.sh -x PG_ABORT_GRACE -np %d %s %s"):format(n, h.quote(bin),
        table.concat(quoted, " "))
  else
    -- hang guard, not a timing assertion
    cmd = n == 1 and "timeout -k 2 120 " .. h.pglua_cmd(args) or h.mpirun_cmd(n, args, 120)
  end
  local rc, out = h.sh(cmd)
  assert.equal(0, rc, out)
  local losses = {}
  for k, v in out:gmatch("step (%d+) loss (%S+)") do
    assert.equal(#losses + 1, tonumber(k), out)
    losses[#losses + 1] = tonumber(v)
  end
  assert.equal(STEPS, #losses, out)
  local logits = tonumber(out:match("logits_max_abs_diff (%S+)"))
  assert.is_true(logits > 1e-4, "bf16 logits as close to float32 as float32 itself: did bf16 run?\n" .. out)
  return losses, out
end

local serial

local function check(n, flags, bin)
  local losses, out = run(n, flags, bin)
  local worst, worst_serial = 0, 0
  for k = 1, STEPS do
    local want = REF.losses[k]
    worst = math.max(worst, math.abs(losses[k] - want) / want)
    if serial then worst_serial = math.max(worst_serial, math.abs(losses[k] - serial[k]) / serial[k]) end
    assert.is_true(math.abs(losses[k] - want) <= 1e-3 * want,
      ("step %d: bf16 loss %.9g, float64 PyTorch %.9g\n%s"):format(k, losses[k], want, out))
    if serial then
      assert.is_true(math.abs(losses[k] - serial[k]) <= 1e-4 * serial[k],
        ("step %d: bf16 loss %.9g, serial bf16 %.9g\n%s"):format(k, losses[k], serial[k], out))
    end
  end
  print(("bf16 %s%s: losses within %.2g of float64 PyTorch, %.2g of serial bf16"):format(bin and "device " or "",
    table.concat(flags, " "), worst, worst_serial))
  return losses
end

describe("precision = bf16 against the float64 PyTorch reference #bf16", function()
  it("serial", function() serial = check(1, {}) end)
  it("--tensor=2", function() check(2, { "--tensor=2" }) end)
  it("--data=2 --zero=1", function() check(2, { "--data=2", "--zero=1" }) end)
  it("--tensor=2 --pipeline=2 --micro-batches=2", function()
    check(4, { "--tensor=2", "--pipeline=2", "--micro-batches=2" })
  end)
  -- the row-parallel layers take their bf16 input with the output gradient gathered in float32
  it("--tensor=2 --sequence-parallel", function() check(2, { "--tensor=2", "--sequence-parallel" }) end)
end)

describe("precision = bf16 on the emulated device #bf16", function()
  it("has the emulated build (make emu)", function()
    assert.is_true(h.exists(EMU), EMU .. " is missing: run make emu")
  end)
  -- the CPU's serial bf16 run, the reference of every device run (once, if the CPU describe did not run)
  local function cpu_serial()
    if not serial then serial = run(1, {}) end
  end
  it("serial, against the fixture and the CPU's bf16 run", function()
    cpu_serial()
    check(1, {}, EMU)
  end)
  it("--tensor=2", function()
    cpu_serial()
    check(2, { "--tensor=2" }, EMU)
  end)
  it("--data=2 --zero=1", function()
    cpu_serial()
    check(2, { "--data=2", "--zero=1" }, EMU)
  end)
  -- NCCL's bf16 reduce-scatter and all-gather of rows
  it("--tensor=2 --sequence-parallel", function()
    cpu_serial()
    check(2, { "--tensor=2", "--sequence-parallel" }, EMU)
  end)
end)
