-- scripts/gpt2_check.lua against the PyTorch fixtures under tensor, pipeline
-- and data parallelism: exit status 0 (loss to 1e-5 relative, logits and
-- every gradient to 1e-4, checked by the script), the losses of 10 AdamW
-- steps equal to the fixture's `losses` to 1e-5 relative, and the global
-- gradient norm before each step equal to the fixture's `grad_norms` to
-- 1e-5 relative (every layout reduces the norm over all of its groups).
-- With --clip the fixture is torch.nn.utils.clip_grad_norm_'s trajectory at
-- a max norm of 0.05, about 1/15 of the real norm: without clipping its
-- losses differ from that trajectory by 1e-4 relative at step 6 and 1e-3 at
-- step 10 (measured in PyTorch), far outside the tolerance.
--
-- 1e-5 relative: float32 against PyTorch's float32 on a different summation
-- order; the fixture's own per-step losses carry ~1e-7 of rounding, and ten
-- AdamW updates of lr 1e-3 cannot grow that to 1e-5 (measured: <= 1e-7).
--
-- Launches are kept few: M = 1 runs once per P because both schedules are
-- the same list with one micro-batch (schedule_spec checks that).
local h = require "helpers"
local cjson = require "cjson"

-- Two batches of the same model: 4 rows (gpt2_tiny_state.bin) and 8 rows
-- (gpt2_tiny_b8_state.bin, for 8 micro-batches); both made by
-- scripts/make_reference.py (--batch=8 for the second).
local MODEL = "spec/fixtures/gpt2_tiny_model.bin"
local function load_ref(state, steps)
  local f = assert(io.open(steps))
  local r = cjson.decode(f:read("a"))
  f:close()
  r.state = state
  return r
end
local REF4 = load_ref("spec/fixtures/gpt2_tiny_state.bin", "spec/fixtures/gpt2_tiny_steps.json")
local REF8 = load_ref("spec/fixtures/gpt2_tiny_b8_state.bin", "spec/fixtures/gpt2_tiny_b8_steps.json")
local CLIP = load_ref("spec/fixtures/gpt2_tiny_state.bin",
  "spec/fixtures/gpt2_tiny_clip_steps.json")
local STEPS = #REF4.losses -- 10: losses[k] is the loss before update k

