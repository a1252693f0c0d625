--- Tokenizers: Hugging Face `tokenizer.json` files (BPE), encoded and decoded
-- in C (src/tokenizer/pg_tokenizer.c) with the ids `tokenizers` gives.
--
--   local tok = pg.tokenizer.load("tokenizer.json" or an HF model directory)
--   tok:encode(text [, {add_special = true, tensor = false}]) -> table of ids (or an int32 tensor)
--   tok:decode(ids [, {skip_special = false}]) -> string   (ids: table or int32 tensor)
--   tok:vocab_size()         1 + the largest id (what an embedding needs)
--   tok:token_to_id(s), tok:id_to_token(id)   (nil when there is none)
--   tok:special_tokens()     {[content] = id} of the special added tokens
--   tok:save(path)           a tokenizer.json tokenizers and transformers load (written atomically)
--   tok:save_pretrained(dir [, {model_max_length =}])   tokenizer.json, tokenizer_config.json and
--                            special_tokens_map.json: what transformers' AutoTokenizer reads
--   tok:bos_id(), tok:eos_id(), tok:pad_id(), tok:unk_id()   a role's token id, or nil
--   tok:special_ids()        {bos =, eos =, pad =, unk =}
--   tok:set_special_tokens{bos =, eos =, pad =, unk =}   each a token, an id or false (none)
--   tok:pre_tokenize(text)   the pre-tokens the model sees (normalized, split, mapped)
--   tok:encode_batch(texts [, {threads =, add_special =, tensor =}]) -> a list of ids per text, on threads
--                            (flat = true: one int32 tensor of all the ids, and a list of each text's count)
--   tok:encode_file(path [, {threads =, chunk_bytes =, add_special = false}]) -> int32 tensor of all ids
--   tok:encode_chunked(text [, the same options])   encode_file's cutting and threads on a string
--
-- This file reads the JSON (lua-cjson), checks every component and names the
-- one it does not implement ("tokenizer.json: pre_tokenizer type
-- 'UnicodeScripts' is not supported") rather than ignoring it, and hands the
-- C side a plain spec (src/lua/lua_tokenizer.c documents it). Training builds the
-- same decoded-JSON table (model = {type = "BPE", vocab =, merges =}, ...)
-- and calls M.from_table, so a trained tokenizer saves and loads like any.
local cjson = require("cjson").new()
local opt = require "pipegoose.options"

local M = {}
local NULL = cjson.null

local function core() return require "pipegoose.core" end

local function fail(src, fmt, ...) error(("%s: " .. fmt):format(src, ...), 0) end
local function absent(v) return v == nil or v == NULL end

-- Ordered JSON values for save: O(k1, v1, k2, v2, ...) is an object whose
-- keys keep this order (NULL for null); a plain table is an array.
local OBJ = {}
local function O(...) return setmetatable({ ... }, OBJ) end

local function write_json(v, out, ind)
  if v == NULL then
    out[#out + 1] = "null"
  elseif type(v) == "boolean" then
    out[#out + 1] = v and "true" or "false"
  elseif math.type(v) == "integer" then
    out[#out + 1] = ("%d"):format(v)
  elseif type(v) == "number" then
    out[#out + 1] = ("%.17g"):format(v)
  elseif type(v) == "string" then
    out[#out + 1] = cjson.encode(v)
  elseif getmetatable(v) == OBJ then
    if #v == 0 then out[#out + 1] = "{}" return end
    out[#out + 1] = "{"
    for i = 1, #v, 2 do
      out[#out + 1] = (i > 1 and ",\n" or "\n") .. ind .. "  " .. cjson.encode(v[i]) .. ": "
      write_json(v[i + 1], out, ind .. "  ")
    end
    out[#out + 1] = "\n" .. ind .. "}"
  else
    if #v == 0 then out[#out + 1] = "[]" return end
    out[#out + 1] = "["
    for i = 1, #v do
      out[#out + 1] = (i > 1 and ",\n" or "\n") .. ind .. "  "
      write_json(v[i], out, ind .. "  ")
    end
    out[#out + 1] = "\n" .. ind .. "]"
  end
end

-- ---- field checks ----

local function obj(src, v, what)
  if type(v) ~= "table" then fail(src, "%s must be an object, not %s", what, v == NULL and "null" or type(v)) end
  return v
end

local function str(src, v, what, default)
  if absent(v) and default ~= nil then return default end
  if type(v) ~= "string" then fail(src, "%s must be a string", what) end
  return v
end

local function bool(src, v, what, default)
  if absent(v) then return default end
  if type(v) ~= "boolean" then fail(src, "%s must be true or false", what) end
  return v
end

local function int(src, v, what, lo, hi)
  local i = math.tointeger(v)
  if not i or i < lo or i > hi then fail(src, "%s must be an integer in [%d, %d], not %s", what, lo, hi, tostring(v)) end
  return i
end

local function list(src, v, what)
  if type(v) ~= "table" or getmetatable(v) == OBJ then fail(src, "%s must be a list", what) end
  return v
end

-- A Replace/Split pattern: {String = s} or {Regex = r} -> pattern, is_regex, canonical
local function pattern(src, p, what)
  obj(src, p, what)
  if type(p.String) == "string" and p.Regex == nil then
    if p.String == "" then fail(src, "%s is an empty string", what) end
    return p.String, false, O("String", p.String)
  elseif type(p.Regex) == "string" and p.String == nil then
    if p.Regex == "" then fail(src, "%s is an empty regex", what) end
    return p.Regex, true, O("Regex", p.Regex)
  end
  fail(src, "%s must be {\"String\": ...} or {\"Regex\": ...}", what)
end

local SCHEMES = { always = true, first = true, never = true }
local function prepend_scheme(src, c, what)
  if not absent(c.prepend_scheme) then
    local s = str(src, c.prepend_scheme, what .. ".prepend_scheme")
    if not SCHEMES[s] then fail(src, "%s.prepend_scheme '%s' is not always, first or never", what, s) end
    return s
  end
  -- files from before prepend_scheme: add_prefix_space true meant always
  return bool(src, c.add_prefix_space, what .. ".add_prefix_space", true) and "always" or "never"
end

local function one_char(src, s, what)
  if utf8.len(s) ~= 1 then fail(src, "%s must be one character, not '%s'", what, s) end
  return s
end

-- ---- components: each adds its steps to `steps` and returns its canonical JSON ----

-- A Sequence component: each of c[field] read by `read` (the component's own reader), in order.
local function sequence(src, c, field, what, read, arg)
  local out = {}
  for i, x in ipairs(list(src, c[field], what .. "." .. field)) do
    out[i] = read(src, x, arg, ("%s.%s[%d]"):format(what, field, i))
  end
  return O("type", "Sequence", field, out)
end

local function normalizer(src, n, steps, what)
  if absent(n) then return NULL end
  obj(src, n, what)
  local t = n.type
  if t == "Sequence" then
    return sequence(src, n, "normalizers", what, normalizer, steps)
  elseif t == "NFC" or t == "NFKC" then
    steps[#steps + 1] = { kind = t }
    return O("type", t)
  elseif t == "Prepend" then
    local p = str(src, n.prepend, what .. ".prepend")
    steps[#steps + 1] = { kind = "Prepend", content = p }
    return O("type", "Prepend", "prepend", p)
  elseif t == "Replace" then
    local p, re, canon = pattern(src, n.pattern, what .. ".pattern")
    local c = str(src, n.content, what .. ".content")
    steps[#steps + 1] = { kind = "Replace", pattern = p, regex = re, content = c }
    return O("type", "Replace", "pattern", canon, "content", c)
  end
  fail(src, "%s type '%s' is not supported", what, tostring(t))
end

local BEHAVIORS = { Removed = true, Isolated = true, MergedWithPrevious = true, MergedWithNext = true, Contiguous = true }

local function pre_tokenizer(src, p, steps, what)
  if absent(p) then return NULL end
  obj(src, p, what)
  local t = p.type
  if t == "Sequence" then
    return sequence(src, p, "pretokenizers", what, pre_tokenizer, steps)
  elseif t == "ByteLevel" then
    local aps = bool(src, p.add_prefix_space, what .. ".add_prefix_space", true)
    local trim = bool(src, p.trim_offsets, what .. ".trim_offsets", true)
    local re = bool(src, p.use_regex, what .. ".use_regex", true)
    steps[#steps + 1] = { kind = "ByteLevel", add_prefix_space = aps, use_regex = re }
    return O("type", "ByteLevel", "add_prefix_space", aps, "trim_offsets", trim, "use_regex", re)
  elseif t == "Split" then
    local pat, re, canon = pattern(src, p.pattern, what .. ".pattern")
    local b = str(src, p.behavior, what .. ".behavior")
    if not BEHAVIORS[b] then fail(src, "%s.behavior '%s' is not supported", what, b) end
    local inv = bool(src, p.invert, what .. ".invert", false)
    steps[#steps + 1] = { kind = "Split", pattern = pat, regex = re, behavior = b, invert = inv }
    return O("type", "Split", "pattern", canon, "behavior", b, "invert", inv)
  elseif t == "Metaspace" then
    local r = one_char(src, str(src, p.replacement, what .. ".replacement", "▁"), what .. ".replacement")
    local scheme = prepend_scheme(src, p, what)
    local split = bool(src, p.split, what .. ".split", true)
    steps[#steps + 1] = { kind = "Metaspace", content = r, prepend_scheme = scheme, split = split }
    return O("type", "Metaspace", "replacement", r, "prepend_scheme", scheme, "split", split)
  elseif t == "Digits" then
    local ind = bool(src, p.individual_digits, what .. ".individual_digits", false)
    steps[#steps + 1] = { kind = "Digits", individual_digits = ind }
    return O("type", "Digits", "individual_digits", ind)
  end
  fail(src, "%s type '%s' is not supported", what, tostring(t))
end

local function decoder(src, d, steps, what)
  if absent(d) then return NULL end
  obj(src, d, what)
  local t = d.type
  if t == "Sequence" then
    return sequence(src, d, "decoders", what, decoder, steps)
  elseif t == "ByteLevel" then
    steps[#steps + 1] = { kind = "ByteLevel" }
    return O("type", "ByteLevel", "add_prefix_space", bool(src, d.add_prefix_space, what .. ".add_prefix_space", true),
      "trim_offsets", bool(src, d.trim_offsets, what .. ".trim_offsets", true),
      "use_regex", bool(src, d.use_regex, what .. ".use_regex", true))
  elseif t == "ByteFallback" or t == "Fuse" then
    steps[#steps + 1] = { kind = t }
    return O("type", t)
  elseif t == "Strip" then
    local c = one_char(src, str(src, d.content, what .. ".content"), what .. ".content")
    local a, b = int(src, d.start, what .. ".start", 0, 1 << 30), int(src, d.stop, what .. ".stop", 0, 1 << 30)
    steps[#steps + 1] = { kind = "Strip", content = c, start = a, stop = b }
    return O("type", "Strip", "content", c, "start", a, "stop", b)
  elseif t == "Replace" then
    local p, re, canon = pattern(src, d.pattern, what .. ".pattern")
    local c = str(src, d.content, what .. ".content")
    steps[#steps + 1] = { kind = "Replace", pattern = p, regex = re, content = c }
    return O("type", "Replace", "pattern", canon, "content", c)
  elseif t == "Metaspace" then
    local r = one_char(src, str(src, d.replacement, what .. ".replacement", "▁"), what .. ".replacement")
    local scheme = prepend_scheme(src, d, what)
    local split = bool(src, d.split, what .. ".split", true)
    steps[#steps + 1] = { kind = "Metaspace", content = r, prepend_scheme = scheme }
    return O("type", "Metaspace", "replacement", r, "prepend_scheme", scheme, "split", split)
  end
  fail(src, "%s type '%s' is not supported", what, tostring(t))
end

-- TemplateProcessing's pieces: {SpecialToken = {id =, type_id =}} or {Sequence = {id = "A"|"B", type_id =}}
local function template_pieces(src, pieces, what, specials, ids, single)
  local out = {}
  for i, x in ipairs(list(src, pieces, what)) do
    local w = ("%s[%d]"):format(what, i)
    obj(src, x, w)
    if type(x.SpecialToken) == "table" then
      local name = str(src, x.SpecialToken.id, w .. ".SpecialToken.id")
      local tid = int(src, x.SpecialToken.type_id or 0, w .. ".SpecialToken.type_id", 0, 1 << 30)
      local sp = specials[name] or fail(src, "%s names the special token '%s', which special_tokens does not define", w, name)
      if ids then
        for _, id in ipairs(sp) do ids[#ids + 1] = id end
      end
      out[i] = O("SpecialToken", O("id", name, "type_id", tid))
    elseif type(x.Sequence) == "table" then
      local id = str(src, x.Sequence.id, w .. ".Sequence.id")
      if id ~= "A" and id ~= "B" then fail(src, "%s.Sequence.id '%s' is not A or B", w, id) end
      if single and id ~= "A" then fail(src, "%s: the single template takes sequence A only", w) end
      if ids then ids[#ids + 1] = -1 end
      out[i] = O("Sequence", O("id", id, "type_id", int(src, x.Sequence.type_id or 0, w .. ".Sequence.type_id", 0, 1 << 30)))
    else
      fail(src, "%s is neither a SpecialToken nor a Sequence", w)
    end
  end
  return out
end

local function post_processor(src, p, state, what)
  if absent(p) then return NULL end
  obj(src, p, what)
  local t = p.type
  if t == "Sequence" then
    return sequence(src, p, "processors", what, post_processor, state)
  elseif t == "ByteLevel" then -- only offsets: the ids stay as they are
    return O("type", "ByteLevel", "add_prefix_space", bool(src, p.add_prefix_space, what .. ".add_prefix_space", true),
      "trim_offsets", bool(src, p.trim_offsets, what .. ".trim_offsets", true),
      "use_regex", bool(src, p.use_regex, what .. ".use_regex", true))
  elseif t == "TemplateProcessing" then
    if state.template then fail(src, "%s: a second TemplateProcessing", what) end
    local specials, canon_sp, names = {}, {}, {}
    for name, sp in pairs(absent(p.special_tokens) and {} or obj(src, p.special_tokens, what .. ".special_tokens")) do
      local w = ("%s.special_tokens['%s']"):format(what, tostring(name))
      obj(src, sp, w)
      local ids, toks = {}, {}
      for i, id in ipairs(list(src, sp.ids, w .. ".ids")) do ids[i] = int(src, id, w .. ".ids[]", 0, (1 << 24) - 1) end
      for i, s in ipairs(list(src, absent(sp.tokens) and {} or sp.tokens, w .. ".tokens")) do toks[i] = str(src, s, w .. ".tokens[]") end
      specials[name] = ids
      names[#names + 1] = name
      canon_sp[name] = O("id", str(src, sp.id or name, w .. ".id"), "ids", ids, "tokens", toks)
    end
    table.sort(names)
    local sp_obj = O()
    for _, name in ipairs(names) do sp_obj[#sp_obj + 1] = name; sp_obj[#sp_obj + 1] = canon_sp[name] end
    state.template = {}
    local single = template_pieces(src, p.single, what .. ".single", specials, state.template, true)
    local pair = template_pieces(src, absent(p.pair) and {} or p.pair, what .. ".pair", specials, nil, false)
    return O("type", "TemplateProcessing", "single", single, "pair", pair, "special_tokens", sp_obj)
  end
  fail(src, "%s type '%s' is not supported", what, tostring(t))
end

-- ---- the tokenizer object ----

local Tokenizer = {}
Tokenizer.__index = Tokenizer

-- The methods' options, checked by pipegoose.options: threads and chunk_bytes
-- here, before C, so that a string or a fraction is refused by name rather
-- than converted (an integral float such as 2.0 is the integer 2).
local THREADS = opt.integer{ min = 1, max = 1024, what = "an integer in [1, 1024]" }
local CHUNK_BYTES = opt.integer{ min = 1, max = math.maxinteger }
local ENCODE = { add_special = "any", tensor = "any" }
local ENCODE_BATCH = { add_special = "any", tensor = "any", threads = THREADS, flat = "any" }
local ENCODE_CHUNKED = { add_special = "any", threads = THREADS, chunk_bytes = CHUNK_BYTES }
local DECODE = { skip_special = "any" }

function Tokenizer:encode(text, opts)
  opts = opt.check("encode", opts, ENCODE)
  if type(text) ~= "string" then error("encode: text must be a string", 2) end
  local add = opts.add_special
  if add == nil then add = true end
  return self._c:encode(text, add, opts.tensor)
end

--- Many texts on threads (default pg.num_threads()), each thread with its own
--- state: the same ids as encode of each text. Returns a list of id tables
--- (int32 tensors with tensor = true).
function Tokenizer:encode_batch(texts, opts)
  opts = opt.check("encode_batch", opts, ENCODE_BATCH)
  if type(texts) ~= "table" then error("encode_batch: texts must be a list of strings", 2) end
  local add = opts.add_special
  if add == nil then add = true end
  return self._c:encode_batch(texts, add, opts.threads, opts.tensor, opts.flat)
end

--- One long text cut at line starts (pg_tokenizer.h: after a newline followed
--- by an ASCII letter or digit, at or past every chunk_bytes, 256 KiB by
--- default), the chunks encoded on threads: an int32 tensor of every chunk's
--- ids in order. The cuts do not depend on threads. add_special (default
--- false: a corpus is not one sequence) puts the template around the whole.
function Tokenizer:encode_chunked(text, opts)
  opts = opt.check("encode_chunked", opts, ENCODE_CHUNKED)
  if type(text) ~= "string" then error("encode_chunked: text must be a string", 2) end
  return self._c:encode_chunked(text, opts.add_special == true, opts.threads, opts.chunk_bytes)
end

--- encode_chunked of a file's bytes (mapped, not read into a Lua string).
function Tokenizer:encode_file(path, opts)
  opts = opt.check("encode_file", opts, ENCODE_CHUNKED)
  if type(path) ~= "string" then error("encode_file: path must be a string", 2) end
  return self._c:encode_file(path, opts.add_special == true, opts.threads, opts.chunk_bytes)
end

--- What the pre-tokenizer regexes run on ("PCRE2 10.42, JIT ..." or "..., no JIT: interpreted").
function Tokenizer:regex_engine() return self._c:regex_engine() end

function Tokenizer:decode(ids, opts)
  opts = opt.check("decode", opts, DECODE)
  return self._c:decode(ids, opts.skip_special)
end

function Tokenizer:vocab_size() return self._c:vocab_size() end
function Tokenizer:token_to_id(s) return self._c:token_to_id(s) end
function Tokenizer:id_to_token(id) return self._c:id_to_token(id) end
function Tokenizer:pre_tokenize(text) return self._c:pre_tokenize(text) end

-- ---- the special roles (bos, eos, pad, unk) ----
-- tokenizer.json does not say which token begins or ends a sequence;
-- transformers keeps that in tokenizer_config.json (and special_tokens_map.json).
-- load reads them from a directory, train sets bos = eos = <|endoftext|> when
-- it is one of the special tokens (GPT-2's convention), save_pretrained writes them.
local ROLES = { "bos", "eos", "pad", "unk" }

--- The id of a role's token, or nil when the tokenizer has none.
function Tokenizer:bos_id() return self._roles.bos end
function Tokenizer:eos_id() return self._roles.eos end
function Tokenizer:pad_id() return self._roles.pad end
function Tokenizer:unk_id() return self._roles.unk end

--- {bos =, eos =, pad =, unk =}: each role's token id (absent: none).
function Tokenizer:special_ids()
  local out = {}
  for _, r in ipairs(ROLES) do out[r] = self._roles[r] end
  return out
end

-- A role's value: a token (string) the tokenizer has, or an id below
-- vocab_size; false clears the role.
local function role_id(tok, role, v, src)
  if v == false then return nil end
  if type(v) == "string" then
    local id = tok._c:token_to_id(v)
    if id == nil then fail(src, "%s_token '%s' is not a token of this tokenizer", role, v) end
    return id
  end
  if math.type(v) == "integer" and v >= 0 and v < tok._c:vocab_size() then return v end
  fail(src, "%s_token must be a token of the tokenizer, an id in [0, %d) or false, not %s", role,
    tok._c:vocab_size(), tostring(v))
end

--- tok:set_special_tokens{bos =, eos =, pad =, unk =}: each a token, an id or
--- false (none); roles not named keep their value. Returns tok.
function Tokenizer:set_special_tokens(t)
  if type(t) ~= "table" then error("set_special_tokens: expected a table {bos =, eos =, pad =, unk =}", 2) end
  for k in pairs(t) do
    local known = false
    for _, r in ipairs(ROLES) do known = known or k == r end
    if not known then error(("set_special_tokens: unknown role '%s' (bos, eos, pad, unk)"):format(tostring(k)), 2) end
  end
  local ok, err = pcall(function()
    for _, r in ipairs(ROLES) do
      if t[r] ~= nil then self._roles[r] = role_id(self, r, t[r], "set_special_tokens") end
    end
  end)
  if not ok then error(err, 2) end
  return self
end

-- A role's token in tokenizer_config.json / special_tokens_map.json: a string,
-- an AddedToken object {content = ...}, or null / absent (none).
local function config_token(src, v, key)
  if absent(v) then return nil end
  if type(v) == "table" then v = v.content end
  if type(v) ~= "string" then fail(src, "%s must be a string or an object with a content string", key) end
  return v
end

-- The roles of a model directory's tokenizer files, as transformers reads
-- them: tokenizer_config.json's fields, special_tokens_map.json's for the
-- roles the first does not give.
local function read_roles(tok, dir)
  local raw
  for _, name in ipairs({ "tokenizer_config.json", "special_tokens_map.json" }) do
    local path = dir .. "/" .. name
    local f = io.open(path, "rb")
    if f then
      local text = f:read("a")
      f:close()
      local ok, j = pcall(cjson.decode, text or "")
      if not ok or type(j) ~= "table" then fail(path, "is not a JSON object (%s)", tostring(j)) end
      if name == "tokenizer_config.json" then raw = j end
      for _, r in ipairs(ROLES) do
        local content = config_token(path, j[r .. "_token"], r .. "_token")
        if content and tok._roles[r] == nil then tok._roles[r] = role_id(tok, r, content, path) end
      end
    end
  end
  tok._hf_config = raw
end

-- JSON objects a tokenizer_config.json holds (an empty one is {} and not []).
local CONFIG_OBJECTS = { added_tokens_decoder = true }

-- A decoded JSON value as an ordered one for write_json (object keys sorted).
local function ordered(v, key)
  if type(v) ~= "table" or v == NULL then return v end
  local n, keys = 0, {}
  for k in pairs(v) do n = n + 1; keys[#keys + 1] = k end
  if n == 0 then return CONFIG_OBJECTS[key] and O() or {} end
  if n == #v and not CONFIG_OBJECTS[key] then
    local out = {}
    for i = 1, n do out[i] = ordered(v[i]) end
    return out
  end
  for i, k in ipairs(keys) do keys[i] = tostring(k) end
  table.sort(keys, function(a, b)
    local na, nb = tonumber(a), tonumber(b)
    if na and nb then return na < nb end
    return a < b
  end)
  local o = O()
  for _, k in ipairs(keys) do o[#o + 1] = k; o[#o + 1] = ordered(v[k] == nil and v[tonumber(k)] or v[k], k) end
  return o
end

--- tok:save_pretrained(dir [, {model_max_length =}]): the files transformers'
--- AutoTokenizer.from_pretrained reads: tokenizer.json, tokenizer_config.json
--- (a loaded one's other fields kept, the roles and added tokens this
--- tokenizer's) and special_tokens_map.json, each written atomically. The
--- directory must exist. Returns dir.
function Tokenizer:save_pretrained(dir, opts)
  opts = opts or {}
  if type(dir) ~= "string" or not core().fs.is_dir(dir) then
    error(("save_pretrained: %s is not a directory"):format(tostring(dir)), 2)
  end
  local mml = opts.model_max_length
  if mml ~= nil and (math.type(mml) ~= "integer" or mml < 1) then
    error("save_pretrained: model_max_length must be a positive integer", 2)
  end
  self:save(dir .. "/tokenizer.json")
  local cfg = {}
  for k, v in pairs(self._hf_config or {}) do cfg[k] = v end
  local decoder = {}
  for _, a in ipairs(self._added) do
    decoder[tostring(a.id)] = O("content", a.content, "lstrip", a.lstrip, "normalized", a.normalized,
      "rstrip", a.rstrip, "single_word", a.single_word, "special", a.special)
  end
  cfg.added_tokens_decoder = decoder
  local map = {}
  for _, r in ipairs(ROLES) do
    local id = self._roles[r]
    local content = id and self._c:id_to_token(id) or nil
    cfg[r .. "_token"] = content or NULL
    map[r .. "_token"] = content
  end
  if cfg.tokenizer_class == nil then cfg.tokenizer_class = "PreTrainedTokenizerFast" end
  -- pipegoose's decode does not clean up spaces before punctuation; neither must transformers'
  if cfg.clean_up_tokenization_spaces == nil then cfg.clean_up_tokenization_spaces = false end
  if mml then cfg.model_max_length = mml end
  local function text(v, key)
    local out = {}
    write_json(ordered(v, key), out, "")
    return table.concat(out) .. "\n"
  end
  -- ordered() would take the decoder's keys for an array's indices: order it here
  local dec_keys = {}
  for k in pairs(decoder) do dec_keys[#dec_keys + 1] = k end
  table.sort(dec_keys, function(a, b) return tonumber(a) < tonumber(b) end)
  local dec = O()
  for _, k in ipairs(dec_keys) do dec[#dec + 1] = k; dec[#dec + 1] = decoder[k] end
  cfg.added_tokens_decoder = nil
  local top = ordered(cfg)
  if getmetatable(top) ~= OBJ then top = O() end
  local merged = O("added_tokens_decoder", dec)
  for i = 1, #top, 2 do merged[#merged + 1] = top[i]; merged[#merged + 1] = top[i + 1] end
  local out = {}
  write_json(merged, out, "")
  core().file.write(dir .. "/tokenizer_config.json", { table.concat(out) .. "\n" })
  core().file.write(dir .. "/special_tokens_map.json", { text(map) })
  return dir
end

function Tokenizer:special_tokens()
  local out = {}
  for _, a in ipairs(self._added) do
    if a.special then out[a.content] = a.id end
  end
  return out
end

--- The tokenizer.json text (what save writes).
function Tokenizer:to_json()
  local out = {}
  local j = self._json
  local model = {}
  local ids = {}
  for tok, id in pairs(self._vocab) do ids[#ids + 1] = { id, tok } end
  table.sort(ids, function(a, b) return a[1] < b[1] end)
  for i, e in ipairs(ids) do
    model[i] = ("      %s: %d"):format(cjson.encode(e[2]), e[1])
  end
  local merges = {}
  local m = self._merges
  for i = 1, #m, 2 do
    merges[#merges + 1] = self._merge_strings and ("      " .. cjson.encode(m[i] .. " " .. m[i + 1]))
      or ("      [" .. cjson.encode(m[i]) .. ", " .. cjson.encode(m[i + 1]) .. "]")
  end
  write_json(O("version", "1.0", "truncation", NULL, "padding", NULL, "added_tokens", j.added_tokens,
    "normalizer", j.normalizer, "pre_tokenizer", j.pre_tokenizer, "post_processor", j.post_processor,
    "decoder", j.decoder), out, "")
  out[#out] = out[#out]:gsub("\n}$", "")
  local mo = {}
  write_json(j.model, mo, "  ")
  local head = table.concat(mo):gsub("\n  }$", "")
  -- the model's vocab (by id) and merges (in rank order) go last, one entry a line
  out[#out + 1] = ",\n  \"model\": " .. head .. ",\n    \"vocab\": {" .. (#model > 0 and "\n" .. table.concat(model, ",\n") .. "\n    " or "")
    .. "},\n    \"merges\": [" .. (#merges > 0 and "\n" .. table.concat(merges, ",\n") .. "\n    " or "") .. "]\n  }\n}\n"
  return table.concat(out)
end

--- Writes the tokenizer.json atomically (pg.file.write: temporary name, fsync, rename).
function Tokenizer:save(path)
  if type(path) ~= "string" then error("save: path must be a string", 2) end
  if core().fs.is_dir(path) then path = path .. "/tokenizer.json" end
  core().file.write(path, { self:to_json() })
  return path
end

--- A tokenizer from a decoded tokenizer.json table; src names it in errors.
function M.from_table(j, src)
  src = src or "tokenizer.json"
  obj(src, j, "the file")
  for _, k in ipairs({ "truncation", "padding" }) do
    if not absent(j[k]) then fail(src, "%s is not supported (set it to null)", k) end
  end
  local m = obj(src, j.model, "model")
  local mtype = m.type
  if mtype == nil and m.merges ~= nil then mtype = "BPE" end -- files from before the model had a type
  if mtype ~= "BPE" then fail(src, "model type '%s' is not supported (only BPE)", tostring(mtype)) end
  if not absent(m.dropout) and m.dropout ~= 0 then fail(src, "model.dropout is not supported (set it to null)") end
  for _, k in ipairs({ "continuing_subword_prefix", "end_of_word_suffix" }) do
    if not absent(m[k]) and m[k] ~= "" then fail(src, "model.%s is not supported", k) end
  end
  local vocab = {}
  for tok, id in pairs(obj(src, m.vocab, "model.vocab")) do
    if type(tok) ~= "string" then fail(src, "model.vocab has a key that is not a string") end
    vocab[tok] = int(src, id, ("model.vocab['%s']"):format(tok), 0, (1 << 24) - 1)
  end
  local merges, strings = {}, false
  for i, mg in ipairs(list(src, m.merges or {}, "model.merges")) do
    local a, b
    if type(mg) == "string" then
      strings = true
      a, b = mg:match("^([^ ]+) ([^ ]+)$")
      if not a then fail(src, "model.merges[%d] '%s' is not two tokens separated by one space", i, mg) end
    elseif type(mg) == "table" and #mg == 2 and type(mg[1]) == "string" and type(mg[2]) == "string" then
      a, b = mg[1], mg[2]
    else
      fail(src, "model.merges[%d] is neither \"a b\" nor [\"a\", \"b\"]", i)
    end
    merges[#merges + 1] = a
    merges[#merges + 1] = b
  end
  local unk = nil
  if not absent(m.unk_token) then unk = str(src, m.unk_token, "model.unk_token") end
  local model = { unk_token = unk, byte_fallback = bool(src, m.byte_fallback, "model.byte_fallback", false),
    fuse_unk = bool(src, m.fuse_unk, "model.fuse_unk", false), ignore_merges = bool(src, m.ignore_merges, "model.ignore_merges", false) }
  local added, canon_added = {}, {}
  for i, a in ipairs(list(src, absent(j.added_tokens) and {} or j.added_tokens, "added_tokens")) do
    local w = ("added_tokens[%d]"):format(i)
    obj(src, a, w)
    local special = bool(src, a.special, w .. ".special", false)
    local e = { id = int(src, a.id, w .. ".id", 0, (1 << 24) - 1), content = str(src, a.content, w .. ".content"),
      special = special, lstrip = bool(src, a.lstrip, w .. ".lstrip", false), rstrip = bool(src, a.rstrip, w .. ".rstrip", false),
      single_word = bool(src, a.single_word, w .. ".single_word", false),
      normalized = bool(src, a.normalized, w .. ".normalized", not special) }
    if e.content == "" then fail(src, "%s.content is empty", w) end
    added[i] = e
    canon_added[i] = O("id", e.id, "content", e.content, "single_word", e.single_word, "lstrip", e.lstrip,
      "rstrip", e.rstrip, "normalized", e.normalized, "special", e.special)
  end
  local norm, pre, dec, state = {}, {}, {}, {}
  local json = {
    added_tokens = canon_added,
    normalizer = normalizer(src, j.normalizer, norm, "normalizer"),
    pre_tokenizer = pre_tokenizer(src, j.pre_tokenizer, pre, "pre_tokenizer"),
    post_processor = post_processor(src, j.post_processor, state, "post_processor"),
    decoder = decoder(src, j.decoder, dec, "decoder"),
    model = O("type", "BPE", "dropout", NULL, "unk_token", unk or NULL, "continuing_subword_prefix", NULL,
      "end_of_word_suffix", NULL, "fuse_unk", model.fuse_unk, "byte_fallback", model.byte_fallback,
      "ignore_merges", model.ignore_merges),
  }
  local spec = { model = model, vocab = vocab, merges = merges, added = added, normalizers = norm,
    pre_tokenizers = pre, decoders = dec, template = state.template }
  local ok, c = pcall(core().tokenizer.new, spec)
  if not ok then fail(src, "%s", tostring(c)) end
  return setmetatable({ _c = c, _json = json, _vocab = vocab, _merges = merges, _merge_strings = strings,
    _added = added, _roles = {}, source = src }, Tokenizer)
end

--- A tokenizer from the text of a tokenizer.json.
function M.from_json(text, src)
  src = src or "tokenizer.json"
  local ok, j = pcall(cjson.decode, text)
  if not ok then fail(src, "not valid JSON (%s)", tostring(j)) end
  return M.from_table(j, src)
end

--- pg.tokenizer.load(path): a tokenizer.json, or a directory holding one (a
--- Hugging Face model directory: its tokenizer_config.json and
--- special_tokens_map.json give the bos / eos / pad / unk roles).
function M.load(path)
  if type(path) ~= "string" then error("tokenizer.load: path must be a string", 2) end
  local dir
  if core().fs.is_dir(path) then
    dir = path
    if not core().fs.exists(path .. "/tokenizer.json") then
      fail(path, "has no tokenizer.json (the only format read; transformers' save_pretrained of a fast tokenizer writes it)")
    end
    path = path .. "/tokenizer.json"
  end
  local f, err = io.open(path, "rb")
  if not f then fail(path, "missing or unreadable (%s)", tostring(err)) end
  local text = f:read("a")
  f:close()
  if not text then fail(path, "unreadable") end
  local tok = M.from_json(text, path)
  if dir then read_roles(tok, dir) end
  return tok
end


-- ---- training ----

-- Llama 3's (and cl100k's) pre-tokenizer regex, as its tokenizer.json's Split holds it.
M.LLAMA3_PATTERN = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
  .. "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
local PATTERN_NAMES = { gpt2 = false, llama3 = M.LLAMA3_PATTERN } -- false: ByteLevel's own (GPT-2's) regex

local TRAIN_SCHEMA
local function train_schema()
  TRAIN_SCHEMA = TRAIN_SCHEMA or {
    files = opt.required(opt.either(opt.string, opt.list(opt.string, { min_len = 1 }))),
    vocab_size = opt.integer { min = 1, max = 1 << 24, required = true },
    special_tokens = opt.list(opt.string, { default = {} }),
    pattern = opt.string { default = "gpt2" },
    min_frequency = opt.integer { min = 0, max = math.maxinteger, default = 0 },
    threads = opt.integer { min = 0, max = 1024, default = 0 },
    progress = opt.boolean(),
    chunk_bytes = opt.integer { min = 0, default = 0 },
  }
  return TRAIN_SCHEMA
end

--- pg.tokenizer.train{files=, vocab_size=, special_tokens=, pattern=, min_frequency=, threads=, progress=}
-- -> tokenizer, stats: a byte-level BPE (GPT-2's layout; Split(pattern) + ByteLevel for another pattern)
-- with the merges `tokenizers`' BpeTrainer makes on the same files and settings
-- (src/tokenizer/pg_tokenizer_train.c has its rules). pattern: "gpt2", "llama3" or a PCRE2 regex (a bare
-- name that is neither is refused, not taken for a regex). threads = 0: all of OpenMP's;
-- progress: a bar on stderr, by default on rank 0 when stderr is a terminal (mpirun's under mpirun;
-- PG_PROGRESS=tty|plain forces it on|off). chunk_bytes: the pieces
-- the files are counted in (0: 64 KB to 16 MB by the corpus size); no result depends on it.
-- stats: {words =, pre_tokens =, bytes =, merges_made =, count_seconds =, merge_seconds =}.
function M.train(o)
  local W = "tokenizer.train"
  o = opt.check(W, o, train_schema())
  local files = type(o.files) == "string" and { o.files } or o.files
  for i, f in ipairs(files) do
    local h, err = io.open(f, "rb")
    if not h then error(("%s: files[%d] '%s' is missing or unreadable (%s)"):format(W, i, f, tostring(err)), 2) end
    h:close()
    if core().fs.is_dir(f) then error(("%s: files[%d] '%s' is a directory"):format(W, i, f), 2) end
  end
  local specials, seen = {}, {}
  for i, s in ipairs(o.special_tokens) do
    if s == "" then error(("%s: special_tokens[%d] is empty"):format(W, i), 2) end
    if not seen[s] then seen[s] = true; specials[#specials + 1] = s end -- a repeat is dropped, as BpeTrainer does
  end
  if o.vocab_size < 256 + #specials then
    error(("%s: vocab_size must be at least %d (the 256 byte-level characters and %d special tokens), got %d")
      :format(W, 256 + #specials, #specials, o.vocab_size), 2)
  end
  local pat = o.pattern
  if PATTERN_NAMES[pat] ~= nil then
    pat = PATTERN_NAMES[pat] or nil
  elseif pat:match("^[%w_%-%.]+$") then
    error(("%s: pattern '%s' is not a known name (gpt2, llama3); a regex is taken as one only when it has "
      .. "a regex character"):format(W, pat), 2)
  end
  local progress = o.progress
  if progress == nil and require("pipegoose.callbacks").process_rank() ~= 0 then progress = false end
  if progress == nil then
    -- as ProgressBar decides (callbacks/progress_bar.lua): $PG_PROGRESS, else under mpirun (which gives
    -- each rank a pseudo-terminal of its own) whether mpirun's stderr is a terminal, else ours
    local forced = core().env("PG_PROGRESS") -- auto, tty or plain: anything else is refused
    if forced == "tty" or forced == "plain" then progress = forced == "tty"
    elseif os.getenv("OMPI_COMM_WORLD_SIZE") then progress = core().fs.parent_isatty("stderr")
    else progress = core().fs.isatty("stderr") end
  end
  local ok, vocab, merges, stats = pcall(core().tokenizer.train, { files = files, vocab_size = o.vocab_size,
    special_tokens = specials, pattern = pat, min_frequency = o.min_frequency, threads = o.threads,
    progress = progress, chunk_bytes = o.chunk_bytes })
  if not ok then
    local msg = tostring(vocab)
    if pat and msg:find("does not compile", 1, true) then msg = msg:gsub("^regex", "pattern: regex") end
    error(msg:find("^" .. W) and msg or (W .. ": " .. msg), 2)
  end
  local bl = { type = "ByteLevel", add_prefix_space = false, trim_offsets = true, use_regex = pat == nil }
  local pre = bl
  if pat then
    pre = { type = "Sequence", pretokenizers = {
      { type = "Split", pattern = { Regex = pat }, behavior = "Isolated", invert = false }, bl } }
  end
  local added = {}
  for i, s in ipairs(specials) do
    added[i] = { id = vocab[s], content = s, single_word = false, lstrip = false, rstrip = false,
      normalized = false, special = true }
  end
  local j = { model = { type = "BPE", vocab = vocab, merges = merges }, added_tokens = added, pre_tokenizer = pre,
    decoder = { type = "ByteLevel", add_prefix_space = true, trim_offsets = true, use_regex = true } }
  local tok = M.from_table(j, W)
  if vocab["<|endoftext|>"] and seen["<|endoftext|>"] then tok._roles.bos, tok._roles.eos = vocab["<|endoftext|>"], vocab["<|endoftext|>"] end
  return tok, stats
end

return M
