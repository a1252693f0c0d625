--- pg.Trainer: the fit / validate / test loops over any engine, optimizer and
-- token data with the interfaces of docs/DESIGN.md, calling callbacks at
-- Lightning's hook points. What a batch does is the TrainingModule's
-- (training_step, validation_step, test_step); the data may come from a
-- DataModule. docs/TRAINER.md is the reference for every option, state
-- field, control flag and hook; keep the two in step.
--
-- Plain Lua: the C module is needed only to combine control flags across
-- ranks (one all_reduce per step when the engine has a context with more
-- than one rank), so the trainer runs under busted with pg.testing's fakes.
local callbacks = require "pipegoose.callbacks"
local CallbackHandler = require "pipegoose.callback_handler"
local TrainingModule = require "pipegoose.training_module"
local DataModule = require "pipegoose.data_module"
local class = require "pipegoose.class"
local options = require "pipegoose.options"

local Trainer = {}
Trainer.__index = Trainer
Trainer.__name = "Trainer"

--- Control flags, in the order they travel in the cross-rank combination.
Trainer.FLAGS = { "should_stop", "should_save", "should_validate", "should_log" }
local FLAG_INDEX = {}
for i, f in ipairs(Trainer.FLAGS) do FLAG_INDEX[f] = i end

-- level: as error()'s, counted from fail's caller; 0 = no position (runtime
-- conditions such as a NaN loss are not about a line of code).
local function fail(level, fmt, ...)
  error("Trainer: " .. fmt:format(...), level > 0 and level + 1 or 0)
end

-- The level a helper given `level` (as fail's, counted from the helper's
-- caller) passes on from its own frame; 0 stays 0.
local function up(level) return level > 0 and level + 1 or 0 end

local function finite(x) return x == x and x ~= math.huge and x ~= -math.huge end

local function number_name(x)
  if x ~= x then return "nan" end
  if x == math.huge then return "inf" end
  if x == -math.huge then return "-inf" end
  return tostring(x)
end

--- The default clock: pg.wtime (monotonic seconds, from C) when the C module
-- is loaded; else /proc/uptime (monotonic, 10 ms steps), else os.time()
-- (wall clock, 1 s steps). os.clock() is CPU time (wrong with OpenMP threads).
local function default_clock()
  local core = package.loaded["pipegoose.core"]
  if core and core.wtime then return core.wtime() end
  local f = io.open("/proc/uptime", "r")
  if f then
    local t = f:read("n")
    f:close()
    if t then return t end
  end
  return os.time()
end
Trainer.default_clock = default_clock

