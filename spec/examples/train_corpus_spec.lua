-- examples/train_llama.lua --corpus=DIR (make run's recipe, run tiny): the
-- model is sized from the corpus's tokenizer, the printed bits per byte is the
-- formula of examples/measures.lua on the logged validation loss and
-- dataset.json's counts, the dictionary-word share is measures.dictionary_share
-- of the sample, and --save-hf writes the corpus's tokenizer with the model.
-- measures.lua's word rule is tested on fixed strings.
package.path = "examples/?.lua;" .. package.path

local assert = require "luassert"
local pg = require "pipegoose"
local cjson = require "cjson"
local h = require "helpers"
local measures = require "measures"

describe("examples/measures.lua", function()
  it("takes words as runs of ASCII letters joined by single apostrophes", function()
    assert.same({ "Don't", "say", "God's", "name", "x", "y", "tis", "rock", "n", "roll", "abc", "caf", "s" },
      measures.words("Don't say \"God's name\"; x''y 'tis rock-n-roll 3abc4 café's"))
    assert.same({}, measures.words(" 12, -- ... "))
  end)

  it("counts the words found in the dictionary, compared case-insensitively", function()
    local dict = { ["the"] = true, ["lord"] = true, ["god's"] = true, ["unto"] = true }
    local share, found, total = measures.dictionary_share("The LORD spake unto Xyzzy: GOD'S.", dict)
    assert.equal(4, found) -- The, LORD, unto, GOD'S (spake and Xyzzy are not in this dictionary)
    assert.equal(6, total)
    assert.equal(4 / 6, share)
    assert.is_nil((measures.dictionary_share("42 -- !", dict)))
  end)

  it("reads a dictionary file a word a line, lower-cased", function()
    local path = h.tmpfile("Aaron\naardvark\nGod's\n")
    local dict = assert(measures.load_dictionary(path))
    assert.same({ ["aaron"] = true, ["aardvark"] = true, ["god's"] = true }, dict)
    local none, why = measures.load_dictionary(path .. ".missing")
    assert.is_nil(none)
    assert.matches("no dictionary at " .. path .. ".missing", why, 1, true)
  end)

  it("computes bits per byte from the loss per token and a split's counts", function()
    -- 2 nats a token, 3 bytes a token: 2 / (3 ln 2) bits a byte
    assert.equal(2 * 300 / (900 * math.log(2)), measures.bits_per_byte(2, { tokens = 300, bytes = 900 }))
    assert.matches("bytes > 0", h.err_of(measures.bits_per_byte, 2, { tokens = 300, bytes = 0 }), 1, true)
  end)
end)

describe("examples/train_llama.lua --corpus=", function()
  local root = h.tmpdir()
  pg.fs.mkdir_p(root)
  teardown(function() h.rm(root) end)

  -- A small English-like corpus: documents of seeded sentences from a short
  -- word list, in the fortunes' format (a "%" line between documents).
  local WORDS = { "the", "lord", "said", "unto", "moses", "and", "a", "man", "is", "known", "by", "his", "dog",
    "light", "was", "good", "there", "in", "beginning", "earth" }
  local x, docs = 7, {}
  for d = 1, 60 do
    local sentences = {}
    for s = 1, 4 do
      local words = {}
      for w = 1, 8 do
        x = (x * 1103515245 + 12345) % 2147483648
        words[w] = WORDS[1 + (x >> 16) % #WORDS]
      end
      words[1] = words[1]:sub(1, 1):upper() .. words[1]:sub(2)
      sentences[s] = table.concat(words, " ") .. "."
    end
    docs[d] = table.concat(sentences, " ") .. "\n"
  end
  local text = root .. "/text.txt"
  local f = assert(io.open(text, "wb"))
  f:write(table.concat(docs, "%\n"))
  f:close()
  local corpus_dir = root .. "/corpus"
  local rc, out = h.sh(h.pglua_cmd{ "scripts/prepare_corpus.lua", "--tokenizer=train:300", "--input=" .. text,
    "--separator=%", "--val-fraction=0.3", "--out=" .. corpus_dir })
  assert(rc == 0, out)
  local corpus = pg.data.corpus(corpus_dir)

  local out_dir, hf_dir = root .. "/run", root .. "/hf"
  local TINY = { "examples/train_llama.lua", "--corpus=" .. corpus_dir, "--dim=32", "--layers=1", "--heads=4",
    "--kv-heads=2", "--hidden=64", "--seq-len=16", "--batch=4", "--steps=4", "--warmup=1", "--eval-every=4",
    "--log-every=2", "--sample=40", "--prompt=The lord", "--out=" .. out_dir, "--save-hf=" .. hf_dir }
  -- (a hang guard, not a timing assertion)
  local run_rc, run_out = h.sh("PG_PROGRESS=plain timeout -k 5 120 " .. h.pglua_cmd(TINY))

  it("trains a model whose vocabulary is the corpus's", function()
    assert.equal(0, run_rc, run_out)
    local manifest = pg.checkpoint.read_manifest(out_dir .. "/checkpoints/step-00000004")
    assert.equal(corpus.vocab_size, manifest.model.vocab)
    assert.equal(corpus.tokenizer:vocab_size(), corpus.vocab_size)
  end)

  it("prints bits per byte from the logged validation loss and dataset.json's counts", function()
    assert.equal(0, run_rc, run_out)
    local val_loss
    for line in io.lines(out_dir .. "/metrics.jsonl") do
      local rec = cjson.decode(line)
      if rec.kind == "val" then val_loss = rec.val_loss end
    end
    assert.is_not_nil(val_loss, run_out)
    local meta = cjson.decode(h.read(corpus_dir .. "/dataset.json"))
    local bpb, tokens, bytes = run_out:match("\nbits per byte: (%S+) %(val loss %S+ nats/token x (%d+) tokens / "
      .. "%((%d+) bytes x ln 2%)%)\n")
    assert.is_not_nil(bpb, run_out)
    assert.equal(meta.val.tokens, tonumber(tokens))
    assert.equal(meta.val.bytes, tonumber(bytes))
    local want = val_loss * meta.val.tokens / (meta.val.bytes * math.log(2))
    -- printed with 4 decimals (rounding: at most 5e-5); metrics.jsonl keeps 10
    -- significant digits of the loss (relative 5e-10 of the result)
    assert.is_true(math.abs(tonumber(bpb) - want) <= 5e-5 + want * 1e-9, ("printed %s, formula %.8f"):format(bpb, want))
  end)

  it("prints the sample through the corpus's tokenizer and its dictionary-word share as measures.lua computes it",
    function()
    assert.equal(0, run_rc, run_out)
    local sample = run_out:match("\nsample:\nThe lord(.-)\ndictionary words: ")
    assert.is_not_nil(sample, run_out)
    local line = run_out:match("\n(dictionary words: [^\n]+)\n")
    local dict = measures.load_dictionary()
    if dict then -- (scripts/install-deps.sh installs wamerican; without it the line says so)
      local share, found, total = measures.dictionary_share(measures.without_special(sample, corpus.tokenizer), dict)
      assert.equal(("dictionary words: %.1f%% (%d of the sample's %d words are in %s)")
        :format(100 * share, found, total, measures.DICTIONARY), line)
    else
      assert.matches("^dictionary words: not measured, no dictionary at ", line)
    end
    -- the command that samples it again names the corpus's tokenizer and gives the prompt as text; run, it
    -- prints the same text (the same weights, prompt ids, temperature and seed)
    local cmd = run_out:match("\nsample it again: ([^\n]+)\n")
    assert.is_not_nil(cmd, run_out)
    assert.matches(" --tokenizer=" .. corpus_dir .. " --prompt='The lord' --tokens=40 ", cmd, 1, true)
    local rc2, again = h.sh(cmd)
    assert.equal(0, rc2, again)
    assert.equal("The lord" .. run_out:match("\nsample:\nThe lord(.-)\ndictionary words: ") .. "\n", again)
  end)

  it("exports a transformers directory holding the corpus's tokenizer, and prints its path", function()
    assert.equal(0, run_rc, run_out)
    assert.matches("\nexported to " .. hf_dir .. " ", run_out, 1, true)
    local tok = pg.tokenizer.load(hf_dir)
    assert.equal(corpus.vocab_size, tok:vocab_size())
    local probe = "The lord said unto Moses."
    assert.same(corpus.tokenizer:encode(probe), tok:encode(probe))
    local config = cjson.decode(h.read(hf_dir .. "/config.json"))
    assert.equal(corpus.vocab_size, config.vocab_size)
  end)

  it("refuses --train or --val with --corpus, and names a --corpus that is not a corpus under its own name", function()
    local rc, out = h.sh(h.pglua_cmd{ "examples/train_llama.lua", "--corpus=" .. corpus_dir, "--train=x.bin" })
    assert.is_not.equal(0, rc)
    assert.matches("--corpus gives the training and validation data", out, 1, true)
    rc, out = h.sh(h.pglua_cmd{ "examples/train_llama.lua", "--corpus=" .. root .. "/nowhere" })
    assert.is_not.equal(0, rc)
    assert.matches("train_llama.lua: pg.data.corpus: " .. root .. "/nowhere", out, 1, true)
    assert.is_nil(out:find("train_gpt.lua:", 1, true), out)
  end)
end)
