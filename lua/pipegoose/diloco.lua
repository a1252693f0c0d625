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
-- Streaming (fragments, delay, mixing) and the quantised exchanges (exchange)
-- are described where they are built below; docs/DESIGN.md, "Islands and
-- DiLoCo", has the whole design, checkpoints included.
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
  delay = opt.integer{ min = 0 },        -- inner steps a fragment's exchange overlaps (default: 1 when streaming)
  mixing = opt.number{ min = 0, lt = 1, default = 0.5 }, -- the local share kept when a delayed fragment lands
}

function DiLoCo.new(opts)
  local o = opt.check("pg.DiLoCo", opts, SCHEMA, { required = true })
  if o.outer_every % o.fragments ~= 0 then
    error(("pg.DiLoCo: fragments=%d must divide outer_every=%d (fragment f syncs at steps f * H / F mod H)")
      :format(o.fragments, o.outer_every), 2)
  end
  local delay = o.delay or (o.fragments > 1 and 1 or 0)
  if delay >= o.outer_every then
    error(("pg.DiLoCo: delay=%d must be less than outer_every=%d (a fragment's exchange ends before its next "
      .. "starts)"):format(delay, o.outer_every), 2)
  end
  if o.nesterov and o.outer_momentum == 0 then o.nesterov = false end -- the same update; torch refuses the pair
  return setmetatable({
    islands = o.islands, outer_every = o.outer_every, outer_lr = o.outer_lr, outer_momentum = o.outer_momentum,
    nesterov = o.nesterov, exchange = o.exchange, fragments = o.fragments, delay = delay, mixing = o.mixing,
    outer_steps = 0, -- fragment syncs done (with fragments = 1: outer steps)
  }, DiLoCo)
end

