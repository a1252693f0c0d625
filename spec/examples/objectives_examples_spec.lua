-- examples/classify.lua and examples/distill.lua run to the end and report
-- what they promise: classify's last line is `val_accuracy <v>`, above
-- chance with its defaults (a seeded, deterministic run: 0.73 on 3 classes
-- when written; chance 0.33); distill's are the teacher's and the student's
-- validation losses. Layouts other than one rank are run short: the specs of
-- the objectives themselves check exactness (spec/dist/objectives_spec.lua).
local pg = require "pipegoose"
local h = require "helpers"

local function last_line(out) return out:match("([^\n]+)\n*$") end

describe("examples/classify.lua", function()
  it("fine-tunes a classifier on fortunes and ends with val_accuracy above chance", function()
    local rc, out = h.sh(h.pglua_cmd{ "examples/classify.lua" })
    assert.equal(0, rc, out)
    local acc = tonumber(last_line(out):match("^val_accuracy (%S+)$"))
    assert.is_not_nil(acc, out)
    assert.is_true(acc > 1 / 3 + 0.15, out)
  end)

  it("runs under mpirun with tensor parallelism", function()
    local rc, out = h.sh(h.mpirun_cmd(2, { "examples/classify.lua", "--tensor=2", "--steps=10", "--eval-every=10" }, 120))
    assert.equal(0, rc, out)
    assert.truthy(last_line(out):match("^val_accuracy [%d.]+$"), out)
  end)
end)

describe("examples/distill.lua", function()
  local dir = h.tmpdir()
  pg.fs.mkdir_p(dir)
  teardown(function() h.rm(dir) end)
  local train, val = dir .. "/train.bin", dir .. "/val.bin"
  local ids = {}
  for i = 1, 4096 do ids[i] = (i * 37 + i // 7) % 200 + 10 end
  pg.data.write_shard(train, pg.tensor(ids, { dtype = "int32" }))
  pg.data.write_shard(val, pg.tensor(ids, { dtype = "int32" }))
  local short = { "--train=" .. train, "--val=" .. val, "--teacher-steps=3", "--steps=3", "--batch=4", "--seq-len=16",
                  "--val-batches=1", "--teacher-dim=32", "--teacher-layers=1", "--dim=16", "--layers=1" }

  it("trains a teacher, distils it into a student and reports both validation losses", function()
    local args = { "examples/distill.lua" }
    for _, a in ipairs(short) do args[#args + 1] = a end
    local rc, out = h.sh(h.pglua_cmd(args))
    assert.equal(0, rc, out)
    assert.truthy(out:match("\nteacher_val_loss [%d.]+\nstudent_val_loss [%d.]+\n*$"), out)
  end)

  it("runs under mpirun with tensor and pipeline parallelism", function()
    local args = { "examples/distill.lua", "--tensor=2", "--pipeline=2", "--micro-batches=2" }
    for _, a in ipairs(short) do args[#args + 1] = a end
    local rc, out = h.sh(h.mpirun_cmd(4, args, 120))
    assert.equal(0, rc, out)
    assert.truthy(out:match("student_val_loss [%d.]+"), out)
  end)

  it("says how to make the corpus when it is missing", function()
    local rc, out = h.sh(h.pglua_cmd{ "examples/distill.lua", "--train=" .. dir .. "/none.bin" })
    assert.equal(1, rc)
    assert.truthy(out:find("none.bin is missing: run ./pglua scripts/prepare_corpus.lua", 1, true), out)
  end)
end)
