-- Checkpoints across separate mpirun jobs of examples/train_gpt.lua (two
-- ranks, data=2 with ZeRO-1, a tiny model): a rank SIGKILLed in the middle
-- of a save leaves the previous checkpoint intact, verified and resumable,
-- and the resumed run ends bitwise where the uninterrupted one does; a
-- corrupt checkpoint ends a resume with exit 1 and the message on every rank;
-- scripts/checkpoint.lua's commands on one process.
local pg = require "pipegoose"
local h = require "helpers"
local ckpt = pg.checkpoint
local st = require "pipegoose.safetensors"
local cjson = require "cjson"

local root = os.tmpname()
os.remove(root)
os.execute("mkdir -p '" .. root .. "'")

local function write_tokens(path, n, seed)
  local ids, x = {}, seed
  for i = 1, n do
    x = (x * 1103515245 + 12345) % 2147483648
    ids[i] = (x >> 8) % 256
  end
  pg.data.write_shard(path, ids)
end
write_tokens(root .. "/train.bin", 8000, 7)
write_tokens(root .. "/val.bin", 2000, 9)

local ARGS = { "--train=" .. root .. "/train.bin", "--val=" .. root .. "/val.bin", "--dim=32", "--layers=2",
  "--heads=4", "--seq-len=16", "--batch=8", "--steps=12", "--eval-every=6", "--val-batches=2", "--log-every=1",
  "--sample=4", "--warmup=3", "--ckpt-every=5", "--data=2", "--zero=1" }

