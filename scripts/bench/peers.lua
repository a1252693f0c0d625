-- The peers that the training-step parts (gpt2, small, llama) measure next to
-- their own step: PyTorch CPU (part torch) and llm.c's CPU trainer (part
-- llmc). Each returns tokens/s, or nil when it is not selected, not
-- available, or failed (then common.check_run has reported it).
local common = require "bench.common"

local run, check_run, worker_cmd, shell_quote = common.run, common.check_run, common.worker_cmd, common.shell_quote
local median = common.median

local M = {}

--- The PyTorch peers, in the order they run: Debian's PyTorch 1.13
-- (/usr/bin/python3; its BLAS is the system libblas, OpenBLAS here) and,
-- when scripts/peers.sh made build/peers, PyTorch 2.x from PyPI (MKL and
-- oneDNN) eager with fused AdamW, and with torch.compile too. key names
-- their machine-readable lines (<key>_tokens_per_s, vs_<key>).
M.TORCH = {
  { key = "torch", label = "PyTorch 1.13 (Debian)", python = "/usr/bin/python3", args = "" },
  { key = "torch2_eager", label = "PyTorch 2 eager, fused AdamW", python = "build/peers/bin/python",
    args = "--fused-adamw" },
  { key = "torch2_compile", label = "PyTorch 2 compile, fused AdamW", python = "build/peers/bin/python",
    args = "--fused-adamw --compile" },
}

local have = {}
--- Whether a peer's python has torch (asked once per python).
function M.have(peer)
  if have[peer.python] == nil then
    have[peer.python] = os.execute(shell_quote(peer.python) .. " -c 'import torch' >/dev/null 2>&1") == true
  end
  return have[peer.python]
end

--- Whether /usr/bin/python3 has torch (the first peer).
function M.have_torch() return M.have(M.TORCH[1]) end

--- Every available PyTorch peer's run of scripts/bench_torch.py's args:
-- { [key] = {tokens_per_s =, version =, blas =, mode =} }, or nil when the
-- part torch is not selected or no peer is available.
function M.torch(ctx, args)
  if not ctx.want("torch") then return nil end
  -- PyTorch runs with the environment it was given: pglua's own OpenMP
  -- wait-policy default (see src/lua/pglua.c) is not passed on to it. The
  -- OpenBLAS core pglua chose is (Debian's PyTorch goes through the same
  -- OpenBLAS here): both sides then run the same sgemm kernels.
  local env = os.getenv("PG_DEFAULT_WAIT_POLICY") and "env -u OMP_WAIT_POLICY -u PG_DEFAULT_WAIT_POLICY " or ""
  local out
  for _, peer in ipairs(M.TORCH) do
    if M.have(peer) then
      -- torch.compile compiles in its first steps: two warm-up steps at least
      local warm = peer.args:find("--compile", 1, true) and " --warmup 2" or ""
      local res, lines, rc = run(env .. shell_quote(peer.python) .. " scripts/bench_torch.py " .. args .. " " .. peer.args .. warm)
      if check_run(peer.label .. " " .. args, res, lines, rc, "torch_tokens_per_s") then
        out = out or {}
        out[peer.key] = { tokens_per_s = res.torch_tokens_per_s, version = res.torch_version, blas = res.torch_blas,
                          mode = res.torch_mode }
      end
    end
  end
  return out
end

-- llm.c's CPU trainer as a peer: its train_gpt2 reads gpt2_124M.bin and the
-- tinyshakespeare shards from its working directory, trains at B = 4,
-- T = 64 and prints "step n: train loss x (took t ms)". We give it our
-- GPT-2 124M (exported in its format) and the fortunes shards, read steps
-- 1..5 (step 0 warms up) and stop it.
M.LLMC_DIR = os.getenv("LLMC_DIR")

--- llm.c's tokens/s on GPT-2 124M at B = 4, T = 64.
function M.llmc(ctx)
  local LLMC_DIR, ncores = M.LLMC_DIR, ctx.ncores
  if not LLMC_DIR or LLMC_DIR == "" or not ctx.want("llmc") then return nil end
  local bin = LLMC_DIR .. "/train_gpt2"
  if not io.open(bin) then
    local _, lines, rc = run("make -C " .. shell_quote(LLMC_DIR) .. " train_gpt2")
    if not check_run("llm.c build (make -C $LLMC_DIR train_gpt2)", {}, lines, rc) then return nil end
  end
  local dir = "build/llmc-bench"
  os.execute("mkdir -p " .. dir .. "/dev/data/tinyshakespeare")
  if not io.open(dir .. "/gpt2_124M.bin") then
    local res, lines, rc = run(worker_cmd(1, ncores, { "--worker=llmc-model", "--out=" .. dir .. "/gpt2_124M.bin" }))
    if not check_run("llm.c model file", res, lines, rc, "written") then return nil end
  end
  if not io.open("data/fortunes_train.bin") or not io.open("data/fortunes_val.bin") then
    local _, lines, rc = run(common.PGLUA .. " scripts/prepare_corpus.lua")
    if not check_run("scripts/prepare_corpus.lua", {}, lines, rc) then return nil end
  end
  local here = os.getenv("PWD") or "."
  for _, split in ipairs{ "train", "val" } do
    os.execute(("ln -sf %s %s"):format(shell_quote(here .. "/data/fortunes_" .. split .. ".bin"),
      shell_quote(dir .. "/dev/data/tinyshakespeare/tiny_shakespeare_" .. split .. ".bin")))
  end
  -- as for PyTorch, llm.c gets the OpenMP environment the user gave us
  local env = os.getenv("PG_DEFAULT_WAIT_POLICY") and "env -u OMP_WAIT_POLICY -u PG_DEFAULT_WAIT_POLICY " or ""
  local abs = LLMC_DIR:sub(1, 1) == "/" and LLMC_DIR or (here .. "/" .. LLMC_DIR)
  -- sed ends the pipe after step 5 (-u: it reads no further ahead than
  -- that line); train_gpt2 then dies of SIGPIPE at its next line
  local _, lines, rc = run(("cd %s && %sOMP_NUM_THREADS=%d stdbuf -oL %s | sed -u '/^step 5:/q'")
    :format(shell_quote(dir), env, ncores, shell_quote(abs .. "/train_gpt2")))
  local ms = {}
  for _, l in ipairs(lines) do
    local n, t = l:match("^step (%d+): train loss %S+ %(took (%S+) ms%)")
    if n and tonumber(n) >= 1 then ms[#ms + 1] = tonumber(t) end
  end
  if #ms == 0 then
    check_run("llm.c train_gpt2", {}, lines, rc ~= 0 and rc or 1)
    return nil
  end
  return 4 * 64 / (median(ms) / 1000)
end

return M
