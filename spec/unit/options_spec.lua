-- Strict options: pipegoose.options (the one checker) and every public
-- constructor and options table through it. Each bad input must raise an
-- error whose message names the function, the option and what is wrong; none
-- may be accepted silently or fail with a raw Lua error.
local pg = require "pipegoose"
local opt = require "pipegoose.options"
local h = require "helpers"

local err_of = h.err_of

-- f() fails with `text` in its message, and with no trace of a raw Lua error.
local function rejects(text, f, ...)
  local msg = err_of(f, ...)
  assert(msg:find(text, 1, true), ("expected %q in the message: %s"):format(text, msg))
  assert.is_nil(msg:find("attempt to", 1, true), msg)
end

local function with(base, k, v)
  local o = {}
  for a, b in pairs(base) do o[a] = b end
  o[k] = v
  return o
end

describe("pipegoose.options", function()
  local S = {
    vocab = opt.integer{ min = 1, required = true }, eps = opt.number{ gt = 0, default = 1e-5 }, tie = "boolean",
    parallel = opt.enum{ "column", "row" }, betas = opt.list(opt.number{ min = 0, lt = 1 }, { len = 2 }),
    path = opt.either(opt.string, opt.list(opt.string)),
    seed = opt.integer{ min = math.mininteger, max = math.maxinteger },
  }

  it("returns a new table with integral floats made integers and defaults filled in", function()
    local given = { vocab = 8.0, betas = { 0, 0.5 } }
    local o = opt.check("X", given, S)
    assert.equal("integer", math.type(o.vocab))
    assert.equal(1e-5, o.eps)
    assert.same({ 0, 0.5 }, o.betas)
    assert.is_nil(given.eps, "the caller's table is not changed")
    assert.equal(math.maxinteger, opt.check("X", { vocab = 1, seed = math.maxinteger }, S).seed)
  end)

  it("names an unknown key and the closest known one, or lists them", function()
    rejects("X: unknown option 'vocb' (did you mean 'vocab'?)", opt.check, "X", { vocab = 1, vocb = 2 }, S)
    rejects("X: unknown option 'zzzzzzzz' (known: betas, eps, parallel, path, seed, tie, vocab)", opt.check, "X",
      { vocab = 1, zzzzzzzz = 2 }, S)
    rejects("X: unknown option [1] (known:", opt.check, "X", { 5, vocab = 1 }, S)
    -- positional entries pass when asked for (Sequential{m1, m2, name=})
    assert.equal(5, opt.check("X", { 5, vocab = 1 }, S, { positional = true })[1])
  end)

  it("reports the first problem in key order, the same on every rank", function()
    -- pairs() order differs between Lua states; the report must not
    for _ = 1, 5 do
      rejects("X: unknown option 'a1'", opt.check, "X", { vocab = 1, b2 = 1, a1 = 1, c3 = 1 }, S)
      rejects("X: eps must be", opt.check, "X", { vocab = 0.5, eps = -1, tie = 1 }, S)
    end
  end)

  it("rejects wrong types, non-integers, out-of-range and non-finite numbers, naming the value", function()
    rejects("X: vocab must be a positive integer, got 65.5", opt.check, "X", { vocab = 65.5 }, S)
    rejects("X: vocab must be a positive integer, got '8'", opt.check, "X", { vocab = "8" }, S)
    rejects("X: vocab must be a positive integer below 2^31, got 4294967360",
      opt.check, "X", { vocab = (1 << 32) + 64 }, S)
    rejects("X: vocab must be a positive integer, got nan", opt.check, "X", { vocab = 0 / 0 }, S)
    rejects("X: eps must be a finite number > 0, got 0", opt.check, "X", { vocab = 1, eps = 0 }, S)
    rejects("X: eps must be a finite number > 0, got inf", opt.check, "X", { vocab = 1, eps = math.huge }, S)
    rejects("X: tie must be a boolean, got 'yes'", opt.check, "X", { vocab = 1, tie = "yes" }, S)
    rejects("X: betas[2] must be a finite number in [0, 1), got 1",
      opt.check, "X", { vocab = 1, betas = { 0.9, 1 } }, S)
    rejects("X: betas must be a list of 2 values, got a list of 3",
      opt.check, "X", { vocab = 1, betas = { 0, 0, 0 } }, S)
    rejects("X: path[2] must be a string, got 5", opt.check, "X", { vocab = 1, path = { "a", 5 } }, S)
    rejects("X: path must be a string or a list, got true", opt.check, "X", { vocab = 1, path = true }, S)
    rejects("X: vocab= is required (a positive integer)", opt.check, "X", { tie = true }, S)
    rejects("X: expects a table of options (vocab=, ...), got nothing", opt.check, "X", nil, S)
    rejects("X: expects a table of options (vocab=, ...), got 5", opt.check, "X", 5, S)
  end)

  it("parses enums exactly", function()
    rejects("X: parallel must be 'column' or 'row', got 'Column'",
      opt.check, "X", { vocab = 1, parallel = "Column" }, S)
    assert.equal("row", opt.check("X", { vocab = 1, parallel = "row" }, S).parallel)
  end)

  it("explains an enum's values when asked to", function()
    local E = { on_nan = opt.enum({ "error", "skip" }, { default = "error",
      explain = { error = "stop with an error", skip = "skip the step" } }) }
    rejects("X: on_nan must be 'error' (stop with an error) or 'skip' (skip the step), got 'ignore'",
      opt.check, "X", { on_nan = "ignore" }, E)
    assert.equal("error", opt.check("X", {}, E).on_nan)
  end)

  it("takes functions and callable values where a callable is asked for", function()
    local C = { f = opt.callable(), clock = opt.callable{ what = "a function returning seconds" }, g = "callable" }
    local callable = setmetatable({}, { __call = function() return 1 end })
    local o = opt.check("X", { f = print, clock = callable, g = callable }, C)
    assert.equal(print, o.f)
    assert.equal(callable, o.clock)
    rejects("X: f must be a function or a callable table, got a table", opt.check, "X", { f = {} }, C)
    rejects("X: clock must be a function returning seconds, got 5", opt.check, "X", { clock = 5 }, C)
  end)

  it("refuses a missing table with how.required, and takes it as {} without", function()
    local N = { n = opt.integer{ min = 1, default = 1 } }
    assert.equal(1, opt.check("X", nil, N).n)
    rejects("X: expects a table of options, got nothing", opt.check, "X", nil, N, { required = true })
    assert.equal(2, opt.check("X", { n = 2 }, N, { required = true }).n)
  end)

  it("names the user's line, or none with level = 0", function()
    local function ctor(o)
      local r = opt.check("C", o, S) -- not a tail call: that would take ctor's frame away
      return r
    end
    local ok, e = pcall(function() local r = ctor({ vocab = 0 }); return r end)
    assert.is_false(ok)
    assert.matches("^spec/unit/options_spec%.lua:%d+: C: vocab must be", e)
    e = err_of(opt.check, "C", { vocab = 0 }, S, { level = 0 })
    assert.equal("C: vocab must be a positive integer, got 0", e)
  end)

  it("words the C bindings' unknown keys the same way", function()
    rejects("ParallelContext: unknown option 'tensors' (did you mean 'tensor'?)", pg.ParallelContext, { tensors = 1 })
    rejects("ParallelContext: expects a table of options, got number", pg.ParallelContext, 5)
    rejects("all_reduce: unknown option 'opp' (did you mean 'op'?)", pg.dist.all_reduce, pg.ones{ 2 }, { opp = "max" })
    rejects("pg.zeros: unknown option 'dtyp' (did you mean 'dtype'?)", pg.zeros, { 2 }, { dtyp = "int32" })
    rejects("pg.randn: unknown option 'sed' (did you mean 'seed'?)", pg.randn, { 2 }, { sed = 1 })
    rejects("pg.randn: mean and std must be finite", pg.randn, { 2 }, { std = 0 / 0 })
  end)

  it("words the test fakes' unknown keys the same way", function()
    rejects("pg.testing.fake_engine: unknown option 'dimm' (did you mean 'dim'?)", pg.testing.fake_engine, { dimm = 4 })
    local e = pg.testing.fake_engine{}
    rejects("fake_engine:forward_backward: unknown option 'grad_scal' (did you mean 'grad_scale'?)",
      function() return e:forward_backward({}, {}, { grad_scal = 2 }) end)
  end)
end)

