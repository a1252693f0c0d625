--- Tools on one process (scripts/checkpoint.lua): verify, seal_dir, info,
-- consolidate, export to llm.c and to Hugging Face, and load_weights (a
-- checkpoint's parameters into an engine of any layout, scripts/generate.lua).
-- They read the files, never a running job. A module of its own because
-- training does not use them; they check checkpoints only through
-- manifest.lua and assemble tensors only through shards.lua.
local fs = require "pipegoose.checkpoint.fs"
local json = require "pipegoose.checkpoint.json"
local layout = require "pipegoose.checkpoint.layout"
local validation = require "pipegoose.checkpoint.manifest"
local shards = require "pipegoose.checkpoint.shards"
local safetensors = require "pipegoose.safetensors"
local describe_layout = layout.describe_layout
local header_reader, pieces_of, originals = shards.header_reader, shards.pieces_of, shards.originals
local assemble, first_rows = shards.assemble, shards.first_rows

local M = {}

--- Checks a checkpoint directory as loading does, every file included
-- (M.validate). Returns the problems (empty: good) and the manifest.
function M.verify(dir)
  return validation.validate(dir)
end

--- Seals a checkpoint's manifest (scripts/checkpoint.lua seal): validates
-- the manifest's fields and every file as loading does, then writes the
-- manifest back with its seal. A manifest whose seal does not match its
-- contents is refused unless opts.force: an edit made on purpose. Returns
-- the directory, the new crc32, the seal it had (nil: none) and whether
-- that one matched.
function M.seal_dir(dir, opts)
  opts = opts or {}
  dir = validation.resolve(dir)
  local how = { unsealed = true, reseal = opts.force }
  local problems = validation.validate(dir, how)
  if #problems > 0 then error(problems[1], 0) end
  local manifest, old, matched = validation.read_manifest(dir, how)
  local text, crc = validation.seal(manifest)
  fs.write(dir .. "/" .. validation.MANIFEST, text)
  return dir, crc, old, matched
end

local function verified(dir)
  dir = dir:gsub("/+$", "")
  local problems, manifest = M.verify(dir)
  if #problems > 0 then error(problems[1], 0) end
  if manifest.tensor_state.format ~= validation.SHARDED then
    error(("checkpoint: %s holds %s state (an engine written in Lua), not sharded tensor files"):format(dir,
      tostring(manifest.tensor_state.format)), 0)
  end
  return dir, manifest
end

-- An output file path a tool may write: refused when it is inside the
-- checkpoint it reads (it would replace one of the checkpoint's files, or
-- add one its manifest does not list), when the checkpoint is inside it, or
-- when it is the `latest` file that named the checkpoint (`given`: the
-- directory as the user named it). Compared as real paths (links resolved,
-- a missing output's parent too).
local function check_output(what, out, dir, given)
  if type(out) ~= "string" or out == "" then error(("checkpoint: %s needs an output path"):format(what), 0) end
  local target, src = fs.absolute(out), fs.absolute(dir)
  if not target then error(("checkpoint: %s: %s is not a path that can be resolved"):format(what, out), 0) end
  if src and fs.within(target, src) then
    error(("checkpoint: %s: the output %s is inside the checkpoint %s it reads (writing it would change the "
      .. "checkpoint): give a path outside it"):format(what, out, dir), 0)
  end
  if src and fs.within(src, target) then
    error(("checkpoint: %s: the output %s holds the checkpoint %s it reads: give another path"):format(what, out, dir), 0)
  end
  local other = fs.checkpoint_above(target)
  if other then
    error(("checkpoint: %s: the output %s is inside the checkpoint %s (writing it would change that checkpoint): give "
      .. "a path outside it"):format(what, out, other), 0)
  end
  local latest = given and fs.absolute(given .. "/" .. validation.LATEST)
  if latest and latest == target then
    error(("checkpoint: %s: the output %s is the latest file of %s, which names the checkpoint it reads: give another "
      .. "path"):format(what, out, given), 0)
  end
  if fs.is_dir(out) then error(("checkpoint: %s: the output %s is a directory; give a file path"):format(what, out), 0) end
  if not fs.is_dir(fs.dirname(target)) then
    error(("checkpoint: %s: the output's directory %s does not exist"):format(what, fs.dirname(out)), 0)
  end
end

local function human(bytes)
  if bytes >= 1 << 30 then return ("%.2f GiB"):format(bytes / (1 << 30)) end
  if bytes >= 1 << 20 then return ("%.2f MiB"):format(bytes / (1 << 20)) end
  if bytes >= 1 << 10 then return ("%.1f KiB"):format(bytes / (1 << 10)) end
  return ("%d B"):format(bytes)
end

local function kv(t)
  local keys = {}
  for k in pairs(t or {}) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  local parts = {}
  for _, k in ipairs(keys) do
    local v = t[k]
    if type(v) ~= "table" then parts[#parts + 1] = ("%s=%s"):format(tostring(k), tostring(v)) end
  end
  return table.concat(parts, " ")
end

--- A summary of a checkpoint's manifest, as lines of text.
function M.info(dir)
  dir = validation.resolve(dir)
  local m = validation.read_manifest(dir)
  local lines = {}
  local function add(fmt, ...) lines[#lines + 1] = fmt:format(...) end
  add("checkpoint %s", dir)
  add("format %s version %d, saved %s", m.format, m.format_version, m.saved_at and os.date("!%Y-%m-%d %H:%M:%S UTC", m.saved_at) or "?")
  add("step %d, epoch %d", m.step or 0, m.epoch or 0)
  if m.counters then add("counters: %s", kv(m.counters)) end
  if m.model then
    -- the imported config.json's text (hf_config) is long: its size only
    local model = {}
    for k, v in pairs(m.model) do model[k] = v end
    if type(model.hf_config) == "string" then model.hf_config = ("<config.json, %d bytes>"):format(#model.hf_config) end
    add("model: %s", kv(model))
  end
  if m.layout then
    add("layout: %s (%d ranks), micro_batches=%s schedule=%s", describe_layout(m.layout), m.world_size or 0,
      tostring(m.layout.micro_batches), tostring(m.layout.schedule))
  end
  if m.optimizer then
    add("optimizer: %s step %s %s", tostring(m.optimizer.type), tostring(m.optimizer.step), kv(m.optimizer.hparams))
  end
  if m.lr then add("lr: base %s, last %s", tostring(m.lr.base_lr), tostring(m.lr.last_lr)) end
  if m.metrics then add("metrics: %s", kv(m.metrics)) end
  if m.data_ranks then
    for d, s in pairs(m.data_ranks) do
      add("data rank %d: epoch %s, batch %s", d - 1, tostring(s.epoch), tostring(s.batch_index or s.pos))
    end
  end
  if m.rng then add("rng: %s", kv(m.rng)) end
  local cbs = {}
  for k in pairs(m.callbacks or {}) do cbs[#cbs + 1] = k end
  table.sort(cbs)
  if #cbs > 0 then add("callback states: %s", table.concat(cbs, ", ")) end
  local ts = m.tensor_state or {}
  local total = 0
  for _, f in ipairs(ts.files or {}) do total = total + (f.bytes or 0) end
  add("tensor state: %s, %d files, %s", tostring(ts.format), #(ts.files or {}), human(total))
  for _, f in ipairs(ts.files or {}) do
    local n = 0
    for _ in pairs(f.slices or {}) do n = n + 1 end
    add("  %-36s %10s  crc32 %08x  %d tensors", f.file, human(f.bytes or 0), f.crc32 or 0, f.kind == "optim" and 2 * n or n)
  end
  return lines, m
end

-- Parameter names in model order: by pipeline stage, then each file's order.
local function param_names(dir, files)
  local recs = {}
  for _, r in ipairs(files) do if r.kind == "params" then recs[#recs + 1] = r end end
  table.sort(recs, function(a, b) if a.pp ~= b.pp then return a.pp < b.pp end return a.tp < b.tp end)
  local names, seen = {}, {}
  local header_of = header_reader(dir)
  for _, r in ipairs(recs) do
    for _, n in ipairs(header_of(r).names) do
      if not seen[n] then seen[n] = true; names[#names + 1] = n end
    end
  end
  return names, header_of
end

-- The model's rows of a full tensor: tensor parallelism pads the vocabulary
-- rows further than the model's padded_vocab; those rows are dropped.
local function model_rows(slice, cfg)
  if slice.valid_rows and cfg and cfg.padded_vocab and cfg.padded_vocab <= slice.full_shape[1] then
    return cfg.padded_vocab
  end
  return slice.full_shape[1]
end

local function full_tensor(dir, manifest, header_of, kind, prefix, name)
  local list = pieces_of(manifest.tensor_state.files, kind, name)
  if #list == 0 then error(("checkpoint: %s holds no %s%s"):format(dir, prefix, name), 0) end
  list = originals(list)
  local full = assemble(dir, list, prefix, name, header_of)
  return first_rows(full, model_rows(list[1].slice, manifest.model))
end

--- Merges every shard into one safetensors file of full tensors (the model's
-- shapes), named as the parameters; with opts.optimizer also "m/<name>" and
-- "v/<name>". Returns the number of tensors, the crc32 and the size.
function M.consolidate(dir, out, opts)
  opts = opts or {}
  local manifest, given = nil, dir
  dir, manifest = verified(validation.resolve(dir))
  check_output("consolidate", out, dir, given)
  local names, header_of = param_names(dir, manifest.tensor_state.files)
  local entries = {}
  for _, name in ipairs(names) do
    entries[#entries + 1] = { name = name, tensor = full_tensor(dir, manifest, header_of, "params", "", name) }
  end
  if opts.optimizer then
    for _, which in ipairs{ "m", "v" } do
      for _, name in ipairs(names) do
        entries[#entries + 1] = { name = which .. "/" .. name,
                                  tensor = full_tensor(dir, manifest, header_of, "optim", which .. "/", name) }
      end
    end
  end
  local meta = { format = "pipegoose-consolidated", step = tostring(manifest.step),
                 model = json.encode(manifest.model or {}, "model") }
  if opts.optimizer and manifest.optimizer then meta.optimizer = json.encode(manifest.optimizer, "optimizer") end
  local crc, bytes = safetensors.write(out, entries, meta)
  return #entries, crc, bytes
end

--- Writes the checkpoint's GPT-2 weights as an llm.c model file (the layout
-- of lua/pipegoose/llmc.lua). Returns the crc32 and the size.
-- dtype (opts.dtype): the values' type in the file, float32 (default) or bfloat16 (rounded to nearest even).
local function export_dtype(opts)
  local dtype = opts and opts.dtype or "float32"
  if dtype ~= "float32" and dtype ~= "bfloat16" then
    error(("checkpoint: the export dtype must be float32 or bfloat16, not %s"):format(tostring(dtype)), 0)
  end
  return dtype
end

function M.export_llmc(dir, out, opts)
  local dtype = export_dtype(opts)
  local manifest, given = nil, dir
  dir, manifest = verified(validation.resolve(dir))
  check_output("export-llmc", out, dir, given)
  local cfg = manifest.model or {}
  local why = require("pipegoose.llmc").refusal(cfg)
  if why then error(("checkpoint: %s: %s"):format(dir, why), 0) end
  local core = require "pipegoose.core"
  local llmc = require "pipegoose.llmc"
  local parts = { llmc.header(cfg, dtype) }
  local header_of = header_reader(dir)
  local cache = {}
  for _, e in ipairs(llmc.entries(cfg)) do
    local full = cache[e.name]
    if not full then
      full = full_tensor(dir, manifest, header_of, "params", "", e.name)
      cache[e.name] = full
    end
    if full:numel() < e.count then
      error(("checkpoint: %s: %s has %d values, llm.c's %s needs %d"):format(dir, e.name, full:numel(), e.file_name,
        e.count), 0)
    end
    local values = full:reshape{ full:numel() }:narrow(1, 1, e.count)
    parts[#parts + 1] = dtype == "bfloat16" and core.ops.to_bf16(values) or values
  end
  return core.file.write(out, parts)
end

--- Writes the checkpoint's weights as a Hugging Face directory
-- (lua/pipegoose/hf.lua's write_checkpoint: config.json with the imported
-- fields the manifest's model config keeps, generation_config.json, the
-- weights, the tokenizer's files when opts.tokenizer names one). opts as
-- engine:save_hf's (dtype, max_shard_size, tokenizer, overwrite ...). The
-- export may not replace the checkpoint, a directory above it, or be inside it.
-- Returns the class written.
function M.export_hf(dir, out, opts)
  local manifest
  dir, manifest = verified(validation.resolve(dir))
  local header_of = header_reader(dir)
  return require("pipegoose.hf").write_checkpoint(manifest.model or {}, out, function(name)
    return full_tensor(dir, manifest, header_of, "params", "", name)
  end, "checkpoint: " .. dir, opts, dir)
end

--- Loads a checkpoint's parameters (not the optimizer or the counters) into
-- an engine of any layout: each rank cuts its shards out of the full tensors.
-- The checkpoint is verified first. Returns the manifest.
function M.load_weights(engine, path)
  local dir, manifest = verified(validation.resolve(path))
  local header_of = header_reader(dir)
  -- a tied head's copy (last stage) takes the original's values, as the loaders of llmc.lua and hf.lua do
  for _, p in ipairs(engine:parameters()) do
    engine:load_param(p.name, full_tensor(dir, manifest, header_of, "params", "", p.name))
  end
  return manifest
end

return M