-- Hang guard (not a timing assertion): a stuck job is killed and fails on its status.
local function run(n, flags, ref, env)
  local args = { "scripts/gpt2_check.lua", MODEL, ref.state, "--steps=" .. STEPS,
                 "--lr=" .. ref.optimizer.lr, "--beta1=" .. ref.optimizer.betas[1],
                 "--beta2=" .. ref.optimizer.betas[2], "--eps=" .. ref.optimizer.eps,
                 "--weight-decay=" .. ref.optimizer.weight_decay }
  if ref.optimizer.grad_clip ~= cjson.null then args[#args + 1] = "--clip=" .. ref.optimizer.grad_clip end
  for _, a in ipairs(flags) do args[#args + 1] = a end
  if n == 1 then return h.sh(("timeout -k 2 %d "):format(h.limit(60)) .. h.pglua_cmd(args)) end
  if env then -- NAME=value: set for every rank
    return h.sh(env .. " " .. h.mpirun_cmd(n, args, 60):gsub("scripts/mpirun.sh ", "scripts/mpirun.sh -x " .. env:match("^[^=]+") .. " ", 1))
  end
  return h.sh(h.mpirun_cmd(n, args, 60))
end

local function check(n, flags, ref, env)
  ref = ref or REF4
  local rc, out = run(n, flags, ref, env)
  assert.equal(0, rc, out)
  local seen = 0
  for k, v, norm in out:gmatch("step (%d+) loss (%S+) grad_norm (%S+)") do
    k, v, norm = tonumber(k), tonumber(v), tonumber(norm)
    seen = seen + 1
    assert.equal(seen, k, "steps in order, printed once (rank 0):\n" .. out)
    local want = ref.losses[k]
    assert.is_true(math.abs(v - want) <= 1e-5 * math.abs(want),
      ("step %d: loss %.9g, PyTorch %.9g\n%s"):format(k, v, want, out))
    want = ref.grad_norms[k]
    assert.is_true(math.abs(norm - want) <= 1e-5 * want,
      ("step %d: gradient norm %.9g, PyTorch %.9g\n%s"):format(k, norm, want, out))
  end
  assert.equal(STEPS, seen, out)
  assert.matches("grads_max_abs_diff", out)
  return out
end

local B = REF4.batch -- 4 rows: micro_batches must divide it

describe("gpt2_check.lua on the PyTorch fixtures", function()
  for _, T in ipairs{ 1, 2, 4 } do
    it(("--tensor=%d"):format(T), function() check(T, { "--tensor=" .. T }) end)
  end

  for _, P in ipairs{ 2, 4 } do
    it(("--pipeline=%d --micro-batches=1"):format(P), function()
      check(P, { "--pipeline=" .. P, "--micro-batches=1" })
    end)
    for _, M in ipairs{ 2, 4 } do
      for _, sched in ipairs{ "gpipe", "1f1b" } do
        it(("--pipeline=%d --micro-batches=%d --schedule=%s"):format(P, M, sched), function()
          assert.equal(0, B % M)
          check(P, { "--pipeline=" .. P, "--micro-batches=" .. M, "--schedule=" .. sched })
        end)
      end
    end
    for _, sched in ipairs{ "gpipe", "1f1b" } do
      it(("--pipeline=%d --micro-batches=8 --schedule=%s (the 8-row batch)"):format(P, sched), function()
        assert.equal(8, REF8.batch)
        check(P, { "--pipeline=" .. P, "--micro-batches=8", "--schedule=" .. sched }, REF8)
      end)
    end
  end

  -- virtual stages: the 5 top-level modules in 4 chunks, 2 per stage, the
  -- embedding on stage 0's first chunk and the tied head on stage 1's second
  for _, M in ipairs{ 2, 4 } do
    it(("--pipeline=2 --virtual-stages=2 --micro-batches=%d (interleaved)"):format(M), function()
      check(2, { "--pipeline=2", "--virtual-stages=2", "--micro-batches=" .. M })
    end)
  end
  it("--pipeline=2 --virtual-stages=2 --micro-batches=8 (interleaved, the 8-row batch)", function()
    check(2, { "--pipeline=2", "--virtual-stages=2", "--micro-batches=8" }, REF8)
  end)

  it("--pipeline=2 --tensor=2 (4 ranks), 1f1b with 2 micro-batches", function()
    check(4, { "--pipeline=2", "--tensor=2", "--micro-batches=2", "--schedule=1f1b" })
  end)

  it("--pipeline=2 --tensor=2 (4 ranks), gpipe with 4 micro-batches", function()
    check(4, { "--pipeline=2", "--tensor=2", "--micro-batches=4", "--schedule=gpipe" })
  end)

  for _, zero in ipairs{ 0, 1, 2 } do
    it(("--data=2 --zero=%d"):format(zero), function() check(2, { "--data=2", "--zero=" .. zero }) end)
  end

  for _, how in ipairs{ "full", "selective" } do
    it(("--recompute=%s serially and --pipeline=2 --micro-batches=4"):format(how), function()
      check(1, { "--recompute=" .. how })
      check(2, { "--pipeline=2", "--micro-batches=4", "--recompute=" .. how })
    end)
  end

  -- PG_RANKS_PER_NODE=k: every k consecutive ranks are one node, so the
  -- paths between nodes run on this machine. Ranks are tensor fastest, then
  -- data, then pipeline (global = p*T*D + d*T + t): on nodes of 4 the
  -- pipeline crosses nodes and each data pair (ranks 2 apart) shares a node
  -- and its memory; on nodes of 2 the data pairs are split too and reduce
  -- through MPI.
  it("--tensor=2 --pipeline=2 --data=2 --zero=1 on one node and on two nodes of 4 (PG_RANKS_PER_NODE=4)", function()
    local flags = { "--tensor=2", "--pipeline=2", "--data=2", "--zero=1", "--micro-batches=2" }
    assert.matches("shared_memory true", check(8, flags))
    assert.matches("shared_memory true", check(8, flags, nil, "PG_RANKS_PER_NODE=4"))
  end)

  -- sequence parallelism: T = 2 and 4 (the fixture's 4 heads rule out T = 3;
  -- sequence_parallel_spec runs T = 3 against the serial model), then with
  -- everything else on nodes of 2 (the tensor pairs share a node, the data
  -- pairs and the pipeline links cross nodes)
  for _, T in ipairs{ 2, 4 } do
    it(("--tensor=%d --sequence-parallel"):format(T), function()
      check(T, { "--tensor=" .. T, "--sequence-parallel" })
    end)
  end

  for _, how in ipairs{ "full", "selective" } do
    it(("--sequence-parallel with 2x2x2, zero 1, --virtual-stages=2, --recompute=%s on nodes of 2"):format(how),
      function()
        local out = check(8, { "--tensor=2", "--pipeline=2", "--data=2", "--zero=1", "--micro-batches=2",
                               "--virtual-stages=2", "--recompute=" .. how, "--sequence-parallel" }, nil,
                          "PG_RANKS_PER_NODE=2")
        assert.matches("shared_memory false", out)
      end)
  end

  it("everything at once on nodes of 2: 2x2x2, 1f1b, zero 1, full recomputation", function()
    local out = check(8, { "--tensor=2", "--pipeline=2", "--data=2", "--zero=1", "--micro-batches=2",
                           "--recompute=full" }, nil, "PG_RANKS_PER_NODE=2")
    assert.matches("shared_memory false", out)
    -- through MPI, the reduction overlaps backward (bucket by bucket)
    assert.matches("overlap_grad_reduce true", out)
  end)
end)

describe("gpt2_check.lua --clip against PyTorch's clipped trajectory", function()
  assert.equal(0.05, CLIP.optimizer.grad_clip)
  it("serial", function() check(1, {}, CLIP) end)
  it("--tensor=2", function() check(2, { "--tensor=2" }, CLIP) end)
  for _, sched in ipairs{ "gpipe", "1f1b" } do
    it(("--pipeline=2 --micro-batches=2 --schedule=%s"):format(sched), function()
      check(2, { "--pipeline=2", "--micro-batches=2", "--schedule=" .. sched }, CLIP)
    end)
  end
  it("--data=2 --zero=1", function() check(2, { "--data=2", "--zero=1" }, CLIP) end)
  it("--tensor=2 --pipeline=2 --data=2 --zero=1 (8 ranks)", function()
    check(8, { "--tensor=2", "--pipeline=2", "--data=2", "--zero=1", "--micro-batches=2" }, CLIP)
  end)
end)