describe("pg.nn constructors", function()
  local G = { vocab = 32, seq_len = 8, dim = 16, heads = 2, layers = 1 }
  local L = { vocab = 32, seq_len = 8, dim = 16, heads = 2, layers = 1, hidden = 32 }

  it("reject a missing options table instead of indexing nil", function()
    for name, need in pairs{ GPT = "dim=, heads=, layers=, seq_len=, vocab=", Llama = "dim=, heads=, hidden=",
                             Embedding = "dim=, vocab=", LMHead = "dim=, vocab=", Attention = "heads=, seq_len=",
                             MLP = "dim=", SwiGLU = "dim=, hidden=", CausalSelfAttention = "dim=, heads=, seq_len=",
                             LlamaAttention = "dim=, heads=, seq_len=", TransformerBlock = "dim=, heads=, seq_len=",
                             LlamaBlock = "dim=, heads=, hidden=, seq_len=" } do
      rejects(name .. ": expects a table of options (" .. need, pg.nn[name])
    end
    rejects("Linear: in= is required (a positive integer)", pg.nn.Linear)
    rejects("LayerNorm: dim= is required", pg.nn.LayerNorm)
    rejects("RMSNorm: dim= is required", pg.nn.RMSNorm)
    rejects("Sequential: expects a table of options, got 5", pg.nn.Sequential, 5)
    rejects("PreNorm: the norm: expected a pg.nn module", pg.nn.PreNorm)
    rejects("from_hf: dir= is required (a string)", pg.nn.from_hf)
    rejects("GPT.load_llmc: path= is required (a string)", pg.nn.GPT.load_llmc)
    -- a missing file is named, not the library line that opened it
    assert.equal("/nonexistent/model.bin: No such file or directory",
      err_of(pg.nn.GPT.load_llmc, "/nonexistent/model.bin"))
  end)

  it("reject unknown keys, naming the closest known one", function()
    rejects("GPT: unknown option 'lyers' (did you mean 'layers'?)", pg.nn.GPT, with(G, "lyers", 2))
    rejects("Llama: unknown option 'hiden' (did you mean 'hidden'?)", pg.nn.Llama, with(L, "hiden", 2))
    rejects("Linear: unknown option 'gather_outputs' (did you mean 'gather_output'?)", pg.nn.Linear,
      { ["in"] = 4, out = 4, gather_outputs = true })
    rejects("Linear: unknown option 'nmae' (did you mean 'name'?)", pg.nn.Linear, 4, 4, { nmae = "x" })
    rejects("Embedding: unknown option 'positon' (did you mean 'positions'?)", pg.nn.Embedding,
      { vocab = 8, dim = 4, positon = 2 })
    rejects("LMHead: unknown option 'tied' (did you mean 'tie'?)", pg.nn.LMHead, { vocab = 8, dim = 4, tied = false })
    rejects("Attention: unknown option 'head' (did you mean 'heads'?)",
      pg.nn.Attention, { dim = 8, heads = 2, seq_len = 4, head = 1 })
    rejects("LayerNorm: unknown option 'nam' (did you mean 'name'?)", pg.nn.LayerNorm, 4, { nam = "x" })
    rejects("RMSNorm: unknown option 'epsilon' (known: dim, eps, name)", pg.nn.RMSNorm, { dim = 4, epsilon = 1e-5 })
    rejects("GELU: unknown option 'nmae'", pg.nn.GELU, { nmae = "g" })
    rejects("GatedSiLU: unknown option 'nmae'", pg.nn.GatedSiLU, { nmae = "g" })
    rejects("MLP: unknown option 'hiden'", pg.nn.MLP, { dim = 4, hiden = 8 })
    rejects("SwiGLU: unknown option 'hiden'", pg.nn.SwiGLU, { dim = 4, hidden = 8, hiden = 8 })
    rejects("TransformerBlock: unknown option 'layers'",
      pg.nn.TransformerBlock, { dim = 8, heads = 2, seq_len = 4, layers = 2 })
    rejects("LlamaBlock: unknown option 'kv_head' (did you mean 'kv_heads'?)", pg.nn.LlamaBlock,
      { dim = 8, heads = 2, seq_len = 4, hidden = 8, kv_head = 1 })
    rejects("CausalSelfAttention: unknown option 'head'",
      pg.nn.CausalSelfAttention, { dim = 8, heads = 2, seq_len = 4, head = 1 })
    rejects("LlamaAttention: unknown option 'theta'",
      pg.nn.LlamaAttention, { dim = 8, heads = 2, seq_len = 4, theta = 1e4 })
    rejects("Residual: unknown option 'nmae'", pg.nn.Residual, pg.nn.GELU(), { nmae = "r" })
    rejects("Sequential: unknown option 'nmae'", pg.nn.Sequential, { pg.nn.GELU(), nmae = "x" })
    rejects("Layer: unknown option 'sed' (did you mean 'seed'?)", pg.nn.Layer, pg.nn.GELU(), nil, { sed = 1 })
  end)

  it("reject invalid values: non-integers, numbers past a C int, wrong types, infinities", function()
    rejects("GPT: padded_vocab must be a positive integer, got 65.5", pg.nn.GPT, with(G, "padded_vocab", 65.5))
    rejects("GPT: vocab must be a positive integer below 2^31, got 4294967360",
      pg.nn.GPT, with(G, "vocab", (1 << 32) + 64))
    rejects("GPT: tie must be a boolean, got 'yes'", pg.nn.GPT, with(G, "tie", "yes"))
    rejects("GPT: heads must be a positive integer, got nan", pg.nn.GPT, with(G, "heads", 0 / 0))
    rejects("GPT: arch must be 'gpt2', got 'llama'", pg.nn.GPT, with(G, "arch", "llama"))
    rejects("Llama: rope_theta must be a finite number > 1, got inf", pg.nn.Llama, with(L, "rope_theta", math.huge))
    rejects("Llama: eps must be a finite number >= 0, got nan", pg.nn.Llama, with(L, "eps", 0 / 0))
    rejects("Llama: tie must be a boolean, got 1", pg.nn.Llama, with(L, "tie", 1))
    rejects("Linear: parallel must be 'column' or 'row', got 'col'",
      pg.nn.Linear, { ["in"] = 4, out = 4, parallel = "col" })
    rejects("Linear: bias must be a boolean, got 'no'", pg.nn.Linear, { ["in"] = 4, out = 4, bias = "no" })
    rejects("Linear: blocks=3 does not divide out=4", pg.nn.Linear, { ["in"] = 4, out = 4, blocks = 3 })
    rejects("Linear: init_std must be a finite number >= 0, got -1",
      pg.nn.Linear, { ["in"] = 4, out = 4, init_std = -1 })
    rejects("Linear: in must be a positive integer, got 4.5", pg.nn.Linear, 4.5, 4)
    rejects("Linear: in is given twice, as an argument and as an option", pg.nn.Linear, 4, 4, { ["in"] = 4 })
    rejects("Embedding: padded_vocab=5 is smaller than vocab=10",
      pg.nn.Embedding, { vocab = 10, padded_vocab = 5, dim = 4 })
    rejects("Embedding: positions must be a non-negative integer, got -1",
      pg.nn.Embedding, { vocab = 10, dim = 4, positions = -1 })
    rejects("LMHead: tie must be a boolean, got 'yes'", pg.nn.LMHead, { vocab = 10, dim = 4, tie = "yes" })
    rejects("RMSNorm: eps must be a finite number >= 0, got inf", pg.nn.RMSNorm, { dim = 4, eps = math.huge })
    rejects("Layer: ctx must be a pg.ParallelContext, got 'ctx'", pg.nn.Layer, pg.nn.GELU(), "ctx")
  end)

  it("take their own config back (a Llama's says arch = 'llama')", function()
    local m = pg.nn.Llama(L)
    assert.equal("llama", m.config.arch)
    assert.same(m.config, pg.nn.Llama(m.config).config)
    local g = pg.nn.GPT(G)
    assert.same(g.config, pg.nn.GPT(g.config).config)
  end)
end)

