-- device = "cuda" on the emulated device (make emu: build-emu/pglua, the
-- whole runtime with the CUDA runtime, cuBLAS and NCCL replaced by the CPU
-- stand-ins of spec/support/cuda_emu): the real kernels/cuda code paths of a
-- training step, checked without a GPU.
--
-- One rank and every layout gpt2_check.lua knows (T, P with both schedules,
-- D with ZeRO-1, 2 x 2 x 2) train the clipped PyTorch fixture. Every transfer
-- is an NCCL call (the emulated NCCL: MPI underneath): tensor, data and
-- embedding groups' collectives, the pipeline's sends and receives; when
-- ranks share a GPU (PG_EMU_DEVICES=1) everything is staged through host
-- memory over MPI, said once.
--
-- Tolerances. Against PyTorch: scripts/gpt2_check.lua's own (loss 1e-5
-- relative, logits and gradients 1e-4) and this spec's 1e-5 relative on every
-- step's loss and gradient norm. Device against CPU in one process: the
-- emulated cuBLAS sums each product in double and rounds once, OpenBLAS sums
-- in float32, so one step's gradients differ by float32 rounding of sums of
-- up to 64 terms: |cuda - cpu| <= 1e-5 |cpu| + 1e-6 max |cpu| (measured: a
-- few 1e-8), and the losses by 1e-6 relative (measured ~1e-7).
local h = require "helpers"
local cjson = require "cjson"

local EMU = os.getenv("PG_EMU_PGLUA") or "build-emu/pglua"
local MODEL = "spec/fixtures/gpt2_tiny_model.bin"

-- Runs a Lua chunk with the emulated pglua; returns status and output.
local function emu(code, env)
  local path = h.tmpfile(code)
  local rc, out = h.sh(("%s timeout -k 2 300 %s %s"):format(env or "", h.quote(EMU), h.quote(path)))
  os.remove(path)
  return rc, out
end

