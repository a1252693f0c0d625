-- pg.tokenizer.train against Hugging Face `tokenizers`' BpeTrainer: the
-- fixtures under spec/fixtures/tokenizers/train_*/ hold what BpeTrainer made
-- from four of Debian's fortune files (~187 KB; scripts/make_tokenizer_fixtures.py
-- --train wrote them): the settings, the vocabulary by id, the merges in rank
-- order and `tokenizers`' ids for sample texts under the trained tokenizer.
-- pipegoose trains on the same files and must give exactly these, at one
-- thread and at two.
local pg = require "pipegoose"
local h = require "helpers"
local cjson = require("cjson").new()

local DIR = "spec/fixtures/tokenizers/"
local FORTUNES = "/usr/share/games/fortunes/"
local FIXTURES = { "train_gpt2", "train_gpt2_mf1", "train_llama3", "train_llama3_mf1" }

local read = h.read

local ints = h.ints

local err_of = h.err_of

-- The fixture's corpus, checked to be the one it was made from (Debian's fortunes package).
local function corpus(exp)
  local files = {}
  for i, name in ipairs(exp.files) do
    files[i] = FORTUNES .. name
    local f = io.open(files[i], "rb")
    assert(f, files[i] .. " is missing: install Debian's fortunes package (scripts/install-deps.sh)")
    local size = f:seek("end")
    f:close()
    assert(size == math.tointeger(exp.file_sizes[i]),
      ("%s has %d bytes, the fixture's had %d: another fortunes release (rerun the --train script)"):format(
        files[i], size, math.tointeger(exp.file_sizes[i])))
  end
  return files
end

local function train(exp, files, threads)
  return pg.tokenizer.train { files = files, vocab_size = math.tointeger(exp.vocab_size),
    min_frequency = math.tointeger(exp.min_frequency), special_tokens = exp.special_tokens,
    pattern = exp.pattern, threads = threads, progress = false }
end

describe("pg.tokenizer.train matches BpeTrainer", function()
  for _, name in ipairs(FIXTURES) do
    describe(name, function()
      local exp = cjson.decode(read(DIR .. name .. "/expected.json"))
      local files = corpus(exp)
      local tok, stats = train(exp, files, 1)
      local j = cjson.decode(tok:to_json())

      it("makes BpeTrainer's vocabulary and merges, in its order", function()
        local want = {}
        for i, t in ipairs(exp.vocab) do want[t] = i - 1 end
        assert.same(want, j.model.vocab)
        assert.equal(#exp.vocab, tok:vocab_size())
        local merges = {}
        for i, m in ipairs(j.model.merges) do merges[i] = m[1] .. " " .. m[2] end
        assert.equal(#exp.merges, #merges)
        for i, m in ipairs(exp.merges) do assert.equal(m, merges[i], ("merge %d"):format(i - 1)) end
        assert.equal(#exp.merges, stats.merges_made)
      end)

      it("gives the same tokenizer at two threads, in pieces of any size", function()
        local tok2, stats2 = train(exp, files, 2)
        assert.equal(tok:to_json(), tok2:to_json())
        assert.equal(stats.words, stats2.words)
        assert.equal(stats.pre_tokens, stats2.pre_tokens)
        -- pieces of 1000 bytes (cut inside lines) and of 1 byte (a piece on every byte, most of them with no line)
        for _, cb in ipairs(name == "train_gpt2" and { 1000, 1 } or { 1000 }) do
          local tok3 = pg.tokenizer.train { files = files, vocab_size = math.tointeger(exp.vocab_size),
            min_frequency = math.tointeger(exp.min_frequency), special_tokens = exp.special_tokens,
            pattern = exp.pattern, threads = 2, progress = false, chunk_bytes = cb }
          assert.equal(tok:to_json(), tok3:to_json(), "chunk_bytes = " .. cb)
        end
      end)

      it("encodes as tokenizers does with BpeTrainer's tokenizer, and so does its saved file", function()
        local d = h.tmpdir()
        pg.fs.mkdir_p(d)
        local back = pg.tokenizer.load(tok:save(d))
        for _, e in ipairs(exp.texts) do
          assert.same(ints(e.ids), tok:encode(e.text, { add_special = false }), e.text)
          assert.same(ints(e.ids), back:encode(e.text, { add_special = false }), e.text)
          assert.equal(e.text, tok:decode(tok:encode(e.text)))
        end
        local sp = {}
        for i, s in ipairs(exp.special_tokens) do sp[s] = i - 1 end
        assert.same(sp, back:special_tokens())
        pg.fs.remove_tree(d)
      end)
    end)
  end
end)

describe("pg.tokenizer.train", function()
  local T = pg.tokenizer
  local file = FORTUNES .. "fortunes"

  it("counts each line on its own, as train_from_files does, and a pattern of its own", function()
    local path = h.tmpfile("ab ab\n\nab  cd\n", ".txt")
    local tok, st = T.train { files = { path }, vocab_size = 258, progress = false }
    assert.equal(8, st.pre_tokens) -- "ab" " ab" "\n" | "\n" | "ab" " " " cd" "\n"
    assert.equal(5, st.words) -- ab Ġab Ċ Ġ Ġcd
    assert.equal("ab", tok:id_to_token(256)) -- the most frequent pair: a b (3 times)
    local tok2 = T.train { files = path, vocab_size = 257, pattern = "[a-z]+|\\s", progress = false }
    assert.same({ "ab", "Ġ", "ab" }, tok2:pre_tokenize("ab ab"))
    os.remove(path)
  end)

  it("draws a progress bar on stderr when asked", function()
    local script = h.tmpfile(("require('pipegoose').tokenizer.train{files = %q, vocab_size = 300, progress = true}")
      :format(file))
    local rc, out = h.sh(h.pglua_cmd({ script }) .. " 2>&1 >/dev/null")
    os.remove(script)
    assert.equal(0, rc, out)
    assert.matches("tokenizer.train: counting [", out, 1, true)
    assert.matches("tokenizer.train: merges", out, 1, true)
  end)

  it("refuses bad options, naming them", function()
    local cases = {
      { { files = file, vocab_size = 256, special_tokens = { "<s>" } },
        "tokenizer.train: vocab_size must be at least 257 (the 256 byte-level characters and 1 special tokens), got 256" },
      { { files = file, vocab_size = 100 }, "vocab_size must be at least 256" },
      { { files = file, vocab_size = 300, pattern = "gpt4" }, "tokenizer.train: pattern 'gpt4' is not a known name (gpt2, llama3)" },
      { { files = file, vocab_size = 300, pattern = "(ab" },
        "tokenizer.train: pattern: regex '(ab' does not compile: PCRE2: missing closing parenthesis" },
      { { files = { file, "/nonexistent/corpus.txt" }, vocab_size = 300 },
        "tokenizer.train: files[2] '/nonexistent/corpus.txt' is missing or unreadable" },
      { { files = "spec", vocab_size = 300 }, "files[1] 'spec' is a directory" },
      { { files = file, vocab = 300 }, "tokenizer.train: unknown option 'vocab'" },
      { { vocab_size = 300 }, "tokenizer.train: files= is required" },
      { { files = file, vocab_size = 300, min_frequency = -1 }, "min_frequency must be a non-negative integer, got -1" },
      { { files = file, vocab_size = 300, special_tokens = { "" } }, "special_tokens[1] is empty" },
      { { files = {}, vocab_size = 300 }, "files must be" },
    }
    for _, c in ipairs(cases) do
      assert.matches(c[2], err_of(T.train, c[1]), 1, true)
    end
  end)
end)