describe("pg.parallelize and the engine", function()
  local G = { vocab = 32, seq_len = 8, dim = 16, heads = 2, layers = 1 }
  local engine = pg.parallelize(pg.nn.GPT(G))
  local x = pg.zeros({ 1, 8 }, { dtype = "int32" })

  it("reject bad parallelize options", function()
    local m = pg.nn.GPT(G)
    rejects("parallelize: bucket_mb must be a finite number in (0, 1048576], got -1",
      pg.parallelize, m, nil, { bucket_mb = -1 })
    rejects("parallelize: bucket_mb must be a finite number in (0, 1048576], got nan",
      pg.parallelize, m, nil, { bucket_mb = 0 / 0 })
    rejects("parallelize: shared_memory must be a boolean, got 'yes'",
      pg.parallelize, m, nil, { shared_memory = "yes" })
    rejects("parallelize: sequence_parallel must be a boolean, got 'yes'",
      pg.parallelize, m, nil, { sequence_parallel = "yes" })
    rejects("parallelize: sequence_parallel must be a boolean, got 1",
      pg.parallelize, m, nil, { sequence_parallel = 1 })
    rejects("parallelize: unknown option 'sequence_paralel' (did you mean 'sequence_parallel'?)",
      pg.parallelize, m, nil, { sequence_paralel = true })
    rejects("parallelize: unknown option 'micro_batch' (did you mean 'micro_batches'?)", pg.parallelize, m, nil,
      { micro_batch = 2 })
    rejects("parallelize: schedule must be '1f1b' or 'gpipe', got '1F1B'",
      pg.parallelize, m, nil, { schedule = "1F1B" })
    rejects("parallelize: stages must be a list, got '2'", pg.parallelize, m, nil, { stages = "2" })
    rejects("parallelize: seed must be an integer, got 1.5", pg.parallelize, m, nil, { seed = 1.5 })
    rejects("parallelize: device must be a string, got 5", pg.parallelize, m, nil, { device = 5 })
    rejects("parallelize: ctx must be a pg.ParallelContext, got 'ctx'", pg.parallelize, m, "ctx")
    rejects("parallelize: expects a table of options, got 'fast'", pg.parallelize, m, nil, "fast")
    rejects("parallelize: the model must be a pg.nn module, got 5", pg.parallelize, 5)
  end)

  it("reject bad forward_backward options and batches", function()
    rejects("forward_backward: unknown option 'grad_scal' (did you mean 'grad_scale'?)",
      function() return engine:forward_backward(x, x, { grad_scal = 2 }) end)
    rejects("forward_backward: grad_scale must be a finite number, got nan",
      function() return engine:forward_backward(x, x, { grad_scale = 0 / 0 }) end)
    rejects("forward_backward: sync must be a boolean, got 'no'",
      function() return engine:forward_backward(x, x, { sync = "no" }) end)
    rejects("inputs: expected an int32 tensor [batch, seq_len], got nil",
      function() return engine:forward_backward() end)
    assert.is_number(engine:forward_backward(x, x, { grad_scale = 2, sync = true }))
  end)

  it("AdamW: rejects infinite, NaN and out-of-range hyperparameters, at construction and in set_lr", function()
    local function adamw(o) return pg.optim.AdamW(engine, o) end
    rejects("AdamW: lr must be a finite number >= 0, got inf", adamw, { lr = math.huge })
    rejects("AdamW: lr must be a finite number >= 0, got nan", adamw, { lr = 0 / 0 })
    rejects("AdamW: lr must be a finite number >= 0, got -1", adamw, { lr = -1 })
    rejects("AdamW: lr must be a number, got '1e-3'", adamw, { lr = "1e-3" })
    rejects("AdamW: betas[1] must be a number in [0, 1), got -0.1", adamw, { betas = { -0.1, 0.9 } })
    rejects("AdamW: betas[2] must be a number in [0, 1), got 1", adamw, { betas = { 0.9, 1 } })
    rejects("AdamW: betas must be a list of 2 values, got 0.9", adamw, { betas = 0.9 })
    rejects("AdamW: eps must be a finite number > 0, got -1", adamw, { eps = -1 })
    rejects("AdamW: weight_decay must be a finite number >= 0, got nan", adamw, { weight_decay = 0 / 0 })
    rejects("AdamW: lr=1e+39 is beyond the range of float32", adamw, { lr = 1e39 })
    rejects("AdamW: zero must be an integer, got true", adamw, { zero = true })
    rejects("AdamW: unknown option 'weight_decy' (did you mean 'weight_decay'?)", adamw, { weight_decy = 0 })
    rejects("AdamW: engine= is required (an engine made by pg.parallelize)", pg.optim.AdamW)
    local o = adamw{ lr = 0.5 }
    rejects("AdamW: lr must be a finite number >= 0, got nan", function() return o:set_lr(0 / 0) end)
    rejects("AdamW: lr must be a finite number >= 0, got inf", function() return o:set_lr(math.huge) end)
    rejects("AdamW: lr must be a finite number >= 0, got -1", function() return o:set_lr(-1) end)
    rejects("AdamW:set_lr: lr= is required (a number)", function() return o:set_lr() end)
    rejects("AdamW: unknown option 'lrr' (did you mean 'lr'?)", function() return o.c:hparams{ lrr = 1 } end)
    assert.equal(0.5, o:get_lr(), "a refused value leaves the rate as it was")
    o:set_lr(0.25)
    assert.equal(0.25, o:get_lr())
    rejects("clip_grad_norm: max_norm must be a number > 0, got nan", function() return o:clip_grad_norm(0 / 0) end)
    rejects("AdamW:clip_grad_norm: max_norm= is required", function() return o:clip_grad_norm() end)
  end)
end)
