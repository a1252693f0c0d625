--- pg.generate: text generation with the key/value cache (pg_engine_decode).
--
-- pg.generate(engine_or_hf_dir, prompt, opts) -> out, ids
--   engine_or_hf_dir  an engine (pg.parallelize), or a Hugging Face model directory (pg.nn.from_hf, then
--                     pg.parallelize on one rank; its tokenizer.json, if there is one, is the tokenizer)
--   prompt            a string (through the tokenizer), a list of token ids, a 1-D int32 tensor of ids, or a
--                     list of those (a batch; the prompts may have different lengths)
--   opts              max_new_tokens (32), temperature (0: greedy), top_k, top_p, seed (0), stop (a string, an
--                     id, or a list of strings and ids), eos_token_id (an id or a list of ids; false: none;
--                     default tok:eos_id() if the tokenizer has it, else engine.config.eos_token_id),
--                     tokenizer (an object with :encode(text) and :decode(ids); default engine.tokenizer),
--                     cache (true; false: recompute the whole prefix every step with engine:forward)
-- Returns, for one prompt: out = the generated text (a string) when there is a tokenizer, else the list of
-- generated ids; ids = the list of generated ids (0-based, the prompt not included). For a list of prompts:
-- out and ids are lists of those, in the prompts' order. A row stops after max_new_tokens, after an EOS id
-- or a stop id (that id is the last one of its output, as in transformers), or once its decoded text holds
-- a stop string (the tokens up to the one that completed it are kept: the text is not cut).
--
-- Sampling is transformers' generate with do_sample: the logits divided by temperature, then top_k (every
-- token below the k-th largest removed), then top_p (TopPLogitsWarper: sorted ascending, the cumulative
-- softmax, tokens whose cumulative probability is <= 1 - top_p removed, the likeliest always kept), then a
-- draw from the softmax with the seeded generator (pipegoose.rng). temperature = 0 is greedy: the first
-- maximum (torch.argmax). Positions: a prompt of n tokens with m new ones needs n + m - 1 positions (the
-- last token is not fed back); past the model's seq_len it is refused (no sliding window: learned
-- positions end there, and transformers refuses too), pg.sample.generate slides instead.
--
-- Collective: every rank calls it with the same arguments (each computes the same ids). Forward only: a
-- training engine's parameters, gradients and optimizer are untouched and its next forward_backward is
-- what it would have been (generate_spec checks it bitwise). The cache path needs a C model without
-- sequence parallelism (a module written in Lua, or sequence parallelism, falls back to recompute, said
-- once on rank 0); MoE layers drop no tokens on the cache path (transformers' Mixtral has no capacity).
local core = require "pipegoose.core"
local opt = require "pipegoose.options"
local generator = require("pipegoose.rng").generator

local M = {}

local OPTIONS = {
  max_new_tokens = opt.integer{ min = 0, default = 32 },
  temperature = opt.number{ min = 0, default = 0 },
  top_k = opt.integer{ min = 1, max = math.maxinteger },
  top_p = opt.number{ gt = 0, max = 1 },
  seed = opt.integer{ min = math.mininteger, max = math.maxinteger },
  stop = "any",
  eos_token_id = "any",
  tokenizer = "any",
  cache = "boolean",
}

local function fail(msg, ...) error("generate: " .. msg:format(...), 3) end

-- ---------------------------------------------------------------- sampling (transformers' warpers)

--- The id (0-based) that transformers' sampling chooses from a row of logits (a Lua list of V numbers):
-- temperature, top_k, top_p, softmax, a draw u in [0, 1) (rand()). Exposed for the specs.
function M.pick(row, o, rand)
  local V = #row
  if not (o.temperature > 0) then
    local best = 1
    for v = 2, V do if row[v] > row[best] then best = v end end
    return best - 1
  end
  local s, keep = {}, {}
  for v = 1, V do s[v] = row[v] / o.temperature; keep[v] = true end
  if o.top_k and o.top_k < V then -- TopKLogitsWarper: remove scores < the k-th largest (ties with it stay)
    local sorted = table.move(s, 1, V, 1, {})
    table.sort(sorted, function(a, b) return a > b end)
    local kth = sorted[o.top_k]
    for v = 1, V do if s[v] < kth then keep[v] = false end end
  end
  if o.top_p and o.top_p < 1 then -- TopPLogitsWarper over what top_k kept
    local order = {}
    for v = 1, V do if keep[v] then order[#order + 1] = v end end
    table.sort(order, function(a, b) if s[a] ~= s[b] then return s[a] < s[b] end return a < b end)
    local mx, total = s[order[#order]], 0
    for _, v in ipairs(order) do total = total + math.exp(s[v] - mx) end
    local cum = 0
    for i = 1, #order - 1 do -- the last (the likeliest) is always kept
      cum = cum + math.exp(s[order[i]] - mx) / total
      if cum <= 1 - o.top_p then keep[order[i]] = false end
    end
  end
  local mx = -math.huge
  for v = 1, V do if keep[v] and s[v] > mx then mx = s[v] end end
  local w, total = {}, 0
  for v = 1, V do
    w[v] = keep[v] and math.exp(s[v] - mx) or 0
    total = total + w[v]
  end
  local r, last = rand() * total, nil
  for v = 1, V do
    if w[v] > 0 then
      last = v
      r = r - w[v]
      if r < 0 then return v - 1 end
    end
  end
  return last - 1 -- rounding left r >= 0 past the end: the last kept token
end

-- ---------------------------------------------------------------- arguments

local function id_list(p, i, vocab)
  local ids
  if core.is_tensor(p) then
    if p:dim() ~= 1 or p:dtype() ~= "int32" then
      fail("prompt %d: a tensor prompt must be 1-D int32 token ids, got %s", i, tostring(p))
    end
    ids = p:totable()
  else
    ids = {}
    for k, t in ipairs(p) do
      if math.type(t) ~= "integer" or t < 0 or t >= vocab then
        fail("prompt %d: token %d is %s, not an id in [0, %d)", i, k, tostring(t), vocab)
      end
      ids[k] = t
    end
  end
  for k, t in ipairs(ids) do
    if t < 0 or t >= vocab then fail("prompt %d: token %d is %d, not an id in [0, %d)", i, k, t, vocab) end
  end
  if #ids == 0 then fail("prompt %d is empty: it needs at least one token", i) end
  return ids
end

local function encode(tok, text, i)
  if not tok then fail("prompt %d is text, but there is no tokenizer (opts.tokenizer or engine.tokenizer)", i) end
  local ids = tok:encode(text)
  if core.is_tensor(ids) then ids = ids:totable() end
  return ids
end

local function ids_set(v, what)
  local set = {}
  if v == nil or v == false then return set end
  if math.type(v) == "integer" then v = { v } end
  if type(v) ~= "table" then fail("%s must be an id or a list of ids, got %s", what, type(v)) end
  for _, id in ipairs(v) do
    if math.type(id) ~= "integer" then fail("%s: %s is not an integer id", what, tostring(id)) end
    set[id] = true
  end
  return set
end

local function stops_of(v, tok)
  local strings, ids = {}, {}
  if v == nil then return strings, ids end
  if type(v) == "string" or math.type(v) == "integer" then v = { v } end
  if type(v) ~= "table" then fail("stop must be a string, an id or a list of them, got %s", type(v)) end
  for _, s in ipairs(v) do
    if type(s) == "string" then
      if s == "" then fail("stop: an empty string would stop at once") end
      if not tok then fail("stop string %q needs a tokenizer (opts.tokenizer or engine.tokenizer)", s) end
      strings[#strings + 1] = s
    elseif math.type(s) == "integer" then ids[s] = true
    else fail("stop: %s is neither a string nor an integer id", tostring(s)) end
  end
  return strings, ids
end

local function default_eos(tok, engine)
  if tok and type(tok.eos_id) == "function" then return tok:eos_id() end
  return engine.config and engine.config.eos_token_id
end

local function engine_of(x)
  if type(x) ~= "string" then return x end
  local pg = require "pipegoose"
  local model = pg.nn.from_hf(x)
  local engine = pg.parallelize(model, nil, {})
  local f = io.open(x .. "/tokenizer.json", "rb")
  if f then
    f:close()
    engine.tokenizer = engine.tokenizer or pg.tokenizer.load(x .. "/tokenizer.json")
  end
  return engine
end

-- ---------------------------------------------------------------- the two paths

-- The next-token logits of the rows come as [n, V] tensors; a row is {t = that tensor, i = its row}. Greedy
-- takes the tensor's argmax (the first maximum, as M.pick), without the logits as a Lua list.
local function rows_of(t2d, first_row, out, list)
  local batch = { t = t2d }
  for k, r in ipairs(list) do out[r] = { batch = batch, i = k } end
  return first_row
end

local function logits_list(row)
  local t = row.batch.t
  return t:narrow(1, row.i, 1):reshape{ t:size(2) }:totable()
end

local function pick_row(row, o, rand)
  if not (o.temperature > 0) then
    local b = row.batch
    b.argmax = b.argmax or b.t:argmax(2):totable()
    return b.argmax[row.i][1] - 1
  end
  return M.pick(logits_list(row), o, rand)
end

-- By the cache: the live rows' new tokens at their positions, a call per run of consecutive live rows.
local function step_cached(engine, rows, live, nrows)
  local out = {}
  local b = 1
  while b <= nrows do
    if live[b] then
      local e = b
      while e < nrows and live[e + 1] do e = e + 1 end
      local toks, pos, list = {}, {}, {}
      for r = b, e do
        toks[#toks + 1] = { rows[r][#rows[r]] }
        pos[#pos + 1] = #rows[r] - 1
        list[#list + 1] = r
      end
      local logits = engine:decode(core.tensor(toks, { dtype = "int32" }), pos, b - 1, nrows)
      rows_of(logits:reshape{ #list, logits:size(3) }, b, out, list)
      b = e + 1
    else
      b = b + 1
    end
  end
  return out
end

local function prefill_cached(engine, rows, nrows)
  local out = {}
  for r = 1, nrows do
    local logits = engine:decode(core.tensor({ rows[r] }, { dtype = "int32" }), { 0 }, r - 1, nrows)
    rows_of(logits:narrow(2, #rows[r], 1):reshape{ 1, logits:size(3) }, r, out, { r })
  end
  return out
end

-- Recompute: engine:forward of every live row's whole prefix, rows of one length together.
local function step_recompute(engine, rows, live, nrows)
  local by_len, out = {}, {}
  for r = 1, nrows do
    if live[r] then
      local n = #rows[r]
      by_len[n] = by_len[n] or {}
      table.insert(by_len[n], r)
    end
  end
  for n, group in pairs(by_len) do
    local batch = {}
    for i, r in ipairs(group) do batch[i] = rows[r] end
    local logits = engine:forward(core.tensor(batch, { dtype = "int32" }))
    rows_of(logits:narrow(2, n, 1):reshape{ #group, logits:size(3) }, group[1], out, group)
  end
  return out
end

--- Whether the engine has the cache path: true, or false and why not.
function M.caches(engine)
  return engine.c:decode_check()
end

function M.generate(engine_or_dir, prompt, opts)
  opts = opt.check("generate", opts, OPTIONS)
  local engine = engine_of(engine_or_dir)
  if type(engine) ~= "table" or not engine.c then
    fail("the first argument must be an engine (pg.parallelize) or a Hugging Face directory, got %s", type(engine))
  end
  local tok = opts.tokenizer or engine.tokenizer
  local vocab = engine.vocab or engine.config.vocab
  local single = type(prompt) == "string" or core.is_tensor(prompt) or
    (type(prompt) == "table" and (#prompt == 0 or math.type(prompt[1]) == "integer"))
  if type(prompt) ~= "string" and not core.is_tensor(prompt) and type(prompt) ~= "table" then
    fail("the prompt must be text, token ids or a list of prompts, got %s", type(prompt))
  end
  local prompts = single and { prompt } or prompt
  if #prompts == 0 then fail("the list of prompts is empty") end
  local rows, plen = {}, {}
  for i, p in ipairs(prompts) do
    if type(p) == "string" then rows[i] = id_list(encode(tok, p, i), i, vocab)
    elseif core.is_tensor(p) or type(p) == "table" then rows[i] = id_list(p, i, vocab)
    else fail("prompt %d must be text or token ids, got %s", i, type(p)) end
    plen[i] = #rows[i]
  end
  local eos = opts.eos_token_id
  if eos == nil then eos = default_eos(tok, engine) end
  local eos_set = ids_set(eos, "eos_token_id")
  local stop_strings, stop_ids = stops_of(opts.stop, tok)
  local n_new = opts.max_new_tokens
  local window = engine.config.seq_len
  for i, r in ipairs(rows) do
    if window and n_new > 0 and #r + n_new - 1 > window then
      fail("prompt %d has %d tokens; with max_new_tokens = %d it needs %d positions, and the model has %d "
        .. "(seq_len)", i, #r, n_new, #r + n_new - 1, window)
    end
  end
  local o = { temperature = opts.temperature, top_k = opts.top_k, top_p = opts.top_p }
  local rand = generator(opts.seed or 0)
  local use_cache = opts.cache ~= false
  if use_cache then
    local ok, why = M.caches(engine)
    if not ok then
      if engine.ctx:rank() == 0 then io.stderr:write("generate: no key/value cache (", why, "): recomputing\n") end
      use_cache = false
    end
  end

  local nrows, live, new = #rows, {}, {}
  for r = 1, nrows do live[r], new[r] = n_new > 0, {} end
  local ok, err = pcall(function()
    local last = nil
    for step = 1, n_new do
      local any = false
      for r = 1, nrows do any = any or live[r] end
      if not any then break end
      if use_cache then
        last = step == 1 and prefill_cached(engine, rows, nrows) or step_cached(engine, rows, live, nrows)
      else
        last = step_recompute(engine, rows, live, nrows)
      end
      for r = 1, nrows do -- rows in order: the generator's draws are the same whatever the path
        if live[r] then
          local id = pick_row(last[r], o, rand)
          rows[r][#rows[r] + 1] = id
          new[r][#new[r] + 1] = id
          if #new[r] >= n_new or eos_set[id] or stop_ids[id] then live[r] = false end
          if live[r] and #stop_strings > 0 then
            local text = tok:decode(new[r])
            for _, s in ipairs(stop_strings) do
              if text:find(s, 1, true) then live[r] = false; break end
            end
          end
        end
      end
    end
  end)
  if use_cache then engine.c:release_cache() end
  if not ok then error(err, 2) end
  local out = {}
  for r = 1, nrows do out[r] = tok and tok:decode(new[r]) or new[r] end
  if single then return out[1], new[1] end
  return out, new
end

return M
