-- What a newcomer meets first on the command line (issue 30, item 3):
-- scripts/generate.lua sampling a run's output directory; examples/train_gpt.lua
-- keeping a final checkpoint and printing the command that samples it (once,
-- from rank 0), --sample=0, --zero's stages, errors in the options of the
-- wrappers (train_llama.lua) reported without another script's file:line; and
-- --help in every script and example, naming the script.
local pg = require "pipegoose"
local h = require "helpers"

local root = h.tmpdir()
pg.fs.mkdir_p(root)

-- A small corpus of printable bytes (one shard for training and validation).
local ids, x = {}, 11
for i = 1, 6000 do
  x = (x * 1103515245 + 12345) % 2147483648
  ids[i] = i % 89 == 0 and 10 or 32 + (x >> 8) % 64
end
pg.data.write_shard(root .. "/tokens.bin", ids)

-- examples/train_gpt.lua with a tiny model, a few steps and the corpus above.
local TINY = { "--train=" .. root .. "/tokens.bin", "--val=" .. root .. "/tokens.bin", "--dim=32", "--layers=1",
  "--heads=4", "--seq-len=16", "--batch=4", "--steps=4", "--warmup=1", "--eval-every=2", "--val-batches=1",
  "--log-every=2" }

local function train_args(script, extra)
  local args = { script }
  for _, a in ipairs(TINY) do args[#args + 1] = a end
  for _, a in ipairs(extra) do args[#args + 1] = a end
  return args
end

-- pglua with a hang guard (not a timing assertion)
local function run(args, env)
  return h.sh((env or "") .. " timeout -k 5 120 " .. h.pglua_cmd(args))
end

describe("scripts/generate.lua --checkpoint=", function()
  local model = { vocab = 256, seq_len = 16, dim = 32, heads = 4, layers = 1 }

  -- A Trainer's save of a fresh model (weights from `seed`) under out_dir at `step`.
  local function save(out_dir, seed, step)
    local engine = pg.parallelize(pg.nn.GPT(model), nil, { seed = seed })
    local t = pg.Trainer{ engine = engine, optimizer = pg.optim.AdamW(engine, { lr = 1e-3 }), out_dir = out_dir,
                          out = pg.testing.capture() }
    t.state.step = step
    t:save_checkpoint()
    return pg.data.bytes.decode(pg.sample.generate(engine, pg.data.bytes.encode("Q: "), 12))
  end

  it("takes a run's output directory and samples its newest checkpoint (the one resume='last' loads)", function()
    local out_dir = root .. "/run"
    local older = save(out_dir, 3, 2)
    local newest = save(out_dir, 4, 7)
    assert.not_equal(older, newest) -- different weights: the output says which checkpoint was read
    assert.equal(out_dir .. "/checkpoints/step-00000007", pg.checkpoint.latest(out_dir .. "/checkpoints"))
    for _, dir in ipairs{ out_dir, out_dir .. "/", out_dir .. "/checkpoints", out_dir .. "/checkpoints/step-00000007" } do
      local rc, out = run{ "scripts/generate.lua", "--checkpoint=" .. dir, "--prompt=Q: ", "--tokens=12" }
      assert.equal(0, rc, dir .. ": " .. out)
      assert.equal("Q: " .. newest .. "\n", out, dir)
    end
    -- an older checkpoint named directly is still that one
    local rc, out = run{ "scripts/generate.lua", "--checkpoint=" .. out_dir .. "/checkpoints/step-00000002",
      "--prompt=Q: ", "--tokens=12" }
    assert.equal(0, rc, out)
    assert.equal("Q: " .. older .. "\n", out)
  end)

  it("names the directory when a run has no checkpoint, and a path that does not exist", function()
    local bare = root .. "/bare run"
    pg.fs.mkdir_p(bare)
    local f = assert(io.open(bare .. "/metrics.jsonl", "w"))
    f:write('{"kind":"train","step":1,"loss":5.5}\n')
    f:close()
    local rc, out = run{ "scripts/generate.lua", "--checkpoint=" .. bare, "--prompt=Q: " }
    assert.equal(1, rc, out)
    assert.matches("generate: " .. bare .. " holds no checkpoint: it is not one (no manifest.json) and, as a run's "
      .. "output directory, has none in " .. bare .. "/checkpoints", out, 1, true)
    rc, out = run{ "scripts/generate.lua", "--checkpoint=" .. root .. "/nowhere", "--prompt=Q: " }
    assert.equal(1, rc, out)
    assert.matches("generate: --checkpoint=" .. root .. "/nowhere: no such directory", out, 1, true)
  end)
end)

describe("examples/train_gpt.lua", function()
  it("keeps its final checkpoint without --ckpt-every and prints the command that samples it again, "
    .. "which gives the same text", function()
    local out_dir = root .. "/gpt"
    local rc, out = run(train_args("examples/train_gpt.lua", { "--out=" .. out_dir, "--sample=24" }))
    assert.equal(0, rc, out)
    -- only the final checkpoint (none at the validations of steps 2 and 4 before it)
    assert.same({ "latest", "step-00000004" }, pg.fs.list(out_dir .. "/checkpoints"))
    local sample = out:match("\nsample:\n(.-)\ndictionary words: [^\n]*\nsample it again: ")
    assert.is_not_nil(sample, out)
    assert.equal(1, h.count(out, "sample it again: "), out)
    local cmd = out:match("\nsample it again: ([^\n]+)\n$")
    assert.equal(h.pglua .. " scripts/generate.lua --checkpoint=" .. out_dir .. " --prompt='Q: ' --tokens=24 "
      .. "--temperature=0.8 --seed=1", cmd)
    local rc2, again = h.sh(cmd)
    assert.equal(0, rc2, again)
    assert.equal(sample .. "\n", again) -- the same weights, tokens, temperature and seed: the same text
  end)

  it("with --sample=0 prints no sample and no header, and on two ranks prints the command once; "
    .. "--zero=2 is a stage it takes", function()
    local out_dir = root .. "/zero2"
    local args = train_args("examples/train_gpt.lua", { "--out=" .. out_dir, "--sample=0", "--data=2", "--zero=2" })
    local rc, out = h.sh("PG_PROGRESS=plain " .. h.mpirun_cmd(2, args, 120))
    assert.equal(0, rc, out)
    assert.is_nil(out:find("sample:", 1, true), out)
    assert.equal(1, h.count(out, "sample it: "), out)
    assert.matches("\nsample it: " .. h.pglua .. " scripts/generate.lua --checkpoint=" .. out_dir .. " --prompt='Q: '\n",
      out, 1, true)
    assert.is_true(pg.fs.exists(out_dir .. "/checkpoints/step-00000004/manifest.json"), out)
    assert.equal(2, pg.checkpoint.read_manifest(out_dir .. "/checkpoints/step-00000004").optimizer.zero)
  end)

  it("--islands=2 --outer-every=2 trains two islands that sync (DiLoCo): island 0 prints, island 1 writes its "
    .. "own directory", function()
    local out_dir = root .. "/islands"
    local args = train_args("examples/train_gpt.lua", { "--out=" .. out_dir, "--sample=0", "--islands=2",
                                                       "--outer-every=2" })
    local rc, out = h.sh("PG_PROGRESS=plain " .. h.mpirun_cmd(2, args, 120))
    assert.equal(0, rc, out)
    assert.equal(1, h.count(out, "sample it: "), out)
    assert.matches("island 0/2", out, 1, true)
    assert.matches("communicated bytes per step %(rank 0%): %d+ %(islands %d+%)", out)
    assert.is_true(pg.fs.exists(out_dir .. "/checkpoints/step-00000004/manifest.json"), out)
    assert.is_true(pg.fs.exists(out_dir .. "/island-1/checkpoints/step-00000004/manifest.json"), out)
    rc, out = h.sh(h.mpirun_cmd(2, train_args("examples/train_gpt.lua", { "--out=" .. out_dir .. "-x", "--islands=2" }),
      60))
    assert.is_not.equal(0, rc)
    assert.matches("--islands > 1 needs --outer-every=H", out, 1, true)
  end)

  it("--islands=2 stopped after step 3 resumes (--resume=last) at 2 islands and at 1, from the outer state", function()
    local out_dir = root .. "/islands-resume"
    local function train(extra)
      local args = train_args("examples/train_gpt.lua", { "--out=" .. out_dir, "--sample=0", "--outer-every=2" })
      for _, a in ipairs(extra) do args[#args + 1] = a end
      return h.sh(h.mpirun_cmd(2, args, 120))
    end
    local rc, out = train{ "--islands=2", "--stop-after=3" }
    assert.equal(0, rc, out)
    local m = pg.checkpoint.read_manifest(out_dir .. "/island-1/checkpoints/step-00000003")
    assert.equal(1, m.callbacks.DiLoCo.outer_steps)
    assert.equal(1, #m.callback_files.DiLoCo)
    assert.equal("outer-tp0-pp0.safetensors", m.callback_files.DiLoCo[1].file)
    rc, out = train{ "--islands=2", "--resume=last" }
    assert.equal(0, rc, out)
    assert.matches("resumed from " .. out_dir .. "/checkpoints/step-00000003 at step 3", out, 1, true)
    assert.equal(2, pg.checkpoint.read_manifest(out_dir .. "/island-1/checkpoints/step-00000004").callbacks.DiLoCo
      .outer_steps)
    -- one island of data = 2 from island 0's checkpoint at step 3 (the resharded outer state: 1 outer step)
    rc, out = train{ "--islands=1", "--resume=" .. out_dir .. "/checkpoints/step-00000003", "--steps=6" }
    assert.equal(0, rc, out)
    assert.matches("resumed from " .. out_dir .. "/checkpoints/step-00000003 at step 3", out, 1, true)
    assert.equal(3, pg.checkpoint.read_manifest(out_dir .. "/checkpoints/step-00000006").callbacks.DiLoCo.outer_steps)
  end)

  it("says in --help which ZeRO stages there are, and refuses another", function()
    local rc, out = run{ "examples/train_gpt.lua", "--help" }
    assert.equal(0, rc, out)
    assert.matches("--zero {0,1,2,3}", out, 1, true)
    assert.matches("2 (the gradients too)", out, 1, true)
    assert.matches("3 (the parameters too", out, 1, true)
    assert.is_nil(out:find("(0 or 1)", 1, true), out)
    rc, out = run{ "examples/train_gpt.lua", "--zero=4" }
    assert.is_not.equal(0, rc)
    assert.matches("argument for option '--zero' must be one of '0', '1', '2', '3'", out, 1, true)
  end)

  it("reports an error in the options under the script's name, not train_gpt.lua's line (also from the wrappers)",
    function()
    for _, c in ipairs{
      { "examples/train_llama.lua", "--kv-heads=3", "train_llama.lua: Llama: kv_heads=3 does not divide heads=4" },
      { "examples/train_moe.lua", "--dim=30", "train_moe.lua: Mixtral: dim=30 is not divisible by heads=4" },
      { "examples/train_gpt.lua", "--batch=0", "train_gpt.lua: TokenShards: batch must be a positive integer, got 0" },
    } do
      local rc, out = run(train_args(c[1], { c[2], "--out=" .. root .. "/bad" }))
      assert.equal(1, rc, out)
      assert.matches(c[3], out, 1, true)
      assert.is_nil(out:find("train_gpt%.lua:%d"), out)
    end
  end)
end)

describe("--help", function()
  local function scripts()
    local list = {}
    for _, dir in ipairs{ "scripts", "examples" } do
      for _, name in ipairs(pg.fs.list(dir)) do
        if name:match("%.lua$") then list[#list + 1] = dir .. "/" .. name end
      end
    end
    return list
  end

  it("works in every script and example: exit 0 and a usage that names the script itself", function()
    local list = scripts()
    assert.is_true(#list >= 20, table.concat(list, " ")) -- the directories were read
    -- mutate.lua would copy and build the tree there if --help started a run: it cannot (a file is in the way)
    local blocker = root .. "/not-a-dir"
    assert(io.open(blocker, "w")):close()
    for _, script in ipairs(list) do
      local rc, out = run({ script, "--help" }, "MUTATE_DIR=" .. h.quote(blocker .. "/m"))
      local name = script:match("[^/]+$")
      assert.equal(0, rc, script .. ": " .. out)
      local usage = out:match("Usage: ([^\n]*)")
      assert.is_not_nil(usage, script .. ": " .. out)
      assert.is_not_nil(usage:find(name, 1, true), script .. ": " .. out)
    end
  end)

  it("checkpoint.lua lists its commands (it said 'unknown flag --help')", function()
    local rc, out = run{ "scripts/checkpoint.lua", "--help" }
    assert.equal(0, rc, out)
    for _, cmd in ipairs{ "info DIR", "verify DIR", "seal DIR", "consolidate DIR OUT", "export-llmc DIR OUT",
                          "export-hf DIR OUTDIR" } do
      assert.matches("\n   " .. cmd, out, 1, true)
    end
    rc, out = run{ "scripts/checkpoint.lua", "--frce", "seal", root }
    assert.equal(1, rc)
    assert.matches("checkpoint.lua: unknown flag --frce", out, 1, true)
  end)

  it("mutate.lua prints its options without starting a run, and refuses an unknown option", function()
    -- a run would copy the tree into $MUTATE_DIR/tree and build it: a file in the way makes that fail at once
    -- (exit 1) instead of building here, should --help ever start one again
    local blocker = root .. "/mutate-blocker"
    assert(io.open(blocker, "w")):close()
    local env = "MUTATE_DIR=" .. h.quote(blocker .. "/m")
    local rc, out = run({ "scripts/mutate.lua", "--help" }, env)
    assert.equal(0, rc, out)
    assert.matches("^Usage: mutate.lua", out)
    assert.matches("--baseline", out, 1, true)
    assert.is_nil(out:find("building the copy", 1, true), out)
    rc, out = run({ "scripts/mutate.lua", "--onyl=bf16-truncates" }, env)
    assert.equal(1, rc, out)
    assert.matches("unknown option '--onyl'", out, 1, true)
    assert.matches("Did you mean '--only'?", out, 1, true)
    assert.is_nil(out:find("building the copy", 1, true), out)
    rc, out = run({ "scripts/mutate.lua", "--list" }, env) -- what it takes still works
    assert.equal(0, rc, out)
    assert.matches("^%S+ +%S+ +%S", out) -- name, file, why
  end)

  it("train_llama.lua and train_moe.lua name themselves and default --model to theirs", function()
    for script, model in pairs{ ["examples/train_llama.lua"] = "llama", ["examples/train_moe.lua"] = "mixtral" } do
      local rc, out = run{ script, "--help" }
      assert.equal(0, rc, out)
      assert.matches("^Usage: " .. script:match("[^/]+$"), out)
      assert.is_nil(out:find("train_gpt.lua [", 1, true), out)
      assert.matches("gpt, llama or mixtral. (default: " .. model .. ")", out, 1, true)
    end
  end)
end)

teardown(function() h.rm(root) end)
