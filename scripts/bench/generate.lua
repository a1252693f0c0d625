-- Part generate: tokens/s of pg.generate with the key/value cache against
-- the recompute path (cache = false: engine:forward of the whole prefix for
-- every new token) and against transformers' generate (KV cache on, greedy)
-- of the same model, exported with engine:save_hf, on the same prompts
-- (scripts/bench_generate.py, under PG_PYTHON, else /tmp/hfvenv/bin/python,
-- when it has transformers; else "skipped: no transformers"). A LLaMA of
-- ~26M parameters (random weights: greedy ids of random weights are as good
-- as any for timing), prompts of 32 tokens, 128 new ones (min = max: no EOS),
-- batch 1 and 8, every side on the same thread count (the cores).
-- The recompute path runs 32 new tokens only (its cost per token grows with
-- the prefix: at 128 the part would take minutes); its tokens/s is for those.
local pg = require "pipegoose"
local common = require "bench.common"

local emit, shell_quote = common.emit, common.shell_quote

local CFG = { vocab = 8192, seq_len = 256, dim = 512, layers = 6, heads = 8, kv_heads = 4, hidden = 1408 }
local PROMPT, NEW, NEW_RECOMPUTE = 32, 128, 32

local function prompts(B)
  local rows = {}
  for b = 0, B - 1 do
    local r = {}
    for i = 0, PROMPT - 1 do r[i + 1] = (i * 37 + b * 11 + 1) % CFG.vocab end
    rows[b + 1] = r
  end
  return rows
end

local function python()
  local env = os.getenv("PG_PYTHON")
  for _, p in ipairs(env and env ~= "" and { env } or { "/tmp/hfvenv/bin/python" }) do
    do
      local _, _, rc = common.run(shell_quote(p) .. " -c 'import transformers, torch'")
      if rc == 0 then return p end
    end
  end
end

local function timed(f)
  local t0 = pg.wtime()
  f()
  return pg.wtime() - t0
end

return function(ctx)
  print()
  print(("== generate: LLaMA %d layers x dim %d (GQA %d/%d heads), prompt %d, %d new tokens, greedy, %d threads")
    :format(CFG.layers, CFG.dim, CFG.heads, CFG.kv_heads, PROMPT, NEW, ctx.ncores))
  print("   (the machine may be shared with other jobs: figures move between runs)")
  local e = pg.parallelize(pg.nn.Llama(CFG), nil, { seed = 1 })
  local n = 0
  for _, p in ipairs(e:parameters()) do n = n + p.tensor:numel() end
  print(("   %.1fM parameters, fp32; CPU paths: OpenBLAS sgemm (core %s) for the prompts' products, "
    .. "pg_matmul_forward's few-rows loop for the decoding steps (<= 8 rows), pg_attention_cached")
    :format(n / 1e6, pg.machine().blas_core))
  local opts = { max_new_tokens = NEW, eos_token_id = false }
  pg.generate(e, prompts(1), { max_new_tokens = 4, eos_token_id = false }) -- warm-up
  local py = python()
  local dir
  if py then
    dir = os.tmpname()
    os.remove(dir)
    e:save_hf(dir)
  end
  local rows = {}
  for _, B in ipairs{ 1, 8 } do
    local p = prompts(B)
    local ids
    local t_cache = math.huge
    for _ = 1, 2 do t_cache = math.min(t_cache, timed(function() _, ids = pg.generate(e, p, opts) end)) end
    local cache = B * NEW / t_cache
    local t_re = timed(function()
      pg.generate(e, p, { max_new_tokens = NEW_RECOMPUTE, eos_token_id = false, cache = false })
    end)
    local recompute = B * NEW_RECOMPUTE / t_re
    local hf, first
    if py then
      local res, lines, rc = common.run(("%s scripts/bench_generate.py %s --batch %d --prompt-len %d --new-tokens %d "
        .. "--threads %d"):format(shell_quote(py), shell_quote(dir), B, PROMPT, NEW, ctx.ncores))
      for _, l in ipairs(lines) do
        hf = hf or tonumber(l:match("^tokens_per_s (%S+)"))
        first = first or l:match("^first_ids (%S+)")
      end
      if rc ~= 0 or not hf then
        for _, l in ipairs(lines) do print("  | " .. l) end
        common.failures[#common.failures + 1] = "generate (transformers peer)"
      end
    end
    local ours = table.concat(table.move(ids[1], 1, 8, 1, {}), ",")
    rows[#rows + 1] = { B = B, cache = cache, recompute = recompute, hf = hf,
      same = first and (first == ours and "same first 8 ids" or ("first ids differ: ours " .. ours .. ", theirs " .. first)) }
  end
  if dir then os.execute("rm -rf " .. shell_quote(dir)) end
  print(("   %-6s %12s %14s %14s %10s %10s"):format("batch", "cache tok/s", "recompute tok/s", "transformers",
    "x recomp.", "x transf."))
  for _, r in ipairs(rows) do
    print(("   %-6d %12.1f %14.1f %14s %10.1f %10s   %s"):format(r.B, r.cache, r.recompute,
      r.hf and ("%.1f"):format(r.hf) or "skipped", r.cache / r.recompute,
      r.hf and ("%.2f"):format(r.cache / r.hf) or "-", r.same or (py and "" or "skipped: no transformers")))
    local cfg = "generate_b" .. r.B
    emit(cfg, "cache_tokens_per_s", r.cache, "%.1f")
    emit(cfg, "recompute_tokens_per_s", r.recompute, "%.1f")
    emit(cfg, "transformers_tokens_per_s", r.hf, "%.1f")
    if r.hf then emit(cfg, "ratio_transformers", r.cache / r.hf, "%.2f") end
  end
end
