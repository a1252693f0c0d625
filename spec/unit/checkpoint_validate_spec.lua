-- Resume trusts nothing that verify would reject: corrupted checkpoints, one
-- corruption per case, each refused by `scripts/checkpoint.lua verify` (the
-- library's ckpt.verify) and by Trainer:load_checkpoint with the same
-- message, naming the file and the field. A manifest edited by a case is
-- re-sealed first (ckpt.seal), so that the check of the field itself is what
-- refuses it, not the seal; the seal has cases of its own.
--
-- The checkpoints: a tiny GPT made by pg.parallelize on a context of this
-- process alone (sharded safetensors files, AdamW state), and pg.testing's
-- fake engine (exact JSON per rank).
local pg = require "pipegoose"
local ckpt = pg.checkpoint
local st = require "pipegoose.safetensors"
local h = require "helpers"

local CFG = { vocab = 61, padded_vocab = 64, seq_len = 8, dim = 16, heads = 2, layers = 1 }
local root = h.tmpdir()
os.execute("mkdir -p " .. h.quote(root))

local function real_trainer(optimizer)
  local ctx = pg.ParallelContext{ self = true, seed = 1 }
  local engine = pg.parallelize(pg.nn.GPT(CFG), ctx)
  local opt = optimizer and optimizer(engine) or pg.optim.AdamW(engine, { lr = 1e-3 })
  return pg.Trainer{ engine = engine, optimizer = opt, max_steps = 2, out = pg.testing.capture() }
end

local function fake_trainer()
  local engine = pg.testing.fake_engine{}
  return pg.Trainer{ engine = engine, optimizer = pg.testing.fake_optimizer(engine), max_steps = 2,
    out = pg.testing.capture() }
end

-- the two good checkpoints every case copies
do
  local t = real_trainer()
  t:fit(pg.testing.fake_data{ batches = 4, batch = 2, seq_len = CFG.seq_len, vocab = CFG.vocab, tensors = true })
  t:save_checkpoint(root .. "/good-real")
  local f = fake_trainer()
  f:fit(pg.testing.fake_data{ batches = 3 })
  f:save_checkpoint(root .. "/good-fake")
end

local read = h.read

local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

local n = 0
-- A fresh copy of a good checkpoint ("real" or "fake").
local function copy(which)
  n = n + 1
  local dir = ("%s/case-%d"):format(root, n)
  os.execute(("cp -r %s %s"):format(h.quote(root .. "/good-" .. which), h.quote(dir)))
  return dir
end

-- Edits the manifest (decoded) with fn and re-seals it.
local function edit(dir, fn)
  local m = ckpt.decode(read(dir .. "/manifest.json"))
  fn(m)
  write(dir .. "/manifest.json", (ckpt.seal(m)))
end

local function record(m, kind)
  for _, r in ipairs(m.tensor_state.files) do if r.kind == kind then return r end end
end
local function slice(m, name) return record(m, "params").slices[name or "ln_f.weight"] end

-- Both ways in: verify's first problem, and the error of a load into a fresh trainer.
local function refusals(dir, which, trainer)
  local problems = ckpt.verify(dir)
  local t = trainer or (which == "fake" and fake_trainer() or real_trainer())
  local ok, err = pcall(t.load_checkpoint, t, dir)
  return problems[1], not ok and tostring(err) or "loaded"
end

-- name, which checkpoint, the damage (gets the directory), the message (%s: the directory)
local P = "%s/manifest.json: tensor_state.files[2] (params-tp0-pp0.safetensors): slices['ln_f.weight']"
local CASES = {
  { "a shard shape that is not its full shape's", "real", function(d) edit(d, function(m) slice(m).shape = { 15 } end) end,
    P .. ".shape[1] is 15; it must be 16 (full_shape[1])" },
  { "a shape of another rank", "real", function(d) edit(d, function(m) slice(m).shape = { 16, 1 } end) end,
    P .. ".shape is {16, 1}; it must be a shape of as many dimensions as full_shape (1)" },
  { "a slice past the end of its shard", "real", function(d) edit(d, function(m) slice(m).hi = 40 end) end,
    P .. ".hi is 40; it must be an integer from lo + 1 = 1 to the shard's 16 elements" },
  { "a negative lo", "real", function(d) edit(d, function(m) slice(m).lo = -4 end) end,
    P .. ".lo is -4; it must be an element of the shard: an integer from 0 to 15" },
  { "part of a shard in a params file", "real", function(d) edit(d, function(m) slice(m).lo = 8 end) end,
    P .. ".hi is 16; it must be 16 with lo = 0: a params file holds whole shards" },
  { "an optimizer slice past its shard", "real",
    function(d) edit(d, function(m) record(m, "optim").slices["ln_f.weight"].hi = 99 end) end,
    "%s/manifest.json: tensor_state.files[1] (optim-tp0-pp0.safetensors): slices['ln_f.weight'].hi is 99; it must be "
      .. "an integer from lo + 1 = 1 to the shard's 16 elements" },
  { "a negative step", "real", function(d) edit(d, function(m) m.step = -5; m.counters.step = -5 end) end,
    "%s/manifest.json: step is -5; it must be a non-negative integer" },
  { "a fractional step", "real", function(d) edit(d, function(m) m.step = 2.5 end) end,
    "%s/manifest.json: step is 2.5; it must be a non-negative integer" },
  { "a step the counters disagree with", "real", function(d) edit(d, function(m) m.step = 7 end) end,
    "%s/manifest.json: counters.step is 2; it must be step = 7" },
  { "a negative counter", "real", function(d) edit(d, function(m) m.counters.tokens_seen = -100 end) end,
    "%s/manifest.json: counters.tokens_seen is -100; it must be a non-negative integer" },
  { "accumulate 0", "real", function(d) edit(d, function(m) m.counters.accumulate = 0 end) end,
    "%s/manifest.json: counters.accumulate is 0; it must be a positive integer" },
  { "no checksums", "real", function(d) edit(d, function(m) for _, r in ipairs(m.tensor_state.files) do r.crc32 = nil end end) end,
    "%s/manifest.json: tensor_state.files[1] (optim-tp0-pp0.safetensors): crc32 is missing; it must be a crc32 (an "
      .. "integer from 0 to 0xffffffff)" },
  { "no sizes", "real", function(d) edit(d, function(m) record(m, "params").bytes = nil end) end,
    "%s/manifest.json: tensor_state.files[2] (params-tp0-pp0.safetensors): bytes is missing; it must be a positive integer" },
  { "split.parts = 0", "real", function(d) edit(d, function(m) slice(m).split = { dim = 1, blocks = 1, parts = 0, index = 0 } end) end,
    P .. ".split.parts is 0; it must be an integer >= 1" },
  { "split.index = parts", "real",
    function(d) edit(d, function(m) slice(m).split = { dim = 1, blocks = 1, parts = 2, index = 2 }; slice(m).shape = { 8 } end) end,
    P .. ".split.index is 2; it must be an integer from 0 to parts - 1 = 1" },
  { "split.dim past the dimensions", "real",
    function(d) edit(d, function(m) slice(m).split = { dim = 3, blocks = 1, parts = 2, index = 0 } end) end,
    P .. ".split.dim is 3; it must be an integer from 0 (not split) to 1 (the dimensions of full_shape)" },
  { "split.blocks = 0", "real",
    function(d) edit(d, function(m) slice(m).split = { dim = 1, blocks = 0, parts = 2, index = 0 } end) end,
    P .. ".split.blocks is 0; it must be an integer >= 1" },
  { "split sizes that do not add up", "real",
    function(d) edit(d, function(m) slice(m).split = { dim = 1, blocks = 2, parts = 1, index = 0, sizes = { 5, 6 } } end) end,
    P .. ".split.sizes is {5, 6}; it must be sizes that add up to full_shape[1] = 16" },
  { "split sizes that parts do not divide", "real", function(d) edit(d, function(m)
      slice(m).split = { dim = 1, blocks = 2, parts = 2, index = 0, sizes = { 9, 7 } }
      slice(m).shape = { 8 }
    end) end,
    P .. ".split.sizes[1] is 9; it must be divisible by parts = 2" },
  { "no split table", "real", function(d) edit(d, function(m) slice(m).split = nil end) end,
    P .. ".split is missing; it must be a JSON object" },
  { "valid_rows past the rows", "real", function(d) edit(d, function(m) slice(m, "embed.wte").valid_rows = 1000 end) end,
    "%s/manifest.json: tensor_state.files[2] (params-tp0-pp0.safetensors): slices['embed.wte'].valid_rows is 1000; it "
      .. "must be an integer from 1 to full_shape[1] = 64" },
  { "a shape of 2^62 elements", "real", function(d) edit(d, function(m)
      slice(m).full_shape, slice(m).shape, slice(m).hi = { 1 << 62 }, { 1 << 62 }, 1 << 62
    end) end,
    P .. ".full_shape is {4611686018427387904}; it must be a shape of at most 2^48 elements" },
  { "a file name outside the directory", "real",
    function(d) edit(d, function(m) record(m, "params").file = "../../../etc/passwd" end) end,
    "%s/manifest.json: tensor_state.files[2].file is '../../../etc/passwd'; it must be the name of a file in the "
      .. "checkpoint directory (letters, digits, '_', '.', '-'; no '/', no '..')" },
  { "an absolute file name", "real", function(d) edit(d, function(m) record(m, "params").file = "/etc/passwd" end) end,
    "%s/manifest.json: tensor_state.files[2].file is '/etc/passwd'; it must be the name of a file in the checkpoint "
      .. "directory (letters, digits, '_', '.', '-'; no '/', no '..')" },
  { "a file in a subdirectory", "real", function(d)
      os.execute(("mkdir %s/sub && mv %s/params-tp0-pp0.safetensors %s/sub/"):format(d, d, d))
      edit(d, function(m) record(m, "params").file = "sub/params-tp0-pp0.safetensors" end)
    end,
    "%s/manifest.json: tensor_state.files[2].file is 'sub/params-tp0-pp0.safetensors'; it must be the name of a file "
      .. "in the checkpoint directory (letters, digits, '_', '.', '-'; no '/', no '..')" },
  { "a file of another role's name", "real",
    function(d) edit(d, function(m) record(m, "params").tp = 0; record(m, "params").pp = 0; record(m, "params").kind = "optim" end) end,
    "%s/manifest.json: tensor_state.files[2] (params-tp0-pp0.safetensors).file is 'params-tp0-pp0.safetensors'; it "
      .. "must be 'optim-tp0-pp0.safetensors' (its kind, tp, pp)" },
  { "a file listed twice", "real", function(d) edit(d, function(m)
      local files = m.tensor_state.files
      files[3] = files[1]
    end) end,
    "%s/manifest.json: tensor_state.files[3].file 'optim-tp0-pp0.safetensors' is listed twice (also tensor_state.files[1])" },
  { "no files", "real", function(d) edit(d, function(m) m.tensor_state.files = {} end) end,
    "%s/manifest.json: tensor_state.files is {}; it must be a list of at least one file" },
  { "no tensor state", "real", function(d) edit(d, function(m) m.tensor_state = nil end) end,
    "%s/manifest.json: tensor_state is missing; it must be a JSON object" },
  { "a tensor rank outside the layout", "real", function(d) edit(d, function(m) record(m, "params").tp = 5 end) end,
    "%s/manifest.json: tensor_state.files[2] (params-tp0-pp0.safetensors): tp is 5; it must be an integer from 0 to "
      .. "layout.tensor - 1 = 0" },
  { "a parameter whose optimizer state no file holds", "real", function(d) edit(d, function(m)
      local slices = record(m, "params").slices
      slices["ln_f.weight2"], slices["ln_f.weight"] = slices["ln_f.weight"], nil
    end) end,
    "%s/manifest.json: tensor_state: no optim file holds the state of 'ln_f.weight2'" },
  { "a tensor the file does not hold", "real", function(d) edit(d, function(m)
      for _, r in ipairs(m.tensor_state.files) do r.slices["ln_f.weight2"], r.slices["ln_f.weight"] = r.slices["ln_f.weight"], nil end
    end) end,
    "%s/optim-tp0-pp0.safetensors: has no tensor 'm/ln_f.weight2' (the manifest lists it)" },
  { "a negative optimizer step", "real", function(d) edit(d, function(m) m.optimizer.step = -3 end) end,
    "%s/manifest.json: optimizer.step is -3; it must be a non-negative integer" },
  { "a NaN learning rate", "real", function(d) edit(d, function(m) m.optimizer.hparams.lr = 0 / 0 end) end,
    "%s/manifest.json: optimizer.hparams.lr is nan; it must be a learning rate >= 0" },
  { "beta1 = 2", "real", function(d) edit(d, function(m) m.optimizer.hparams.beta1 = 2 end) end,
    "%s/manifest.json: optimizer.hparams.beta1 is 2; it must be in [0, 1)" },
  { "a layout of 0 tensor ranks", "real", function(d) edit(d, function(m) m.layout.tensor = 0 end) end,
    "%s/manifest.json: layout.tensor is 0; it must be a positive integer" },
  { "no model config", "real", function(d) edit(d, function(m) m.model = nil end) end,
    "%s/manifest.json: model is missing; it must be a JSON object" },
  { "a format_version that is a string", "real", function(d) edit(d, function(m) m.format_version = "2" end) end,
    "%s/manifest.json: format_version '2' is not supported (this version reads 2)" },
  { "a manifest that is a JSON array", "real", function(d) write(d .. "/manifest.json", "[1,2,3]") end,
    "%s/manifest.json: not a manifest (a JSON object)" },
  -- the files against the manifest
  { "an int32 tensor", "real", function(d)
      local path = d .. "/params-tp0-pp0.safetensors"
      local hd = st.read_header(path)
      local entries = {}
      for _, name in ipairs(hd.names) do
        local t = st.read(hd, name)
        if name == "ln_f.weight" then t = pg.zeros(t:shape(), { dtype = "int32" }) end
        entries[#entries + 1] = { name = name, tensor = t }
      end
      local crc, bytes = st.write(path, entries, hd.metadata)
      edit(d, function(m) record(m, "params").crc32, record(m, "params").bytes = crc, bytes end)
    end,
    "%s/params-tp0-pp0.safetensors: 'ln_f.weight' is int32; checkpoints hold float32 (F32) tensors" },
  { "a tensor of another shape in the file", "real", function(d)
      local path = d .. "/params-tp0-pp0.safetensors"
      local hd = st.read_header(path)
      local entries = {}
      for _, name in ipairs(hd.names) do
        entries[#entries + 1] = { name = name, tensor = st.read(hd, name), shape = name == "ln_f.weight" and { 4, 4 } or nil }
      end
      local crc, bytes = st.write(path, entries, hd.metadata)
      edit(d, function(m) record(m, "params").crc32, record(m, "params").bytes = crc, bytes end)
    end,
    "%s/params-tp0-pp0.safetensors: 'ln_f.weight' has shape {4, 4}, the manifest says {16}" },
  { "a link out of the directory", "real", function(d)
      os.execute(("mkdir -p %s-out && mv %s/params-tp0-pp0.safetensors %s-out/outside.safetensors && "
        .. "ln -s %s-out/outside.safetensors %s/params-tp0-pp0.safetensors"):format(d, d, d, d, d))
    end,
    "%s/params-tp0-pp0.safetensors: is a link to %s-out/outside.safetensors, outside the checkpoint directory %s" },
  -- an engine written in Lua: exact JSON per rank
  { "a rank file outside the directory", "fake",
    function(d) edit(d, function(m) m.tensor_state.files[1].file = "../good-real/manifest.json" end) end,
    "%s/manifest.json: tensor_state.files[1].file is '../good-real/manifest.json'; it must be the name of a file in "
      .. "the checkpoint directory (letters, digits, '_', '.', '-'; no '/', no '..')" },
  { "a rank that is a string", "fake", function(d) edit(d, function(m) m.tensor_state.files[1].rank = "0" end) end,
    "%s/manifest.json: tensor_state.files[1] (rank-00000.json): rank is '0'; it must be an integer from 0 to "
      .. "world_size - 1 = 0" },
  { "a rank file without a checksum", "fake", function(d) edit(d, function(m) m.tensor_state.files[1].crc32 = nil end) end,
    "%s/manifest.json: tensor_state.files[1] (rank-00000.json): crc32 is missing; it must be a crc32 (an integer "
      .. "from 0 to 0xffffffff)" },
  { "a negative batch position", "fake", function(d) edit(d, function(m) m.counters.batch_in_epoch = -7 end) end,
    "%s/manifest.json: counters.batch_in_epoch is -7; it must be a non-negative integer" },
}

describe("a corrupted checkpoint is refused by verify and by resume, with one message naming the file and field:", function()
  for _, c in ipairs(CASES) do
    local name, which, damage, message = c[1], c[2], c[3], c[4]
    it(name, function()
      local dir = copy(which)
      damage(dir)
      local want = "checkpoint: " .. message:gsub("%%s", (dir:gsub("%%", "%%%%")))
      local by_verify, by_load = refusals(dir, which)
      assert.equal(want, by_verify)
      assert.equal(want, by_load)
    end)
  end
end)

describe("the manifest's seal", function()
  local function tool(...) return h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", ... }) end

  it("is the crc32 of the manifest's JSON without it (keys sorted), under manifest_crc32", function()
    local dir = copy("real")
    local text = read(dir .. "/manifest.json")
    local raw = require("cjson").decode(text)
    local sealed = math.tointeger(raw.manifest_crc32)
    local m = ckpt.decode(text)
    m.manifest_crc32 = nil
    assert.equal(sealed, pg.file.crc32_of(ckpt.encode(m, "manifest")))
    assert.matches('\n"manifest_crc32":' .. sealed .. ",\n", text, 1, true)
    -- the pure-Lua crc32 (plain Lua, no C module) agrees with zlib's
    assert.equal(pg.file.crc32_of(text), ckpt.crc32_of(text))
  end)

  it("refuses a manifest edited after the save, naming both checksums and the way to re-seal", function()
    local dir = copy("real")
    local text = read(dir .. "/manifest.json")
    write(dir .. "/manifest.json", (text:gsub('"tokens_seen":32', '"tokens_seen":31')))
    local want = ("checkpoint: %s/manifest.json: checksum mismatch: the contents have crc32 %%x+, manifest_crc32 says "
      .. "%%x+ %%(the manifest is corrupt or was edited; `pglua scripts/checkpoint.lua seal %%-%%-force %s` re%%-seals a "
      .. "deliberate edit%%)"):format(dir:gsub("%p", "%%%0"), dir:gsub("%p", "%%%0"))
    local by_verify, by_load = refusals(dir, "real")
    assert.matches("^" .. want .. "$", by_verify)
    assert.equal(by_verify, by_load)
  end)

  it("is required: an unsealed manifest (an older checkpoint) is refused until `seal` checks and seals it", function()
    local dir = copy("real")
    local m = ckpt.decode(read(dir .. "/manifest.json"))
    m.manifest_crc32 = nil
    write(dir .. "/manifest.json", ckpt.encode(m, "manifest"))
    local want = ("checkpoint: %s/manifest.json: has no manifest_crc32, so its contents cannot be checked (saved before "
      .. "pipegoose sealed manifests, or written by hand); `pglua scripts/checkpoint.lua seal %s` validates the "
      .. "checkpoint and seals it"):format(dir, dir)
    local by_verify, by_load = refusals(dir, "real")
    assert.equal(want, by_verify)
    assert.equal(want, by_load)
    local rc, out = tool("seal", dir)
    assert.equal(0, rc, out)
    assert.matches("^sealed " .. dir:gsub("%p", "%%%0") .. "/manifest%.json: manifest_crc32 %x+ %(it had no seal%)\n$", out)
    rc, out = tool("verify", dir)
    assert.equal(0, rc, out)
    local t = real_trainer()
    t:load_checkpoint(dir)
    assert.equal(2, t.state.step)
  end)

  it("is not renewed over a mismatch or a bad field without --force, and never over a bad file", function()
    local dir = copy("real")
    local text = read(dir .. "/manifest.json")
    write(dir .. "/manifest.json", (text:gsub('"tokens_seen":32', '"tokens_seen":30')))
    local rc, out = tool("seal", dir)
    assert.equal(1, rc)
    assert.matches("checksum mismatch", out, 1, true)
    rc, out = tool("seal", "--force", dir)
    assert.equal(0, rc, out)
    assert.matches("(it had %x+, which did not match its contents)", out)
    -- a field that loading refuses is refused by seal too, --force or not
    write(dir .. "/manifest.json", (read(dir .. "/manifest.json"):gsub('"tokens_seen":30', '"tokens_seen":-30')))
    rc, out = tool("seal", "--force", dir)
    assert.equal(1, rc)
    assert.matches("counters.tokens_seen is -30; it must be a non-negative integer", out, 1, true)
    -- and so is a corrupt file
    local f = assert(io.open(dir .. "/optim-tp0-pp0.safetensors", "r+b"))
    f:seek("set", 500)
    f:write("\255\255\255\255")
    f:close()
    write(dir .. "/manifest.json", (read(dir .. "/manifest.json"):gsub('"tokens_seen":%-30', '"tokens_seen":30')))
    rc, out = tool("seal", "--force", dir)
    assert.equal(1, rc)
    assert.matches("optim-tp0-pp0.safetensors: checksum mismatch", out, 1, true)
  end)
end)

describe("loading checks every file", function()
  it("refuses a corrupt optimizer file even when it loads only the weights (the optimizer is not AdamW)", function()
    local dir = copy("real")
    local f = assert(io.open(dir .. "/optim-tp0-pp0.safetensors", "r+b"))
    f:seek("set", 500)
    f:write("\255\255\255\255")
    f:close()
    local sgd = function(engine)
      return { step = function() end, zero_grad = function() end, set_lr = function() end,
               get_lr = function() return 1 end, engine = engine }
    end
    local _, err = refusals(dir, "real", real_trainer(sgd))
    assert.matches("^checkpoint: " .. dir:gsub("%p", "%%%0") .. "/optim%-tp0%-pp0%.safetensors: checksum mismatch", err)
  end)

  it("refuses a `latest` file that names a directory outside its parent", function()
    local dir = root .. "/parent"
    os.execute("mkdir -p " .. h.quote(dir))
    write(dir .. "/latest", "../../../../tmp\n")
    local t = real_trainer()
    local want = "checkpoint: " .. dir .. "/latest names '../../../../tmp', which is not a checkpoint directory inside " .. dir
    assert.has_error(function() t:load_checkpoint(dir) end, want)
    local rc, out = h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", "verify", dir })
    assert.equal(1, rc)
    assert.equal(want .. "\n", out)
  end)
end)

teardown(function() h.rm(root) end)
