--- pg.sample: text generation from an engine (greedy or temperature sampling).
-- Recomputes the whole window for every new token (no key/value cache): fine
-- for the short samples a training run prints.
local core = require "pipegoose.core"

local M = {}

-- A seeded generator of its own (pipegoose.rng), so that samples are
-- reproducible and do not disturb math.random.
local generator = require("pipegoose.rng").generator

local opt = require "pipegoose.options"
local OPTIONS = {
  temperature = opt.number{ min = 0, finite = false, default = 0 },
  top_k = opt.integer{ min = 1, max = math.maxinteger },
  seed = opt.integer{ min = math.mininteger, max = math.maxinteger },
}

--- M.generate(engine, prompt, n, {temperature = 0, seed = 0, top_k = nil}) -> list of ids
-- prompt: token ids, as a list or a 1-D int32 tensor (what pg.data.bytes.encode
-- returns), at least one. temperature 0 is greedy; top_k keeps the k likeliest.
-- Collective: every rank of the engine must call it with the same arguments.
function M.generate(engine, prompt, n, opts)
  opts = opt.check("generate", opts, OPTIONS)
  if math.type(n) ~= "integer" or n < 0 then error(("generate: n must be an integer >= 0, got %s"):format(tostring(n)), 2) end
  local temperature, top_k = opts.temperature, opts.top_k
  local rand = generator(opts.seed or 0)
  if core.is_tensor(prompt) then
    if prompt:dim() ~= 1 or prompt:dtype() ~= "int32" then
      error(("generate: a prompt tensor must be 1-D int32 token ids, got %s"):format(tostring(prompt)), 2)
    end
    prompt = prompt:totable()
  elseif type(prompt) ~= "table" then
    error(("generate: the prompt must be a list or a tensor of token ids, got %s"):format(type(prompt)), 2)
  end
  local vocab = engine.config.vocab
  local ids = {}
  for i, t in ipairs(prompt) do
    if math.type(t) ~= "integer" or t < 0 or (vocab and t >= vocab) then
      error(("generate: prompt token %d is %s, not an id in [0, %s)"):format(i, tostring(t), tostring(vocab)), 2)
    end
    ids[i] = t
  end
  if #ids == 0 then error("generate: the prompt needs at least one token", 2) end
  local window = engine.config.seq_len or #ids + n
  local out = {}
  for _ = 1, n do
    local first = math.max(1, #ids - window + 1)
    local ctx_ids = table.move(ids, first, #ids, 1, {})
    local logits = engine:forward(core.tensor({ ctx_ids }, { dtype = "int32" }))
    local V = logits:size(3)
    local row = logits:narrow(2, #ctx_ids, 1):reshape{ V }:totable()
    local pick
    if temperature <= 0 then
      pick = 1
      for v = 2, V do if row[v] > row[pick] then pick = v end end
    else
      local order = {}
      for v = 1, V do order[v] = v end
      if top_k and top_k < V then
        table.sort(order, function(a, b) return row[a] > row[b] end)
        for v = #order, top_k + 1, -1 do order[v] = nil end
      end
      local mx = -math.huge
      for _, v in ipairs(order) do mx = math.max(mx, row[v]) end
      local total, w = 0, {}
      for i, v in ipairs(order) do
        w[i] = math.exp((row[v] - mx) / temperature)
        total = total + w[i]
      end
      local r = rand() * total
      pick = order[#order]
      for i, v in ipairs(order) do
        r = r - w[i]
        if r <= 0 then pick = v; break end
      end
    end
    ids[#ids + 1] = pick - 1
    out[#out + 1] = pick - 1
  end
  return out
end

return M
