--- pg.DiLoCo{...}: training across islands that talk every H steps (DiLoCo,
-- Douillard et al. 2023, arXiv 2311.08105), as a Trainer callback.
--
-- The context carves the world into islands (pg.ParallelContext{islands = k,
-- ...}); each island trains alone with the inner optimizer (its own
-- Trainer, engine and AdamW: the context's groups are the island's). Every
-- `outer_every` optimizer steps the callback runs the outer step over the
-- "islands" group (the k ranks at the same place in their islands, which
-- hold the same shard of the same parameters):
--   g      = p_sync - mean over islands of p          (the pseudo-gradient)
--   buf    = momentum * buf + g                        (torch.optim.SGD's buffer, zero at the start)
--   d      = g + momentum * buf   (nesterov)  or  buf  (not)
--   p      = p_sync - lr * d,  then p_sync = p on every island
-- The inner optimizer's state is kept (as the paper). The outer state (p_sync
-- and buf) is sharded like ZeRO-1 over the islands group: of its rank's flat
-- parameter buffer each of the k ranks owns block i of k; the parameters are
-- reduce-scattered (avg) into the owned block, the block updated, and the
-- blocks all-gathered into every island's buffer. Because p_sync is the same
-- on every island, the mean of the pseudo-gradients is p_sync minus the mean
-- of the parameters, so only the owned block of p_sync is ever needed.
local core = require "pipegoose.core"
local callbacks = require "pipegoose.callbacks"
local opt = require "pipegoose.options"

local DiLoCo = callbacks.class("DiLoCo")

local SCHEMA = {
  islands = opt.integer{ min = 1 },  -- checked against the context's islands
  outer_every = opt.integer{ min = 1, required = true },
  outer_lr = opt.number{ gt = 0, default = 0.7 },
  outer_momentum = opt.number{ min = 0, lt = 1, default = 0.9 },
  nesterov = opt.boolean{ default = true },
  exchange = opt.enum({ "float32", "bf16", "int8" }, { default = "float32" }),
  fragments = opt.integer{ min = 1, default = 1 },
}

function DiLoCo.new(opts)
  local o = opt.check("pg.DiLoCo", opts, SCHEMA, { required = true })
  if o.fragments > 1 then
    error(("pg.DiLoCo: fragments=%d (streaming DiLoCo) is not built yet; fragments = 1 syncs every parameter at "
      .. "once"):format(o.fragments), 2)
  end
  if o.exchange ~= "float32" then
    error(("pg.DiLoCo: exchange='%s' (a quantised exchange) is not built yet; 'float32' is"):format(o.exchange), 2)
  end
  if o.nesterov and o.outer_momentum == 0 then o.nesterov = false end -- the same update; torch refuses the pair
  return setmetatable({
    islands = o.islands, outer_every = o.outer_every, outer_lr = o.outer_lr, outer_momentum = o.outer_momentum,
    nesterov = o.nesterov, exchange = o.exchange, fragments = o.fragments,
    outer_steps = 0, -- outer steps done
  }, DiLoCo)
end

-- The flat parameter buffer of the engine and this rank's block of it (0-based [lo, hi), padded to k equal blocks).
local function layout(engine)
  local ctx = engine.ctx
  local params = engine:flat()
  local n = params:numel()
  local k, i = ctx:world_size("islands"), ctx:local_rank("islands")
  local block = (n + k - 1) // k
  return params, n, k, i, block
end

--- Starts (or restarts) the outer state from the engine's parameters: island
-- 0's are broadcast to every island first, so that all start from the same
-- point whatever their initialisation. Collective over the whole world.
-- What the outer step needs of an engine (level: error()'s, from check's caller).
local function check(self, engine, level)
  local ctx = engine.ctx
  if engine:stats().device ~= "cpu" then
    error("pg.DiLoCo: the outer step runs on host engines only (this engine is on " .. engine:stats().device .. ")",
      level + 1)
  end
  if self.islands and self.islands ~= ctx:world_size("islands") then
    error(("pg.DiLoCo: islands=%d, but the context has %d (pg.ParallelContext{islands = ...})"):format(
      self.islands, ctx:world_size("islands")), level + 1)
  end
end

function DiLoCo:attach(engine)
  local ctx = engine.ctx
  check(self, engine, 2)
  self.engine = engine
  local params, n, k, i, block = layout(engine)
  if k > 1 then
    core.dist.broadcast(params, { ctx = ctx, group = "islands", src = 0 })
  end
  local lo, hi = i * block, math.min((i + 1) * block, n)
  self.anchor = core.zeros({ block })       -- p_sync's owned block (zeros past the end of the buffer)
  if hi > lo then self.anchor:narrow(1, 1, hi - lo):copy_(params:narrow(1, lo + 1, hi - lo)) end
  self.momentum = core.zeros({ block })     -- the outer momentum buffer's owned block
  self.lo, self.hi, self.block, self.n = lo, hi, block, n
end

