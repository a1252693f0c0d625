-- scripts/prepare_corpus.lua with a real tokenizer: the prepared-corpus
-- directory (dataset.json, tokenizer.json, train_/val_ shards), its bad
-- input, and pg.data.corpus / TokenShards{corpus =} reading it back.
local pg = require "pipegoose"
local assert = require "luassert"
local cjson = require "cjson"
local h = require "helpers"

local GPT2 = "spec/fixtures/tokenizers/gpt2/tokenizer.json" -- 1200 ids; <|endoftext|> is id 0, no roles
local EOT = "<|endoftext|>"

local dir
local function path(name) return dir .. "/" .. name end

local function write(p, text)
  local f = assert(io.open(p, "wb"))
  f:write(text)
  f:close()
  return p
end

local function has(msg, text)
  assert(msg:find(text, 1, true), ("expected %q in the message: %s"):format(text, msg))
end

-- The documents (each a text) and two input files in the fortune format.
local docs_a = { "First fortune.\n", "Second one,\nover two lines.\n", "  Third, indented.\n", "Fourth: 42 is the answer.\n" }
local docs_b = { "Another file's document.\n", "Ünïcödé bytes too.\n", "Last words" }
local all_docs = {}
for _, d in ipairs(docs_a) do all_docs[#all_docs + 1] = d end
for _, d in ipairs(docs_b) do all_docs[#all_docs + 1] = d end
local in_a, in_b, in_jsonl

setup(function()
  dir = h.tmpdir()
  pg.fs.mkdir_p(dir)
  in_a = write(path("a.txt"), table.concat(docs_a, "%\n") .. "%\n")
  -- a leading separator and a blank document are dropped; no final newline
  in_b = write(path("b.txt"), "%\n" .. docs_b[1] .. "%\n   \n%\n" .. docs_b[2] .. "%\n" .. docs_b[3])
  local lines = {}
  for i, d in ipairs(all_docs) do lines[i] = cjson.encode{ id = i, text = d } end
  lines[#lines + 1] = "" -- a blank line is skipped
  in_jsonl = write(path("docs.jsonl"), table.concat(lines, "\n") .. "\n")
end)

teardown(function() h.rm(dir) end)

local function prepare(args)
  local cmd = { "scripts/prepare_corpus.lua" }
  for _, a in ipairs(args) do cmd[#cmd + 1] = a end
  return h.sh(h.pglua_cmd(cmd))
end

local function prepare_ok(args)
  local rc, out = prepare(args)
  assert.equal(0, rc, out)
  return out
end

local function dataset(d) return cjson.decode(h.read(d .. "/dataset.json")) end

-- Every id of a split's shards, in order.
local function split_ids(d, split)
  local ids = {}
  for _, name in ipairs(dataset(d)[split].shards) do
    for _, id in ipairs(pg.data.read_shard(d .. "/" .. name):totable()) do ids[#ids + 1] = id end
  end
  return ids
end

-- A split's ids cut into documents at the document token (at "end": after each; "start": before each).
local function cut(ids, token, at)
  local docs, cur = {}, {}
  for i, id in ipairs(ids) do
    if id == token then
      if at == "end" then docs[#docs + 1] = cur; cur = {}
      else
        if i > 1 then docs[#docs + 1] = cur end
        cur = {}
      end
    else
      cur[#cur + 1] = id
    end
  end
  if at == "start" and #ids > 0 then docs[#docs + 1] = cur end
  assert(at == "start" or #cur == 0, "ids after the last document token")
  return docs
end

-- The documents of each split, as the split rule puts them: hash_unit(doc, seed) < fraction -> val.
local function expected_split(docs, fraction, seed)
  local want = { train = {}, val = {} }
  for _, d in ipairs(docs) do
    local side = pg.data.hash_unit(d, seed) < fraction and want.val or want.train
    side[#side + 1] = d
  end
  return want
end

local function bytes_of(list)
  local n = 0
  for _, d in ipairs(list) do n = n + #d end
  return n
end

-- The shards of d decode back to the documents, each once, with one document token each.
local function assert_round_trip(d, docs, fraction, seed)
  local meta = dataset(d)
  local tok = pg.tokenizer.load(d)
  local want = expected_split(docs, fraction, seed)
  for _, split in ipairs{ "train", "val" } do
    local ids = split_ids(d, split)
    local got = cut(ids, meta.tokenizer.document_token, meta.tokenizer.document_token_at)
    assert.equal(#want[split], #got, split)
    for i, doc in ipairs(want[split]) do
      assert.same(tok:encode(doc, { add_special = false }), got[i], split .. " document " .. i)
      assert.equal(doc, tok:decode(got[i]), split .. " document " .. i)
    end
    assert.equal(#ids, meta[split].tokens)
    assert.equal(#want[split], meta[split].documents)
    assert.equal(bytes_of(want[split]), meta[split].bytes)
  end
  return meta
end

describe("prepare_corpus.lua --tokenizer", function()
  it("text with separators and a tokenizer.json: shards that decode back, dataset.json, pg.data.corpus", function()
    local out = path("c_text")
    local log = prepare_ok{ "--tokenizer=" .. GPT2, "--eos-token=" .. EOT, "--input=" .. in_a .. "," .. in_b,
      "--separator=%", "--out=" .. out, "--val-fraction=0.4", "--seed=5", "--threads=2" }
    local meta = assert_round_trip(out, all_docs, 0.4, 5)
    assert.equal("pipegoose-corpus", meta.format)
    assert.equal(1, meta.version)
    assert.equal("uint16", meta.dtype)
    assert.same({ file = "tokenizer.json", hash = pg.data.hash_hex(h.read(out .. "/tokenizer.json")), vocab_size = 1200,
      bos_id = cjson.null, eos_id = 0, document_token = 0, document_token_at = "end" }, meta.tokenizer)
    assert.same({ in_a, in_b }, meta.inputs)
    assert.equal("text", meta.input_format)
    assert.equal(cjson.null, meta.field)
    assert.equal("%", meta.separator)
    assert.equal(0.4, meta.val_fraction)
    assert.equal(5, meta.seed)
    assert.equal(0, meta.skipped)
    assert.equal("scripts/prepare_corpus.lua", meta.created_by)
    -- with this seed both sides get documents (a fixed fact of these seven documents)
    assert.is_true(meta.train.documents > 0 and meta.val.documents > 0)
    assert.same({ "train_000000.bin" }, meta.train.shards)
    assert.is_true(pg.fs.exists(out .. "/tokenizer_config.json") and pg.fs.exists(out .. "/special_tokens_map.json"))
    assert.matches("7 documents, %d+ tokens, " .. bytes_of(all_docs) .. " bytes", log)
    -- pg.data.corpus reads it back, and TokenShards opens a split
    local c = pg.data.corpus(out)
    assert.equal(1200, c.vocab_size)
    assert.equal("uint16", c.dtype)
    assert.equal(meta.tokenizer.hash, c.hash)
    assert.equal(0, c.tokenizer:eos_id())
    assert.equal(meta.train.tokens, c.train.tokens)
    assert.equal(meta.val.documents, c.val.documents)
    assert.equal("/", c.train.paths[1]:sub(1, 1))
    local d = pg.data.TokenShards{ corpus = out, split = "train", batch = 1, seq_len = 4, shuffle = false }
    local x = d:next_batch()
    assert.same({ { table.unpack(split_ids(out, "train"), 1, 4) } }, x:totable())
    assert.has_error(function() pg.data.TokenShards{ corpus = c, split = "train", batch = 1, seq_len = 4, vocab = 1000 } end,
      "TokenShards: the corpus's tokenizer has 1200 ids; the model's vocabulary is 1000 (vocab=)")
    -- vocab >= the corpus's is fine
    pg.data.TokenShards{ corpus = c, split = "train", batch = 1, seq_len = 4, vocab = 1300 }
    -- the model's tokenizer: the corpus's (loaded from its own file) is accepted, another one refused
    pg.data.TokenShards{ corpus = c, split = "train", batch = 1, seq_len = 4, tokenizer = pg.tokenizer.load(out) }
    local other = pg.tokenizer.train{ files = in_a, vocab_size = 300, progress = false }
    local err = h.err_of(pg.data.TokenShards, { corpus = c, split = "train", batch = 1, seq_len = 4, tokenizer = other })
    assert.truthy(err:find("was made with another tokenizer than the one given (tokenizer=)", 1, true), err)
  end)

  it("jsonl with --tokenizer=train:300: the trained tokenizer's <|endoftext|> ends each document", function()
    local out = path("c_train")
    prepare_ok{ "--tokenizer=train:300", "--input=" .. in_jsonl, "--format=jsonl", "--out=" .. out, "--val-fraction=0.3" }
    local meta = assert_round_trip(out, all_docs, 0.3, 0)
    assert.equal("jsonl", meta.input_format)
    assert.equal("text", meta.field)
    local tok = pg.tokenizer.load(out)
    assert.equal(tok:token_to_id(EOT), meta.tokenizer.document_token)
    assert.equal("end", meta.tokenizer.document_token_at)
    assert.is_true(meta.tokenizer.vocab_size <= 300)
    -- the text extracted to train on is gone; nothing but the corpus is left
    local names = pg.fs.list(out)
    assert.same({ "dataset.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json", "train_000000.bin",
      "val_000000.bin" }, names)
  end)

  it("a tokenizer with a bos and no eos puts it before each document; --field picks another field", function()
    local hf = path("hf_bos")
    pg.fs.mkdir_p(hf)
    pg.tokenizer.load(GPT2):set_special_tokens{ bos = EOT }:save_pretrained(hf)
    local lines = {}
    for i, d in ipairs(all_docs) do lines[i] = cjson.encode{ body = d } end
    local input = write(path("body.jsonl"), table.concat(lines, "\n"))
    local out = path("c_bos")
    prepare_ok{ "--tokenizer=" .. hf, "--input=" .. input, "--format=jsonl", "--field=body", "--out=" .. out }
    local meta = assert_round_trip(out, all_docs, 0.1, 0)
    assert.equal(0, meta.tokenizer.bos_id)
    assert.equal("start", meta.tokenizer.document_token_at)
    assert.equal("body", meta.field)
  end)

  it("uint32 ids when the vocabulary has more than 65536 ids", function()
    -- the fixture with one added token of id 70000 (ids may be sparse): vocab_size 70001
    local j = cjson.decode(h.read(GPT2))
    j.added_tokens[#j.added_tokens + 1] = { id = 70000, content = "<|big|>", special = true, single_word = false,
      lstrip = false, rstrip = false, normalized = false }
    local hf = path("hf_big")
    pg.fs.mkdir_p(hf)
    pg.tokenizer.from_table(j, "big"):set_special_tokens{ eos = "<|big|>" }:save_pretrained(hf)
    local out = path("c_big")
    prepare_ok{ "--tokenizer=" .. hf, "--input=" .. in_a, "--separator=%", "--out=" .. out, "--val-fraction=0" }
    local meta = assert_round_trip(out, docs_a, 0, 0)
    assert.equal("uint32", meta.dtype)
    assert.equal(70001, meta.tokenizer.vocab_size)
    assert.equal(70000, meta.tokenizer.document_token)
    assert.equal(7, pg.data.shard_info(out .. "/" .. meta.train.shards[1]).version)
    assert.equal(70000, split_ids(out, "train")[#split_ids(out, "train")])
    assert.equal("uint32", pg.data.corpus(out).dtype)
  end)

  it("rolls shards over at --shard-tokens; block size, batch size and threads change no byte", function()
    local base = { "--tokenizer=" .. GPT2, "--eos-token=" .. EOT, "--input=" .. in_a .. "," .. in_b, "--separator=%",
      "--val-fraction=0.4", "--seed=5" }
    local function run(out, extra)
      local a = {}
      for _, x in ipairs(base) do a[#a + 1] = x end
      for _, x in ipairs(extra) do a[#a + 1] = x end
      a[#a + 1] = "--out=" .. out
      prepare_ok(a)
      return dataset(out)
    end
    local one = run(path("r_one"), { "--threads=1" })
    local small = run(path("r_small"), { "--threads=2", "--block-bytes=3", "--batch-bytes=10", "--shard-tokens=7" })
    -- the same ids, cut into shards of exactly 7 (the last of a split fewer)
    for _, split in ipairs{ "train", "val" } do
      assert.same(split_ids(path("r_one"), split), split_ids(path("r_small"), split), split)
      local n = #small[split].shards
      assert.equal((one[split].tokens + 6) // 7, n, split)
      for i, name in ipairs(small[split].shards) do
        assert.equal(("%s_%06d.bin"):format(split, i - 1), name)
        local t = pg.data.shard_info(path("r_small") .. "/" .. name).tokens
        if i < n then assert.equal(7, t) else assert.is_true(t >= 1 and t <= 7) end
      end
    end
    -- threads 1 and 2, 4 MiB and 3-byte blocks: byte-identical shards
    local two = run(path("r_two"), { "--threads=2", "--block-bytes=3", "--batch-bytes=10" })
    for _, name in ipairs(one.train.shards) do
      assert.equal(h.read(path("r_one/" .. name)), h.read(path("r_two/" .. name)))
    end
    assert.equal(#one.train.shards, #two.train.shards)
  end)

  it("--tokenizer=bytes: the byte ids with 0 before each document, and a tokenizer.json that encodes the same", function()
    local out = path("c_bytes")
    prepare_ok{ "--tokenizer=bytes", "--input=" .. in_a .. "," .. in_b, "--separator=%", "--out=" .. out, "--val-fraction=0" }
    local meta = dataset(out)
    assert.equal(256, meta.tokenizer.vocab_size)
    assert.equal(0, meta.tokenizer.document_token)
    assert.equal("start", meta.tokenizer.document_token_at)
    -- the same ids as the byte-level mode's shard of these files
    prepare_ok{ "--out=" .. path("legacy"), "--name=t", "--val-fraction=0", in_a, in_b }
    assert.same(pg.data.read_shard(path("legacy/t_train.bin")):totable(), split_ids(out, "train"))
    local tok = pg.tokenizer.load(out)
    for _, d in ipairs(all_docs) do
      assert.same(pg.data.bytes.encode(d):totable(), tok:encode(d))
      assert.equal(d, tok:decode(tok:encode(d)))
    end
    assert_round_trip(out, all_docs, 0, 0)
  end)

  it("draws a progress bar on stderr with --progress, and none when stderr is not a terminal", function()
    local base = { "--tokenizer=" .. GPT2, "--eos-token=" .. EOT, "--input=" .. in_a, "--separator=%" }
    local function run(extra, out)
      local a = { "scripts/prepare_corpus.lua" }
      for _, x in ipairs(base) do a[#a + 1] = x end
      for _, x in ipairs(extra) do a[#a + 1] = x end
      a[#a + 1] = "--out=" .. out
      -- stdout to /dev/null: what is left is stderr
      local rc, err = h.sh(h.pglua_cmd(a) .. " >/dev/null")
      assert.equal(0, rc, err)
      return err
    end
    has(run({ "--progress" }, path("p_on")), "100%")
    assert.is_nil(run({}, path("p_off")):find("100%", 1, true))
  end)

  it("one document per file without a separator; directories and globs as inputs", function()
    local sub = path("tree")
    pg.fs.mkdir_p(sub .. "/deeper")
    write(sub .. "/x.txt", "one whole file\n%\nstill the same document\n")
    write(sub .. "/deeper/y.txt", "another file")
    write(sub .. "/.hidden", "skipped")
    local out = path("c_files")
    prepare_ok{ "--tokenizer=" .. GPT2, "--eos-token=" .. EOT, "--input=" .. sub, "--out=" .. out, "--val-fraction=0" }
    local meta = assert_round_trip(out, { "another file", "one whole file\n%\nstill the same document\n" }, 0, 0)
    assert.same({ sub .. "/deeper/y.txt", sub .. "/x.txt" }, meta.inputs)
    local out2 = path("c_glob")
    prepare_ok{ "--tokenizer=" .. GPT2, "--eos-token=" .. EOT, "--input=" .. sub .. "/*.txt", "--out=" .. out2 }
    assert.same({ sub .. "/x.txt" }, dataset(out2).inputs)
  end)
end)

describe("prepare_corpus.lua refuses bad input", function()
  local function refused(args, text)
    local rc, out = prepare(args)
    assert.equal(1, rc, out)
    has(out, text)
    return out
  end
  local tok = { "--tokenizer=" .. GPT2, "--eos-token=" .. EOT }
  local function with(...)
    local a = {}
    for _, x in ipairs(tok) do a[#a + 1] = x end
    for _, x in ipairs{ ... } do a[#a + 1] = x end
    return a
  end

  it("JSONL lines: malformed, without the field, a field that is not a string; --skip-bad counts them", function()
    local input = write(path("bad.jsonl"), '{"text": "fine"}\n{"text": "also fine"\n{"body": "x"}\n{"text": 5}\n[1]\n')
    local out = path("never")
    refused(with("--input=" .. input, "--format=jsonl", "--out=" .. out), input .. ":2: not valid JSON")
    local good = write(path("bad3.jsonl"), '{"text": "fine"}\n{"body": "x"}\n')
    refused(with("--input=" .. good, "--format=jsonl", "--out=" .. out), good .. ":2: no field 'text'")
    local num = write(path("bad4.jsonl"), '{"text": 5}\n')
    refused(with("--input=" .. num, "--format=jsonl", "--out=" .. out), num .. ":1: field 'text' is a number, not a string")
    local arr = write(path("bad5.jsonl"), '[1]\n')
    refused(with("--input=" .. arr, "--format=jsonl", "--out=" .. out), arr .. ":1: not a JSON object")
    -- nothing was left behind: no output, no temporary directory
    assert.is_nil(pg.fs.kind(out))
    for _, name in ipairs(pg.fs.list(dir)) do assert.is_nil(name:find("never.tmp", 1, true), name) end
    local log = prepare_ok(with("--input=" .. input, "--format=jsonl", "--out=" .. out, "--skip-bad", "--val-fraction=0"))
    has(log, "skipped 4 bad documents")
    local meta = dataset(out)
    assert.equal(4, meta.skipped)
    assert.equal(1, meta.train.documents) -- "fine"; the unclosed line 2 is one of the four
  end)

  it("a document that is not UTF-8, named by file and byte offset", function()
    local input = write(path("latin1.txt"), "good\n%\nna\xefve\n%\nalso good\n")
    local out = path("u8")
    refused(with("--input=" .. input, "--separator=%", "--out=" .. out), input .. ": not UTF-8 at byte offset 9")
    local j = write(path("latin1.jsonl"), '{"text": "ok"}\n{"text": "na\xefve"}\n')
    refused(with("--input=" .. j, "--format=jsonl", "--out=" .. out), j .. ":2: field 'text' is not UTF-8 (byte 2 of it)")
    prepare_ok(with("--input=" .. input, "--separator=%", "--out=" .. out, "--skip-bad", "--val-fraction=0"))
    assert.equal(1, dataset(out).skipped)
    assert.equal(2, dataset(out).train.documents)
  end)

  it("an empty corpus, a tokenizer without a document token, arguments it does not know", function()
    local blank = write(path("blank.txt"), "  \n%\n\n")
    refused(with("--input=" .. blank, "--separator=%", "--out=" .. path("e")), "the inputs hold no documents")
    assert.is_nil(pg.fs.kind(path("e")))
    refused({ "--tokenizer=" .. GPT2, "--input=" .. in_a, "--out=" .. path("e") }, "give --eos-token=TOKEN")
    refused(with("--input=" .. in_a, "--out=" .. path("e"), "--eos-token=<|nope|>"), "--eos-token '<|nope|>' is not a token")
    refused(with("--input=" .. in_a, "--out=" .. path("e"), "--shard-tokenz=5"), "unknown option '--shard-tokenz'")
    refused(with("--input=" .. in_a, "--out=" .. path("e"), "stray.txt"), "unexpected argument 'stray.txt'")
    refused(with("--input=" .. path("missing.txt"), "--out=" .. path("e")), "missing.txt: no such file or directory")
    refused(with("--input=" .. in_a, "--out=" .. path("e"), "--field=body"), "--field is for --format=jsonl")
    refused({ "--tokenizer=train:x", "--input=" .. in_a, "--out=" .. path("e") }, "needs an integer vocabulary size")
  end)

  it("an output directory that holds something else, or an input", function()
    local out = path("taken")
    prepare_ok(with("--input=" .. in_a, "--separator=%", "--out=" .. out))
    -- the same corpus again: replaced (it is the same)
    prepare_ok(with("--input=" .. in_a, "--separator=%", "--out=" .. out))
    -- another corpus into it: refused, then --overwrite
    refused(with("--input=" .. in_b, "--separator=%", "--out=" .. out), "holds a different corpus")
    assert.same({ in_a }, dataset(out).inputs)
    prepare_ok(with("--input=" .. in_b, "--separator=%", "--out=" .. out, "--overwrite"))
    assert.same({ in_b }, dataset(out).inputs)
    -- a directory of other files
    local other = path("other")
    pg.fs.mkdir_p(other)
    write(other .. "/notes.txt", "mine")
    refused(with("--input=" .. in_a, "--out=" .. other), "is not empty and holds no corpus")
    assert.equal("mine", h.read(other .. "/notes.txt"))
    refused(with("--input=" .. other .. "/notes.txt", "--out=" .. other, "--overwrite"), "a corpus is never written into its inputs")
    assert.equal("mine", h.read(other .. "/notes.txt"))
    pg.fs.mkdir_p(other .. "/sub")
    refused(with("--input=" .. in_a, "--out=" .. other, "--overwrite"), "not replaced even with --overwrite")
    assert.equal("mine", h.read(other .. "/notes.txt"))
    refused(with("--input=" .. in_jsonl, "--format=jsonl", "--separator=%", "--out=" .. path("e")), "--separator is for --format=text")
  end)
end)

describe("pg.data.corpus refuses", function()
  local good
  setup(function()
    good = path("good")
    prepare_ok{ "--tokenizer=" .. GPT2, "--eos-token=" .. EOT, "--input=" .. in_a, "--separator=%", "--out=" .. good }
  end)

  -- a copy of the good corpus with dataset.json's table changed by edit (or the tokenizer.json text)
  local n = 0
  local function variant(edit, tok_text)
    n = n + 1
    local d = path("variant" .. n)
    assert.equal(0, (h.sh(("cp -r %s %s"):format(h.quote(good), h.quote(d)))))
    local meta = dataset(d)
    if edit then edit(meta) end
    write(d .. "/dataset.json", cjson.encode(meta))
    if tok_text then write(d .. "/tokenizer.json", tok_text) end
    return d
  end

  it("a directory without dataset.json (unfinished), a malformed field, another tokenizer", function()
    pg.fs.mkdir_p(path("half"))
    has(h.err_of(pg.data.corpus, path("half")), "has no dataset.json: not a prepared corpus, or an unfinished one")
    has(h.err_of(pg.data.corpus, variant(function(m) m.format = "other" end)), "format is other")
    has(h.err_of(pg.data.corpus, variant(function(m) m.dtype = "int8" end)), "dtype must be \"uint16\" or \"uint32\"")
    has(h.err_of(pg.data.corpus, variant(function(m) m.tokenizer.vocab_size = 70000 end)),
      "dtype is uint16 but tokenizer.vocab_size 70000 needs uint32")
    has(h.err_of(pg.data.corpus, variant(function(m) m.train.tokens = m.train.tokens + 1 end)), "train.tokens is")
    has(h.err_of(pg.data.corpus, variant(function(m) m.tokenizer.document_token_at = "middle" end)),
      "tokenizer.document_token_at must be")
    has(h.err_of(pg.data.corpus, variant(function(m) m.val.shards = { "nope.bin" } end)), "val.shards[1]")
    local other = h.read(good .. "/tokenizer.json"):gsub('"Hello"', '"Hallo"', 1) .. "\n"
    has(h.err_of(pg.data.corpus, variant(nil, other)), "but the corpus was made with a tokenizer of hash")
    has(h.err_of(pg.data.TokenShards, { corpus = good, batch = 1, seq_len = 2 }), "corpus= needs split")
    has(h.err_of(pg.data.TokenShards, { corpus = good, split = "val", path = "x", batch = 1, seq_len = 2 }), "not both")
  end)
end)

describe("TokenShards: headerless files and llm.c's stride", function()
  local raw
  setup(function()
    -- ids 0..99 as raw little-endian uint16, nanoGPT's train.bin layout
    local parts = {}
    for i = 0, 99 do parts[#parts + 1] = string.pack("<I2", i) end
    raw = write(path("raw.bin"), table.concat(parts))
  end)

  local function rows(x) return x:totable() end

  it("reads raw ids with dtype=, and refuses a file without the magic without it", function()
    has(h.err_of(pg.data.TokenShards, { path = raw, batch = 2, seq_len = 4 }), "give dtype = \"uint16\" or \"uint32\"")
    local d = pg.data.TokenShards{ path = raw, dtype = "uint16", batch = 2, seq_len = 4, shuffle = false }
    local x, y = d:next_batch()
    -- windows of 5: [0..4], [5..9]
    assert.same({ { 0, 1, 2, 3 }, { 5, 6, 7, 8 } }, rows(x))
    assert.same({ { 1, 2, 3, 4 }, { 6, 7, 8, 9 } }, rows(y))
    assert.equal(10, d:batches_per_epoch()) -- 20 windows of 5 in 100 ids, 2 a batch
    -- as uint32 the same bytes are 50 ids: id k = (2k) + (2k+1) * 65536
    local w = pg.data.TokenShards{ path = raw, dtype = "uint32", batch = 1, seq_len = 2, shuffle = false }
    assert.same({ { 0 + 1 * 65536, 2 + 3 * 65536 } }, rows((w:next_batch())))
    write(path("odd.bin"), "abc")
    has(h.err_of(pg.data.TokenShards, { path = path("odd.bin"), dtype = "uint16", batch = 1, seq_len = 1 }),
      "3 bytes are not a whole number of uint16 ids")
    has(h.err_of(pg.data.TokenShards, { path = raw, dtype = "uint16", batch = 1, seq_len = 4, vocab = 50 }),
      "token 50 at position 50 (counting from 0) is not below the vocabulary size 50")
    assert.same({ 0, 1, 2 }, { table.unpack(pg.data.read_shard(raw, nil, "uint16"):totable(), 1, 3) })
  end)

  it("stride = \"llmc\": batches of B*T + 1 consecutive ids, advancing B*T", function()
    local B, T = 2, 4
    local d = pg.data.TokenShards{ path = raw, dtype = "uint16", batch = B, seq_len = T, shuffle = false, stride = "llmc" }
    -- (100 - 1) // 8 = 12 batches; batch u reads ids [8u, 8u + 9)
    assert.equal(12, d:batches_per_epoch())
    assert.equal(24, d:num_windows())
    for u = 0, 11 do
      local x, y = d:next_batch()
      local b = 8 * u
      assert.same({ { b, b + 1, b + 2, b + 3 }, { b + 4, b + 5, b + 6, b + 7 } }, rows(x), "batch " .. u)
      assert.same({ { b + 1, b + 2, b + 3, b + 4 }, { b + 5, b + 6, b + 7, b + 8 } }, rows(y), "batch " .. u)
    end
    assert.is_nil(d:next_batch())
    assert.equal(1, d:epoch())
    -- shuffled: the same 12 batches, each once per epoch, resumable from state_dict
    local s = pg.data.TokenShards{ path = raw, dtype = "uint16", batch = B, seq_len = T, seed = 3, stride = "llmc" }
    local firsts, seen = {}, {}
    for i = 1, 12 do
      local x = s:next_batch()
      local f = rows(x)[1][1]
      assert.equal(0, f % 8)
      assert.is_nil(seen[f])
      seen[f], firsts[i] = true, f
    end
    local again = pg.data.TokenShards{ path = raw, dtype = "uint16", batch = B, seq_len = T, seed = 3, stride = "llmc" }
    for _ = 1, 5 do again:next_batch() end
    local sd = again:state_dict()
    assert.equal("llmc", sd.stride)
    local resumed = pg.data.TokenShards{ path = raw, dtype = "uint16", batch = B, seq_len = T, seed = 3, stride = "llmc" }
    resumed:load_state_dict(sd)
    for i = 6, 12 do assert.equal(firsts[i], rows((resumed:next_batch()))[1][1], "batch " .. i) end
    -- a state of the other stride is refused; a state from before strides existed is "window"'s
    local win = pg.data.TokenShards{ path = raw, dtype = "uint16", batch = B, seq_len = T, seed = 3 }
    has(h.err_of(function() win:load_state_dict(sd) end), "stride llmc in the state but window here")
    local old = win:state_dict()
    old.stride = nil
    win:load_state_dict(old)
    -- too short for one llm.c batch: B*T + 1 ids
    has(h.err_of(pg.data.TokenShards, { path = raw, dtype = "uint16", batch = 11, seq_len = 10, stride = "llmc" }),
      "it has 100 tokens, but one batch of 11 rows of seq_len 10 (llm.c's stride) needs 111")
  end)
end)
