-- Writes never destroy what a user saved: scripts/checkpoint.lua's writing
-- tools refuse an output that is, or is inside, the checkpoint they read
-- (compared as real paths: a link into it, a missing file under it), the
-- directory holding it, or the `latest` file that named it; the checkpoint
-- verifies after every refusal. save_hf over a sharded import replaces the
-- whole directory, so no stale index survives to shadow the new weights.
local pg = require "pipegoose"
local h = require "helpers"
local ckpt = require "pipegoose.checkpoint"

local function gpt_engine(seed)
  return pg.parallelize(pg.nn.GPT{ vocab = 64, seq_len = 8, dim = 16, heads = 2, layers = 1 }, nil, { seed = seed })
end

describe("the checkpoint tools' outputs", function()
  local root, ck
  setup(function()
    root = h.tmpdir()
    local e = gpt_engine(7)
    ck = pg.Trainer{ engine = e, optimizer = pg.optim.AdamW(e, { lr = 1e-3 }), out = pg.testing.capture() }
      :save_checkpoint(root .. "/runs/step-00000001")
    assert(os.execute(("ln -s %s %s"):format(h.quote(ck), h.quote(root .. "/link"))))
  end)
  teardown(function() h.rm(root) end)

  local function intact()
    local problems = ckpt.verify(ck)
    assert.same({}, problems)
  end

  it("refuse a path inside the checkpoint, by name, and leave it whole", function()
    for _, c in ipairs{
      { "consolidate", ck .. "/params-tp0-pp0.safetensors" },
      { "consolidate", ck .. "/new.safetensors" },
      { "export-llmc", ck .. "/manifest.json" },
      { "export-llmc", root .. "/link/manifest.json" }, -- a link into it
      { "consolidate", root .. "/runs/../runs/step-00000001/x/y.bin" }, -- a missing directory under it
    } do
      local fn = c[1] == "consolidate" and ckpt.consolidate or ckpt.export_llmc
      local ok, err = pcall(fn, ck, c[2])
      assert.is_false(ok, c[2])
      assert.equal(("checkpoint: %s: the output %s is inside the checkpoint %s it reads (writing it would change the "
        .. "checkpoint): give a path outside it"):format(c[1], c[2], ck), err)
      intact()
    end
  end)

  it("refuse the directory holding it and the latest file that named it", function()
    local ok, err = pcall(ckpt.consolidate, ck, root .. "/runs")
    assert.is_false(ok)
    assert.equal(("checkpoint: consolidate: the output %s/runs holds the checkpoint %s it reads: give another path")
      :format(root, ck), err)
    ok, err = pcall(ckpt.export_llmc, root .. "/runs", root .. "/runs/latest")
    assert.is_false(ok)
    assert.equal(("checkpoint: export-llmc: the output %s/runs/latest is the latest file of %s/runs, which names "
      .. "the checkpoint it reads: give another path"):format(root, root), err)
    intact()
    assert.equal("step-00000001", (h.read(root .. "/runs/latest"):gsub("%s+$", "")))
  end)

  it("refuse through the script with exit 1, and write where it is safe", function()
    local rc, text = h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", "consolidate", ck, ck .. "/params-tp0-pp0.safetensors" })
    assert.equal(1, rc, text)
    assert.matches("is inside the checkpoint " .. ck, text, 1, true)
    rc, text = h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", "export-hf", ck, ck .. "/hf" })
    assert.equal(1, rc, text)
    assert.matches("is inside the checkpoint " .. ck, text, 1, true)
    intact()
    local n = ckpt.consolidate(ck, root .. "/all.safetensors")
    assert.is_true(n > 0)
    assert.is_true(pg.fs.exists(root .. "/all.safetensors"))
  end)
end)

describe("writers into another checkpoint", function()
  it("refuse a file or directory inside any checkpoint, not only the one read", function()
    local root = h.tmpdir()
    local e = gpt_engine(5)
    local function save(path)
      return pg.Trainer{ engine = e, optimizer = pg.optim.AdamW(e, { lr = 1e-3 }), out = pg.testing.capture() }
        :save_checkpoint(path)
    end
    local a, b = save(root .. "/a/step-00000001"), save(root .. "/b/step-00000001")
    local before = h.read(b .. "/params-tp0-pp0.safetensors")
    local ok, err = pcall(ckpt.consolidate, a, b .. "/params-tp0-pp0.safetensors")
    assert.is_false(ok)
    assert.equal(("checkpoint: consolidate: the output %s/params-tp0-pp0.safetensors is inside the checkpoint %s "
      .. "(writing it would change that checkpoint): give a path outside it"):format(b, b), err)
    ok, err = pcall(function() e:save_llmc(b .. "/manifest.json") end)
    assert.is_false(ok)
    assert.matches(("save_llmc: %s/manifest.json is inside the checkpoint %s: give a path outside it"):format(b, b),
      err, 1, true)
    assert.matches("overwrite_guard_spec.lua", err, 1, true) -- at the user's line
    ok, err = pcall(e.save_hf, e, b .. "/hf")
    assert.is_false(ok)
    assert.equal(("save_hf: %s/hf is inside the checkpoint %s (writing it would change that checkpoint): give a "
      .. "directory outside it"):format(b, b), err)
    assert.equal(before, h.read(b .. "/params-tp0-pp0.safetensors"))
    assert.same({}, ckpt.verify(b))
    -- and the paths that cannot be written are named before anything is read
    ok, err = pcall(ckpt.consolidate, a, root .. "/missing/x.safetensors")
    assert.is_false(ok)
    assert.equal(("checkpoint: consolidate: the output's directory %s/missing does not exist"):format(root), err)
    assert.has_error(function() e:save_hf("") end, "save_hf: needs a directory path, got an empty string")
    ok, err = pcall(e.save_llmc, e, "")
    assert.matches("save_llmc: needs a file path, got an empty string", err, 1, true)
    h.rm(root)
  end)
end)

describe("save_hf over a sharded import", function()
  it("leaves no stale index: the directory is replaced whole, and the re-import has the new weights", function()
    local dir = h.tmpdir()
    local old = gpt_engine(1)
    old:save_hf(dir, { max_shard_size = 5000 })
    assert.is_true(pg.fs.exists(dir .. "/model.safetensors.index.json"))
    local imported = pg.parallelize(pg.nn.from_hf(dir), nil, {})
    local new = gpt_engine(2) -- other weights, one file
    new:save_hf(dir)
    assert.same({ "config.json", "generation_config.json", "model.safetensors" }, (function()
      local l = pg.fs.list(dir); table.sort(l); return l end)())
    local again = pg.parallelize(pg.nn.from_hf(dir), nil, {})
    local function w(e) return e:parameter("blocks.0.attn.qkv.weight").tensor:totable() end
    assert.same(w(new), w(again))
    assert.are_not.same(w(imported), w(again))
    h.rm(dir)
  end)
end)
