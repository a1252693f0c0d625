--- The sharded safetensors state of an engine made by pg.parallelize:
-- writing this rank's params and optimizer files (M.write_sharded), and
-- loading them into any layout (M.load_sharded): planned per parameter, a
-- saved piece of the very shard is copied as it is, anything else is
-- assembled into the full tensor and cut for this layout (resliced). Before
-- anything is copied the ranks check the files (M.check_files, by
-- manifest.lua's check_file) and agree. A module of its own because it is
-- the one part that knows shards and pieces; the tools assemble full
-- tensors with the same functions (M.pieces_of, M.originals, M.assemble).
local json = require "pipegoose.checkpoint.json"
local layout = require "pipegoose.checkpoint.layout"
local validation = require "pipegoose.checkpoint.manifest"
local ranks = require "pipegoose.checkpoint.ranks"
local safetensors = require "pipegoose.safetensors"
local real_optimizer, norm_split, slice_of = layout.real_optimizer, layout.norm_split, layout.slice_of
local multi_rank, agree_error = ranks.multi_rank, ranks.agree_error

local M = {}

local numel = safetensors.numel
-- This rank's engine and optimizer state as safetensors files in dir;
-- returns the records of the files it wrote.
local function write_sharded(trainer, dir)
  local engine, opt, ctx = trainer.engine, trainer.optimizer, trainer.engine.ctx
  local l = layout.layout(trainer)
  -- dp: the place among the replicas of this (tp, pp), whose ZeRO slices are the files' (with context
  -- parallelism the data x context group: the parameters are replicated over both)
  local tp, pp = ctx:local_rank("tensor"), ctx:local_rank("pipeline")
  local dp = ctx:local_rank((l.context or 1) > 1 and "data_context" or "data")
  local records = {}
  local function write(file, kind, entries, slices, extra)
    local meta = { format = "pipegoose-shard", kind = kind, tp = tp, pp = pp, dp = dp, step = trainer.state.step,
                   tensor = l.tensor, pipeline = l.pipeline, data = l.data, expert = l.expert, zero = l.zero,
                   context = (l.context or 1) > 1 and l.context or nil, slices = slices }
    for k, v in pairs(extra or {}) do meta[k] = v end
    local crc, bytes = safetensors.write(dir .. "/" .. file, entries, { pipegoose = json.encode(meta, file) })
    records[#records + 1] = { file = file, kind = kind, tp = tp, pp = pp, dp = dp, bytes = bytes, crc32 = crc,
                              slices = slices, ep = extra and extra.ep }
  end
  local params = engine:parameters()
  -- Data rank 0 writes the dense parameters and its experts; under expert
  -- parallelism the other members of the first expert group (data ranks 1 ..
  -- E - 1) write the experts they hold, each in its own file (ep > 0).
  local ep = (l.expert or 1) > 1 and dp > 0 and dp < l.expert and dp or nil
  -- zero = 3: no rank holds a parameter whole; each is gathered over the data
  -- group (an expert over expert_data) in turn (every data rank takes part,
  -- in the parameters' order) for its writer. The files are those of zero =
  -- 1 and 2: any stage loads them.
  local gathered = {}
  for _, p in ipairs(params) do
    if not p.tensor then
      local t = engine:local_param(p.name)
      if dp == 0 or (ep and p.expert) then gathered[p.name] = t end
    end
  end
  if dp == 0 or ep then
    local entries, slices = {}, {}
    for _, p in ipairs(params) do
      if dp == 0 or p.expert then
        entries[#entries + 1] = { name = p.name, tensor = p.tensor or gathered[p.name] }
        slices[p.name] = slice_of(p, 0, numel(p.shape))
      end
    end
    write(layout.params_file(tp, pp, ep), "params", entries, slices, { ep = ep })
  end
  if real_optimizer(opt) and (layout.sharded_optimizer(opt.zero) or dp == 0 or ep) then
    local s = opt:shard_state()
    local entries, slices = {}, {}
    for _, r in ipairs(layout.shard_ranges(s)) do
      for _, p in ipairs(params) do
        local n = numel(p.shape)
        local a, b = math.max(p.offset, r.lo), math.min(p.offset + n, r.hi)
        if a < b and (layout.sharded_optimizer(opt.zero) or dp == 0 or p.expert) then
          local shape = (b - a == n) and p.shape or { b - a }
          local at = a - r.lo + r.at + 1
          entries[#entries + 1] = { name = "m/" .. p.name, tensor = s.m:narrow(1, at, b - a), shape = shape }
          entries[#entries + 1] = { name = "v/" .. p.name, tensor = s.v:narrow(1, at, b - a), shape = shape }
          slices[p.name] = slice_of(p, a - p.offset, b - p.offset)
        end
      end
    end
    write(layout.sharded_optimizer(opt.zero) and layout.optim_file(tp, pp, dp) or layout.optim_file(tp, pp, nil, ep), "optim", entries,
      slices, { optimizer_step = s.step, flat_lo = s.lo, flat_hi = s.hi, ep = not layout.sharded_optimizer(opt.zero) and ep or nil })
  end
  return records
end

-- Every saved piece of tensor `name` in files of `kind`: { {rec=, slice=}, ... }.
local function pieces_of(files, kind, name)
  local out = {}
  for _, rec in ipairs(files) do
    if rec.kind == kind and rec.slices and rec.slices[name] then out[#out + 1] = { rec = rec, slice = rec.slices[name] } end
  end
  return out
end

-- The pieces to assemble a full tensor from, each element once: not the
-- second copies of a tied weight (unless there is nothing else), and of the
-- tensor ranks that hold the same shard (replicated tensors: all of them)
-- only the lowest one's pieces (its data ranks' ZeRO ranges cover the shard).
local function originals(list)
  local kept = {}
  for _, pc in ipairs(list) do if not pc.slice.tied_copy then kept[#kept + 1] = pc end end
  if #kept == 0 then kept = list end
  local owner = {} -- shard (parts, index) -> the lowest (pp, tp) holding it
  local function key(pc) return pc.slice.split.parts .. ":" .. pc.slice.split.index end
  local function rank_of(pc) return (pc.rec.pp or 0) * 65536 + (pc.rec.tp or 0) end
  for _, pc in ipairs(kept) do
    local k = key(pc)
    if owner[k] == nil or rank_of(pc) < owner[k] then owner[k] = rank_of(pc) end
  end
  local out = {}
  for _, pc in ipairs(kept) do
    if rank_of(pc) == owner[key(pc)] then out[#out + 1] = pc end
  end
  return out
end

local function same_shard(s, p)
  if #s.full_shape ~= #p.full_shape then return false end
  for i, d in ipairs(p.full_shape) do if s.full_shape[i] ~= d then return false end end
  local a, b = norm_split(s.split), norm_split(p.split)
  local sa, sb = table.concat(a.sizes or {}, ","), table.concat(b.sizes or {}, ",")
  return a.dim == b.dim and a.parts == b.parts and a.index == b.index and a.blocks == b.blocks and sa == sb
end

-- A saved piece of the very shard p holds that covers its local elements [lo, hi).
local function find_direct(list, p, lo, hi)
  local any
  for _, pc in ipairs(list) do
    local s = pc.slice
    if same_shard(s, p) and s.lo <= lo and s.hi >= hi then
      if (s.tied_copy or false) == (p.tied_copy or false) then return pc end
      any = any or pc
    end
  end
  return any
end

local function header_reader(dir)
  local headers = {}
  return function(rec)
    local h = headers[rec.file]
    if not h then
      local ok, res = pcall(safetensors.read_header, dir .. "/" .. rec.file)
      if not ok then error("checkpoint: " .. tostring(res), 0) end
      h = res
      headers[rec.file] = h
    end
    return h
  end
end

local function read_piece(header_of, pc, entry, first, count)
  local ok, t = pcall(safetensors.read, header_of(pc.rec), entry, first, count)
  if not ok then error("checkpoint: " .. tostring(t), 0) end
  return t
end

-- The full tensor (its saved full shape) of `prefix .. name` from pieces.
local function assemble(dir, list, prefix, name, header_of)
  local core = require "pipegoose.core"
  local shape = list[1].slice.full_shape
  local full = core.zeros(shape)
  local covered = 0
  for _, pc in ipairs(list) do
    local s = pc.slice
    for i, d in ipairs(shape) do
      if s.full_shape[i] ~= d then
        error(("checkpoint: %s: the pieces of %s disagree on its full shape"):format(dir, name), 0)
      end
    end
    local t = read_piece(header_of, pc, prefix .. name, 0, s.hi - s.lo)
    core.shard_copy(full, t, { full_shape = s.full_shape, split = s.split, lo = s.lo }, "to_full")
    covered = covered + (s.hi - s.lo)
  end
  if covered ~= numel(shape) then
    error(("checkpoint: %s: the saved pieces of %s%s cover %d of its %d elements"):format(dir, prefix, name, covered,
      numel(shape)), 0)
  end
  return full
end

local function first_rows(full, rows)
  if rows < full:size(1) then return full:narrow(1, 1, rows) end
  return full
end

-- Before anything is copied: every rank checks the files it reads and its
-- share of the others (file i on rank i mod world size), so that the ranks
-- together check every file once (a corrupt file is refused even when no
-- rank reads it: the optimizer files of a weights-only load), then they
-- agree, and every rank raises the same first problem. `planned` is one
-- found while planning (the checkpoint lacks a tensor): a bad file is
-- reported before it.
local function check_files(trainer, dir, manifest, reads, planned)
  local world, rank = 1, 0
  if multi_rank(trainer) then world, rank = trainer.state.world_size, trainer.state.rank end
  local problem
  for i, rec in ipairs(manifest.tensor_state.files) do
    if problem then break end
    if reads[rec.file] or (i - 1) % world == rank then problem = validation.check_file(dir, rec) end
  end
  agree_error(trainer, problem or planned)
end

-- Loads the sharded files into this rank's engine and optimizer: pieces of
-- the same shard are copied as they are, anything else is assembled into the
-- full tensor and cut for this layout. Returns nil, or why only the weights
-- were loaded.
local function load_sharded(trainer, dir, manifest)
  local core = require "pipegoose.core"
  local engine, opt = trainer.engine, trainer.optimizer
  if not layout.is_sharded_engine(engine) then
    error(("checkpoint: %s holds sharded tensor files, which only an engine made by pg.parallelize can load"):format(dir), 0)
  end
  local files = manifest.tensor_state.files or {}
  local plan, need, problem = {}, {}, nil
  local function note(msg) problem = problem or msg end
  local function want(list) for _, pc in ipairs(list) do need[pc.rec.file] = pc.rec end end
  local params = engine:parameters()
  for _, p in ipairs(params) do
    local list = pieces_of(files, "params", p.name)
    if #list == 0 then
      note(("checkpoint: %s/%s: holds no parameter '%s' (the checkpoint's model lacks it)"):format(dir, validation.MANIFEST, p.name))
    else
      local d = find_direct(list, p, 0, numel(p.shape))
      local step = { what = "param", p = p, direct = d, pieces = not d and originals(list) or nil }
      want(d and { d } or step.pieces)
      plan[#plan + 1] = step
    end
  end
  local weights_only
  local has_optim = false
  for _, rec in ipairs(files) do if rec.kind == "optim" then has_optim = true end end
  if not real_optimizer(opt) then
    weights_only = opt == nil and "there is no optimizer" or "the optimizer is not pg.optim.AdamW"
  elseif not has_optim or not manifest.optimizer or manifest.optimizer.type ~= "AdamW" then
    weights_only = "the checkpoint holds no AdamW state"
  else
    local s = opt:shard_state()
    for _, r in ipairs(layout.shard_ranges(s)) do
      for _, p in ipairs(params) do
        local n = numel(p.shape)
        local a, b = math.max(p.offset, r.lo), math.min(p.offset + n, r.hi)
        if a < b then
          local list = pieces_of(files, "optim", p.name)
          if #list == 0 then
            note(("checkpoint: %s/%s: holds no optimizer state for '%s'"):format(dir, validation.MANIFEST, p.name))
          else
            local lo, hi = a - p.offset, b - p.offset
            local d = find_direct(list, p, lo, hi)
            local step = { what = "optim", p = p, lo = lo, hi = hi, at = a - r.lo + r.at, direct = d,
                           pieces = not d and originals(list) or nil }
            want(d and { d } or step.pieces)
            plan[#plan + 1] = step
          end
        end
      end
    end
  end
  check_files(trainer, dir, manifest, need, problem)

  local header_of = header_reader(dir)
  local function full_of(prefix, step) return assemble(dir, step.pieces, prefix, step.p.name, header_of) end
  local s = real_optimizer(opt) and opt:shard_state() or nil
  local resliced = false
  for _, step in ipairs(plan) do
    local p = step.p
    if step.what == "param" then
      if step.direct and p.tensor then
        p.tensor:copy_(read_piece(header_of, step.direct, p.name, 0, numel(p.shape)))
      elseif step.direct then -- zero = 3: this rank keeps the part inside its shard
        engine:local_param(p.name, read_piece(header_of, step.direct, p.name, 0, numel(p.shape)))
      else
        resliced = true
        local full = full_of("", step)
        engine:load_param(p.name, first_rows(full, math.min(full:size(1), p.full_shape[1])))
        full:free() -- full tensors can be large: do not wait for the collector
      end
    else
      local count = step.hi - step.lo
      for _, which in ipairs{ "m", "v" } do
        local dst = s[which]:narrow(1, step.at + 1, count)
        if step.direct then
          dst:copy_(read_piece(header_of, step.direct, which .. "/" .. p.name, step.lo - step.direct.slice.lo, count))
        else
          resliced = true
          local full = full_of(which .. "/", step)
          core.shard_copy(first_rows(full, math.min(full:size(1), p.full_shape[1])), dst,
            { full_shape = p.full_shape, split = norm_split(p.split), lo = step.lo }, "from_full")
          full:free()
        end
      end
    end
  end
  if not weights_only then
    opt:set_step(manifest.optimizer.step)
    opt:set_hparams(manifest.optimizer.hparams)
  end
  return weights_only, resliced
end

M.write_sharded = write_sharded
M.pieces_of = pieces_of
M.originals = originals
M.header_reader = header_reader
M.assemble = assemble
M.first_rows = first_rows
M.check_files = check_files
M.load_sharded = load_sharded

return M
