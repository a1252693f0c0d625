-- The two numbers make run reports about a trained model, for the examples
-- that train on a prepared corpus (examples/train_gpt.lua --corpus=DIR):
--   local measures = dofile(here .. "measures.lua")
--   measures.bits_per_byte(val_loss, corpus.val)         -- corpus: pg.data.corpus(DIR)
--   measures.words(text)                                 -- the words of a text, as below
--   measures.dictionary_share(text [, dict])             -- share, found, total
--   measures.without_special(text, tokenizer)            -- its special tokens as newlines
-- Run by itself (pglua examples/measures.lua) it says what it is and how it is used.
require "pipegoose.library_file"("local measures = dofile(here .. \"measures.lua\")",
  "measures.lua is not a script: the examples load it for bits per byte and the share of a sample's "
  .. "words found in a dictionary.")

local M = {}

--- Bits per byte of a split: the mean validation loss (nats per token) times
-- the split's tokens, over its UTF-8 bytes times ln 2 (`split` is a
-- pg.data.corpus split, {tokens =, bytes =} from dataset.json). Unlike the
-- loss per token it does not depend on the tokenizer, so runs with different
-- vocabularies (or byte-level ones) compare. The loss is measured over the
-- split's whole windows, which hold nearly the same tokens per byte as the
-- whole split.
function M.bits_per_byte(loss_nats, split)
  local tokens = type(split) == "table" and math.tointeger(split.tokens)
  local bytes = type(split) == "table" and math.tointeger(split.bytes)
  if not tokens or not bytes or bytes <= 0 then
    error("bits_per_byte: the split needs whole numbers tokens and bytes > 0 (dataset.json's counts)", 2)
  end
  return loss_nats * tokens / (bytes * math.log(2))
end

M.DICTIONARY = "/usr/share/dict/words" -- Debian's wamerican (scripts/install-deps.sh installs it)

--- The words of a text: its maximal runs of ASCII letters joined by single
-- apostrophes ("don't", "God's"; a leading or trailing apostrophe is a quote,
-- not part of the word). Digits, other punctuation and non-ASCII bytes
-- separate words. Returns them as they are written, in order.
function M.words(text)
  local out, last_end = {}, nil -- last_end: the position just after the previous run of letters
  for run_start, run, run_end in text:gmatch("()(%a+)()") do
    -- %a: ASCII letters (pglua runs in the C locale)
    if last_end and run_start == last_end + 1 and text:sub(last_end, last_end) == "'" then
      out[#out] = out[#out] .. "'" .. run
    else
      out[#out + 1] = run
    end
    last_end = run_end
  end
  return out
end

--- text with every special token of tok (its tok:special_tokens(), such as
-- <|endoftext|> between documents) replaced by a newline: a document boundary
-- in a sample is not a word.
function M.without_special(text, tok)
  for content in pairs(tok:special_tokens()) do
    local parts, pos = {}, 1
    while true do
      local i, j = text:find(content, pos, true)
      if not i then break end
      parts[#parts + 1] = text:sub(pos, i - 1)
      pos = j + 1
    end
    parts[#parts + 1] = text:sub(pos)
    text = table.concat(parts, "\n")
  end
  return text
end

local cache = {}
--- The dictionary as a set of lower-case words (one word a line), read once
-- per path. Returns nil and a message when the file is missing.
function M.load_dictionary(path)
  path = path or M.DICTIONARY
  if cache[path] then return cache[path] end
  local f, err = io.open(path, "rb")
  if not f then return nil, ("no dictionary at %s (%s; Debian's wamerican installs it)"):format(path, err) end
  local set = {}
  for line in f:lines() do set[line:lower()] = true end
  f:close()
  cache[path] = set
  return set
end

--- The share of text's words (M.words) found in dict (a set of lower-case
-- words, M.load_dictionary's; default the system's), compared case-
-- insensitively: "The" counts as "the", "GOD'S" as "god's". Returns share,
-- found, total (share nil when the text has no words).
function M.dictionary_share(text, dict)
  if dict == nil then dict = assert(M.load_dictionary()) end
  local found, words = 0, M.words(text)
  for _, w in ipairs(words) do
    if dict[w:lower()] then found = found + 1 end
  end
  return #words > 0 and found / #words or nil, found, #words
end

return M
