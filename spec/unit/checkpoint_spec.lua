-- pg.checkpoint: exact JSON round trips, the directory layout, atomic
-- replacement and the `latest` pointer.
local pg = require "pipegoose"
local ckpt = pg.checkpoint
local T = pg.testing

local function tmpdir()
  local p = os.tmpname()
  os.remove(p)
  return p
end

local function rm(dir) os.execute("rm -rf '" .. dir .. "'") end
local function exists(path) return os.rename(path, path) ~= nil end

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

describe("pg.checkpoint save / load", function()
  local dir
  before_each(function() dir = tmpdir() end)
  after_each(function() rm(dir) end)

  local function trainer(steps)
    local engine = T.fake_engine{}
    local t = pg.Trainer{ engine = engine, optimizer = T.fake_optimizer(engine, { momentum = 0.5 }), max_steps = steps,
      out = T.capture(), out_dir = dir }
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

  it("loads into a fresh trainer: counters, lr position, engine, optimizer and data", function()
    local t = trainer(4)
    local path = t:save_checkpoint()
    local engine = T.fake_engine{}
    local opt = T.fake_optimizer(engine, { momentum = 0.5 })
    local data = T.fake_data{ batches = 3 }
    local fresh = pg.Trainer{ engine = engine, optimizer = opt, out = T.capture() }
    fresh:load_checkpoint(dir .. "/checkpoints", data) -- a parent directory: follows `latest`
    assert.same(t:_counters(), fresh:_counters())
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

  it("removes temporary directories left by interrupted saves, and only after a complete save", function()
    local t = trainer(2)
    local parent = dir .. "/checkpoints"
    os.execute("mkdir -p '" .. parent .. "/step-00000009.tmp-4242' '" .. parent .. "/step-00000001.old-77'")
    io.open(parent .. "/latest.tmp.99", "w"):close()
    io.open(parent .. "/notes.txt", "w"):close()
    t:save_checkpoint()
    assert.equal("latest\nnotes.txt\nstep-00000002\n", io.popen("ls '" .. parent .. "'"):read("a"))
  end)
end)
