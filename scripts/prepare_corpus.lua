--- Prepares a training corpus: token shards in llm.c's format.
--
--   ./pglua scripts/prepare_corpus.lua --tokenizer=PATH|HF_DIR|train:VOCAB|bytes --input=FILES|DIRS|GLOB
--       [--input=...] [--format=text|jsonl] [--field=text] [--separator=LINE] --out=DIR
--       [--val-fraction=0.1] [--seed=0] [--shard-tokens=100000000] [--threads=N] [--skip-bad]
--       [--eos-token=TOKEN] [--overwrite] [--progress]
--
-- writes the prepared-corpus directory pg.data.corpus(DIR) reads (lua/pipegoose/data.lua's
-- header): DIR/tokenizer.json (+ tokenizer_config.json, special_tokens_map.json),
-- DIR/train_000000.bin ..., DIR/val_000000.bin ... and DIR/dataset.json.
-- Without --tokenizer it is the byte-level script of before (the Makefile's
-- data/fortunes_*.bin):
--
--   ./pglua scripts/prepare_corpus.lua [--out=data] [--name=fortunes] [--val-fraction=0.1]
--                                      [--seed=0] [--separator=%] [files...]
--
-- writing OUT/NAME_train.bin and OUT/NAME_val.bin (either may be empty); with
-- no files, the text files of Debian's `fortunes` package under
-- /usr/share/games/fortunes (sorted; .dat and .u8 files and symlinks skipped).
--
-- Inputs (--input, repeatable, each a comma list): a file; a directory (its
-- files, recursively, sorted; names starting with "." skipped); a glob (its
-- sorted matches). Read in blocks (--block-bytes, a test knob), so memory does
-- not grow with the corpus, only with its largest document.
--
-- Documents. text: each file is split on lines that are exactly the separator
-- (--separator=% for the fortune format; --separator= with nothing after "="
-- splits on empty lines); a document is the text between two separator lines,
-- byte for byte, newlines included. Without a separator a file is one document
-- (the byte-level mode's default separator is "%", as before). jsonl: one JSON
-- object a line, the document its --field string (blank lines skipped).
-- Documents that are empty or only whitespace are dropped.
--
-- Bad input is refused with its file and line or byte offset: a line that is
-- not a JSON object, a line without the field (or a field that is not a
-- string), a document that is not UTF-8. --skip-bad skips such a document
-- instead and counts it (dataset.json's "skipped"). The tokenizer would take
-- any bytes; a corpus of text is what the bits-per-byte figure assumes.
--
-- Split: a document goes to validation when pg.data.hash_unit(document, seed)
-- < val-fraction, so the split depends on the content and seed only, and two
-- copies of a document land on the same side.
--
-- Tokens: one document token per document, as the tokenizer defines it: its
-- eos after each document when it has one, else its bos before each; else
-- --eos-token (a token of the tokenizer, after each document; given, it is
-- used whatever the tokenizer has); else an error. "bytes": ids are the bytes
-- (vocabulary 256), the end-of-text token 0 (a NUL byte, which text never
-- contains) before every document, as today's byte-level shards; DIR then gets
-- a tokenizer.json that encodes the same (a byte-fallback BPE without merges).
-- "train:VOCAB" trains a byte-level BPE of VOCAB ids on the inputs (for jsonl,
-- on their extracted text, written to a temporary file in the output's
-- temporary directory) with the special token <|endoftext|> (its eos).
-- Ids are uint16 when the vocabulary has at most 65536 ids, else uint32.
-- Shards hold --shard-tokens ids each (the last of a split fewer); a document
-- may continue into the next shard, as in llm.c's data scripts.
--
-- Atomic: everything is written to DIR.tmp-<pid> next to DIR, dataset.json
-- last, then renamed onto DIR, so DIR is a whole corpus or untouched; a
-- directory without dataset.json is not a corpus (pg.data.corpus says so).
-- An existing DIR that is not empty is replaced only when it holds the same
-- corpus (the same dataset.json) or with --overwrite; DIR may not be or hold
-- an input. Under mpirun only rank 0 works.
local pg = require "pipegoose"
local cjson = require("cjson").new()
if cjson.encode_escape_forward_slash then cjson.encode_escape_forward_slash(false) end

local default_dir = "/usr/share/games/fortunes"
local argparse = require "argparse"
local p = argparse("prepare_corpus.lua", "Token shards from text or JSONL files (without --tokenizer: byte-level "
  .. "shards of the fortunes, as before).")
p:argument("files", "Byte-level mode: text files (default: every fortune file in " .. default_dir .. ")."):args("*")
p:option("--tokenizer", "A tokenizer.json, a model directory holding one, train:VOCAB or bytes.")
p:option("--input", "Input files, directories or globs (repeatable; a comma list)."):count("*")
p:option("--format", "Input format.", "text"):choices{ "text", "jsonl" }
p:option("--field", "The JSONL field holding a document's text.")
p:option("--separator", "Line that separates documents (text).")
p:option("--out", "Output directory.")
p:option("--name", "Byte-level mode: shard name prefix (default fortunes).")
p:option("--val-fraction", "Fraction of documents for validation.", "0.1"):convert(tonumber)
p:option("--seed", "Seed of the train/val split.", "0"):convert(function(s) return math.tointeger(tonumber(s)) end)
p:option("--shard-tokens", "Tokens per shard.", "100000000"):convert(function(s) return math.tointeger(tonumber(s)) end)
p:option("--threads", "Tokenizer threads (default pg.num_threads()).")
  :convert(function(s) return math.tointeger(tonumber(s)) end)
p:flag("--skip-bad", "Skip (and count) documents that are bad input instead of stopping.")
p:option("--eos-token", "The document token to put after each document (a token of the tokenizer).")
p:flag("--overwrite", "Replace an output directory that holds something else.")
p:flag("--progress", "A progress bar on stderr even when it is not a terminal.")
p:option("--block-bytes", "Bytes read at a time (a test knob).", tostring(4 << 20))
  :convert(function(s) return math.tointeger(tonumber(s)) end)
p:option("--batch-bytes", "Bytes of documents tokenized per batch.", tostring(16 << 20))
  :convert(function(s) return math.tointeger(tonumber(s)) end)
local args = p:parse()

local function die(fmt, ...) error(("prepare_corpus: " .. fmt):format(...), 0) end

local legacy = args.tokenizer == nil
if legacy then
  for _, o in ipairs{ "format", "field", "eos_token" } do
    if args[o] ~= nil and not (o == "format" and args[o] == "text") then
      p:error(("--%s needs --tokenizer (without it the script makes byte-level shards)"):format(o:gsub("_", "-")))
    end
  end
else
  if args.name then p:error("--name is for the byte-level mode (without --tokenizer); a corpus directory's shards are named train_/val_") end
  if #args.files > 0 then p:error("unexpected argument '" .. args.files[1] .. "': give inputs with --input=") end
  if #args.input == 0 then p:error("--input is required with --tokenizer") end
  if not args.out then p:error("--out is required with --tokenizer") end
  if args.format ~= "jsonl" and args.field then p:error("--field is for --format=jsonl") end
  if args.format == "jsonl" and args.separator then p:error("--separator is for --format=text (a JSONL line is a document)") end
end
local val_fraction, seed = args.val_fraction, args.seed
if not val_fraction or val_fraction < 0 or val_fraction > 1 then
  p:error("--val-fraction must be a number from 0 to 1, got " .. tostring(args.val_fraction))
end
if not seed then p:error("--seed must be an integer") end
if not args.shard_tokens or args.shard_tokens < 1 or args.shard_tokens > 0x7fffffff then
  p:error("--shard-tokens must be an integer from 1 to 2^31 - 1")
end
if args.threads ~= nil and (args.threads < 1 or args.threads > 1024) then p:error("--threads must be an integer from 1 to 1024") end
for _, o in ipairs{ "block_bytes", "batch_bytes" } do
  if not args[o] or args[o] < 1 then p:error(("--%s must be a positive integer"):format(o:gsub("_", "-"))) end
end
local separator = args.separator
if legacy and separator == nil then separator = "%" end
if separator and separator:find("\n", 1, true) then p:error("--separator must be one line") end
local field = args.format == "jsonl" and (args.field or "text") or nil
local C = pg.core.token_data

-- ---- inputs ----

local function expand_inputs(list)
  local files = {}
  local function add_dir(d)
    for _, name in ipairs(pg.fs.list(d)) do
      if name:sub(1, 1) ~= "." then
        local q = d .. "/" .. name
        local k = pg.fs.kind(q)
        if k == "directory" then add_dir(q) elseif k == "file" then files[#files + 1] = q end
      end
    end
  end
  for _, item in ipairs(list) do
    for one in item:gmatch("[^,]+") do
      local k = pg.fs.kind(one)
      if k == "directory" then
        add_dir((one:gsub("/+$", "")))
      elseif k == "file" or k == "link" then
        files[#files + 1] = one
      elseif C.expand_paths and one:find("[*?[]") then
        local ok, m = pcall(C.expand_paths, one)
        if not ok then die("--input %s: no files match", one) end
        for _, q in ipairs(m) do
          if pg.fs.kind(q) ~= "directory" then files[#files + 1] = q end
        end
      else
        die("--input %s: no such file or directory", one)
      end
    end
  end
  return files
end

local files
if legacy then
  files = {}
  for _, f in ipairs(args.files) do files[#files + 1] = f end
  for _, f in ipairs(expand_inputs(args.input)) do files[#files + 1] = f end
  if #files == 0 then
    if pg.fs.kind(default_dir) ~= "directory" then
      die("no input files given and %s is missing (install Debian's fortunes package, or name text files)", default_dir)
    end
    for _, q in ipairs(C.expand_paths(default_dir .. "/*")) do
      if not q:match("%.dat$") and not q:match("%.u8$") and pg.fs.kind(q) == "file" then files[#files + 1] = q end
    end
    table.sort(files)
  end
else
  files = expand_inputs(args.input)
  if #files == 0 then die("the inputs %s hold no files", table.concat(args.input, ",")) end
end
local total_bytes = 0
for _, f in ipairs(files) do
  local h, err = io.open(f, "rb")
  if not h then die("%s", tostring(err)) end
  total_bytes = total_bytes + (h:seek("end") or 0)
  h:close()
end

if pg.world_rank() ~= 0 then return end -- one writer when started under mpirun

-- ---- reading documents ----

local block_bytes = args.block_bytes

--- Calls emit(doc, path, offset) for each document of a text file (offset:
-- the document's first byte in the file, counting from 0), or for a block's
-- run of them emit_many(docs, first, offs, base, path): docs[first..] begin at
-- file offsets base + offs[k] - 1 and have a visible byte.
local function text_documents(path, sep, emit, on_bytes, emit_many)
  local f, err = io.open(path, "rb")
  if not f then die("%s", tostring(err)) end
  if sep == nil then -- one document: the file
    local parts = {}
    for block in function() return f:read(block_bytes) end do
      parts[#parts + 1] = block
      on_bytes(#block)
    end
    f:close()
    emit(table.concat(parts), path, 0)
    return
  end
  local P = "\n" .. sep .. "\n"
  -- buf[1] is a virtual newline (at file offset -1) so that a separator on the first line matches P
  local buf, base, start = "\n", -1, 2
  local parts = {} -- the current document's bytes before buf[start], when it began in an earlier block
  while true do
    local block = f:read(block_bytes)
    if block then buf = buf .. block; on_bytes(#block) end
    -- the documents that end in buf, cut in C (one call a block, not a Lua call a document)
    local docs, offs, next_start, next_pos = C.cut_documents(buf, P, start, 1, #parts > 0)
    local first = 1
    if #parts > 0 and next_start ~= start then -- the first document began in an earlier block
      parts[#parts + 1] = docs[1]
      emit(table.concat(parts), path, parts.off)
      parts, first = {}, 2
    end
    if first <= #docs then emit_many(docs, first, offs, base, path) end
    start = next_start
    if not block then
      -- the file ends: a last line that is the separator has no newline after it
      local j = #buf - #sep
      local stop = (j >= start - 1 and j >= 1 and buf:sub(j) == "\n" .. sep) and j or #buf
      local d = buf:sub(start, stop)
      if #parts > 0 then parts[#parts + 1] = d; d = table.concat(parts) end
      emit(d, path, #parts > 0 and parts.off or base + start - 1)
      break
    end
    -- keep what a separator that crosses into the next block could start with
    local keep = math.max(start - 1, next_pos, 1)
    if keep > start then
      if #parts == 0 then parts.off = base + start - 1 end
      parts[#parts + 1] = buf:sub(start, keep - 1)
    end
    start = math.max(start - keep + 1, 1)
    base = base + keep - 1
    buf = buf:sub(keep)
  end
  f:close()
end

local function jsonl_documents(path, emit, on_bytes, bad)
  local f, err = io.open(path, "rb")
  if not f then die("%s", tostring(err)) end
  -- one line's document (lua-cjson decodes it): the field's string, or what is wrong, by file:line
  local function document_of(line, line_no)
    local ok, j = pcall(cjson.decode, line)
    if not ok then return bad(("%s:%d: not valid JSON (%s)"):format(path, line_no, (tostring(j):gsub("^.-: ", "")))) end
    -- cjson decodes an array to a table too: an object is what starts with {
    if type(j) ~= "table" or not line:match("^%s*{") then return bad(("%s:%d: not a JSON object"):format(path, line_no)) end
    local v = j[field]
    if v == nil or v == cjson.null then return bad(("%s:%d: no field '%s'"):format(path, line_no, field)) end
    if type(v) ~= "string" then
      return bad(("%s:%d: field '%s' is a %s, not a string"):format(path, line_no, field, type(v)))
    end
    emit(v, path, nil, line_no)
  end
  local buf, line_no = "", 0
  local function lines_of(list, first_no)
    for i, line in ipairs(list) do
      if line:find("%S") then document_of(line, first_no + i - 1) end -- blank lines are skipped
    end
  end
  while true do
    local block = f:read(block_bytes)
    if not block then break end
    on_bytes(#block)
    buf = buf .. block
    local pos, list = 1, {}
    while true do
      local nl = buf:find("\n", pos, true)
      if not nl then break end
      list[#list + 1] = buf:sub(pos, nl - 1)
      pos = nl + 1
    end
    lines_of(list, line_no + 1)
    line_no = line_no + #list
    buf = buf:sub(pos)
  end
  if buf ~= "" then lines_of({ buf }, line_no + 1) end
  f:close()
end

local skipped = 0
local function bad_input(msg)
  if not args.skip_bad then die("%s (--skip-bad skips such documents)", msg) end
  skipped = skipped + 1
  if skipped <= 10 then io.stderr:write("prepare_corpus: skipped: ", msg, "\n") end
  if skipped == 10 then io.stderr:write("prepare_corpus: (further skipped documents are only counted)\n") end
end

--- Every document of every file, in order: visit(doc, path, at), at the
-- document's byte offset in the file (text) or its line (jsonl); empty and
-- whitespace-only documents dropped.
local function each_document(visit, on_bytes, visit_many)
  local function emit(d, path, off, line_no)
    if d:find("%S") then visit(d, path, line_no or off) end
  end
  -- visit_many(docs, first, offs, base, path): a block's documents at once, without a Lua call each
  visit_many = visit_many or function(docs, first, offs, base, path)
    for k = first, #docs do visit(docs[k], path, base + offs[k] - 1) end
  end
  for _, path in ipairs(files) do
    if args.format == "jsonl" then jsonl_documents(path, emit, on_bytes, bad_input)
    else text_documents(path, separator, emit, on_bytes, visit_many) end
  end
end

--- The message for a document that is not UTF-8 (bad: the offset of its first bad byte).
local function not_utf8(path, at, bad)
  if args.format == "jsonl" then return ("%s:%d: field '%s' is not UTF-8 (byte %d of it)"):format(path, at, field, bad) end
  return ("%s: not UTF-8 at byte offset %d"):format(path, at + bad)
end

-- ---- progress ----

local progress_on = args.progress
if not progress_on then
  local forced = os.getenv("PG_PROGRESS")
  if forced == "tty" then progress_on = true
  elseif forced ~= "plain" then progress_on = pg.fs.isatty("stderr") end
end
local human = require("pipegoose.callbacks.progress_bar").human
local t_start = pg.wtime()
local read_bytes, last_draw = 0, 0
local pass_label = ""
local progress_tokens = 0
local function on_bytes(n)
  read_bytes = read_bytes + n
  if not progress_on then return end
  local now = pg.wtime()
  if now - last_draw < 0.2 and read_bytes < total_bytes then return end
  last_draw = now
  local frac = total_bytes > 0 and math.min(read_bytes / total_bytes, 1) or 1
  local w = 30
  local fill = math.floor(frac * w + 0.5)
  io.stderr:write(("\r%s[%s%s] %3d%% %sB %s tokens %sB/s  "):format(pass_label, ("#"):rep(fill), ("."):rep(w - fill),
    math.floor(frac * 100), human(read_bytes), human(progress_tokens), human(read_bytes / math.max(now - t_start, 1e-9))))
end
local function progress_done()
  if progress_on then io.stderr:write("\n") end
end

-- ---- byte-level mode: the shards of before ----

local shard_tokens = args.shard_tokens

--- Where one split's documents go: shards that roll over at `limit` tokens
-- (named name_of(k)), or one fixed file.
local function new_sink(split, dir, dtype, doc_token, at_end, limit, name_of)
  local s = { split = split, shards = {}, shard_tokens = {}, tokens = 0, documents = 0, bytes = 0 }
  local w
  local function open()
    local name = name_of(#s.shards)
    s.shards[#s.shards + 1] = name
    w = pg.data.ShardWriter(dir .. "/" .. name, dtype)
  end
  local function close()
    s.tokens = s.tokens + w:tokens()
    s.shard_tokens[#s.shard_tokens + 1] = w:tokens()
    w:close()
    w = nil
  end
  --- ids: an int32 tensor of the documents' ids one after another; counts: each document's
  function s.write(ids, counts, nbytes)
    s.documents = s.documents + #counts
    s.bytes = s.bytes + nbytes
    if #counts == 0 then return end
    local k, pos = 1, 0
    while true do
      if w and w:tokens() >= limit then close() end
      if not w then open() end
      k, pos = w:append_documents(ids, counts, k, pos, doc_token, at_end, limit)
      if not k then break end
    end
  end
  function s.finish(keep_empty)
    if keep_empty and not w and #s.shards == 0 then open() end
    if w then close() end
  end
  function s.live_tokens() return s.tokens + (w and w:tokens() or 0) end
  function s.abort() if w then w:abort() end end
  return s
end

local batch_bytes = args.batch_bytes

--- Reads every document, tokenizes them in batches with encode(list) -> list of
-- int32 tensors, and sends each to its split's sink. Returns the encode seconds.
local function run_pipeline(encode, sinks)
  -- the batch: its documents, and where each came from in runs (segs: a block's run or one document)
  local docs, segs, nbytes = {}, {}, 0
  local encode_s = 0
  local threads = args.threads
  local function flush()
    if #docs == 0 then return end
    -- the UTF-8 check and the split of the whole batch in C, on threads
    -- (the byte-level shards take any bytes, as before)
    local train, val, train_bytes, val_bytes, bad = C.split_documents(docs, seed, val_fraction, threads, legacy)
    if next(bad) then
      for _, g in ipairs(segs) do
        for i = g.from, g.to do
          if bad[i] then
            local at = g.at or (g.base + g.offs[i - g.from + g.first] - 1)
            bad_input(not_utf8(g.path, at, bad[i]))
          end
        end
      end
    end
    local t0 = pg.wtime()
    local train_ids, train_counts = encode(train)
    local val_ids, val_counts = encode(val)
    encode_s = encode_s + (pg.wtime() - t0)
    sinks.train.write(train_ids, train_counts, train_bytes)
    sinks.val.write(val_ids, val_counts, val_bytes)
    progress_tokens = sinks.train.live_tokens() + sinks.val.live_tokens()
    docs, segs, nbytes = {}, {}, 0
  end
  each_document(function(d, path, at)
    local k = #docs + 1
    docs[k] = d
    segs[#segs + 1] = { from = k, to = k, path = path, at = at }
    nbytes = nbytes + #d
    if nbytes >= batch_bytes then flush() end
  end, on_bytes, function(list, first, offs, base, path)
    local n0 = #docs
    table.move(list, first, #list, n0 + 1, docs)
    segs[#segs + 1] = { from = n0 + 1, to = #docs, path = path, offs = offs, base = base, first = first }
    -- the run's span in the block (separators included): the batch size is a knob, not a count
    nbytes = nbytes + (offs[#list] + #list[#list] - offs[first])
    if nbytes >= batch_bytes then flush() end
  end)
  flush()
  return encode_s
end

--- The byte ids of docs one after another, and each one's count (encode_batch's flat result).
local function bytes_encode(docs)
  local counts = {}
  for i, d in ipairs(docs) do counts[i] = #d end
  return pg.data.bytes.encode(table.concat(docs)), counts
end

if legacy then
  local out, name = args.out or "data", args.name or "fortunes"
  pg.fs.mkdir_p(out)
  local sinks = {}
  for _, split in ipairs{ "train", "val" } do
    local fixed = ("%s_%s.bin"):format(name, split)
    sinks[split] = new_sink(split, out, "uint16", pg.data.bytes.eot, false, 0x7fffffff, function(k)
      if k > 0 then die("%s: more than 2^31 - 1 tokens do not fit one shard", fixed) end
      return fixed
    end)
  end
  local ok, err = pcall(run_pipeline, bytes_encode, sinks)
  progress_done()
  if not ok then
    sinks.train.abort(); sinks.val.abort()
    error(err, 0)
  end
  if sinks.train.documents + sinks.val.documents == 0 then
    -- nothing written yet (a sink opens its shard with the first document): the shards of before stay
    die("the inputs hold no documents%s: an empty corpus is refused",
      skipped > 0 and (" (%d bad ones skipped)"):format(skipped) or "")
  end
  sinks.train.finish(true); sinks.val.finish(true)
  print(("prepare_corpus: %d files, %d documents, byte tokens (vocab 256), end-of-text token %d before each document")
    :format(#files, sinks.train.documents + sinks.val.documents, pg.data.bytes.eot))
  for _, which in ipairs{ "train", "val" } do
    local s = sinks[which]
    print(("  %-5s %8d documents %10d tokens -> %s/%s"):format(which, s.documents, s.tokens, out, s.shards[1]))
  end
  if skipped > 0 then print(("  skipped %d bad documents"):format(skipped)) end
  return
end

-- ---- corpus mode ----

local out = args.out:gsub("/+$", "")
if out == "" then die("--out must name a directory") end

-- a path made absolute and without . / .. parts, to compare inputs with the output
local function canonical(q)
  if q:sub(1, 1) ~= "/" then q = (os.getenv("PWD") or ".") .. "/" .. q end
  local parts = {}
  for c in q:gmatch("[^/]+") do
    if c == ".." then parts[#parts] = nil elseif c ~= "." then parts[#parts + 1] = c end
  end
  return "/" .. table.concat(parts, "/")
end
local out_abs = canonical(out)
for _, f in ipairs(files) do
  local fa = canonical(f)
  if fa == out_abs or fa:sub(1, #out_abs + 1) == out_abs .. "/" then
    die("--out %s holds the input %s: a corpus is never written into its inputs", out, f)
  end
end

local function read_file(q)
  local h = io.open(q, "rb")
  if not h then return nil end
  local s = h:read("a")
  h:close()
  return s
end

-- What an existing --out holds: nothing (absent or empty), a corpus (its dataset.json decoded), or other files.
local existing
if pg.fs.kind(out) ~= nil then
  if pg.fs.kind(out) ~= "directory" then die("--out %s exists and is not a directory", out) end
  if #pg.fs.list(out) > 0 then
    local text = read_file(out .. "/dataset.json")
    local ok, j = pcall(cjson.decode, text or "")
    existing = ok and type(j) == "table" and j or false
    if existing == false and not args.overwrite then
      die("--out %s is not empty and holds no corpus (no dataset.json): give --overwrite to replace it", out)
    end
    -- a corpus has no subdirectories: --overwrite never removes a tree such as a home directory
    for _, name in ipairs(pg.fs.list(out)) do
      if pg.fs.kind(out .. "/" .. name) == "directory" then
        die("--out %s holds the directory %s: not a corpus, and not replaced even with --overwrite", out, name)
      end
    end
  end
end

local inputs_record = {}
for i, f in ipairs(files) do inputs_record[i] = f end
-- the settings a corpus is made of, known before any work: an existing corpus made otherwise is refused early
local function same_settings(j)
  if j.input_format ~= args.format or (j.field or cjson.null) ~= (field or cjson.null) then return false end
  if (j.separator or cjson.null) ~= (separator or cjson.null) or j.val_fraction ~= val_fraction or j.seed ~= seed then
    return false
  end
  if type(j.inputs) ~= "table" or #j.inputs ~= #inputs_record then return false end
  for i, f in ipairs(inputs_record) do if j.inputs[i] ~= f then return false end end
  return true
end
if existing and not args.overwrite and not same_settings(existing) then
  die("--out %s holds a different corpus (other inputs or settings in its dataset.json): give --overwrite to "
    .. "replace it", out)
end

local tmp = ("%s.tmp-%d"):format(out, pg.fs.getpid())
if pg.fs.kind(tmp) then pg.fs.remove_tree(tmp) end
pg.fs.mkdir_p(tmp)

local function cleanup_and_fail(err)
  progress_done()
  pcall(pg.fs.remove_tree, tmp)
  error(err, 0)
end

-- ---- the tokenizer ----

local tok, encode, doc_token, at_end, vocab_size
local spec = args.tokenizer
local ok, err = pcall(function()
  if spec == "bytes" then
    local vocab = {}
    for b = 0, 255 do vocab[("<0x%02X>"):format(b)] = b end
    tok = pg.tokenizer.from_table({ model = { type = "BPE", vocab = vocab, merges = {}, byte_fallback = true },
      decoder = { type = "Sequence", decoders = { { type = "ByteFallback" }, { type = "Fuse" } } } }, "bytes")
    encode = bytes_encode
    doc_token, at_end = pg.data.bytes.eot, false
    return
  end
  local v = spec:match("^train:(.*)$")
  if v then
    local vs = math.tointeger(tonumber(v))
    if not vs then die("--tokenizer=train:VOCAB needs an integer vocabulary size, got '%s'", v) end
    local train_files = files
    if args.format == "jsonl" then
      -- the documents' text, one after another: what the tokenizer is trained on
      local text_path = tmp .. "/train_text.tmp"
      local h = assert(io.open(text_path, "wb"))
      pass_label = "text "
      each_document(function(d) h:write(d, "\n") end, on_bytes)
      h:close()
      read_bytes, skipped, pass_label, t_start = 0, 0, "", pg.wtime()
      train_files = { text_path }
    end
    tok = pg.tokenizer.train{ files = train_files, vocab_size = vs, special_tokens = { "<|endoftext|>" },
      threads = args.threads or 0, progress = progress_on and true or false }
    if args.format == "jsonl" then os.remove(train_files[1]) end
  else
    tok = pg.tokenizer.load(spec)
  end
  local th = args.threads
  encode = function(docs) return tok:encode_batch(docs, { threads = th, add_special = false, flat = true }) end
  if args.eos_token then
    doc_token = tok:token_to_id(args.eos_token)
    if not doc_token then die("--eos-token '%s' is not a token of %s", args.eos_token, spec) end
    at_end = true
    tok:set_special_tokens{ eos = doc_token } -- what the saved tokenizer_config.json then says
  elseif tok:eos_id() then
    doc_token, at_end = tok:eos_id(), true
  elseif tok:bos_id() then
    doc_token, at_end = tok:bos_id(), false
  else
    die("the tokenizer %s has neither an eos nor a bos token to mark documents with: give --eos-token=TOKEN "
      .. "(one of its tokens, e.g. a special one)", spec)
  end
end)
if not ok then cleanup_and_fail(err) end
vocab_size = tok:vocab_size()
local dtype = pg.data.dtype_for(vocab_size)

-- ---- the shards ----

local sinks = {}
for _, split in ipairs{ "train", "val" } do
  sinks[split] = new_sink(split, tmp, dtype, doc_token, at_end, shard_tokens,
    function(k) return ("%s_%06d.bin"):format(split, k) end)
end
local encode_s
local t_tokens = pg.wtime() -- the rate is the tokenizing pass's (not loading or training the tokenizer)
ok, err = pcall(function() encode_s = run_pipeline(encode, sinks) end)
local pass_s = math.max(pg.wtime() - t_tokens, 1e-9)
if not ok then
  sinks.train.abort(); sinks.val.abort()
  cleanup_and_fail(err)
end
sinks.train.finish(false); sinks.val.finish(false)
progress_done()
local ndocs = sinks.train.documents + sinks.val.documents
if ndocs == 0 then
  cleanup_and_fail(("prepare_corpus: the inputs hold no documents%s: an empty corpus is refused")
    :format(skipped > 0 and (" (%d bad ones skipped)"):format(skipped) or ""))
end

-- ---- dataset.json, last ----

ok, err = pcall(function() tok:save_pretrained(tmp) end)
if not ok then cleanup_and_fail(err) end
local hash = pg.data.hash_hex(assert(read_file(tmp .. "/tokenizer.json")))

-- JSON with the keys in the order given: O(k1, v1, k2, v2, ...); a plain table is an array
local OBJ = {}
local function O(...) return setmetatable({ n = select("#", ...), ... }, OBJ) end
local function json(v, ind)
  ind = ind or ""
  if v == nil then return "null" end
  if getmetatable(v) == OBJ then
    local parts = {}
    for i = 1, v.n, 2 do parts[#parts + 1] = ind .. "  " .. cjson.encode(v[i]) .. ": " .. json(v[i + 1], ind .. "  ") end
    return "{\n" .. table.concat(parts, ",\n") .. "\n" .. ind .. "}"
  elseif type(v) == "table" then
    local parts = {}
    for i, x in ipairs(v) do parts[i] = json(x, ind) end
    return "[" .. table.concat(parts, ", ") .. "]"
  elseif math.type(v) == "integer" then
    return ("%d"):format(v)
  elseif type(v) == "number" then
    local short = ("%.15g"):format(v)
    return tonumber(short) == v and short or ("%.17g"):format(v)
  end
  return cjson.encode(v)
end
local function split_json(s) return O("shards", s.shards, "shard_tokens", s.shard_tokens, "tokens", s.tokens, "documents", s.documents, "bytes", s.bytes) end
local meta = json(O("format", "pipegoose-corpus", "version", 1,
  "tokenizer", O("file", "tokenizer.json", "hash", hash, "vocab_size", vocab_size, "bos_id", tok:bos_id(),
    "eos_id", tok:eos_id(), "document_token", doc_token, "document_token_at", at_end and "end" or "start"),
  "dtype", dtype, "train", split_json(sinks.train), "val", split_json(sinks.val),
  "inputs", inputs_record, "input_format", args.format, "field", field, "separator", separator,
  "val_fraction", val_fraction, "seed", seed, "skipped", skipped, "created_by", "scripts/prepare_corpus.lua")) .. "\n"

if existing and not args.overwrite then
  -- the same settings but another result (another tokenizer, changed inputs): a different corpus
  local old = read_file(out .. "/dataset.json")
  if old ~= meta then
    cleanup_and_fail(("prepare_corpus: --out %s holds a different corpus (its dataset.json differs from this one's: "
      .. "another tokenizer or changed inputs): give --overwrite to replace it"):format(out))
  end
end
pg.core.file.write(tmp .. "/dataset.json", { meta })

-- into place: the old directory aside, the new one onto its name, the old one removed
local aside
if pg.fs.kind(out) then
  aside = ("%s.old-%d"):format(out, pg.fs.getpid())
  local r, e = os.rename(out, aside)
  if not r then cleanup_and_fail("prepare_corpus: cannot move " .. out .. " aside: " .. tostring(e)) end
end
local r, e = os.rename(tmp, out)
if not r then
  if aside then os.rename(aside, out) end
  cleanup_and_fail("prepare_corpus: cannot rename " .. tmp .. " to " .. out .. ": " .. tostring(e))
end
if aside then pg.fs.remove_tree(aside) end

local dt = pass_s
local ntok = sinks.train.tokens + sinks.val.tokens
local nbytes = sinks.train.bytes + sinks.val.bytes
print(("prepare_corpus: %s -> %s: %d files, %s tokenizer (%d ids, %s, document token %d at the %s)"):format(
  spec, out, #files, spec == "bytes" and "byte-level" or "BPE", vocab_size, dtype, doc_token, at_end and "end" or "start"))
for _, which in ipairs{ "train", "val" } do
  local s = sinks[which]
  print(("  %-5s %8d documents %12d tokens %12d bytes %4d shards"):format(which, s.documents, s.tokens, s.bytes, #s.shards))
end
if skipped > 0 then print(("  skipped %d bad documents (--skip-bad)"):format(skipped)) end
print(("prepare_corpus: %d documents, %d tokens, %d bytes in %.2f s: %.0f tokens/s, %.2f MB/s; the tokenizer encoded "
  .. "%.2f MB/s"):format(ndocs, ntok, nbytes, dt, ntok / dt, nbytes / dt / 1e6, nbytes / math.max(encode_s, 1e-9) / 1e6))