--- The outer step (see the top of this file). Collective over the whole world.
function DiLoCo:outer_step()
  local engine = self.engine
  if not engine then error("pg.DiLoCo:outer_step: no engine (attach(engine) first, or use it as a callback)", 2) end
  local ctx = engine.ctx
  local params, n, k = layout(engine)
  if n ~= self.n then error("pg.DiLoCo:outer_step: the engine's flat buffer changed size", 2) end
  local block = self.block
  local all = params
  if k * block ~= n then
    all = core.zeros({ k * block })
    all:narrow(1, 1, n):copy_(params)
  end
  local mean = core.dist.reduce_scatter(all, { ctx = ctx, group = "islands", op = "avg" })
  local g = self.anchor:sub(mean)
  local d = g
  local m = self.outer_momentum
  if m > 0 then
    local buf = self.momentum
    buf:scale_(m):add_(g)
    d = self.nesterov and g:add(buf:scale(m)) or buf
  end
  -- p_sync - lr d written as mean + (g - lr d): the same number (p_sync = mean + g), and exactly the mean when
  -- lr = 1 without momentum (g - d = 0), so that k = 1, H = 1 is plain training to the bit.
  local new = mean:add_(g:sub(d:scale(self.outer_lr)))
  self.anchor:copy_(new)
  local full = k > 1 and core.dist.all_gather(new, { ctx = ctx, group = "islands" }) or new
  params:copy_(full:narrow(1, 1, n))
  self.outer_steps = self.outer_steps + 1
end

--- The pieces this rank holds (views): { lo, hi (0-based flat range of the owned block), anchor, momentum }.
function DiLoCo:outer_state()
  return { lo = self.lo, hi = self.hi, anchor = self.anchor, momentum = self.momentum, outer_steps = self.outer_steps }
end

-- Callback hooks ------------------------------------------------------------

function DiLoCo:on_train_start(trainer)
  if self.engine ~= trainer.engine then self:attach(trainer.engine) end
end

-- Right after the inner optimizer's step (state.step counts it): every outer_every-th step syncs.
function DiLoCo:on_before_zero_grad(trainer)
  if trainer.state.step % self.outer_every == 0 then self:outer_step() end
end

-- A run that ends between syncs ends with one more, so that every island holds the same model; a run
-- stopped early (should_stop, max_time: preempted, to be resumed) keeps the islands apart, so that its
-- checkpoint resumes into exactly the uninterrupted run.
function DiLoCo:on_train_end(trainer)
  local why = trainer.state.stop_reason
  if why == "should_stop" or why == "max_time" then return end
  if trainer.state.step % self.outer_every ~= 0 then self:outer_step() end
end

