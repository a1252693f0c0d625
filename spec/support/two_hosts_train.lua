-- A tiny GPT trained tensor=2 x pipeline=2 x data=2 (ZeRO-1, 1F1B, 2 micro-batches)
-- on a fixed batch, for spec/examples/two_hosts_spec.lua, which runs it once on
-- one host and once across two (scripts/netns_hosts.sh) and compares the lines
-- it prints: every rank prints
--   rank R host H node_size N hosts K
--   rank R params DIGEST           (FNV-1a of the float32 bits of its flat shard)
--   rank R bytes MODE SENT         (comm_stats: bytes this rank moved per group)
-- and rank 0 prints "loss S HEX" per step (%a: every bit).
-- Arguments: the steps (default 4), and "diloco" for 2 DiLoCo islands of
-- tensor=2 x pipeline=2 each (island-major: one island per host), an outer
-- step every H steps (the third argument, default 2; lr 0.7, Nesterov
-- momentum 0.9), island i training on rows 4i+1..4i+4 of the batch; then
-- rank 0 and 4 print their island's losses ("loss S HEX island I"). The loss lines are flushed as they come (the
-- fault spec takes a host away once it has seen a few). A fourth argument, a file name, is a gate: after step 3
-- every rank waits until that file exists (the fault spec takes the link down first, so that no outer step can
-- run before it, however fast the steps go).
local pg = require "pipegoose"
local steps = tonumber(arg[1]) or 4
local CFG = { vocab = 61, padded_vocab = 64, seq_len = 16, dim = 32, heads = 4, layers = 2 }
local GLOBAL_BATCH = 8

local function batch()
  local x, y = {}, {}
  local r = pg.randn({ GLOBAL_BATCH, CFG.seq_len + 1 }, { seed = 11 }):totable()
  for b = 1, GLOBAL_BATCH do
    x[b], y[b] = {}, {}
    for t = 1, CFG.seq_len do
      x[b][t] = math.floor(math.abs(r[b][t]) * 1000) % CFG.vocab
      y[b][t] = math.floor(math.abs(r[b][t + 1]) * 1000) % CFG.vocab
    end
  end
  return pg.tensor(x, { dtype = "int32" }), pg.tensor(y, { dtype = "int32" })
end

local function digest(t)
  local h = 0xcbf29ce484222325
  for _, v in ipairs(t:reshape{ t:numel() }:totable()) do
    for i = 1, 4 do
      h = (h ~ string.byte(string.pack("<f", v), i)) * 0x100000001b3
    end
  end
  return ("%016x"):format(h)
end

local X, Y = batch()
local diloco = arg[2] == "diloco"
local H = tonumber(arg[3]) or 2
local gate = arg[4]
local ctx, dl
if diloco then
  ctx = pg.ParallelContext{ islands = 2, tensor = 2, pipeline = 2, seed = 5 }
else
  ctx = pg.ParallelContext{ tensor = 2, pipeline = 2, data = 2, seed = 5 }
end
local engine = pg.parallelize(pg.nn.GPT(CFG), ctx, { micro_batches = 2, schedule = "1f1b" })
local opt = pg.optim.AdamW(engine, { lr = 1e-3, betas = { 0.9, 0.95 }, weight_decay = 0.1, zero = 1 })
local island = ctx:local_rank("islands")
local D, d = ctx:world_size("data"), ctx:local_rank("data")
local rows = GLOBAL_BATCH // (D * ctx:world_size("islands"))
local first = (island * D + d) * rows
local x, y = X:narrow(1, first + 1, rows), Y:narrow(1, first + 1, rows)
if diloco then
  dl = pg.DiLoCo{ outer_every = H, outer_lr = 0.7, outer_momentum = 0.9, islands = 2 }
  dl:attach(engine)
end
local me = pg.world_rank()
local node = pg.node()
print(("rank %d host %s node_size %d hosts %d"):format(me, node.host, node.size, node.hosts))
for s = 1, steps do
  engine:zero_grad()
  local loss = engine:forward_backward(x, y)
  opt:clip_grad_norm(1.0)
  opt:step()
  if dl and s % H == 0 then dl:outer_step() end
  if ctx:rank() == 0 then
    print(("loss %d %a%s"):format(s, loss, diloco and (" island " .. island) or ""))
    io.stdout:flush()
  end
  if gate and s == 3 then
    local f = io.open(gate)
    while not f do
      os.execute("sleep 0.05")
      f = io.open(gate)
    end
    f:close()
  end
end
print(("rank %d params %s"):format(me, digest(engine:flat():to("cpu"))))
for mode, kinds in pairs(ctx:comm_stats()) do
  local bytes = 0
  for _, st in pairs(kinds) do bytes = bytes + st.bytes end
  print(("rank %d bytes %s %.0f"):format(me, mode, bytes))
end
