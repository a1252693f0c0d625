-- The Trainer's guards against a run that would lose what a user saved or
-- go on silently with something wrong: a fresh fit into a directory that
-- holds another run's checkpoints, a training_step that never runs backward,
-- a non-finite validation metric, a callback that writes trainer.state.
local pg = require "pipegoose"
local T = pg.testing
local h = require "helpers"

local function build(o)
  o = o or {}
  local engine = T.fake_engine(o.engine)
  local opt = T.fake_optimizer(engine, o.optimizer or { lr = 0.5 })
  local data = T.fake_data(o.data or { batches = 4 })
  local topts = { engine = engine, optimizer = opt, out = T.capture() }
  for k, v in pairs(o) do
    if k ~= "engine" and k ~= "optimizer" and k ~= "data" then topts[k] = v end
  end
  return pg.Trainer(topts), engine, opt, data
end

local function saving_run(dir, extra, fit_opts)
  local o = { max_steps = 2, out_dir = dir, callbacks = { pg.callbacks.ModelCheckpoint{ every_n_steps = 1 } } }
  for k, v in pairs(extra or {}) do o[k] = v end
  local trainer, _, _, data = build(o)
  return trainer:fit(data, nil, fit_opts)
end

describe("a fresh fit into a used checkpoint directory", function()
  local dir
  before_each(function() dir = h.tmpdir() end)
  after_each(function() h.rm(dir) end)

  it("refuses, naming the directory and how to go on; the old checkpoints are untouched", function()
    saving_run(dir)
    local ckdir = dir .. "/checkpoints"
    local before = pg.checkpoint.fs.read(ckdir .. "/step-00000002/manifest.json")
    local ok, err = pcall(saving_run, dir, { max_steps = 3 })
    assert.is_false(ok)
    assert.equal("Trainer: " .. ckdir .. " already holds checkpoints (step-00000001, step-00000002) of another run; "
      .. "a fresh fit would write over them: pass fit(..., { resume = \"last\" }) to continue that run, overwrite = "
      .. "true (pg.Trainer{ overwrite = true }) to write over it, or another out_dir", err)
    assert.equal(before, pg.checkpoint.fs.read(ckdir .. "/step-00000002/manifest.json"))
    assert.equal("step-00000002", (pg.checkpoint.fs.read(ckdir .. "/latest"):gsub("%s+$", "")))
    -- the refused fit released its locks: a resume in the same directory runs
    local st = saving_run(dir, { max_steps = 3 }, { resume = "last" })
    assert.equal(3, st.step)
  end)

  it("allows overwrite = true, and a directory with no checkpoint", function()
    saving_run(dir)
    assert.equal(2, saving_run(dir, { overwrite = true }).step)
    local fresh = dir .. "/other"
    pg.checkpoint.fs.mkdir_p(fresh .. "/checkpoints/notes")
    assert.equal(2, saving_run(fresh).step)
    assert.has_error(function() build{ overwrite = "yes" } end, "Trainer: overwrite must be a boolean, got 'yes'")
  end)

  it("checks a ModelCheckpoint's own directory too", function()
    local ck = dir .. "/mine"
    local function run(o)
      local trainer, _, _, data = build{ max_steps = 1, out_dir = dir .. "/o",
        callbacks = { pg.callbacks.ModelCheckpoint{ dir = ck, every_n_steps = 1 } }, overwrite = o }
      return trainer:fit(data)
    end
    run()
    assert.has_error(function() run() end, "Trainer: " .. ck .. " already holds checkpoints (step-00000001) of "
      .. "another run; a fresh fit would write over them: pass fit(..., { resume = \"last\" }) to continue that run, "
      .. "overwrite = true (pg.Trainer{ overwrite = true }) to write over it, or another out_dir")
    assert.equal(1, run(true).step)
  end)
end)
