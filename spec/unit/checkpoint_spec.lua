-- pg.checkpoint: exact JSON round trips, the directory layout, atomic
-- replacement and the `latest` pointer.
local pg = require "pipegoose"
local ckpt = pg.checkpoint
local T = pg.testing

local h = require "helpers"
local tmpdir = h.tmpdir
local rm = h.rm
local exists = h.exists

describe("pg.checkpoint encode / decode", function()
  it("restores plain Lua values exactly, integers and floats kept apart", function()
    local v = {
      int = 3, float = 3.0, third = 1 / 3, tiny = 5e-324, big = 2 ^ 80, bigint = math.maxinteger,
      neg = -7, nan = 0 / 0, inf = math.huge, ninf = -math.huge,
      list = { 1, 2.5, "x", true }, empty = {}, nested = { a = { b = { 0.1 + 0.2 } } },
      sparse = { [1] = "a", [3] = "c" }, intkeys = { [10] = 1, [-2] = 2 }, mixed = { 1, 2, k = "v" },
      hash = "#not a tag", boolkey = { [true] = "yes" },
    }
    local back = ckpt.decode(ckpt.encode(v))
    for _, k in ipairs{ "int", "float", "third", "tiny", "big", "bigint", "neg", "inf", "ninf", "hash" } do
      assert.equal(v[k], back[k], k)
      assert.equal(math.type(v[k]), math.type(back[k]), k)
    end
    assert.is_true(back.nan ~= back.nan)
    assert.same(v.list, back.list)
    assert.same(v.empty, back.empty)
    assert.equal(0.1 + 0.2, back.nested.a.b[1])
    assert.same(v.sparse, back.sparse)
    assert.same(v.intkeys, back.intkeys)
    assert.same(v.mixed, back.mixed)
    assert.same(v.boolkey, back.boolkey)
  end)

  it("stores tensors by dtype, shape and values", function()
    local t = pg.tensor({ { 1.5, -2 }, { 1 / 3, 4 } })
    local back = ckpt.decode(ckpt.encode{ w = t, ids = pg.tensor({ 1, 2, 3 }, { dtype = "int32" }) })
    assert.is_true(t:equal(back.w))
    assert.same({ 2, 2 }, back.w:shape())
    assert.equal("int32", back.ids:dtype())
  end)

  it("names what it cannot store", function()
    assert.has_error(function() ckpt.encode({ a = { f = print } }, "engine") end,
      "checkpoint: cannot store a function at engine.a.f (state must be plain tables, numbers, strings, booleans or tensors)")
  end)
end)

