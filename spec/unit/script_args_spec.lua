-- Every script's command line goes through lua-argparse: --help prints the
-- usage and exits 0 before doing anything, an unknown option or an extra
-- positional argument is refused with exit 1 and one line naming it.
local h = require "helpers"

-- The runnable scripts (libraries that scripts load are not among them: check_options.lua, mutations.lua,
-- examples/options.lua, measures.lua, lua_llama.lua). A script missing from the list fails the last test.
local SCRIPTS = {
  "scripts/bench.lua", "scripts/bench_attention_block.lua", "scripts/bench_comm.lua", "scripts/bench_gpu.lua", "scripts/bench_kernels.lua",
  "scripts/calibrate.lua", "scripts/checkpoint.lua", "scripts/generate.lua", "scripts/gpt2_check.lua",
  "scripts/hf_check.lua", "scripts/hf_export_check.lua", "scripts/model_check.lua", "scripts/mutate.lua",
  "scripts/plan.lua", "scripts/plan_published.lua", "scripts/plan_validate.lua", "scripts/plot.lua",
  "scripts/prepare_corpus.lua", "scripts/test_summary.lua",
  "examples/callbacks_recipe.lua", "examples/classify.lua", "examples/distill.lua", "examples/train_gpt.lua",
  "examples/train_llama.lua", "examples/train_moe.lua",
}
-- the scripts that take positional arguments (the others must refuse one)
local POSITIONAL = { ["scripts/checkpoint.lua"] = true, ["scripts/gpt2_check.lua"] = true,
  ["scripts/hf_check.lua"] = true, ["scripts/plot.lua"] = true, ["scripts/prepare_corpus.lua"] = true,
  ["scripts/test_summary.lua"] = true }
local LIBRARIES = { ["scripts/check_options.lua"] = true, ["scripts/mutations.lua"] = true,
  ["examples/options.lua"] = true, ["examples/measures.lua"] = true, ["examples/lua_llama.lua"] = true }

-- Every invocation the tests need, run once, 8 at a time (each pglua start is ~0.4 s of MPI set-up, mostly
-- waiting): results[key] = { rc, out }. A hang guard only (mutate.lua --help once started a mutation run).
local results
local function run(script, ...)
  local key = table.concat({ script, ... }, " ")
  if results and results[key] then return results[key][1], results[key][2] end
  return h.sh(("timeout -k 5 %d %s"):format(h.limit(60), h.pglua_cmd{ script, ... }))
end

local function run_all(invocations)
  local dir = h.tmpdir()
  assert(os.execute("mkdir -p " .. h.quote(dir)))
  local list = {}
  for i, inv in ipairs(invocations) do
    list[i] = ("%d %s"):format(i, h.quote(("timeout -k 5 %d %s > %s/%d.out 2>&1; echo $? > %s/%d.rc")
      :format(h.limit(60), h.pglua_cmd(inv), h.quote(dir), i, h.quote(dir), i)))
  end
  local jobs = h.tmpfile(table.concat(list, "\n") .. "\n", ".txt")
  h.sh(("cut -d' ' -f2- %s | xargs -P 8 -I{} sh -c {}"):format(h.quote(jobs)))
  os.remove(jobs)
  results = {}
  for i, inv in ipairs(invocations) do
    local rc = tonumber((h.read(("%s/%d.rc"):format(dir, i)):match("%d+")))
    results[table.concat(inv, " ")] = { rc, h.read(("%s/%d.out"):format(dir, i)) }
  end
  h.rm(dir)
end

local function lines_with(out, text)
  local n = 0
  for line in out:gmatch("[^\n]+") do
    if line:find(text, 1, true) then n = n + 1 end
  end
  return n
end

describe("script arguments", function()
  setup(function()
    local inv = { { "scripts/test_summary.lua", "/nonexistent/summaries" } }
    for _, script in ipairs(SCRIPTS) do
      inv[#inv + 1] = { script, "--help" }
      inv[#inv + 1] = { script, "--no-such-option=1" }
      if not POSITIONAL[script] and script ~= "scripts/plan_validate.lua" then inv[#inv + 1] = { script, "stray-positional" } end
    end
    run_all(inv)
  end)

  for _, script in ipairs(SCRIPTS) do
    it(script .. " --help: the usage, exit 0", function()
      local rc, out = run(script, "--help")
      assert.equal(0, rc, out)
      assert.truthy(out:find("Usage: ", 1, true), out)
    end)

    it(script .. " --no-such-option: exit 1, one line naming it", function()
      local rc, out = run(script, "--no-such-option=1")
      assert.equal(1, rc, out)
      assert.equal(1, lines_with(out, "--no-such-option"), out)
    end)

    if not POSITIONAL[script] and script ~= "scripts/plan_validate.lua" then
      it(script .. " with an extra positional argument: exit 1, refused", function()
        local rc, out = run(script, "stray-positional")
        assert.equal(1, rc, out)
        assert.truthy(out:find("Error: too many arguments", 1, true) or out:find("stray-positional", 1, true), out)
      end)
    end
  end

  it("test_summary.lua refuses a directory that is not there (it read as a run of no tests)", function()
    local rc, out = run("scripts/test_summary.lua", "/nonexistent/summaries")
    assert.equal(1, rc, out)
    assert.truthy(out:find("/nonexistent/summaries is not a directory of summaries", 1, true), out)
  end)

  it("prepare_corpus.lua without --tokenizer refuses inputs that hold no documents (it wrote two empty shards)",
    function()
    local dir = h.tmpdir()
    assert(os.execute("mkdir -p " .. h.quote(dir)))
    local empty = h.tmpfile("%\n%\n", ".txt")
    local rc, out = h.sh(h.pglua_cmd{ "scripts/prepare_corpus.lua", "--out=" .. dir, empty })
    os.remove(empty)
    local left = h.exists(dir .. "/fortunes_train.bin")
    h.rm(dir)
    assert.equal(1, rc, out)
    assert.truthy(out:find("prepare_corpus: the inputs hold no documents: an empty corpus is refused", 1, true), out)
    assert.is_false(left)
  end)

  it("every script is in the list", function()
    local f = assert(io.popen("ls scripts/*.lua examples/*.lua"))
    local listed = {}
    for _, s in ipairs(SCRIPTS) do listed[s] = true end
    for p in f:lines() do
      assert.is_true(listed[p] or LIBRARIES[p] or false, p .. " is neither in SCRIPTS nor in LIBRARIES")
    end
    f:close()
  end)
end)
