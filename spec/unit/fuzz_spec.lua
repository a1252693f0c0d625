-- The fuzz targets' seed corpus (fuzz/corpus, written by fuzz/make_corpus.lua)
-- replayed through the same harness libFuzzer drives (`make fuzz`): every
-- file must come back (an error from the reader is fine) — no crash, no
-- sanitizer report (under `make asan` the replay binaries are built with
-- them), no hang (the guard below is not a timing assertion: the whole
-- corpus takes well under a second). New crashers found by `make fuzz` go
-- into fuzz/corpus/<target>/ so that they stay fixed.
local pg = require "pipegoose"
local h = require "helpers"

-- every target has its corpus folder (the Makefile's FUZZ_TARGETS)
local TARGETS = pg.fs.list("fuzz/corpus")

describe("the fuzz corpus", function()
  for _, target in ipairs(TARGETS) do
    it(("replays through the %s target"):format(target), function()
      local bin = ("%s/fuzz/replay_%s"):format(h.build, target)
      assert.is_true(h.exists(bin), bin .. " is missing: make fuzz-replay (make test builds it)")
      local files = pg.fs.list("fuzz/corpus/" .. target)
      assert.is_true(#files >= 5, "a seed corpus of several files")
      local args = {}
      for i, f in ipairs(files) do args[i] = h.quote("fuzz/corpus/" .. target .. "/" .. f) end
      local rc, out = h.sh(("timeout -k 2 120 %s %s"):format(h.quote(bin), table.concat(args, " ")))
      assert.equal(0, rc, out)
      assert.matches(("replayed %d inputs"):format(#files), out, 1, true)
    end)
  end

  it("has headers that lie about sizes refused at once, with the sizes named", function()
    local ok, err = pcall(require("pipegoose.llmc").read_header, "fuzz/corpus/llmc/huge_sizes")
    assert.is_false(ok)
    assert.matches("fuzz/corpus/llmc/huge_sizes: truncated: the header's model needs about 5.94e+28 bytes, the file has 1024",
      err, 1, true)
    ok, err = pcall(require("pipegoose.llmc").read_header, "fuzz/corpus/llmc/zero_heads")
    assert.is_false(ok)
    assert.matches("the header's heads is 0, not a positive size", err, 1, true)
    ok, err = pcall(require("pipegoose.safetensors").read_header, "fuzz/corpus/safetensors/huge_shape")
    assert.is_false(ok)
    assert.matches("fuzz/corpus/safetensors/huge_shape: bad header", err, 1, true)
  end)
end)
