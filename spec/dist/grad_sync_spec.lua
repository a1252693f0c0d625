-- worlds: 2 4
-- The data-parallel gradient reductions: shared-memory buffers (the default
-- on one node) and the chunked MPI ring (shared_memory = false) give the
-- same bits, zero = 0 and zero = 1 give the same bits, every replica holds
-- the same bits, and the averaged gradients are those of the whole batch
-- computed by one process alone. engine:stats().shared_memory says which
-- path ran, so the two paths are really compared with each other.
local pg = require "pipegoose"

local world = pg.world_size()
local CFG = { vocab = 61, padded_vocab = 64, seq_len = 16, dim = 32, heads = 4, layers = 2 }
local BATCH = 8

local function batch()
  local x, y = {}, {}
  for i = 1, BATCH * CFG.seq_len do
    x[i] = (i * 37 + 5) % CFG.vocab
    y[i] = (i * 11 + 3) % CFG.vocab
  end
  return pg.tensor(x, { dtype = "int32" }):reshape{ BATCH, CFG.seq_len },
    pg.tensor(y, { dtype = "int32" }):reshape{ BATCH, CFG.seq_len }
end
local X, Y = batch()

local ctx = pg.ParallelContext{ data = world, seed = 3 }
local D, d = ctx:world_size("data"), ctx:local_rank("data")
local rows = BATCH // D
local x, y = X:narrow(1, d * rows + 1, rows), Y:narrow(1, d * rows + 1, rows)

-- Three AdamW steps; returns the flat parameters and the last step's averaged gradients.
local function train(zero, shared)
  local engine = pg.parallelize(pg.nn.GPT(CFG), ctx, { shared_memory = shared })
  local opt = pg.optim.AdamW(engine, { lr = 1e-2, weight_decay = 0.1, zero = zero })
  local grads, first
  for s = 1, 3 do
    engine:zero_grad()
    engine:forward_backward(x, y)
    opt:clip_grad_norm(1.0)
    local _, g = engine:flat()
    grads = g:clone()
    if s == 1 then first = grads end
    opt:step()
  end
  local sd = opt:state_dict()
  return (engine:flat()):clone(), grads, engine, first, sd
end

--- max over the group of |a - b| element by element is 0 on every member: the same bits everywhere
local function same_everywhere(t)
  local hi, lo = t:clone(), t:clone()
  pg.dist.all_reduce(hi, { op = "max", ctx = ctx })
  pg.dist.all_reduce(lo, { op = "min", ctx = ctx })
  return hi:equal(t) and lo:equal(t)
end

