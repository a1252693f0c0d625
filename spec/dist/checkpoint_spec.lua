-- worlds: 1 2 4 8
-- Checkpoints of real engines: sharded safetensors files that resume a run
-- bit for bit in the same layout (1/1/1 on one rank; 2/1/1, 1/2/1 and 1/1/2
-- with ZeRO-1 on two; 2/2/2 on eight), that load into other layouts (saved at
-- 2/2/1, loaded at 1/2/2 and 1/1/1 on four ranks), and bad checkpoints that
-- every rank refuses with the same message; a resume whose optimizer was made
-- with other hyperparameters takes the checkpoint's. Layouts are
-- tensor/pipeline/data.
-- "Fresh job" here is a fresh context, engine, optimizer, data loader and
-- Trainer in the same mpirun; spec/unit/checkpoint_jobs_spec.lua resumes
-- across separate mpirun jobs.
local pg = require "pipegoose"
local ckpt = pg.checkpoint

local world = pg.world_size()
local CFG = { vocab = 61, padded_vocab = 63, seq_len = 16, dim = 32, heads = 4, layers = 2 }
local BATCH = 8
local root_ctx = pg.ParallelContext{ data = world, seed = 1 }
local me = root_ctx:rank()

-- A directory every rank agrees on (rank 0's choice), created by rank 0.
local function shared_dir(tag)
  local t = pg.tensor({ (ckpt.getpid() * 7919 + os.time()) % 1000000007 }, { dtype = "int32" })
  pg.dist.broadcast(t, { ctx = root_ctx, src = 0 })
  local dir = ("%s/pg-ckpt-%s-%d"):format(os.getenv("TMPDIR") or "/tmp", tag, math.tointeger(t:item()))
  if me == 0 then os.execute("rm -rf '" .. dir .. "' && mkdir -p '" .. dir .. "'") end
  root_ctx:barrier()
  return dir
end

local function cleanup(dir)
  root_ctx:barrier()
  if me == 0 then os.execute("rm -rf '" .. dir .. "'") end
end

-- Token data: a shard of pseudo-random ids below the vocabulary.
local DATA_DIR = shared_dir("data")
local TOKENS = DATA_DIR .. "/tokens.bin"
if me == 0 then
  local ids, x = {}, 12345
  for i = 1, 6000 do
    x = (x * 1103515245 + 12345) % 2147483648
    ids[i] = (x >> 8) % CFG.vocab
  end
  pg.data.write_shard(TOKENS, ids)
end
root_ctx:barrier()

-- A fresh engine, optimizer, data loader and Trainer on ctx.
local function build(ctx, o)
  local engine = pg.parallelize(pg.nn.GPT(o.cfg or CFG), ctx, { micro_batches = o.micro_batches or 2,
    schedule = "1f1b", virtual_stages = o.virtual_stages })
  local hp = { lr = 1e-3, betas = { 0.9, 0.95 }, weight_decay = 0.1, zero = o.zero or 0 }
  for k, v in pairs(o.adamw or {}) do hp[k] = v end
  local opt = pg.optim.AdamW(engine, hp)
  local data = pg.data.TokenShards{ path = TOKENS, batch = BATCH, seq_len = CFG.seq_len, seed = 7, ctx = ctx }
  local losses = {}
  local callbacks = { { name = "Recorder", on_train_batch_end = function(_, t, out)
    if not out.step_end then return end
    losses[t.state.step] = t.state.metrics.loss
    if o.stop_at and t.state.step == o.stop_at then t.control.should_stop = true end
  end } }
  if o.dir then callbacks[2] = pg.callbacks.ModelCheckpoint{ dir = o.dir, every_n_steps = 10, verbose = false } end
  local trainer = pg.Trainer{ engine = engine, optimizer = opt, max_steps = o.steps or 20, clip_grad_norm = 1.0,
    lr_schedule = pg.lr.cosine{ warmup = 4, min_lr = 1e-4 }, seed = 3, out = pg.testing.capture(),
    out_dir = o.dir or DATA_DIR, callbacks = callbacks }
  return trainer, data, losses
end

-- The uninterrupted run, a run stopped after step 10 (its checkpoint is
-- step-00000010), and a fresh resume from "last" through step 20.
local function resume_case(layout)
  local ctx = pg.ParallelContext{ tensor = layout[1], pipeline = layout[2], data = layout[3], seed = 5 }
  local zero = layout.zero or 0
  local dir = shared_dir("resume")
  local straight, data, want = build(ctx, { zero = zero })
  straight:fit(data)
  local first, data1, before = build(ctx, { zero = zero, dir = dir, stop_at = 10 })
  first:fit(data1)
  local resumed, data2, got = build(ctx, { zero = zero, dir = dir })
  resumed:fit(data2, nil, { resume = "last" })
  return { ctx = ctx, dir = dir, want = want, before = before, got = got, first = first, resumed = resumed,
           straight = straight }
end

local function describe_resume(layout)
  local name = ("%d/%d/%d%s"):format(layout[1], layout[2], layout[3],
    (layout.zero or 0) > 0 and (" with zero=" .. layout.zero) or "")
  describe("resume at " .. name, function()
    local r = resume_case(layout)
    it("resumes from the step-10 checkpoint with steps 11-20 bitwise equal to the uninterrupted run", function()
      assert.equal(r.dir .. "/step-00000010", r.resumed.state.resumed_from)
      assert.equal(10, #r.before, "the first run stopped after step 10")
      for s = 1, 10 do assert.equal(r.want[s], r.before[s], "step " .. s .. " before the stop") end
      for s = 1, 10 do assert.is_nil(r.got[s], "the resumed run did not redo step " .. s) end
      for s = 11, 20 do
        -- exact: same layout, same bits in, same deterministic kernels
        assert.equal(r.want[s], r.got[s], ("step %d: %.17g uninterrupted, %.17g resumed"):format(s, r.want[s] or -1,
          r.got[s] or -1))
      end
      assert.same(r.straight:counters(), r.resumed:counters())
    end)
    it("ends with the uninterrupted run's parameters and optimizer state, bitwise", function()
      local e1, e2 = r.straight.engine, r.resumed.engine
      local f1, f2 = e1:flat(), e2:flat()
      assert.is_true(f1:equal(f2), "flat parameter buffers")
      local s1, s2 = r.straight.optimizer:shard_state(), r.resumed.optimizer:shard_state()
      assert.same({ s1.step, s1.lo, s1.hi }, { s2.step, s2.lo, s2.hi })
      assert.is_true(s1.m:equal(s2.m) and s1.v:equal(s2.v), "m and v")
    end)
    it("wrote the files of its layout, each verified by scripts/checkpoint.lua's checks", function()
      local problems, manifest = ckpt.verify(r.dir .. "/step-00000010")
      assert.same({}, problems)
      local T, P, D = layout[1], layout[2], layout[3]
      local n_optim = (layout.zero or 0) > 0 and T * P * D or T * P
      assert.equal(T * P + n_optim, #manifest.tensor_state.files)
      assert.same({ tensor = T, pipeline = P, data = D, zero = layout.zero or 0 },
        { tensor = manifest.layout.tensor, pipeline = manifest.layout.pipeline, data = manifest.layout.data,
          zero = manifest.layout.zero })
      assert.equal(D, #manifest.data_ranks)
      for d = 1, D do assert.equal(10, manifest.data_ranks[d].batch_index) end
      assert.same({ step = 10, type = "AdamW", zero = layout.zero or 0 },
        { step = manifest.optimizer.step, type = manifest.optimizer.type, zero = manifest.optimizer.zero })
    end)
    teardown(function() cleanup(r.dir) end)
  end)
end

if world == 1 then describe_resume{ 1, 1, 1 } end
if world == 2 then
  describe_resume{ 2, 1, 1 }
  describe_resume{ 1, 2, 1 }
  describe_resume{ 1, 1, 2, zero = 1 }
  describe_resume{ 1, 1, 2, zero = 2 }
end
if world == 8 then describe_resume{ 2, 2, 2, zero = 1 } end

------------------------------------------------------------------------------
-- Another layout (four ranks): save at 2/2/1, load at 1/2/2 (ZeRO-1) and 1/1/1.

-- A fixed batch, the same on every rank; each data rank takes its rows.
local function fixed_batch()
  local x, y = {}, {}
  for b = 1, BATCH do
    x[b], y[b] = {}, {}
    for t = 1, CFG.seq_len do
      x[b][t] = (b * 7 + t * 3) % CFG.vocab
      y[b][t] = (b * 5 + t * 11) % CFG.vocab
    end
  end
  return pg.tensor(x, { dtype = "int32" }), pg.tensor(y, { dtype = "int32" })
end
local X, Y = fixed_batch()

local function rows_of(ctx)
  local D, d = ctx:world_size("data"), ctx:local_rank("data")
  local n = BATCH // D
  return X:narrow(1, d * n + 1, n), Y:narrow(1, d * n + 1, n)
end

-- One AdamW step on the fixed batch, then the loss on it.
local function step_then_loss(trainer, ctx)
  local x, y = rows_of(ctx)
  trainer.engine:zero_grad()
  trainer.engine:forward_backward(x, y)
  trainer.optimizer:clip_grad_norm(1.0)
  trainer.optimizer:step()
  return trainer.engine:loss(x, y)
end

-- Tolerance: reslicing copies values exactly (checked bitwise below through
-- consolidated files), but another layout sums in another order (tensor
-- ranks split the matmul sums, data ranks average partial means), so losses
-- agree to float rounding: 1e-6 relative (float32 epsilon ~1.2e-7 times a
-- few accumulated roundings; the measured differences are ~1e-9).
local LOSS_RTOL = 1e-6

if world == 4 then
  describe("a checkpoint saved at 2/2/1", function()
    local dir = shared_dir("reslice")
    local src = pg.ParallelContext{ tensor = 2, pipeline = 2, data = 1, seed = 5 }
    local saver, data = build(src, { steps = 6 })
    saver:fit(data)
    saver:save_checkpoint(dir .. "/saved")
    local ref_loss = saver.engine:loss(rows_of(src))
    local ref_after = step_then_loss(saver, src)

    local dst = pg.ParallelContext{ tensor = 1, pipeline = 2, data = 2, seed = 9 } -- another seed: nothing comes from init
    local loader, data2 = build(dst, { zero = 1 })
    loader:load_checkpoint(dir .. "/saved", data2)
    local got_loss = loader.engine:loss(rows_of(dst))
    local loaded = { step = loader.state.step, opt_step = loader.optimizer:shard_state().step,
                     batch = data2:state_dict().batch_index }
    loader:save_checkpoint(dir .. "/as-1-2-2")
    local got_after = step_then_loss(loader, dst)

    it("loads at 1/2/2 with ZeRO-1: the same loss on a fixed batch, and after one more step", function()
      assert.near(ref_loss, got_loss, LOSS_RTOL * ref_loss)
      assert.near(ref_after, got_after, LOSS_RTOL * ref_after)
      assert.same({ step = 6, opt_step = 6, batch = 6 }, loaded)
    end)

    -- 1/1/1: a context of rank 0 alone; the others wait at the barrier.
    local serial = {}
    if me == 0 then
      local one = pg.ParallelContext{ self = true, seed = 11 }
      local t1, d1 = build(one, {})
      t1:load_checkpoint(dir .. "/saved", d1)
      serial.loss = t1.engine:loss(X, Y)
      t1:save_checkpoint(dir .. "/as-1-1-1")
      serial.after = step_then_loss(t1, one)
      serial.out = t1.out:text()
    end
    root_ctx:barrier()

    it("loads at 1/1/1: the same loss on a fixed batch, and after one more step", function()
      if me ~= 0 then return end
      assert.near(ref_loss, serial.loss, LOSS_RTOL * ref_loss)
      assert.near(ref_after, serial.after, LOSS_RTOL * ref_after)
      assert.matches("saved at tensor=2 pipeline=2 data=1 zero=0; resliced into tensor=1 pipeline=1 data=1 zero=0",
        serial.out, 1, true)
    end)

    it("reslices exactly: every full parameter, m and v is bitwise the saved one", function()
      if me ~= 0 then return end
      local files = {}
      for _, name in ipairs{ "saved", "as-1-2-2", "as-1-1-1" } do
        files[name] = dir .. "/" .. name .. ".safetensors"
        ckpt.consolidate(dir .. "/" .. name, files[name], { optimizer = true })
      end
      local st = require "pipegoose.safetensors"
      local ref = st.read_header(files.saved)
      local n = 0
      for _, other in ipairs{ "as-1-2-2", "as-1-1-1" } do
        local h = st.read_header(files[other])
        assert.same(ref.names, h.names)
        for _, name in ipairs(ref.names) do
          n = n + 1
          assert.is_true(st.read(ref, name):equal(st.read(h, name)), other .. ": " .. name)
        end
      end
      -- 28 parameters (embedding 2, 2 blocks x 12, ln_f 2), each with m and v, in both layouts
      assert.equal(2 * 3 * 28, n)
      -- the vocabulary padding of T = 2 (63 -> 64 rows) is not in the consolidated file
      assert.same({ 63, 32 }, ref.entries["embed.wte"].shape)
    end)

    it("exports the 2/2/1 shards as llm.c weights that load back identical (fused q|k|v reassembled)", function()
      if me ~= 0 then return end
      local st = require "pipegoose.safetensors"
      local model = dir .. "/model.bin"
      ckpt.export_llmc(dir .. "/saved", model)
      local engine = pg.parallelize(pg.nn.GPT.load_llmc(model), pg.ParallelContext{ self = true })
      ckpt.consolidate(dir .. "/saved", dir .. "/saved-params.safetensors")
      local ref = st.read_header(dir .. "/saved-params.safetensors")
      for _, p in ipairs(engine:parameters()) do
        assert.is_true(p.tensor:equal(st.read(ref, p.name)), p.name)
      end
      assert.equal(28, #engine:parameters())
    end)

    it("loads only the weights, with a message, when the optimizer is not AdamW", function()
      local e = pg.parallelize(pg.nn.GPT(CFG), dst, { micro_batches = 2 })
      local t = pg.Trainer{ engine = e, optimizer = { step = function() end, zero_grad = function() end,
        set_lr = function() end, get_lr = function() return 1 end }, out = pg.testing.capture() }
      t:load_checkpoint(dir .. "/saved")
      assert.near(ref_loss, e:loss(rows_of(dst)), LOSS_RTOL * ref_loss)
      if me == 0 then
        assert.matches("loaded only the weights from " .. dir .. "/saved (the optimizer is not pg.optim.AdamW)",
          t.out:text(), 1, true)
      end
    end)
    teardown(function() cleanup(dir) end)
  end)
end

------------------------------------------------------------------------------
-- The interleaved schedule (two ranks): a checkpoint saved with
-- virtual_stages = 2 (rank r holds pieces r and r + 2) records it and loads
-- at virtual_stages = 1 and on one rank; a V = 1 checkpoint loads at V = 2.
-- The model has 4 pieces; CFG's 2 layers would leave chunks empty.
if world == 2 then
  describe("a checkpoint saved with virtual_stages = 2", function()
    local dir = shared_dir("virtual")
    local cfg = { vocab = 61, padded_vocab = 63, seq_len = 16, dim = 32, heads = 4, layers = 4 }
    local pipe = pg.ParallelContext{ pipeline = 2, seed = 5 }
    local saver, data = build(pipe, { cfg = cfg, steps = 4, virtual_stages = 2 })
    saver:fit(data)
    saver:save_checkpoint(dir .. "/v2")
    local manifest = ckpt.read_manifest(dir .. "/v2")
    local ref_loss = saver.engine:loss(rows_of(pipe))
    local ref_after = step_then_loss(saver, pipe)

    local plain, data1 = build(pg.ParallelContext{ pipeline = 2, seed = 9 }, { cfg = cfg })
    plain:load_checkpoint(dir .. "/v2", data1)
    local v1_loss = plain.engine:loss(rows_of(plain.ctx))
    plain:save_checkpoint(dir .. "/v1")
    local v1_after = step_then_loss(plain, plain.ctx)

    local back, data2 = build(pg.ParallelContext{ pipeline = 2, seed = 13 }, { cfg = cfg, virtual_stages = 2 })
    back:load_checkpoint(dir .. "/v1", data2)
    local back_loss = back.engine:loss(rows_of(back.ctx))

    local serial = {}
    if me == 0 then
      local one = pg.ParallelContext{ self = true, seed = 11 }
      local t1, d1 = build(one, { cfg = cfg })
      t1:load_checkpoint(dir .. "/v2", d1)
      serial.loss = t1.engine:loss(X, Y)
      serial.info = table.concat(ckpt.info(dir .. "/v2"), "\n")
    end
    root_ctx:barrier()

    it("records virtual_stages and the interleaved schedule in its manifest", function()
      assert.equal(2, manifest.layout.virtual_stages)
      assert.equal("interleaved", manifest.layout.schedule)
    end)

    it("loads at virtual_stages = 1 and back: the same loss, and after one more step", function()
      assert.near(ref_loss, v1_loss, LOSS_RTOL * ref_loss)
      assert.near(ref_after, v1_after, LOSS_RTOL * ref_after)
      assert.near(ref_loss, back_loss, LOSS_RTOL * ref_loss)
      assert.equal(4, plain.state.step)
    end)

    it("loads on one rank; `info` shows the interleaved layout", function()
      if me ~= 0 then return end
      assert.near(ref_loss, serial.loss, LOSS_RTOL * ref_loss)
      assert.matches("layout: tensor=1 pipeline=2 (virtual_stages=2) data=1 zero=0 (2 ranks), micro_batches=2 "
        .. "schedule=interleaved", serial.info, 1, true)
    end)
    cleanup(dir)
  end)
end

------------------------------------------------------------------------------
-- Bad checkpoints: every rank raises the same error, naming the file and the
-- problem; the checkpoint is left as it was.

if world == 2 or world == 4 then
  describe(("bad checkpoints on %d ranks"):format(world), function()
    local dir = shared_dir("bad")
    local ctx = pg.ParallelContext{ tensor = 2, pipeline = 1, data = world // 2, seed = 5 }
    local saver, data = build(ctx, { steps = 2 })
    saver:fit(data)
    local good = saver:save_checkpoint(dir .. "/good")

    -- A copy of the good checkpoint, damaged by `damage(path)` on rank 0.
    local n = 0
    local function damaged(damage)
      n = n + 1
      local path = ("%s/case-%d"):format(dir, n)
      if me == 0 then
        os.execute(("cp -r '%s' '%s'"):format(good, path))
        damage(path)
      end
      ctx:barrier()
      return path
    end

    -- Loads path on every rank; returns this rank's error, and whether all ranks had that same one.
    -- optimizer: a function engine -> optimizer (default AdamW).
    local function load_error(path, cfg, optimizer)
      local engine = pg.parallelize(pg.nn.GPT(cfg or CFG), ctx, { micro_batches = 2 })
      local opt = optimizer and optimizer(engine) or pg.optim.AdamW(engine, {})
      local t = pg.Trainer{ engine = engine, optimizer = opt, out = pg.testing.capture() }
      local ok, err = pcall(t.load_checkpoint, t, path)
      local all = ckpt.all_gather_strings(root_ctx, ok and "" or tostring(err))
      local same = true
      for _, e in ipairs(all) do same = same and e == all[1] end
      return not ok and tostring(err) or nil, same
    end

    local function listing(path)
      local p = io.popen("cd '" .. path .. "' && ls -l --time-style=+%s && cksum *")
      local s = p:read("a")
      p:close()
      return s
    end

    it("a flipped byte in a tensor file: a checksum mismatch naming the file", function()
      local path = damaged(function(p)
        local f = io.open(p .. "/params-tp1-pp0.safetensors", "r+b")
        f:seek("set", 4000)
        local b = f:read(1)
        f:seek("set", 4000)
        f:write(string.char(b:byte() ~ 0xFF))
        f:close()
      end)
      local before = listing(path)
      local err, same = load_error(path)
      assert.matches("^checkpoint: " .. path:gsub("%p", "%%%0") .. "/params%-tp1%-pp0%.safetensors: checksum mismatch: "
        .. "crc32 %x+ on disk, %x+ in the manifest %(the file is corrupt%)$", err)
      assert.is_true(same, "every rank raised the same error, also those that do not read the file")
      assert.equal(before, listing(path), "nothing was written")
      local problems = ckpt.verify(path)
      assert.equal(1, #problems)
      assert.equal(err, problems[1])
    end)

    it("a truncated file: its size against the manifest's", function()
      local path = damaged(function(p) os.execute(("truncate -s 100 '%s/optim-tp0-pp0.safetensors'"):format(p)) end)
      local err, same = load_error(path)
      assert.matches("^checkpoint: " .. path:gsub("%p", "%%%0") .. "/optim%-tp0%-pp0%.safetensors: truncated: 100 bytes on "
        .. "disk, the manifest says %d+$", err)
      assert.is_true(same)
    end)

    it("a missing file", function()
      local path = damaged(function(p) os.remove(p .. "/params-tp0-pp0.safetensors") end)
      local err, same = load_error(path)
      assert.matches("^checkpoint: " .. path:gsub("%p", "%%%0") .. "/params%-tp0%-pp0%.safetensors: missing %(the "
        .. "manifest lists it with %d+ bytes%)$", err)
      assert.is_true(same)
    end)

    it("a deleted manifest: not a checkpoint", function()
      local path = damaged(function(p) os.remove(p .. "/manifest.json") end)
      local err, same = load_error(path)
      assert.equal("checkpoint: " .. path .. " is not a checkpoint (no manifest.json)", err)
      assert.is_true(same)
      assert.same({ "checkpoint: " .. path .. "/manifest.json: missing (not a complete checkpoint)" }, ckpt.verify(path))
    end)

    it("a manifest of an unknown format version", function()
      local path = damaged(function(p)
        local text = io.open(p .. "/manifest.json"):read("a")
        local f = io.open(p .. "/manifest.json", "w")
        f:write((text:gsub('"format_version":2', '"format_version":99')))
        f:close()
      end)
      local err, same = load_error(path)
      assert.equal("checkpoint: " .. path .. "/manifest.json: format_version 99 is not supported (this version reads 2)",
        err)
      assert.is_true(same)
    end)

    -- Edits the manifest of a copy (decoded) and re-seals it: the field's own check is what refuses it.
    local function edited(fn)
      return damaged(function(p)
        local m = ckpt.decode(io.open(p .. "/manifest.json"):read("a"))
        fn(m)
        local f = io.open(p .. "/manifest.json", "w")
        f:write((ckpt.seal(m)))
        f:close()
      end)
    end

    it("a split table with parts = 0 (re-sealed): refused on every rank before anything is read", function()
      local path = edited(function(m)
        for _, r in ipairs(m.tensor_state.files) do
          if r.file == "params-tp1-pp0.safetensors" then r.slices["blocks.0.attn.qkv.weight"].split.parts = 0 end
        end
      end)
      local err, same = load_error(path)
      assert.matches("^checkpoint: " .. path:gsub("%p", "%%%0") .. "/manifest%.json: tensor_state%.files%[%d+%] %(params%-tp1%-pp0"
        .. "%.safetensors%): slices%['blocks%.0%.attn%.qkv%.weight'%]%.split%.parts is 0; it must be an integer >= 1$", err)
      assert.is_true(same)
      assert.equal(err, ckpt.verify(path)[1])
    end)

    it("a file name that leaves the directory (re-sealed)", function()
      local path = edited(function(m) m.tensor_state.files[1].file = "../../../etc/passwd" end)
      local err, same = load_error(path)
      assert.matches("tensor_state.files[1].file is '../../../etc/passwd'; it must be the name of a file in the "
        .. "checkpoint directory", err, 1, true)
      assert.is_true(same)
    end)

    it("a manifest edited without re-sealing: its checksum", function()
      local path = damaged(function(p)
        local text = io.open(p .. "/manifest.json"):read("a")
        local f = io.open(p .. "/manifest.json", "w")
        f:write((text:gsub('"step":2', '"step":1')))
        f:close()
      end)
      local err, same = load_error(path)
      assert.matches("^checkpoint: " .. path:gsub("%p", "%%%0") .. "/manifest%.json: checksum mismatch: the contents have "
        .. "crc32 %x+, manifest_crc32 says %x+", err)
      assert.is_true(same)
    end)

    it("a corrupt file that no rank reads (the optimizer's, for a weights-only load)", function()
      local path = damaged(function(p)
        local f = io.open(p .. "/optim-tp1-pp0.safetensors", "r+b")
        f:seek("set", 3000)
        f:write("\255\255\255\255")
        f:close()
      end)
      local err, same = load_error(path, nil, function()
        return { step = function() end, zero_grad = function() end, set_lr = function() end, get_lr = function() return 1 end }
      end)
      assert.matches("^checkpoint: " .. path:gsub("%p", "%%%0") .. "/optim%-tp1%-pp0%.safetensors: checksum mismatch", err)
      assert.is_true(same)
    end)

    it("an out_dir that another job holds: every rank refuses to start, naming it", function()
      local out = dir .. "/held"
      if me == 0 then
        os.execute("mkdir -p '" .. out .. "'")
        local owner = ckpt.lock_owner()
        local f = io.open(out .. "/.pipegoose.lock", "w")
        f:write(ckpt.encode({ pid = 1, host = owner.host, boot = owner.boot, time = 0, command = "init" }, "lock"))
        f:close()
      end
      ctx:barrier()
      local engine = pg.testing.fake_engine{ ctx = ctx }
      local t = pg.Trainer{ engine = engine, optimizer = pg.testing.fake_optimizer(engine), max_steps = 1, out_dir = out,
        out = pg.testing.capture() }
      local ok, err = pcall(t.fit, t, pg.testing.fake_data{ ctx = ctx })
      local all = ckpt.all_gather_strings(root_ctx, ok and "" or tostring(err))
      assert.is_false(ok)
      assert.matches("Trainer: out_dir " .. out .. " is in use by another job (pid 1 on ", err, 1, true)
      for _, e in ipairs(all) do assert.equal(all[1], e) end
    end)

    it("a model config that differs from the one being trained", function()
      local other = {}
      for k, v in pairs(CFG) do other[k] = v end
      other.layers = 1
      local err, same = load_error(good, other)
      assert.equal("checkpoint: " .. good .. "/manifest.json: the model differs from the one being trained: layers is 2 "
        .. "in the checkpoint, 1 here", err)
      assert.is_true(same)
    end)
    teardown(function() cleanup(dir) end)
  end)
end

-- after every test of this file
teardown(function() cleanup(DATA_DIR) end)

------------------------------------------------------------------------------
-- ZeRO-2 checkpoints hold the same optimizer state as ZeRO-1 (a slice per
-- data rank): on two ranks, saved with zero = 2 and loaded with zero = 0 and
-- 1, and saved with zero = 0 and loaded with zero = 2. With two data ranks
-- every stage reduces the same sums (grad_sync_spec), so the step after the
-- load is bitwise the saver's; with one micro-batch, since ZeRO-2 reduces
-- after every micro-batch (the sum of reduced gradients rounds otherwise).
if world == 2 then
  describe("a checkpoint across ZeRO stages at 1/1/2", function()
    local ctx = pg.ParallelContext{ data = 2, seed = 5 }
    local dir = shared_dir("zero2")
    local results = {}
    for _, from in ipairs{ 2, 0 } do
      local saver, data = build(ctx, { steps = 4, zero = from, micro_batches = 1 })
      saver:fit(data)
      saver:save_checkpoint(("%s/z%d"):format(dir, from))
      local want = step_then_loss(saver, ctx)
      for _, to in ipairs(from == 2 and { 0, 1 } or { 2 }) do
        local loader, data2 = build(ctx, { zero = to, micro_batches = 1 })
        loader:load_checkpoint(("%s/z%d"):format(dir, from), data2)
        results[#results + 1] = { from = from, to = to, want = want, got = step_then_loss(loader, ctx),
                                  step = loader.optimizer:shard_state().step }
      end
    end
    it("loads zero = 2 into zero = 0 and 1 and zero = 0 into zero = 2: the next step bitwise the saver's", function()
      assert.equal(3, #results)
      for _, r in ipairs(results) do
        assert.equal(r.want, r.got, ("saved with zero=%d, loaded with zero=%d"):format(r.from, r.to))
        assert.equal(5, r.step, "the optimizer's step count: 4 loaded, 1 taken")
      end
    end)
    teardown(function() cleanup(dir) end)
  end)
end

------------------------------------------------------------------------------
-- AdamW's hyperparameters on resume are the checkpoint's (docs/TRAINER.md,
-- "Resume, same layout": the AdamW state restored is m, v, step and the
-- hyperparameters): a loader whose optimizer was made with other betas, eps
-- and weight_decay takes the saved ones (what its lr is the schedule's
-- business: the saved one too, until fit sets the next step's), and the step
-- after the load is the saver's bit for bit (same layout, same bits in). On
-- one rank and on two with ZeRO-1 (each rank's shard of the state).
if world <= 2 then
  describe("AdamW's hyperparameters on resume", function()
    local ctx = pg.ParallelContext{ data = world, seed = 5 }
    local zero = world == 2 and 1 or 0
    local dir = shared_dir("hparams")
    local saver, data = build(ctx, { steps = 2, zero = zero })
    saver:fit(data)
    saver:save_checkpoint(dir .. "/saved")
    local saved = saver.optimizer:hparams()
    local want = step_then_loss(saver, ctx)
    local loader, data2 = build(ctx, { zero = zero, adamw = { betas = { 0.5, 0.6 }, eps = 1e-3, weight_decay = 0.5 } })
    local before = loader.optimizer:hparams()
    loader:load_checkpoint(dir .. "/saved", data2)
    local loaded = loader.optimizer:hparams()
    local got = step_then_loss(loader, ctx)
    it("are the checkpoint's betas, eps and weight_decay, not the resumed optimizer's; the next step is the saver's", function()
      for _, k in ipairs{ "beta1", "beta2", "eps", "weight_decay" } do
        assert.are_not.equal(saved[k], before[k], k .. " differs before the load")
      end
      assert.same(saved, loaded)
      assert.equal(want, got, ("the step after the load: %.17g, the saver's %.17g"):format(got, want))
    end)
    teardown(function() cleanup(dir) end)
  end)
end