-- Each island validates on its share of the validation data (islands split batches as data ranks do): the
-- metrics become the islands' mean, the whole validation set's when the islands have just synced.
function DiLoCo:on_validation_end(trainer)
  local ctx = trainer.engine.ctx
  if ctx:world_size("islands") == 1 then return end
  local names = {}
  for name, v in pairs(trainer.state.metrics) do
    if type(v) == "number" and name:match("^val_") then names[#names + 1] = name end
  end
  table.sort(names)
  if #names == 0 then return end
  local t = core.zeros({ #names }) -- float32 (pg.dist's reductions): the mean to ~1e-7 relative
  for i, name in ipairs(names) do t:set(i, trainer.state.metrics[name]) end
  core.dist.all_reduce(t, { ctx = ctx, group = "islands", op = "avg" })
  for i, name in ipairs(names) do trainer.state.metrics[name] = t:get(i) end
end

-- Checkpoints ---------------------------------------------------------------
--
-- The scalars go into the manifest (state_dict); the outer tensors into
-- outer-tp{t}-pp{p}.safetensors beside the engine's files, one per
-- (tensor, pipeline) rank of the island (its flat buffer's; -dp{d} per data
-- rank when experts are spread over the data ranks), holding the WHOLE p_sync and
-- momentum buffer ("anchor", "momentum", each [n] float32): the owned blocks
-- are all-gathered over the islands group at the save (two flat buffers'
-- worth, counted in comm_stats). Each island's checkpoint is therefore
-- complete on its own, and one saved at k islands loads at any k' (same
-- layout inside an island): the outer state is one per-parameter tensor in
-- meaning, and each rank cuts its block i of k' out of it, as ZeRO-1's
-- optimizer state reshards over data ranks. Which island's checkpoint a new
-- island loads (its inner state) is the caller's choice; train_gpt.lua takes
-- old island i mod k for new island i.

-- The data ranks of an island hold the same flat buffer (one file, by data rank 0, read by every data rank
-- whatever their number) unless experts are spread over them (then one file per data rank).
local function outer_file(ctx)
  local t, p = ctx:local_rank("tensor"), ctx:local_rank("pipeline")
  if ctx:world_size("expert") > 1 then return ("outer-tp%d-pp%d-dp%d.safetensors"):format(t, p, ctx:local_rank("data")) end
  return ("outer-tp%d-pp%d.safetensors"):format(t, p)
end

-- Whether this rank writes its outer file.
local function writes_outer(ctx) return ctx:world_size("expert") > 1 or ctx:local_rank("data") == 0 end

function DiLoCo:state_dict()
  local ctx = self.engine and self.engine.ctx
  return { outer_steps = self.outer_steps, islands = ctx and ctx:world_size("islands") or 1, numel = self.n,
           outer_every = self.outer_every }
end

-- The scalars; the tensors follow in load_checkpoint_files (the checkpoint code calls it next).
function DiLoCo:load_state_dict(sd)
  if type(sd) ~= "table" or math.type(sd.outer_steps) ~= "integer" or sd.outer_steps < 0 then
    error("pg.DiLoCo: the checkpoint's DiLoCo state has no outer step count (outer_steps)", 0)
  end
  self._loaded = sd
end

-- The whole of an owned-block buffer (padded blocks gathered, cut to n).
local function whole(self, t)
  local ctx = self.engine.ctx
  if ctx:world_size("islands") == 1 then return t:narrow(1, 1, self.n) end
  return core.dist.all_gather(t, { ctx = ctx, group = "islands" }):narrow(1, 1, self.n)
end

function DiLoCo:save_checkpoint_files(trainer, dir)
  if not self.engine then return {} end -- saved before the first fit attached: nothing outer yet
  local safetensors = require "pipegoose.safetensors"
  local json = require "pipegoose.checkpoint.json"
  local anchor, momentum = whole(self, self.anchor), whole(self, self.momentum)
  local file = outer_file(self.engine.ctx)
  if not writes_outer(self.engine.ctx) then return {} end
  local meta = { format = "pipegoose-diloco-outer", outer_steps = self.outer_steps, step = trainer.state.step,
                 islands = self.engine.ctx:world_size("islands"), numel = self.n }
  local crc, bytes = safetensors.write(dir .. "/" .. file, { { name = "anchor", tensor = anchor },
    { name = "momentum", tensor = momentum } }, { pipegoose = json.encode(meta, file) })
  return { { file = file, bytes = bytes, crc32 = crc } }
end

-- Binds the engine and takes this rank's blocks of the saved whole buffers (see above). Every rank of the
-- island checks its file first and they agree on any problem, so all raise the same error.
function DiLoCo:load_checkpoint_files(trainer, dir, records)
  local loaded = self._loaded
  self._loaded = nil
  local validation = require "pipegoose.checkpoint.manifest"
  local ranks = require "pipegoose.checkpoint.ranks"
  local safetensors = require "pipegoose.safetensors"
  local engine = trainer.engine
  local ctx = engine.ctx
  check(self, engine, 0)
  if #records == 0 then
    -- a checkpoint of plain training (or of k = 1 before DiLoCo): the islands start from it (attach)
    ranks.agree_error(trainer, loaded and ("pg.DiLoCo: %s holds DiLoCo's state (%d outer steps) but no outer "
      .. "state files (outer-*.safetensors)"):format(dir, loaded.outer_steps) or nil)
    return
  end
  local file, problem, header = outer_file(ctx), nil, nil
  local rec
  for _, r in ipairs(records) do if r.file == file then rec = r end end
  local n = engine:flat():numel()
  if not loaded then
    problem = ("pg.DiLoCo: %s has outer state files but no DiLoCo state in its manifest"):format(dir)
  elseif not rec then
    problem = ("pg.DiLoCo: %s has no %s (the outer state of this rank's place in the island: the checkpoint was "
      .. "saved with another layout inside an island)"):format(dir, file)
  else
    problem = validation.check_file(dir, rec)
    if not problem then
      local ok, h = pcall(safetensors.read_header, dir .. "/" .. file)
      if not ok then problem = "pg.DiLoCo: " .. tostring(h) else header = h end
    end
    if not problem then
      for _, name in ipairs{ "anchor", "momentum" } do
        local e = header.entries[name]
        if not e or e.dtype ~= "float32" or e.numel ~= n then
          problem = ("pg.DiLoCo: %s/%s: '%s' should be %d float32 values (this rank's flat parameter buffer), "
            .. "found %s"):format(dir, file, name, n, e and (e.numel .. " " .. e.dtype) or "none")
          break
        end
      end
    end
  end
  ranks.agree_error(trainer, problem)
  self.engine = engine
  local _, _, _, i, block = layout(engine)
  local lo, hi = i * block, math.min((i + 1) * block, n)
  self.anchor, self.momentum = core.zeros({ block }), core.zeros({ block })
  if hi > lo then
    self.anchor:narrow(1, 1, hi - lo):copy_(safetensors.read(header, "anchor", lo, hi - lo))
    self.momentum:narrow(1, 1, hi - lo):copy_(safetensors.read(header, "momentum", lo, hi - lo))
  end
  self.lo, self.hi, self.block, self.n = lo, hi, block, n
  self.outer_steps = loaded.outer_steps
end

return DiLoCo
