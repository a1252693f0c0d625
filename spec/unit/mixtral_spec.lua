-- pg.nn.Mixtral against PyTorch: spec/fixtures/hf_mixtral_tiny is a random
-- transformers MixtralForCausalLM (vocabulary 61, dim 32, 2 layers, 4 heads
-- over 2 key/value heads, 4 experts of SwiGLU 48, top-2, untied head) written
-- by scripts/make_mixtral_reference.py with transformers' losses of 10 AdamW
-- steps on one batch, the load-balancing loss on (output_router_logits,
-- router_aux_loss_coef 0.02). scripts/model_check.lua trains the same
-- directory in pipegoose. Tolerance: llama_spec's, 1e-5 relative on every
-- loss and the first gradient norm, 1e-4 on the later gradient norms; the
-- auxiliary loss (2% of the objective) 1e-5 relative too. Routing is
-- discontinuous: the fixture's smallest gap between a token's 2nd and 3rd
-- router probability is 1e-4 (min_routing_gap), far above float32's
-- differences, so both sides choose the same experts throughout.
--
-- The auxiliary losses are taken per micro-batch (averaged over them by
-- rows), the load balance over that micro-batch's routing totals on all data
-- ranks together: with one micro-batch they are transformers' over the batch
-- in any data or expert layout; with more, each layout with the same
-- micro-batches agrees.
local h = require "helpers"
local cjson = require "cjson"

local DIR = "spec/fixtures/hf_mixtral_tiny"
local RTOL = 1e-5

local function expected()
  local f = assert(io.open(DIR .. "/expected.json"))
  local e = cjson.decode(f:read("a"))
  f:close()
  return e
end

