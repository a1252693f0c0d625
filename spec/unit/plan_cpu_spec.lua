-- The planner's CPU path (plan/cpu.lua, scripts/calibrate.lua, plan.lua
-- --validate): its memory model against engine:memory() of real serial
-- engines, the profile that calibrate writes, and the --validate output. No
-- timing is asserted: the figures themselves depend on the machine and its
-- load (docs/PLANNER.md has the measured table).
local pg = require "pipegoose"
local h = require "helpers"
local cjson = require("cjson").new()
local plan = pg.plan
local cpu = require "pipegoose.plan.cpu"
local search = plan.search_module
local memory = plan.memory

--- The planner's shape of a pg.nn config.
local function shape_of(cfg, arch)
  return plan.models.check{ arch = arch, layers = cfg.layers, hidden = cfg.dim, heads = cfg.heads,
    kv_heads = cfg.kv_heads or cfg.heads, ffn = arch == "llama" and cfg.hidden or 4 * cfg.dim,
    vocab = cfg.padded_vocab or cfg.vocab, seq_len = cfg.seq_len }
end

local function within(expected, actual, rel, what)
  assert(math.abs(expected - actual) <= rel * math.abs(actual),
    ("%s: model %.0f, engine %.0f (%.1f%%)"):format(what, expected, actual, 100 * (expected - actual) / actual))
end

describe("plan/cpu.lua memory against engine:memory()", function()
  local MODELS = {
    gpt = { arch = "gpt", build = pg.nn.GPT, cfg = { vocab = 64, seq_len = 16, dim = 32, heads = 4, layers = 2 } },
    llama = { arch = "llama", build = pg.nn.Llama,
      cfg = { vocab = 61, seq_len = 16, dim = 32, heads = 4, kv_heads = 2, hidden = 48, layers = 2 } },
  }
  for _, name in ipairs{ "gpt", "llama" } do
    for _, rc in ipairs{ "none", "selective", "full" } do
      for _, run in ipairs{ { m = 1, schedule = "1f1b" }, { m = 2, schedule = "gpipe" } } do
        it(("%s serial, recompute %s, %d micro-batches %s: parameters, gradients, AdamW and activations within 10%%")
          :format(name, rc, run.m, run.schedule), function()
          local mdl = MODELS[name]
          local ctx = pg.ParallelContext{ seed = 1 }
          local model = mdl.build(mdl.cfg)
          local engine = pg.parallelize(model, ctx, { micro_batches = run.m, schedule = run.schedule, recompute = rc })
          local opt = pg.optim.AdamW(engine, { lr = 1e-3 })
          local B, S = 4, mdl.cfg.seq_len
          local x = pg.zeros({ B, S }, { dtype = "int32" })
          engine:forward_backward(x, x) -- buffers are sized by the first step
          opt:step()
          local m = engine:memory()
          local s = shape_of(model.config, mdl.arch)
          local L = { t = 1, p = 1, d = 1, m = run.m, b = B // run.m, seq = S, schedule = run.schedule, zero = 0,
            recompute = rc, sp = false, precision = "fp32" }
          local part = search.partition(s, 1)[1]
          local _, parts = cpu.stage_bytes(s, L, part, search.in_flight(run.schedule, 1, run.m, 1),
            memory.stage_params)
          within(parts.weights, m.params_bytes, 0.10, "parameters")
          within(parts.gradients, m.grads_bytes, 0.10, "gradients")
          within(parts.optimizer, m.optimizer_bytes, 0.10, "AdamW state")
          within(parts.activations, m.peak_activation_bytes, 0.10, "activations")
        end)
      end
    end
  end

  it("is what the search uses with a CPU profile (and Megatron's closed form without)", function()
    local s = plan.models.get("gpt2-124m")
    local L = { t = 1, p = 1, d = 1, m = 1, b = 1, seq = 1024, schedule = "1f1b", zero = 0, recompute = "none",
      sp = false, precision = "fp32" }
    local parts = search.partition(s, 1)
    local gpu_bytes = search.layout_memory(s, L, parts, plan.hardware.get("a100-80gb"))
    local cpu_bytes = search.layout_memory(s, L, parts, { cpu = {} })
    assert.equal(memory.stage_bytes(s, L, parts[1], 1), gpu_bytes)
    assert.equal(cpu.stage_bytes(s, L, parts[1], 1, memory.stage_params), cpu_bytes)
  end)
end)