------------------------------------------------------------------------------
-- trainer.control: four booleans that callbacks may set to true. Assigning a
-- false value is ignored (flags are OR-combined within a rank: one callback
-- cannot cancel another's request); only the trainer clears them. Unknown
-- names are errors, so a typo cannot silently do nothing.

local function new_control()
  local values = {}
  for _, f in ipairs(Trainer.FLAGS) do values[f] = false end
  local function unknown(k)
    error(("trainer.control has no flag '%s'%s (flags: %s)"):format(tostring(k),
      type(k) == "string" and callbacks.suggestion(k, Trainer.FLAGS) or "", table.concat(Trainer.FLAGS, ", ")), 3)
  end
  local control = setmetatable({}, {
    __index = function(_, k)
      local v = values[k]
      if v == nil then unknown(k) end
      return v
    end,
    __newindex = function(_, k, v)
      if values[k] == nil then unknown(k) end
      if v then values[k] = true end
    end,
    __pairs = function() return next, values, nil end,
    __tostring = function()
      local parts = {}
      for _, f in ipairs(Trainer.FLAGS) do parts[#parts + 1] = f .. "=" .. tostring(values[f]) end
      return "control{" .. table.concat(parts, ", ") .. "}"
    end,
  })
  return control, values
end

------------------------------------------------------------------------------
-- Construction

local function engine_rank(ctx)
  if not ctx then return 0, 1 end
  return ctx:rank(), ctx:world_size()
end

local function is_object(v) return type(v) == "table" or type(v) == "userdata" end

-- Counts of steps, epochs and batches: Lua integers (no C int to fit in).
local function count(spec)
  spec = spec or {}
  spec.min, spec.max = 1, math.maxinteger
  return options.integer(spec)
end

-- The options of pg.Trainer{...} (docs/TRAINER.md), checked by pipegoose.options
-- in key order. Keys whose values are checked elsewhere (optimizer when fit
-- needs it, callbacks by the callback handler) or not at all are "any".
local SCHEMA = {
  engine = options.check_with("an engine (what pg.parallelize returns, or pg.testing.fake_engine{})", is_object),
  ctx = options.check_with("a pg.ParallelContext (or pg.testing.fake_context{})",
    function(v) return is_object(v) and v.rank ~= nil and v.world_size ~= nil end),
  optimizer = "any",
  lr_schedule = options.callable{ what = "a function step -> lr (or pg.lr.*)" },
  lr_horizon = options.enum({ "checkpoint", "max_steps" }, { default = "checkpoint", explain = {
    checkpoint = "a resumed schedule keeps the horizon it was saved with",
    max_steps = "it is stretched to this fit's total steps" } }),
  max_steps = count(), max_epochs = count(),
  max_time = options.number{ gt = 0, finite = false }, -- seconds; math.huge: no limit
  accumulate = count{ default = 1 },
  clip_grad_norm = options.number{ gt = 0, finite = false },
  track_grad_norm = "any",
  val_every_n_steps = count(), val_batches = count(), log_every_n_steps = count{ default = 10 },
  callbacks = "any",
  seed = options.integer{ min = math.mininteger, max = math.maxinteger },
  out_dir = options.string{ what = "a string path", default = "runs" },
  overwrite = options.boolean{ default = false },
  on_nan = options.enum({ "error", "skip" }, { default = "error", explain = {
    error = "stop with an error", skip = "skip the step" } }),
  clock = options.callable{ what = "a function returning seconds", default = default_clock },
  out = "any",
  combine = options.func{ what = "a function(values, trainer) -> values" },
}
local FIT_SCHEMA = { resume = options.string{ what = 'a checkpoint directory or "last"' } }

--- pg.Trainer{...}: see docs/TRAINER.md for every option.
function Trainer.new(opts)
  local o = options.check("Trainer", opts, SCHEMA, { required = true })
  local engine, ctx = o.engine, o.ctx
  if ctx ~= nil and engine ~= nil and engine.ctx ~= nil and engine.ctx ~= ctx then
    fail(2, "ctx= is not the engine's context (engine.ctx); give one of them")
  end
  local self = setmetatable({}, Trainer)
  self.optimizer = o.optimizer
  self.ctx = ctx or (engine and engine.ctx)
  self.lr_schedule = o.lr_schedule
  self.lr_horizon = o.lr_horizon
  self.max_steps, self.max_epochs, self.max_time = o.max_steps, o.max_epochs, o.max_time
  if not (self.max_steps or self.max_epochs or self.max_time) then self.max_epochs = 1 end
  self.accumulate = o.accumulate
  self.clip_grad_norm = o.clip_grad_norm
  self.track_grad_norm = o.track_grad_norm ~= false
  self.val_every_n_steps, self.val_batches = o.val_every_n_steps, o.val_batches
  self.log_every_n_steps = o.log_every_n_steps
  self.seed = o.seed
  self.out_dir = o.out_dir
  -- fit locks an out_dir the user named (the default is locked by the first save)
  self._lock_out_dir = opts.out_dir ~= nil
  self.overwrite = o.overwrite
  self.on_nan = o.on_nan
  self.clock = o.clock
  self.out = o.out or io.stdout
  self.combine = o.combine

  -- Hooks go through the handler (its own file); trainer.callbacks is the list it checked.
  self.callback_handler = CallbackHandler.new(o.callbacks or {}, 2)
  self.callbacks = self.callback_handler:list()
  self.checkpoint_dir = self.callback_handler:checkpoint_dir()

  local rank, world = engine_rank(self.ctx)
  self.state = {
    step = 0, epoch = 0, batch_in_epoch = 0, micro_batches = 0, tokens_seen = 0, skipped_steps = 0,
    accumulate = self.accumulate, lr = nil, grad_norm = nil, metrics = {}, elapsed = 0, train_elapsed = 0,
    total_steps = self.max_steps, lr_total_steps = self.max_steps, stage = nil, stop_reason = nil, resumed_from = nil,
    rank = rank, world_size = world, is_global_zero = rank == 0,
  }
  self.control, self._flags = new_control()
  self.combines = 0 -- how many times control flags were combined (for tests and logs)
  self._locks = {} -- canonical directory -> lock path (rank 0) or true: the directories this trainer holds
  -- engine= means today's objective: the default module, trained by fit(train_data, ...)
  if engine ~= nil then
    self._default_module = TrainingModule.language_model(engine)
    self:_attach(self._default_module, nil, 2)
  end
  return self
end

setmetatable(Trainer, {
  __call = function(_, opts) return Trainer.new(opts) end,
})

--- Where agreed saves go: a callback's checkpoint_dir (ModelCheckpoint's dir),
-- else <out_dir>/checkpoints.
function Trainer:get_checkpoint_dir()
  return self.checkpoint_dir or (self.out_dir .. "/checkpoints")
end

--- The path of the checkpoint for optimizer step `step`.
function Trainer:checkpoint_path(step)
  return ("%s/step-%08d"):format(self:get_checkpoint_dir(), step or self.state.step)
end

------------------------------------------------------------------------------
-- Hooks

--- Calls `hook` on every callback that implements it, in list order
-- (through the callback handler, which names the callback when one fails).
function Trainer:call_hook(hook, ...)
  if not callbacks.IS_HOOK[hook] then
    fail(2, "call_hook: '%s' is not a hook%s", tostring(hook), callbacks.suggestion(tostring(hook), callbacks.HOOKS))
  end
  self.callback_handler:call(self, hook, ...)
end

--- The callbacks that implement `hook`, in call order (the trainer calls
-- only these).
function Trainer:callbacks_for(hook)
  return self.callback_handler:callbacks_for(hook)
end

--- Prints on global rank 0 only (to the `out` option, default io.stdout).
function Trainer:print(...)
  if not self.state.is_global_zero then return end
  local n = select("#", ...)
  local parts = {}
  for i = 1, n do parts[i] = tostring((select(i, ...))) end
  self.out:write(table.concat(parts, "\t"), "\n")
  if self.out.flush then self.out:flush() end
end

--- Writes raw text on global rank 0 (no newline added): ProgressBar's "\r" lines.
function Trainer:write(s)
  if not self.state.is_global_zero then return end
  self.out:write(s)
  if self.out.flush then self.out:flush() end
end

--- Adds a metric to trainer.state.metrics (local to this rank; loggers
-- record it). The sanctioned way for callbacks to publish numbers.
function Trainer:log(name, value)
  if type(name) ~= "string" then fail(2, "log: metric name must be a string") end
  self.state.metrics[name] = value
end

--- Sets the number of batches per optimizer step from the next step on
-- (never mid-step). Must be called identically on every rank (it is, when
-- it depends only on trainer.state, as GradientAccumulationScheduler does).
function Trainer:set_accumulate(n)
  local i = math.tointeger(n)
  if i == nil or i < 1 then fail(2, "set_accumulate(%s): expected a positive integer", tostring(n)) end
  self.accumulate = i
  self.state.accumulate = i
end

--- The options engine:forward_backward takes for the current training
-- batch (a new table): grad_scale = 1/k for a step of k batches, sync = true
-- on the step's last batch only. nil outside a training step.
-- TrainingModule:forward_backward passes them on.
function Trainer:forward_backward_options()
  local o = self._fb_opts
  if o == nil then return nil end
  return { grad_scale = o.grad_scale, sync = o.sync }
end

------------------------------------------------------------------------------
-- The TrainingModule and the DataModule being run

-- Makes module (and datamodule, or none) the ones fit / validate / test
-- run: hooks and state go through the callback handler (errors there point
-- `level` up, as fail's); trainer.engine is the module's engine, which may
-- come later from configure_model.
function Trainer:_attach(module, datamodule, level)
  self.callback_handler:set_module(module, up(level))
  self.callback_handler:set_datamodule(datamodule, up(level))
  module.trainer = self
  self.module, self.datamodule = module, datamodule
  self.engine = nil
  if module.engine ~= nil then self:_use_engine(module.engine, up(level)) end
end

-- trainer.engine = engine, and its context the trainer's when ctx= gave
-- none. `level` as fail's; 0 once hooks have run (configure_model), when a
-- context of several ranks comes too late: fit has locked directories and
-- run hooks thinking it was alone.
function Trainer:_use_engine(engine, level)
  local who = callbacks.describe_module(self.module, callbacks.TRAINING_MODULE)
  if not is_object(engine) then
    fail(up(level), "the engine of %s is a %s; expected what pg.parallelize returns", who, type(engine))
  end
  local ctx = engine.ctx
  if ctx ~= nil and self.ctx ~= nil and ctx ~= self.ctx then
    fail(up(level), "the engine of %s runs on another context than the Trainer's (ctx=, or the engine it was built with)", who)
  end
  if ctx ~= nil and self.ctx == nil then
    local rank, world = engine_rank(ctx)
    if level == 0 and world > 1 then
      fail(0, "configure_model of %s made an engine on %d ranks, but the Trainer has no ctx=: give pg.Trainer{ctx = ctx} "
        .. "the context configure_model gets, so that every rank knows its rank before fit runs a hook", who, world)
    end
    local st = self.state
    self.ctx = ctx
    st.rank, st.world_size, st.is_global_zero = rank, world, rank == 0
  end
  self.engine = engine
end

-- What fit / validate / test were given, when it is a TrainingModule and a
-- DataModule: returns them (nil when the first argument is something else:
-- data for the trainer's own module). Shapes that mix the two are errors.
-- `level` as fail's.
local function module_arguments(level, what, a, b)
  local usage = ("%s(module, datamodule)"):format(what)
  local function describe(x)
    if TrainingModule.is_instance(x) then return callbacks.describe_module(x, callbacks.TRAINING_MODULE) end
    if DataModule.is_instance(x) then return callbacks.describe_module(x, callbacks.DATA_MODULE) end
    if is_object(x) and x.next_batch then return "a data object" end
    return "a " .. type(x)
  end
  for i, x in ipairs{ a, b } do
    for _, base in ipairs{ TrainingModule, DataModule } do
      if class.is_class(x, base) then
        fail(up(level), "%s: argument %d is the class %s, not an instance; make one with %s{...}", what, i, x.__name, x.__name)
      end
    end
  end
  if TrainingModule.is_instance(a) then
    if DataModule.is_instance(b) then return a, b end
    local hint = is_object(b) and b.next_batch and " (wrap data objects: pg.DataModule.from_data{train = ..., val = ...})" or ""
    fail(up(level), "%s: after %s comes a pg.DataModule, got %s%s", usage, describe(a), b == nil and "nothing" or describe(b), hint)
  end
  if DataModule.is_instance(a) or TrainingModule.is_instance(b) or DataModule.is_instance(b) then
    fail(up(level), "%s: got %s and %s; the TrainingModule comes first, then the DataModule", usage, describe(a),
      b == nil and "nothing" or describe(b))
  end
  return nil
end

-- The module that data passed to fit / validate / test is run on: the one
-- attached last (the default language model when the Trainer has engine=).
function Trainer:_own_module(level, what)
  if self.module == nil then
    fail(up(level), "%s(data) needs engine= (what pg.parallelize returns, or pg.testing.fake_engine{}) to train a language "
      .. "model on, or a TrainingModule: %s(module, datamodule)", what, what)
  end
  return self.module
end

-- A data object from the DataModule's `method` (train_dataloader, ...);
-- nil is an error unless `optional`.
function Trainer:_dataloader(method, optional)
  local dm = self.datamodule
  local who = callbacks.describe_module(dm, callbacks.DATA_MODULE)
  if dm[method] == nil then
    if optional then return nil end
    fail(0, "%s has no %s()", who, method)
  end
  local data = dm[method](dm)
  if data == nil and optional then return nil end
  if not (is_object(data) and data.next_batch) then
    fail(0, "%s() of %s returned %s; expected a data object with next_batch()", method, who,
      data == nil and "nil" or "a " .. type(data) .. " without next_batch()")
  end
  return data
end

-- The checks of what a stage runs with, wherever it came from (the
-- Trainer's options, or configure_model / configure_optimizers). `level` as fail's.
local function check_engine(level, engine)
  if engine.forward_backward == nil then fail(up(level), "the engine has no forward_backward() method") end
end

local function check_optimizer(level, opt)
  for _, m in ipairs{ "step", "zero_grad", "set_lr", "get_lr" } do
    if opt[m] == nil then fail(up(level), "the optimizer has no %s() method", m) end
  end
end

-- Before a stage runs a hook: what it needs must exist or be made by the
-- module (configure_model; in fit, configure_optimizers). `level` as fail's.
function Trainer:_check_ready(level, stage)
  local module = self.module
  local who = callbacks.describe_module(module, callbacks.TRAINING_MODULE)
  if self.engine == nil then
    if module.configure_model == nil then
      fail(up(level), "%s has no engine: define configure_model(ctx) returning one, or set module.engine", who)
    end
  else
    check_engine(up(level), self.engine)
  end
  if stage ~= "fit" then return end
  if self.optimizer == nil then
    if module.configure_optimizers == nil then
      fail(up(level), "fit needs optimizer= (e.g. pg.optim.AdamW(engine, {lr = 3e-4}))%s",
        module == self._default_module and "" or (", or configure_optimizers(engine) on " .. who))
    end
  else
    check_optimizer(up(level), self.optimizer)
  end
end

-- After the setup hooks (where Lightning calls them): configure_model when
-- the module has no engine, configure_optimizers in fit when the Trainer
-- has no optimizer.
function Trainer:_configure(stage)
  local module = self.module
  local who = callbacks.describe_module(module, callbacks.TRAINING_MODULE)
  if module.engine == nil then
    local engine = module:configure_model(self.ctx)
    if not is_object(engine) then
      fail(0, "configure_model of %s returned a %s; expected an engine (what pg.parallelize returns)", who, type(engine))
    end
    module.engine = engine
    self:_use_engine(engine, 0)
    check_engine(0, engine)
  end
  if stage == "fit" and self.optimizer == nil then
    local opt, schedule = module:configure_optimizers(module.engine)
    if not is_object(opt) then
      fail(0, "configure_optimizers of %s returned a %s; expected an optimizer (and optionally an lr schedule)", who,
        type(opt))
    end
    check_optimizer(0, opt)
    if schedule ~= nil and self.lr_schedule ~= nil then
      fail(0, "configure_optimizers of %s returned an lr schedule, and the Trainer has lr_schedule=; keep one", who)
    end
    self.optimizer = opt
    self.lr_schedule = options.value("Trainer", "the lr schedule configure_optimizers of " .. who .. " returned",
      schedule, SCHEMA.lr_schedule, 0) or self.lr_schedule
  end
end

------------------------------------------------------------------------------
-- Running a stage with on_exception / teardown on error

function Trainer:_reset_run(stage)
  for _, f in ipairs(Trainer.FLAGS) do self._flags[f] = false end
  self._fb_opts = nil -- left set by a step an error ended
  self._stop_reason = nil
  self._torn_down = false
  self.state.stage = stage
  self.state.stop_reason = nil
end

function Trainer:_teardown(stage)
  self._torn_down = true
  self:call_hook("teardown", stage)
end

-- Runs body; on error: on_exception on every callback that has it, then
-- teardown, then the error propagates (pglua then ends the whole job).
-- Errors inside those hooks are reported on stderr and do not hide the
-- original error.
function Trainer:_run(stage, body)
  self:_reset_run(stage)
  local handler = self.callback_handler
  local ok, result = xpcall(body, function(err) return handler:attribute(err) end)
  if ok then return result end
  local err = result
  handler:call_guarded(self, "on_exception", err)
  if not self._torn_down then
    self._torn_down = true
    handler:call_guarded(self, "teardown", stage)
  end
  -- rank-local (no collective: the other ranks may not be here)
  self._in_fit = false
  pcall(self._unlock_all, self)
  error(err, 0)
end

------------------------------------------------------------------------------
-- Combining control flags across ranks

-- values: { stop, save, validate, log } as 0/1; returns them combined with
-- max over the global group of the engine's context. Nothing to do (and no
-- collective) without a context or on one rank.
function Trainer:_all_reduce_max(values)
  local ctx = self.ctx
  -- pg.testing.fake_context has ranks but no communication
  if not ctx or ctx.fake or self.state.world_size <= 1 then return values end
  local core = require "pipegoose.core"
  local t = self._flag_tensor
  if not t then
    t = core.zeros({ #Trainer.FLAGS }, { dtype = "int32" })
    self._flag_tensor = t
  end
  for i, v in ipairs(values) do t:set(i, v) end
  core.dist.all_reduce(t, { ctx = ctx, group = "global", op = "max" })
  for i = 1, #values do values[i] = t:get(i) end
  return values
end

-- The one combination point: every flag is combined (OR across ranks) in a
-- single all_reduce; afterwards trainer.control is the same on every rank.
function Trainer:_combine()
  local flags = self._flags
  local values = {}
  for i, f in ipairs(Trainer.FLAGS) do values[i] = flags[f] and 1 or 0 end
  if self.combine then
    values = self.combine(values, self) or values
  else
    values = self:_all_reduce_max(values)
  end
  for i, f in ipairs(Trainer.FLAGS) do flags[f] = values[i] ~= 0 and values[i] ~= false end
  self.combines = self.combines + 1
  if flags.should_stop and not self._stop_reason then self._stop_reason = "should_stop" end
end

------------------------------------------------------------------------------
-- fit

local function check_data(name, data, need)
  if data == nil then return end
  if type(data) ~= "table" and type(data) ~= "userdata" then
    fail(4, "%s must be a data object with next_batch(), got a %s", name, type(data))
  end
  for _, m in ipairs(need) do
    if data[m] == nil then fail(4, "%s has no %s() method", name, m) end
  end
end

--- Trains: trainer:fit(module, datamodule [, opts]) or
-- trainer:fit(train_data [, val_data] [, opts]) (the trainer's own module:
-- the language model of engine=, or the module attached last); opts:
-- {resume = path | "last"}. Returns trainer.state.
function Trainer:fit(a, b, opts)
  opts = options.check("Trainer: fit", opts, FIT_SCHEMA)
  local module, datamodule = module_arguments(2, "fit", a, b)
  local train_data, val_data
  if module == nil then
    train_data, val_data = a, b
    if train_data == nil then fail(2, "fit: needs training data (pg.data.TokenShards{...})") end
    check_data("fit: the training data", train_data, { "next_batch" })
    check_data("fit: the validation data", val_data, { "next_batch" })
    module = self:_own_module(2, "fit")
  end
  self:_attach(module, datamodule, 2)
  self:_check_ready(2, "fit")
  -- One job per output directory, settled before any hook runs (MetricsLogger
  -- truncates its file in setup): a refused fit has not started, so no hook
  -- (on_exception, teardown) runs for it.
  self._in_fit = true
  local ok, err = pcall(function()
    if self._lock_out_dir then self:_lock(self.out_dir, "Trainer: out_dir") end
    if self.checkpoint_dir then self:_lock(self.checkpoint_dir, "Trainer: the checkpoint directory") end
    self:_refuse_used_checkpoint_dir(opts)
  end)
  if not ok then
    self._in_fit = false
    self:_unlock_all()
    error(err, 0)
  end
  return self:_run("fit", function() return self:_fit(train_data, val_data, opts) end)
end

-- train_data, val_data: nil with a DataModule, whose setup makes them.
function Trainer:_fit(train_data, val_data, opts)
  local st = self.state
  self.train_data, self.val_data = train_data, val_data
  if self.seed then math.randomseed(self.seed) end
  self:call_hook("setup", "fit")
  self:_configure("fit")
  if self.datamodule then
    self.train_data = self:_dataloader("train_dataloader")
    self.val_data = self:_dataloader("val_dataloader", true)
  end
  if opts.resume then self:_resume(opts.resume) end
  if self._base_lr == nil then self._base_lr = self.optimizer:get_lr() end
  local data = self.train_data
  self._tokens_per_batch = data.tokens_per_batch and data:tokens_per_batch() or nil
  st.total_steps = self:_estimate_total_steps()
  st.lr_total_steps = self:_lr_horizon()
  self._t0, self._tokens0 = self.clock(), st.tokens_seen
  self._train_mark = self._t0
  st.elapsed, st.train_elapsed = 0, 0
  self:call_hook("on_fit_start")
  self:call_hook("on_train_start")
  self:_train_loop()
  st.stop_reason = self._stop_reason
  self:call_hook("on_train_end")
  self:call_hook("on_fit_end")
  self:_teardown("fit")
  self._in_fit = false
  self:_unlock_all()
  return st
end

-- The horizon the lr schedule sees (info.total_steps): this fit's
-- total_steps, except that a resumed schedule keeps the one it was saved
-- with (lr_horizon = "checkpoint"), so that extending max_steps on resume
-- does not stretch a cosine that is half done.
function Trainer:_lr_horizon()
  local st, saved = self.state, self._checkpoint_lr_total
  if self.lr_horizon ~= "checkpoint" or saved == nil or saved == st.total_steps then return st.total_steps end
  if self.lr_schedule then
    self:print(("Trainer: the lr schedule keeps the horizon of %d steps it was saved with (this fit's total is %s; "
      .. "lr_horizon='max_steps' stretches it to that)"):format(saved, tostring(st.total_steps)))
  end
  return saved
end

function Trainer:_estimate_total_steps()
  if self.max_steps then return self.max_steps end
  local data = self.train_data
  if self.max_epochs and data.batches_per_epoch then
    local per_epoch = math.ceil(data:batches_per_epoch() / self.accumulate)
    return per_epoch * self.max_epochs
  end
  return nil
end

function Trainer:_train_loop()
  local st = self.state
  while true do
    if self.max_steps and st.step >= self.max_steps then
      self._stop_reason = self._stop_reason or "max_steps"
      break
    end
    if self.max_epochs and st.epoch >= self.max_epochs then
      self._stop_reason = self._stop_reason or "max_epochs"
      break
    end
    self:call_hook("on_train_epoch_start")
    local exhausted, stop = self:_train_epoch()
    if exhausted and not stop and self.val_data and not self.val_every_n_steps then
      -- epoch-end validation (no val_every_n_steps): the same on every rank
      -- because the data ends on every rank at the same batch.
      stop = self:_validate_and_settle()
    end
    self:call_hook("on_train_epoch_end")
    if exhausted then
      st.epoch = st.epoch + 1
      st.batch_in_epoch = 0
    end
    if stop then break end
  end
end

-- One epoch (or what is left of it after a resume). Returns exhausted (the
-- data returned nil) and stop (the agreed should_stop).
function Trainer:_train_epoch()
  local st, data = self.state, self.train_data
  local inputs, targets = data:next_batch()
  if inputs == nil then
    if st.batch_in_epoch == 0 then
      fail(0, "the training data produced no batches in epoch %d", st.epoch)
    end
    return true, false
  end
  while true do
    local exhausted = self:_train_step(inputs, targets)
    local stop = self:_end_of_step()
    if stop then return exhausted, true end
    if exhausted then return true, false end
    inputs, targets = data:next_batch()
    if inputs == nil then return true, false end
  end
end

-- Step numbers in messages are 1-based: the step being computed is state.step + 1.
function Trainer:_set_lr(step)
  local st, opt = self.state, self.optimizer
  if self.lr_schedule then
    local lr = self.lr_schedule(step, { base_lr = self._base_lr, total_steps = st.lr_total_steps })
    if type(lr) ~= "number" or not finite(lr) then
      fail(0, "lr_schedule returned %s for step %d (expected a finite number)", tostring(lr), step)
    end
    opt:set_lr(lr)
    st.lr = lr
  else
    st.lr = opt:get_lr()
  end
end

function Trainer:_batch_tokens(inputs)
  if self._tokens_per_batch then return self._tokens_per_batch end
  local rows, cols
  if type(inputs) == "table" then
    rows = #inputs
    cols = type(inputs[1]) == "table" and #inputs[1] or 1
  elseif inputs.shape then
    local s = inputs:shape()
    rows, cols = s[1], s[2] or 1
  else
    return 0
  end
  local dp = 1
  if self.ctx and self.ctx.world_size then dp = self.ctx:world_size("data") end
  return rows * cols * dp
end

-- Takes one optimizer step's worth of batches, starting with the batch
-- already fetched. Returns true when the data ran out during the step.
function Trainer:_train_step(inputs, targets)
  local st, flags, data, module = self.state, self._flags, self.train_data, self.module
  local step = st.step + 1
  local k = self.accumulate
  if data.batches_per_epoch then
    -- the last step of an epoch averages over the batches that are left
    local left = data:batches_per_epoch() - st.batch_in_epoch
    if left >= 1 and left < k then k = left end
  end
  flags.should_save = false
  flags.should_log = step % self.log_every_n_steps == 0
  flags.should_validate = self.val_every_n_steps ~= nil and step % self.val_every_n_steps == 0
  self:_set_lr(step)
  -- gradient reductions across ranks (data parallel, tied embedding) run once,
  -- after the step's last batch (sync = false before it, as DDP's no_sync)
  -- (trainer:forward_backward_options() reads them: module:forward_backward passes them on)
  local fb_opts = { grad_scale = 1 / k, sync = k == 1 }
  self._fb_opts = fb_opts
  local loss_sum, done, bad = 0, 0, nil
  local exhausted = false
  for i = 1, k do
    st.batch_in_epoch = st.batch_in_epoch + 1
    local idx = st.batch_in_epoch
    local batch = { inputs = inputs, targets = targets }
    self:call_hook("on_train_batch_start", batch, idx)
    self:call_hook("on_before_backward", idx)
    fb_opts.sync = i == k
    local passes = self:_backward_passes()
    local loss = module:training_step(batch, idx)
    st.micro_batches = st.micro_batches + 1
    st.tokens_seen = st.tokens_seen + self:_batch_tokens(inputs)
    if type(loss) ~= "number" then
      fail(0, "training_step of %s returned a %s at step %d, expected the loss (a number)",
        callbacks.describe_module(module, callbacks.TRAINING_MODULE), type(loss), step)
    end
    self:_check_backward(passes, module, step, idx)
    if not finite(loss) then
      if self.on_nan == "error" then
        error(("Trainer: loss is %s at step %d (epoch %d, batch %d); on_nan='skip' skips such steps")
          :format(number_name(loss), step, st.epoch, idx), 0)
      end
      bad = bad or loss
    end
    loss_sum, done = loss_sum + loss, done + 1
    self:call_hook("on_after_backward", loss, idx)
    local last = i == k
    if not last then
      inputs, targets = data:next_batch()
      if inputs == nil then exhausted, last = true, true end
    end
    if last then self:_optimizer_step(step, loss_sum / done, bad) end
    self:call_hook("on_train_batch_end", { loss = loss, step_end = last, skipped = last and bad ~= nil }, idx)
    if last then break end
  end
  self._fb_opts = nil
  return exhausted
end

-- The engine's count of backward passes, or nil for an engine that keeps none.
function Trainer:_backward_passes()
  local e = self.engine
  if e == nil or e.backward_passes == nil then return nil end
  return e:backward_passes()
end

-- A training_step must run the engine's backward pass (engine:forward_backward,
-- module:forward_backward): without it the optimizer would step on the
-- gradients zero_grad left (zeros), and the run would look like training.
function Trainer:_check_backward(before, module, step, idx)
  if before == nil then return end
  if self:_backward_passes() == before then
    fail(0, "training_step of %s ran no backward pass at step %d (batch %d): it must call self:forward_backward "
      .. "(or engine:forward_backward) so that the optimizer steps on this batch's gradients (engine:loss computes "
      .. "no gradients)", callbacks.describe_module(module, callbacks.TRAINING_MODULE), step, idx)
  end
end

function Trainer:_optimizer_step(step, step_loss, bad)
  local st, opt = self.state, self.optimizer
  st.metrics.loss = step_loss
  if bad == nil then
    self:call_hook("on_before_optimizer_step", opt)
    local norm
    if self.clip_grad_norm then
      norm = opt:clip_grad_norm(self.clip_grad_norm)
    elseif self.track_grad_norm and opt.grad_norm then
      norm = opt:grad_norm()
    end
    st.grad_norm = norm
    st.metrics.grad_norm = norm
    opt:step()
  else
    st.skipped_steps = st.skipped_steps + 1
    self:print(("Trainer: loss is %s at step %d; skipping the step (on_nan='skip')"):format(number_name(bad), step))
  end
  st.step = step
  self:call_hook("on_before_zero_grad", opt)
  opt:zero_grad()
  local now = self.clock()
  st.elapsed = now - self._t0
  st.train_elapsed = st.train_elapsed + (now - self._train_mark)
  self._train_mark = now
  if st.elapsed > 0 then
    st.metrics.tokens_per_s = (st.tokens_seen - self._tokens0) / st.elapsed
  end
end

-- After a step's last on_train_batch_end: the trainer's own stop reasons,
-- the combination, then validation and saving as agreed. Returns the agreed
-- should_stop.
function Trainer:_end_of_step()
  local st, flags = self.state, self._flags
  if self.max_steps and st.step >= self.max_steps then
    flags.should_stop = true
    self._stop_reason = self._stop_reason or "max_steps"
  end
  if self.max_time and st.elapsed >= self.max_time then
    flags.should_stop = true
    self._stop_reason = self._stop_reason or "max_time"
  end
  self:_combine()
  if flags.should_validate and self.val_data then
    return self:_validate_and_settle()
  end
  flags.should_validate = false
  if flags.should_save then self:_save_agreed() end
  return flags.should_stop
end

-- Validation during fit, then a second combination (validation hooks may
-- request a stop or a save, e.g. EarlyStopping / ModelCheckpoint on
-- val_loss), then the agreed save. Returns the agreed should_stop.
function Trainer:_validate_and_settle()
  local flags = self._flags
  self:_eval_loop("validation", self.val_data, self.val_batches)
  self:_combine()
  self:_train_clock_from_now()
  flags.should_validate = false
  if flags.should_save then self:_save_agreed() end
  return flags.should_stop
end

-- Validation and checkpoint saves are not training: after one of them
-- state.train_elapsed counts again from now (leaving out the time since the
-- last step's end, the hooks' included), so that a rate over it (the
-- ProgressBar's tokens/s) is the training's speed.
function Trainer:_train_clock_from_now()
  if self._in_fit then self._train_mark = self.clock() end
end

function Trainer:_save_agreed()
  self:save_checkpoint(self:checkpoint_path(self.state.step))
  self._flags.should_save = false
end

------------------------------------------------------------------------------
-- validate / test

-- The two evaluation loops: their stage, hooks, module step, metric prefix
-- and the DataModule method that gives their data.
local EVAL = {
  validation = { stage = "validate", hooks = "on_validation", step = "validation_step", prefix = "val_",
                 loader = "val_dataloader" },
  test = { stage = "test", hooks = "on_test", step = "test_step", prefix = "test_", loader = "test_dataloader" },
}

-- A step's outputs as a table of named numbers (a number is {loss = it}).
local function step_outputs(who, step, out, n)
  if type(out) == "number" then return { loss = out } end
  if type(out) ~= "table" or next(out) == nil then
    fail(0, "%s of %s returned %s at batch %d; expected the loss (a number) or a table of named numbers "
      .. "({loss = ..., accuracy = ...})", step, who, type(out) == "table" and "an empty table" or "a " .. type(out), n)
  end
  for k, v in pairs(out) do
    if type(k) ~= "string" or type(v) ~= "number" then
      fail(0, "%s of %s returned %s = %s at batch %d; expected a table of named numbers", step, who, tostring(k),
        type(v) == "string" and ("'" .. v .. "'") or tostring(v), n)
    end
  end
  return out
end

local function sorted_names(t)
  local names = {}
  for k in pairs(t) do names[#names + 1] = k end
  table.sort(names)
  return table.concat(names, ", ")
end

-- kind: "validation" or "test". Every batch goes through the module's
-- validation_step / test_step; each named number it returns is averaged over
-- the batches (each the same on every rank) and published as val_<name> /
-- test_<name> (the default module: val_loss / test_loss). Returns them.
function Trainer:_eval_loop(kind, data, max_batches)
  local st, module, e = self.state, self.module, EVAL[kind]
  local who = callbacks.describe_module(module, callbacks.TRAINING_MODULE)
  self._flags.should_validate = false
  self:call_hook(e.hooks .. "_start")
  if data.reset then data:reset() end
  local sums, names, n, first_bad = {}, nil, 0, {}
  while not max_batches or n < max_batches do
    local inputs, targets = data:next_batch()
    if inputs == nil then break end
    n = n + 1
    local batch = { inputs = inputs, targets = targets }
    self:call_hook(e.hooks .. "_batch_start", batch, n)
    local outputs = step_outputs(who, e.step, module[e.step](module, batch, n), n)
    local these = sorted_names(outputs)
    names = names or these
    if these ~= names then
      fail(0, "%s of %s returned {%s} at batch %d but {%s} before; every batch must return the same names", e.step,
        who, these, n, names)
    end
    for k, v in pairs(outputs) do
      sums[k] = (sums[k] or 0) + v
      if not finite(v) and not first_bad[k] then first_bad[k] = { n = n, v = v } end
    end
    self:call_hook(e.hooks .. "_batch_end", outputs, n)
  end
  if n == 0 then fail(0, "the %s data produced no batches", kind) end
  local metrics = {}
  for k, sum in pairs(sums) do
    metrics[e.prefix .. k] = sum / n
  end
  self:_check_eval_metrics(kind, e, metrics, first_bad)
  for k, v in pairs(metrics) do st.metrics[k] = v end
  self:call_hook(e.hooks .. "_end")
  return metrics
end

-- Non-finite evaluation metrics go by on_nan, as the training loss does:
-- "error" raises naming the metric, the step and the first batch that gave a
-- non-finite value; "skip" publishes them (a callback such as EarlyStopping's
-- check_finite decides) with a line saying so. The metrics are the same on
-- every rank (the module's steps reduce them), so every rank decides alike.
function Trainer:_check_eval_metrics(kind, e, metrics, first_bad)
  local names = sorted_names(metrics)
  for name in names:gmatch("[^, ]+") do
    local v = metrics[name]
    if not finite(v) then
      local bad = first_bad[name:sub(#e.prefix + 1)]
      local where = bad and (" (%s batch %d returned %s = %s)"):format(kind, bad.n, name:sub(#e.prefix + 1),
        number_name(bad.v)) or ""
      if self.on_nan == "error" then
        error(("Trainer: %s is %s after step %d%s; on_nan='skip' reports it and goes on"):format(name,
          number_name(v), self.state.step, where), 0)
      end
      self:print(("Trainer: %s is %s after step %d%s (on_nan='skip')"):format(name, number_name(v), self.state.step,
        where))
    end
  end
end

-- validate / test's arguments, (module, datamodule) or (data), attached and
-- checked. Returns the data (nil with a DataModule). `level` as fail's.
function Trainer:_eval_arguments(level, what, a, b)
  local module, datamodule = module_arguments(up(level), what, a, b)
  if module == nil then
    check_data(what .. ": the data", a, { "next_batch" })
    if a == nil then fail(up(level), "%s needs data", what) end
    if b ~= nil then fail(up(level), "%s(data) takes one data object; the second argument is a %s", what, type(b)) end
    module = self:_own_module(up(level), what)
  end
  self:_attach(module, datamodule, up(level))
  self:_check_ready(up(level), what)
  return datamodule == nil and a or nil
end

-- A validate or test run over data (nil: the DataModule's); returns the metrics.
function Trainer:_evaluate(kind, data)
  local e = EVAL[kind]
  return self:_run(e.stage, function()
    self:call_hook("setup", e.stage)
    self:_configure(e.stage)
    if self.datamodule then data = self:_dataloader(e.loader) end
    local metrics = self:_eval_loop(kind, data, kind == "validation" and self.val_batches or nil)
    self:_teardown(e.stage)
    return metrics
  end)
end

--- Evaluates at most val_batches batches: trainer:validate(module, datamodule)
-- (the DataModule's val_dataloader) or trainer:validate(data) (the trainer's
-- own module). Returns the metrics, {val_loss =, val_<name> = ...}.
function Trainer:validate(a, b)
  local data = self:_eval_arguments(2, "validate", a, b)
  return self:_evaluate("validation", data)
end

--- Evaluates on every batch of one epoch: trainer:test(module, datamodule)
-- (test_dataloader) or trainer:test(data). Returns {test_loss =, test_<name> = ...}.
function Trainer:test(a, b)
  local data = self:_eval_arguments(2, "test", a, b)
  return self:_evaluate("test", data)
end

------------------------------------------------------------------------------
-- Checkpoints

--- Saves a checkpoint directory now (every rank must call it at the same
-- point: the trainer does so for agreed saves; callbacks may call it from
-- hooks that run at the same point on every rank, like on_train_end).
-- Runs on_save_checkpoint before writing and on_checkpoint_saved after the
-- directory is complete. Returns the path.
function Trainer:save_checkpoint(path)
  local ckpt = require "pipegoose.checkpoint"
  if self.engine == nil then fail(2, "save_checkpoint: there is no engine yet (a module's configure_model makes it in fit)") end
  path = path or self:checkpoint_path(self.state.step)
  -- the directory the save writes into (and cleans up) is this job's: a
  -- lock taken here lasts for the fit, or for this save outside fit
  local parent = ckpt.fs.dirname((path:gsub("/+$", "")))
  local took = self:_lock(parent, "Trainer: the checkpoint directory")
  local ok, err = pcall(ckpt.save, self, path)
  if took and not self._in_fit then self:_unlock(took) end
  if not ok then error(err, 0) end
  self:call_hook("on_checkpoint_saved", path)
  self:_train_clock_from_now()
  return path
end

------------------------------------------------------------------------------
-- One job per output directory: locks (lua/pipegoose/checkpoint.lua M.lock)

-- Locks dir for this job unless a directory it holds already covers it.
-- Collective with a context of several ranks (rank 0 holds the lock file;
-- every rank raises its refusal). Returns the key to _unlock when it took a
-- new lock, else nil.
function Trainer:_lock(dir, label)
  local ckpt = require "pipegoose.checkpoint"
  local key = ckpt.canonical(dir)
  for held in pairs(self._locks) do
    if key == held or key:sub(1, #held + 1) == held .. "/" then return nil end
  end
  local path, warning, err
  if self.state.is_global_zero then
    local ok, a, b = pcall(ckpt.lock, dir, label)
    if ok then path, warning = a, b else err = tostring(a) end
  end
  ckpt.agree_error(self, err)
  if warning then self:print(warning) end
  self._locks[key] = path or true
  return key
end

function Trainer:_unlock(key)
  local path = self._locks[key]
  self._locks[key] = nil
  if type(path) == "string" then require("pipegoose.checkpoint").unlock(path) end
end

function Trainer:_unlock_all()
  for key in pairs(self._locks) do self:_unlock(key) end
end

--- The counters a checkpoint keeps (restore_counters puts them back).
function Trainer:counters()
  local st = self.state
  return {
    step = st.step, epoch = st.epoch, batch_in_epoch = st.batch_in_epoch, micro_batches = st.micro_batches,
    tokens_seen = st.tokens_seen, skipped_steps = st.skipped_steps, accumulate = self.accumulate,
  }
end

function Trainer:restore_counters(c)
  if type(c) ~= "table" then fail(2, "restore_counters: expects the table counters() returned, got a %s", type(c)) end
  local st = self.state
  for _, k in ipairs{ "step", "epoch", "batch_in_epoch", "micro_batches", "tokens_seen", "skipped_steps" } do
    if c[k] ~= nil then st[k] = c[k] end
  end
  if c.accumulate then self:set_accumulate(c.accumulate) end
end

--- The learning-rate record a checkpoint keeps: the schedule's base rate,
-- the last rate set, the step the schedule was at and its horizon.
function Trainer:lr_state()
  local st = self.state
  return { base_lr = self._base_lr, last_lr = st.lr, schedule_step = st.step, total_steps = st.lr_total_steps }
end

--- Puts back what lr_state() returned; the saved horizon is kept for
-- lr_horizon = "checkpoint" (see _lr_horizon).
function Trainer:load_lr_state(rec)
  if type(rec) ~= "table" then fail(2, "load_lr_state: expects the table lr_state() returned, got a %s", type(rec)) end
  self._base_lr = rec.base_lr
  self.state.lr = rec.last_lr
  self._checkpoint_lr_total = rec.total_steps
end

-- The checkpoints (directories with a manifest) a directory holds, sorted.
local function checkpoints_in(dir)
  local ckpt = require "pipegoose.checkpoint"
  local found = {}
  if not ckpt.fs.is_dir(dir) then return found end
  for _, name in ipairs(ckpt.fs.list(dir)) do
    if ckpt.fs.exists(dir .. "/" .. name .. "/" .. ckpt.MANIFEST) then found[#found + 1] = name end
  end
  table.sort(found)
  return found
end

-- A fresh fit (no resume=) never writes over another run's checkpoints: the
-- checkpoint directory must hold none unless overwrite = true (Lightning's and
-- the Hugging Face Trainer's overwrite_output_dir). Rank 0 looks; every rank
-- raises its refusal (collective).
function Trainer:_refuse_used_checkpoint_dir(opts)
  if opts.resume ~= nil or self.overwrite then return end
  local ckpt = require "pipegoose.checkpoint"
  local err
  if self.state.is_global_zero then
    local dir = self:get_checkpoint_dir()
    local found = checkpoints_in(dir)
    local has_latest = ckpt.fs.exists(dir .. "/" .. ckpt.LATEST)
    if #found > 0 or has_latest then
      local names = #found > 0 and table.concat(found, ", ", 1, math.min(#found, 3)) .. (#found > 3 and ", ..." or "")
        or "a latest file"
      err = ("Trainer: %s already holds checkpoints (%s) of another run; a fresh fit would write over them: "
        .. "pass fit(..., { resume = \"last\" }) to continue that run, overwrite = true (pg.Trainer{ overwrite = "
        .. "true }) to write over it, or another out_dir"):format(dir, names)
    end
  end
  ckpt.agree_error(self, err)
end

-- spec: fit's resume= (a string: FIT_SCHEMA checked it).
function Trainer:_resume(spec)
  local ckpt = require "pipegoose.checkpoint"
  local path = spec
  if spec == "last" then
    path = ckpt.latest(self:get_checkpoint_dir())
    if not path then
      self:print(("Trainer: resume='last': no checkpoint in %s yet; starting from step 0"):format(self:get_checkpoint_dir()))
      return
    end
  end
  local _, dir = ckpt.load(self, path)
  self.state.resumed_from = dir
  self:print(("Trainer: resumed from %s at step %d (epoch %d)"):format(dir, self.state.step, self.state.epoch))
end

--- Loads a checkpoint into this trainer outside fit (counters, callback,
-- data, optimizer and engine state). fit{resume=} does this itself.
function Trainer:load_checkpoint(path, train_data)
  if self.engine == nil then fail(2, "load_checkpoint: there is no engine yet (a module's configure_model makes it in fit)") end
  if train_data then self.train_data = train_data end
  local _, dir = require("pipegoose.checkpoint").load(self, path)
  self.state.resumed_from = dir
end

return Trainer
