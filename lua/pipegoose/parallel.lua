--- pg.parallelize(model, ctx, opts) -> engine.
-- Cuts the model's top-level sequence into pipeline stages, describes this
-- rank's stage (sharded for tensor parallelism) and builds it in C. The
-- engine object here is a thin Lua face over the C engine. With
-- virtual_stages = V > 1 the sequence is cut into P x V chunks, rank r holding
-- chunks r, r + P, ... (round-robin), run by the interleaved 1F1B schedule.
--
-- Collective methods (every rank of the context calls them, in the same
-- order): pg.parallelize itself, forward_backward, loss, forward,
-- sync_grads, gather_to_root, save_llmc, save_hf. Every other method is
-- local to the rank and may be called on one rank alone: zero_grad,
-- parameters, grads, parameter, num_parameters (counted when the engine is
-- built), memory, partition, stats, reset_stats, schedule_actions and
-- load_weights (each rank reads the file itself). A rank that skips a
-- collective leaves the others waiting: they end the job after
-- PG_COLLECTIVE_TIMEOUT seconds, naming it.
local core = require "pipegoose.core"
local nn = require "pipegoose.nn"
local opt = require "pipegoose.options"

local M = {}

local Engine = {}
Engine.__index = Engine

---------------------------------------------------------------- partitioning

--- Contiguous cut of `costs` into P stages minimising the most expensive
-- stage (dynamic programming over cut points). Returns stage sizes.
function M.balance(costs, P)
  local n = #costs
  local prefix = { [0] = 0 }
  for i = 1, n do prefix[i] = prefix[i - 1] + costs[i] end
  -- best[p][i]: smallest max-stage cost splitting the first i modules into p stages
  local best, cut = {}, {}
  for p = 1, P do
    best[p], cut[p] = {}, {}
    for i = p, n - (P - p) do
      if p == 1 then
        best[1][i], cut[1][i] = prefix[i], 0
      else
        local b, c = math.huge, nil
        for j = p - 1, i - 1 do
          local v = math.max(best[p - 1][j], prefix[i] - prefix[j])
          if v < b then b, c = v, j end
        end
        best[p][i], cut[p][i] = b, c
      end
    end
  end
  local sizes, i = {}, n
  for p = P, 1, -1 do
    local j = cut[p][i]
    sizes[p] = i - j
    i = j
  end
  return sizes
end

