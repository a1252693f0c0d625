-- The tools users reach for: pg.fs (directories without a shell), the
-- examples' and scripts' options (lua-argparse: --help, unknown options are
-- errors), scripts/generate.lua (text from a checkpoint) and scripts/plot.lua
-- (a run's metrics through gnuplot), and pg.sample.generate's prompt forms.
local pg = require "pipegoose"
local h = require "helpers"

describe("pg.fs", function()
  it("makes, lists and removes directory trees whose names a shell would misread", function()
    local root = h.tmpdir() .. " it's -rf $HOME"
    pg.fs.mkdir_p(root .. "/b/c")
    pg.fs.mkdir_p(root .. "/b/c") -- an existing directory is fine
    assert.is_true(pg.fs.is_dir(root .. "/b/c"))
    local f = assert(io.open(root .. "/b/z.txt", "w"))
    f:write("x")
    f:close()
    f = assert(io.open(root .. "/b/a.txt", "w"))
    f:close()
    assert.same({ "a.txt", "c", "z.txt" }, pg.fs.list(root .. "/b"))
    assert.is_true(pg.fs.exists(root .. "/b/z.txt"))
    assert.is_false(pg.fs.is_dir(root .. "/b/z.txt"))
    pg.fs.remove_tree(root)
    assert.is_false(pg.fs.exists(root))
    pg.fs.remove_tree(root) -- a missing tree is fine
  end)

  it("refuses to remove /, ., .. or an empty path, and names what it cannot do", function()
    for _, bad in ipairs{ "", "/", ".", "..", "a/..", "x/.", "//" } do
      local ok, err = pcall(pg.fs.remove_tree, bad)
      assert.is_false(ok, bad)
      assert.matches("remove_tree: refusing to remove", err, 1, true)
    end
    local ok, err = pcall(pg.fs.list, "/nonexistent/dir")
    assert.is_false(ok)
    assert.matches("list /nonexistent/dir: No such file or directory", err, 1, true)
    local file = os.tmpname()
    ok, err = pcall(pg.fs.mkdir_p, file .. "/sub")
    os.remove(file)
    assert.is_false(ok)
    assert.matches("mkdir " .. file .. "/sub: Not a directory", err, 1, true)
  end)

  it("knows whether output goes to a terminal (here it does not: busted's output is captured)", function()
    local rc, out = h.sh(h.pglua_cmd{ "-e", "print(require('pipegoose').fs.isatty('stdout'))" })
    assert.equal(0, rc, out)
    assert.matches("^false", out)
  end)
end)

describe("command-line options", function()
  it("train_gpt.lua refuses an unknown option, suggesting the right one, and explains itself with --help", function()
    local rc, out = h.sh(h.pglua_cmd{ "examples/train_gpt.lua", "--stpes=5" })
    assert.is_not.equal(0, rc)
    assert.matches("unknown option '--stpes'", out, 1, true)
    assert.matches("Did you mean '--steps'?", out, 1, true)
    rc, out = h.sh(h.pglua_cmd{ "examples/train_gpt.lua", "--steps=many" })
    assert.is_not.equal(0, rc)
    assert.matches("--steps must be an integer, got 'many'", out, 1, true)
    rc, out = h.sh(h.pglua_cmd{ "examples/train_gpt.lua", "--steps=-5" })
    assert.is_not.equal(0, rc)
    assert.matches("--steps must be at least 1, got -5", out, 1, true)
    rc, out = h.sh(h.pglua_cmd{ "examples/train_gpt.lua", "--help" })
    assert.equal(0, rc, out)
    assert.matches("--steps", out, 1, true)
    assert.matches("--model {gpt,llama,mixtral}", out, 1, true)
  end)

  it("the check scripts do too", function()
    for _, script in ipairs{ "scripts/model_check.lua", "scripts/gpt2_check.lua", "scripts/hf_check.lua",
                             "scripts/prepare_corpus.lua", "scripts/generate.lua", "scripts/plot.lua" } do
      local rc, out = h.sh(h.pglua_cmd{ script, "--tensr=2" })
      assert.is_not.equal(0, rc, script)
      assert.matches("unknown option '--tensr'", out, 1, true)
      rc, out = h.sh(h.pglua_cmd{ script, "--help" })
      assert.equal(0, rc, script .. ": " .. out)
      assert.matches("Usage: ", out, 1, true)
    end
  end)

  it("bench.lua lists its parts with --help and refuses a BENCH_ONLY part it does not know, naming them", function()
    local rc, out = h.sh(h.pglua_cmd{ "scripts/bench.lua", "--help" })
    assert.equal(0, rc, out)
    assert.matches("Usage: ", out, 1, true)
    assert.matches("\n  pp     pipeline = 2", out, 1, true)
    rc, out = h.sh("BENCH_ONLY=peak,bogus " .. h.pglua_cmd{ "scripts/bench.lua" })
    assert.is_not.equal(0, rc)
    assert.matches("no part named bogus; the parts are peak, gpt2, gpt2_b8, small,", out, 1, true)
    assert.is_nil(out:find("pipegoose bench:", 1, true), out) -- refused before anything ran
  end)
end)

describe("scripts/generate.lua", function()
  local model = { vocab = 256, seq_len = 16, dim = 32, layers = 1, heads = 4, kv_heads = 2, hidden = 48 }

  it("rebuilds a checkpoint's model from its record and continues a prompt as the trained engine does", function()
    local dir = h.tmpdir()
    local engine = pg.parallelize(pg.nn.Llama(model), nil, { seed = 3 })
    local t = pg.Trainer{ engine = engine, optimizer = pg.optim.AdamW(engine, { lr = 1e-3 }), out = pg.testing.capture() }
    t:save_checkpoint(dir .. "/ck")
    local want = pg.data.bytes.decode(pg.sample.generate(engine, pg.data.bytes.encode("Q: "), 12, { temperature = 0 }))
    local rc, out = h.sh(h.pglua_cmd{ "scripts/generate.lua", "--checkpoint=" .. dir .. "/ck", "--prompt=Q: ",
      "--tokens=12" })
    assert.equal(0, rc, out)
    assert.equal("Q: " .. want .. "\n", out)
    -- sampling with a seed repeats
    local args = { "scripts/generate.lua", "--checkpoint=" .. dir .. "/ck", "--prompt=ab", "--tokens=8",
      "--temperature=0.9", "--top-k=5", "--seed=7" }
    local _, a = h.sh(h.pglua_cmd(args))
    local _, b = h.sh(h.pglua_cmd(args))
    assert.equal(a, b)
    h.rm(dir)
  end)

  it("takes and prints token ids for a model that is not byte-level, and refuses a bad id", function()
    local dir = h.tmpdir()
    local engine = pg.parallelize(pg.nn.GPT{ vocab = 50, seq_len = 8, dim = 16, heads = 2, layers = 1 }, nil, {})
    local t = pg.Trainer{ engine = engine, optimizer = pg.optim.AdamW(engine, { lr = 1e-3 }), out = pg.testing.capture() }
    t:save_checkpoint(dir .. "/ck")
    local want = table.concat(pg.sample.generate(engine, { 3, 4 }, 5), ",")
    local rc, out = h.sh(h.pglua_cmd{ "scripts/generate.lua", "--checkpoint=" .. dir .. "/ck", "--prompt=3,4", "--tokens=5" })
    assert.equal(0, rc, out)
    assert.equal(want .. "\n", out)
    rc, out = h.sh(h.pglua_cmd{ "scripts/generate.lua", "--checkpoint=" .. dir .. "/ck", "--prompt=3,77" })
    assert.is_not.equal(0, rc)
    assert.matches("generate: prompt token 2 is 77, not an id in [0, 50)", out, 1, true)
    h.rm(dir)
  end)
end)

describe("pg.sample.generate", function()
  it("takes the prompt as a list or as the int32 tensor pg.data.bytes.encode returns, and checks its options", function()
    local engine = pg.parallelize(pg.nn.GPT{ vocab = 256, seq_len = 8, dim = 16, heads = 2, layers = 1 }, nil, {})
    local ids = pg.data.bytes.encode("hi")
    assert.same(pg.sample.generate(engine, ids:totable(), 4), pg.sample.generate(engine, ids, 4))
    for _, c in ipairs{
      { { 1 }, 4, { temprature = 1 }, "generate: unknown option 'temprature' (did you mean 'temperature'?)" },
      { { 1 }, 4, 5, "generate: expects a table of options, got 5" },
      { { 1 }, 2, { seed = 0.5 }, "generate: seed must be an integer, got 0.5" },
      { { 1 }, -1, nil, "generate: n must be an integer >= 0, got -1" },
      { { 1 }, 2, { temperature = -1 }, "generate: temperature must be a number >= 0, got -1" },
      { { 1 }, 2, { top_k = 0 }, "generate: top_k must be a positive integer, got 0" },
      { {}, 2, nil, "generate: the prompt needs at least one token" },
      { { 1.5 }, 2, nil, "generate: prompt token 1 is 1.5, not an id in [0, 256)" },
      { "hi", 2, nil, "generate: the prompt must be a list or a tensor of token ids, got string" },
    } do
      local ok, err = pcall(pg.sample.generate, engine, c[1], c[2], c[3])
      assert.is_false(ok)
      assert.matches(c[4], err, 1, true)
    end
  end)
end)

describe("scripts/plot.lua", function()
  local function metrics(lines)
    local path = h.tmpfile(table.concat(lines, "\n") .. "\n", ".jsonl")
    return path
  end

  it("draws loss, validation loss, learning rate and tokens/s into a PNG", function()
    local path = metrics{
      '{"kind":"train","step":1,"loss":5.5,"lr":0.001,"tokens_per_s":1000}',
      '{"kind":"train","step":2,"loss":5.1,"lr":0.0009,"tokens_per_s":1100}',
      '{"kind":"val","step":2,"val_loss":5.2}',
    }
    local png = h.tmpdir() .. " it's.png"
    local rc, out = h.sh(h.pglua_cmd{ "scripts/plot.lua", path, "-o", png, "--title=a \"run\"" })
    assert.equal(0, rc, out)
    assert.matches("wrote .*: 3 panels from 3 records", out)
    local f = assert(io.open(png, "rb"))
    assert.equal("\137PNG", f:read(4))
    f:close()
    os.remove(png)
    os.remove(path)
  end)

  it("names a line that is not JSON, and a file without losses", function()
    local bad = metrics{ '{"kind":"train","step":1,"loss":5.5}', "not json" }
    local rc, out = h.sh(h.pglua_cmd{ "scripts/plot.lua", bad, "-o", "/tmp/x.png" })
    assert.is_not.equal(0, rc)
    assert.matches(bad .. ":2 is not a JSON object", out, 1, true)
    local empty = metrics{ '{"kind":"train","step":1,"grad_norm":1}' }
    rc, out = h.sh(h.pglua_cmd{ "scripts/plot.lua", empty, "-o", "/tmp/x.png" })
    assert.is_not.equal(0, rc)
    assert.matches("has no loss or val_loss records (1 records read)", out, 1, true)
    os.remove(bad)
    os.remove(empty)
  end)
end)

describe("pg.machine", function()
  it("says which OpenBLAS kernels run and keeps a core the user chose", function()
    local rc, out = h.sh(h.pglua_cmd{ "-e", [[local m = require("pipegoose").machine()
      print(m.blas_core, m.blas_core_chosen, m.features ~= nil)]] })
    assert.equal(0, rc, out)
    local core, chosen = out:match("^(%S+)\t(%S+)\ttrue")
    assert.is_not_nil(core, out)
    -- pglua only steps in when OpenBLAS fell back to its generic kernels
    if chosen == "true" then
      assert.is_nil(({ Prescott = 1, Core2 = 1, Nehalem = 1, Katmai = 1 })[core], out)
    end
    rc, out = h.sh("OPENBLAS_CORETYPE=Prescott " .. h.pglua_cmd{ "-e", [[local m = require("pipegoose").machine()
      print(m.blas_core, m.blas_core_chosen)]] })
    assert.equal(0, rc, out)
    assert.matches("^Prescott\tfalse", out)
  end)
end)

describe("ProgressBar", function()
  it("rewrites its line only on a terminal: a log redirected to a file or a pipe gets plain lines", function()
    local script = h.tmpfile([[
      local pg = require "pipegoose"
      local engine = pg.testing.fake_engine{}
      local t = pg.Trainer{ engine = engine, optimizer = pg.testing.fake_optimizer(engine), max_steps = 3,
        log_every_n_steps = 1, callbacks = { pg.callbacks.ProgressBar{} } }
      t:fit(pg.testing.fake_data{})
    ]])
    local rc, out = h.sh(h.pglua_cmd{ script } .. " | cat")
    assert.equal(0, rc, out)
    assert.matches("step 3/3", out, 1, true)
    assert.is_nil(out:find("\r", 1, true), "no carriage return in a piped log")
    rc, out = h.sh("PG_PROGRESS=tty " .. h.pglua_cmd{ script } .. " | cat")
    assert.equal(0, rc, out)
    assert.is_not_nil(out:find("\r", 1, true), "PG_PROGRESS=tty forces the one-line display")
    os.remove(script)
  end)
end)