-- train_gpt.lua on 2 ranks with extra arguments and environment; returns rc, output.
local function train(extra, env)
  local args = { "examples/train_gpt.lua" }
  for _, a in ipairs(ARGS) do args[#args + 1] = a end
  for _, a in ipairs(extra) do args[#args + 1] = a end
  local pre, xs = "", ""
  for k, v in pairs(env or {}) do
    pre = pre .. k .. "=" .. h.quote(v) .. " "
    xs = xs .. " -x " .. k
  end
  -- hang guard only (a job takes a few seconds)
  local cmd = ("%stimeout -k 5 120 scripts/mpirun.sh -x PG_ABORT_GRACE -x PG_PROGRESS%s -np 2 %s"):format(pre, xs,
    h.pglua_cmd(args))
  return h.sh("PG_PROGRESS=plain " .. cmd)
end

local function tool(...)
  return h.sh(h.pglua_cmd{ "scripts/checkpoint.lua", ... })
end

-- metrics.jsonl records of kind "train" by step (the last one of a step wins:
-- a resumed run appends after the killed run's records)
local function train_records(path)
  local out = {}
  for line in io.lines(path) do
    local r = cjson.decode(line)
    if r.kind == "train" then out[math.tointeger(r.step)] = line:match('"loss":([^,}]+)') end
  end
  return out
end

local function manifest(dir) return ckpt.read_manifest(dir) end

local function crcs(dir)
  local out = {}
  for _, f in ipairs(manifest(dir).tensor_state.files) do out[f.file] = f.crc32 end
  return out
end

describe("train_gpt.lua across jobs", function()
  local A, B = root .. "/a", root .. "/b"
  local rc_a, out_a = train{ "--out=" .. A }
  local rc_b, out_b = train({ "--out=" .. B }, { PG_CHECKPOINT_TEST_KILL = "10:1" })
  local after_kill = ckpt.fs.list(B .. "/checkpoints")
  local latest_after_kill = ckpt.latest(B .. "/checkpoints")
  local rc_v, out_v = tool("verify", B .. "/checkpoints/step-00000005")
  local rc_c, out_c = train{ "--out=" .. B, "--resume=last" }

  it("SIGKILL of rank 1 in the step-10 save leaves step 5 as the latest complete checkpoint, verified", function()
    assert.equal(0, rc_a, out_a)
    assert.not_equal(0, rc_b, "the killed job failed")
    assert.matches("rank 1 kills itself in the save at step 10", out_b, 1, true)
    assert.equal(B .. "/checkpoints/step-00000005", latest_after_kill)
    -- the interrupted save: a temporary directory with some files and no manifest
    assert.equal(3, #after_kill, table.concat(after_kill, " "))
    assert.same({ "latest", "step-00000005" }, { after_kill[1], after_kill[2] })
    assert.matches("^step%-00000010%.tmp%-%d+$", after_kill[3])
    assert.is_false(ckpt.fs.exists(B .. "/checkpoints/" .. after_kill[3] .. "/manifest.json"))
    assert.equal(0, rc_v, out_v)
    assert.matches("OK: " .. B .. "/checkpoints/step-00000005 (step 5): the manifest and 3 files", out_v, 1, true)
  end)

  it("resumes from 'last' at step 5 and cleans up the leftover temporary directory", function()
    assert.equal(0, rc_c, out_c)
    assert.matches("Trainer: resumed from " .. B .. "/checkpoints/step-00000005 at step 5 (epoch 0)", out_c, 1, true)
    assert.same({ "latest", "step-00000005", "step-00000010", "step-00000012" }, ckpt.fs.list(B .. "/checkpoints"))
  end)

  it("continues bitwise: the same losses for steps 6-12 and the same final files as the uninterrupted job", function()
    local want, got = train_records(A .. "/metrics.jsonl"), train_records(B .. "/metrics.jsonl")
    for s = 6, 12 do assert.equal(want[s], got[s], "loss at step " .. s) end
    -- the files hold the parameters and AdamW state byte for byte: equal crc32 means equal bits
    local a, b = crcs(A .. "/checkpoints/step-00000012"), crcs(B .. "/checkpoints/step-00000012")
    assert.same(a, b)
    local n = 0
    for _ in pairs(a) do n = n + 1 end
    assert.equal(3, n) -- params-tp0-pp0, optim-tp0-pp0-dp0, optim-tp0-pp0-dp1
  end)

  it("stopped cleanly with --stop-after=6 (a checkpoint of step 6) and resumed, ends bitwise the same", function()
    local D = root .. "/d"
    local rc1, out1 = train{ "--out=" .. D, "--stop-after=6" }
    assert.equal(0, rc1, out1)
    assert.equal(D .. "/checkpoints/step-00000006", ckpt.latest(D .. "/checkpoints"))
    local rc2, out2 = train{ "--out=" .. D, "--resume=last" }
    assert.equal(0, rc2, out2)
    assert.matches("resumed from " .. D .. "/checkpoints/step-00000006 at step 6", out2, 1, true)
    local want, got = train_records(A .. "/metrics.jsonl"), train_records(D .. "/metrics.jsonl")
    for s = 1, 12 do assert.equal(want[s], got[s], "loss at step " .. s) end
    assert.same(crcs(A .. "/checkpoints/step-00000012"), crcs(D .. "/checkpoints/step-00000012"))
  end)

  it("a corrupt checkpoint ends the resume with exit 1, the message on every rank, and nothing written", function()
    local C = root .. "/c"
    os.execute(("mkdir -p '%s' && cp -r '%s/checkpoints' '%s/'"):format(C, A, C))
    local file = C .. "/checkpoints/step-00000012/optim-tp0-pp0-dp1.safetensors"
    local f = io.open(file, "r+b")
    f:seek("set", 2000)
    local byte = f:read(1)
    f:seek("set", 2000)
    f:write(string.char(byte:byte() ~ 0x01))
    f:close()
    local before = io.popen("cd '" .. C .. "' && find . -type f | sort | xargs cksum"):read("a")
    local rc, out = train{ "--out=" .. C, "--resume=last" }
    assert.equal(1, rc, out)
    local msg = "checkpoint: " .. file .. ": checksum mismatch: crc32 "
    for r = 0, 1 do -- alone ("[rank 1] ...") or in one report for both ("[ranks 0-1] ...")
      assert.is_true(h.reported_by(out, r, msg), "rank " .. r .. " reported it\n" .. out)
    end
    local after = io.popen("cd '" .. C .. "' && find . -type f -not -name metrics.jsonl | sort | xargs cksum"):read("a")
    local before_ckpt = before:gsub("[^\n]*metrics%.jsonl\n", "")
    assert.equal(before_ckpt, after)
  end)
end)

describe("scripts/checkpoint.lua", function()
  local dir = root .. "/a/checkpoints/step-00000012"
  local function damaged(name, damage)
    local path = root .. "/" .. name
    os.execute(("rm -rf '%s' && cp -r '%s' '%s'"):format(path, dir, path))
    damage(path)
    return path
  end

  it("info summarises the manifest and lists the files", function()
    local rc, out = tool("info", root .. "/a/checkpoints")
    assert.equal(0, rc, out)
    assert.matches("checkpoint " .. dir, out, 1, true)
    assert.matches("step 12, epoch 0", out, 1, true)
    assert.matches("layout: tensor=1 pipeline=1 data=2 zero=1 (2 ranks), micro_batches=1 schedule=1f1b", out, 1, true)
    assert.matches("model: dim=32 heads=4 hidden=128 layers=2 padded_vocab=256 seq_len=16 tie=true vocab=256", out, 1, true)
    assert.matches("data rank 1: epoch 0, batch 12", out, 1, true)
    assert.matches("params%-tp0%-pp0%.safetensors +%d+%.%d KiB  crc32 %x+  28 tensors", out)
  end)

  it("verify names the bad file: a flipped byte, a truncated file, a deleted manifest; exit 1", function()
    local rc, out = tool("verify", damaged("flip", function(p)
      local f = io.open(p .. "/params-tp0-pp0.safetensors", "r+b")
      f:seek("set", 3000)
      local b = f:read(1)
      f:seek("set", 3000)
      f:write(string.char(b:byte() ~ 0x80))
      f:close()
    end))
    assert.equal(1, rc)
    assert.matches("^checkpoint: " .. (root .. "/flip"):gsub("%p", "%%%0") .. "/params%-tp0%-pp0%.safetensors: checksum "
      .. "mismatch: crc32 %x+ on disk, %x+ in the manifest %(the file is corrupt%)\n$", out)
    rc, out = tool("verify", damaged("trunc", function(p)
      os.execute(("truncate -s 1000 '%s/optim-tp0-pp0-dp0.safetensors'"):format(p))
    end))
    assert.equal(1, rc)
    assert.matches("checkpoint: " .. root .. "/trunc/optim-tp0-pp0-dp0.safetensors: truncated: 1000 bytes on disk, "
      .. "the manifest says ", out, 1, true)
    rc, out = tool("verify", damaged("nomanifest", function(p) os.remove(p .. "/manifest.json") end))
    assert.equal(1, rc)
    assert.equal("checkpoint: " .. root .. "/nomanifest is not a checkpoint (no manifest.json)\n", out)
    rc, out = tool("verify", dir)
    assert.equal(0, rc, out)
  end)

  it("consolidates full tensors, and exports llm.c weights that load back identical", function()
    local merged, model = root .. "/merged.safetensors", root .. "/model.bin"
    local rc, out = tool("consolidate", dir, merged)
    assert.equal(0, rc, out)
    assert.matches("wrote " .. merged .. ": 28 tensors", out, 1, true)
    rc, out = tool("export-llmc", dir, model)
    assert.equal(0, rc, out)
    local header = st.read_header(merged)
    assert.same({ 256, 32 }, header.entries["embed.wte"].shape)
    assert.same({ 96, 32 }, header.entries["blocks.1.attn.qkv.weight"].shape)
    assert.equal("pipegoose-consolidated", header.metadata.format)
    -- llm.c's file back into an engine: every parameter equals the checkpoint's, bitwise
    local ctx = pg.ParallelContext{ self = true }
    local engine = pg.parallelize(pg.nn.GPT.load_llmc(model), ctx)
    local n = 0
    for _, p in ipairs(engine:parameters()) do
      n = n + 1
      assert.is_true(p.tensor:equal(st.read(header, p.name)), p.name)
    end
    assert.equal(28, n)
    -- and the merged optimizer state with --optimizer
    rc, out = tool("consolidate", dir, merged, "--optimizer")
    assert.equal(0, rc, out)
    assert.matches(": 84 tensors", out, 1, true)
  end)
end)

teardown(function() os.execute("rm -rf '" .. root .. "'") end)
