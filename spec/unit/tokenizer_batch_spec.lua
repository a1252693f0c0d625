-- The multi-threaded encoders (tok:encode_batch, encode_chunked, encode_file)
-- give exactly the serial encode's ids, at 1 and 2 threads, on the committed
-- tokenizer fixtures (spec/fixtures/tokenizers, which tokenizer_spec.lua
-- checks against `tokenizers`); encode_chunked's cuts are pinned by a
-- reimplementation of the rule of pg_tokenizer.h here, and bad options are
-- refused by name.
local pg = require "pipegoose"
local h = require "helpers"
local cjson = require("cjson").new()

local DIR = "spec/fixtures/tokenizers/"
local LAYOUTS = { "gpt2", "gpt2_prefix", "llama3", "sp_llama2", "sp_meta" }
-- layouts whose pre-tokens never span a cut and that add nothing at a piece's
-- start: encode_chunked equals the whole text's encode there
local WHOLE = { gpt2 = true, llama3 = true }

local read = h.read

local function texts_of(name)
  local out = {}
  for i, e in ipairs(cjson.decode(read(DIR .. name .. "/expected.json")).texts) do out[i] = e.text end
  -- bytes that are not UTF-8 have a defined result (pg_tokenizer.h): in a batch too
  out[#out + 1] = "bad \xff\xfe bytes \xc3 and \xe2\x82"
  return out
end

local function cat(lists)
  local o = {}
  for _, t in ipairs(lists) do
    for _, v in ipairs(t) do o[#o + 1] = v end
  end
  return o
end

local function is_alnum(b) return b and ((b >= 48 and b <= 57) or (b >= 65 and b <= 90) or (b >= 97 and b <= 122)) end

-- pg_tokenizer_encode_chunked's cuts: after the first "\n" at or past every
-- `size` bytes from the last cut that has a visible ASCII byte before it and
-- an ASCII letter or digit after it
local function chunks(text, size)
  local out, s, n = {}, 1, #text
  while s <= n do
    local e = n
    if n - s + 1 > size then
      local i = s + size - 1
      while true do
        local j = text:find("\n", i, true)
        if not j or j >= n then break end
        local w = j > s and text:byte(j - 1) or 0
        if w > 32 and w < 127 and is_alnum(text:byte(j + 1)) then
          e = j
          break
        end
        i = j + 1
      end
    end
    out[#out + 1] = text:sub(s, e)
    s = e + 1
  end
  return out
end

-- a corpus of the fixture texts, one a line, with the line starts the cuts look for
local function corpus(texts, reps)
  local lines = {}
  for r = 1, reps do
    for i, t in ipairs(texts) do lines[#lines + 1] = ("%d. %s"):format(r * 1000 + i, t) end
  end
  return table.concat(lines, "\n") .. "\n"
end

local err_of = h.err_of

describe("pg.tokenizer's multi-threaded encoders", function()
  for _, name in ipairs(LAYOUTS) do
    describe(name, function()
      local tok = pg.tokenizer.load(DIR .. name)
      local texts = texts_of(name)

      it("encode_batch gives every text's serial ids at 1 and 2 threads", function()
        for _, add in ipairs({ false, true }) do
          local want = {}
          for i, t in ipairs(texts) do want[i] = tok:encode(t, { add_special = add }) end
          for _, th in ipairs({ 1, 2 }) do
            assert.same(want, tok:encode_batch(texts, { threads = th, add_special = add }))
          end
        end
        local want = {}
        for i, t in ipairs(texts) do want[i] = tok:encode(t) end
        assert.same(want, tok:encode_batch(texts)) -- add_special defaults to true, threads to pg.num_threads()
        local tens = tok:encode_batch(texts, { threads = 2, tensor = true })
        assert.equal(#texts, #tens)
        for i, t in ipairs(tens) do
          assert.equal("int32", t:dtype())
          assert.same(want[i], t:numel() > 0 and h.flat(t) or {})
        end
        assert.same({}, tok:encode_batch({}, { threads = 2 }))
      end)

      it("encode_batch of many texts in shuffled lengths equals the serial encode", function()
        local many = {}
        for r = 1, 12 do
          for i = 1, #texts do many[#many + 1] = texts[(i * 7 + r) % #texts + 1]:rep(r % 4 + 1) end
        end
        local want = {}
        for i, t in ipairs(many) do want[i] = tok:encode(t, { add_special = false }) end
        assert.same(want, tok:encode_batch(many, { threads = 2, add_special = false }))
      end)

      it("encode_chunked and encode_file give each chunk's serial ids in order, at 1 and 2 threads", function()
        local text = corpus(texts, 3)
        for _, size in ipairs({ 1, 64, 1000, 1 << 20 }) do
          local parts = chunks(text, size)
          if size == 64 then assert.is_true(#parts > 20) end
          if size == 1 << 20 then assert.equal(1, #parts) end
          local want = {}
          for i, p in ipairs(parts) do want[i] = tok:encode(p, { add_special = false }) end
          want = cat(want)
          for _, th in ipairs({ 1, 2 }) do
            assert.same(want, h.flat(tok:encode_chunked(text, { threads = th, chunk_bytes = size })), size)
          end
          if WHOLE[name] then assert.same(tok:encode(text, { add_special = false }), want) end
        end
        local path = h.tmpfile(text, ".txt")
        local want = h.flat(tok:encode_chunked(text, { chunk_bytes = 64 }))
        for _, th in ipairs({ 1, 2 }) do
          local x = tok:encode_file(path, { threads = th, chunk_bytes = 64 })
          assert.equal("int32", x:dtype())
          assert.same(want, h.flat(x))
        end
        -- the default chunk size (256 KiB): several chunks of a larger file
        local big = corpus(texts, 500)
        assert.is_true(#big > 600 * 1024)
        local f = assert(io.open(path, "wb"))
        f:write(big)
        f:close()
        local parts = chunks(big, 256 * 1024)
        assert.is_true(#parts >= 3)
        local n = 0
        for _, p in ipairs(parts) do n = n + #tok:encode(p, { add_special = false }) end
        local x = tok:encode_file(path, { threads = 2 })
        assert.equal(n, x:numel())
        assert.is_true(tok:encode_file(path, { threads = 1 }):equal(x))
        if WHOLE[name] then assert.is_true(tok:encode(big, { add_special = false, tensor = true }):equal(x)) end
        os.remove(path)
      end)
    end)
  end

  describe("special tokens and edge cases", function()
    local llama3 = pg.tokenizer.load(DIR .. "llama3")
    local bos = llama3:token_to_id("<|begin_of_text|>")

    it("add_special puts the template once around a chunked text, as encode does around one text", function()
      local text = corpus(texts_of("llama3"), 2)
      local x = h.flat(llama3:encode_chunked(text, { add_special = true, chunk_bytes = 50, threads = 2 }))
      assert.equal(bos, x[1])
      assert.same(llama3:encode(text), x)
      assert.equal(1, h.count(" " .. table.concat(x, " ") .. " ", " " .. bos .. " "))
    end)

    it("an empty text or file has no ids, or the template's alone", function()
      assert.equal(0, llama3:encode_chunked("", { threads = 2 }):numel())
      assert.same({ bos }, h.flat(llama3:encode_chunked("", { add_special = true })))
      local path = h.tmpfile("", ".txt")
      assert.equal(0, llama3:encode_file(path):numel())
      assert.same({ bos }, h.flat(llama3:encode_file(path, { add_special = true })))
      os.remove(path)
      assert.same({ {}, {} }, llama3:encode_batch({ "", "" }, { add_special = false, threads = 2 }))
      assert.same({ { bos } }, llama3:encode_batch({ "" }))
    end)

    it("names the regex engine", function()
      assert.truthy(llama3:regex_engine():match("^PCRE2 %S+"))
    end)

    it("refuses bad options and arguments by name", function()
      local dir = h.tmpdir()
      pg.fs.mkdir_p(dir)
      local qdir = dir:gsub("%p", "%%%0")
      for _, c in ipairs({
        { "encode_batch: threads must be an integer in %[1, 1024%], got 0", llama3.encode_batch, { "a" }, { threads = 0 } },
        { "encode_batch: threads must be an integer in %[1, 1024%], got 1.5", llama3.encode_batch, { "a" }, { threads = 1.5 } },
        { "encode_batch: threads must be an integer in %[1, 1024%], got '2'", llama3.encode_batch, { "a" }, { threads = "2" } },
        { "encode_file: threads must be an integer in %[1, 1024%], got 2000", llama3.encode_file, "x", { threads = 2000 } },
        { "encode_batch: unknown option 'thread' %(did you mean 'threads'%?%)", llama3.encode_batch, { "a" }, { thread = 2 } },
        { "encode_batch: expects a table of options, got 2", llama3.encode_batch, { "a" }, 2 },
        { "encode_batch: texts must be a list of strings", llama3.encode_batch, "a" },
        { "encode_batch: texts%[2%] is a number, not a string", llama3.encode_batch, { "a", 3 } },
        { "encode_file: unknown option 'tensor' %(known: add_special, chunk_bytes, threads%)", llama3.encode_file, "x", { tensor = true } },
        { "encode_file: chunk_bytes must be a positive integer, got 0", llama3.encode_file, "x", { chunk_bytes = 0 } },
        { "encode_chunked: chunk_bytes must be a positive integer, got %-5", llama3.encode_chunked, "x", { chunk_bytes = -5 } },
        { "encode_chunked: text must be a string", llama3.encode_chunked, 42 },
        { "encode_file: path must be a string", llama3.encode_file, nil },
        { "encode_file: " .. qdir .. "/missing%.txt: No such file or directory", llama3.encode_file, dir .. "/missing.txt" },
        { "encode_file: " .. qdir .. " is not a regular file", llama3.encode_file, dir },
      }) do
        local e = err_of(c[2], llama3, c[3], c[4])
        assert.truthy(e:find(c[1]), ("%s\nnot in: %s"):format(c[1], e))
      end
      h.rm(dir)
    end)
  end)
end)
