-- Checks of a Hugging Face fixture directory (written by a scripts/make_*_reference.py
-- with expected.json: the loss at the loaded weights, the losses and gradient
-- norms of clipped AdamW steps, the final loss) trained by
-- scripts/model_check.lua, serially or under mpirun in a layout.
local h = require "helpers"
local cjson = require "cjson"
-- luassert itself: a module required from a spec does not see the spec's `assert`
local assert = require "luassert"

local M = {}

M.RTOL = 1e-5

function M.expected(dir)
  local f = assert(io.open(dir .. "/expected.json"))
  local e = cjson.decode(f:read("a"))
  f:close()
  return e
end

--- scripts/model_check.lua's arguments for the fixture, then `extra`.
function M.check_args(dir, extra)
  local e = M.expected(dir)
  local args = { "scripts/model_check.lua", "--hf=" .. dir, "--tokens=" .. dir .. "/tokens.bin",
    "--batch=" .. e.batch, "--seq-len=" .. e.seq_len, "--steps=" .. e.steps, "--lr=" .. e.lr, "--beta1=" .. e.beta1,
    "--beta2=" .. e.beta2, "--eps=" .. e.eps, "--weight-decay=" .. e.weight_decay, "--clip=" .. e.clip }
  for _, a in ipairs(extra or {}) do args[#args + 1] = a end
  return args
end

--- Runs model_check (ranks > 1: under mpirun); returns its output.
function M.run_check(dir, ranks, extra)
  local args = M.check_args(dir, extra)
  local rc, out = h.sh(ranks > 1 and h.mpirun_cmd(ranks, args, 240) or h.pglua_cmd(args))
  assert.equal(0, rc, out)
  return out
end

function M.assert_rel(got, want, what, rtol)
  rtol = rtol or M.RTOL
  assert(got, what .. ": not printed")
  assert(math.abs(got - want) <= rtol * math.abs(want), ("%s: got %.9g, PyTorch %.9g (rtol %g)"):format(what, got, want, rtol))
end

--- Every loss model_check printed against the fixture's (the gradient norms
-- after the first step at 1e-4: see spec/unit/llama_spec.lua for why).
function M.assert_losses(out, dir, what)
  local e = M.expected(dir)
  M.assert_rel(tonumber(out:match("\nloss (%S+)") or out:match("^loss (%S+)")), e.loss, what .. " loss")
  local n, norms = 0, 0
  for k, l in out:gmatch("step (%d+) loss (%S+)") do
    k = tonumber(k)
    M.assert_rel(tonumber(l), e.step_losses[k], ("%s step %d loss"):format(what, k))
    n = n + 1
  end
  for k, g in out:gmatch("grad_norm (%d+) (%S+)") do
    k = tonumber(k)
    M.assert_rel(tonumber(g), e.grad_norms[k], ("%s step %d grad norm"):format(what, k), k > 1 and 1e-4 or nil)
    norms = norms + 1
  end
  assert.equal(e.steps, n, what .. ": steps printed")
  assert.equal(e.steps, norms, what .. ": gradient norms printed")
  local final = out:match("final loss (%S+)")
  if final then M.assert_rel(tonumber(final), e.final_loss, what .. " final loss") end
end

--- The fixture's model trained at T = 2 and written with --save-hf, then loaded
-- serially from what it wrote: the loss there is the trained final loss (1e-6).
function M.assert_trained_export_reloads(dir)
  local pg = require "pipegoose"
  local out = h.tmpdir()
  local text = M.run_check(dir, 2, { "--tensor=2", "--save-hf=" .. out })
  M.assert_losses(text, dir, "T = 2 with --save-hf")
  local final = tonumber(text:match("final loss (%S+)"))
  local e = M.expected(dir)
  local engine = pg.parallelize(pg.nn.from_hf(out), nil, {})
  local data = pg.data.TokenShards{ path = dir .. "/tokens.bin", batch = e.batch, seq_len = e.seq_len, shuffle = false }
  local x, y = data:next_batch()
  local reloaded = engine:loss(x, y)
  assert.is_true(math.abs(reloaded - final) <= 1e-6 * final, ("reloaded %.9g, trained %.9g"):format(reloaded, final))
  h.rm(out)
end

--- A copy of a fixture directory with config.json edited by edit(cfg).
function M.edited(dir, edit)
  local out = h.tmpdir()
  os.execute(("mkdir -p %s && cp %s/model.safetensors %s/"):format(h.quote(out), h.quote(dir), h.quote(out)))
  local f = assert(io.open(dir .. "/config.json"))
  local cfg = cjson.decode(f:read("a"))
  f:close()
  edit(cfg)
  f = assert(io.open(out .. "/config.json", "w"))
  f:write(cjson.encode(cfg))
  f:close()
  return out
end

--- Asserts that two safetensors files hold the same tensors, bit for bit; returns how many.
function M.assert_same_tensors(want_path, got_path, what)
  local want, got = h.safetensors_tensors(want_path), h.safetensors_tensors(got_path)
  local n = 0
  for name, t in pairs(want) do
    assert.is_not_nil(got[name], what .. ": missing " .. name)
    assert.equal(t.shape, got[name].shape, name)
    assert.is_true(t.bytes == got[name].bytes, what .. ": " .. name .. " differs")
    n = n + 1
  end
  for name in pairs(got) do assert.is_not_nil(want[name], what .. ": extra tensor " .. name) end
  return n
end

return M
