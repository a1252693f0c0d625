-- pg.tokenizer against Hugging Face `tokenizers`: the fixtures under
-- spec/fixtures/tokenizers/<layout>/ hold a tokenizer.json trained on the
-- Debian fortunes and expected.json with `tokenizers`' ids and decodes for
-- each text (scripts/make_tokenizer_fixtures.py made them; this compares the
-- committed values only). Invalid UTF-8, which Python strings cannot hold,
-- has pipegoose's defined result pinned here (pg_tokenizer.h).
local pg = require "pipegoose"
local h = require "helpers"
local cjson = require("cjson").new()

local DIR = "spec/fixtures/tokenizers/"
local LAYOUTS = { "gpt2", "gpt2_prefix", "llama3", "sp_llama2", "sp_meta" }

local read = h.read

local ints = h.ints

local function concat(...)
  local o = {}
  for _, t in ipairs({ ... }) do
    for _, v in ipairs(t) do o[#o + 1] = v end
  end
  return o
end

local function tmpdir()
  local d = os.tmpname()
  os.remove(d)
  pg.fs.mkdir_p(d)
  return d
end

local err_of = h.err_of

describe("pg.tokenizer matches tokenizers", function()
  for _, name in ipairs(LAYOUTS) do
    describe(name, function()
      local tok = pg.tokenizer.load(DIR .. name)
      local exp = cjson.decode(read(DIR .. name .. "/expected.json"))

      it("gives every id tokenizers gives, with and without special tokens", function()
        assert.is_true(#exp.texts >= 30)
        for _, e in ipairs(exp.texts) do
          assert.same(ints(e.ids), tok:encode(e.text, { add_special = false }), e.text)
          assert.same(ints(e.ids_special), tok:encode(e.text), e.text)
        end
      end)

      it("decodes as tokenizers decodes, and losslessly where tokenizers is lossless", function()
        for _, e in ipairs(exp.texts) do
          assert.equal(e.decode, tok:decode(ints(e.ids)), e.text)
          assert.equal(e.decode_special, tok:decode(ints(e.ids_special)), e.text)
          assert.equal(e.decode_skip, tok:decode(ints(e.ids_special), { skip_special = true }), e.text)
          if e.decode == e.text then assert.equal(e.text, tok:decode(tok:encode(e.text, { add_special = false }))) end
        end
      end)

      it("has tokenizers' vocabulary size", function()
        assert.equal(math.tointeger(exp.vocab_size), tok:vocab_size())
      end)

      it("saves a tokenizer.json that loads back with the same ids", function()
        local d = tmpdir()
        assert.equal(d .. "/tokenizer.json", tok:save(d))
        local back = pg.tokenizer.load(d .. "/tokenizer.json")
        for _, e in ipairs(exp.texts) do
          assert.same(ints(e.ids_special), back:encode(e.text), e.text)
          assert.equal(e.decode_special, back:decode(ints(e.ids_special)), e.text)
        end
        assert.equal(tok:to_json(), back:to_json())
        pg.fs.remove_tree(d)
      end)
    end)
  end
end)

describe("pg.tokenizer's API", function()
  local gpt2 = pg.tokenizer.load(DIR .. "gpt2/tokenizer.json")
  local llama3 = pg.tokenizer.load(DIR .. "llama3")
  local sp = pg.tokenizer.load(DIR .. "sp_llama2")

  it("encodes into an int32 tensor, and decodes one", function()
    local t = llama3:encode("Hello world", { tensor = true })
    assert.equal("int32", t:dtype())
    local ids = llama3:encode("Hello world")
    assert.equal(#ids, t:numel())
    for i, id in ipairs(ids) do assert.equal(id, t:get(i)) end
    assert.equal("<|begin_of_text|>Hello world", llama3:decode(t))
    assert.equal(0, llama3:encode("", { add_special = false, tensor = true }):numel())
  end)

  it("maps tokens and ids both ways, and lists the special tokens", function()
    assert.equal(0, llama3:token_to_id("<|begin_of_text|>"))
    assert.equal("<|eot_id|>", llama3:id_to_token(2))
    assert.is_nil(llama3:token_to_id("no such token"))
    assert.is_nil(llama3:id_to_token(-1))
    assert.is_nil(llama3:id_to_token(1 << 40))
    assert.same({ ["<|begin_of_text|>"] = 0, ["<|end_of_text|>"] = 1, ["<|eot_id|>"] = 2 }, llama3:special_tokens())
    assert.same({ ["<unk>"] = 0, ["<s>"] = 1, ["</s>"] = 2 }, sp:special_tokens())
    assert.equal("Ġthe", gpt2:id_to_token(gpt2:token_to_id("Ġthe")))
  end)

  it("gives the pre-tokens the model sees", function()
    assert.same({ "Hello", "Ġworld", "!" }, gpt2:pre_tokenize("Hello world!"))
    assert.same({ "Hello", "Ġworld" }, llama3:pre_tokenize("Hello<|eot_id|> world"))
  end)

  it("refuses unknown options and bad arguments", function()
    assert.equal("encode: unknown option 'add_specials' (did you mean 'add_special'?)",
      err_of(gpt2.encode, gpt2, "x", { add_specials = true }))
    assert.equal("decode: unknown option 'skip' (known: skip_special)", err_of(gpt2.decode, gpt2, { 1 }, { skip = true }))
    assert.equal("decode: expects a table of options, got true", err_of(gpt2.decode, gpt2, { 1 }, true))
    -- checked by pipegoose.options, at the caller's line; an integral float is an integer
    local line
    local ok, e = pcall(function()
      line = debug.getinfo(1, "l").currentline + 1
      local ids = gpt2:encode_batch({ "x" }, { threads = 0 })
      return ids
    end)
    assert.is_false(ok)
    assert.equal(("spec/unit/tokenizer_spec.lua:%d: encode_batch: threads must be an integer in [1, 1024], got 0"):format(line), e)
    assert.same(gpt2:encode_batch({ "ab", "c" }), gpt2:encode_batch({ "ab", "c" }, { threads = 2.0 }))
    assert.matches("encode: text must be a string", err_of(gpt2.encode, gpt2, 12), 1, true)
    assert.matches("decode: entry 2 is not an integer token id", err_of(gpt2.decode, gpt2, { 1, "x" }), 1, true)
    assert.matches("int32", err_of(gpt2.decode, gpt2, pg.tensor({ 1, 2 })), 1, true)
  end)
end)

describe("pg.tokenizer on invalid UTF-8 (pipegoose's defined result)", function()
  local gpt2 = pg.tokenizer.load(DIR .. "gpt2")
  local llama3 = pg.tokenizer.load(DIR .. "llama3")
  local sp = pg.tokenizer.load(DIR .. "sp_llama2")
  local prefix = pg.tokenizer.load(DIR .. "gpt2_prefix")

  it("makes a run of invalid bytes a pre-token of its own, tokenized from the byte alphabet", function()
    for _, tok in ipairs({ gpt2, llama3 }) do
      local ff = tok:token_to_id("ÿ") -- byte 0xFF's byte-level character
      assert.same(concat(tok:encode("abc", { add_special = false }), { ff }, tok:encode("def", { add_special = false })),
        tok:encode("abc\xffdef", { add_special = false }))
      assert.same({ "ÿ" }, { tok:pre_tokenize("\xff")[1] })
    end
  end)

  it("decodes them to U+FFFD, one per maximal ill-formed subsequence, as tokenizers' decoders do", function()
    assert.equal("abc\u{FFFD}def", gpt2:decode(gpt2:encode("abc\xffdef")))
    assert.equal("x\u{FFFD}", gpt2:decode(gpt2:encode("x\xe4\xb8")))         -- a truncated 中: one U+FFFD
    assert.equal("\u{FFFD}\u{FFFD}", gpt2:decode(gpt2:encode("\xc0\xaf")))  -- an overlong '/': two
    assert.equal("\u{FFFD}\u{FFFD}\u{FFFD}a", gpt2:decode(gpt2:encode("\xed\xa0\x80a"))) -- a UTF-16 surrogate: three
    assert.equal("\u{FFFD}a", llama3:decode(llama3:encode("\xeda", { add_special = false })))
  end)

  it("gives each invalid byte its <0xXX> token under byte_fallback", function()
    local ids = sp:encode("abc\xffdef", { add_special = false })
    local found = false
    for _, id in ipairs(ids) do found = found or id == sp:token_to_id("<0xFF>") end
    assert.is_true(found)
    assert.equal("abc\u{FFFD}def", sp:decode(ids))
  end)

  it("leaves invalid bytes as they are through NFC", function()
    local ids = prefix:encode("e\u{301}\xff", { add_special = false })
    assert.same(concat(prefix:encode("é", { add_special = false }), { prefix:token_to_id("ÿ") }), ids)
  end)
end)

describe("pg.tokenizer on long input", function()
  local gpt2 = pg.tokenizer.load(DIR .. "gpt2")
  local llama3 = pg.tokenizer.load(DIR .. "llama3")
  local sp = pg.tokenizer.load(DIR .. "sp_llama2")

  it("encodes a few MB on one line in bounded time (n log n merges, no quadratic blow-up)", function()
    local t0 = os.clock()
    for _, text in ipairs({ ("a"):rep(2 << 20), (" "):rep(1 << 20) .. "x", ("ab1 "):rep(1 << 19) }) do
      for _, tok in ipairs({ gpt2, llama3, sp }) do
        local ids = tok:encode(text, { add_special = false, tensor = true })
        assert.is_true(ids:numel() > 0 and ids:numel() <= #text + 1) -- + 1: sp_llama2 prepends "▁"
      end
    end
    local line = ("The quick brown fox, 123 jumps! "):rep(1 << 16)
    assert.equal(line, gpt2:decode(gpt2:encode(line)))
    assert.is_true(os.clock() - t0 < 120, "a guard against a quadratic path, not a benchmark")
  end)
end)

describe("pg.tokenizer refuses bad files by name", function()
  local T = pg.tokenizer
  local function tiny(over)
    local j = { model = { type = "BPE", vocab = { a = 0, b = 1, ab = 2 }, merges = { "a b" } } }
    for k, v in pairs(over or {}) do j[k] = v end
    return j
  end

  it("loads a tiny handmade file", function()
    local tok = T.from_table(tiny())
    assert.same({ 2, 0 }, tok:encode("aba"))
    assert.equal("ab a", tok:decode({ 2, 0 })) -- no decoder: tokens joined with spaces, as tokenizers does
  end)

  it("malformed and truncated JSON, a missing file", function()
    assert.matches("x.json: not valid JSON", err_of(T.from_json, "{\"model\": ", "x.json"), 1, true)
    local text = read(DIR .. "gpt2/tokenizer.json")
    assert.matches("not valid JSON", err_of(T.from_json, text:sub(1, #text // 2)), 1, true)
    assert.matches("/nonexistent: missing or unreadable", err_of(T.load, "/nonexistent"), 1, true)
    assert.matches("spec/fixtures: has no tokenizer.json (the only format read", err_of(T.load, "spec/fixtures"), 1, true)
    assert.matches("tokenizer.json: model must be an object, not nil", err_of(T.from_json, "[1, 2]"), 1, true)
    assert.matches("the file must be an object", err_of(T.from_json, "7"), 1, true)
  end)

  it("a merge naming an unknown token, or making one", function()
    local j = tiny()
    j.model.merges = { "a c" }
    assert.matches("merge 0 ('a' 'c') names 'c', which is not in the vocabulary", err_of(T.from_table, j), 1, true)
    j.model.merges = { { "b", "a" } }
    assert.matches("the merged token 'ba' is not in the vocabulary", err_of(T.from_table, j), 1, true)
    j.model.merges = { "a b c" }
    assert.matches("model.merges[1] 'a b c' is not two tokens separated by one space", err_of(T.from_table, j), 1, true)
    j.model.merges = { 7 }
    assert.matches("model.merges[1] is neither", err_of(T.from_table, j), 1, true)
  end)

  it("ids outside the vocabulary, in the file and in decode", function()
    local j = tiny()
    j.model.vocab = { a = 0, b = -1 }
    assert.matches("model.vocab['b'] must be an integer in [0, 16777215]", err_of(T.from_table, j), 1, true)
    j.model.vocab = { a = 0, b = 0 }
    j.model.merges = {}
    assert.matches("vocab: id 0 is given to both", err_of(T.from_table, j), 1, true)
    local tok = T.load(DIR .. "gpt2")
    assert.matches("decode: id 5000 (position 2) is not in the vocabulary (1200 ids)", err_of(tok.decode, tok, { 1, 5000 }), 1, true)
    assert.matches("decode: id -1 (position 1)", err_of(tok.decode, tok, { -1 }), 1, true)
    local holes = T.from_table({ model = { type = "BPE", vocab = { a = 0, b = 5 }, merges = {} } })
    assert.equal(6, holes:vocab_size())
    assert.matches("decode: id 3 (position 1) is not in the vocabulary", err_of(holes.decode, holes, { 3 }), 1, true)
  end)

  it("a regex PCRE2 rejects", function()
    local j = tiny({ pre_tokenizer = { type = "Split", pattern = { Regex = "(ab" }, behavior = "Isolated", invert = false } })
    assert.matches("regex '(ab' does not compile: PCRE2: missing closing parenthesis", err_of(T.from_table, j), 1, true)
  end)

  it("every component it does not implement, by name", function()
    local cases = {
      { { pre_tokenizer = { type = "UnicodeScripts" } }, "tokenizer.json: pre_tokenizer type 'UnicodeScripts' is not supported" },
      { { pre_tokenizer = { type = "Sequence", pretokenizers = { { type = "Whitespace" } } } },
        "pre_tokenizer.pretokenizers[1] type 'Whitespace' is not supported" },
      { { normalizer = { type = "Lowercase" } }, "normalizer type 'Lowercase' is not supported" },
      { { decoder = { type = "WordPiece" } }, "decoder type 'WordPiece' is not supported" },
      { { post_processor = { type = "RobertaProcessing" } }, "post_processor type 'RobertaProcessing' is not supported" },
      { { truncation = { max_length = 10 } }, "truncation is not supported (set it to null)" },
      { { padding = { pad_id = 0 } }, "padding is not supported (set it to null)" },
      { { model = { type = "WordPiece", vocab = {} } }, "model type 'WordPiece' is not supported (only BPE)" },
      { { model = { type = "Unigram", vocab = {} } }, "model type 'Unigram' is not supported (only BPE)" },
      { { model = { type = "BPE", vocab = {}, merges = {}, dropout = 0.1 } }, "model.dropout is not supported" },
      { { model = { type = "BPE", vocab = {}, merges = {}, end_of_word_suffix = "</w>" } }, "model.end_of_word_suffix is not supported" },
      { { model = { type = "BPE", vocab = {}, merges = {}, unk_token = "<unk>" } }, "unk_token '<unk>' is not in the vocabulary" },
      { { pre_tokenizer = { type = "Split", pattern = { Regex = "a" }, behavior = "Sideways" } }, "behavior 'Sideways' is not supported" },
      { { pre_tokenizer = { type = "Metaspace", replacement = "ab" } }, "replacement must be one character" },
      { { added_tokens = { { id = 9, content = "" } } }, "added_tokens[1].content is empty" },
      { { post_processor = { type = "TemplateProcessing", single = { { SpecialToken = { id = "<s>" } } }, special_tokens = {} } },
        "names the special token '<s>', which special_tokens does not define" },
    }
    for _, c in ipairs(cases) do
      assert.matches(c[2], err_of(T.from_table, tiny(c[1])), 1, true)
    end
  end)
end)