describe("device = 'cuda' on the emulated device", function()
  it("has the emulated build (make emu, which make test runs first)", function()
    assert.is_true(h.exists(EMU), EMU .. " is missing: run make emu")
  end)

  local f = assert(io.open("spec/fixtures/gpt2_tiny_clip_steps.json"))
  local CLIP = cjson.decode(f:read("a"))
  f:close()
  local STEPS = 4

  -- gpt2_check.lua --device=cuda on n ranks with the clipped PyTorch fixture;
  -- returns its output (rank 0) after checking every step's loss and norm.
  local function check(n, flags, env)
    local args = { "scripts/gpt2_check.lua", MODEL, "spec/fixtures/gpt2_tiny_state.bin", "--steps=" .. STEPS,
                   "--clip=" .. CLIP.optimizer.grad_clip, "--device=cuda" }
    for _, a in ipairs(flags) do args[#args + 1] = a end
    local quoted = {}
    for i, a in ipairs(args) do quoted[i] = h.quote(a) end
    local cmd = n == 1 and ("PG_EMU_STATS=1 timeout -k 2 300 %s %s"):format(h.quote(EMU), table.concat(quoted, " "))
      or ("%s PG_EMU_STATS=1 timeout -k 2 300 scripts/mpirun.sh -x PG_EMU_STATS -x PG_EMU_DEVICES -np %d %s %s"):format(
        env or "", n, h.quote(EMU), table.concat(quoted, " "))
    local rc, out = h.sh(cmd)
    assert.equal(0, rc, out)
    local seen = 0
    for k, loss, norm in out:gmatch("step (%d+) loss (%S+) grad_norm (%S+)") do
      k, loss, norm = tonumber(k), tonumber(loss), tonumber(norm)
      seen = seen + 1
      assert.is_true(math.abs(loss - CLIP.losses[k]) <= 1e-5 * CLIP.losses[k],
        ("step %d loss %.9g, PyTorch %.9g\n%s"):format(k, loss, CLIP.losses[k], out))
      assert.is_true(math.abs(norm - CLIP.grad_norms[k]) <= 1e-5 * CLIP.grad_norms[k],
        ("step %d gradient norm %.9g, PyTorch %.9g\n%s"):format(k, norm, CLIP.grad_norms[k], out))
    end
    assert.equal(STEPS, seen, out)
    -- PG_EMU_STATS=1: every rank counts what it asked of its device
    local ranks, nccl = 0, 0
    for launches, cublas, calls in out:gmatch("emu: (%d+) kernel launches, (%d+) cublas calls, (%d+) nccl calls") do
      ranks = ranks + 1
      assert.is_true(tonumber(launches) >= 10 * STEPS and tonumber(cublas) >= 4 * STEPS, out)
      nccl = nccl + tonumber(calls)
    end
    assert.equal(n, ranks, out)
    return out, nccl
  end

  it("trains the PyTorch fixture with clipping on one rank (gpt2_check --device=cuda)", function()
    local out = check(1, {})
    assert.is_nil(out:find("host buffers"), "one rank: no collective, nothing staged")
  end)

  -- every layout's transfers are NCCL calls (tensor and data groups, the
  -- pipeline's sends and receives, the tied embedding's all-reduce): nothing staged
  for _, layout in ipairs{
    { 2, { "--tensor=2" } },
    { 2, { "--pipeline=2", "--micro-batches=2", "--schedule=gpipe" } },
    { 2, { "--pipeline=2", "--micro-batches=2", "--schedule=1f1b" } },
    { 2, { "--data=2", "--zero=1" } },
    { 2, { "--data=2", "--zero=2" } }, -- buckets reduced onto their owners (ncclReduce per piece)
    { 2, { "--data=2", "--zero=3" } }, -- and each module gathered (ncclBroadcast per piece)
    { 8, { "--tensor=2", "--pipeline=2", "--data=2", "--zero=1", "--micro-batches=2" } },
  } do
    it(("trains it on %d ranks: %s"):format(layout[1], table.concat(layout[2], " ")), function()
      local out = check(layout[1], layout[2])
      local ranks = 0
      for calls in out:gmatch("(%d+) nccl calls") do
        ranks = ranks + 1
        assert.is_true(tonumber(calls) > 0, "every rank's transfers are NCCL calls:\n" .. out)
      end
      assert.equal(layout[1], ranks, out)
      assert.is_nil(out:find("host buffers"), "nothing staged:\n" .. out)
    end)
  end

  for _, flags in ipairs{ { "--data=2", "--zero=1" }, { "--pipeline=2", "--micro-batches=4", "--schedule=1f1b" } } do
    it("stages every collective through the host when ranks outnumber the node's GPUs (NCCL refuses that): "
      .. table.concat(flags, " "), function()
      local out, nccl = check(2, flags, "PG_EMU_DEVICES=1")
      assert.equal(0, nccl, out)
      assert.equal(1, h.count(out, "pipegoose: ranks outnumber the GPUs of a node: collectives on device memory go "
        .. "through host buffers over MPI instead of NCCL"), out)
    end)
  end

  -- ZeRO-2's buckets and ZeRO-3's gathers are NCCL calls on the data group's stream: staged, they are refused
  it("refuses zero 2 and 3 by name when ranks outnumber the node's GPUs", function()
    for _, z in ipairs{ 2, 3 } do
      local args = { EMU, "scripts/gpt2_check.lua", MODEL, "spec/fixtures/gpt2_tiny_state.bin", "--steps=1",
                     "--device=cuda", "--data=2", "--zero=" .. z }
      for i, a in ipairs(args) do args[i] = h.quote(a) end
      local rc, out = h.sh("PG_EMU_DEVICES=1 timeout -k 2 300 scripts/mpirun.sh -x PG_EMU_DEVICES -np 2 "
        .. table.concat(args, " "))
      assert.are_not.equal(0, rc, out)
      assert.matches(("zero = %d on the cuda backend reduces and gathers over the data group's NCCL stream, which "
        .. "this context lacks"):format(z), out, 1, true)
    end
  end)

  it("starts from the cpu engine's bits and computes one step's loss and gradients as the cpu backend does, to float32 rounding", function()
    local rc, out = emu([[
local pg = require "pipegoose"
local CFG = { vocab = 61, padded_vocab = 64, seq_len = 16, dim = 32, heads = 4, layers = 2 }
local x = pg.randn({ 4, 17 }, { seed = 3 })
local ids = {}
for b = 1, 4 do ids[b] = {} for t = 1, 17 do ids[b][t] = math.floor(math.abs(x:get(b, t)) * 1000) % 61 end end
local all = pg.tensor(ids, { dtype = "int32" })
local xs, ys = all:narrow(2, 1, 16), all:narrow(2, 2, 16)
local init
local function step(device, M)
  local e = pg.parallelize(pg.nn.GPT(CFG), nil, { device = device, micro_batches = M, seed = 5 })
  -- the same initial bits on either backend (the init rule runs on the host)
  local w = e:flat():to("cpu")
  if init then assert(w:equal(init), device .. ": initial parameters differ from the cpu engine's") end
  init = init or w
  e:zero_grad()
  local loss = e:forward_backward(xs, ys)
  local _, g = e:flat()
  return loss, g:to("cpu"), e
end
for _, M in ipairs{ 1, 2 } do
  local lc, gc = step("cpu", M)
  local ld, gd, e = step("cuda", M)
  assert(e.device == "cuda:0", e.device)
  local scale = math.max(1, gc:max_abs_diff(pg.zeros(gc:shape())))
  assert(scale > 0)
  assert(math.abs(ld - lc) <= 1e-6 * lc, ("M=%d loss cuda %.9g cpu %.9g"):format(M, ld, lc))
  assert(gd:allclose(gc, 1e-5, 1e-6 * scale), ("M=%d gradients: max |diff| %.3g"):format(M, gd:max_abs_diff(gc)))
  print(("M=%d loss %.9g vs %.9g, gradients max |diff| %.3g"):format(M, ld, lc, gd:max_abs_diff(gc)))
end
print("agree")
]])
    assert.equal(0, rc, out)
    assert.matches("agree", out)
  end)

  -- The device's AdamW step is one launch over a table of every piece (kernels.h's pg_adamw_piece), decay on the
  -- matrices only; with the cpu's gradients copied in, the cpu's bits (its per-piece kernel, operation for
  -- operation). Two engines of one shape step in turn: the device keeps one table and must see the other's pieces.
  it("takes AdamW steps with the cpu's bits: the fused step, decay on matrices only, two optimizers in turn", function()
    local rc, out = emu([[
local pg = require "pipegoose"
local CFG = { vocab = 61, padded_vocab = 64, seq_len = 16, dim = 32, heads = 4, layers = 2 }
local all = pg.tensor((function()
  local ids = {}
  for b = 1, 2 do ids[b] = {} for t = 1, 17 do ids[b][t] = (b * 31 + t * 7) % 61 end end
  return ids
end)(), { dtype = "int32" })
local xs, ys = all:narrow(2, 1, 16), all:narrow(2, 2, 16)
local function pair(seed)
  local r = {}
  for _, device in ipairs{ "cpu", "cuda" } do
    local e = pg.parallelize(pg.nn.GPT(CFG), nil, { device = device, seed = seed })
    r[device] = { e = e, o = pg.optim.AdamW(e, { lr = 1e-2, weight_decay = 0.5 }) }
  end
  return r
end
local pairs_ = { pair(5), pair(6) }
for s, k in ipairs{ 1, 2, 1, 2 } do
  local c, d = pairs_[k].cpu, pairs_[k].cuda
  c.e:zero_grad()
  c.e:forward_backward(xs, ys)
  local _, gc = c.e:flat()
  local _, gd = d.e:flat()
  gd:copy_(gc) -- the same gradients on both
  c.o:step()
  d.o:step()
  assert(d.e:flat():to("cpu"):equal(c.e:flat()), ("step %d (engine %d): parameters differ"):format(s, k))
  local sc, sd = c.o:state_dict(), d.o:state_dict()
  assert(sd.m:to("cpu"):equal(sc.m) and sd.v:to("cpu"):equal(sc.v), ("step %d: moments differ"):format(s))
end
print("same bits")
]], "PG_EMU_STATS=1")
    assert.equal(0, rc, out)
    assert.matches("same bits", out)
  end)

  -- ALiBi (BLOOM's biases): the slopes on the device backend, also where
  -- selective recomputation runs the forward kernel again in backward (the
  -- two layers share one probability buffer)
  it("an ALiBi block computes one step's loss and gradients as the cpu backend does, recomputed or not", function()
    local rc, out = emu([[
local pg = require "pipegoose"
local nn = pg.nn
local function model()
  local list = { nn.Embedding{ vocab = 61, dim = 32, name = "embed" } }
  for i = 0, 1 do -- two layers: their attentions share one probability buffer when recomputed
    list[#list + 1] = nn.Sequential{
      nn.Residual(nn.Sequential{ nn.LayerNorm(32, { name = "ln1" }),
        nn.CausalSelfAttention{ dim = 32, heads = 4, seq_len = 16, alibi = true, name = "attn" } }),
      nn.Residual(nn.Sequential{ nn.LayerNorm(32, { name = "ln2" }), nn.MLP{ dim = 32, name = "mlp" } }),
      name = "blocks." .. i,
    }
  end
  list[#list + 1] = nn.LayerNorm(32, { name = "ln_f" })
  list[#list + 1] = nn.LMHead{ vocab = 61, dim = 32, tie = false, name = "head" }
  return nn.Sequential(list)
end
local x = pg.randn({ 4, 17 }, { seed = 3 })
local ids = {}
for b = 1, 4 do ids[b] = {} for t = 1, 17 do ids[b][t] = math.floor(math.abs(x:get(b, t)) * 1000) % 61 end end
local all = pg.tensor(ids, { dtype = "int32" })
local xs, ys = all:narrow(2, 1, 16), all:narrow(2, 2, 16)
local function step(device, recompute)
  local e = pg.parallelize(model(), nil, { device = device, seed = 5, recompute = recompute, micro_batches = 2 })
  e:zero_grad()
  local loss = e:forward_backward(xs, ys)
  local _, g = e:flat()
  return loss, g:to("cpu")
end
local lc, gc = step("cpu", "none")
local ls, gs = step("cpu", "selective")
assert(ls == lc and gs:equal(gc), "selective recomputation with ALiBi: not the same bits")
local ld, gd = step("cuda", "none")
local ldr, gdr = step("cuda", "selective")
assert(ldr == ld and gdr:equal(gd), "cuda: selective recomputation with ALiBi: not the same bits")
local scale = math.max(1, gc:max_abs_diff(pg.zeros(gc:shape())))
assert(math.abs(ld - lc) <= 1e-6 * lc, ("loss cuda %.9g cpu %.9g"):format(ld, lc))
assert(gd:allclose(gc, 1e-5, 1e-6 * scale), ("gradients: max |diff| %.3g"):format(gd:max_abs_diff(gc)))
print(("alibi agrees: loss %.9g vs %.9g, gradients max |diff| %.3g"):format(ld, lc, gd:max_abs_diff(gc)))
]])
    assert.equal(0, rc, out)
    assert.matches("alibi agrees", out)
  end)

  it("keeps device tensors on the device: to(), clone(), copy_(), narrow, printing, and a clear refusal elsewhere", function()
    local rc, out = emu([[
local pg = require "pipegoose"
local t = pg.tensor{ { 1, 2, 3 }, { 4, 5, 6 } }
local d = t:to("cuda")
assert(d:device() == "cuda:0" and t:device() == "cpu")
assert(t:to("cpu") == t and d:to("cuda:0") == d, "to() returns the tensor itself when it is already there")
assert(tostring(d) == "pg.Tensor([2, 3] float32, cuda:0)", tostring(d))
assert(d:numel() == 6 and d:shape()[2] == 3 and d:reshape{ 6 }:device() == "cuda:0")
assert(d:to("cpu"):equal(t))
assert(d:clone():device() == "cuda:0" and d:clone():to("cpu"):equal(t))
local z = pg.zeros{ 2, 3 }:to("cuda")
z:copy_(t)
assert(z:to("cpu"):equal(t))
local back = pg.zeros{ 2, 3 }
back:copy_(z)
assert(back:equal(t))
local ok, err = pcall(function() return d:sum() end)
assert(not ok and err:find('the tensor is on cuda:0 %(device memory%); copy it to the host with :to%("cpu"%)'), err)
local col = d:narrow(2, 2, 1) -- not contiguous: a copy, made on the device (pg_backend_narrow_copy)
assert(col:device() == "cuda:0" and col:to("cpu"):equal(t:narrow(2, 2, 1)))
ok, err = pcall(function() return t:to("tpu") end)
assert(not ok and err:find("device must be 'cpu', 'cuda' or 'cuda:N', not 'tpu'"), err)
print("device tensors ok")
]])
    assert.equal(0, rc, out)
    assert.matches("device tensors ok", out)
  end)

  it("copies to the device on one rank alone, to that rank's device (no collective)", function()
    -- the rank -> device rule uses the rank's place on its node, found at start-up
    local rc, out = h.sh(("timeout -k 2 60 scripts/mpirun.sh -np 2 %s -e %s"):format(h.quote(EMU), h.quote(
      [[local pg = require "pipegoose"
        if pg.world_rank() == 1 then print("rank 1: " .. pg.tensor{ 1, 2 }:to("cuda"):device()) end]])))
    assert.equal(0, rc, out)
    assert.matches("rank 1: cuda:1", out)
  end)

  -- context = 2: with a GPU per rank the ring's key/value blocks (and in backward their gradients) are grouped
  -- ncclSend/ncclRecv on the context group's stream, overlapping the block kernels; when ranks share a GPU they
  -- are staged through the host. Same kernels, same order of folds: the same bits, the losses and every gradient,
  -- and the loss after an AdamW step.
  it("context = 2: the ring over NCCL on its own stream gives the staged ring's bits (GPT-2, LLaMA, BLOOM)", function()
    local chunk = h.tmpfile([[
local pg = require "pipegoose"
local S, V = 16, 61
local function batch(seed)
  local t = {}
  for b = 1, 4 do
    t[b] = {}
    for s = 1, S do t[b][s] = (seed * 7919 + b * 2713 + s * 337) % V end
  end
  return pg.tensor(t, { dtype = "int32" })
end
local X, Y = batch(1), batch(2)
local models = {
  pg.nn.GPT{ vocab = V, seq_len = S, dim = 24, heads = 4, layers = 2 },
  pg.nn.Llama{ vocab = V, seq_len = S, dim = 24, heads = 4, kv_heads = 2, hidden = 48, layers = 2 },
  pg.nn.Bloom{ vocab = V, seq_len = S, dim = 24, heads = 4, layers = 2 },
}
local function hex(t, acc)
  for _, v in ipairs(t) do
    if type(v) == "table" then hex(v, acc) else acc[#acc + 1] = ("%a"):format(v) end
  end
  return acc
end
for i, model in ipairs(models) do
  local ctx = pg.ParallelContext{ context = 2, seed = 5 }
  local e = pg.parallelize(model, ctx, { micro_batches = 2, device = "cuda" })
  local o = pg.optim.AdamW(e, { lr = 1e-3 })
  ctx:reset_comm_stats()
  e:zero_grad()
  local lines = { ("model %d loss %a"):format(i, e:forward_backward(X, Y)) }
  for _, p in ipairs(e:parameters()) do
    lines[#lines + 1] = p.name .. " " .. table.concat(hex(e:gather_param(p.name, true):to("cpu"):totable(), {}), ",")
  end
  o:step()
  lines[#lines + 1] = ("model %d after a step: loss %a"):format(i, e:loss(X, Y))
  local st = ctx:comm_stats().context
  if ctx:rank() == 0 then
    print(table.concat(lines, "\n"))
    print(("ring: %d sends, %d direct"):format(st.send.calls, st.send.direct))
  end
end
]])
    local function run(env)
      local rc, out = h.sh(("%s timeout -k 2 300 scripts/mpirun.sh -x PG_EMU_DEVICES -np 2 %s %s"):format(env,
        h.quote(EMU), h.quote(chunk)))
      assert.equal(0, rc, out)
      return out
    end
    local nccl, staged = run("PG_EMU_DEVICES=2"), run("PG_EMU_DEVICES=1")
    os.remove(chunk)
    local function bits(out) return (out:gsub("\n?pipegoose:[^\n]*", ""):gsub("\nring:[^\n]*", "")) end
    assert.equal(3 * 2, h.count(nccl, " loss "), nccl)
    assert.is_true(h.count(nccl, "0x") > 1000, nccl) -- every gradient's values
    assert.equal(bits(staged), bits(nccl))
    for sends, direct in nccl:gmatch("ring: (%d+) sends, (%d+) direct") do
      assert.is_true(tonumber(sends) > 0 and direct == sends, nccl)
    end
    for _, direct in staged:gmatch("ring: (%d+) sends, (%d+) direct") do assert.equal("0", direct, staged) end
    assert.equal(3, h.count(nccl, "ring: "), nccl)
    assert.equal(3, h.count(staged, "ring: "), staged)
  end)

  it("saves a checkpoint on the device that loads on the cpu and back, bit for bit", function()
    local dir = h.tmpdir()
    local rc, out = emu(([[
local pg = require "pipegoose"
local dir = %q
os.execute("mkdir -p " .. dir)
local CFG = { vocab = 61, seq_len = 8, dim = 16, heads = 2, layers = 1 }
local ids = {}
for i = 1, 400 do ids[i] = (i * 7 + 3) %% 61 end
pg.data.write_shard(dir .. "/tokens.bin", ids)
local function build(device)
  local e = pg.parallelize(pg.nn.GPT(CFG), nil, { device = device, seed = 9 })
  local o = pg.optim.AdamW(e, { lr = 1e-2 })
  local data = pg.data.TokenShards{ path = dir .. "/tokens.bin", batch = 2, seq_len = 8, seed = 1 }
  local t = pg.Trainer{ engine = e, optimizer = o, max_steps = 2, out = pg.testing.capture(), out_dir = dir }
  return t, data
end
local function flat_of(t) local p = t.engine:flat() return p:to("cpu") end
local function state_of(t) local sd = t.optimizer:state_dict() return sd.m:to("cpu"), sd.v:to("cpu") end
local gpu, data = build("cuda")
gpu:fit(data)
local path = dir .. "/ckpt"
gpu:save_checkpoint(path)
local want = flat_of(gpu)
local wm, wv = state_of(gpu)
local cpu = build("cpu")
pg.checkpoint.load(cpu, path)
assert(flat_of(cpu):equal(want), "parameters on the cpu")
local m, v = state_of(cpu)
assert(m:equal(wm) and v:equal(wv), "AdamW state on the cpu")
assert(cpu.optimizer:state_dict().step == 2)
local again = build("cuda")
pg.checkpoint.load(again, path)
assert(flat_of(again):equal(want), "parameters back on the device")
print("checkpoint ok")
]]):format(dir))
    h.rm(dir)
    assert.equal(0, rc, out)
    assert.matches("checkpoint ok", out)
  end)

  it("ends the job with what failed on which device when the model does not fit (no hang)", function()
    -- a 1 MB emulated device; the model needs 2 x 3.7 MB of flat buffers
    local rc, out = h.sh(("PG_EMU_MEMORY=1000000 timeout -k 2 60 scripts/mpirun.sh -x PG_EMU_MEMORY -np 2 %s -e %s")
      :format(h.quote(EMU), h.quote([[local pg = require "pipegoose"
        pg.parallelize(pg.nn.GPT{ vocab = 1000, seq_len = 64, dim = 128, heads = 4, layers = 4 },
                       pg.ParallelContext{ data = 2 }, { device = "cuda" })
        print("fitted")]])))
    assert.is_true(rc ~= 0 and rc ~= 124, out)
    assert.is_nil(out:find("fitted"), out)
    assert.matches("%[ranks? [%d,%-]+%] [^\n]*the flat parameter and gradient buffers %(2 x 3718144 bytes on cuda%): allocating "
      .. "device memory on cuda:%d: out of memory %(3718144 bytes%)", out)
  end)

  it("trains the LLaMA fixture (GQA, RoPE, RMSNorm, SwiGLU) on one rank and at T = 2 and P = 2 (model_check --device=cuda)", function()
    -- spec/unit/llama_spec.lua's fixture and tolerance (1e-5 relative on the losses and the first gradient norm)
    local dir = "spec/fixtures/hf_llama_tiny"
    local ef = assert(io.open(dir .. "/expected.json"))
    local e = cjson.decode(ef:read("a"))
    ef:close()
    for _, c in ipairs{ { 1, {} }, { 2, { "--tensor=2" } }, { 2, { "--pipeline=2", "--micro-batches=2" } } } do
      local args = { "scripts/model_check.lua", "--hf=" .. dir, "--tokens=" .. dir .. "/tokens.bin", "--steps=4",
                     "--clip=" .. e.clip, "--device=cuda" }
      for _, a in ipairs(c[2]) do args[#args + 1] = a end
      local quoted = {}
      for i, a in ipairs(args) do quoted[i] = h.quote(a) end
      local cmd = c[1] == 1 and ("timeout -k 2 300 %s %s"):format(h.quote(EMU), table.concat(quoted, " "))
        or ("timeout -k 2 300 scripts/mpirun.sh -np %d %s %s"):format(c[1], h.quote(EMU), table.concat(quoted, " "))
      local rc, out = h.sh(cmd)
      assert.equal(0, rc, out)
      local seen = 0
      for k, loss in out:gmatch("step (%d+) loss (%S+)") do
        k, loss = tonumber(k), tonumber(loss)
        seen = seen + 1
        assert.is_true(math.abs(loss - e.step_losses[k]) <= 1e-5 * e.step_losses[k],
          ("%s step %d loss %.9g, PyTorch %.9g"):format(table.concat(c[2], " "), k, loss, e.step_losses[k]))
      end
      assert.equal(4, seen, out)
      local norm = tonumber(out:match("grad_norm 1 (%S+)"))
      assert.is_true(norm and math.abs(norm - e.grad_norms[1]) <= 1e-5 * e.grad_norms[1], out)
    end
  end)

  -- spec/unit/mixtral_spec.lua's fixture and tolerance (1e-5 relative on the losses, their cross-entropy and
  -- load-balancing parts, and the first gradient norm), 4 of its 10 steps: the moe kind on the device, serially
  -- and with the experts spread over 2 ranks (the all-to-all NCCL's grouped sends and receives)
  it("trains the Mixtral fixture (4 experts, top-2, load balancing) on one rank and at D = 2 x E = 2 (model_check --device=cuda)", function()
    local dir = "spec/fixtures/hf_mixtral_tiny"
    local ef = assert(io.open(dir .. "/expected.json"))
    local e = cjson.decode(ef:read("a"))
    ef:close()
    local steps = 4
    for _, c in ipairs{ { 1, {} }, { 2, { "--data=2", "--expert=2" } } } do
      local args = { "scripts/model_check.lua", "--hf=" .. dir, "--tokens=" .. dir .. "/tokens.bin", "--batch=" .. e.batch,
                     "--seq-len=" .. e.seq_len, "--steps=" .. steps, "--lr=" .. e.lr, "--beta1=" .. e.beta1,
                     "--beta2=" .. e.beta2, "--eps=" .. e.eps, "--weight-decay=" .. e.weight_decay, "--device=cuda" }
      for _, a in ipairs(c[2]) do args[#args + 1] = a end
      local quoted = {}
      for i, a in ipairs(args) do quoted[i] = h.quote(a) end
      local cmd = c[1] == 1 and ("timeout -k 2 400 %s %s"):format(h.quote(EMU), table.concat(quoted, " "))
        or ("timeout -k 2 400 scripts/mpirun.sh -np %d %s %s"):format(c[1], h.quote(EMU), table.concat(quoted, " "))
      local rc, out = h.sh(cmd)
      assert.equal(0, rc, out)
      local what = table.concat(c[2], " ")
      local function close(got, want, name)
        assert.is_true(got and math.abs(got - want) <= 1e-5 * math.abs(want),
          ("%s %s: %s, PyTorch %.9g\n%s"):format(what, name, tostring(got), want, out))
      end
      local seen = 0
      for k, loss in out:gmatch("step (%d+) loss (%S+)") do
        k = tonumber(k)
        seen = seen + 1
        close(tonumber(loss), e.step_losses[k], "step " .. k .. " loss")
      end
      for k, ce, aux in out:gmatch("step (%d+) ce_loss (%S+) aux_loss (%S+)") do
        k = tonumber(k)
        close(tonumber(ce), e.step_ce_losses[k], "step " .. k .. " ce_loss")
        close(tonumber(aux), e.aux_loss_coef * e.step_aux_losses[k], "step " .. k .. " aux_loss")
      end
      assert.equal(steps, seen, out)
      close(tonumber(out:match("grad_norm 1 (%S+)")), e.grad_norms[1], "first gradient norm")
    end
  end)

  it("refuses a module written in Lua that returns a host tensor to a device engine, naming both devices", function()
    -- spec/unit/lua_modules_spec.lua trains modules written in Lua on the device
    local rc2, out2 = emu([[
local pg = require "pipegoose"
local ident = { in_width = 16, out_width = 16 }
function ident:forward(slot, x) return x:to("cpu") end
function ident:backward(slot, dy) return dy end
local m = pg.nn.Sequential{ name = "" }
m:add(pg.nn.Embedding{ vocab = 20, dim = 16, positions = 8, name = "embed" })
m:add(ident)
m:add(pg.nn.LMHead{ vocab = 20, dim = 16 })
m.config = { vocab = 20, seq_len = 8, dim = 16 }
local e = pg.parallelize(m, nil, { device = "cuda" })
local x = pg.tensor({ { 1, 2, 3 } }, { dtype = "int32" })
local ok, err = pcall(e.loss, e, x, x)
print(ok, err)
]])
    assert.equal(0, rc2, out2)
    assert.matches("module written in Lua: forward returned a cpu tensor, but the engine runs on cuda:0", out2, 1, true)
  end)

  -- Mixture of experts on the device (kernels/cuda/moe.cu: routing, capacity, grouping, gather and combine; the
  -- experts' products one cuBLAS GEMM each) against the cpu backend in one process, same weights and batch, with
  -- the load-balancing and z-losses and capacity_factor (dropped choices), one and two micro-batches. The routing
  -- decisions are integer scans of the same logits on both (the self-test checks them bit for bit), and the
  -- fixture's router margins are far above float32's differences, so both choose the same experts: the per-expert
  -- token counts are compared exactly. What differs is the products' summation (the emulated cuBLAS sums in double
  -- and rounds once, OpenBLAS in float32): the GPT case's tolerance, |cuda - cpu| <= 1e-5 |cpu| + 1e-6 max |cpu| on
  -- the gradients, 1e-6 relative on the losses.
  it("runs a mixture of experts on the device as the cpu backend does (aux and z-losses, capacity, micro-batches)", function()
    local rc, out = emu([[
local pg = require "pipegoose"
local CFG = { vocab = 61, padded_vocab = 64, seq_len = 16, dim = 16, heads = 2, kv_heads = 2, hidden = 24, layers = 2,
              experts = 4, top_k = 2, aux_loss_coef = 0.02, z_loss_coef = 0.001 }
local x = pg.randn({ 4, 17 }, { seed = 3 })
local ids = {}
for b = 1, 4 do ids[b] = {} for t = 1, 17 do ids[b][t] = math.floor(math.abs(x:get(b, t)) * 1000) % 61 end end
local all = pg.tensor(ids, { dtype = "int32" })
local xs, ys = all:narrow(2, 1, 16), all:narrow(2, 2, 16)
local function step(device, M, capacity)
  local cfg = {}
  for k, v in pairs(CFG) do cfg[k] = v end
  cfg.capacity_factor = capacity
  local e = pg.parallelize(pg.nn.Mixtral(cfg), nil, { device = device, micro_batches = M, seed = 5 })
  e:zero_grad()
  local loss = e:forward_backward(xs, ys)
  local _, g = e:flat()
  return loss, g:to("cpu"), e:losses().expert_tokens
end
for _, c in ipairs{ { 1, nil }, { 2, nil }, { 2, 0.75 } } do
  local M, cap = c[1], c[2]
  local lc, gc, tc = step("cpu", M, cap)
  local ld, gd, td = step("cuda", M, cap)
  local what = ("M=%d capacity %s"):format(M, tostring(cap))
  local scale = math.max(1, gc:max_abs_diff(pg.zeros(gc:shape())))
  assert(math.abs(ld - lc) <= 1e-6 * lc, ("%s loss cuda %.9g cpu %.9g"):format(what, ld, lc))
  assert(gd:allclose(gc, 1e-5, 1e-6 * scale), ("%s gradients: max |diff| %.3g"):format(what, gd:max_abs_diff(gc)))
  assert(#tc == CFG.experts and #td == CFG.experts, what .. ": no expert_tokens")
  for e, n in ipairs(tc) do assert(td[e] == n, ("%s expert %d: %s choices, cpu %s"):format(what, e, td[e], n)) end
  print(("%s loss %.9g vs %.9g, gradients max |diff| %.3g"):format(what, ld, lc, gd:max_abs_diff(gc)))
end
print("agree")
]])
    assert.equal(0, rc, out)
    assert.matches("agree", out)
  end)

  it("refuses by name what the moe kind cannot run on a device yet (jitter), when its buffers are made", function()
    local rc2, out2 = emu([[
local pg = require "pipegoose"
local m = pg.nn.Mixtral{ vocab = 20, dim = 16, layers = 1, heads = 2, hidden = 16, experts = 2, seq_len = 8, jitter = 0.1 }
local e = pg.parallelize(m, nil, { device = "cuda" })
local x = pg.zeros({ 2, 8 }, { dtype = "int32" })
local ok, err = pcall(e.forward_backward, e, x, x)
print(ok, err)
]])
    assert.equal(0, rc2, out2)
    assert.matches("blocks.0.moe: the moe kind's jitter %(router noise drawn on the host%) runs on the cpu backend only for now, not cuda", out2)
  end)

  -- precision = "bf16" on the device against the CPU's bf16 in one process, same weights and batch (two
  -- micro-batches: the weight gradients accumulate, the working weights serve both): the same
  -- rounded operands (the device's rounding is the CPU's, bit for bit: make cuda-emu), whose products are exact
  -- in float32, summed in float32 in an order that depends on the CPU's bf16 GEMM path (#bf16: make test runs
  -- both). The first step's gradients, by path:
  --   fallback: like with like. The emulated GemmEx adds the products in order of k, and so does OpenBLAS's
  --     sgemm on the widened operands at these K (each output's sum in one register, K under one block), so
  --     every rounded activation is the same: |cuda - cpu| <= 1e-5 max |cpu| (measured 3e-8 of max 0.08);
  --   onednn: its kernels add the products in pairs (vdpbf16ps, AMX tiles), other float32 sums, so now and
  --     then an activation rounds to the neighbouring bf16 value, a step of 2^-8 of itself, which moves the
  --     gradients that flow through it by as much: |cuda - cpu| <= 2^-8 max |cpu| (measured 1.9e-4 of max
  --     0.08 on GPT-2, 738 of 28032 gradients past 1e-5 of the max; an Intel Xeon with AMX and the same with
  --     oneDNN held to AVX512_BF16 alike).
  -- Three AdamW steps' losses to 1e-4 relative on both, bf16_check_spec's layout tolerance (measured 9.6e-6 at
  -- step 3: Adam's normalised updates carry the sum-order differences on).
  -- GPT-2 (GELU, bias gradients of bf16 outputs), LLaMA (SwiGLU, RoPE on bf16 q|k|v), Mixtral (the moe kind's
  -- router and experts on bf16 operands) and a bf16 residual branch: the device's bf16 kernels against the CPU's.
  local MODELS = {
    gpt2 = 'pg.nn.GPT.load_llmc("spec/fixtures/gpt2_tiny_model.bin")',
    llama = "pg.nn.Llama{ vocab = 61, dim = 16, layers = 2, heads = 2, kv_heads = 1, hidden = 24, seq_len = 16 }",
    -- the moe kind's bf16 products (router and experts) on its working weights in device memory
    mixtral = "pg.nn.Mixtral{ vocab = 61, dim = 16, layers = 2, heads = 2, kv_heads = 1, hidden = 24, seq_len = 16, " ..
      "experts = 4, top_k = 2, aux_loss_coef = 0.02, z_loss_coef = 0.001 }",
    -- a bf16 branch (a plain Linear and GELU) added to the float32 stream
    branch = [=[pg.nn.Sequential{ pg.nn.Embedding{ vocab = 61, dim = 16, positions = 16, name = "embed" },
      pg.nn.Residual(pg.nn.Sequential{ pg.nn.Linear{ ["in"] = 16, out = 16, name = "mix" }, pg.nn.GELU() }),
      pg.nn.LayerNorm(16, { name = "ln_f" }), pg.nn.LMHead{ vocab = 61, dim = 16, tie = false, name = "head" } }]=],
  }
  for _, model in ipairs{ "gpt2", "llama", "mixtral", "branch" } do
  it("runs precision = \"bf16\" on the device: the CPU's bf16 results, the working weights in device memory (" ..
    model .. ") #bf16", function()
    local rc, out = emu((([[
local pg = require "pipegoose"
print("cpu_gemm " .. pg.ops.bf16_gemm_path())
local x, y = pg.zeros({ 4, 16 }, { dtype = "int32" }), pg.zeros({ 4, 16 }, { dtype = "int32" })
for b = 1, 4 do
  for s = 1, 16 do
    x:set(b, s, (b * 31 + s * 7) % 61)
    y:set(b, s, (b * 13 + s * 5 + b * s) % 61)
  end
end
local function build(device, precision)
  local e = pg.parallelize(MODEL, pg.ParallelContext{ seed = 7 },
    { device = device, precision = precision, micro_batches = 2 })
  return e, pg.optim.AdamW(e, { lr = 1e-2 })
end
local gpu, go = build("cuda", "bf16")
local cpu, co = build("cpu", "bf16")
local f32 = build("cuda", "fp32")
print(("fp32 loss %.9g"):format(f32:loss(x, y)))
for step = 1, 3 do
  gpu:zero_grad()
  cpu:zero_grad()
  local lg, lc = gpu:forward_backward(x, y), cpu:forward_backward(x, y)
  local _, gg = gpu:flat()
  local _, gc = cpu:flat()
  local a, b = gg:to("cpu"):totable(), gc:totable()
  local diff, big = 0, 0
  for i = 1, #b do
    diff = math.max(diff, math.abs(a[i] - b[i]))
    big = math.max(big, math.abs(b[i]))
  end
  print(("step %d loss %.9g cpu %.9g grad_diff %.3g grad_max %.3g"):format(step, lg, lc, diff, big))
  go:step()
  co:step()
end
local mg, mc = gpu:memory(), cpu:memory()
print(("memory %s %d %d"):format(mg.precision, mg.bf16_bytes, mc.bf16_bytes))
]]):gsub("MODEL", function() return MODELS[model] end)))
    assert.equal(0, rc, out)
    local fp32 = tonumber(out:match("fp32 loss (%S+)"))
    local gemm = out:match("cpu_gemm (%a+)")
    assert.is_true(gemm == "fallback" or gemm == "onednn", out)
    local bound = gemm == "fallback" and 1e-5 or 2 ^ -8
    local seen = 0
    for k, lg, lc, diff, big in out:gmatch("step (%d+) loss (%S+) cpu (%S+) grad_diff (%S+) grad_max (%S+)") do
      k, lg, lc, diff, big = tonumber(k), tonumber(lg), tonumber(lc), tonumber(diff), tonumber(big)
      seen = seen + 1
      assert.is_true(math.abs(lg - lc) <= 1e-4 * lc, ("step %d: device bf16 loss %.9g, cpu %.9g"):format(k, lg, lc))
      if k == 1 then
        assert.is_true(big > 0 and diff <= bound * big,
          ("first gradients: |cuda - cpu| %.3g, max %.3g (the CPU's bf16 GEMM: %s)"):format(diff, big, gemm))
        assert.is_true(lg ~= fp32, "the device's bf16 loss is its float32 loss: did bf16 run?")
      end
    end
    assert.equal(3, seen, out)
    -- the working weights and scratch: the same bytes as on the CPU, in the device's memory
    local prec, bg, bc = out:match("memory (%S+) (%d+) (%d+)")
    assert.equal("bf16", prec, out)
    assert.is_true(tonumber(bg) > 0 and bg == bc, out)
  end)
  end

  -- precision bf16's forward product goes through cuBLASLt (the bias in its epilogue, and a bf16 output written
  -- by the product itself) where it loads; the emulated cuBLASLt sums as the emulated GemmEx does, adds the bias
  -- once and rounds as bf16_from_f32, so the step has the GemmEx path's bits (PG_CUBLASLT=0), with one bias pass
  -- fewer per linear with a bias and one rounding pass fewer per linear with a bf16 output (GPT, 2 layers: 4
  -- linears each, all with a bias and a bf16 output: 8 + 8).
  it("runs precision bf16's forward products through cuBLASLt: PG_CUBLASLT=0's bits, 16 launches fewer #bf16",
    function()
    local code = [[
local pg = require "pipegoose"
local CFG = { vocab = 61, padded_vocab = 64, seq_len = 16, dim = 32, heads = 4, layers = 2 }
local e = pg.parallelize(pg.nn.GPT(CFG), nil, { device = "cuda", seed = 5, precision = "bf16" })
local x = pg.tensor((function()
  local ids = {}
  for b = 1, 2 do ids[b] = {} for t = 1, 17 do ids[b][t] = (b * 13 + t * 5) % 61 end end
  return ids
end)(), { dtype = "int32" })
e:zero_grad()
local loss = e:forward_backward(x:narrow(2, 1, 16), x:narrow(2, 2, 16))
local _, g = e:flat()
local gc = g:to("cpu")
print(("loss %.17g gradsum %.17g gradsq %.17g"):format(loss, gc:abs():sum(), gc:mul(gc):sum()))
]]
    local rc1, lt = emu(code, "PG_EMU_STATS=1")
    local rc2, ex = emu(code, "PG_EMU_STATS=1 PG_CUBLASLT=0")
    assert.equal(0, rc1, lt)
    assert.equal(0, rc2, ex)
    local a, b = lt:match("loss %S+ gradsum %S+ gradsq %S+"), ex:match("loss %S+ gradsum %S+ gradsq %S+")
    assert.is_truthy(a, lt)
    assert.equal(b, a)
    local la, lb = tonumber(lt:match("emu: (%d+) kernel launches")), tonumber(ex:match("emu: (%d+) kernel launches"))
    assert.equal(lb - 16, la, lt .. ex)
  end)

  -- precision bf16's attention on tensor cores (kernels/cuda/flash_bf16.cu, kind_attention.c's tensor_cores):
  -- on a device, bf16 q|k|v of head size 64 or 128 and T a multiple of 16 go to the bf16 flash kernels as
  -- they are (no float32 copy of q|k|v or dy); PG_FLASH_BF16=0, or any other shape, takes the float32 core on the
  -- widened inputs. GPT-2 (head size 64, 2 heads), LLaMA (head size 128, GQA 2:1, RoPE) and BLOOM (head size 64,
  -- 4 heads, ALiBi: the kernels add slope (j - i) as the float32 core does), T = 32:
  --   * the first step's gradients no further from the float32 run's (precision fp32, same process) than
  --     1.5x the float32 core's are: the kernels round P and dS to bf16 for their products (and the rotated
  --     q|k, as autocast's are), 2^-9 relative each, a few more of the bf16 roundings both runs make in every
  --     layer, so the distance grows by a fraction (measured 1.02x GPT-2, 1.01x LLaMA, 1.00x BLOOM; a wrong mask,
  --     scale, bias or head mapping is many times it: BLOOM without ALiBi 10x). The first losses within 1e-3 relative (measured 2.3e-5,
  --     4.8e-5, 2.6e-6);
  --   * not the float32 core's bits (the tensor-core kernels ran), and the launches the float32 core's
  --     widenings and roundings (the tensor-core kernels write the bf16 output and input gradient themselves)
  --     cost: GPT-2 and BLOOM 5 fewer per layer and step (q|k|v in the forward and the backward, the output, dy,
  --     the input gradient), 7 with full recomputation's second forward; LLaMA 3 (q|k|v and the output in the
  --     forward: the rotation runs on a bf16 copy; dy), 5 with full recomputation's second forward (RoPE's
  --     backward rotation needs the float32 input gradient);
  --   * a second engine's bits (no atomics), and recomputation's (full, selective) bits;
  --   * T = 24, not a multiple of 16: PG_FLASH_BF16=0's bits (the float32 core).
  it("runs precision bf16's attention on tensor cores where the shape allows (head size 64 and 128, GQA, RoPE, ALiBi)",
    function()
    local code = [[
local pg = require "pipegoose"
local MODELS = {
  gpt2 = function() return pg.nn.GPT{ vocab = 61, padded_vocab = 64, seq_len = 32, dim = 128, heads = 2, layers = 2 } end,
  llama = function() return pg.nn.Llama{ vocab = 61, dim = 256, layers = 2, heads = 2, kv_heads = 1, hidden = 96, seq_len = 32 } end,
  bloom = function() return pg.nn.Bloom{ vocab = 61, dim = 256, heads = 4, layers = 2, seq_len = 32 } end,
}
local function batch(T)
  local x, y = pg.zeros({ 2, T }, { dtype = "int32" }), pg.zeros({ 2, T }, { dtype = "int32" })
  for b = 1, 2 do
    for s = 1, T do
      x:set(b, s, (b * 31 + s * 7) % 61)
      y:set(b, s, (b * 13 + s * 5 + b * s) % 61)
    end
  end
  return x, y
end
-- the first step's loss and gradients of a fresh engine
local function first(model, T, opts)
  opts.device, opts.seed = "cuda", 7
  local e = pg.parallelize(MODELS[model](), nil, opts)
  local x, y = batch(T)
  e:zero_grad()
  local loss = e:forward_backward(x, y)
  local _, g = e:flat()
  return loss, g:to("cpu"):totable()
end
local function same(a, b)
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return #a == #b
end
local function dist(a, b) -- |a - b| / |b|
  local d, n = 0, 0
  for i = 1, #b do d, n = d + (a[i] - b[i]) ^ 2, n + b[i] ^ 2 end
  return math.sqrt(d / n)
end
for _, model in ipairs{ "gpt2", "llama", "bloom" } do
  local loss, g = first(model, 32, { precision = "bf16" })
  local _, g32 = first(model, 32, { precision = "fp32" })
  local f = assert(io.open(OUT .. model, "w"))
  for i = 1, #g do f:write(("%.9g\n"):format(g[i])) end
  f:close()
  local _, again = first(model, 32, { precision = "bf16" })
  local _, full = first(model, 32, { precision = "bf16", recompute = "full" })
  local _, sel = first(model, 32, { precision = "bf16", recompute = "selective" })
  local l24, g24 = first(model, 24, { precision = "bf16" })
  local sq = 0
  for i = 1, #g24 do sq = sq + g24[i] ^ 2 end
  print(("%s loss %.9g dist_fp32 %.6g rerun %s full %s selective %s t24 %.17g %.17g"):format(model, loss,
    dist(g, g32), same(again, g), same(full, g), same(sel, g), l24, sq))
end
]]
    local out_tc, out_core = os.tmpname(), os.tmpname()
    local rc1, tc = emu(code:gsub("OUT", ("%q"):format(out_tc)), "PG_EMU_STATS=1")
    local rc2, core = emu(code:gsub("OUT", ("%q"):format(out_core)), "PG_EMU_STATS=1 PG_FLASH_BF16=0")
    assert.equal(0, rc1, tc)
    assert.equal(0, rc2, core)
    local function grads(path)
      local t = {}
      for line in io.lines(path) do t[#t + 1] = tonumber(line) end
      os.remove(path)
      return t
    end
    local line = "loss (%S+) dist_fp32 (%S+) rerun (%a+) full (%a+) selective (%a+) t24 (%S+ %S+)"
    for _, model in ipairs{ "gpt2", "llama", "bloom" } do
      local lt, dt, rerun, full, sel, t24 = tc:match(model .. " " .. line)
      local lc, dc, _, _, _, c24 = core:match(model .. " " .. line)
      assert.is_truthy(lt and lc, tc .. core)
      lt, dt, lc, dc = tonumber(lt), tonumber(dt), tonumber(lc), tonumber(dc)
      assert.is_true(math.abs(lt - lc) <= 1e-3 * lc, ("%s: first loss %.9g on tensor cores, %.9g"):format(model, lt, lc))
      assert.is_true(dc > 0 and dt <= 1.5 * dc,
        ("%s: the gradients %.3g from float32's on tensor cores, %.3g with the float32 core"):format(model, dt, dc))
      local a, b = grads(out_tc .. model), grads(out_core .. model)
      local differ = #a ~= #b
      for i = 1, #b do differ = differ or a[i] ~= b[i] end
      assert.is_true(differ, model .. ": the float32 core's bits: did the tensor-core kernels run?")
      assert.equal("true", rerun, model .. ": a second engine's gradients differ")
      assert.equal("true", full, model .. ": full recomputation's gradients differ")
      assert.equal("true", sel, model .. ": selective recomputation's gradients differ")
      assert.equal(c24, t24, model .. ": T = 24 is not the float32 core's")
    end
    -- one step of each engine at T = 32 (default, again, full, selective), 2 layers: GPT-2 and BLOOM
    -- 2 x (5 + 5 + 7 + 5) fewer each, LLaMA 2 x (3 + 3 + 5 + 3)
    local nt, nc = tonumber(tc:match("emu: (%d+) kernel launches")), tonumber(core:match("emu: (%d+) kernel launches"))
    assert.equal(nc - 2 * 2 * (5 + 5 + 7 + 5) - 2 * (3 + 3 + 5 + 3), nt, tc .. core)
  end)

  -- scripts/bench_gpu.lua runs on a real GPU (scripts/gpu_check.sh); here its logic, not its speed: both
  -- precisions' peaks (sgemm, bf16 GemmEx) and training lines, the flash attention kernels' lines, and the rate
  -- functions' argument checks.
  it("runs bench_gpu.lua's fp32 and bf16 parts (--model=tiny)", function()
    local rc, out = h.sh(("timeout -k 2 300 %s scripts/bench_gpu.lua --model=tiny --steps=1 --warmup=0 --peak-n=16")
      :format(h.quote(EMU)))
    assert.equal(0, rc, out)
    assert.matches("peak sgemm_fp32 %S+ GFLOP/s %(n = 16%)", out)
    assert.matches("peak gemm_bf16 %S+ GFLOP/s %(n = 16, bf16 inputs, float32 sums%)", out)
    local line = "gpt2%-tiny 4x16 tokens_per_s %S+ step_ms %S+ "
    local fp32, fp32_attn = out:match(line .. "mfu_vs_sgemm (%S+) mfu_attn (%S+) loss %S+ %(fp32")
    local bf16, bf16_attn = out:match(line .. "mfu_vs_bf16_gemm (%S+) mfu_attn (%S+) loss %S+ %(bf16")
    fp32, bf16 = tonumber(fp32), tonumber(bf16)
    assert.is_true(fp32 ~= nil and fp32 >= 0 and bf16 ~= nil and bf16 >= 0, out)
    -- --attention (tiny: T 64): the bf16 flash attention kernels timed at both head sizes
    for _, hs in ipairs{ 64, 128 } do
      local fwd, bwd = out:match(("attention_bf16 T 64 HS %d BxNH 1x%d fwd_ms (%%S+) bwd_ms (%%S+) "):format(hs, 128 // hs))
      assert.is_true(tonumber(fwd) ~= nil and tonumber(fwd) > 0 and tonumber(bwd) ~= nil and tonumber(bwd) > 0, out)
    end
    -- attention's products add to the count
    assert.is_true(tonumber(fp32_attn) >= fp32 and tonumber(bf16_attn) >= bf16, out)
    -- the issue's table's shape: LLaMA at several lengths, a step's tokens fixed (the batch = tokens / T)
    local rc3, out3 = h.sh(("timeout -k 2 300 %s scripts/bench_gpu.lua --model=llama-tiny --seqs=8,16 --tokens=32 "
      .. "--precision=bf16 --steps=1 --warmup=0 --peak-n=16"):format(h.quote(EMU)))
    assert.equal(0, rc3, out3)
    assert.matches("llama%-tiny 4x8 tokens_per_s %S+ step_ms %S+ mfu_vs_bf16_gemm %S+ mfu_attn %S+ loss", out3)
    assert.matches("llama%-tiny 2x16 tokens_per_s %S+ step_ms %S+ mfu_vs_bf16_gemm %S+ mfu_attn %S+ loss", out3)
    local rc2, out2 = emu([[
local pg = require "pipegoose"
print(pcall(pg.cuda.bf16_gemm_gflops, 0))
print(pcall(pg.cuda.flash_bf16_seconds, 1, 64, 2, 2, 96))
]])
    assert.equal(0, rc2, out2)
    assert.matches("false\tbad argument #1 (n): an integer from 1 to 65536 expected, got 0", out2, 1, true)
    assert.matches("false\tpg.cuda.flash_bf16_seconds: flash_bf16_seconds: the head size is not 64 or 128 (B 1, T 64, "
      .. "NH 2, NKV 2, HS 96): use the float32 attention", out2, 1, true)
  end)
end)