local function run_check(ranks, extra)
  local e = expected()
  local args = { "scripts/model_check.lua", "--hf=" .. DIR, "--tokens=" .. DIR .. "/tokens.bin", "--batch=" .. e.batch,
    "--seq-len=" .. e.seq_len, "--steps=" .. e.steps, "--lr=" .. e.lr, "--beta1=" .. e.beta1, "--beta2=" .. e.beta2,
    "--eps=" .. e.eps, "--weight-decay=" .. e.weight_decay }
  for _, a in ipairs(extra or {}) do args[#args + 1] = a end
  local rc, out = h.sh(ranks > 1 and h.mpirun_cmd(ranks, args, 240) or h.pglua_cmd(args))
  assert.equal(0, rc, out)
  return out
end

local worst = {}
local function assert_rel(got, want, what, rtol, layout)
  rtol = rtol or RTOL
  assert(got, what .. ": not printed")
  local rel = math.abs(got - want) / math.abs(want)
  worst[layout] = math.max(worst[layout] or 0, rel)
  assert(rel <= rtol, ("%s: got %.9g, PyTorch %.9g (rtol %g)"):format(what, got, want, rtol))
end

local function assert_fixture(out, what)
  local e = expected()
  -- the evaluation loss has no auxiliary term: transformers' cross-entropy
  assert_rel(tonumber(out:match("^loss (%S+)") or out:match("\nloss (%S+)")), e.ce_loss, what .. " loss", nil, what)
  local n = 0
  for k, l in out:gmatch("step (%d+) loss (%S+)") do
    k = tonumber(k)
    assert_rel(tonumber(l), e.step_losses[k], ("%s step %d loss"):format(what, k), nil, what)
    n = n + 1
  end
  for k, ce, aux in out:gmatch("step (%d+) ce_loss (%S+) aux_loss (%S+)") do
    k = tonumber(k)
    assert_rel(tonumber(ce), e.step_ce_losses[k], ("%s step %d ce"):format(what, k), nil, what)
    assert_rel(tonumber(aux), e.aux_loss_coef * e.step_aux_losses[k], ("%s step %d aux"):format(what, k), nil, what)
  end
  for k, g in out:gmatch("grad_norm (%d+) (%S+)") do
    k = tonumber(k)
    assert_rel(tonumber(g), e.grad_norms[k], ("%s step %d grad norm"):format(what, k), k > 1 and 1e-4 or nil, what)
  end
  assert.equal(e.steps, n, what .. ": steps printed")
  if os.getenv("PG_SHOW_MARGIN") then io.stderr:write(("%-28s worst relative difference %.3g\n"):format(what, worst[what])) end
end

describe("pg.nn.Mixtral (MixtralForCausalLM) against PyTorch", function()
  it("reads the config: experts, top_k, the aux loss coefficient, rope theta", function()
    local pg = require "pipegoose"
    local c = pg.nn.from_hf(DIR).config
    assert.same({ "mixtral", 61, 64, 32, 2, 4, 2, 48, 4, 2, 0.02, 0, 10000, false },
      { c.arch, c.vocab, c.padded_vocab, c.dim, c.layers, c.heads, c.kv_heads, c.hidden, c.experts, c.top_k,
        c.aux_loss_coef, c.z_loss_coef, c.rope_theta, c.tie })
  end)

  it("serially: the loss and 10 AdamW steps (cross-entropy and load balancing) match PyTorch", function()
    assert_fixture(run_check(1), "serial")
  end)

  it("matches PyTorch with T = 2 and with P = 2", function()
    assert_fixture(run_check(2, { "--tensor=2" }), "T = 2")
    assert_fixture(run_check(2, { "--pipeline=2" }), "P = 2")
  end)

  -- expert parallelism: the experts spread over expert groups of the data
  -- group; the load balance over the data group's routing totals is
  -- transformers' over the whole batch
  it("matches PyTorch with the experts spread: E = 2 (D = 2), E = 4 (D = 4), E = 2 x T = 2, E = 2 with P = 2", function()
    assert_fixture(run_check(2, { "--data=2", "--expert=2" }), "D = 2, E = 2")
    assert_fixture(run_check(4, { "--data=4", "--expert=4" }), "D = 4, E = 4")
    assert_fixture(run_check(4, { "--data=2", "--expert=2", "--tensor=2" }), "E = 2 x T = 2")
    assert_fixture(run_check(4, { "--data=2", "--expert=2", "--pipeline=2" }), "E = 2, P = 2")
    assert_fixture(run_check(4, { "--data=4", "--expert=2", "--zero=1" }), "D = 4, E = 2, ZeRO-1")
  end)

  it("a model trained at E = 2 exports with --save-hf (each expert from the rank holding it) and reloads with its loss",
    function()
      local out = h.tmpdir()
      local text = run_check(2, { "--data=2", "--expert=2", "--save-hf=" .. out })
      assert_fixture(text, "E = 2 with --save-hf")
      local final = tonumber(text:match("final loss (%S+)"))
      local pg = require "pipegoose"
      local e = expected()
      local engine = pg.parallelize(pg.nn.from_hf(out), nil, {})
      local data = pg.data.TokenShards{ path = DIR .. "/tokens.bin", batch = e.batch, seq_len = e.seq_len, shuffle = false }
      local x, y = data:next_batch()
      local reloaded = engine:loss(x, y)
      assert.is_true(math.abs(reloaded - final) <= 1e-5 * final, ("reloaded %.9g, trained %.9g"):format(reloaded, final))
      h.rm(out)
    end)

  it("examples/train_moe.lua trains with the experts spread (--data=2 --expert=2), logging aux_loss and each "
    .. "expert's tokens", function()
    local pg = require "pipegoose"
    local dir = h.tmpdir()
    os.execute("mkdir -p '" .. dir .. "'")
    local ids, v = {}, 7
    for i = 1, 20000 do
      v = (v * 1103515245 + 12345) % 2147483648
      ids[i] = i % 97 == 0 and 0 or 32 + (v >> 8) % 64 -- documents of printable bytes
    end
    pg.data.write_shard(dir .. "/train.bin", ids)
    pg.data.write_shard(dir .. "/val.bin", ids)
    local rc, out = h.sh(h.mpirun_cmd(2, { "examples/train_moe.lua", "--data=2", "--expert=2", "--steps=20",
      "--dim=32", "--hidden=64", "--layers=2", "--heads=4", "--seq-len=32", "--batch=4", "--eval-every=10",
      "--log-every=10", "--sample=0", "--train=" .. dir .. "/train.bin", "--val=" .. dir .. "/val.bin",
      "--out=" .. dir .. "/run" }, 240))
    assert.equal(0, rc, out)
    local f = assert(io.open(dir .. "/run/metrics.jsonl"))
    local first, last
    for line in f:lines() do
      local r = cjson.decode(line)
      if r.kind == "train" then first, last = first or r, r end
    end
    f:close()
    assert.is_true(last.aux_loss > 0 and last.ce_loss < first.ce_loss, out)
    local total = 0
    for e = 0, 3 do total = total + last["expert_tokens_" .. e] end
    assert.equal(2 * 2 * 4 * 32, total) -- 2 layers x top-2 x the global batch's tokens
    h.rm(dir)
  end)

  it("matches PyTorch with T = 2 and sequence parallelism (the MoE blocks between sp_gather and sp_scatter)", function()
    assert_fixture(run_check(2, { "--tensor=2", "--sequence-parallel" }), "T = 2 sequence parallel")
  end)

  it("P = 2 with micro-batches gives the serial run's numbers with the same micro-batches", function()
    local function lines(out)
      local t = {}
      for l in out:gmatch("step %d+ [^\n]+") do t[#t + 1] = l end
      return t
    end
    for _, c in ipairs{ { "--micro-batches=2" }, { "--micro-batches=4", "--schedule=gpipe" } } do
      local serial = lines(run_check(1, { c[1] }))
      local piped = lines(run_check(2, { "--pipeline=2", c[1], c[2] }))
      assert.equal(#serial, #piped)
      -- the routing totals travel down the pipeline and back: the same objective,
      -- up to the order of float sums on the stage boundary
      for i, l in ipairs(serial) do
        local a, b = tonumber(l:match("(%S+)$")), tonumber(piped[i]:match("(%S+)$"))
        assert(math.abs(a - b) <= 1e-5 * math.abs(a), l .. " vs " .. piped[i])
      end
    end
  end)
end)

-- precision = "bf16" on the MoE blocks: the router's and the experts' products
-- run on bf16 operands with float32 sums (as torch.autocast runs
-- MixtralSparseMoeBlock's gate and expert Linears), beside the attention's
-- and the LM head's. Against the float32 transformers fixture, every layout
-- to 1e-2 relative on each step's loss (issue 16's bound; the float64 and
-- float32 references differ by ~1e-6 here, far below it). Measured: <= 1.2e-3
-- (serial), larger than the dense GPT-2's 3e-5 because the rounded router
-- logits move some tokens' 2nd and 3rd expert choices past each other; the
-- layouts then flip other tokens (T = 2 sums the experts' partial outputs
-- in another order) and stay within 6e-4 of the serial bf16 run. bf16 did
-- run: some step's loss is more than 1e-4 from the fixture (float32 layouts
-- are within 1e-5).
describe("pg.nn.Mixtral with precision = bf16 #bf16", function()
  local function losses(out)
    local t = {}
    for k, l in out:gmatch("step (%d+) loss (%S+)") do t[tonumber(k)] = tonumber(l) end
    return t
  end
  local function check_bf16(ranks, flags, what)
    local args = { "--precision=bf16" }
    for _, f in ipairs(flags) do args[#args + 1] = f end
    local out = run_check(ranks, args)
    local e, got = expected(), losses(out)
    local far = 0
    for k = 1, e.steps do
      assert(got[k], what .. ": step " .. k .. " not printed\n" .. out)
      local rel = math.abs(got[k] - e.step_losses[k]) / e.step_losses[k]
      assert(rel <= 1e-2, ("%s step %d: bf16 loss %.9g, PyTorch float32 %.9g"):format(what, k, got[k], e.step_losses[k]))
      far = math.max(far, rel)
    end
    assert(far > 1e-4, what .. ": every loss within 1e-4 of float32: did the bf16 products run?\n" .. out)
  end
  it("serially and with the experts spread (D = 2, E = 2) and at T = 2", function()
    check_bf16(1, {}, "serial")
    check_bf16(2, { "--data=2", "--expert=2" }, "D = 2, E = 2")
    check_bf16(2, { "--tensor=2" }, "T = 2")
  end)
end)