describe("scripts/calibrate.lua and plan.lua --validate", function()
  local profile = os.tmpname() .. ".json"

  it("calibrate --quick writes a profile the strict loader accepts, every figure positive", function()
    local rc, out = h.sh(h.pglua_cmd{ "scripts/calibrate.lua", "--quick", "--ranks=2", "--out=" .. profile })
    assert.equal(0, rc, out)
    assert.matches("wrote " .. profile, out, 1, true)
    local f = assert(io.open(profile))
    local p = cjson.decode(f:read("a"))
    f:close()
    local hw = plan.hardware.from_profile(p, profile) -- errors on a missing, unknown or non-positive field
    assert.is_table(hw.cpu)
    for _, k in ipairs{ "gemm", "attention" } do assert.is_true(#hw.cpu[k] > 0, k) end
    for _, op in ipairs{ "gelu", "layernorm", "rmsnorm", "residual", "swiglu", "rope" } do
      assert.is_true(#hw.cpu.elementwise[op] > 0, op)
    end
    for _, c in ipairs{ "all_reduce", "all_gather", "reduce_scatter", "shm_all_reduce" } do
      assert.is_table(hw.cpu.collectives[c][2], c)
    end
    assert.is_true(hw.cpu.p2p.bandwidth > 0 and hw.cpu.step_overhead > 0 and hw.kernel_overhead > 0)
    -- the planner plans with it
    rc, out = h.sh(h.pglua_cmd{ "scripts/plan.lua", "--model=gpt2-124m", "--gpus=2", "--global-batch=8",
      "--precision=fp32", "--gpu=cpu-profile=" .. profile })
    assert.equal(0, rc, out)
    assert.matches("^best t=%d+ p=%d+ d=%d+ ", out)
  end)

  it("--validate --quick prints a row per configuration and the last line (format only)", function()
    local rc, out = h.sh(h.pglua_cmd{ "scripts/plan.lua", "--validate", "--quick", "--profile=" .. profile })
    assert.equal(0, rc, out)
    local last = out:match("([^\n]*)\n?$")
    assert.matches("^validation median_error=[%d.]+ max_error=[%d.]+ memory_max_error=[%d.]+ n=2$", last)
    assert.matches("\nllama serial +1 +%d+ +[%d.]+ +[%d.]+ +[+-][%d.]+%%", out)
  end)

  it("the loader refuses a cpu section with a missing or unknown field", function()
    local f = assert(io.open(profile))
    local good = f:read("a")
    f:close()
    local function broken(edit, msg)
      local p = cjson.decode(good)
      edit(p)
      local ok, err = pcall(plan.hardware.from_profile, p, "p.json")
      assert.is_false(ok)
      assert.matches("cpu-profile p.json: " .. msg, err, 1, true)
    end
    broken(function(p) p.cpu.p2p = nil end, "cpu.p2p is required")
    broken(function(p) p.cpu.gemms = {} end, "unknown field cpu.gemms")
    broken(function(p) p.cpu.gemm[1].flops = 0 end, "cpu.gemm[1].flops must be a positive finite number")
    broken(function(p) p.cpu.collectives.all_reduce = { two = p.cpu.collectives.all_reduce["2"] } end,
      "cpu.collectives.all_reduce: key two is not a positive integer")
    broken(function(p) p.cpu.elementwise.softmax = {} end, "unknown field cpu.elementwise.softmax")
  end)
end)
