--- TextSampler{every_n_steps = 100, prompt = "\n", tokens = 32, temperature = 0,
-- top_k = nil, seed = nil, decode = nil, encode = nil, print = true}: every
-- n optimizer steps (counter trainer.state.step) continues `prompt` by
-- `tokens` tokens with engine:forward, prints the text on rank 0 and keeps
-- it as `sample` (also in its checkpointed state).
--
-- temperature = 0 is greedy (argmax, the lowest id on ties); otherwise ids
-- are drawn from softmax(logits / temperature) (restricted to the top_k
-- logits when given) with this callback's own seeded generator (seed:
-- this option, else the trainer's seed, else 0), the same on every rank.
-- encode: string -> ids, default bytes; decode: ids -> string, default
-- string.char per id < 256 (U+FFFD for others).
--
-- engine:forward runs on every rank at the same step (the step counter is
-- the same everywhere), as a tensor/pipeline-parallel engine requires. The
-- context is the last seq_len ids; with the engine's config.seq_len known,
-- the input is right-padded with id 0 to exactly seq_len (a causal model
-- ignores what comes after) and the logits at the last real position are used.
local callbacks = require "pipegoose.callbacks"
local opt = require "pipegoose.options"

local TextSampler = callbacks.class("TextSampler")

local REPLACEMENT = "\xEF\xBF\xBD"

function TextSampler.encode_bytes(s)
  local ids = {}
  for i = 1, #s do ids[i] = s:byte(i) end
  return ids
end

function TextSampler.decode_bytes(ids)
  local out = {}
  for i, id in ipairs(ids) do
    id = math.tointeger(id) or math.floor(id)
    out[i] = (id >= 0 and id < 256) and string.char(id) or REPLACEMENT
  end
  return table.concat(out)
end

local SCHEMA = {
  every_n_steps = opt.integer{ min = 1, max = math.maxinteger, default = 100 },
  prompt = opt.check_with("a non-empty string", function(p) return type(p) == "string" and p ~= "" end,
    { default = "\n" }),
  tokens = opt.integer{ min = 1, max = math.maxinteger, default = 32 },
  temperature = opt.number{ min = 0, finite = false, default = 0 },
  top_k = opt.integer{ min = 1, max = math.maxinteger },
  seed = opt.integer{ min = math.mininteger, max = math.maxinteger },
  decode = "any", encode = "any", print = "any", state_key = "any",
}

function TextSampler.new(opts)
  local o = opt.check("pg.callbacks.TextSampler", opts, SCHEMA, { required = true })
  return setmetatable({
    every_n_steps = o.every_n_steps, prompt = o.prompt, tokens = o.tokens, temperature = o.temperature,
    top_k = o.top_k, seed = o.seed,
    decode = o.decode or TextSampler.decode_bytes, encode = o.encode or TextSampler.encode_bytes,
    print = o.print ~= false, state_key = o.state_key or "TextSampler",
    rng = nil, sample = nil, sample_step = nil,
  }, TextSampler)
end

------------------------------------------------------------------------------
-- A seeded generator of its own (pipegoose.rng's splitmix64), so sampling
-- neither disturbs nor depends on math.random; its state is saved.

--- A uniform number in [0, 1).
function TextSampler:uniform()
  local u
  self.rng, u = require("pipegoose.rng").uniform(self.rng)
  return u
end

function TextSampler:setup(trainer)
  if self.rng == nil then self.rng = math.tointeger(self.seed or trainer.seed or 0) end
end

--- Chooses the next id from one position's logits (a list over the vocabulary).
function TextSampler:choose(logits)
  local V = #logits
  if self.temperature == 0 then
    local best, bi = -math.huge, 1
    for v = 1, V do
      if logits[v] > best then best, bi = logits[v], v end
    end
    return bi - 1
  end
  local idx = {}
  for v = 1, V do idx[v] = v end
  if self.top_k and self.top_k < V then
    table.sort(idx, function(a, b)
      if logits[a] == logits[b] then return a < b end
      return logits[a] > logits[b]
    end)
    for v = #idx, self.top_k + 1, -1 do idx[v] = nil end
    table.sort(idx)
  end
  local max = -math.huge
  for _, v in ipairs(idx) do if logits[v] > max then max = logits[v] end end
  local weights, total = {}, 0
  for i, v in ipairs(idx) do
    weights[i] = math.exp((logits[v] - max) / self.temperature)
    total = total + weights[i]
  end
  local u, acc = self:uniform() * total, 0
  for i, v in ipairs(idx) do
    acc = acc + weights[i]
    if u < acc then return v - 1 end
  end
  return idx[#idx] - 1
end

local function make_inputs(ids)
  local core = package.loaded["pipegoose.core"]
  if core == nil then
    local ok, mod = pcall(require, "pipegoose.core")
    core = ok and mod or nil
  end
  if core then return core.tensor({ ids }, { dtype = "int32" }) end
  return { ids }
end

-- logits[1][pos] as a Lua list, from nested tables or a [1, T, V] tensor.
local function row_of(logits, pos)
  if type(logits) == "table" then return logits[1][pos] end
  return logits:narrow(1, 1, 1):narrow(2, pos, 1):totable()[1][1]
end

--- Generates from the prompt now (every rank); returns the text (prompt included).
function TextSampler:generate(trainer)
  local engine = trainer.engine
  local seq_len = engine.config and engine.config.seq_len
  local ids = self.encode(self.prompt)
  local generated = {}
  if self.rng == nil then self:setup(trainer) end
  for _ = 1, self.tokens do
    local first = seq_len and math.max(1, #ids - seq_len + 1) or 1
    local context = table.move(ids, first, #ids, 1, {})
    local n = #context
    if seq_len then
      for i = n + 1, seq_len do context[i] = 0 end
    end
    local logits = engine:forward(make_inputs(context))
    local id = self:choose(row_of(logits, n))
    ids[#ids + 1] = id
    generated[#generated + 1] = id
  end
  return self.prompt .. self.decode(generated)
end

function TextSampler:on_train_batch_end(trainer, outputs)
  local st = trainer.state
  if not outputs.step_end or st.step % self.every_n_steps ~= 0 then return end
  self.sample = self:generate(trainer)
  self.sample_step = st.step
  if self.print then trainer:print(("TextSampler step %d: %s"):format(st.step, self.sample)) end
end

function TextSampler:state_dict()
  return { rng = self.rng, sample = self.sample, sample_step = self.sample_step }
end

function TextSampler:load_state_dict(sd)
  self.rng, self.sample, self.sample_step = sd.rng, sd.sample, sd.sample_step
end

return TextSampler
