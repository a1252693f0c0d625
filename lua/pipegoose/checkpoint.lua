--- Checkpoints: a directory per checkpoint, written atomically, with the
-- engine's parameters and the optimizer's state in sharded safetensors files
-- that load into the same parallel layout bit for bit, or into another one
-- (resliced by parameter name). docs/FORMATS.md ("Checkpoints") describes the
-- files exactly; docs/TRAINER.md how the Trainer uses them.
--
--   <dir>/manifest.json                         written last, by rank 0
--   <dir>/params-tp{t}-pp{p}.safetensors        by data rank 0 of each (tensor, pipeline) rank
--   <dir>/optim-tp{t}-pp{p}.safetensors         zero = 0: by data rank 0
--   <dir>/optim-tp{t}-pp{p}-dp{d}.safetensors   zero = 1 or 2: by every rank (each holds its own flat slice)
--   <parent>/latest                             the name of the newest complete checkpoint
--
--   <dir>/<callback's files>                    callbacks' tensor state (save_checkpoint_files: pg.DiLoCo's
--                                               outer-tp{t}-pp{p}.safetensors), listed in manifest.callback_files
--
-- Engines without flat buffers (pg.testing's fakes, anything written in Lua)
-- keep their state_dict in <dir>/rank-{r}.json instead (exact JSON:
-- checkpoint/json.lua).
--
-- Saving (every rank calls save() at the same point): all files go into
-- <dir>.tmp-<pid of rank 0>, each written by pg.file.write (temporary name,
-- fsync, rename, fsync of the directory); the ranks' file records (size,
-- crc32, which slice of which tensor each entry holds) and data positions are
-- gathered to rank 0, which writes the manifest last, renames the directory
-- into place, and updates `latest` (atomically). A crash at any point leaves
-- the previous checkpoint and `latest` as they were; leftover temporary
-- directories are ignored and removed by the next successful save.
--
-- Loading validates before it trusts anything (checkpoint/manifest.lua:
-- the manifest's seal and every field, every file's name, size, crc32 and
-- header, the same checks scripts/checkpoint.lua verify runs), agrees on any
-- problem across ranks (every rank raises the same error, naming the file
-- and the field), and only then copies.
--
-- A job locks the directories it writes (M.lock: <dir>/.pipegoose.lock,
-- created with O_EXCL; checkpoint/lock.lua), so that two jobs never share one.
--
-- This file is the save/load protocol (save_tensor_state, manifest, save,
-- cleanup, load). The rest is one file per concept under checkpoint/
-- (lua/pipegoose/checkpoint/), and this module offers all of it as before
-- (pg.checkpoint.xxx; each is defined once, in its file):
--
--   checkpoint/fs.lua        files and directories, getpid, crc32 (M.fs, M.getpid, M.crc32_of)
--   checkpoint/json.lua      exact JSON (M.encode, M.decode)
--   checkpoint/ranks.lua     rank agreement (M.all_gather_strings, M.agree_error; barrier, rank 0's pid)
--   checkpoint/layout.lua    file names, slice records, the parallel layout (M.params_file, M.optim_file,
--                            M.is_sharded_engine, M.layout)
--   checkpoint/manifest.lua  validation: the format's names (M.FORMAT, M.MANIFEST, M.LATEST, M.SEAL_KEY, ...),
--                            M.read_manifest, M.manifest_problem, M.check_file, M.validate, M.seal, M.show,
--                            M.plain_name; finding a checkpoint (M.latest, M.resolve)
--   checkpoint/lock.lua      one job per directory (M.lock, M.unlock, M.lock_owner, M.pid_running, M.canonical)
--   checkpoint/shards.lua    sharded safetensors: writing, the load's plan and file checks, reslicing (M._assemble)
--   checkpoint/tools.lua     M.verify, M.seal_dir, M.info, M.consolidate, M.export_llmc, M.export_hf, M.load_weights
--
-- Each requires only those above it in this list (and pipegoose.safetensors,
-- the C module when it loads), never this file.
local fs = require "pipegoose.checkpoint.fs"
local json = require "pipegoose.checkpoint.json"
local ranks = require "pipegoose.checkpoint.ranks"
local layout = require "pipegoose.checkpoint.layout"
local validation = require "pipegoose.checkpoint.manifest"
local lock = require "pipegoose.checkpoint.lock"
local shards = require "pipegoose.checkpoint.shards"
local tools = require "pipegoose.checkpoint.tools"
local barrier, agreed_pid = ranks.barrier, ranks.agreed_pid
local multi_rank, agree_error = ranks.multi_rank, ranks.agree_error
local real_optimizer, describe_layout = layout.real_optimizer, layout.describe_layout
local write_sharded, load_sharded, check_files = shards.write_sharded, shards.load_sharded, shards.check_files

local M = {}

------------------------------------------------------------------------------
-- The API of the files under checkpoint/, offered here as it always was

M.FORMAT, M.FORMAT_VERSION, M.MANIFEST, M.LATEST = validation.FORMAT, validation.FORMAT_VERSION, validation.MANIFEST,
  validation.LATEST
M.SHARDED, M.JSON_PER_RANK, M.SEAL_KEY = validation.SHARDED, validation.JSON_PER_RANK, validation.SEAL_KEY
M.show, M.plain_name, M.manifest_problem, M.seal = validation.show, validation.plain_name, validation.manifest_problem,
  validation.seal
M.read_manifest, M.check_file, M.validate = validation.read_manifest, validation.check_file, validation.validate
M.latest, M.resolve = validation.latest, validation.resolve

M.fs, M.getpid, M.crc32_of = fs, fs.getpid, fs.crc32_of
M.encode, M.decode = json.encode, json.decode
M.all_gather_strings, M.agree_error = ranks.all_gather_strings, ranks.agree_error
M.params_file, M.optim_file, M.is_sharded_engine, M.layout = layout.params_file, layout.optim_file,
  layout.is_sharded_engine, layout.layout
M.LOCK, M.lock, M.unlock, M.lock_owner = lock.LOCK, lock.lock, lock.unlock, lock.lock_owner
M.pid_running, M.canonical = lock.pid_running, lock.canonical
M._assemble = shards.assemble
M.verify, M.seal_dir, M.info, M.consolidate = tools.verify, tools.seal_dir, tools.info, tools.consolidate
M.export_llmc, M.export_hf, M.load_weights = tools.export_llmc, tools.export_hf, tools.load_weights

local function copy(t)
  local out = {}
  for k, v in pairs(t) do out[k] = type(v) == "table" and copy(v) or v end
  return out
end

------------------------------------------------------------------------------
-- Tensor state: sharded safetensors files for real engines, exact JSON per
-- rank for engines written in Lua (pg.testing's fakes).

--- Writes this rank's engine and optimizer state into `dir` (every rank
-- calls it); returns {format=, files = the records of the files this rank wrote}.
function M.save_tensor_state(trainer, dir)
  if M.is_sharded_engine(trainer.engine) then
    return { format = M.SHARDED, files = write_sharded(trainer, dir) }
  end
  local rank = trainer.state.rank
  local engine, opt = trainer.engine, trainer.optimizer
  local body = {
    rank = rank,
    engine = engine.state_dict and engine:state_dict() or nil,
    optimizer = opt and opt.state_dict and opt:state_dict() or nil,
  }
  local file = ("rank-%05d.json"):format(rank)
  local crc, bytes = fs.write(dir .. "/" .. file, M.encode(body, ("rank %d state"):format(rank)))
  return { format = M.JSON_PER_RANK, files = { { file = file, kind = "rank", rank = rank, bytes = bytes, crc32 = crc } } }
end

--- Reads back what save_tensor_state wrote into the engine and optimizer.
-- Returns nil, or why only the weights were loaded (sharded files).
function M.load_tensor_state(trainer, dir, manifest)
  local desc = manifest.tensor_state
  if desc.format == M.SHARDED then
    local weights_only, resliced = load_sharded(trainer, dir, manifest)
    local saved, now = manifest.layout or {}, M.layout(trainer)
    if resliced then
      trainer:print(("checkpoint: %s was saved at %s; resliced into %s"):format(dir, describe_layout(saved),
        describe_layout(now)))
    end
    if weights_only then
      trainer:print(("checkpoint: loaded only the weights from %s (%s); the optimizer state starts fresh")
        :format(dir, weights_only))
    end
    return weights_only
  end
  -- json-per-rank (M.manifest_problem allows no other format)
  local rank = trainer.state.rank
  local rec
  for _, r in ipairs(desc.files) do if r.rank == rank then rec = r end end
  check_files(trainer, dir, manifest, { [rec and rec.file or ""] = true },
    not rec and ("checkpoint: %s/%s: lists no state file for rank %d"):format(dir, M.MANIFEST, rank) or nil)
  local file = dir .. "/" .. rec.file
  local body = M.decode(assert(fs.read(file)), file)
  local engine, opt = trainer.engine, trainer.optimizer
  if body.engine ~= nil then
    if not engine.load_state_dict then error("checkpoint: the engine has no load_state_dict()", 0) end
    engine:load_state_dict(body.engine)
  end
  if body.optimizer ~= nil and opt then
    if not opt.load_state_dict then error("checkpoint: the optimizer has no load_state_dict()", 0) end
    opt:load_state_dict(body.optimizer)
  end
end

------------------------------------------------------------------------------
-- save

local function optimizer_info(opt)
  if real_optimizer(opt) then
    local s = opt:shard_state()
    return { type = "AdamW", step = s.step, zero = opt.zero, hparams = opt:hparams() }
  end
  if opt ~= nil then return { type = "lua" } end
  return nil
end

--- The manifest for the trainer's current state (callback states included;
-- tensor_state and data_ranks are added by save()).
function M.manifest(trainer)
  local st = trainer.state
  local data = trainer.train_data
  local ctx = trainer.ctx
  return {
    format = M.FORMAT,
    format_version = M.FORMAT_VERSION,
    step = st.step,
    epoch = st.epoch,
    counters = trainer:counters(),
    lr = trainer:lr_state(),
    metrics = copy(st.metrics),
    callbacks = trainer.callback_handler:state_dict(),
    data = data and data.state_dict and data:state_dict() or nil,
    model = type(trainer.engine.config) == "table" and copy(trainer.engine.config) or nil,
    layout = M.layout(trainer),
    optimizer = optimizer_info(trainer.optimizer),
    -- The C runtime keeps no random state (initialisation is a pure function
    -- of seed, name and index; data order of its own seed and the epoch);
    -- the trainer reseeds math.random from its seed when fit starts.
    rng = { trainer_seed = trainer.seed, context_seed = (ctx and ctx.seed) and ctx:seed() or nil },
    world_size = st.world_size,
    saved_at = os.time(),
  }
