-- pg.Callback, pg.rank_zero_only and every built-in callback, driven by a
-- real pg.Trainer over pg.testing's fakes. No timing: clocks are injected.
local pg = require "pipegoose"
local cjson = require "cjson"
local T = pg.testing
local cb = pg.callbacks

local h = require "helpers"
local tmpdir = h.tmpdir
local rm = h.rm
local exists = h.exists

local function read_lines(path)
  local lines = {}
  for line in io.lines(path) do lines[#lines + 1] = line end
  return lines
end

-- A trainer over fresh fakes (o.engine / o.optimizer options; the rest go to the Trainer).
local function trainer_with(o)
  local engine = T.fake_engine(o.engine)
  local opt = T.fake_optimizer(engine, o.optimizer)
  local topts = { engine = engine, optimizer = opt, out = T.capture() }
  for k, v in pairs(o) do
    if k ~= "engine" and k ~= "optimizer" then topts[k] = v end
  end
  return pg.Trainer(topts)
end

-- An engine whose validation loss is values[n] on the n-th engine:loss call
-- (val_batches = 1: one call per validation run), then -n (still improving).
local function scripted(values)
  return { eval_loss = function(_, _, _, n) return values[n] or -n end }
end

describe("pg.Callback", function()
  it("returns the table of hooks, checked", function()
    local hooks = { name = "Mine", on_fit_start = function() end }
    assert.equal(hooks, pg.Callback(hooks))
    assert.has_error(function() pg.Callback{ name = "Mine", on_fit_strat = function() end } end,
      "pg.Callback: callback (Mine) has unknown hook 'on_fit_strat' (did you mean 'on_fit_start'?)")
    assert.has_error(function() pg.Callback(3) end, "pg.Callback: expects a table of hooks, got a number")
  end)

  it("needs no hooks: missing ones are no-ops", function()
    local st = trainer_with{ max_steps = 3, callbacks = { pg.Callback{}, {} } }:fit(T.fake_data{})
    assert.equal(3, st.step)
  end)

  it("run in the order given, for every hook", function()
    local order = {}
    local function named(n)
      return pg.Callback{ name = n,
        on_train_start = function() order[#order + 1] = n .. ":start" end,
        on_train_end = function() order[#order + 1] = n .. ":end" end }
    end
    trainer_with{ max_steps = 1, callbacks = { named("b"), named("a"), named("c") } }:fit(T.fake_data{})
    assert.same({ "b:start", "a:start", "c:start", "b:end", "a:end", "c:end" }, order)
  end)

  it("names unknown built-ins", function()
    assert.has_error(function() return cb.EarlyStoping end,
      "pg.callbacks has no 'EarlyStoping' (did you mean 'EarlyStopping'?) (built-ins: EarlyStopping, "
      .. "GradientAccumulationScheduler, LambdaCallback, LearningRateMonitor, MetricsLogger, ModelCheckpoint, "
      .. "ProgressBar, TextSampler, Timer)")
  end)
end)

describe("pg.rank_zero_only", function()
  it("runs on rank 0 only, asking the trainer when called as a hook", function()
    local calls = {}
    local f = pg.rank_zero_only(function(_, t) calls[#calls + 1] = t.state.rank return "ran" end)
    local r0 = trainer_with{ engine = { rank = 0, world_size = 2 } }
    local r1 = trainer_with{ engine = { rank = 1, world_size = 2 } }
    assert.equal("ran", f({}, r0))
    assert.is_nil(f({}, r1))
    assert.same({ 0 }, calls)
    -- outside hooks: this process's rank (0 under plain busted)
    assert.equal(7, pg.rank_zero_only(function() return 7 end)())
  end)
end)

describe("pg.callbacks.LambdaCallback", function()
  it("calls loose functions as fn(trainer, ...) and rejects keys that are not hooks", function()
    local got = {}
    local lc = cb.LambdaCallback{ on_train_batch_end = function(t, outputs, i)
      if outputs.step_end then got[#got + 1] = { t.state.step, i } end
    end }
    trainer_with{ max_steps = 2, callbacks = { lc } }:fit(T.fake_data{})
    assert.same({ { 1, 1 }, { 2, 2 } }, got)
    assert.has_error(function() cb.LambdaCallback{ on_train_ended = function() end } end,
      "pg.callbacks.LambdaCallback: 'on_train_ended' is not a hook (did you mean 'on_train_end'?)")
  end)
end)

describe("pg.callbacks.EarlyStopping", function()
  -- on_nan = "skip": a NaN val_loss reaches EarlyStopping (its check_finite is the subject)
  local function fit_with(values, opts)
    local es = cb.EarlyStopping(opts)
    local trainer = trainer_with{ engine = scripted(values), max_steps = 50, val_every_n_steps = 1, val_batches = 1,
      clock = T.manual_clock(0, 1), callbacks = { es }, on_nan = "skip" }
    return trainer:fit(T.fake_data{ batches = 100 }, T.fake_data{ batches = 1 }), es, trainer
  end

  it("stops after `patience` checks without improvement, at that step", function()
    -- best 3 at step 3; steps 4 and 5 do not improve on it
    local st, es, trainer = fit_with({ 5, 4, 3, 3.5, 3.2, 3.1, 1 }, { patience = 2 })
    assert.same({ 5, "should_stop" }, { st.step, st.stop_reason })
    assert.same({ 3, 3, 2, 5 }, { es.best, es.best_step, es.wait, es.stopped_step })
    assert.matches("EarlyStopping: val_loss has not improved for 2 checks %(best 3 at step 3%); stopping after step 5",
      trainer.out:text())
  end)

  it("requires an improvement larger than min_delta", function()
    local st = fit_with({ 5, 4.8, 4.0, 3.8, 3.7, 1 }, { patience = 2, min_delta = 0.5 })
    assert.equal(5, st.step)
    st = fit_with({ 5, 4.8, 4.0, 3.8, 3.7 }, { patience = 2 })
    assert.same({ 50, "max_steps" }, { st.step, st.stop_reason }, "every value improves without min_delta")
  end)

  it("maximises in mode 'max' and stops at once on a NaN", function()
    local st = fit_with({ 1, 2, 2, 1.5, 9 }, { patience = 2, mode = "max", monitor = "val_loss" })
    assert.equal(4, st.step)
    st = fit_with({ 3, 0 / 0, 1 }, { patience = 5 })
    assert.equal(2, st.step)
  end)

  it("watches the training loss every n steps", function()
    local es = cb.EarlyStopping{ monitor = "loss", every_n_steps = 2, patience = 1, min_delta = 10 }
    local st = trainer_with{ max_steps = 50, callbacks = { es } }:fit(T.fake_data{ batches = 100 })
    assert.equal(4, st.step) -- first check at step 2 sets the best, the check at step 4 fails
  end)

  it("names a monitored metric that does not exist", function()
    assert.has_error(function() fit_with({ 1, 2 }, { monitor = "val_acc" }) end,
      "Trainer: on_validation_end of callback 1 (EarlyStopping) failed: EarlyStopping: metric 'val_acc' is not "
      .. "available after validation (metrics: grad_norm, loss, tokens_per_s, val_loss)")
  end)
end)

describe("pg.callbacks.ModelCheckpoint", function()
  local dir
  before_each(function() dir = tmpdir() end)
  after_each(function() rm(dir) end)

  local function step_dir(n) return ("%s/step-%08d"):format(dir, n) end

  it("keeps the best k by the monitored value and deletes others only after a new one is complete", function()
    local mc = cb.ModelCheckpoint{ dir = dir, monitor = "val_loss", keep_top_k = 2 }
    local checks = {}
    local spy = { name = "Spy",
      on_save_checkpoint = function(_, t)
        -- while step 3 is being written, step 1 (about to be evicted) is still there
        if t.state.step == 3 then checks.step1_during_save = exists(step_dir(1)) end
      end,
      on_checkpoint_saved = function(_, t, path)
        checks[#checks + 1] = t.state.step
        assert.is_true(exists(path .. "/manifest.json"))
      end }
    local trainer = trainer_with{ engine = scripted{ 5, 3, 4, 2, 6, 2.5 }, max_steps = 6, val_every_n_steps = 1,
      val_batches = 1, callbacks = { spy, mc } }
    trainer:fit(T.fake_data{ batches = 10 }, T.fake_data{ batches = 1 })
    -- 6 (step 5) would not enter the top 2, so it was never saved
    assert.same({ 1, 2, 3, 4, 6 }, { table.unpack(checks, 1, 5) })
    assert.is_true(checks.step1_during_save)
    for n = 1, 6 do
      assert.equal(n == 4 or n == 6, exists(step_dir(n)), "step " .. n)
    end
    assert.equal(step_dir(4), mc:best_path())
    assert.same({ 2, 2.5 }, { mc.best[1].score, mc.best[2].score })
    assert.equal(step_dir(6), pg.checkpoint.latest(dir))
    local files = io.popen("ls -a '" .. dir .. "'"):read("a")
    assert.is_nil(files:find("tmp", 1, true), "no temporary directories left: " .. files)
  end)

  it("maximises with mode = 'max'", function()
    local mc = cb.ModelCheckpoint{ dir = dir, monitor = "val_loss", mode = "max", keep_top_k = 1 }
    trainer_with{ engine = scripted{ 1, 3, 2 }, max_steps = 3, val_every_n_steps = 1, val_batches = 1,
      callbacks = { mc } }:fit(T.fake_data{}, T.fake_data{ batches = 1 })
    assert.same({ false, true, false }, { exists(step_dir(1)), exists(step_dir(2)), exists(step_dir(3)) })
  end)

  it("without a monitor keeps the newest k, every n steps", function()
    local mc = cb.ModelCheckpoint{ dir = dir, every_n_steps = 2, keep_top_k = 2 }
    trainer_with{ max_steps = 7, callbacks = { mc } }:fit(T.fake_data{ batches = 10 })
    for n = 1, 7 do assert.equal(n == 4 or n == 6, exists(step_dir(n)), "step " .. n) end
  end)

  it("with save_last keeps the newest too and saves the final step at train end", function()
    local mc = cb.ModelCheckpoint{ dir = dir, every_n_steps = 2, monitor = "loss", mode = "max", keep_top_k = 1,
      save_last = true }
    -- the training loss falls, so the best (max) stays at step 2; last moves on
    trainer_with{ max_steps = 5, callbacks = { mc } }:fit(T.fake_data{ batches = 10 })
    for n = 1, 5 do assert.equal(n == 2 or n == 5, exists(step_dir(n)), "step " .. n) end
    assert.same({ step_dir(5), 5 }, { mc.last.path, mc.last.step })
    assert.equal(step_dir(5), pg.checkpoint.latest(dir))
  end)

  it("with keep_last keeps the newest n (and the best k), deleting older ones after a new one is complete", function()
    local during = {}
    local spy = { name = "Spy", on_save_checkpoint = function(_, t)
      during[t.state.step] = exists(step_dir(t.state.step - 2)) end }
    local mc = cb.ModelCheckpoint{ dir = dir, every_n_steps = 1, keep_last = 2 }
    trainer_with{ max_steps = 5, callbacks = { spy, mc } }:fit(T.fake_data{ batches = 10 })
    for n = 1, 5 do assert.equal(n >= 4, exists(step_dir(n)), "step " .. n) end
    assert.is_true(during[3] and during[4] and during[5], "the oldest was still there while the next was written")
    assert.same({ step_dir(5), step_dir(4) }, { mc.recent[1].path, mc.recent[2].path })
    -- with a monitor: the best (max loss: step 1) stays as well
    rm(dir)
    local best = cb.ModelCheckpoint{ dir = dir, every_n_steps = 1, monitor = "loss", mode = "max", keep_last = 2 }
    trainer_with{ max_steps = 5, callbacks = { best } }:fit(T.fake_data{ batches = 10 })
    for n = 1, 5 do assert.equal(n == 1 or n >= 4, exists(step_dir(n)), "step " .. n) end
    assert.has_error(function() cb.ModelCheckpoint{ keep_last = -1 } end,
      "pg.callbacks.ModelCheckpoint: keep_last must be a non-negative integer, got -1")
  end)

  it("is restored on resume, including the checkpoint it resumed from", function()
    local function run(steps, resume)
      local mc = cb.ModelCheckpoint{ dir = dir, every_n_steps = 1, monitor = "loss", keep_top_k = 2 }
      trainer_with{ max_steps = steps, callbacks = { mc } }:fit(T.fake_data{ batches = 10 }, nil,
        resume and { resume = "last" })
      return mc
    end
    run(3)
    local mc = run(5, true)
    -- the loss falls: the two newest are the best; steps 1-3 are gone
    assert.same({ step_dir(5), step_dir(4) }, { mc.best[1].path, mc.best[2].path })
    for n = 1, 5 do assert.equal(n >= 4, exists(step_dir(n)), "step " .. n) end
  end)

  it("rejects bad options", function()
    assert.has_error(function() cb.ModelCheckpoint{ mode = "lowest" } end,
      "pg.callbacks.ModelCheckpoint: mode must be 'min' or 'max', got 'lowest'")
    assert.has_error(function() cb.ModelCheckpoint{ keep_top = 3 } end,
      "pg.callbacks.ModelCheckpoint: unknown option 'keep_top' (did you mean 'keep_top_k'?)")
  end)
end)

describe("pg.callbacks.Timer", function()
  it("stops at the end of the step where the duration is reached (injected clock)", function()
    -- the clock advances 1 s per reading: start 0, then one reading per step
    local timer = cb.Timer{ duration = "00:00:03", clock = T.manual_clock(0, 1) }
    local trainer = trainer_with{ max_steps = 100, callbacks = { timer } }
    local st = trainer:fit(T.fake_data{ batches = 100 })
    assert.same({ 3, "should_stop", 3 }, { st.step, st.stop_reason, timer.stopped_step })
    assert.matches("Timer: 3 s of training reached the duration 3 s; stopping after step 3", trainer.out:text())
  end)

  it("counts time from before a resume", function()
    local timer = cb.Timer{ duration = 10, clock = T.manual_clock(0, 1) }
    timer:load_state_dict{ elapsed = 8 }
    local st = trainer_with{ max_steps = 100, callbacks = { timer } }:fit(T.fake_data{ batches = 100 })
    assert.equal(2, st.step)
    assert.same({ elapsed = 11 }, timer:state_dict()) -- 8 + the reading after the stop
  end)

  it("parses durations and rejects bad ones", function()
    assert.equal(90, cb.Timer.parse_duration("00:01:30"))
    assert.equal(86400 + 3600, cb.Timer.parse_duration("1:01:00:00"))
    assert.has_error(function() cb.Timer{ duration = "soon" } end,
      "pg.callbacks.Timer: duration must be positive seconds or \"HH:MM:SS\", got 'soon'")
  end)
end)

describe("pg.callbacks.GradientAccumulationScheduler", function()
  it("changes the accumulation factor from the given step on", function()
    local engine = T.fake_engine{}
    local trainer = pg.Trainer{ engine = engine, optimizer = T.fake_optimizer(engine), max_steps = 5, out = T.capture(),
      callbacks = { cb.GradientAccumulationScheduler{ [3] = 2 } } }
    local st = trainer:fit(T.fake_data{ batches = 100 })
    -- steps 1-3 take one batch each; once 3 steps are done, two per step
    assert.same({ 1, 1, 1, 0.5, 0.5, 0.5, 0.5 }, engine.grad_scales)
    assert.same({ 5, 7, 2 }, { st.step, st.micro_batches, st.accumulate })
  end)

  it("rejects bad schedules", function()
    assert.has_error(function() cb.GradientAccumulationScheduler{ [2] = 0 } end,
      "pg.callbacks.GradientAccumulationScheduler: the factor at step 2 must be a positive integer, got 0")
    assert.has_error(function() cb.GradientAccumulationScheduler{ later = 2 } end,
      "pg.callbacks.GradientAccumulationScheduler: a key must be a step number >= 0, got 'later'")
  end)
end)

describe("pg.callbacks.TextSampler", function()
  it("decodes greedy samples to text and keeps the last one", function()
    for _, tensors in ipairs{ false, true } do
      local ts = cb.TextSampler{ every_n_steps = 2, prompt = "Hello", tokens = 5 }
      local trainer = trainer_with{ engine = { tensors = tensors }, max_steps = 4, callbacks = { ts } }
      trainer:fit(T.fake_data{ batches = 10 })
      -- the fake model continues every byte with the next one: "o" -> "pqrst"
      assert.equal("Hellopqrst", ts.sample)
      assert.equal(4, ts.sample_step)
      assert.equal("TextSampler step 2: Hellopqrst\nTextSampler step 4: Hellopqrst\n", trainer.out:text())
      assert.same({ rng = 0, sample = "Hellopqrst", sample_step = 4 }, ts:state_dict())
    end
  end)

  it("uses a custom decode and keeps only seq_len ids of context", function()
    local ts = cb.TextSampler{ every_n_steps = 1, prompt = "abcdefgh", tokens = 3,
      decode = function(ids) return "|" .. table.concat(ids, ",") end }
    trainer_with{ engine = { seq_len = 4 }, max_steps = 1, callbacks = { ts } }:fit(T.fake_data{})
    assert.equal("abcdefgh|105,106,107", ts.sample)
  end)

  it("samples with temperature from a seeded generator: same seed, same text", function()
    local function sample(seed)
      local ts = cb.TextSampler{ every_n_steps = 1, prompt = "a", tokens = 12, temperature = 5, print = false }
      trainer_with{ seed = seed, max_steps = 1, callbacks = { ts } }:fit(T.fake_data{})
      return ts.sample
    end
    local a, b, c = sample(1), sample(1), sample(2)
    assert.equal(a, b)
    assert.equal(13, #a:gsub("\xEF\xBF\xBD", "?")) -- one character per id (ids < 256)
    assert.not_equal(a, c)
    -- at temperature 5 the fake's preferred byte has probability e^2/(e^2+255) < 3%
    assert.not_equal("abcdefghijklm", a)
  end)

  it("samples on every rank and prints on rank 0 only", function()
    for rank = 0, 1 do
      local ts = cb.TextSampler{ every_n_steps = 1, prompt = "x", tokens = 1 }
      local trainer = trainer_with{ engine = { rank = rank, world_size = 2 }, max_steps = 1, callbacks = { ts } }
      trainer:fit(T.fake_data{})
      assert.equal("xy", ts.sample)
      assert.equal(1, trainer.engine.calls.forward)
      assert.equal(rank == 0 and "TextSampler step 1: xy\n" or "", trainer.out:text())
    end
  end)
end)

describe("pg.callbacks.LearningRateMonitor", function()
  it("publishes the step's lr as a metric before the loggers run, whatever the order", function()
    local dir = tmpdir()
    local lrm = cb.LearningRateMonitor{}
    trainer_with{ max_steps = 3, log_every_n_steps = 1, out_dir = dir, lr_schedule = function(s) return s / 10 end,
      callbacks = { cb.MetricsLogger{}, lrm } }:fit(T.fake_data{})
    local lines = read_lines(dir .. "/metrics.jsonl")
    assert.equal(3, #lines)
    for i, line in ipairs(lines) do
      assert.near(i / 10, cjson.decode(line).lr, 1e-12)
    end
    assert.same({ { step = 1, lr = 0.1 }, { step = 2, lr = 0.2 }, { step = 3, lr = 0.3 } }, lrm.history)
    rm(dir)
  end)
end)

describe("pg.callbacks.ProgressBar", function()
  -- batch 2 x 16 tokens; the clock reads 0 at fit start and +10 s per reading
  local function run(bar)
    local trainer = trainer_with{ max_steps = 4, log_every_n_steps = 2, val_every_n_steps = 4,
      clock = T.manual_clock(0, 10), callbacks = { bar } }
    trainer:fit(T.fake_data{ batches = 10, batch = 2, seq_len = 16 }, T.fake_data{ batches = 1 })
    return trainer.out:text()
  end

  it("prints plain lines: step/total, loss, lr, tokens/s, ETA", function()
    local text = run(cb.ProgressBar{ tty = false })
    local lines = {}
    for l in text:gmatch("[^\n]+") do lines[#lines + 1] = l end
    assert.equal(3, #lines)
    -- step 2: 64 tokens in 20 s = 3.2 tok/s; 10 s per step, 2 steps left
    assert.matches("^step 2/4 | loss %d%.%d%d%d%d | lr 5%.00e%-01 | 3 tok/s | ETA 20s$", lines[1])
    assert.matches("^step 4/4 | loss %d%.%d%d%d%d | lr 5%.00e%-01 | 3 tok/s | ETA 0s$", lines[2])
    assert.matches("^step 4 | val_loss %d%.%d%d%d%d$", lines[3])
  end)

  it("rewrites one line with \\r on a terminal and ends it before other output", function()
    local text = run(cb.ProgressBar{ tty = true })
    assert.matches("^\rstep 2/4 [^\n]*\rstep 4/4 [^\n]*\nstep 4 | val_loss [%d.]+\n$", text)
  end)

  it("shows the tokens/s of the steps since its previous line, without the time in validation and saves", function()
    -- 8 x 64 = 512 tokens per step; steps 1-2 take 10 s each, later ones 20 s;
    -- every validation takes 1000 s and every checkpoint save 500 s
    local dir = tmpdir()
    local clock = T.manual_clock(0, 0)
    local cost = cb.LambdaCallback{
      on_before_optimizer_step = function(t) clock.t = clock.t + (t.state.step < 2 and 10 or 20) end,
      on_validation_batch_end = function() clock.t = clock.t + 1000 end,
      on_save_checkpoint = function() clock.t = clock.t + 500 end,
    }
    local trainer = trainer_with{ max_steps = 6, log_every_n_steps = 2, val_every_n_steps = 2, val_batches = 1,
      clock = clock, callbacks = { cost, cb.ModelCheckpoint{ dir = dir, every_n_steps = 2 }, cb.ProgressBar{ tty = false } } }
    local st = trainer:fit(T.fake_data{ batches = 10, batch = 8, seq_len = 64 }, T.fake_data{ batches = 1 })
    local rates = {}
    for r in trainer.out:text():gmatch("| (%d+) tok/s |") do rates[#rates + 1] = r end
    -- step 2: 1024 tokens in 20 s; steps 3-4 and 5-6: 1024 tokens in 40 s
    assert.same({ "51", "26", "26" }, rates)
    assert.equal(20 + 40 + 40, st.train_elapsed)
    assert.equal(100 + 2 * 1500, st.elapsed) -- the step-6 validation and save come after the last step's end
    assert.near(6 * 512 / 3100, st.metrics.tokens_per_s, 1e-12) -- the fit's average is unchanged
    rm(dir)
  end)

  it("prints plain lines under Open MPI's mpirun unless mpirun's stdout is a terminal or $PG_PROGRESS says tty",
    function()
    local function env(t) return function(k) return t[k] end end
    local function tty() return true end
    local function pipe() return false end
    local default = cb.ProgressBar.default_tty
    -- Open MPI gives a rank's stdout a pseudo-terminal even when mpirun's output is a file: mpirun's own decides
    assert.is_false(default(env{ OMPI_COMM_WORLD_SIZE = "2" }, tty, pipe))
    assert.is_true(default(env{ OMPI_COMM_WORLD_SIZE = "2" }, pipe, tty))
    assert.is_false(default(env{ OMPI_COMM_WORLD_SIZE = "2" }, tty, false))
    assert.is_true(default(env{ OMPI_COMM_WORLD_SIZE = "2", PG_PROGRESS = "tty" }, pipe, pipe))
    assert.is_false(default(env{ OMPI_COMM_WORLD_SIZE = "2", PG_PROGRESS = "plain" }, tty, tty))
    assert.is_false(default(env{ PG_PROGRESS = "plain" }, tty))
    assert.is_true(default(env{}, tty))
    assert.is_false(default(env{}, pipe))
    assert.is_true(default(env{ TERM = "xterm" }, false))
    assert.is_false(default(env{ TERM = "dumb" }, false))
  end)

  it("formats numbers and durations", function()
    assert.same({ "950", "12.3k", "4.50M" }, { cb.ProgressBar.human(950), cb.ProgressBar.human(12345),
      cb.ProgressBar.human(4.5e6) })
    assert.same({ "45s", "2m13s", "1h02m", "?" }, { cb.ProgressBar.duration(45), cb.ProgressBar.duration(133),
      cb.ProgressBar.duration(3720), cb.ProgressBar.duration(nil) })
  end)
end)

describe("pg.callbacks.MetricsLogger", function()
  local dir
  before_each(function() dir = tmpdir() end)
  after_each(function() rm(dir) end)

  it("writes one JSON line per logged step and per validation", function()
    local trainer = trainer_with{ max_steps = 6, log_every_n_steps = 2, val_every_n_steps = 3, out_dir = dir,
      callbacks = { cb.MetricsLogger{} } }
    trainer:fit(T.fake_data{ batches = 10 }, T.fake_data{ batches = 1 })
    local kinds = {}
    for _, line in ipairs(read_lines(dir .. "/metrics.jsonl")) do
      local r = cjson.decode(line)
      kinds[#kinds + 1] = r.kind .. math.tointeger(r.step)
      if r.kind == "train" then
        assert.is_number(r.loss)
        assert.is_number(r.grad_norm)
        assert.is_nil(r.val_loss)
      else
        assert.is_number(r.val_loss)
      end
    end
    assert.same({ "train2", "val3", "train4", "train6", "val6" }, kinds)
  end)

  it("writes CSV with a header, and appends when a fit resumes", function()
    local path = dir .. "/m.csv"
    local function run(steps, resume, overwrite)
      trainer_with{ max_steps = steps, log_every_n_steps = 1, out_dir = dir, overwrite = overwrite,
        callbacks = { cb.MetricsLogger{ path = path, columns = { "kind", "step", "loss" } },
          cb.ModelCheckpoint{ every_n_steps = 2 } } }
        :fit(T.fake_data{ batches = 10 }, nil, resume and { resume = "last" } or nil)
    end
    run(2)
    run(3, true)
    local lines = read_lines(path)
    assert.equal("kind,step,loss", lines[1])
    assert.equal(4, #lines)
    for i = 2, 4 do assert.matches("^train," .. (i - 1) .. ",%d%.%d+$", lines[i]) end
    run(1, false, true) -- a fresh run (over the old one's checkpoints: overwrite = true) truncates
    assert.equal(2, #read_lines(path))
  end)
end)

describe("the built-ins' options", function()
  it("are checked by pipegoose.options: the option, what it must be, what it got, in key order", function()
    for _, c in ipairs{
      { cb.EarlyStopping, { patience = 0 }, "pg.callbacks.EarlyStopping: patience must be a positive integer, got 0" },
      { cb.EarlyStopping, { min_delta = -1 }, "pg.callbacks.EarlyStopping: min_delta must be a number >= 0, got -1" },
      { cb.EarlyStopping, { mode = "max", patience = 1.5, every_n_steps = 0 },
        "pg.callbacks.EarlyStopping: every_n_steps must be a positive integer, got 0" }, -- e before p
      { cb.ModelCheckpoint, { keep_top_k = -2 }, "pg.callbacks.ModelCheckpoint: keep_top_k must be an integer >= -1, got -2" },
      { cb.ModelCheckpoint, { dir = 5 }, "pg.callbacks.ModelCheckpoint: dir must be a string path, got 5" },
      { cb.ModelCheckpoint, { every_n_steps = 0 }, "pg.callbacks.ModelCheckpoint: every_n_steps must be a positive integer, got 0" },
      { cb.MetricsLogger, { format = "xml" }, "pg.callbacks.MetricsLogger: format must be 'jsonl' or 'csv', got 'xml'" },
      { cb.ProgressBar, { every_n_steps = 2.5 }, "pg.callbacks.ProgressBar: every_n_steps must be a positive integer, got 2.5" },
      { cb.TextSampler, { prompt = "" }, "pg.callbacks.TextSampler: prompt must be a non-empty string, got ''" },
      { cb.TextSampler, { tokens = 0 }, "pg.callbacks.TextSampler: tokens must be a positive integer, got 0" },
      { cb.TextSampler, { temperature = -1 }, "pg.callbacks.TextSampler: temperature must be a number >= 0, got -1" },
      { cb.TextSampler, { top_k = 0 }, "pg.callbacks.TextSampler: top_k must be a positive integer, got 0" },
      { cb.TextSampler, { seed = 0.5 }, "pg.callbacks.TextSampler: seed must be an integer, got 0.5" },
      { cb.Timer, {}, "pg.callbacks.Timer: duration= is required (positive seconds or \"HH:MM:SS\")" },
      { cb.LearningRateMonitor, { nmae = "lr" }, "pg.callbacks.LearningRateMonitor: unknown option 'nmae' (did you mean 'name'?)" },
    } do
      assert.has_error(function() c[1](c[2]) end, c[3])
    end
    assert.has_error(function() cb.ProgressBar.new(5) end, "pg.callbacks.ProgressBar: expects a table of options, got 5")
    -- defaults, and integral floats as integers
    local ts = cb.TextSampler{ tokens = 4.0 }
    assert.same({ 100, 4, "integer", 0, "\n" }, { ts.every_n_steps, ts.tokens, math.type(ts.tokens), ts.temperature, ts.prompt })
    local es = cb.EarlyStopping{}
    assert.same({ 3, 0, "min", "val_loss" }, { es.patience, es.min_delta, es.mode, es.monitor })
    assert.equal("csv", cb.MetricsLogger{ path = "m.csv" }.format)
  end)

  it("name the user's line", function()
    for _, make in ipairs{
      function() local c = cb.ModelCheckpoint{ every_n_steps = 0 }; return c end,
      function() local c = cb.ModelCheckpoint.new{ every_n_steps = 0 }; return c end,
      function() local c = cb.GradientAccumulationScheduler{ [2] = 0 }; return c end,
      function() local c = cb.LambdaCallback{ on_train_ended = print }; return c end,
    } do
      local line = debug.getinfo(make, "S").linedefined
      local ok, e = pcall(make)
      assert.is_false(ok)
      assert.matches("^spec/unit/callbacks_spec%.lua:" .. line .. ": pg%.callbacks%.", e)
    end
  end)
end)
