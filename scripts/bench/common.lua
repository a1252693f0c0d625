-- What the driver and the workers of scripts/bench.lua share: the model
-- configurations, running a command and reading its "result k v" lines, the
-- worker command line, and the output's "<config> <metric> <value>" lines.
local pg = require "pipegoose"

local M = {}

--- The median of a list of numbers (NaN for an empty list).
function M.median(t)
  local s = {}
  for i, v in ipairs(t) do s[i] = v end
  table.sort(s)
  local n = #s
  if n == 0 then return 0 / 0 end
  if n % 2 == 1 then return s[(n + 1) // 2] end
  return (s[n // 2] + s[n // 2 + 1]) / 2
end

--- The --key=value arguments as a table (a worker's options).
function M.parse_args(list)
  local o = {}
  for _, a in ipairs(list) do
    local k, v = a:match("^%-%-([%w_-]+)=(.*)$")
    if not k then error("bench.lua: unknown argument " .. a) end
    o[k] = v
  end
  return o
end

-- The models the workers build: the step worker's --model=<name>, and those of the pp and llmc-model workers.
M.MODELS = {
  -- GPT-2 124M: llm.c's padded vocabulary; only 64 of its positions are used.
  gpt2 = { vocab = 50257, padded_vocab = 50304, seq_len = 64, dim = 768, heads = 12, layers = 12, batch = 4 },
  -- a small GPT: examples/train_gpt.lua's defaults until make run was tuned (now dim 128, seq 64, batch 12).
  small = { vocab = 256, seq_len = 128, dim = 256, heads = 4, layers = 4, batch = 16 },
  -- a LLaMA of GPT-2 124M's width and depth: grouped-query attention (12 heads over 4 key/value heads),
  -- rotary embeddings, SwiGLU 2048, RMSNorm, untied head, LLaMA-2's vocabulary of 32000
  llama = { arch = "llama", vocab = 32000, seq_len = 64, dim = 768, heads = 12, kv_heads = 4, hidden = 2048,
            layers = 12, batch = 4 },
  -- GPT-2 124M on a batch closer to real training: 8 sequences of 256 tokens
  gpt2_b8 = { vocab = 50257, padded_vocab = 50304, seq_len = 256, dim = 768, heads = 12, layers = 12, batch = 8 },
  -- pipeline part: small enough that 16 micro-batches take seconds
  pp = { vocab = 256, seq_len = 128, dim = 256, heads = 4, layers = 8, batch = 2 },
  -- part moe: a Mixtral of examples/train_moe.lua's shape (4 experts of SwiGLU 688, top-2), and the dense
  -- LLaMA with the same active parameters per token (SwiGLU 2 x 688: the two experts a token runs)
  moe = { arch = "mixtral", vocab = 256, seq_len = 128, dim = 256, heads = 8, kv_heads = 2, hidden = 688, layers = 4,
          experts = 4, top_k = 2, aux_loss_coef = 0.01, batch = 8 },
  moe_dense = { arch = "llama", vocab = 256, seq_len = 128, dim = 256, heads = 8, kv_heads = 2, hidden = 1376,
                layers = 4, batch = 8 },
}

function M.shell_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

--- Runs a command; returns its "result k v" pairs, its output lines, and its exit status.
function M.run(cmd)
  local f = assert(io.popen(cmd .. " 2>&1"))
  local res, lines = {}, {}
  for line in f:lines() do
    lines[#lines + 1] = line
    local k, v = line:match("^result (%S+) (%S+)$")
    if not k then k, v = line:match("^(torch_[%w_]+) (%S+)$") end -- scripts/bench_torch.py
    if k then res[k] = tonumber(v) or v end
  end
  local ok, _, code = f:close()
  return res, lines, ok and 0 or (code or 1)
end

function M.cores()
  local f = io.popen("env -u OMP_NUM_THREADS nproc 2>/dev/null")
  local n = f and tonumber(f:read("l") or "") or nil
  if f then f:close() end
  return n or pg.num_threads()
end

-- A worker is this same pglua running this same script with --worker=<name>.
M.PGLUA = arg[-1] or "./pglua"
M.SCRIPT = arg[0] or "scripts/bench.lua"

--- The shell command of a worker on `ranks` ranks (mpirun when more than one)
--- of `threads` OpenMP threads each, with the worker's arguments.
function M.worker_cmd(ranks, threads, args)
  local base = ("OMP_NUM_THREADS=%d"):format(threads)
  local cmd = { M.PGLUA, M.SCRIPT }
  for _, a in ipairs(args) do cmd[#cmd + 1] = M.shell_quote(a) end
  if ranks > 1 then
    return ("%s scripts/mpirun.sh -np %d -x OMP_NUM_THREADS %s"):format(base, ranks, table.concat(cmd, " "))
  end
  return base .. " " .. table.concat(cmd, " ")
end

-- What failed, in order: the driver's last line names them and it exits 1.
M.failures = {}

--- Whether a run succeeded (exit 0 and, with key, a result of that name);
--- when not, records it in M.failures and prints the end of its output.
function M.check_run(name, res, lines, rc, key)
  if rc ~= 0 or (key and res[key] == nil) then
    M.failures[#M.failures + 1] = name
    print(("%s failed (exit %s); its output:"):format(name, tostring(rc)))
    for i = math.max(1, #lines - 30), #lines do print("  | " .. lines[i]) end
    return false
  end
  return true
end

--- Prints one machine-readable line "<config> <metric> <value>" (none for a nil value).
function M.emit(config, metric, value, fmt)
  if value == nil then return end
  if type(value) == "number" then print(("%s %s " .. (fmt or "%.6g")):format(config, metric, value))
  else print(("%s %s %s"):format(config, metric, tostring(value))) end
end

--- A training step's FLOPs per token for a worker's result (params, layers, dim, seq_len).
function M.flops_per_token(r)
  -- 6 N for the parameter matmuls (forward 2, backward 4) plus 6 L C T for attention's scores and mixing.
  return 6 * r.params + 6 * r.layers * r.dim * r.seq_len
end

return M