end

-- Test-only: PG_CHECKPOINT_TEST_KILL=STEP:RANK makes that rank SIGKILL itself
-- in the save at that step, after writing its files and before the manifest.
local function test_kill_point(trainer)
  local spec = os.getenv("PG_CHECKPOINT_TEST_KILL")
  if not spec then return end
  local step, rank = spec:match("^(%d+):(%d+)$")
  if not step then error(("PG_CHECKPOINT_TEST_KILL: expected STEP:RANK (two integers), got '%s'"):format(spec)) end
  if tonumber(step) == trainer.state.step and tonumber(rank) == trainer.state.rank then
    io.stderr:write(("checkpoint: PG_CHECKPOINT_TEST_KILL: rank %d kills itself in the save at step %d\n")
      :format(trainer.state.rank, trainer.state.step))
    io.stderr:flush()
    os.execute("kill -9 " .. M.getpid())
  end
end

--- Removes what interrupted saves left in a checkpoint directory's parent:
-- <name>.tmp-<pid> and <name>.old-<pid> directories and latest.tmp.<pid>
-- files of this process or of processes that have ended. Those of a running
-- process are left alone: they may be another job's save in progress (the
-- lock should keep a second job out of the directory; this holds without it).
function M.cleanup(parent)
  local removed = {}
  local me = M.getpid()
  for _, name in ipairs(fs.list(parent)) do
    local pid = name:match("^.+%.tmp%-(%d+)$") or name:match("^.+%.old%-(%d+)$")
      or name:match("^" .. M.LATEST .. "%.tmp%.(%d+)$")
    pid = pid and math.tointeger(tonumber(pid))
    if pid and (pid == me or M.pid_running(pid) == false) then
      fs.rm_rf(parent .. "/" .. name)
      removed[#removed + 1] = name
    end
  end
  return removed
end

--- Saves the trainer's state into directory `dir` (see the top of this file).
function M.save(trainer, dir)
  if type(dir) ~= "string" or dir == "" then error("checkpoint.save: needs a directory path", 2) end
  dir = dir:gsub("/+$", "")
  local rank = trainer.state.rank
  local parent = fs.dirname(dir)
  local pid = agreed_pid(trainer)
  local tmp = ("%s.tmp-%d"):format(dir, pid)
  if rank == 0 then
    fs.rm_rf(tmp)
    fs.mkdir_p(tmp)
  end
  barrier(trainer)
  local manifest = M.manifest(trainer)
  trainer:call_hook("on_save_checkpoint", manifest, dir)
  local desc = M.save_tensor_state(trainer, tmp)
  local cb_files = trainer.callback_handler:save_files(trainer, tmp)
  test_kill_point(trainer)
  -- every rank's file records and data position to rank 0 (pg.file.write
  -- synced each file before returning, so after this gather every file is
  -- durable)
  local ctx = trainer.ctx
  local mine = { rank = rank, files = desc.files, callback_files = cb_files, data = manifest.data, tp = 0, pp = 0,
                 dp = 0 }
  if ctx and not ctx.fake then
    mine.tp, mine.pp, mine.dp = ctx:local_rank("tensor"), ctx:local_rank("pipeline"), ctx:local_rank("data")
  end
  local all = { mine }
  if multi_rank(trainer) then
    all = {}
    for i, text in ipairs(M.all_gather_strings(ctx, M.encode(mine, "file records"))) do
      all[i] = M.decode(text, "file records")
    end
  end
  if rank == 0 then
    local files, data_ranks, callback_files = {}, {}, nil
    for _, r in ipairs(all) do
      for _, f in ipairs(r.files or {}) do files[#files + 1] = f end
      for key, recs in pairs(r.callback_files or {}) do
        callback_files = callback_files or {}
        callback_files[key] = callback_files[key] or {}
        for _, f in ipairs(recs) do table.insert(callback_files[key], f) end
      end
      if r.tp == 0 and r.pp == 0 and r.data ~= nil then data_ranks[r.dp + 1] = r.data end
    end
    table.sort(files, function(a, b) return a.file < b.file end)
    manifest.tensor_state = { format = desc.format, files = files }
    for _, recs in pairs(callback_files or {}) do table.sort(recs, function(a, b) return a.file < b.file end) end
    manifest.callback_files = callback_files
    manifest.data_ranks = data_ranks
    -- never write what loading would refuse: a failure here is a bug in
    -- the writer (or in the checks), found at the save instead of the resume
    local problem = M.manifest_problem(tmp, M.decode(M.encode(manifest, "manifest"), "manifest"))
    if problem then error(problem .. " (in the manifest being saved)", 0) end
    fs.write(tmp .. "/" .. M.MANIFEST, (M.seal(manifest)))
    if fs.exists(dir) then
      local old = ("%s.old-%d"):format(dir, pid)
      fs.rm_rf(old)
      local ok, err = os.rename(dir, old)
      if not ok then error(("checkpoint: cannot move %s aside: %s"):format(dir, tostring(err)), 0) end
      ok, err = os.rename(tmp, dir)
      if not ok then error(("checkpoint: cannot rename %s to %s: %s"):format(tmp, dir, tostring(err)), 0) end
      fs.rm_rf(old)
    else
      local ok, err = os.rename(tmp, dir)
      if not ok then error(("checkpoint: cannot rename %s to %s: %s"):format(tmp, dir, tostring(err)), 0) end
    end
    fs.fsync_dir(parent)
    fs.write(parent .. "/" .. M.LATEST, fs.basename(dir) .. "\n")
    M.cleanup(parent)
  end
  barrier(trainer) -- nobody reads or deletes before the directory is complete
  return dir
end

------------------------------------------------------------------------------
-- load

-- A value as text, tables with their keys sorted (a config's rope_scaling): equal values, equal text.
-- Numbers by value (JSON reads 64 back as 64.0).
local function canonical(v)
  if type(v) == "number" then return math.tointeger(v) and tostring(math.tointeger(v)) or ("%.17g"):format(v) end
  if type(v) ~= "table" then return tostring(v) end
  local keys, parts = {}, {}
  for k in pairs(v) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  for i, k in ipairs(keys) do parts[i] = tostring(k) .. " = " .. canonical(v[k]) end
  return "{" .. table.concat(parts, ", ") .. "}"
end

--- Differences between a saved model config and this one, as a message, or nil.
function M.config_difference(saved, mine)
  if type(saved) ~= "table" or type(mine) ~= "table" then return nil end
  local keys, seen = {}, {}
  for k in pairs(saved) do if not seen[k] then seen[k] = true; keys[#keys + 1] = k end end
  for k in pairs(mine) do if not seen[k] then seen[k] = true; keys[#keys + 1] = k end end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  local diffs = {}
  for _, k in ipairs(keys) do
    -- hf_config (the config.json a model was imported from) says where it came from, not what it computes
    if k ~= "hf_config" then
      local a, b = canonical(saved[k]), canonical(mine[k])
      if a ~= b then diffs[#diffs + 1] = ("%s is %s in the checkpoint, %s here"):format(tostring(k), a, b) end
    end
  end
  if #diffs == 0 then return nil end
  return table.concat(diffs, "; ")
end

--- Loads a checkpoint directory (or a parent with a `latest` file) into the
-- trainer: engine and optimizer state, counters, lr position, metrics, data,
-- then on_load_checkpoint(manifest) and each callback's load_state_dict.
-- Returns the manifest and the directory.
function M.load(trainer, path)
  if type(path) ~= "string" then error("checkpoint.load: needs a directory path", 2) end
  -- every rank reads and validates the manifest; they agree before going on
  local dir, manifest
  local ok, err = pcall(function()
    dir = M.resolve(path)
    manifest = M.read_manifest(dir)
  end)
  agree_error(trainer, not ok and tostring(err) or nil)
  local st = trainer.state
  local diff = M.config_difference(manifest.model, trainer.engine.config)
  if diff then
    error(("checkpoint: %s/%s: the model differs from the one being trained: %s"):format(dir, M.MANIFEST, diff), 0)
  end
  local ts = manifest.tensor_state
  if ts.format == M.JSON_PER_RANK and manifest.world_size ~= st.world_size then
    error(("checkpoint: %s was saved by %s ranks; this job has %d"):format(dir, tostring(manifest.world_size),
      st.world_size), 0)
  end
  M.load_tensor_state(trainer, dir, manifest)
  trainer:restore_counters(manifest.counters)
  trainer:load_lr_state(manifest.lr)
  st.metrics = manifest.metrics
  local data = trainer.train_data
  local dstate = manifest.data
  local ranks, ctx = manifest.data_ranks, trainer.ctx
  if type(ranks) == "table" and ctx and not ctx.fake and #ranks == ctx:world_size("data") then
    dstate = ranks[ctx:local_rank("data") + 1] or dstate
  end
  if dstate ~= nil and data and data.load_state_dict then data:load_state_dict(dstate) end
  local rng = manifest.rng or {}
  if trainer.seed ~= nil and rng.trainer_seed ~= nil and rng.trainer_seed ~= trainer.seed then
    trainer:print(("checkpoint: %s was saved with seed=%s; this trainer has seed=%s"):format(dir,
      tostring(rng.trainer_seed), tostring(trainer.seed)))
  end
  trainer:call_hook("on_load_checkpoint", manifest)
  trainer.callback_handler:load_state_dict(manifest.callbacks or {})
  trainer.callback_handler:load_files(trainer, dir, manifest.callback_files or {})
  return manifest, dir
end

return M
