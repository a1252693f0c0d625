--- pg.nn: model specs, composed like Lua Torch's nn.
-- A spec is a plain description (sizes, names, options); pg.parallelize turns
-- the specs of this rank's pipeline stage into runtime modules in C. Specs
-- know their parameter count and forward FLOPs per token (for stage
-- balancing) and check that widths fit together, with or without tensor
-- parallelism.
local nn = {}

local Spec = {}
Spec.__index = Spec

local function spec(kind, fields)
  fields.kind = kind
  return setmetatable(fields, Spec)
end

local function is_spec(x) return getmetatable(x) == Spec end
nn.is_spec = is_spec

local function check_positive_int(where, key, v)
  if math.type(v) ~= "integer" or v < 1 then
    error(("%s: %s must be a positive integer, got %s"):format(where, key, tostring(v)), 3)
  end
end

local function module_kind_name(s)
  return s.label or s.kind
end

-- A Lua table with forward/backward (a module written in Lua) used as a spec.
local function is_lua_module(x)
  return type(x) == "table" and not is_spec(x) and type(x.forward) == "function" and type(x.backward) == "function"
end
nn.is_lua_module = is_lua_module

local function as_spec(x, where)
  if is_spec(x) then return x end
  if is_lua_module(x) then return spec("lua", { module = x }) end
  error(("%s: expected a pg.nn module or a Lua table with forward and backward, got %s"):format(where, type(x)), 3)
end

---------------------------------------------------------------- containers

--- nn.Sequential{ m1, m2, ..., name = } (or nn.Sequential() then :add(m)).
function nn.Sequential(list)
  local s = spec("sequential", { children = {}, label = "Sequential" })
  if list then
    s.name = list.name
    for i, m in ipairs(list) do s:add(m, "Sequential child " .. i) end
  end
  return s
end