describe(("data-parallel gradient sync on %d ranks"):format(world), function()
  local p_shm0, g_shm0, e_shm0, f_shm0, sd_shm0 = train(0, true)
  local p_mpi0, g_mpi0, e_mpi0, f_mpi0, sd_mpi0 = train(0, false)
  local p_shm1, g_shm1, e1 = train(1, true)
  local p_mpi1, g_mpi1, e_mpi1 = train(1, false)

  it("runs the path it was asked for: shared buffers by default, the MPI ring with shared_memory = false", function()
    -- one node with /dev/shm (as in CI): the default shares the buffers
    assert.is_true(e_shm0:stats().shared_memory, "zero = 0, default")
    assert.is_true(e1:stats().shared_memory, "zero = 1, default")
    assert.is_false(e_mpi0:stats().shared_memory, "zero = 0, shared_memory = false")
    assert.is_false(e_mpi1:stats().shared_memory, "zero = 1, shared_memory = false")
  end)

  it("gives every replica the same parameters and (zero = 0) gradients, bit for bit", function()
    assert.is_true(same_everywhere(p_shm0), "shared memory, zero = 0")
    assert.is_true(same_everywhere(g_shm0), "shared memory, zero = 0 gradients")
    assert.is_true(same_everywhere(p_mpi0), "MPI ring, zero = 0")
    assert.is_true(same_everywhere(p_shm1), "shared memory, zero = 1")
    assert.is_true(same_everywhere(p_mpi1), "MPI ring, zero = 1")
  end)

  it("keeps the replicated optimizer state (zero = 0) the same on every replica", function()
    assert.is_true(same_everywhere(sd_shm0.m) and same_everywhere(sd_shm0.v), "shared memory")
    assert.is_true(same_everywhere(sd_mpi0.m) and same_everywhere(sd_mpi0.v), "MPI ring")
    if D == 2 then
      assert.is_true(sd_shm0.m:equal(sd_mpi0.m) and sd_shm0.v:equal(sd_mpi0.v), "the same bits either way")
    end
  end)

  it("agrees between shared memory and the MPI ring (two members: the same bits)", function()
    -- shared memory adds the members in order, the ring in ring order: for
    -- two members both are a + b; for more, sums of the same terms
    local n = e1:stats().flat_padded
    local lo, hi = n * d // D, n * (d + 1) // D
    local pairs_ = { { p_shm0, p_mpi0, "zero = 0 parameters" }, { g_shm0, g_mpi0, "zero = 0 gradients" },
                     { p_shm1, p_mpi1, "zero = 1 parameters" },
                     -- ZeRO-1: only this rank's shard of the gradient buffer is reduced
                     { g_shm1:narrow(1, lo + 1, hi - lo), g_mpi1:narrow(1, lo + 1, hi - lo), "zero = 1 shard" } }
    if D == 2 then
      for _, c in ipairs(pairs_) do assert.is_true(c[1]:equal(c[2]), c[3]) end
    else
      -- the first step's averaged gradients (later steps go through Adam,
      -- which turns rounding-level differences of near-zero gradients into
      -- updates of up to lr)
      local scale = math.max(1, f_mpi0:max_abs_diff(pg.zeros(f_mpi0:shape())))
      assert.is_true(f_shm0:allclose(f_mpi0, 1e-5, 1e-6 * scale), ("max |diff| %.3g"):format(f_shm0:max_abs_diff(f_mpi0)))
    end
  end)

  it("gets the same bits with and without ZeRO-1", function()
    assert.is_true(p_shm0:equal(p_shm1), "shared memory")
    assert.is_true(p_mpi0:equal(p_mpi1), "MPI ring")
    -- any D: the shard a rank reduced under ZeRO-1 is what zero = 0 averaged there
    local n = e1:stats().flat_padded
    local lo, hi = n * d // D, n * (d + 1) // D
    assert.is_true(g_shm1:narrow(1, lo + 1, hi - lo):equal(g_shm0:narrow(1, lo + 1, hi - lo)))
  end)

  for _, shared in ipairs{ true, false } do
    it(("averages to the gradients of the whole batch on one process (%s)"):format(
      shared and "shared memory" or "MPI ring"), function()
      -- the reference: this process alone (no data group) on the whole batch,
      -- the same initial weights (a pure function of seed and name)
      local alone = pg.parallelize(pg.nn.GPT(CFG), pg.ParallelContext{ self = true, seed = 3 }, {})
      alone:zero_grad()
      alone:forward_backward(X, Y)
      local _, whole = alone:flat()
      local e2 = pg.parallelize(pg.nn.GPT(CFG), ctx, { shared_memory = shared })
      e2:zero_grad()
      e2:forward_backward(x, y) -- each rank its share, then the average over the replicas
      local _, avg = e2:flat()
      -- D means of BATCH/D rows each, averaged, against one mean of BATCH rows:
      -- the same terms summed in another order (float32, 1e-6 relative)
      local scale = math.max(1, whole:max_abs_diff(pg.zeros(whole:shape())))
      assert.is_true(avg:allclose(whole, 1e-5, 1e-6 * scale), ("max |diff| %.3g"):format(avg:max_abs_diff(whole)))
    end)
  end

  it("leaves nothing in /dev/shm", function()
    local f = io.popen("ls /dev/shm 2>/dev/null")
    local listing = f:read("a")
    f:close()
    assert.is_nil(listing:find("pipegoose%."), "shared-memory names are unlinked once mapped")
  end)
end)
