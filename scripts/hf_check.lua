-- Checks pg.nn.from_hf / engine:save_hf against transformers' numbers
-- (scripts/hf_reference.py makes them).
--
--   [mpirun -np N] pglua scripts/hf_check.lua DIR [--tensor=T] [--pipeline=P] [--data=D] [--steps=K]
--       [--save-hf=OUT] [--device=cpu|cuda]
--
-- Loads DIR (a transformers GPT2LMHeadModel directory with expected.json),
-- prints "loss <v>" on expected.json's tokens and exits 1 unless it is within
-- 1e-5 relative of transformers' loss. With --steps=K it then trains K AdamW
-- steps (lr 1e-3) on those tokens; with --save-hf=OUT writes the model there,
-- copies expected.json's tokens to OUT/tokens.json and prints "final loss <v>"
-- (for hf_reference.py loss OUT OUT/tokens.json to compare).
local pg = require "pipegoose"
local cjson = require "cjson"

local argparse = require "argparse"
local p = argparse("hf_check.lua", "Check pg.nn.from_hf / engine:save_hf against transformers' numbers.")
local function to_int(s) return math.tointeger(tonumber(s)) end
p:argument("dir", "A transformers GPT2LMHeadModel directory with expected.json.")
p:option("--tensor", "Tensor-parallel size.", "1"):convert(to_int)
p:option("--pipeline", "Pipeline stages.", "1"):convert(to_int)
p:option("--data", "Data-parallel size.", "1"):convert(to_int)
p:option("--steps", "AdamW steps after the check.", "0"):convert(to_int)
p:option("--save-hf", "Write the model there and print its final loss.")
p:option("--device", "cpu, cuda or cuda:N.", "cpu")
local opt = p:parse()
local dir = opt.dir

local f = assert(io.open(dir .. "/expected.json"))
local expected = cjson.decode(f:read("a"))
f:close()
local ctx = pg.ParallelContext{ tensor = opt.tensor, pipeline = opt.pipeline, data = opt.data, seed = 1 }
local engine = pg.parallelize(pg.nn.from_hf(dir), ctx, { device = opt.device })
local all = pg.tensor(expected.tokens, { dtype = "int32" })
local T = all:shape()[2] - 1
local x, y = all:narrow(2, 1, T), all:narrow(2, 2, T)
-- each data rank its equal share of the rows
local D, dp = ctx:world_size("data"), ctx:local_rank("data")
local rows = all:shape()[1] // D
x, y = x:narrow(1, dp * rows + 1, rows), y:narrow(1, dp * rows + 1, rows)
local loss = engine:loss(x, y)
local rel = math.abs(loss - expected.loss) / expected.loss
if ctx:rank() == 0 then print(("loss %.9g (transformers %.9g, relative difference %.2g)"):format(loss, expected.loss, rel)) end
local ok = rel <= 1e-5
local steps = opt.steps
if steps > 0 then
  local optim = pg.optim.AdamW(engine, { lr = 1e-3, weight_decay = 0.1 })
  for _ = 1, steps do
    engine:zero_grad()
    engine:forward_backward(x, y)
    optim:step()
  end
end
if opt.save_hf then
  engine:save_hf(opt.save_hf)
  local final = engine:loss(x, y)
  if ctx:rank() == 0 then
    local out = assert(io.open(opt.save_hf .. "/tokens.json", "w"))
    out:write(cjson.encode({ tokens = expected.tokens }))
    out:close()
    print(("final loss %.9g"):format(final))
  end
end
os.exit(ok and 0 or 1)
