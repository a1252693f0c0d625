-- pg.CallbackHandler driven alone (no Trainer): the checks at construction,
-- dispatch order, error attribution (also after a nested dispatch), guarded
-- calls, callback state.
local pg = require "pipegoose"
local Handler = pg.CallbackHandler

describe("pg.CallbackHandler", function()
  it("dispatches a hook to the callbacks that define it, in list order, with the trainer and the arguments", function()
    local calls = {}
    local function rec(tag) return function(_, trainer, ...) calls[#calls + 1] = { tag, trainer, ... } end end
    local a = pg.Callback{ name = "A", on_fit_start = rec("a"), on_train_batch_end = rec("a") }
    local b = pg.Callback{ name = "B", on_train_batch_end = rec("b") }
    local h = Handler{ a, b }
    local trainer = {}
    h:call(trainer, "on_train_batch_end", { loss = 1 }, 3)
    h:call(trainer, "on_fit_start")
    h:call(trainer, "teardown", "fit") -- no callback has it: nothing happens
    assert.equal(3, #calls)
    assert.same({ "a", "b", "a" }, { calls[1][1], calls[2][1], calls[3][1] })
    assert.equal(trainer, calls[1][2])
    assert.equal(3, calls[1][4])
    assert.same({ a, b }, h:callbacks_for("on_train_batch_end"))
    assert.same({ a, b }, h:list())
  end)

  it("refuses a non-hook name in call and callbacks_for, with the closest hook", function()
    local h = Handler{}
    assert.has_error(function() h:call({}, "on_fit_strat") end,
      "Trainer: call: 'on_fit_strat' is not a hook (did you mean 'on_fit_start'?)")
    assert.has_error(function() h:callbacks_for("on_fit_strat") end,
      "Trainer: callbacks_for: 'on_fit_strat' is not a hook (did you mean 'on_fit_start'?)")
  end)

  it("checks callbacks at construction: a list, valid callbacks, distinct state keys, one checkpoint directory", function()
    assert.has_error(function() Handler("x") end, "Trainer: callbacks must be a list of callbacks, got a string")
    assert.has_error(function() Handler{ x = 1 } end, "Trainer: callbacks must be a list (1..n), found key 'x'")
    local s1 = { name = "S", state_dict = function() return {} end }
    local s2 = { name = "S", state_dict = function() return {} end }
    local ok, err = pcall(Handler, { s1, s2 })
    assert.is_false(ok)
    assert.truthy(err:find("share state_key 'S'", 1, true))
    ok, err = pcall(Handler, { { checkpoint_dir = "a" }, { checkpoint_dir = "b" } })
    assert.is_false(ok)
    assert.truthy(err:find("different directories ('a', 'b')", 1, true))
    assert.equal("a", Handler{ { checkpoint_dir = "a" } }:checkpoint_dir())
    assert.is_nil(Handler{}:checkpoint_dir())
  end)

  it("names the hook and the callback of an error raised inside a hook, once", function()
    local h = Handler{ pg.Callback{ name = "Ok", on_fit_start = function() end },
                       pg.Callback{ name = "Bad", on_fit_start = function() error("boom", 0) end } }
    local ok, err = xpcall(function() h:call({}, "on_fit_start") end, function(e) return h:attribute(e) end)
    assert.is_false(ok)
    assert.equal("Trainer: on_fit_start of callback 2 (Bad) failed: boom", err)
    -- the running callback was forgotten: an error outside hooks is not attributed
    assert.equal("plain", h:attribute("plain"))
  end)

  it("names the outer hook and its callback when it fails after a hook it dispatched has returned", function()
    local h, inner = nil, {}
    local outer = pg.Callback{ name = "Outer", on_train_end = function(_, trainer)
      h:call(trainer, "on_save_checkpoint", {}, "path") -- nested, as a save from on_train_end dispatches it
      error("after the save", 0)
    end }
    local saver = pg.Callback{ name = "Inner", on_save_checkpoint = function(_, _, _, path) inner[#inner + 1] = path end }
    h = Handler{ outer, saver }
    local ok, err = xpcall(function() h:call({}, "on_train_end") end, function(e) return h:attribute(e) end)
    assert.is_false(ok)
    assert.same({ "path" }, inner, "the nested hook ran")
    assert.equal("Trainer: on_train_end of callback 1 (Outer) failed: after the save", err)
    -- an error inside the nested hook names the nested one
    h = Handler{ outer, pg.Callback{ name = "Inner", on_save_checkpoint = function() error("inside", 0) end } }
    ok, err = xpcall(function() h:call({}, "on_train_end") end, function(e) return h:attribute(e) end)
    assert.is_false(ok)
    assert.equal("Trainer: on_save_checkpoint of callback 2 (Inner) failed: inside", err)
  end)

  it("through the Trainer: ModelCheckpoint's on_train_end saves (its hooks run), then fails: the message names it", function()
    local dir = require("helpers").tmpdir()
    local engine = pg.testing.fake_engine()
    local mc = pg.callbacks.ModelCheckpoint{ dir = dir .. "/checkpoints", save_last = true, verbose = false }
    local save_end = mc.on_train_end
    mc.on_train_end = function(self, trainer)
      save_end(self, trainer)
      error("after the save", 0)
    end
    local saved = {}
    local spy = pg.Callback{ name = "Spy", on_save_checkpoint = function(_, t) saved[#saved + 1] = t.state.step end,
      on_checkpoint_saved = function(_, _, path) saved[#saved + 1] = path end }
    local t = pg.Trainer{ engine = engine, optimizer = pg.testing.fake_optimizer(engine), out = pg.testing.capture(),
      max_steps = 2, out_dir = dir, callbacks = { mc, spy } }
    local ok, err = pcall(t.fit, t, pg.testing.fake_data{ batches = 3 })
    os.execute("rm -rf '" .. dir .. "'")
    assert.is_false(ok)
    assert.same({ 2, dir .. "/checkpoints/step-00000002" }, saved, "the save from on_train_end ran its hooks")
    assert.equal("Trainer: on_train_end of callback 1 (ModelCheckpoint) failed: after the save", err)
  end)

  it("call_guarded runs every callback even when one fails, and reports failures on stderr", function()
    local ran = {}
    local h = Handler{ pg.Callback{ name = "A", teardown = function() error("first", 0) end },
                       pg.Callback{ name = "B", teardown = function() ran[#ran + 1] = "B" end } }
    local stderr, written = io.stderr, {}
    io.stderr = { write = function(_, s) written[#written + 1] = s end } -- luacheck: ignore
    local ok = pcall(h.call_guarded, h, {}, "teardown", "fit")
    io.stderr = stderr -- luacheck: ignore
    assert.is_true(ok)
    assert.same({ "B" }, ran)
    assert.equal("Trainer: teardown of callback 1 (A) failed while handling an error: first\n", table.concat(written))
  end)

  it("collects every stateful callback's state under its key and gives it back", function()
    local Counter = { }
    Counter.__index = Counter
    local function counter(key, n)
      return setmetatable({ state_key = key, n = n,
        state_dict = function(self) return { n = self.n } end,
        load_state_dict = function(self, s) self.n = s.n end }, Counter)
    end
    local a, b = counter("a", 1), counter("b", 2)
    local plain = pg.Callback{ name = "Plain", on_fit_start = function() end }
    local h = Handler{ a, plain, b }
    assert.same({ a = { n = 1 }, b = { n = 2 } }, h:state_dict())
    h:load_state_dict({ a = { n = 10 }, other = { n = 5 } })
    assert.equal(10, a.n)
    assert.equal(2, b.n) -- no saved state: left alone
    assert.has_error(function() h:load_state_dict(nil) end,
      "Trainer: load_state_dict: expects a table {[state_key] = state}, got a nil")
  end)

  it("calls a module after the callbacks and a DataModule before them (set_module / set_datamodule), names them, keeps their state", function()
    local calls = {}
    local M = pg.TrainingModule:extend("Classifier")
    function M:on_fit_start(...) calls[#calls + 1] = { "module", self, ... } end
    function M:teardown(stage) calls[#calls + 1] = { "module teardown", stage } end
    function M:state_dict() return { n = self.n } end
    function M:load_state_dict(s) self.n = s.n end
    local D = pg.DataModule:extend("Shards")
    function D:teardown(stage) calls[#calls + 1] = { "datamodule teardown", stage } end
    function D:state_dict() return { shard = 1 } end
    local cb = pg.Callback{ name = "A", on_fit_start = function(_, t) calls[#calls + 1] = { "callback", t } end,
      teardown = function(_, _, stage) calls[#calls + 1] = { "callback teardown", stage } end }
    local h, trainer, m = Handler{ cb }, {}, M{ n = 3 }
    h:set_module(m)
    h:set_datamodule(D{})
    h:call(trainer, "on_fit_start", "x")
    h:call(trainer, "teardown", "fit")
    assert.same({ { "callback", trainer }, { "module", m, "x" }, { "datamodule teardown", "fit" },
                  { "callback teardown", "fit" }, { "module teardown", "fit" } }, calls)
    assert.same({ cb }, h:callbacks_for("on_fit_start")) -- callbacks only
    assert.same({ TrainingModule = { n = 3 }, DataModule = { shard = 1 } }, h:state_dict())
    h:load_state_dict({ TrainingModule = { n = 9 } })
    assert.equal(9, m.n)
    function m:on_fit_start() error("boom", 0) end
    h:set_module(m) -- the call lists are built when a module is set
    local ok, err = xpcall(function() h:call(trainer, "on_fit_start") end, function(e) return h:attribute(e) end)
    assert.is_false(ok)
    assert.equal("Trainer: on_fit_start of the TrainingModule (Classifier) failed: boom", err)
    h:set_module(nil)
    h:set_datamodule(nil)
    calls = {}
    h:call(trainer, "teardown", "fit")
    assert.same({ { "callback teardown", "fit" } }, calls)
    assert.same({}, h:state_dict())
  end)

  it("is what the Trainer dispatches through; its public checkpoint methods refuse wrong arguments", function()
    local engine = pg.testing.fake_engine()
    local seen = {}
    local t = pg.Trainer{ engine = engine, optimizer = pg.testing.fake_optimizer(engine), out = pg.testing.capture(),
      callbacks = { pg.Callback{ name = "C", on_load_checkpoint = function(_, tr, m) seen[#seen + 1] = { tr, m } end } } }
    assert.equal("CallbackHandler", getmetatable(t.callback_handler).__name)
    t:call_hook("on_load_checkpoint", "m")
    assert.equal(1, #seen)
    assert.is_true(seen[1][1] == t) -- the trainer (as callbacks see it: its state read-only)
    assert.equal("m", seen[1][2])
    assert.has_error(function() t:call_hook("on_load_checkpiont") end,
      "Trainer: call_hook: 'on_load_checkpiont' is not a hook (did you mean 'on_load_checkpoint'?)")
    assert.has_error(function() t:restore_counters(nil) end,
      "Trainer: restore_counters: expects the table counters() returned, got a nil")
    assert.has_error(function() t:load_lr_state(7) end,
      "Trainer: load_lr_state: expects the table lr_state() returned, got a number")
    local c = t:counters()
    c.step, c.tokens_seen = 5, 40
    t:restore_counters(c)
    assert.same({ 5, 40 }, { t.state.step, t.state.tokens_seen })
    t:load_lr_state{ base_lr = 0.1, last_lr = 0.05, schedule_step = 5, total_steps = 9 }
    local lr = t:lr_state() -- total_steps: this fit's horizon, settled when fit starts (lr_horizon)
    assert.same({ 0.1, 0.05, 5 }, { lr.base_lr, lr.last_lr, lr.schedule_step })
  end)
end)