function Spec:add(m, where)
  assert(self.kind == "sequential", "add: only a Sequential takes children")
  self.children[#self.children + 1] = as_spec(m, where or "Sequential:add")
  return self
end

--- nn.Residual(inner): x + inner(x).
function nn.Residual(inner, opts)
  return spec("residual", { inner = as_spec(inner, "Residual"), name = opts and opts.name, label = "Residual" })
end

---------------------------------------------------------------- layers

--- nn.Linear(in, out [, opts]) or nn.Linear{ ["in"] =, out =, bias =, parallel = "column"|"row",
-- gather_output =, blocks =, init_std =, name = }.
function nn.Linear(a, b, opts)
  local o = type(a) == "table" and a or setmetatable({ ["in"] = a, out = b }, { __index = opts or {} })
  local s = spec("linear", {
    ["in"] = o["in"], out = o.out, bias = o.bias ~= false, parallel = o.parallel, gather_output = o.gather_output,
    blocks = o.blocks or 1, init_std = o.init_std or 0.02, name = o.name, label = "Linear",
  })
  check_positive_int("Linear", "in", s["in"])
  check_positive_int("Linear", "out", s.out)
  if s.parallel ~= nil and s.parallel ~= "column" and s.parallel ~= "row" then
    error(("Linear: parallel must be \"column\" or \"row\", got %q"):format(tostring(s.parallel)), 2)
  end
  return s
end

function nn.LayerNorm(dim, opts)
  check_positive_int("LayerNorm", "dim", dim)
  return spec("layernorm", { width = dim, name = opts and opts.name, label = "LayerNorm" })
end

function nn.GELU(opts)
  return spec("gelu", { name = opts and opts.name, width = opts and opts.width, label = "GELU" })
end

--- The attention core: causal softmax(QK^T/sqrt(hs))V over a fused q|k|v input.
function nn.Attention(o)
  check_positive_int("Attention", "dim", o.dim)
  check_positive_int("Attention", "heads", o.heads)
  check_positive_int("Attention", "seq_len", o.seq_len)
  if o.dim % o.heads ~= 0 then
    error(("Attention: dim=%d is not divisible by heads=%d"):format(o.dim, o.heads), 2)
  end
  return spec("attention", { width = o.dim, heads = o.heads, max_seq = o.seq_len, name = o.name, label = "Attention" })
end

--- Token (+ position) embedding; vocab-parallel under tensor parallelism.
function nn.Embedding(o)
  check_positive_int("Embedding", "vocab", o.vocab)
  check_positive_int("Embedding", "dim", o.dim)
  return spec("embedding", {
    vocab = o.vocab, padded_vocab = o.padded_vocab or o.vocab, width = o.dim, positions = o.positions or 0,
    init_std = o.init_std or 0.02, name = o.name, label = "Embedding",
  })
end

--- LM head with the fused softmax cross-entropy. tie = true: the weight is the
-- embedding's (`tie_name`, default "embed.wte").
function nn.LMHead(o)
  check_positive_int("LMHead", "vocab", o.vocab)
  check_positive_int("LMHead", "dim", o.dim)
  local tie = o.tie ~= false
  return spec("lm_head", {
    vocab = o.vocab, padded_vocab = o.padded_vocab or o.vocab, width = o.dim,
    tie = tie and (o.tie_name or "embed.wte") or nil, init_std = o.init_std or 0.02, name = o.name, label = "LMHead",
  })
end

---------------------------------------------------------------- composites

function nn.CausalSelfAttention(o)
  local proj_std = o.proj_std or 0.02
  local s = nn.Sequential{
    nn.Linear{ ["in"] = o.dim, out = 3 * o.dim, parallel = "column", blocks = 3, name = "qkv" },
    nn.Attention{ dim = o.dim, heads = o.heads, seq_len = o.seq_len, name = "core" },
    nn.Linear{ ["in"] = o.dim, out = o.dim, parallel = "row", init_std = proj_std, name = "proj" },
    name = o.name,
  }
  s.label = "CausalSelfAttention"
  return s
end

function nn.MLP(o)
  local hidden = o.hidden or 4 * o.dim
  local s = nn.Sequential{
    nn.Linear{ ["in"] = o.dim, out = hidden, parallel = "column", name = "fc" },
    nn.GELU{ name = "gelu" },
    nn.Linear{ ["in"] = hidden, out = o.dim, parallel = "row", init_std = o.proj_std or 0.02, name = "proj" },
    name = o.name,
  }
  s.label = "MLP"
  return s
end

--- Pre-LayerNorm block: x + attn(ln1(x)), then x + mlp(ln2(x)).
function nn.TransformerBlock(o)
  -- The wrappers are transparent: parameter names read blocks.3.attn.qkv.weight.
  local function wrap(first, second)
    local inner = nn.Sequential{ first, second }
    inner.transparent = true
    local r = nn.Residual(inner)
    r.transparent = true
    return r
  end
  local s = nn.Sequential{
    wrap(nn.LayerNorm(o.dim, { name = "ln1" }),
      nn.CausalSelfAttention{ dim = o.dim, heads = o.heads, seq_len = o.seq_len, proj_std = o.proj_std, name = "attn" }),
    wrap(nn.LayerNorm(o.dim, { name = "ln2" }), nn.MLP{ dim = o.dim, hidden = o.hidden, proj_std = o.proj_std, name = "mlp" }),
    name = o.name,
  }
  s.label = "TransformerBlock"
  return s
end

--- GPT-2: embed, blocks.0 .. blocks.L-1, ln_f, head (tied to embed.wte).
-- padded_vocab: rows of the embedding (>= vocab); tensor parallelism pads
-- further to a multiple of T. Init is GPT-2's: N(0, 0.02), residual
-- projections N(0, 0.02/sqrt(2*layers)), LayerNorm 1/0, biases 0.
local function build_gpt(o)
  for _, k in ipairs{ "vocab", "seq_len", "dim", "heads", "layers" } do check_positive_int("GPT", k, o[k]) end
  if o.dim % o.heads ~= 0 then error(("GPT: dim=%d is not divisible by heads=%d"):format(o.dim, o.heads), 2) end
  local padded = o.padded_vocab or o.vocab
  if padded < o.vocab then error(("GPT: padded_vocab=%d is smaller than vocab=%d"):format(padded, o.vocab), 2) end
  local proj_std = 0.02 / math.sqrt(2 * o.layers)
  local model = nn.Sequential{ name = "" }
  model:add(nn.Embedding{ vocab = o.vocab, padded_vocab = padded, dim = o.dim, positions = o.seq_len, name = "embed" })
  for i = 0, o.layers - 1 do
    model:add(nn.TransformerBlock{ dim = o.dim, heads = o.heads, seq_len = o.seq_len, hidden = o.hidden,
      proj_std = proj_std, name = "blocks." .. i })
  end
  model:add(nn.LayerNorm(o.dim, { name = "ln_f" }))
  model:add(nn.LMHead{ vocab = o.vocab, padded_vocab = padded, dim = o.dim, tie = o.tie, name = "head" })
  model.label = "GPT"
  model.config = { vocab = o.vocab, padded_vocab = padded, seq_len = o.seq_len, dim = o.dim, heads = o.heads,
                   layers = o.layers, hidden = o.hidden or 4 * o.dim, tie = o.tie ~= false }
  return model
end

nn.GPT = setmetatable({}, { __call = function(_, o) return build_gpt(o) end })

--- pg.nn.GPT.load_llmc(path): a GPT-2 spec with the config and weights of an
-- llm.c model file (the weights are loaded by pg.parallelize, each rank its shards).
function nn.GPT.load_llmc(path)
  local cfg = require("pipegoose.llmc").read_header(path)
  local m = nn.GPT{ vocab = cfg.vocab, padded_vocab = cfg.padded_vocab, seq_len = cfg.seq_len, dim = cfg.dim,
                    heads = cfg.heads, layers = cfg.layers }
  m.weights = { format = "llmc", path = path }
  return m
end

--- pg.nn.from_hf(dir): the model of a Hugging Face `transformers` directory
-- (config.json + model.safetensors, or the sharded index) with its weights,
-- loaded by pg.parallelize (each rank its shards). GPT2LMHeadModel for now;
-- lua/pipegoose/hf.lua has the conventions.
function nn.from_hf(dir)
  local o = require("pipegoose.hf").read_config(dir)
  local m = nn.GPT(o)
  m.weights = { format = "hf", path = dir }
  return m
end
nn.GPT.from_hf = nn.from_hf

---------------------------------------------------------------- analysis

local function round_up(x, m) return (x + m - 1) // m * m end
nn.round_up = round_up

--- Resolves the spec against a tensor-parallel size T and an input flow
-- {width=, split=} (split: the activation is cut over the tensor group).
-- Returns the runtime description (for core.Engine) and the output flow.
-- `path` is the name prefix; errors name the module and the numbers.
function Spec:describe(path, flow, T)
  local function join(name)
    if name == nil or name == "" then return path end
    return path == "" and name or (path .. "." .. name)
  end
  local me = join(self.name)
  local where = ("%s%s"):format(module_kind_name(self), me ~= "" and (" '" .. me .. "'") or "")
  local function fail(fmt, ...) error(where .. ": " .. fmt:format(...), 0) end
  local function need_full(width)
    if flow.split and T > 1 then fail("needs the full activation of width %d, but receives a tensor split over tensor=%d (add gather_output to the column-parallel Linear before it)", width, T) end
    if flow.width ~= width then fail("expects width %d, receives width %s", width, tostring(flow.width)) end
  end
  local k = self.kind
  if k == "sequential" then
    local kids = {}
    for i, c in ipairs(self.children) do
      local d
      if c.name == nil and not c.transparent then -- unnamed: named by position, as torch's Sequential does
        d, flow = c:describe(me == "" and tostring(i) or (me .. "." .. i), flow, T)
      else
        d, flow = c:describe(me, flow, T)
      end
      kids[i] = d
    end
    if #kids == 0 then fail("is empty") end
    return { kind = "sequential", name = me, children = kids }, flow
  elseif k == "residual" then
    local d, out = self.inner:describe(me, flow, T)
    if out.width ~= flow.width or out.split ~= flow.split then
      fail("its inner module maps width %s to %s: a residual needs the same width", tostring(flow.width), tostring(out.width))
    end
    return { kind = "residual", name = me, inner = d }, flow
  elseif k == "embedding" then
    if flow.width ~= 0 then fail("takes token ids, but receives activations of width %d", flow.width) end
    return { kind = "embedding", name = me, vocab = self.vocab, padded_vocab = round_up(self.padded_vocab, T),
             width = self.width, positions = self.positions, init_std = self.init_std },
           { width = self.width, split = false }
  elseif k == "layernorm" then
    need_full(self.width)
    return { kind = "layernorm", name = me, width = self.width }, flow
  elseif k == "gelu" then
    if flow.width == 0 then fail("needs activations, receives token ids") end
    local local_w = (flow.split and T > 1) and flow.width // T or flow.width
    return { kind = "gelu", name = me, width = local_w }, flow
  elseif k == "attention" then
    if self.heads % T ~= 0 then fail("tensor=%d does not divide heads=%d", T, self.heads) end
    if self.width % T ~= 0 then fail("tensor=%d does not divide dim=%d", T, self.width) end
    if flow.width ~= 3 * self.width then fail("expects the fused q|k|v of width %d, receives width %s", 3 * self.width, tostring(flow.width)) end
    if T > 1 and not flow.split then fail("needs q|k|v split over tensor=%d (from a column-parallel Linear with blocks = 3)", T) end
    return { kind = "attention", name = me, width = self.width, heads = self.heads, max_seq = self.max_seq },
           { width = self.width, split = T > 1 }
  elseif k == "linear" then
    local inw, outw = self["in"], self.out
    local d = { kind = "linear", name = me, ["in"] = inw, out = outw, bias = self.bias, blocks = self.blocks,
                init_std = self.init_std, mode = "plain" }
    if self.parallel == "column" then
      need_full(inw)
      if outw % (self.blocks * T) ~= 0 then
        -- with blocks (q|k|v), name the block width too: it is the model's channels
        fail("tensor=%d does not divide the output width %d%s", T, outw,
          self.blocks > 1 and (" in %d blocks of %d"):format(self.blocks, outw // self.blocks) or "")
      end
      d.mode, d.gather_output = "column", self.gather_output or false
      return d, { width = outw, split = T > 1 and not self.gather_output }
    elseif self.parallel == "row" then
      if inw % T ~= 0 then fail("tensor=%d does not divide the input width %d", T, inw) end
      if flow.width ~= inw then
        if flow.split and T > 1 then
          fail("row-parallel with in=%d receives a split tensor of width %d/%d", inw, flow.width, T)
        end
        if T == 1 then fail("row-parallel with in=%d receives width %d", inw, flow.width) end
        fail("row-parallel with in=%d receives an unsplit tensor of width %d (expected %d, or its split %d/%d = %d from a column-parallel layer)",
          inw, flow.width, inw, inw, T, inw // T)
      end
      d.mode, d.input_is_parallel = "row", (flow.split and T > 1) or false
      if T == 1 then d.mode = "row" end
      return d, { width = outw, split = false }
    else
      need_full(inw)
      return d, { width = outw, split = false }
    end
  elseif k == "lm_head" then
    need_full(self.width)
    return { kind = "lm_head", name = me, vocab = self.vocab, padded_vocab = round_up(self.padded_vocab, T),
             width = self.width, tie = self.tie, init_std = self.init_std }, { width = -1, split = false }
  elseif k == "lua" then
    local m = self.module
    if flow.split and T > 1 then fail("a module written in Lua needs the full activation, not a split one") end
    local inw = m.in_width or flow.width
    local outw = m.out_width or inw
    if inw ~= flow.width then fail("expects width %d, receives width %s", inw, tostring(flow.width)) end
    local params = {}
    if m.parameters then
      for i, p in ipairs(m:parameters()) do
        params[i] = { name = p.name or ("p" .. i), shape = p.shape, init = p.init or "normal", std = p.std or 0.02 }
      end
    end
    self.path = me
    return { kind = "lua", name = me, in_width = inw, out_width = outw, params = params, module = m },
           { width = outw, split = false }
  end
  error("unknown spec kind " .. tostring(k))
end

--- Parameters of the full model under this spec (padding excluded).
function Spec:num_params()
  local k = self.kind
  if k == "sequential" then
    local n = 0
    for _, c in ipairs(self.children) do n = n + c:num_params() end
    return n
  elseif k == "residual" then return self.inner:num_params()
  elseif k == "embedding" then return self.vocab * self.width + self.positions * self.width
  elseif k == "layernorm" then return 2 * self.width
  elseif k == "linear" then return self["in"] * self.out + (self.bias and self.out or 0)
  elseif k == "lm_head" then return self.tie and 0 or self.vocab * self.width
  elseif k == "lua" then
    local n = 0
    if self.module.parameters then
      for _, p in ipairs(self.module:parameters()) do
        local c = 1
        for _, d in ipairs(p.shape) do c = c * d end
        n = n + c
      end
    end
    return n
  end
  return 0
end

--- Forward FLOPs per token (multiply-adds count 2), for stage balancing.
-- `T` is the sequence length (attention's cost grows with it).
function Spec:flops(T, width_in)
  local k = self.kind
  if k == "sequential" then
    local f = 0
    for _, c in ipairs(self.children) do f = f + c:flops(T) end
    return f
  elseif k == "residual" then return self.inner:flops(T) + 1
  elseif k == "embedding" then return 2 * self.width
  elseif k == "layernorm" then return 8 * self.width
  elseif k == "gelu" then return 0 -- elementwise, priced with the Linear before it
  elseif k == "linear" then return 2 * self["in"] * self.out
  elseif k == "attention" then return 2 * T * self.width -- QK^T and PV over the causal half
  elseif k == "lm_head" then return 2 * self.width * self.padded_vocab + 6 * self.padded_vocab
  elseif k == "lua" then return 10 * (width_in or 1)
  end
  return 0
end

--- The flow a spec takes as input when it stands alone (see nn.Layer).
function Spec:input_flow(T)
  local k = self.kind
  if k == "sequential" then return self.children[1]:input_flow(T)
  elseif k == "residual" then return self.inner:input_flow(T)
  elseif k == "embedding" then return { width = 0, split = false }
  elseif k == "linear" then
    return { width = self["in"], split = self.parallel == "row" and T > 1 and not self.split_input }
  elseif k == "attention" then return { width = 3 * self.width, split = T > 1 }
  elseif k == "lua" then return { width = self.module.in_width, split = false }
  elseif k == "gelu" then return { width = self.width, split = false }
  end
  return { width = self.width, split = false }
end

--- nn.Layer(spec, ctx [, {seed=, input={width=, split=}}]): one module on its own
-- (this rank's shard under tensor parallelism), with flat parameters like an
-- engine's: layer:forward(x [, targets]), layer:backward([dy]), layer:params(),
-- layer:gather_param(name [, grad]), layer:zero_grad().
function nn.Layer(s, ctx, opts)
  local core = require "pipegoose.core"
  opts = opts or {}
  s = as_spec(s, "Layer")
  ctx = ctx or core.ParallelContext{}
  local T = ctx:world_size("tensor")
  local flow = opts.input or s:input_flow(T)
  if flow.width == nil then error("Layer: give the input width: opts.input = {width = ...}", 2) end
  local ok, desc = pcall(s.describe, s, "", flow, T)
  if not ok then error("Layer: " .. tostring(desc), 2) end
  local layer = core.Layer(ctx, desc, { seed = opts.seed })
  if desc.kind == "lua" then
    local m = s.module
    m.params, m.grads = {}, {}
    for _, p in ipairs(layer:params()) do
      local short = p.name:match("([^.]+)$")
      m.params[short], m.grads[short] = p.tensor, p.grad
    end
  end
  return layer
end

--- The top-level modules a pipeline cuts between.
function Spec:top_level()
  if self.kind == "sequential" then return self.children end
  return { self }
end

return nn
