-- The special roles (bos, eos, pad, unk) a tokenizer.json does not hold:
-- read from a Hugging Face directory's tokenizer_config.json and
-- special_tokens_map.json as transformers reads them, set by train for
-- <|endoftext|>, written back by save_pretrained so that a reload (here and in
-- transformers: scripts/check_hf_export.py) gives the same ids.
local pg = require "pipegoose"
local h = require "helpers"
local cjson = require("cjson").new()

local FORTUNE = "/usr/share/games/fortunes/science"

local function write(path, text)
  local f = assert(io.open(path, "wb"))
  f:write(text)
  f:close()
end

local function trained(specials)
  return pg.tokenizer.train { files = FORTUNE, vocab_size = 300, special_tokens = specials, progress = false }
end

describe("tokenizer roles", function()
  it("train makes <|endoftext|> the bos and eos, and nothing else a role", function()
    local tok = trained { "<|pad|>", "<|endoftext|>" }
    assert.are.equal(tok:token_to_id("<|endoftext|>"), tok:eos_id())
    assert.are.equal(tok:eos_id(), tok:bos_id())
    assert.is_nil(tok:pad_id())
    assert.is_nil(tok:unk_id())
    local none = trained { "<s>" }
    assert.are.same({}, none:special_ids())
  end)

  it("save_pretrained writes the roles and the added tokens; load reads them back", function()
    local tok = trained { "<|endoftext|>", "<|pad|>" }
    tok:set_special_tokens { pad = "<|pad|>" }
    local dir = h.tmpdir(); pg.fs.mkdir_p(dir)
    tok:save_pretrained(dir, { model_max_length = 64 })
    local cfg = cjson.decode(h.read(dir .. "/tokenizer_config.json"))
    assert.are.equal("<|endoftext|>", cfg.eos_token)
    assert.are.equal("<|pad|>", cfg.pad_token)
    assert.are.equal(cjson.null, cfg.unk_token)
    assert.are.equal(64, cfg.model_max_length)
    assert.are.equal("PreTrainedTokenizerFast", cfg.tokenizer_class)
    assert.is_false(cfg.clean_up_tokenization_spaces)
    assert.are.equal("<|pad|>", cfg.added_tokens_decoder[tostring(tok:pad_id())].content)
    local map = cjson.decode(h.read(dir .. "/special_tokens_map.json"))
    assert.are.same({ bos_token = "<|endoftext|>", eos_token = "<|endoftext|>", pad_token = "<|pad|>" }, map)
    local back = pg.tokenizer.load(dir)
    assert.are.same(tok:special_ids(), back:special_ids())
    assert.are.same(tok:encode("The moon is a planet."), back:encode("The moon is a planet."))
    h.rm(dir)
  end)

  it("reads AddedToken objects, keeps a loaded config's other fields, and fills roles from special_tokens_map.json",
    function()
      local tok = trained { "<|endoftext|>", "<unk>" }
      local dir = h.tmpdir(); pg.fs.mkdir_p(dir)
      tok:save(dir .. "/tokenizer.json")
      write(dir .. "/tokenizer_config.json", cjson.encode {
        eos_token = { content = "<|endoftext|>", special = true, __type = "AddedToken" },
        chat_template = "{{ messages }}", add_bos_token = true, additional_special_tokens = {} })
      write(dir .. "/special_tokens_map.json", cjson.encode { eos_token = "<unk>", unk_token = "<unk>" })
      local back = pg.tokenizer.load(dir)
      assert.are.equal(tok:token_to_id("<|endoftext|>"), back:eos_id()) -- tokenizer_config.json's wins
      assert.are.equal(tok:token_to_id("<unk>"), back:unk_id())         -- the map fills what it lacks
      assert.is_nil(back:bos_id())
      local out = h.tmpdir(); pg.fs.mkdir_p(out)
      back:save_pretrained(out)
      local cfg = cjson.decode(h.read(out .. "/tokenizer_config.json"))
      assert.are.equal("{{ messages }}", cfg.chat_template)
      assert.is_true(cfg.add_bos_token)
      assert.are.equal("<unk>", cfg.unk_token)
      assert.truthy(h.read(out .. "/tokenizer_config.json"):find('"additional_special_tokens": []', 1, true))
      h.rm(dir)
      h.rm(out)
    end)

  it("refuses roles that are not tokens, naming the file and the field", function()
    local tok = trained { "<|endoftext|>" }
    local dir = h.tmpdir(); pg.fs.mkdir_p(dir)
    tok:save(dir .. "/tokenizer.json")
    write(dir .. "/tokenizer_config.json", cjson.encode { bos_token = "<s>" })
    local err = h.err_of(pg.tokenizer.load, dir)
    assert.truthy(err:find("tokenizer_config.json", 1, true), err)
    assert.truthy(err:find("bos_token '<s>' is not a token", 1, true), err)
    write(dir .. "/tokenizer_config.json", "[1, 2")
    err = h.err_of(pg.tokenizer.load, dir)
    assert.truthy(err:find("is not a JSON object", 1, true), err)
    write(dir .. "/tokenizer_config.json", cjson.encode { eos_token = 7 })
    err = h.err_of(pg.tokenizer.load, dir)
    assert.truthy(err:find("eos_token must be a string", 1, true), err)
    h.rm(dir)
    err = h.err_of(tok.set_special_tokens, tok, { eos = 1 << 20 })
    assert.truthy(err:find("eos_token must be a token of the tokenizer, an id in [0, ", 1, true), err)
    err = h.err_of(tok.set_special_tokens, tok, { begin = "<|endoftext|>" })
    assert.truthy(err:find("unknown role 'begin'", 1, true), err)
    assert.are.equal(tok, tok:set_special_tokens { eos = false })
    assert.is_nil(tok:eos_id())
  end)
end)
