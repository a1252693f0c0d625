-- worlds: 2
-- device worlds: 2
-- The overlapped reduction where the engine runs: with PG_TEST_DEVICE=cuda
-- (the emulated device in CI) each bucket's all-reduce runs on the data
-- group's reduction stream (NCCL), after an event recorded on the engine's
-- stream behind the bucket's last gradient kernel, and the engine's stream
-- waits for it before the optimizer. Against the reduction at the end of
-- the step (overlap_grad_reduce = false) on the same seed and batch, D = 2:
-- both are NCCL's average of the same two terms, element by element, so the
-- parameters after two AdamW steps are compared bit for bit. With ZeRO-1 the
-- device keeps the one reduce-scatter at the end (a bucket's pieces of the
-- shards are uneven, NCCL's blocks are not). With ZeRO-2 every bucket is
-- reduced during backward on the device too (each member's piece onto its
-- owner: ncclReduce per piece), overlapped or waited for at once: the same
-- sums, bit for bit. On the CPU the same run goes through MPI.
local pg = require "pipegoose"

local DEVICE = os.getenv("PG_TEST_DEVICE") or "cpu"
local CFG = { vocab = 61, padded_vocab = 64, seq_len = 8, dim = 16, heads = 2, layers = 2 }
local ctx = pg.ParallelContext{ data = 2, seed = 9 }
local d = ctx:local_rank("data")
local rows = {}
for b = 1, 4 do
  rows[b] = {}
  for s = 1, CFG.seq_len do rows[b][s] = (b * 2713 + s * 337 + b * s * 41) % CFG.vocab end
end
local X = pg.tensor(rows, { dtype = "int32" })
local x = X:narrow(1, d * 2 + 1, 2)

local function train(overlap, zero)
  local e = pg.parallelize(pg.nn.GPT(CFG), ctx, { device = DEVICE, shared_memory = false, bucket_mb = 0.002,
                                                  overlap_grad_reduce = overlap })
  local opt = pg.optim.AdamW(e, { lr = 1e-2, weight_decay = 0.1, zero = zero })
  local loss
  for _ = 1, 2 do
    e:zero_grad()
    loss = e:forward_backward(x, x)
    opt:step()
  end
  return { params = (e:flat()):to("cpu"), loss = loss, stats = e:stats() }
end

describe(("the overlapped reduction on %s, D = 2"):format(DEVICE), function()
  it("reduces bucket by bucket during backward with zero = 0, with the bits of the reduction at the end", function()
    local on, off = train(true, 0), train(false, 0)
    assert.is_true(on.stats.overlap_grad_reduce)
    assert.is_true(on.stats.grad_buckets > 2, "buckets: " .. on.stats.grad_buckets)
    assert.are.equal(on.stats.grad_buckets, on.stats.grad_buckets_in_backward)
    assert.is_false(off.stats.overlap_grad_reduce)
    assert.is_true(on.params:equal(off.params), "parameters after 2 steps")
    assert.are.equal(off.loss, on.loss)
  end)

  it("keeps the one reduction at the end with zero = 1 on the device", function()
    local on, off = train(true, 1), train(false, 1)
    assert.are.equal(DEVICE == "cpu", on.stats.overlap_grad_reduce)
    assert.is_true(on.params:equal(off.params), "parameters after 2 steps")
  end)

  it("reduces bucket by bucket during backward with zero = 2, overlapped or not, with the same bits", function()
    local on, off = train(true, 2), train(false, 2)
    assert.is_true(on.stats.overlap_grad_reduce)
    assert.is_true(on.stats.grad_buckets > 2, "buckets: " .. on.stats.grad_buckets)
    -- all but the tied embedding's (resident: the head writes it before the embedding does)
    assert.are.equal(on.stats.grad_buckets - 1, on.stats.grad_buckets_in_backward)
    assert.is_true(on.params:equal(off.params), "parameters after 2 steps")
    assert.are.equal(off.loss, on.loss)
  end)
end)