describe("pg.checkpoint's files", function()
  -- lua/pipegoose/checkpoint.lua offers what the files under
  -- lua/pipegoose/checkpoint/ define, as it did when they were one file
  it("offers every function and constant it always has", function()
    local names = [[FORMAT FORMAT_VERSION MANIFEST LATEST SHARDED JSON_PER_RANK SEAL_KEY LOCK fs getpid crc32_of
      encode decode all_gather_strings agree_error params_file optim_file is_sharded_engine layout show plain_name
      manifest_problem seal read_manifest check_file validate pid_running lock_owner lock unlock canonical _assemble
      save_tensor_state load_tensor_state manifest cleanup save latest resolve config_difference load verify seal_dir
      info consolidate export_llmc export_hf load_weights]]
    for name in names:gmatch("%S+") do assert.is_not_nil(ckpt[name], name) end
  end)

  it("has files that each load on their own, never requiring pipegoose.checkpoint", function()
    local mods = {}
    for _, f in ipairs(pg.fs.list("lua/pipegoose/checkpoint")) do mods[#mods + 1] = f:match("^(.*)%.lua$") end
    assert.is_true(#mods >= 8, table.concat(mods, " "))
    local path = h.tmpfile(([[
package.preload["pipegoose.checkpoint"] = function() error("requires pipegoose.checkpoint", 0) end
for _, m in ipairs{ %s } do require("pipegoose.checkpoint." .. m) end
print("loaded")
]]):format(("%q, "):rep(#mods):format(table.unpack(mods))))
    local rc, out = h.sh(h.pglua_cmd{ path })
    os.remove(path)
    assert.equal(0, rc, out)
    assert.matches("loaded", out)
  end)
end)

describe("pg.checkpoint save / load", function()
  local dir
  before_each(function() dir = tmpdir() end)
  after_each(function() rm(dir) end)

  local function trainer(steps)
    local engine = T.fake_engine{}
    local t = pg.Trainer{ engine = engine, optimizer = T.fake_optimizer(engine, { momentum = 0.5 }), max_steps = steps,
      out = T.capture(), out_dir = dir, overwrite = true } -- several fits share dir (the saves are the subject)
    t:fit(T.fake_data{ batches = 3 })
    return t
  end

  it("writes a manifest, one state file per rank, and the latest pointer", function()
    local t = trainer(2)
    local path = t:save_checkpoint()
    assert.equal(dir .. "/checkpoints/step-00000002", path)
    assert.is_true(exists(path .. "/manifest.json"))
    assert.is_true(exists(path .. "/rank-00000.json"))
    assert.equal(path, ckpt.latest(dir .. "/checkpoints"))
    local m = ckpt.decode(io.open(path .. "/manifest.json"):read("a"))
    assert.same({ 2, 2, 0, 1, 0.5 }, { m.format_version, m.step, m.epoch, m.world_size, m.lr.base_lr }) -- the fake optimizer's lr is 0.5
    assert.equal("pipegoose-checkpoint", m.format)
    assert.same({ epoch = 0, pos = 2 }, m.data)
    assert.same({ { epoch = 0, pos = 2 } }, m.data_ranks)
    assert.same({ vocab = 256, seq_len = 16, dim = 4 }, m.model)
    -- an engine written in Lua keeps exact JSON per rank, listed with its size and crc32
    assert.equal("json-per-rank", m.tensor_state.format)
    local rec = m.tensor_state.files[1]
    assert.same({ "rank-00000.json", "rank", 0 }, { rec.file, rec.kind, rec.rank })
    local crc, bytes = pg.file.crc32(path .. "/rank-00000.json")
    assert.same({ crc, bytes }, { rec.crc32, rec.bytes })
    assert.equal(2 * 2 * 16, m.counters.tokens_seen)
  end)

  it("replaces an existing checkpoint of the same name whole, leaving no temporary directories", function()
    local t = trainer(2)
    local path = t:save_checkpoint(dir .. "/ck")
    t.engine.w[1] = 42
    t:save_checkpoint(dir .. "/ck")
    local rank = ckpt.decode(io.open(path .. "/rank-00000.json"):read("a"))
    assert.equal(42, rank.engine.w[1])
    local listing = io.popen("ls '" .. dir .. "'"):read("a")
    assert.equal("ck\nlatest\n", listing)
  end)

  it("finds a checkpoint that a crash left moved aside while it was being replaced", function()
    local t = trainer(2)
    t:save_checkpoint(dir .. "/ck")
    -- the moment between moving the old directory aside and renaming the new one into place
    assert(os.rename(dir .. "/ck", dir .. "/ck.old-123"))
    os.execute("mkdir '" .. dir .. "/ck.tmp-123'")
    assert.equal(dir .. "/ck.old-123", ckpt.resolve(dir))
    local engine = T.fake_engine{}
    local fresh = pg.Trainer{ engine = engine, optimizer = T.fake_optimizer(engine), out = T.capture() }
    fresh:load_checkpoint(dir)
    assert.equal(2, fresh.state.step)
  end)

  it("loads into a fresh trainer: counters, lr position, engine, optimizer and data", function()
    local t = trainer(4)
    local path = t:save_checkpoint()
    local engine = T.fake_engine{}
    local opt = T.fake_optimizer(engine, { momentum = 0.5 })
    local data = T.fake_data{ batches = 3 }
    local fresh = pg.Trainer{ engine = engine, optimizer = opt, out = T.capture() }
    fresh:load_checkpoint(dir .. "/checkpoints", data) -- a parent directory: follows `latest`
    assert.same(t:counters(), fresh:counters())
    assert.same(t.engine.w, engine.w)
    assert.same(t.optimizer.m, opt.m)
    assert.same(t.train_data:state_dict(), data:state_dict())
    assert.equal(path, fresh.state.resumed_from)
  end)

  it("refuses another world size and another format version", function()
    local path = trainer(1):save_checkpoint()
    local engine = T.fake_engine{ rank = 0, world_size = 2 }
    local two = pg.Trainer{ engine = engine, optimizer = T.fake_optimizer(engine), out = T.capture() }
    assert.has_error(function() two:load_checkpoint(path) end,
      "checkpoint: " .. path .. " was saved by 1 ranks; this job has 2")
    local f = io.open(path .. "/manifest.json", "w")
    f:write(ckpt.encode{ format_version = 9 })
    f:close()
    assert.has_error(function() trainer(1):load_checkpoint(path) end,
      "checkpoint: " .. path .. "/manifest.json: format_version 9 is not supported (this version reads 2)")
  end)

  it("refuses a model config that differs, naming each difference", function()
    local path = trainer(1):save_checkpoint()
    local engine = T.fake_engine{ dim = 6, seq_len = 8 }
    local other = pg.Trainer{ engine = engine, optimizer = T.fake_optimizer(engine), out = T.capture() }
    assert.has_error(function() other:load_checkpoint(path) end,
      "checkpoint: " .. path .. "/manifest.json: the model differs from the one being trained: dim is 4 in the "
        .. "checkpoint, 6 here; seq_len is 16 in the checkpoint, 8 here")
  end)

  it("refuses a checkpoint whose model config lacks a key this model has, or has one it lacks, naming the key", function()
    local path = trainer(1):save_checkpoint() -- model = { vocab, seq_len, dim }
    local function load_with(edit)
      local engine = T.fake_engine{}
      edit(engine.config)
      local other = pg.Trainer{ engine = engine, optimizer = T.fake_optimizer(engine), out = T.capture() }
      local ok, err = pcall(other.load_checkpoint, other, path)
      assert.is_false(ok, "loaded")
      return err
    end
    local prefix = "checkpoint: " .. path .. "/manifest.json: the model differs from the one being trained: "
    -- every shared key equal: only the key one side lacks tells the models apart
    assert.equal(prefix .. "heads is nil in the checkpoint, 2 here", load_with(function(c) c.heads = 2 end))
    assert.equal(prefix .. "dim is 4 in the checkpoint, nil here", load_with(function(c) c.dim = nil end))
    assert.is_nil(ckpt.config_difference({ vocab = 256, dim = 4 }, { dim = 4, vocab = 256 }))
    -- a table field (LLaMA's rope_scaling) by its contents; numbers by value (JSON reads 32 back as 32.0)
    local rs = { rope_type = "llama3", factor = 8, original_max_position_embeddings = 32 }
    assert.is_nil(ckpt.config_difference({ rope_scaling = rs }, { rope_scaling = { rope_type = "llama3", factor = 8.0,
      original_max_position_embeddings = 32.0 } }))
    assert.equal("rope_scaling is {factor = 8, original_max_position_embeddings = 32, rope_type = llama3} in the "
      .. "checkpoint, nil here", ckpt.config_difference({ rope_scaling = rs }, {}))
  end)

  it("refuses a state file whose checksum differs from the manifest's", function()
    local path = trainer(1):save_checkpoint()
    local file = path .. "/rank-00000.json"
    local text = io.open(file):read("a")
    local f = io.open(file, "w")
    local at = #text // 2 -- one byte changed: the check runs before the JSON is read
    f:write(text:sub(1, at - 1), text:sub(at, at) == "x" and "y" or "x", text:sub(at + 1))
    f:close()
    local engine = T.fake_engine{}
    local fresh = pg.Trainer{ engine = engine, optimizer = T.fake_optimizer(engine), out = T.capture() }
    local ok, err = pcall(fresh.load_checkpoint, fresh, path)
    assert.is_false(ok)
    assert.matches("checkpoint: " .. path:gsub("%p", "%%%0") .. "/rank%-00000%.json: checksum mismatch: crc32 %x+ on disk, %x+ in the manifest", err)
  end)

  -- the pid of a process that has ended (a shell that printed its own pid)
  local function dead_pid()
    local p = io.popen("sh -c 'echo $$'")
    local pid = math.tointeger(tonumber(p:read("a")))
    p:close()
    return pid
  end

  it("removes temporary directories left by interrupted saves, and only after a complete save", function()
    local t = trainer(2)
    local parent = dir .. "/checkpoints"
    local a, b, c = dead_pid(), dead_pid(), dead_pid()
    os.execute(("mkdir -p '%s/step-00000009.tmp-%d' '%s/step-00000001.old-%d'"):format(parent, a, parent, b))
    io.open(("%s/latest.tmp.%d"):format(parent, c), "w"):close()
    io.open(parent .. "/notes.txt", "w"):close()
    t:save_checkpoint()
    assert.equal("latest\nnotes.txt\nstep-00000002\n", io.popen("ls '" .. parent .. "'"):read("a"))
  end)

  it("leaves the temporary directories of running processes alone (another job's save in progress)", function()
    local t = trainer(2)
    local parent = dir .. "/checkpoints"
    -- pid 1 always runs and is never this process
    os.execute("mkdir -p '" .. parent .. "/step-00000009.tmp-1' '" .. parent .. "/step-00000003.old-1'")
    t:save_checkpoint()
    assert.equal("latest\nstep-00000002\nstep-00000003.old-1\nstep-00000009.tmp-1\n",
      io.popen("ls '" .. parent .. "'"):read("a"))
  end)
end)

describe("pipegoose.safetensors", function()
  local st = require "pipegoose.safetensors"
  local path
  before_each(function() path = os.tmpname() end)
  after_each(function() os.remove(path) end)

  it("writes the safetensors layout: length, a padded JSON header, data back to back", function()
    local a = pg.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })
    local b = pg.tensor({ 7, 8 }, { dtype = "int32" })
    local crc, bytes = st.write(path, { { name = "a", tensor = a }, { name = "m/b", tensor = b } }, { note = "x\"y" })
    local raw = io.open(path, "rb"):read("a")
    local n = string.unpack("<I8", raw)
    assert.equal(0, n % 8)
    assert.equal(8 + n + 6 * 4 + 2 * 4, #raw)
    assert.same({ crc, bytes }, { pg.file.crc32(path) })
    local header = require("cjson").decode(raw:sub(9, 8 + n))
    assert.same({ dtype = "F32", shape = { 2, 3 }, data_offsets = { 0, 24 } }, header.a)
    assert.same({ dtype = "I32", shape = { 2 }, data_offsets = { 24, 32 } }, header["m/b"])
    assert.same({ note = "x\"y" }, header.__metadata__)
    assert.equal(string.pack("<f", 4), raw:sub(8 + n + 13, 8 + n + 16)) -- a[2][1], little-endian
    local h = st.read_header(path)
    assert.same({ "a", "m/b" }, h.names)
    assert.is_true(a:equal(st.read(h, "a")))
    assert.is_true(b:equal(st.read(h, "m/b")))
    assert.same({ 5, 6 }, st.read(h, "a", 4, 2):totable())
  end)

  it("names the file and the problem for a short file, a bad length and a truncated tensor", function()
    st.write(path, { { name = "w", tensor = pg.zeros{ 16 } } })
    local raw = io.open(path, "rb"):read("a")
    local function with(bytes)
      local f = io.open(path, "wb")
      f:write(bytes)
      f:close()
      local ok, err = pcall(st.read_header, path)
      assert.is_false(ok)
      return err
    end
    assert.equal(path .. ": truncated: 3 bytes, too short for a safetensors header", with(raw:sub(1, 3)))
    assert.matches("^" .. path:gsub("%p", "%%%0") .. ": truncated: the header length is %d+ bytes but the file has 20 bytes$",
      with(raw:sub(1, 20)))
    assert.matches("truncated: 'w' ends at data byte 64, but the file holds 60 data bytes", with(raw:sub(1, -5)), 1, true)
    assert.matches("missing or unreadable", select(2, pcall(st.read_header, path .. ".none")), 1, true)
  end)
end)

describe("core.shard_copy", function()
  -- a fused q|k|v weight [12, 2]: 3 blocks of 4 rows, each cut into 2 parts of 2 rows
  local values = {}
  for i = 1, 24 do values[i] = i - 1 end
  local full = pg.tensor(values):reshape{ 12, 2 }
  local function spec(index, lo) return { full_shape = { 12, 2 }, split = { dim = 1, blocks = 3, parts = 2, index = index }, lo = lo } end

  it("cuts a shard out of a full tensor, piece `index` of every block", function()
    local shard = pg.zeros{ 6, 2 }
    pg.shard_copy(full, shard, spec(1, 0), "from_full")
    -- rows 2-3 of each block of 4: full rows 2, 3, 6, 7, 10, 11 (0-based)
    assert.same({ { 4, 5 }, { 6, 7 }, { 12, 13 }, { 14, 15 }, { 20, 21 }, { 22, 23 } }, shard:totable())
    local part = pg.zeros{ 3 }
    pg.shard_copy(full, part, spec(1, 5), "from_full") -- local elements [5, 8)
    assert.same({ 13, 14, 15 }, part:totable())
  end)

  it("assembles the full tensor from all shards, and reads missing padding rows as 0", function()
    local back = pg.zeros{ 12, 2 }
    for index = 0, 1 do
      local shard = pg.zeros{ 6, 2 }
      pg.shard_copy(full, shard, spec(index, 0), "from_full")
      pg.shard_copy(back, shard, spec(index, 0), "to_full")
    end
    assert.is_true(back:equal(full))
    -- a full tensor with fewer rows (a layout padded less): the rows past it are 0
    local short = full:narrow(1, 1, 11)
    local shard = pg.full({ 6, 2 }, -1)
    pg.shard_copy(short, shard, spec(1, 0), "from_full")
    assert.same({ 20, 21, 0, 0 }, { shard:get(5, 1), shard:get(5, 2), shard:get(6, 1), shard:get(6, 2) })
    assert.has_error(function() pg.shard_copy(full, pg.zeros{ 13 }, spec(0, 0), "to_full") end,
      "shard_copy: elements [0, 13) are outside the shard's 12 elements")
  end)
end)