-- The quantised exchanges (exchange = "bf16" | "int8"): each island's pseudo-gradient, coded, goes to the
-- block's owner by an all-to-all over the islands (a reduce-scatter cannot sum codes); the owner decodes the
-- k pieces and averages them in float32 (island order), and the outer update of its block, coded the same way,
-- is all-gathered and added to p_sync on every island. bf16: nearest-even rounding (relative error <= 2^-8);
-- int8: blocks of INT8_BLOCK values with their absmax scale (core.ops.quantize_int8: error <= scale / 2).
-- align: a rank's block of a fragment is a whole number of code blocks; words(len): the codes' elements.
local INT8_BLOCK = 256
local CODECS = {
  bf16 = { align = 2, encode = function(t) return core.ops.to_bf16(t) end,
           decode = function(q) return core.ops.from_bf16(q) end, words = function(len) return len end },
  int8 = { align = INT8_BLOCK, encode = function(t) return core.ops.quantize_int8(t, INT8_BLOCK) end,
           decode = function(q) return core.ops.dequantize_int8(q, INT8_BLOCK) end,
           words = function(len) return len // INT8_BLOCK * (1 + INT8_BLOCK // 4) end },
}
DiLoCo.INT8_BLOCK = INT8_BLOCK

-- The fragments of an engine's flat buffer of n floats: fragment f (1-based here) is the contiguous range
-- [a, b) = [(f - 1) n / F, f n / F) in flat order, cut into k blocks of ceil((b - a) / k) (the last padded);
-- island i owns block i: [lo, hi). offset: the step (mod H) at which it starts its sync.
local function fragments_of(self, engine)
  local ctx = engine.ctx
  local n = engine:flat():numel()
  local k, i = ctx:world_size("islands"), ctx:local_rank("islands")
  local F, H = self.fragments, self.outer_every
  local out = {}
  for f = 1, F do
    local a, b = (f - 1) * n // F, f * n // F
    local align = CODECS[self.exchange] and CODECS[self.exchange].align or 1
    local block = ((b - a + k - 1) // k + align - 1) // align * align
    local lo, hi = math.min(a + i * block, b), math.min(a + (i + 1) * block, b)
    out[f] = { a = a, b = b, block = block, lo = lo, hi = hi, offset = (f - 1) * H // F,
               anchor = core.zeros({ block }), momentum = core.zeros({ block }) }
  end
  return out, n, k
end

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

-- Binds the engine: the fragments' layout, their outer state zero.
local function bind(self, engine)
  self.engine = engine
  self.frags, self.n, self.k = fragments_of(self, engine)
  local f1 = self.frags[1] -- with fragments = 1 the owned block of the whole buffer (outer_state's fields)
  self.lo, self.hi, self.block = f1.lo, f1.hi, f1.block
end

--- Starts (or restarts) the outer state from the engine's parameters: island
-- 0's are broadcast to every island first, so that all start from the same
-- point whatever their initialisation. Collective over the whole world.
function DiLoCo:attach(engine)
  local ctx = engine.ctx
  check(self, engine, 2)
  local params = engine:flat()
  if ctx:world_size("islands") > 1 then
    core.dist.broadcast(params, { ctx = ctx, group = "islands", src = 0 })
  end
  bind(self, engine)
  for _, fr in ipairs(self.frags) do
    if fr.hi > fr.lo then fr.anchor:narrow(1, 1, fr.hi - fr.lo):copy_(params:narrow(1, fr.lo + 1, fr.hi - fr.lo)) end
    -- a quantised exchange sends each island's own pseudo-gradient: it needs the whole fragment's p_sync
    if CODECS[self.exchange] then fr.sync = params:narrow(1, fr.a + 1, fr.b - fr.a):clone() end
  end
end

-- Starts fragment fr's exchange. float32: its parameters, padded to k blocks, reduce-scattered (avg) over the
-- islands without blocking (the request is waited for when it lands, in finish). bf16 / int8: its coded
-- pseudo-gradient all-to-all, blocking, averaged into the owned block now (CODECS above).
local function start(self, fr, step)
  local ctx = self.engine.ctx
  local k = self.k
  local codec = CODECS[self.exchange]
  if codec then -- blocking (pg_comm has no nonblocking all-to-all); with delay > 0 it still lands later
    local len = fr.b - fr.a
    local delta = core.zeros({ k * fr.block })
    delta:narrow(1, 1, len):copy_(fr.sync:sub(self.engine:flat():narrow(1, fr.a + 1, len)))
    local codes = codec.encode(delta)
    local got = k > 1 and core.dist.all_to_all(codes, { ctx = ctx, group = "islands" }) or codes
    local per = codec.words(fr.block)
    local sum = core.zeros({ fr.block })
    for j = 1, k do sum:add_(codec.decode(got:narrow(1, (j - 1) * per + 1, per))) end
    fr.pending = { mean = sum:scale_(1 / k), finish_at = step + self.delay, started = step }
    return
  end
  local buf = core.zeros({ k * fr.block })
  buf:narrow(1, 1, fr.b - fr.a):copy_(self.engine:flat():narrow(1, fr.a + 1, fr.b - fr.a))
  fr.pending = { buf = buf, finish_at = step + self.delay, started = step }
  if k > 1 then
    fr.pending.req = core.dist.ireduce_scatter(buf, { ctx = ctx, group = "islands", op = "avg" })
  end
end

-- The mean of the islands' parameters in this rank's block of fragment fr (its exchange completed).
local function pending_mean(self, fr)
  local p = fr.pending
  if p.req then p.req:wait(); p.req = nil end
  if not p.mean then
    local i = self.engine.ctx:local_rank("islands")
    p.mean = p.buf:narrow(1, i * fr.block + 1, fr.block):clone()
    p.buf = nil
  end
  return p.mean
end

-- Finishes fragment fr's sync (see the top of this file): the outer update of the owned block, the blocks
-- all-gathered, and the fragment's parameters set to them (delay = 0) or merged with the progress made
-- while the exchange was in flight: p = mixing * p + (1 - mixing) * new (Streaming DiLoCo's rule).
local function finish(self, fr)
  local ctx = self.engine.ctx
  local mean = pending_mean(self, fr)
  local delayed = fr.pending.finish_at > fr.pending.started
  fr.pending = nil
  local codec = CODECS[self.exchange]
  local g = codec and mean or fr.anchor:sub(mean) -- a quantised exchange averaged the pseudo-gradients themselves
  local d = g
  local m = self.outer_momentum
  if m > 0 then
    local buf = fr.momentum
    buf:scale_(m):add_(g)
    d = self.nesterov and g:add(buf:scale(m)) or buf
  end
  -- p_sync - lr d written as mean + (g - lr d): the same number (p_sync = mean + g), and exactly the mean when
  -- lr = 1 without momentum (g - d = 0), so that k = 1, H = 1 is plain training to the bit.
  local full
  local len = fr.b - fr.a
  if codec then
    -- the owned block's update, coded and gathered: every island adds the same decoded numbers to p_sync
    local codes = codec.encode(d:scale(-self.outer_lr))
    local all = self.k > 1 and core.dist.all_gather(codes, { ctx = ctx, group = "islands" }) or codes
    fr.sync:add_(codec.decode(all):narrow(1, 1, len))
    full = fr.sync
    fr.anchor:fill_(0)
    if fr.hi > fr.lo then fr.anchor:narrow(1, 1, fr.hi - fr.lo):copy_(fr.sync:narrow(1, fr.lo - fr.a + 1, fr.hi - fr.lo)) end
  else
    local new = mean:add_(g:sub(d:scale(self.outer_lr)))
    fr.anchor:copy_(new)
    full = self.k > 1 and core.dist.all_gather(new, { ctx = ctx, group = "islands" }) or new
  end
  local p = self.engine:flat():narrow(1, fr.a + 1, len)
  if delayed then
    local a = self.mixing
    p:copy_(p:scale(a):add_(full:narrow(1, 1, len):scale(1 - a)))
  else
    p:copy_(full:narrow(1, 1, len))
  end
  self.outer_steps = self.outer_steps + 1
end

--- The outer step of every fragment at once, blocking (delay 0: the islands end with the same parameters).
-- Exchanges in flight finish first. Collective over the whole world.
function DiLoCo:outer_step()
  local engine = self.engine
  if not engine then error("pg.DiLoCo:outer_step: no engine (attach(engine) first, or use it as a callback)", 2) end
  if engine:flat():numel() ~= self.n then error("pg.DiLoCo:outer_step: the engine's flat buffer changed size", 2) end
  for _, fr in ipairs(self.frags) do if fr.pending then finish(self, fr) end end
  for _, fr in ipairs(self.frags) do
    start(self, fr, 0)
    fr.pending.finish_at = 0
    finish(self, fr)
  end
end

--- After optimizer step `step`: the fragments whose exchange lands now finish, then those due start (and
-- finish at once with delay 0). Collective over the whole world.
function DiLoCo:after_step(step)
  local H = self.outer_every
  for _, fr in ipairs(self.frags) do
    if fr.pending and fr.pending.finish_at <= step then finish(self, fr) end
  end
  for _, fr in ipairs(self.frags) do
    if step % H == fr.offset then
      start(self, fr, step)
      if self.delay == 0 then finish(self, fr) end
    end
  end
end

--- The pieces this rank holds (views): { lo, hi (0-based flat range of the owned block), anchor, momentum,
-- outer_steps } of the first fragment, and fragments = that record for every fragment (a, b: its flat range).
function DiLoCo:outer_state()
  local list = {}
  for f, fr in ipairs(self.frags or {}) do
    list[f] = { a = fr.a, b = fr.b, lo = fr.lo, hi = fr.hi, anchor = fr.anchor, momentum = fr.momentum,
                offset = fr.offset, pending = fr.pending ~= nil }
  end
  local f1 = list[1] or {}
  return { lo = f1.lo, hi = f1.hi, anchor = f1.anchor, momentum = f1.momentum, outer_steps = self.outer_steps,
           fragments = list }
end

-- Callback hooks ------------------------------------------------------------

function DiLoCo:on_train_start(trainer)
  if self.engine ~= trainer.engine then self:attach(trainer.engine) end
end

-- Right after the inner optimizer's step (state.step counts it).
function DiLoCo:on_before_zero_grad(trainer)
  self:after_step(trainer.state.step)
end

-- A run that ends with the islands apart (between syncs, or a fragment's exchange in flight) ends with one more
-- blocking sync of every fragment, so that every island holds the same model; a run stopped early
-- (should_stop, max_time: preempted, to be resumed) keeps the islands apart, so that its checkpoint resumes
-- into exactly the uninterrupted run.
function DiLoCo:on_train_end(trainer)
  local why = trainer.state.stop_reason
  if why == "should_stop" or why == "max_time" then return end
  local step = trainer.state.step
  local apart = false
  for _, fr in ipairs(self.frags) do
    if fr.pending or step % self.outer_every ~= fr.offset then
      apart = true
    end
  end
  if apart then self:outer_step() end
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
  local pending = {}
  for f, fr in ipairs(self.frags or {}) do
    if fr.pending then pending[#pending + 1] = { fragment = f, started = fr.pending.started,
                                                 finish_at = fr.pending.finish_at } end
  end
  return { outer_steps = self.outer_steps, islands = ctx and ctx:world_size("islands") or 1, numel = self.n,
           outer_every = self.outer_every, fragments = self.fragments, exchange = self.exchange, pending = pending }
end

-- The scalars; the tensors follow in load_checkpoint_files (the checkpoint code calls it next).
function DiLoCo:load_state_dict(sd)
  if type(sd) ~= "table" or math.type(sd.outer_steps) ~= "integer" or sd.outer_steps < 0 then
    error("pg.DiLoCo: the checkpoint's DiLoCo state has no outer step count (outer_steps)", 0)
  end
  self._loaded = sd
end

-- The whole of a per-fragment owned-block buffer (each fragment's blocks gathered and cut to its length),
-- [n] in flat order. get(fr) is the fragment's block.
local function whole(self, get)
  local ctx = self.engine.ctx
  local out = core.zeros({ self.n })
  for _, fr in ipairs(self.frags) do
    local t = get(fr)
    local all = self.k > 1 and core.dist.all_gather(t, { ctx = ctx, group = "islands" }) or t
    if fr.b > fr.a then out:narrow(1, fr.a + 1, fr.b - fr.a):copy_(all:narrow(1, 1, fr.b - fr.a)) end
  end
  return out
end

-- Exchanges in flight are completed (their means kept for when they land: the numbers do not change) and
-- saved as pending/<f> (the fragment's whole mean), so that a resume lands them at the same step.
function DiLoCo:save_checkpoint_files(trainer, dir)
  if not self.engine then return {} end -- saved before the first fit attached: nothing outer yet
  local safetensors = require "pipegoose.safetensors"
  local json = require "pipegoose.checkpoint.json"
  local ctx = self.engine.ctx
  local entries = { { name = "anchor", tensor = whole(self, function(fr) return fr.anchor end) },
                    { name = "momentum", tensor = whole(self, function(fr) return fr.momentum end) } }
  for f, fr in ipairs(self.frags) do
    if fr.pending then
      local mean = pending_mean(self, fr)
      local all = self.k > 1 and core.dist.all_gather(mean, { ctx = ctx, group = "islands" }) or mean
      entries[#entries + 1] = { name = "pending/" .. f, tensor = all:narrow(1, 1, fr.b - fr.a) }
    end
  end
  local file = outer_file(ctx)
  if not writes_outer(ctx) then return {} end
  local meta = { format = "pipegoose-diloco-outer", outer_steps = self.outer_steps, step = trainer.state.step,
                 islands = ctx:world_size("islands"), numel = self.n, fragments = self.fragments }
  local crc, bytes = safetensors.write(dir .. "/" .. file, entries, { pipegoose = json.encode(meta, file) })
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
  local pending = loaded and loaded.pending or {}
  if not loaded then
    problem = ("pg.DiLoCo: %s has outer state files but no DiLoCo state in its manifest"):format(dir)
  elseif not rec then
    problem = ("pg.DiLoCo: %s has no %s (the outer state of this rank's place in the island: the checkpoint was "
      .. "saved with another layout inside an island)"):format(dir, file)
  elseif #pending > 0 and (loaded.exchange or "float32") ~= self.exchange then
    problem = ("pg.DiLoCo: %s was saved with exchange='%s' and an exchange in flight; it resumes with "
      .. "exchange='%s' only when saved with none in flight"):format(dir, tostring(loaded.exchange), self.exchange)
  elseif #pending > 0 and loaded.fragments ~= self.fragments then
    problem = ("pg.DiLoCo: %s was saved with fragments=%s and %d exchange(s) in flight; it resumes with "
      .. "fragments=%s only when saved with none in flight"):format(dir, tostring(loaded.fragments), #pending,
      tostring(self.fragments))
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
  bind(self, engine)
  for f, fr in ipairs(self.frags) do
    local len = fr.hi - fr.lo
    if len > 0 then
      fr.anchor:narrow(1, 1, len):copy_(safetensors.read(header, "anchor", fr.lo, len))
      fr.momentum:narrow(1, 1, len):copy_(safetensors.read(header, "momentum", fr.lo, len))
    end
    if CODECS[self.exchange] then fr.sync = safetensors.read(header, "anchor", fr.a, fr.b - fr.a) end
    for _, p in ipairs(pending) do
      if p.fragment == f then
        local mean = core.zeros({ fr.block })
        if len > 0 then mean:narrow(1, 1, len):copy_(safetensors.read(header, "pending/" .. f, fr.lo - fr.a, len)) end
        fr.pending = { mean = mean, started = p.started, finish_at = p.finish_at }
      end
    end
  end
  self.outer_steps = loaded.outer_steps
end

return DiLoCo
