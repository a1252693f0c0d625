-- worlds: 1 2 4
-- TokenShards under data parallelism: each data rank's share of a step is
-- disjoint from the others', and the shares, in data-rank order, are the
-- global batch that a loader without a context reads in the same process.
-- Ranks with the same data rank (one tensor or pipeline group) get the same share.
local pg = require "pipegoose"

local world = pg.world_size()
local layouts = ({
  [1] = { { 1, 1, 1 } },
  [2] = { { 1, 1, 2 }, { 2, 1, 1 } },
  [4] = { { 1, 1, 4 }, { 2, 1, 2 }, { 1, 2, 2 } },
})[world]

local B, L = 8, 5 -- windows of 6 tokens

-- Each rank writes its own copy of the same shards (no shared path to agree
-- on). Token i of file f is f*100000 + i: a token names its file and place.
local dir = os.tmpname()
os.remove(dir)
pg.fs.mkdir_p(dir)
local files = {}
for f = 1, 2 do
  local t = {}
  for i = 0, 6 * (10 + 3 * f) + f - 1 do t[#t + 1] = f * 100000 + i end
  files[f] = dir .. "/part" .. f .. ".bin"
  pg.data.write_shard(files[f], t)
end

for _, layout in ipairs(layouts) do
  local T, P, D = layout[1], layout[2], layout[3]
  describe(("layout tensor=%d pipeline=%d data=%d"):format(T, P, D), function()
    local ctx = pg.ParallelContext{ tensor = T, pipeline = P, data = D }

    -- llm.c's stride too: rank d reads its B/D rows from d * (B/D) * L into the batch's span (process_rank's offset)
    for _, stride in ipairs{ "window", "llmc" } do
      it(("gives each data rank a disjoint share whose union is the global batch (stride %s)"):format(stride), function()
        local mine = pg.data.TokenShards{ path = files, batch = B, seq_len = L, seed = 4, ctx = ctx, stride = stride }
        local ref = pg.data.TokenShards{ path = files, batch = B, seq_len = L, seed = 4, stride = stride }
        assert.equal(B // D, mine.local_batch)
        assert.equal(ref:batches_per_epoch(), mine:batches_per_epoch())
        assert.equal(B * L, mine:tokens_per_batch())
        local steps = 0
        -- two epochs and a bit: the nil comes at the same step on every rank
        for _ = 1, 2 * ref:batches_per_epoch() + 4 do
          local x, y = mine:next_batch()
          local rx, ry = ref:next_batch()
          assert.equal(rx == nil, x == nil)
          if x then
            assert.same({ B // D, L }, x:shape())
            local gx = pg.dist.all_gather(x, { group = "data", ctx = ctx })
            local gy = pg.dist.all_gather(y, { group = "data", ctx = ctx })
            assert.is_true(gx:equal(rx), "the data ranks' shares, in order, are the global batch")
            assert.is_true(gy:equal(ry))
            -- disjoint: every row of the step is a different window
            local seen = {}
            for _, row in ipairs(gx:totable()) do
              assert.is_nil(seen[row[1]], "a window in two shares")
              seen[row[1]] = true
            end
            steps = steps + 1
          end
          assert.equal(ref:epoch(), mine:epoch())
        end
        assert.equal(2 * ref:batches_per_epoch() + 2, steps)
      end)
    end

    it("gives the same share to the ranks of a tensor or pipeline group", function()
      local mine = pg.data.TokenShards{ path = files, batch = B, seq_len = L, seed = 1, ctx = ctx }
      for _ = 1, 3 do
        local x, y = mine:next_batch()
        for _, group in ipairs{ "tensor", "pipeline" } do
          local n = ctx:world_size(group)
          local gx = pg.dist.all_gather(x, { group = group, ctx = ctx })
          local gy = pg.dist.all_gather(y, { group = group, ctx = ctx })
          for k = 1, n do
            assert.is_true(gx:narrow(1, (k - 1) * (B // D) + 1, B // D):equal(x), group .. " member " .. k)
            assert.is_true(gy:narrow(1, (k - 1) * (B // D) + 1, B // D):equal(y), group .. " member " .. k)
          end
        end
      end
    end)

    it("resumes a data-parallel state without a context, and the other way round", function()
      local mine = pg.data.TokenShards{ path = files, batch = B, seq_len = L, seed = 2, ctx = ctx }
      for _ = 1, 5 do mine:next_batch() end -- into the second epoch (3 batches per epoch)
      local serial = pg.data.TokenShards{ path = files, batch = B, seq_len = L, seed = 2 }
      serial:load_state_dict(mine:state_dict())
      local x = mine:next_batch()
      local rx = serial:next_batch()
      assert.is_true(pg.dist.all_gather(x, { group = "data", ctx = ctx }):equal(rx))
      local again = pg.data.TokenShards{ path = files, batch = B, seq_len = L, seed = 2, ctx = ctx }
      again:load_state_dict(serial:state_dict())
      assert.is_true(again:next_batch():equal(mine:next_batch()))
    end)

    if D > 1 then
      it("rejects a batch that the data ranks cannot share evenly", function()
        local ok, e = pcall(pg.data.TokenShards, { path = files, batch = D + 1, seq_len = L, ctx = ctx })
        assert.is_false(ok)
        assert.matches(("TokenShards: batch %d is not divisible by the data%%-parallel size %d"):format(D + 1, D), e)
      end)
    end

    it("is torn down", function()
      ctx:barrier()
      ctx:destroy()
      assert.matches("destroyed", tostring(ctx))
    end)
  end)
end

describe("the spec's files", function()
  it("are removed", function()
    for _, f in ipairs(files) do assert.is_true(os.remove(f)) end
    assert.is_true(os.remove(dir))
  end)
end)