-- Cuts the model into P pieces (the pipeline's stages; with virtual stages,
-- P = pipeline x virtual_stages chunks), named `what` in errors.
local function partition(top, P, seq_len, stages, what)
  if P > #top then
    error(("%s is larger than the model's %d top-level modules"):format(what, #top), 0)
  end
  local sizes
  if stages then
    if #stages ~= P then error(("stages lists %d stages, but %s"):format(#stages, what), 0) end
    local total = 0
    for _, s in ipairs(stages) do total = total + s end -- positive integers (parallelize's options)
    if total ~= #top then error(("stages cover %d modules, but the model has %d top-level modules"):format(total, #top), 0) end
    sizes = stages
  else
    local costs = {}
    for i, m in ipairs(top) do costs[i] = 3 * m:flops(seq_len) + 1 end -- forward + backward; +1 keeps every module weighed
    sizes = M.balance(costs, P)
  end
  local ranges, first = {}, 1
  for p = 1, P do
    ranges[p] = { first, first + sizes[p] - 1 }
    first = first + sizes[p]
  end
  return ranges
end

---------------------------------------------------------------- parallelize

-- The runtime's schedules (core.schedules(): src/engine/pg_schedule.c): the
-- names offered with one chunk per rank, the default, and what each runs as
-- with more chunks.
local SCHEDULES = core.schedules()

local PARALLELIZE = {
  micro_batches = opt.integer{ min = 1, default = 1 },
  schedule = opt.enum(SCHEDULES.offered, { default = SCHEDULES.default }),
  -- model chunks per pipeline rank: more than 1 runs the interleaved 1F1B
  -- schedule (Narayanan et al. 2021) with schedule = "1f1b" (SCHEDULES.chunked)
  virtual_stages = opt.integer{ min = 1, default = 1 },
  stages = opt.list(opt.integer{ min = 1 }),
  bucket_mb = opt.number{ gt = 0, max = 1 << 20, default = 25 }, -- up to 1 TiB: the element count fits an int64
  -- reduce the data group's gradient buckets while the last micro-batch's backward runs (Megatron's name); it
  -- applies over MPI with host memory (not to shared buffers nor the device backend: engine:stats() says)
  overlap_grad_reduce = opt.boolean{ default = true },
  -- 3: ZeRO-3 from construction: only this rank's shards of the parameters and gradients are ever allocated
  -- (the optimizer then takes zero = 3, its default here); without it AdamW{zero = 3} shards a whole engine
  zero = opt.check_with("3 (ZeRO-3 from construction; stages 1 and 2 are pg.optim.AdamW's zero)",
    function(v) return v == 3 end),
  seed = opt.integer{ min = math.mininteger, max = math.maxinteger },
  -- data-parallel replicas on one node share their flat buffers unless told not to
  shared_memory = opt.boolean{ default = true },
  device = opt.string, -- "cpu" (default), "cuda" (the node's device of this rank), "cuda:N": parsed by the runtime
  -- the loss of a model that does not end with one (an LMHead with output = "logits", a head of your own)
  objective = opt.func,
  -- activation recomputation: "full" recomputes each block (a top-level
  -- composite: TransformerBlock, LlamaBlock) from its input in backward,
  -- "selective" only the attention probabilities (Korthikanti et al. 2022)
  recompute = opt.enum({ "none", "full", "selective" }, { default = "none" }),
  -- "bf16": torch.autocast's types: linear layers, the LM head and MoE multiply bf16 operands (a bf16 working
  -- copy of the float32 master weights) with float32 sums, and a Linear's output stays bf16 through GELU,
  -- SwiGLU and attention; norms, the residual stream, the loss, the gradients and the optimizer stay float32
  -- (the runtime's pg_module_set_precision is the one place the rule lives)
  precision = opt.enum({ "fp32", "bf16" }, { default = "fp32" }),
  -- sequence parallelism (Korthikanti et al. 2022): with tensor > 1, the
  -- norms, residual adds and stage boundaries hold 1/tensor of each
  -- micro-batch's rows; all-gathers and reduce-scatters replace the tensor
  -- group's all-reduces. With tensor = 1 it changes nothing (as Megatron-LM).
  sequence_parallel = opt.boolean{ default = false },
}

-- The runtime's traits of each kind (core.module_kinds(): src/nn/module_registry.c);
-- the tree walks below ask them rather than a kind's name.
local KINDS = core.module_kinds()
local function has(d, trait)
  local k = KINDS[d.kind]
  return k ~= nil and k[trait] == true
end

-- The stage description with recomputation applied: every attention core
-- keeps one micro-batch's probabilities ("selective"), or every top-level
-- composite is wrapped to recompute its activations ("full").
local function with_recompute(stage_desc, how)
  if how == "none" then return stage_desc end
  if how == "full" then
    for i, d in ipairs(stage_desc.children) do
      -- (not the sequence-parallel transitions around a module: sp_wrap)
      if (KINDS[d.kind] or {}).assembly == "list" and not d.sp_wrap then
        -- its output is this rank's rows under sequence parallelism (parallelize marks it)
        stage_desc.children[i] = { kind = "recompute", name = d.name, inner = d, sequence_parallel = d.sp_rows_out }
      end
    end
    return stage_desc
  end
  local function mark(d)
    if has(d, "selective") then d.recompute = true end
    for _, c in ipairs(d.children or {}) do mark(c) end
    if d.inner then mark(d.inner) end
  end
  mark(stage_desc)
  return stage_desc
end

function M.parallelize(model, ctx, opts)
  opts = opt.check("parallelize", opts, PARALLELIZE)
  if not nn.is_spec(model) then
    error(("parallelize: the model must be a pg.nn module, got %s"):format(opt.show(model)), 2)
  end
  ctx = opt.value("parallelize", "ctx", ctx, opt.context) or core.ParallelContext{}
  local sizes = ctx:sizes()
  local T, P = sizes.tensor, sizes.pipeline
  local sp = opts.sequence_parallel and T > 1
  local schedule, micro, V = opts.schedule, opts.micro_batches, opts.virtual_stages
  if V > 1 then
    -- one chunk per rank would hand activations to itself: nothing to interleave
    if P == 1 then error(("parallelize: virtual_stages = %d needs pipeline > 1"):format(V), 2) end
    local chunked = SCHEDULES.chunked[schedule]
    if not chunked then
      error(("parallelize: virtual_stages = %d runs the interleaved 1F1B schedule; schedule = \"%s\" has one chunk "
        .. "per stage"):format(V, schedule), 2)
    end
    schedule = chunked
  end
  local config = model.config or {}
  local top = model:top_level()
  local seq_len = config.seq_len or 1
  local what = V > 1 and ("pipeline x virtual_stages = %d x %d"):format(P, V) or ("pipeline=%d"):format(P)
  local ok, ranges = pcall(partition, top, P * V, seq_len, opts.stages, what)
  if not ok then error("parallelize: " .. ranges, 2) end

  -- Describe every piece (this checks widths for the whole model on every
  -- rank, so a bad model fails everywhere alike), keep this rank's: piece p
  -- (1-based) sits where core.schedule_place says (round-robin over the ranks).
  local me = ctx:local_rank("pipeline")
  local flow = { width = 0, split = false }
  local chunk_descs, width, tie, head_tied, logits_head = {}, nil, nil, nil, nil
  local partition_report = {}
  local lua_modules = {}
  -- One Lua table per position: the runtime hands each position its own
  -- parameters through the table (m.params), so a table used twice would
  -- compute both positions with the second one's.
  local lua_paths = {}
  local function check_lua_tables(d)
    if has(d, "written_in_lua") then
      if lua_paths[d.module] then
        error(("parallelize: one Lua module table is used at '%s' and at '%s'; give each position its own table")
          :format(lua_paths[d.module], d.name), 3)
      end
      lua_paths[d.module] = d.name
    end
    for _, c in ipairs(d.children or {}) do check_lua_tables(c) end
    if d.inner then check_lua_tables(d.inner) end
  end
  -- Mixture-of-experts layers, every stage's, in model order: the load-balancing
  -- loss is one function of them all, so each learns its number and the count
  local moe_layers = {}
  local function find_moe(d)
    if has(d, "router") then moe_layers[#moe_layers + 1] = d end
    for _, c in ipairs(d.children or {}) do find_moe(c) end
    if d.inner then find_moe(d.inner) end
  end
  for p = 1, P * V do
    local kids, names, nparams = {}, {}, 0
    local rank, chunk = core.schedule_place(p, P) -- chunk 1-based
    for i = ranges[p][1], ranges[p][2] do
      local m = top[i]
      -- an unnamed top-level module is named by its position, as in a Sequential
      local path = (m.name == nil and not m.transparent) and tostring(i) or ""
      local ok2, d, out = pcall(m.describe, m, path, flow, T, sp)
      if not ok2 then error("parallelize: " .. tostring(d), 2) end
      if out.seq then d.sp_rows_out = true end -- its output is this rank's rows (with_recompute's wrapper too)
      kids[#kids + 1], flow = d, out
      check_lua_tables(d)
      find_moe(d)
      names[#names + 1] = d.name ~= "" and d.name or (m.label or m.kind)
      nparams = nparams + m:num_params()
      if has(d, "head") and d.tie then tie, head_tied = d.tie, true end
      if has(d, "head") then logits_head = d.output == "logits" and d or nil end
    end
    partition_report[p] = { modules = names, params = nparams, first = ranges[p][1], last = ranges[p][2],
                            stage = rank, chunk = chunk }
    local want = p < P * V
    if sp and not flow.split and flow.width > 0 and (flow.seq or false) ~= want then
      -- sequence parallelism: the pieces hand over this rank's rows; an
      -- objective takes every row (the gradient it returns is the same on every rank)
      kids[#kids + 1] = { kind = want and "sp_scatter" or "sp_gather", name = "", width = flow.width }
      flow = { width = flow.width, split = false, seq = want }
    end
    if p < P * V then
      if flow.width <= 0 or flow.split then
        local piece = V > 1 and ("stage %d chunk %d"):format(rank, chunk) or ("stage %d"):format(rank)
        error(("parallelize: %s ends with %s; a pipeline stage must hand over full activations"):format(
          piece, flow.width < 0 and "the loss" or "a split tensor"), 2)
      end
      width = width or flow.width
      if flow.width ~= width then error("parallelize: stages hand over different widths", 2) end
    end
    if rank == me then chunk_descs[chunk] = { kind = "sequential", name = "", children = kids } end
  end
  -- The model ends with its loss (an LMHead), or with an output an objective
  -- written in Lua turns into the loss (the engine's last stage then ends in
  -- an objective module that calls it).
  local with_objective = flow.width ~= -1
  if with_objective and flow.width <= 0 then
    error("parallelize: the model must end with an LMHead (it computes the loss) or with an output for an objective", 2)
  end
  if not with_objective and opts.objective then
    error("parallelize: the model computes its own loss (its LMHead has output = \"loss\"); objective= needs a model "
      .. "that ends with an output (LMHead{output = \"logits\"}, GPT{head = \"logits\" | \"none\"})", 2)
  end
  if with_objective and flow.split and not logits_head then
    error("parallelize: the model ends with a tensor split over the tensor group; an objective takes the full output "
      .. "(gather_output on the last Linear) or an LMHead's logits", 2)
  end
  width = width or (config.dim or 0)
  local vocab = config.vocab
  for _, m in ipairs(top) do if has(m, "head") then vocab = vocab or m.vocab end end

  -- Collect the Lua modules of this stage to hand them their parameter views.
  local function find_lua(d)
    if has(d, "written_in_lua") then lua_modules[#lua_modules + 1] = d end
    for _, c in ipairs(d.children or {}) do find_lua(c) end
    if d.inner then find_lua(d.inner) end
  end
  for v, d in ipairs(chunk_descs) do
    find_lua(d)
    chunk_descs[v] = with_recompute(d, opts.recompute)
  end

  if V > 1 and #moe_layers > 0 then
    -- their routing totals would cross the wrap-around links too; not checked yet
    error("parallelize: virtual_stages > 1 with mixture-of-experts layers is not supported yet", 2)
  end
  local router_experts = 0
  for i, d in ipairs(moe_layers) do
    d.layer, d.layers = i - 1, #moe_layers
    if router_experts > 0 and d.experts ~= router_experts then
      error(("parallelize: MoE layers with different expert counts (%d at '%s', %d before): the load-balancing loss "
        .. "takes one count"):format(d.experts, d.name, router_experts), 2)
    end
    router_experts = d.experts
  end

  -- through pcall: an error of the runtime (a bad device, no memory) names the user's line, not this one
  local ok_engine, c = pcall(core.Engine, ctx, chunk_descs, {
    micro_batches = micro, schedule = schedule, vocab = vocab, width = width, seed = opts.seed or ctx:seed(),
    tied_name = (P > 1 and head_tied) and tie or nil,
    bucket_mb = opts.bucket_mb, overlap_grad_reduce = opts.overlap_grad_reduce, shared_memory = opts.shared_memory,
    device = opts.device, objective = with_objective, router_experts = router_experts, precision = opts.precision,
    sequence_parallel = sp, zero = opts.zero,
  })
  if not ok_engine then error(c, 2) end
  local e = setmetatable({
    c = c, ctx = ctx, config = config, model = model, micro_batches = micro, schedule = schedule,
    tokenizer = model.tokenizer, -- the model's tokenizer (pg.nn.from_hf's), or nil; save_hf writes it
    virtual_stages = V, recompute = opts.recompute, precision = opts.precision, sequence_parallel = sp, zero = opts.zero,
    device = c:info().device,
    stage = me, stages = P, partition_report = partition_report, vocab = vocab, _ = {},
  }, Engine)
  if with_objective then
    e._.objective = opts.objective
    -- what an objective needs to read the output: the context (its tensor group) and,
    -- for an LMHead's logits, which vocabulary columns this rank holds
    e.objective_info = { ctx = ctx, width = flow.width }
    if logits_head then
      local per = logits_head.padded_vocab // T
      e.objective_info.vocab = { size = logits_head.vocab, padded = logits_head.padded_vocab,
                                 first = ctx:local_rank("tensor") * per + 1, count = per }
    end
  end
  local by_name = {}
  for _, p in ipairs(c:params()) do by_name[p.name] = p end
  for _, d in ipairs(lua_modules) do
    local m = d.module
    m.params, m.grads = {}, {}
    for _, p in ipairs(d.params) do
      local full = d.name == "" and p.name or (d.name .. "." .. p.name)
      m.params[p.name], m.grads[p.name] = by_name[full].tensor, by_name[full].grad
    end
  end
  if model.weights then e:load_weights(model.weights) end
  return e
end

---------------------------------------------------------------- the engine's face

local FORWARD_BACKWARD = { grad_scale = opt.number{ default = 1 }, sync = opt.boolean{ default = true },
                          objective = opt.func }
local LOSS = { objective = opt.func }

-- Sets the objective the engine's objective module calls for this call:
-- the call's own, else parallelize's. objective(out, batch) gets batch's
-- fields from the runtime (targets, batch, seq_len, micro_batch, first_row,
-- want_grad) and ctx / vocab from the engine (objective_info).
function Engine:_use_objective(fn, where)
  if not self.objective_info then
    if fn then error(("%s: objective= needs a model that ends with an output, not its own loss"):format(where), 3) end
    return
  end
  fn = fn or self._.objective
  local info = self.objective_info
  self.c:set_objective(fn and function(out, batch)
    batch.ctx, batch.vocab = info.ctx, info.vocab
    return fn(out, batch)
  end or nil)
end

--- engine:losses() -> {ce_loss =, aux_loss =, expert_tokens =}: the last forward_backward's token
-- loss and the auxiliary losses of its mixture-of-experts layers (0 without); their sum is what it
-- returned. expert_tokens (models with MoE layers): each expert's choices over all MoE layers and
-- the whole batch (a token counts top_k times per layer).
function Engine:losses() return self.c:losses() end

--- engine:forward_backward(inputs, targets [, {grad_scale = 1, sync = true, objective = fn}]) -> loss  (collective)
function Engine:forward_backward(inputs, targets, opts)
  opts = opt.check("forward_backward", opts, FORWARD_BACKWARD)
  self:_use_objective(opts.objective, "forward_backward")
  -- C calls through pcall: their errors (a bad batch) name the user's line, not this file's
  local ok, loss = pcall(self.c.forward_backward, self.c, inputs, targets, opts.grad_scale, opts.sync)
  if not ok then error(loss, 2) end
  self._backward_passes = (self._backward_passes or 0) + 1
  return loss
end

--- How many forward_backward passes this engine has run (the Trainer checks that a training_step ran one).
function Engine:backward_passes() return self._backward_passes or 0 end

--- engine:loss(inputs, targets [, {objective = fn}]) -> mean loss (no gradients)  (collective)
function Engine:loss(inputs, targets, opts)
  opts = opt.check("loss", opts, LOSS)
  self:_use_objective(opts.objective, "loss")
  local ok, loss = pcall(self.c.evaluate, self.c, inputs, targets, false)
  if not ok then error(loss, 2) end
  return loss
end

--- engine:forward(inputs) -> logits [B, T, vocab] on every rank  (collective)
function Engine:forward(inputs)
  local ok, res, logits = pcall(self.c.evaluate, self.c, inputs, nil, true)
  if not ok then error(res, 2) end
  return logits
end

--- engine:decode(inputs [B, T] int32, positions {B}, row0, cache_rows) -> logits [B, T, vocab]  (collective)
-- The key/value cache path (pg_engine_decode): row b is the cache's sequence row0 + b (0-based) of cache_rows,
-- its T tokens at positions positions[b] ..; pg.generate is its user. engine.c:release_cache() frees the cache.
function Engine:decode(inputs, positions, row0, cache_rows)
  local ok, logits = pcall(self.c.decode, self.c, inputs, positions, row0, cache_rows)
  if not ok then error(logits, 2) end
  return logits
end

function Engine:zero_grad() self.c:zero_grad() end -- local
function Engine:sync_grads() self.c:sync_grads() end -- collective (data and embedding groups)

--- This rank's parameters: { name=, shape=, full_shape=, split=, tensor=, grad=, ... } in flat order
-- (no grad with zero = 2: the optimizer made the engine keep only its shard of the gradients).
function Engine:parameters()
  -- zero = 3: no tensor either (this rank holds a shard of the parameters: gather_param, shard_state().param)
  local sharded = self.optimizer ~= nil and self.optimizer.zero >= 2 and self.optimizer.zero
  if not self._.params or self._.params_sharded ~= sharded then
    self._.params, self._.params_sharded = self.c:params(), sharded
  end
  return self._.params
end

--- This rank's flat buffers: parameters and gradients, one tensor each
-- (views: every parameter's tensor and grad is a piece of them, in flat order).
function Engine:flat() return self.c:flat() end

function Engine:grads()
  -- the gradients' shards are over the replicas: data x context (data_context is the data group's members at C = 1)
  if self.optimizer and self.optimizer.zero >= 2 and self.ctx:world_size("data_context") > 1 then
    error(("engine:grads(): with zero = %d this rank keeps only its shard of the gradients "
      .. "(optimizer:shard_state().grad), not each parameter's"):format(self.optimizer.zero), 2)
  end
  local out = {}
  for i, p in ipairs(self:parameters()) do out[i] = { name = p.name, shape = p.shape, tensor = p.grad } end
  return out
end

function Engine:parameter(name)
  for _, p in ipairs(self:parameters()) do if p.name == name then return p end end
end

--- Parameters of the whole (unsharded) model. Local: counted when the engine
-- was built (printing it on rank 0 alone used to break the next step).
function Engine:num_parameters() return self.c:num_parameters() end

--- What this rank holds, in bytes.
function Engine:memory()
  local info = self.c:info()
  local local_params = 0
  for _, p in ipairs(self:parameters()) do
    local n = 1
    for _, d in ipairs(p.shape) do n = n * d end
    local_params = local_params + n
  end
  local m = {
    -- measured by the runtime: with zero = 2 the gradients' shard and the staging buffers made so far, with
    -- zero = 3 also the parameters' shard and the gather slots (the largest unit's, two of them)
    params_bytes = info.params_bytes, grads_bytes = info.grads_bytes,
    slot_bytes = info.slot_bytes, slots = info.slots,
    -- recomputed blocks keep one micro-batch's activations whatever is in flight
    fixed_activation_bytes = info.fixed_activation_bytes,
    -- precision "bf16": the working weights, the rounded GEMM operands and the float32 scratch of the bf16
    -- activations (0 in fp32)
    bf16_bytes = info.bf16_bytes, precision = info.precision,
    -- chunk by chunk (virtual stages): slots x bytes of each chunk's micro-batch
    activation_bytes = info.activation_bytes + info.fixed_activation_bytes,
    peak_activation_bytes = info.peak_activation_bytes + info.fixed_activation_bytes,
    peak_in_flight = info.peak_in_flight,
    local_parameters = local_params,
  }
  if self.optimizer then
    m.optimizer_bytes = self.optimizer:memory().state_bytes
    m.bytes_per_parameter = (m.params_bytes + m.grads_bytes + m.optimizer_bytes) / local_params
  end
  return m
end

--- Which modules and how many parameters sit on each piece of the model, in
-- model order: { modules =, params =, first =, last =, stage =, chunk = },
-- stage the pipeline rank (0-based) and chunk its chunk (1-based; more than 1
-- with virtual stages, whose P x V pieces are listed).
function Engine:partition() return self.partition_report end

--- Timing counters of this rank (seconds) and the step count.
function Engine:stats() return self.c:info() end
function Engine:reset_stats() self.c:reset_stats() end

--- The schedule this rank runs: { {"forward", 1}, {"send_act", 1}, ... }; with
-- virtual stages each action names its chunk: {"forward", 1, 2}
function Engine:schedule_actions() return self.c:schedule() end

--- engine:load_param(name, full): this rank's shard of parameter `name` from
-- its full tensor (fewer rows than the padded full shape: the rest is padding,
-- set to 0). Local: each rank cuts its own shard. For loaders of model files
-- (llmc.lua, hf.lua) and checkpoints.
function Engine:load_param(name, full) self.c:load_param(name, full) end

--- engine:gather_param(name [, grad]) -> the full tensor (or its gradient).
-- Collective over the tensor group of the stage that holds it (with zero = 3
-- over its data group too: the parameter is gathered from the shards).
function Engine:gather_param(name, grad) return self.c:gather_param(name, grad) end

--- engine:local_param(name [, tensor]) -> a copy of this rank's piece of the parameter (its tensor-parallel
-- shard, p.shape); with a tensor, sets it. Local, except that with zero = 3 reading gathers the piece over the
-- data group (collective there) and setting keeps the part inside this rank's shard.
function Engine:local_param(name, t) return self.c:local_param(name, t) end

-- zero = 3 over more than one replica (data x context): the parameters exist only as shards (gathers are collective
-- over data_context)
local function params_sharded(e)
  return e.optimizer ~= nil and e.optimizer.zero == 3 and e.ctx:world_size("data_context") > 1
end

--- (collective) engine:gather_to_root(name, convert, shape) -> on rank 0, convert(the full
-- parameter), a tensor of `shape`; nil elsewhere. Collective over all ranks:
-- the first stage that holds the parameter (the tied embedding's original)
-- gathers it over its tensor group, converts it, and its (dp = 0, tp = 0)
-- rank sends it to rank 0. For writers of whole-model files (llmc, hf).
function Engine:gather_to_root(name, convert, shape)
  local top = name:match("^blocks%.%d+") or name:match("^[^.]+")
  local owner
  for _, part in ipairs(self:partition()) do
    for _, m in ipairs(part.modules) do
      if m == top and not owner then owner = part.stage end
    end
  end
  if not owner then error("no stage holds " .. name) end
  local ctx, sizes = self.ctx, self.ctx:sizes()
  local me = ctx:rank()
  -- an expert under expert parallelism lives on one member of each expert
  -- group: data rank e // (experts / E) of the first one (pg_context.h)
  local dp, e = 0, tonumber(name:match("%.experts%.(%d+)%."))
  if e and (sizes.expert or 1) > 1 and self.config.experts then dp = e // (self.config.experts // sizes.expert) end
  local TC = sizes.tensor * (sizes.context or 1) -- tp-cp-dp-pp (pg_context.h)
  local src = owner * TC * sizes.data + dp * TC -- (pp = owner, dp, cp = 0, tp = 0)
  local buf
  if ctx:local_rank("pipeline") == owner and ctx:local_rank("data") == dp then
    buf = convert(self.c:gather_param(name))
  elseif ctx:local_rank("pipeline") == owner and params_sharded(self) then
    self.c:gather_param(name) -- zero = 3: every data rank takes part in the gather; data rank dp keeps it
  end
  if src ~= 0 then
    if me == src then core.dist.send(buf, { ctx = ctx, dst = 0, tag = 7 })
    elseif me == 0 then
      buf = core.zeros(shape)
      core.dist.recv(buf, { ctx = ctx, src = src, tag = 7 })
    end
  end
  if me == 0 then return buf end
end

--- Loads weights given by the model spec (pg.nn.GPT.load_llmc and pg.nn.from_hf set them).
-- Local: each rank reads the file and keeps its shard.
function Engine:load_weights(w)
  if w.format == "llmc" then require("pipegoose.llmc").load_into(self, w.path)
  elseif w.format == "hf" then require("pipegoose.hf").load_into(self, w.path)
  else error("unknown weights format " .. tostring(w.format)) end
end

--- Writes the model as an llm.c GPT-2 file (collective; rank 0 writes).
function Engine:save_llmc(path) require("pipegoose.llmc").save_from(self, path) end

--- (collective) Writes the model as a Hugging Face directory that transformers'
-- pipeline and from_pretrained load (rank 0 writes): config.json,
-- generation_config.json, the weights (model.safetensors, or shards and
-- their index) and the tokenizer's files; the whole directory replaced at
-- once. opts: tokenizer (default engine.tokenizer: the one pg.nn.from_hf
-- found), dtype, max_shard_size, generation, bos_token_id, eos_token_id,
-- pad_token_id, overwrite (lua/pipegoose/hf.lua's save_from).
function Engine:save_hf(dir, opts) require("pipegoose.hf").save_from(self, dir, opts) end

M.Engine = Engine
return M
